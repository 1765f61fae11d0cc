"""One command for the GPU: the trainer at real sizes, generation against its memory-bandwidth bound, the CUDA tests
and a one-GPU FSDP2 step, each part's figures written as soon as it ends.

GPU time is rare and short (minutes, commands of at most 10 minutes, no network), so one prepared command does
everything, most important part first. ``--limit`` (the call's limit less a margin) stops a part still running then,
with every process it started, keeping the runs it finished, and starts no part whose last measured time
(``PART_SECONDS``) it does not leave; ``--deadline`` starts no part after its seconds. A later call runs what is left
with ``--parts``. Here (with a network), once, the wheels the GPU machine lacks (``WHEELS``,
versions from ``constraints.txt``):

    .venv/bin/python benchmarks/gpu_suite.py --download-wheels base --dest .whl           # 9 wheels, about 16 MiB
    .venv/bin/python benchmarks/gpu_suite.py --download-wheels qlora --dest .whl-qlora    # QLoRA's call, 44 MiB

(a folder per set: the install line installs every wheel of the folder carried, and the two sets with the working
tree pass the 64 MiB a call carries). On the GPU machine, with ``.whl`` carried (``.gitignore`` keeps ``.whl*``
folders out of commits), after the offline install line (``INSTALL``; ``--download-wheels`` prints it):

    python3 benchmarks/gpu_suite.py --out "$OUT" --deadline 420 --limit $((575 - SECONDS + T0))   # PARTS's order
    python3 benchmarks/gpu_suite.py --out "$OUT" --parts trainer-full,trainer-1.5B \\
        --limit $((LEFT - 30 - SECONDS + T0))

(``LEFT``: the call's ``timeout_s``, or the device time left if less: without ``--limit`` the call's own timeout
stops the suite from outside, and the part it was running keeps its figures in its own JSON file alone.)

Anywhere, the same code at tiny shapes on the CPU (``tests/test_gpu_suite.py`` runs it):

    .venv/bin/python benchmarks/gpu_suite.py --smoke --out /tmp/gpu-smoke

Parts (``PARTS``), each in fresh processes:
    tests          ``pytest -m cuda``: bf16 autocast, gradient checkpointing with the LoRA critic (same updates with
                   and without), the log-probs through the LM head in tiles (TRL's fused-head kernel) against the
                   plain computation, QLoRA's 4-bit kernels (only where bitsandbytes is installed: the ``qlora``
                   wheels), continuous batching's paged attention against ``generate()``, the static-cache engine
                   against ``generate()`` and its CUDA graph against its eager step, FSDP2 on one GPU, fp16's loss
                   scaling, and the CUDA generators' states restored on resuming; stopped at ``TESTS_LIMIT`` seconds
                   whatever ``--limit`` leaves (a hung test does not take the call), each outcome streamed as it
                   happens (a stopped run keeps the ended tests' outcomes and names the ones it interrupted)
    trainer-lora   ``bench_gpu.py`` at Qwen2.5-0.5B shapes (random weights), VAPO (its defaults: the static-cache
                   engine on a GPU; ``bench_gpu.py --methods vapo-lora-generate`` for ``generate()``) and GRPO (as TRL
                   runs it: ``generate()``) with LoRA: step time split (generation, scoring: rewards and the old
                   log-probs and values, update), tokens/s, peak memory, VAPO's ratios to GRPO against the targets
                   (step at most 1.1x, peak at most 1.15x), and each run's seconds by phase (start-up, model, trainer,
                   steps)
    generation     the engines of ``ENGINES`` at 0.5B shapes (batch 64, 512 new tokens, bf16): ms per decode step and
                   tokens/s, each against the memory-bandwidth bound of a decode step (the weights read once per
                   step, at the copy bandwidth measured on the device): batch x bandwidth / weight bytes tokens per
                   second, an upper bound (it leaves out the KV cache's reads); and against the bound with the KV
                   cache's reads (each step reads its filled slots: the prompt and, on average, half the new tokens;
                   a static cache that reads all its slots shows as its share of this bound)
    trainer-full   ``bench_gpu.py`` at 0.5B shapes, full fine-tuning, VAPO (a separate critic) and GRPO
    trainer-1.5B   ``bench_gpu.py`` at Qwen2.5-1.5B shapes, VAPO and GRPO with LoRA

Printed: each part's table as it ends, then a summary; written to ``--out``: ``gpu_suite.json`` (every figure, the
machine, each part's status (ok, failed, cut at ``--limit``, skipped) and seconds; rewritten after each part) and
``gpu_suite.txt`` (the tables); the trainer and generation parts also write their own JSON after each run or
engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

STARTED = time.time()  # --limit and --deadline count from here: torch's import and the machine's look too
ROOT = Path(__file__).resolve().parent.parent
BENCH_GPU = ROOT / "benchmarks" / "bench_gpu.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import phase_line, write_json  # noqa: E402  (bench_gpu.py's runs, by phase)
from _pytest_outcomes import OUTCOMES, read_outcomes  # noqa: E402  (the tests part's outcomes, as they happen)

# What the GPU machine's image lacks, or has at a version outside pyproject.toml's ranges, for `import trl_vapo`, the
# rewards and the tests (its image: torch 2.11 + CUDA, transformers 5.17, accelerate, huggingface-hub, pytest,
# pytest-xdist, hypothesis; /work/.library/device/KINDS.md). Versions are constraints.txt's (the locked set), so the
# GPU runs the code CI tests. A call carries at most 64 MiB with the working tree (`tracked_mib`, about 25 MiB):
# bitsandbytes (41 MiB) and transformers (13 MiB) do not fit together, so the QLoRA set keeps the image's
# transformers.
WHEELS = {
    "base": [
        "transformers",
        "trl",
        "peft",
        "datasets",
        "dill",  # datasets'
        "multiprocess",  # datasets'
        "math-verify",
        "latex2sympy2-extended",  # math-verify's
        "antlr4-python3-runtime",  # latex2sympy2-extended's
    ],
    "qlora": [
        "bitsandbytes",
        "trl",
        "peft",
        "datasets",
        "dill",
        "multiprocess",
        "math-verify",
        "latex2sympy2-extended",
        "antlr4-python3-runtime",
    ],
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]
"""CPython 3.12 on x86-64 Linux, the GPU machine's: pip matches each platform tag exactly (bitsandbytes: 2_24)."""
INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
    '{wheels}/*.whl && export PYTHONPATH="/tmp/site:$PWD"'
)
"""The offline install line on the GPU machine, for the wheels carried in the folder ``{wheels}`` (``--no-deps``:
pyproject's torch bound would pull a CPU torch over the machine's CUDA one)."""
CARRY_LIMIT_MIB = 64

