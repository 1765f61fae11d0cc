"""Answer extraction: the gold answer of a dataset row (:func:`normalize_gold_answer`) and the predicted answer of a
completion (:func:`extract_predicted_answer`), each read as math-verify reads it: the boxes, the MATH few-shot
sentence, a final ``#### x``, ``... (final) answer is x`` or ``Answer: x`` line. Pure text: no math-verify, no
processes (what is done with the two answers is :mod:`.exact_numbers`' and :mod:`.pool`'s)."""

from __future__ import annotations

import bisect
import math
import numbers
import re
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

MAX_ANSWER_CHARS = 300
"""Longest answer, in characters, that counts as an answer at all.

Gold answers of MATH, GSM8K, DeepScaleR and DAPO-Math are far shorter (matrices and long polynomials stay under ~150).
A longer extracted prediction is scored incorrect without being parsed: it is either a policy stuffing the box with
candidates or text that would only cost the verifier time. A longer gold answer is treated as unparseable (``None``).
"""

_BOX_OPEN_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Escaped characters (``\{``, ``\}``, ``\\``) are skipped as a unit so that set braces never count as grouping.
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)
# Markdown emphasis may wrap the label or the answer: ``**Answer:** 72``, ``**Final answer**: $72$``,
# ``Answer: **7**``.
_ANSWER_LINE_RE = re.compile(
    r"^\s*(?:\*\*|__)?\s*(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*(?:\*\*|__)?\s*[:：]\s*(?:\*\*|__)?"
    r"(?P<answer>.*?)(?:\*\*|__)?\s*$",
    re.IGNORECASE,
)
_GSM8K_LINE_RE = re.compile(r"^\s*####\s*(?P<answer>.*?)\s*$")
# Raw text longer than this cannot hold an answer of MAX_ANSWER_CHARS plus delimiters and markup; checked before any
# super-linear work.
_MAX_RAW_CHARS = 2 * MAX_ANSWER_CHARS

