"""What differs on the machines users have and the development VM (Linux, CPU) is not: Windows, Apple's MPS, other
accelerators. None of them runs here, so each test states the platform's behaviour it stands in for; the CUDA
variants run on the GPU machine (`benchmarks/gpu_suite.py`)."""

from __future__ import annotations

import ast
import errno
import json
import logging
import os
import random
import select
import signal
import types
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

import trl_vapo
from trl_vapo import checkpoint as ckpt
from trl_vapo.core import exact, exact_device
from trl_vapo.rewards import MathReward
from trl_vapo.rewards import pool as reward_pool


def test_rng_states_come_back_on_the_device(device, tmp_path):
    """A resumed run samples what the uninterrupted one would: Python's, NumPy's and torch's generators, the
    accelerator's among them (on CUDA here; MPS and XPU go through the same `torch.accelerator` calls)."""
    torch.rand(1, device=device)  # the device's generator exists before the save, as in a run that sampled

    def draw():
        return random.random(), np.random.rand(), torch.rand(3).tolist(), torch.rand(3, device=device).tolist()

    ckpt.save_rng_state(tmp_path / "rng_state_0.safetensors")
    expected = draw()
    draw()
    ckpt.load_rng_state(tmp_path / "rng_state_0.safetensors")
    assert draw() == expected


def test_an_accelerators_generators_are_saved_and_restored_under_its_name(tmp_path, monkeypatch):
    """MPS and XPU do not run here: stand-ins with the interface of torch's device modules (`get_rng_state(index)`,
    `set_rng_state(state, index)`, `is_initialized()` where CUDA and XPU have it, MPS not), as torch returns them.
    States go under `torch_<type>_<index>` (CUDA's key before this change too), come back on that accelerator only,
    and are not read before CUDA has started (reading would start it)."""
    from safetensors import safe_open

    restored = {}

    def accelerator(kind, started=True):
        module = types.SimpleNamespace(
            get_rng_state=lambda index: torch.tensor([index, 7], dtype=torch.uint8),
            set_rng_state=lambda state, index: restored.__setitem__((kind, index), state.tolist()),
        )
        if kind != "mps":
            module.is_initialized = lambda: started
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device(kind))
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
        monkeypatch.setattr(torch, "get_device_module", lambda device: module)

    def saved_keys(path):
        with safe_open(str(path), framework="pt") as handle:
            return sorted(key for key in handle.keys() if key.startswith("torch_") and key != "torch_cpu")

    for kind, started, keys in [("mps", True, ["torch_mps_0", "torch_mps_1"]), ("cuda", False, [])]:
        accelerator(kind, started)
        ckpt.save_rng_state(tmp_path / f"{kind}.safetensors")
        assert saved_keys(tmp_path / f"{kind}.safetensors") == keys
    accelerator("cuda")
    ckpt.save_rng_state(tmp_path / "cuda.safetensors")
    assert saved_keys(tmp_path / "cuda.safetensors") == ["torch_cuda_0", "torch_cuda_1"]

    accelerator("mps")
    ckpt.load_rng_state(tmp_path / "mps.safetensors")
    ckpt.load_rng_state(tmp_path / "cuda.safetensors")  # another accelerator's states are left unread
    assert restored == {("mps", 0): [0, 7], ("mps", 1): [1, 7]}
    restored.clear()
    accelerator("cuda", started=False)  # setting a state needs no started device
    ckpt.load_rng_state(tmp_path / "cuda.safetensors")
    assert restored == {("cuda", 0): [0, 7], ("cuda", 1): [1, 7]}


def _float64_uses(tree: ast.AST) -> list[int]:
    """Lines that make float64 tensors: `torch.float64`/`torch.double`, `.double()`, `dtype="float64"`."""
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr in ("float64", "double"))
        or (isinstance(node, ast.Constant) and node.value == "float64")
    )


