"""Scoring completions with reward functions (TRL's protocol), the one copy shared by training and `trl-vapo eval`.

A reward function is called with keyword arguments `prompts`, `completions` (strings, or one-message lists for chat
data), `completion_ids`, `trainer_state`, `log_extra`, `log_metric` and every other dataset column (e.g. `answer`),
and returns one float per completion, or None where it has no opinion; `async def` functions run concurrently with
each other, after the synchronous ones (as GRPOTrainer runs them).
Several functions are summed with weights; a completion no function scores has no reward at all (it trains nothing;
GRPOTrainer's warning names it). NaN and inf returned by a function count as None, with one warning per function.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float | None]]

TRAINER_KWARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra", "kwargs"}
"""Keyword arguments the caller supplies to every reward function; any other required parameter is a data column."""
UNPASSED_COLUMNS = ("prompt", "completion", "completion_ids")
"""Dataset columns never passed to reward functions, as GRPOTrainer leaves them out (``prompts`` carries the prompt;
a reference ``completion`` column would otherwise reach ``**kwargs`` beside the generated ``completions``)."""


@dataclass
class Scores:
    """The verdicts on one batch of completions."""

    per_function: torch.Tensor  # [N, F] float, NaN where a function gave no score
    reward: torch.Tensor  # [N] the weighted sum of the scores given (0 where none was)
    scored: torch.Tensor  # [N] bool, at least one function scored the completion
    names: list[str]
    # [N] the weighted sum of the functions that judge correctness (`positive_reward_funcs`), NaN where none of them
    # scored; None: all of them (`reward`)
    verdict: torch.Tensor | None = None
    # [N, F] bool, the function returned NaN or inf (NaN in `per_function`, as if it had returned None); default: none
    non_finite: torch.Tensor | None = None

    def __post_init__(self):
        if self.non_finite is None:
            self.non_finite = torch.zeros(self.per_function.shape, dtype=torch.bool)

    def is_correct(self, threshold: float) -> torch.Tensor:
        """[N] bool: scored, with a reward of at least `threshold` ("correct": the NLL loss and accuracy); only the
        functions that judge correctness count, where they are named."""
        if self.verdict is not None:
            return ~torch.isnan(self.verdict) & (self.verdict >= threshold)
        return self.scored & (self.reward >= threshold)

    @property
    def judged(self) -> torch.Tensor:
        """[N] bool: a function that judges correctness scored the completion (the completions an accuracy counts;
        with `positive_reward_funcs` a format reward may score what math_reward leaves unscored)."""
        return self.scored if self.verdict is None else ~torch.isnan(self.verdict)


class RewardModel:
    """A sequence-classification reward model as a reward function of TRL's protocol, scored as GRPOTrainer scores
    it: each prompt + completion through the model's own tokenizer (with its chat template for chat data), right
    padded, no special tokens added; the reward is the first label's logit, computed in eval mode without
    gradients. `model` may be replaced by its placed form (a DeepSpeed engine, FSDP) and `device` set to its inputs'.
    """

    def __init__(self, model: nn.Module, tokenizer, chat_template_kwargs: dict | None = None):
        from ._compat import get_config_model_id

        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        # The model scores the last non-padding token: it must know the tokenizer's padding id.
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.device = next(model.parameters()).device
        self.batch_size = 256  # sequences a forward
        self.__name__ = reward_model_name(get_config_model_id(model.config))

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        from trl import apply_chat_template

        if isinstance(prompts[0], list):  # chat messages
            texts = [
                apply_chat_template({"messages": p + c}, self.tokenizer, **self.chat_template_kwargs)["text"]
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        rewards = []
        # In batches of `batch_size`: a rollout is one or a few (as GRPOTrainer scores it), an evaluation set at k
        # samples a prompt (thousands of sequences) many.
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(
                text=texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(self.device)
            # no_grad, not inference_mode: FSDP2 keeps the gathered weights' buffers across calls, and a buffer first
            # made under inference mode is an inference tensor, whose version counter FSDP2 reads on its next gather
            # ("Inference tensors do not track version counter", on one process).
            with torch.no_grad():
                rewards += self.model(**inputs).logits[:, 0].float().tolist()
        return rewards


def checked_reward_weights(reward_weights: Sequence[float] | None, count: int) -> list[float]:
    """One weight per reward function (1 each by default), or a ValueError naming both counts."""
    weights = list(reward_weights) if reward_weights is not None else [1.0] * count
    if len(weights) != count:
        raise ValueError(
            f"reward_weights has {len(weights)} values but there are {count} reward functions (a reward model counts "
            "as one): give one weight per function, in their order, or none (1 each)."
        )
    return weights


def load_reward_models(reward_funcs, reward_processing_classes, args) -> list:
    """`reward_funcs` with each reward model (a model id, a local path or a module for sequence classification with a
    transformers config, as GRPOTrainer takes them) made a :class:`RewardModel`: loaded with `args.model_init_kwargs`
    (in its saved dtype unless they name one; not those naming files of the policy's repository or placing its
    modules) and `num_labels=1`, with its tokenizer from `reward_processing_classes` (one per entry, None for
    functions) or its own."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, PretrainedConfig

    from ._compat import get_config_model_id
    from .loading import CHECKPOINT_ONLY_KWARGS
    from .pretrained import from_pretrained_kwargs, load_pretrained, lookup_kwargs, with_dtype_named

    funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    checked_reward_weights(args.reward_weights, len(funcs))  # before a reward model loads
    classes = reward_processing_classes
    classes = [None] * len(funcs) if classes is None else classes if isinstance(classes, list) else [classes]
    if len(classes) != len(funcs):
        raise ValueError(
            f"The number of reward processing classes ({len(classes)}) must match the number of reward functions "
            f"({len(funcs)}) (as in GRPOTrainer): one per entry, None for the functions."
        )
    loaded = []
    for func, tokenizer in zip(funcs, classes):
        lookup = {"trust_remote_code": args.trust_remote_code}  # where a model loaded here found its files
        if isinstance(func, (str, os.PathLike)):
            # Frozen: in the dtype it was saved in ("auto", as GRPOTrainer loads it), unless model_init_kwargs says;
            # the float32 default is the trained models' (their master weights). Not the policy's options that name
            # files of its own repository or place its modules (a `subfolder` was looked for in the reward model, a
            # `device_map` placed it as the policy); its revision and quantization are the reward model's too, as
            # GRPOTrainer loads it (it loads the reward model's tokenizer at that revision).
            init = {"dtype": "auto", **(with_dtype_named(args.model_init_kwargs) or {})}
            shared = ("quantization_config", "revision")
            init = {k: v for k, v in init.items() if k not in CHECKPOINT_ONLY_KWARGS or k in shared}
            kwargs = from_pretrained_kwargs(args, init)
            func = load_pretrained(AutoModelForSequenceClassification, str(func), {"num_labels": 1, **kwargs})
            lookup = lookup_kwargs(kwargs)  # (its cache_dir, token, local_files_only)
        # A model: any module with a transformers config, as GRPOTrainer takes it (a `torch.compile`d one, a PEFT
        # sequence classifier: they were refused as not a PreTrainedModel).
        if isinstance(func, nn.Module) and isinstance(getattr(func, "config", None), PretrainedConfig):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(get_config_model_id(func.config), **lookup)
            func = RewardModel(func, tokenizer, args.chat_template_kwargs)
        loaded.append(func)
    return loaded


