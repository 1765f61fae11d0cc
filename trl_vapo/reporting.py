"""What a user sees while a run trains: the completions table and the phase on the progress bar.

The completions table follows TRL's `log_completions` (GRPOTrainer): at each logging step, a sample of the latest
rollout's prompts and completions with each reward function's score, printed with `rich` when it is installed and
logged as a table to wandb / trackio when those are among `report_to`. Ours adds the columns only a value-based
method has: the completion's mean advantage and the critic's value at its first and last token.

Everything here but `MetricsMixin` takes plain lists (or, in `completion_token_stats`, the rollout's tensors), so the
tests exercise it without a training run. `MetricsMixin` is the trainer's side: the metrics each rollout and step
record, averaged into each log, and GRPOTrainer's `_logs`.
"""

from __future__ import annotations

import math
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from accelerate.utils import gather_object
from transformers.trainer_callback import ProgressCallback

from .diagnostics import LOG_FILE, strict_json
from .metric_names import RL, VALUE_PRETRAIN

# Column names of the table, after the reward functions' own columns.
PROMPT, COMPLETION, STEP = "prompt", "completion", "step"
SEQUENCE_REWARD, ADVANTAGE, VALUE_FIRST, VALUE_LAST = "reward", "advantage", "value_first", "value_last"
_RESERVED = {STEP, PROMPT, COMPLETION, SEQUENCE_REWARD, ADVANTAGE, VALUE_FIRST, VALUE_LAST}
MISSING = "-"  # how a reward no function gave (None / NaN) or an undefined statistic is printed

# Step metrics that are not token means: GRPOTrainer's extremes, over the step's sequences on every process (its are
# over each micro-batch's, averaged: a reading that would change with the micro-batches' size and the processes), and
# its mean over sequences.
STEP_EXTREMES = {"clip_ratio/low_min": torch.amin, "clip_ratio/high_max": torch.amax}
SEQUENCE_MEANS = {"vespo/phi_seq_mean"}

# What the progress bar says in each phase of `TrainingProgress.phase`.
PHASE_LABELS = {VALUE_PRETRAIN: "value pretraining", RL: "RL"}


# ---------------------------------------------------------------------------------------------------------------------
# The completions table
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class CompletionsTable:
    """One logging step's completions: `columns` maps each column name to one value per completion.

    Columns, in order: `prompt`, `completion` (a string, or chat messages), one column per reward function
    (its name; `rewards/<name>` if the name is one of the fixed columns), `reward` (the weighted sequence reward),
    `advantage` (the mean advantage over the completion's tokens; absent during value pretraining), `value_first` and
    `value_last` (the critic's value at the first and last completion token). Numbers are floats, or None where the
    reward functions gave no score or the statistic is undefined. `step` titles the printout and fills the `step`
    column the trackers' table starts with: set it to the logging step when the table is reported.
    """

    step: int
    columns: dict[str, list[Any]]
    reward_columns: list[str] = field(default_factory=list)
    phase: str | None = None
    # Columns reward functions logged with `log_extra` (TRL's protocol): in the trackers' table, not the printout.
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def title(self) -> str:
        label = PHASE_LABELS.get(self.phase, self.phase)
        return f"Step {self.step}" + (f" ({label})" if label else "")

    def __len__(self) -> int:
        return len(self.columns[PROMPT])

    def select(self, limit: int | None) -> CompletionsTable:
        """At most `limit` rows (None: all), chosen at random but reproducibly (seeded by the step), in their
        original order so a prompt's group of completions stays together."""
        return self._rows(sample_rows(len(self), limit, seed=self.step))

    def unique_prompts(self) -> CompletionsTable:
        """Each prompt's first row only (GRPOConfig's `log_unique_prompts`)."""
        first = {entry_text(prompt): i for i, prompt in reversed(list(enumerate(self.columns[PROMPT])))}
        return self._rows(sorted(first.values()))

    @classmethod
    def concatenate(cls, tables: Sequence[CompletionsTable]) -> CompletionsTable:
        """The rows of `tables` (one step's, e.g. every process's share of a rollout) in order, as one table; an extra
        column that some table lacks is None in its rows, as GRPOTrainer pads a process's share that lacks it (left
        out, a column one process logged vanished from a run on several)."""
        first = tables[0]
        columns = {name: [v for table in tables for v in table.columns[name]] for name in first.columns}
        names = list(dict.fromkeys(name for table in tables for name in table.extra_columns))
        extra = {
            name: [v for table in tables for v in table.extra_columns.get(name, [None] * len(table))] for name in names
        }
        return cls(first.step, columns, first.reward_columns, first.phase, extra)

    def _rows(self, rows: list[int]) -> CompletionsTable:
        columns = {name: [values[i] for i in rows] for name, values in self.columns.items()}
        extra = {name: [values[i] for i in rows] for name, values in self.extra_columns.items()}
        return CompletionsTable(self.step, columns, self.reward_columns, self.phase, extra)

    def text_columns(self) -> dict[str, list[Any]]:
        """`step` and the columns, with prompts and completions as plain text: what a tracker's table stores."""
        columns = {STEP: [self.step] * len(self), **self.columns, **self.extra_columns}
        columns[PROMPT] = [entry_text(x) for x in columns[PROMPT]]
        columns[COMPLETION] = [entry_text(x) for x in columns[COMPLETION]]
        return columns

    def to_dataframe(self):
        """A pandas DataFrame of `text_columns()` (missing numbers become NaN), as TRL logs to wandb / trackio."""
        import pandas as pd

        frame = pd.DataFrame(self.text_columns())
        numeric = [name for name in self.columns if name not in (PROMPT, COMPLETION)]
        frame[numeric] = frame[numeric].astype(float)  # None -> NaN, so every tracker reads numbers
        return frame


