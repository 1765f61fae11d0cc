"""Prompt datasets for the CLI: a hub name or local files, turned into `prompt` + `answer` rows.

The loading code is the one a user with internet runs (`datasets.load_dataset`); local json / jsonl / csv / parquet
files and folders go through the same call. Presets name the layouts of common math data sets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from datasets import Dataset, IterableDataset, load_dataset
from trl import is_conversational, maybe_apply_chat_template

from .run import prompts_per_rollout

logger = logging.getLogger(__name__)

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class DatasetPreset:
    """Where a known data set keeps its problem and its gold answer."""

    dataset_name: str
    dataset_config: str | None
    prompt_column: str
    answer_column: str


PRESETS = {
    # GSM8K: `answer` is a worked solution ending in `#### 72`; the math reward reads that final number.
    "gsm8k": DatasetPreset("openai/gsm8k", "main", "question", "answer"),
    # MATH: `solution` is a worked solution whose last `\boxed{}` is the answer.
    "math": DatasetPreset("DigitalLearningGmbH/MATH-lighteval", None, "problem", "solution"),
}


def load_prompt_dataset(
    dataset_name: str,
    split: str = "train",
    dataset_config: str | None = None,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    prompt_template: str | None = None,
    system_prompt: str | None = None,
    chat: bool = True,
    streaming: bool = False,
) -> Dataset | IterableDataset:
    """Load `split` of a data set and return its rows with a `prompt` (chat messages or text) and an `answer` (the
    other columns are kept, for the reward functions).

    Args:
        dataset_name: a hub data set name, a local file (`.json`, `.jsonl`, `.csv`, `.parquet`) or a folder of them.
        prompt_column: column holding the problem text (or ready-made chat messages).
        answer_column: column holding the gold answer, copied to `answer` as text (math-verify reads text) for the
            reward functions; None: none copied, an `answer` column kept as the data set holds it.
            The default, `"answer"`, is skipped when the data set has no such column (GRPO data sets often keep
            theirs under another name, e.g. `solution`, which the reward functions read directly).
        prompt_template: a `str.format` template over the row's columns, e.g. `"{question}\\nAnswer in \\boxed{{}}."`.
        system_prompt: a system message put before the problem: the first message of a chat prompt (an error when a
            row's messages already start with one), or a paragraph before a text prompt.
        chat: build chat messages (`[{"role": "user", ...}]`) rather than plain text.
        streaming: load it as an `IterableDataset` (`datasets`' streaming mode), read as training goes.

    Raises:
        ValueError: naming the missing column and listing the columns present, before anything else runs.
    """
    dataset = _load(dataset_name, split, dataset_config, streaming)
    first = next(iter(dataset), None)
    if first is None:
        raise ValueError(f"{dataset_name} ({split}) is empty.")
    columns = list(first)
    if answer_column == "answer" and "answer" not in columns:
        answer_column = None
    for role, column in (("prompt_column", prompt_column), ("answer_column", answer_column)):
        if role == "prompt_column" and prompt_template and column not in _template_fields(prompt_template):
            continue  # of no use: the template names its own columns (checked below)
        if column is not None and column not in columns:
            raise ValueError(
                f"{dataset_name} ({split}) has no column {column!r} ({role}); its columns are {columns}. "
                f"Pass --{role} with one of them."
            )

    if prompt_template and isinstance(first.get(prompt_column), list):
        raise ValueError(
            f"--prompt_template formats text, but {dataset_name} ({split})'s column {prompt_column!r} holds chat "
            "messages, which are used as they are: drop --prompt_template, or pass a text column as --prompt_column."
        )
    template_columns = check_prompt_template(prompt_template, columns) if prompt_template else []
    # `map` writes a returned column into the data set's own column of that name, in its type: the gold "0.00000025"
    # went back into a float column (2.5e-07) and came out of it as the text "2.5e-7", which math-verify does not read
    # as that number. Renamed away first, the answers are a new column, of text.
    if answer_column and "answer" in columns and not streaming:  # (a stream's mapped rows are not cast)
        dataset = dataset.rename_column("answer", GOLD_SOURCE)

    def to_prompt(row: dict) -> dict:
        if GOLD_SOURCE in row:  # the row as the data set holds it
            row = {("answer" if key == GOLD_SOURCE else key): value for key, value in row.items()}
        problem = row.get(prompt_column)  # (none with a template that names other columns)
        if isinstance(problem, list):  # already chat messages: the system prompt goes first, unless they have one
            if not_chat_messages(problem):
                raise ValueError(
                    f"A row's {prompt_column!r} in {dataset_name} ({split}) is a list but not chat messages "
                    f"({str(problem)[:80]}): {CHAT_MESSAGES}"
                )
            if system_prompt and problem and problem[0].get("role") == "system":
                raise ValueError(
                    f"--system_prompt was given, but a row of {dataset_name} ({split}) already starts with a system "
                    f"message ({str(problem[0].get('content'))[:60]!r}): drop --system_prompt to keep the data set's."
                )
            if prompt_column != "prompt" and problem and problem[-1].get("role") == "assistant":
                # TRL's conversational "messages" format ends with the reply to learn: as a prompt, the policy would
                # be asked to continue it (a final assistant message is a prefill, continued as it stands).
                raise ValueError(
                    f"The {prompt_column!r} messages of {dataset_name} ({split}) end with an assistant message (in "
                    'TRL\'s "messages" format, the reply to learn), which the policy would continue: drop it '
                    f"(dataset.map(lambda row: {{'prompt': row[{prompt_column!r}][:-1]}}), then --prompt_column "
                    "prompt), or name a column whose messages end with the user's turn. A prefill to continue on "
                    "purpose goes in a column named prompt."
                )
            if system_prompt:
                problem = [{"role": "system", "content": system_prompt}, *problem]
            return {"prompt": problem, **({"answer": answer_text(row[answer_column])} if answer_column else {})}
        # A null problem would be the text "None" in the prompt (through a chat template, or a template's field).
        fields = template_columns if prompt_template else [prompt_column]
        missing = [column for column in fields if row[column] is None]
        if missing:
            raise ValueError(
                f"A row of {dataset_name} ({split}) has no {missing[0]!r} (null): {str(row)[:120]}. Drop such rows "
                "(dataset.filter) or fill them in."
            )
        text = prompt_template.format(**row) if prompt_template else problem
        if chat:
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            prompt = messages + [{"role": "user", "content": text}]
        else:
            prompt = f"{system_prompt}\n\n{text}" if system_prompt else text
        if not answer_column:
            return {"prompt": prompt}
        return {"prompt": prompt, "answer": answer_text(row[answer_column])}

    if streaming:
        to_prompt(first)  # a stream maps as it is read: its first row's errors now, before any model loads
        return dataset.map(to_prompt)
    hidden = [GOLD_SOURCE] if GOLD_SOURCE in dataset.column_names else []
    return dataset.map(to_prompt, desc="Building prompts", remove_columns=hidden)


GOLD_SOURCE = "__trl_vapo_gold__"
"""The data set's own `answer` column while the gold answers are written as text (`load_prompt_dataset`)."""


def answer_text(gold):
    """A reference answer as the rewards read it: a number as text written out in full (`str` made 1e-05 the text
    "1e-05", which math-verify does not read as that number; inf and NaN None; a decimal column's values as
    written), anything else as it is (a missing one stays None: the rewards leave it unscored)."""
    from decimal import Decimal

    from .rewards.answers import number_text

    if isinstance(gold, Decimal):
        return format(gold, "f") if gold.is_finite() else None
    return number_text(gold) if isinstance(gold, (int, float)) and not isinstance(gold, bool) else gold


def _field_column(field: str) -> str:
    """The column a `str.format` field reads: `{row[0]}` and `{row.x}` read `row`."""
    return re.split(r"[.\[]", field, maxsplit=1)[0]


def _template_fields(template: str) -> list[str]:
    """The columns `template` names, or none where it does not parse (`check_prompt_template` says why)."""
    try:
        return [_field_column(field) for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError:
        return []


def check_prompt_template(template: str, columns: list[str]) -> list[str]:
    """The columns `template` (`str.format` over a row's columns) names; a clear error unless it names only `columns`,
    by name: a field that is no column, a positional one (`{}`, `{0}`: often a LaTeX `\\boxed{}` left unescaped), or
    bad braces raised from inside `datasets.map` as a bare KeyError or IndexError."""
    escape = "write a literal brace twice: \\boxed{{}}"
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as error:
        raise ValueError(f"--prompt_template {template!r} does not parse ({error}); {escape}.") from None
    names = []
    for field in fields:
        name = _field_column(field)
        if name == "" or name.isdigit():
            raise ValueError(
                f"--prompt_template {template!r} has a positional field {{{field}}}: fields name columns "
                f"({', '.join(columns)}); {escape}."
            )
        if name not in columns:
            raise ValueError(
                f"--prompt_template {template!r} names {{{name}}}, which is no column; the columns are {columns}."
            )
        names.append(name)
    return names


@contextlib.contextmanager
def _no_download_counts():
    # `datasets` pings an S3 bucket to count downloads even when loading local files; a local run must not touch
    # the network (and must not wait on it when there is none).
    previous = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = previous


def prepare_tokenizer(tokenizer, conversational: bool) -> None:
    """Check the tokenizer can serve the rollouts, and pad on the left (prompts are continued on the right)."""
    if not hasattr(tokenizer, "eos_token_id") and hasattr(tokenizer, "tokenizer"):  # an AttributeError before
        raise TypeError(
            f"processing_class is a processor ({type(tokenizer).__name__}): VAPOTrainer trains on text prompts; pass "
            "its tokenizer, processing_class=processor.tokenizer."
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "The tokenizer has no EOS token, so completions could never end: set `tokenizer.eos_token` (e.g. to the "
            "end-of-turn token of the chat template)."
        )
    if conversational and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "The dataset's prompts are chat messages but the tokenizer has no chat template. Set "
            "`tokenizer.chat_template`, or use plain-text prompts."
        )
    if tokenizer.pad_token_id is None:
        logger.warning(f"The tokenizer has no pad token; using its EOS token {tokenizer.eos_token!r} for padding.")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"


def refuse_prompts_without_tokens(prompts: list, ids: list[list[int]]) -> None:
    """A clear error for a prompt of `prompts` whose token ids (`ids`, :func:`prompt_token_ids`) are none: an empty
    text prompt where the tokenizer adds no token (no BOS, as Qwen's). Sampled from padding alone, or first in its
    batch, a float tensor of no ids failed in the embedding."""
    empty = [prompt for prompt, tokens in zip(prompts, ids, strict=True) if not tokens]
    if empty:
        raise ValueError(
            f"A prompt has no token: {empty[0]!r} (the tokenizer adds none to it), and a completion cannot be "
            "sampled from nothing. Remove the empty prompts: dataset.filter(lambda row: len(row['prompt']) > 0)."
        )


def has_empty_text_prompt(dataset) -> bool:
    """Whether a map-style set (or a set of a dict of them) has an empty text prompt, one a tokenizer may give no
    token (:func:`refuse_prompts_without_tokens`), read as Arrow (no second pass over the rows in Python). A stream's
    prompts are read as training reads them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts = dataset.values() if isinstance(dataset, dict) else [dataset]
    for part in (p for p in parts if isinstance(p, Dataset)):
        prompts = part.with_format("arrow")["prompt"]
        if pa.types.is_string(prompts.type) or pa.types.is_large_string(prompts.type):
            if pc.any(pc.equal(prompts, "")).as_py():
                return True
    return False


def prompt_token_ids(
    tokenizer, prompts: list, conversational: bool, chat_template_kwargs: dict | None = None
) -> list[list[int]]:
    """Token ids of prompts as the policy sees them: chat messages through the chat template (which adds any BOS
    itself), plain text with the tokenizer's special tokens. Shared by training and evaluation."""
    if conversational:
        texts = [
            maybe_apply_chat_template({"prompt": p}, tokenizer, **(chat_template_kwargs or {}))["prompt"]
            for p in prompts
        ]
        return tokenizer(text=texts, add_special_tokens=False)["input_ids"]
    return tokenizer(text=list(prompts))["input_ids"]


def left_truncated(ids: list[list[int]], max_prompt_length: int | None) -> list[list[int]]:
    """Prompt token ids cut to their last `max_prompt_length` (the start goes, as GRPOTrainer cut them before TRL
    1.0), as training and evaluation cut them; None: whole."""
    return ids if max_prompt_length is None else [x[-max_prompt_length:] for x in ids]


def _raise_on_a_non_utf8_line(path: Path) -> None:
    """A clear error naming the file, the line and the byte when a text data file is not UTF-8 (what `datasets`
    reads it as; its own error names neither)."""
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}, line {number}: byte 0x{line[error.start]:02x} at column {error.start + 1} is not UTF-8. "
                    "Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or fix that line."
                ) from None


