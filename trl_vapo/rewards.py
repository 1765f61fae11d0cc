"""Verifier rewards for math reasoning: correct, fast, and never hanging.

VAPO learns from a rule-based verifier, so whatever the verifier gets wrong, slow or stuck, training gets wrong, slow
or stuck. The functions here follow TRL's reward-function protocol::

    func(prompts=[...], completions=[...], completion_ids=[...], **dataset_columns) -> list[float | None]

and can be passed to a trainer as ``reward_funcs`` objects, by registry name or by import path (see
:func:`get_reward_function`).

How a completion is scored by :func:`math_reward` (and by every reward built with :func:`make_math_reward`):

1. The gold answer is read from the ``answer`` column (``solution`` when there is no ``answer``) and reduced to a bare
   answer by :func:`normalize_gold_answer`: GSM8K's ``... #### 72``, a solution with boxes (MATH, NuminaMath), or a
   bare answer as DeepScaleR / DAPO-Math store it.
2. The prediction is extracted by :func:`extract_predicted_answer`: the boxes, else the MATH few-shot sentence ``The
   final answer is X. I hope it is correct.``, else a final ``#### x``, ``... final answer is x`` or ``Answer: x``
   line. There is deliberately no "last number in the text" fallback, and an answer longer than
   :data:`MAX_ANSWER_CHARS` is no answer.
3. When both are plain numbers, :func:`fast_verdict` decides in-process (exact ``fractions.Fraction`` arithmetic)
   wherever its verdict provably equals math-verify's.
4. Everything else goes to math-verify in a worker *process* (:class:`MathVerifyPool`) with a hard deadline: a worker
   that overruns it is killed (and replaced), and the sample scores ``incorrect_reward``.

Gold and prediction are read as math-verify reads them (``tests/test_rewards_math_verify.py`` compares the two on the
same strings): several boxes next to each other, or in one math environment, are one answer (``\\boxed{2},
\\boxed{3}`` is the set {2, 3}, so a completion giving one of several gold answers is wrong); ``0,111`` is 0.111;
a decimal matches a fraction after rounding to six places. ``\\mathrm{e}`` is read as Euler's number, where
math-verify reads a symbol named e.

math-verify's own timeouts are ``signal.alarm`` based: they raise off the main thread, take whole seconds only,
cancel the caller's own alarms, and cannot interrupt a long C-level computation (``9^{9^{9^{9}}}`` hangs inside one
big-integer power). Killing a process is the only deadline that always holds, so the parent never touches a sympy
object: workers return plain ``bool`` / ``None`` over a pipe.

Workers are ``subprocess.Popen`` children speaking JSON lines over pipes rather than ``multiprocessing`` processes,
because ``torch.utils.data.DataLoader`` workers are daemonic and ``multiprocessing`` forbids daemonic processes from
having children. Workers start lazily, are shared by all math rewards of a process (one pool per worker count), are
forgotten (not killed) in forked children, and are shut down at interpreter exit and at ``multiprocessing`` child exit.
"""

from __future__ import annotations

import atexit
import bisect
import difflib
import importlib
import json
import logging
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_ANSWER_CHARS",
    "REWARD_FUNCTIONS",
    "MathReward",
    "MathVerifyPool",
    "completion_text",
    "extract_predicted_answer",
    "fast_verdict",
    "find_last_boxed",
    "get_reward_function",
    "make_math_reward",
    "math_reward",
    "normalize_gold_answer",
    "parse_plain_number",
    "shutdown_workers",
    "think_boxed_format_reward",
]

MAX_ANSWER_CHARS = 300
"""Longest answer, in characters, that counts as an answer at all.

Gold answers of MATH, GSM8K, DeepScaleR and DAPO-Math are far shorter (matrices and long polynomials stay under ~150).
A longer extracted prediction is scored incorrect without being parsed: it is either a policy stuffing the box with
candidates or text that would only cost the verifier time. A longer gold answer is treated as unparseable (``None``).
"""

DEFAULT_TIMEOUT = 5.0
"""Hard deadline, in seconds, for math-verify to parse and compare one gold/prediction pair in a worker."""

DEFAULT_STARTUP_TIMEOUT = 120.0
"""How long a fresh worker may take to import math-verify before the pool gives up with an error (busy nodes)."""

DEFAULT_MEMORY_LIMIT_MB = 2048
"""Address-space cap of a worker: a power tower can otherwise eat the training node's memory inside the deadline."""

