"""`tests/_train_script.py` in a real process of its own, started in milliseconds instead of seconds.

A fresh interpreter spends about five seconds importing torch, transformers and peft before the run's first step; the
reliability tests start a dozen runs. Here each run is a process forked from one server (multiprocessing's
"forkserver": a single-threaded interpreter started once per test worker, which imported `_train_script` and all it
imports). The child is a process like any other: its own PID, its own file
locks and signal handlers, killed by SIGKILL like one; only the imports are shared. A run on several ranks forks one
process per rank with the environment torchrun gives its workers (`run_ranks`); `run_code` runs a `python -c` script
so (the README's blocks, a script that starts a process group or reads its environment at import). What tests a
launcher itself (`torchrun` in test_rewards.py, `trl-vapo train` and `accelerate launch` in test_cli.py) still starts
a fresh interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import _train_script

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["_train_script"])


def _ensure_server() -> None:
    """Start the fork server with this folder on its path: it is a fresh interpreter, which multiprocessing does not
    give the test worker's `sys.path` (Python 3.11 passes it and drops it), and whose preload of a module it cannot
    find fails without a word; every run then imported torch and transformers itself, five seconds each. On a GPU
    the server must not initialise CUDA, which no forked child could then use: torch asks NVML, not the CUDA
    runtime, whether there is a GPU (`PYTORCH_NVML_BASED_CUDA_CHECK`), and a child that finds CUDA initialised says
    so (`_train_script.main_in_child`)."""
    from multiprocessing import forkserver

    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    server_env = {"PYTHONPATH": path, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    before = {name: os.environ.get(name) for name in server_env}
    os.environ.update(server_env)
    try:
        forkserver.ensure_running()
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class ScriptProcess:
    """The parts of `subprocess.Popen` the tests use, for one `_train_script.main(argv)` in a forked process (or, with
    `code`, one `python -c CODE ARGV` in `cwd`)."""

    def __init__(
        self,
        argv: list[str],
        default_sigint: bool = False,
        env: dict[str, str] | None = None,
        code: str | None = None,
        cwd: str | None = None,
    ):
        folder = Path(tempfile.mkdtemp(prefix="train-script-"))
        owner = os.getpid()  # removed as this process exits (one per run was left behind), never by a child of it
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
        self._stdout, self._stderr = folder / "stdout", folder / "stderr"
        for path in (self._stdout, self._stderr):  # there to read even if the child dies before it writes
            path.touch()
        _ensure_server()
        outputs = (str(self._stdout), str(self._stderr))
        if code is None:
            target, args = _train_script.main_in_child, (argv, *outputs, default_sigint, env or {})
        else:
            target, args = _train_script.exec_in_child, (code, argv, cwd or os.getcwd(), *outputs, env or {})
        self._process = _context.Process(target=target, args=args)
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


SCRIPT_TIMEOUT = "VAPO_SCRIPT_TIMEOUT"
"""An environment variable: the most seconds a script of these functions runs, whatever its test asks. The GPU
suite sets it below its tests part's limit (`TESTS_LIMIT`): a hung run fails its test, and the report of the
others comes back, where the part was stopped whole with no report."""


def capped(timeout: float) -> float:
    """`timeout`, or `SCRIPT_TIMEOUT`'s seconds where they are fewer."""
    return min(timeout, float(os.environ.get(SCRIPT_TIMEOUT, "inf")))


def run_script(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`_train_script.py ARGV` to its end, as `subprocess.run(..., capture_output=True, text=True)` returns it."""
    process = start_script(*argv)
    try:
        stdout, stderr = process.communicate(capped(timeout))
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(["_train_script.py", *argv], process.returncode, stdout, stderr)


def run_code(
    code: str, *argv: str, cwd: str | Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python -c CODE ARGV` in `cwd` to its end (`env` added to the environment), as `subprocess.run(...,
    capture_output=True, text=True)` returns it: the code runs as written, in a process of its own, without a fresh
    interpreter's imports. What differs from one: `env` comes after the server's imports (huggingface_hub,
    transformers and datasets read theirs at import: the server's, the test worker's, offline as conftest.py sets
    it), this folder is on `sys.path`, and the process ends with `os._exit` (no `atexit` handlers)."""
    process = ScriptProcess(list(argv), env=env, code=code, cwd=str(cwd))
    try:
        stdout, stderr = process.communicate(capped(timeout))
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(["python", "-c", code, *argv], process.returncode, stdout, stderr)


def _free_port() -> int:
    with socket.socket() as probe:  # the port the OS gives a bind to 0: free now (torchrun's own way to pick one)
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(*argv: str, processes: int, timeout: float = 300, grace: float = 5) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node PROCESSES _train_script.py ARGV` to its end, each rank forked from the server.

    Each rank gets the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), so `accelerate` and `torch.distributed` start the process group (gloo, or NCCL on a
    GPU) that a torchrun launch starts. Left out: torchrun's own interpreter and elastic agent, and each rank's five
    seconds of imports (under two test workers on two cores, about 20 s of CPU a launch). As torchrun does, a rank
    that fails brings the others down, `grace` seconds later (their own errors first): they would wait in a
    collective. Returned as `subprocess.run(...,
    capture_output=True, text=True)` returns torchrun's: the ranks' stdout one after another, their stderr each
    under a `--- rank N ---` line with the first rank to fail last (its traceback in the tail a test prints), and that
    rank's exit status (0 when none failed). A forked rank ends with `os._exit`, without the interpreter's teardown,
    where torchrun's workers sometimes aborted after a finished run (PyTorch's gloo threads, 'terminate called
    without an active exception'). A run still going after `timeout` seconds is killed, and the TimeoutExpired
    carries what it wrote (300 s: each run takes 5-25 s here and under a minute on a GPU, where a hung one would
    spend the GPU suite's call)."""
    ranks: list[ScriptProcess] = []
    failed = None  # the first rank seen to fail
    timeout = capped(timeout)
    deadline = time.monotonic() + timeout

    def kill_running() -> None:
        for r in ranks:
            if r.poll() is None:
                r.send_signal(signal.SIGKILL)

    def outputs() -> tuple[str, str]:
        kill_running()
        written = [r.communicate(timeout=60) for r in ranks]
        order = sorted(range(len(ranks)), key=lambda rank: rank == failed)
        stdout = "".join(out for out, _ in written)
        return stdout, "".join(f"--- rank {rank} ---\n{written[rank][1]}" for rank in order)

    try:
        port = str(_free_port())
        for rank in range(processes):
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(processes)}
            env |= {"LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            ranks.append(ScriptProcess([str(a) for a in argv], env=env))
        while any(r.poll() is None for r in ranks):
            failed = next((rank for rank, r in enumerate(ranks) if r.poll() not in (None, 0)), None)
            if failed is not None:  # the rest would wait for it forever: their own error first, if they have one
                time.sleep(min(grace, max(0, deadline - time.monotonic())))
                break
            if time.monotonic() > deadline:
                stdout, stderr = outputs()
                raise subprocess.TimeoutExpired(f"_train_script.py on {processes} ranks", timeout, stdout, stderr)
            time.sleep(0.05)
    except BaseException:
        kill_running()
        raise
    if failed is None:
        failed = next((rank for rank, r in enumerate(ranks) if r.returncode != 0), None)
    stdout, stderr = outputs()
    code = 0 if failed is None else ranks[failed].returncode
    return subprocess.CompletedProcess(["_train_script.py", *argv], code, stdout, stderr)
