"""The CPU benchmarks' own code, run at the smallest size so they cannot rot: `bench_generation.py --quick`, a
two-step `bench_trainer.py` (generate engine), and `bench_critic.py --quick`."""

from __future__ import annotations

import json

import pytest
from helpers import run_benchmark


def test_generation_benchmark_quick_compares_the_engines():
    out = run_benchmark("bench_generation.py", "--quick", "--models", "demo")
    rows = [line.split() for line in out.splitlines() if line.startswith("demo ")]
    assert sorted(row[2] for row in rows) == ["continuous", "generate()", "static"], out
    assert all(int(row[-2].replace(",", "")) > 0 for row in rows)  # tokens per second
    # Per decode step: the static-cache engine reads the device once per 16 steps (its "all stopped?" check),
    # generate() at every step; both launch the model's operators.
    steps = {line.split()[0]: line.split()[-2:] for line in out.split("per decode step")[1].splitlines()[2:4]}
    assert float(steps["static"][1]) == round(1 / 16, 2) and float(steps["generate()"][1]) >= 1, out
    assert float(steps["static"][0]) > 100 and float(steps["generate()"][0]) > 100


@pytest.mark.parametrize("engine", ["generate"])  # continuous batching: 67 s here, covered by test_engines.py
def test_trainer_benchmark_runs_both_trainers_with_each_engine(engine):
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


def test_quick_probe_trains_the_critic_and_writes_the_table(tmp_path):
    run_benchmark("bench_critic.py", "--quick", "--out", str(tmp_path))
    records = json.loads((tmp_path / "lr1e-3.json").read_text())
    assert len(records) == 2  # one per value-pretraining rollout
    assert all(-5 < r["ev"] <= 1 and 0 <= r["oracle_ev"] <= 1 and 0 < r["slipped_share"] < 1 for r in records)
    assert records[1]["ev"] > records[0]["ev"]  # the critic learned from the first rollout (-0.109 -> -0.045)
    assert all(0 < r["exact_ev"] <= 1 and r["exact_drop"] < 0 for r in records)  # the exact value, at each slip
    assert "lr1e-3" in (tmp_path / "table.txt").read_text()
    assert (tmp_path / "critic_probe.png").stat().st_size > 10_000


def test_padding_count_quick_finds_length_order_computes_less_than_the_drawn_order():
    """`bench_padding.py --quick` counts what the trainer's own split computes (`trim_padding`, `length_sorted`):
    in length order the micro-batches compute fewer padding positions than as drawn, and never fewer positions than
    the completions hold. In process: the count itself takes a second."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_padding

    results = bench_padding.main(["--quick"])
    assert sorted(results) == ["128/16", "512/64", "64/8"]
    for layout, summary in results.items():
        (drawn, _), (ordered, _) = summary["as drawn"], summary["length order"]
        assert 1.0 <= ordered < 1.2 < 1.5 < drawn < 2.0, (layout, summary)
