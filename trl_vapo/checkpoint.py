"""Checkpoint files: crash-safe folder writes, random-number state without pickle, rotation.

A checkpoint is written into a temporary sibling folder and renamed into place only when complete, so a crash (or
`kill -9`) while writing leaves the previous checkpoint untouched and no half-written folder that looks valid.
Random-number states go to safetensors plus JSON: nothing in a checkpoint needs pickle to load except the optimizer
and scheduler state dicts, which load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CHECKPOINT_PREFIX = "checkpoint"
COMPLETE_MARKER = "vapo_state.json"
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")


def temporary_folder(final: Path) -> Path:
    """The folder a checkpoint is assembled in before :func:`publish` renames it to ``final``."""
    return final.with_name(f".{final.name}.tmp")


def publish(tmp: Path, final: Path) -> None:
    """Atomically replace ``final`` with the complete folder ``tmp``."""
    if final.exists():
        stale = final.with_name(f".{final.name}.old")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, final)


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first (a folder without its state file is incomplete)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = _CHECKPOINT_RE.match(child.name)
        if match and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def rotate_checkpoints(output_dir: str | os.PathLike, save_total_limit: int | None, keep: Path | None = None) -> None:
    """Delete the oldest checkpoints beyond ``save_total_limit`` (never ``keep``)."""
    if not save_total_limit or save_total_limit <= 0:
        return
    checkpoints = [c for c in list_checkpoints(output_dir) if c != keep]
    excess = len(checkpoints) + (keep is not None) - save_total_limit
    for stale in checkpoints[: max(excess, 0)]:
        shutil.rmtree(stale, ignore_errors=True)


def save_rng_state(path: Path) -> None:
    """Python, NumPy and torch (CPU and every CUDA device) generator states, as safetensors with JSON metadata."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {"torch_cpu": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_keys.astype(np.int64))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            tensors[f"torch_cuda_{index}"] = torch.cuda.get_rng_state(index)
    version, internal, gauss = random.getstate()
    metadata = {
        "python": json.dumps([version, list(internal), gauss]),
        "numpy": json.dumps([np_name, np_pos, np_has_gauss, np_gauss]),
    }
    save_file(tensors, str(path), metadata=metadata)


def load_rng_state(path: Path) -> None:
    """Restore the states written by :func:`save_rng_state`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    version, internal, gauss = json.loads(metadata["python"])
    random.setstate((version, tuple(internal), gauss))
    np_name, np_pos, np_has_gauss, np_gauss = json.loads(metadata["numpy"])
    np.random.set_state((np_name, tensors["numpy_keys"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(tensors["torch_cpu"])
    for key, state in tensors.items():
        if key.startswith("torch_cuda_") and torch.cuda.is_available():
            index = int(key.rsplit("_", 1)[1])
            if index < torch.cuda.device_count():
                torch.cuda.set_rng_state(state, index)
