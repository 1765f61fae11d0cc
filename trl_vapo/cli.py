"""The `trl-vapo` command line.

    trl-vapo train [--config vapo.yaml] [--flag value ...] [--num_processes N | --accelerate_config zero2 ...]
    trl-vapo eval --model DIR --dataset_name NAME [...]
    trl-vapo plot OUTPUT_DIR

`train` follows the `trl` CLI: a YAML file sets dataclass defaults and flags override it (`TrlParser` over the
script arguments, `VAPOConfig` and TRL's `ModelConfig`); arguments that belong to `accelerate launch` (such as
`--num_processes 2` or `--accelerate_config zero2`) relaunch the run through it. With no model and no data set,
`trl-vapo train` is the offline demo: the bundled cold-start model learns the built-in arithmetic task.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
import textwrap
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from . import __version__
from .field_checks import check_number_fields, check_text_fields, number_list
from .metric_names import ACCURACY, REWARD
from .signals import STOP_SIGNALS
from .vllm_fields import VLLMOptions

logger = logging.getLogger("trl_vapo")

# The demo's training recipe: small batches and short runs sized for two CPU cores. Any flag overrides it.
DEMO_DEFAULTS = {
    "output_dir": "vapo-demo",
    # 8 prompts x 8 samples per rollout, trained on in 4 mini-batches of 16.
    "per_device_train_batch_size": 16,
    "steps_per_generation": 4,
    "num_generations": 8,
    "max_completion_length": 96,  # the longest correct answer is 83 tokens
    # The VAPO variant the tuning stage of benchmarks/bench_learning.py chose under protocols 1 and 2 (one tuning
    # seed, never reported; protocol 2 also tried 20 pretraining rollouts with replay, whose critic explained more of
    # the return's variance and which scored lower in that one run): a short value pretraining, then four critic
    # passes over each rollout (one with the policy, three critic-only), so the critic keeps up with a policy that
    # moves at lr 1e-4. 35 rollouts of 64 samples in all, as in the benchmark.
    "value_pretrain_steps": 5,
    "critic_num_iterations": 4,
    "max_steps": 480,  # RL optimizer steps, critic-only ones included: 30 rollouts x (4 + 12)
    "learning_rate": 1e-4,
    "critic_learning_rate": 1e-3,
    # The paper's alpha = 0.05 is sized for chains of thousands of tokens: on these 26-83 token answers it gives
    # lambda_actor = 0.2-0.76, a horizon of a few tokens. alpha = 0.5 keeps the paper's rule with a horizon
    # alpha * l of 13-40 tokens (lambda_actor = 0.92-0.98). Held-out avg@4 after the demo (README): 0.922 with
    # 0.5, 0.552 with 0.05 (benchmarks/demo/ablation-2026-12-01.txt).
    "length_adaptive_alpha": 0.5,
    "logging_steps": 16,  # once per RL rollout
    "save_strategy": "no",
    "report_to": "none",
    "eval_num_prompts": 200,
    "eval_k": 4,
    "log_completions": True,  # the demo shows what the model writes: 2 of each rollout's completions per log
    "num_completions_to_print": 2,
}


@dataclass
class VAPOScriptArguments:
    """What to train on: data, rewards and the critic, beyond `VAPOConfig` and TRL's `ModelConfig`."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub data set name, or a local .json/.jsonl/.csv/.parquet file or folder. Omit with the "
            "model too for the offline demo."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Data set configuration (subset) name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(
        default="test",
        metadata={
            "help": "Split evaluated during training when --eval_strategy is not 'no' (as `trl grpo`), and for the "
            "held-out accuracy before and after training (--eval_num_prompts)."
        },
    )
    dataset_streaming: bool = field(
        default=False,
        metadata={"help": "Stream the data set (`datasets`' streaming mode); training then needs --max_steps."},
    )
    dataset_preset: str | None = field(
        default=None,
        metadata={
            "help": "Known layout: 'gsm8k' (openai/gsm8k, question/answer) or 'math' (MATH, problem/"
            "solution). Sets the data set, its columns and a boxed-answer instruction."
        },
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column with the problem (text or chat messages)."})
    answer_column: str = field(default="answer", metadata={"help": "Column with the gold answer, for the rewards."})
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "str.format template over the columns, e.g. '{question} Answer in \\boxed{{}}.' (text prompts "
            "only: with a column of chat messages as the prompt, refused)"
        },
    )
    system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "System message before each problem: a chat prompt's first message (refused where the data set's "
            "messages have their own), or a paragraph before a text prompt."
        },
    )
    prompt_format: str = field(
        default="auto",
        metadata={
            "help": "'chat' (messages through the chat template), 'text', or 'auto': chat when the tokenizer "
            "has a chat template and the prompt is built here (from another column than `prompt`, a template, a "
            "preset or a system prompt); a `prompt` column is used as `trl grpo` uses it (text as text, chat "
            "messages through the chat template)."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions by name (math_reward, think_boxed_format_reward, TRL's accuracy_reward, "
            "reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment, ...) or import path "
            "(my_pkg.rewards.fn). Default: math_reward, unless --reward_model_name_or_path is given."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A reward model (sequence classification, one label): hub id or local folder, scored as "
            "`trl grpo` scores it, first among the reward functions (as `trl grpo` puts it: --reward_weights' "
            "first weight is its)."
        },
    )
    value_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Critic to start from, e.g. <output_dir>/value_pretrained_critic of an earlier run (pushed: "
            "owner/name/value_pretrained_critic)."
        },
    )
    eval_num_prompts: int = field(
        default=0, metadata={"help": "Held-out prompts scored before and after training (0: skip)."}
    )
    eval_k: int = field(default=4, metadata={"help": "Samples per held-out prompt for avg@k in that report."})
    ignore_bias_buffers: bool = field(
        default=False,
        metadata={"help": "TRL's ScriptArguments field, accepted so that a `trl grpo` config runs; unused, as there."},
    )

    def __post_init__(self):
        check_number_fields(self)  # a YAML `eval_k: null`: one line, not a TypeError where the report compares it
        check_text_fields(self)  # a YAML `prompt_template: {question}`, a mapping: one line, not a traceback


TRAIN_DESCRIPTION = """\
Train a model with VAPO (arXiv 2504.05118): PPO with a value model, as `trl grpo` trains with GRPO, from flags, a YAML
file (--config FILE.yaml: its keys are the flags below, and flags override it), or both.

  trl-vapo train                                    the offline demo (no model or data set given, nor in --config)
  trl-vapo train --config examples/gsm8k_lora.yaml  a recipe; --model_name_or_path and --dataset_name as flags work too
  trl-vapo train --config x.yaml --num_processes 2  several processes: `accelerate launch`'s flags (--num_processes,
                                                    --multi_gpu, --config_file, --accelerate_config zero1|zero2|zero3|
                                                    fsdp2|multi_gpu|single_gpu) relaunch the run through it

The defaults below are every run's (VAPOConfig's: the paper's where it has one, but for the batch, where the paper
samples 512 prompts x 16, and value pretraining's early stop: --value_pretrain_patience None runs all its steps, as
the paper does). The demo changes these:
{demo}
"""


def _parser():
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    from .config import VAPOConfig

    class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """The defaults after each flag, and the description as written."""

    demo = textwrap.fill(", ".join(f"{k}={v}" for k, v in DEMO_DEFAULTS.items()), 118, initial_indent="  ",
                         subsequent_indent="  ")  # fmt: skip
    # allow_abbrev=False: `--learning_rat` is a typo to name, not a prefix to take silently (a YAML key never is one)
    parser = TrlParser(
        (VAPOScriptArguments, VAPOConfig, ModelConfig, DatasetMixtureConfig),
        prog="trl-vapo train",
        description=TRAIN_DESCRIPTION.format(demo=demo),
        formatter_class=Help,
        allow_abbrev=False,
    )
    return _in_one_line(parser)


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2."""


def _in_one_line(parser):
    """`parser` with argparse's errors (a flag's or a YAML key's value of the wrong type, a bad choice) raised as a
    `UsageError`: one line, where argparse prints the usage of every flag (some 300 of them) first. A number field
    that may be None takes `None` (or `null`) on the command line too (`--length_adaptive_alpha None`):
    HfArgumentParser reads `float | None` as a float, and `None` was an invalid float value. So does a text field
    whose default is None (`--prompt_template None`, `--system_prompt null`): it was the text "None", every prompt
    then the word None; and a switch whose None is its own choice (`--use_static_cache_engine None`: automatic,
    which a YAML's `true` could not be set back to: "Truthy value expected")."""

    def error(message: str):
        raise UsageError(f"{message} (see `{parser.prog} --help`)")

    parser.error = error
    optional = set()
    for dataclass_type in parser.dataclass_types:
        hints = typing.get_type_hints(dataclass_type)
        optional |= {f.name for f in fields(dataclass_type) if type(None) in typing.get_args(hints[f.name])}
    for action in parser._actions:
        if action.dest not in optional or action.nargs in ("*", "+"):  # not a list's
            continue
        # (`bool | None`: the type is TRL's copy of transformers' string_to_bool)
        switch = getattr(action.type, "__name__", "") == "string_to_bool" and action.default is None
        if (
            switch
            or action.type in (int, float)
            or (action.type is str and action.default is None and not action.choices)
        ):
            action.type = _or_none(action.type)
    return parser


def _or_none(number_type):
    """`number_type` (or a switch's), or None for the text None / null (argparse names the type in its error:
    `invalid float`)."""

    def parse(text: str):
        return None if text.strip().lower() in ("none", "null") else number_type(text)

    parse.__name__ = number_type.__name__
    return parse


LIST_FIELDS = ("reward_funcs", "positive_reward_funcs", "reward_weights", "lora_modules_to_save")
"""List flags a YAML file may give one value of without brackets (argparse leaves a default as it is, and the
string's characters would be taken as the names: peft matched `lora_modules_to_save: lm_head`'s letters against the
module names). Not TRL's list fields that take a string too (`lora_target_modules: all-linear`)."""

PATH_FIELDS = (
    "model_name_or_path",
    "model",
    "dataset_name",
    "reward_model_name_or_path",
    "value_model_name_or_path",
    "resume_from_checkpoint",
    "output_json",
)
"""Fields naming a file or folder, `~` expanded as the shell expands a flag's (a YAML file's `~/models/qwen` reached
`from_pretrained` as written: taken for a Hub id). transformers expands `output_dir` itself."""


def _apply_config_env(argv: list[str]) -> None:
    """The `--config` file's `env:` block set in this process's environment before anything imports the Hugging
    Face libraries, which read theirs once, on import (`HF_HUB_OFFLINE`, `HF_HOME`, `HF_TOKEN`): TrlParser sets the
    block as it parses, after the parser's own imports, so a one-process run ignored them (a launched one, whose
    processes start with them, did not). Not a mapping: TrlParser's error, when it parses."""
    config = _given(argv)[1]
    env = config.get("env") if isinstance(config, dict) else None
    if isinstance(env, dict):
        for key, value in env.items():
            os.environ[str(key)] = str(value)


def _config_flag_apart(argv: list[str]) -> list[str]:
    """`--config=FILE` as `--config FILE`: TrlParser finds that one alone (the other is left over as unknown)."""
    return [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]


def _parse_args_and_config(parser, argv: list[str]):
    """`TrlParser.parse_args_and_config` with the remaining strings apart, its failures one line each."""
    import yaml

    argv = _config_flag_apart(argv)
    if "--config" in argv and argv.index("--config") + 1 == len(argv):  # TrlParser: IndexError, a traceback
        raise UsageError("--config needs a YAML file's path")
    try:
        *parsed_args, config_remaining, cli_remaining = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except UnicodeDecodeError as error:  # (a ValueError)
        config_file = argv[argv.index("--config") + 1] if "--config" in argv else "--config"
        raise UsageError(f"--config {config_file} is not UTF-8 text ({error}): save it as UTF-8") from None
    except ValueError as error:  # the config classes' validation
        raise UsageError(str(error)) from None
    except (FileNotFoundError, IsADirectoryError) as error:  # --config's file, or a field's (accelerator_config)
        kind = "no such file" if isinstance(error, FileNotFoundError) else "a folder"
        config_file = argv[argv.index("--config") + 1] if "--config" in argv else None
        if config_file is not None and error.filename is not None and Path(error.filename) == Path(config_file):
            raise UsageError(f"{error.filename}: {kind} (--config takes a YAML file's path)") from None
        raise UsageError(f"{error.filename or error}: {kind}, named by a setting that takes a file's path") from None
    except yaml.YAMLError as error:  # its message names the file, the line and the column
        raise UsageError("--config is not valid YAML: " + " ".join(str(error).split())) from None
    choices = {action.dest: action.choices for action in parser._actions if action.choices}
    for parsed in parsed_args:
        for name, allowed in choices.items():  # a config's value: argparse checks the command line's alone
            value = getattr(parsed, name, None)
            if value is not None and not isinstance(value, (list, dict)) and value not in allowed:
                raise UsageError(f"{name}: {value!r} is not one of {', '.join(map(str, allowed))}")
        for name in LIST_FIELDS:  # a YAML scalar (`reward_funcs: math_reward`) is the default as written
            value = getattr(parsed, name, None)
            if value is not None and not isinstance(value, list):
                setattr(parsed, name, [value])
        for name in PATH_FIELDS:
            value = getattr(parsed, name, None)
            if isinstance(value, str) and value.startswith("~"):
                setattr(parsed, name, os.path.expanduser(value))
        targets = getattr(parsed, "lora_target_modules", None)
        if isinstance(targets, str) and targets != "all-linear" and re.fullmatch(r"[\w.]+", targets):
            # One module's name: TRL's ModelConfig unwraps a one-name list (`--lora_target_modules q_proj`) into the
            # string, which peft reads as a regular expression of the whole module path: "Target modules q_proj not
            # found in the base model", once the model had loaded.
            parsed.lora_target_modules = [targets]
    return (*parsed_args, config_remaining, cli_remaining)


# ------------------------------------------------------------------------------------------------------------- train
DATA_AND_MODEL_FLAGS = {
    "--model_name_or_path",
    "--dataset_name",
    "--dataset_preset",
    "--datasets",
    "--reward_model_name_or_path",
    "--value_model_name_or_path",
}
"""What makes a `train` run other than the offline demo, as a flag or as a config's key: a reward or value model
too, which the demo (its own model and reward) would have trained with instead of saying the policy is missing."""


def _given(argv: list[str]) -> tuple[dict[str, typing.Any], dict[str, typing.Any] | None]:
    """A look at what a command is given before its parser reads it: the flags (`--name value`, `--name=value`, a
    flag alone as True) and the `--config` file's keys, each by field name; the file's None where it cannot be read
    (the parser then says what is wrong with it)."""
    argv = _config_flag_apart(argv)
    flags = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--") and arg != "--config":
            name, equals, value = arg[2:].partition("=")
            following = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
            flags[name.replace("-", "_")] = value if equals else following
    config = {}
    if "--config" in argv[:-1]:
        import yaml

        try:
            config = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):  # (ValueError: not UTF-8; TrlParser's read says it in a line)
            config = None
        config = config if isinstance(config, dict) or config is None else {}
    return flags, config


