"""The math-verify worker pool (parent side): worker processes with a hard per-pair deadline, shared by the math
rewards of a process, forgotten in forked children and shut down at exit. Each worker runs :mod:`.worker`, loaded by
path. No relative imports: a test loads this file by path too."""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0
"""Hard deadline, in seconds, for math-verify to parse and compare one gold/prediction pair in a worker."""

DEFAULT_STARTUP_TIMEOUT = 120.0
"""How long a fresh worker may take to import math-verify before the pool gives up with an error (busy nodes)."""

DEFAULT_MEMORY_LIMIT_MB = 2048
"""Address-space cap of a worker: a power tower can otherwise eat the training node's memory inside the deadline (on
Linux: macOS does not enforce it)."""


# A worker loads `worker.py` by path, not ``import trl_vapo``: the package ``__init__`` may grow heavy imports (torch,
# the trainer) that would cost every worker seconds and hundreds of MB.
_WORKER_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_trl_vapo_reward_worker', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main(sys.argv[2:])\n"
)
_WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


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


class _Verifier:
    """What the worker pool and the in-process verifier share: :meth:`verify` and the checks of
    :meth:`verify_with_timeouts`; each implements ``_verify``."""

    def verify(self, pairs: Sequence[tuple[str, str | None]], timeout: float = DEFAULT_TIMEOUT) -> list[bool | None]:
        """Verify ``(gold_answer, predicted_answer)`` pairs; one verdict per pair, in order.

        A predicted answer of ``None`` only checks that the gold parses (``False``, or ``None`` for a bad gold).
        Raises ``RuntimeError`` when math-verify cannot run at all (e.g. it is not installed).
        """
        return self.verify_with_timeouts(pairs, timeout)[0]

    def verify_with_timeouts(
        self, pairs: Sequence[tuple[str, str | None]], timeout: float = DEFAULT_TIMEOUT
    ) -> tuple[list[bool | None], set[int]]:
        """Like :meth:`verify`, also returning the indices of the pairs that overran the deadline, or whose worker
        died twice on them (scored False: counted, and cached, as overruns)."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        return self._verify(list(pairs), timeout)

    def _verify(self, pairs: list[tuple[str, str | None]], timeout: float) -> tuple[list[bool | None], set[int]]:
        raise NotImplementedError


class MathVerifyPool(_Verifier):
    """A small pool of math-verify worker processes with a hard per-pair deadline.

    ``verify(pairs, timeout)`` verifies ``(gold_answer, predicted_answer)`` pairs in parallel, one pair in flight per
    worker, and returns one verdict per pair in order: ``True``/``False``, or ``None`` when math-verify cannot parse
    the gold answer. A worker still busy ``timeout`` seconds after it was given a pair is SIGKILLed, reaped and
    replaced at once, and that pair is ``False``. A worker that dies mid-pair gets the pair once more on a fresh
    worker, then the pair is ``False``, with a warning, and counted as an overrun.

    Workers are started lazily (``warm_up()`` starts them eagerly and waits until they are ready) and reused across
    calls; start-up (importing math-verify, ~1 s) does not count against the deadline but is bounded by
    ``startup_timeout``. ``memory_limit_mb`` caps each worker's address space (``None`` or 0: no cap; Linux's
    `RLIMIT_AS`, which macOS takes and does not enforce).

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
            [sys.executable, "-c", _WORKER_BOOTSTRAP, _WORKER_FILE, *argv],
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

    def _verify(self, pairs: list[tuple[str, str | None]], timeout: float) -> tuple[list[bool | None], set[int]]:
        with self._owned_lock():
            try:
                return self._run(pairs, timeout)
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
                else:  # twice: what kills math-verify on it will again (a gold that does fails every completion)
                    timed_out.add(worker.task)
                    pair = pairs[worker.task]
                    logger.warning(
                        "math-verify's worker died twice on one answer (exit code %s); scored incorrect. gold=%r "
                        "prediction=%r",
                        worker.proc.poll(),
                        pair[0][:80],
                        (pair[1] or "")[:80],
                    )
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
_SHARED_POOLS: dict[tuple[int, int], MathVerifyPool | InProcessVerifier] = {}  # by (workers, memory cap)
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


class InProcessVerifier(_Verifier):
    """math-verify in this process, with no deadline: :class:`MathVerifyPool`'s interface where its workers cannot run
    (Windows, whose pipes ``select.poll`` cannot watch). An answer that keeps sympy busy (``9^{9^{9^{9}}}``) holds the
    rollout until sympy gives up; the first call says so in a warning."""

    def __init__(self) -> None:
        self.stats = {"verified": 0, "timeouts": 0, "crashes": 0, "started": 0}
        self._verify_pair = None
        self._lock = threading.Lock()

    def close(self, lock_timeout: float | None = None) -> None:
        """Nothing to stop (no workers)."""

    def _verify(self, pairs: list[tuple[str, str | None]], timeout: float) -> tuple[list[bool | None], set[int]]:
        # No pair overruns: there is no deadline to overrun.
        with self._lock:
            if self._verify_pair is None:
                logger.warning(
                    "math-verify runs in the training process on this system (no select.poll for its worker "
                    f"processes), without the {timeout:g} s deadline: an answer that keeps it busy holds the rollout."
                )
                try:
                    self._verify_pair = _worker_module()._load_math_verify()
                except ImportError as error:
                    raise RuntimeError(f"math-verify cannot be imported: {error}") from error
            results: list[bool | None] = []
            for gold, pred in pairs:
                try:
                    results.append(self._verify_pair(gold, pred))
                except Exception:  # noqa: BLE001 - as a worker: MemoryError, RecursionError, sympy bugs, not verified
                    results.append(False)
            self.stats["verified"] += len(pairs)
        return results, set()


def _worker_module():
    """:mod:`.worker`, loaded by path as a worker loads it (this file has no relative imports)."""
    import importlib.util

    module = sys.modules.get("_trl_vapo_reward_worker")
    if module is None:
        spec = importlib.util.spec_from_file_location("_trl_vapo_reward_worker", _WORKER_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[spec.name] = module
    return module


def _shared_pool(num_workers: int | None, memory_limit_mb: int | None) -> MathVerifyPool | InProcessVerifier:
    """The pool of this worker count and memory cap (one per process); math-verify in-process where no pool can run."""
    if hasattr(select, "poll"):
        key = (num_workers or _default_num_workers(), memory_limit_mb or 0)
    else:  # Windows: no worker processes
        key = (0, 0)
    with _SHARED_POOLS_LOCK:
        pool = _SHARED_POOLS.get(key)
        if pool is None:
            pool = MathVerifyPool(num_workers=key[0], memory_limit_mb=key[1]) if key[0] else InProcessVerifier()
            _SHARED_POOLS[key] = pool
        return pool