def check_reward_funcs(
    reward_funcs: RewardFunc | Sequence[RewardFunc] | None,
) -> tuple[list[RewardFunc], list[str]]:
    """The reward functions as a list, with their names; a clear error for what cannot be one."""
    if reward_funcs is None:
        reward_funcs = []
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        # GRPOTrainer's error: its other reward source, an environment's `get_reward`, is not one VAPO takes.
        raise ValueError(
            "No reward source provided. Pass `reward_funcs`: at least one reward function, e.g. "
            "trl_vapo.rewards.math_reward (VAPO takes no `environment_factory`, GRPOTrainer's other reward source)."
        )
    for func in funcs:
        if not callable(func) or isinstance(func, nn.Module):
            raise TypeError(
                f"Reward functions must be callables following TRL's protocol, a reward model's id or path, or a "
                f"model for sequence classification (with a transformers config); got {type(func).__name__}."
            )
    given = [reward_func_name(func) for func in funcs]
    names = unique_reward_names(given)
    for func, name, unique in zip(funcs, given, names, strict=True):
        if unique == f"{name}_2" and hasattr(func, "answer_columns"):  # a MathReward, which logs under its own name
            logger.warning(
                f"Two reward functions are named {name!r}: their rewards are logged apart ({name}, {name}_2), but "
                f"what math_reward logs itself ({name}/no_answer_rate, the {name}_answer column) mixes both. Give "
                "each its own name: make_math_reward(..., name=...)."
            )
    return funcs, names


