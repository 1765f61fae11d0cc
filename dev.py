#!/usr/bin/env python3
"""Set up a virtual environment with the tested set of dependencies, and run the demo or the tests.

    python3 dev.py demo [args...]   # the main job: the offline VAPO demo (`trl-vapo train`; args override it)
    python3 dev.py test [args...]   # ruff, then the test suite (extra args go to pytest)
    python3 dev.py setup            # only create or update .venv
    python3 dev.py upgrade [args]   # re-resolve the newest releases within pyproject.toml's ranges in a scratch venv,
                                    # run the suite there, and rewrite constraints.txt only if it passes
    python3 dev.py lowest [args]    # the same with every direct dependency at its lower bound: are the bounds true?

Needs nothing but Python 3.10+. The first run creates `.venv`, installs PyTorch (the version `constraints.txt` pins;
installed on its own so that no dependency pulls in another build), then uv into the venv, then with uv this package
with its `dev` extra, every package pinned by `constraints.txt`: the set the suite last passed with. Later runs skip
every step already done.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
UPGRADE_VENV = ROOT / ".venv-upgrade"
LOCK = ROOT / "constraints.txt"
LOCK_PYTHON = "# python: "  # the header line naming the interpreter the lock was resolved and tested on


def bin_dir(env: Path) -> Path:
    return env / ("Scripts" if os.name == "nt" else "bin")


def python_of(env: Path) -> Path:
    return bin_dir(env) / ("python.exe" if os.name == "nt" else "python")


def _run(*cmd: str | Path, check: bool = True) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=check, cwd=ROOT).returncode


def python_tag() -> str:
    return f"{sys.implementation.name} {sys.version_info.major}.{sys.version_info.minor}"


def python_problem(version_info: tuple = sys.version_info) -> str | None:
    """Why this interpreter cannot set the project up (it needs Python 3.10+; a Mac's own `python3` is 3.9), or None.
    Said first: the venv was built, and then failed at its first install, with a venv left to repair."""
    if tuple(version_info[:2]) < (3, 10):
        return f"dev.py needs Python 3.10 or newer; this is {version_info[0]}.{version_info[1]} ({sys.executable})"
    return None


def venv_python_tag(env: Path) -> str | None:
    """`python_tag()` of `env`'s interpreter, or None where it does not run or has no pip: a venv left half-built (a
    first run interrupted while venv installed pip; Debian's and Ubuntu's Python without `python3-venv`, whose venv
    writes the interpreter, then stops) or made without pip (`uv venv`). Each later run took it for built."""
    command = "import pip, sys; print(sys.implementation.name, '%d.%d' % sys.version_info[:2])"
    try:
        found = subprocess.run([str(python_of(env)), "-c", command], capture_output=True, text=True)
    except OSError:  # no interpreter there, or not one this machine runs
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def ensure_venv(env: Path) -> None:
    """`env` as a venv of this interpreter with pip: created, or created anew where it is half-built, pip-less or of
    another Python (whose packages the lock and the install stamp, both this interpreter's, do not describe)."""
    found = venv_python_tag(env)
    if found == python_tag():
        return
    if python_of(env).exists():
        why = f"its interpreter is {found}" if found else "it has no working interpreter with pip (left half-built?)"
        print(f"recreating the virtual environment in {env}: {why}", flush=True)
    else:
        print(f"creating virtual environment in {env}", flush=True)
    # Symlinks where the OS has them, as `python -m venv` makes them: a copied interpreter that loads its libpython
    # at run time (Apple's, uv's builds of Python on macOS) failed in ensurepip.
    venv.EnvBuilder(with_pip=True, clear=True, symlinks=os.name != "nt").create(env)


def _exec(*cmd: str | Path) -> int:
    """Run `cmd` in this process's place (POSIX `exec`, from the repository's root), so that a Ctrl-C or a SIGTERM
    reaches it as it would reach it run directly: under `subprocess.run`, Python killed the child 0.25 s after a Ctrl-C
    (the demo's checkpoint on a stop never written) and a SIGTERM to dev.py left it running. Returns its exit status
    where there is no exec to replace the process with (Windows), where dev.py ignores the Ctrl-C its command
    gets too."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    if os.name == "nt":
        # The console gives a Ctrl-C to every process attached to it: the command gets its own; dev.py waits for it
        # to end (`subprocess.run` killed it 0.25 s after one, before its stop's checkpoint).
        signal.signal(signal.SIGINT, lambda signum, frame: None)  # (a handler, unlike SIG_IGN, is not inherited)
        return subprocess.Popen([str(c) for c in cmd], cwd=ROOT).wait()
    sys.stderr.flush()
    os.chdir(ROOT)
    os.execv(str(cmd[0]), [str(c) for c in cmd])


def canonical_name(name: str) -> str:
    """A distribution's normalised name (PEP 503): `PyYAML` and `pyyaml`, `math_verify` and `math-verify` are one."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def parse_pins(text: str) -> dict[str, str]:
    """`{name: version}` of the `name==version` lines of a constraints file or of `pip freeze`'s output.

    A local label (`2.13.0+cpu`) names where a wheel came from, not a release, and `==2.13.0` matches it: dropped.
    """
    pins = {}
    for line in text.splitlines():
        name, sep, pinned = line.split("#", 1)[0].partition("==")
        if sep:
            pins[canonical_name(name)] = pinned.strip().split("+", 1)[0]
    return pins


def read_lock(path: Path = LOCK) -> dict[str, str]:
    return parse_pins(path.read_text())


def lock_python(path: Path = LOCK) -> str:
    """The interpreter the lock was resolved and tested on (its `# python: ` header line)."""
    header = [line for line in path.read_text().splitlines() if line.startswith(LOCK_PYTHON)]
    return header[0][len(LOCK_PYTHON) :].strip() if header else "unknown"


def torch_spec() -> str:
    # Pinned even where the rest of the lock does not apply: the version the suite passed on. Which build (CPU or CUDA)
    # is the configured index's: PyPI's Linux wheel is the multi-GB CUDA one.
    return f"torch=={read_lock()['torch']}"


def pip_install(python: Path) -> list[str]:
    """`python -m pip install --quiet`: pip, which reads this machine's pip configuration (an index mirror, a proxy,
    `find-links`, a local CPU wheel of torch), where uv reads none of it."""
    return [str(python), "-m", "pip", "install", "--quiet"]


def installer(env: Path) -> list[str]:
    """The install command for `env`: uv (about 4 s for the `dev` extra's ~100 packages, where pip takes about 40 s),
    installed into the venv itself at the lock's pin; pip where uv cannot be installed."""
    python, uv = python_of(env), bin_dir(env) / ("uv.exe" if os.name == "nt" else "uv")
    if not uv.exists():
        pinned = read_lock().get("uv")
        spec = f"uv=={pinned}" if pinned else "uv"
        subprocess.run([*pip_install(python), spec], cwd=ROOT, check=False)
    if uv.exists():
        # Compiled at install, as pip does: else every process of the first test run compiles transformers alike.
        return [str(uv), "pip", "install", "--quiet", "--compile-bytecode", "--python", str(python)]
    return pip_install(python)


def install(env: Path, constraints: Path | None, with_dependencies: bool = True) -> None:
    """Create `env` if needed, install torch first on its own, then this package with its `dev` extra."""
    python = python_of(env)
    ensure_venv(env)
    if subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode != 0:
        _run(*pip_install(python), torch_spec())  # (pip: a local CPU wheel, an extra index, as configured)
    if not with_dependencies:
        install_packages(env, "--no-deps", "-e", ".")
        return
    pin = ["-c", str(constraints)] if constraints else []
    install_packages(env, *pin, "-e", ".[dev]")


def install_packages(env: Path, *arguments: str) -> None:
    """`pip install` of `arguments` into `env` by `installer`'s command; where uv fails, again by pip (`pip_install`),
    which reads the pip configuration (an index mirror, a proxy, `find-links`, a certificate) this machine may need."""
    command = installer(env)
    uses_uv = Path(command[0]).stem == "uv"
    try:
        if _run(*command, *arguments, check=False) == 0:
            return
    except OSError:  # a uv binary this machine cannot run
        if not uses_uv:
            raise
    if uses_uv:
        print("note: uv could not install; pip, which reads this machine's pip configuration, tries", flush=True)
        if _run(*pip_install(python_of(env)), *arguments, check=False) == 0:
            return
    raise SystemExit(f"dev.py: installing {' '.join(arguments)} into {env} failed (pip's error above)")


def setup() -> None:
    stamp = VENV / ".trl-vapo-install-stamp"
    # On another interpreter some pins may have no wheel: there the dependencies resolve within the ranges.
    applies = lock_python() == python_tag()
    # Reinstall only when the declared dependencies, the lock or the interpreter change.
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + LOCK.read_bytes())
    digest.update(f"{sys.version} {applies}".encode())
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        return
    if not applies:
        print(
            f"note: {LOCK.name} was tested on {lock_python()}; on {python_tag()} the dependencies resolve within "
            "pyproject.toml's ranges instead",
            flush=True,
        )
    install(VENV, LOCK if applies else None)
    stamp.write_text(digest.hexdigest())


