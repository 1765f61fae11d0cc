"""What shows, before a run is wasted, whether the critic helps: statistics by response position, and plots.

VC-PPO (arXiv 2503.01491, Figures 2 and 5) diagnoses a biased critic by the mean value and the mean advantage at each
token position: with a critic that has not learned the returns, the advantage drifts with the position instead of
averaging zero everywhere. At every rollout the trainer logs, pooled over all processes:

    by_position/value/<a>-<b>, by_position/advantage/<a>-<b>, by_position/return/<a>-<b>
        the mean over valid tokens whose position t (from 0) falls in [a, b), `num_buckets` buckets of
        `max_completion_length` as equal as whole positions allow (GAE advantages before whitening; the advantage's
        in RL rollouts only: value pretraining computes none)
    advantages/position_correlation
        Pearson's correlation of the advantage with t over all valid tokens (RL rollouts)

`write_plots(output_dir)` draws the training curves and these profiles from the run's `vapo_logs.jsonl`, which the
trainer writes as it logs (each `train()` call's first log writes it anew from the state's history, later ones
append: a running run can be plotted, `trl-vapo plot OUTPUT_DIR`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from .core import AllReduce, exact
from .metric_names import (
    ACCURACY,
    EXPLAINED_VARIANCE,
    POSITION_CORRELATION,
    REWARD,
    RL,
    VALUE_LOSS,
    VALUE_PRETRAIN,
    value_pretraining_end,
)

logger = logging.getLogger(__name__)
_SAID = {"no matplotlib": False}

LOG_FILE = "vapo_logs.jsonl"
PLOTS_DIR = "plots"
PROFILED = {"value": "old_values", "advantage": "raw_advantages", "return": "returns"}


def bucket_edges(max_length: int, num_buckets: int) -> list[int]:
    """`num_buckets + 1` edges splitting positions 0..max_length into buckets as equal as whole positions allow
    (fewer for short lengths: 10 positions in 4 are 0, 2, 5, 8, 10)."""
    count = max(1, min(num_buckets, max_length))
    edges = sorted({round(i * max_length / count) for i in range(count + 1)})
    return edges


def position_profile(
    values: torch.Tensor, mask: torch.Tensor, edges: list[int], all_reduce: AllReduce | None = None
) -> list[float]:
    """The mean of `values` [N, C] over valid tokens in each position bucket [edges[i], edges[i+1]); NaN for an
    empty bucket. The last bucket also holds the positions past the last edge (a `rollout_func`'s completions may
    be longer than `max_completion_length`). Pooled over processes with `all_reduce` (sums and counts, one call)."""
    values = exact(values)
    valid = mask.to(values.device).bool()
    positions = torch.arange(values.shape[1], device=values.device)
    sums, counts = [], []
    for low, high in zip(edges[:-1], edges[1:]):
        below = positions < high if high < edges[-1] else torch.ones_like(positions, dtype=torch.bool)
        in_bucket = valid & ((positions >= low) & below)[None, :]
        sums.append(torch.where(in_bucket, values, 0.0).sum())
        counts.append(exact(in_bucket.sum()))
    totals = torch.stack(sums + counts)
    if all_reduce is not None:
        totals = all_reduce(totals)
    sums, counts = totals[: len(sums)], totals[len(sums) :]
    return [(s / c).item() if c > 0 else math.nan for s, c in zip(sums, counts)]


def position_correlation(values: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce | None = None) -> float:
    """Pearson's correlation between `values` [N, C] and the token position over valid tokens (NaN when either is
    constant). Pooled over processes with `all_reduce`."""
    values = exact(values)
    valid = mask.to(values.device).bool()
    t = exact(torch.arange(values.shape[1], device=values.device))[None, :].expand_as(values)
    x = torch.where(valid, values, 0.0)
    t = torch.where(valid, t, 0.0)
    moments = torch.stack([exact(valid.sum()), x.sum(), t.sum(), (x * x).sum(), (t * t).sum(), (x * t).sum()])
    if all_reduce is not None:
        moments = all_reduce(moments)
    n, sx, st, sxx, stt, sxt = moments.tolist()
    if n < 2:
        return math.nan
    cov = sxt / n - (sx / n) * (st / n)
    var_x, var_t = sxx / n - (sx / n) ** 2, stt / n - (st / n) ** 2
    if var_x <= 1e-12 or var_t <= 1e-12:
        return math.nan
    return cov / math.sqrt(var_x * var_t)


def rollout_diagnostics(rollout, max_length: int, num_buckets: int, all_reduce: AllReduce | None) -> dict[str, float]:
    """The position statistics of a `trl_vapo.rollout.Rollout` (see the module docstring)."""
    edges = bucket_edges(max_length, num_buckets)
    width = len(str(max_length))
    metrics = {}
    for name, attribute in PROFILED.items():
        if name == "advantage" and rollout.phase != RL:
            continue  # value pretraining computes no advantages
        means = position_profile(getattr(rollout, attribute), rollout.loss_mask, edges, all_reduce)
        for low, high, mean in zip(edges[:-1], edges[1:], means):
            metrics[f"by_position/{name}/{low:0{width}d}-{high:0{width}d}"] = mean
    if rollout.phase == RL:
        metrics[POSITION_CORRELATION] = position_correlation(rollout.raw_advantages, rollout.loss_mask, all_reduce)
    return metrics


# ---------------------------------------------------------------------------------------------------------------------
# Logs and plots
# ---------------------------------------------------------------------------------------------------------------------


def finite_or_null(value: Any) -> Any:
    """`value` with each NaN or infinity (in dicts and lists too) made None: strict JSON, which every reader parses
    (`json.dumps` writes `NaN` and `Infinity`, Python's own; GRPOTrainer logs an all-NaN mean as None for JSON
    loggers too). Written with `allow_nan=False`, so that one left is an error, not a file others cannot read."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def strict_json(value: Any, **dumps_kwargs: Any) -> str:
    """`value` as strict JSON (:func:`finite_or_null`): what every file trl-vapo writes for others to read holds."""
    return json.dumps(finite_or_null(value), allow_nan=False, **dumps_kwargs)