def parsed_completions(
    tokenizer,
    completion_ids: list[list[int]],
    prompt_ids: Callable[[], list[list[int]]],
    texts: list[str] | None = None,
) -> list[dict[str, Any] | str] | None:
    """Chat completions as the assistant messages the tokenizer's response template reads from their tokens (the
    reasoning apart from the content: `{"role": "assistant", "reasoning_content": ..., "content": ...}`, or
    `"thinking"` where the template names it so), as
    GRPOTrainer passes them to reward functions where the tokenizer has a `response_template` (Gemma 4's own, or
    one TRL's `add_response_schema` sets); None where it has none (the decoded text is then the message's content).
    `prompt_ids()` gives each completion's prompt tokens, which the parser reads from the assistant turn's start: a
    template may open the reasoning there, and a prefill's text begins the message. (The former `response_schema`
    alone is not read: transformers 5.23's parser reads `response_template` only, and raises without one.) `texts`:
    the completions decoded (`skip_special_tokens=True`), where the caller has them."""
    if getattr(tokenizer, "response_template", None) is None:
        return None
    from ._compat import parse_response

    if texts is None:
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    messages = []
    for ids, prefix, text in zip(completion_ids, prompt_ids(), texts, strict=True):
        message = parse_response(tokenizer, ids, prefix=prefix)
        # Where the parser fails (a malformed tool call), TRL's fallback is the decoded completion alone: text, as a
        # tokenizer without a parser gives, to which a prefill's text is joined (the parser's own message holds it;
        # as a message, the prefill was dropped from the prompt and found nowhere).
        fallback = message.keys() == {"role", "content"} and message["content"] == text
        messages.append(text if fallback else message)
    return messages


def unique_reward_names(names: list[str]) -> list[str]:
    """One name, one metric and one table column each: a second function of a name (two partials of one function,
    two reward models saved as checkpoint-500) is `<name>_2`, where it overwrote the first."""
    unique, count = [], {}
    for name in names:
        count[name] = count.get(name, 0) + 1
        unique.append(name if count[name] == 1 else f"{name}_{count[name]}")
    return unique


def check_positive_reward_funcs(positive_reward_funcs: Sequence[str] | None, names: Sequence[str]) -> None:
    """A clear error where `positive_reward_funcs` names a function that is not one of `names`."""
    unknown = [name for name in positive_reward_funcs or [] if name not in names]
    if unknown:
        raise ValueError(
            f"positive_reward_funcs names {unknown}, which are not reward functions here: they are {list(names)}."
        )


def reward_model_name(model_id: str) -> str:
    """A reward model's name, as GRPOTrainer names it: its id's last part (of a path given with a trailing slash,
    as a shell completes it, too: GRPOTrainer's split named it "")."""
    return model_id.rstrip("/\\").replace("\\", "/").split("/")[-1]


