"""Shared fixtures: tiny models and tokenizers built locally and saved with `save_pretrained`.

Tests load them back with `from_pretrained`, exactly as users load hub models. Nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a hub: make any accidental look-up fail fast instead of waiting on the network (forced: a user's
# HF_HUB_OFFLINE=0 let them try). And they never read or write the user's Hugging Face folder: a model the README's
# quick start cached there loaded for real where a test expects "not in the cache", the user's accelerate default
# config relaunched the CLI's runs, and the datasets cache grew by every run. One folder for the whole session (xdist's
# workers inherit the controller's environment), set before any Hugging Face library reads it at import.
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
_OWN_HF_HOME = None  # the folder this process made (the session's first: xdist's controller), removed at its end
if "TRL_VAPO_TESTS_HF_HOME" not in os.environ:
    import tempfile

    _OWN_HF_HOME = tempfile.mkdtemp(prefix="trl-vapo-tests-hf-")
    os.environ["TRL_VAPO_TESTS_HF_HOME"] = os.environ["HF_HOME"] = _OWN_HF_HOME
    own = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "HF_XET_CACHE")
    own += ("HF_ASSETS_CACHE", "HF_MODULES_CACHE", "HF_TOKEN_PATH", "ACCELERATE_CONFIG_FILE")
    for name in own:  # (each a place of the user's own, read before HF_HOME)
        os.environ.pop(name, None)

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per xdist worker (and per process it starts): two workers of two threads each on two cores
    # thrash, and the in-process demo test ran 6x slower than alone.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

# The slowest files first (seconds on the development VM, 2026-11-30, `--durations=0`), so that xdist's per-file
# scheduling ends both workers together (pyproject.toml passes --no-loadscope-reorder: xdist would otherwise order the
# files by their number of tests, and the two workers finished up to 30 s apart).
SLOWEST_FILES = [
    "test_cli.py",  # 114
    "test_reliability.py",  # 69
    "test_gpu_suite.py",  # 44
    "test_bench_learning.py",  # 39
    "test_rewards.py",  # 37
    "test_trainer.py",  # 31
    "test_distributed.py",  # 29
    "test_benchmarks.py",  # 24
    "test_engines.py",  # 13
    "test_generation.py",  # 13
    "test_security.py",  # 11
    "test_grpo_parity.py",  # 11
    "test_demo_chains.py",  # 10
    "test_diagnostics.py",  # 9
    "test_demo_data.py",  # 9
]


def pytest_xdist_auto_num_workers(config):
    """`-n logical` (pyproject.toml): one worker for each CPU this process may run on (its affinity, a container's
    CPU quota), where xdist counts the host's (psutil's count): a 2-CPU container on a 64-core host started 64
    workers, each importing torch. None where the affinity cannot be read (macOS, Windows): xdist's own count."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = len(os.sched_getaffinity(0))
    try:  # cgroup v2's quota: "max 100000" (none) or "200000 100000" (two CPUs' time)
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)

    items.sort(key=rank)  # stable: each file's tests keep their order

    # Without a GPU the CUDA tests leave the default run quietly (deselected, not a skip line each); `-m cuda` still
    # collects and skips them, as the GPU suite's smoke test does.
    import torch

    if not config.getoption("markexpr") and not torch.cuda.is_available():
        cuda = [item for item in items if item.get_closest_marker("cuda")]
        config.hook.pytest_deselected(items=cuda)
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> str:
    """The device a test runs on: the CPU everywhere, and a CUDA GPU where there is one (`pytest -m cuda` runs only
    those; `benchmarks/gpu_suite.py` runs them on the GPU machine)."""
    import torch

    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (benchmarks/gpu_suite.py runs the cuda tests there)")
    return request.param


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved ~80k-parameter Llama decoder with a character-level tokenizer (chat template, EOS, pad)."""
    from trl_vapo.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny model and its tokenizer, loaded (one copy per test module: tests may change the model's weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory):
    """A saved one-label Llama sequence classifier (a reward model) with the same character tokenizer."""
    from trl_vapo.tiny import save_tiny_reward_model

    return save_tiny_reward_model(tmp_path_factory.mktemp("reward-model"))


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """TRL's `VLLMGeneration` replaced by `helpers.StandInVLLMGeneration` (vLLM cannot be installed here: no GPU), with
    TRL's `is_vllm_available` answering yes: `use_vllm=True` then builds the trainer's vLLM engine on it."""
    import importlib

    from helpers import StandInVLLMGeneration

    vllm_generation = importlib.import_module("trl.generation.vllm_generation")
    # TRL's `is_vllm_available`, as the engine check reads it (imported through `trl_vapo._compat`).
    monkeypatch.setattr(importlib.import_module("trl_vapo.generation"), "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vllm_generation, "VLLMGeneration", StandInVLLMGeneration)


def pytest_unconfigure(config):
    if _OWN_HF_HOME is not None:  # (the session's own folder: the process that made it removes it)
        import shutil

        shutil.rmtree(_OWN_HF_HOME, ignore_errors=True)
