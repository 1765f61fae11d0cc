"""The math reward against real math-verify in real worker processes: verdicts on the formats data sets use,
extraction that cannot be gamed, hard deadlines on inputs that hang math-verify, and use from threads, DataLoader
workers and torchrun ranks."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_vapo.rewards import (
    MAX_ANSWER_CHARS,
    REWARD_FUNCTIONS,
    MathReward,
    MathVerifyPool,
    completion_text,
    extract_predicted_answer,
    fast_verdict,
    find_last_boxed,
    get_reward_function,
    make_math_reward,
    math_reward,
    normalize_gold_answer,
    parse_plain_number,
    think_boxed_format_reward,
)
from trl_vapo.rewards.functions import STRIKES

DEADLINE = 2.0  # seconds; the adversarial tests check each call returns within DEADLINE + 1


@pytest.fixture(scope="module")
def reward() -> MathReward:
    """+1/-1 math reward with the default deadline; its workers are started once for the whole module."""
    fn = make_math_reward(name="test_math_reward")
    fn.pool.warm_up()
    return fn


@pytest.fixture(scope="module")
def fast_deadline_reward(reward) -> MathReward:
    """The same worker pool with a short deadline, for inputs that hang math-verify."""
    return make_math_reward(timeout=DEADLINE, name="fast_deadline_reward")


def is_gone(pid: int) -> bool:
    """True once ``pid`` has no /proc entry: neither running nor a zombie waiting to be reaped."""
    return not os.path.exists(f"/proc/{pid}")


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's zombie is for init to reap, not for us)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """The pids still present (running or zombie) after waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if not is_gone(pid)]
        if left:
            time.sleep(0.1)
    return left


# ---------------------------------------------------------------------------------------------------------------------
# Verdict table: gold answer (as data sets store it), completion, expected verdict
# ---------------------------------------------------------------------------------------------------------------------

GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
MATH_GOLD = r"We have $\frac{2}{4} = \frac{1}{2}$, so the answer is $\boxed{\frac{1}{2}}$."
MATH_GOLD_INTERVAL = r"The domain is where $x \ge 2$ and $x<5$, that is $\boxed{[2,5)}$."

TABLE = [
    # GSM8K golds (``#### x``, thousands separators)
    ("gsm8k-boxed", GSM8K_GOLD, r"She sold 48 + 24 = 72 clips. \boxed{72}", True),
    ("gsm8k-wrong", GSM8K_GOLD, r"She sold 48 + 24 = 72 clips. \boxed{73}", False),
    ("gsm8k-hash-line", GSM8K_GOLD, "48 + 24 = 72\n#### 72", True),
    ("gsm8k-answer-line", GSM8K_GOLD, "48 + 24 = 72\nAnswer: 72", True),
    ("gsm8k-bold-answer-line", GSM8K_GOLD, "48 + 24 = 72\n**Final Answer:** $72$.", True),
    ("gsm8k-no-last-number-fallback", GSM8K_GOLD, "So Natalia sold 72 clips in total.", False),
    # The count and what it counts: math-verify reads the number off a completion (given "72 clips" as an answer it
    # would read a product of symbols). Each was scored wrong.
    ("gsm8k-answer-line-with-unit", GSM8K_GOLD, "48 + 24 = 72\nAnswer: 72 clips", True),
    ("gsm8k-hash-line-with-unit", GSM8K_GOLD, "48 + 24 = 72\n#### 72 clips.", True),
    ("gsm8k-final-answer-with-unit", GSM8K_GOLD, "48 + 24 = 72\nThe final answer is $72$ clips.", True),
    ("gsm8k-wrong-count-with-unit", GSM8K_GOLD, "48 + 24 = 73\nAnswer: 73 clips", False),
    ("final-answer-slash", r"\frac{1}{2}", "The final answer is 1/2.", True),  # as `Answer: 1/2` is read
    ("gsm8k-marker-not-final", GSM8K_GOLD, "#### 72\nWait, let me recount: 73.", False),
    ("thousands-gold", "#### 1,234", r"\boxed{1234}", True),
    ("thousands-pred", "#### 1234", r"\boxed{1,234}", True),
    ("thousands-latex", "#### 1234", r"\boxed{1{,}234}", True),
    # math-verify reads a thin space as no separator (1\,234\,567 is 802 to it), so neither does the fast path.
    ("thousands-thin-space", "#### 1234567", r"\boxed{1\,234\,567}", False),
    ("leading-zero-comma-is-decimal", "0,111", r"\boxed{0.111}", True),  # math-verify: 0,111 is 0.111, not 111
    ("leading-zero-comma-not-111", "0,111", r"\boxed{111}", False),
    ("not-thousands", "#### 46", r"\boxed{4,6}", False),
    ("bad-grouping", "#### 12345", r"\boxed{1,2345}", False),
    ("decimal-zero", "#### 46", r"\boxed{46.0}", True),
    ("currency", "#### 18", r"The total is \boxed{\$18}", True),
    ("negative", "#### -5", r"\boxed{-5}", True),
    ("sign-wrong", "#### -5", r"\boxed{5}", False),
    ("close-decimal", "#### 72", r"\boxed{72.001}", False),
    ("decimal-rounded-like-math-verify", r"\frac{1}{12}", r"\boxed{0.0833333333333333}", True),  # 6 places
    ("percent", "#### 28", r"\boxed{28\%}", True),
    # MATH golds (full solutions: the last box, with the boxes math-verify reads together with it, is the answer)
    ("math-half-decimal", MATH_GOLD, r"\boxed{0.5}", True),
    ("math-dfrac-shorthand", MATH_GOLD, r"\boxed{\dfrac12}", True),
    ("math-interval", MATH_GOLD_INTERVAL, r"\boxed{[2, 5)}", True),
    ("math-interval-closed-wrong", MATH_GOLD_INTERVAL, r"\boxed{[2,5]}", False),
    ("math-membership", MATH_GOLD_INTERVAL, r"\boxed{x \in [2,5)}", True),
    # Every box of a gold holding several is part of the answer: a partial answer is wrong.
    ("gold-boxes-all-needed", r"$$\boxed{2}, \boxed{3}, \boxed{5}$$", r"So \boxed{5}", False),
    ("gold-boxes-all-given", r"$$\boxed{2}, \boxed{3}, \boxed{5}$$", r"So \boxed{5, 3, 2}", True),
    ("gold-boxes-in-chained-envs", r"\(\boxed{1}\) and \(\boxed{-2}\).", r"\boxed{-2}", False),
    (
        "gold-boxes-far-apart",
        r"First \boxed{7}. A long computation then gives the answer \boxed{9}.",
        r"\boxed{9}",
        True,
    ),
    ("final-answer-sentence", "$34$", "Final Answer: The final answer is $34$. I hope it is correct.", True),
    ("final-answer-sentence-wrong", "$34$", "Final Answer: The final answer is $35$. I hope it is correct.", False),
    ("mathrm-e-gold", r"1 - \frac{1}{\mathrm{e}}", r"\boxed{1-e^{-1}}", True),
    ("mathrm-e-pred", r"e^{2}", r"\boxed{\mathrm{e}^{2}}", True),
    ("inequality-gold-interval-pred", r"2 \le x < 5", r"\boxed{[2,5)}", True),
    # bare answers (DeepScaleR / DAPO-Math)
    ("half-vs-decimal", r"\frac{1}{2}", r"\boxed{0.5}", True),
    ("fraction-slash", r"\frac{3}{4}", r"Answer: 3/4", True),
    ("fraction-inverted", r"\frac{3}{4}", r"\boxed{\frac{4}{3}}", False),
    ("rounded-third", r"\frac{1}{3}", r"\boxed{0.333}", False),
    ("sqrt-same", r"2\sqrt{3}", r"\boxed{2\sqrt{3}}", True),
    ("sqrt-equivalent", r"2\sqrt{3}", r"\boxed{\sqrt{12}}", True),
    ("sqrt-bare-gold-is-not-2", r"2\sqrt{3}", r"\boxed{2}", False),
    ("sqrt-product-form", r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{1}{2}\sqrt{3}}", True),
    ("pair", "(3,-1)", r"\boxed{(3, -1)}", True),
    ("pair-swapped", "(3,-1)", r"\boxed{(-1,3)}", False),
    ("polynomial-factored", "x^2+7x", r"\boxed{x(x+7)}", True),
    ("polynomial-reordered", "x^2+7x", r"\boxed{7x + x^2}", True),
    ("polynomial-wrong", "x^2+7x", r"\boxed{x^2+7}", False),
    ("set-order", r"\{1,2\}", r"\boxed{\{2,1\}}", True),
    ("set-wrong", r"\{1,2\}", r"\boxed{\{1,3\}}", False),
    ("interval-infinity", r"(-\infty, 3]", r"\boxed{(-\infty,3]}", True),
    ("interval-open-wrong", r"(-\infty, 3]", r"\boxed{(-\infty,3)}", False),
    ("units-pred", "10", r"\boxed{10\text{ cm}}", True),
    ("units-gold", r"10\text{ cm}", r"\boxed{10}", True),
    ("assignment", "5", r"\boxed{x = 5}", True),
    ("power-of-ten", "1000000", r"\boxed{10^6}", True),
    ("pi-is-not-3.14", r"\pi", r"\boxed{3.14}", False),
    ("text-answer", r"\text{Monday}", r"\boxed{\text{Monday}}", True),
    ("matrix", r"\begin{pmatrix}1\\2\end{pmatrix}", r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", True),
    ("dollar-wrapped-gold", r"$2\sqrt{3}$", r"$\boxed{\sqrt{12}}$", True),
    # extraction
    ("last-box-wins", "5", r"First guess \boxed{3}. Checking each case again the count is \boxed{5}", True),
    ("earlier-box-ignored", "3", r"First guess \boxed{3}. Checking each case again the count is \boxed{5}", False),
    # Boxes close together (or a separator apart) are one answer to math-verify: here the set {3, 5}.
    ("nearby-boxes-are-one-answer", "5", r"First guess \boxed{3}, but actually \boxed{5}", False),
    ("several-boxes-one-answer", r"\{1,2,3\}", r"\boxed{1},\boxed{2},\boxed{3}", True),
    ("several-boxes-one-answer-and", "(1,2),(2,1)", r"$\boxed{(2,1)}$ and $\boxed{(1,2)}$", True),
    ("nested-box", "7", r"\boxed{\boxed{7}}", True),
    ("truncated-last-box", "5", r"So \boxed{5}. Double-checking: \boxed{\frac{10}{2", False),
    ("candidate-stuffing", "3", r"\boxed{1, 2, 3, 4, 5}", False),
    ("empty-box", "3", r"\boxed{}", False),
]


@pytest.mark.parametrize(("gold", "completion", "correct"), [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_verdict_table(reward, gold, completion, correct):
    assert reward(completions=[completion], answer=[gold]) == [1.0 if correct else -1.0]


def test_table_size_and_batch_order(reward):
    assert len(TABLE) >= 40
    golds = [row[1] for row in TABLE]
    completions = [row[2] for row in TABLE]
    expected = [1.0 if row[3] else -1.0 for row in TABLE]
    # One batch, reversed too: verdicts come back in input order whatever finishes first.
    assert reward(completions=completions, answer=golds) == expected
    assert reward(completions=completions[::-1], answer=golds[::-1]) == expected[::-1]


def test_a_gold_column_given_as_one_string_is_refused(reward):
    """TRL passes each column as a list; a direct call with one string made each character a gold answer."""
    with pytest.raises(TypeError, match="answer= is one string; pass a list with one gold answer per completion"):
        reward(completions=[r"\boxed{1}", r"\boxed{2}"], answer="12")


def test_each_row_reads_the_first_column_that_holds_its_gold():
    """A mixture of data sets gives some rows an `answer` and others only a `solution`: each row is scored against
    the gold it has (the first column present decided for the whole batch, and the other rows went unscored). Its own
    instance: a gold warned about is not warned about again, which the module's shared reward counts."""
    completions = [r"\boxed{1}", r"\boxed{2}", r"\boxed{3}"]
    answer = ["", "#### 2", None]  # a blank cell holds no gold either (it was taken, and the row went unscored)
    solution = [r"So it is $\boxed{1}$.", r"\boxed{5}", None]
    own = make_math_reward(name="mixture_reward")
    assert own(completions=completions, answer=answer, solution=solution) == [1.0, 1.0, None]


def test_chat_completions_and_solution_column(reward):
    completions = [
        [{"role": "assistant", "content": r"It is \boxed{\frac{3}{4}}"}],
        [{"role": "assistant", "content": [{"type": "text", "text": r"It is \boxed{0.75}"}]}],
        [
            {"role": "assistant", "content": r"Let me call a tool. \boxed{1}"},
            {"role": "tool", "content": "0.75"},
            {"role": "assistant", "content": r"So \boxed{0.75}"},
        ],
        [{"role": "assistant", "content": r"It is \boxed{\frac{4}{3}}"}],
    ]
    solution = [r"\frac{3}{4}"] * 4
    assert reward(completions=completions, solution=solution) == [1.0, 1.0, 1.0, -1.0]


# ---------------------------------------------------------------------------------------------------------------------
# The TRL protocol
# ---------------------------------------------------------------------------------------------------------------------


def test_trainer_style_call_ignores_unknown_kwargs_and_logs(reward):
    logged: dict[str, list] = {}
    metrics: dict[str, float] = {}
    rewards = reward(
        prompts=["p1", "p2", "p3"],
        completions=[r"\boxed{72}", "I give up", r"\boxed{x(x+7)}"],
        completion_ids=[[1, 2], [3], [4]],
        answer=["#### 72", "#### 72", "x^2+7x"],
        problem=["a", "b", "c"],
        trainer_state=object(),
        log_extra=lambda column, values: logged.__setitem__(column, values),
        log_metric=lambda name, value: metrics.__setitem__(name, value),
    )
    assert rewards == [1.0, -1.0, 1.0]
    assert logged == {
        "test_math_reward_gold": ["72", "72", "x^2+7x"],
        "test_math_reward_answer": ["72", "[no answer]", "x(x+7)"],
    }
    assert metrics["test_math_reward/no_answer_rate"] == pytest.approx(1 / 3)
    assert metrics["test_math_reward/timeout_rate"] == 0.0


def test_answer_column_precedence_and_configuration(reward):
    both = {"answer": ["#### 72"], "solution": ["#### 5"]}
    assert math_reward(completions=[r"\boxed{72}"], **both) == [1.0]  # `answer` wins over `solution`
    assert math_reward(completions=[r"\boxed{72}"], answer=None, solution=["#### 72"]) == [1.0]

    binary = make_math_reward(answer_column="final", correct_reward=1.0, incorrect_reward=0.0, name="binary")
    assert binary.__name__ == "binary"
    assert binary(completions=[r"\boxed{\frac{1}{2}}", r"\boxed{2}"], final=["0.5", "0.5"]) == [1.0, 0.0]
    with pytest.raises(KeyError, match="'final'"):
        binary(completions=[r"\boxed{1}"], answer=["1"])
    with pytest.raises(ValueError, match="2 completions but 1 gold"):
        reward(completions=["a", "b"], answer=["1"])
    with pytest.raises(ValueError, match="timeout must be > 0, got 0"):
        make_math_reward(timeout=0)


def test_unparseable_gold_gives_none_and_warns_once_per_gold(reward, caplog):
    bad = [r"\frac{1}{", "", None, "((((", "x" * (MAX_ANSWER_CHARS + 1), r"So \boxed{3} and then \boxed{4"]
    completions = [r"\boxed{1}"] * len(bad) + [r"\boxed{1}"]
    with caplog.at_level(logging.WARNING, logger="trl_vapo.rewards"):
        for _ in range(3):
            assert reward(completions=completions, answer=[*bad, "1"]) == [None] * len(bad) + [1.0]
    warnings = [r for r in caplog.records if "cannot parse the gold answer" in r.getMessage()]
    assert len(warnings) == len(bad) - 1  # once per distinct gold (a blank one is none, as None), not once per call


def test_name_and_pickling_round_trip(reward):
    assert math_reward.__name__ == "math_reward"
    assert think_boxed_format_reward.__name__ == "think_boxed_format_reward"
    clone = pickle.loads(pickle.dumps(reward))
    assert clone.__name__ == reward.__name__ and clone.timeout == reward.timeout
    assert clone(completions=[r"\boxed{\sqrt{12}}"], answer=[r"2\sqrt{3}"]) == [1.0]


def test_get_reward_function_by_name_and_import_path():
    assert get_reward_function("math_reward") is math_reward
    assert set(REWARD_FUNCTIONS) == {"math_reward", "think_boxed_format_reward"}
    assert get_reward_function("trl_vapo.rewards.think_boxed_format_reward") is think_boxed_format_reward
    assert get_reward_function("trl_vapo.rewards:math_reward") is math_reward
    for bad in ("no_such_reward", "trl_vapo.rewards.no_such_reward", "no_such_module.reward"):
        with pytest.raises(ValueError, match=rf"^(unknown|cannot load) reward function '{re.escape(bad)}'"):
            get_reward_function(bad)


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"a \boxed{1} b \boxed{\{1,2\}} c", r"\{1,2\}"),  # escaped braces do not close the box
        (r"\boxed{\text{a}\}}", r"\text{a}\}"),
        (r"\fbox{4}", "4"),
        (r"\boxed{1} \boxed{2", None),  # the last box is truncated
        (r"\boxed{1}, \boxed{2}", "2"),  # the last box only (extract_predicted_answer reads both)
        (r"\boxed{\boxed{3}} x", r"\boxed{3}"),
        ("no box", None),
    ],
)
def test_find_last_boxed(text, expected):
    assert find_last_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{72} then #### 5", "72"),  # a box beats the other markers
        ("steps\n#### 1,234  \n", "1234"),  # a number as math-verify reads it
        ("steps\nThe final answer is: $\\frac{1}{2}$.", r"\frac{1}{2}"),
        ("Answer: **(3,-1)**", "(3,-1)"),
        ("Answer: 3\nbecause 1 + 2 = 3", None),  # the marker must be on the final line
        ("1 + 2 = 3", None),  # no marker, no answer: never the last number in the text
        (r"\boxed{5} \boxed{6", None),
        (r"\boxed{" + "1" * (MAX_ANSWER_CHARS + 1) + "}", None),
        (r"\boxed{" + "1" * MAX_ANSWER_CHARS + "}", "1" * MAX_ANSWER_CHARS),
        (r"\boxed{ }", None),
        # several boxes: those math-verify joins with the last one
        (r"\boxed{1},\boxed{2}, \boxed{3}", "1,2,3"),
        (r"$\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}$", "(2, 2),(6, 2)"),
        (r"\boxed{4}, \boxed{4}", "4"),  # a repeated answer once
        (r"\boxed{1} then some words here \boxed{2}", "2"),  # 10+ characters and no separator: not joined
        (r"$\boxed{1} then some words here \boxed{2}$", "1,2"),  # ... unless one math environment holds both
        (r"$\boxed{1}$ and then, much later and after checking everything again, $\boxed{2}$", "2"),
        (r"\(\boxed{1}\) and \(\boxed{-2}\) are the roots", "1, -2"),  # chained environments: each read apart
        (r"\boxed{1}, \boxed{2}, " * 200 + r"\boxed{3}", None),  # a list of candidates is no answer
        # the MATH few-shot sentence, also before further text (math-verify takes it wherever it stands)
        ("Final Answer: The final answer is $34$. I hope it is correct.", "34"),
        ("The final answer is 12,000,023. I hope it is correct. <|im_start|>user", "12000023"),
        ("The final answer is $1$ and $2$. I hope it is correct.", "1, 2"),
        (r"So \boxed{5}. Final Answer: The final answer is $6$. I hope it is correct.", "6"),  # the later one wins
        (r"Final Answer: The final answer is $6$. I hope it is correct. Then \boxed{5}", "5"),
        ("The final answer is x + 1. I hope it is correct.", None),  # not a math environment or a number
        ("steps\nAnswer: 72 clips", "72"),  # a count and what it counts: the number
        ("Answer: 12 sq. ft", "12"),
        ("Answer: 5 pi", "5 pi"),  # a math word is no unit
        ("Answer: 3 and 4", "3 and 4"),
        ("The final answer is $34$.", "34"),
        ("Final Answer: The volume of the box is 120. I hope it is correct.", "120"),
        # Euler's number written upright
        (r"\boxed{\mathrm{e}^{2}}", "e^{2}"),
        (r"\boxed{1 - \frac{1}{\mathrm{e}}}", r"1 - \frac{1}{e}"),
    ],
)
def test_extract_predicted_answer(text, expected):
    assert extract_predicted_answer(text) == expected


@pytest.mark.parametrize(
    ("gold", "expected"),
    [
        (GSM8K_GOLD, "72"),
        ("#### 1,234\n", "1,234"),
        (MATH_GOLD, r"\frac{1}{2}"),
        (r"$2\sqrt{3}$", r"2\sqrt{3}"),
        ("  x^2+7x ", "x^2+7x"),
        (72, "72"),
        (0.5, "0.5"),
        (1e20, "100000000000000000000"),  # not 1e+20, nor 2.5e-07 below: math-verify reads neither as the number
        (1e23, "1" + "0" * 23),  # the repr's digits, not the binary value's 99999999999999991611392
        (np.float64(72.0), "72"),  # numpy's repr is np.float64(72.0)
        (np.int64(72), "72"),  # (a column read with set_format("numpy"): it was no answer, every row unscored)
        (np.float32(0.1), "0.1"),  # float32's own shortest digits, not float64's 0.10000000149011612
        (np.bool_(True), None),
        (Decimal("72.500"), "72.5"),  # a decimal column (Arrow's decimal128): it was no answer, every row unscored
        (Decimal("1E+2"), "100"),
        (Decimal("NaN"), None),
        (2.5e-07, "0.00000025"),
        (-1.25e-05, "-0.0000125"),
        (None, None),
        (True, None),
        (["72"], None),
        ("", None),
        (r"\frac{1}{", None),
        ("Let me explain at length " * 20, None),
        (r"$$\boxed{2}, \boxed{3}, \boxed{5}, \boxed{7}, \boxed{13}$$", "2,3,5,7,13"),
        (r"\(\boxed{1}\) and \(\boxed{-2}\).", "1, -2"),
        (r"The answers are \boxed{1} papers and \boxed{2} bins.", "1,2"),
        (r"First \boxed{1}, then more words than math-verify joins across (70 or more), and at last \boxed{2}.", "2"),
        ("$6$ and $8$", "6, 8"),
        ("$6$ and $120$", "6, 120"),  # a set: "6,120" read as the number 6120 (math-verify reads the set)
        (r"$1 - \frac{1}{\mathrm{e}}$", r"1 - \frac{1}{e}"),
        # A gold in words, read as a completion's answer line: "72 clips" was kept whole, which math-verify reads as
        # 72*c*l*i*p*s (every completion scored wrong, the gold counted as valid).
        ("72 clips", "72"),
        ("#### 72 clips", "72"),
        ("So the answer is 5.", "5"),
        ("Answer: 1/2", "1/2"),
        ("2 pi", "2 pi"),  # (a product math-verify reads as meant)
        ("50 percent", "50 percent"),  # (words that are part of the number stay: 50 alone is another number)
        ("2 million", "2 million"),
        ("3 squared", "3 squared"),
    ],
)
def test_normalize_gold_answer(gold, expected):
    assert normalize_gold_answer(gold) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("72", Fraction(72)),
        ("+5", Fraction(5)),
        ("-3", Fraction(-3)),
        ("46.0", Fraction(46)),
        (".5", Fraction(1, 2)),
        ("1,234", Fraction(1234)),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("1{,}234", Fraction(1234)),
        (r"1\,234", None),  # math-verify reads a thin space as no separator
        (r"\$18.90", Fraction(189, 10)),
        ("3/4", Fraction(3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"-\dfrac{3}{4}", Fraction(-3, 4)),
        (r"\tfrac{-3}{4}", Fraction(-3, 4)),
        (r"\frac12", Fraction(1, 2)),
        ("$72$", Fraction(72)),
        ("4,6", None),
        ("1,2345", None),
        ("12,34.5", None),
        ("0,5", None),
        ("0,111", None),  # math-verify reads it as 0.111
        ("-1,234", Fraction(-1234)),
        ("1,234/5", None),  # a set to math-verify
        (r"\frac{1.5}{2}", None),
        ("72.", None),
        ("1e6", None),
        (r"\frac{1}{0}", None),
        ("１２", None),  # fullwidth digits
        ("٧٢", None),  # Arabic-Indic digits
        (r"2\sqrt{3}", None),
        ("x", None),
    ],
)
def test_parse_plain_number(text, value):
    assert parse_plain_number(text) == value


@settings(deadline=None)  # (a descheduled example on a loaded machine is no failure)
@given(st.integers(min_value=0, max_value=10**30))
def test_thousands_separators_round_trip(n):
    assert parse_plain_number(f"{n:,}") == n
    assert parse_plain_number(f"{n:,}".replace(",", "{,}")) == n
    assert fast_verdict(str(n), f"{n:,}") is True


@settings(max_examples=50, deadline=None)
@given(st.fractions(min_value=-(10**9), max_value=10**9, max_denominator=10**6).filter(lambda f: f.denominator > 1))
def test_fast_verdict_is_exact_without_decimals(value):
    latex = rf"\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"
    if value < 0:
        latex = "-" + latex
    assert parse_plain_number(latex) == value
    assert fast_verdict(latex, f"{value.numerator}/{value.denominator}") is True
    assert fast_verdict(latex, f"{value.numerator + 1}/{value.denominator}") is False


@settings(max_examples=100, deadline=None)
@given(st.fractions(min_value=-(10**6), max_value=10**6, max_denominator=10**4), st.integers(min_value=1, max_value=8))
def test_fast_verdict_leaves_close_decimals_to_math_verify(value, places):
    # math-verify rounds to six places before comparing a decimal: the fast path decides only what that cannot change.
    # (At most 7 + 8 = 15 significant digits: longer decimals are left to math-verify whatever their value.)
    decimal = f"{float(value):.{places}f}"
    verdict = fast_verdict(rf"\frac{{{value.numerator}}}{{{value.denominator}}}", decimal)
    gap = abs(Fraction(decimal) - value)
    if gap == 0:
        assert verdict is True
    elif gap >= Fraction(1, 1000):
        assert verdict is False
    else:
        assert verdict is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=9999), min_size=2, max_size=4))
def test_bad_digit_grouping_is_never_a_number(groups):
    text = ",".join(map(str, groups))
    # A leading 0 makes a decimal comma to math-verify (0,100 is 0.1), so it is no thousands separator either.
    valid = 1 <= len(str(groups[0])) <= 3 and groups[0] != 0 and all(len(str(g)) == 3 for g in groups[1:])
    assert (parse_plain_number(text) is not None) == valid


def test_fast_verdict_needs_both_numbers():
    assert fast_verdict("46", "46.0") is True
    assert fast_verdict("72", "72.0000001") is None  # math-verify says False here, for 72.000001 too
    assert fast_verdict("1234567890", "1234567890.0") is None  # beyond the magnitude the fast path vouches for
    assert fast_verdict("46", "4,6") is None  # not a number: math-verify decides (a set, so wrong)
    assert fast_verdict(r"2\sqrt{3}", "2") is None


def test_completion_text():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "a"}]) == "a"
    assert completion_text({"role": "assistant", "content": "b"}) == "b"
    assert (
        completion_text([{"role": "assistant", "content": [{"type": "text", "text": "c"}, {"type": "image"}]}]) == "c"
    )
    assert completion_text([{"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"}]) == "x"
    assert completion_text(None) == ""


def test_the_answer_of_a_reasoning_model_is_read_after_its_thinking(reward):
    """The last box of the whole text was the answer, one inside `<think>...</think>` too: a guess the model went on
    to revise scored as its answer, and a completion cut off while thinking scored on its last guess."""
    cases = [
        ("<think>guess \\boxed{4}? no: 2+3=5</think>\nThe answer is 5.", "5"),
        ("<think>guess \\boxed{4}</think> so \\boxed{5}", "5"),
        ("2+3 is \\boxed{4}? no, 5</think>\nThe answer is 5.", "5"),  # `<think>` in the prompt (R1, Qwen3)
        ("<think>never closed \\boxed{5}", None),
        ("<think>a</think><think>b \\boxed{5}", None),  # opened again, not closed
        ("no tags: \\boxed{5}", "5"),
    ]
    assert [extract_predicted_answer(text) for text, _ in cases] == [answer for _, answer in cases]
    completions = [text for text, _ in cases] + [[{"role": "assistant", "content": cases[0][0]}]]
    assert reward(completions=completions, answer=["5"] * 7) == [1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
    assert reward(completions=[cases[0][0], cases[3][0]], answer=["4", "5"]) == [-1.0, -1.0]


def test_a_completion_cut_off_in_the_think_block_its_prompt_opened_answers_nothing(reward):
    """DeepSeek-R1's chat template ends the prompt with `<think>`: a finished completion holds `</think>` alone, and
    one cut off while thinking holds no tag, so its tentative box was scored as its answer. The trainer says where
    the prompt opened the block (`prompt_opens_think`, read from the prompt's tokens); without it a completion without
    tags is read whole."""
    cut_off, finished = "2+3 is \\boxed{5}? check", "2+3 is \\boxed{4}? no</think> \\boxed{5}"
    assert extract_predicted_answer(cut_off, thinking=True) is None
    assert extract_predicted_answer(cut_off) == extract_predicted_answer(finished, thinking=True) == "5"
    completions = [cut_off, finished, cut_off]
    opened = [True, True, False]
    assert reward(completions=completions, answer=["5"] * 3, prompt_opens_think=opened) == [-1.0, 1.0, 1.0]
    assert type(reward).reads_prompt_opens_think


def test_think_boxed_format_reward():
    completions = [
        "<think>\n2 + 2 = 4\n</think>\nThe answer is \\boxed{4}.",  # canonical
        "2 + 2 = 4\n</think>\n\\boxed{4}",  # <think> was in the prompt (R1 / Qwen3 templates)
        [{"role": "assistant", "content": "<think>sum</think> \\boxed{4}"}],  # chat
        # parsed by a response template: the reasoning apart, named as the template names it (TRL's LFM2.5, gpt-oss)
        [{"role": "assistant", "reasoning_content": "sum", "content": "\\boxed{4}"}],
        [{"role": "assistant", "thinking": "sum", "content": "\\boxed{4}"}],
        "<think>sum</think> The answer is 4.",  # no box
        "<think>sum</think> \\boxed{4",  # truncated box
        "<think>\\boxed{4}</think> 4",  # box only inside the reasoning
        "<think>  </think> \\boxed{4}",  # blank reasoning
        "<think>a</think><think>b</think> \\boxed{4}",  # two think blocks
        "<think>a <think> b</think> \\boxed{4}",  # nested think
        "<think>never closed \\boxed{4}",
        "<think>a</think> \\boxed{}",  # empty box
    ]
    assert think_boxed_format_reward(completions=completions) == [1.0] * 5 + [0.0] * 8


# ---------------------------------------------------------------------------------------------------------------------
# Adversarial completions and the hard deadline
# ---------------------------------------------------------------------------------------------------------------------

HANGS = {  # each of these keeps math-verify busy far beyond any deadline (the first even through its own alarm)
    "power-tower-5": r"\boxed{\dfrac{5^{(5^{(5^{(5^5)})}-4)}-5}{16}}",
    "power-tower-9": r"\boxed{9^{9^{9^{9}}}}",
    "huge-factorial": r"\boxed{(10^{10})!}",
}
OTHERS = {  # most never reach math-verify; all must return within the deadline
    "100k-chars-then-box": "lorem ipsum " * 8500 + r"\boxed{6}",
    "100k-chars-in-box": r"\boxed{" + "9" * 100_000 + "}",
    "deep-braces-unclosed": r"\boxed{" + "{" * 50_000,
    "deep-braces-closed": r"\boxed{" + "{" * 50_000 + "6" + "}" * 50_001,
    "deep-braces-short": r"\boxed{" + "{" * 140 + "6" + "}" * 141,
    "deep-nested-boxes": r"\boxed{" * 30_000 + "6" + "}" * 30_000,
    "open-boxes-then-box": r"\boxed{1 " * 30_000 + r"\boxed{6}",  # each open box passed over: one pass, not 30,000
    "answer-line-of-spaces": "Answer:" + " " * 100_000 + "6",
    "unicode-digits-fullwidth": r"\boxed{６}",
    "unicode-digits-arabic": r"\boxed{٦}",
    "many-boxes": "".join(rf"\boxed{{{i}}} " for i in range(20_000)),
    "truncated-last-box": r"\boxed{6} and finally \boxed{\frac{12}{2",
    "long-nested-latex": r"\boxed{" + r"\sqrt{" * 40 + "36" + "}" * 41,
}
OTHERS_EXPECTED = {
    "100k-chars-then-box": 1.0,
    "open-boxes-then-box": 1.0,
    "deep-braces-short": None,
    "many-boxes": -1.0,
}


@pytest.mark.parametrize("name", list(HANGS) + list(OTHERS))
def test_adversarial_completion_returns_within_deadline(fast_deadline_reward, name):
    completion = HANGS.get(name) or OTHERS[name]
    pool = fast_deadline_reward.pool
    pool.warm_up()  # a worker killed by the previous case restarts in the background; its start-up is not timed
    before = pool.worker_pids()
    start = time.monotonic()
    result = fast_deadline_reward(completions=[completion], answer=["6"])
    elapsed = time.monotonic() - start
    assert elapsed < DEADLINE + 2.0, f"{name} took {elapsed:.2f} s"  # (the kill and the replacement's start)
    if name in HANGS:
        assert result == [-1.0]
        assert elapsed > DEADLINE * 0.9  # it really did hang until the deadline
        killed = set(before) - set(pool.worker_pids())
        assert len(killed) == 1 and not wait_gone(killed, timeout=2.0)  # killed and reaped, no zombie
    else:
        expected = OTHERS_EXPECTED.get(name, -1.0)
        if expected is None:  # math-verify's own verdict on deep nesting is not ours to pin down, only the time
            assert result[0] in (1.0, -1.0)
        else:
            assert result == [expected]
    # The pool keeps serving, with math-verify (not the fast path) on the next answer.
    assert fast_deadline_reward(completions=[r"\boxed{\sqrt{12}}"], answer=[r"2\sqrt{3}"]) == [1.0]


def test_batch_with_hangs_keeps_order_and_repeats_are_not_retried():
    fn = make_math_reward(timeout=DEADLINE, name="batch_deadline_reward")
    fn.pool.warm_up()
    hang = HANGS["power-tower-9"]
    completions = [r"\boxed{0.5}", hang, r"\boxed{\dfrac12}", hang, r"\boxed{\frac{1}{3}}", r"\boxed{(1,2)}"]
    golds = [r"\frac{1}{2}"] * 5 + ["(1,2)"]
    expected = [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]

    def scored() -> tuple[float, dict[str, int]]:
        """The call's seconds and what the pool verified: pairs sent, overruns."""
        before, start = dict(fn.pool.stats), time.monotonic()
        assert fn(completions=completions, answer=golds) == expected
        return time.monotonic() - start, {k: fn.pool.stats[k] - before[k] for k in ("verified", "timeouts")}

    # The identical hanging pair is verified once, on one worker, while the other worker serves the rest (the
    # plain-number golds take the fast path: the pool gets the hang and (1,2)).
    first, sent = scored()
    assert first < DEADLINE + 2.0 and sent == {"verified": 2, "timeouts": 1}
    for call in range(STRIKES):
        seconds, sent = scored()
        retried = seconds > DEADLINE * 0.9
        # Verified again until it has overrun in STRIKES calls, then no more (a retry: a deadline more).
        assert retried == (call < STRIKES - 1)
        assert sent == ({"verified": 2, "timeouts": 1} if retried else {"verified": 1, "timeouts": 0})


def test_an_overrun_of_a_stalled_machine_is_verified_again():
    # One overrun may be a stall of the machine, not the answer's doing: a stopped worker (SIGSTOP) stands for one.
    # An overrun pair was scored -1 for the rest of the run, right answers too; and a gold whose probe against 0
    # overran (the second stopped worker takes it) was unusable for good: None for every completion, after a stall
    # as long as the pair's deadline and the probes after it.
    fn = make_math_reward(timeout=1.0, memory_limit_mb=3000, name="stalled_reward")  # (a pool of its own)
    pool = fn.pool
    try:
        pool.warm_up()
        for pid in pool.worker_pids():
            os.kill(pid, signal.SIGSTOP)
        timeouts = pool.stats["timeouts"]
        assert fn(completions=[r"\boxed{x(x+7)}"], answer=["x^2+7x"]) == [-1.0]
        assert pool.stats["timeouts"] - timeouts == 2  # the pair, then the gold's first probe
        assert fn(completions=[r"\boxed{x(x+7)}"], answer=["x^2+7x"]) == [1.0]
    finally:
        pool.close()


def test_a_gold_that_overruns_every_comparison_scores_nothing(caplog):
    # A gold math-verify evaluates in every comparison made each of its predictions cost a deadline and a worker
    # restart, and scored the right ones -1. A gold that overruns only against some predictions (a power tower the
    # policy wrote) compares with 0 in time and stays usable. Unusable once it has overrun against 0 in STRIKES calls
    # (one overrun alone may be a stall of the machine): until then its rows score as overruns, -1.
    fn = make_math_reward(timeout=1.0, name="overrunning_gold_reward")
    fn.pool.warm_up()
    tower = "9^{9^{9^{9}}}"
    completions = [r"\boxed{42}", rf"\boxed{{{tower}}}", HANGS["power-tower-9"], r"\boxed{7}"]
    golds = [tower, tower, "x^2+7x", "7"]
    for _ in range(STRIKES - 1):  # (row 1: the gold's own text, the same string)
        assert fn(completions=completions, answer=golds) == [-1.0, 1.0, -1.0, 1.0]
    with caplog.at_level(logging.WARNING, logger="trl_vapo.rewards.functions"):
        # That call's rows of the gold too: the right answer (row 1), compared by its text alone, would be +1.
        assert fn(completions=[r"\boxed{41}", *completions[1:]], answer=golds) == [None, None, -1.0, 1.0]
    assert "cannot compare the gold answer '9^{9^{9^{9}}}' with 0 within the 1 s deadline" in caplog.text
    timeouts = fn.pool.stats["timeouts"]
    start = time.monotonic()
    assert fn(completions=[r"\boxed{43}"], answer=[tower]) == [None]
    assert time.monotonic() - start < 0.5 and fn.pool.stats["timeouts"] == timeouts  # not compared again
    assert fn(completions=[r"\boxed{x(x+7)}"], answer=["x^2+7x"]) == [1.0]


def test_caller_alarm_survives(fast_deadline_reward):
    # math-verify's in-process timeouts call signal.alarm(0) and replace the SIGALRM handler; workers must not.
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert fast_deadline_reward(completions=[r"\boxed{x(x+7)}"], answer=["x^2+7x"]) == [1.0]
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        time.sleep(0.3)
        assert fired == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------------------------------------
# The pool survives dead workers and is usable from threads, DataLoader workers and torchrun ranks
# ---------------------------------------------------------------------------------------------------------------------


def test_pool_replaces_a_worker_killed_while_idle_or_busy(caplog):
    pool = MathVerifyPool(num_workers=1)
    try:
        pool.warm_up()
        (first,) = pool.worker_pids()
        os.kill(first, signal.SIGKILL)
        assert pool.verify([(r"2\sqrt{3}", r"\sqrt{12}")]) == [True]
        (second,) = pool.worker_pids()
        assert second != first and not wait_gone([first], timeout=2.0)

        # Killed mid-answer: the pair is retried once on a fresh worker. 400000! - 400000! takes math-verify ~1.5 s,
        # long enough to be killed in the middle, and the retry's True shows the answer was really verified again.
        crashes = pool.stats["crashes"]
        result: list = []
        thread = threading.Thread(target=lambda: result.append(pool.verify([("0", "400000! - 400000!")], timeout=60)))
        thread.start()
        waited = time.monotonic() + 10  # killed once it has the pair (a kill before is an idle worker's death)
        while not any(w.task is not None for w in list(pool._workers)) and time.monotonic() < waited:
            time.sleep(0.01)
        time.sleep(0.3)
        os.kill(second, signal.SIGKILL)
        thread.join(timeout=90)
        assert result == [[True]]
        assert pool.stats["crashes"] - crashes == 1
        # Killed twice on it: scored False with a warning, and reported with the overruns (a reward caches it and
        # counts it in its timeout rate; a gold that kills math-verify is probed as one that overruns). It was
        # silent, and retried at every call. (Another number: the worker that computed 400000! has it cached.)
        done: list = []
        thread = threading.Thread(
            target=lambda: done.append(pool.verify_with_timeouts([("0", "390000! - 390000!")], timeout=60))
        )
        with caplog.at_level(logging.WARNING, logger="trl_vapo.rewards.pool"):
            thread.start()
            for _ in range(2):
                busy, waited = None, time.monotonic() + 60  # (a replacement imports math-verify first: slow if loaded)
                while busy is None and time.monotonic() < waited:
                    busy = next((w for w in list(pool._workers) if w.ready and w.task is not None), None)
                    time.sleep(0.01)
                assert busy is not None, "no worker took the pair"
                time.sleep(0.3)
                os.kill(busy.proc.pid, signal.SIGKILL)
                waited = time.monotonic() + 30  # until the death is seen and the task taken back
                while busy.task is not None and time.monotonic() < waited:
                    time.sleep(0.01)
            thread.join(timeout=90)
        assert done == [([False], {0})]
        assert ["died twice on one answer" in r.getMessage() for r in caplog.records] == [True]
        assert pool.verify([("x^2+7x", "x(x+7)"), ("x^2+7x", "x(x+6)")]) == [True, False]
        assert not wait_gone([second], timeout=2.0)
    finally:
        pids = pool.worker_pids()
        pool.close()
    assert not wait_gone(pids, timeout=5.0)


def test_workers_die_with_a_hard_killed_parent(tmp_path):
    # A trainer killed with SIGKILL (OOM killer, torchrun tearing ranks down) runs no cleanup: a worker stuck on a
    # power tower must still go (parent-death signal), or it spins on a core forever.
    pool_py = Path(__file__).resolve().parents[1] / "trl_vapo" / "rewards" / "pool.py"  # no torch: a quick parent
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('rewards_under_test', {str(pool_py)!r})\n"
        "rewards = importlib.util.module_from_spec(spec); sys.modules[spec.name] = rewards\n"
        "spec.loader.exec_module(rewards)\n"
        "pool = rewards.MathVerifyPool(num_workers=1)\n"
        "pool.warm_up()\n"
        "print(pool.worker_pids()[0], flush=True)\n"
        "pool.verify([('6', '9^{9^{9^{9}}}')], timeout=600)\n"
    )
    assert not worker_left_by_a_killed_parent(script, busy_after=0.5)  # (deep inside the power tower by then)


def worker_left_by_a_killed_parent(script: str, busy_after: float) -> bool:
    """Runs `script` as a parent process that prints its worker's PID, kills the parent (SIGKILL: no cleanup) once
    the worker has been busy `busy_after` seconds, and says whether the worker still runs 10 s later."""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(busy_after)
        assert is_running(worker)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    deadline = time.monotonic() + 10
    while is_running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return is_running(worker)


def test_a_worker_without_the_death_signal_exits_with_its_parent_gone():
    """macOS has no parent-death signal: a hard-crashed trainer left a worker on a power tower, with no deadline and
    no memory bound (macOS does not enforce RLIMIT_AS). Its watch (`_exit_with_parent`, the worker's on every
    platform but Linux; run here by hand) ends it once its parent is gone, though its main thread computes."""
    worker_py = Path(__file__).resolve().parents[1] / "trl_vapo" / "rewards" / "worker.py"
    child = (
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('worker_under_test', {str(worker_py)!r})\n"
        "worker = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker)\n"
        "worker._exit_with_parent(os.getppid(), every=0.05)\n"
        "print(os.getpid(), flush=True)\n"
        "while True: sum(i * i for i in range(10**6))\n"  # (busy, holding the GIL between bytecodes)
    )
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    assert not worker_left_by_a_killed_parent(parent, busy_after=0.3)