# Which boxes form one answer, as math-verify decides it (``extract_boxed_content`` of latex2sympy2_extended, the
# "last" mode its parser uses for a ``\boxed{...}`` match): walking left from the last box, an earlier box belongs to
# the answer when fewer than 10 characters separate the two, or fewer than 70 that include a separator while the two
# contents differ. ``\boxed{1},\boxed{2},\boxed{3}`` is the set {1, 2, 3}; ``\boxed{1} no no no no no \boxed{2}`` is 2.
_BOX_NEAR_CHARS = 10
_BOX_SEPARATED_CHARS = 70
_BOX_SEPARATOR_RE = re.compile(r"\b(?:and|or)\b|,|;")
# math-verify also reads every box of the math environment holding the last box (its "all" mode), and environments
# chained like ``\(\boxed{1}\) and \(\boxed{-2}\)`` as one answer: a first environment and at most five more.
_ENV_CHAIN_SEPARATOR = r"\s*(?:,?and|,?or|,)\s*"
_ENV_CHAIN_BEFORE_RE = re.compile(_ENV_CHAIN_SEPARATOR + r"\Z")
_ENV_CHAIN_SEPARATOR_RE = re.compile(_ENV_CHAIN_SEPARATOR)
_MAX_CHAINED_ENVS = 6
# Longer chains than this are candidate lists, not answers: scanning them further would only cost time.
_MAX_CHAIN_SCAN = 2 * _MAX_CHAINED_ENVS
_DISPLAY_DOLLAR_RE = re.compile(r"(?<!\\)\$\$")
# Consecutive $...$ segments holding boxes are a candidate list, not an answer; looking further back only costs time.
_MAX_DOLLAR_RUN = 2 * _MAX_CHAINED_ENVS
# One math environment at the start of a string, with math-verify's content rules (inline ones stay on one line).
_ENV_RES = (
    re.compile(r"\$\$(?P<content>(?:[^$]|\$(?!\$))+?)(?<!\\)\$\$"),
    re.compile(r"\\\[(?P<content>(?:[^\\]|\\(?!\]))+?)(?<!\\)\\\]"),
    re.compile(r"(?<![\\\d])\$(?P<content>(?:\\[$]|[^\n$])+?)(?<!\\)\$"),
    re.compile(r"\\\((?P<content>(?:[^\\\n]|\\(?!\)))+?)(?<!\\)\\\)"),
)
# A bare number as math-verify's expression extractor reads it after an answer phrase: thousands separated by commas
# or spaces (only after a non-zero digit), a decimal point or comma, a currency sign before, a percent sign after.
_CURRENCY = re.escape("$€£¥₹₽₪₩₫฿₡₢₣₤₥₦₧₨₩₪₫₭₮₯₰₱₲₳₴₵₶₷₸₹₺₻₼₽₾₿")
_MV_NUMBER_RE = re.compile(
    rf"(?:\*\*)?[{_CURRENCY}]?(?:(?P<int1>-?[1-9]\d{{0,2}}(?:[ ,]\d{{3}})+)(?P<dec1>\.\d+)?|(?P<int2>-?\d+)"
    r"(?P<dec2>[.,]\d+)|(?P<dec3>\.\d+)|(?P<int3>-?\d+))(?P<percent>\s*(?:%|[Pp]ercent|\s*[Pp]ercentage|\s*[Pp]ct))?"
    # LaTeX's ``\%`` after a bare number: math-verify's expression extractor reads the number, without its percent
    r"(?:\s*\\%)?",
    re.ASCII,
)
_MV_FRACTION_RE = re.compile(r"-?\\frac\{-?\d+(?:[.,]\d+)?\}\{-?\d+(?:[.,]\d+)?\}")
_SLASH_FRACTION_RE = re.compile(r"-?\d+\s*/\s*\d+")
# A number and the words naming what it counts, on an answer line: ``72 clips``, ``18 dollars``, ``12 sq. ft``.
_NUMBER_AND_WORDS_RE = re.compile(r"(?P<number>\S+)(?P<words>(?:\s+[A-Za-z]{2,}\.?){1,3})")
# Words that are part of the number, not what it counts: ``2 pi``, ``3 squared``, ``2 million``, ``50 percent`` (left
# whole: the number alone would be another number).
_MATH_WORDS = {"pi", "sqrt", "and", "or", "times", "over", "plus", "minus", "squared", "cubed", "factorial"}
_MATH_WORDS |= {"percent", "percentage", "pct", "hundred", "thousand", "million", "billion", "trillion", "dozen"}
# The MATH few-shot format ends with ``Final Answer: The final answer is $X$. I hope it is correct.``; math-verify
# takes the last such sentence wherever it stands, and it competes with boxes by position (the later one wins).
_HOPE_PREFIX_RE = re.compile(r"(?i:final answer is):?\s*")
_MAX_HOPES = 20
# ``The final answer is $34$.`` on the final line (math-verify's "final answer ... is" pattern), also as ``Final
# Answer: The volume is 120. I hope it is correct.`` where the sentence lacks "final answer is", and without "final"
# (``Therefore, the answer is $18$.``, ``So the answer is: 18``: what a GSM8K-style prompt asks for).
_FINAL_ANSWER_IS_RE = re.compile(
    r"(?i:(?:final )?answer).{0,100}?\s+is:?\s*(?P<answer>.+?)\.?(?:\s?I hope it is correct\.?)?\s*$"
)
# ISO style writes Euler's number upright. math-verify reads ``\mathrm{e}`` as a symbol named e, not as e (so
# ``\mathrm{e}^2`` differs from ``e^2``), and its unit stripping eats the ``\mathrm{e}}`` ending
# ``\frac{1}{\mathrm{e}}``.
_MATHRM_E_RE = re.compile(r"\\mathrm\s*\{\s*e\s*\}|\{\\rm\s+e\s*\}")