def test_float64_goes_through_the_one_door_that_keeps_it_off_apples_gpu():
    """Apple's MPS has no float64 (`TypeError: Cannot convert a MPS Tensor to float64 dtype`): the first rollout's
    statistics died there. Every float64 in the package goes through `core.exact`, which sums an MPS tensor's on the
    CPU. MPS cannot run here: this reads the source, and the door's choice of device."""
    root = Path(trl_vapo.__file__).parent
    door = ast.parse((root / "core.py").read_text())
    exact_lines = next(
        range(node.lineno, node.end_lineno + 1)
        for node in door.body
        if isinstance(node, ast.FunctionDef) and node.name == "exact"
    )
    elsewhere = {
        f"{path.relative_to(root)}:{line}"
        for path in sorted(root.rglob("*.py"))
        for line in _float64_uses(ast.parse(path.read_text()))
        if not (path.name == "core.py" and path.parent == root and line in exact_lines)
    }
    assert not elsewhere, f"float64 outside core.exact (MPS has none): {sorted(elsewhere)}"
    assert _float64_uses(ast.parse("x.double()\ntorch.float64\nt.to(dtype='float64')")) == [1, 2, 3]

    assert exact_device(torch.device("mps")) == torch.device("cpu")
    for kept in ("cpu", "cuda:1", "xpu"):
        assert exact_device(torch.device(kept)) == torch.device(kept)
    x = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert exact(x).dtype == torch.float64 and exact(x).tolist() == [1.0, 2.0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_suite.py)")
def test_the_statistics_of_a_device_without_float64_are_the_cpus(monkeypatch):
    """An Apple GPU's moments are summed on the CPU (`exact`), and its mask stayed on the GPU: the centring's
    `torch.where` mixed the two devices and refused, so whitening and the explained variance (every rollout's
    metric) stopped a run on MPS at its first rollout. MPS cannot run here: CUDA stands in for it, its float64
    declined as MPS's is."""
    from trl_vapo import core

    monkeypatch.setattr(core, "NO_FLOAT64_DEVICES", frozenset({"cuda"}))
    generator = torch.Generator().manual_seed(0)
    values, returns = torch.randn(2, 4, 9, generator=generator)
    mask = (torch.rand(4, 9, generator=generator) > 0.3).float()
    whitened = core.masked_whiten(values.cuda(), mask.cuda())
    assert whitened.device.type == "cuda"
    torch.testing.assert_close(whitened.cpu(), core.masked_whiten(values, mask))
    explained = core.explained_variance(values.cuda(), returns.cuda(), mask.cuda())
    torch.testing.assert_close(explained.cpu(), core.explained_variance(values, returns, mask))


class _WindowsOs(types.ModuleType):
    """`os` as `checkpoint.py` meets it on Windows: its name, a folder cannot be opened (PermissionError), and
    `os.fsync` (`_commit`, FlushFileBuffers) needs a handle that may write (EBADF otherwise). Everything else is this
    `os`."""

    name = "nt"

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def open(path, flags, *args, **kwargs):
        if os.path.isdir(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return os.open(path, flags, *args, **kwargs)

    @staticmethod
    def fsync(fd):
        import fcntl  # (here, not at the top: on Windows, where there is none, the file failed to collect)

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        os.fsync(fd)


def test_a_checkpoint_is_published_where_folders_cannot_be_flushed(tmp_path, monkeypatch):
    """Every `save_model` and checkpoint flushes its files and folders before the rename that publishes them; on
    Windows that raised (and `save_model` then removed the model it had written). Windows does not run here: its two
    behaviours are emulated for `checkpoint.py`'s calls, which choose their Windows settings by `os.name`."""
    monkeypatch.setattr(ckpt, "os", _WindowsOs("os"))
    final = tmp_path / "checkpoint-2"
    for generation in ("first", "second"):  # a new checkpoint, then one that replaces it
        tmp = ckpt.temporary_folder(final, "run")
        (tmp / "critic").mkdir(parents=True)
        (tmp / "model.safetensors").write_text(generation)
        (tmp / "critic" / "value_head.safetensors").write_text(generation)
        ckpt.publish(tmp, final)
        assert (final / "model.safetensors").read_text() == generation
        assert (final / "critic" / "value_head.safetensors").read_text() == generation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]

    monkeypatch.setattr(_WindowsOs, "name", "posix")  # the emulation bites: POSIX's settings fail there
    with pytest.raises(OSError, match="Bad file descriptor|Permission denied"):
        ckpt.fsync_tree(final)