def run_checks(python: Path, pytest_args: list[str], in_place: bool = False) -> int:
    """`ruff check .` (seconds, so that the code stays ruff-clean), then the test suite (`in_place`: as this
    process, `_exec`)."""
    if _run(python, "-m", "ruff", "check", ".", check=False) != 0:
        return 1
    if in_place:
        return _exec(python, "-m", "pytest", *pytest_args)
    return _run(python, "-m", "pytest", *pytest_args, check=False)


def freeze(python: Path) -> dict[str, str]:
    """The pins of everything installed in `python`'s environment but this package."""
    command = [str(python), "-m", "pip", "freeze", "--exclude-editable"]
    return parse_pins(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def write_lock(pins: dict[str, str], path: Path = LOCK) -> None:
    lines = [
        "# The tested set: every package `pip install -e .[dev]` pulls in, pinned. `python3 dev.py demo|test|setup`",
        "# install with `-c constraints.txt`. Written by `python3 dev.py upgrade` only after ruff and the whole suite",
        "# passed with exactly these versions; do not edit it by hand, except torch's pin (then run the upgrade).",
        f"{LOCK_PYTHON}{python_tag()}",
        f"# platform: {sys.platform} {platform.machine()}",
        *(f"{name}=={pins[name]}" for name in sorted(pins)),
    ]
    path.write_text("\n".join(lines) + "\n")


def moved_packages(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package whose pin changed, appeared or went, in name order."""
    lines = []
    for name in sorted(old.keys() | new.keys()):
        if old.get(name) != new.get(name):
            lines.append(f"{name} {old.get(name, '(new)')} -> {new.get(name, '(gone)')}")
    return lines


def lower_bounds(requirements: list[str], extra: str = "dev") -> dict[str, str]:
    """`{name: version}` of the `>=` (or `==`) bound of each requirement line, core ones and those of `extra`."""
    pins = {}
    for line in requirements:
        spec, _, marker = line.partition(";")
        if "extra" in marker and f'"{extra}"' not in marker:
            continue
        name = re.match(r"[A-Za-z0-9._-]+", spec.strip()).group()
        bound = re.search(r"(?:>=|==)\s*([^,;\s]+)", spec)
        if bound:
            pins[canonical_name(name)] = bound.group(1)
    return pins


def lowest(pytest_args: list[str]) -> int:
    """Every direct dependency at its lower bound (torch: the lock's pin), tested in a scratch venv."""
    shutil.rmtree(UPGRADE_VENV, ignore_errors=True)  # always a fresh one: nothing left from an earlier try
    install(UPGRADE_VENV, None, with_dependencies=False)
    python = python_of(UPGRADE_VENV)
    declared = subprocess.run(
        [str(python), "-c", "from importlib.metadata import requires; print(*requires('trl-vapo'), sep='\\n')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    pins = {**lower_bounds(declared), "torch": read_lock()["torch"]}
    constraints = UPGRADE_VENV / "lower-bounds.txt"
    constraints.write_text("".join(f"{name}=={pins[name]}\n" for name in sorted(pins)))
    try:
        install(UPGRADE_VENV, constraints)
    except subprocess.CalledProcessError:
        print(f"lowest: pip cannot install these bounds together ({constraints}); raise the bound its message names")
        return 1
    result = run_checks(python, pytest_args)
    verdict = "passed" if result == 0 else f"FAILED (the scratch venv is kept: {UPGRADE_VENV})"
    print(f"lowest: the suite {verdict} with", *(f"{n}=={pins[n]}" for n in sorted(pins)), sep="\n  ")
    return result


def upgrade(pytest_args: list[str]) -> int:
    """Newest releases within pyproject.toml's ranges (torch: the lock's pin), tested in a scratch venv."""
    shutil.rmtree(UPGRADE_VENV, ignore_errors=True)  # always a fresh one: nothing left from an earlier try
    install(UPGRADE_VENV, None)
    python = python_of(UPGRADE_VENV)
    if run_checks(python, pytest_args) != 0:
        print(f"upgrade: the suite failed on the newest releases; {LOCK.name} is unchanged ({UPGRADE_VENV} kept)")
        return 1
    old, new = read_lock(), freeze(python)
    write_lock(new)
    moved = moved_packages(old, new)
    print(f"upgrade: the suite passed; {LOCK.name} rewritten, {len(moved)} package(s) moved", *moved, sep="\n  ")
    shutil.rmtree(UPGRADE_VENV)
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "setup", "upgrade", "lowest"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if problem := python_problem():
        print(problem, file=sys.stderr)
        return 2
    if command in ("upgrade", "lowest"):
        return upgrade(rest) if command == "upgrade" else lowest(rest)
    setup()
    if command == "demo":  # (Windows starts a program by a path only with its .exe named)
        return _exec(bin_dir(VENV) / ("trl-vapo.exe" if os.name == "nt" else "trl-vapo"), "train", *rest)
    if command == "test":
        return run_checks(python_of(VENV), rest, in_place=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
