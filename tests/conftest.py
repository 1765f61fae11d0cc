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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved ~80k-parameter Llama decoder with a character-level tokenizer (chat template, EOS, pad)."""
    from trl_vapo.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
