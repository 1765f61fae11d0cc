"""``math_reward`` against math-verify itself, on the same strings.

The reference is math-verify as its own test suite calls it (``compare_strings`` in its ``tests/test_all.py``): the
gold and the whole completion each parsed with ``LatexExtractionConfig(boxed_match_priority=0)`` and
``ExprExtractionConfig()``, then ``verify`` with its default settings. The cases are ours, grouped by what the reward
must read as math-verify does: golds holding several boxes, completions holding several boxes, the MATH few-shot
``The final answer is X. I hope it is correct.`` sentence, ``\\mathrm{e}``, and plain numbers (the in-process fast
path). The reward must agree with math-verify on every case except those listed below with their reason, and it
may never score +1 where math-verify says wrong, except where math-verify misreads Euler's number.
"""

from __future__ import annotations

import logging
import random

import pytest

from trl_vapo.rewards import extract_predicted_answer, fast_verdict, make_math_reward, parse_plain_number

math_verify = pytest.importorskip("math_verify")

CONFIG = [math_verify.LatexExtractionConfig(boxed_match_priority=0), math_verify.ExprExtractionConfig()]
LATEX_ONLY = [math_verify.LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]


def mv_parse(text: str, config=CONFIG) -> list:
    # In-process, without math-verify's signal-based timeouts: these inputs are small and benign.
    return math_verify.parse(text, config, parsing_timeout=None)


def mv_verdict(gold: str, completion: str) -> bool:
    return bool(math_verify.verify(mv_parse(gold), mv_parse(completion), timeout_seconds=None))


