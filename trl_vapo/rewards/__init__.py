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
   final answer is X. I hope it is correct.``, else a final ``#### x``, ``... (final) answer is x`` or ``Answer: x``
   line. There is deliberately no "last number in the text" fallback, and an answer longer than
   :data:`MAX_ANSWER_CHARS` is no answer. Only the text after a reasoning model's last ``</think>`` is read; a think
   block left open (cut off while thinking) is no answer.
3. When both are plain numbers, :func:`fast_verdict` decides in-process (exact ``fractions.Fraction`` arithmetic)
   wherever its verdict provably equals math-verify's.
4. Everything else goes to math-verify in a worker *process* (:class:`MathVerifyPool`) with a hard deadline: a worker
   that overruns it is killed (and replaced), and the sample scores ``incorrect_reward``. On Windows, whose pipes the
   pool cannot watch, math-verify runs in the training process without a deadline (:class:`.pool.InProcessVerifier`,
   which warns once).

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

The package, one module per concern: :mod:`.answers` (reading the gold and predicted answers), :mod:`.exact_numbers`
(the in-process verdict on plain numbers), :mod:`.pool` (the worker processes and their deadlines) and :mod:`.worker`
(what each runs, loaded by path), :mod:`.functions` (:class:`MathReward`, the format reward); here, the registry of
named rewards. Where rewards end and scoring begins: a reward function scores completions given the dataset's columns;
``trl_vapo.scoring`` calls whatever reward functions and reward models a run has on a rollout (TRL's protocol, the
weights, ``None`` and NaN), these or any others.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable

from .answers import MAX_ANSWER_CHARS, extract_predicted_answer, find_last_boxed, normalize_gold_answer
from .exact_numbers import fast_verdict, parse_plain_number
from .functions import MathReward, completion_text, make_math_reward, math_reward, think_boxed_format_reward
from .pool import DEFAULT_TIMEOUT, MathVerifyPool, shutdown_workers

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
        from .._compat import trl_reward_function

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
