"""The reward functions: :class:`MathReward` (gold against prediction: :mod:`.answers` extracts, :mod:`.exact_numbers`
decides plain numbers, :mod:`.pool`'s math-verify workers the rest) and the format reward."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from .answers import MAX_ANSWER_CHARS, extract_predicted_answer, find_last_boxed, normalize_gold_answer
from .exact_numbers import fast_verdict, parse_plain_number
from .pool import DEFAULT_MEMORY_LIMIT_MB, DEFAULT_TIMEOUT, InProcessVerifier, MathVerifyPool, _shared_pool

logger = logging.getLogger(__name__)

STRIKES = 2
"""Overruns of the deadline after which a pair is no longer verified, or a gold compared with ``0`` is unusable: one
alone may be a stall of a loaded machine, not the answer's doing."""


def completion_text(completion: Any) -> str:
    """The text of one completion: a plain string, or the last assistant message of a chat completion.

    Chat completions are lists of ``{"role": ..., "content": ...}`` messages; tool calls can put several assistant
    messages in one completion, and the final answer lives in the last. Multimodal content (a list of
    ``{"type": "text", "text": ...}`` parts) is joined. Anything else gives ``""``.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if not isinstance(completion, (list, tuple)):
        return ""
    messages = [m for m in completion if isinstance(m, dict)]
    assistant = [m for m in messages if m.get("role", "assistant") == "assistant"]
    if not (assistant or messages):
        return ""
    content = (assistant or messages)[-1].get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return ""


def _blank(gold: Any) -> bool:
    return gold is None or (isinstance(gold, str) and not gold.strip())


class MathReward:
    """A configured math reward following TRL's reward-function protocol (:func:`make_math_reward` builds one).

    A callable object rather than a closure so that it pickles (TRL's async rollout ships reward functions to a
    spawned process); the worker pool is not pickled, the receiving process starts its own.

    Args:
        answer_column: dataset column holding the gold answer, or several to try in order (the first present wins).
        correct_reward: reward of a verified answer.
        incorrect_reward: reward of a wrong, missing, over-long or timed-out answer: ``-1.0`` as in VC-PPO / VAPO,
            ``0.0`` for the 1/0 convention.
        timeout: hard deadline in seconds for math-verify on one answer; overrunning scores ``incorrect_reward``.
        num_workers: math-verify worker processes; ``None`` picks 2-4 from the CPUs available to this rank.
        memory_limit_mb: address-space cap per worker (``None``: no cap).
        name: the function's ``__name__``, under which trainers log its rewards; give each configuration its own.
    """

    reads_prompt_opens_think = True  # VAPOTrainer passes it `prompt_opens_think` (see `__call__`)

    def __init__(
        self,
        answer_column: str | Sequence[str] = ("answer", "solution"),
        correct_reward: float = 1.0,
        incorrect_reward: float = -1.0,
        timeout: float = DEFAULT_TIMEOUT,
        num_workers: int | None = None,
        memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB,
        name: str = "math_reward",
    ):
        self.answer_columns = (answer_column,) if isinstance(answer_column, str) else tuple(answer_column)
        if not self.answer_columns:
            raise ValueError("answer_column must name at least one column")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.correct_reward = float(correct_reward)
        self.incorrect_reward = float(incorrect_reward)
        self.timeout = float(timeout)
        self.num_workers = num_workers
        self.memory_limit_mb = memory_limit_mb
        self.__name__ = name
        self.__doc__ = (
            f"Math reward {name!r}: {self.correct_reward:+g} when the completion's final answer matches the gold "
            f"answer in column {' or '.join(self.answer_columns)}, {self.incorrect_reward:+g} otherwise, None when "
            f"the gold answer cannot be parsed; math-verify runs under a {self.timeout:g} s deadline."
        )
        self._init_state()

    def _init_state(self) -> None:
        self._warned_golds: set[str] = set()
        # Whether math-verify could parse a gold answer: skips a worker round trip for unanswered completions.
        self._gold_parses: OrderedDict[str, bool] = OrderedDict()
        self._timed_out: OrderedDict[tuple[str, str | None], int] = OrderedDict()  # a pair's overruns
        # Golds that compared with a plain number within the deadline: their overruns are the predictions' doing.
        self._gold_compares: OrderedDict[str, bool] = OrderedDict()
        self._gold_probe_overruns: OrderedDict[str, int] = OrderedDict()  # a gold's overruns against 0, by call
        self._overrunning_golds: set[str] = set()  # golds judged unusable for overrunning (their warning differs)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in (
            "_warned_golds",
            "_gold_parses",
            "_timed_out",
            "_gold_compares",
            "_gold_probe_overruns",
            "_overrunning_golds",
        ):
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_state()

    def __repr__(self) -> str:
        return (
            f"MathReward(name={self.__name__!r}, answer_column={self.answer_columns!r}, "
            f"correct_reward={self.correct_reward}, incorrect_reward={self.incorrect_reward}, timeout={self.timeout})"
        )

    @property
    def pool(self) -> MathVerifyPool | InProcessVerifier:
        """The worker pool this reward sends non-numeric answers to (shared per worker count, started lazily; on
        Windows math-verify in this process, without the deadline)."""
        return _shared_pool(self.num_workers, self.memory_limit_mb)

    def _golds(self, kwargs: dict) -> list:
        """Each completion's gold: from the first of `answer_columns` that holds one for its row (a mixture of data
        sets may give some rows an `answer` and others only a `solution`)."""
        columns = [(name, kwargs[name]) for name in self.answer_columns if kwargs.get(name) is not None]
        for name, column in columns:
            if isinstance(column, str):  # list() would make each character a gold answer
                raise TypeError(
                    f"{self.__name__}: {name}= is one string; pass a list with one gold answer per completion (TRL "
                    "passes each dataset column so)"
                )
        if columns:
            rows = zip(*(column for _, column in columns), strict=True)
            # A blank cell holds no gold either (a mixture's set without answers may fill the column with "").
            return [next((gold for gold in row if not _blank(gold)), None) for row in rows]
        wanted = " or ".join(map(repr, self.answer_columns))
        present = sorted(k for k in kwargs if k not in _TRAINER_KWARGS)
        raise KeyError(
            f"{self.__name__} reads the gold answer from the dataset column {wanted}, but the batch only has the "
            f"columns {present}; pass answer_column= to make_math_reward (--answer_column on the command line)"
        )

    def verdicts(
        self, gold_answers: Sequence[str | None], predicted_answers: Sequence[str | None]
    ) -> list[bool | None]:
        """Verdicts for already-normalised answers: ``True``/``False``, ``None`` where the gold is unusable.

        Identical pairs are verified once, plain numbers never leave the process (:func:`fast_verdict`). A pair that
        overran the deadline scores ``False``; one that overran in ``STRIKES`` calls is scored ``False`` without being
        verified again (a policy that found a power tower tends to repeat it, and each retry costs a full deadline and
        a worker restart), while one overrun alone (a stall of a loaded machine) is verified again at its next call.

        A gold whose comparison overruns is compared with ``0``: a gold that overruns that in ``STRIKES`` calls
        (``9^{9^{9^{9}}}``, ``(10^{10})!``: math-verify evaluates it in every comparison) is unusable like a gold that
        does not parse, ``None`` from then on, that call's rows included; otherwise each of its predictions would cost
        a deadline and a worker restart and score ``False``, correct ones too. (In separate calls: a stall of the
        machine long enough to cover a pair's overrun and the probes after it would have made a gold unusable.)
        """
        return self._score(gold_answers, predicted_answers)[0]

    def _score(
        self, gold_answers: Sequence[str | None], predicted_answers: Sequence[str | None]
    ) -> tuple[list[bool | None], int]:
        verdicts: list[bool | None] = [None] * len(gold_answers)
        to_verify: dict[tuple[str, str | None], list[int]] = {}
        timeouts = 0
        for i, (gold, pred) in enumerate(zip(gold_answers, predicted_answers, strict=True)):
            if gold is None:
                continue
            known = self._gold_parses.get(gold)
            if known is False or (known and pred is None):
                verdicts[i] = None if known is False else False
                continue
            if parse_plain_number(gold) is not None:
                verdict = False if pred is None else fast_verdict(gold, pred)
                if verdict is not None:
                    verdicts[i] = verdict
                    continue
            if self._timed_out.get((gold, pred), 0) >= STRIKES:
                verdicts[i] = False
                timeouts += 1
                continue
            to_verify.setdefault((gold, pred), []).append(i)
        if to_verify:
            keys = list(to_verify)
            results, timed_out = self.pool.verify_with_timeouts(keys, timeout=self.timeout)
            overran: set[str] = set()
            for k, (key, verdict) in enumerate(zip(keys, results, strict=True)):
                if k in timed_out:
                    _remember(self._timed_out, key, self._timed_out.get(key, 0) + 1, 4096)
                    timeouts += len(to_verify[key])
                    overran.add(key[0])
                else:
                    self._timed_out.pop(key, None)  # (its overrun was the machine's: it is verified as any other)
                    _remember(self._gold_parses, key[0], verdict is not None, 65536)
                for i in to_verify[key]:
                    verdicts[i] = verdict
            for gold in self._golds_that_overrun(overran):
                _remember(self._gold_parses, gold, False, 65536)
                self._overrunning_golds.add(gold)
                verdicts = [None if g == gold else v for g, v in zip(gold_answers, verdicts, strict=True)]
        return verdicts, timeouts

    def _golds_that_overrun(self, golds: set[str]) -> list[str]:
        """Of golds whose comparison just overran, those that have now overrun against ``0`` in ``STRIKES`` calls (see
        :meth:`verdicts`); a gold that compared in time is not tried again, a plain number never (:func:`fast_verdict`
        compares it with anything in-process)."""
        golds = [g for g in golds if g not in self._gold_compares and parse_plain_number(g) is None]
        if not golds:
            return []
        _, timed_out = self.pool.verify_with_timeouts([(gold, "0") for gold in golds], timeout=self.timeout)
        unusable = []
        for k, gold in enumerate(golds):
            if k not in timed_out:
                _remember(self._gold_compares, gold, True, 65536)
                continue
            overruns = self._gold_probe_overruns.get(gold, 0) + 1
            _remember(self._gold_probe_overruns, gold, overruns, 65536)
            if overruns >= STRIKES:
                unusable.append(gold)
        return unusable

    def __call__(self, completions: list, **kwargs: Any) -> list[float | None]:
        """Score ``completions`` against the gold column; ``None`` only where the gold answer cannot be parsed.

        Extra keyword arguments (``prompts``, ``completion_ids``, ``trainer_state``, other dataset columns) are
        accepted and ignored, except ``log_extra`` / ``log_metric`` which, when the trainer provides them, receive the
        extracted answers and the share of answers that hit the deadline, and ``prompt_opens_think`` (VAPOTrainer's,
        for the functions with ``reads_prompt_opens_think``): where the chat template opened a think block in the
        prompt, a completion without ``</think>`` was cut off while thinking and answers nothing.
        """
        golds = self._golds(kwargs)
        if len(golds) != len(completions):
            raise ValueError(f"{self.__name__}: {len(completions)} completions but {len(golds)} gold answers")
        gold_answers = [normalize_gold_answer(g) for g in golds]
        thinking = kwargs.get("prompt_opens_think") or [False] * len(completions)
        predicted = [
            extract_predicted_answer(completion_text(c), t) for c, t in zip(completions, thinking, strict=True)
        ]
        verdicts, timeouts = self._score(gold_answers, predicted)
        rewards: list[float | None] = []
        for gold, normalized, verdict in zip(golds, gold_answers, verdicts, strict=True):
            if verdict is None:
                self._warn_bad_gold(gold, normalized in self._overrunning_golds)
                rewards.append(None)
            else:
                rewards.append(self.correct_reward if verdict else self.incorrect_reward)
        log_extra, log_metric = kwargs.get("log_extra"), kwargs.get("log_metric")
        if callable(log_extra):
            # Column names carry the function name: the trainer appends columns of the same name from every function.
            log_extra(f"{self.__name__}_gold", [g if g is not None else "[unparseable]" for g in gold_answers])
            log_extra(f"{self.__name__}_answer", [p if p is not None else "[no answer]" for p in predicted])
        if callable(log_metric) and completions:
            log_metric(f"{self.__name__}/no_answer_rate", sum(p is None for p in predicted) / len(completions))
            log_metric(f"{self.__name__}/timeout_rate", timeouts / len(completions))
        return rewards

    def _warn_bad_gold(self, gold: Any, overruns: bool = False) -> None:
        key = repr(gold)[:500]
        if key in self._warned_golds or len(self._warned_golds) >= 10000:
            return
        self._warned_golds.add(key)
        if overruns:
            logger.warning(
                "%s: math-verify cannot compare the gold answer %s with 0 within the %g s deadline, so no answer can "
                "be scored against it; these samples get no reward (None)",
                self.__name__,
                key,
                self.timeout,
            )
        else:
            logger.warning(
                "%s: cannot parse the gold answer %s; these samples get no reward (None)", self.__name__, key
            )


def _remember(cache: OrderedDict, key: Any, value: Any, max_size: int) -> None:
    """Insert into a bounded LRU mapping."""
    try:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > max_size:
            cache.popitem(last=False)
    except KeyError:  # another thread evicted the same entries first: a cache, so losing a race only costs a miss
        pass


_TRAINER_KWARGS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"})


def make_math_reward(**options: Any) -> MathReward:
    """Build a math reward function for ``reward_funcs``: a picklable :class:`MathReward`, whose arguments (keywords
    only here) and defaults are its own."""
    return MathReward(**options)


math_reward = make_math_reward()
"""Ready-to-use math reward: gold from ``answer`` (else ``solution``), +1 correct, -1 otherwise, 5 s deadline."""


def think_boxed_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 for ``[<think>] reasoning </think> ... \\boxed{answer}``, else 0.0; plain-text or chat completions.

    The format: at most one leading ``<think>`` (chat templates such as DeepSeek-R1's and Qwen3's put it in the
    prompt, so it may be missing), non-blank reasoning, exactly one ``</think>``, and after it a complete, non-empty
    ``\\boxed{}`` of at most :data:`MAX_ANSWER_CHARS` characters, with no further think tags.

    A chat completion the tokenizer's response template parsed (its reasoning apart, as ``reasoning_content``, or
    ``thinking`` where the template names it so: TRL's gpt-oss and LFM2.5 ones) has its reasoning as the think block.
    TRL's ``trl.rewards.think_format_reward`` is not reused because it only reads chat completions, requires
    ``<think>`` in the completion, and does not look for an answer at all.
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        message = completion[-1] if isinstance(completion, list) and completion else completion
        reasoning = message.get("reasoning_content", message.get("thinking")) if isinstance(message, dict) else None
        if isinstance(reasoning, str):
            # Parsed by the tokenizer's response template: the think block is its reasoning, the rest its content.
            text = f"<think>{reasoning}</think>{text}"
        reasoning, closed, tail = text.partition("</think>")
        reasoning = reasoning.lstrip().removeprefix("<think>")
        answer = find_last_boxed(tail)
        ok = (
            bool(closed)
            and bool(reasoning.strip())
            and "<think>" not in reasoning
            and "<think>" not in tail
            and "</think>" not in tail
            and answer is not None
            and 0 < len(answer.strip()) <= MAX_ANSWER_CHARS
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards
