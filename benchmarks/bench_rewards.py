"""Throughput of ``trl_vapo.rewards.math_reward`` against ``trl.rewards.accuracy_reward`` on the same batches.

    .venv/bin/python benchmarks/bench_rewards.py [--batch-size 512] [--repeats 3] [--group-size 8] [--num-workers N]

Two synthetic batch kinds:

- GSM8K-style: gold ``... <<a*b=c>> ... #### 1,234`` solutions; completions ending in a boxed number (plain, with
  thousands separators, or ``.0``), about half of them wrong by a little;
- MATH-style: bare LaTeX golds (DeepScaleR / DAPO-Math) or full solutions ending in ``\\boxed{}`` (MATH): fractions,
  surds, intervals, pairs, polynomials, sets; completions box an equivalent form (``\\dfrac``, a decimal,
  ``\\sqrt{12}`` for ``2\\sqrt{3}``, a factored polynomial, a reordered set), about half of them a wrong one.

and two layouts of each: every completion for a different problem (``x1``: no cache can help), and groups of
``--group-size`` completions per problem (``xG``), as group sampling in GRPO / VAPO produces them. Every repeat draws a
fresh batch and builds a fresh reward, so nothing is cached across repeats except what math-verify itself caches.

``accuracy_reward`` gets the same completions in chat form and the same gold strings as its ``solution`` column.
Rewards per second exclude the one-off start of our worker processes (reported separately). "Agreement" counts the
samples where both functions give a verdict; "right" counts verdicts that match how the sample was constructed.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A problem: (gold as the data set stores it, completion builder taking "right or wrong?" and returning the completion)
Problem = tuple[str, Callable[[bool], str]]


def gsm8k_problem(rng: random.Random, index: int) -> Problem:
    """A GSM8K-style problem: a worked solution ending in ``#### answer`` and boxed-number completions."""
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    answer = a * b + rng.randint(0, 999)
    gold = f"Each box holds {b} items and there are {a} boxes: {a}*{b} = <<{a}*{b}={a * b}>>{a * b}.\n#### {answer:,}"

    def completion(right: bool) -> str:
        guess = answer if right else answer + rng.choice([-10, -1, 1, 2, 100])
        boxed = rng.choice([f"{guess}", f"{guess:,}", f"{guess}.0"])
        return f"There are {a} boxes of {b}, so {a}*{b} = {a * b} plus the rest.\nThe answer is \\boxed{{{boxed}}}."

    return gold, completion


def _factors(n: int) -> list[int]:
    out, d = [], 2
    while d * d <= n:
        while n % d == 0:
            out.append(d)
            n //= d
        d += 1
    return out + ([n] if n > 1 else [])


def _fraction_latex(value: Fraction, rng: random.Random) -> str:
    terminating = all(f in (2, 5) for f in _factors(value.denominator))
    if terminating and rng.random() < 0.5:
        return f"{float(value):g}"
    return rf"\dfrac{{{value.numerator}}}{{{value.denominator}}}"


def math_problem(rng: random.Random, index: int) -> Problem:
    """A MATH / DeepScaleR-style problem: a LaTeX gold and completions boxing an equivalent or a wrong form."""
    kind = rng.randrange(6)
    if kind == 0:  # fraction
        p, q = rng.randint(1, 40), rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 16, 20, 25])
        if Fraction(p, q).denominator == 1:
            q += 1
        gold = rf"\frac{{{p}}}{{{q}}}"
        forms = (lambda: _fraction_latex(Fraction(p, q), rng), lambda: _fraction_latex(Fraction(p + 1, q), rng))
    elif kind == 1:  # surd
        c, r = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
        gold = rf"{c}\sqrt{{{r}}}"
        forms = (lambda: rf"\sqrt{{{c * c * r}}}", lambda: rf"\sqrt{{{c * c * r + 1}}}")
    elif kind == 2:  # interval
        a, b = sorted(rng.sample(range(-20, 21), 2))
        gold = f"[{a},{b})"
        forms = (lambda: f"[{a}, {b})", lambda: f"[{a}, {b}]")
    elif kind == 3:  # ordered pair
        a, b = rng.randint(-9, 9), rng.randint(-9, 9)
        gold = f"({a},{b})"
        forms = (lambda: f"({a}, {b})", lambda: f"({b + 1}, {a})")
    elif kind == 4:  # polynomial
        a = rng.randint(2, 12)
        gold = f"x^2+{a}x"
        forms = (lambda: f"x(x+{a})", lambda: f"x(x+{a + 1})")
    else:  # set
        a, b, c = rng.sample(range(1, 30), 3)
        gold = rf"\{{{a},{b},{c}\}}"
        forms = (lambda: rf"\{{{c},{a},{b}\}}", lambda: rf"\{{{c},{a},{b + 30}\}}")
    if index % 2:  # MATH stores a full solution whose last box is the answer
        gold = rf"Working through problem {index}, we simplify step by step and find $\boxed{{{gold}}}$."

    def completion(right: bool) -> str:
        pred = forms[0]() if right else forms[1]()
        return f"<think>Problem {index}: let me work it out carefully.</think>\nThe answer is $\\boxed{{{pred}}}$."

    return gold, completion