DEMO_DEFAULTS_YIELD_TO = {
    "steps_per_generation": ("generation_batch_size", "gradient_accumulation_steps"),
    "save_strategy": ("save_steps",),
    "max_steps": ("num_train_epochs",),
    "critic_num_iterations": ("num_iterations",),
    "critic_learning_rate": ("learning_rate",),
}
"""The demo's settings that a setting the user gives replaces, as it would outside the demo: a rollout's size as
`generation_batch_size` (both set, they were refused as disagreeing: the user had set only one), another
`gradient_accumulation_steps` (refused: the demo's `steps_per_generation` 4 is no multiple of 8), `save_steps` (no
checkpoint was written: the demo saves none), `num_train_epochs` (the demo's `max_steps` ruled), `num_iterations`
(refused: more than the demo's `critic_num_iterations`), `learning_rate` (the critic's rate follows it, 2x, as it
does outside the demo)."""


def _demo_defaults(argv: list[str]) -> dict[str, typing.Any]:
    """The demo's settings under those `argv` gives (`DEMO_DEFAULTS_YIELD_TO`)."""
    flags, config = _given(argv)
    given = {**(config or {}), **flags}
    return {
        name: value
        for name, value in DEMO_DEFAULTS.items()
        if not any(other in given for other in DEMO_DEFAULTS_YIELD_TO.get(name, ()))
    }


DEMO_IGNORES = (
    "dataset_config",
    "dataset_train_split",
    "dataset_test_split",
    "dataset_streaming",
    "prompt_column",
    "answer_column",
    "prompt_template",
    "system_prompt",
    "prompt_format",
)
"""What shapes a named data set's prompts: given with none, the demo (its own data) would ignore them."""


PEFT_FLAGS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_parameters",
    "lora_modules_to_save",
    "lora_task_type",
    "use_rslora",
    "use_dora",
)
"""TRL's `ModelConfig` fields that shape the LoRA adapter, which `get_peft_config` reads only with `use_peft`."""


def _check_peft_flags(argv: list[str], model_args) -> None:
    """LoRA's settings without `--use_peft` refused (but those set off: `use_dora: false`): the run fine-tuned every
    weight (a float32 copy of the whole model as the critic's too, at a rate meant for an adapter), as `trl grpo`
    does, silently. `--use_peft false` said outright keeps them unused (a saved adapter as the model trains as it
    is). (A setting at TRL's default counts: a recipe's `lora_r: 16` is one.)"""
    flags, config = _given(argv)
    given = {**(config or {}), **flags}
    if model_args.use_peft or "use_peft" in given:
        return
    shaping = [f"--{name}" for name in PEFT_FLAGS if name in given and getattr(model_args, name) not in (False, None)]
    if shaping:
        raise UsageError(
            f"{', '.join(shaping)} shape{'s' if len(shaping) == 1 else ''} a LoRA adapter, and --use_peft is not "
            "set: the run would fine-tune every weight of the model. Add --use_peft true (`use_peft: true`), or "
            "--use_peft false to leave them unused (a saved adapter as --model_name_or_path trains as it is)"
        )


def _check_no_data_flags(argv: list[str]) -> None:
    """A data set's flags without a data set (its flag forgotten, say) refused: the demo ran, ignoring them."""
    flags, config = _given(argv)
    given = [f"--{name}" for name in DEMO_IGNORES if name in flags or name in (config or {})]
    if given:
        raise UsageError(
            f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} a data set's prompts, and no data set is "
            "named: without one the offline demo trains on its own. Name it (--dataset_name or --dataset_preset, "
            "with --model_name_or_path), or drop the flag for the demo"
        )


def _is_demo(argv: list[str]) -> bool:
    """No model and no data, as flags or in the `--config` file: the offline demo (a config then changes its
    settings, `max_steps: 5` say)."""
    flags, config = _given(argv)
    if config is None:  # the parser says what is wrong with the file
        return False
    return not {f"--{name}" for name in [*flags, *config]} & DATA_AND_MODEL_FLAGS


def _split_launch_args(remaining: list[str], from_config: list[str] = (), parser=None) -> list[str]:
    """Check that every argument the training parsers left over belongs to `accelerate launch`; `from_config` are
    those that came from the YAML file's keys. An unknown one is named with the closest known flag."""
    if not remaining:
        return []
    import difflib

    launcher = _launcher_in_one_line()
    switches = {o for a in launcher._actions if a.nargs == 0 for o in a.option_strings}  # `--multi_gpu`
    # Choices with a "no" (`--mixed_precision`, `--dynamo_backend`): a config's unquoted `mixed_precision: no` is YAML
    # 1.1's false, and arrives as `--mixed_precision False` (refused: "invalid choice").
    with_no = {o for a in launcher._actions if a.choices and "no" in a.choices for o in a.option_strings}
    flags = []
    # A config's `multi_gpu: true` arrives as `--multi_gpu True`: the flag, or nothing.
    for arg in remaining:
        if flags and flags[-1] in switches and arg.lower() in ("true", "false"):
            if arg.lower() == "false":
                flags.pop()
            continue
        flags.append("no" if flags and flags[-1] in with_no and arg == "False" else arg)
    try:
        launch_args = _one_launch_file(flags)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if any(Path(arg).name == "fsdp1.yaml" for arg in launch_args):  # TRL's name for its FSDP1 config
        raise UsageError("--accelerate_config fsdp1: FSDP version 1 is not supported; use --accelerate_config fsdp2")
    parsed, unknown = launcher.parse_known_args(launch_args + ["-m", "trl_vapo.cli"])
    unknown = [arg for arg in unknown if arg.startswith("-")]
    if unknown:
        known = [o for p in (parser or _parser(), launcher) for a in p._actions for o in a.option_strings]
        named = []
        for arg in unknown:
            flag = arg.split("=")[0]
            underscored = "--" + flag[2:].replace("-", "_")  # TrlParser reads a YAML key by its field's name only
            close = [RENAMED_FLAGS[flag]] if flag in RENAMED_FLAGS else []
            close = close or ([underscored] if flag in from_config and underscored in known else [])
            close = close or difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if flag in from_config:  # a YAML key, named as the file spells it
                hint = f" (did you mean {close[0][2:]!r}?)" if close else ""
                named.append(f"the config's key {flag[2:]!r}{hint}")
            else:
                named.append(flag + (f" (did you mean {close[0]}?)" if close else ""))
        raise UsageError(f"unrecognized argument(s): {', '.join(named)} (see `trl-vapo train --help`)")
    # A value no flag took (an unknown flag's is named above): the launcher would run it as its script.
    if parsed.training_script != "trl_vapo.cli":
        stray = parsed.training_script
        hint = f" (did you mean --config {stray}?)" if stray.endswith((".yaml", ".yml")) else ""
        raise UsageError(
            f"unexpected argument {stray!r}{hint}: every value follows its flag (see `trl-vapo train --help`)"
        )
    return launch_args


def _one_launch_file(args: list[str]) -> list[str]:
    """`args` with each `--accelerate_config NAME` (also `=NAME`, `--accelerate-config`) resolved to `--config_file
    PATH` where it stands, and the last `--config_file` alone kept: the one the launcher reads, a flag's over the
    config's key (TRL's resolver read the first `--accelerate_config` alone and put its file first: the launcher
    refused the other as an unknown key of the config, or launched the config's file)."""
    from ._compat import resolve_accelerate_config_argument

    resolved, index = [], 0
    while index < len(args):
        flag, equals, value = args[index].partition("=")
        if flag in ("--accelerate_config", "--accelerate-config"):
            named = ["--accelerate_config"]  # without a value, the resolver says it is missing
            if equals:
                named.append(value)
            elif index + 1 < len(args) and not args[index + 1].startswith("--"):
                named.append(args[index + 1])
                index += 1
            resolved += resolve_accelerate_config_argument(named)
        else:
            resolved.append(args[index])
        index += 1
    files = [n for n, arg in enumerate(resolved[:-1]) if arg == "--config_file"]
    return [arg for n, arg in enumerate(resolved) if not any(n in (at, at + 1) for at in files[:-1])]


def _launcher_in_one_line():
    """`accelerate launch`'s parser, its errors (`--num_processes two`) one line each, as the training flags'."""
    from accelerate.commands.launch import launch_command_parser

    launcher = launch_command_parser()

    def error(message: str):
        raise UsageError(f"{message} (see `accelerate launch --help`)")

    launcher.error = error
    return launcher