CUDA_TEST_FILES = [
    "tests/test_precision_checkpointing.py",  # bf16 autocast, gradient checkpointing with the LoRA critic, QLoRA
    "tests/test_logprobs.py",  # the LM head in tiles (TRL's fused-head kernel)
    "tests/test_generation.py",  # continuous batching's paged attention
    "tests/test_static_cache_engine.py",  # the static-cache engine: exact against generate(), CUDA graphs
    "tests/test_distributed.py",  # FSDP2 on one GPU
    "tests/test_platforms.py",  # the accelerator's random generators, saved and restored
]
PARTS = ("tests", "trainer-lora", "generation", "trainer-full", "trainer-1.5B")
SCRIPT_TIMEOUT = "VAPO_SCRIPT_TIMEOUT"  # (tests/_script_process.py's: the most seconds a test's training run takes)
TESTS_LIMIT = 240
"""Seconds the tests part may take, whatever ``--limit`` leaves: about twice its 113 s on the H200 (2026-11-27)."""
PART_SECONDS = {"tests": 113, "trainer-lora": 151, "generation": 201, "trainer-full": 153, "trainer-1.5B": 300}
"""Each part's seconds on the H200 (2026-11-27, `benchmarks/gpu/h200-2026-11-27/`; trainer-1.5B was cut there after
222 s, its GRPO run unfinished: 300 is a floor's guess). A part is not started where ``--limit`` leaves less: cut near
its end, it kept its first run's figures alone (trainer-1.5B's VAPO row, in the log only), and its seconds were lost
to the part after it; a later call runs it with ``--parts``."""
SMOKE_PART_SECONDS: dict[str, float] = {}  # (--smoke: none known, every part starts; a test sets one)
TRAINER_PARTS = {  # part: (size, methods)
    "trainer-lora": ("0.5B", ("vapo-lora", "grpo-lora")),
    "trainer-full": ("0.5B", ("vapo-full", "grpo-full")),
    "trainer-1.5B": ("1.5B", ("vapo-lora", "grpo-lora")),
}
TRAINER_STEPS = 2  # optimizer steps per trainer run, the first a warm-up: one timed step
TARGETS = {"step": 1.1, "peak": 1.15}  # VAPO LoRA against GRPO LoRA (issue "One command for the GPU")
GENERATION = {"size": "0.5B", "batch": 64, "new_tokens": 512, "warmup_tokens": 16, "copy_bytes": 2 * 2**30}
SMOKE_GENERATION = {
    "size": "smoke",
    "batch": 4,
    "new_tokens": 8,
    "warmup_tokens": 2,
    "copy_bytes": 64 * 2**20,
    "engines": ["static-cache captured", "generate()", "static-cache eager"],  # no compile on the CPU
}
ENGINES = {  # name: (engine, its options, warm up at the timed length: what has one-time costs at each length)
    "static-cache captured": ("static", {"cuda_graph": True}, True),
    "generate()": ("generate", {}, True),
    "static-cache eager": ("static", {"cuda_graph": False}, False),
    "generate() static+compile": ("generate-compiled", {}, True),
    "static-cache compiled+captured": ("static", {"cuda_graph": True, "compile_step": True}, True),
}
"""The generation part's engines, most important first: the static-cache engine's CUDA graph, transformers'
`generate()` as it runs by default, the engine's step without a graph, `generate()` with transformers' own static
cache and compiled decode step (`cache_implementation="static"`, compile not disabled: the one-flag baseline), and
the engine's step compiled by torch.compile, then captured. Each is timed on its second call. The first, the
warm-up, runs at the timed length where a call pays once for a length: a compile or capture per shape, and
`generate()`, whose cache grows a step at a time (its first 512-token call, after a 16-token warm-up, read 100.6 ms a
step on the H200 on 2026-11-27, while GRPOTrainer's timed second rollout of the same shape took 34.6 ms a step in
the same run; the cause was not isolated). The eager step's shapes are fixed: a short warm-up does. Continuous
batching (859 tokens/s on the H100, 2026-11-26) is left out to save the call's minutes."""


