"""Can the critic learn? Value pretraining alone, with the policy frozen, probed rollout by rollout.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_critic.py --jobs 2          # every probe, then the table
    .venv/bin/python benchmarks/bench_critic.py --quick --out /tmp/critic            # smoke test, < 1 minute

``bench_learning.py`` found the critic's explained variance near 0 after value pretraining and through RL, on both
tasks. This benchmark asks whether that is the task or the critic. Each probe trains the critic of the learning
benchmark's VAPO recipe (the chains task's cold-start model, tuning seed 1000: this is tuning, never reported) for
``--rollouts`` value-pretraining rollouts of 64 samples with one critic setting, and records on every rollout,
*before* the critic trains on it (so on samples it has never seen):

* ``ev``: the critic's explained variance of the returns, what the trainer logs as ``value/explained_variance``;
* ``oracle_ev``: the explained variance reached by a critic that knows one thing, whether a step of the chain has
  already slipped (``trl_vapo.demo.chains.first_wrong_index``), and predicts the mean return of its class: a lower
  bound on what a critic able to check the arithmetic would reach, not the most a critic can explain (one that also
  knows the prompt can do better);
* ``drop_at_slip``: the mean change of the value across the decisive token of wrong chains, V(s_{w+1}) - V(s_w), and
  ``mean_abs_step`` the mean |V(s_{t+1}) - V(s_t)| elsewhere: a critic that locates slips drops there;
* ``exact_ev`` and ``exact_drop``: the same two for the exact value P(correct | prompt, prefix) on the same rollout
  (``trl_vapo.demo.oracle``, at the hazards measured on it): the most a critic can explain, and the drop a critic
  that locates slips shows. (Records written before these two existed lack them; the table shows ``nan``.)

The table gives each statistic averaged over the last five rollouts and the best five-rollout mean of ``ev``;
``--out`` also gets the per-rollout records (JSON) and ``critic_probe.png`` (five-rollout means against rollouts).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_learning as bl  # noqa: E402
from _launch import run_dir, worker_env  # noqa: E402

# name: VAPOConfig fields of the critic; "-xN": N passes over each value-pretraining rollout; "-mb8": optimizer
# steps of 8 samples instead of 16 (eight per pass); "-rK": value pretraining's replay of the K rollouts before. The
# records of seeds 1000-1001 were written when the passes were set through num_iterations (and
# critic_num_iterations), which value pretraining then followed: the same runs.
PROBES: dict[str, dict] = {
    "lr1e-3": {"critic_learning_rate": 1e-3},  # the learning benchmark's recipe
    "lr3e-4": {"critic_learning_rate": 3e-4},
    "lr3e-3": {"critic_learning_rate": 3e-3},
    "lr1e-3-x4": {"critic_learning_rate": 1e-3, "value_pretrain_num_iterations": 4},
    "lr3e-4-x4": {"critic_learning_rate": 3e-4, "value_pretrain_num_iterations": 4},
    "lr3e-4-x8": {"critic_learning_rate": 3e-4, "value_pretrain_num_iterations": 8},
    "lr1e-4-x8": {"critic_learning_rate": 1e-4, "value_pretrain_num_iterations": 8},
    "lr1e-4-x16": {"critic_learning_rate": 1e-4, "value_pretrain_num_iterations": 16},
    "lr1e-4-x8-mb8": {
        "critic_learning_rate": 1e-4,
        "value_pretrain_num_iterations": 8,
        "per_device_train_batch_size": 8,
        "steps_per_generation": 8,
    },
    "lr1e-4-x8-r7": {"critic_learning_rate": 1e-4, "value_pretrain_num_iterations": 8, "value_pretrain_replay": 7},
    "lr3e-4-x4-r7": {"critic_learning_rate": 3e-4, "value_pretrain_num_iterations": 4, "value_pretrain_replay": 7},
    "lr3e-4-x8-r14": {"critic_learning_rate": 3e-4, "value_pretrain_num_iterations": 8, "value_pretrain_replay": 14},
    "lr3e-4-x8-r7": {"critic_learning_rate": 3e-4, "value_pretrain_num_iterations": 8, "value_pretrain_replay": 7},
    "lr1e-3-x4-r14": {"critic_learning_rate": 1e-3, "value_pretrain_num_iterations": 4, "value_pretrain_replay": 14},
    "lr1e-4-x16-r14": {"critic_learning_rate": 1e-4, "value_pretrain_num_iterations": 16, "value_pretrain_replay": 14},
    "lr3e-4-x16-r14": {"critic_learning_rate": 3e-4, "value_pretrain_num_iterations": 16, "value_pretrain_replay": 14},
    # The shared-base critic: a LoRA adapter of rank `lora_r` on every linear layer of the policy's frozen base, and a
    # value head (the policy gets an adapter of its own, which value pretraining leaves at its zero start); eight
    # passes, replay of 7.
    **{
        f"lora{rank}-lr{lr}-x8-r7": {
            "lora_r": rank,
            "critic_learning_rate": float(lr),
            "value_pretrain_num_iterations": 8,
            "value_pretrain_replay": 7,
        }
        for rank, lr in ((16, "1e-3"), (16, "3e-4"), (4, "1e-3"), (64, "1e-3"), (16, "3e-3"))
    },
}
TUNING_SEEDS = bl.CRITIC_PROBE_SEEDS
"""Seeds a probe may run with (``--seed``): the benchmark's tuning seed and two more, never reporting seeds."""
SETTINGS_FILE = "probe_settings.json"  # the seed and the rollouts of the records in a folder
LAST = 5  # the table averages the last five rollouts


