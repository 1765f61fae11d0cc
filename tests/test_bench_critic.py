"""The critic probe (``benchmarks/bench_critic.py``): its statistics against a direct computation, and its
``--quick`` run (in this process: its own would spend most of its time importing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_critic import TUNING_SEEDS, main, probe_stats, run_probe  # noqa: E402


def test_probe_stats_match_a_direct_computation():
    # Three completions: wrong with its decisive token at index 1 (length 4), correct (length 3), wrong but cut
    # before its slip could be located (length 2, no decisive token known).
    values = torch.tensor([[0.0, 0.1, -0.7, -0.9], [0.2, 0.4, 0.8, 9.0], [0.0, -0.2, 9.0, 9.0]])
    returns = torch.tensor([[-1.0] * 4, [1.0] * 4, [-1.0] * 4])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    stats = probe_stats(values, returns, mask, [1, None, None])

    valid = mask.bool()
    g, v = returns[valid], values[valid]
    assert stats["ev"] == pytest.approx(float(1 - (g - v).var(unbiased=False) / g.var(unbiased=False)), abs=1e-6)
    # Slipped: row 0 at t = 2, 3 (returns -1, -1). Not yet: the other 7 tokens, returns -1, -1 | 1, 1, 1 | -1, -1.
    p = -1 / 7
    oracle = torch.tensor([p, p, -1.0, -1.0, p, p, p, p, p])
    assert stats["oracle_ev"] == pytest.approx(float(1 - (g - oracle).var(unbiased=False) / g.var(unbiased=False)))
    assert stats["drop_at_slip"] == pytest.approx(-0.8)  # V(s_2) - V(s_1)
    # |steps| elsewhere: row 0 (0.1, 0.2), row 1 (0.2, 0.4), row 2 (0.2)
    assert stats["mean_abs_step"] == pytest.approx((0.1 + 0.2 + 0.2 + 0.4 + 0.2) / 5)
    assert stats["slipped_share"] == pytest.approx(2 / 9)
    assert stats["exact_ev"] != stats["exact_ev"] and stats["exact_drop"] != stats["exact_drop"]  # NaN: not given
    # The exact value's statistics, from the oracle's values of the same completions.
    exact = torch.tensor([[-0.2, -0.2, -1.0, -1.0], [0.5, 1.0, 1.0, 0.0], [-0.4, -0.4, 0.0, 0.0]])
    stats = probe_stats(values, returns, mask, [1, None, None], exact)
    e = exact[valid]
    assert stats["exact_ev"] == pytest.approx(float(1 - (g - e).var(unbiased=False) / g.var(unbiased=False)), abs=1e-6)
    assert stats["exact_drop"] == pytest.approx(-0.8)  # -1.0 - (-0.2)


def test_probes_run_on_tuning_seeds_only():
    assert 1000 in TUNING_SEEDS and not set(TUNING_SEEDS) & {0, 1, 2, 2000, 2001, 2002, 2003, 2004}
    with pytest.raises(ValueError, match="seed 2000 is not a tuning seed"):
        run_probe("lr1e-3", rollouts=1, seed=2000)


def test_records_of_another_seed_or_length_are_not_reused_under_this_one(tmp_path, capsys):
    """A probe whose record is in `--out` is not run again, and records hold neither seed nor length: `--seed 1001`
    into a folder of seed 1000's took them as its own and labelled the table 1001, and a full run took `--quick`'s
    2-rollout records. The folder says both (`probe_settings.json`)."""
    from bench_critic import SETTINGS_FILE

    (tmp_path / "lr1e-3.json").write_text("[]")
    for recorded, says in ((None, "unknown settings"), ({"seed": 1000, "rollouts": 30}, "{'seed': 1000")):
        if recorded:
            (tmp_path / SETTINGS_FILE).write_text(json.dumps(recorded))
        for run in (["--seed", "1001"], ["--seed", "1000", "--rollouts", "40"]):
            with pytest.raises(SystemExit) as stop:
                main(["--out", str(tmp_path), *run, "--probes", "lr1e-3"])
            assert stop.value.code == 2 and f"holds probe records of {says}" in capsys.readouterr().err


def test_quick_probe_trains_the_critic_and_writes_the_table(tmp_path):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "lr1e-3.json").read_text())
    assert len(records) == 2  # one per value-pretraining rollout
    assert all(-5 < r["ev"] <= 1 and 0 <= r["oracle_ev"] <= 1 and 0 < r["slipped_share"] < 1 for r in records)
    assert records[1]["ev"] > records[0]["ev"]  # the critic learned from the first rollout (-0.109 -> -0.045)
    assert all(0 < r["exact_ev"] <= 1 and r["exact_drop"] < 0 for r in records)  # the exact value, at each slip
    assert "lr1e-3" in (tmp_path / "table.txt").read_text()
    assert (tmp_path / "critic_probe.png").stat().st_size > 10_000