# ---------------------------------------------------------------------------------------------------------------------
# Pure text helpers
# ---------------------------------------------------------------------------------------------------------------------

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
    r"(?P<dec2>[.,]\d+)|(?P<dec3>\.\d+)|(?P<int3>-?\d+))(?P<percent>\s*(?:%|[Pp]ercent|\s*[Pp]ercentage|\s*[Pp]ct))?",
    re.ASCII,
)
_MV_FRACTION_RE = re.compile(r"-?\\frac\{-?\d+(?:[.,]\d+)?\}\{-?\d+(?:[.,]\d+)?\}")
# The MATH few-shot format ends with ``Final Answer: The final answer is $X$. I hope it is correct.``; math-verify
# takes the last such sentence wherever it stands, and it competes with boxes by position (the later one wins).
_HOPE_PREFIX_RE = re.compile(r"(?i:final answer is):?\s*")
_MAX_HOPES = 20
# ``The final answer is $34$.`` on the final line (math-verify's "final answer ... is" pattern), also as ``Final
# Answer: The volume is 120. I hope it is correct.`` where the sentence lacks "final answer is".
_FINAL_ANSWER_IS_RE = re.compile(
    r"(?i:final answer).{0,100}?\s+is:?\s*(?P<answer>.+?)\.?(?:\s?I hope it is correct\.?)?\s*$"
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
    a box opened after the last of them never closes (a truncated completion)."""
    spans, pos = [], 0
    while (match := _BOX_OPEN_RE.search(text, pos)) is not None:
        end = _matching_brace(text, match.end())
        if end is None:
            # An unterminated box runs to the end of the text, so it is the last one: the final answer was cut off.
            return spans, True
        spans.append((match.start(), match.end(), end))
        pos = end + 1
    return spans, False


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


def _join_contents(contents: Sequence[str]) -> str | None:
    """Box contents joined into one answer as math-verify joins them (``1,2,3``), dropping a content that repeats the
    one before it; ``None`` when the answer would exceed :data:`_MAX_RAW_CHARS` (a list of candidates)."""
    kept: list[str] = []
    size = 0
    for content in contents:
        if kept and content == kept[-1]:
            continue
        kept.append(content)
        size += len(content) + 1
        if size > _MAX_RAW_CHARS:
            return None
    return ",".join(kept)


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
        if opening < 0 or not _not_escaped(text, opening) or text.find(right, opening, start) >= 0:
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
        contents = [
            text[content_start:close].strip()
            for box_start, content_start, close in spans
            if any(left <= box_start and close < right for left, right in chain)
        ]
        return _join_contents(contents), env[1]
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
        return _join_contents(contents)
    if _MV_FRACTION_RE.fullmatch(text):
        return text
    return _mv_number(text)


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
            if raw != raw.rstrip():
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


def _final_line_answer(text: str) -> str | None:
    """The answer a completion without boxes states on its final line: ``#### x``, ``... final answer is x``,
    ``Answer: x``; a trailing full stop is dropped."""
    line = _final_line(text)
    if len(line) > _MAX_RAW_CHARS:
        return None
    match = _GSM8K_LINE_RE.match(line)
    if match is None:
        phrase = _FINAL_ANSWER_IS_RE.search(line)
        if phrase is not None and (answer := _phrase_answer(phrase.group("answer"))) is not None:
            return answer
        match = _ANSWER_LINE_RE.match(line)
    if match is None:
        return None
    answer = match.group("answer")
    if answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1]
    return answer


def extract_predicted_answer(text: str) -> str | None:
    """The answer a completion commits to, or ``None`` when it commits to none.

    Read as math-verify reads a completion, except that nothing counts that a completion does not explicitly mark:

    1. boxes: the last complete ``\\boxed{...}`` together with the boxes math-verify joins to it (those a few
       characters or a separator away, ``\\boxed{1},\\boxed{2}``, and all boxes of the math environment holding it),
       as one answer ``1,2``; if the completion opens a box anywhere, only boxes (or 2.) count, and an unterminated
       last box means no answer;
    2. the MATH few-shot sentence ``The final answer is X. I hope it is correct.``, wherever it stands, when it ends
       after the boxes (math-verify's rule: the later of the two wins); X is a math environment or a number;
    3. without either, a final line ``#### x`` (GSM8K), ``... final answer is x`` or ``Answer: x`` (also
       ``Final answer:``, ``**Answer:**``; a trailing full stop is dropped).

    "Final line" is the last non-empty line: an answer marker followed by more text is not an answer, and there is no
    "last number anywhere" fallback (math-verify has one), which a policy learns to game. Math delimiters around the
    answer are removed and ``\\mathrm{e}`` becomes ``e``. An empty answer, or one longer than
    :data:`MAX_ANSWER_CHARS`, is ``None``.
    """
    spans, truncated = _box_spans(text)
    if truncated:
        return None
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


def normalize_gold_answer(gold: Any) -> str | None:
    """Reduce a data set's gold answer to the bare answer string, or ``None`` when it holds no usable answer.

    - GSM8K: ``"... #### 1,234"`` gives ``"1,234"`` (the text after the last ``####``, up to the end of its line);
    - MATH and other solutions with boxes: the boxes math-verify reads as the answer, as for a completion
      (:func:`extract_predicted_answer`): the last complete ``\\boxed{}`` with the boxes next to it or in its math
      environment, so ``$$\\boxed{2}, \\boxed{3}, \\boxed{5}$$`` gives ``"2,3,5"`` (all of them are the answer, and
      a completion giving one of them is wrong);
    - bare answers (DeepScaleR, DAPO-Math): ``"\\frac{1}{2}"``, ``"$2\\sqrt{3}$"``, ``"(3,-1)"`` are kept, minus
      surrounding math delimiters (``"$6$ and $8$"`` gives ``"6,8"``); ints and floats are converted with ``str``.

    ``\\mathrm{e}`` becomes ``e``. ``None`` when the gold is empty, not text or a number, has an unterminated last
    box or unbalanced braces, or is longer than :data:`MAX_ANSWER_CHARS` (a solution without any answer marker is not
    an answer).
    """
    if isinstance(gold, bool) or gold is None:
        return None
    if isinstance(gold, float):
        if not math.isfinite(gold):
            return None
        # ``str(1e20)`` is ``1e+20``, which no parser reads as a number.
        gold = str(int(gold)) if gold.is_integer() else repr(gold)
    if isinstance(gold, (int, Fraction)):
        gold = str(gold)
    if not isinstance(gold, str):
        return None
    spans, truncated = _box_spans(gold)
    if truncated:
        return None
    marker = gold.rfind("####")
    if spans:
        answer = _boxed_answer(gold, spans)[0]
    elif marker >= 0:
        answer = gold[marker + 4 :].partition("\n")[0]
    else:
        # ``$6$ and $8$`` is the set {6, 8} to math-verify, like ``6,8``.
        contents = _env_contents(gold.strip()) if len(gold) <= _MAX_RAW_CHARS else None
        answer = gold if contents is None else _join_contents(contents)
    answer = _clean_answer(answer)
    if answer is None or not _braces_balanced(answer):
        return None
    return answer


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


# ---------------------------------------------------------------------------------------------------------------------
# The worker process (runs in a fresh interpreter, see MathVerifyPool._spawn)
# ---------------------------------------------------------------------------------------------------------------------

# Loads this file by path, not ``import trl_vapo``: the package ``__init__`` may grow heavy imports (torch, the
# trainer) that would cost every worker seconds and hundreds of MB.
_WORKER_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_trl_vapo_reward_worker', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main(sys.argv[2:])\n"
)


def _set_parent_death_signal() -> None:
    # Linux only: SIGKILL this worker when the thread that spawned it dies, so a hard-killed trainer (OOM killer,
    # torchrun tearing ranks down) leaves no worker spinning on a power tower. An idle worker also exits on stdin EOF.
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except Exception:  # noqa: BLE001, S110 - a missing libc symbol only loses the orphan protection
        pass


def _worker_main(argv: list[str]) -> None:
    """Entry point of a worker process: ``parent_pid memory_limit_mb pdeathsig`` then JSON lines on stdin."""
    parent_pid, memory_limit_mb, pdeathsig = int(argv[0]), int(argv[1]), argv[2] == "1"
    if pdeathsig:
        _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        return
    # Ctrl-C goes to the whole process group; the parent decides what happens to its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The protocol gets a private copy of stdout; anything a library prints goes to stderr instead.
    protocol_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    protocol_in = sys.stdin.buffer

    def send(message: dict) -> None:
        protocol_out.write(json.dumps(message).encode() + b"\n")

    if memory_limit_mb > 0:
        try:
            import resource

            limit = memory_limit_mb * 1024 * 1024
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            if hard != resource.RLIM_INFINITY:
                limit = min(limit, hard)
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        except (ImportError, ValueError, OSError):
            pass
    try:
        verify_pair = _load_math_verify()
        # The first parse builds the ANTLR parser and compiles math-verify's regexes; do it before reporting ready so
        # that the deadline of the first real request measures verification only.
        verify_pair("\\frac{1}{2}", "0.5")
        verify_pair("[2,5)", "x^2+7x")
    except BaseException as exc:  # noqa: BLE001 - report any start-up failure to the parent, then exit
        send({"fatal": f"{type(exc).__name__}: {exc}"})
        return
    send({"ready": os.getpid()})
    for line in protocol_in:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        try:
            result = verify_pair(request["g"], request["p"])
        except Exception:  # noqa: BLE001 - MemoryError, RecursionError, sympy bugs: the answer is not verified
            result = False
        send({"id": request.get("id"), "r": result})


def _load_math_verify() -> Callable[[str, str | None], bool | None]:
    """Import math-verify in the worker and return ``verify_pair(gold, pred) -> True | False | None (bad gold)``."""
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        # With its own timeouts off math-verify warns once per process; the parent enforces the deadline.
        logging.getLogger(name).setLevel(logging.CRITICAL)
    from functools import lru_cache

    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    config = [
        LatexExtractionConfig(
            boxed_match_priority=0,
            try_extract_without_anchor=False,
            normalization_config=NormalizationConfig(
                basic_latex=True, units=True, malformed_operators=True, nits=True, boxed="all", equations=False
            ),
        )
    ]

    def parse_answer(answer: str) -> list:
        # Bare LaTeX must be wrapped: math-verify's anchors read a bare ``2\sqrt{3}`` as 2.
        return parse(
            "\\boxed{" + answer + "}",
            extraction_config=config,
            extraction_mode="first_match",
            parsing_timeout=None,
            raise_on_error=False,
        )

    @lru_cache(maxsize=4096)
    def parse_gold(answer: str) -> tuple:
        parsed = parse_answer(answer)
        # Only the string fallback means math-verify could not read it: such a gold would only match itself verbatim.
        return tuple(parsed) if any(not isinstance(p, str) for p in parsed) else ()

    def verify_pair(gold: str, pred: str | None) -> bool | None:
        gold_parsed = parse_gold(gold)
        if not gold_parsed:
            return None
        if pred is None:
            return False
        pred_parsed = parse_answer(pred)
        if not pred_parsed:
            return False
        return bool(verify(list(gold_parsed), pred_parsed, timeout_seconds=None, raise_on_error=False))

    return verify_pair


# ---------------------------------------------------------------------------------------------------------------------
# The worker pool (parent side)
# ---------------------------------------------------------------------------------------------------------------------


class _Worker:
    """One worker process and the parent's view of it."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.fd = proc.stdout.fileno()
        self.buffer = b""
        self.ready = False
        self.started = time.monotonic()
        self.task: int | None = None  # index of the pair being verified
        self.request_id = 0
        self.deadline = 0.0


class MathVerifyPool:
    """A small pool of math-verify worker processes with a hard per-pair deadline.

    ``verify(pairs, timeout)`` verifies ``(gold_answer, predicted_answer)`` pairs in parallel, one pair in flight per
    worker, and returns one verdict per pair in order: ``True``/``False``, or ``None`` when math-verify cannot parse
    the gold answer. A worker still busy ``timeout`` seconds after it was given a pair is SIGKILLed, reaped and
    replaced at once, and that pair is ``False``. A worker that dies mid-pair gets the pair once more on a fresh
    worker, then the pair is ``False``.

    Workers are started lazily (``warm_up()`` starts them eagerly and waits until they are ready) and reused across
    calls; start-up (importing math-verify, ~1 s) does not count against the deadline but is bounded by
    ``startup_timeout``. ``memory_limit_mb`` caps each worker's address space (``None`` or 0: no cap).

    Safe to call from any thread (calls are serialised) and from processes without signal handling, such as
    ``DataLoader`` workers; a forked child never uses or kills its parent's workers, it starts its own. POSIX only.
    Every pool is closed at interpreter exit; call ``close()`` to free a private pool's workers earlier. Math rewards
    share pools and never need closing.
    """

    def __init__(
        self,
        num_workers: int = 2,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not hasattr(select, "poll"):
            raise RuntimeError("MathVerifyPool needs select.poll (Linux or macOS)")
        self.num_workers = num_workers
        self.startup_timeout = startup_timeout
        self.memory_limit_mb = memory_limit_mb or 0
        self.stats = {"verified": 0, "timeouts": 0, "crashes": 0, "started": 0}
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._next_request_id = 0
        _LIVE_POOLS.add(self)
        _register_exit_hooks()

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def worker_pids(self) -> list[int]:
        """Process ids of this pool's current workers (started or starting)."""
        return [w.proc.pid for w in self._workers]

    def warm_up(self) -> None:
        """Start any missing worker and wait until every worker is ready to verify."""
        with self._owned_lock():
            self._run([], DEFAULT_TIMEOUT, wait_ready=True)

    def close(self, lock_timeout: float | None = None) -> None:
        """Stop and reap every worker. The pool starts fresh workers if it is used again.

        With ``lock_timeout``, a call still running in another thread after that many seconds does not block the
        close (at interpreter exit a daemon thread may be mid-batch): its workers are killed under it.
        """
        lock = self._owned_lock()
        locked = lock.acquire(timeout=-1 if lock_timeout is None else lock_timeout)
        try:
            self._stop_workers()
        finally:
            if locked:
                lock.release()

    def _owned_lock(self) -> threading.Lock:
        # A forked child inherits the parent's workers and possibly a held lock: neither is its own.
        if os.getpid() != self._pid:
            self._forget_workers()
        return self._lock

    def _stop_workers(self) -> None:
        workers, self._workers = self._workers, []
        for worker in workers:
            if worker.task is not None or not worker.ready:
                try:
                    worker.proc.kill()
                except OSError:
                    pass
            try:
                worker.proc.stdin.close()  # EOF: an idle worker exits on its own
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in workers:
            try:
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
            worker.proc.stdout.close()

    def _forget_workers(self) -> None:
        """In a forked child: drop the parent's workers without signalling or waiting on them (not our children)."""
        for worker in self._workers:
            for stream in (worker.proc.stdin, worker.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            # Not our child: mark it finished so that Popen never tries to wait on it.
            worker.proc.returncode = 0
        self._workers = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _spawn(self) -> _Worker:
        if not sys.executable:
            raise RuntimeError("math-verify workers need sys.executable to start a Python interpreter")
        # The parent-death signal fires when the spawning *thread* exits, so arm it only from the main thread, which
        # lives as long as the process; workers spawned from other threads rely on stdin EOF alone.
        pdeathsig = threading.current_thread() is threading.main_thread()
        argv = [str(os.getpid()), str(self.memory_limit_mb), "1" if pdeathsig else "0"]
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOTSTRAP, os.path.abspath(__file__), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            bufsize=0,
        )
        self.stats["started"] += 1
        return _Worker(proc)

    def _reap(self, worker: _Worker, kill: bool) -> None:
        if kill:
            try:
                worker.proc.kill()
            except OSError:
                pass
        for stream in (worker.proc.stdin, worker.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        worker.proc.wait()  # no zombies

    def _replace(self, worker: _Worker, kill: bool) -> None:
        self._reap(worker, kill)
        self._workers.remove(worker)
        self._workers.append(self._spawn())

    # -- verification ----------------------------------------------------------------------------------------------

    def verify(self, pairs: Sequence[tuple[str, str | None]], timeout: float = DEFAULT_TIMEOUT) -> list[bool | None]:
        """Verify ``(gold_answer, predicted_answer)`` pairs; one verdict per pair, in order.

        A predicted answer of ``None`` only checks that the gold parses (``False``, or ``None`` for a bad gold).
        Raises ``RuntimeError`` when workers cannot start at all (e.g. math-verify is not installed).
        """
        return self.verify_with_timeouts(pairs, timeout)[0]

    def verify_with_timeouts(
        self, pairs: Sequence[tuple[str, str | None]], timeout: float = DEFAULT_TIMEOUT
    ) -> tuple[list[bool | None], set[int]]:
        """Like :meth:`verify`, also returning the indices of the pairs that overran the deadline (scored False)."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        with self._owned_lock():
            try:
                return self._run(list(pairs), timeout)
            except BaseException:
                # An exception (a KeyboardInterrupt, a signal handler raising) leaves busy workers computing answers
                # nobody will read: stop them so that the next call starts clean (it starts replacements).
                for worker in list(self._workers):
                    if worker.task is not None:
                        self._reap(worker, kill=True)
                        self._workers.remove(worker)
                raise

    def _run(
        self, pairs: list[tuple[str, str | None]], timeout: float, wait_ready: bool = False
    ) -> tuple[list[bool | None], set[int]]:
        results: list[bool | None] = [False] * len(pairs)
        timed_out: set[int] = set()
        pending = deque(range(len(pairs)))
        attempts = [0] * len(pairs)
        startup_failures = 0

        for i, worker in enumerate(self._workers):
            if worker.proc.poll() is not None:  # died while idle (OOM killer, parent-death signal of a gone thread)
                self._reap(worker, kill=False)
                self._workers[i] = self._spawn()
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

        def on_death(worker: _Worker) -> None:
            nonlocal startup_failures
            if not worker.ready:
                startup_failures += 1
                if startup_failures >= 2:
                    self._reap(worker, kill=True)
                    self._workers.remove(worker)
                    raise RuntimeError(
                        f"math-verify worker exited during start-up (exit code {worker.proc.returncode}); "
                        "see its stderr above"
                    )
            elif worker.task is not None:
                self.stats["crashes"] += 1
                attempts[worker.task] += 1
                if attempts[worker.task] < 2:
                    pending.appendleft(worker.task)
                worker.task = None
            self._replace(worker, kill=False)

        while True:
            for worker in list(self._workers):
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    if not self._send(worker, index, pairs[index], timeout):
                        pending.appendleft(index)
                        worker.task = None
                        on_death(worker)
            # Starting workers matter only while there is work for them (or to warm up): after a timeout the
            # replacement imports math-verify in the background instead of delaying this call's return.
            busy = [w for w in self._workers if w.task is not None]
            starting = [w for w in self._workers if not w.ready] if pending or wait_ready else []
            waiting = busy + starting
            if not waiting:
                break
            now = time.monotonic()
            deadlines = [w.deadline if w.ready else w.started + self.startup_timeout for w in waiting]
            poller = select.poll()
            for worker in waiting:
                poller.register(worker.fd, select.POLLIN | select.POLLHUP | select.POLLERR)
            events = poller.poll(max(0.0, min(deadlines) - now) * 1000 + 1)
            by_fd = {w.fd: w for w in waiting}
            for fd, _ in events:
                worker = by_fd[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    on_death(worker)
                    continue
                worker.buffer += chunk
                while b"\n" in worker.buffer:
                    line, worker.buffer = worker.buffer.split(b"\n", 1)
                    self._handle_line(worker, line, results)
            now = time.monotonic()
            for worker in waiting:
                if worker not in self._workers:  # died and replaced above
                    continue
                if worker.task is not None and now >= worker.deadline:
                    index, worker.task = worker.task, None
                    results[index] = False
                    timed_out.add(index)
                    self.stats["timeouts"] += 1
                    self._log_timeout(pairs[index], timeout)
                    self._replace(worker, kill=True)
                elif not worker.ready and now >= worker.started + self.startup_timeout:
                    self._reap(worker, kill=True)
                    self._workers.remove(worker)
                    raise RuntimeError(f"math-verify worker not ready after {self.startup_timeout:.0f} s")
        self.stats["verified"] += len(pairs)
        return results, timed_out

    def _send(self, worker: _Worker, index: int, pair: tuple[str, str | None], timeout: float) -> bool:
        self._next_request_id += 1
        worker.request_id = self._next_request_id
        data = json.dumps({"id": worker.request_id, "g": pair[0], "p": pair[1]}).encode() + b"\n"
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(worker.proc.stdin.fileno(), view) :]
        except OSError:  # BrokenPipeError: the worker is gone
            return False
        worker.task = index
        worker.deadline = time.monotonic() + timeout
        return True

    def _handle_line(self, worker: _Worker, line: bytes, results: list[bool | None]) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return
        if "fatal" in message:
            self._reap(worker, kill=True)
            self._workers.remove(worker)
            raise RuntimeError(f"math-verify worker failed to start: {message['fatal']}")
        if "ready" in message:
            worker.ready = True
        elif worker.task is not None and message.get("id") == worker.request_id:
            result = message.get("r")
            results[worker.task] = result if result is None else bool(result)
            worker.task = None

    def _log_timeout(self, pair: tuple[str, str | None], timeout: float) -> None:
        count = self.stats["timeouts"]
        # A policy that learns to emit power towers would flood the log: report the first few, then every 100th.
        if count <= 5 or count % 100 == 0:
            logger.warning(
                "math-verify overran its %.1f s deadline (%d so far); worker restarted, scored incorrect. "
                "gold=%r prediction=%r",
                timeout,
                count,
                pair[0][:80],
                (pair[1] or "")[:80],
            )


_LIVE_POOLS: weakref.WeakSet[MathVerifyPool] = weakref.WeakSet()
_SHARED_POOLS: dict[tuple[int, int], MathVerifyPool] = {}
_SHARED_POOLS_LOCK = threading.Lock()
_EXIT_HOOKS_PID: int | None = None


def shutdown_workers() -> None:
    """Stop and reap every math-verify worker of this process (runs at exit; call it to free them earlier)."""
    for pool in list(_LIVE_POOLS):
        try:
            pool.close(lock_timeout=2.0)
        except Exception:  # best effort at shutdown
            logger.debug("closing a math-verify pool failed", exc_info=True)


def _register_exit_hooks() -> None:
    global _EXIT_HOOKS_PID
    if _EXIT_HOOKS_PID == os.getpid():
        return
    _EXIT_HOOKS_PID = os.getpid()
    atexit.register(shutdown_workers)
    # multiprocessing children (DataLoader workers) leave through os._exit and skip atexit, but run these finalizers;
    # the registry is cleared in each child, hence registering per process.
    import multiprocessing.util

    multiprocessing.util.Finalize(None, shutdown_workers, exitpriority=10)


def _after_fork_in_child() -> None:
    global _SHARED_POOLS_LOCK
    _SHARED_POOLS_LOCK = threading.Lock()
    _SHARED_POOLS.clear()
    for pool in list(_LIVE_POOLS):
        pool._forget_workers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _default_num_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    # At least two, so that a killed worker's replacement starts while the other keeps verifying.
    return max(2, min(4, cpus // local_ranks))


def _shared_pool(num_workers: int | None, memory_limit_mb: int | None) -> MathVerifyPool:
    key = (num_workers or _default_num_workers(), memory_limit_mb or 0)
    with _SHARED_POOLS_LOCK:
        pool = _SHARED_POOLS.get(key)
        if pool is None:
            pool = _SHARED_POOLS[key] = MathVerifyPool(num_workers=key[0], memory_limit_mb=key[1])
        return pool


# ---------------------------------------------------------------------------------------------------------------------
# Reward functions
# ---------------------------------------------------------------------------------------------------------------------


class MathReward:
    """A configured math reward following TRL's reward-function protocol; build it with :func:`make_math_reward`.

    A callable object rather than a closure so that it pickles (TRL's async rollout ships reward functions to a
    spawned process); the worker pool is not pickled, the receiving process starts its own.
    """

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
        self._timed_out: OrderedDict[tuple[str, str | None], bool] = OrderedDict()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_warned_golds"], state["_gold_parses"], state["_timed_out"]
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
    def pool(self) -> MathVerifyPool:
        """The worker pool this reward sends non-numeric answers to (shared per worker count, started lazily)."""
        return _shared_pool(self.num_workers, self.memory_limit_mb)

    def _golds(self, kwargs: dict) -> list:
        for column in self.answer_columns:
            if kwargs.get(column) is not None:
                return list(kwargs[column])
        wanted = " or ".join(map(repr, self.answer_columns))
        present = sorted(k for k in kwargs if k not in _TRAINER_KWARGS)
        raise KeyError(
            f"{self.__name__} reads the gold answer from the dataset column {wanted}, but the batch only has the "
            f"columns {present}; pass answer_column= to make_math_reward"
        )

    def verdicts(
        self, gold_answers: Sequence[str | None], predicted_answers: Sequence[str | None]
    ) -> list[bool | None]:
        """Verdicts for already-normalised answers: ``True``/``False``, ``None`` where the gold is unusable.

        Identical pairs are verified once, plain numbers never leave the process (:func:`fast_verdict`), and a pair
        that once overran the deadline is scored ``False`` without being retried (a policy that found a power tower
        tends to repeat it, and each retry would cost a full deadline and a worker restart).
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
            if (gold, pred) in self._timed_out:
                verdicts[i] = False
                timeouts += 1
                continue
            to_verify.setdefault((gold, pred), []).append(i)
        if to_verify:
            keys = list(to_verify)
            results, timed_out = self.pool.verify_with_timeouts(keys, timeout=self.timeout)
            for k, (key, verdict) in enumerate(zip(keys, results, strict=True)):
                if k in timed_out:
                    _remember(self._timed_out, key, True, 4096)
                    timeouts += len(to_verify[key])
                else:
                    _remember(self._gold_parses, key[0], verdict is not None, 65536)
                for i in to_verify[key]:
                    verdicts[i] = verdict
        return verdicts, timeouts

    def __call__(self, completions: list, **kwargs: Any) -> list[float | None]:
        """Score ``completions`` against the gold column; ``None`` only where the gold answer cannot be parsed.

        Extra keyword arguments (``prompts``, ``completion_ids``, ``trainer_state``, other dataset columns) are
        accepted and ignored, except ``log_extra`` / ``log_metric`` which, when the trainer provides them, receive the
        extracted answers and the share of answers that hit the deadline.
        """
        golds = self._golds(kwargs)
        if len(golds) != len(completions):
            raise ValueError(f"{self.__name__}: {len(completions)} completions but {len(golds)} gold answers")
        gold_answers = [normalize_gold_answer(g) for g in golds]
        predicted = [extract_predicted_answer(completion_text(c)) for c in completions]
        verdicts, timeouts = self._score(gold_answers, predicted)
        rewards: list[float | None] = []
        for gold, verdict in zip(golds, verdicts, strict=True):
            if verdict is None:
                self._warn_bad_gold(gold)
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

    def _warn_bad_gold(self, gold: Any) -> None:
        key = repr(gold)[:500]
        if key in self._warned_golds or len(self._warned_golds) >= 10000:
            return
        self._warned_golds.add(key)
        logger.warning("%s: cannot parse the gold answer %s; these samples get no reward (None)", self.__name__, key)


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


def make_math_reward(
    *,
    answer_column: str | Sequence[str] = ("answer", "solution"),
    correct_reward: float = 1.0,
    incorrect_reward: float = -1.0,
    timeout: float = DEFAULT_TIMEOUT,
    num_workers: int | None = None,
    memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB,
    name: str = "math_reward",
) -> MathReward:
    """Build a math reward function for ``reward_funcs``.

    Args:
        answer_column: dataset column holding the gold answer, or several to try in order (the first present wins).
        correct_reward: reward of a verified answer.
        incorrect_reward: reward of a wrong, missing, over-long or timed-out answer: ``-1.0`` as in VC-PPO / VAPO,
            ``0.0`` for the 1/0 convention.
        timeout: hard deadline in seconds for math-verify on one answer; overrunning scores ``incorrect_reward``.
        num_workers: math-verify worker processes; ``None`` picks 2-4 from the CPUs available to this rank.
        memory_limit_mb: address-space cap per worker (``None``: no cap).
        name: the function's ``__name__``, under which trainers log its rewards; give each configuration its own.

    Returns:
        A picklable :class:`MathReward`.
    """
    return MathReward(
        answer_column=answer_column,
        correct_reward=correct_reward,
        incorrect_reward=incorrect_reward,
        timeout=timeout,
        num_workers=num_workers,
        memory_limit_mb=memory_limit_mb,
        name=name,
    )


math_reward = make_math_reward()
"""Ready-to-use math reward: gold from ``answer`` (else ``solution``), +1 correct, -1 otherwise, 5 s deadline."""


def think_boxed_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 for ``[<think>] reasoning </think> ... \\boxed{answer}``, else 0.0; plain-text or chat completions.

    The format: at most one leading ``<think>`` (chat templates such as DeepSeek-R1's and Qwen3's put it in the
    prompt, so it may be missing), non-blank reasoning, exactly one ``</think>``, and after it a complete, non-empty
    ``\\boxed{}`` of at most :data:`MAX_ANSWER_CHARS` characters, with no further think tags.

    TRL's ``trl.rewards.think_format_reward`` is not reused because it only reads chat completions, requires
    ``<think>`` in the completion, and does not look for an answer at all.
    """
    rewards = []
    for completion in completions:
        reasoning, closed, tail = completion_text(completion).partition("</think>")
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


REWARD_FUNCTIONS: dict[str, Callable[..., list[float | None]]] = {
    "math_reward": math_reward,
    "think_boxed_format_reward": think_boxed_format_reward,
}
"""Reward functions a command line can name; :func:`get_reward_function` also accepts import paths."""


# TRL's own reward functions, by the names its `grpo` script accepts.
_TRL_REWARD_FUNCTIONS = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",  # built with `trl grpo`'s values: max_completion_len=1280, soft_punish_cache=256
)


def get_reward_function(name: str) -> Callable[..., list[float | None]]:
    """Resolve a reward function by registry name (:data:`REWARD_FUNCTIONS`, or one of `trl grpo`'s:
    ``accuracy_reward``, ``reasoning_accuracy_reward``, ``think_format_reward``, ``get_soft_overlong_punishment``) or
    import path.

    Import paths are ``package.module.attribute`` or ``package.module:attribute`` (as TRL's ``grpo`` script accepts),
    e.g. ``trl.rewards.accuracy_reward`` or ``my_rewards:make_reward`` (the attribute itself is returned; call
    factories yourself).
    """
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    if name in _TRL_REWARD_FUNCTIONS:
        from ._compat import trl_reward_function

        func = trl_reward_function(name)
        return func(max_completion_len=1280, soft_punish_cache=256) if name == "get_soft_overlong_punishment" else func
    module_name, sep, attribute = name.rpartition(":") if ":" in name else name.rpartition(".")
    if not sep or not module_name or not attribute:
        known = sorted(REWARD_FUNCTIONS) + sorted(_TRL_REWARD_FUNCTIONS)
        close = difflib.get_close_matches(name, known, n=1)
        raise ValueError(
            f"unknown reward function {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}; expected one of "
            f"{', '.join(known)}, or an import path (my_pkg.rewards.fn)"
        )
    try:
        func = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load reward function {name!r}: {exc}") from exc
    if not callable(func):
        raise ValueError(f"reward function {name!r} is not callable")  # noqa: TRY004 - the CLI reports ValueErrors
    return func