def build_completions_table(
    *,
    step: int,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    rewards: dict[str, Sequence[float | None]],
    sequence_rewards: Sequence[float | None],
    advantages: Sequence[float | None] | None = None,
    first_values: Sequence[float | None] | None = None,
    last_values: Sequence[float | None] | None = None,
    phase: str | None = None,
    extra_columns: dict[str, Sequence[Any]] | None = None,
) -> CompletionsTable:
    """Assemble the table of one logging step from plain per-completion lists.

    `rewards` maps each reward function's name to its scores (None or NaN where it had no opinion); pass
    `advantages=None` during value pretraining, where there are none. Every list must have one entry per prompt.
    `extra_columns`: what reward functions logged with `log_extra`; one whose length is not one per prompt is left
    out (a function that logged it twice, say), one named as a column of the table's own is
    `rewards/log_extra/<name>`.
    """
    n = len(prompts)
    lists = {COMPLETION: completions, SEQUENCE_REWARD: sequence_rewards}
    lists.update({f"rewards[{name!r}]": scores for name, scores in rewards.items()})
    optional = {ADVANTAGE: advantages, VALUE_FIRST: first_values, VALUE_LAST: last_values}
    lists.update({k: v for k, v in optional.items() if v is not None})
    wrong = {name: len(values) for name, values in lists.items() if len(values) != n}
    if wrong:
        raise ValueError(f"The completions table needs one value per prompt ({n}); got {wrong}.")

    columns: dict[str, list[Any]] = {PROMPT: list(prompts), COMPLETION: list(completions)}
    reward_columns = []
    for name, scores in rewards.items():
        column = f"rewards/{name}" if name in _RESERVED else name
        columns[column] = [_number(x) for x in scores]
        reward_columns.append(column)
    columns[SEQUENCE_REWARD] = [_number(x) for x in sequence_rewards]
    for name, values in optional.items():
        if values is not None:
            columns[name] = [_number(x) for x in values]
    # One named as a column of the table's own (a reward function's, `advantage`, ...) keeps both, as `log_metric`'s
    # values do (`averaged_metrics`): GRPOTrainer's table overwrote the column; here a text one failed the numbers'
    # conversion and stopped the run.
    extra = {
        f"rewards/log_extra/{name}" if name in columns or name == STEP else name: list(values)
        for name, values in (extra_columns or {}).items()
        if len(values) == n
    }
    return CompletionsTable(step, columns, reward_columns, phase, extra)