def read_logs(output_dir: str | Path) -> list[dict[str, Any]]:
    """The logged entries of a run: one per logging step (the last one per step after a resume re-logged it), then
    the entries without a `phase` (evaluations, the end-of-training summary)."""
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {output_dir} the output_dir of a trl-vapo run?")
    by_step: dict[int, dict] = {}
    extra = []
    text = path.read_text()
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not text.endswith("\n"):  # the line a running run is writing now
                break
            raise ValueError(f"{path}, line {number}: not JSON ({error.msg}): the log is damaged there") from None
        if "phase" in entry:
            by_step[entry["step"]] = entry
        else:
            extra.append(entry)  # evaluations, the end-of-training summary
    return [by_step[step] for step in sorted(by_step)] + extra


CURVES = [
    ("reward", [REWARD]),
    ("accuracy", [ACCURACY]),
    ("completion length", ["completions/mean_length"]),
    ("entropy", ["entropy"]),
    ("value loss", [VALUE_LOSS]),
    ("explained variance", [EXPLAINED_VARIANCE]),
    # (CISPO's capped weights are its `cispo_clip_ratio`, where PPO's upper clip is `clip_ratio/high_mean`)
    ("clip fractions", ["clip_ratio/low_mean", "clip_ratio/high_mean", "cispo_clip_ratio", "value/clip_ratio"]),
    ("advantage / position correlation", [POSITION_CORRELATION]),
]