def test_math_reward_verifies_in_process_where_no_worker_pool_can_run(monkeypatch, caplog):
    """Windows has no `select.poll` for the worker pool's pipes: an answer that is not a plain number raised there.
    There math-verify runs in the training process, without a deadline, and says so once. Windows does not run
    here: `select.poll` is taken away; math-verify is the real one."""
    monkeypatch.delattr(select, "poll")
    monkeypatch.setattr(reward_pool, "_SHARED_POOLS", {})
    children = {child.pid for child in psutil.Process().children()}
    levels = {name: logging.getLogger(name).level for name in ("math_verify", "latex2sympy2_extended")}
    reward = MathReward(timeout=2.0)
    completions = [r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{x^2}", r"\boxed{2x}", "no box"]
    with caplog.at_level(logging.WARNING, logger=reward_pool.__name__):
        first = reward(completions, answer=[r"\frac12", r"\frac{1}{2}", "x^2", "x^2", "x^2"])
        again = reward(completions[:3], answer=[r"\frac12", r"\frac{1}{2}", "2"])
    assert first == [1.0, 1.0, 1.0, -1.0, -1.0]  # correct_reward, incorrect_reward
    assert again == [1.0, 1.0, -1.0]
    assert isinstance(reward.pool, reward_pool.InProcessVerifier)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "without the 2 s deadline" in caplog.records[0].message
    assert {child.pid for child in psutil.Process().children()} <= children  # no worker process started
    assert {name: logging.getLogger(name).level for name in levels} == levels  # the user's math-verify still speaks


def test_no_signal_is_forwarded_on_windows(monkeypatch):
    """`trl-vapo train` with launcher arguments forwards SIGTERM/SIGINT to its launcher on POSIX. On Windows the
    console gives Ctrl-C to every attached process, and psutil forwards only SIGTERM there (TerminateProcess: no
    checkpoint), raising ValueError for SIGINT inside the handler: no handler is installed. `os.name` is Windows'
    for the call alone."""
    from trl_vapo.cli import _forward_signals_to_children

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    with monkeypatch.context() as patch:
        patch.setattr(os, "name", "nt")
        replaced = _forward_signals_to_children()
    assert replaced == {}
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_eval_runs_on_the_cpu_where_torch_was_built_for_a_gpu_that_is_not_there(tiny_model_dir, monkeypatch, capsys):
    """PyPI's Linux torch is a CUDA build: on a machine without a GPU `torch.accelerator` still names CUDA unless
    asked whether one is present. The torch here is a CPU build: `current_accelerator` answers as a CUDA build does."""
    from trl_vapo.cli import main

    def current_accelerator(check_available=False):
        return None if check_available else torch.device("cuda")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", current_accelerator)
    command = ["eval", "--model", str(tiny_model_dir), "--num_prompts", "2", "--k", "1", "--max_new_tokens", "4"]
    assert main(command) == 0
    assert json.loads(capsys.readouterr().out)["num_problems"] == 2


def test_eval_runs_on_the_cpu_where_an_accelerator_is_present_when_asked_to(tiny_model_dir, monkeypatch, capsys):
    """`--use_cpu`, as TrainingArguments' field: an MPS or CUDA device present is not used. No accelerator here: the
    meta device stands in for one (a model moved there cannot sample, so eval fails where it is used)."""
    from trl_vapo.cli import main

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("meta"))
    command = ["eval", "--model", str(tiny_model_dir), "--num_prompts", "2", "--k", "1", "--max_new_tokens", "4"]
    assert main([*command, "--use_cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["num_problems"] == 2
    with pytest.raises(RuntimeError, match="meta tensors"):  # without it, the device present is used
        main(command)


def test_bf16_is_the_default_only_on_a_gpu_that_computes_in_it_natively(monkeypatch):
    """torch's `is_bf16_supported()` says yes on a T4 or a V100, which emulate bf16 (no tensor cores for it): the
    default there is float32, with a warning naming fp16. No GPU here: torch.cuda's answers stand in for a T4's."""
    from trl_vapo import config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert not config._cuda_supports_bf16() and config._cuda_without_native_bf16()
    with pytest.warns(UserWarning, match=r"no native bf16 \(a T4, a V100.*fp16=True"):
        assert config.default_bf16(False, use_cpu=False) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fp16 asked for, or the CPU: nothing to say
        assert config.default_bf16(True, use_cpu=False) is False and config.default_bf16(False, use_cpu=True) is False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100
    assert config._cuda_supports_bf16() and not config._cuda_without_native_bf16()
    # Training on the CPU of a machine with such a GPU (`use_cpu`): off, as on any CPU (it was on, under CPU autocast).
    assert config.VAPOConfig(output_dir="unused", use_cpu=True).bf16 is False
    # `accelerate launch --mixed_precision fp16` asks for fp16: bf16's default was on and overrode it (transformers
    # lets bf16 win over the launcher's fp16). The A100's answers stand; a whole config would set up the CUDA device.
    assert config.default_bf16(config.fp16_asked(False), use_cpu=False) is True
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert config.fp16_asked(False) is True and config.default_bf16(config.fp16_asked(False), use_cpu=False) is False