def _matching_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` closing the group whose ``{`` sits just before ``start``; ``None`` when it never closes."""
    depth = 1
    for match in _BRACE_TOKEN_RE.finditer(text, start):
        token = match.group()
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if depth == 0:
                return match.start()
    return None


def _box_spans(text: str) -> tuple[list[tuple[int, int, int]], bool]:
    """The complete top-level boxes of ``text`` as ``(start, content start, index of the closing brace)``, and whether
    a box opened after the last of them never closes (a truncated completion).

    A box that never closes before a complete one (``\\boxed{3 ... the answer is \\boxed{4}``: a model that opened
    a box and began again) is passed over, as math-verify passes over it: the boxes inside it count. One pass over
    the braces, whatever the number of boxes left open."""
    openers = {match.end() - 1: match for match in _BOX_OPEN_RE.finditer(text)}  # each box's opening brace
    if not openers:
        return [], False
    open_braces, complete = [], []
    for token in _BRACE_TOKEN_RE.finditer(text, next(iter(openers))):
        if token.group() == "{":
            open_braces.append(token.start())
        elif token.group() == "}" and open_braces:
            box = openers.get(open_braces.pop())
            if box is not None:
                complete.append((box.start(), box.end(), token.start()))
    spans = []
    for span in sorted(complete):  # a box inside a complete one belongs to it
        if not spans or span[0] > spans[-1][2]:
            spans.append(span)
    last_end = spans[-1][2] if spans else -1
    return spans, any(brace > last_end for brace in open_braces if brace in openers)


def find_last_boxed(text: str) -> str | None:
    """Content of the last complete top-level ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}`` and a box nested inside another belongs to
    the outer one. Escaped braces (``\\{1,2\\}``) do not count. When the last box is unterminated (a truncated
    completion) the result is ``None``: the answer the model was writing is unknown, and falling back to an earlier
    box would reward an answer it went on to revise. (:func:`extract_predicted_answer` also reads the boxes written
    next to the last one; this reads the last box only.)
    """
    spans, truncated = _box_spans(text)
    if truncated or not spans:
        return None
    _, content_start, end = spans[-1]
    return text[content_start:end]


def _join_contents(contents: Sequence[str], separator: str = ",") -> str | None:
    """Box contents joined into one answer as math-verify joins them (``1,2,3``), dropping a content that repeats the
    one before it; ``None`` when the answer would exceed :data:`_MAX_RAW_CHARS` (a list of candidates).

    The boxes of one math environment are joined by a bare ``,``, as math-verify joins them (``$$\\boxed{2},
    \\boxed{128}$$`` is 2128 to it too); a chain of environments (``$6$ and $120$``) by ``, ``
    (:data:`ENVIRONMENTS_SEPARATOR`), since math-verify reads each environment apart, as the set {6, 120}: ``6,120``
    read as one thousands number, 6120 (the right set scored wrong, 6120 right)."""
    kept: list[str] = []
    size = 0
    for content in contents:
        if kept and content == kept[-1]:
            continue
        kept.append(content)
        size += len(content) + len(separator)
        if size > _MAX_RAW_CHARS:
            return None
    return separator.join(kept)


ENVIRONMENTS_SEPARATOR = ", "  # a space after the comma: no number reads ``6, 120`` as 6120 (math-verify's neither)
# latex2sympy's `comma_number_regex`, by which math-verify reads an environment's `1,000` (and `0,500`) as a number
_THOUSANDS_NUMBER_RE = re.compile(r"\s*-?\d{1,3}(?:,\d{3})+(?:\.\d+)?\s*")


def _comma_number(content: str) -> str:
    """``content`` as latex2sympy's `convert_number` reads a number with commas in it, alone in an environment: its
    thousands separators dropped (``1,000``: 1000), or a decimal comma after a leading 0 (``0,500``: 0.5); anything
    else as it is."""
    if not _THOUSANDS_NUMBER_RE.fullmatch(content):
        return content
    return (content.replace(",", ".") if content.startswith("0") else content).replace(",", "").replace(" ", "")


def _join_environments(contents: Sequence[str]) -> str | None:
    """The answers of chained math environments (``$5$ and $1,000$``) joined as :func:`_join_contents` joins them,
    by ``, ``: math-verify reads each environment apart, a number with commas in it as one number (the set
    {5, 1000}; `_comma_number`); joined as it was written, ``5, 1,000`` read as the set {5, 1, 0}."""
    return _join_contents([_comma_number(c) for c in contents], ENVIRONMENTS_SEPARATOR)


def _walk_boxes(text: str, spans: Sequence[tuple[int, int, int]]) -> list[str]:
    """Contents (stripped, in text order) of the boxes math-verify's "last" mode joins with the last box."""
    contents: list[str] = []
    size, later_start = 0, len(text)
    for start, content_start, end in reversed(spans):
        content = text[content_start:end].strip()
        if contents:
            between = text[end + 1 : later_start]
            near = len(between) < _BOX_NEAR_CHARS
            separated = (
                len(between) < _BOX_SEPARATED_CHARS and content != contents[-1] and _BOX_SEPARATOR_RE.search(between)
            )
            if not (near or separated):
                break
        if not contents or content != contents[-1]:
            contents.append(content)
            size += len(content) + 1
            if size > _MAX_RAW_CHARS:
                break  # already too long to be an answer, as _join_contents will find
        later_start = start
    return contents[::-1]


def _not_escaped(text: str, index: int) -> bool:
    return index == 0 or text[index - 1] != "\\"


def _single_dollar(text: str, start: int, end: int, forward: bool) -> int:
    """Index of the first (``forward``) or last single ``$`` of ``text[start:end]`` (not escaped, not half of ``$$``),
    or -1."""
    while True:
        index = text.find("$", start, end) if forward else text.rfind("$", start, end)
        if index < 0:
            return -1
        if (index == 0 or text[index - 1] not in "\\$") and text[index + 1 : index + 2] != "$":
            return index
        if forward:
            start = index + 1
        else:
            end = index


def _enclosing_env(text: str, start: int, end: int) -> tuple[int, int] | None:
    """``(start, end)`` of the math environment around ``text[start:end]``, or ``None``.

    Environments are math-verify's: ``$$...$$`` and ``\\[...\\]`` (may span lines), ``$...$`` (one line, not opened
    right after a digit) and ``\\(...\\)`` (one line). Where several enclose the span, the one opening first wins, as
    in math-verify's left-to-right scan. Linear scans only: completions are untrusted and may be long.
    """
    candidates = []
    # $$...$$: inside when an odd number of unescaped $$ precede the span (math-verify pairs them first).
    if (text.count("$$", 0, start) - text.count("\\$$", 0, start)) % 2 == 1:
        opening = text.rfind("$$", 0, start)
        close = _DISPLAY_DOLLAR_RE.search(text, end)
        if close is not None:
            candidates.append((opening, close.end()))
    for left, right, one_line in (("\\[", "\\]", False), ("\\(", "\\)", True)):
        opening = text.rfind(left, 0, start)
        while opening >= 0 and not _not_escaped(text, opening):  # a line break's ``\\[4pt]`` is no opening
            opening = text.rfind(left, 0, opening)
        if opening < 0 or text.find(right, opening, start) >= 0:
            continue
        close = text.find(right, end)
        while close >= 0 and not _not_escaped(text, close):
            close = text.find(right, close + 1)
        if close >= 0 and not (one_line and "\n" in text[opening:close]):
            candidates.append((opening, close + len(right)))
    # $...$ on one line: math-verify tries each single $ in turn as an opening one. A segment between two $ is an
    # environment when it holds a box, its opening $ does not follow a digit, and the segment before it is not one
    # (whose closing $ it would reuse): in a run of such segments every other one is an environment.
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end)
    line_end = len(text) if line_end < 0 else line_end
    closing = _single_dollar(text, end, line_end, forward=True)
    opening = _single_dollar(text, line_start, start, forward=False)
    if closing >= 0 and opening >= 0:
        run, segment_end, segment_start = 0, closing, opening
        while segment_start >= 0 and run <= _MAX_DOLLAR_RUN:
            holds_box = _BOX_OPEN_RE.search(text, segment_start, segment_end) is not None
            if not holds_box or (segment_start > 0 and text[segment_start - 1].isdigit()):
                break
            run += 1
            segment_end, segment_start = segment_start, _single_dollar(text, line_start, segment_start, forward=False)
        if run % 2 == 1 and run <= _MAX_DOLLAR_RUN:
            candidates.append((opening, closing + 1))
    return min(candidates) if candidates else None


def _env_chain(text: str, env: tuple[int, int], spans: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]] | None:
    """The environments math-verify reads as one answer with ``env``: those before it joined by ``,`` / ``and`` /
    ``or``, each holding a box, grouped from the left in sixes as its pattern does; ``None`` for an overlong chain."""
    chain = [env]
    ends = [end for _, _, end in spans]
    while len(chain) <= _MAX_CHAIN_SCAN:
        separator = _ENV_CHAIN_BEFORE_RE.search(text, max(0, chain[0][0] - 40), chain[0][0])
        if separator is None:
            break
        index = bisect.bisect_left(ends, separator.start()) - 1
        if index < 0:
            break
        start, _, end = spans[index]
        previous = _enclosing_env(text, start, end + 1)
        if previous is None or previous[1] != separator.start():
            break
        chain.insert(0, previous)
    if len(chain) > _MAX_CHAIN_SCAN:
        return None
    keep = (len(chain) - 1) % _MAX_CHAINED_ENVS + 1
    return chain[-keep:]


def _boxed_answer(text: str, spans: Sequence[tuple[int, int, int]]) -> tuple[str | None, int]:
    """The answer math-verify reads from the boxes of ``text``, and where that reading ends.

    A math environment around the last box that closes after every ``}`` of the text wins, with all its boxes (and
    those of environments chained to it); otherwise the boxes next to the last one count (:func:`_walk_boxes`).
    """
    start, _, end = spans[-1]
    env = _enclosing_env(text, start, end + 1)
    if env is not None and env[1] - 1 > text.rfind("}"):
        chain = _env_chain(text, env, spans)
        if chain is None:
            return None, env[1]
        answers = [  # each environment's boxes, then the environments
            _join_contents(
                [
                    text[content_start:close].strip()
                    for box_start, content_start, close in spans
                    if left <= box_start and close < right
                ]
            )
            for left, right in chain
        ]
        if None in answers:
            return None, env[1]
        return _join_environments([a for a in answers if a]), env[1]
    return _join_contents(_walk_boxes(text, spans)), text.rfind("}") + 1


def _env_contents(text: str) -> list[str] | None:
    """Contents of ``text`` when it is one math environment or a chain of them (``$1$ and $2$``), else ``None``."""
    contents, pos = [], 0
    while len(contents) < _MAX_CHAINED_ENVS:
        match = next((m for env_re in _ENV_RES if (m := env_re.match(text, pos)) is not None), None)
        if match is None:
            return None
        contents.append(match.group("content").strip())
        if match.end() == len(text):
            return contents
        separator = _ENV_CHAIN_SEPARATOR_RE.match(text, match.end())
        if separator is None:
            return None
        pos = separator.end()
    return None


def _mv_number(text: str) -> str | None:
    """``text`` as the number math-verify's expression extractor reads (``1,234`` -> ``1234``, ``2,74`` -> ``2.74``,
    ``28 %`` -> ``28\\%``), or ``None`` when it is not one."""
    match = _MV_NUMBER_RE.fullmatch(text)
    if match is None:
        return None
    integer = match.group("int1") or match.group("int2") or match.group("int3") or ""
    decimal = match.group("dec1") or match.group("dec2") or match.group("dec3") or ""
    negative = integer.startswith("-")
    integer = integer.lstrip("-").replace(",", "").replace(" ", "").lstrip("0") or "0"
    number = ("-" if negative else "") + integer + decimal.replace(",", ".")
    return number + "\\%" if match.group("percent") else number


def _phrase_answer(text: str) -> str | None:
    """The answer after an answer phrase (``final answer is X``): a math environment or a chain of them, a number, or
    a ``\\frac`` of numbers, as math-verify's phrase patterns accept them; ``None`` for anything else."""
    text = text.strip()
    contents = _env_contents(text)
    if contents is not None:
        return _join_environments(contents)
    if _MV_FRACTION_RE.fullmatch(text):
        return text
    return _mv_number(text)


def _number_of_a_count(text: str) -> str | None:
    """The number of ``72 clips`` (a number, a math environment or a ``\\frac``, and up to three words naming what
    it counts), as math-verify reads it off a completion; ``None`` for anything else. Given whole as an answer,
    math-verify would parse the words as a product of symbols and score a correct count wrong."""
    match = _NUMBER_AND_WORDS_RE.fullmatch(text.strip())
    if match is None or _MATH_WORDS & {w.rstrip(".").lower() for w in match.group("words").split()}:
        return None
    number = match.group("number")  # (`1/2 cup` is 1/2 to math-verify too: it was read whole, the words a product)
    return _phrase_answer(number) or (number if _SLASH_FRACTION_RE.fullmatch(number) else None)


def _hope_answer(text: str) -> tuple[str, int] | None:
    """Answer and end of the last ``final answer is X. I hope`` sentence of ``text`` whose X is an answer.

    Only the last few ``I hope`` are looked at, each with the text just before it: an answer is short, and a
    completion repeating the phrase thousands of times must not cost seconds.
    """
    end = len(text)
    for _ in range(_MAX_HOPES):
        hope = text.rfind("I hope", 0, end)
        if hope < 0:
            return None
        for prefix in _HOPE_PREFIX_RE.finditer(text, max(0, hope - _MAX_RAW_CHARS - 20), hope):
            # math-verify's sentence: ``final answer is: X.? I hope``, at most one space before "I hope".
            raw = text[prefix.end() : hope]
            raw = raw[:-1] if raw[-1:].isspace() else raw
            raw = raw.removesuffix(".")
            if raw != raw.rstrip() or raw.endswith("\\%"):  # (math-verify's sentence takes no ``\%`` before it)
                continue
            answer = _phrase_answer(raw)
            if answer is not None:
                return answer, hope + len("I hope")
        end = hope
    return None


def _strip_delimiters(answer: str) -> str:
    """Remove math delimiters and whole-answer boxes around an answer: ``$72$``, ``\\(72\\)``, ``\\boxed{72}``."""
    while True:
        stripped = answer.strip()
        for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(stripped) >= len(left) + len(right) and stripped.startswith(left) and stripped.endswith(right):
                stripped = stripped[len(left) : len(stripped) - len(right)].strip()
                break
        box = _BOX_OPEN_RE.match(stripped)
        if box is not None and _matching_brace(stripped, box.end()) == len(stripped) - 1:
            stripped = stripped[box.end() : -1].strip()
        if stripped == answer:
            return stripped
        answer = stripped


def _braces_balanced(text: str) -> bool:
    depth = 0
    for match in _BRACE_TOKEN_RE.finditer(text):
        token = match.group()
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def _final_line(text: str) -> str:
    return text.rstrip().rpartition("\n")[2]


def _without_emphasis(answer: str) -> str:
    """An answer phrase's answer without the Markdown bold around it, as math-verify's patterns read it: ``**72**``,
    and the line's closing ``**`` after its full stop (``**The answer is 72.**``). (Not ``__72__``: math-verify
    reads no answer there.)"""
    answer = answer.strip()
    if answer.endswith("**"):
        answer = answer[:-2].rstrip()
        answer = answer[:-1] if answer.endswith(".") and not answer.endswith("..") else answer
    return answer.removeprefix("**").lstrip()


def _final_line_answer(text: str) -> str | None:
    """The answer a completion without boxes states on its final line: ``#### x``, ``... (final) answer is x``,
    ``Answer: x``; a trailing full stop is dropped."""
    line = _final_line(text)
    if len(line) > _MAX_RAW_CHARS:
        return None
    match = _GSM8K_LINE_RE.match(line)
    if match is None:
        phrase = _FINAL_ANSWER_IS_RE.search(line)
        if phrase is not None:
            raw = _without_emphasis(phrase.group("answer"))
            slash = raw if _SLASH_FRACTION_RE.fullmatch(raw) else None  # as ``Answer: 1/2`` is read
            answer = _phrase_answer(raw) or _number_of_a_count(raw) or slash
            if answer is not None:
                return answer
        match = _ANSWER_LINE_RE.match(line)
    if match is None:
        return None
    answer = _without_emphasis(match.group("answer"))  # `#### **72**` (`Answer:` lines' own pattern takes theirs)
    if answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1]
    # A number as math-verify reads it first (`50 percent` is 50%), then a count's (`72 clips` is 72).
    return _phrase_answer(answer) or _number_of_a_count(answer) or answer


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
"""The tags of a reasoning model's thinking (DeepSeek-R1's, Qwen3's): the answer is read after the block."""