def completion_token_stats(advantages, values, action_mask, loss_mask=None) -> dict[str, list[float | None]]:
    """Per-completion statistics of a rollout's `[N, C]` tensors, for `build_completions_table`.

    Returns `advantages` (the mean over the completion's trained tokens, `loss_mask`, or None when it has none),
    `first_values` and `last_values` (the critic's value at the first and last token of `action_mask`, the tokens
    the policy sampled; None for a completion without one). Pass `advantages=None` during value pretraining.
    """
    import torch

    from .core import last_valid_position

    action_mask = action_mask.float()
    valid = action_mask.bool()
    first = valid.int().argmax(dim=1)  # the first maximum: the first valid token (0 for an empty row)
    rows = torch.arange(len(action_mask), device=action_mask.device)
    first_values = values[rows, first].float().tolist()
    last_values = values[rows, last_valid_position(valid).clamp(min=0)].float().tolist()
    empty = (~valid.any(dim=1)).tolist()
    stats = {
        "first_values": [None if e else v for v, e in zip(first_values, empty)],
        "last_values": [None if e else v for v, e in zip(last_values, empty)],
        "advantages": None,
    }
    if advantages is not None:
        mask = action_mask if loss_mask is None else loss_mask.float()
        count = mask.sum(dim=1)
        means = ((advantages.float() * mask).sum(dim=1) / count.clamp(min=1)).tolist()
        stats["advantages"] = [None if c == 0 else m for m, c in zip(means, count.tolist())]
    return stats


def sample_rows(num_rows: int, limit: int | None, seed: int = 0) -> list[int]:
    """Indices of at most `limit` of `num_rows` rows (None: all; 0 or less: none), sorted.

    A private `random.Random(seed)` picks them: the global random state, which a resumed run replays, is untouched.
    """
    if limit is None or limit >= num_rows:
        return list(range(num_rows))
    if limit <= 0:
        return []
    return sorted(random.Random(seed).sample(range(num_rows), limit))


def entry_text(entry: Any) -> str:
    """A prompt or completion as plain text: strings as they are, chat messages as `ROLE: content` paragraphs."""
    if isinstance(entry, list) and all(isinstance(m, dict) for m in entry):
        return "\n\n".join(f"{str(m.get('role', '')).upper()}: {_content_text(m.get('content', ''))}" for m in entry)
    return str(entry)


def format_number(value: float | None) -> str:
    """Two decimals, as TRL prints rewards; `-` for a missing value."""
    return MISSING if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # multimodal content blocks: keep the text, mark the rest
        return "".join(
            b.get("text", "") if b.get("type") == "text" else f"[{str(b.get('type', '?')).upper()}]" for b in content
        )
    return str(content)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


# ---------------------------------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------------------------------


def is_rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def print_completions_table(
    table: CompletionsTable,
    num_completions_to_print: int | None = None,
    *,
    use_rich: bool | None = None,
    file: TextIO | None = None,
    width: int | None = None,
) -> None:
    """Print at most `num_completions_to_print` rows (None: all) of the table.

    With `rich` (the default when it is installed) it looks like TRL's `print_prompt_completions_sample`: a panel
    titled with the step, one row per completion. Without it, a plain-text block per completion. `file` defaults to
    standard output; `width` to the console's (rich uses 80 columns when the output is not a terminal).
    """
    sample = table.select(num_completions_to_print)
    if len(sample) == 0:
        return
    if use_rich is None:
        use_rich = is_rich_available()
    # What the stream cannot encode shown as "?": Windows' stdout into a pipe or file is cp1252, and a completion's
    # "≥" or CJK text raised UnicodeEncodeError there, which stopped the run at its log (rich's too: it is always
    # installed, with transformers).
    stream = file or sys.stdout
    if stream is None:  # (no console: pythonw.exe)
        return
    out = _Replacing(stream)
    if use_rich:
        _print_rich(sample, out, width)
    else:
        print(format_plain_table(sample), file=out, flush=True)