def build_batch(
    make_problem: Callable[[random.Random, int], Problem], rng: random.Random, size: int, group: int
) -> tuple[list[str], list[str], list[bool]]:
    """``size`` samples, ``group`` completions per problem; about half right. Returns golds, completions, labels."""
    golds, completions, labels = [], [], []
    for index in range(size // group):
        gold, completion = make_problem(rng, index)
        for _ in range(group):
            right = rng.random() < 0.5
            golds.append(gold)
            completions.append(completion(right))
            labels.append(right)
    return golds, completions, labels


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--num-workers", type=int, default=None, help="math-verify workers (default: automatic)")
    args = parser.parse_args()
    # Both libraries warn about disabled or expiring timeouts; the numbers are what matters here.
    logging.basicConfig(level=logging.ERROR)

    from trl.rewards import accuracy_reward

    from trl_vapo.rewards import extract_predicted_answer, make_math_reward, normalize_gold_answer

    reward = make_math_reward(num_workers=args.num_workers)
    _, startup = timed(reward.pool.warm_up)
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, batch {args.batch_size}, {args.repeats} repeats, "
        f"{reward.pool.num_workers} math-verify workers (started in {startup:.2f} s, not counted below)"
    )
    print()
    header = f"{'batch':<10} {'trl_vapo math_reward':>21} {'trl accuracy_reward':>20} {'ratio':>7} {'agreement':>18}"
    print(header)
    print("-" * len(header))
    notes = []
    for kind, make_problem in (("GSM8K", gsm8k_problem), ("MATH", math_problem)):
        for group in (1, args.group_size):
            ours_rates, trl_rates = [], []
            agree = compared = total = 0
            right = {"ours": 0, "trl": 0}
            skipped = {"ours": 0, "trl": 0}
            disagreements: collections.Counter = collections.Counter()
            examples: dict[str, tuple] = {}
            for repeat in range(args.repeats):
                rng = random.Random(f"{kind}-{group}-{repeat}")
                golds, completions, labels = build_batch(make_problem, rng, args.batch_size, group)
                # A fresh reward per repeat: no gold or timeout memory from an earlier repeat.
                fn = make_math_reward(num_workers=args.num_workers)
                ours, t_ours = timed(fn, completions=completions, answer=golds)
                chat = [[{"role": "assistant", "content": c}] for c in completions]
                theirs, t_trl = timed(accuracy_reward, completions=chat, solution=golds)
                ours_rates.append(len(golds) / t_ours)
                trl_rates.append(len(golds) / t_trl)
                for gold, completion, label, a, b in zip(golds, completions, labels, ours, theirs, strict=True):
                    total += 1
                    for name, value in (("ours", a), ("trl", b)):
                        right[name] += value is not None and (value > 0) == label
                        skipped[name] += value is None
                    if a is None or b is None:
                        continue
                    compared += 1
                    if (a > 0) == (b > 0):
                        agree += 1
                    else:
                        shape = re.sub(r"\d+", "N", normalize_gold_answer(gold) or gold)
                        disagreements[shape] += 1
                        pred = extract_predicted_answer(completion)
                        examples.setdefault(shape, (normalize_gold_answer(gold), pred, a, b))
            ours_rate, trl_rate = statistics.median(ours_rates), statistics.median(trl_rates)
            name = f"{kind} x{group}"
            print(
                f"{name:<10} {ours_rate:>16,.0f} / s {trl_rate:>15,.0f} / s {ours_rate / trl_rate:>6.1f}x "
                f"{agree:>6}/{compared:<5} {100 * agree / max(compared, 1):5.1f}%"
            )
            notes.append(
                f"{name}: right ours {right['ours']}/{total}, trl {right['trl']}/{total}; "
                f"no verdict (None) ours {skipped['ours']}, trl {skipped['trl']}"
            )
            for shape, count in disagreements.most_common(3):
                gold, pred, a, b = examples[shape]
                notes.append(
                    f"{name}: {count} disagreements like gold {gold!r} vs boxed {pred!r}: ours {a:+g}, trl {b:+g}"
                )
    print()
    print("\n".join(notes))


if __name__ == "__main__":
    main()
