"""The critic diagnostics: statistics by response position against direct computations, and the plots of a run."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from helpers import first_char_is_letter, make_args, prompts_dataset

from trl_vapo import VAPOTrainer
from trl_vapo.cli import main as cli_main
from trl_vapo.diagnostics import (
    LOG_FILE,
    CriticBiasWatch,
    bucket_edges,
    position_correlation,
    position_profile,
    read_logs,
    write_plots,
)


def batch(seed=0, rows=5, width=11):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    values = torch.randn(rows, width, generator=g)
    values[~mask.bool()] = math.nan  # padding must not leak into any statistic
    return values, mask


def test_bucket_edges_split_the_completion_length():
    assert bucket_edges(96, 8) == [0, 12, 24, 36, 48, 60, 72, 84, 96]
    assert bucket_edges(10, 4) == [0, 2, 5, 8, 10]
    assert bucket_edges(3, 8) == [0, 1, 2, 3]  # no empty buckets for short completions


def test_position_profile_matches_a_direct_loop():
    values, mask = batch()
    edges = [0, 3, 7, 11]
    expected = []
    for low, high in zip(edges[:-1], edges[1:]):
        picked = [values[i, t].item() for i in range(values.shape[0]) for t in range(low, high) if mask[i, t]]
        expected.append(sum(picked) / len(picked) if picked else math.nan)
    got = position_profile(values, mask, edges)
    assert got == pytest.approx(expected, nan_ok=True)
    # Positions past the last edge (a rollout_func's completions longer than max_completion_length) count in the last
    # bucket, [3, 7) here.
    last = [values[i, t].item() for i in range(values.shape[0]) for t in range(3, values.shape[1]) if mask[i, t]]
    assert position_profile(values, mask, [0, 3, 7])[-1] == pytest.approx(sum(last) / len(last))


def test_position_statistics_pool_over_processes():
    """Two simulated processes: each statistic's all-reduce adds the other process's sums, and the result equals the
    statistic of the two batches together."""
    (v1, m1), (v2, m2) = batch(seed=1), batch(seed=2)
    edges = [0, 4, 8, 11]

    def local_sums(statistic, values, mask):
        captured = []
        statistic(values, mask, all_reduce=lambda sums: captured.append(sums) or sums)
        return captured[0]

    for statistic, args in ((position_profile, (edges,)), (position_correlation, ())):

        def bound(values, mask, all_reduce=None, statistic=statistic, args=args):
            return statistic(values, mask, *args, all_reduce=all_reduce)

        other = local_sums(bound, v2, m2)
        pooled = bound(v1, m1, all_reduce=lambda sums, other=other: sums + other)
        together = bound(torch.cat([v1, v2]), torch.cat([m1, m2]))
        assert pooled == pytest.approx(together, nan_ok=True)


def test_position_correlation_is_pearsons_over_valid_tokens():
    values, mask = batch(seed=3, rows=8, width=9)
    positions = torch.arange(9.0)[None, :].expand_as(values)
    x, t = values[mask.bool()].double(), positions[mask.bool()].double()
    expected = torch.corrcoef(torch.stack([x, t]))[0, 1].item()
    assert position_correlation(values, mask) == pytest.approx(expected, rel=1e-9)
    # Advantages that grow with the position (a biased critic) correlate strongly; constant ones have no correlation.
    assert position_correlation(positions + 0.1 * values.nan_to_num(0), mask) > 0.9
    assert math.isnan(position_correlation(torch.ones_like(values), mask))


def test_a_run_logs_position_profiles_and_draws_them(tiny_model_dir, tmp_path, capsys):
    args = make_args(
        tmp_path,
        plot_diagnostics=True,
        max_steps=3,
        value_pretrain_steps=2,
        value_pretrain_patience=None,
        max_completion_length=8,
        diagnostic_position_buckets=4,
    )
    trainer = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=first_char_is_letter, args=args, train_dataset=prompts_dataset()
    )
    trainer.train()
    out = tmp_path / "out"
    logs = read_logs(out)
    steps = [h for h in logs if "phase" in h]
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5]
    pretraining, rl = steps[0], steps[-1]
    assert {k for k in pretraining if k.startswith("by_position/value/")} == {
        f"by_position/value/{a}-{b}" for a, b in (("0", "2"), ("2", "4"), ("4", "6"), ("6", "8"))
    }
    assert not any(k.startswith("by_position/advantage/") for k in pretraining)  # no advantages while pretraining
    assert any(k.startswith("by_position/advantage/") for k in rl) and "advantages/position_correlation" in rl
    # A trainer built on the finished run's folder, evaluating: its log is added to the file, which it replaced (the
    # run's curves gone: `trl-vapo plot` found no training logs).
    later = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=first_char_is_letter, args=args, train_dataset=prompts_dataset()
    )
    later.evaluate(prompts_dataset(4))
    logs = read_logs(out)
    assert [h["step"] for h in logs if "phase" in h] == [1, 2, 3, 4, 5] and any("eval_reward" in h for h in logs)
    plots = out / "plots"
    assert {p.name for p in plots.glob("*.png")} == {"training_curves.png", "position_profiles.png"}

    from PIL import Image

    for png in plots.glob("*.png"):
        assert Image.open(png).size[0] > 1000
        png.unlink()
    # `trl-vapo plot` redraws them from the logs alone.
    assert cli_main(["plot", str(out)]) == 0
    assert {p.name for p in plots.glob("*.png")} == {"training_curves.png", "position_profiles.png"}
    assert (out / LOG_FILE).is_file()
    assert cli_main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # A running run's log ends in the line it is writing: plotted without it. A damaged line elsewhere is named.
    log = (out / LOG_FILE).read_text()
    (out / LOG_FILE).write_text(log + '{"step": 6, "phase": "r')
    assert cli_main(["plot", str(out)]) == 0
    lines = log.splitlines()
    (out / LOG_FILE).write_text("\n".join([*lines[:2], '{"step": 3, "pha', *lines[3:]]) + "\n")
    assert cli_main(["plot", str(out)]) == 2
    assert f"{out / LOG_FILE}, line 3: not JSON" in capsys.readouterr().err
    (out / LOG_FILE).write_text(log)
    shutil.rmtree(plots)
    plots.write_text("")  # where the PNGs go, a file: one line, not a traceback
    assert cli_main(["plot", str(out)]) == 2
    assert capsys.readouterr().err.startswith("trl-vapo plot: error: ")


def test_the_grey_band_covers_value_pretrainings_steps_and_no_rl_step(tmp_path, monkeypatch):
    """Logged every 10 steps, value pretraining that ended at step 13 (its last readings logged there): the band ran
    from the first log (step 10, not 1) to the first RL log (step 20), shading RL's steps 14-19. matplotlib's
    `axvspan` is watched (the band is in the PNG's pixels)."""
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    spans, axvspan = [], Axes.axvspan
    monkeypatch.setattr(Axes, "axvspan", lambda self, *a, **k: spans.append(a[:2]) or axvspan(self, *a, **k))
    titles, suptitle = [], Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda self, t, **k: titles.append(t) or suptitle(self, t, **k))
    logs = [{"step": 10, "phase": "value_pretrain"}, {"step": 13, "phase": "value_pretrain"}]
    logs += [{"step": 20, "phase": "rl", "reward": 0.5}]
    write_plots(tmp_path, logs)
    assert spans and set(spans) == {(0.5, 13.5)}
    assert titles[0].endswith("training curves (grey: value pretraining)")
    spans.clear()
    # No value pretraining: no band, and the title names none. CISPO's clip fraction has a curve of its own.
    labels, plot = [], Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **k: labels.append(k.get("label")) or plot(self, *a, **k))
    write_plots(tmp_path, [{"step": 10, "phase": "rl", "reward": 0.5, "cispo_clip_ratio": 0.1}])
    assert spans == [] and titles[-2].endswith("training curves")  # (the last: the position profiles')
    assert "cispo_clip_ratio" in labels


