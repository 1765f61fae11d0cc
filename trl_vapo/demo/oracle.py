"""The oracle critic of the demo tasks: V*(prompt, prefix) = P(correct | prompt, prefix), exact under a model of the
policy whose errors are the task's own, at rates measured on the rollout being scored.

The tasks (``data`` and ``chains``) have one correct chain per prompt up to free commentary letters
(``chains.correct_pattern``), so a prefix either is still consistent with a correct chain or is already wrong
(``chains.first_mismatch``). What decides the rest is a list of *decision positions*, one per character of the correct
completion plus the end-of-sequence position after it, each of one kind:

* ``sum_ten`` / ``above_ten``: the tens digit of a step that needs a carry, whose ones digits sum to exactly ten / to
  more than ten. Dropping the carry there is the slip the cold-start data was made with (``data.random_slip``), and
  it decides the answer: the chain carries on from the wrong total.
* ``other``: every other position (a digit copied from the prompt or the previous line, a tag, a commentary letter,
  the boxed answer, the end of sequence), where the cold-start data never goes wrong.

If the policy leaves the correct chains at a position of kind ``k`` with probability ``h_k`` (its hazard there), given
that it has not left them before, independently across positions, then with ``S(p) = prod_{q >= p} (1 - h_kind(q))``
over the decision positions ``q`` from ``p`` to the end::

    V*(x, y_<t) = r_wrong + (r_right - r_wrong) * S(offset_t)     if y_<t is still consistent with a correct chain
                = r_wrong                                          otherwise,

``offset_t`` being the number of characters before token ``t``. This is the Bayes value: the conditional expectation of
the return given the prefix under that model, which no critic can beat in mean squared error when the model holds
(it does exactly for the task's generator, the check in ``tests/test_demo_oracle.py``). ``OracleValue`` measures the
three hazards on each rollout it is given (failures over visits of each kind, ``measure_hazards``) and plugs ``V*``
into the trainer as a frozen value function (``value_model=OracleValue(tokenizer)``,
``trl_vapo.modeling.ValueFunction``).

Two simplifications, both measurable: a prefix that left the correct chains is valued ``r_wrong`` although a
completion that only changed a commentary letter outside ``uvwxyz`` would still box the right total (the ``other``
hazard measures how often anything but a slip happens: about never for the cold-start models), and the hazards depend
on the kind of position only, not on the problem.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from . import chains, data

KINDS = ("sum_ten", "above_ten", "other")


@dataclasses.dataclass(frozen=True)
class Hazards:
    """The probability of leaving the correct chains at a position of each kind, given the prefix is still correct."""

    sum_ten: float
    above_ten: float
    other: float = 0.0

    def of(self, kind: str) -> float:
        return getattr(self, kind)


@functools.lru_cache(maxsize=4096)  # a rollout repeats each prompt (group sampling) and is read twice per call
def _correct_pattern(prompt: str) -> tuple[str, ...]:
    return tuple(chains.correct_pattern(prompt))


@functools.lru_cache(maxsize=4096)
def decision_kinds(prompt: str) -> tuple[str, ...]:
    """The kind of each decision position of ``prompt``'s correct completion: one per character, then the end of
    sequence (``len(correct completion) + 1`` entries)."""
    _, terms = chains.parse_prompt(prompt)
    pattern = _correct_pattern(prompt)
    kinds = ["other"] * (len(pattern) + 1)
    text = "".join(allowed[0] for allowed in pattern)  # one correct completion: the kinds do not depend on which
    start, total = 0, 0
    for term, line in zip(terms, text.split("\n")):
        if data.needs_carry(total, term):
            tens_digit = start + line.index("=") + 1  # "17+5=22": after "=", the digit a dropped carry changes
            kinds[tens_digit] = "sum_ten" if total % 10 + term == 10 else "above_ten"
        total += term
        start += len(line) + 1
    return tuple(kinds)


def survival(kinds: Sequence[str], hazards: Hazards) -> list[float]:
    """``S(p) = prod_{q >= p} (1 - h_kind(q))`` for ``p = 0 .. len(kinds)`` (``S(len(kinds)) = 1``)."""
    suffix = [1.0] * (len(kinds) + 1)
    for p in range(len(kinds) - 1, -1, -1):
        suffix[p] = suffix[p + 1] * (1.0 - hazards.of(kinds[p]))
    return suffix


def first_wrong(prompt: str, completion: str, ended: bool) -> int | None:
    """The first decision position at which ``completion`` left the correct chains, or None if it never did within
    what it generated (``ended``: it ended with the end-of-sequence token, which is then position
    ``len(completion)``)."""
    wrong = chains.first_mismatch(_correct_pattern(prompt), completion)
    generated = len(completion) + (1 if ended else 0)
    return wrong if wrong is not None and wrong < generated else None


def measure_hazards(prompts: Sequence[str], completions: Sequence[str], ended: Sequence[bool]) -> tuple[Hazards, dict]:
    """The hazard of each kind on a set of completions: the completions that went wrong at a position of that kind
    over the completions that reached one still correct (a position is reached when every position before it was
    right). A kind never reached gets hazard 0. Returns the hazards and the counts (``visits``, ``failures``)."""
    visits, failures = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
    for prompt, completion, has_end in zip(prompts, completions, ended):
        kinds = decision_kinds(prompt)
        wrong = first_wrong(prompt, completion, has_end)
        reached = len(completion) + (1 if has_end else 0) if wrong is None else wrong + 1
        for kind in kinds[: min(reached, len(kinds))]:
            visits[kind] += 1
        if wrong is not None:
            failures[kinds[min(wrong, len(kinds) - 1)]] += 1
    rates = {kind: failures[kind] / visits[kind] if visits[kind] else 0.0 for kind in KINDS}
    return Hazards(**rates), {"visits": visits, "failures": failures}


def oracle_values(
    prompt: str,
    completion: str,
    ended: bool,
    offsets: Sequence[int],
    hazards: Hazards,
    right_reward: float = 1.0,
    wrong_reward: float = -1.0,
) -> list[float]:
    """``V*`` before each token of one completion: ``offsets[t]`` is the number of characters before token ``t``."""
    kinds = decision_kinds(prompt)
    suffix = survival(kinds, hazards)
    wrong = first_wrong(prompt, completion, ended)
    values = []
    for offset in offsets:
        consistent = wrong is None or offset <= wrong
        chance = suffix[min(offset, len(kinds))] if consistent else 0.0
        values.append(wrong_reward + (right_reward - wrong_reward) * chance)
    return values


def bayes_explained_variance(prompts: Sequence[str], hazards: Hazards) -> float:
    """The explained variance, pooled over all tokens of all completions, that ``V*`` reaches in expectation on
    completions of ``prompts`` sampled from the model with these hazards (one completion per prompt, every
    completion as long as the correct one, its end-of-sequence token included; rewards of any two values).

    The error of ``V*`` at position ``t`` is the return's conditional variance: ``S(0) (1 - S(t))`` in units of the
    squared reward gap (the chain is still right before ``t`` with probability ``S(0) / S(t)``, and then the return's
    variance is ``S(t) (1 - S(t))``). The returns' pooled variance is that of a Bernoulli with the token-weighted
    success rate ``m`` around ``m``, per token: ``P (1 - m)^2 + (1 - P) m^2`` with ``P = S(0)`` of its prompt.
    """
    error, weighted_success, tokens, per_prompt = 0.0, 0.0, 0, []
    for prompt in prompts:
        suffix = survival(decision_kinds(prompt), hazards)
        length = len(suffix) - 1  # decision positions = tokens
        error += sum(suffix[0] * (1.0 - suffix[t]) for t in range(length))
        weighted_success += length * suffix[0]
        tokens += length
        per_prompt.append((length, suffix[0]))
    m = weighted_success / tokens
    variance = sum(length * (p * (1 - m) ** 2 + (1 - p) * m**2) for length, p in per_prompt)
    return 1.0 - error / variance


class OracleValue:
    """``V*`` of the demo tasks as a frozen value function: ``VAPOTrainer(..., value_model=OracleValue(tokenizer))``.

    Each call (one per rollout, with all of its completions) decodes the prompts and completions, measures the
    policy's hazards on them (``measure_hazards``), keeps them in ``hazards`` and the counts in ``counts``, and returns
    ``V*`` before every completion token. ``right_reward`` / ``wrong_reward``: the reward of a right and a wrong answer
    (``math_reward``'s +1 / -1 by default).
    """

    def __init__(self, tokenizer, right_reward: float = 1.0, wrong_reward: float = -1.0):
        self.tokenizer = tokenizer
        self.right_reward, self.wrong_reward = right_reward, wrong_reward
        self.hazards: Hazards | None = None
        self.counts: dict | None = None

    def decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int):
        """Prompts, completions (text before the end of sequence), whether each ended, and each completion's
        character offset before every token."""
        tokenizer, special = self.tokenizer, set(self.tokenizer.all_special_ids)
        prompt_width = input_ids.shape[1] - completion_length
        prompts, completions, ended, offsets = [], [], [], []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = [i for i, m in zip(ids[:prompt_width], mask[:prompt_width]) if m]
            prompts.append(tokenizer.decode(prompt, skip_special_tokens=True))
            text, has_end, row_offsets = "", False, []
            for token, m in zip(ids[prompt_width:], mask[prompt_width:]):
                row_offsets.append(len(text))
                if not m or has_end:
                    continue
                if token in special:
                    has_end = True
                else:
                    text += tokenizer.decode([token])
            completions.append(text)
            ended.append(has_end)
            offsets.append(row_offsets)
        return prompts, completions, ended, offsets

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int) -> torch.Tensor:
        prompts, completions, ended, offsets = self.decode(input_ids, attention_mask, completion_length)
        self.hazards, self.counts = measure_hazards(prompts, completions, ended)
        rows = [
            oracle_values(p, c, e, o, self.hazards, self.right_reward, self.wrong_reward)
            for p, c, e, o in zip(prompts, completions, ended, offsets)
        ]
        return torch.tensor(rows, dtype=torch.float32)
