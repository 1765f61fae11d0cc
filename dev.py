#!/usr/bin/env python3
"""Set up a virtual environment and run the demo or the tests.

    python3 dev.py demo [args...]   # the main job: the offline VAPO demo (`trl-vapo train`; args override it)
    python3 dev.py test [args...]   # ruff, then the test suite (extra args go to pytest)

Needs nothing but Python 3.10+. The first run creates `.venv`, installs PyTorch when none is importable
(`torch==2.13.0`), then this package with its `dev` extra. Later runs skip every step that is already done.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".trl-vapo-install-stamp"
TORCH_SPEC = "torch==2.13.0"


def _run(*cmd: str | Path) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def _install_fingerprint() -> str:
    # Reinstall only when the declared dependencies or the interpreter change.
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(sys.version.encode())
    return digest.hexdigest()


def setup() -> None:
    if not PYTHON.exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    has_torch = subprocess.run([str(PYTHON), "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:
        # Install torch on its own first: an unpinned `torch` pulled in by a dependency would fetch the CUDA build.
        _run(PYTHON, "-m", "pip", "install", "--quiet", TORCH_SPEC)
    fingerprint = _install_fingerprint()
    if not STAMP.exists() or STAMP.read_text() != fingerprint:
        _run(PYTHON, "-m", "pip", "install", "--quiet", "-e", ".[dev]")
        STAMP.write_text(fingerprint)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "setup"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    setup()
    if command == "setup":
        return 0
    if command == "demo":
        cmd = [str(BIN / "trl-vapo"), "train", *rest]
    else:
        # Lint first (seconds), so that the code stays ruff-clean; then the test suite.
        lint = [str(PYTHON), "-m", "ruff", "check", "."]
        print("+", " ".join(lint), flush=True)
        if subprocess.run(lint, cwd=ROOT).returncode != 0:
            return 1
        cmd = [str(PYTHON), "-m", "pytest", *rest]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