def test_without_matplotlib_a_run_says_so_once(tmp_path, monkeypatch, caplog):
    """Each run draws at value pretraining's end and at its own: without matplotlib (the `plot` extra), the line
    that says there are no PNGs came twice a run. A warning (it was said at INFO, which a Python script does not
    show: `plot_diagnostics` is on by default, and no PNG came without a word)."""
    import logging
    import sys

    from trl_vapo import diagnostics

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setitem(diagnostics._SAID, "no matplotlib", False)
    with caplog.at_level(logging.WARNING, logger="trl_vapo.diagnostics"):
        for _ in range(2):
            diagnostics.write_plots_if_possible(tmp_path, [{"phase": "rl", "step": 1}])
    assert [r.getMessage() for r in caplog.records].count(
        "plot_diagnostics: matplotlib is not installed (`pip install matplotlib`); no PNGs."
    ) == 1


def test_drawing_leaves_the_processs_matplotlib_backend_as_it_was(tmp_path):
    """A notebook (or a script with pyplot imported) keeps its backend: the plots' `matplotlib.use("Agg")` switched
    it for the rest of the process, and a later `plt.show()` showed nothing."""
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    plt.switch_backend("svg")  # (any backend other than Agg stands for a notebook's)
    try:
        written = write_plots(tmp_path, [{"step": 1, "phase": "rl", "reward": 0.5}])
        assert matplotlib.get_backend() == "svg" and not plt.get_fignums()
    finally:
        plt.switch_backend(before)
    assert [p.read_bytes()[:8] for p in written] == [b"\x89PNG\r\n\x1a\n"] * 2


def test_a_critic_bias_that_survives_value_pretraining_is_warned_about(caplog):
    from trl_vapo.run import TrainingProgress

    watch, progress = CriticBiasWatch(threshold=0.5, readings=3), TrainingProgress()
    with caplog.at_level("WARNING"):
        for correlation in (0.7, 0.2, 0.8, float("nan"), 0.9):
            watch.update(correlation, progress)
        assert "critic is biased" not in caplog.text  # 0.2 broke the run of strong readings; NaN is skipped
        # The count is the run's progress, which a checkpoint holds: resumed here, it goes on (it began at 0).
        progress = TrainingProgress.from_dict(json.loads(json.dumps(dataclasses.asdict(progress))))
        assert progress.critic_bias_run == 2
        watch.update(0.75, progress)
        assert caplog.text.count("critic is biased") == 1 and "0.75" in caplog.text
        watch.update(0.95, TrainingProgress.from_dict(dataclasses.asdict(progress)))
    assert caplog.text.count("critic is biased") == 1  # said once, a resumed run too
    # The drift takes the rewards' sign: negative where most rewards are -1 (it went unsaid).
    watch, progress = CriticBiasWatch(threshold=0.5, readings=3), TrainingProgress()
    caplog.clear()
    with caplog.at_level("WARNING"):
        for correlation in (-0.7, -0.3, -0.8, -0.6, -0.9):
            watch.update(correlation, progress)
    assert caplog.text.count("critic is biased") == 1 and "(-0.90, and beyond ±0.5 for 3 rollouts)" in caplog.text
