"""Stopping a run on SIGTERM, SIGINT or SIGUSR1 without losing what it trained: the first signal is noted and the loop
finishes its rollout, writes a checkpoint and raises `TrainingInterrupted` naming it
(`VAPOTrainer._stop_after_signal`); a repeat within `SIGNAL_REPEAT_WINDOW` is the same request, a later one stops at
once."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path


class TrainingInterrupted(RuntimeError):
    """`VAPOTrainer.train` stopped on a stop signal after writing the checkpoint `checkpoint`; a command exits with
    `exit_code` (128 + the signal's number, the shell's convention for a process a signal ended)."""

    def __init__(self, signum: int, checkpoint: Path, message: str):
        super().__init__(message)
        self.signum, self.checkpoint, self.exit_code = int(signum), checkpoint, 128 + int(signum)


class _Received:
    signum: int | None = None
    at: float = 0.0
    acted: bool = False  # a repeat took the signal's own action

    def __init__(self) -> None:
        self.uncaught: dict[str, str] = {}  # each stop signal not caught, and why: its stop writes no checkpoint


SIGNAL_REPEAT_WINDOW = 5.0
"""Seconds after the first stop signal in which another is the same request, not a second one: under `torchrun`,
`accelerate launch` or `scancel` a worker gets the signal twice, once itself (its process group or job step) and once
forwarded by the launcher."""


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, name))
"""The signals that ask a run to stop with a checkpoint: SIGTERM (preemption, `scancel`, a container stop), SIGINT
(Ctrl-C) and SIGUSR1, Slurm's advance warning (`#SBATCH --signal=USR1@600`), whose own action is to end the process
at once. (Windows has no SIGUSR1.)"""


def _say(text: str) -> None:
    """`text` to stderr from a signal handler: a write, not logging (a handler may run while logging holds its lock),
    and none where stderr cannot take it. Ctrl-C under `trl-vapo train ... 2>&1 | tee log` ends `tee` too: the write
    raised BrokenPipeError (Python ignores SIGPIPE) where the main thread was, and the run ended unsaved. A pipe no
    one reads any longer is replaced by the null device: the progress bar's next write (tqdm re-raises EPIPE) and the
    command's last lines then go nowhere, not into an error that ends the run before its checkpoint."""
    try:
        os.write(2, text.encode())
    except BrokenPipeError:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
    except OSError:  # (a full disk: the stop goes on without its notice)
        pass


@contextlib.contextmanager
def stop_on_signals(
    signums=STOP_SIGNALS,
    doing: str = "finishing this rollout, then a checkpoint",
    repeated: str = "already stopping after this rollout",
):
    """While training: the first of `STOP_SIGNALS` is noted (`received.signum`) so that the loop can finish its
    rollout and write a checkpoint. A repeat within `SIGNAL_REPEAT_WINDOW` seconds is the same request (the launcher
    forwarding it); a later one acts as it would have without this handler (SIGTERM and SIGUSR1 end the process,
    SIGINT raises KeyboardInterrupt; `received.acted`). Handlers can only be set in the main thread: elsewhere, and for
    signals a caller already handles (submitit's, a user's), nothing changes, and `received.uncaught` says which and
    why. `doing`: what the notice says the run does meanwhile; `repeated`: what a repeat within the window is told."""
    received = _Received()
    if threading.current_thread() is not threading.main_thread():
        received.uncaught = {signal.Signals(s).name: "training runs outside the main thread" for s in signums}
        yield received
        return
    previous = {}

    def note(signum, frame):
        now = time.monotonic()
        if received.signum is None:
            received.signum, received.at = signum, now
            name = signal.Signals(signum).name
            later = f"{SIGNAL_REPEAT_WINDOW:g} s on"
            _say(f"{name}: {doing} (sent again {later}: stop now)\n")
        elif now - received.at > SIGNAL_REPEAT_WINDOW:  # a second request: the signal's own action, now
            received.acted = True
            for other, handler in previous.items():
                signal.signal(other, handler)
            signal.raise_signal(signum)
        else:
            _say(f"{repeated}\n")

    for signum in signums:
        handler = signal.getsignal(signum)
        if handler in (signal.SIG_DFL, signal.default_int_handler):
            previous[signum] = signal.signal(signum, note)
        elif handler is not signal.SIG_IGN:  # (an ignored signal stops nothing)
            own = getattr(handler, "__qualname__", None) or repr(handler)  # (None: set outside Python)
            received.uncaught[signal.Signals(signum).name] = f"its handler is {own}'s"
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def stop_signals_held(signums=STOP_SIGNALS):
    """While the trained model is saved: a stop signal is held until the save is whole, then acts as it would have
    (SIGTERM and SIGUSR1 end the process, SIGINT raises KeyboardInterrupt). Acting at once, mid-save (the files are
    moved into `output_dir` one by one), it left a new policy beside an earlier save's critic, or none, and the save's
    rest was removed by the next run as a stopped run's debris. `stop_on_signals`' handling: said when it comes, a
    repeat past `SIGNAL_REPEAT_WINDOW` acts at once (inside `train()`, its own `stop_on_signals` notes them)."""
    received = None
    try:
        waiting = "stopping once the model is saved"
        with stop_on_signals(signums, doing=waiting, repeated=f"already {waiting}") as received:
            yield
    finally:
        if received is not None and received.signum is not None and not received.acted:
            signal.raise_signal(received.signum)