def write_plots(output_dir: str | Path, logs: list[dict[str, Any]] | None = None) -> list[Path]:
    """Draw `plots/training_curves.png` and `plots/position_profiles.png` in `output_dir` from its logs."""
    # Figures of their own, not pyplot's: `matplotlib.use("Agg")` switched the process's backend for good (a
    # notebook's later `plt.show()` showed nothing), and no display or GUI backend is needed to write a PNG.
    from matplotlib.figure import Figure

    logs = [h for h in (logs if logs is not None else read_logs(output_dir)) if "phase" in h]
    if not logs:
        raise ValueError(f"No training logs in {output_dir} yet.")
    folder = Path(output_dir) / PLOTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    # Value pretraining's steps: from the first to its last log (not the first RL log's: with logging_steps=10, RL's
    # first steps were drawn as value pretraining).
    pretrained_to = value_pretraining_end(logs)

    fig = Figure(figsize=(18, 7.5), constrained_layout=True)
    axes = fig.subplots(2, 4)
    for ax, (title, keys) in zip(axes.flat, CURVES):
        for key in keys:
            points = [
                (h["step"], h[key]) for h in logs if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])
            ]
            if points:
                ax.plot(*zip(*points), marker=".", label=key)
        if pretrained_to is not None:
            ax.axvspan(0.5, pretrained_to + 0.5, color="0.9", zorder=0)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        if len(keys) > 1 and ax.get_legend_handles_labels()[0]:  # a panel with no data yet has nothing to name
            ax.legend(fontsize=7)
    shaded = " (grey: value pretraining)" if pretrained_to is not None else ""
    fig.suptitle(f"{Path(output_dir).name}: training curves{shaded}")
    curves = folder / "training_curves.png"
    fig.savefig(curves, dpi=110)

    fig = Figure(figsize=(16, 4.5), constrained_layout=True)
    axes = fig.subplots(1, 3)
    snapshots = _profile_snapshots(logs)
    for ax, name in zip(axes, PROFILED):
        for i, (label, entry) in enumerate(snapshots):  # one colour per snapshot in every panel
            points = _profile(entry, name)
            if points:
                ax.plot([c for c, _ in points], [m for _, m in points], marker="o", label=label, color=f"C{i}")
        ax.axhline(0.0, color="0.6", linewidth=0.8)
        ax.set_title(f"mean {name} by response position")
        ax.set_xlabel("token position (bucket centre)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("VC-PPO's critic check: a biased critic shows as advantages that drift with the position")
    profiles = folder / "position_profiles.png"
    fig.savefig(profiles, dpi=110)
    return [curves, profiles]


def write_plots_if_possible(output_dir: str | Path, logs: list[dict[str, Any]]) -> None:
    """`write_plots` for a running trainer: skipped without matplotlib or logs, and never raising (a figure must not
    cost a run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if not _SAID["no matplotlib"]:  # once a process: each run drew at value pretraining's end and at its own
            _SAID["no matplotlib"] = True
            logger.warning("plot_diagnostics: matplotlib is not installed (`pip install matplotlib`); no PNGs.")
        return
    if not any("phase" in entry for entry in logs):
        return  # nothing logged yet
    try:
        write_plots(output_dir, logs)
    except Exception as error:
        logger.warning(f"Could not draw the diagnostic plots ({type(error).__name__}: {error}).")


class CriticBiasWatch:
    """Warns once when, after value pretraining, the advantage stays strongly correlated with the token position:
    `readings` consecutive RL rollouts beyond `threshold` either way (a biased critic's drift takes the rewards' sign:
    with rewards of -1 at low accuracy it is negative; a NaN reading is skipped, and any reading within the threshold
    starts the count again). The count and whether it warned are the run's `TrainingProgress`'s, which a checkpoint
    holds (kept here, a resume counted from 0 again, and warned again)."""

    def __init__(self, threshold: float = 0.5, readings: int = 3):
        self.threshold, self.readings = threshold, readings

    def update(self, correlation: float, progress) -> None:
        """One RL rollout's reading; `progress`: the run's `TrainingProgress`."""
        if progress.critic_bias_warned or not math.isfinite(correlation):
            return
        progress.critic_bias_run = progress.critic_bias_run + 1 if abs(correlation) > self.threshold else 0
        if progress.critic_bias_run >= self.readings:
            progress.critic_bias_warned = True
            logger.warning(
                f"The advantage is strongly correlated with the token position ({correlation:.2f}, and beyond "
                f"±{self.threshold} for {self.readings} rollouts): the critic is biased (VC-PPO, Fig. 5), and its "
                "advantages push whole completions rather than the tokens that decide them. Pretrain it longer "
                "(value_pretrain_steps), raise critic_learning_rate, or check lam_critic=1.0; see by_position/* and "
                "output_dir/plots/."
            )


def _profile(entry: dict[str, Any], name: str) -> list[tuple[float, float]]:
    prefix = f"by_position/{name}/"
    points = []
    for key, value in entry.items():
        if key.startswith(prefix) and isinstance(value, (int, float)) and math.isfinite(value):
            low, high = (int(x) for x in key[len(prefix) :].split("-"))
            points.append(((low + high - 1) / 2, value))
    return sorted(points)


def _profile_snapshots(logs: list[dict[str, Any]]) -> list[tuple[str, dict]]:
    """A few logged entries to draw the profiles of: end of value pretraining, first and last RL logs."""
    with_profile = [h for h in logs if any(k.startswith("by_position/") for k in h)]
    pretraining = [h for h in with_profile if h["phase"] == VALUE_PRETRAIN]
    rl = [h for h in with_profile if h["phase"] == RL]
    snapshots = []
    if pretraining:
        snapshots.append((f"end of value pretraining (step {pretraining[-1]['step']})", pretraining[-1]))
    if rl:
        snapshots.append((f"first RL log (step {rl[0]['step']})", rl[0]))
        if len(rl) > 2:
            snapshots.append((f"mid RL (step {rl[len(rl) // 2]['step']})", rl[len(rl) // 2]))
        if len(rl) > 1:
            snapshots.append((f"last RL log (step {rl[-1]['step']})", rl[-1]))
    return snapshots
