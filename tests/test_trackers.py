"""Metrics reach real trackers, offline: TensorBoard (read back with TensorBoard's own reader) and trackio (its local
SQLite store). Plus what a user sees of a tiny LoRA run: the completions table, the phase on the progress bar and
the model card.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import textwrap

import pytest
import yaml
from helpers import digit_fraction, prompts_dataset

from trl_vapo import VAPOConfig, VAPOTrainer
from trl_vapo.model_card import build_model_card
from trl_vapo.modeling import value_pretraining_record


def tiny_run_args(output_dir, **overrides) -> VAPOConfig:
    """One value-pretraining rollout, then two RL steps, logging every step: three logs, both phases."""
    settings = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 6,
        "max_steps": 2,
        "value_pretrain_steps": 1,
        "logging_steps": 1,
        "save_strategy": "no",
        "plot_diagnostics": False,
        "seed": 0,
        "log_completions": True,
        "num_completions_to_print": 2,
    }
    settings.update(overrides)
    return VAPOConfig(**settings)


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """A tiny LoRA run reporting to TensorBoard with the progress bar on; its stdout and stderr are kept."""
    pytest.importorskip("tensorboard")
    from peft import LoraConfig

    out = tmp_path_factory.mktemp("lora-run") / "out"
    args = tiny_run_args(out, report_to=["tensorboard"], disable_tqdm=False)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        trainer = VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=args,
            train_dataset=prompts_dataset(32),
            peft_config=peft_config,
        )
        trainer.train()
        trainer.save_model(str(out))
    return {"trainer": trainer, "out": out, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def event_files(out):
    return sorted((out / "runs").glob("*/events.out.tfevents.*"))


def read_events(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {path.parent for path in event_files(out)}
    assert len(runs) == 1, runs
    accumulator = EventAccumulator(str(runs.pop()), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


# ---------------------------------------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------------------------------------


def test_tensorboard_events_hold_reward_explained_variance_and_phase(lora_run):
    from tensorboard.util import tensor_util

    events = read_events(lora_run["out"])
    tags = events.Tags()
    history = [h for h in lora_run["trainer"].state.log_history if "phase" in h]
    assert [h["phase"] for h in history] == ["value_pretrain", "rl", "rl"]
    for key in ("reward", "value/explained_variance", "loss/value"):
        scalars = events.Scalars(f"train/{key}")
        assert [e.step for e in scalars] == [h["step"] for h in history], key
        assert [e.value for e in scalars] == pytest.approx([h[key] for h in history], rel=1e-5), key
    assert "train/loss/policy" in tags["scalars"] and "train/grad_norm/critic" in tags["scalars"]
    # transformers' TensorBoardCallback writes string metrics with `add_text`: the phase is a text summary per log.
    assert "train/phase/text_summary" in tags["tensors"]
    phases = [
        (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
        for e in events.Tensors("train/phase/text_summary")
    ]
    assert phases == [(h["step"], h["phase"]) for h in history]


def test_one_tensorboard_event_file_per_run(lora_run):
    files = event_files(lora_run["out"])
    assert len(files) == 1, [f.name for f in files]
    assert "train/train_runtime" in read_events(lora_run["out"]).Tags()["scalars"]


# ---------------------------------------------------------------------------------------------------------------------
# trackio: local-first, offline
# ---------------------------------------------------------------------------------------------------------------------

TRACKIO_SCRIPT = textwrap.dedent("""
    import json, socket, sys

    # Record every outbound connection: a local-first tracker must make none (the hub is unreachable here).
    attempts = []
    _connect = socket.socket.connect
    def connect(self, address):
        attempts.append(repr(address))
        return _connect(self, address)
    socket.socket.connect = connect

    from datasets import Dataset
    from trl_vapo import VAPOConfig, VAPOTrainer
    sys.path.insert(0, sys.argv[3])
    from helpers import digit_fraction, prompts_dataset
    from test_trackers import tiny_run_args

    args = tiny_run_args(sys.argv[2], report_to=["trackio"], project="vapo-test", run_name="tiny", disable_tqdm=True)
    trainer = VAPOTrainer(model=sys.argv[1], reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset(32))
    trainer.train()

    from trackio.sqlite_storage import SQLiteStorage
    report = {
        "attempts": attempts,
        "runs": SQLiteStorage.get_runs("vapo-test"),
        "logs": SQLiteStorage.get_logs("vapo-test", "tiny"),
        "history": trainer.state.log_history,
    }
    print("REPORT " + json.dumps(report, default=str))