RENAMED_FLAGS = {"--torch_dtype": "--dtype", "--warmup_ratio": "--warmup_steps"}
"""Flags of older TRL and transformers versions under their names now (TRL's ModelConfig has no `torch_dtype`;
transformers 5 folded `warmup_ratio` into `warmup_steps`, which reads a value below 1 as the ratio)."""


def _check_resume(output_dir: str, resume: str | bool | None) -> None:
    """What the trainer would refuse of `--resume_from_checkpoint` (read by `resume_request`: True, None, 'auto' or a
    path), said before any model loads: no checkpoint to resume from in `output_dir` (true / latest), a folder that
    is none, or, without it, an earlier run's checkpoints.
    (A checkpoint of another run's settings is said once the trainer is built: it needs the run's fingerprint.)"""
    from .checkpoint import RESUME_IF_ANY, checkpoint_problem, resolve_resume

    try:
        if resume in (True, None, RESUME_IF_ANY):
            # (the trainer names the damaged checkpoints it passes over, and publishes one a stop left whole)
            resolve_resume(output_dir, resume, warn=False, before_lock=True)
        elif not Path(resume).is_dir():
            raise ValueError(
                f"--resume_from_checkpoint {resume}: no such folder; name a checkpoint folder, or pass true (or "
                f"latest) for the newest one in {output_dir} (auto: the newest, or a fresh run if none)"
            )
        elif problem := checkpoint_problem(Path(resume)):
            raise ValueError(f"Cannot resume from {resume}: {problem}")
    except ValueError as error:
        raise UsageError(str(error)) from None


@contextlib.contextmanager
def _checked_as_launched(argv: list[str]):
    """The config's batch checks (`generation_batch_size` a multiple of `num_generations`, ...) made for the process
    count the command launches (`_planned_processes`), not for this process alone, which reads the config before it
    launches the others: a per-device batch that fits N processes was refused ("x 1 process(es)"), and one that does
    not fit them was refused only by each launched process."""
    from .config import VAPOConfig

    planned = _planned_processes(*_given(argv))
    if planned <= 1 or "LOCAL_RANK" in os.environ or LAUNCHED in os.environ:  # launched: its own count is right
        yield
        return
    VAPOConfig.world_size = property(lambda self: planned)  # (TrainingArguments' reads this process's state)
    try:
        yield
    finally:
        del VAPOConfig.world_size


def _planned_processes(flags: dict[str, typing.Any], config: dict[str, typing.Any] | None) -> int:
    """How many processes `accelerate launch` will start, as it decides: `--num_processes` (a flag or the config's
    key), else the accelerate config file's `num_processes` (`--accelerate_config zero2`: TRL's files say 8;
    `--config_file`; else accelerate's default config, `_default_launch_config`), else with `--multi_gpu` every visible
    GPU. 1 where it cannot be read: the launcher says what is wrong."""
    import yaml

    given = {**(config or {}), **flags}
    try:
        if given.get("num_processes") is not None:
            return int(given["num_processes"])
        launch_file = None
        for source in (flags, config or {}):  # a flag's file over the config's, and the last one given in each: the
            files = [  # launcher reads the last `--config_file` (`_one_launch_file`)
                (key, value)
                for key, value in source.items()
                if key in ("accelerate_config", "config_file") and value not in (None, True)
            ]
            if files:
                key, value = files[-1]
                if key == "accelerate_config":
                    from ._compat import resolve_accelerate_config_argument

                    value = resolve_accelerate_config_argument(["--accelerate_config", str(value)])[1]
                launch_file = value
                break
        else:
            if str(given.get("cpu", False)).lower() not in ("true", "") and _default_launch_file().is_file():
                launch_file = _default_launch_file()  # accelerate reads it where no file is named (not with --cpu)
            elif str(given.get("multi_gpu", False)).lower() in ("true", ""):
                import torch

                return torch.cuda.device_count()
            else:
                return 1
        launched = yaml.safe_load(Path(launch_file).read_text(encoding="utf-8")) or {}
        if str(launched.get("distributed_type", "")).upper() in ("NO", "FALSE"):  # one process, whatever else it says
            return 1  # (TRL's single_gpu.yaml: `num_processes: 8`, and accelerate's simple launcher starts one)
        return int(launched.get("num_processes") or 1)
    except (OSError, TypeError, ValueError, AttributeError, ImportError, yaml.YAMLError):
        return 1


def _default_launch_file() -> Path:
    """Where `accelerate config` writes accelerate's default config (`$HF_HOME/accelerate/default_config.yaml`)."""
    from accelerate.commands import config as accelerate_config

    return Path(accelerate_config.default_config_file)


def _default_launch_config() -> str | None:
    """accelerate's default config file (`_default_launch_file`) where it exists and says something else than one
    process (`distributed_type: NO`): `accelerate launch` reads it when no other file is named, and `trl grpo` always
    launches through it, so `trl-vapo train` given no launcher argument launches with it too (a machine configured
    for 8 GPUs trained in one process, without a word). None otherwise, or where it cannot be read."""
    import yaml

    path = _default_launch_file()
    try:
        settings = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(settings, dict) or str(settings.get("distributed_type", "NO")).upper() in ("NO", "FALSE"):
        return None
    return str(path)


def _check_held_out_report(script_args, demo: bool, flags: typing.Collection[str] = ()) -> None:
    """The held-out report's numbers in their ranges, before any model loads (the report runs after loading);
    `flags`: the settings given on the command line (over the config's)."""
    from .demo.data import HELD_OUT_PROBLEMS

    if script_args.eval_num_prompts < 0:
        raise UsageError(
            f"--eval_num_prompts must be >= 0 (0: no held-out report), got {script_args.eval_num_prompts}"
        )
    if script_args.eval_k < 1:
        raise UsageError(f"--eval_k must be >= 1 (samples per held-out prompt), got {script_args.eval_k}")
    # An eval_k without the report's prompts (forgotten?); not a config's, whose report a flag turns off (the
    # config's eval_k was refused as if given alone).
    skipped = not script_args.eval_num_prompts and "eval_num_prompts" in flags and "eval_k" not in flags
    if not script_args.eval_num_prompts and script_args.eval_k != VAPOScriptArguments.eval_k and not skipped:
        raise UsageError(
            f"--eval_k {script_args.eval_k} sets the held-out report's samples per prompt, and --eval_num_prompts 0 "
            "skips that report: set --eval_num_prompts N (prompts of the test split) too, or drop --eval_k"
        )
    if demo and script_args.eval_num_prompts > HELD_OUT_PROBLEMS:
        raise UsageError(
            f"--eval_num_prompts {script_args.eval_num_prompts}: the demo's held-out split has {HELD_OUT_PROBLEMS:,} "
            "problems"
        )


def _check_reward_settings(reward_funcs: list, reward_model: str | None, training_args) -> None:
    """`reward_weights` and `positive_reward_funcs` against the run's reward functions, by count and by name, as the
    trainer checks them once its reward model has loaded (and the data set before it)."""
    from .scoring import (
        check_positive_reward_funcs,
        checked_reward_weights,
        reward_func_name,
        reward_model_name,
        unique_reward_names,
    )

    # The trainer names a reward model by its id's last part (`RewardModel`), a function by its name.
    given = ([reward_model_name(reward_model)] if reward_model else []) + [reward_func_name(f) for f in reward_funcs]
    names = unique_reward_names(given)
    try:
        checked_reward_weights(training_args.reward_weights, len(names))
        check_positive_reward_funcs(training_args.positive_reward_funcs, names)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _check_before_loading(script_args, training_args, model_args, demo: bool) -> list:
    """What a typo can break, checked before any model or data loads (and before a launch): the reward functions
    (returned, resolved), the engine, the resume request, the output dir's lock, the models' sources. A failure is
    one line on stderr."""
    reward_funcs = _resolve_rewards(_reward_names(script_args), training_args.max_completion_length)
    _check_reward_settings(reward_funcs, script_args.reward_model_name_or_path, training_args)
    from .generation import EngineSettings, check_engine_available

    try:  # vLLM asked for but not installed, say
        check_engine_available(EngineSettings.from_config(training_args))
    except (ImportError, ValueError) as error:
        raise UsageError(str(error)) from None
    from .checkpoint import resume_request

    # `--resume_from_checkpoint false` turns off a config's `resume_from_checkpoint`; `latest` is True.
    training_args.resume_from_checkpoint = resume_request(training_args.resume_from_checkpoint)
    if all(os.environ.get(rank, "0") == "0" for rank in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")):
        # One process looks (torchrun's, MPI's rank 0): two looking at once would each see the other.
        from .run_lock import live_holder, refusal

        holder = live_holder(training_args.output_dir)
        if holder is not None:  # the trainer would refuse too, but after the models had loaded
            raise UsageError(refusal(training_args.output_dir, holder))
        _check_resume(training_args.output_dir, training_args.resume_from_checkpoint)  # as for these two
    if not demo:
        if not model_args.model_name_or_path:
            raise UsageError(
                "--model_name_or_path is required with a data set, a reward model or a value model (omit them all "
                "for the offline demo)"
            )
        where = _policy_lookup(model_args, training_args)
        _check_model_source(model_args.model_name_or_path, "--model_name_or_path", where.get("revision"), where)
        # (the other models are looked up in the same cache, with the same token; not in the policy's subfolder, but
        # a value model that is the policy's checkpoint, which the trainer reads where the policy is)
        elsewhere = {key: where[key] for key in ("cache_dir", "token") if key in where}
        _check_model_source(script_args.reward_model_name_or_path, "--reward_model_name_or_path", where=elsewhere)
        value_model = script_args.value_model_name_or_path
        own = where if value_model == model_args.model_name_or_path else elsewhere
        from .loading import hub_repository_folder

        split = hub_repository_folder(value_model)
        if split is not None and split[1]:  # a critic folder of a Hub repository (a pushed run's `critic/`)
            value_model, own = split[0], {**own, "subfolder": split[1]}
        _check_model_source(value_model, "--value_model_name_or_path", own.get("revision"), own)
    return reward_funcs


def train_command(argv: list[str]) -> int:
    demo = _is_demo(argv) and not {"-h", "--help"} & set(argv)  # help shows every run's defaults, naming the demo's
    parser = _parser()
    if demo:
        parser.set_defaults(**_demo_defaults(argv))
    with _checked_as_launched(argv):
        script_args, training_args, model_args, mixture, config_remaining, cli_remaining = _parse_args_and_config(
            parser, argv
        )
    launch_args = _split_launch_args(config_remaining + cli_remaining, config_remaining, parser)
    if not launch_args and (default := _default_launch_config()) is not None:
        launch_args = ["--config_file", default]
    # TrlParser always builds a DatasetMixtureConfig: a run trains on a mixture when it lists data sets (TRL's test).
    mixed = mixture is not None and bool(mixture.datasets)
    _check_held_out_report(script_args, demo, _given(argv)[0])
    _check_data_flags(script_args, mixture)
    _check_peft_flags(argv, model_args)
    if training_args.use_vllm and training_args.vllm_mode == "colocate" and script_args.eval_num_prompts:
        from .generation import colocated_vllm_seed_problem  # (the config checks the training groups' copies)

        if seeded := colocated_vllm_seed_problem(training_args.generation_kwargs or {}, script_args.eval_k):
            raise UsageError(f"{seeded} (the held-out report samples --eval_k {script_args.eval_k} a prompt)")
    if demo:
        _check_no_data_flags(argv)
    # Checked before a launch too: each launched process would fail on the same line, among the launcher's report.
    reward_funcs = _check_before_loading(script_args, training_args, model_args, demo)
    if not (demo or mixed or script_args.dataset_name or script_args.dataset_preset):
        raise UsageError(
            "--dataset_name (or --dataset_preset) is required with a model (omit both for the offline demo)"
        )
    # The launched command reads the same config, launch keys included: it runs them, it does not launch again
    # (accelerate's one-process launcher sets no LOCAL_RANK).
    if launch_args and "LOCAL_RANK" not in os.environ and LAUNCHED not in os.environ:
        return _relaunch(launch_args, _without_subsequence(argv, cli_remaining))

    from trl import get_peft_config, get_quantization_config

    from .signals import TrainingInterrupted
    from .trainer import VAPOTrainer

    started = time.time()
    run_data = asdict(script_args)  # as given (`_resolve_data` fills a preset's fields in), for `trl-vapo eval`
    for key in ("dataset_name", "reward_model_name_or_path"):  # read from any working directory
        if run_data[key] and Path(run_data[key]).exists():
            run_data[key] = str(Path(run_data[key]).resolve())
    run_data["mixture"] = mixed
    if mixed:  # a --dataset_name beside a `datasets:` mixture is not what trained (TRL's `trl grpo` uses the mixture):
        # eval read it as the run's data, and scored that set quietly where it refuses to guess a mixture's
        run_data.update(dataset_name=None, dataset_config=None)
    run_data["working_dir"] = os.getcwd()  # where eval finds the modules `--reward_funcs my_rewards.fn` names
    model_id, train_dataset, eval_dataset, test_dataset = _resolve_data(
        script_args, model_args, training_args, demo, mixture
    )
    _configure_logging()
    model_kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype}
    if model_args.attn_implementation:
        model_kwargs["attn_implementation"] = model_args.attn_implementation
    quantization = get_quantization_config(model_args)
    if quantization is not None:
        model_kwargs["quantization_config"] = quantization
    training_args.model_init_kwargs = {**model_kwargs, **(training_args.model_init_kwargs or {})}

    try:  # the trainer checks the settings against the data and the models before training: each a line here
        trainer = VAPOTrainer(
            model=model_id,
            reward_funcs=[script_args.reward_model_name_or_path, *reward_funcs]
            if script_args.reward_model_name_or_path
            else reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=_tokenizer_of(model_id, model_args, training_args),
            value_model=script_args.value_model_name_or_path,
            peft_config=get_peft_config(model_args),
        )
        trainer.resume_point(training_args.resume_from_checkpoint)  # a checkpoint of other settings, say
    except (ValueError, ImportError, NotImplementedError) as error:
        logging.getLogger(__name__).debug("The trainer refused the run", exc_info=True)  # the traceback, if asked
        raise UsageError(" ".join(str(error).split())) from None
    before = held_out_report_before_training(trainer, test_dataset, script_args, training_args.resume_from_checkpoint)
    trainer.run_script_args = run_data  # saved with each model: what `trl-vapo eval --model OUTPUT_DIR` scores
    with trainer.holding_output_dir():  # until the model is saved: a run started meanwhile would remove it half-saved
        try:
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        except TrainingInterrupted as stopped:  # a stop signal: the checkpoint is written and named in the log
            print(f"trl-vapo train: {stopped}", file=sys.stderr)
            trainer.accelerator.end_training()
            return stopped.exit_code
        before = before()
        # The trained model is saved before the held-out report, which takes minutes at eval_k x eval_num_prompts: a
        # stop there (Ctrl-C; SIGTERM's default action) or a crash no longer loses it. Pushed once, with the scores.
        trainer.model_card_info = _model_card_info(script_args, before, None, demo, mixed)
        trainer.save_model(training_args.output_dir, _internal_call=True)
        try:
            after = _held_out_report(trainer, test_dataset, script_args, trainer.reward_funcs)
        except Exception:
            if training_args.push_to_hub:  # the trained model reaches the Hub all the same, without the scores
                trainer.push_to_hub(commit_message="Model save", revision=training_args.hub_revision)
            raise
        trainer.model_card_info = _model_card_info(script_args, before, after, demo, mixed, training_args)
        trainer.create_model_card(output_dir=training_args.output_dir)
        if training_args.push_to_hub:
            trainer.push_to_hub(commit_message="Model save", revision=training_args.hub_revision)
    if trainer.accelerator.is_main_process:
        print(_summary(trainer, before, after, time.time() - started, demo))
    # Several processes: destroy the process group before the interpreter exits; left to exit, a gloo worker once
    # aborted there ("terminate called without an active exception", SIGABRT) after its model was saved.
    trainer.accelerator.end_training()
    return 0


QUIET_LOGGERS = ("httpx", "httpx2")
"""Loggers left at WARNING when the command logs at INFO, unless the user set their level: huggingface_hub's HTTP
clients log every request at INFO (a cached file's lookup too), dozens of lines before the first step."""


def _configure_logging() -> None:
    """The command's logging: INFO lines as `LEVEL name: message` (transformers', the trainer's), `QUIET_LOGGERS`
    aside."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    for name in QUIET_LOGGERS:
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)


def _report_sampling(args) -> list[str]:
    """The run's sampling settings the held-out report applies beyond temperature 1 and top_p 1 (`_held_out_report`
    samples with them), as `name=value`."""
    settings = (("top_k", args.top_k, (None, 0)), ("min_p", args.min_p, (None, 0.0)))
    settings += (("repetition_penalty", args.repetition_penalty, (1.0,)),)
    return [f"{name}={value}" for name, value, off in settings if value not in off]


def _model_card_info(script_args, before, after, demo: bool, mixture: bool = False, args=None) -> dict:
    """What the model card needs from the command line: the data set and the held-out scores."""
    info = {  # (a `datasets:` mixture is trained on where a --dataset_name is given beside it: the card names none)
        "dataset_name": None if demo or mixture else script_args.dataset_name,
        "dataset_config": None if demo or mixture else script_args.dataset_config,
        "dataset_description": "trl-vapo's built-in arithmetic task (the offline demo)" if demo else None,
    }
    if before and after:
        settings = _report_sampling(args) if args is not None else []
        run = f" with the run's {', '.join(settings)}" if settings else ""
        split = "the demo's held-out split" if demo else f"the `{script_args.dataset_test_split}` split"
        own_code = " --trust_remote_code true" if args is not None and args.trust_remote_code else ""
        again = (
            f"`trl-vapo eval --model <this folder> --temperature 1.0 --top_p 1.0 --k {script_args.eval_k} "
            f"--num_prompts {before['num_problems'] + before.get('num_unscored', 0)}{own_code}` samples the same "
            "way: it reads the run's data and sampling settings"
        )
        if mixture:  # cut from the mixture at random (`test_split_size`): no data set eval can name
            split, again = "the data set mixture's test split", "a split `trl-vapo eval` cannot draw again"
        info["held_out"] = {
            "before": before,
            "after": after,
            "description": f"{before['num_problems']} problems of {split}, {script_args.eval_k} samples each at "
            f"temperature 1.0 and top_p 1.0{run} for avg@k ({again}), greedy for pass@1",
        }
        chosen = getattr(args, "load_best_model_at_end", False) and getattr(args, "eval_strategy", "no") != "no"
        if chosen and not demo:  # evaluations during training read the same split, the report's problems among them
            # (the demo's read 64 other problems of it)
            info["held_out"]["description"] += (
                "; the checkpoint scored after was chosen by evaluations on the same split (load_best_model_at_end), "
                "so the scores after it read high"
            )
    return info


def _resolve_data(script_args, model_args, training_args, demo: bool, mixture=None):
    """The model id and the prompt data sets the flags describe: to train on, to evaluate on during training (when
    `eval_strategy` or `eval_on_start` asks for it: `trl grpo` leaves it out for the latter, which fails after the
    models load), and for the held-out report (`eval_num_prompts`)."""
    evaluates = training_args.eval_strategy != "no" or training_args.eval_on_start
    if demo:
        from .demo import MODEL_DIR
        from .demo.data import build_split

        # The report's problems, then 64 others for the evaluations during training (drawn in order: the report's
        # are the first `eval_num_prompts` either way); they were the report's first 64, and a checkpoint chosen by
        # them (load_best_model_at_end, an early stop) scored high on the report.
        reported = script_args.eval_num_prompts or 0
        held_out = build_split("held_out", reported + 64)
        test = held_out.select(range(reported)) if reported else None
        during = held_out.select(range(reported, reported + 64)) if evaluates else None
        return str(MODEL_DIR), build_split("train", 4096), during, test
    if mixture is not None and mixture.datasets:
        return _resolve_mixture(script_args, model_args, mixture, evaluates, training_args.seed)

    from .data import BOXED_INSTRUCTION, PRESETS, load_prompt_dataset

    _check_data_flags(script_args)
    if script_args.dataset_preset is not None:
        preset = PRESETS[script_args.dataset_preset]
        given, script_args.dataset_name = script_args.dataset_name, script_args.dataset_name or preset.dataset_name
        if given in (None, preset.dataset_name):  # the preset's own set: its subset (a local copy has its own layout:
            script_args.dataset_config = script_args.dataset_config or preset.dataset_config  # `main` not found)
        # The preset's columns, unless the user named others (a local copy of the set with its columns renamed).
        defaults = {f.name: f.default for f in fields(VAPOScriptArguments)}
        for name in ("prompt_column", "answer_column"):
            if getattr(script_args, name) == defaults[name]:
                setattr(script_args, name, getattr(preset, name))
        script_args.prompt_template = script_args.prompt_template or "{{{}}}\n{}".format(
            script_args.prompt_column,
            BOXED_INSTRUCTION.replace("{}", "{{}}"),
        )
    chat = script_args.prompt_format == "chat"
    # A `prompt` column taken as it is, as `trl grpo` takes it: its text is the model's input, no chat template.
    as_trl = script_args.prompt_column == "prompt" and not (
        script_args.dataset_preset or script_args.prompt_template or script_args.system_prompt
    )
    # `trl grpo` passes every other column as the data set holds it, the gold answer too (a number stays one, which a
    # ported reward may compare as such); trl-vapo writes a named answer column as text (math-verify reads text).
    answer_column = script_args.answer_column
    if as_trl and answer_column == VAPOScriptArguments.answer_column:
        answer_column = None
    if script_args.prompt_format == "auto" and not as_trl:
        tokenizer = _tokenizer_of(model_args.model_name_or_path, model_args, training_args)
        chat = getattr(tokenizer, "chat_template", None) is not None

    from datasets.exceptions import DatasetGenerationError

    def load(split):
        import datasets

        datasets.disable_progress_bars()  # small prompt sets load in a blink; keep stderr for errors
        try:
            return load_prompt_dataset(
                script_args.dataset_name,
                split=split,
                dataset_config=script_args.dataset_config,
                prompt_column=script_args.prompt_column,
                answer_column=answer_column,
                prompt_template=script_args.prompt_template,
                system_prompt=script_args.system_prompt,
                chat=chat,
                streaming=script_args.dataset_streaming,
            )
        except (ValueError, FileNotFoundError, ConnectionError) as error:
            raise UsageError(str(error)) from None
        except DatasetGenerationError as error:  # a line that is not JSON, a column of mixed types, ...
            raise UsageError(_unreadable_data(script_args.dataset_name, error)) from None

    train = load(script_args.dataset_train_split)
    if script_args.prompt_format == "text" and isinstance(next(iter(train))["prompt"], list):
        raise UsageError(  # (they went through the chat template, whatever the flag said)
            f"--prompt_format text, but the {script_args.prompt_column!r} column of {script_args.dataset_name} holds "
            "chat messages, which the chat template formats: drop --prompt_format text, or pass a text column as "
            "--prompt_column"
        )
    test_split = None
    if evaluates or script_args.eval_num_prompts:
        splits = (script_args.dataset_train_split, script_args.dataset_test_split)
        if _test_split_is_the_training_one(script_args.dataset_name, *splits):
            raise UsageError(
                f"{script_args.dataset_name} is one file, so one split: its {splits[1]!r} split would be the training "
                "prompts. Pass a folder with a file per split (train.jsonl, test.jsonl), slices of its split "
                "(--dataset_train_split 'train[:90%]' --dataset_test_split 'train[90%:]'), or --dataset_test_split "
                f"{splits[0]} to score the training prompts"
            )
        test_split = load(script_args.dataset_test_split)
    return _data_sets(model_args.model_name_or_path, train, test_split, evaluates, script_args)


def _unreadable_data(name: str, error: Exception) -> str:
    """`datasets`' error for data it could not read, in a line: its message is generic, the cause is in
    `__cause__` (the file's parser's)."""
    cause = error.__cause__ or error
    return f"{name} cannot be read as a data set: {type(cause).__name__}: {' '.join(str(cause).split())[:500]}"


def _check_data_flags(script_args, mixture=None) -> None:
    """The data flags' values that name nothing, and with a `datasets:` mixture (`mixture`) those it cannot take
    (checked before a launch: each launched process said it)."""
    from .data import PRESETS, dataset_config_problem

    if problem := dataset_config_problem(script_args.dataset_name, script_args.dataset_config):
        raise UsageError(problem.replace("dataset_config", "--dataset_config", 1))
    if script_args.dataset_preset is not None and script_args.dataset_preset not in PRESETS:
        raise UsageError(f"unknown --dataset_preset {script_args.dataset_preset!r}; choose from {sorted(PRESETS)}")
    if script_args.prompt_format not in ("auto", "chat", "text"):
        raise UsageError(f"--prompt_format must be auto, chat or text, got {script_args.prompt_format!r}")
    if mixture is None or not mixture.datasets:
        # TRL's mixture flags, which `--help` lists beside trl-vapo's own: without a mixture they did nothing.
        unused = {
            "streaming": "--dataset_streaming",
            "test_split_size": "slices of a split (--dataset_train_split 'train[:90%]' --dataset_test_split "
            "'train[90%:]')",
        }
        given = [name for name in unused if getattr(mixture, name, None) not in (None, False)]
        if given:
            raise UsageError(
                f"--{given[0]} applies to a `datasets:` mixture in the --config file, and none is given: for "
                f"--dataset_name or --dataset_preset, use {unused[given[0]]}"
            )
        return
    if mixture.streaming and mixture.test_split_size is not None:
        raise UsageError(
            "test_split_size cannot split a streamed mixture (streaming: true): a stream has no train_test_split. "
            "Name a test split of each data set instead (`split:`), or stream without a test split"
        )
    loading = [f"--{name}" for name in ("dataset_config", "dataset_streaming") if getattr(script_args, name)]
    if loading:
        raise UsageError(
            f"{', '.join(loading)} load(s) --dataset_name; a `datasets:` mixture names each set's config (`name:`) "
            "and streams with `streaming: true` beside `datasets:`: move it into the mixture, or drop it"
        )


def _mixture_splits(mixture, seed: int):
    """TRL's `get_dataset` of a `datasets:` mixture, its test split (`test_split_size`) drawn with `seed` (numpy's
    global state restored): `train_test_split` without a seed draws one from numpy's global generator, which nothing
    seeded yet, so each process, and each resume, cut another split and trained on test rows of the others."""
    import numpy as np
    from datasets.exceptions import DatasetGenerationError
    from trl import get_dataset

    state = np.random.get_state()
    np.random.seed(seed)
    try:
        return get_dataset(mixture)
    except (ValueError, FileNotFoundError, ConnectionError) as error:
        raise UsageError(str(error)) from None
    except DatasetGenerationError as error:
        raise UsageError(_unreadable_data("the datasets: mixture", error)) from None
    finally:
        np.random.set_state(state)


def _resolve_mixture(script_args, model_args, mixture, evaluates: bool, seed: int):
    """`--datasets` (a `trl grpo` mixture, usually from the YAML config), loaded by TRL's `get_dataset` and used as
    `trl grpo` uses it: the rows as they are (a `prompt` column), the train and test splits by their names."""
    _check_data_flags(script_args, mixture)
    if script_args.dataset_name:
        logger.warning("Both `datasets` and `dataset_name` are given: `datasets` is used, as by `trl grpo`.")
    defaults = VAPOScriptArguments()
    flags = ("dataset_preset", "prompt_column", "answer_column", "prompt_template", "system_prompt", "prompt_format")
    formatting = [f"--{name}" for name in flags if getattr(script_args, name) != getattr(defaults, name)]
    if formatting:
        raise UsageError(
            f"{', '.join(formatting)} format(s) --dataset_name's rows; a `datasets:` mixture's rows are used as "
            "they are, as `trl grpo` uses them (a prompt column): drop the flag(s), or name the data in --dataset_name"
        )
    splits = _mixture_splits(mixture, seed)

    def split(name: str):
        if name not in splits:
            raise UsageError(f"the --datasets mixture has no split {name!r}; its splits are {sorted(splits)}")
        return splits[name]

    test_split = split(script_args.dataset_test_split) if evaluates or script_args.eval_num_prompts else None
    train = split(script_args.dataset_train_split)
    return _data_sets(model_args.model_name_or_path, train, test_split, evaluates, script_args)


def _data_sets(model_id: str, train, test_split, evaluates: bool, script_args):
    """What `_resolve_data` returns: the model id, the training prompts, the test split to evaluate on during
    training (when `eval_strategy` asks for it) and its first `eval_num_prompts` prompts for the held-out report."""
    report = None
    if test_split is not None and script_args.eval_num_prompts:
        from datasets import Dataset, IterableDataset

        if isinstance(test_split, IterableDataset):
            report = Dataset.from_list(list(test_split.take(script_args.eval_num_prompts)))
        else:
            report = test_split.select(range(min(len(test_split), script_args.eval_num_prompts)))
    return model_id, train, test_split if evaluates else None, report


def _check_model_source(name: str | None, flag: str, revision: str | None = None, where: dict | None = None) -> None:
    """A model the flag names is a local folder, in the Hugging Face cache, or on a Hub this machine reaches: one line
    saying which is not so, before anything loads (offline, transformers would retry for a minute, then raise
    through two tracebacks). A local path must be a model's folder (or a PEFT adapter's). `where`: the loading
    options that say where its files are, as `from_pretrained` reads them (`subfolder`, `cache_dir`, `token`)."""
    if not name:
        return
    where = where if isinstance(where, dict) else {}
    subfolder, cache_dir, token = (where.get(key) for key in ("subfolder", "cache_dir", "token"))
    folder = Path(name).expanduser()
    if folder.is_file():
        raise UsageError(f"{flag} {name} is a file: name the model's folder")
    if folder.is_dir() and subfolder:
        if not (folder / subfolder).is_dir():
            raise UsageError(f"{flag} {name} has no folder {subfolder} (model_init_kwargs' subfolder)")
        folder, name = folder / subfolder, f"{name} (subfolder {subfolder})"
    if folder.is_dir():  # (read before the Hub, as transformers reads it, where a Hub id names a local folder too)
        markers = ("config.json", "adapter_config.json")
        if not any((folder / marker).is_file() for marker in markers) and not any(folder.glob("*.gguf")):
            raise UsageError(
                f"{flag} {name} is a local folder but not a model's: it has no config.json (a model) nor "
                f"adapter_config.json (a PEFT adapter). Files there: {sorted(p.name for p in folder.iterdir())[:10]}"
            )
        return
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    from .hub import unreachable

    shown = f"{name} (subfolder {subfolder})" if subfolder else name  # (`hf download` takes the repository's id)
    try:
        markers = [f"{subfolder}/{f}" if subfolder else f for f in ("config.json", "adapter_config.json")]
        cached = (try_to_load_from_cache(name, f, cache_dir=cache_dir, revision=revision) for f in markers)
        if any(isinstance(path, str) for path in cached):  # a model, or a PEFT adapter
            return
    except HFValidationError:  # not of the form `owner/name`: a path
        raise UsageError(f"{flag} {name}: no such folder (a Hub id reads `owner/name`)") from None
    if constants.HF_HUB_OFFLINE:
        raise UsageError(
            f"{flag} {shown} is not a local folder and not in the Hugging Face cache, and HF_HUB_OFFLINE is set: "
            f"download it where the Hub is reachable (`hf download {name}`), or pass a local folder"
        )
    try:
        error = unreachable(name, "model", revision, token=token)
    except GatedRepoError:
        raise UsageError(f"{flag} {name} is gated: accept its terms on the Hub, then `hf auth login`") from None
    except RepositoryNotFoundError:
        raise UsageError(
            f"{flag} {name}: no such folder, and no such model on the Hub (a private one needs `hf auth login`)"
        ) from None
    except HfHubHTTPError:  # the Hub answered (a rate limit, a server error): loading says what it says
        return
    if error is not None:
        raise UsageError(
            f"{flag} {shown} is not a local folder and not in the Hugging Face cache, and the Hub cannot be reached "
            f"({type(error).__name__}: {str(error)[:120]}): download it where the Hub is reachable "
            f"(`hf download {name}`), or pass a local folder (HF_HUB_OFFLINE=1 runs offline from the cache)"
        )


def _reward_names(script_args) -> list[str]:
    """The reward functions asked for: `--reward_funcs`, by default VAPO's verifier `math_reward`, or none when a
    reward model is the reward source (as in `trl grpo`, which needs one or the other)."""
    if script_args.reward_funcs is not None:
        return script_args.reward_funcs
    return [] if script_args.reward_model_name_or_path else ["math_reward"]


def _resolve_rewards(names: list[str], max_completion_length: int | None = None, run_working_dir: str | None = None):
    """The reward functions `names` name; import paths to the user's own modules resolve from the working directory,
    then from `run_working_dir` (eval of a run trained elsewhere: where the run resolved them)."""
    from .rewards import get_reward_function

    if "get_soft_overlong_punishment" in names and max_completion_length not in (None, 1280):
        # Built for a 1,280-token budget: another never meets its ramp, cuts it short, or meets its -1 plateau.
        if max_completion_length <= 1024:
            effect = "never reaches them: it gives 0 to every completion"
        elif max_completion_length < 1280:
            effect = f"cuts its ramp short: a cut completion gets {(1024 - max_completion_length) / 256:g}, not -1"
        else:
            effect = "lets completions run on past 1,280 tokens, where it gives -1 (cancelling a correct answer)"
        logger.warning(
            f"get_soft_overlong_punishment is built as `trl grpo` builds it (max_completion_len=1280, "
            f"soft_punish_cache=256): it penalises completions beyond 1,024 tokens, and max_completion_length="
            f"{max_completion_length} {effect}. For another length, build it with "
            "trl.rewards.get_soft_overlong_punishment(max_completion_len=<max_completion_length>, ...) and pass it to "
            "VAPOTrainer in Python."
        )
    sys.path[:0] = [os.getcwd(), *([run_working_dir] if run_working_dir else [])]
    try:
        return [get_reward_function(name) for name in names]
    except ValueError as error:
        raise UsageError(str(error)) from None


def held_out_report_before_training(
    trainer, dataset, script_args, resume_from_checkpoint
) -> Callable[[], dict | None]:
    """The held-out report of the policy training starts from, read after `train()` (the function returned). Under
    DeepSpeed or FSDP it is taken as training begins (`on_train_begin`), once `train()` has placed the models: before
    that the policy is on the host (DeepSpeed and FSDP place it in `train()`), where a real model's sampling took hours
    on one thread a process. A resumed run's is taken now, before its checkpoint replaces the initial weights."""
    resuming = trainer.resume_point(resume_from_checkpoint)[0] is not None
    if dataset is None or resuming or not (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
        report = _held_out_report(trainer, dataset, script_args, trainer.reward_funcs)
        return lambda: report
    from transformers import TrainerCallback

    taken: dict[str, dict | None] = {}

    class HeldOutReportAtTrainBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if "report" not in taken:  # (a second `train()`, a resume after an error, starts from trained weights)
                taken["report"] = _held_out_report(trainer, dataset, script_args, trainer.reward_funcs)

    trainer.add_callback(HeldOutReportAtTrainBegin())
    return lambda: taken.get("report")


def _held_out_report(trainer, dataset, script_args, reward_funcs) -> dict | None:
    """avg@k, pass@k and the greedy pass@1 of the trainer's policy on `dataset`, on the main process (None on the
    others). With several processes each samples its share of the prompts where it holds the whole policy (the main
    process sampling them all, the others waited at training's first collective, whose timeout a long report
    overran). Every process evaluates the same prompts under DeepSpeed and FSDP (a reward model under ZeRO-3, and a
    sharded policy once placed, compute in collectives every process must join: shares of unequal size, or none,
    hung), and always with vLLM (a server gathers every process's requests; a tensor-parallel group samples
    together)."""
    if dataset is None:
        return None
    from .evaluation import evaluate_policy, random_state_kept
    from .generation import EngineSettings

    args, main = trainer.args, trainer.accelerator.is_main_process
    placed = trainer.models_placed
    # A transformers engine of its own, in batches of the sequences each process samples for a rollout, which the run
    # showed fit (`evaluate_policy`'s 64 could not on a GPU that held a rollout of 8: after the training run; the
    # demo's rollouts are 64); the engine left to the default is chosen as training's is
    sharded = trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled
    engine = EngineSettings.from_config(args).placed(trainer.accelerator.device.type, sharded, trainer.model)
    shared = not engine.holds_own_weights and not sharded  # each process its share of the prompts
    if engine.holds_own_weights:  # vLLM's copy of the policy: the trainer's engine, synced with it
        engine = trainer.generation_engine
        engine.sync_weights(trainer.state.global_step)

    @contextlib.contextmanager
    def unplaced_policy():  # under the run's autocast, as `_generation_model` samples once the models are placed:
        with trainer.accelerator.autocast():  # the report before training sampled a float32 policy (full fine-tuning
            yield trainer.actor_critic.policy  # keeps it so) in float32, the one after in bf16: two precisions

    # Training's random state kept: the report before training sampled from it, and the run trained on other
    # rollouts than the same command without the report.
    generation_model = trainer._generation_model() if placed else unplaced_policy()
    with generation_model as model, random_state_kept(trainer.accelerator.device):
        result = evaluate_policy(
            model,
            trainer.processing_class,
            dataset,
            reward_funcs,
            k=script_args.eval_k,
            temperature=1.0,
            top_p=1.0,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            max_new_tokens=args.max_completion_length,
            max_prompt_length=args.max_prompt_length,
            batch_size=args.per_device_train_batch_size * args.steps_per_generation,
            reward_weights=args.reward_weights,
            positive_reward_threshold=args.positive_reward_threshold,
            engine=engine,
            chat_template_kwargs=args.chat_template_kwargs,
            positive_reward_funcs=args.positive_reward_funcs,
            trainer_state=trainer.state,
            generation_kwargs=args.generation_kwargs,
            accelerator=trainer.accelerator if shared else None,
        )
    return result.as_dict() if main else None


def _summary(trainer, before, after, seconds, demo) -> str:
    from .model_card import format_finite, start_and_end_means  # as the model card's table takes them

    n, means = start_and_end_means(trainer.state.log_history, (REWARD, ACCURACY))
    lines = ["", "=" * 72, "trl-vapo " + ("demo " if demo else "") + "summary", "-" * 72]
    lines.append(
        f"steps            {trainer.state.global_step} "
        f"({trainer.progress.value_pretrain_rollouts} value-pretraining rollouts, then RL)"
    )
    lines.append(f"wall time        {seconds / 60:.1f} min")
    if n:
        (reward_start, reward_end), (accuracy_start, accuracy_end) = means[REWARD], means[ACCURACY]
        lines.append(
            f"train reward     {format_finite('{:+.3f}', reward_start)} -> {format_finite('{:+.3f}', reward_end)}   "
            f"(mean of the first -> last {n} RL logs)"
        )
        lines.append(
            f"train accuracy   {format_finite('{:.3f}', accuracy_start)} -> {format_finite('{:.3f}', accuracy_end)}"
        )
    if before and after:
        k = next(key for key in before if key.startswith("avg@"))
        lines.append(
            f"held-out {k:<8s} {before[k]:.3f} -> {after[k]:.3f}   (sampled at "
            f"{', '.join(['T=1', *_report_sampling(trainer.args)])}, {before['num_problems']} problems"
            + (f"; {before['num_unscored']} no reward scored, left out)" if before.get("num_unscored") else ")")
        )
        lines.append(f"held-out pass@1  {before['pass@1']:.3f} -> {after['pass@1']:.3f}   (greedy)")
        lines.append(f"mean length      {before['mean_length']:.1f} -> {after['mean_length']:.1f} tokens")
    lines.append(f"saved to         {Path(trainer.args.output_dir).resolve()}")
    lines.append("=" * 72)
    return "\n".join(lines)


def _without_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """`items` minus the ordered `subsequence` (the launcher's arguments, which the parser left over in order)."""
    remaining = iter(subsequence)
    current = next(remaining, None)
    kept = []
    for item in items:
        if current is not None and item == current:
            current = next(remaining, None)
        else:
            kept.append(item)
    return kept


def _forward_signals_to_children(signums=STOP_SIGNALS) -> dict:
    """Handlers that pass each of `signums` on to this process's children; returns the handlers they replace, for the
    caller to restore. With no child (yet), the signal acts as it would have without them: the previous handler is
    put back and the signal raised again.

    Why: with one process, `accelerate launch` waits on a child of its own and dies at the signal, leaving the child
    running; forwarded, the child stops as it would alone (with several, torch's launcher takes SIGTERM and SIGINT
    over once it starts its workers, and leaves SIGUSR1 to this handler, where it would die of it). Not on Windows,
    whose console gives Ctrl-C to every process attached to it, and where psutil could forward no other signal than
    SIGTERM (a TerminateProcess: no checkpoint)."""
    if os.name == "nt":
        return {}
    import psutil

    def forward(signum, frame):
        children = psutil.Process().children()
        if not children:
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in signums}
    return previous