class _Replacing:
    """A text stream whose writes replace what its encoding cannot encode with "?"; the stream's other attributes
    (`encoding`, `isatty`, `flush`: what rich's console reads) are its own."""

    def __init__(self, stream: TextIO):
        self._stream, self._encoding = stream, getattr(stream, "encoding", None)

    def write(self, text: str) -> int:
        if self._encoding:
            text = text.encode(self._encoding, errors="replace").decode(self._encoding)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def format_plain_table(table: CompletionsTable) -> str:
    """The table as plain text, for consoles without `rich`: a header, then each completion's text and numbers."""
    numbers = [c for c in table.columns if c not in (PROMPT, COMPLETION)]
    lines = [f"===== {table.title}: {len(table)} completion(s) " + "=" * 40]
    for i in range(len(table)):
        lines.append(f"--- prompt:\n{entry_text(table.columns[PROMPT][i])}")
        lines.append(f"--- completion:\n{entry_text(table.columns[COMPLETION][i])}")
        lines.append("--- " + "   ".join(f"{name} {format_number(table.columns[name][i])}" for name in numbers))
    return "\n".join(lines)


def _print_rich(table: CompletionsTable, file: TextIO, width: int | None) -> None:
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    # TRL's colours: prompt yellow, completion green, rewards cyan, advantage magenta; values get their own colour.
    styles = {
        SEQUENCE_REWARD: "bold cyan",
        ADVANTAGE: "bold magenta",
        VALUE_FIRST: "bold blue",
        VALUE_LAST: "bold blue",
    }
    headers = {
        SEQUENCE_REWARD: "Reward",
        ADVANTAGE: "Advantage",
        VALUE_FIRST: "Value (first)",
        VALUE_LAST: "Value (last)",
    }
    rich_table = Table(show_header=True, header_style="bold white", expand=True)
    # "fold" everywhere: on a narrow console a long unbroken token (`7+1+3+5+4+6+2+9.`, `digit_fraction`) wraps
    # instead of being cut to an ellipsis, and every column stays inside the panel.
    rich_table.add_column("Prompt", style="bright_yellow", overflow="fold")
    rich_table.add_column("Completion", style="bright_green", overflow="fold")
    numbers = [c for c in table.columns if c not in (PROMPT, COMPLETION)]
    for name in numbers:
        rich_table.add_column(
            headers.get(name, name), style=styles.get(name, "bold cyan"), justify="right", overflow="fold"
        )
    for i in range(len(table)):
        cells = [_rich_entry(table.columns[PROMPT][i], Text), _rich_entry(table.columns[COMPLETION][i], Text)]
        cells += [format_number(table.columns[name][i]) for name in numbers]
        rich_table.add_row(*cells)
        rich_table.add_section()  # a rule between completions, as TRL draws
    console = Console(file=file, width=width)  # (standard output by default, as TRL prints)
    console.print(Panel(rich_table, expand=False, title=table.title, border_style="bold white"))


def _rich_entry(entry: Any, Text) -> Any:
    if isinstance(entry, list) and all(isinstance(m, dict) for m in entry):
        text = Text()
        for j, message in enumerate(entry):
            text.append(f"{str(message.get('role', '')).upper()}\n", style="bold red")
            text.append(_content_text(message.get("content", "")))
            if j < len(entry) - 1:
                text.append("\n\n")
        return text
    return Text(str(entry))  # a Text, not a str: rich must not read "[...]" in a completion as markup


# ---------------------------------------------------------------------------------------------------------------------
# Trackers
# ---------------------------------------------------------------------------------------------------------------------


def reporting_integrations(report_to: str | Sequence[str] | None) -> list[str]:
    """`report_to` as a list of names (TrainingArguments resolves "all" to the installed ones; "none" is none)."""
    if report_to is None:
        return []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    return [name for name in names if name != "none"]


