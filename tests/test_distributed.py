"""DeepSpeed ZeRO-2/3 and FSDP2 with real processes (gloo on CPU), each compared with the same run without them.

Every run is `tests/_train_script.py`: value pretraining (2 rollouts), then RL, two optimizer steps per rollout,
gradient accumulation 2, per-side clipping that bites (`--max-grad-norm 0.05`), greedy sampling so that every run
sees the same completions. The reference is one plain process. DeepSpeed must take exactly one optimizer step per
trainer step (it stepped after every micro-batch), keep the step-wide token mean, clip the actor and the critic
separately, log both gradient norms, reset the actor's Adam step count when RL starts, and resume exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "_train_script.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
COMMON = [
    "--greedy",
    "--grad-accum",
    "2",
    "--max-grad-norm",
    "0.05",
    "--max-steps",
    "4",
    "--value-pretrain-steps",
    "2",
]
STEPS = 8  # 2 value-pretraining rollouts x 2 steps, then 4 RL steps


def train(model_dir: Path, output_dir: Path, processes: int, *extra: str) -> Path:
    port = str(29500 + (os.getpid() + hash(output_dir.name)) % 1000)
    command = [TORCHRUN, "--nproc_per_node", str(processes), "--master_port", port, str(SCRIPT)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [*command, "--model", str(model_dir), "--output-dir", str(output_dir), *COMMON, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return output_dir


def weights(run: Path) -> dict[str, torch.Tensor]:
    policy = load_file(run / "final" / "model.safetensors")
    critic = load_file(run / "final" / "critic" / "model.safetensors")
    return {**{f"policy.{k}": v for k, v in policy.items()}, **{f"critic.{k}": v for k, v in critic.items()}}


def step_logs(run: Path, name: str = "logs") -> dict[int, dict]:
    lines = (run / f"{name}-rank0.jsonl").read_text().splitlines()
    return {h["step"]: h for h in map(json.loads, lines) if "phase" in h}


def assert_same_training(run: Path, reference: Path, atol: float = 2e-5) -> None:
    expected, got = weights(reference), weights(run)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=1e-4, msg=name)
    reference_logs, logs = step_logs(reference), step_logs(run)
    assert sorted(logs) == sorted(reference_logs) == list(range(1, STEPS + 1))
    for step, log in logs.items():
        keys = ["grad_norm/critic"] + (["grad_norm/policy"] if log["phase"] == "rl" else [])
        for key in keys:
            assert log[key] == pytest.approx(reference_logs[step][key], rel=1e-3), (step, key)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> Path:
    return train(tiny_model_dir, tmp_path_factory.mktemp("plain"), 1, "--save-final", "--save-steps", "100")


@pytest.fixture(scope="module")
def zero3_two_ranks(tiny_model_dir, tmp_path_factory) -> Path:
    """ZeRO-3 on two processes, with a checkpoint after the first RL rollout (step 6) and the final weights: one
    launch that the comparison with the plain run and the resume test both read (a checkpoint changes no update)."""
    run = tmp_path_factory.mktemp("zero3-2")
    return train(tiny_model_dir, run, 2, "--deepspeed", "3", "--save-final", "--save-steps", "6")


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("processes", [1, 2])
def test_deepspeed_steps_once_per_trainer_step_and_matches_the_run_without_it(
    tiny_model_dir, tmp_path, reference, zero3_two_ranks, processes, stage
):
    if (processes, stage) == (2, 3):
        run = zero3_two_ranks
    else:
        extra = ("--deepspeed", str(stage), "--save-final", "--save-steps", "100")
        run = train(tiny_model_dir, tmp_path / "ds", processes, *extra)
    steps = json.loads((run / "steps.json").read_text())
    assert steps["trainer"] == steps["deepspeed"] == STEPS
    assert_same_training(run, reference)


def test_deepspeed_resumes_exactly(tiny_model_dir, tmp_path, reference, zero3_two_ranks):
    """ZeRO-3 on two processes, stopped after the first RL rollout and resumed from its checkpoint."""
    run = tmp_path / "ds"
    shutil.copytree(zero3_two_ranks, run)
    assert (run / "checkpoint-6" / "deepspeed").is_dir()
    shutil.rmtree(run / "checkpoint-8", ignore_errors=True)  # written at the end of the first run
    shutil.rmtree(run / "final")  # so that the weights compared below are the resumed run's
    (run / "logs-rank0.jsonl").rename(run / "first-rank0.jsonl")
    train(tiny_model_dir, run, 2, "--deepspeed", "3", "--save-steps", "100", "--resume", "--save-final")
    resumed = step_logs(run)
    assert sorted(resumed) == [7, 8]
    expected = weights(reference)
    for name, value in weights(run).items():
        torch.testing.assert_close(value, expected[name], atol=2e-5, rtol=1e-4, msg=name)


def test_fsdp2_samples_trains_and_saves_like_the_run_without_it(tiny_model_dir, tmp_path, reference):
    run = train(tiny_model_dir, tmp_path / "fsdp2", 2, "--fsdp2", "--save-final", "--save-steps", "100")
    assert json.loads((run / "steps.json").read_text())["distributed_type"] == "DistributedType.FSDP"
    assert_same_training(run, reference)
