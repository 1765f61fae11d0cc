"""A procedural arithmetic data set for the offline demo: sums of distinct digits, solved with a running total.

A problem is a sum of 2 to 9 distinct digits. The chain of thought adds the terms one per line to a two-digit
running total that starts at ``00``, then boxes the final total::

    prompt      "Compute 7+5+9+3.\\n"
    completion  "00+7=07\\n07+5=12\\n12+9=21\\n21+3=24\\n\\\\boxed{24}"
    answer      "24"

Every line has the same width, so each token depends on tokens at fixed distances (the previous total, the term)
plus one look-up of the next term in the prompt, which distinct terms make unambiguous: a model of under a million
parameters learns it in minutes on one CPU core. The number of lines grows with the number of terms, so responses
run from 25 to 82 characters (26 to 83 tokens with EOS): the heterogeneous lengths length-adaptive GAE is for.

The cold-start model is trained on chains that sometimes contain a *slip*: a step that needs a carry drops it
(``17+5=22`` becomes ``17+5=12``), and the chain carries on consistently from the wrong total. Slips are more
likely when the ones digits sum to exactly ten, so even greedy decoding makes them on some problems. The correct
step always stays in the model's distribution, which is the gap reinforcement learning closes.

Problems are assigned to the train or held-out split by a hash of their prompt, so the splits are disjoint by
construction whatever the sizes and seeds.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

MIN_TERMS = 2
MAX_TERMS = 9
HELD_OUT_PERCENT = 10
"""Share of all possible problems that belong to the held-out split."""
HELD_OUT_PROBLEMS = 98_329
"""How many distinct problems the held-out split has (of 986,400 problems: every ordering of 2 to 9 distinct
digits), the most a held-out set can hold; counted by the tests."""

SLIP_RATE_SUM_TEN = 0.65
"""Probability that the SFT chain drops a carry when the ones digits sum to exactly ten (above 1/2: greedy slips)."""
SLIP_RATE_SUM_ABOVE_TEN = 0.25
"""Probability that the SFT chain drops a carry when the ones digits sum to more than ten."""

TRAIN_SEED = 0
HELD_OUT_SEED = 1

SlipDecider = Callable[[int, int], bool]
"""Called as ``slip(total, term)`` at each step that needs a carry; ``True`` drops the carry."""


def render_prompt(terms: tuple[int, ...]) -> str:
    """The prompt for a sum, e.g. ``"Compute 7+5+9+3.\\n"``."""
    return f"Compute {'+'.join(map(str, terms))}.\n"


def needs_carry(total: int, term: int) -> bool:
    """Whether ``total + term`` (``term`` a single digit) carries into the tens."""
    return total % 10 + term >= 10


def running_total_lines(terms: tuple[int, ...], slip: SlipDecider | None = None) -> list[str]:
    """The chain of thought: one line ``total+term=new_total`` per term, totals as two digits from ``00``.

    At a step that needs a carry, ``slip(total, term)`` may drop it: the new total loses ten and later lines carry
    on from that wrong number, so the chain stays internally consistent.
    """
    total, lines = 0, []
    for term in terms:
        new_total = total + term
        if slip is not None and needs_carry(total, term) and slip(total, term):
            new_total -= 10
        lines.append(f"{total:02d}+{term}={new_total:02d}")
        total = new_total
    return lines


def render_completion(terms: tuple[int, ...], slip: SlipDecider | None = None) -> str:
    """The chain of thought followed by its final total in ``\\boxed{}`` (no end-of-sequence token)."""
    lines = running_total_lines(terms, slip)
    final = int(lines[-1].rsplit("=", 1)[1])
    return "\n".join(lines) + f"\n\\boxed{{{final}}}"


def random_slip(
    rng: random.Random, rate_sum_ten: float = SLIP_RATE_SUM_TEN, rate_above_ten: float = SLIP_RATE_SUM_ABOVE_TEN
) -> SlipDecider:
    """A slip decider drawing from ``rng`` at the rates the cold-start model is meant to learn (one draw per carry)."""

    def slip(total: int, term: int) -> bool:
        sums_to_ten = total % 10 + term == 10
        return rng.random() < (rate_sum_ten if sums_to_ten else rate_above_ten)

    return slip


def prompt_is_held_out(prompt: str) -> bool:
    """Whether a prompt belongs to the held-out split: a stable hash (not Python's salted ``hash``) of its text."""
    return zlib.crc32(prompt.encode()) % 100 < HELD_OUT_PERCENT


def is_held_out(terms: tuple[int, ...]) -> bool:
    """Whether a problem belongs to the held-out split; a stable hash of its prompt (``prompt_is_held_out``)."""
    return prompt_is_held_out(render_prompt(terms))


def sample_terms(rng: random.Random) -> tuple[int, ...]:
    """A random problem: a uniform number of terms in ``[MIN_TERMS, MAX_TERMS]``, distinct digits from 1 to 9."""
    return tuple(rng.sample(range(1, 10), rng.randint(MIN_TERMS, MAX_TERMS)))


def sample_problems(
    n: int,
    held_out: bool,
    seed: int,
    unique: bool = False,
    draw: Callable[[random.Random], tuple[int, ...]] = sample_terms,
    in_held_out: Callable[[tuple[int, ...]], bool] = is_held_out,
) -> list[tuple[int, ...]]:
    """``n`` problems of one split, drawn with ``seed``; ``unique`` rejects repeats (an evaluation set wants that).

    ``draw`` and ``in_held_out`` default to this task's generator and split rule; other tasks (``chains``) pass theirs.
    """
    rng = random.Random(seed)
    problems, seen = [], set()
    while len(problems) < n:
        terms = draw(rng)
        if in_held_out(terms) != held_out or (unique and terms in seen):
            continue
        seen.add(terms)
        problems.append(terms)
    return problems


def problem_row(terms: tuple[int, ...]) -> dict[str, str]:
    """A data set row: the prompt and the gold answer as a plain number string."""
    return {"prompt": render_prompt(terms), "answer": str(sum(terms))}


def build_split(split: str, n: int, seed: int | None = None):
    """A ``datasets.Dataset`` with columns ``prompt`` and ``answer``; ``split`` is ``"train"`` or ``"held_out"``.

    Held-out problems are unique, so a large held-out set runs short of the shortest sums (only 72 sums of two
    distinct digits exist, about a tenth of them held out); train problems may repeat.
    """
    from datasets import Dataset

    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    held_out = split == "held_out"
    if held_out and n > HELD_OUT_PROBLEMS:  # (it would draw forever)
        raise ValueError(f"The held-out split has {HELD_OUT_PROBLEMS:,} distinct problems; {n:,} were asked for.")
    if seed is None:
        seed = HELD_OUT_SEED if held_out else TRAIN_SEED
    problems = sample_problems(n, held_out=held_out, seed=seed, unique=held_out)
    return Dataset.from_list([problem_row(terms) for terms in problems])


def sft_examples(n: int, seed: int, slips: bool = True) -> list[tuple[str, str]]:
    """``n`` (prompt, completion) pairs from the train split for supervised fine-tuning.

    With ``slips`` the completions drop carries at the ``SLIP_RATE_*`` rates; without, every chain is correct.
    """
    rng = random.Random(seed)
    slip = random_slip(rng) if slips else None
    return [
        (render_prompt(terms), render_completion(terms, slip))
        for terms in sample_problems(n, held_out=False, seed=rng.randrange(2**32))
    ]
