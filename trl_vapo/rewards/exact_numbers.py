"""The exact-number fast path: a gold/predicted pair of plain numbers decided in-process, with ``fractions.Fraction``
arithmetic, wherever the verdict provably equals math-verify's on the same two answers; everything else goes to the
worker pool (:mod:`.pool`)."""

from __future__ import annotations

import re
from fractions import Fraction

from .answers import _bounded_answer

# The fast path decides a pair in-process only where its verdict provably equals math-verify's on the same two
# answers (each parsed from ``\boxed{answer}``). ASCII digits only: other Unicode digits (``٧٢``, ``７２``) go to
# math-verify, which treats them as text. What math-verify reads as an exact number (sympy Integer / Rational):
# integers (``+5``, leading zeros), thousands separated by commas in groups of three after a non-zero leading digit
# (``1,234``: its parser reads ``0,111`` as 0.111 and ``4,6`` as the set {4, 6}), the same with ``{,}``, a leading
# ``\$``, and fractions of integers (``3/4``, ``\frac{3}{4}``, ``\frac12``). A thin space is no separator to it
# (``1\,234`` is not 1234), so such answers are left to it. Decimals are sympy Floats, compared after rounding to
# six places: see fast_verdict.
_NUMBER_RE = re.compile(
    r"(?P<int>[+-]?\d+|-?[1-9]\d{0,2}(?:,\d{3})+)(?P<decimals>\.\d+)?|(?P<leading_point>\.\d+)", re.ASCII
)
_FRACTION_RE = re.compile(
    r"(?P<sign>-?)(?:\\[dtc]?frac\{(?P<num>-?\d+)\}\{(?P<den>\d+)\}|\\[dtc]?frac(?P<num1>\d)(?P<den1>\d))"
    r"|(?P<num2>-?\d+)/(?P<den2>\d+)",
    re.ASCII,
)
# ``1{,}234``: LaTeX's spelling of a thousands separator, which math-verify turns into a comma.
_LATEX_SEPARATOR_RE = re.compile(r"(?<=\d)\{,\}(?=\d{3})")
# math-verify parses a decimal into a Float of 15 significant digits; within these bounds its rounding to six places
# cannot merge values 1e-3 apart, nor split equal ones.
_FAST_DECIMAL_DIGITS = 15
_FAST_DECIMAL_MAGNITUDE = 10**9
_FAST_DECIMAL_GAP = Fraction(1, 1000)


def _plain_number(text: str) -> tuple[Fraction, bool] | None:
    """``(exact value, written with a decimal point)`` of a plain number (:func:`parse_plain_number`), else
    ``None``."""
    text = _bounded_answer(text)
    if text is None:
        return None
    text = _LATEX_SEPARATOR_RE.sub(",", text)
    if text.startswith("\\$"):  # currency: ``\$18.90``; math-verify drops the sign
        text = text[2:].lstrip()
    match = _NUMBER_RE.fullmatch(text)
    if match is not None:
        digits = text.replace(",", "")
        if match.group("int") is not None and match.group("decimals") is None:
            return Fraction(int(digits)), False  # int() first: Fraction's string parser is several times slower
        return Fraction(digits), True
    match = _FRACTION_RE.fullmatch(text)
    if match is None:
        return None
    numerator = int(match.group("num") or match.group("num1") or match.group("num2"))
    denominator = int(match.group("den") or match.group("den1") or match.group("den2"))
    if denominator == 0:
        return None
    value = Fraction(numerator, denominator)
    return (-value if match.group("sign") == "-" else value), False


def parse_plain_number(text: str) -> Fraction | None:
    """Exact value of a plain number, or ``None`` when ``text`` is anything else.

    Plain numbers are those math-verify reads as exactly this number: integers and decimals with an optional sign
    (``72``, ``+5``, ``-3``, ``46.0``, ``.5``), thousands separators in groups of three after a non-zero digit
    (``1,234``, ``1{,}234``; ``4,6``, ``1,2345`` and ``0,111`` are not, nor is the thin space of ``1\\,234``), a
    leading ``\\$``, and fractions of integers (``3/4``, ``\\frac{3}{4}``, ``-\\dfrac{3}{4}``, ``\\frac12``). A
    fraction with a zero denominator is not a number. Only ASCII digits count.
    """
    number = _plain_number(text)
    return None if number is None else number[0]


def _significant_digits(text: str) -> int:
    return len(re.sub(r"\D", "", text).lstrip("0"))


def fast_verdict(gold_answer: str, predicted_answer: str) -> bool | None:
    """math-verify's verdict on two plain numbers (:func:`parse_plain_number`) without math-verify, else ``None``.

    Without a decimal point on either side the comparison is exact, as in math-verify: ``1,234`` equals ``1234``,
    ``\\frac{2}{4}`` equals ``\\frac{1}{2}``. math-verify compares a decimal after
    rounding both sides to six places, so ``0.0833333333333333`` equals ``\\frac{1}{12}`` but ``0.333`` is not
    ``\\frac{1}{3}``. Where a decimal is involved the fast path only decides what that rounding cannot change: equal
    values (``46`` and ``46.0``, ``0.5`` and ``\\frac{1}{2}``) and values at least 0.001 apart, for numbers below
    1e9 of at most 15 significant digits. Anything closer is left to math-verify (``None``).
    """
    gold = _plain_number(gold_answer)
    if gold is None:
        return None
    pred = _plain_number(predicted_answer)
    if pred is None:
        return None
    (gold_value, gold_decimal), (pred_value, pred_decimal) = gold, pred
    if not (gold_decimal or pred_decimal):
        return gold_value == pred_value
    if (
        max(abs(gold_value), abs(pred_value)) >= _FAST_DECIMAL_MAGNITUDE
        or max(_significant_digits(gold_answer), _significant_digits(predicted_answer)) > _FAST_DECIMAL_DIGITS
    ):
        return None
    if gold_value == pred_value:
        return True
    if abs(gold_value - pred_value) >= _FAST_DECIMAL_GAP:
        return False
    return None
