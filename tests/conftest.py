"""Shared fixtures: tiny models and tokenizers built locally and saved with `save_pretrained`.

Tests load them back with `from_pretrained`, exactly as users load hub models. Nothing is downloaded.
"""

from __future__ import annotations

import os

import pytest

# Tests never reach a hub: make any accidental look-up fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per xdist worker (and per process it starts): two workers of two threads each on two cores
    # thrash, and the in-process demo test ran 6x slower than alone.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

# The slowest files first (seconds on the development VM), so that xdist's per-file scheduling ends both workers
# together: in alphabetical order the two workers finished 35 s apart.
SLOWEST_FILES = [
    "test_distributed.py",  # 86
    "test_reliability.py",  # 84
    "test_cli.py",  # 55
    "test_bench_learning.py",  # 47
    "test_trainer.py",  # 46
    "test_benchmarks.py",  # 40
    "test_rewards.py",  # 28
]


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved ~80k-parameter Llama decoder with a character-level tokenizer (chat template, EOS, pad)."""
    from trl_vapo.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory):
    """A saved one-label Llama sequence classifier (a reward model) with the same character tokenizer."""
    from trl_vapo.tiny import save_tiny_reward_model

    return save_tiny_reward_model(tmp_path_factory.mktemp("reward-model"))