def constraint_versions(path: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """Package name (lower case, ``_`` as ``-``) to its pinned version in the locked set."""
    versions = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].split(";")[0].strip()  # no comment, no environment marker
        if "==" in line:
            name, version = line.split("==", 1)
            versions[name.strip().lower().replace("_", "-")] = version.strip()
    return versions


def wheel_requirements(wheel_set: str) -> list[str]:
    """``NAME==VERSION`` for each wheel of ``wheel_set``, at constraints.txt's versions."""
    versions = constraint_versions()
    missing = [name for name in WHEELS[wheel_set] if name not in versions]
    if missing:
        raise ValueError(f"constraints.txt pins no version of {missing}: `python3 dev.py upgrade` writes the lock")
    return [f"{name}=={versions[name]}" for name in WHEELS[wheel_set]]


def download_command(requirement: str, dest: Path) -> list[str]:
    """``pip download`` of one wheel for CPython 3.12 manylinux x86-64, without its dependencies (the set names
    them)."""
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    return [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
        "3.12", "--implementation", "cp", *platforms, "--dest", str(dest), requirement,
    ]  # fmt: skip


def tracked_mib() -> float:
    """The size of the working tree's tracked files, which travel with every call."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file()) / 2**20


def download_wheels(wheel_set: str, dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    for requirement in wheel_requirements(wheel_set):
        subprocess.run(download_command(requirement, dest), check=True)
    report, fits = carried_wheels(wheel_set, dest, tracked_mib())
    print(report)
    return 0 if fits else 1


def carried_wheels(wheel_set: str, dest: Path, tree_mib: float) -> tuple[str, bool]:
    """What a call carrying `dest` carries: every wheel in it (the install line installs them all, and each travels),
    its size with the working tree's (`tree_mib`) against `CARRY_LIMIT_MIB`, and the wheels of no package of
    `wheel_set` (another set's, downloaded into the same folder: they made the call too large, or put bitsandbytes
    into the base call). Returns the report and whether the call carries it."""
    wanted = {r.split("==")[0].replace("-", "_").lower() for r in wheel_requirements(wheel_set)}
    wheels = sorted(dest.glob("*.whl"))
    others = [w.name for w in wheels if w.name.split("-")[0].lower() not in wanted]
    names = [w.name.split("-")[0].lower() for w in wheels]
    twice = sorted({name for name in names if names.count(name) > 1})  # pip refuses the whole install for one
    total = sum(w.stat().st_size for w in wheels) / 2**20
    carried = total + tree_mib
    fits = carried <= CARRY_LIMIT_MIB and not others and not twice
    lines = [f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}" for wheel in wheels]
    lines.append(
        f"{len(wheels)} wheels, {total:.2f} MiB; with the working tree ({tree_mib:.2f} MiB) {carried:.2f} MiB of the "
        f"{CARRY_LIMIT_MIB} MiB a call carries: {'fits' if carried <= CARRY_LIMIT_MIB else 'DOES NOT FIT'}"
    )
    if others:
        lines.append(f"{dest} also holds wheels of no {wheel_set!r} package, installed with it: {', '.join(others)}")
    if twice:
        lines.append(f"{dest} holds two versions of {', '.join(twice)}, which pip refuses to install together")
    lines.append(f"carry {dest.name!r}, and start the command with: {INSTALL.format(wheels=dest.name)}")
    return "\n".join(lines), fits


# ---------------------------------------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------------------------------------


BAD = ("failure", "error", "running")  # "running": a test a stop at the limit interrupted


def run_command(command: list[str], stop_at: float | None, env: dict[str, str] | None = None) -> tuple[int, bool]:
    """``command`` in the repository's root, its output as it comes (a call cut short still shows it): its exit code,
    and whether it was still running at ``stop_at`` (``time.time()``) and so stopped with everything it started
    (bench_gpu.py's workers, pytest's, the FSDP2 test's ranks). It runs in a process group of its own (in this
    session: the GPU machine's tool ends what a command leaves running, except in a session of its own), so that
    stopping it stops all of them; the group is stopped too when this process is interrupted (Ctrl-C, or SIGTERM:
    ``main`` turns it into an exit)."""
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    # Unbuffered: a process stopped here (SIGTERM, then SIGKILL) would lose what it held for the pipe to `tee`.
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, **group)
    try:
        return proc.wait(timeout=None if stop_at is None else max(0.0, stop_at - time.time())), False
    except subprocess.TimeoutExpired:
        stop_group(proc)
        return proc.returncode, True
    except BaseException:
        stop_group(proc)
        raise


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL to what is left of it 5 s later (or at once, when this process
    is interrupted meanwhile): within the margin ``--limit`` leaves the call."""
    try:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_tests(out: Path, smoke: bool = False, stop_at: float | None = None) -> dict:
    """``pytest -m cuda`` on the files that hold the CUDA tests; each test's outcome from the JUnit report. Without a
    GPU (``--smoke``) every one is skipped (the default suite runs this command on a stand-in file instead)."""
    import importlib.util

    junit, stream = out / "cuda-tests.xml", out / "cuda-tests.jsonl"
    deselect = [] if importlib.util.find_spec("bitsandbytes") else ["-k", "not qlora"]
    # Two processes, a file each at a time (pyproject's --dist loadfile): the FSDP2 test (its plain reference run and
    # its FSDP2 run, 51 s on the H200 on 2026-11-27, when that was a torchrun launch) beside the other files (56 s),
    # which ran one after the other (113 s in all). The one GPU holds both: each test's figures are outcomes, not
    # timings. On the CPU (--smoke) each is skipped, and one process collects them sooner.
    command = [
        sys.executable, "-m", "pytest", "-m", "cuda", "-n", "0" if smoke else "2", "-p", "no:cacheprovider",
        f"--junitxml={junit}",
        "-o", "junit_family=legacy",  # keeps the properties tests record (the graph pool's bytes, ...)
        "-p", "_pytest_outcomes",  # each outcome as it happens: a run cut short keeps them (JUnit comes at the end)
        *deselect, *CUDA_TEST_FILES,
    ]  # fmt: skip
    junit.unlink(missing_ok=True)
    stream.unlink(missing_ok=True)
    benchmarks = str(ROOT / "benchmarks")
    path = os.pathsep.join(p for p in (benchmarks, os.environ.get("PYTHONPATH")) if p)
    # A test's own training runs (`tests/_script_process.py`) stop well within the part's limit: a hung one fails its
    # test, and the report of the others comes back (the FSDP2 test's runs may take 300 s each).
    env = {**os.environ, "PYTHONPATH": path, OUTCOMES: str(stream), SCRIPT_TIMEOUT: str(TESTS_LIMIT // 3)}
    # Its own limit besides the call's: a test that hangs (a distributed launch waiting on a rank) stops here, not
    # after the trainer and generation parts' minutes too.
    own_stop = time.time() + TESTS_LIMIT
    exit_code, cut = run_command(command, own_stop if stop_at is None else min(stop_at, own_stop), env)
    hung = cut and (stop_at is None or own_stop < stop_at)  # its own limit, not the call's: a failure to report
    cut = cut and not hung
    outcomes, properties = {}, {}  # properties: what tests record with `record_property` (the graph pool's bytes)
    if not junit.is_file():  # a stopped run: the streamed outcomes, of what ended and what was "running"
        outcomes, properties = read_outcomes(stream) if stream.is_file() else ({}, {})
    else:
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            kinds = {child.tag for child in case}
            outcomes[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
            for prop in case.iter("property"):
                properties[f"{name}::{prop.get('name')}"] = prop.get("value")
    result = {"exit_code": exit_code, "cut": cut, "ok": exit_code == 0 and junit.is_file()}
    if hung:
        running = sum(outcome == "running" for outcome in outcomes.values())
        result["error"] = f"stopped at TESTS_LIMIT ({TESTS_LIMIT} s) with {running} test(s) still running"
    if not outcomes:
        return result | {"ok": False, "error": result.get("error") or f"pytest wrote no report (exit {exit_code})"}
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failure", "error", "skipped", "running")}
    return result | {
        "counts": counts,
        "outcomes": outcomes,
        "properties": properties,
        "qlora": "run" if not deselect else "not run: bitsandbytes is not installed (carry the qlora wheels)",
    }


def run_trainer(
    size: str,
    methods: tuple[str, ...],
    smoke: bool,
    out: Path,
    steps: int = TRAINER_STEPS,
    stop_at: float | None = None,
) -> dict:
    """``bench_gpu.py`` for ``methods`` at ``size`` (``--smoke``: its tiny model on the CPU), VAPO's ratios to GRPO."""
    result = out / f"bench_gpu-{size}-{'-'.join(methods)}.json"
    command = [sys.executable, str(BENCH_GPU), "--methods", ",".join(methods), "--json", str(result)]
    command += ["--smoke"] if smoke else ["--sizes", size, "--steps", str(steps), "--warmup", "1"]
    result.unlink(missing_ok=True)
    exit_code, cut = run_command(command, stop_at)
    rows = json.loads(result.read_text()) if result.is_file() else {}  # written after each run that ended
    size = "smoke" if smoke else size
    measured = {name: row for name, row in rows.items() if "error" not in row}  # a failed run: {"error": ...}
    ratios = {}
    for method in (m for m in methods if m.startswith("vapo-")):  # kind: "lora", "lora-generate", "full"
        kind = method.removeprefix("vapo-")
        vapo, grpo = measured.get(f"{size}/{method}"), measured.get(f"{size}/grpo-{kind.split('-')[0]}")
        if vapo and grpo:
            ratios[kind] = {"step": vapo["step_s"] / grpo["step_s"], "peak": vapo["peak_gib"] / grpo["peak_gib"]}
            ratios[kind]["engines"] = [vapo["engine"], grpo["engine"]]  # (the step's ratio is the engines' too)
    targets = {}
    if "lora" in ratios:
        targets = {f"lora {k} <= {limit}x": ratios["lora"][k] <= limit for k, limit in TARGETS.items()}
    figures = {"rows": rows, "vapo_over_grpo": ratios, "targets_met": targets}
    return {"ok": exit_code == 0, **figures} | ({"exit_code": exit_code, "cut": cut} if exit_code else {})


def copy_bandwidth(device: str, nbytes: int, repeats: int = 5, copies: int | None = None) -> float:
    """Bytes per second a device-to-device copy moves, reads and writes counted (the memory bandwidth a decode step
    spends reading the weights): the median of `repeats` timings of `copies` copies each (one copy of ~1 ms timed
    alone carried the launch and synchronisation's overhead: a few percent low; the CPU's smoke run copies once)."""
    import torch

    copies = copies or (10 if device == "cuda" else 1)

    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for i in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(copies):
            target.copy_(source)
        synchronize(device)
        if i:  # the first round warms up
            times.append(time.perf_counter() - start)
    return 2 * nbytes * copies / statistics.median(times)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def generation_engine(kind: str, options: dict, model, common: dict):
    """One engine of `ENGINES`, and the sampling-settings extras it runs with."""
    from trl_vapo.generation import TransformersGenerate
    from trl_vapo.static_cache import StaticCacheEngine

    if kind == "static":
        return StaticCacheEngine(model, **options, **common), {}
    if kind == "generate-compiled":
        # transformers compiles the decode step of a static cache on CUDA unless compile is disabled
        return TransformersGenerate(model, **common), {"cache_implementation": "static", "disable_compile": False}
    return TransformersGenerate(model, **common), {}


def generation_worker(settings: dict, result: Path) -> None:
    """Tokens/s and ms per decode step of each engine of `ENGINES` on one random model with real shapes, against
    the memory-bandwidth bound of a decode step; written to ``result`` after each engine (a part stopped at
    ``--limit`` keeps the engines that ended)."""
    import torch
    from bench_gpu import byte_level_tokenizer, qwen_config
    from transformers import AutoModelForCausalLM

    from trl_vapo.generation import SamplingSettings, stop_token_ids

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen_config(settings["size"]), dtype=dtype).eval()
    texts = [f"Problem {i}: compute {i} + {3 * i}, then explain." for i in range(settings["batch"])]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    common = {"pad_token_id": tokenizer.pad_token_id, "stop_token_ids": stop_token_ids(tokenizer, model)}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, settings["copy_bytes"])
    bound = settings["batch"] * bandwidth / weight_bytes
    # The KV cache a decode step reads, its filled slots on average over the completion (at 0.5B shapes, 64 x 512:
    # about 0.4 of the weights' bytes; leaving it out flattered no engine but understated every share).
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    filled = sum(len(p) for p in prompts) + settings["batch"] * settings["new_tokens"] / 2
    bound_with_cache = settings["batch"] * bandwidth / (weight_bytes + filled * kv_bytes_per_token)
    rows = {}
    report = {
        **settings,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype),
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "bound_tokens_per_s": bound,
        "kv_cache_bytes_per_token": kv_bytes_per_token,
        "kv_cache_tokens_read_per_step": filled,
        "bound_with_kv_cache_tokens_per_s": bound_with_cache,
        "engines": rows,
    }
    for name in settings.get("engines", ENGINES):
        kind, options, full_warmup = ENGINES[name]
        if kind == "generate-compiled" and device != "cuda":
            continue  # transformers compiles the step on CUDA only
        began, engine = time.perf_counter(), None
        try:
            engine, extra = generation_engine(kind, options, model, common)
            warmup = settings["new_tokens"] if full_warmup else settings["warmup_tokens"]
            sampling = SamplingSettings(max_new_tokens=warmup, temperature=1.0, generation_kwargs=extra)
            engine.generate(prompts, sampling=sampling)
            torch.manual_seed(1)
            synchronize(device)
            start = time.perf_counter()
            sampling = SamplingSettings(
                max_new_tokens=settings["new_tokens"], temperature=1.0, generation_kwargs=extra
            )
            out = engine.generate(prompts, sampling=sampling)
            synchronize(device)
            seconds = time.perf_counter() - start
            tokens, steps = int(out.lengths.sum()), out.completion_ids.shape[1]
            rows[name] = {
                "seconds": seconds,
                "tokens": tokens,
                "decode_steps": steps,
                "ms_per_step": 1000 * seconds / steps,
                "tokens_per_s": tokens / seconds,
                "share_of_bound": tokens / seconds / bound,
                "share_of_bound_with_kv_cache": tokens / seconds / bound_with_cache,
                "warmup_seconds": start - began,
            }
        except Exception as error:  # noqa: BLE001 -- one engine failing must not lose the others' figures
            rows[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        print(f"{name}: {rows[name]}", flush=True)
        del engine  # a failed one's memory too, before the next engine
        if device == "cuda":
            torch.cuda.empty_cache()
        write_json(result, report)  # after each engine: a part stopped at --limit keeps those that ended
    write_json(result, report)


def run_generation(smoke: bool, out: Path, stop_at: float | None = None) -> dict:
    settings = SMOKE_GENERATION if smoke else GENERATION
    result = out / "generation.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--generation-worker", json.dumps(settings), "--result", str(result)]
    exit_code, cut = run_command(command, stop_at)
    figures = json.loads(result.read_text()) if result.is_file() else {}  # written after each engine that ended
    return {"ok": exit_code == 0, **figures} | ({"exit_code": exit_code, "cut": cut} if exit_code else {})


def run_part(
    part: str, smoke: bool, out: Path, trainer_steps: int = TRAINER_STEPS, stop_at: float | None = None
) -> dict:
    if part == "tests":
        return run_tests(out, smoke, stop_at)
    if part == "generation":
        return run_generation(smoke, out, stop_at)
    size, methods = TRAINER_PARTS[part]
    return run_trainer(size, methods, smoke, out, trainer_steps, stop_at)


# ---------------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------------


def format_part(part: str, result: dict) -> str:
    """A part's table; a part that failed or was cut at ``--limit``: a line saying so, then what it finished."""
    if result.get("status") == "skipped":
        return f"{part}: not run ({result['why']})"
    if result.get("ok"):
        return format_figures(part, result)
    if result.get("status") in ("cut", "interrupted"):
        why = "at --limit" if result["status"] == "cut" else "by a signal"
        head = f"{part}: {result['status'].upper()} {why} after {result['seconds']:.0f} s"
    else:
        why = result.get("error") or f"exit {result.get('exit_code')}; its output is above"
        head = f"{part}: FAILED ({why})"
    finished = result.get("rows") or result.get("engines") or result.get("outcomes")
    return f"{head}; what it finished:\n{format_figures(part, result)}" if finished else head


def format_figures(part: str, result: dict) -> str:
    if part == "tests":
        counts = ", ".join(f"{v} {k}" for k, v in result["counts"].items() if v)
        lines = [f"tests (pytest -m cuda): {counts or 'none'}; QLoRA {result['qlora']}"]
        lines += [f"  {outcome:8s} {name}" for name, outcome in result["outcomes"].items() if outcome in BAD]
        lines += [f"  {name} = {value}" for name, value in result.get("properties", {}).items()]
        return "\n".join(lines)
    if part == "generation":
        header = (
            f"{'engine':32s}{'tokens':>8s}{'seconds':>9s}{'ms/step':>9s}{'tokens/s':>10s}{'of bound':>10s}"
            f"{'+KV':>7s}{'warm-up s':>11s}"
        )
        lines = [
            f"generation: {result['size']} shapes ({result['params'] / 1e6:.0f}M parameters, {result['dtype']}), "
            f"batch {result['batch']} x {result['new_tokens']} new tokens, T=1, {result['device']}; copy bandwidth "
            f"{result['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, weights {result['weight_bytes'] / 2**30:.2f} GiB:"
            f" bound {result['bound_tokens_per_s']:,.0f} tokens/s, with the KV cache's reads "
            f"{result.get('bound_with_kv_cache_tokens_per_s', math.nan):,.0f}",
            header,
            "-" * len(header),
        ]
        for name, row in result["engines"].items():
            if "error" in row:
                lines.append(f"{name:32s}FAILED: {row['error'][:200]}")
                continue
            lines.append(
                f"{name:32s}{row['tokens']:>8d}{row['seconds']:>9.2f}{row['ms_per_step']:>9.1f}"
                f"{row['tokens_per_s']:>10,.0f}{row['share_of_bound']:>10.1%}"
                f"{row.get('share_of_bound_with_kv_cache', math.nan):>7.1%}{row['warmup_seconds']:>11.1f}"
            )
        return "\n".join(lines)
    header = (
        f"{'row':24s}{'engine':>20s}{'step s':>8s}{'gen s':>8s}{'score s':>9s}{'update s':>10s}{'tok/s':>9s}"
        f"{'peak GiB':>10s}"
    )
    measured = {name: r for name, r in result["rows"].items() if "error" not in r}
    device = next(iter(measured.values()))["device"] if measured else "no run measured"
    lines = [f"{part} (bench_gpu.py; {device})", header, "-" * len(header)]
    for name, r in result["rows"].items():
        if "error" in r:
            lines.append(f"{name:24s}FAILED: {r['error'][:200]}")
            continue
        lines.append(
            f"{name:24s}{r['engine']:>20s}{r['step_s']:>8.2f}{r['generation']:>8.2f}{r['scoring']:>9.2f}"
            f"{r['update']:>10.2f}{r['tokens_per_s']:>9.0f}{r['peak_gib']:>10.2f}"
        )
    lines.append("seconds of each run (its steps are `train`):")
    lines += [f"  {name}: {phase_line(r['phases'])}" for name, r in measured.items()]
    for kind, ratio in result.get("vapo_over_grpo", {}).items():
        engines = " / ".join(ratio.get("engines", ()))
        lines.append(f"VAPO / GRPO, {kind} ({engines}): step {ratio['step']:.2f}x, peak memory {ratio['peak']:.2f}x")
    for target, met in result.get("targets_met", {}).items():
        lines.append(f"  target {target}: {'met' if met else 'MISSED'}")
    return "\n".join(lines)


MACHINE_PACKAGES = (
    "torch", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes", "huggingface-hub", "pyarrow",
    "regex", "fsspec",
)  # fmt: skip
"""Packages whose versions the report names: the carried wheels and what they require of the machine's image."""


def machine() -> dict:
    from importlib import metadata

    import torch

    versions = {}
    for name in MACHINE_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    device = "cpu"
    if torch.cuda.is_available():  # the name from nvidia-smi: the driver process holds no CUDA context of its own
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        try:
            device = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or "cuda"
        except (OSError, subprocess.TimeoutExpired):  # no nvidia-smi there: the report is written all the same
            device = torch.cuda.get_device_name()
    return {"python": platform.python_version(), "device": device, "cpus": os.cpu_count(), "packages": versions}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "gpu_suite")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, run in this order: {PARTS}")
    parser.add_argument("--deadline", type=float, help="seconds after which no further part starts")
    parser.add_argument(
        "--limit",
        type=float,
        help="seconds after which a part still running is stopped, keeping the runs it finished (a call's limit, "
        "less a margin for the last write)",
    )
    parser.add_argument("--smoke", action="store_true", help="the same parts at tiny shapes on the CPU")
    parser.add_argument(
        "--trainer-steps", type=int, default=TRAINER_STEPS, help="optimizer steps per trainer run, the first a warm-up"
    )
    parser.add_argument(
        "--download-wheels", choices=sorted(WHEELS), help="download a wheel set (here, with a network)"
    )
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="where --download-wheels puts them")
    parser.add_argument("--generation-worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.download_wheels:
        return download_wheels(opts.download_wheels, opts.dest)
    if opts.generation_worker:
        generation_worker(json.loads(opts.generation_worker), Path(opts.result))
        return 0
    parts = opts.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {PARTS}")
    import torch

    if not torch.cuda.is_available() and not opts.smoke:
        parser.error("no CUDA GPU here: run on the GPU machine, or pass --smoke for the tiny CPU run")
    opts.out = opts.out.resolve()  # the parts run in the repository's root
    opts.out.mkdir(parents=True, exist_ok=True)
    report = {"command": shlex.join(["gpu_suite.py", *(argv or sys.argv[1:])]), "machine": machine(), "parts": {}}
    print(f"{report['machine']}; parts {parts}; out {opts.out}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # a part's processes are stopped too
    stop_at = None if opts.limit is None else STARTED + opts.limit
    for part in parts:
        elapsed = time.time() - STARTED
        late = [(name, at) for name, at in (("deadline", opts.deadline), ("limit", opts.limit)) if at is not None]
        late = [(name, at) for name, at in late if elapsed >= at]
        expected = (SMOKE_PART_SECONDS if opts.smoke else PART_SECONDS).get(part)
        if late:
            result = {"status": "skipped", "why": f"{late[0][0]}: {elapsed:.0f} s >= {late[0][1]:.0f} s"}
        elif opts.limit is not None and expected is not None and elapsed + expected > opts.limit:
            result = {
                "status": "skipped",
                "why": f"limit: {expected:.0f} s expected (PART_SECONDS), {opts.limit - elapsed:.0f} s left",
            }
        else:
            print(f"\n== {part} ({elapsed:.0f} s)", flush=True)
            began = time.time()
            try:
                result = run_part(part, opts.smoke, opts.out, opts.trainer_steps, stop_at)
            except Exception as error:  # noqa: BLE001 -- one broken part must not lose the others' figures
                result = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            except BaseException:  # SIGTERM (an exit, above) or Ctrl-C: the part's processes are stopped; say so
                report["parts"][part] = {"ok": False, "status": "interrupted", "seconds": time.time() - began}
                write_report(report, opts.out)
                raise
            status = "ok" if result["ok"] else "cut" if result.get("cut") else "failed"
            result |= {"status": status, "seconds": time.time() - began}
        report["parts"][part] = result
        text = write_report(report, opts.out)  # after every part: a call cut off at its limit brings back what ended
        print(
            f"== {part}: {result['status']}" + (f" in {result['seconds']:.0f} s" if "seconds" in result else ""),
            flush=True,
        )
    times = ", ".join(f"{name} {r['seconds']:.0f} s" for name, r in report["parts"].items() if "seconds" in r)
    print(f"\n== summary ({time.time() - STARTED:.0f} s: {times or 'no part ran'})\n{text}", flush=True)
    return 0 if all(r["status"] != "failed" for r in report["parts"].values()) else 1


def write_report(report: dict, out: Path) -> str:
    """``gpu_suite.json``, then ``gpu_suite.txt`` (the parts' tables, which it returns): the figures first, so that a
    table that cannot be formatted loses no figure and stops no later part (the error is its table's text)."""
    write_json(out / "gpu_suite.json", report, indent=1)
    tables = []
    for name, done in report["parts"].items():
        try:
            tables.append(format_part(name, done))
        except Exception as error:  # (its figures are in gpu_suite.json)
            tables.append(f"{name}: its table could not be formatted ({type(error).__name__}: {error})")
    text = "\n\n".join(tables)
    (out / "gpu_suite.txt").write_text(f"{report['machine']}\n\n{text}\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