def dataset_config_problem(dataset_name: str | None, dataset_config: str | None) -> str | None:
    """Why `dataset_config` cannot apply to `dataset_name`, or None: a single local file has no configurations, and
    `load_dataset` ignored the name without a word (the user meant another subset than the one read)."""
    if dataset_config and dataset_name and Path(dataset_name).expanduser().is_file():
        return (
            f"dataset_config {dataset_config!r} names a configuration (subset) of a Hub data set or folder, and "
            f"{dataset_name} is a single file, which has none: drop it, or name the data set or folder it belongs to"
        )
    return None


@contextlib.contextmanager
def _no_rows_named(dataset_name: str, split: str):
    """An empty local file or split as one line naming it: `datasets` raised a bare StopIteration (an empty .jsonl)
    or said a split "corresponds to no data" (a .csv of its header alone), naming neither."""
    try:
        yield
    except StopIteration:
        raise ValueError(f"{dataset_name} ({split}) has no rows: it is empty.") from None
    except ValueError as error:
        if "corresponds to no data" not in str(error):
            raise
        raise ValueError(f"{dataset_name} ({split}) has no rows: give a file or split with some.") from None


def _load(dataset_name: str, split: str, dataset_config: str | None, streaming: bool = False):
    if problem := dataset_config_problem(dataset_name, dataset_config):
        raise ValueError(problem)
    path = Path(dataset_name).expanduser()
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"{path} is not a .json, .jsonl, .csv or .parquet file.")
        # A single local file holds one split; call it by the split asked for.
        if builder in ("json", "csv"):  # `datasets` loads such bytes and fails later, on reading, naming nothing
            _raise_on_a_non_utf8_line(path)
        # Keyed by the split's name: a slice of it (`train[:90%]`) is read as from a folder's or the Hub's.
        name = re.match(r"\w+", split)
        with _no_download_counts(), _no_rows_named(dataset_name, split):
            return load_dataset(
                builder, data_files={name[0] if name else split: str(path)}, split=split, streaming=streaming
            )
    if path.is_dir():
        with _no_download_counts(), _no_rows_named(dataset_name, split):
            return load_dataset(str(path), dataset_config, split=split, streaming=streaming)
    if dataset_name.startswith((".", "/", "~")) or os.sep in dataset_name and dataset_name.count(os.sep) > 1:
        raise FileNotFoundError(f"Dataset path {dataset_name} does not exist.")
    if path.suffix.lower() in _FILE_BUILDERS:  # `nope.jsonl`: a file's name, not a Hub data set's
        raise FileNotFoundError(
            f"Dataset file {dataset_name} does not exist (in {Path.cwd()}); a name ending in {path.suffix} is read as "
            "a local file, not looked up on the Hub."
        )
    _check_hub_reachable(dataset_name)
    try:
        return load_dataset(dataset_name, dataset_config, split=split, streaming=streaming)
    except ConnectionError as error:  # offline, and not in `datasets`' cache
        raise ConnectionError(_unreachable(dataset_name, error)) from None