def extract_predicted_answer(text: str, thinking: bool = False) -> str | None:
    """The answer a completion commits to, or ``None`` when it commits to none.

    Read as math-verify reads a completion, except that nothing counts that a completion does not explicitly mark:

    1. boxes: the last complete ``\\boxed{...}`` together with the boxes math-verify joins to it (those a few
       characters or a separator away, ``\\boxed{1},\\boxed{2}``, and all boxes of the math environment holding it),
       as one answer ``1,2``; if the completion opens a box anywhere, only boxes (or 2.) count, and an unterminated
       last box means no answer (boxes that are all empty, ``\\boxed{}``, count as none);
    2. the MATH few-shot sentence ``The final answer is X. I hope it is correct.``, wherever it stands, when it ends
       after the boxes (math-verify's rule: the later of the two wins); X is a math environment or a number;
    3. without either, a final line ``#### x`` (GSM8K), ``... (final) answer is x`` or ``Answer: x`` (also
       ``Final answer:``, ``**Answer:**``; a trailing full stop is dropped, and the words after a count: ``Answer: 72
       clips`` is ``72``).

    "Final line" is the last non-empty line: an answer marker followed by more text is not an answer, and there is no
    "last number anywhere" fallback (math-verify has one), which a policy learns to game. Math delimiters around the
    answer are removed and ``\\mathrm{e}`` becomes ``e``. An empty answer, or one longer than
    :data:`MAX_ANSWER_CHARS`, is ``None``.

    A reasoning model's thinking is not its answer (a box there is a guess it may go on to revise): only the text
    after the last ``</think>`` is read, and a completion that opens a ``<think>`` block it does not close (cut off
    while thinking) commits to none, as TRL's ``reasoning_accuracy_reward`` reads it. A completion without think tags
    is read whole, unless ``thinking`` says it began inside a block its prompt opened (DeepSeek-R1's chat template
    ends the prompt with ``<think>``: the completion holds only ``</think>``, and without it was cut off thinking).
    """
    if thinking and THINK_CLOSE not in text:
        return None
    text = text.rpartition(THINK_CLOSE)[2]
    if THINK_OPEN in text:
        return None
    spans, truncated = _box_spans(text)
    if truncated:
        return None
    if all(not text[start:end].strip() for _, start, end in spans):
        # Only empty boxes (a model repeating "put your answer in \\boxed{}"): math-verify's box patterns need a
        # character inside the braces, so it reads the completion as if they were not there.
        spans = []
    hope = _hope_answer(text)
    if len(spans) == 1 and hope is None:
        # The common case: one box is the answer whatever environment holds it.
        _, content_start, end = spans[0]
        answer = text[content_start:end]
    elif spans:
        answer, end = _boxed_answer(text, spans)
        if hope is not None and hope[1] > end:
            answer = hope[0]
    else:
        answer = hope[0] if hope is not None else _final_line_answer(text)
    return _clean_answer(answer)


