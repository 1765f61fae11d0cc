"""How a benchmark measures one run in a fresh process of its own (its peak memory, its imports and its threads are
its own): the worker's environment, and the launch that reads back the JSON record the worker writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_json(path: Path, data, indent: int | None = None) -> None:
    """``data`` as JSON at ``path``, atomically: a reader (or a run killed mid-write) sees the last whole file, never
    half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    tmp.replace(path)


def versions(*packages: str) -> str:
    """ "python 3.11.9, torch 2.9.0, ...": the installed versions, read from the packages' metadata (a driver that
    imported them to print this line spent seconds on imports its workers pay again)."""
    import platform
    from importlib.metadata import version

    return ", ".join([f"python {platform.python_version()}", *(f"{name} {version(name)}" for name in packages)])


def run_dir(prefix: str) -> str:
    """A temporary `output_dir` for one run (its checkpoints and logs; a benchmark's records are written elsewhere),
    removed when the process exits: each run left one behind, some with checkpoints (a suite run's quick benchmarks
    too)."""
    import atexit
    import shutil

    path, owner = tempfile.mkdtemp(prefix=prefix), os.getpid()
    # By this process alone: a child forked from it that ends through sys.exit would run the handlers it inherited.
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
    return path


def worker_env(one_thread: bool = True) -> dict[str, str]:
    """A worker's environment: offline and quiet; with `one_thread`, one intra-op thread (the CPU benchmarks: runs
    side by side on a shared machine must not fight over cores)."""
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
    }
    if one_thread:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


class WorkerFailed(SystemExit):
    """A worker exited with an error. A SystemExit, so that a benchmark that does not catch it stops with its message
    (no traceback of the launcher); one that measures several runs catches it and goes on with the others."""


def launch_worker(script: str | Path, args: list[str], name: str, one_thread: bool = True) -> dict:
    """`python SCRIPT ARGS --result FILE` in a fresh process; the record it wrote to FILE. The worker's stderr is
    this process's (a run stopped at `gpu_suite.py --limit` kills this process too: an output held here would be
    lost with it); a failed worker's stdout tail goes to stderr and `WorkerFailed` is raised, naming `name`."""
    result = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    command = [sys.executable, str(script), *args, "--result", result]
    proc = subprocess.run(command, env=worker_env(one_thread), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:])
            raise WorkerFailed(f"worker {name} failed (exit {proc.returncode})")
        with open(result) as f:
            return json.load(f)
    finally:
        os.unlink(result)


def phase_line(phases: dict) -> str:
    """A run's seconds by phase: start (imports, CUDA init), model (tokenizer, weights), trainer (its constructor),
    train (the steps), the worker's `total` and the `process` as its launcher timed it (with the interpreter's start
    and exit)."""
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