def _check_hub_reachable(dataset_name: str) -> None:
    """Offline without HF_HUB_OFFLINE, `datasets` retries for half a minute before it says so: one request instead.
    In offline mode `datasets` reads its cache, and says at once when the data set is not there."""
    from datasets import config
    from datasets.naming import camelcase_to_snakecase
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError

    from .hub import unreachable

    # Where `datasets` looks when the Hub fails (its CachedDatasetModuleFactory): the name snake-cased after the
    # namespace, `AI-MO/NuminaMath-CoT` in `AI-MO___numina_math-co_t/<config>/<version>/<commit>`.
    *namespace, name = dataset_name.split("/")
    prepared = Path(config.HF_DATASETS_CACHE) / "___".join([*namespace, camelcase_to_snakecase(name)])
    downloaded = Path(constants.HF_HUB_CACHE) / f"datasets--{dataset_name.replace('/', '--')}"  # its files
    if config.HF_HUB_OFFLINE or any(p.is_dir() for p in prepared.glob("*/*/*")) or downloaded.exists():
        return  # `datasets` reads its cache
    try:
        error = unreachable(dataset_name, "dataset")
    except HfHubHTTPError:  # the Hub answered (no such data set, private, a rate limit): `load_dataset` says it
        return
    if error is not None:
        raise ConnectionError(_unreachable(dataset_name, error))