LAUNCHED = "TRL_VAPO_LAUNCHED"
"""Set in the environment of the processes `_relaunch` starts."""

WORKERS_STOP_GRACE = 1800
"""Seconds torch's launcher gives its workers to stop after it forwards a stop signal before it kills them
(`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, 30 s by default: less than a rollout and its checkpoint take, so the stop lost
everything since the last checkpoint). The scheduler's own deadline (Slurm's `KillWait`, a pod's grace period) still
holds; a worker that does not stop is killed by it."""


def _relaunch(launch_args: list[str], training_args: list[str]) -> int:
    """Run this same command under `accelerate launch` with the given launcher arguments; its exit code is the
    workers' (128 + the signal's number after a stop on a stop signal, as one process's run)."""
    import subprocess

    from accelerate.commands.launch import launch_command
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = _launcher_in_one_line().parse_args(launch_args + ["-m", "trl_vapo.cli", "train", *training_args])
    marked = os.environ.get(LAUNCHED)
    os.environ[LAUNCHED] = "1"  # the launched processes inherit it; this one's is restored below
    # The workers' time to stop, where the user set none. (SIGUSR1, which torch's launcher does not take over, is
    # passed on by `_forward_signals_to_children`'s handler in this process, the launcher's.)
    added = {}
    if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ and "PET_SHUTDOWN_TIMEOUT" not in os.environ:
        added["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(WORKERS_STOP_GRACE)
    os.environ.update(added)
    previous = _forward_signals_to_children()
    try:
        launch_command(args)
    except (ImportError, ValueError) as error:  # accelerate's checks of its settings, before any process starts
        raise UsageError(f"accelerate launch: {' '.join(str(error).split())}") from None
    except subprocess.CalledProcessError as failed:  # one process
        return failed.returncode if failed.returncode > 0 else 128 - failed.returncode
    except ChildFailedError as failed:  # several: the first worker that failed
        code = failed.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code
    except SignalException as stopped:  # the launcher itself was signalled; its workers have stopped
        return 128 + int(stopped.sigval)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for name in added:
            os.environ.pop(name, None)
        if marked is None:
            os.environ.pop(LAUNCHED, None)  # a later command in this process (a notebook, a sweep) launches again
    return 0


# -------------------------------------------------------------------------------------------------------------- eval
@dataclass
class EvalArguments(VLLMOptions):
    """How `trl-vapo eval` samples and scores; the data flags are the same as `train`'s, vLLM's options training's (a
    training YAML's apply: its server, its structured-outputs regex, its context)."""

    model: str | None = field(
        default=None,
        metadata={
            "help": "Model folder or hub id (a PEFT adapter folder works too). `--model_name_or_path` is an alias; a "
            "config's `model_name_or_path` (the base a run trained from) is not read.",
            "aliases": ["--model_name_or_path"],
        },
    )
    num_prompts: int | None = field(
        default=None, metadata={"help": "Score the first N prompts only (the demo's task: 200 unless set)."}
    )
    k: int = field(default=32, metadata={"help": "Samples per prompt for avg@k and pass@k (paper: avg@32)."})
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature (paper: 1.0; a config's `temperature` applies)."}
    )
    top_p: float = field(default=0.7, metadata={"help": "Nucleus sampling (paper: 0.7; a config's `top_p` applies)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling, 0: off (the run's `top_k` applies)."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling, None: off (the run's applies)."})
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Repetition penalty, 1.0: none (the run's `repetition_penalty` applies)."}
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Prompts cut to their last N tokens, as training cut them (the run's applies); None: whole."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Weights of the reward functions, as in training (a config's `reward_weights` applies)."},
    )
    max_completion_length: int = field(
        default=1024,
        metadata={
            "help": "Maximum number of generated tokens per completion; a training YAML's value applies, so that "
            "evaluation cuts completions where training did (training's default is 512). `--max_new_tokens` is an "
            "alias.",
            "aliases": ["--max_new_tokens"],
        },
    )
    batch_size: int = field(
        default=64,
        metadata={
            "help": "Sequences generated at once: the batch of generate() and of the static-cache engine, vLLM's "
            "max_num_seqs (continuous batching schedules its own)."
        },
    )
    use_transformers_continuous_batching: bool = field(
        default=False, metadata={"help": "Sample with transformers' continuous-batching engine, as in training."}
    )
    transformers_continuous_batching_config: str | None = field(
        default=None, metadata={"help": "JSON keyword arguments of transformers' ContinuousBatchingConfig."}
    )
    use_static_cache_engine: bool | None = field(
        default=None,
        metadata={
            "help": "Sample with trl-vapo's static-cache engine, as in training. None (default): on a CUDA GPU for "
            "an unquantized model, generate() elsewhere (VAPOConfig's field says more)."
        },
    )
    static_cache_compile: bool = field(
        default=False,
        metadata={"help": "Compile the static-cache engine's decode step with torch.compile, as in training."},
    )
    use_vllm: bool = field(default=False, metadata={"help": "Sample with vLLM (`pip install vllm`), as in training."})
    use_cpu: bool = field(
        default=False,
        metadata={"help": "Score on the CPU where an accelerator (CUDA, MPS, XPU) is present (TrainingArguments')."},
    )
    positive_reward_threshold: float = field(default=0.5, metadata={"help": "Reward counted as correct."})
    positive_reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "The reward functions that judge correctness, as in training (a config's "
            "`positive_reward_funcs` applies). Default: all of them."
        },
    )
    seed: int = field(default=0, metadata={"help": "Sampling seed."})
    chat_template_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "The chat template's keyword arguments as JSON, as in training (a config's "
            "`chat_template_kwargs` applies), e.g. '{\"enable_thinking\": false}'."
        },
    )
    generation_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "Generation settings as JSON, as in training (a config's `generation_kwargs` applies): where "
            "completions end (stop_strings, eos_token_id, min_new_tokens) as training's did, e.g. "
            '\'{"stop_strings": ["</answer>"]}\'.'
        },
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow the model's own Python code."})
    use_safetensors: bool = field(
        default=True,
        metadata={
            "help": "Load the model's safetensors weights only, as training does: unpickling a `pytorch_model.bin` "
            "can run any code in it. false loads a model saved only so, if you trust it. (An adapter's own file "
            "loads either way: peft reads a `.bin` with torch's weights-only loader.)"
        },
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "The dtype the model loads and samples in (training's `--dtype`; a training config's applies): "
            "unset, the checkpoint's own (what training saved). float16 on a GPU without bf16 (T4, V100), float32 on "
            "a CPU without bf16 arithmetic, where bf16 is slow.",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )
    output_json: str | None = field(default=None, metadata={"help": "Also write the scores to this file."})

    def __post_init__(self):
        check_number_fields(self)  # a YAML `k: null` or `num_prompts: 8.0`: one line, before any model loads
        self.reward_weights = number_list(self.reward_weights, "reward_weights")  # a YAML list's `1e-1` is text