def probe_stats(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    first_wrong: Sequence[int | None],
    exact: torch.Tensor | None = None,
) -> dict[str, float]:
    """One rollout's statistics (see the module docstring). ``values``, ``returns``, ``mask``: ``[N, C]``, V(s_t)
    read before token t; ``first_wrong[i]``: index of completion i's decisive token, None when it has none;
    ``exact``: the oracle's values of the same completions (``exact_ev``, ``exact_drop``; NaN without)."""
    from trl_vapo.core import explained_variance

    mask = mask.float()
    lengths = mask.sum(dim=1).long().tolist()
    slipped = torch.zeros_like(mask)
    steps = []
    for i, wrong_at in enumerate(first_wrong):
        length = lengths[i]
        v = values[i, :length].float()
        step = (v[1:] - v[:-1]).abs()
        if wrong_at is not None and wrong_at + 1 < length:
            slipped[i, wrong_at + 1 : length] = 1.0
            step = torch.cat([step[:wrong_at], step[wrong_at + 1 :]])
        steps += step.tolist()
    oracle = torch.zeros_like(returns, dtype=torch.float32)
    for group in (slipped, (1 - slipped) * mask):
        group = group * mask
        if group.sum() > 0:
            oracle += group * ((returns.float() * group).sum() / group.sum())
    return {
        "ev": float(explained_variance(values, returns, mask)),
        "oracle_ev": float(explained_variance(oracle, returns, mask)),
        "drop_at_slip": bl.value_drop_at_first_wrong(values.float().tolist(), first_wrong, lengths),
        "exact_ev": math.nan if exact is None else float(explained_variance(exact, returns, mask)),
        "exact_drop": math.nan
        if exact is None
        else bl.value_drop_at_first_wrong(exact.float().tolist(), first_wrong, lengths),
        "mean_abs_step": statistics.mean(steps) if steps else math.nan,
        "slipped_share": float((slipped * mask).sum() / mask.sum()),
        "reward": float(returns[:, 0].mean()),
    }


class Probe(TrainerCallback):
    """Records ``probe_stats`` of every value-pretraining rollout, as the trainer built it (before any update), and
    stops the run at the ``last``-th: the critic's training on it, and the RL rollout after, are never read."""

    def __init__(self, tokenizer, last: int):
        self.tokenizer = tokenizer
        self.last = last
        self.records: list[dict[str, float]] = []

    def on_rollout(self, args, state, control, *, rollout, rows, **kwargs):
        if rollout.phase != "value_pretrain":
            return control
        from trl_vapo.demo.chains import first_wrong_index
        from trl_vapo.demo.oracle import OracleValue

        lengths = rollout.lengths.tolist()
        texts = bl.completion_texts(self.tokenizer, rollout.completion_ids, lengths)
        first_wrong = [first_wrong_index(row["prompt"], text) for row, text in zip(rows, texts)]
        ids, attention = rollout.input_ids, rollout.attention_mask
        exact = OracleValue(self.tokenizer)(ids, attention, ids.shape[1] - rollout.prompt_length)
        self.records.append(probe_stats(rollout.old_values, rollout.returns, rollout.loss_mask, first_wrong, exact))
        if len(self.records) == self.last:
            control.should_training_stop = True
        return control


def run_probe(name: str, rollouts: int, seed: int = TUNING_SEEDS[0]) -> list[dict[str, float]]:
    """Value-pretrain the chains critic with probe ``name`` for ``rollouts`` rollouts from tuning seed ``seed``; one
    record per rollout."""
    if seed not in TUNING_SEEDS:
        raise ValueError(f"seed {seed} is not a tuning seed {TUNING_SEEDS}: probes are tuning, never reporting runs")
    torch.set_num_threads(1)
    from trl_vapo.rewards import math_reward

    extra = dict(PROBES[name])
    actor_lr = 1e-4  # unused: the policy is frozen while the critic pretrains
    spec = bl.RunSpec(
        stage="tune", task="chains", method="vapo", seed=seed, learning_rate=actor_lr, rollouts=rollouts + 1,
        eval_every=rollouts, eval_k=1, eval_problems=0, eval_set="validation", value_pretrain_steps=rollouts,
    )  # fmt: skip
    out_dir = run_dir(f"bench_critic_{name}_")
    trainer, _ = bl.build_trainer(spec, out_dir, math_reward, extra)
    probe = Probe(trainer.processing_class, last=rollouts)
    trainer.add_callback(probe)
    trainer.train()  # the rollouts of value pretraining (the plan's RL rollout after them is never reached)
    return probe.records


