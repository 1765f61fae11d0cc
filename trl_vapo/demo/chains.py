"""A harder variant of the demo task for the learning benchmark: long chains, free tokens, slips at any carry.

A problem is a sum of 4 to 10 digits from 1 to 9, repeats allowed; each term has a letter tag. The chain of thought
is the demo's running total (``data.running_total_lines``), one line per term, each line tagged with its term's letter
and followed by two letters of free commentary, then the boxed total::

    prompt      "Add a=7 b=5 c=9 d=5.\\n"
    completion  "a 00+7=07 xv\\nb 07+5=12 uu\\nc 12+9=21 zw\\nd 21+5=26 yx\\n\\\\boxed{26}"
    answer      "26"

Why this shape:

- **Long chains with slips anywhere.** Repeats let chains run to 10 terms and about three carries per problem (none
  to nine), spread over the whole chain; the cold-start model drops each carry with some probability, and any
  single dropped carry decides the answer (the chain carries on consistently from the wrong total, as in the demo).
  The tags keep the term look-up unambiguous despite repeats: the line tagged ``c`` adds the digit after ``c=`` in
  the prompt, which a small model finds by content, without counting lines.
- **Most tokens are free.** The two commentary letters after each line are drawn uniformly from ``uvwxyz`` in the
  SFT data, so the policy samples them at high entropy, and they never affect the answer. Two free choices per line
  against about one carry decision every two lines: a wrong answer is decided by one token among ~100, next to
  ~14 tokens that were free to be anything.
- **Credit assignment is what separates methods.** A group baseline (GRPO) gives every token of a wrong completion
  the same negative advantage, free letters included, and relies on averaging over many samples to cancel that
  noise; a critic that has learned the value of each prefix can put the blame on the slipped carry (the value drops
  there and nowhere else). Both see the same reward, the same sparse verifier and the same cold-start policy, the
  correct step is always in the policy's support, and the group-baseline estimator stays unbiased: the task makes
  credit assignment harder, it does not make any method's estimator wrong.

Completions run from 61 to 140 characters (62 to 141 tokens with EOS), the demo's 26 to 83 stretched by the tags and
the commentary. Train and held-out problems are split by a hash of the prompt (``data.prompt_is_held_out``).

The SFT data drops a carry with probability 0.7 where the ones digits sum to exactly ten (so greedy decoding slips
there too) and 0.35 elsewhere: 23% of its chains are right. The cold-start model trained on it
(``python -m trl_vapo.demo.train_sft --task chains --output-dir benchmarks/models/chains_sft``) scores held-out avg@4
0.30 at T=1, greedy 0.50 and pass@4 0.64 on 200 problems; 98% of its wrong samples go wrong by a dropped carry.

``first_wrong_index(prompt, completion)`` gives, for a demo or a chains prompt, the index of the first character of
a completion after which no correct chain is possible (the decisive token of the first slip), or ``None``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from . import data

MIN_TERMS = 4
MAX_TERMS = 10
MIN_DIGIT = 1
MAX_DIGIT = 9
TAGS = "abcdefghij"
"""One letter per term, in order; ``len(TAGS) == MAX_TERMS``."""
FILLER_LETTERS = "uvwxyz"
"""The free commentary's alphabet: no tag letters, no digits, so it can be neither copied nor mistaken for a term."""
FILLER_LENGTH = 2

SLIP_RATE_SUM_TEN = 0.7
"""Chance that the SFT chain drops a carry when the ones digits sum to exactly ten (above 1/2: greedy slips)."""
SLIP_RATE_SUM_ABOVE_TEN = 0.35
"""Chance that the SFT chain drops a carry when the ones digits sum to more than ten."""

MAX_COMPLETION_TOKENS = 141
"""Longest correct completion in tokens (10 lines of 13 characters, ``\\boxed{NN}``, EOS)."""

_DEMO_PROMPT = re.compile(r"Compute ((?:\d\+)*\d)\.\n")
_CHAINS_PROMPT = re.compile(r"Add ([a-j]=\d(?: [a-j]=\d)*)\.\n")


def render_prompt(terms: tuple[int, ...]) -> str:
    """The prompt for a sum, e.g. ``"Add a=7 b=5 c=9.\\n"``."""
    return "Add " + " ".join(f"{tag}={term}" for tag, term in zip(TAGS, terms)) + ".\n"


def render_completion(terms: tuple[int, ...], fillers: Sequence[str], slip: data.SlipDecider | None = None) -> str:
    """The tagged chain with one commentary string per line, then the boxed total (no EOS).

    The running totals, the slips and the boxed answer are the demo's (``data.render_completion``); this only adds
    the tag before and the commentary after each line.
    """
    *steps, boxed = data.render_completion(terms, slip).split("\n")
    if len(fillers) != len(steps):
        raise ValueError(f"need one filler per line ({len(steps)}), got {len(fillers)}")
    lines = [f"{tag} {step} {filler}" for tag, step, filler in zip(TAGS, steps, fillers)]
    return "\n".join(lines + [boxed])