TRAIN_ONLY = {
    "dataset_train_split",
    "dataset_streaming",
    "value_model_name_or_path",
    "eval_num_prompts",
    "eval_k",
    "ignore_bias_buffers",
}
"""`VAPOScriptArguments` fields that only `train` reads: a training YAML's keys that `eval` accepts and ignores."""


EVAL_FROM_RUN_CONFIG = (
    "max_completion_length",
    "max_prompt_length",
    "temperature",
    "top_k",
    "min_p",
    "repetition_penalty",
    "reward_weights",
    "positive_reward_funcs",
    "positive_reward_threshold",
    "chat_template_kwargs",
    "generation_kwargs",
)
RUN_DATA = (
    "dataset_name",
    "dataset_config",
    "dataset_test_split",
    "dataset_preset",
    "prompt_column",
    "answer_column",
    "prompt_template",
    "system_prompt",
    "prompt_format",
)
RUN_REWARDS = ("reward_funcs", "reward_model_name_or_path")
RUN_REWARD_SETTINGS = ("reward_weights", "positive_reward_funcs")  # (in EVAL_FROM_RUN_CONFIG: they name RUN_REWARDS)
"""What `eval` takes from the run that saved `--model` (`vapo_config.json`'s EVAL_FROM_RUN_CONFIG, and
`vapo_script_args.json`'s RUN_DATA and RUN_REWARDS: `checkpoint.RUN_DATA_FILE`), so that it scores as training
sampled and scored: not `top_p` (the paper evaluates at 0.7, the run's 1.0 is a default a config cannot tell from a
choice) nor `k`."""