def _bounded_answer(answer: str | None) -> str | None:
    """``answer`` without delimiters if it is non-empty and at most :data:`MAX_ANSWER_CHARS` long, else ``None``."""
    # Length first: stripping thousands of nested whole-answer boxes one by one would take quadratic time.
    if answer is None or len(answer) > _MAX_RAW_CHARS:
        return None
    answer = _strip_delimiters(answer)
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return None
    return answer


def _clean_answer(answer: str | None) -> str | None:
    """:func:`_bounded_answer` with Euler's number written ``e`` (see :data:`_MATHRM_E_RE`)."""
    answer = _bounded_answer(answer)
    return None if answer is None else _MATHRM_E_RE.sub("e", answer)


def number_text(number: int | float | Fraction) -> str | None:
    """``number`` written out as math-verify reads it; None for inf and NaN.

    ``str(1e20)`` is ``1e+20`` and ``str(2.5e-07)`` is ``2.5e-07``, which math-verify does not read as those numbers:
    a float is written out in full, with the digits of its shortest repr (``1e23`` is ``1`` and 23 zeros, not the
    binary value's ``99999999999999991611392``).
    """
    if isinstance(number, float):
        if not math.isfinite(number):
            return None
        exact = Decimal(repr(float(number)))  # (numpy's repr of its own floats is `np.float64(72.0)`)
        return str(int(exact)) if number.is_integer() else format(exact, "f")
    return str(number)


