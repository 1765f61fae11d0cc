"""What `pip install` of a built trl-vapo gets: the wheel and the sdist, built from the tracked files (what a release
ships) by setuptools' own build hooks, hold the package, the demo's model files and the `trl-vapo` command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}

# One process per artifact: setuptools keeps state between its hooks in one process (the wheel lands elsewhere).
BUILD = """
import sys
import setuptools.build_meta as backend
print("built:", getattr(backend, "build_" + sys.argv[2])(sys.argv[1]))  # its own log comes first on stdout
"""


def test_the_wheel_and_the_sdist_hold_the_package_the_demo_model_and_the_command(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    source = tmp_path / "source"
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():  # a deletion not yet committed is not shipped
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    names = {}
    for kind in ("sdist", "wheel"):
        built = subprocess.run(
            [sys.executable, "-c", BUILD, str(dist), kind], cwd=source, capture_output=True, text=True, timeout=300
        )
        assert built.returncode == 0, built.stderr[-3000:]
        names[kind] = built.stdout.split("built:")[-1].strip()
    sdist_name, wheel_name = names["sdist"], names["wheel"]

    with tarfile.open(dist / sdist_name) as sdist:
        names = {Path(n).relative_to(Path(n).parts[0]).as_posix() for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "trl_vapo/cli.py"} <= names
    assert {f"trl_vapo/demo/model/{f}" for f in DEMO_FILES} <= names

    with zipfile.ZipFile(dist / wheel_name) as wheel:
        names = set(wheel.namelist())
        entry_points = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {f"trl_vapo/demo/model/{f}" for f in DEMO_FILES} <= names and "trl_vapo/py.typed" in names
    assert "trl-vapo = trl_vapo.cli:main" in entry_points

    # Installed on its own (the dependencies are this environment's), it runs: the command and the demo's model.
    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
         str(dist / wheel_name)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    version = subprocess.run([site / "bin" / "trl-vapo", "--version"], env=env, capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("trl-vapo "), version.stderr[-2000:]
    check = "import trl_vapo, trl_vapo.demo as d; print(trl_vapo.__file__); print(d.MODEL_DIR)"
    where = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, cwd=tmp_path)
    module, model = where.stdout.split()
    assert Path(module).is_relative_to(site) and {p.name for p in Path(model).iterdir()} >= DEMO_FILES
