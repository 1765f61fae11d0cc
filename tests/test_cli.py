"""The `trl-vapo` command line: YAML + flags, training on local files, eval, one-line errors."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy
import pytest
from helpers import put_in_hub_cache, refuse_model_loads
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_vapo.checkpoint import RUN_CONFIG_FILE, RUN_DATA_FILE, list_checkpoints
from trl_vapo.cli import (
    UsageError,
    _parse_args_and_config,
    _parser,
    _run_settings,
    _split_launch_args,
    main,
)
from trl_vapo.config import _cuda_supports_bf16

TRL_VAPO = str(Path(sys.executable).parent / "trl-vapo")


@pytest.fixture(scope="module")
def jsonl_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    with path.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"question": f"What is {i}+{i}?", "answer": str(2 * i), "source": "local"}) + "\n")
    return path


def test_yaml_sets_defaults_and_flags_override(tmp_path):
    config = tmp_path / "vapo.yaml"
    config.write_text(
        "model_name_or_path: some/model\n"
        "dataset_name: data.jsonl\n"
        "lam_actor: 0.9\n"
        "max_steps: 50\n"
        "use_peft: true\n"
        "lora_r: 8\n"
        "reward_funcs: [math_reward, think_boxed_format_reward]\n"
        "output_dir: from-yaml\n"
    )
    script, training, model, _, remaining = _parser().parse_args_and_config(
        ["--config", str(config), "--max_steps", "2", "--lora_r", "4"], return_remaining_strings=True
    )
    assert remaining == []
    assert training.lam_actor == 0.9 and training.max_steps == 2 and training.output_dir == "from-yaml"
    assert model.use_peft and model.lora_r == 4 and model.model_name_or_path == "some/model"
    assert script.reward_funcs == ["math_reward", "think_boxed_format_reward"]
    # VAPO defaults the YAML did not touch
    assert training.lam_critic == 1.0 and training.epsilon_high == 0.28 and training.length_adaptive_alpha == 0.05
    # A number that may be None takes None on the command line too, as the README's ablation commands pass it
    # (`--length_adaptive_alpha None` was an invalid float: HfArgumentParser reads `float | None` as a float).
    parsed = _parse_args_and_config(
        _parser(), ["--length_adaptive_alpha", "None", "--value_pretrain_patience", "null"]
    )
    assert parsed[1].length_adaptive_alpha is None and parsed[1].value_pretrain_patience is None
    with pytest.raises(UsageError, match=r"--learning_rate/--learning-rate: invalid float value: 'None'"):
        _parse_args_and_config(_parser(), ["--learning_rate", "None"])  # not one that may be None
    with pytest.raises(UsageError, match=r"--reward_weights/--reward-weights: invalid float value: 'None'"):
        _parse_args_and_config(_parser(), ["--reward_weights", "None"])  # a list's values are numbers
    # So does a text field whose default is None: it was the text "None" (every prompt the word None, silently);
    # one whose default is text keeps the text.
    script = _parse_args_and_config(_parser(), ["--prompt_template", "None", "--system_prompt", "null"])[0]
    assert script.prompt_template is None and script.system_prompt is None
    assert _parse_args_and_config(_parser(), ["--dataset_train_split", "None"])[0].dataset_train_split == "None"
    # And a switch whose None is a choice (automatic): a YAML's `true` could not be set back to it ("Truthy value
    # expected"); a plain switch (default False) stays true or false.
    assert _parse_args_and_config(_parser(), ["--use_static_cache_engine", "None"])[1].use_static_cache_engine is None
    with pytest.raises(UsageError, match=r"--remove_unused_columns.*Truthy value expected: got None"):
        _parse_args_and_config(_parser(), ["--remove_unused_columns", "None"])


def test_a_prompt_column_of_text_is_the_models_input_as_trl_grpo_takes_it(tiny_model_dir, tmp_path):
    """`trl grpo` passes a standard-format `prompt` as it is (no chat template), and the other columns as the data
    set holds them (a numeric `answer` was made text, which a ported reward comparing numbers scored 0); a prompt
    trl-vapo builds from another column goes through the chat template where the tokenizer has one (the tiny
    model's has), its answer column as text. The test split is loaded where evaluation is asked for, by
    `eval_on_start` alone too (`trl grpo` leaves it out, and the run failed once its models were loaded)."""
    from trl_vapo.cli import _resolve_data

    data = tmp_path / "rows.jsonl"
    rows = ({"prompt": f"{i}+{i}=", "question": f"{i}+{i}=", "answer": 2 * i} for i in range(8))
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for column, expected, answer in (
        ("prompt", "3+3=", 6),
        ("question", [{"role": "user", "content": "3+3="}], "6"),
    ):
        argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--prompt_column", column]
        script, training, model, _, _ = _parser().parse_args_and_config(argv, return_remaining_strings=True)
        _, train, during, _ = _resolve_data(script, model, training, demo=False)
        assert train[3]["prompt"] == expected and train[3]["answer"] == answer, (column, train[3])
        assert during is None  # no evaluation asked for
    # `eval_on_start` alone asks for the test split (`trl grpo` leaves it out, and fails once the models are loaded)
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--eval_on_start", "true"]
    script, training, model, _, _ = _parser().parse_args_and_config(
        [*argv, "--dataset_test_split", "train"], return_remaining_strings=True
    )
    assert len(_resolve_data(script, model, training, demo=False)[2]) == 8


def test_a_preset_takes_the_columns_the_user_named(jsonl_data, tmp_path):
    """`--dataset_preset gsm8k` over a local copy whose problems sit in another column: the column named on the
    command line is read (and the preset's boxed-answer template formats it); before, the preset's `question`
    replaced it."""
    from trl_vapo.cli import _resolve_data

    renamed = tmp_path / "gsm8k.jsonl"
    rows = [json.loads(line) for line in jsonl_data.read_text().splitlines()]
    renamed.write_text("".join(json.dumps({"problem": r["question"], "answer": r["answer"]}) + "\n" for r in rows))
    argv = ["--model_name_or_path", "m", "--dataset_name", str(renamed), "--dataset_preset", "gsm8k"]
    script, training, model, _, _ = _parser().parse_args_and_config(
        [*argv, "--prompt_column", "problem", "--prompt_format", "text"], return_remaining_strings=True
    )
    _, train, _, _ = _resolve_data(script, model, training, demo=False)
    assert train[3]["prompt"].startswith("What is 3+3?\n") and "\\boxed{}" in train[3]["prompt"]
    assert script.prompt_column == "problem" and script.answer_column == "answer"
    script, training, model, _, _ = _parser().parse_args_and_config(
        [*argv, "--prompt_format", "text"], return_remaining_strings=True
    )
    assert script.prompt_column == "prompt"  # the default, until the preset fills it in

    with pytest.raises(UsageError, match=r"no column 'question' \(prompt_column\)"):  # the preset's own column
        _resolve_data(script, model, training, demo=False)
    # A local folder copy (train.jsonl, as `Dataset.to_json` writes it): the preset's Hub subset ("main") is not
    # its, where datasets said "BuilderConfig 'main' not found" for a name the user never gave.
    (tmp_path / "copy").mkdir()
    shutil.copy(jsonl_data, tmp_path / "copy" / "train.jsonl")
    argv = ["--model_name_or_path", "m", "--dataset_name", str(tmp_path / "copy"), "--dataset_preset", "gsm8k"]
    script, training, model, _, _ = _parser().parse_args_and_config(
        [*argv, "--prompt_format", "text"], return_remaining_strings=True
    )
    _, train, _, _ = _resolve_data(script, model, training, demo=False)
    assert script.dataset_config is None and len(train) == len(jsonl_data.read_text().splitlines())


def test_text_prompts_asked_of_chat_messages_are_refused(tmp_path):
    """`--prompt_format text` over a column of chat messages: they went through the chat template, whatever the flag
    said."""
    from trl_vapo.cli import _resolve_data

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n")
    argv = ["--model_name_or_path", "m", "--dataset_name", str(data), "--prompt_format", "text"]
    script, training, model, _, _ = _parser().parse_args_and_config(argv, return_remaining_strings=True)
    with pytest.raises(UsageError, match=r"--prompt_format text, but the 'prompt' column of .* holds chat messages"):
        _resolve_data(script, model, training, demo=False)


def test_a_yaml_list_key_given_one_value_without_brackets_is_a_list_of_it(tmp_path):
    """argparse leaves a YAML default as written: `reward_funcs: math_reward` was read as the names 'm', 'a', ..."""
    config = tmp_path / "run.yaml"
    config.write_text(
        "reward_funcs: math_reward\npositive_reward_funcs: math_reward\nreward_weights: 1.0\n"
        "lora_target_modules: all-linear\noutput_dir: out\n"
    )
    script, training, model, *_ = _parse_args_and_config(_parser(), ["--config", str(config)])
    assert script.reward_funcs == training.positive_reward_funcs == ["math_reward"]
    assert training.reward_weights == [1.0]
    assert model.lora_target_modules == "all-linear"  # a string peft reads as such: left alone
    # One module's name, on the command line or in a YAML list: TRL's ModelConfig unwraps it into the string, which
    # peft reads as a regular expression of the whole module path (matched nothing: "Target modules q_proj not
    # found"); a regular expression is left as it is.
    for flags, targets in (
        (["--lora_target_modules", "q_proj"], ["q_proj"]),
        (["--lora_target_modules", "self_attn.q_proj", "v_proj"], ["self_attn.q_proj", "v_proj"]),
        (["--lora_target_modules", ".*attn.(q|v)_proj"], ".*attn.(q|v)_proj"),
    ):
        _, _, model, *_ = _parse_args_and_config(_parser(), ["--output_dir", "out", *flags])
        assert model.lora_target_modules == targets, flags
    config.write_text("lora_target_modules: [q_proj]\noutput_dir: out\n")
    assert _parse_args_and_config(_parser(), ["--config", str(config)])[2].lora_target_modules == ["q_proj"]


def test_a_yaml_file_is_read_as_its_writer_meant(tmp_path, monkeypatch, capsys):
    """What YAML 1.1 reads otherwise than it reads: `1e-1` without a dot is text (a list's item reached
    `math.isfinite` unconverted: a TypeError's traceback), an unquoted `no` is false (transformers then refused False
    "is not a valid SaveStrategy ... 'no'"), a module named without brackets its letters (peft matched `l`, `m`, ...
    against the module names); and `~`, which no shell expands in a file (it reached `from_pretrained` as a Hub id)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "run.yaml"
    config.write_text(
        "reward_weights: [1e-1, 1]\nsave_strategy: no\neval_strategy: no\nlora_modules_to_save: lm_head\n"
        "model_name_or_path: ~/models/qwen\nvalue_model_name_or_path: ~/critic\noutput_dir: ~/out\n"
        "resume_from_checkpoint: ~/out/checkpoint-3\n"
    )
    script, training, model, *_ = _parse_args_and_config(_parser(), ["--config", str(config)])
    assert training.reward_weights == [0.1, 1]
    assert training.save_strategy == training.eval_strategy == "no"
    assert model.lora_modules_to_save == ["lm_head"]
    assert model.model_name_or_path == str(tmp_path / "models" / "qwen")
    assert script.value_model_name_or_path == str(tmp_path / "critic")
    assert training.resume_from_checkpoint == str(tmp_path / "out" / "checkpoint-3")
    config.write_text("reward_weights: [1e-1, one]\n")
    with pytest.raises(UsageError, match=r"^reward_weights must be a list of numbers, got \['1e-1', 'one'\]$"):
        _parse_args_and_config(_parser(), ["--config", str(config)])
    config.write_text("prompt_template: {question}\n")  # a mapping to YAML: a TypeError where str.format read it
    with pytest.raises(
        UsageError, match=r"^prompt_template must be text or None, got \{'question': None\} \(a dict\)"
    ):
        _parse_args_and_config(_parser(), ["--config", str(config)])
    config.write_text("eval_k: null\n")  # train's own held-out report: a TypeError where it compared None with 1
    with pytest.raises(UsageError, match=r"^eval_k must be a whole number, got None\.$"):
        _parse_args_and_config(_parser(), ["--config", str(config)])
    (tmp_path / "run").mkdir()  # eval's `--model ~/run` reads the run's settings there
    (tmp_path / "run" / RUN_DATA_FILE).write_text(json.dumps({"dataset_name": "problems.jsonl"}))
    assert _run_settings(["--model", "~/run"])[0]["dataset_name"] == "problems.jsonl"
    # Another data set named: the run's prompt formatting is not applied to it, and eval says so.
    (tmp_path / "run" / RUN_DATA_FILE).write_text(
        json.dumps({"dataset_name": "a.jsonl", "system_prompt": "Be brief."})
    )
    settings, _ = _run_settings(["--model", "~/run", "--dataset_name", "b.jsonl"])
    assert "system_prompt" not in settings
    assert "the run formatted its prompts with --system_prompt 'Be brief.', not applied" in capsys.readouterr().err
    # A checkpoint's folder read as the current one (`--model .`): its name ("") was no checkpoint's, and the run's
    # settings, one folder up, were not found.
    (tmp_path / "run" / "checkpoint-2").mkdir()
    monkeypatch.chdir(tmp_path / "run" / "checkpoint-2")
    assert _run_settings(["--model", "."])[0]["dataset_name"] == "a.jsonl"
    # A checkpoint saved from Python (its config, no data flags) beside an earlier `trl-vapo train`'s data flags in
    # the run folder: those describe another model, and eval took them as this one's.
    (tmp_path / "run" / "checkpoint-2" / RUN_CONFIG_FILE).write_text(json.dumps({"max_completion_length": 64}))
    assert _run_settings(["--model", "."])[0] == {"max_completion_length": 64}


def test_a_configs_env_block_is_set_before_the_hub_library_reads_its_environment(tmp_path):
    """huggingface_hub reads HF_HUB_OFFLINE (HF_HOME, HF_TOKEN, ...) once, when imported: TrlParser set the YAML's
    `env:` block as it parsed, after the parser's imports, so a one-process run went to the Hub it was told not to
    (here an unreachable one: "the Hub cannot be reached") where a launched one, whose processes start with the
    variables, ran offline. A real `trl-vapo train` process: what it imports first is what is tested."""
    config = tmp_path / "run.yaml"
    config.write_text(
        "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\nreport_to: none\noutput_dir: out\nenv:\n  HF_HUB_OFFLINE: 1\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "trl_vapo.cli", "train", "--config", str(config)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "and HF_HUB_OFFLINE is set: download it where the Hub is reachable" in run.stderr, run.stderr[-2000:]


def test_the_overlong_punishment_by_name_warns_where_it_cannot_penalise(caplog):
    """By name it is `trl grpo`'s, penalising beyond 1,024 tokens and giving -1 from 1,280: at 512 it gives 0 to
    everything; at 4,096 every completion past 1,280 tokens gets -1, right or wrong. Both are warned, 1,280 is not."""
    from trl_vapo.cli import _resolve_rewards

    cases = ((512, 0.0, "never reaches them"), (1152, -0.5, "gets -0.5, not -1"), (1280, -1.0, None))
    for length, reward, warning in (*cases, (4096, -1.0, "past 1,280")):
        caplog.clear()
        (punish,) = _resolve_rewards(["get_soft_overlong_punishment"], length)
        assert punish(completion_ids=[[1] * length]) == [reward]
        assert (warning in caplog.text) if warning else "get_soft_overlong_punishment" not in caplog.text


def test_accelerate_arguments_are_recognised_and_unknown_ones_are_not():
    assert _split_launch_args([]) == []
    assert _split_launch_args(["--num_processes", "2"]) == ["--num_processes", "2"]
    resolved = _split_launch_args(["--accelerate_config", "zero2", "--num_processes", "2"])
    assert resolved[0] == "--config_file" and resolved[1].endswith("zero2.yaml") and Path(resolved[1]).is_file()
    from trl_vapo.cli import UsageError

    with pytest.raises(UsageError, match="--not_a_flag"):
        _split_launch_args(["--not_a_flag", "3"])
    with pytest.raises(UsageError, match="FSDP version 1 is not supported; use --accelerate_config fsdp2"):
        _split_launch_args(["--accelerate_config", "fsdp1"])
    # `--accelerate_config=zero2` and the dashed spelling, as argparse takes every other flag (refused: "did you mean
    # --accelerator_config?", a transformers field that reads a JSON file); a flag's after the config's key (the
    # resolver read the config's alone, and the flag was refused as an unknown key of the config).
    for spelled in (["--accelerate_config=zero2"], ["--accelerate-config", "zero2"], ["--accelerate-config=zero2"]):
        assert _split_launch_args(spelled) == resolved[:2]
    assert _split_launch_args(["--accelerate_config", "zero3", "--accelerate_config", "zero2"]) == resolved[:2]
    # Resolved where it stands: after a config's `config_file: a.yaml`, the flag's file is the last, which the
    # launcher reads (TRL's resolver put it first, and the config's file was launched).
    assert _split_launch_args(["--config_file", "a.yaml", "--accelerate_config", "zero2"])[-2:] == resolved[:2]
    # FSDP1 refused only where it is the file launched (a config's, which a flag's fsdp2 replaces, was refused).
    fsdp1 = _split_launch_args(["--accelerate_config", "fsdp1", "--config_file", "fsdp2.yaml"])
    assert fsdp1[-2:] == ["--config_file", "fsdp2.yaml"]
    with pytest.raises(UsageError, match="Expected a value after `--accelerate_config`"):  # not "--multi_gpu"'s file
        _split_launch_args(["--accelerate_config", "--multi_gpu"])
    # A config's `multi_gpu: true` / `false` arrives as `--multi_gpu True` / `False`: accelerate took "True" for the
    # script to run.
    assert _split_launch_args(["--multi_gpu", "True", "--num_processes", "2"]) == [
        "--multi_gpu",
        "--num_processes",
        "2",
    ]
    assert _split_launch_args(["--multi_gpu", "False"]) == []
    # A config's unquoted `mixed_precision: no` (YAML 1.1's false) arrives as `--mixed_precision False`: "no".
    assert _split_launch_args(["--mixed_precision", "False", "--dynamo_backend", "False"]) == [
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]


def test_the_batch_checks_count_the_processes_a_command_launches(tiny_model_dir, jsonl_data, tmp_path, monkeypatch):
    """The command reads the config before it launches the others, as one process: 2 completions per device and 16
    per group, which 8 processes hold, were refused ("x 1 process(es)"); for 2 they are refused, naming 2. The count
    is the launcher's: `--num_processes`, else the accelerate config file's (`_relaunch` is replaced: this test is of
    the check before it)."""
    import trl_vapo.cli as cli

    launched = []
    monkeypatch.setattr(cli, "_relaunch", lambda launch_args, argv: launched.append(launch_args) or 0)
    common = ["train", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(jsonl_data)]
    common += ["--prompt_column", "question", "--report_to", "none", "--output_dir", str(tmp_path / "out")]
    common += ["--per_device_train_batch_size", "2", "--num_generations", "16"]
    assert main([*common, "--num_processes", "8"]) == 0 and launched == [["--num_processes", "8"]]
    with pytest.raises(cli.UsageError, match=r"per_device_train_batch_size 2 x 2 process\(es\)"):
        cli.train_command([*common[1:], "--num_processes", "2"])
    # The count an accelerate config file gives: TRL's `zero2` says 8 (it was checked for 1 process and refused), as
    # the run's YAML key too; a file of 2 is refused for 2.
    assert main([*common, "--accelerate_config", "zero2"]) == 0 and launched[-1][1].endswith("zero2.yaml")
    (tmp_path / "run.yaml").write_text("accelerate_config: zero2\n")
    assert main([*common, "--config", str(tmp_path / "run.yaml")]) == 0 and len(launched) == 3
    with pytest.raises(cli.UsageError, match=r"per_device_train_batch_size 2 x 1 process\(es\)"):
        cli.train_command([*common[1:], "--accelerate_config", "single_gpu"])  # distributed_type NO: one, not its 8
    (two := tmp_path / "two.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    with pytest.raises(cli.UsageError, match=r"per_device_train_batch_size 2 x 2 process\(es\)"):
        cli.train_command([*common[1:], "--config_file", str(two)])
    # A flag's file over the config's key, as the launcher reads the last one given (zero2's 8 were counted); of two
    # flags, the last.
    for last in (["--config", str(tmp_path / "run.yaml")], ["--accelerate_config", "zero2"]):
        with pytest.raises(cli.UsageError, match=r"per_device_train_batch_size 2 x 2 process\(es\)"):
            cli.train_command([*common[1:], *last, "--config_file", str(two)])
    # accelerate's default config (`accelerate config` writes it), which `accelerate launch` reads where no file is
    # named and `trl grpo` always launches with: without launcher arguments, the run trained in one process.
    import accelerate.commands.config

    default = tmp_path / "default_config.yaml"
    monkeypatch.setattr(accelerate.commands.config, "default_config_file", str(default))
    default.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\n")
    assert main(common) == 0 and launched[-1] == ["--config_file", str(default)]
    for one_process in ("distributed_type: 'NO'\nnum_processes: 8\n", "distributed_type: NO\n"):  # (a YAML false)
        default.write_text(one_process)
        with pytest.raises(cli.UsageError, match=r"per_device_train_batch_size 2 x 1 process\(es\)"):
            cli.train_command(common[1:])  # not launched, and checked for this one process
    assert len(launched) == 4
    from transformers import TrainingArguments

    from trl_vapo import VAPOConfig

    assert VAPOConfig.world_size is TrainingArguments.world_size  # as it was, after the check


def test_the_command_alone_prints_its_help_and_a_wrong_one_is_an_error(capsys):
    """`trl-vapo` alone printed argparse's "the following arguments are required" and exited 2, where `trl` alone
    prints its help and exits 0."""
    assert main([]) == 0
    assert "train: train (no arguments: the offline demo)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:
        main(["trian"])
    assert stopped.value.code == 2 and "invalid choice: 'trian'" in capsys.readouterr().err


def test_the_command_logs_at_info_without_each_hub_request(monkeypatch):
    """huggingface_hub's HTTP client logs every request at INFO (a cached file's lookup too): under the command's
    INFO logging, dozens of `HTTP Request: HEAD https://huggingface.co/...` lines before the first step. A level the
    user set is theirs."""
    import logging

    from trl_vapo.cli import _configure_logging

    for name, level in (("httpx2", logging.NOTSET), ("httpx", logging.DEBUG)):
        monkeypatch.setattr(logging.getLogger(name), "level", level)
    _configure_logging()
    assert logging.getLogger("httpx2").level == logging.WARNING and logging.getLogger("httpx").level == logging.DEBUG


def test_the_held_out_reports_description_names_the_runs_sampling_settings():
    """The report samples with the run's top_k, min_p and repetition_penalty (`_held_out_report`); the card said
    temperature 1.0 and top_p 1.0 alone. A checkpoint chosen on the report's split is said to be."""
    from types import SimpleNamespace

    from trl_vapo.cli import _model_card_info

    script = SimpleNamespace(dataset_name="d", dataset_config=None, dataset_test_split="test", eval_k=4)
    scores = {"avg@4": 0.5, "pass@1": 0.5, "num_problems": 8, "mean_length": 3.0}
    run = SimpleNamespace(top_k=50, min_p=None, repetition_penalty=1.1, trust_remote_code=True)
    described = _model_card_info(script, scores, scores, demo=False, args=run)["held_out"]["description"]
    assert "temperature 1.0 and top_p 1.0 with the run's top_k=50, repetition_penalty=1.1 for avg@k" in described
    assert "--num_prompts 8 --trust_remote_code true`" in described  # a model with its own code loads so only
    plain = SimpleNamespace(top_k=0, min_p=None, repetition_penalty=1.0, trust_remote_code=False)
    described = _model_card_info(script, scores, scores, demo=False, args=plain)["held_out"]["description"]
    assert "temperature 1.0 and top_p 1.0 for avg@k" in described and "--num_prompts 8`" in described
    assert "chosen" not in described
    # The checkpoint chosen by evaluations on the split the report draws its problems from: said so.
    chose = SimpleNamespace(**vars(plain), load_best_model_at_end=True, eval_strategy="steps")
    described = _model_card_info(script, scores, scores, demo=False, args=chose)["held_out"]["description"]
    assert described.endswith(
        "was chosen by evaluations on the same split (load_best_model_at_end), so the scores after it read high"
    )
    # The demo's evaluations during training read 64 other problems of its held-out split than the report's (they
    # were the report's first 64): a checkpoint chosen by them is not said to read high.
    from trl_vapo.cli import _resolve_data

    argv = ["--eval_strategy", "steps", "--eval_num_prompts", "100"]
    demo_script, training, model, _, _ = _parser().parse_args_and_config(argv, return_remaining_strings=True)
    _, _, during, report = _resolve_data(demo_script, model, training, demo=True)
    assert len(during) == 64 and len(report) == 100 and not set(during["prompt"]) & set(report["prompt"])
    from trl_vapo.demo.data import build_split

    assert report["prompt"] == build_split("held_out", 100)["prompt"]  # the report's problems as before
    described = _model_card_info(script, scores, scores, demo=True, args=chose)["held_out"]["description"]
    assert "chosen" not in described


def test_a_launch_leaves_no_mark_on_the_process_that_launched(monkeypatch):
    """The command a launch starts is marked (so that it does not launch again on reading the same config: the
    relaunch test's one-process run); the process that launched it is not, so that a later command in it (a
    notebook, a sweep) launches again."""
    from trl_vapo.cli import LAUNCHED, _relaunch

    monkeypatch.delenv(LAUNCHED, raising=False)
    code = _relaunch(["--num_processes", "1"], ["--no_such_flag"])  # the child's one-line error, exit status 2
    assert code == 2 and LAUNCHED not in os.environ


def test_an_eval_k_without_the_report_is_refused_unless_a_flag_turns_a_configs_report_off():
    """`--eval_num_prompts 0` turning a config's report off (its `eval_k: 8`) was refused as an `--eval_k` given
    without the report's prompts, asking to drop a flag the command did not have."""
    from types import SimpleNamespace

    from trl_vapo.cli import UsageError, _check_held_out_report

    config_with_k = SimpleNamespace(eval_num_prompts=0, eval_k=8)
    _check_held_out_report(config_with_k, demo=False, flags={"eval_num_prompts": "0"})
    refused = "--eval_k 8 sets the held-out report's samples per prompt"
    for flags in ({}, {"eval_k": "8"}, {"eval_k": "8", "eval_num_prompts": "0"}):  # the prompts forgotten, or both
        with pytest.raises(UsageError, match=refused):  # given at once: the eval_k is for nothing
            _check_held_out_report(config_with_k, demo=False, flags=flags)


def test_a_config_without_a_model_or_data_changes_the_demos_settings(tiny_model_dir, tmp_path, capsys):
    """`trl-vapo train --config tweaks.yaml` with neither a model nor data in it runs the offline demo with the file's
    settings over the demo's; it was refused, asking for a model it did not mention."""
    from trl_vapo.cli import DEMO_DEFAULTS, _demo_defaults, _is_demo

    tweaks = tmp_path / "tweaks.yaml"
    tweaks.write_text("max_steps: 32\n")
    assert _is_demo(["--config", str(tweaks)]) and _is_demo([f"--config={tweaks}"])
    parser = _parser()
    parser.set_defaults(**DEMO_DEFAULTS)
    _, training_args, *_ = _parse_args_and_config(parser, ["--config", str(tweaks)])
    assert (
        training_args.max_steps == 32 and training_args.critic_num_iterations == DEMO_DEFAULTS["critic_num_iterations"]
    )
    # A rollout's size in samples replaces the demo's in optimizer steps (both were set, and refused as disagreeing).
    parser = _parser()
    parser.set_defaults(**_demo_defaults(["--generation_batch_size", "128"]))
    _, training_args, *_ = _parse_args_and_config(parser, ["--generation_batch_size", "128"])
    assert (training_args.generation_batch_size, training_args.steps_per_generation) == (128, 8)
    # The demo's settings that another one given replaces, as outside the demo: another accumulation (refused: the
    # demo's steps_per_generation 4 is no multiple of 8), save_steps (the demo saved nothing), epochs (its max_steps).
    for given, expected in (
        (["--gradient_accumulation_steps", "8"], {"steps_per_generation": 8}),
        (["--save_steps", "20"], {"save_strategy": "steps", "save_steps": 20}),
        (["--num_train_epochs", "2"], {"max_steps": -1, "num_train_epochs": 2}),
        # (the demo's critic took 4 passes however many the policy took: refused, naming a field not given; and its
        # rate stayed the demo's whatever learning_rate said, where it follows it, 2x, outside the demo)
        (["--num_iterations", "8"], {"num_iterations": 8, "critic_num_iterations": 8}),
        (["--learning_rate", "1e-5"], {"learning_rate": 1e-5, "critic_learning_rate": 2e-5}),
    ):
        parser = _parser()
        parser.set_defaults(**_demo_defaults(given))
        _, training_args, *_ = _parse_args_and_config(parser, given)
        assert {name: getattr(training_args, name) for name in expected} == expected, given
        if "critic_num_iterations" not in expected:
            assert training_args.critic_num_iterations == DEMO_DEFAULTS["critic_num_iterations"]  # the others stay
    (tmp_path / "run.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nmax_steps: 32\n")
    assert not _is_demo(["--config", str(tmp_path / "run.yaml")])
    assert not _is_demo(["--config", str(tweaks), "--dataset_name", "data.jsonl"])
    assert not _is_demo(["--model-name-or-path", "Qwen/Qwen2.5-0.5B"])  # argparse's other spelling (was the demo)
    # A reward or value model alone is a run missing its policy, not the demo trained with that model (it was).
    (tmp_path / "rm.yaml").write_text("reward_model_name_or_path: my/reward-model\n")
    assert not _is_demo(["--config", str(tmp_path / "rm.yaml")])
    assert not _is_demo(["--value_model_name_or_path", "my/critic"])
    assert main(["train", "--config", str(tmp_path / "rm.yaml"), "--output_dir", str(tmp_path / "out")]) == 2
    assert "--model_name_or_path is required with a data set, a reward model" in capsys.readouterr().err
    # A model without data, said before a launch (each launched process said it, among the launcher's report).
    policy_only = ["train", "--model_name_or_path", str(tiny_model_dir), "--num_processes", "2"]
    assert main([*policy_only, "--output_dir", str(tmp_path / "out")]) == 2
    assert "--dataset_name (or --dataset_preset) is required with a model" in capsys.readouterr().err


def test_lora_settings_without_use_peft_are_refused_unless_it_is_said_false(tmp_path):
    """`--lora_r` without `--use_peft` trained every weight (`trl grpo` ignores it too): refused, at TRL's default
    too (a recipe's `lora_r: 16`). Not a setting off (`use_dora: false`), nor beside `--use_peft false` said
    outright: a saved adapter given as the model trains as it is (refused with --use_peft true), and a LoRA recipe's
    YAML then needed editing."""
    from trl import ModelConfig

    from trl_vapo.cli import UsageError, _check_peft_flags

    for r in ("8", "16"):
        with pytest.raises(UsageError, match="^--lora_r shapes a LoRA adapter, and --use_peft is not set"):
            _check_peft_flags(["--lora_r", r], ModelConfig(lora_r=int(r)))
    recipe = tmp_path / "lora.yaml"
    recipe.write_text("lora_alpha: 64\nuse_dora: false\n")
    with pytest.raises(UsageError, match="^--lora_alpha shapes"):  # (use_dora off: not named)
        _check_peft_flags(["--config", str(recipe)], ModelConfig(lora_alpha=64))
    _check_peft_flags(["--config", str(recipe), "--use_peft", "false"], ModelConfig(lora_alpha=64, use_peft=False))
    _check_peft_flags(["--use_dora", "false"], ModelConfig())
    _check_peft_flags(["--lora_r", "8", "--use_peft"], ModelConfig(lora_r=8, use_peft=True))


def test_train_two_steps_on_local_files_and_eval_the_result(tiny_model_dir, jsonl_data, tmp_path, capsys, monkeypatch):
    from trl_vapo import VAPOTrainer
    from trl_vapo.run_lock import live_holder

    out = tmp_path / "run"
    # The command holds its output_dir until the model is saved: a run started after train() returned took the
    # folder, and removed the model being saved as a stopped run's debris.
    held_while_saving = []
    save_model = VAPOTrainer.save_model

    def saving(self, *args, **kwargs):
        held_while_saving.append(live_holder(out))
        # The run's data flags are saved with its model, not at its start: a run in the folder of an earlier one
        # paired the new run's data with the old model (what eval scores) until the new model was saved.
        held_while_saving.append((out / RUN_DATA_FILE).exists())
        return save_model(self, *args, **kwargs)

    monkeypatch.setattr(VAPOTrainer, "save_model", saving)
    code = main(
        [
            "train",
            "--model_name_or_path",
            str(tiny_model_dir),
            "--dataset_name",
            str(jsonl_data),
            "--prompt_column",
            "question",
            "--prompt_format",
            "chat",
            "--system_prompt",
            "Be brief.",
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--value_pretrain_steps",
            "1",
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
            "--max_completion_length",
            "8",
            "--report_to",
            "none",
            "--logging_steps",
            "1",
            "--disable_tqdm",
            "true",
            "--dataset_test_split",
            "train",
            "--eval_num_prompts",
            "4",
            "--eval_k",
            "2",
        ]
    )
    assert code == 0
    assert [holder["pid"] for holder in held_while_saving[::2]] == [os.getpid()]
    assert held_while_saving[1::2] == [False]
    run_data = json.loads((out / RUN_DATA_FILE).read_text())
    assert run_data["prompt_column"] == "question" and run_data["system_prompt"] == "Be brief."
    assert json.loads((list_checkpoints(out)[-1] / RUN_DATA_FILE).read_text()) == run_data  # each checkpoint too
    assert run_data["working_dir"] == os.getcwd()
    printed = capsys.readouterr().out
    assert "trl-vapo summary" in printed and "held-out avg@2" in printed and str(out) in printed
    saved = AutoModelForCausalLM.from_pretrained(out).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert saved.keys() == initial.keys() and any(not saved[k].equal(initial[k]) for k in saved)  # the trained policy
    assert (out / "critic" / "config.json").is_file()

    # eval on the run's output scores as the run did without being told: its data (the 40 local prompts as chat
    # with its system prompt, not the demo's held-out problems), its completion length (8, not eval's 1024)
    capsys.readouterr()
    scores_file = tmp_path / "scores.json"
    code = main(["eval", "--model", str(out), "--k", "2", "--num_prompts", "50", "--output_json", str(scores_file)])
    assert code == 0
    told = capsys.readouterr().err
    assert f"the run's settings ({out / 'vapo_script_args.json'}, {out / 'vapo_config.json'})" in told
    assert "prompt_column='question'" in told and "system_prompt='Be brief.'" in told
    scores = json.loads(scores_file.read_text())
    assert set(scores) == {"pass@1", "avg@2", "pass@2", "num_problems", "mean_length", "settings"}
    assert scores["num_problems"] == 40 and 0 <= scores["avg@2"] <= scores["pass@2"] <= 1
    # What was scored and how, the run's settings taken among them (said on stderr alone, they were lost with it).
    settings = scores["settings"]
    assert settings["model"] == str(out) and settings["num_prompts"] == 40 and settings["k"] == 2
    assert settings["max_completion_length"] == 8 and settings["top_p"] == 0.7 and settings["pass@1"] == "greedy"
    assert settings["rewards"] == ["math_reward"] and settings["split"] == "train"  # (the run's: one file's split)
    assert settings["dtype"] == "float32"  # the checkpoint's own (the run's, loaded as TRL's ModelConfig loads)
    assert 1 <= scores["mean_length"] <= 8
    # A flag overrides the run's setting; so does a config (`--config=FILE`, its `model:` read for the run's too).
    main(["eval", "--model", str(out), "--k", "1", "--num_prompts", "3", "--max_new_tokens", "2", "--output_json",
          str(scores_file), "--dtype", "bfloat16"])  # fmt: skip
    scores = json.loads(scores_file.read_text())
    assert scores["num_problems"] == 3 and 1 <= scores["mean_length"] <= 2
    assert scores["settings"]["dtype"] == "bfloat16"  # (a GPU without bf16 asks for float16 so)
    config = tmp_path / "eval.yaml"
    config.write_text(f"model: {out}\nk: 1\nnum_prompts: 50\nmax_completion_length: 2\noutput_json: {scores_file}\n")
    assert main(["eval", f"--config={config}"]) == 0
    scores = json.loads(scores_file.read_text())
    assert scores["num_problems"] == 40 and 1 <= scores["mean_length"] <= 2  # the run's data, the config's length
    # Another data set named: none of the run's data settings (its `question` column, its system prompt) applies.
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(6)))
    capsys.readouterr()
    main(["eval", "--model", str(out), "--dataset_name", str(other), "--k", "1", "--output_json", str(scores_file)])
    assert json.loads(scores_file.read_text())["num_problems"] == 6
    told = capsys.readouterr().err
    taken = next(line for line in told.splitlines() if "unless given" in line)
    assert "prompt_column" not in taken and "system_prompt" not in taken and "max_completion_length=8" in taken
    assert "the run formatted its prompts with --system_prompt" in told  # and it says which it leaves out
    # A run without a held-out report, on one file: its "test" split read that file whole, and eval scored the
    # training prompts as held-out ones, without a word (`train` refuses it).
    data_file = out / "vapo_script_args.json"
    data_file.write_text(json.dumps({**json.loads(data_file.read_text()), "dataset_test_split": "test"}))
    assert main(["eval", "--model", str(out), "--k", "1", "--output_json", str(scores_file)]) == 2
    assert "(the run's data) is one file, so one split: its 'test' split would be the training prompts. Pass " in (
        capsys.readouterr().err
    )
    assert main(["eval", "--model", str(out), "--dataset_test_split", "train", "--k", "1", "--num_prompts", "2"]) == 0
    # A run that named its one split otherwise (and scored it as its held-out set, as told): eval took its own
    # default training split, "train", for the run's, and refused the run's own command.
    data_file.write_text(
        json.dumps({**json.loads(data_file.read_text()), "dataset_train_split": "rows", "dataset_test_split": "rows"})
    )
    assert main(["eval", "--model", str(out), "--k", "1", "--num_prompts", "2"]) == 0
    # A run's reward in a module of the folder it trained in (`--reward_funcs my_rewards.fn`), scored by eval run
    # from another folder: "No module named 'my_rewards'" (they resolve from the working directory, the run's too).
    project = tmp_path / "project"
    project.mkdir()
    (project / "rewards_of_the_project.py").write_text(
        "def has_digit(completions, **kwargs):  # (chat completions: a list of one message)\n"
        "    return [float(any(map(str.isdigit, c[0]['content']))) for c in completions]\n"
    )
    data_file.write_text(
        json.dumps({**json.loads(data_file.read_text()), "reward_funcs": ["rewards_of_the_project.has_digit"],
                    "working_dir": str(project)})
    )  # fmt: skip
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    code = main(["eval", "--model", str(out), "--k", "1", "--num_prompts", "2", "--output_json", str(scores_file)])
    assert code == 0
    assert json.loads(scores_file.read_text())["settings"]["rewards"] == ["rewards_of_the_project.has_digit"]


def test_eval_of_a_model_on_the_hub_reads_the_runs_settings_from_its_repository(tmp_path, monkeypatch):
    """The model card's `trl-vapo eval --model <this folder>` reads the run's data and sampling settings from two files
    beside the model; for a model on the Hub (they are pushed with it) they were never read, and eval scored the
    demo's problems with its own defaults. The Hub cannot be reached here: a stand-in `hf_hub_download`, with the
    real one's interface, serves a folder as the repository."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / RUN_DATA_FILE).write_text(json.dumps({"dataset_name": "me/problems", "prompt_column": "question"}))
    (repo / RUN_CONFIG_FILE).write_text(json.dumps({"max_completion_length": 8, "learning_rate": 1e-6}))

    def hf_hub_download(repo_id, filename, **kwargs):
        assert repo_id == "me/vapo", repo_id
        if not (repo / filename).is_file():
            raise EntryNotFoundError(f"{filename} is not in {repo_id}")
        return str(repo / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    settings, files = _run_settings(["--model", "me/vapo"])
    assert settings == {"max_completion_length": 8, "dataset_name": "me/problems", "prompt_column": "question"}
    assert files == [repo / RUN_DATA_FILE, repo / RUN_CONFIG_FILE]
    for name in (RUN_DATA_FILE, RUN_CONFIG_FILE):
        (repo / name).unlink()
    assert _run_settings(["--model", "me/vapo"]) == ({}, [])  # a model no trl-vapo run pushed


def test_an_adapter_on_the_hub_pushed_without_a_tokenizer_takes_its_base_models(tiny_model_dir, tmp_path, monkeypatch):
    """peft's `push_to_hub` uploads no tokenizer: for `--model_name_or_path me/lora` the tokenizer was looked up in the
    adapter's repository (an OSError once the policy had loaded); it is its base model's, as for a local folder saved
    so. The Hub cannot be reached here: a stand-in `hf_hub_download`, with the real one's interface, serves a folder
    as the repository."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    from trl_vapo.cli import _tokenizer_source
    from trl_vapo.loading import adapter_base_of

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))

    def hf_hub_download(repo_id, filename, **kwargs):
        if repo_id != "me/lora" or not (repo / filename).is_file():
            raise EntryNotFoundError(f"{filename} is not in {repo_id}")
        return str(repo / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    assert adapter_base_of("me/lora") == (str(tiny_model_dir), None)
    assert _tokenizer_source("me/lora", "--model_name_or_path") == (str(tiny_model_dir), None)
    assert adapter_base_of("me/model") is None  # no adapter
    (repo / "tokenizer_config.json").write_text("{}")
    assert adapter_base_of("me/lora") is None  # an adapter pushed with its tokenizer: that one


def test_the_tokenizer_of_an_adapter_on_the_hub_is_read_at_the_revision_the_run_names(
    tiny_model_dir, tmp_path, monkeypatch
):
    """`--model_revision v2` (or model_init_kwargs' `revision`) of an adapter repository: its base model was read from
    `main`'s adapter_config.json (where another base, or a full model with its tokenizer, may be), the policy from
    v2's; the tokenizer is v2's adapter's base's, at the base revision that adapter names. A stand-in
    `hf_hub_download` (the Hub cannot be reached here), with the real one's interface, serves a folder per revision."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    from trl_vapo.cli import _tokenizer_source
    from trl_vapo.config import VAPOConfig
    from trl_vapo.loading import adapter_base_of, policy_tokenizer

    branches = {"main": tmp_path / "main", "v2": tmp_path / "v2"}
    for folder in branches.values():
        folder.mkdir()
    (branches["main"] / "tokenizer_config.json").write_text("{}")  # main: pushed with a tokenizer
    (branches["main"] / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "other/base"}))
    v2 = {"base_model_name_or_path": str(tiny_model_dir), "revision": "b1"}
    (branches["v2"] / "adapter_config.json").write_text(json.dumps(v2))
    asked = []

    def hf_hub_download(repo_id, filename, *, revision=None, subfolder=None, cache_dir=None, token=None, **kwargs):
        asked.append((filename, revision))
        path = branches.get(revision or "main", tmp_path / "none") / (subfolder or "") / filename
        if repo_id != "me/lora" or not path.is_file():
            raise EntryNotFoundError(f"{filename} is not in {repo_id}@{revision}")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    assert adapter_base_of("me/lora") is None  # main's has its tokenizer
    assert adapter_base_of("me/lora", {"revision": "v2", "trust_remote_code": False}) == (str(tiny_model_dir), "b1")
    assert _tokenizer_source("me/lora", "--model_name_or_path", {"revision": "v2"}) == (str(tiny_model_dir), "b1")
    v3 = {"revision": "v3"}
    assert _tokenizer_source(str(tiny_model_dir), "--model_name_or_path", v3) == (str(tiny_model_dir), "v3")
    asked.clear()
    args = VAPOConfig(output_dir=str(tmp_path / "out"), report_to="none")
    assert policy_tokenizer("me/lora", "me/lora", args, {"revision": "v2"}).name_or_path == str(tiny_model_dir)
    assert ("adapter_config.json", "v2") in asked and ("adapter_config.json", "main") not in asked
    # The base's tokenizer is looked up with the run's other options too (a gated base's token, an offline cache),
    # at the base revision the adapter names and not in the adapter's subfolder (they were all dropped).
    from trl_vapo import loading

    real, seen = loading.AutoTokenizer.from_pretrained, []
    monkeypatch.setattr(
        loading.AutoTokenizer, "from_pretrained", lambda name, **kw: seen.append((name, kw)) or real(name)
    )
    options = {"revision": "v2", "token": "hf_x", "cache_dir": str(tmp_path / "cache")}
    policy_tokenizer("me/lora", "me/lora", args, options)
    assert seen[-1][0] == str(tiny_model_dir)
    assert {k: seen[-1][1].get(k) for k in ("revision", "token", "cache_dir")} == {**options, "revision": "b1"}


def test_the_command_finds_the_tokenizer_where_the_trainer_finds_the_policy(tiny_model_dir, tmp_path):
    """`trl-vapo train` hands the trainer a tokenizer (to refuse chat prompts without a template before any model
    loads), which it looked up with `--model_revision` alone: a policy loaded from model_init_kwargs' `subfolder`
    (or `cache_dir`, `token`) got the tokenizer of the repository's root, or an OSError where it has none. Now
    looked up as the trainer looks it up (`loading.policy_tokenizer`)."""
    import shutil
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from trl_vapo.cli import _tokenizer_of
    from trl_vapo.config import VAPOConfig

    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo / "sft")  # the model and its tokenizer in a subfolder; none at the root
    args = VAPOConfig(output_dir=str(tmp_path / "out"), report_to="none", model_init_kwargs={"subfolder": "sft"})
    tokenizer = _tokenizer_of(str(repo), SimpleNamespace(model_revision=None), args)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()
    # A value model that is the policy's checkpoint is read where the policy is (the trainer reads it there), and
    # checked there: at the root it was "a local folder but not a model's".
    from trl_vapo.cli import _check_before_loading

    script = SimpleNamespace(
        reward_funcs=["math_reward"], reward_model_name_or_path=None, value_model_name_or_path=str(repo)
    )
    model_args = SimpleNamespace(model_name_or_path=str(repo), model_revision=None)
    _check_before_loading(script, args, model_args, demo=False)
    # A pushed run's critic, `owner/name/critic` (the trainer reads it from the Hub's cache): found in the repository
    # `owner/name` at its folder, in the cache the models are looked up in; it was "no such folder".
    cache = tmp_path / "hub-cache"
    put_in_hub_cache(cache, "me/run", {"critic": tiny_model_dir})
    args.model_init_kwargs = {"subfolder": "sft", "cache_dir": str(cache)}
    script.value_model_name_or_path = "me/run/critic"
    _check_before_loading(script, args, model_args, demo=False)
    script.value_model_name_or_path = "me/run/critc"
    with pytest.raises(UsageError, match=r"me/run \(subfolder critc\) is not a local folder and not in the Hugging"):
        _check_before_loading(script, args, model_args, demo=False)


def test_eval_writes_a_score_nothing_was_judged_for_as_null():
    """`json.dumps` wrote NaN (no judged problem) as `NaN`, which strict JSON parsers (jq, JavaScript) refuse."""
    from trl_vapo.cli import scores_json

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    text = scores_json({"pass@1": math.nan, "avg@4": 0.5, "num_problems": 0})
    assert json.loads(text, parse_constant=refuse) == {"pass@1": None, "avg@4": 0.5, "num_problems": 0}


def test_eval_takes_a_python_runs_sampling_but_not_rewards_it_cannot_name(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """A run trained in Python saves its VAPOConfig (vapo_config.json) but not its reward functions: eval takes its
    length, and not its reward_weights or positive_reward_funcs, which count and name functions eval does not know
    (two weights for eval's one reward function were an error after the model loaded)."""
    import shutil

    out = tmp_path / "python-run"
    shutil.copytree(tiny_model_dir, out)
    saved = {"max_completion_length": 3, "reward_weights": [1.0, 0.5], "positive_reward_funcs": ["my_reward"]}
    (out / "vapo_config.json").write_text(json.dumps(saved))
    assert main(["eval", "--model", str(out), "--k", "1", "--num_prompts", "2"]) == 0
    told = capsys.readouterr().err
    assert "max_completion_length=3" in told and "reward_weights" not in told and "positive_reward_funcs" not in told
    # The run's other sampling settings and its prompt cut, as training sampled (they were left out).
    from trl_vapo import evaluation

    given, real = {}, evaluation.evaluate_policy

    def evaluate_policy(*args, **kwargs):  # the real evaluation, its settings kept
        given.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_policy", evaluate_policy)
    saved = {"max_prompt_length": 4, "top_k": 3, "min_p": 0.05, "repetition_penalty": 1.2}
    (out / "vapo_config.json").write_text(json.dumps(saved))
    assert main(["eval", "--model", str(out), "--k", "1", "--num_prompts", "2"]) == 0
    told = capsys.readouterr().err
    assert all(f"{key}={value}" in told for key, value in saved.items()), told
    assert {key: given[key] for key in saved} == saved  # and they reach the sampling


def test_evaluation_cuts_prompts_and_penalises_repeats_as_training():
    """`sample_completions` (eval's and the train command's reports) cuts each prompt to its last
    `max_prompt_length` tokens as training does, and applies `repetition_penalty` (greedy too: a processor): each
    as the engine samples the prompts cut, or with the penalty (below 1: repeats favoured), itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_vapo.data import prompt_token_ids
    from trl_vapo.demo import MODEL_DIR, data
    from trl_vapo.evaluation import sample_completions
    from trl_vapo.generation import EngineSettings, SamplingSettings, build_engine

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)  # the demo's: its sums read the whole prompt
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    tokenizer.padding_side = "left"
    prompts = [data.render_prompt((17, 25, 38, 46)), data.render_prompt((9, 8, 7))]
    engine = build_engine(EngineSettings("generate"), model, tokenizer)
    greedy = dict(temperature=0.0, max_new_tokens=6, engine=engine, return_ids=True)
    whole, _, _, _ = sample_completions(model, tokenizer, prompts, **greedy)
    cut, _, cut_ids, _ = sample_completions(model, tokenizer, prompts, max_prompt_length=3, **greedy)
    last_three = [ids[-3:] for ids in prompt_token_ids(tokenizer, prompts, False)]
    expected = engine.generate(last_three, sampling=SamplingSettings(6, 0.0)).completion_lists()
    assert cut_ids == expected and cut != whole
    penalised, _, penalised_ids, _ = sample_completions(model, tokenizer, prompts, repetition_penalty=0.05, **greedy)
    whole_ids = prompt_token_ids(tokenizer, prompts, False)
    penalising = SamplingSettings(6, 0.0, repetition_penalty=0.05)
    expected = engine.generate(whole_ids, sampling=penalising).completion_lists()
    assert penalised_ids == expected and penalised != whole
    # A length below one (VAPOConfig and the CLI refuse it) kept every prompt whole at 0 while warning each was cut,
    # and cut the first tokens at -2: refused.
    for limit in (0, -2):
        with pytest.raises(ValueError, match=f"max_prompt_length={limit}: a prompt keeps at least one token"):
            sample_completions(model, tokenizer, prompts, max_prompt_length=limit, **greedy)


def test_a_stop_during_the_held_out_report_after_training_keeps_the_trained_model(
    tiny_model_dir, jsonl_data, tmp_path, monkeypatch
):
    """The held-out report after training takes minutes at eval_k x eval_num_prompts: a Ctrl-C there (a SIGTERM's
    default action ends the process at once) lost the trained model, saved only after the report. It is saved first
    (policy, critic, card), and the card is written again with the report's scores when the report ends."""
    import torch

    from trl_vapo import cli

    reports, real = [], cli._held_out_report

    def report(*args, **kwargs):
        reports.append(len(reports))
        if len(reports) == 2:  # the report after training
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "_held_out_report", report)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        main(
            ["train", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(jsonl_data),
             "--prompt_column", "question", "--output_dir", str(out), "--max_steps", "1",
             "--value_pretrain_steps", "0", "--learning_rate", "1e-2", "--per_device_train_batch_size", "8",
             "--num_generations", "4",
             "--max_completion_length", "4", "--report_to", "none", "--disable_tqdm", "true",
             "--dataset_test_split", "train", "--eval_num_prompts", "2", "--eval_k", "1"]
        )  # fmt: skip
    assert reports == [0, 1]
    trained, initial = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(not torch.equal(p, initial.get_parameter(n)) for n, p in trained.named_parameters())
    assert (out / "critic" / "config.json").is_file() and (out / "README.md").is_file()


def run_cli(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([TRL_VAPO, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


BAD_INPUT = [
    (["--bogus_flag", "1"], "--bogus_flag"),
    (["--torch_dtype", "bfloat16"], "--torch_dtype (did you mean --dtype?)"),  # TRL's ModelConfig renamed it
    (["--prompt_column", "problem"], "'problem'"),
    (["--answer_column", "solution"], "'solution'"),
    (["--lam_actor", "1.5"], "lam_actor"),
    (["--reward_funcs", "no_such_reward"], "no_such_reward"),
    (["--dataset_preset", "aime"], "aime"),
    (["--deepspeed", '{"zero_optimization": {"stage": 2, "zenflow": {}}}'], "ZenFlow"),  # {}: on, with defaults
    # Accepted, trained: fp16's loss scale in the gradients VAPO clips; the config's clipping replaced by VAPO's.
    (["--deepspeed", '{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}}'], "turns on fp16"),
    (["--deepspeed", '{"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}'], "gradient_clipping=0.5 vs"),
    # Pickled weights: transformers' OSError, a traceback, where the message gives the flag that loads them.
    (["--model_name_or_path", "pickled"], "has pickled weights only (`pytorch_model.bin`) and you trust them, pass"),
    (["--model_name_or_path", "untokenized"], "--model_name_or_path untokenized: its tokenizer does not load: "),
    # An optimizer whose package is missing (not in the locked set): a traceback when train() built it.
    (["--optim", "stable_adamw"], "optim='stable_adamw' cannot be built here: You need to install `torch-optimi`"),
    # A skipped step's NaN gradients, which ZeRO-1/2 no longer found, stepped into the weights.
    (
        ["--bf16", "true", "--use_cpu", "true", "--deepspeed"]
        + ['{"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto", "check_grad_overflow": false}}'],
        "sets bf16.check_grad_overflow to false",
    ),
    (["--deepspeed", '{"zero_optimization": {"stage": 1, "compute_grad_norm": false}}'], "sets zero_optimization.com"),
    (["--eval_strategy", "steps"], "is one file, so one split: its 'test' split would be the training prompts"),
    # Issue 50's rows: each was accepted (and trained), or a traceback, or named another field.
    (["--learning_rate=-1e-5"], "learning_rate must be >= 0, got -1e-05."),
    (["--learning_rate", "0"], "critic_learning_rate must be > 0, got 0.0 (2 x learning_rate=0.0, its default)."),
    (["--config", "nope.yaml"], "nope.yaml: no such file (--config takes a YAML file's path)"),
    (["--use_vllm", "true"], "pip install vllm"),
    (["--dataset_name", "nope.jsonl"], "Dataset file nope.jsonl does not exist"),
    (["--model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct"], "Hugging Face cache, and HF_HUB_OFFLINE is set"),
    (["--dataset_name", "owner/nope"], "not a local file or folder (none in"),
    (["--learning_rat", "1e-3"], "--learning_rat (did you mean --learning_rate?)"),  # not taken as a prefix
    (["--config", "typo.yaml"], "the config's key 'learnin_rate' (did you mean 'learning_rate'?)"),
    # A YAML key is read by its field's name: the flag's hyphenated alias was offered as the fix of itself.
    (["--config", "hyphen.yaml"], "the config's key 'max-steps' (did you mean 'max_steps'?)"),
    (["--warmup_ratio", "0.1"], "--warmup_ratio (did you mean --warmup_steps?)"),  # transformers 5 folded it in
    (["--reward_funcs", "math_rewrd"], "(did you mean 'math_reward'?); expected one of math_reward, "),
    (["--reward_funcs", "x"], "think_format_reward"),  # TRL's rewards are in the list too
    (
        ["--steps_per_generation", "4", "--gradient_accumulation_steps", "3"],
        "Nearest valid: steps_per_generation=3 or 6; or gradient_accumulation_steps=2 or 4.",
    ),
    (  # the rollout's size set in completions: the error names that field, in its unit, not steps_per_generation
        ["--generation_batch_size", "6", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4"]
        + ["--num_generations", "2"],
        "generation_batch_size (6) must be a multiple of per_device_train_batch_size x processes x "
        "gradient_accumulation_steps (4): a rollout is split into whole optimizer steps, so that every step's token "
        "mean spans as many completions (GRPO lets a step span two rollouts). Nearest valid: generation_batch_size=4 "
        "or 8; or gradient_accumulation_steps=3 or 6.",
    ),
    *([] if _cuda_supports_bf16() else [(["--bf16", "true"], "bf16=True needs an accelerator with bf16")]),
    # A tracker transformers knows but this environment lacks (not in the locked set), and a misspelt one: both were
    # raised by the Trainer's callbacks, a traceback after the models had loaded.
    (["--report_to", "clearml"], "report_to names clearml, not installed here: `pip install clearml`, or set"),
    (["--report_to", "tensorbaord"], "report_to names 'tensorbaord', which transformers does not know: use one of"),
    # DeepSpeed's and FSDP's loss scalers are their own (one process's and DDP's fp16 trains: test_precision_...).
    (["--fp16", "true", "--deepspeed", '{"zero_optimization": {"stage": 2}}'], "fp16=True is supported on one"),
    # Each process's random state is written beside the main process's files: one output_dir for all (was ignored).
    (["--save_on_each_node", "true"], "save_on_each_node=True is not supported: checkpoints are written into"),
    (["--remove_unused_columns", "true"], "remove_unused_columns=True is not supported: the reward functions"),
    # A template's unescaped LaTeX brace or misspelt column: a bare IndexError or KeyError from inside datasets.map.
    (["--prompt_template", "{question} \\boxed{}"], "has a positional field {}: fields name columns (question, "),
    (["--prompt_template", "{qestion}"], "names {qestion}, which is no column; the columns are ['question', "),
    # argparse's own errors printed the usage of some 300 flags first; a YAML error or a folder was a traceback.
    (["--max_steps", "1e3"], "--max_steps/--max-steps: invalid int value: '1e3' (see `trl-vapo train --help`)"),
    (["--config", "broken.yaml"], 'is not valid YAML: while parsing a flow sequence in "broken.yaml", line 1'),
    # A YAML value argparse passes on unconverted (not a string): a TypeError's traceback, or an 8.0 taken as is.
    (["--config", "null.yaml"], "num_generations must be a whole number, got None."),
    (["--config", "float.yaml"], "num_generations must be a whole number, got 8.0 (a float)."),
    # A config's value argparse's choices do not check (the command line's only): refused later, naming another field.
    (["--config", "dtype.yaml"], "dtype: 'bf16' is not one of auto, bfloat16, float16, float32"),
    (["--lr_scheduler_type", "polynomial"], "constant, linear, cosine; got 'polynomial'."),  # not the enum's repr
    (["--lr_scheduler_type", "cosin"], "constant, linear, cosine; got 'cosin'."),  # not transformers' longer list
    (["--pad_to_multiple_of", "64.0"], "pad_to_multiple_of must be a whole number >= 1, 'auto' or None, got '64.0'."),
    (["--config", "."], ".: a folder (--config takes a YAML file's path)"),
    # An output_dir that is a file: transformers' FileExistsError once the models had loaded.
    (["--output_dir", "typo.yaml"], "output_dir typo.yaml is a file: name a folder (it holds the checkpoints"),
    (["--config"], "--config needs a YAML file's path"),  # was TRL's IndexError
    # A resume that cannot be was a traceback once the models had loaded (train() refused it).
    (["--resume_from_checkpoint", "latest"], "resume_from_checkpoint=True but no complete checkpoint in"),
    (["--resume_from_checkpoint", "gone/checkpoint-3"], "--resume_from_checkpoint gone/checkpoint-3: no such folder"),
    (["--resume_from_checkpoint", "."], ". is not a complete trl-vapo checkpoint (no vapo_state.json)"),
    # `false` turns a config's resume off (it was taken as a path): a fresh run, refused in a folder of checkpoints.
    (["--output_dir", "earlier", "--resume_from_checkpoint", "false"], "holds an earlier run's checkpoints"),
    # Each checkpoint's problem in the line itself ("see above" named nothing: the CLI's check does not warn).
    (
        ["--output_dir", "earlier", "--resume_from_checkpoint", "latest"],
        "no checkpoint in earlier can be read (checkpoint-1: missing trainer_state.json, scheduler.pt, optimizer.pt)",
    ),
    # What the trainer refuses before training (a traceback before): settings against the data and the rewards.
    # A Python dict's quotes: json's message named no field; a field read as a mapping later: an AttributeError.
    (["--model_init_kwargs", "{'dtype': 'bfloat16'}"], "model_init_kwargs is not JSON (Expecting property name"),
    (
        ["--transformers_continuous_batching_config", "max_batch_tokens=512"],
        "transformers_continuous_batching_config must be a dict or a JSON object, got 'max_batch_tokens=512'",
    ),
    (["--reward_weights", "1", "2"], "reward_weights has 2 values but there are 1 reward functions (a reward model"),
    # Names a function this run does not have: refused by the trainer, once the data had loaded (and a reward model).
    (["--positive_reward_funcs", "math_rewrd"], "names ['math_rewrd'], which are not reward functions here: they are"),
    (["--dataset_streaming", "true"], "is an IterableDataset (streaming), whose length is unknown: set max_steps"),
    # A reward model's LoRA task type: it trained, and saved an adapter AutoPeftModelForCausalLM refuses.
    (["--use_peft", "true", "--lora_task_type", "SEQ_CLS"], "peft_config has task_type='SEQ_CLS': the policy is"),
    # A folder that holds no model (a parent folder, a run's output_dir): transformers' traceback once data loaded.
    (["--reward_model_name_or_path", "."], "--reward_model_name_or_path . is a local folder but not a model's"),
    (["--value_model_name_or_path", "typo.yaml"], "--value_model_name_or_path typo.yaml is a file: name the model's"),
    # A value no flag takes was handed to `accelerate launch` as its script: python ran the YAML file.
    (["typo.yaml"], "unexpected argument 'typo.yaml' (did you mean --config typo.yaml?)"),
    (["--eval_strategy", "steps", "100"], "unexpected argument '100': every value follows its flag"),
    # The launcher's own errors: its usage (some 60 flags) and exit 2, or accelerate's traceback.
    (["--num_processes", "two"], "--num_processes/--num-processes: invalid int value: 'two' (see `accelerate launch"),
    # Checked before launching: each launched process failed on it, among the launcher's report of their failures.
    (["--num_processes", "2", "--reward_funcs", "no_such_reward"], "no_such_reward"),
    (["--num_processes", "2", "--dataset_preset", "aime"], "unknown --dataset_preset 'aime'; choose from"),
    (["--num_processes", "2", "--prompt_format", "json"], "--prompt_format must be auto, chat or text, got 'json'"),
    (["--num_processes", "2", "--config", "streamed.yaml"], "test_split_size cannot split a streamed mixture"),
    (["--num_processes", "2", "--resume_from_checkpoint", "gone/checkpoint-3"], "gone/checkpoint-3: no such folder"),
    (["--cpu", "true", "--multi_gpu", "true"], "accelerate launch: You can only use one of `--cpu`, `--multi_gpu`"),
    # The held-out report's numbers: a traceback once the model had loaded (an empty set to score).
    (["--eval_k", "0", "--eval_num_prompts", "2"], "--eval_k must be >= 1 (samples per held-out prompt), got 0"),
    (["--eval_num_prompts", "-1"], "--eval_num_prompts must be >= 0 (0: no held-out report), got -1"),
    # Ignored without a word: the report it shapes is off, and `load_dataset` reads one file whatever subset is named.
    (["--eval_k", "8"], "--eval_k 8 sets the held-out report's samples per prompt, and --eval_num_prompts 0 skips"),
    # A file a field names (transformers opens it as the config is built), not --config's: "(--config takes a YAML".
    (["--accelerator_config", "missing.json"], "missing.json: no such file, named by a setting that takes a file's"),
    (["--dataset_config", "main"], "--dataset_config 'main' names a configuration (subset) of a Hub data set or"),
    # TRL's mixture flags (in `--help`) without a mixture, and LoRA's without --use_peft: ignored, and trained.
    (["--streaming", "true"], "--streaming applies to a `datasets:` mixture in the --config file, and none is given"),
    (["--test_split_size", "0.1"], "use slices of a split (--dataset_train_split 'train[:90%]' --dataset_test_split"),
    (["--lora_r", "8", "--lora_alpha", "16"], "--lora_r, --lora_alpha shape a LoRA adapter, and --use_peft is not"),
]
# The same offline, without HF_HUB_OFFLINE: a Hub that cannot be reached (a closed port) is said at once, where the
# libraries would retry for a minute.
UNREACHABLE_HUB = [
    (["--model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct"], "not in the Hugging Face cache, and the Hub cannot be"),
    (["--dataset_name", "owner/nope"], "and the Hub cannot be reached (ConnectError"),
]

# Runs `trl-vapo train` once per case in one process: it imports what the command imports once, then forks one
# child per case, whose stdout and stderr go to that case's own files. What the imports print lands in this process's
# stderr, which every case counts with its own: the lines of each case are exactly those a separate `trl-vapo train`
# process would print, at one process start instead of one per case. (The offline cases' driver is forked from the
# tests' server, which imported all this already: the unreachable-hub cases, in a fresh interpreter, count the
# imports' output.)
_BAD_INPUT_DRIVER = """
import json, logging, os, sys
import trl_vapo  # first, as the `trl-vapo` command imports it (it quiets bitsandbytes' notice on CPUs)
import datasets, torch, transformers, trl  # noqa: F401
from accelerate.commands.launch import launch_command_parser  # noqa: F401
from trl_vapo import cli, config, data, rewards, trainer  # noqa: F401
from trl_vapo.cli import main
cases, out = json.loads(sys.argv[1]), sys.argv[2]
for i, args in enumerate(cases):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(f"{out}/{i}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        try:
            code = main(args)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    with open(f"{out}/{i}.code", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
"""


@pytest.fixture(scope="module")
def bad_input_runs(tiny_model_dir, jsonl_data, tmp_path_factory):
    from _script_process import run_code

    runs = {}
    for name, rows, hub in (
        ("offline", BAD_INPUT, {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}),
        ("unreachable", UNREACHABLE_HUB, {"HF_ENDPOINT": "http://127.0.0.1:9"}),
    ):
        out = tmp_path_factory.mktemp(f"bad-input-{name}")
        (out / "typo.yaml").write_text(f"model_name_or_path: {tiny_model_dir}\nlearnin_rate: 1.0e-4\n")
        (out / "hyphen.yaml").write_text(f"model_name_or_path: {tiny_model_dir}\nmax-steps: 2\n")
        (out / "broken.yaml").write_text("learning_rate: [1\nmax_steps: 2\n")
        (out / "null.yaml").write_text("num_generations: null\n")
        (out / "float.yaml").write_text("num_generations: 8.0\n")
        (out / "dtype.yaml").write_text("dtype: bf16\n")
        (out / "streamed.yaml").write_text("datasets:\n  - path: some/data\nstreaming: true\ntest_split_size: 0.1\n")
        (out / "earlier" / "checkpoint-1").mkdir(parents=True)
        (out / "earlier" / "checkpoint-1" / "vapo_state.json").write_text("{}")
        (out / "pickled").mkdir()  # a model saved as pickled weights alone: refused before they are read
        for saved in Path(tiny_model_dir).iterdir():
            if saved.suffix != ".safetensors":
                (out / "pickled" / saved.name).write_bytes(saved.read_bytes())
        (out / "pickled" / "pytorch_model.bin").write_bytes(b"never unpickled")
        (out / "untokenized").mkdir()  # a model saved without its tokenizer
        (out / "untokenized" / "config.json").write_bytes((Path(tiny_model_dir) / "config.json").read_bytes())
        common = ["train", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(jsonl_data)]
        common += ["--prompt_column", "question", "--report_to", "none"]
        cases = [[*common, "--output_dir", str(out / f"run{i}"), *args] for i, (args, _) in enumerate(rows)]
        if name == "offline":  # forked from the tests' server, offline as they are (conftest.py): no fresh imports
            driver = run_code(_BAD_INPUT_DRIVER, json.dumps(cases), str(out), cwd=out)
        else:  # a fresh interpreter: the hub's settings are read at import, and what the imports print is counted
            env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
            env.update(hub, OMP_NUM_THREADS="1")
            driver = subprocess.run(
                [sys.executable, "-c", _BAD_INPUT_DRIVER, json.dumps(cases), str(out)],
                capture_output=True,
                text=True,
                cwd=out,
                env=env,
                timeout=300,
            )
        assert driver.returncode == 0, driver.stderr[-3000:]
        runs[name] = out, driver.stderr
    return runs


@pytest.mark.parametrize(
    "rows, case",
    [("offline", i) for i in range(len(BAD_INPUT))] + [("unreachable", i) for i in range(len(UNREACHABLE_HUB))],
    ids=[" ".join(a) for a, _ in BAD_INPUT] + [f"unreachable {' '.join(a)}" for a, _ in UNREACHABLE_HUB],
)
def test_bad_input_is_a_one_line_error_naming_it(bad_input_runs, rows, case):
    out, imports_output = bad_input_runs[rows]
    args, needle = (BAD_INPUT if rows == "offline" else UNREACHABLE_HUB)[case]
    stderr = imports_output + (out / f"{case}.stderr").read_text()
    assert int((out / f"{case}.code").read_text()) == 2, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("trl-vapo train: error:") and needle in lines[0]
    if args[0] in ("--prompt_column", "--answer_column"):  # a column flag's error
        assert "question" in lines[0] and "answer" in lines[0]  # lists the columns present


@pytest.mark.parametrize("granted", [False, True])
def test_a_gated_model_without_access_is_named_before_anything_loads(tmp_path, monkeypatch, granted):
    """The Hub gives a gated repository's metadata to anyone and its files only to those granted access: the check
    asked for the metadata alone, so a gated model one had not been granted passed it, and failed as transformers
    downloaded it. The Hub is stood in for by an HTTP transport that answers as it does (huggingface_hub's own
    client and error mapping run)."""
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils._http import default_client_factory

    from trl_vapo.cli import UsageError, _check_model_source

    asked = []

    def hub(request):
        asked.append(request.url.path)
        if request.url.path.endswith("/auth-check") and not granted:
            headers = {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model org/gated is restricted."}
            return httpx2.Response(403, headers=headers, request=request)
        return httpx2.Response(200, json={"id": "org/gated", "gated": "manual", "private": False}, request=request)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # not in the cache
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(hub)))
    try:
        if granted:
            _check_model_source("org/gated", "--model_name_or_path")
        else:
            with pytest.raises(UsageError, match="--model_name_or_path org/gated is gated: accept its terms"):
                _check_model_source("org/gated", "--model_name_or_path")
    finally:
        huggingface_hub.set_client_factory(default_client_factory)
    assert asked == ["/api/models/org/gated", "/api/models/org/gated/auth-check"]


def test_the_model_source_check_looks_where_the_model_loads_from(tmp_path, monkeypatch, tiny_model_dir):
    """model_init_kwargs' `subfolder`, `cache_dir` and `token` say where transformers finds a model: the check looked
    elsewhere, and refused models that load (a local repository's subfolder, a model in the user's own cache while
    offline) or asked the Hub without the token (a private model read as missing). The Hub is stood in for by an HTTP
    transport (huggingface_hub's own client runs)."""
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils._http import default_client_factory

    from trl_vapo.cli import UsageError, _check_model_source

    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo / "sft")
    with pytest.raises(UsageError, match=r"repo is a local folder but not a model's"):
        _check_model_source(str(repo), "--model_name_or_path")
    _check_model_source(str(repo), "--model_name_or_path", where={"subfolder": "sft"})
    with pytest.raises(UsageError, match=r"repo has no folder rl \(model_init_kwargs' subfolder\)$"):
        _check_model_source(str(repo), "--model_name_or_path", where={"subfolder": "rl"})
    # A model in a cache of the user's own (`cache_dir`), offline: in the cache, where the default one lacks it.
    snapshot = tmp_path / "cache" / "models--org--private" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "cache" / "models--org--private" / "refs").mkdir()
    (tmp_path / "cache" / "models--org--private" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        _check_model_source("org/private", "--model_name_or_path")
    _check_model_source("org/private", "--model_name_or_path", where={"cache_dir": str(tmp_path / "cache")})
    # Online, a private model is found with the token it loads with.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)

    def hub(request):
        if request.headers.get("authorization") != "Bearer hf_mine":
            headers = {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
            return httpx2.Response(404, headers=headers, request=request)
        return httpx2.Response(200, json={"id": "org/private", "private": True}, request=request)

    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(hub)))
    try:
        with pytest.raises(UsageError, match="no such model on the Hub"):
            _check_model_source("org/private", "--model_name_or_path")
        _check_model_source("org/private", "--model_name_or_path", where={"token": "hf_mine"})
    finally:
        huggingface_hub.set_client_factory(default_client_factory)


def test_help_tells_every_runs_defaults_and_each_commands_own_flags(capsys):
    """`train --help` shows VAPOConfig's defaults (the paper's learning rate), not the demo's, and names what the demo
    changes and the launcher's flags; `eval --help` lists no flag eval does not read, and refuses one given."""
    from trl_vapo.cli import DEMO_DEFAULTS, TRAIN_ONLY

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines wherever the terminal ends
    assert "Paper: 1e-6. (default: 1e-06)" in text and "(default: 480)" not in text
    demo = text.split("The demo changes these:")[1]
    assert all(f"{key}=" in demo for key in DEMO_DEFAULTS) and "learning_rate=0.0001" in demo
    assert all(flag in text for flag in ("--config FILE.yaml", "--num_processes", "--accelerate_config zero1"))
    # An example to paste in single quotes: one backslash (two made every prompt read `\\boxed{}`).
    assert "e.g. '{question} Answer in \\boxed{{}}.'" in text and "Omit with the model too for the offline" in text
    # What the command does with it (transformers' help said it was not used by the Trainer).
    assert "`latest` (or `true`): the newest readable one in output_dir; `auto`:" in text
    assert "but the schedule-free ones, LOMO and AdaLomo, GaLore and APOLLO, and torchao's low-bit AdamW" in text

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    said = " ".join(text.split())
    assert "Omitted: the run's own (its settings, saved beside --model), else the offline demo's held-out" in said
    assert "Omit with the model too" not in said  # training's: eval's --model is required
    listed = set(re.findall(r"^  --(\w+)", text, flags=re.MULTILINE))
    assert "dataset_test_split" in listed and not listed & TRAIN_ONLY
    assert main(["eval", "--model", "m", "--value_model_name_or_path", "c"]) == 2
    assert "--value_model_name_or_path: a `trl-vapo train` flag" in capsys.readouterr().err


def test_offline_demo_in_reduced_mode_learns(tmp_path, capsys):
    """`trl-vapo train` with no model and no data: the bundled model on the built-in task, shortened for CI."""
    out = tmp_path / "demo"
    code = main(
        [
            "train",
            "--output_dir",
            str(out),
            # The optimizer steps are most of its time (a value-pretraining rollout's 4 cost about what 4 RL steps
            # do): one pretraining rollout, then 3 RL rollouts of 4 policy-and-critic and 12 critic-only steps each
            # (held-out avg@2 0.42 -> 0.80 on 64 prompts on a 2-core runner, 2026-11-30; with 5 and 4 rollouts: 0.81,
            # 7 s longer).
            # The report on 32 prompts (its two passes were 5 s of 64; the gap it checks is 0.1).
            "--value_pretrain_steps",
            "1",
            "--max_steps",
            "48",
            "--eval_num_prompts",
            "32",
            "--eval_k",
            "2",
            "--disable_tqdm",
            "true",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "trl-vapo demo summary" in printed
    line = next(line for line in printed.splitlines() if line.startswith("held-out avg@2"))
    before, after = (float(x) for x in line.split()[2:5:2])
    assert after > before + 0.1, line
    assert (out / "model.safetensors").is_file() and (out / "critic" / "model.safetensors").is_file()
    assert (out / "value_pretrained_critic" / "vapo_value_pretraining.json").is_file()
    # Its card says how to score it again (TrlParser's empty mixture had every run read as one: a split no eval
    # could draw, and `trl-vapo eval --model <demo>` refused).
    card = (out / "README.md").read_text()
    assert "32 problems of the demo's held-out split" in card and "trl-vapo eval --model <this folder>" in card
    assert "mixture" not in card and json.loads((out / "vapo_script_args.json").read_text())["mixture"] is False
    # The demo draws its diagnostic plots (`trl-vapo plot` redraws them from the logs: test_diagnostics.py).
    plots = out / "plots"
    assert {p.name for p in plots.glob("*.png")} == {"training_curves.png", "position_profiles.png"}


# A process that forwards its signals as `trl-vapo train --num_processes 1` does around `accelerate launch`: first with
# a child running (the child gets the SIGTERM, this process lives on), then with none (SIGTERM ends it as usual).
FORWARDER = """
import subprocess, sys, time
from trl_vapo.cli import _forward_signals_to_children
_forward_signals_to_children()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("child", child.pid, flush=True)
print("child exited", child.wait(), flush=True)
print("no child", flush=True)
time.sleep(60)
print("survived", flush=True)
"""


def test_signals_reach_the_launched_child_and_act_as_usual_before_there_is_one():
    """The relaunching process's SIGTERM handler: with a child (the run `accelerate launch` started) it passes the
    signal on, so the child stops as it would alone and the launcher lives to report its exit code; with no child
    yet it puts the previous handler back and raises the signal again: the process ends by SIGTERM, as it would have
    without the handler (a stop before the run starts is not swallowed)."""
    proc = subprocess.Popen([sys.executable, "-c", FORWARDER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("child ")
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == f"child exited {-signal.SIGTERM}"
        assert proc.stdout.readline().strip() == "no child"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert "survived" not in proc.stdout.read()
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("processes", "stop"), [(2, signal.SIGUSR1), (1, signal.SIGTERM)], ids=["2-SIGUSR1", "1-SIGTERM"]
)
def test_accelerate_arguments_relaunch_the_run_and_a_stop_signal_ends_it_with_a_checkpoint(
    tiny_model_dir, jsonl_data, tmp_path, processes, stop
):
    """`--num_processes 2` goes to `accelerate launch` (with `--multi_gpu`, which on a CPU-only machine starts two
    gloo processes); the training flags reach the relaunched command intact. A stop signal to every process of the
    job, as `scancel --signal=USR1` (or Slurm's advance warning, `--signal=USR1@600`) sends it, reaches each worker
    twice (itself, then forwarded by the launcher, which died of SIGUSR1 before, leaving its workers running): the
    run still finishes its rollout, writes a checkpoint at the last step it logged and exits with 128 + the signal,
    not killed by the repeat; the launcher gives its workers `WORKERS_STOP_GRACE` to stop, not 30 s. With one process,
    SIGTERM to the launcher alone (`kill PID`, a container stop) is forwarded to the run it started."""
    from trl_vapo.cli import WORKERS_STOP_GRACE

    out = tmp_path / "two"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    flags = {
        "--model_name_or_path": tiny_model_dir,
        "--dataset_name": jsonl_data,
        "--prompt_column": "question",
        "--output_dir": out,
        "--max_steps": 200,
        "--value_pretrain_steps": 1,
        "--per_device_train_batch_size": 4,
        "--num_generations": 4,
        "--max_completion_length": 6,
        "--logging_steps": 1,
        "--save_strategy": "steps",
        "--save_steps": 1000,  # the signal's checkpoint is the only one
        "--report_to": "none",
        "--disable_tqdm": "true",
    }
    # Launch settings in a config: the launched command reads them again and must not launch once more (one process:
    # accelerate's launcher sets no LOCAL_RANK, and the command relaunched itself without end); `multi_gpu: true`
    # reaches accelerate as the flag (it was `--multi_gpu True`, "True" taken for the script to run).
    launch = tmp_path / "launch.yaml"
    launch.write_text(f"num_processes: {processes}\n" if processes == 1 else "multi_gpu: true\n")
    flags["--config"] = launch
    command = [TRL_VAPO, "train", *(str(x) for item in flags.items() for x in item)]
    command += ["--num_processes", str(processes)] if processes > 1 else []
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = out / "vapo_logs.jsonl"
    deadline = time.time() + 240
    while (not log.exists() or '"phase"' not in log.read_text()) and time.time() < deadline:  # training has begun
        time.sleep(0.05)
    from trl_vapo.run_lock import live_holder

    # The run trains in the process accelerate launched, not in the command's own (so the signal was forwarded).
    holder = live_holder(out)
    assert holder and holder["pid"] != process.pid, holder
    if processes > 1:
        worker = Path(f"/proc/{holder['pid']}/environ").read_bytes().split(b"\0")
        assert f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={WORKERS_STOP_GRACE}".encode() in worker
        os.killpg(process.pid, stop)
    else:
        process.send_signal(stop)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + stop, stderr[-3000:]
    stopped = re.search(rf"Stopped by {stop.name} at step (\d+): (\S+) holds every step so far", stderr)
    assert stopped, stderr[-3000:]
    checkpoint = Path(stopped[2])
    assert list_checkpoints(out) == [checkpoint] == [out / f"checkpoint-{stopped[1]}"]
    logged = [json.loads(line)["step"] for line in log.read_text().splitlines() if '"phase"' in line]
    assert int(stopped[1]) == max(logged)  # nothing trained is lost
    assert sorted(p.name for p in checkpoint.glob("training_state/rng_state_*")) == [
        f"rng_state_{rank}.safetensors" for rank in range(processes)
    ]
    state = json.loads((checkpoint / "vapo_state.json").read_text())
    assert state["run"]["num_processes"] == processes and state["run"]["generation_batch_size"] == 4 * processes


EXAMPLES = sorted((Path(__file__).parent.parent / "examples").rglob("*.yaml"))  # trl_grpo/: `trl grpo` configs


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_parses_into_valid_settings(example):
    """The examples use only fields that exist and values VAPOConfig accepts, on this machine without a GPU as on
    one (bf16 is left to its default: on where the GPU supports it), and no deprecated name; the models and data sets
    they name are not loaded."""
    from trl_vapo.cli import _parser

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # `gradient_checkpointing`: use `activation_checkpointing`
        script, config, model, _ = _parser().parse_args_and_config(["--config", str(example)])
    assert model.model_name_or_path and (script.dataset_name or script.dataset_preset)
    assert config.activation_checkpointing and config.bf16 == _cuda_supports_bf16()
    if model.load_in_4bit:
        assert model.use_peft  # QLoRA trains adapters


def test_the_python_example_builds_valid_settings():
    """`examples/train_gsm8k_lora.py`'s `VAPOConfig(...)` as written (the script itself loads GSM8K and a model)."""
    import ast

    from trl_vapo import VAPOConfig

    source = (Path(__file__).parent.parent / "examples" / "train_gsm8k_lora.py").read_text()
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "VAPOConfig"
    ]
    assert len(calls) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = eval(compile(ast.Expression(calls[0]), "train_gsm8k_lora.py", "eval"), {"VAPOConfig": VAPOConfig})
    assert config.activation_checkpointing and config.value_pretrain_steps == 50


# ---------------------------------------------------------------------------------------------------------------------
# Coming from `trl grpo`: its script with the import swapped, and its YAML config, run unchanged
# ---------------------------------------------------------------------------------------------------------------------
GRPO_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo" / "grpo.py"


def test_the_grpo_example_is_trls_script_with_only_the_imports_swapped():
    import difflib

    import trl.scripts.grpo

    ours = GRPO_EXAMPLE.read_text().splitlines()
    ours = ours[next(i for i, line in enumerate(ours) if line.startswith("# Copyright")) :]  # after our header
    changed = [
        line
        for line in difflib.unified_diff(Path(trl.scripts.grpo.__file__).read_text().splitlines(), ours, lineterm="")
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed == [
        "-    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config",
        "+    from trl import get_dataset, get_peft_config, get_quantization_config",
        "+    from trl_vapo import VAPOTrainer as GRPOTrainer  # trl-vapo: the one changed import",
        "-    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser",
        "+    from trl import DatasetMixtureConfig, ModelConfig, TrlParser",
        "+    from trl_vapo import VAPOConfig as GRPOConfig  # trl-vapo: the one changed import",
    ]


def test_trls_script_sits_with_the_configs_it_reads_and_every_config_names_its_command():
    """TRL's script does not know trl-vapo's reward names and data presets: given `examples/gsm8k_lora.yaml` it ended
    in a traceback. Its folder holds `trl grpo` configs only, each of whose keys its parser takes (TRL's parser ignores
    unknown keys where the script calls it) and whose rewards its registry or an import path names; every config
    says in its first lines which command runs it."""
    import runpy

    script = runpy.run_path(str(GRPO_EXAMPLE))  # its functions, without running it
    registry = {"accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"}
    trl_configs = sorted(GRPO_EXAMPLE.parent.glob("*.yaml"))
    assert trl_configs and all(p.parent == GRPO_EXAMPLE.parent for p in trl_configs)
    for path in trl_configs:
        args = script["make_parser"]().parse_args_and_config(["--config", str(path)], fail_with_unknown_args=True)
        assert all(name in registry or "." in name for name in args[0].reward_funcs), path
        assert args[0].dataset_name or args[3].datasets, path
        head = path.read_text()[:600]
        assert f"python examples/trl_grpo/grpo.py --config examples/trl_grpo/{path.name}" in head, path
        assert f"trl-vapo train --config examples/trl_grpo/{path.name}" in head, path
    for path in EXAMPLES:
        if path.parent != GRPO_EXAMPLE.parent:
            assert f"trl-vapo train --config examples/{path.name}" in "".join(path.read_text().splitlines()[:2]), path


@pytest.fixture(scope="module")
def grpo_data(tmp_path_factory):
    """A local data folder as `trl grpo` reads one: chat prompts and a `solution` column (TRL's accuracy_reward)."""
    folder = tmp_path_factory.mktemp("grpo-data")
    for split, numbers in (("train", range(32)), ("test", range(100, 106))):
        with (folder / f"{split}.jsonl").open("w") as f:
            for i in numbers:
                row = {"prompt": [{"role": "user", "content": f"{i}+{i}="}], "solution": str(2 * i)}
                f.write(json.dumps(row) + "\n")
    return folder


def grpo_yaml(path: Path, output_dir: Path, model_dir, reward_model_dir, data: str) -> Path:
    """A `trl grpo` config (GRPOConfig's own values: loss_type dapo, scale_rewards group, beta 0), with LoRA, a
    reward model, TRL's accuracy_reward and evaluation on the test split; then VAPO's own fields."""
    path.write_text(
        f"model_name_or_path: {model_dir}\n{data}"
        f"reward_model_name_or_path: {reward_model_dir}\n"
        "reward_funcs: [accuracy_reward]\n"
        f"output_dir: {output_dir}\n"
        "per_device_train_batch_size: 8\n"
        "num_generations: 4\n"
        "max_completion_length: 8\n"
        "max_steps: 2\n"
        "learning_rate: 1.0e-3\n"
        "loss_type: dapo\n"
        "scale_rewards: group\n"
        "beta: 0.0\n"
        "eval_strategy: steps\n"
        "eval_steps: 1\n"
        "per_device_eval_batch_size: 4\n"
        "num_generations_eval: 2\n"
        "logging_steps: 1\n"
        "save_strategy: 'no'\n"
        "report_to: none\n"
        "use_peft: true\n"
        "lora_r: 4\n"
        "lora_alpha: 8\n"
        "lora_target_modules: [q_proj, v_proj]\n"
        "# VAPO's own\n"
        "value_pretrain_steps: 0\n"
    )
    return path


def assert_trained_lora_with_evaluations(output_dir: Path, reward_model_name: str, evaluations: int) -> None:
    from peft import AutoPeftModelForCausalLM

    assert (output_dir / "adapter_config.json").is_file()
    reloaded = AutoPeftModelForCausalLM.from_pretrained(output_dir)  # the saved adapter reloads, trained (B was 0)
    assert any(p.abs().sum() > 0 for name, p in reloaded.named_parameters() if "lora_B" in name)
    logs = [json.loads(line) for line in (output_dir / "vapo_logs.jsonl").read_text().splitlines()]
    evaluated = [h for h in logs if "eval_loss" in h]
    assert len(evaluated) == evaluations
    for h in evaluated:
        assert -1 <= h["eval_rewards/accuracy_reward/mean"] <= 1
        assert math.isfinite(h[f"eval_rewards/{reward_model_name}/mean"])


def test_trls_grpo_script_with_the_import_swapped_trains_lora_evaluates_and_reloads(
    tiny_model_dir, reward_model_dir, grpo_data, tmp_path, monkeypatch, capsys
):
    """`python examples/trl_grpo/grpo.py --config grpo.yaml`, run in this process (`runpy`, as `python` runs it)."""
    import runpy

    out = tmp_path / "grpo-script"
    config = grpo_yaml(tmp_path / "grpo.yaml", out, tiny_model_dir, reward_model_dir, f"dataset_name: {grpo_data}\n")
    monkeypatch.setattr(sys, "argv", [str(GRPO_EXAMPLE), "--config", str(config)])
    runpy.run_path(str(GRPO_EXAMPLE), run_name="__main__")
    printed = capsys.readouterr().out
    assert "Training completed" in printed and f"Model saved to {out}" in printed
    assert_trained_lora_with_evaluations(out, reward_model_dir.name, evaluations=2)


def test_a_trl_grpo_config_with_a_dataset_mixture_runs_with_trl_vapo_train(
    tiny_model_dir, reward_model_dir, grpo_data, tmp_path, capsys, monkeypatch
):
    """The same config, its data as a `datasets` mixture with a test split cut off (TRL's DatasetMixtureConfig), run by
    `trl-vapo train --config`; the held-out report also scores with the reward model. A `dataset_name` beside the
    mixture is not trained on (TRL's `trl grpo` says so and uses the mixture): the card named it as the run's data,
    and eval scored it as the run's."""
    out = tmp_path / "trl-vapo"
    mixture = f"dataset_name: org/other\ndatasets:\n  - path: {grpo_data}\n    split: train\ntest_split_size: 0.25\n"
    config = grpo_yaml(tmp_path / "grpo.yaml", out, tiny_model_dir, reward_model_dir, mixture)
    # A flag that formats --dataset_name's rows would be ignored: refused, before any data loads.
    assert main(["train", f"--config={config}", "--prompt_column", "question"]) == 2
    assert "--prompt_column format(s) --dataset_name's rows" in capsys.readouterr().err
    import trl_vapo.cli as cli
    from trl_vapo.scoring import reward_func_name

    scored_by, report = [], cli._held_out_report  # the reward functions of each report, before and after training
    monkeypatch.setattr(
        cli, "_held_out_report", lambda *a: scored_by.append(sorted(map(reward_func_name, a[3]))) or report(*a)
    )
    assert main(["train", f"--config={config}", "--eval_num_prompts", "2", "--eval_k", "1"]) == 0  # `=`: one flag
    assert_trained_lora_with_evaluations(out, reward_model_dir.name, evaluations=2)
    # The held-out report, on the mixture's test split, scored by the training rewards (the reward model among them).
    assert len(scored_by) == 2 and all(reward_model_dir.name in names and len(names) > 1 for names in scored_by)
    assert re.search(
        r"held-out avg@1 +\d\.\d{3} -> \d\.\d{3} +\(sampled at T=1, 2 problems\)", capsys.readouterr().out
    )
    # Its card says where the held-out problems came from, which eval cannot draw again; eval reads a run's data
    # set, but a mixture is not one: it asks for the one to score (not the demo's problems).
    card = (out / "README.md").read_text()
    assert "problems of the data set mixture's test split" in card and "cannot draw again" in card
    assert "org/other" not in card
    assert main(["eval", "--model", str(out)]) == 2
    assert "was trained on a data set mixture (datasets:); eval scores one data set" in capsys.readouterr().err


def test_unreadable_data_and_configs_and_mixture_misuse_are_one_line_errors(
    tiny_model_dir, tmp_path, capsys, stand_in_vllm
):
    """Tracebacks before: data `datasets` cannot read (its DatasetGenerationError is no ValueError), a config that is
    not UTF-8 (read before the parser, for its `env:` block), a streamed mixture with a test split (an
    IterableDataset has no train_test_split); and --dataset_streaming beside a mixture was ignored."""
    common = ["train", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "out")]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "1+1?", "answer": "2"}\n{"question": oops\n')
    assert main([*common, "--dataset_name", str(broken), "--prompt_column", "question"]) == 2
    assert "broken.jsonl cannot be read as a data set: ArrowInvalid: JSON parse error" in capsys.readouterr().err
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("system_prompt: Réponds\n".encode("latin-1"))
    assert main([*common, "--config", str(latin)]) == 2
    assert f"--config {latin} is not UTF-8 text" in capsys.readouterr().err
    mixture = tmp_path / "mixture.yaml"
    mixture.write_text("datasets:\n  - path: some/data\n")
    assert main([*common, "--config", str(mixture), "--dataset_streaming", "true"]) == 2
    assert "--dataset_streaming load(s) --dataset_name; a `datasets:` mixture" in capsys.readouterr().err
    mixture.write_text("datasets:\n  - path: some/data\nstreaming: true\ntest_split_size: 0.1\n")
    assert main([*common, "--config", str(mixture)]) == 2
    assert "test_split_size cannot split a streamed mixture" in capsys.readouterr().err
    # The held-out report's k copies a prompt with colocated vLLM and a seed: identical (one copy a group trains).
    seeded = ["--use_vllm", "true", "--generation_kwargs", '{"seed": 3}', "--num_generations", "1"]
    seeded += ["--eval_num_prompts", "2", "--eval_k", "2"]
    assert main([*common, "--dataset_name", str(broken), *seeded]) == 2
    assert "each of a prompt's 2 copies is one request" in capsys.readouterr().err


def test_a_mixtures_test_split_is_the_same_in_every_process_and_resume(jsonl_data):
    """TRL's `get_dataset` cuts `test_split_size` with a seed drawn from numpy's global generator, which nothing had
    seeded: each launched process (and each resume) cut its own split, and trained on the others' test rows."""
    import numpy as np
    from trl import DatasetMixtureConfig

    from trl_vapo.cli import _mixture_splits

    mixture = DatasetMixtureConfig(
        datasets=[{"path": "json", "data_files": str(jsonl_data), "split": "train"}], test_split_size=0.25
    )
    cuts = []
    for state in (1, 2):  # what each process's numpy drew before
        np.random.seed(state)
        cuts.append(_mixture_splits(mixture, seed=42)["test"]["question"])
        assert np.random.get_state()[1][0] == np.random.RandomState(state).get_state()[1][0]  # left as it was
    assert cuts[0] == cuts[1] and len(cuts[0]) == 10
    assert _mixture_splits(mixture, seed=7)["test"]["question"] != cuts[0]


@pytest.mark.parametrize("flag", ["--prompt_column question", "--dataset_config main", "--system_prompt Solve."])
def test_a_data_sets_flag_without_a_data_set_is_refused_not_ignored_by_the_demo(flag, tmp_path, capsys, monkeypatch):
    """With no data set named (its flag forgotten), the offline demo ran on its own data, the flag ignored."""
    refuse_model_loads(monkeypatch)
    name, value = flag.split(" ", 1)
    assert main(["train", name, value, "--output_dir", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"trl-vapo train: error: {name} shapes a data set's prompts, and no data set is named")
    (tmp_path / "run.yaml").write_text(f"{name[2:]}: {value}\nmax_steps: 2\n")  # from a config too
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--output_dir", str(tmp_path / "out")]) == 2
    assert f"{name} shapes a data set's prompts" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "{tmp}/empty"], "--model {tmp}/empty is a local folder but not a model's: it has no config.json"),
        (["--model", "{tmp}/file"], "--model {tmp}/file is a file: name the model's folder"),
        # (a traceback after the whole evaluation had run, its scores printed)
        (
            ["--model", "{model}", "--output_json", "{tmp}/file/s.json"],
            "--output_json {tmp}/file/s.json: {tmp}/file is a",
        ),
        (["--model_name_or_path", "{tmp}/empty"], "--model {tmp}/empty is a local folder"),  # the alias
        (["--model", "{model}", "--k", "0"], "--k must be >= 1, got 0"),
        (["--model", "{model}", "--num_prompts", "-1"], "--num_prompts must be >= 1, got -1"),
        (["--model", "{model}", "--k", "8", "16"], "unexpected argument '16': every value follows its flag"),
        # The demo's held-out split without a data set: it drew forever for a distinct problem more than it has.
        (["--model", "{model}", "--num_prompts", "98330"], "--num_prompts 98330: The held-out split has 98,329"),
        (
            ["--model", "{model}", "--temperature", "-1", "--top_p", "1.5"],
            "--temperature must be >= 0 (0: greedy), got",
        ),
        (["--model", "{model}", "--reward_model_name_or_path", "./nope"], "--reward_model_name_or_path ./nope: no"),
        (["--model", "{model}", "--config", "nope.yaml"], "nope.yaml: no such file (--config takes a YAML file's"),
        # A YAML value argparse passes on unconverted: a TypeError's traceback (k: null) or once the model had loaded.
        (["--model", "{model}", "--config", "{tmp}/k.yaml"], "k must be a whole number, got None."),
        (["--model", "{model}", "--config", "{tmp}/weights.yaml"], "reward_weights must be a list of numbers, got"),
        (["--model", "{model}", "--output_json", "{tmp}"], "--output_json {tmp} is a folder: name a file"),
        # Checked as train checks them: a traceback (exit 1) once the model had loaded
        (["--model", "{model}", "--reward_weights", "1", "2"], "reward_weights has 2 values"),
        (["--model", "{model}", "--positive_reward_funcs", "nope"], "positive_reward_funcs names ['nope']"),
        (
            ["--model", "{model}", "--use_vllm", "true", "--vllm_mode", "server", "--temperature", "0", "--k", "4"],
            "greedy sampling (--temperature 0) with a vLLM server and --k 4: vLLM refuses n > 1",
        ),
        (
            ["--model", "{model}", "--transformers_continuous_batching_config", "{{max_batch_tokens: 8}}"],
            "--transformers_continuous_batching_config is not JSON (",
        ),
    ],
)
def test_eval_bad_input_is_one_line_before_any_model_loads(
    args, needle, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """Each was a traceback: from transformers once the model had loaded, or from writing the scores after the whole
    evaluation had run."""
    refuse_model_loads(monkeypatch)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    (tmp_path / "k.yaml").write_text("k: null\n")
    (tmp_path / "weights.yaml").write_text("reward_weights: [one]\n")
    fill = dict(tmp=tmp_path, model=tiny_model_dir)
    assert main(["eval", *(a.format(**fill) for a in args)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trl-vapo eval: error: {needle.format(**fill)}"), lines


def test_eval_of_an_adapter_whose_base_is_not_here_is_one_line(tiny_model_dir, jsonl_data, tmp_path, capsys):
    """A run's output folder copied to another machine: its adapter names a base that is not there (trl-vapo saves the
    tokenizer beside the adapter, so nothing checked the base before it loaded): peft's traceback, now one line."""
    from peft import LoraConfig, get_peft_model

    adapter = tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/moved/base"}))
    capsys.readouterr()  # (the base's loading bar, above)
    data = ["--dataset_name", str(jsonl_data), "--prompt_column", "question", "--dataset_test_split", "train"]
    assert main(["eval", "--model", str(adapter), "--k", "1", "--num_prompts", "1", *data]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trl-vapo eval: error: --model {adapter} does not load: "), lines


def test_eval_renders_prompts_with_the_chat_template_kwargs_of_training(tiny_model_dir, jsonl_data, tmp_path, capsys):
    """The held-out scores (`trl-vapo eval`, and the report of `trl-vapo train`) render the prompts as training does:
    with `chat_template_kwargs` (Qwen3's `enable_thinking`). Before, they were left out, and a template that reads
    them rendered another prompt. This template refuses to render without its keyword."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = (
        "{% if enable_thinking is not defined %}{{ raise_exception('enable_thinking is not given') }}{% endif %}"
        + tokenizer.chat_template
    )
    tokenizer.save_pretrained(model)
    common = ["eval", "--model", str(model), "--num_prompts", "2", "--k", "1", "--max_new_tokens", "2"]
    common += ["--dataset_name", str(jsonl_data), "--dataset_test_split", "train", "--prompt_column", "question"]
    common += ["--prompt_format", "chat"]
    with pytest.raises(Exception, match="enable_thinking is not given"):
        main(common)
    assert main([*common, "--chat_template_kwargs", '{"enable_thinking": false}']) == 0
    assert json.loads(capsys.readouterr().out)["num_problems"] == 2
    (tmp_path / "run.yaml").write_text("chat_template_kwargs:\n  enable_thinking: false\n")
    assert main([*common, "--config", str(tmp_path / "run.yaml")]) == 0  # a training YAML's mapping
    assert main([*common, "--chat_template_kwargs", "{enable_thinking: false}"]) == 2
    assert "--chat_template_kwargs is not JSON (" in capsys.readouterr().err


def test_eval_ends_completions_where_training_ends_them(tiny_model_dir, tmp_path, capsys):
    """`generation_kwargs` (stop tokens, stop strings, min_new_tokens) decide where a completion ends; evaluation
    sampled without them, past where training's completions stopped. Here every character stops."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    every = [i for i in range(len(tokenizer)) if i != tokenizer.pad_token_id]  # every token but padding
    stops = json.dumps({"eos_token_id": [tokenizer.eos_token_id, *every]})
    common = ["eval", "--model", str(tiny_model_dir), "--num_prompts", "4", "--k", "2", "--max_new_tokens", "8"]
    assert main([*common, "--generation_kwargs", stops]) == 0
    assert json.loads(capsys.readouterr().out)["mean_length"] == 1.0
    (tmp_path / "run.yaml").write_text(f"generation_kwargs: {stops}\n")  # a training YAML's mapping
    assert main([*common, "--config", str(tmp_path / "run.yaml")]) == 0
    assert json.loads(capsys.readouterr().out)["mean_length"] == 1.0
    assert main([*common, "--generation_kwargs", "[1]"]) == 2
    assert "--generation_kwargs must be a JSON object, got [1]" in capsys.readouterr().err


def test_held_out_evaluation_takes_nonfinite_rewards_as_unscored_and_refuses_an_empty_set(tiny_model_dir):
    """A reward of inf or NaN during held-out evaluation was a TypeError (the scorer counted it through a logger
    that evaluation does not pass), raised after training and before the model was saved. What no reward scored is
    left out of the estimates, as training's accuracy leaves it out (it counted as wrong: a data set with 3% of its
    reference answers unreadable could never score above 0.97)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_vapo.evaluation import evaluate_policy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    data = Dataset.from_list([{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(3)])

    def unbounded(completions, **kwargs):
        return [float("inf"), float("nan"), 1.0] * (len(completions) // 3)

    result = evaluate_policy(model, tokenizer, data, unbounded, k=1, max_new_tokens=2, greedy=False)
    # The finite 1.0 counts; inf and NaN are unscored, neither correct nor wrong.
    assert (result.avg_at_k, result.pass_at_k, result.num_problems, result.num_unscored) == (1.0, 1.0, 1, 2)
    assert result.as_dict()["num_unscored"] == 2

    # Judged by `positive_reward_funcs`: a format reward scores the problems the judge cannot (no reference answer).
    def judge(completions, answer, **kwargs):
        return [None if a == "0" else 1.0 for a in answer]

    def format_reward(completions, **kwargs):
        return [0.1] * len(completions)

    funcs = [judge, format_reward]
    result = evaluate_policy(model, tokenizer, data, funcs, k=1, max_new_tokens=2, positive_reward_funcs=["judge"])
    assert (result.avg_at_k, result.pass_at_1, result.num_problems, result.num_unscored) == (1.0, 1.0, 2, 1)
    with pytest.raises(ValueError, match="The data set to evaluate on is empty"):
        evaluate_policy(model, tokenizer, data.select([]), unbounded, k=1, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"k \(samples per prompt\) must be a whole number >= 1, got 0$"):
        evaluate_policy(model, tokenizer, data, unbounded, k=0, max_new_tokens=2)  # (a reshape's error, once sampled)

    # A problem partly scored is one problem: avg@k is the mean over problems of each one's share correct among its
    # scored samples (one right of one scored, and four wrong: 0.5, where the share pooled over samples read 0.2).
    # pass@k is over the problems whose k samples were all scored (here the second alone), the first left out though
    # its scored sample hit: counting such problems, and leaving out those whose scored samples all missed (whose
    # hit may be unscored), would read pass@k high (a problem whose scored samples all missed counted as a miss).
    def partly(completions, answer, **kwargs):
        return [(1.0 if i % 4 == 0 else None) if a == "0" else -1.0 for i, a in enumerate(answer)]

    result = evaluate_policy(model, tokenizer, data.select([0, 1]), partly, k=4, max_new_tokens=2, greedy=False)
    assert (result.avg_at_k, result.pass_at_k, result.num_problems, result.num_partly_scored) == (0.5, 0.0, 2, 1)
    assert result.as_dict()["num_partly_scored"] == 1

    def misses_partly(completions, answer, **kwargs):  # the first problem: one miss scored of four
        return [(-1.0 if i % 4 == 0 else None) if a == "0" else 1.0 for i, a in enumerate(answer)]

    k = numpy.int64(4)  # (a sweep's grid: numpy's integers are whole numbers too)
    result = evaluate_policy(model, tokenizer, data.select([0, 1]), misses_partly, k=k, max_new_tokens=2, greedy=False)
    assert type(result.k) is int and "pass@4" in result.as_dict()
    assert (result.avg_at_k, result.pass_at_k, result.num_problems, result.num_partly_scored) == (0.5, 1.0, 2, 1)
    # The scores as the JSON writes them: 29 of 40 is 0.725 (float32's mean wrote 0.7250000238418579).
    from trl_vapo.evaluation import ProblemOutcomes

    hits = [1.0] * 29 + [0.0] * 11
    scores = ProblemOutcomes(1, hits, [[True]] * 40, [1] * 40, hits, [True] * 40).result(greedy=True).as_dict()
    assert (scores["pass@1"], scores["avg@1"]) == (0.725, 0.725)

    # A tokenizer without a pad token (Llama's, as loaded): padded with its EOS, as training pads, where the first
    # batch's padding failed (a TypeError from `torch.full(..., None)`).
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    result = evaluate_policy(model, tokenizer, data.select([0, 1]), partly, k=4, max_new_tokens=2, greedy=False)
    assert (result.avg_at_k, result.pass_at_k, result.num_problems) == (0.5, 0.0, 2)


def test_eval_takes_temperature_zero_as_greedy():
    """`evaluate_policy` samples greedily at temperature 0: the range check lets it through."""
    from types import SimpleNamespace

    from trl_vapo.cli import _check_eval_numbers

    numbers = dict(k=1, num_prompts=None, top_p=1.0, max_completion_length=4, batch_size=1)
    numbers |= dict(top_k=0, min_p=None, repetition_penalty=1.0, max_prompt_length=None)
    _check_eval_numbers(SimpleNamespace(temperature=0.0, **numbers))
    with pytest.raises(UsageError, match=r"--max_prompt_length must be >= 1 or None, got 0"):  # 0 kept them whole
        _check_eval_numbers(SimpleNamespace(**{**numbers, "temperature": 1.0, "max_prompt_length": 0}))


def test_eval_of_an_adapter_saved_alone_with_the_configs_weights_and_one_sample(
    tiny_model_dir, jsonl_data, tmp_path, capsys, monkeypatch
):
    """A PEFT adapter folder without a tokenizer reads its base's, on a data set too (whose prompts the tokenizer
    formats); a config's `reward_weights` score as in training (0: nothing is correct); `--k 1` reports the greedy
    pass@1 beside avg@1 (its own pass@1 overwrote the greedy one); `--output_json` makes its folder."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "tokenizer_config.json").exists()
    # A reward that finds every completion correct (a module of the working directory, by its dotted path): the
    # config's weight 0 makes none correct (the tiny model is never right by math_reward: 0 proved nothing).
    (tmp_path / "always.py").write_text("def right(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    config = f"model_name_or_path: {tiny_model_dir}\nreward_funcs: [always.right]\n"
    # (and its launcher's keys, which the README suggests: eval runs in one process, and took them for unknown)
    launch = "num_processes: 2\nmulti_gpu: true\naccelerate_config: zero2\n"
    (tmp_path / "run.yaml").write_text(config + "reward_weights: [0.0]\n" + launch)
    (tmp_path / "unweighted.yaml").write_text(config)
    scores = tmp_path / "new" / "scores.json"
    common = ["eval", "--model", str(tmp_path / "adapter"), "--num_prompts", "4", "--max_new_tokens", "4"]
    assert main([*common, "--k", "1", "--output_json", str(scores), "--config", str(tmp_path / "run.yaml")]) == 0
    result = json.loads(scores.read_text())
    assert set(result) == {"pass@1", "avg@1", "num_problems", "mean_length", "settings"}
    assert result["pass@1"] == result["avg@1"] == 0.0 and result["num_problems"] == 4
    assert (
        main([*common, "--k", "1", "--output_json", str(scores), "--config", str(tmp_path / "unweighted.yaml")]) == 0
    )
    assert json.loads(scores.read_text())["pass@1"] == json.loads(scores.read_text())["avg@1"] == 1.0
    # (Both runs' rewards are the same for every completion, greedy or sampled: where they differ, one sample's
    # pass@1 must not overwrite the greedy one.)
    from trl_vapo.evaluation import EvaluationResult

    greedy_right = EvaluationResult(pass_at_1=1.0, avg_at_k=0.0, pass_at_k=0.0, k=1, num_problems=4, mean_length=2)
    assert greedy_right.as_dict() == {"pass@1": 1.0, "avg@1": 0.0, "num_problems": 4, "mean_length": 2}
    data = ["--dataset_name", str(jsonl_data), "--prompt_column", "question", "--dataset_test_split", "train"]
    assert main([*common, "--k", "1", *data]) == 0  # the adapter folder was read as the tokenizer's: an OSError


def test_train_goes_on_from_an_adapter_saved_alone_with_its_bases_tokenizer(tiny_model_dir, jsonl_data, tmp_path):
    """`--model_name_or_path` names a PEFT adapter folder as peft's `save_pretrained` writes it (no tokenizer): the
    command read the folder as a tokenizer's (an OSError traceback, where `eval` read its base's); it trains on."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "tokenizer_config.json").exists()
    out = tmp_path / "run"
    assert main(
        ["train", "--model_name_or_path", str(tmp_path / "adapter"), "--dataset_name", str(jsonl_data),
         "--prompt_column", "question", "--output_dir", str(out), "--max_steps", "1", "--value_pretrain_steps", "0",
         "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4",
         "--report_to", "none", "--disable_tqdm", "true", "--eval_num_prompts", "0"]
    ) == 0  # fmt: skip
    assert (out / "adapter_config.json").is_file() and (out / "tokenizer_config.json").is_file()


def test_eval_with_vllm_samples_with_the_seed_it_is_given(tiny_model_dir, stand_in_vllm, monkeypatch):
    """vLLM's start seeds torch with its own seed (`LLM(seed=...)`; its stand-in here does too, as vLLM cannot be
    installed): `trl-vapo eval --use_vllm` seeded before building the engine, so every --seed drew the same samples."""
    import torch
    from helpers import StandInVLLMGeneration

    seeds, generate = [], StandInVLLMGeneration.generate

    def seeded_generate(self, *args, **kwargs):
        seeds.append(torch.initial_seed())  # what the last `torch.manual_seed` set
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(StandInVLLMGeneration, "generate", seeded_generate)
    flags = ["--use_vllm", "true", "--num_prompts", "1", "--k", "1", "--max_new_tokens", "1", "--temperature", "1"]
    for seed in (3, 4):
        assert main(["eval", "--model", str(tiny_model_dir), "--seed", str(seed), *flags]) == 0
    assert seeds and set(seeds[: len(seeds) // 2]) == {3} and set(seeds[len(seeds) // 2 :]) == {4}


def test_eval_with_colocated_vllm_refuses_a_seed_for_several_samples(
    tiny_model_dir, stand_in_vllm, monkeypatch, capsys
):
    """Colocated vLLM makes each of a prompt's k copies one request, each sampled with `generation_kwargs`' seed: the
    k samples were identical (pass@k = avg@k). Refused before loading; one sample a prompt may be seeded. vLLM's
    stand-in (vLLM cannot be installed here) counts the engines built. A trainer's engine refuses it at sampling
    (evaluation's per-call kwargs never meet the config): `test_trainer_evaluate`."""
    from helpers import StandInVLLMGeneration

    built, init = [], StandInVLLMGeneration._init_vllm
    monkeypatch.setattr(StandInVLLMGeneration, "_init_vllm", lambda self: init(self) or built.append(self))
    flags = ["--use_vllm", "true", "--num_prompts", "1", "--max_new_tokens", "1", "--generation_kwargs", '{"seed": 3}']
    assert main(["eval", "--model", str(tiny_model_dir), "--k", "2", *flags]) == 2
    assert "generation_kwargs sets a seed, with colocated vLLM: each of a prompt's 2 copies" in capsys.readouterr().err
    assert not built
    assert main(["eval", "--model", str(tiny_model_dir), "--k", "1", *flags]) == 0 and built


def test_eval_with_vllm_samples_from_the_weights_it_evaluates(tiny_model_dir, tmp_path, stand_in_vllm, monkeypatch):
    """vLLM loads the checkpoint by name, an adapter folder's base: `trl-vapo eval --use_vllm` pushed no weights to
    it and scored the base model as the adapter. The engine is synced once before sampling: vLLM's stand-in (vLLM
    cannot be installed here) receives the adapter merged into its base."""
    import torch
    from helpers import StandInVLLMGeneration
    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model

    built, init = [], StandInVLLMGeneration._init_vllm
    monkeypatch.setattr(StandInVLLMGeneration, "_init_vllm", lambda self: init(self) or built.append(self))
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.fill_(0.5)
    adapter.save_pretrained(tmp_path / "adapter")
    merged = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").merge_and_unload().state_dict()
    flags = ["--use_vllm", "true", "--num_prompts", "2", "--k", "1", "--max_new_tokens", "2"]
    assert main(["eval", "--model", str(tmp_path / "adapter"), *flags]) == 0
    [vllm] = built
    query = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(vllm.received[query], merged[query].to(vllm.received[query].dtype))


def test_eval_takes_a_training_configs_vllm_options(tiny_model_dir, tmp_path, stand_in_vllm, monkeypatch):
    """A training YAML's vLLM options apply to `trl-vapo eval --config` as to `train`: eval knew three of them and
    took the others' defaults without a word (a server's host and port, the structured-outputs regex, the context).
    vLLM's stand-in (vLLM cannot be installed here) is TRL's `VLLMGeneration` with transformers sampling: the options
    are what TRL's constructor was given."""
    from helpers import StandInVLLMGeneration

    built, init = [], StandInVLLMGeneration._init_vllm
    monkeypatch.setattr(StandInVLLMGeneration, "_init_vllm", lambda self: init(self) or built.append(self))
    options = {
        "max_model_length": 48,
        "structured_outputs_regex": "[0-9]+",
        "server_host": "10.0.0.5",
        "server_port": 8001,
        "group_port": 51300,
        "server_timeout": 30.0,
        "model_impl": "transformers",
        "gpu_memory_utilization": 0.5,
    }
    config = tmp_path / "run.yaml"
    config.write_text(
        "use_vllm: true\nlearning_rate: 1.0e-5\n" + "".join(f"vllm_{k}: {v!r}\n" for k, v in options.items())
    )
    flags = ["--config", str(config), "--num_prompts", "2", "--k", "1", "--max_new_tokens", "2"]
    assert main(["eval", "--model", str(tiny_model_dir), *flags]) == 0
    [vllm] = built
    assert {name: getattr(vllm, name) for name in options} == options


def test_eval_refuses_a_training_configs_dataset_mixture(tmp_path, capsys):
    config = tmp_path / "grpo.yaml"
    config.write_text("datasets:\n  - path: some/data\ntest_split_size: 0.1\nlearning_rate: 1.0e-5\n")
    assert main(["eval", "--config", str(config), "--model", "some/model"]) == 2
    assert "the config's datasets: mixture is for training" in capsys.readouterr().err
    # With a data set named, the mixture is a training key as the others: the refusal told to pass what was passed.
    assert main(["eval", "--config", str(config), "--model", str(tmp_path / "none"), "--dataset_name", "d.jsonl"]) == 2
    assert "mixture" not in (told := capsys.readouterr().err) and "--model" in told


def test_train_in_an_output_dir_another_run_holds_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """The trainer refuses a held output_dir too, but only once its models have loaded (a traceback after minutes of
    a large model's loading): the command looks first. The look takes nothing: a folder without a lock file, or
    with one a dead run left, is free, and the run then takes it."""
    from trl_vapo.run_lock import RUN_LOCK, live_holder, output_dir_lock

    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    assert live_holder(out) is None and not out.exists()
    with output_dir_lock(out), monkeypatch.context() as no_loads:  # another run's lock: flock locks of two opens
        refuse_model_loads(no_loads)  # of one file exclude each other
        holder = live_holder(out)
        assert holder["pid"] == os.getpid()
        assert main(["train", "--output_dir", str(out), "--report_to", "none"]) == 2  # the demo, refused
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"trl-vapo train: error: Another run is writing to {out}: PID {os.getpid()} on {holder['host']}, started "
        f"{holder['started']} ({out / RUN_LOCK}). Two runs in one output_dir overwrite each other's checkpoints "
        "and logs. Wait for it or stop it; then resume its run with resume_from_checkpoint=True "
        "(`--resume_from_checkpoint latest`), or choose another output_dir."
    ]
    with monkeypatch.context() as no_loads:  # the demo's held-out report asking for more problems than its split
        refuse_model_loads(no_loads)  # has: said as soon (it drew forever for one more distinct problem)
        assert main(["train", "--output_dir", str(tmp_path / "free"), "--eval_num_prompts", "98330"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "trl-vapo train: error: --eval_num_prompts 98330: the demo's held-out split has 98,329 problems"
    )
    (out / RUN_LOCK).write_text(json.dumps({"pid": 1, "host": "a-node-that-died"}))  # what kill -9 leaves
    assert live_holder(out) is None
    with output_dir_lock(out):  # and the run itself can take it
        pass
    # An earlier run's checkpoint: a fresh run is refused as soon (`resume` would take it, rotation delete its own).
    (out / "checkpoint-3").mkdir()
    (out / "checkpoint-3" / "vapo_state.json").write_text("{}")
    assert main(["train", "--output_dir", str(out), "--report_to", "none"]) == 2
    assert f"output_dir {out} holds an earlier run's checkpoints (checkpoint-3)" in capsys.readouterr().err