def _run_settings(argv: list[str]) -> tuple[dict, list[Path]]:
    """The settings of the trl-vapo run whose output `--model` names (its folder, or for a checkpoint its folder
    and the run's output_dir above it), as eval's defaults, and the files they came from. A data set named here (flag
    or config) takes none of the run's data settings; reward functions named here none of its rewards, weights and
    positive functions (which count and name the run's functions, and come only with them).
    """
    from .checkpoint import RUN_CONFIG_FILE, RUN_DATA_FILE

    flags, config = _given(argv)
    config = config or {}
    model = flags.get("model") or flags.get("model_name_or_path") or config.get("model")  # (a config's
    if not isinstance(model, str):  # model_name_or_path is the base it trained from)
        return {}, []
    if Path(model).expanduser().is_dir():
        folder = Path(model).expanduser().resolve()  # (`--model .` in a checkpoint's folder: named "checkpoint-N")
        places = [folder, folder.parent] if folder.name.startswith("checkpoint-") else [folder]
        # Both files from the one save that wrote them: a checkpoint holds its config, and its data flags where
        # `trl-vapo train` saved it (one from Python has none, and the run folder's may be an earlier run's).
        place = next((place for place in places if (place / RUN_CONFIG_FILE).is_file()), places[-1])
        found = {name: place / name if (place / name).is_file() else None for name in (RUN_DATA_FILE, RUN_CONFIG_FILE)}
    else:  # a model on the Hub: `push_to_hub` uploads both files with it (the model card's eval command reads them)
        from .loading import hub_file

        found = {name: hub_file(model, name) for name in (RUN_DATA_FILE, RUN_CONFIG_FILE)}
    data = json.loads(found[RUN_DATA_FILE].read_text(encoding="utf-8")) if found[RUN_DATA_FILE] else {}
    run_config = json.loads(found[RUN_CONFIG_FILE].read_text(encoding="utf-8")) if found[RUN_CONFIG_FILE] else {}
    named = {*flags, *config}
    takes_data = not named & {"dataset_name", "dataset_preset"}
    formatting = ("prompt_template", "system_prompt")
    if not takes_data and (left := {key: data[key] for key in formatting if data.get(key) and key not in named}):
        print(  # (the named data set may have other columns: said, not applied)
            "trl-vapo eval: the run formatted its prompts with "
            + ", ".join(f"--{key} {value!r}" for key, value in left.items())
            + ", not applied to the data set named here: pass them to score its prompts as the run's were",
            file=sys.stderr,
        )
    takes_rewards = bool(data) and not named & set(RUN_REWARDS)
    keys = [key for key in EVAL_FROM_RUN_CONFIG if takes_rewards or key not in RUN_REWARD_SETTINGS]
    settings = {key: run_config[key] for key in keys if key in run_config}
    keys = (RUN_DATA if takes_data else ()) + (RUN_REWARDS if takes_rewards else ())
    settings.update({key: data[key] for key in keys if key in data})
    if data.get("mixture") and takes_data:
        settings["mixture"] = True
    if takes_rewards and data.get("working_dir"):
        settings["working_dir"] = data["working_dir"]
    if takes_data and data.get("dataset_train_split"):  # (not a default: eval takes no training split)
        settings["train_split"] = data["dataset_train_split"]
    return settings, [path for path in found.values() if path is not None]