def _unreachable(dataset_name: str, error: Exception) -> str:
    from datasets import config

    where = f"none in {Path.cwd()}"
    if config.HF_HUB_OFFLINE:
        return (
            f"Dataset {dataset_name} is not a local file or folder ({where}), nor in `datasets`' cache, and "
            "HF_HUB_OFFLINE is set: pass a file's or folder's path, or load it once where the Hub is reachable."
        )
    return (
        f"Dataset {dataset_name} is not a local file or folder ({where}), and the Hub cannot be reached "
        f"({type(error).__name__}: {str(error)[:120]}): pass a file's or folder's path, or load it where the Hub is "
        "reachable (HF_HUB_OFFLINE=1 reads `datasets`' cache)."
    )


def check_stream_settings(train_dataset, eval_dataset, args) -> None:
    """GRPOTrainer's settings for streamed (`IterableDataset`) data, with its messages: every process reads the
    stream itself, in order, never a batch the main process dispatches, so `accelerator_config.dispatch_batches=True`
    is refused and it is set False; and a streamed train set is read in the training process, so
    `dataloader_num_workers` is set to 0 for it (only then: a map-style train set keeps its workers)."""
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if any(isinstance(d, IterableDataset) for d in (train_dataset, *evals)):
        if args.accelerator_config.dispatch_batches:
            raise ValueError(
                "Iterable datasets require `dispatch_batches=False`, but it is set to `True` in `accelerator_config`. "
                "Please set it to `False`."
            )
        args.accelerator_config.dispatch_batches = False
    if isinstance(train_dataset, IterableDataset) and args.dataloader_num_workers != 0:
        logger.warning(
            "Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding the "
            f"provided value ({args.dataloader_num_workers})."
        )
        args.dataloader_num_workers = 0


