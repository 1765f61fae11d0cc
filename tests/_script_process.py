"""`tests/_train_script.py` in a real process of its own, started in milliseconds instead of seconds.

A fresh interpreter spends about five seconds importing torch, transformers and peft before the run's first step; the
reliability tests start a dozen runs. Here each run is a process forked from one server (multiprocessing's
"forkserver": a single-threaded interpreter started once per test worker, which imported `_train_script` and all it
imports). The child is a process like any other: its own PID, its own file
locks and signal handlers, killed by SIGKILL like one; only the imports are shared. What needs a launch as a user makes
it (`torchrun`, `trl-vapo train`, `accelerate launch`) still starts a fresh interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import _train_script

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["_train_script"])


def _ensure_server() -> None:
    """Start the fork server with this folder on its path: it is a fresh interpreter, which multiprocessing does not
    give the test worker's `sys.path` (Python 3.11 passes it and drops it), and whose preload of a module it cannot
    find fails without a word; every run then imported torch and transformers itself, five seconds each."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), before]))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def script_env() -> dict[str, str]:
    """The environment of a run in a fresh interpreter (`torchrun`); the forked runs inherit the test worker's, which
    `conftest.py` sets alike (and `_train_script` takes one torch thread itself)."""
    return {**os.environ, **ENV}


class ScriptProcess:
    """The parts of `subprocess.Popen` the tests use, for one `_train_script.main(argv)` in a forked process."""

    def __init__(self, argv: list[str], default_sigint: bool = False):
        folder = Path(tempfile.mkdtemp(prefix="train-script-"))
        self._stdout, self._stderr = folder / "stdout", folder / "stderr"
        for path in (self._stdout, self._stderr):  # there to read even if the child dies before it writes
            path.touch()
        _ensure_server()
        self._process = _context.Process(
            target=_train_script.main_in_child, args=(argv, str(self._stdout), str(self._stderr), default_sigint)
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        """As Popen's: the exit status, or minus the signal that ended the process."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"_train_script.py (PID {self.pid})", timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._stdout.read_text(errors="replace"), self._stderr.read_text(errors="replace")


def start_script(*argv: str, default_sigint: bool = False) -> ScriptProcess:
    return ScriptProcess([str(a) for a in argv], default_sigint)


def run_script(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`_train_script.py ARGV` to its end, as `subprocess.run(..., capture_output=True, text=True)` returns it."""
    process = start_script(*argv)
    try:
        stdout, stderr = process.communicate(timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(["_train_script.py", *argv], process.returncode, stdout, stderr)