def test_from_non_main_threads(fast_deadline_reward):
    fn = make_math_reward(timeout=DEADLINE, name="threaded_reward")  # fresh: no memory of earlier timeouts
    fn.pool.warm_up()
    results: dict[str, list] = {}
    batches = {
        "with-hang": ([r"\boxed{\sqrt{12}}", HANGS["power-tower-5"], r"\boxed{2}"], [r"2\sqrt{3}", "6", r"2\sqrt{3}"]),
        "plain": ([r"\boxed{x(x+7)}", r"\boxed{0.5}"], ["x^2+7x", r"\frac{1}{2}"]),
    }
    threads = [
        threading.Thread(
            target=lambda k=k: results.__setitem__(k, fn(completions=batches[k][0], answer=batches[k][1]))
        )
        for k in batches
    ]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {"with-hang": [1.0, -1.0, -1.0], "plain": [1.0, 1.0]}
    # Calls are serialised on the shared pool: at worst the plain batch waits for the other's deadline.
    assert time.monotonic() - start < 2 * DEADLINE + 1.0


class _RewardDataset:
    """Each item scores a small batch inside the DataLoader worker and reports which worker processes did it."""

    def __init__(self, reward: MathReward):
        self.reward = reward

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        rewards = self.reward(
            completions=[r"\boxed{\sqrt{12}}", rf"\boxed{{{index}}}", r"\boxed{(-1,3)}"],
            answer=[r"2\sqrt{3}", "#### 0", "(3,-1)"],
        )
        return {"rewards": rewards, "pid": os.getpid(), "workers": self.reward.pool.worker_pids()}


