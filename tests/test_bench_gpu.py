"""`benchmarks/bench_gpu.py`'s memory instruments on the CPU (its `--smoke` run: `tests/test_gpu_suite.py`), so they
cannot rot."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_logits_memory_measures_each_log_prob_path():
    """`--logits-memory`'s worker, in this process at the smallest shape: every path runs forward and backward."""
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_gpu import LOGPROB_PATHS, logits_memory_table, logits_memory_worker

    records = {}
    for path in LOGPROB_PATHS:
        opts = argparse.Namespace(method=path, size="smoke", micro_batch=1, completion_length=4)
        records[("smoke", path)] = logits_memory_worker(opts)
        assert records[("smoke", path)]["logits_bytes"] == 4 * 151936 * 2
    # Every path computes the same log-probs of the same tokens, and their gradient reaches the hidden states.
    first = records[("smoke", LOGPROB_PATHS[0])]
    assert first["grad_norm"] > 0
    for record in records.values():
        assert record["logprob_sum"] == pytest.approx(first["logprob_sum"], rel=1e-2)
        assert record["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-2)
    table = logits_memory_table(records).splitlines()
    assert [line.split()[1] for line in table[1:]] == list(LOGPROB_PATHS)
    # trl-fused against itself; "-" where the peak read 0 (in this long-lived process, the allocator may serve the
    # smoke shape's tensors from pages already resident: the benchmark measures each path in a fresh process)
    assert table[2].split()[4] == ("1.00x" if records[("smoke", "trl-fused")]["peak_bytes"] else "-")

    # The peak: the float32 path holds its float32 logits at least, 39 MB for 64 tokens (a peak read before the
    # backward, or none, reads less). Seen in this process too: an allocation that large takes fresh pages (glibc maps
    # anything above 32 MiB anew), where the smoke shape's few MB may reuse freed ones.
    opts = argparse.Namespace(method="fp32-log-softmax", size="smoke", micro_batch=1, completion_length=64)
    record = logits_memory_worker(opts)
    assert record["peak_bytes"] >= 2 * record["logits_bytes"] == 64 * 151936 * 4


def test_peak_memory_sees_an_allocation_made_and_freed_after_the_reset():
    """The instrument of `--logits-memory` and `--step-memory`: the peak above the start, after a fresh reset."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_gpu import peak_memory, reset_peak_memory, step_memory_table

    big = torch.ones(64 * 2**20)  # 256 MiB, then freed: raises the peak of this process
    del big
    before = reset_peak_memory()
    assert peak_memory() - before < 64 * 2**20  # the reset forgot it
    # 128 MiB of fresh pages, touched: an anonymous mapping always takes new pages from the kernel, where a tensor
    # could reuse freed memory the process still holds (the allocator's state depends on the tests run before).
    block = mmap.mmap(-1, 128 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    block.close()
    assert 120 * 2**20 <= peak_memory() - before < 250 * 2**20

    records = {
        ("s", "vapo-lora"): {"peak_growth_bytes": 300 * 2**20, "step_s": [2.0]},
        ("s", "grpo-lora"): {"peak_growth_bytes": 1200 * 2**20, "step_s": [1.5]},
    }
    rows = [line.split() for line in step_memory_table(records).splitlines()[1:]]
    assert rows == [["s", "vapo-lora", "300", "0.25x", "2.0"], ["s", "grpo-lora", "1,200", "1.00x", "1.5"]]


def test_a_workers_stderr_is_the_launchers_as_it_runs(tmp_path):
    """A worker's stderr goes straight to the launcher's, not held until it ends: `gpu_suite.py --limit` kills a run
    still going with its launcher, and a held output went with it (where the cut run was: the call's log showed
    nothing). A real process, which succeeds: its output is not only a failure's tail. The launcher's stderr is a file
    here (read while the worker runs, never truncated: a line cannot be lost between two reads)."""
    import threading
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _launch import launch_worker

    go = tmp_path / "go"  # the worker ends only once its line has reached this process's stderr
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, os, sys, time\nprint('warm-up step done', file=sys.stderr, flush=True)\n"
        f"any(os.path.exists({str(go)!r}) or time.sleep(0.05) for _ in range(400))\n"
        "json.dump({'step_s': [1.0]}, open(sys.argv[sys.argv.index('--result') + 1], 'w'))\n"
    )
    stderr, result = tmp_path / "stderr", []
    saved = os.dup(2)
    with open(stderr, "wb") as file:
        os.dup2(file.fileno(), 2)
    try:
        running = threading.Thread(target=lambda: result.append(launch_worker(worker, [], "smoke/vapo-lora")))
        running.start()
        deadline = time.monotonic() + 15
        while b"warm-up step done" not in stderr.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = stderr.read_bytes()
        go.touch()
        running.join(timeout=60)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert b"warm-up step done" in seen and result == [{"step_s": [1.0]}]  # seen while the worker was running


def test_a_failed_run_costs_only_its_own_row(tmp_path, monkeypatch, capfd):
    """A worker that fails (VAPO's, here: a real process exiting 1) is a FAILED row; the driver still measures the
    others (GRPO's side, the ratios' base), writes both to `--json`, and exits naming the failure. The GRPO record
    is a stand-in for a worker's (its real run is `tests/test_gpu_suite.py`'s smoke)."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu
    from _launch import WorkerFailed, launch_worker

    failing = tmp_path / "failing_worker.py"
    failing.write_text("import sys\nprint('CUDA out of memory', file=sys.stderr)\nsys.exit(1)\n")
    grpo = {
        "step_s": [3.0, 2.0], "parts": [{"generate": 1.0}, {"generate": 1.5, "backward": 0.5}],
        "tokens_per_step": 64, "peak_bytes": 2**30, "peak_growth_bytes": 2**29, "trainable": 10, "device": "cpu",
        "engine": "generate()",
        "phases": {"start": 1.0},
    }  # fmt: skip
    launched = []

    def launch(opts, size, method):
        launched.append(method)
        if method == "vapo-lora":
            return launch_worker(failing, [], f"{size}/{method}")
        return grpo

    monkeypatch.setattr(bench_gpu, "launch", launch)
    result = tmp_path / "rows.json"
    with pytest.raises(SystemExit, match=r"1 of 2 runs failed: smoke/vapo-lora") as stopped:
        bench_gpu.main(["--smoke", "--methods", "vapo-lora,grpo-lora", "--json", str(result)])
    assert not isinstance(stopped.value, WorkerFailed)  # the driver's own exit, after every run
    assert launched == ["vapo-lora", "grpo-lora"]
    rows = json.loads(result.read_text())
    assert rows["smoke/vapo-lora"] == {"error": "worker smoke/vapo-lora failed (exit 1)"}
    assert rows["smoke/grpo-lora"]["step_s"] == 2.0 and rows["smoke/grpo-lora"]["generation"] == 1.5
    out = capfd.readouterr()
    assert "smoke vapo-lora: FAILED (worker smoke/vapo-lora failed (exit 1))" in out.out
    assert "CUDA out of memory" in out.err  # the failed worker's own output, for the reader of the call's log
    table = out.out.split("\n\n")[-1]
    assert "vapo-lora" in table and "FAILED" in table and "grpo-lora" in table and "1.00x" in table


def test_an_unknown_method_or_size_is_refused_before_any_run(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu

    for flags in (["--methods", "vapo-lora,grpo-loar"], ["--sizes", "0.5b"]):
        with pytest.raises(SystemExit) as stopped:
            bench_gpu.main(flags)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert ("grpo-loar" in err or "0.5b" in err) and "grpo-lora" in err and "0.5B" in err


def test_the_critic_adapter_switch_is_cheaper_than_peft_set_adapter():
    """`bench_gpu.py --adapter-switch` at the smoke model's shapes: VAPO's switch sets what peft's `set_adapter`
    leaves in each layer, without walking the model or flipping `requires_grad` (35x cheaper there; 57x at
    Qwen2.5-0.5B's, 0.55 against 31.6 ms on the development VM)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu

    times = bench_gpu.adapter_switch_times("smoke", repeats=5)
    assert times["modules"] > 100 and 0 < times["vapo"] < times["peft set_adapter"] / 3, times