""")


@pytest.fixture(scope="module")
def trackio_run(tiny_model_dir, tmp_path_factory):
    """A tiny run reporting to trackio, in a process of its own (forked from the tests' server, which has not imported
    trackio): trackio reads TRACKIO_DIR once, at import."""
    from _script_process import run_code

    pytest.importorskip("trackio")
    root = tmp_path_factory.mktemp("trackio-run")
    # Local: neither a Space nor a server of the caller's environment.
    local = "import os\nos.environ.pop('TRACKIO_SPACE_ID', None)\nos.environ.pop('TRACKIO_SERVER_URL', None)\n"
    args = (str(tiny_model_dir), str(root / "out"), os.path.dirname(__file__))
    result = run_code(local + TRACKIO_SCRIPT, *args, cwd=root, env={"TRACKIO_DIR": str(root / "trackio")})
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))
    return {"root": root, "stdout": result.stdout, **json.loads(line[len("REPORT ") :])}


def test_trackio_stores_the_metrics_locally_without_network(trackio_run):
    assert trackio_run["attempts"] == []
    assert (trackio_run["root"] / "trackio" / "vapo-test.db").is_file()
    assert trackio_run["runs"] == ["tiny"]
    history = [h for h in trackio_run["history"] if "phase" in h]
    logs = [log for log in trackio_run["logs"] if "train/phase" in log]
    assert [log["train/phase"] for log in logs] == ["value_pretrain", "rl", "rl"]  # strings are kept as strings
    assert [log["train/global_step"] for log in logs] == [h["step"] for h in history]
    for key in ("reward", "value/explained_variance"):
        assert [log[f"train/{key}"] for log in logs] == pytest.approx([h[key] for h in history], rel=1e-6), key


def test_trackio_gets_the_completions_table(trackio_run):
    tables = [log["completions"] for log in trackio_run["logs"] if "completions" in log]
    assert len(tables) == 3  # one per logging step
    assert all(table["_type"] == "trackio.table" for table in tables)
    rows = tables[-1]["_value"]
    assert len(rows) == 8  # the whole rollout goes to the tracker; num_completions_to_print limits the printout
    columns = {"step", "prompt", "completion", "digit_fraction", "reward", "advantage", "value_first", "value_last"}
    assert columns <= set(rows[0])


# ---------------------------------------------------------------------------------------------------------------------
# What the user sees of the LoRA run
# ---------------------------------------------------------------------------------------------------------------------


def test_completions_table_printed_at_each_logging_step(lora_run):
    printed = lora_run["stdout"]
    assert "(value pretraining)" in printed and "(RL)" in printed
    titles = re.findall(r"Step (\d+) \((value pretraining|RL)\)", printed)
    assert [phase for _, phase in titles] == ["value pretraining", "RL", "RL"]
    # rich draws 80 columns wide when stdout is not a terminal: long headers fold ("Advantag" / "e")
    assert "Prompt" in printed and "(first)" in printed and "(last)" in printed and "Advantag" in printed


def test_progress_bar_names_the_phase(lora_run):
    bar = lora_run["stderr"]
    assert "value pretraining:" in bar and "RL:" in bar
    assert bar.index("value pretraining:") < bar.rindex("RL:")


def test_save_model_writes_a_card_a_user_can_publish(lora_run, tiny_model_dir):
    content = (lora_run["out"] / "README.md").read_text()
    meta = yaml.safe_load(content.split("---\n")[1])
    assert "licence" not in meta and "base_model" not in meta  # a local base is not hub metadata
    assert meta["library_name"] == "peft" and "lora" in meta["tags"]  # the run's own record: a LoRA adapter
    assert "None" not in content
    assert f"the local model `{tiny_model_dir}`" in content
    assert "| 1 | value pretraining |" in content and "ran 1 rollout" in content
    assert "LoRA adapter on the policy's frozen base" in content and "`value_pretrained_critic/`" in content


def test_model_card_of_the_tiny_run_loads_its_quick_start(lora_run, tiny_model_dir, tmp_path):
    """The card built from the run's own record: valid front matter, and its quick-start code runs as written."""
    trainer, out = lora_run["trainer"], lora_run["out"]
    card = build_model_card(
        base_model=str(tiny_model_dir),
        output_dir=out,
        args=trainer.args,
        dataset_description="sums of two numbers",
        is_adapter=True,
        critic_shares_base=trainer.actor_critic.shares_base,
        value_pretraining=value_pretraining_record(out / "value_pretrained_critic"),
        pretrained_critic_dir=out / "value_pretrained_critic",
        log_history=trainer.state.log_history,
        example_prompt=prompts_dataset(32)[0]["prompt"],
    )
    path = tmp_path / "README.md"
    card.save(str(path))
    content = path.read_text()
    meta = yaml.safe_load(content.split("---\n")[1])
    assert meta["library_name"] == "peft" and "lora" in meta["tags"] and "base_model" not in meta
    assert "ran 1 rollout, final explained variance" in content
    assert (out / "value_pretrained_critic").is_dir() and "`value_pretrained_critic/`" in content
    assert (out / "critic" / "value_head.safetensors").is_file() and "value_head.safetensors" in content
    assert "LoRA adapter on the policy's frozen base" in content
    code = re.search(r"## Quick start\n\n```python\n(.*?)\n```", content, re.DOTALL).group(1)
    namespace, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        # The card's own code, as a user would paste it: loads the adapter folder through `pipeline`.
        exec(compile(code, "quick_start", "exec"), namespace)  # noqa: S102
    generated = namespace["output"]["generated_text"]
    assert isinstance(generated, str) and printed.getvalue() == generated + "\n"
    assert namespace["generator"].model.active_adapters()  # transformers applied the adapter to its local base


def test_trackers_that_log_numbers_only_get_the_logs_without_the_phase(tiny_model_dir, tmp_path):
    """transformers' MLflow, ClearML and DVCLive callbacks log numbers only, and warn about a text value at every log:
    `phase` would give a warning each logging step. They get the logs without it; the log history keeps it. (mlflow,
    clearml and dvclive are not installed here: a stand-in with MLflowCallback's name and `on_log` records what it
    receives.)"""
    from helpers import make_args
    from transformers import TrainerCallback

    received = []

    class MLflowCallback(TrainerCallback):
        def on_log(self, args, state, control, logs, model=None, **kwargs):
            received.append(dict(logs))

    class DagsHubCallback(MLflowCallback):  # transformers' `report_to="dagshub"`: MLflow's, under its own name
        pass

    args = make_args(tmp_path, max_steps=1)
    callbacks = [MLflowCallback(), DagsHubCallback()]
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), callbacks=callbacks)
    trainer.train()
    assert len(received) == 2 * len(trainer.state.log_history)  # each callback, every log
    assert "reward" in received[0] and not any("phase" in logs for logs in received)
    assert trainer.state.log_history[0]["phase"] == "rl"
