"""`benchmarks/bench_gpu.py`'s memory instruments on the CPU (its `--smoke` run: `tests/test_gpu_suite.py`), so they
cannot rot."""

from __future__ import annotations

import mmap
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
    assert table[2].split()[4] == "1.00x"  # trl-fused against itself


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