def test_from_dataloader_workers():
    import torch.utils.data

    reward = make_math_reward(num_workers=1, name="loader_reward")
    reward.pool.warm_up()
    parent_workers = reward.pool.worker_pids()  # started before the fork: children must not touch these
    loader = torch.utils.data.DataLoader(
        _RewardDataset(reward), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    items = list(loader)
    assert [item["rewards"] for item in items] == [[1.0, 1.0 if i == 0 else -1.0, -1.0] for i in range(4)]
    loader_pids = {item["pid"] for item in items}
    assert len(loader_pids) == 2 and os.getpid() not in loader_pids
    child_workers = {pid for item in items for pid in item["workers"]}
    assert child_workers.isdisjoint(parent_workers)
    del loader
    assert not wait_gone(child_workers, timeout=15.0)  # reaped when the DataLoader workers exited
    assert reward.pool.worker_pids() == parent_workers
    assert reward(completions=[r"\boxed{\{2,1\}}"], answer=[r"\{1,2\}"]) == [1.0]


def test_two_torchrun_processes(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    out = tmp_path / "ranks.json"
    script = Path(__file__).with_name("_reward_torchrun_script.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["rewards"] == [1.0, 1.0, 1.0, -1.0, 1.0, 1.0]
    assert ranks[1]["rewards"] == [-1.0, 1.0, -1.0, 1.0, 1.0, -1.0]
    assert ranks[1]["s"] < 2.0 + 1.0 + 5.0  # the hang on rank 1 was cut at its deadline (plus the replacement's start)
    workers = [pid for r in ranks for pid in r["workers"]]
    assert len(set(workers)) == len(workers) == 2  # each rank has its own pool
    assert not wait_gone(workers, timeout=10.0)


# ---------------------------------------------------------------------------------------------------------------------
# The package's layout: every documented import path, and a worker that loads only what it runs
# ---------------------------------------------------------------------------------------------------------------------


def test_every_documented_name_imports_from_the_package():
    """`trl_vapo.rewards` is a package of modules; each name of its `__all__` and each `trl_vapo.rewards` name the
    README and the docs of the package give (``from trl_vapo.rewards import X``, ``trl_vapo.rewards.X``) imports from
    the package itself."""
    import re

    import trl_vapo.rewards as rewards

    root = Path(__file__).resolve().parents[1]
    documented = set()
    for text in [(root / "README.md").read_text(), (root / "benchmarks" / "README.md").read_text(), rewards.__doc__]:
        for names in re.findall(r"from trl_vapo\.rewards import ([\w, ]+)", text):
            documented.update(name.strip() for name in names.split(","))
        documented.update(re.findall(r"trl_vapo\.rewards[.:](\w+)", text))
    assert "math_reward" in documented  # the README's first example
    for name in sorted(documented | set(rewards.__all__)):
        namespace: dict = {}
        exec(f"from trl_vapo.rewards import {name}", namespace)  # noqa: S102 - the import statement users write
        assert name in rewards.__all__, f"{name} is documented but not in trl_vapo.rewards.__all__"


def test_a_worker_process_loads_its_own_file_and_nothing_of_the_package():
    from trl_vapo.rewards import pool

    worker_py = Path(pool._WORKER_FILE)
    assert worker_py.parent == Path(pool.__file__).parent and worker_py.name == "worker.py"
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('_trl_vapo_reward_worker', {str(worker_py)!r})\n"
        "module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "print(callable(module._worker_main), sorted(n for n in sys.modules if n.split('.')[0] in "
        "('trl_vapo', 'torch', 'transformers', 'math_verify', 'sympy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True []"  # math-verify comes when `_worker_main` starts, not at load
