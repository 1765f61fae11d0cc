"""A math-verify worker process: what a fresh interpreter started by :class:`~trl_vapo.rewards.pool.MathVerifyPool`
runs. The pool loads this file by path (``_WORKER_BOOTSTRAP``), so it imports only the standard library and, once
started, math-verify: no relative imports, nothing of ``trl_vapo`` (its package would cost every worker seconds and
hundreds of MB). Protocol: ``parent_pid memory_limit_mb pdeathsig`` as arguments, then one JSON request per line on
stdin (``{"id", "g", "p"}``), one JSON answer per line on stdout (``{"ready"}``, ``{"id", "r"}`` or ``{"fatal"}``)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable


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


def _exit_with_parent(parent_pid: int, every: float = 1.0) -> None:
    """Elsewhere than Linux (macOS), which has no parent-death signal: a thread that ends this worker once its parent
    is gone (it is re-parented: its parent's PID changes), checked every `every` seconds. A hard-crashed trainer left a
    worker computing a power tower, with no deadline and no memory bound (macOS does not enforce `RLIMIT_AS`)."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _worker_main(argv: list[str]) -> None:
    """Entry point of a worker process: ``parent_pid memory_limit_mb pdeathsig`` then JSON lines on stdin."""
    parent_pid, memory_limit_mb, pdeathsig = int(argv[0]), int(argv[1]), argv[2] == "1"
    if pdeathsig:
        _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        return
    if not sys.platform.startswith("linux"):
        _exit_with_parent(parent_pid)
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
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        # With its own timeouts off math-verify warns once per process; the parent enforces the deadline. (Here, not
        # in `_load_math_verify`: the in-process verifier must not silence the training process's math-verify.)
        logging.getLogger(name).setLevel(logging.CRITICAL)
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
    """Import math-verify and return ``verify_pair(gold, pred) -> True | False | None (bad gold)``."""
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