def log_completions_to_trackers(table: CompletionsTable, report_to: str | Sequence[str] | None) -> list[str]:
    """Log the whole table as `completions` to wandb and trackio when they are among `report_to` and have a live
    run (started by transformers' callbacks at the first log), as GRPOTrainer does. Returns the trackers used.

    Call it after `Trainer.log`, so the trackers' runs exist. TensorBoard has no table type and is skipped.
    """
    names = reporting_integrations(report_to)
    used = []
    if "wandb" in names:
        import wandb

        if wandb.run is not None:
            wandb.log({"completions": wandb.Table(dataframe=table.to_dataframe())})
            used.append("wandb")
    if "trackio" in names:
        import trackio

        if trackio.context_vars.current_run.get() is not None:
            trackio.log({"completions": trackio.Table(dataframe=table.to_dataframe())})
            used.append("trackio")
    return used


COMPLETIONS_DIR = "completions"
"""Where `log_completions` writes each logged rollout's table in `output_dir`, as GRPOTrainer does."""


def write_completions_file(table: CompletionsTable, directory: Path) -> Path:
    """`table` as GRPOTrainer writes its completions with `log_completions`: `completions_<step, 5 digits>.parquet`
    in `directory`, the columns the trackers' table has (`to_dataframe`). Returns the file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"completions_{table.step:05d}.parquet"
    table.to_dataframe().to_parquet(path)
    return path


def tracker_urls() -> dict[str, str | None]:
    """Dashboards of the live tracker runs, for the model card's badges: `wandb` (an online run's page) and
    `trackio` (a Space's, when the run logs to one). None where there is none: an offline wandb run has no page, a
    local trackio run no public address."""
    urls: dict[str, str | None] = {"wandb": None, "trackio": None}
    # A run can only exist if its tracker was imported (by transformers' callback): never import one just to look.
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None and not wandb.run.offline:
        urls["wandb"] = wandb.run.url  # an offline run has no page (`.url` would only warn)
    if sys.modules.get("trackio") is not None:
        from ._compat import get_trackio_space_url

        urls["trackio"] = get_trackio_space_url()
    return urls


def report_completions(
    table: CompletionsTable,
    *,
    num_completions_to_print: int | None,
    report_to: str | Sequence[str] | None,
    file: TextIO | None = None,
    unique_prompts: bool = False,
) -> list[str]:
    """What the trainer calls at a logging step with `log_completions=True`: print the sample, log the table (with
    `unique_prompts`, GRPOConfig's `log_unique_prompts`, each prompt's first row only, as TRL logs it).

    Returns the trackers the table went to.
    """
    print_completions_table(table, num_completions_to_print, file=file)
    return log_completions_to_trackers(table.unique_prompts() if unique_prompts else table, report_to)


# ---------------------------------------------------------------------------------------------------------------------
# The phase on the progress bar
# ---------------------------------------------------------------------------------------------------------------------


# transformers' tracker callbacks that log numbers only and warn, at every log, about any other value: `phase`, the one
# text in the logs (TensorBoard writes it as text, wandb and trackio take it, AzureML drops it without a word).
NUMBERS_ONLY_TRACKERS = ("MLflowCallback", "ClearMLCallback", "DVCLiveCallback")


def leave_text_out_of_logs(callback) -> None:
    """Make `callback.on_log` receive the logs without their text values (`NUMBERS_ONLY_TRACKERS`), in place."""
    on_log = callback.on_log

    def numbers_only(*args, **kwargs):
        if kwargs.get("logs") is not None:
            kwargs["logs"] = {key: value for key, value in kwargs["logs"].items() if not isinstance(value, str)}
        return on_log(*args, **kwargs)

    callback.on_log = numbers_only


class PhaseProgressCallback(ProgressCallback):
    """transformers' progress bar, with the training phase as its description: `value pretraining: 40%|...` then
    `RL: ...`.

    It replaces the trainer's `ProgressCallback` (so the bar, and the trainer's adjustment of its total when value
    pretraining stops early, stay as they are). `get_phase` returns the current phase name (`"value_pretrain"` or
    `"rl"`); the label is refreshed when the bar opens, after each step, and whenever `refresh()` is called (the
    trainer calls it at the phase change, so the first RL rollout's generation already shows "RL").
    """

    def __init__(self, get_phase: Callable[[], str], labels: dict[str, str] | None = None, max_str_len: int = 100):
        super().__init__(max_str_len=max_str_len)
        self.get_phase = get_phase
        self.labels = {**PHASE_LABELS, **(labels or {})}

    def refresh(self) -> None:
        """Show the current phase on the bar (when there is one)."""
        if self.training_bar is None:
            return
        phase = self.get_phase()
        label = self.labels.get(phase, str(phase))
        if self.training_bar.desc.rstrip(": ") != label:
            self.training_bar.set_description(label)

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.refresh()

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        self.refresh()


def rollout_completions_table(rollout, tokenizer, step: int) -> CompletionsTable:
    """The completions of a `trl_vapo.rollout.Rollout` (this process's): prompts and completions as the model saw and
    wrote them, each reward function's score, the reward, and, ours alone, the mean advantage and the critic's value
    at the first and last token."""
    import torch

    prompt_columns = slice(0, rollout.prompt_length)
    prompt_ids = [
        ids[m.bool()].tolist()
        for ids, m in zip(rollout.input_ids[:, prompt_columns], rollout.attention_mask[:, prompt_columns])
    ]
    scores = rollout.scores
    advantages = rollout.advantages if rollout.phase == RL else None
    return build_completions_table(
        step=step,
        prompts=tokenizer.batch_decode(prompt_ids, skip_special_tokens=True),
        completions=tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True),
        rewards={name: scores.per_function[:, j].tolist() for j, name in enumerate(scores.names)},
        sequence_rewards=torch.where(scores.scored, scores.reward, torch.nan).tolist(),
        phase=rollout.phase,
        extra_columns=rollout.extra_columns,
        **completion_token_stats(advantages, rollout.old_values, rollout.action_mask, rollout.loss_mask),
    )


def nan_mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN when none is): how logged metrics are averaged over steps."""
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


USER_METRIC = "log_metric:"
"""The prefix under which the reward functions' `log_metric` values are collected (`averaged_metrics` names them)."""


def averaged_metrics(metrics: dict[str, list[float]]) -> dict[str, float]:
    """The averages of the metrics collected since the last log (`nan_mean`), each reward function's `log_metric`
    value under its own name, as GRPOTrainer logs it, or, where VAPO logs a metric of that name itself (`accuracy`,
    `value/mean`, ...), under `rewards/log_metric/<name>`: the two were averaged together into one number."""
    averaged = {key: nan_mean(values) for key, values in metrics.items()}
    own = {key for key in averaged if not key.startswith(USER_METRIC)}
    named = {}
    for key, value in averaged.items():
        if key.startswith(USER_METRIC):
            name = key[len(USER_METRIC) :]
            key = f"rewards/log_metric/{name}" if name in own else name
        named[key] = value
    return named


class MetricsMixin:
    """`VAPOTrainer`'s metrics: what each rollout and step records (over every process), averaged into each log
    (`log`, which also writes `vapo_logs.jsonl` and, with `log_completions`, the completions table)."""

    @property
    def _logs(self) -> dict[str, Any]:
        """GRPOTrainer's record of the completions it logs, under its name, for callbacks written for GRPOTrainer:
        the last rollout's (this process's) `prompt`, `completion`, `rewards` by function, `advantages` and `extra`
        (the columns reward functions logged with `log_extra`), read from its completions table; `images` is
        always empty (VAPO takes text). A missing reward, and a value-pretraining rollout's advantage, are NaN (as
        GRPOTrainer's missing rewards): one value per row in each list. Empty before the first rollout."""
        logs = {"images": [], "prompt": [], "completion": [], "rewards": {}, "advantages": [], "extra": {}}
        if self._last_rollout is None:
            return logs
        table = rollout_completions_table(self._last_rollout, self.processing_class, self.state.global_step)
        logs.update(prompt=table.columns["prompt"], completion=table.columns["completion"])

        def numbers(values: list) -> list[float]:
            return [math.nan if value is None else value for value in values]

        # By the functions' names, as GRPOTrainer keys them (the table renames one named as its own columns)
        names = self._last_rollout.scores.names
        logs["rewards"] = {name: numbers(table.columns[column]) for name, column in zip(names, table.reward_columns)}
        logs["advantages"] = numbers(table.columns.get("advantage", [None] * len(logs["prompt"])))
        logs["extra"] = table.extra_columns
        return logs

    def _record_reward_metrics(self, values: dict[str, list[float]]) -> None:
        """The reward functions' `log_metric` values of one rollout, averaged over every process's calls as
        GRPOTrainer averages them (processes may log different names: all of them are reduced, in one order)."""
        names = sorted(values)
        if self._distributed:
            names = sorted(set(gather_object(names)))
        if not names:
            return
        sums = [[sum(values.get(name, [])), len(values.get(name, []))] for name in names]
        totals = self._all_reduce(torch.tensor(sums, dtype=torch.float32, device=self.accelerator.device))
        for name, (total, count) in zip(names, totals.tolist()):
            if count:
                self._metrics[USER_METRIC + name].append(total / count)

    def _record(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._metrics[key].append(value)

    def _record_step(
        self,
        sums: dict[str, torch.Tensor],
        grad_norms: dict[str, torch.Tensor],
        extremes: dict[str, list[torch.Tensor]],
    ) -> None:
        keys = sorted(sums)
        totals = dict(zip(keys, self._all_reduce(torch.stack([sums[k] for k in keys])).tolist()))
        world = self.accelerator.num_processes
        self._metrics["skipped_steps"] = [float(self.progress.skipped_steps)]  # a running count: the latest
        tokens, sequences = totals.pop("_tokens"), totals.pop("_sequences", 0.0)
        if tokens == 0:  # nothing scored in the step, nothing trained: its zeros are no reading (a falling entropy)
            return
        # A step skipped for its non-finite loss trained nothing: its readings are none (one inf made the log's
        # `loss` inf, where transformers' `logging_nan_inf_filter` leaves such a step out). Its gradient norms stay.
        trained = math.isfinite(totals["loss"])
        for key, value in totals.items() if trained else ():
            # Losses (and the routers' `aux_loss`) were already normalised by the global count or the micro-batches:
            # their sum over processes / world is the step's. The others are weighted sums of per-micro-batch means.
            if key.startswith("loss") or key == "aux_loss":
                self._metrics[key].append(value / world)
            else:
                self._metrics[key].append(value / (sequences if key in SEQUENCE_MEANS else tokens))
        # The extremes over every sequence of the step, on every process (gathered: every process has the same keys).
        extreme_keys = sorted(extremes)
        if extreme_keys:
            local = torch.stack([STEP_EXTREMES[k](torch.stack(extremes[k])) for k in extreme_keys])
            gathered = self.accelerator.gather(local[None]).view(-1, len(extreme_keys))
            reduced = torch.stack([STEP_EXTREMES[key](values) for key, values in zip(extreme_keys, gathered.T)])
            for key, value in zip(extreme_keys, reduced.tolist()) if trained else ():  # one host sync
                self._metrics[key].append(value)
        bonus = self.args.entropy_coef > 0 or self.args.use_adaptive_entropy
        if trained and bonus and "loss/policy" in totals:  # GRPOTrainer's names, with its entropy bonus
            self._metrics["policy_loss"].append(totals["loss/policy"] / world)  # the policy's loss before the bonus
            self._metrics["entropy_coef"].append(self.entropy_coef)  # after this step's control, as GRPOTrainer's
        # The gradient norms of the log's last step, as transformers.Trainer logs `grad_norm` (not a mean over the
        # steps, which one fp16 overflow's inf would fill): of every weight that trains, before clipping. Each side's
        # (`grad_norm/<side>`) is its last step's in the log's window: where each rollout ends with critic-only steps
        # (`critic_num_iterations`), a log on such a step otherwise never showed the policy's.
        norms = torch.stack(list(grad_norms.values())).tolist() if grad_norms else []
        for key, value in zip(grad_norms, norms):
            self._metrics[key] = [value]
        if norms:  # the sides' together
            self._metrics["grad_norm"] = [math.sqrt(sum(n * n for n in norms))]
        if trained:  # a skipped non-finite step would make `train_loss` NaN for good
            self._loss_sum += totals["loss"] / world
            self._loss_steps += 1

    def _note_learning_rates(self) -> None:
        """The rates of the step about to run, by parameter group: what the next log reports."""
        self._step_learning_rates = {group.get("name"): group["lr"] for group in self.optimizer.param_groups}

    _logged_step: int | None = None  # the step of the last training log

    def _log_metrics(self, phase: str) -> None:
        # Once a step, as transformers logs: value pretraining's readings logged as it ended, the end of an epoch at
        # that step logged a second, empty entry labelled RL (drawn by the trackers, read by the plots in its place).
        if self.state.global_step == self._logged_step:
            return
        self._logged_step = self.state.global_step
        # The rates the last step used (as transformers.Trainer logs them), not the next step's.
        rates = self._step_learning_rates
        first = next(iter(rates.values()))
        logs = {"learning_rate": rates.get("policy", first), "phase": phase}
        if "critic" in rates:  # a frozen value function has no rate
            logs["critic_learning_rate"] = rates["critic"]
        self.log(logs, self._train_start_time)  # (as transformers' loop logs: tokens per second since it)

    def log(self, logs: dict[str, Any], start_time: float | None = None) -> None:
        """Add the averages of the metrics collected since the last log, then log as `Trainer.log` does, and write
        what it adds (`epoch`, ...) into `logs`, as it does; with `log_completions`, also the latest rollout's
        completions table (once per rollout)."""
        averaged = averaged_metrics({key: values for key, values in self._metrics.items() if values})
        self._metrics.clear()
        merged = {**averaged, **logs}
        super().log(merged, start_time)
        # What `Trainer.log` adds (`epoch`, `num_input_tokens_seen`) lands in `logs` too, as transformers' own `log`
        # writes it into the dict it is given: `evaluate()` returns it, and `on_evaluate` reads it.
        logs.update({key: value for key, value in merged.items() if key not in averaged})
        if self.accelerator.is_main_process:  # what `trl-vapo plot` reads, also while the run is going
            # The file starts anew with each run's first log: a fresh run's (an earlier run's entries in this folder
            # would splice into its curves) and a resumed run's, whose history is the checkpoint's (the steps the
            # crashed run logged after it are abandoned, and would splice in where the resumed run logs otherwise).
            # A log outside `train` (an evaluation by a trainer built on a run's folder) is added: it was the whole
            # file, the run's curves gone.
            rewrite = self._rewrite_log_file
            entries = self.state.log_history if rewrite else self.state.log_history[-1:]
            lines = "".join(strict_json(e, default=str) + "\n" for e in entries)
            path = Path(self.args.output_dir) / LOG_FILE
            if rewrite:  # whole or not at all: a kill mid-write, or `trl-vapo plot` reading then, cut the history
                written = path.with_name(f".{LOG_FILE}.tmp")
                written.write_text(lines)
                try:
                    os.replace(written, path)
                except PermissionError:  # Windows: the log open in a program that shares no deletion (a tail, an
                    # editor): written over in place, not whole or not at all, rather than stop the run
                    path.write_text(lines)
                    written.unlink(missing_ok=True)
            else:
                with path.open("a") as log_file:
                    log_file.write(lines)  # (one write: a line is never left half-written between two)
            self._rewrite_log_file = False
        rollout = self._last_rollout
        fresh = rollout is not None and rollout is not self._reported_rollout
        if self.args.log_completions and fresh:
            table = rollout_completions_table(rollout, self.processing_class, self.state.global_step)
            if self.accelerator.num_processes > 1:  # every process's share of the rollout, as GRPOTrainer gathers
                from accelerate.utils import gather_object

                table = CompletionsTable.concatenate(gather_object([table]))
            if self.accelerator.is_main_process:
                report_completions(
                    table,
                    num_completions_to_print=self.args.num_completions_to_print,
                    report_to=self.args.report_to,
                    unique_prompts=self.args.log_unique_prompts,
                )
                write_completions_file(table, Path(self.args.output_dir) / COMPLETIONS_DIR)
            self._reported_rollout = rollout