CHAT_TURNS_TO_CONTINUE = ("user", "tool", "assistant")
"""The roles a chat prompt's last message may have: TRL's chat templating refuses any other (a system message)."""


def check_train_dataset(dataset, args) -> dict:
    """A clear error unless `dataset` can feed the trainer: a non-empty `Dataset` with a `prompt` column and enough
    prompts for one rollout of `args` (a VAPOConfig), or an `IterableDataset` (streaming) with `max_steps` set.
    Returns its first row."""
    if dataset is None:
        raise ValueError("`train_dataset` is required: a datasets.Dataset with a 'prompt' column.")
    if isinstance(dataset, IterableDataset):
        if args.max_steps <= 0:
            raise ValueError(
                "train_dataset is an IterableDataset (streaming), whose length is unknown: set max_steps, the number "
                "of RL optimizer steps, as transformers' Trainer asks."
            )
        row = next(iter(dataset), None)
        if row is None:
            raise ValueError("train_dataset is empty: it needs at least one rollout's worth of prompts.")
        if "prompt" not in row:
            raise ValueError(f"train_dataset has no 'prompt' column; its columns are {sorted(row)}.")
        check_prompts([row["prompt"]], "train_dataset")  # a stream's rows are read as training goes: its first one
        refuse_images(row, "train_dataset")
        return row
    if not isinstance(dataset, Dataset):
        raise TypeError(f"train_dataset must be a datasets.Dataset or IterableDataset, got {type(dataset).__name__}.")
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty: it needs at least one rollout's worth of prompts.")
    if "prompt" not in dataset.column_names:
        raise ValueError(f"train_dataset has no 'prompt' column; its columns are {dataset.column_names}.")
    prompts = dataset["prompt"]
    check_prompts(prompts, "train_dataset")
    needed = prompts_per_rollout(args)
    if len(dataset) < needed:
        # The rollout's size follows the field the user set: generation_batch_size, or the batch size and the steps
        # (lowering the batch size alone leaves a generation_batch_size set as it is)
        smaller = (
            "generation_batch_size" if args._rollout_size_set else "per_device_train_batch_size / steps_per_generation"
        )
        raise ValueError(
            f"train_dataset has {len(dataset)} prompts but one rollout needs {needed} "
            f"(generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}). Add "
            f"prompts, or lower {smaller}, or raise num_generations."
        )
    for i, prompt in enumerate(prompts):  # an image part may sit in any row's messages, not the first one's
        refuse_images({"prompt": prompt}, f"train_dataset (row {i})")
    refuse_image_columns(dataset, "train_dataset")
    return dataset[0]