def normalize_gold_answer(gold: Any) -> str | None:
    """Reduce a data set's gold answer to the bare answer string, or ``None`` when it holds no usable answer.

    - GSM8K: ``"... #### 1,234"`` gives ``"1,234"`` (the text after the last ``####``, up to the end of its line);
    - MATH and other solutions with boxes: the boxes math-verify reads as the answer, as for a completion
      (:func:`extract_predicted_answer`): the last complete ``\\boxed{}`` with the boxes next to it or in its math
      environment, so ``$$\\boxed{2}, \\boxed{3}, \\boxed{5}$$`` gives ``"2,3,5"`` (all of them are the answer, and
      a completion giving one of them is wrong);
    - bare answers (DeepScaleR, DAPO-Math): ``"\\frac{1}{2}"``, ``"$2\\sqrt{3}$"``, ``"(3,-1)"`` are kept, minus
      surrounding math delimiters (``"$6$ and $8$"`` gives ``"6, 8"``); ints and floats become their digits in full
      (``1e20`` is ``"100000000000000000000"``, ``2.5e-07`` is ``"0.00000025"``), and so do decimals;
    - a bare or GSM8K answer in words, as a completion's final line is read: ``"72 clips"`` gives ``"72"`` (the
      count, not the words, which math-verify would read as a product of symbols), ``"So the answer is 5."``
      ``"5"``.

    ``\\mathrm{e}`` becomes ``e``. ``None`` when the gold is empty, not text or a number, has an unterminated last
    box or unbalanced braces, or is longer than :data:`MAX_ANSWER_CHARS` (a solution without any answer marker is not
    an answer).
    """
    if isinstance(gold, bool) or gold is None:
        return None
    if isinstance(gold, numbers.Integral):  # numpy's too (a column read with set_format("numpy"))
        gold = int(gold)
    elif isinstance(gold, numbers.Real) and not isinstance(gold, (float, Fraction)):  # its shortest digits (float32)
        gold = float(str(gold))
    if isinstance(gold, (int, float, Fraction)):
        gold = number_text(gold)
    elif isinstance(gold, Decimal):  # a decimal column (Arrow's decimal128): no `numbers.Real`, its digits in full
        gold = format(gold.normalize(), "f") if gold.is_finite() else None
    if not isinstance(gold, str):
        return None
    spans, truncated = _box_spans(gold)
    if truncated:
        return None
    marker = gold.rfind("####")
    if spans:
        answer = _boxed_answer(gold, spans)[0]
    else:
        # ``$6$ and $8$`` is the set {6, 8} to math-verify, like ``6,8``.
        contents = _env_contents(gold.strip()) if marker < 0 and len(gold) <= _MAX_RAW_CHARS else None
        answer = gold[marker + 4 :].partition("\n")[0] if marker >= 0 else gold
        if contents is not None:
            answer = _join_environments(contents)
        elif len(answer) <= _MAX_RAW_CHARS:  # read as a completion's answer line is: ``72 clips`` is 72 (math-verify
            # reads the words as a product of symbols: every completion scored wrong), ``So the answer is 5.`` is 5
            answer = _final_line_answer(answer) or _number_of_a_count(answer) or answer
    answer = _clean_answer(answer)
    if answer is None or not _braces_balanced(answer):
        return None
    return answer