def window_means(series: Sequence[float], width: int = LAST) -> list[float]:
    """Mean of each reading with the ``width - 1`` before it (fewer at the start)."""
    return [statistics.mean(series[max(0, i - width + 1) : i + 1]) for i in range(len(series))]


def summarize(records: dict[str, list[dict]], seed: int = TUNING_SEEDS[0]) -> str:
    keys = ("ev", "oracle_ev", "exact_ev", "drop_at_slip", "exact_drop", "mean_abs_step", "slipped_share")
    lines = [
        f"chains, value pretraining only (policy frozen), tuning seed {seed}: each statistic averaged over the "
        f"last {LAST} rollouts, measured before the critic trains on them; 'best ev' the highest {LAST}-rollout mean "
        "and the rollout it ends at",
        f"{'probe':<12}{'rollouts':>9}" + "".join(f"{k:>15}" for k in keys) + f"{'best ev':>10}{'at':>5}",
    ]
    for name, runs in records.items():
        tail = runs[-LAST:]
        finite = [[r[k] for r in tail if not math.isnan(r.get(k, math.nan))] for k in keys]
        means = [statistics.mean(values) if values else math.nan for values in finite]
        smoothed = window_means([r["ev"] for r in runs])
        best = max(range(len(smoothed)), key=smoothed.__getitem__)
        lines.append(
            f"{name:<12}{len(runs):>9}"
            + "".join(f"{m:>15.3f}" for m in means)
            + f"{smoothed[best]:>10.3f}{best + 1:>5d}"
        )
    return "\n".join(lines)


def plot(records: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in records.items():
        ax.plot(range(1, len(runs) + 1), window_means([r["ev"] for r in runs]), label=name)
    oracle = [statistics.mean(r["oracle_ev"] for r in runs) for runs in zip(*records.values())]
    ax.plot(range(1, len(oracle) + 1), window_means(oracle), "k--", label="oracle (knows if a step slipped)")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("value-pretraining rollout (64 samples each)")
    ax.set_ylabel(f"explained variance on the fresh rollout\n(mean of the last {LAST} rollouts)")
    ax.set_title("chains: can the critic learn? (policy frozen)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "critic")
    parser.add_argument("--probes", help="comma-separated subset of " + ",".join(PROBES))
    parser.add_argument("--rollouts", type=int, default=30, help="value-pretraining rollouts of 64 per probe")
    parser.add_argument("--jobs", type=int, default=1, help="probes at once (one thread each)")
    parser.add_argument("--quick", action="store_true", help="one probe, 2 rollouts, in this process")
    parser.add_argument("--seed", type=int, default=TUNING_SEEDS[0], help=f"a tuning seed, one of {TUNING_SEEDS}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        path = args.out / f"{args.worker}.json"
        path.write_text(json.dumps(run_probe(args.worker, args.rollouts, args.seed)))
        return 0
    names = args.probes.split(",") if args.probes else list(PROBES)
    if args.quick:
        names, args.rollouts = names[:1], 2
    if args.seed not in TUNING_SEEDS:
        parser.error(f"--seed {args.seed} is not a tuning seed {TUNING_SEEDS}")
    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        parser.error(f"unknown probes {unknown}; choose from {', '.join(PROBES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    # A probe whose record is there is not run again: the records must be of this seed and length (they hold neither).
    settings_file, settings = args.out / SETTINGS_FILE, {"seed": args.seed, "rollouts": args.rollouts}
    recorded = json.loads(settings_file.read_text()) if settings_file.exists() else None
    if recorded != settings and (recorded is not None or any(args.out.glob("*.json"))):
        parser.error(
            f"{args.out} holds probe records of {recorded or 'unknown settings (no ' + SETTINGS_FILE + ')'}, which "
            f"this run would reuse as {settings}'s: give another --out, or the settings they ran with"
        )
    settings_file.write_text(json.dumps(settings) + "\n")

    def launch(name: str) -> int:
        if (args.out / f"{name}.json").exists():
            return 0
        if args.quick:  # in this process: a fresh interpreter's imports would take as long as the probe
            (args.out / f"{name}.json").write_text(json.dumps(run_probe(name, args.rollouts, args.seed)))
            return 0
        cmd = [sys.executable, __file__, "--worker", name, "--rollouts", str(args.rollouts), "--out", str(args.out)]
        cmd += ["--seed", str(args.seed)]
        with open(args.out / f"{name}.log", "w") as log:
            return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env()).returncode

    with ThreadPoolExecutor(args.jobs) as pool:
        failed = [n for n, rc in zip(names, pool.map(launch, names)) if rc != 0]
    if failed:
        print(f"probes failed: {failed}; see their .log in {args.out}", file=sys.stderr)
        return 1
    records = {n: json.loads((args.out / f"{n}.json").read_text()) for n in names}
    table = summarize(records, args.seed)
    (args.out / "table.txt").write_text(table + "\n")
    plot(records, args.out / "critic_probe.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