def not_chat_messages(prompt: list) -> bool:
    """Whether a list prompt holds something other than chat messages (dicts with a 'role'): ShareGPT's
    {'from', 'value'} messages (or their 'role' None, where a data set holds both kinds: Arrow gives each row every
    key), plain strings. TRL's `is_conversational` reads such a prompt as no chat at all."""
    return any(not isinstance(message, dict) or not isinstance(message.get("role"), str) for message in prompt)


CHAT_MESSAGES = (
    "a chat prompt is a list of messages, each a dict with a 'role' and a 'content' (TRL's conversational format). "
    "ShareGPT's {'from': ..., 'value': ...} messages convert with `dataset.map(trl.maybe_convert_to_chatml)`, then "
    "their roles such as 'human' and 'gpt' to 'user' and 'assistant'."
)
"""What a list prompt that `not_chat_messages` is told."""


def check_prompts(prompts: list, what: str, warn: bool = True) -> None:
    """A clear error for prompts the rollout that draws them would fail on, hours in (none at all; chat prompts with
    no message to reply to), and (`warn`) a warning for those it would sample from as the user may not expect (an
    assistant prefill, an empty prompt). `what` names the data set in the messages."""

    def rows(indices: list[int]) -> str:
        return f"rows {indices[:5]}{', ...' if len(indices) > 5 else ''}"

    missing = [i for i, prompt in enumerate(prompts) if prompt is None]
    if missing:
        raise ValueError(
            f"{what} has {len(missing)} row(s) without a prompt ({rows(missing)}: None, as a JSON-lines row without "
            "the 'prompt' key reads). Remove them: dataset.filter(lambda row: row['prompt'] is not None)."
        )
    unreadable = [i for i, prompt in enumerate(prompts) if isinstance(prompt, list) and not_chat_messages(prompt)]
    if unreadable:
        raise ValueError(
            f"{what} has {len(unreadable)} prompt(s) that are lists but not chat messages ({rows(unreadable)}, the "
            f"first {str(prompts[unreadable[0]])[:80]}): {CHAT_MESSAGES}"
        )
    unanswerable = [
        i
        for i, prompt in enumerate(prompts)
        if isinstance(prompt, list) and (not prompt or prompt[-1]["role"] not in CHAT_TURNS_TO_CONTINUE)
    ]
    if unanswerable:
        first = prompts[unanswerable[0]]
        last = f"the first's last role is {first[-1]['role']!r}" if first else "the first has no message"
        raise ValueError(
            f"{what} has {len(unanswerable)} chat prompt(s) with no message to reply to ({rows(unanswerable)}; "
            f"{last}): no message, or a last message that is not the user's, a tool's or an assistant prefill, e.g. "
            "a system message alone. Remove them: "
            "dataset.filter(lambda row: row['prompt'] and row['prompt'][-1]['role'] in ('user', 'tool', 'assistant'))."
        )
    if not warn:
        return
    prefills = [
        i
        for i, p in enumerate(prompts)
        if isinstance(p, list) and p and p[-1]["role"] == "assistant"  # (chat messages: `not_chat_messages`)
    ]
    if prefills:  # GRPOTrainer (TRL 1.16) opens a new assistant turn after them instead
        logger.warning(
            f"{what} has {len(prefills)} chat prompt(s) ending with an assistant message ({rows(prefills)}): the "
            "policy continues that message, a prefill (GRPOTrainer opens a new turn after it). A conversation whose "
            "last message is the reply to learn (TRL's 'messages' format) wants it dropped: "
            "dataset.map(lambda row: {'prompt': row['prompt'][:-1]})."
        )
    empty = [i for i, prompt in enumerate(prompts) if not prompt]
    if empty:
        logger.warning(
            f"{what} has {len(empty)} empty prompt(s) ({rows(empty)}): their completions are sampled from nothing "
            "but the special tokens, and where the tokenizer adds none (Qwen's) they are refused (a stream's as it "
            "is read). Remove them, or check the column."
        )


