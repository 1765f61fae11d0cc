"""The lock that gives one run its `output_dir`: a second run there would overwrite the first's checkpoints, its
saved model and its logs without a word. Standard library only (psutil on Windows), so that a process can take it
before torch loads."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

RUN_LOCK = ".vapo_run.lock"
"""The file in `output_dir` that names the run writing there (`output_dir_lock`)."""

_HELD: set[int] = set()
"""The descriptors of the locks this process holds: a forked child (a reward function's `multiprocessing` worker)
closes its copies at once. A `flock` is the open file's, and a copy kept the lock after the run died, until the child
ended (a hung worker: for ever), and every later run in the folder was refused naming a dead PID."""


def _close_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):  # (not on Windows, which has neither fork nor flock)
    os.register_at_fork(after_in_child=_close_in_child)


@contextlib.contextmanager
def output_dir_lock(output_dir: str | os.PathLike):
    """Hold `output_dir` for one run: a second run there would overwrite its checkpoints, its saved model and its logs
    without a word. The lock is an advisory lock (`flock`) on a file naming the holder (PID, host, start time): the
    operating system releases it when the holder dies however it dies, so a lock file left by a run that is gone is
    taken over with a warning, a PID reused since cannot keep it, and two runs taking over at once cannot both win.
    Where the file system has no locks (Windows, some network mounts; an NFS mount with `local_lock=flock` locks on
    one host only), the run goes on unlocked with a warning. Yields whether the folder is locked; released when the
    run ends, however it ends."""
    path = Path(output_dir) / RUN_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    warn = logging.getLogger(__name__).warning  # the main process alone holds the lock: a plain logger
    fd = _take(path, output_dir, warn)
    if fd is None:
        yield False
        return
    try:
        gone = _lock_holder(path, fd)
        if gone is not None or os.fstat(fd).st_size:
            warn(
                f"Taking over the lock of a run that is gone ({gone or 'an unreadable lock file'}, {path}): its "
                "checkpoints stay; resume_from_checkpoint=True continues from the newest."
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        os.fsync(fd)
        _HELD.add(fd)
        yield True
    finally:
        _HELD.discard(fd)
        try:
            # (any OSError: a mount lost as the run ends, ESTALE or EIO, must neither keep the descriptor open nor
            # replace the error in flight, a stop signal's `TrainingInterrupted` and its exit code)
            with contextlib.suppress(OSError):
                # Before the lock goes: a run waiting on this file then opens a new one. Only the file this run
                # locked: one deleted while it ran (a holder taken for gone) may have made way for another run's.
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    path.unlink()
        finally:
            with contextlib.suppress(OSError):  # (EIO from a lost mount)
                os.close(fd)


def _take(path: Path, output_dir, warn) -> int | None:
    """The descriptor of `path`, locked; None where the file system cannot lock (said in a warning); an error naming
    the holder where another run holds it."""
    if fcntl is None:  # Windows
        warn(f"{output_dir} cannot be locked on this system: start one run at a time there.")
        return None
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as error:  # a lock file another user's run left, or a folder this user may not write
            raise RuntimeError(
                f"Cannot open the run lock {path} ({error.strerror}): {output_dir} was written by another user's run, "
                f"or is not writable by this one. Choose another output_dir, or, once sure no run writes there, "
                f"have its owner delete {path}."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:  # a holder that released the lock removed the file we opened: lock the one now at `path`
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                return fd
        except OSError as error:
            os.close(fd)
            # (CIFS's EACCES was taken for a file system without locks: a second run went on there unlocked, and
            # both wrote the same checkpoints.)
            if _held(error):
                raise RuntimeError(refusal(output_dir, _lock_holder(path) or {})) from None
            # ENOLCK, EOPNOTSUPP, ESTALE: a file system without locks
            warn(f"{output_dir} cannot be locked ({error}): start one run at a time there.")
            return None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def live_holder(output_dir: str | os.PathLike) -> dict | None:
    """The run that holds `output_dir` now (`{}` where its lock file is unreadable), else None. A look that keeps
    nothing, for a command to refuse before it loads a model; the run's own `output_dir_lock` still decides (two
    runs starting at once both see a free folder here). A shared lock: it conflicts with a run's exclusive one and not
    with another look, and a file opened read-only can take it on NFS too (an exclusive lock there needs write
    access: the look failed and saw no holder)."""
    if fcntl is None:
        return None
    path = Path(output_dir) / RUN_LOCK
    try:
        fd = os.open(path, os.O_RDONLY)  # never created here: no lock file, no holder
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:  # else a file system without locks: the run says so itself
        return (_lock_holder(path) or {}) if _held(error) else None
    finally:
        os.close(fd)  # and with it the lock this look took
    return None


def refusal(output_dir: str | os.PathLike, holder: dict) -> str:
    """Why a run may not start in `output_dir`, held by `holder`, and the ways on. A holder on another host may be
    gone with its host: a shared file system's server keeps a lost client's lock (NFSv4 for its lease, about 90 s;
    NFSv3 until that client restarts, which a deleted machine never does)."""
    host = holder.get("host") or "?"
    node = "its host" if host == "?" else host  # unknown: a holder that died before writing the file, maybe
    elsewhere = (
        f" If {node} is gone (a lost or deleted node), the file server may keep its lock: once sure no run there "
        f"writes, delete {Path(output_dir) / RUN_LOCK} and start again."
        if host != socket.gethostname()
        else ""
    )
    if not elsewhere and not alive(holder.get("pid")):
        elsewhere = (
            f" PID {holder.get('pid')} is gone, and a process it started keeps the lock (`fuser -v "
            f"{Path(output_dir) / RUN_LOCK}` names it): stop that process and start again."
        )
    return (
        f"Another run is writing to {output_dir}: PID {holder.get('pid', '?')} on {host}, "
        f"started {holder.get('started', '?')} ({Path(output_dir) / RUN_LOCK}). Two runs in one output_dir "
        "overwrite each other's checkpoints and logs. Wait for it or stop it; then resume its run with "
        "resume_from_checkpoint=True (`--resume_from_checkpoint latest`), or choose another output_dir." + elsewhere
    )


def alive(pid) -> bool:
    """Whether a process `pid` of this host is running (True where that cannot be told). On Windows, psutil's
    answer: `os.kill(pid, 0)` sends it a Ctrl+C there, and tells nothing (every PID counted as alive, the debris of
    runs gone, a half-written checkpoint of a full model each, was never removed)."""
    if not isinstance(pid, int) or pid <= 0:
        return True
    if os.name == "nt":
        import psutil

        return psutil.pid_exists(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def _held(error: OSError) -> bool:
    """Whether `flock`'s error says that another run holds the lock: EWOULDBLOCK, or EACCES where `flock` is an SMB
    byte-range lock (CIFS, since Linux 5.5)."""
    return isinstance(error, BlockingIOError) or error.errno == errno.EACCES


def _lock_holder(path: Path, fd: int | None = None) -> dict | None:
    """The lock's holder, or None when the file is gone, empty or unreadable (a holder that died mid-write, an SMB
    lock another run holds: CIFS refuses any read of a file locked through another descriptor). `fd`: the lock's own
    descriptor, read through it (the path's new one is refused there even to the lock's holder)."""
    try:
        return json.loads(os.pread(fd, 1 << 16, 0) if fd is not None else path.read_bytes())
    except (OSError, ValueError):
        return None
