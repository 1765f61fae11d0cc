"""The CPU benchmarks' own code, run at the smallest size so they cannot rot: `bench_generation.py --quick`, a
two-step `bench_trainer.py` (generate engine) and `bench_padding.py --quick` (`bench_critic.py --quick`: in
test_bench_critic.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import run_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_generation_benchmark_quick_compares_the_engines(capsys):
    """In this process: its own would spend most of its time importing."""
    import bench_generation

    bench_generation.main(["--quick", "--models", "demo"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("demo ")]
    assert sorted(row[2] for row in rows) == ["continuous", "generate()", "static"], out
    assert all(int(row[-2].replace(",", "")) > 0 for row in rows)  # tokens per second
    # Per decode step: the static-cache engine reads the device once per 16 steps (its "all stopped?" check),
    # generate() at every step; both launch the model's operators.
    steps = {line.split()[0]: line.split()[-2:] for line in out.split("per decode step")[1].splitlines()[2:4]}
    assert float(steps["static"][1]) == round(1 / 16, 2) and float(steps["generate()"][1]) >= 1, out
    assert float(steps["static"][0]) > 100 and float(steps["generate()"][0]) > 100


@pytest.mark.parametrize("engine", ["generate"])  # continuous batching: 67 s here, not run (its trainer path is tested
def test_trainer_benchmark_runs_both_trainers(engine):  # in test_engines.py, not this benchmark's branch for it)
    out = run_benchmark(
        "bench_trainer.py",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--batch-size",  # the shapes are not what is tested: the processes' start is most of the time
        "8",
        "--max-completion-length",
        "32",
        "--trainers",
        "vapo,grpo",
        "--engine",
        engine,
        "--breakdown",
    )
    assert f"engine: {engine}" in out
    # --breakdown's table: a part timed in both trainers' steps (a cell "seconds (share%)" each).
    breakdown = out.split("breakdown, ")[1].split("\nload average")[0].splitlines()[2:]
    assert any(line.count("%)") == 2 for line in breakdown), out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("VAPO ", "GRPO "))}
    assert set(rows) == {"VAPO", "GRPO"}
    assert rows["GRPO"][4] == "1.00x" and float(rows["VAPO"][-1]) > 0  # the ratio column and generation tokens/s
    vapo_s, grpo_s = float(rows["VAPO"][3]), float(rows["GRPO"][3])  # mean s/step, then the ratio VAPO / GRPO
    assert float(rows["VAPO"][4].removesuffix("x")) == pytest.approx(vapo_s / grpo_s, rel=0.05, abs=0.01)


def test_padding_count_quick_finds_length_order_computes_less_than_the_drawn_order():
    """`bench_padding.py --quick` counts what the trainer's own split computes (`trim_padding`, `length_sorted`):
    in length order the micro-batches compute fewer padding positions than as drawn, and never fewer positions than
    the completions hold. In process: the count itself takes a second."""
    import bench_padding

    results = bench_padding.main(["--quick"])
    assert sorted(results) == ["128/16", "512/64", "64/8"]
    for layout, summary in results.items():
        (drawn, _), (ordered, _) = summary["as drawn"], summary["length order"]
        assert 1.0 <= ordered < 1.2 < 1.5 < drawn < 2.0, (layout, summary)