def check_streamed_rows(rows: list[dict], what: str) -> None:
    """A stream's rows as a rollout or an evaluation batch reads them (its first was checked up front), refused as
    a data set's are up front (no prompt, nothing to reply to, images), without the warnings. Every process checks
    the whole batch, which each holds: one that raised on its own share left the others waiting in a collective."""
    check_prompts([row.get("prompt") for row in rows], what, warn=False)
    for row in rows:
        refuse_images(row, what)


IMAGE_COLUMNS = ("image", "images")
"""The columns GRPOTrainer reads images from."""


def _holds_image(value: Any) -> bool:
    """Whether a row's image column holds an image: None and an empty list are none (the text rows of a set that
    mixes text and images: GRPOTrainer reads a batch whose `images` are all `[]` as text)."""
    return value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0)


def refuse_image_columns(dataset: Dataset, what: str) -> None:
    """`refuse_images` for the image columns of every row of a map-style set, read as Arrow (no image decoded)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for name in (c for c in IMAGE_COLUMNS if c in dataset.column_names):
        column = dataset.with_format("arrow")[name]
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            held = (pc.max(pc.list_value_length(column)).as_py() or 0) > 0
        else:
            held = column.null_count < len(column)
        if held:
            _refuse_images(what, f"its {name!r} column")


def _refuse_images(what: str, where: str) -> None:
    raise ValueError(
        f"{what} has images ({where}), and this trainer trains on text prompts only: they would be left out. "
        "Drop them to train on the text alone (dataset.remove_columns(...)), or use TRL's GRPOTrainer for a "
        "vision-language model."
    )


def refuse_images(row: dict, what: str) -> None:
    """A clear error for a row with images (an `image` / `images` column holding one, or an image part in a chat
    message): the trainer samples and scores text prompts only, so they would be left out silently (GRPOTrainer
    passes them to a vision-language model)."""
    parts = [
        part
        for message in (row["prompt"] if isinstance(row.get("prompt"), list) else [])
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    ]
    columns = [c for c in IMAGE_COLUMNS if c in row and _holds_image(row[c])]
    if columns or any(isinstance(part, dict) and part.get("type") == "image" for part in parts):
        _refuse_images(what, f"its {columns[0]!r} column" if columns else "an image in its chat messages")


def check_eval_dataset(dataset, args, conversational: bool | None = None) -> dict[str, dict]:
    """A clear error unless `dataset` can be evaluated on (in any form `GRPOTrainer` takes: a `Dataset`, an
    `IterableDataset`, or a `DatasetDict` / `IterableDatasetDict` / dict of them), or unless it is there when
    `args.eval_strategy` or `args.eval_on_start` asks for evaluation. With `conversational` (the train set's
    format), its prompts must be in that format too: the trainer formats every prompt as the train set's. Returns the
    first row of each: `{name: row}`, name "" for a single one.
    """
    if dataset is None:
        if args.eval_strategy != "no":
            strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
            raise ValueError(
                f"eval_strategy={strategy!r} asks for evaluation during training, but no eval_dataset was given: pass "
                "one, or set eval_strategy='no'."
            )
        if args.eval_on_start:  # (transformers' Trainer fails at the start of training)
            raise ValueError(
                "eval_on_start=True evaluates before the first step, but no eval_dataset was given: pass one, or set "
                "eval_on_start=False."
            )
        return {}
    parts = dict(dataset) if isinstance(dataset, dict) else {"": dataset}  # DatasetDicts are dicts
    rows = {}
    for name, part in parts.items():
        what = f"eval_dataset[{name!r}]" if name else "eval_dataset"
        if not isinstance(part, (Dataset, IterableDataset)):
            raise TypeError(
                f"{what} must be a datasets.Dataset or IterableDataset (or a dict of them), got {type(part).__name__}."
            )
        row = next(iter(part), None)
        if row is None:
            raise ValueError(f"{what} is empty: it needs at least one prompt.")
        if "prompt" not in row:
            raise ValueError(f"{what} has no 'prompt' column; its columns are {sorted(row)}.")
        if isinstance(part, Dataset):
            refuse_image_columns(part, what)
            prompts = part["prompt"]
            check_prompts(prompts, what)
            for i, prompt in enumerate(prompts):
                refuse_images({"prompt": prompt}, f"{what} (row {i})")
        else:  # a stream's rows are read as training goes: its first one is checked
            refuse_images(row, what)
            check_prompts([row["prompt"]], what)
        if conversational is not None and is_conversational({"prompt": row["prompt"]}) != conversational:
            formats = ("plain text", "chat messages") if conversational else ("chat messages", "plain text")
            raise ValueError(
                f"{what}'s prompts are {formats[0]} and train_dataset's are {formats[1]}: the trainer formats every "
                "prompt as the train set's. Give both the same format, e.g. a plain prompt p as chat messages: "
                "[{'role': 'user', 'content': p}]."
            )
        rows[name] = row
    return rows


def check_best_metric_names_an_eval_set(dataset, args) -> None:
    """With a dict of eval sets (the trainer's, which the evaluations during training read), `metric_for_best_model`
    names one of them: each set's metrics are logged under its name (`eval_<name>_reward`), as transformers names
    their eval loss. A name without one was a KeyError at the first evaluation during training, after the steps
    before it (GRPOTrainer logs its own metrics unnamed: the last set's)."""
    metric = args.metric_for_best_model
    if not isinstance(dataset, dict) or not metric or args.eval_strategy == "no":
        return
    checked = metric if metric.startswith("eval_") else f"eval_{metric}"
    if not any(checked.startswith(f"eval_{name}_") for name in dataset):
        named = ", ".join(f"eval_{name}_{checked.removeprefix('eval_')}" for name in dataset)
        raise ValueError(
            f"metric_for_best_model={metric!r} names no data set of the eval_dataset dict, whose metrics are logged "
            f"by data set: name one of them ({named})."
        )


def long_prompts_handled(
    dataset: Dataset | IterableDataset, args, prompt_lengths: Callable[[list], list[int]]
) -> tuple[Dataset | IterableDataset, str | None]:
    """The training prompts longer than `args.max_prompt_length` tokens (`prompt_lengths` gives the untruncated
    token counts of a list of prompts), counted once before training: dropped with `drop_long_prompts` (a stream's
    as they arrive: it is not counted ahead), else kept, to be cut from the left. Returns the dataset to train on and
    what to tell the user (None: nothing)."""
    limit = args.max_prompt_length
    if isinstance(dataset, IterableDataset) and limit is not None and args.drop_long_prompts:

        def short_enough(row: dict) -> bool:
            # The filter reads each row before the rollout's check would: checked here, or the tokenizer's error
            # (or the chat template's) named a bad row.
            check_streamed_rows([row], "train_dataset (a row read from the stream)")
            return prompt_lengths([row["prompt"]])[0] <= limit

        return dataset.filter(short_enough), None
    if limit is None or isinstance(dataset, IterableDataset):
        return dataset, None
    lengths = []
    for start in range(0, len(dataset), 1000):
        lengths += prompt_lengths(dataset[start : start + 1000]["prompt"])
    long = [i for i, n in enumerate(lengths) if n > limit]
    if not long:
        return dataset, None
    counted = f"{len(long)} of {len(dataset)} training prompts"
    if args.drop_long_prompts:
        dropped = f"Dropped {counted} longer than max_prompt_length={limit} tokens (longest: {max(lengths)})."
        kept = dataset.select(sorted(set(range(len(dataset))) - set(long)))
        try:
            check_train_dataset(kept, args)
        except ValueError as error:  # (it counts the prompts the drop left: said why they are few)
            raise ValueError(f"drop_long_prompts=True: {dropped} Then: {error} Or raise max_prompt_length.") from None
        return kept, dropped
    return dataset, (
        f"{counted} are longer than max_prompt_length={limit} tokens (longest: {max(lengths)}); they are truncated "
        "from the left. Raise max_prompt_length to keep them whole, or set drop_long_prompts=True to leave them out."
    )
