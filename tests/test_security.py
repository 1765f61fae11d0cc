"""Security: no remote code unless asked, no unpickling of untrusted files, no code from reward names, no network."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_args, prompts_dataset

from trl_vapo import VAPOTrainer
from trl_vapo.rewards import get_reward_function


def constant(completions, **kwargs):
    return [0.0] * len(completions)


def args(tmp_path, **overrides):
    """`make_args` for one short step (the security checks train nothing worth measuring)."""
    return make_args(
        tmp_path, **{"per_device_train_batch_size": 8, "max_completion_length": 4, "max_steps": 1, **overrides}
    )


class Tripwire:
    """Unpickling this touches a file: proof that something unpickled an untrusted file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_remote_code_is_not_run_unless_asked(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "remote"
    model_dir.mkdir()
    for item in Path(tiny_model_dir).iterdir():
        (model_dir / item.name).write_bytes(item.read_bytes())
    marker = tmp_path / "remote-code-ran"
    (model_dir / "evil_modeling.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert args(tmp_path).trust_remote_code is False
    try:
        trainer = VAPOTrainer(
            model=str(model_dir), reward_funcs=constant, args=args(tmp_path), train_dataset=prompts_dataset(16)
        )
    except ValueError as refused:  # refusing is fine, saying why; running the file is not
        assert "trust_remote_code" in str(refused)
    else:  # transformers' own class for the config's model_type, the file's ignored
        assert type(trainer.actor_critic.policy).__name__ == "LlamaForCausalLM"
    assert not marker.exists()


def test_pickled_weights_are_never_unpickled(tiny_model_dir, tmp_path, capsys):
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    for item in Path(tiny_model_dir).iterdir():
        if not item.name.endswith(".safetensors"):
            (model_dir / item.name).write_bytes(item.read_bytes())
    marker = tmp_path / "unpickled"
    with open(model_dir / "pytorch_model.bin", "wb") as f:
        pickle.dump(Tripwire(marker), f)
    # The error says why safetensors, and how to load pickled weights one trusts (transformers' asked the user to
    # unset `use_safetensors=True`, which they never set).
    explained = r"model.safetensors.*unpickling.*model_init_kwargs=\{'use_safetensors': False\}"
    with pytest.raises(OSError, match=explained):
        VAPOTrainer(
            model=str(model_dir), reward_funcs=constant, args=args(tmp_path), train_dataset=prompts_dataset(16)
        )
    assert not marker.exists()
    # `trl-vapo eval` loads as training does (it unpickled them), its own flag named.
    from trl_vapo.cli import main

    assert main(["eval", "--model", str(model_dir), "--k", "1", "--num_prompts", "1"]) == 2
    assert not marker.exists() and "`trl-vapo eval --use_safetensors false`" in capsys.readouterr().err


def test_a_tampered_checkpoint_is_not_unpickled(tiny_model_dir, tmp_path):
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=constant,
        args=args(tmp_path, save_strategy="steps", save_steps=1),
        train_dataset=prompts_dataset(16),
    )
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    marker = tmp_path / "unpickled"
    torch.save({"state": {}, "param_groups": [Tripwire(marker)]}, checkpoint / "optimizer.pt")
    resumed = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=constant,
        args=args(tmp_path, max_steps=2),
        train_dataset=prompts_dataset(16),
    )
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert not marker.exists()


def test_reward_names_are_imported_never_evaluated(tmp_path):
    marker = tmp_path / "evaluated"
    for name in (f"__import__('pathlib').Path({str(marker)!r}).touch()", f"os.system('touch {marker}')"):
        with pytest.raises(ValueError):
            get_reward_function(name)
    assert not marker.exists()
    assert get_reward_function("trl_vapo.rewards.math_reward").__name__ == "math_reward"


NETWORK_GUARD = """
import socket, json, os
open(os.environ["NETWORK_LOG"] + ".loaded", "a").close()  # the guard watched this process
_connect = socket.socket.connect
def guarded(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost") and not host.startswith("/"):
        with open(os.environ["NETWORK_LOG"], "a") as log:
            log.write(json.dumps(str(address)) + "\\n")
        raise OSError("network disabled by the test")
    return _connect(self, address)
socket.socket.connect = guarded
_getaddrinfo = socket.getaddrinfo
def guarded_getaddrinfo(host, *args, **kwargs):
    if host not in (None, "127.0.0.1", "::1", "localhost"):
        with open(os.environ["NETWORK_LOG"], "a") as log:
            log.write(json.dumps(str(host)) + "\\n")
        raise socket.gaierror("network disabled by the test")
    return _getaddrinfo(host, *args, **kwargs)
socket.getaddrinfo = guarded_getaddrinfo
"""


def test_a_local_run_makes_no_network_call(tiny_model_dir, tmp_path):
    """With hub variables unset (as a user has them), training a local model on local data never opens a socket."""
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NETWORK_GUARD)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(16)))
    log = tmp_path / "network.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "DISABLE_TELEMETRY"))}
    env.update(
        {"PYTHONPATH": str(guard), "NETWORK_LOG": str(log), "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf")}
    )
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "trl-vapo"),
            "train",
            "--model_name_or_path",
            str(tiny_model_dir),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "1",
            "--value_pretrain_steps",
            "0",
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
            "--max_completion_length",
            "4",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert Path(f"{log}.loaded").exists(), "the network guard never loaded: nothing was watched"
    assert not log.exists(), f"network calls: {log.read_text()}"
    # A quiet console too: deepspeed (installed here, unused by this run) is imported by accelerate while the Trainer
    # is built, and logged "Setting accelerator to CPU. If you have GPU ..." on every run before trl_vapo hushed it.
    console = result.stdout + result.stderr
    assert "accelerator" not in console and "DeepSpeed" not in console, console[:2000]