def reward_func_name(func: RewardFunc) -> str:
    """A reward function's name, as GRPOTrainer names it: a `functools.partial` by the function it wraps, a callable
    object by its class."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async(func: RewardFunc) -> bool:
    """An `async def` reward function, a callable object whose `__call__` is one, or a `functools.partial` of
    either (TRL's `is_async_callable`)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


_event_loop: tuple[int, asyncio.AbstractEventLoop] | None = None  # (the process it runs in, the loop)


def run_async(coroutine) -> concurrent.futures.Future:
    """Schedule `coroutine` on the reward functions' event loop, in a daemon thread (TRL's
    `start_event_loop_in_daemon`), so that it runs whether or not the caller has a loop of its own (a notebook).
    A forked process starts its own: the parent's loop thread does not exist in it, and a result waited for there
    never came."""
    global _event_loop
    if _event_loop is None or _event_loop[0] != os.getpid():
        from ._compat import start_event_loop_in_daemon

        _, loop, ready = start_event_loop_in_daemon(name="trl-vapo-reward-functions")
        ready.wait()
        _event_loop = os.getpid(), loop
    return asyncio.run_coroutine_threadsafe(coroutine, _event_loop[1])


def _blocking(func: RewardFunc) -> RewardFunc:
    """An async reward function as a synchronous one (each call waits for its result), reading what it reads."""

    def blocking(**kwargs):
        return run_async(func(**kwargs)).result()

    blocking.reads_prompt_opens_think = getattr(func, "reads_prompt_opens_think", False)
    return blocking


def required_columns(func: RewardFunc) -> list[str]:
    """Keyword parameters of a reward function without a default that the caller does not supply: dataset columns."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return []
    return [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.name not in TRAINER_KWARGS
    ]


def preview(sample: dict, limit: int = 600) -> str:
    text = json.dumps(sample, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


class RewardScorer:
    """Calls the reward functions on completions and combines their scores.

    Args:
        reward_funcs: one function or a list (TRL's protocol).
        reward_weights: one weight per function (default: 1 each).
        conversational: the prompts are chat messages, so completions are passed as one assistant message each.
        positive_reward_funcs: the names of the functions whose weighted sum says whether a completion is correct
            (`Scores.is_correct`); None: all of them.
    """

    def __init__(
        self,
        reward_funcs: RewardFunc | Sequence[RewardFunc],
        reward_weights: Sequence[float] | None = None,
        conversational: bool = False,
        positive_reward_funcs: Sequence[str] | None = None,
    ):
        self.funcs, self.names = check_reward_funcs(reward_funcs)
        self.weights = torch.tensor(checked_reward_weights(reward_weights, len(self.funcs)), dtype=torch.float32)
        check_positive_reward_funcs(positive_reward_funcs, self.names)
        self.judges = None
        if positive_reward_funcs is not None:
            self.judges = torch.tensor([name in positive_reward_funcs for name in self.names])
        self.conversational = conversational
        # Whether a function reads `prompt_opens_think` (`math_reward`): the callers work it out only then.
        self.reads_thinking = any(getattr(func, "reads_prompt_opens_think", False) for func in self.funcs)
        self._warned_non_finite: set[str] = set()

    def check_threshold_reachable(self, threshold: float) -> None:
        """A clear error where no completion can ever be positive: every function that judges correctness says what
        a right and a wrong answer score (`correct_reward`, `incorrect_reward`: the built-in math rewards), and the
        best sum of those, weighted, is under `threshold` (`reward_weights=[0.4]` on `math_reward`: a right answer's
        0.4 under 0.5, so `accuracy` read 0 and the NLL loss never ran, silently). Functions of unknown range pass."""
        judges = range(len(self.funcs)) if self.judges is None else self.judges.nonzero().flatten().tolist()
        best = 0.0
        for i in judges:
            values = [getattr(self.funcs[i], name, None) for name in ("correct_reward", "incorrect_reward")]
            if None in values:
                return
            best += max(float(self.weights[i]) * value for value in values)
        if best < threshold:
            raise ValueError(
                f"positive_reward_threshold={threshold} is above the best weighted reward of the functions that judge "
                f"correctness ({', '.join(self.names[i] for i in judges)}: {best:g}, with reward_weights "
                f"{[float(w) for w in self.weights]}): no completion could count as correct, so `accuracy` would read "
                "0 and the positive-example NLL loss never train. Lower positive_reward_threshold to at most "
                f"{best:g}, or raise those weights."
            )

    def score(
        self,
        rows: list[dict[str, Any]],
        completions: list[str] | list[dict[str, Any]],
        completion_ids: list[list[int]] | None = None,
        trainer_state=None,
        log_metric: Callable[[str, float], None] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
        prompt_opens_think: list[bool] | None = None,
    ) -> Scores:
        """Score `completions` (decoded text, or for chat data the messages :func:`parsed_completions` read) of the
        prompts in `rows` (dataset rows, one per completion).

        `prompt_opens_think` (:func:`prompt_opens_think`, for decoded text): where the prompt opened a think block
        (DeepSeek-R1's template), given to the functions that read it (`math_reward`: a completion without `</think>`
        was cut off while thinking, and commits to no answer).

        `trainer_state`, `log_metric` and `log_extra` are passed to the functions (TRL's protocol). As in
        GRPOTrainer, the synchronous functions run first, one after another, then the async ones concurrently with
        each other, each on its own copy of the prompts and completions.
        A NaN or inf score counts as no score (`Scores.non_finite` says which were).
        """
        rows, messages = self._as_messages(rows, completions)
        ids = completion_ids if completion_ids is not None else [[] for _ in completions]
        common = {
            "trainer_state": trainer_state,
            "log_metric": log_metric or (lambda key, value: None),
            "log_extra": log_extra or (lambda column, values: None),
        }
        thinking = prompt_opens_think if prompt_opens_think is not None and any(prompt_opens_think) else None
        # (copied before the synchronous functions run: a judge that appends its verdict to the messages does not
        # change what an async one reads)
        copies = {j: _own_messages(rows, messages) for j, func in enumerate(self.funcs) if is_async(func)}
        per_function = torch.full((len(rows), len(self.funcs)), math.nan)
        non_finite = torch.zeros(len(rows), len(self.funcs), dtype=torch.bool)

        def record(j: int, values: list) -> None:
            name = self.names[j]
            column = torch.tensor([math.nan if v is None else v for v in values])
            given = torch.tensor([v is not None for v in values])
            non_finite[:, j] = torch.isinf(column) | (torch.isnan(column) & given)
            if non_finite[:, j].any() and name not in self._warned_non_finite:
                logger.warning(
                    f"Reward function {name!r} returned NaN or inf for {int(non_finite[:, j].sum())} of {len(rows)} "
                    f"completions; they are treated like None (left out unless another function scores them) and "
                    f"their share is logged as `rewards/{name}/non_finite_fraction`."
                )
                self._warned_non_finite.add(name)
            column[non_finite[:, j]] = math.nan
            per_function[:, j] = column

        for j, (func, name) in enumerate(zip(self.funcs, self.names)):
            if j not in copies:
                record(j, self.call(func, name, rows, messages, ids, common, thinking))
        # As GRPOTrainer: the async functions start once the synchronous ones have ended (an object the two share,
        # a fast tokenizer, raised "Already borrowed" when used from both at once; a failing synchronous function
        # left paid judges running), then run concurrently with each other.
        started = {
            j: run_async(self.funcs[j](**_arguments(self.funcs[j], *copies[j], ids, common, thinking))) for j in copies
        }
        for j, future in started.items():
            try:
                returned = future.result()
            except Exception as error:  # called one by one to name the first sample it fails on, then raised
                blocking = _blocking(self.funcs[j])
                _raise_naming_the_failing_sample(blocking, self.names[j], *copies[j], ids, common, error, thinking)
            record(j, _checked_values(returned, self.names[j], len(rows)))
        scored = ~torch.isnan(per_function).all(dim=1)
        if not scored.all():  # GRPOTrainer's warning, naming the first such sample
            i = int((~scored).nonzero()[0])
            sample = {**rows[i], "completion": messages[i]}
            logger.warning(
                f"All reward functions returned None for the following kwargs:\n{sample}\nPlease ensure that at least "
                "one reward function returns a valid reward."
            )
        reward = torch.where(scored, torch.nansum(per_function * self.weights, dim=1), torch.zeros(len(rows)))
        verdict = None
        if self.judges is not None:
            judged = per_function[:, self.judges]
            verdict = torch.nansum(judged * self.weights[self.judges], dim=1)
            verdict[torch.isnan(judged).all(dim=1)] = math.nan
        return Scores(per_function, reward, scored, self.names, verdict, non_finite)

    def _as_messages(
        self, rows: list[dict[str, Any]], completions: list[str | dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list]:
        """The rows and completions as reward functions take them: for chat data, each completion one assistant
        message (the decoded text as its content, or the message :func:`parsed_completions` read). A prompt that ends
        with an assistant message (a prefill) was continued by the policy (TRL's `maybe_apply_chat_template`
        continues it): that message and its continuation are one turn, the completion, and the prompt is the rest,
        as GRPOTrainer passed them when it continued prefills. Else a reward model read two closed turns where the
        policy wrote one. `completion_ids` stay the tokens the policy sampled."""
        if not self.conversational:
            return rows, completions
        joined_rows, messages = [], []
        for row, completion in zip(rows, completions, strict=True):
            parsed = isinstance(completion, dict)
            message = dict(completion) if parsed else {"role": "assistant", "content": completion}
            prompt = row["prompt"]
            if prompt and prompt[-1].get("role") == "assistant" and isinstance(prompt[-1].get("content"), str):
                row = {**row, "prompt": prompt[:-1]}
                if not parsed:  # (the parser read the prefill in the prompt's tokens: its message holds it already)
                    message["content"] = prompt[-1]["content"] + message.get("content", "")
            joined_rows.append(row)
            messages.append([message])
        return joined_rows, messages

    @staticmethod
    def call(func, name, rows, completions, completion_ids, common: dict[str, Any], thinking=None) -> list:
        """One function on a batch (`common`: `trainer_state`, `log_metric`, `log_extra`; `thinking`: `score`'s
        `prompt_opens_think`); when it raises, the error names the first sample it fails on."""
        try:
            values = func(**_arguments(func, rows, completions, completion_ids, common, thinking))
        except Exception as error:
            _raise_naming_the_failing_sample(func, name, rows, completions, completion_ids, common, error, thinking)
        return _checked_values(values, name, len(rows))

    def check(self, row: dict[str, Any], group_size: int = 1, max_steps: int = 1) -> None:
        """Call every function once on a dataset row's group (`group_size` copies, as a rollout holds the completions
        of a prompt: a function that reads the batch by groups, `reshape(-1, num_generations)`, runs) with empty
        completions, before any compute, with what training passes (a `TrainerState` at step 0 of `max_steps`, at
        least 1: TRL's reward schedules divide by it, and transformers' default 0 was a ZeroDivisionError; `log_metric`
        and `log_extra`); a reward model, which scores each row alone, on one row.

        A missing column, a bad import or a crash then fails here, with the dataset's columns in the message, not
        after the model has loaded and generated.
        """
        from transformers import TrainerState

        state = TrainerState(max_steps=max(1, max_steps))
        common = {"trainer_state": state, "log_metric": lambda *a: None, "log_extra": lambda *a: None}
        passed = TRAINER_KWARGS - {"kwargs"}  # what each call gets, whatever the columns
        clashing = sorted((set(row) - set(UNPASSED_COLUMNS)) & passed)
        if clashing:  # GRPOTrainer fails on these too, later: "got multiple values for argument"
            raise ValueError(
                f"The dataset column(s) {clashing} have the name of an argument the trainer passes to reward "
                f"functions (the generated {', '.join(sorted(passed))}), which the column would "
                "replace; "
                f"rename it, e.g. dataset.rename_column({clashing[0]!r}, 'reference_{clashing[0]}')."
            )
        for func, name in zip(self.funcs, self.names):
            missing = [c for c in required_columns(func) if c not in row]
            if missing:
                raise ValueError(
                    f"Reward function {name!r} needs the column(s) {missing}, which the dataset lacks; its columns "
                    f"are {sorted(row)}."
                )
            try:
                copies = 1 if isinstance(func, RewardModel) else group_size  # (a model scores each row alone)
                rows, completions = self._as_messages(repeated_rows([row], copies), [""] * copies)
                self.call(_blocking(func) if is_async(func) else func, name, rows, completions, [[]] * copies, common)
            except RuntimeError as error:
                raise ValueError(
                    f"{error} (checked before training on {copies} cop{'y' if copies == 1 else 'ies'} of the first "
                    f"dataset row with empty completions; dataset columns: {sorted(row)})"
                ) from error


def repeated_rows(rows: list[dict[str, Any]], times: int, share: slice = slice(None)) -> list[dict[str, Any]]:
    """Each row `times` times in a row (a prompt's group), every copy its own objects, as GRPOTrainer's rows are
    (its DataLoader builds each one anew): a reward function that edits what it is given, e.g. appends each
    completion to its prompt's messages to ask a judge, changed the other completions' prompts and columns, and the
    rows a later call (the greedy pass of an evaluation) read. `share`: the part of the repeated rows wanted (a
    process's), the others not copied."""
    return [copy.deepcopy(row) for row in [row for row in rows for _ in range(times)][share]]


def rows_with_fields(rows: list[dict[str, Any]], fields: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows with a `rollout_func`'s other fields as columns, which reward functions read as they read the
    dataset's: a list gives each row its entry, anything else every row the same value (as GRPOTrainer merges them).
    New dicts: the dataset's rows stay as they were."""
    clashing = sorted(set(fields) & (TRAINER_KWARGS | set(UNPASSED_COLUMNS)))
    if clashing:
        raise ValueError(
            f"rollout_func returned the field(s) {clashing}, the name of what the trainer passes to reward functions "
            "itself; rename them."
        )
    for name, values in fields.items():
        if isinstance(values, list) and len(values) != len(rows):
            raise ValueError(
                f"rollout_func's field `{name}` is a list of {len(values)} for {len(rows)} prompts: give one entry "
                "per prompt, or a value that is not a list to give every completion the same one."
            )
    return [
        {**row, **{name: values[i] if isinstance(values, list) else values for name, values in fields.items()}}
        for i, row in enumerate(rows)
    ]


def _own_messages(rows: list[dict[str, Any]], completions: list) -> tuple[list[dict[str, Any]], list]:
    """The rows with a copy of their prompts, and a copy of the completions, taken before the synchronous functions
    run: what an async function reads, after them, one of which may edit what it is given (a judge appending to a
    prompt's messages). The other columns are passed as they are: a rollout function's environment handle (a lock,
    a socket) cannot be copied, and an image column would be copied for nothing."""
    prompts, completions = copy.deepcopy(([row["prompt"] for row in rows], completions))
    return [{**row, "prompt": prompt} for row, prompt in zip(rows, prompts)], completions


def _arguments(
    func, rows: list[dict[str, Any]], completions: list, completion_ids: list, common: dict, thinking=None
) -> dict[str, Any]:
    """The keyword arguments of `func`'s call on a batch: TRL's, and every dataset column but `UNPASSED_COLUMNS` as a
    list; and `thinking` as `prompt_opens_think` where `func` reads it (`reads_prompt_opens_think`)."""
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in UNPASSED_COLUMNS}
    if thinking is not None and getattr(func, "reads_prompt_opens_think", False):
        columns["prompt_opens_think"] = list(thinking)
    prompts = [row["prompt"] for row in rows]
    return {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **common, **columns}


def prompt_opens_think(tokenizer, prompt_ids: list[list[int]]) -> list[bool]:
    """Whether each prompt, as the policy read it (its token ids: the chat template applied), leaves a think block
    open: DeepSeek-R1's template (and its distillations') ends the prompt with `<think>`, so a completion holds only
    `</think>`, and one cut off while thinking holds no tag at all (its tentative `\\boxed{}` is no answer). Qwen3's
    `enable_thinking=False` closes the block it opens: not open."""
    from .rewards.answers import THINK_CLOSE, THINK_OPEN

    tails = [tuple(ids[-32:]) for ids in prompt_ids]  # (the tags are among the last tokens)
    unique = list(dict.fromkeys(tails))  # each prompt once, not once per completion of its group
    opens = {
        tail: THINK_OPEN in text.rpartition(THINK_CLOSE)[2]
        for tail, text in zip(unique, tokenizer.batch_decode(unique))
    }
    return [opens[tail] for tail in tails]


FAILING_SAMPLE_SEARCH = (8, 30.0)
"""At most this many samples, and seconds (checked between calls), `_raise_naming_the_failing_sample` calls a failed
function on: a judge that a rate limit or an outage refused (each sample alone then answers, or fails as slowly) was
called on every sample of a 512-row rollout, minutes of paid calls, before its error was raised (GRPOTrainer raises
at once)."""


def _raise_naming_the_failing_sample(
    func, name, rows, completions, completion_ids, common, error: Exception, thinking=None
):
    """`func` raised `error` on the batch: called on each of its first samples alone (`FAILING_SAMPLE_SEARCH`), the
    error names the first it fails on (or says that none of them fails alone). Raised whatever the search finds: a
    result of a second call is never used (an async function's failure was retried on the whole batch, silently,
    where a function that is not async's stopped)."""
    most, seconds = FAILING_SAMPLE_SEARCH
    deadline = time.monotonic() + seconds
    tried = 0
    for i in range(min(len(rows), most)):
        if i and time.monotonic() > deadline:
            break
        tried += 1
        try:
            one = None if thinking is None else thinking[i : i + 1]
            func(**_arguments(func, rows[i : i + 1], completions[i : i + 1], completion_ids[i : i + 1], common, one))
        except Exception:
            sample = {**rows[i], "completion": completions[i]}
            raise RuntimeError(
                f"Reward function {name!r} raised {type(error).__name__}: {error} -- first failing sample "
                f"(#{i} of the batch): {preview(sample)}"
            ) from error
    some = f"its {tried} completions" if tried == len(rows) else f"the first {tried} of its completions"
    later = "" if tried == len(rows) else ", or a later completion's"
    raise RuntimeError(
        f"Reward function {name!r} raised {type(error).__name__} on the batch of {len(rows)}: {error} -- but "
        f"on none of {some} called alone, one by one, to find the failing one: a "
        "transient failure (a timeout, a rate limit), or one that depends on the batch (its size, a mix of "
        f"rows){later}. Make the function retry, or return None for the completions it cannot score."
    ) from error


def _checked_values(values, name: str, expected: int) -> list[float | None]:
    """A reward function's `values` as floats (None kept), after checking that there is one number (or None) per
    completion: a scalar, a generator, a coroutine or a string raised a bare TypeError or ValueError that did not
    name the function."""
    must = "it must return a list of one float (or None) per completion"
    zero_d = getattr(values, "ndim", None) == 0  # a 0-d tensor or array has __len__, which raises
    if values is None or zero_d or isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ValueError(f"Reward function {name!r} returned {type(values).__name__} ({preview(values)}); {must}.")
    if len(values) != expected:
        raise ValueError(f"Reward function {name!r} returned {len(values)} values for {expected} completions; {must}.")
    floats: list[float | None] = []
    for value in values:
        try:
            if isinstance(value, (str, bytes)):  # float("1.0") reads; a reward is a number, not its text
                raise TypeError
            floats.append(None if value is None else float(value))
        except (TypeError, ValueError):
            raise ValueError(
                f"Reward function {name!r} returned {type(value).__name__} ({preview(value)}) as a value; {must}."
            ) from None
    return floats