def eval_command(argv: list[str]) -> int:
    from trl import TrlParser

    parser = _in_one_line(TrlParser((VAPOScriptArguments, EvalArguments), prog="trl-vapo eval", allow_abbrev=False))
    # The run's own settings are the defaults (a training YAML given with --config, then the flags, override them).
    run_settings, run_files = _run_settings(argv)
    trained_on_mixture = run_settings.pop("mixture", False)
    run_train_split = run_settings.pop("train_split", None)  # the run's, which its own test split may be
    run_working_dir = run_settings.pop("working_dir", None)  # the run's rewards' modules resolve from there too
    parser.set_defaults(**run_settings)
    for action in parser._actions:
        if action.dest in TRAIN_ONLY:  # accepted from a training YAML, never read here: not in eval's help
            action.help = argparse.SUPPRESS
        elif action.dest == "dataset_test_split":  # its help is training's
            action.help = "The split scored (a single local file is read whole, as this split)."
        elif action.dest == "dataset_name":  # (training's says to omit it with the model for the demo)
            action.help = (
                "Hub data set name, or a local .json/.jsonl/.csv/.parquet file or folder, to score. Omitted: the "
                "run's own (its settings, saved beside --model), else the offline demo's held-out problems."
            )
    given = [arg.split("=", 1)[0] for arg in argv if arg.startswith("--")]
    training_flags = [flag for flag in given if flag[2:].replace("-", "_") in TRAIN_ONLY]
    if training_flags:
        raise UsageError(
            f"{', '.join(training_flags)}: a `trl-vapo train` flag, which eval does not read (eval scores "
            "--dataset_test_split; its own flags: `trl-vapo eval --help`)"
        )
    script, args, config_remaining, cli_remaining = _parse_args_and_config(parser, argv)
    unknown = [arg for arg in cli_remaining if arg.startswith("-")]
    # A training YAML works as is: its training-only keys (learning_rate, lora_r, ...) are left for `train`, and
    # only keys that neither command knows are errors.
    # Its launcher keys (num_processes: 2) too: eval runs in one process.
    if config_remaining:
        train_dests = {action.dest for action in (*_parser()._actions, *_launcher_in_one_line()._actions)}
        train_dests.add("accelerate_config")
        unknown += [arg for arg in config_remaining if arg.startswith("--") and arg[2:] not in train_dests]
    if unknown:
        raise UsageError(f"unrecognized argument(s): {' '.join(unknown)} (see `trl-vapo eval --help`)")
    if stray := [arg for arg in cli_remaining if not arg.startswith("-")]:  # `--k 8 16`: the 16
        raise UsageError(
            f"unexpected argument {stray[0]!r}: every value follows its flag (see `trl-vapo eval --help`)"
        )
    if "--datasets" in config_remaining and script.dataset_name is None and script.dataset_preset is None:
        raise UsageError(
            "the config's datasets: mixture is for training; eval scores one data set: pass --dataset_name (and "
            "--dataset_test_split)"
        )  # (with one named, the mixture is a training key, left to `train` as the others)
    if not args.model:
        raise UsageError("--model is required: the folder or hub id of the model to score")
    if trained_on_mixture and script.dataset_name is None and script.dataset_preset is None:
        raise UsageError(
            f"{args.model} was trained on a data set mixture (datasets:); eval scores one data set: pass "
            "--dataset_name (or --dataset_preset)"
        )
    _check_eval_numbers(args)
    run_file = run_settings.get("dataset_name")
    if run_file and run_file == script.dataset_name:
        train_split = run_train_split or script.dataset_train_split
        if _test_split_is_the_training_one(run_file, train_split, script.dataset_test_split):  # (the run: if told so)
            raise UsageError(
                f"{run_file} (the run's data) is one file, so one split: its {script.dataset_test_split!r} split "
                "would be the training prompts. Pass --dataset_name with held-out problems, or --dataset_test_split "
                f"{train_split} to score the training prompts"
            )
    if run_files:
        taken = ", ".join(f"{key}={value!r}" for key, value in run_settings.items() if value is not None)
        print(
            f"trl-vapo eval: the run's settings ({', '.join(map(str, run_files))}) unless given: {taken}",
            file=sys.stderr,
        )
    # The JSON flags as mappings, once, for every reader (a YAML config's are mappings already).
    from .config import DICT_FIELD_EXAMPLES

    for name in JSON_FLAGS:
        setattr(args, name, _json_object(getattr(args, name), f"--{name}", DICT_FIELD_EXAMPLES[name]))
    greedy = args.temperature == 0 or (args.generation_kwargs or {}).get("do_sample") is False
    if args.use_vllm and args.vllm_mode == "server" and greedy and args.k > 1:  # (training refuses it too)
        raise UsageError(
            f"greedy sampling (--temperature 0) with a vLLM server and --k {args.k}: vLLM refuses n > 1 under greedy "
            "sampling ('n must be 1 when using greedy sampling'), and the k samples would be identical anyway: pass "
            "--k 1, or a temperature > 0"
        )
    _check_model_source(args.model, "--model")
    tokenizer_source, tokenizer_revision = _tokenizer_source(args.model, "--model")
    _check_model_source(script.reward_model_name_or_path, "--reward_model_name_or_path")
    if args.output_json and Path(args.output_json).is_dir():
        raise UsageError(f"--output_json {args.output_json} is a folder: name a file")
    if args.output_json:  # written after the whole evaluation: a file or folder it cannot be written in said first
        target = Path(args.output_json).absolute()
        if target.exists():  # (a file one may write, whatever its folder: /dev/stdout, a shell's /dev/fd/63)
            if not os.access(target, os.W_OK):
                raise UsageError(f"--output_json {args.output_json} is not writable")
        else:
            above = next(p for p in target.parents if p.exists())
            if not above.is_dir() or not os.access(above, os.W_OK | os.X_OK):
                why = "a file" if not above.is_dir() else "not writable"
                raise UsageError(f"--output_json {args.output_json}: {above} is {why}: the scores cannot be written")
    from .generation import EngineSettings, build_engine, check_engine_available, colocated_vllm_seed_problem

    try:
        engine_settings = EngineSettings.from_eval_args(args)
        check_engine_available(engine_settings)
    except (ImportError, ValueError) as error:
        raise UsageError(str(error)) from None
    seeded = (
        args.use_vllm
        and args.vllm_mode == "colocate"
        and colocated_vllm_seed_problem(engine_settings.sampling.generation_kwargs, args.k)
    )
    if seeded:
        raise UsageError(seeded)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluation import evaluate_policy
    from .loading import is_saved_adapter
    from .pretrained import load_pretrained

    reward_funcs = _resolve_rewards(_reward_names(script), args.max_completion_length, run_working_dir)
    _check_reward_settings(reward_funcs, script.reward_model_name_or_path, args)  # before any model loads
    if script.reward_model_name_or_path:  # scored as in training (loaded as `VAPOTrainer` loads it)
        from .config import VAPOConfig
        from .scoring import load_reward_models

        settings = VAPOConfig(
            output_dir=".",
            report_to="none",
            trust_remote_code=args.trust_remote_code,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        reward_funcs = load_reward_models([script.reward_model_name_or_path, *reward_funcs], None, settings)
    demo_data = script.dataset_name is None and script.dataset_preset is None
    if demo_data:
        from .demo.data import build_split

        try:
            dataset = build_split("held_out", args.num_prompts or 200)
        except ValueError as error:  # more problems than the split has
            raise UsageError(f"--num_prompts {args.num_prompts}: {error}") from None
        print(  # a model trained on another task (its folder without the run's settings) is scored on this one
            "trl-vapo eval: no data set named (--dataset_name, --dataset_preset, or the run's settings): scoring the "
            "offline demo's held-out arithmetic problems",
            file=sys.stderr,
        )
    else:
        from trl import ModelConfig

        from .config import VAPOConfig

        script.dataset_train_split = script.dataset_test_split or "test"
        script.dataset_streaming = False  # a training config's: eval selects and scores a whole split
        _, dataset, _, _ = _resolve_data(  # (prompts formatted with the chat template of the tokenizer's model)
            script,
            ModelConfig(model_name_or_path=tokenizer_source, model_revision=tokenizer_revision),
            VAPOConfig(output_dir=".", report_to="none", trust_remote_code=args.trust_remote_code),
            demo=False,
        )
        if args.num_prompts:
            dataset = dataset.select(range(min(args.num_prompts, len(dataset))))

    # A saved adapter, local or on the Hub, loads its base at the revision the adapter names (read as a model, a Hub
    # adapter's base was its default branch's).
    if is_saved_adapter(args.model, {}):
        from peft import AutoPeftModelForCausalLM as model_class
    else:
        model_class = AutoModelForCausalLM
    try:
        kwargs = {"trust_remote_code": args.trust_remote_code, "use_safetensors": args.use_safetensors}
        model = load_pretrained(model_class, args.model, {**kwargs, "dtype": args.dtype or "auto"})
    except (OSError, ValueError) as error:  # an adapter whose base is not here, a folder without weights: a traceback
        raise UsageError(f"--model {args.model} does not load: {' '.join(str(error).split())}") from None
    # As training picks: an accelerator present here (CUDA, MPS, XPU, ...), not merely built into torch, unless
    # `--use_cpu`; else the CPU.
    device = (not args.use_cpu and torch.accelerator.current_accelerator(check_available=True)) or torch.device("cpu")
    model.to(device)
    for reward_model in (f for f in reward_funcs if isinstance(getattr(f, "model", None), torch.nn.Module)):
        reward_model.model.to(device)  # beside the policy (it loaded on the CPU)
        reward_model.device = device
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_source, revision=tokenizer_revision, trust_remote_code=args.trust_remote_code
    )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The engine left to the default is chosen as training chooses it (the static-cache one on a CUDA GPU).
    engine = build_engine(engine_settings.placed(device.type, False, model), model, tokenizer)
    engine.sync_weights()  # vLLM loads the checkpoint by name (an adapter's base): the weights evaluated go to it
    # After the engine's start, which for vLLM seeds torch with its own seed (`LLM(seed=...)`): seeded before it,
    # every --seed sampled the same completions.
    torch.manual_seed(args.seed)
    result = evaluate_policy(
        model,
        tokenizer,
        dataset,
        reward_funcs,
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_new_tokens=args.max_completion_length,
        max_prompt_length=args.max_prompt_length,
        batch_size=args.batch_size,
        reward_weights=args.reward_weights,
        positive_reward_threshold=args.positive_reward_threshold,
        engine=engine,
        chat_template_kwargs=args.chat_template_kwargs,
        positive_reward_funcs=args.positive_reward_funcs,
        generation_kwargs=args.generation_kwargs,
    ).as_dict()
    # What was scored and how, beside the scores (the run's settings among them: told on stderr alone, they were
    # lost with it): two evaluations compare only under the same settings.
    sampling = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length")
    judging = ("reward_weights", "positive_reward_funcs", "positive_reward_threshold")
    prompts = ("max_prompt_length", "chat_template_kwargs", "generation_kwargs")
    result["settings"] = {
        "model": args.model,
        "data": "the offline demo's held-out problems" if demo_data else script.dataset_name or script.dataset_preset,
        "data_config": None if demo_data else script.dataset_config,
        "split": None if demo_data else script.dataset_test_split,
        "num_prompts": len(dataset),
        "k": args.k,
        "pass@1": "greedy",
        **{name: getattr(args, name) for name in (*sampling, *prompts)},
        "rewards": [name for name in (script.reward_model_name_or_path, *_reward_names(script)) if name],
        **{name: getattr(args, name) for name in judging},
        "seed": args.seed,
        "engine": type(engine).__name__,
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    text = scores_json(result)
    print(text)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(text)
    return 0


def scores_json(scores: dict[str, float]) -> str:
    """`trl-vapo eval`'s scores as strict JSON: a score that nothing was judged for (NaN) is null, which every JSON
    parser reads (`NaN`, what `json.dumps` writes, is Python's own)."""
    from .diagnostics import strict_json

    return strict_json(scores, indent=2)


JSON_FLAGS = ("chat_template_kwargs", "generation_kwargs", "transformers_continuous_batching_config")
"""`trl-vapo eval`'s flags that take a JSON object (each one's example: `config.DICT_FIELD_EXAMPLES`)."""


def _json_object(value, flag: str, example: str) -> dict | None:
    """A flag's JSON object (a YAML config's mapping as it is), or a one-line error."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise UsageError(f"{flag} is not JSON ({error}): e.g. '{example}'") from None
    if value is not None and not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object, got {value!r}: e.g. '{example}'")
    return value


def _check_eval_numbers(args) -> None:
    """Each number `eval` reads in its range, before any model loads."""
    problems = [
        f"--{name} must be {rule}, got {value}"
        for name, value, ok, rule in (
            ("k", args.k, args.k >= 1, ">= 1"),
            ("num_prompts", args.num_prompts, args.num_prompts is None or args.num_prompts >= 1, ">= 1"),
            ("temperature", args.temperature, args.temperature >= 0, ">= 0 (0: greedy)"),
            ("top_p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
            ("top_k", args.top_k, args.top_k is None or args.top_k >= 0, ">= 0 (0: off)"),
            ("min_p", args.min_p, args.min_p is None or 0 <= args.min_p <= 1, "in [0, 1] or None"),
            ("repetition_penalty", args.repetition_penalty, args.repetition_penalty > 0, "> 0 (1.0: none)"),
            ("max_completion_length", args.max_completion_length, args.max_completion_length >= 1, ">= 1"),
            (
                "max_prompt_length",
                args.max_prompt_length,
                args.max_prompt_length is None or args.max_prompt_length >= 1,
                ">= 1 or None",
            ),
            ("batch_size", args.batch_size, args.batch_size >= 1, ">= 1"),
        )
        if not ok
    ]
    if problems:
        raise UsageError("; ".join(problems))


def _test_split_is_the_training_one(dataset_name: str, train_split: str, test_split: str) -> bool:
    """Whether `test_split` of the data set `dataset_name` names its training prompts: a file is one split, and
    another name reads that split again; only slices of it chosen apart (`train[:90%]` and `train[90%:]`) differ."""
    sliced = "[" in train_split and "[" in test_split
    return Path(dataset_name).expanduser().is_file() and test_split != train_split and not sliced


def _policy_lookup(model_args, training_args) -> dict[str, typing.Any]:
    """Where `trl-vapo train` looks the policy's files up, as the trainer loads it: model_init_kwargs' `revision`,
    `subfolder`, `cache_dir`, `token`... (`pretrained.LOOKUP_KWARGS`), `--model_revision` unless they name one."""
    from .pretrained import LOOKUP_KWARGS

    init = training_args.model_init_kwargs if isinstance(training_args.model_init_kwargs, dict) else {}
    given = {"revision": model_args.model_revision, **init}
    return {key: value for key, value in given.items() if key in LOOKUP_KWARGS}


def _tokenizer_of(model: str, model_args, training_args):
    """The tokenizer `trl-vapo train` trains `model` with, looked up as the trainer looks it up
    (`loading.policy_tokenizer`: where the policy loads from, with `--model_revision` and model_init_kwargs'
    `revision`, `subfolder`, `cache_dir`, `token`...; for a PEFT adapter folder saved without one, its base model's),
    after the command's checks of that base (`_tokenizer_source`)."""
    from .loading import policy_tokenizer

    where = _policy_lookup(model_args, training_args)
    _tokenizer_source(model, "--model_name_or_path", where)
    try:
        return policy_tokenizer(model, model, training_args, where)
    except (ValueError, OSError) as error:  # a folder saved without its tokenizer: transformers' error, a traceback
        said = " ".join(str(error).split())
        raise UsageError(f"--model_name_or_path {model}: its tokenizer does not load: {said}") from None


def _tokenizer_source(model: str, flag: str, where: dict | None = None) -> tuple[str, str | None]:
    """Where `model`'s tokenizer is, and at which revision: the folder itself (or the Hub id) at `where`'s revision,
    or for a PEFT adapter saved without one (peft's `save_pretrained` and `push_to_hub`), its base model at the
    revision its `adapter_config.json` (`where`'s: `revision`, `subfolder`...) names, checked as `flag`'s model was
    (`_check_model_source`)."""
    from .loading import adapter_base_of

    try:
        base = adapter_base_of(model, where)
    except ValueError as error:
        raise UsageError(f"{flag} {error}") from None
    if base is None:
        return model, (where or {}).get("revision")
    _check_model_source(
        base[0], f"the adapter's base model (base_model_name_or_path in {model}/adapter_config.json)", base[1]
    )
    return base


def plot_command(argv: list[str]) -> int:
    """`trl-vapo plot OUTPUT_DIR`: redraw the diagnostic PNGs of a finished or running run from its logs."""
    parser = argparse.ArgumentParser(prog="trl-vapo plot", description=plot_command.__doc__)
    parser.add_argument("output_dir", help="the output_dir of a trl-vapo run (it holds vapo_logs.jsonl)")
    args = parser.parse_args(argv)
    from .diagnostics import write_plots

    try:
        paths = write_plots(args.output_dir)
    except (OSError, ValueError) as error:  # no such run, a damaged log, a plots/ that is a file
        raise UsageError(str(error)) from None
    except ImportError:
        raise UsageError("plots need matplotlib: pip install matplotlib") from None
    for path in paths:
        print(path)
    return 0


# -------------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": train_command, "eval": eval_command, "plot": plot_command}
    if not argv or argv[0] not in commands:
        parser = argparse.ArgumentParser(prog="trl-vapo", description="VAPO training for the Hugging Face TRL stack.")
        parser.add_argument("--version", action="version", version=f"trl-vapo {__version__}")
        parser.add_argument(
            "command",
            choices=sorted(commands),
            help="train: train (no arguments: the offline demo); eval: score a model; plot: redraw a run's plots",
        )
        if not argv:  # as `trl` alone: the help, not an error
            parser.print_help()
            return 0
        parser.parse_args(argv)
        return 2
    try:
        _apply_config_env(argv[1:])
        return commands[argv[0]](argv[1:])
    except UsageError as error:
        print(f"trl-vapo {argv[0]}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