@pytest.fixture(scope="module", autouse=True)
def quiet_math_verify():
    # math-verify warns once per process that its timeouts are off; nothing else it logs matters here.
    loggers = [logging.getLogger(name) for name in ("math_verify", "latex2sympy2_extended")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


# (id, gold as a data set stores it, completion)
CASES = {
    "gold with several boxes": [
        ("primes-one-of-four", r"The primes are $$\boxed{2}, \boxed{3}, \boxed{5}, \boxed{7}$$", r"So \boxed{7}."),
        ("primes-all", r"The primes are $$\boxed{2}, \boxed{3}, \boxed{5}, \boxed{7}$$", r"\boxed{2, 3, 5, 7}"),
        ("primes-reordered", r"The primes are $$\boxed{2}, \boxed{3}, \boxed{5}, \boxed{7}$$", r"\boxed{7,5,3,2}"),
        ("primes-three-of-four", r"The primes are $$\boxed{2}, \boxed{3}, \boxed{5}, \boxed{7}$$", r"\boxed{2,3,5}"),
        ("roots-one-of-two", r"The roots are \(\boxed{4}\) and \(\boxed{-3}\).", r"Thus $x = \boxed{-3}$."),
        ("roots-both", r"The roots are \(\boxed{4}\) and \(\boxed{-3}\).", r"Thus $x \in \boxed{\{-3, 4\}}$."),
        ("roots-both-boxed-apart", r"The roots are \(\boxed{4}\) and \(\boxed{-3}\).", r"$\boxed{-3}$ or $\boxed{4}$"),
        ("pair-second-only", r"So $a = \boxed{3}$ and $b = \boxed{5}$.", r"\boxed{5}"),
        ("pair-both", r"So $a = \boxed{3}$ and $b = \boxed{5}$.", r"\boxed{3, 5}"),
        ("text-and-one", r"\boxed{6} \text{ and } \boxed{8}", r"\boxed{8}"),
        ("text-and-both", r"\boxed{6} \text{ and } \boxed{8}", r"\boxed{6 \text{ and } 8}"),
        ("tuples-one", r"$\boxed{(1, 2)}$, $\boxed{(2, 1)}$", r"\boxed{(2,1)}"),
        ("tuples-both", r"$\boxed{(1, 2)}$, $\boxed{(2, 1)}$", r"\boxed{(2,1), (1,2)}"),
        ("gold-chain-thousands", r"$5$ and $1,000$", r"\boxed{5, 1000}"),
        # Boxes far apart without a separator are not one answer to math-verify: the last one is the answer.
        (
            "far-apart-last",
            r"Part (a) is \boxed{12}. The second part takes longer to work out: \boxed{18}",
            r"\boxed{18}",
        ),
    ],
    "completion with several boxes": [
        ("comma-boxes", r"$\{1, 2, 3\}$", r"The values are \boxed{1},\boxed{2},\boxed{3}."),
        ("and-boxes", r"$1, 2, 3$", r"\boxed{1} and \boxed{2} and \boxed{3}"),
        ("quad-and-tuples", r"$(2, 2), (6, 2)$", r"$$\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}$$"),
        ("chained-equations", r"$x = 2, y = 5$", r"Hence \(\boxed{x = 2}\) and \(\boxed{y = 5}\)."),
        ("chained-values", r"$-1, \frac{15}{8}$", r"$p = \boxed{-1}$ or $p = \boxed{\frac{15}{8}}$"),
        ("extra-answer-is-a-set", r"$3$", r"\boxed{3}, \boxed{4}"),
        ("revised-answer", r"$3$", r"First attempt gave \boxed{4}. Redoing the arithmetic carefully gives \boxed{3}"),
        ("one-display-holds-both", r"$\{1, 2\}$", r"$\boxed{1} is one root the other root is \boxed{2}$"),
        ("think-then-answer", r"$(1, -2)$", "<think>Maybe \\boxed{(1, 2)}?</think>\nSo \\[\\boxed{(1, -2)}\\]"),
        ("deduplicated", r"$7$", r"\boxed{7}, \boxed{7}"),
        # Environments chained, a later one of three digits: each is read apart, the set {6, 120} (joined "6,120"
        # they were the thousands number 6120: the set scored wrong, 6120 right).
        ("chain-three-digits", r"$6$ and $120$", r"Thus $\boxed{6}$ and $\boxed{120}$."),
        ("chain-three-digits-as-set", r"$6$ and $120$", r"\boxed{6, 120}"),
        ("chain-three-digits-not-thousands", r"$6$ and $120$", r"\boxed{6120}"),
        ("chain-three-digits-gold-set", r"$\{6, 120\}$", r"Thus $\boxed{6}$ and $\boxed{120}$."),
        ("chain-three-digits-sentence", r"$\{6, 120\}$", "The final answer is $6$ and $120$. I hope it is correct."),
        ("chain-boxes-then-env", r"$1, 2, 300$", r"$\boxed{1}, \boxed{2}$ and $\boxed{300}$"),
        # A number with thousands separators in one environment of a chain: one number to math-verify, the set
        # {5, 1000} (joined as written, "5, 1,000" was the set {5, 1, 0}: the right set scored wrong, that one right)
        ("chain-thousands", r"$5$ and $1000$", r"Thus $\boxed{5}$ and $\boxed{1,000}$."),
        ("chain-thousands-not-three-numbers", r"$\{1, 0, 5\}$", r"Thus $\boxed{5}$ and $\boxed{1,000}$."),
        ("chain-comma-not-thousands", r"$5, 1, 0$", r"Thus $\boxed{5}$ and $\boxed{1,0}$."),
        ("chain-decimal-comma", r"$\{5, 0.5\}$", r"Thus $\boxed{5}$ and $\boxed{0,500}$."),  # latex2sympy's 0,5xx
        ("chain-decimal-comma-not-a-set", r"$\{5, 0, 500\}$", r"Thus $\boxed{5}$ and $\boxed{0,500}$."),
        # A line break with spacing, ``\\[4pt]``, inside the display: its ``\[`` is no opening (the display's is).
        (
            "aligned-spaced-lines",
            r"$(2, 5)$",
            r"So \[ \begin{aligned} x &= \boxed{2} \\[4pt] y &= \boxed{5} \end{aligned} \]",
        ),
    ],
    "final answer sentence": [
        (
            "dollars",
            r"$34$",
            "Adding them up gives 34.\nFinal Answer: The final answer is $34$. I hope it is correct.",
        ),
        ("fraction", r"$\frac{3}{4}$", r"Final Answer: The final answer is $\frac{3}{4}$. I hope it is correct."),
        ("wrong", r"$34$", "Final Answer: The final answer is $35$. I hope it is correct."),
        (
            "trailing-text",
            r"$(0, 1)$",
            "Final Answer: The final answer is $(0, 1)$. I hope it is correct. <|im_start|>user",
        ),
        (
            "after-box",
            r"$5866608$",
            r"So $\boxed{5866608}$. Final Answer: The final answer is 5866608. I hope it is correct.",
        ),
        ("percent", r"$20\%$", r"So $\boxed{20\%}$. Final Answer: The final answer is $20\%$. I hope it is correct."),
        ("overrides-box", r"$6$", r"So \boxed{5}. Final Answer: The final answer is $6$. I hope it is correct."),
        ("sentence-thousands", r"$12000023$", "Final Answer: The final answer is 12,000,023. I hope it is correct."),
        ("sentence-chain-thousands", r"$\{5, 1000\}$", "The final answer is $5$ and $1,000$. I hope it is correct."),
        ("no-hope", r"$34$", "The final answer is $34$."),
        # Without "final", as GSM8K-style prompts ask ("end with 'The answer is N'"): read as math-verify reads it.
        ("the-answer-is", "#### 18", "Janet makes 9 * 2 = 18 dollars.\nTherefore, the answer is $18$."),
        ("the-answer-is-wrong", "#### 18", "Therefore, the answer is $19$."),
        ("answer-is-colon", "#### 18", "So the answer is: 18"),
        ("answer-is-count", "#### 18", "The answer is 18 dollars."),
        # Markdown emphasis around the answer or the whole line: math-verify's patterns read the number inside.
        ("answer-is-bold", "#### 72", "Natalia sold 48 + 24 = 72 clips.\nThe answer is **72**."),
        ("answer-is-bold-line", "#### 72", "**The answer is 72.**"),
        ("answer-is-bold-math", "#### 72", "The final answer is **$72$**."),
        ("answer-is-bold-count", "#### 72", "The answer is **72 clips**."),
        ("answer-is-underscored", "#### 72", "The answer is __72__."),  # no answer to math-verify either
        ("answer-is-bold-wrong", "#### 72", "The answer is **71**."),
        ("gsm8k-line-bold", "#### 72", "48 + 24 = 72\n#### **72**"),
        ("answer-line-percent", "0.5", "Answer: 50 percent"),  # the percent kept, as on a "final answer is" line
        ("answer-line-slash-count", "0.5", "Answer: 1/2 cup"),  # a slash fraction's count too (it scored -1)
        ("answer-is-slash-count", "3/4", "The answer is 3/4 of the pizza."),
        ("answer-is-slash-count-wrong", "3/4", "The answer is 2/3 of the pizza."),
        # LaTeX's \% outside $...$: the number without its percent, as math-verify reads it (it was no answer)
        ("answer-is-escaped-percent", r"$25\%$", r"The answer is 25\%."),
        ("answer-is-escaped-percent-wrong", r"$25\%$", r"The answer is 26\%."),
        ("answer-is-escaped-percent-of-a-fraction", "0.25", r"The answer is 25\%."),  # 25, not 0.25: wrong
        ("answer-is-spaced-escaped-percent", r"$25\%$", r"The answer is 25 \%."),
        ("answer-line-spaced-escaped-percent-of-a-fraction", "0.25", r"Answer: 25 \%"),
        # The MATH sentence takes no \% before "I hope": the box is the answer, as math-verify reads it.
        ("hope-escaped-percent-after-box", "25", "So \\boxed{30}.\nThe final answer is 25\\%. I hope it is correct."),
    ],
    "mathrm e": [
        ("e-alone", r"$\mathrm{e}$", r"\boxed{e}"),
        ("one-minus-inverse", r"$1 - \frac{1}{\mathrm{e}}$", r"\boxed{1 - \frac{1}{\mathrm{e}}}"),
        ("one-minus-inverse-wrong-sign", r"$1 - \frac{1}{\mathrm{e}}$", r"\boxed{1 + \frac{1}{\mathrm{e}}}"),
        ("one-minus-inverse-plain-e", r"$1 - \frac{1}{\mathrm{e}}$", r"\boxed{1 - \frac{1}{e}}"),
        ("gold-upright-square", r"$\mathrm{e}^{2}$", r"\boxed{e^2}"),
        ("pred-upright-square", r"$e^{2}$", r"\boxed{\mathrm{e}^{2}}"),
        ("both-upright", r"$\mathrm{e}^{2}$", r"\boxed{\mathrm{e}^{2}}"),
        ("both-upright-wrong", r"$\mathrm{e}^{2}$", r"\boxed{\mathrm{e}^{3}}"),
    ],
    "plain numbers": [
        ("decimal-comma", "0,111", r"\boxed{0.111}"),
        ("decimal-comma-not-thousands", "0,111", r"\boxed{111}"),
        ("twelfth-rounded", r"$\frac{1}{12}$", r"\boxed{0.0833333333333333}"),
        ("third-too-short", r"$\frac{1}{3}$", r"\boxed{0.333}"),
        ("third-rounded", r"$\frac{1}{3}$", r"\boxed{0.3333333}"),
        ("thousands", "7425000", r"\boxed{7,425,000}"),
        ("thousands-decimals", "1000.99", r"\boxed{1,000.99}"),
        ("thousands-latex", "#### 1234", r"The answer is \boxed{1{,}234}."),
        ("thin-space", "1234567", r"\boxed{1\,234\,567}"),
        ("not-thousands", "#### 46", r"\boxed{4,6}"),
        ("integer-as-decimal", "#### 72", r"\boxed{72.0}"),
        ("integer-nearly", "#### 72", r"\boxed{72.0000001}"),
        ("integer-off-by-one", "#### 72", r"\boxed{73}"),
        ("leading-point", "0.4", r"\boxed{.4}"),
        ("negative-fraction", "-10/9", r"\boxed{-\frac{10}{9}}"),
        ("currency", "18.90", r"\boxed{\$18.90}"),
        ("percent-as-integer", r"$28\%$", r"\boxed{28}"),
        ("percent-as-decimal", r"$28\%$", r"\boxed{0.28}"),
        ("tuple-with-decimal", r"$(1,\frac{9}{2})$", r"\boxed{(1,4.5)}"),
    ],
    "one box": [
        ("interval", r"$[0,1)$", r"\boxed{[0,1)}"),
        ("interval-closed", r"$(0,9)$", r"\boxed{[0,9)}"),
        ("sqrt-shorthand", r"$\sqrt{3}$", r"\boxed{\sqrt3}"),
        ("cfrac", r"$1/3$", r"\boxed{\cfrac{1}{3}}"),
        ("math-solution", r"Thus $x-p=\boxed{2-2p}$.", r"So the difference is $\boxed{2 - 2p}$."),
        ("display-box", r"$[-4,0]$", r"The values of $k$ are: \[ \boxed{[-4, 0]} \]"),
        ("inequality-as-interval", r"$-2 \le x \le 7$", r"\boxed{x \in [-2,7]}"),
        ("units", r"$0.06 \text{ yuan}$", r"\boxed{0.06 \text{ yuan}}"),
        ("truncated", r"$5$", r"So \boxed{5}. Checking once more: \boxed{\frac{10}{2"),
        # A box left open before a complete one (the model began again): passed over, as math-verify passes it over.
        ("open-box-then-box", r"$4$", r"First \boxed{3, no. Counting again, the answer is \boxed{4}"),
        ("open-box-around-box", r"$\frac{3}{4}$", r"\boxed{\frac{3}{4} let me write it again: \boxed{\frac{3}{4}}"),
        ("open-box-then-wrong-box", r"$3$", r"First \boxed{3, no. Counting again, the answer is \boxed{4}"),
        # An empty box is no box to math-verify (its patterns need a character inside): the answer line is read.
        ("empty-box-then-answer-line", "72", "I'll put the result in \\boxed{}.\nThe answer is 72."),
        ("blank-box-then-answer-line", "72", "\\boxed{ }\nAnswer: 72"),
        # An empty box after the answer is its last box: no answer, to math-verify as here.
        ("empty-box-after-the-answer", "72", r"\boxed{72}, then \boxed{}"),
        ("empty-box-a-line-after-the-answer", "72", "The total is \\boxed{72}.\nWrite the answer in \\boxed{}."),
    ],
    # Without a box or an answer phrase ending the completion there is no answer: math-verify falls back to the last
    # number or formula anywhere in the text, which a policy learns to game.
    "unmarked answers": [
        ("last-number", "#### 72", "So Natalia sold 72 clips in total."),
        ("answer-not-on-final-line", "3", "Answer: 3\nbecause 1 + 2 = 3"),
        ("last-formula", r"$\frac{1}{2}$", r"We find that $x = \frac{1}{2}$ solves it."),
        ("answer-mid-sentence", "#### 42", "The answer is 42 apples, as computed above."),
        ("box-then-unboxed-revision", "5", "\\boxed{4}\nWait, actually it is 5."),
        ("nothing", "5", "I could not solve it."),
    ],
}

# Cases where the reward is deliberately stricter than math-verify (it says wrong, math-verify right).
STRICTER = {
    "last-number": "no answer marker: math-verify takes the last number of the text",
    "answer-not-on-final-line": "an 'Answer:' line followed by more text is no answer",
    "last-formula": "no answer marker: math-verify takes the last formula of the text",
    "answer-mid-sentence": "an answer phrase counts only when the answer ends the completion",
}
# Cases where the reward says right and math-verify says wrong: math-verify reads \mathrm{e} as a symbol named e,
# not as Euler's number (and, in a fraction, loses it to unit stripping); the reward normalises it to e.
MATH_VERIFY_MISREADS = {
    "one-minus-inverse-plain-e": "math-verify's unit stripping eats the '\\mathrm{e}}' ending the gold, which it then "
    "reads as 1",
    "gold-upright-square": "\\mathrm{e}^{2} is e^2; math-verify reads a symbol e squared",
    "pred-upright-square": "\\mathrm{e}^{2} is e^2; math-verify reads a symbol e squared",
}

ALL_CASES = [(category, *case) for category, cases in CASES.items() for case in cases]


@pytest.fixture(scope="module")
def verdicts() -> dict[str, tuple[float | None, bool]]:
    """``{case id: (our reward, math-verify's verdict)}``, ours from one batch through real worker processes."""
    reward = make_math_reward(name="reward_vs_math_verify")
    ours = reward(completions=[c[3] for c in ALL_CASES], answer=[c[2] for c in ALL_CASES])
    return {c[1]: (r, mv_verdict(c[2], c[3])) for c, r in zip(ALL_CASES, ours, strict=True)}


def test_case_ids_are_unique_and_every_category_has_several():
    ids = [c[1] for c in ALL_CASES]
    assert len(ids) == len(set(ids))
    assert all(len(cases) >= 5 for cases in CASES.values())
    assert set(STRICTER) | set(MATH_VERIFY_MISREADS) <= set(ids)


@pytest.mark.parametrize(("category", "case_id", "gold", "completion"), ALL_CASES, ids=[c[1] for c in ALL_CASES])
def test_agrees_with_math_verify(verdicts, category, case_id, gold, completion):
    ours, theirs = verdicts[case_id]
    assert ours is not None, f"{case_id}: the gold {gold!r} should parse"
    if case_id in STRICTER:
        # Listed disagreements must still disagree, or the list would hide a change.
        assert ours == -1.0 and theirs, STRICTER[case_id]
    elif case_id in MATH_VERIFY_MISREADS:
        assert ours == 1.0 and not theirs, MATH_VERIFY_MISREADS[case_id]
    else:
        assert (ours == 1.0) == theirs, f"{category}: ours {ours:+g}, math-verify {theirs}"


def test_never_rewards_what_math_verify_rejects(verdicts):
    false_positives = {case_id for case_id, (ours, theirs) in verdicts.items() if ours == 1.0 and not theirs}
    assert false_positives <= set(MATH_VERIFY_MISREADS)
    # A partial answer to a gold holding several boxes is never rewarded.
    for case_id in ("primes-one-of-four", "primes-three-of-four", "roots-one-of-two", "pair-second-only"):
        assert verdicts[case_id] == (-1.0, False)


# ---------------------------------------------------------------------------------------------------------------------
# Randomised layouts: what the reward extracts equals what math-verify reads from the whole completion
# ---------------------------------------------------------------------------------------------------------------------

ATOMS = ["1", "2", "-3", r"\frac{1}{2}", "(1, 2)", "7", r"\sqrt{2}", "5", "5"]
SEPARATORS = [
    ", ",
    ",",
    " and ",
    " or ",
    " ",
    "; ",
    r" \quad \text{and} \quad ",
    " no no no no no ",
    "\n\n",
    ". Also ",
    r"\text{ for part (a) and } ",
    " for the second part we get ",
    " hence the answer for the other case, after a long computation, is ",
]
WRAPPERS = [("", ""), ("$", "$"), ("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]"), ("$x = ", "$"), ("\\[\n", "\n\\]")]


def random_layout(rng: random.Random) -> str:
    """Up to four groups of boxes, each bare or in a math environment, joined by separators of every kind."""
    groups = []
    for _ in range(rng.randint(1, 4)):
        left, right = rng.choice(WRAPPERS)
        boxes = [rf"\boxed{{{rng.choice(ATOMS)}}}" for _ in range(rng.randint(1, 3))]
        groups.append(left + boxes[0] + "".join(rng.choice(SEPARATORS) + box for box in boxes[1:]) + right)
    prefix = rng.choice(["", "We compute. ", "So we get "])
    return prefix + rng.choice(SEPARATORS).join(groups) + rng.choice(["", ".", r" \text{cm}", " Done."])


def test_box_layouts_read_as_math_verify_reads_them():
    rng = random.Random(20250101)
    mismatches = []
    for _ in range(150):
        completion = random_layout(rng)
        answer = extract_predicted_answer(completion)
        ours = mv_parse("\\boxed{" + answer + "}", LATEX_ONLY) if answer is not None else []
        theirs = mv_parse(completion)
        same = (not ours and not theirs) or (
            bool(ours and theirs)
            and math_verify.verify(ours, theirs, timeout_seconds=None)
            and math_verify.verify(theirs, ours, timeout_seconds=None)
        )
        if not same:
            mismatches.append((completion, answer, theirs[:1]))
    assert not mismatches, mismatches[:5]


# ---------------------------------------------------------------------------------------------------------------------
# The fast path: every verdict it gives is math-verify's
# ---------------------------------------------------------------------------------------------------------------------


def random_number(rng: random.Random) -> str:
    """A plain number in one of the spellings data sets and completions use."""
    n = rng.choice([rng.randint(0, 20), rng.randint(0, 10**6), rng.randint(0, 10**12)])
    return rng.choice(
        [
            str(n),
            f"{n:,}",
            f"-{n}",
            f"{n}.0",
            f"{n}.{rng.randint(0, 999):0{rng.randint(1, 3)}d}",
            f"{rng.random() * rng.choice([1, 100, 1e5]):.{rng.randint(1, 16)}f}",
            rf"\frac{{{rng.randint(-20, 99)}}}{{{rng.randint(1, 40)}}}",
            f"{rng.randint(0, 50)}/{rng.randint(1, 50)}",
            "." + str(rng.randint(0, 9999)),
        ]
    )


def nearby_number(rng: random.Random, text: str) -> str:
    """Another spelling of the same value, or a value close to it, or at least 0.001 away."""
    value = parse_plain_number(text)
    if value is None or rng.random() < 0.2:
        return random_number(rng)
    return rng.choice(
        [
            text,
            f"{float(value):.{rng.randint(0, 8)}f}",
            str(value.numerator) if value.denominator == 1 else rf"\frac{{{value.numerator}}}{{{value.denominator}}}",
            f"{float(value) + rng.choice([1e-7, 1e-5, 1e-3, 0.5, 1]):.9f}",
            f"{float(value):.15g}",
            f"{int(value):,}" if value >= 1000 else repr(float(value)),
        ]
    )


def test_fast_path_verdicts_are_math_verifys():
    rng = random.Random(7)
    decided = 0
    for _ in range(400):
        gold = random_number(rng)
        pred = nearby_number(rng, gold)
        verdict = fast_verdict(gold, pred)
        if verdict is None:
            continue
        decided += 1
        theirs = math_verify.verify(
            mv_parse("\\boxed{" + gold + "}"), mv_parse("\\boxed{" + pred + "}"), timeout_seconds=None
        )
        assert verdict == theirs, (gold, pred)
    assert decided > 250  # the fast path still decides most plain-number pairs


@pytest.mark.parametrize(
    ("gold", "pred"),
    [("0,111", "111"), ("1234567", r"1\,234\,567"), (r"\frac{1}{12}", "0.0833333333333333"), ("72", "72.0000001")],
)
def test_fast_path_leaves_what_it_cannot_vouch_for(gold, pred):
    assert fast_verdict(gold, pred) is None
