"""The CPU benchmarks' own code, run at the smallest size so they cannot rot: `bench_generation.py --quick` and a
two-step `bench_trainer.py` with each generation engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_generation_benchmark_quick_compares_the_engines():
    out = run("bench_generation.py", "--quick", "--models", "demo")
    rows = [line.split() for line in out.splitlines() if line.startswith("demo ")]
    assert sorted(row[2] for row in rows) == ["continuous", "generate()"], out
    assert all(int(row[-2].replace(",", "")) > 0 for row in rows)  # tokens per second


@pytest.mark.parametrize("engine", ["generate", "continuous_batching"])
def test_trainer_benchmark_runs_both_trainers_with_each_engine(engine):
    out = run(
        "bench_trainer.py",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--trainers",
        "vapo,grpo",
        "--engine",
        engine,
        "--breakdown",
    )
    assert f"engine: {engine}" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("VAPO ", "GRPO "))}
    assert set(rows) == {"VAPO", "GRPO"}
    assert rows["GRPO"][4] == "1.00x" and float(rows["VAPO"][-1]) > 0  # the ratio column and generation tokens/s