def random_fillers(rng: random.Random, n: int) -> list[str]:
    """``n`` commentary strings of ``FILLER_LENGTH`` letters drawn uniformly from ``FILLER_LETTERS``."""
    return ["".join(rng.choice(FILLER_LETTERS) for _ in range(FILLER_LENGTH)) for _ in range(n)]


def sample_terms(rng: random.Random) -> tuple[int, ...]:
    """A random problem: a uniform number of terms in ``[MIN_TERMS, MAX_TERMS]``, digits drawn with replacement."""
    return tuple(rng.randint(MIN_DIGIT, MAX_DIGIT) for _ in range(rng.randint(MIN_TERMS, MAX_TERMS)))


def is_held_out(terms: tuple[int, ...]) -> bool:
    """Whether a problem belongs to the held-out split (the demo's hash rule on this task's prompt)."""
    return data.prompt_is_held_out(render_prompt(terms))


def sample_problems(n: int, held_out: bool, seed: int, unique: bool = False) -> list[tuple[int, ...]]:
    """``n`` problems of one split, drawn with ``seed``; ``unique`` rejects repeats."""
    return data.sample_problems(n, held_out, seed, unique, draw=sample_terms, in_held_out=is_held_out)


def problem_row(terms: tuple[int, ...]) -> dict[str, str]:
    """A data set row: the prompt and the gold answer as a plain number string."""
    return {"prompt": render_prompt(terms), "answer": str(sum(terms))}


def build_split(split: str, n: int, seed: int | None = None):
    """A ``datasets.Dataset`` with columns ``prompt`` and ``answer``; ``split`` is ``"train"`` or ``"held_out"``.

    Held-out problems are unique; train problems may repeat (rarely: there are about 4 billion problems).
    """
    from datasets import Dataset

    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    held_out = split == "held_out"
    if seed is None:
        seed = data.HELD_OUT_SEED if held_out else data.TRAIN_SEED
    problems = sample_problems(n, held_out=held_out, seed=seed, unique=held_out)
    return Dataset.from_list([problem_row(terms) for terms in problems])


def sft_examples(n: int, seed: int, slips: bool = True) -> list[tuple[str, str]]:
    """``n`` (prompt, completion) pairs from the train split: random commentary, carries dropped at the set rates."""
    rng = random.Random(seed)
    slip = data.random_slip(rng, SLIP_RATE_SUM_TEN, SLIP_RATE_SUM_ABOVE_TEN) if slips else None
    examples = []
    for terms in sample_problems(n, held_out=False, seed=rng.randrange(2**32)):
        fillers = random_fillers(rng, len(terms))
        examples.append((render_prompt(terms), render_completion(terms, fillers, slip)))
    return examples


# ---------------------------------------------------------------------------------------------------------------------
# Where a chain first goes wrong (both tasks)
# ---------------------------------------------------------------------------------------------------------------------


def parse_prompt(prompt: str) -> tuple[str, tuple[int, ...]]:
    """The task (``"demo"`` or ``"chains"``) and the terms of a prompt of either task."""
    if match := _DEMO_PROMPT.fullmatch(prompt):
        return "demo", tuple(int(term) for term in match.group(1).split("+"))
    if match := _CHAINS_PROMPT.fullmatch(prompt):
        pairs = [pair.split("=") for pair in match.group(1).split(" ")]
        if "".join(tag for tag, _ in pairs) != TAGS[: len(pairs)]:
            raise ValueError(f"tags out of order in {prompt!r}")
        return "chains", tuple(int(term) for _, term in pairs)
    raise ValueError(f"not a demo or chains prompt: {prompt!r}")


def correct_pattern(prompt: str) -> list[str]:
    """The correct completions of a prompt as one string of allowed characters per position.

    The demo has a single correct completion; a chains prompt has one per choice of commentary, all of the same
    length, so a set of allowed characters per position describes them exactly.
    """
    task, terms = parse_prompt(prompt)
    if task == "demo":
        return list(data.render_completion(terms))
    placeholder = "\0" * FILLER_LENGTH
    text = render_completion(terms, [placeholder] * len(terms))
    return [FILLER_LETTERS if char == "\0" else char for char in text]


def first_mismatch(pattern: Sequence[str], completion: str) -> int | None:
    """The first index where ``completion`` leaves every string ``pattern`` allows, or ``None`` if it is one of them.

    A completion that stops early is wrong at index ``len(completion)``, where it put EOS instead of the next
    character; one that goes on is wrong at ``len(pattern)``, where EOS belonged. With a character-level tokenizer the
    index is the token's position in the completion (EOS included), so index ``len(completion)`` is the EOS token, or
    no token at all when the completion was cut at the length limit.
    """
    for i, allowed in enumerate(pattern):
        if i >= len(completion):
            return len(completion)
        if completion[i] not in allowed:
            return i
    return None if len(completion) == len(pattern) else len(pattern)


def first_wrong_index(prompt: str, completion: str) -> int | None:
    """Index of the decisive token of a completion's first wrong step (a demo or a chains prompt), ``None`` if right.

    For a dropped carry (``17+5=12`` for ``17+5=22``) it is the tens digit of the new total: the first character
    after which no correct chain is possible. Everything before it was consistent with some correct chain.
    """
    return first_mismatch(correct_pattern(prompt), completion)
