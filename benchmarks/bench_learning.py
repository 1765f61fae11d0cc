"""What the critic buys: held-out accuracy per sample and per second, VAPO and its ablations against PPO and GRPO.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_learning.py --jobs 2                 # tune, report, aggregate
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_learning.py --stage tune --methods ppo --jobs 2 \
        --out benchmarks/learning/protocol2                                                   # protocol 2's records
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_learning.py --stage report --tasks chains --methods vapo,grpo
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_learning.py --stage report --jobs 2 \
        --methods oracle-64x1,critic-free-64x1,best-grpo --out benchmarks/learning/protocol2     # the decisive arms
    .venv/bin/python benchmarks/bench_learning.py --stage aggregate                          # table and plots only
    .venv/bin/python benchmarks/bench_learning.py --quick --out /tmp/quick                   # smoke test, < 1 minute

Each run is a fresh single-threaded subprocess (``--jobs 2`` runs two at once) that trains one method on one task
with one seed and writes ``<out>/<stage>/<task>/<method>/<run>.json``: its learning curve (samples generated,
training wall time, held-out avg@k at each evaluation point), the credit-assignment statistics of every RL rollout
and the trainer's log history. The driver skips runs whose JSON exists, so an interrupted benchmark resumes where it
stopped; ``aggregate`` reads every finished run, prints the table and writes ``table.txt``, ``summary.json`` and the
plots ``learning_vs_samples.png`` and ``learning_vs_time.png`` (one panel per task) into ``--out``.

The protocol below is written before the reporting runs it governs; ``PROTOCOL`` holds its numbers and every run
records them. Protocol 1 (reporting seeds 0, 1, 2; the committed results in ``benchmarks/learning/``) was fixed
before any result was seen but named no primary metric and no decision rule; protocol 2 adds them, with fresh seeds,
and was written after protocol 1's results and before any of its own reporting runs.

Protocol
--------
The numbers (``PROTOCOL``): 35 rollouts x 64 = 2,240 training samples per run; tuning seed 1000; reporting seeds
2000-2004, at least five per arm, never a tuning seed and never a seed already reported (``spent_seeds``: 0, 1, 2);
actor learning rates 3e-5, 1e-4 and 3e-4 swept; evaluation every 5 rollouts (320 samples), avg@4 on 200 held-out
problems (tuning: the next 200).

Primary metrics, per run: the final held-out avg@k, and the area under the held-out curve (the trapezoid area of
avg@k against training samples over the evaluation points, 0 to the budget, divided by the budget: the run's mean
avg@k; points during value pretraining carry the start's score, so samples spent there count). Each is averaged over
the reporting seeds; a difference between two arms, which run the same seeds, is the mean of the per-seed
differences with its 95% t interval (n - 1 degrees of freedom; ``paired_difference``, in ``table.txt`` and
``summary.json``). Rule: an arm is "better" only when that interval excludes 0;
otherwise the result is "no measurable difference". The primary comparisons are VAPO (as tuned) against GRPO and PPO
against GRPO, per task, on both metrics; ablations against VAPO are secondary. Intervals are not corrected for the
number of comparisons; the write-up states that number. Training time is secondary and is reported per arm with
the variant that ran.

Amended on 2026-11-26, before any reporting run (``PROTOCOL["amendments"]``): the primary comparator is the
best-tuned GRPO, not GRPO 8x8: of the three GRPO arms, the one whose frozen choice scored best on validation by the
tuning criterion (a tie: the larger group), frozen in ``chosen.json`` as ``best-grpo`` when all three are tuned
(``--methods best-grpo`` reports it; ``aggregate`` compares every arm with it). The decisive arms, ``oracle-64x1``,
``critic-free-64x1`` and the best-tuned GRPO, get 10 reporting seeds (2000-2009): 5 seeds gave intervals of
half-width about 0.05. ``no-group-sampling`` stays an untuned ablation (VAPO's choice), which every table labels
("(untuned)"); it is not a primary comparison. ``--seeds`` refuses the tuning and spent seeds, and a reporting
arm whose frozen choice is missing is refused before any run.

Methods, on top of the task's VAPO recipe (``VAPO_RECIPE``: the demo's recipe when the protocol was fixed; 8
prompts x 8 samples per rollout, 4 optimizer steps of 16 per rollout, actor lr 1e-4, critic lr 1e-3, length-adaptive
alpha 0.5, 15 value-pretraining rollouts): ``vapo``; the paper's ablations, each switching one technique off
(``METHODS``); ``ppo``, all seven off; and ``grpo``, TRL's ``GRPOTrainer`` with DAPO-style settings
(``loss_type="dapo"``, ``epsilon_high=0.28``, ``beta=0``) and the same prompts x samples per rollout, optimizer
steps per rollout, learning-rate schedule, lengths and sampling.

The arms that separate the hypotheses about the critic (``ARMS``; added to protocol 2 before any of its tuning or
reporting runs): GRPO at three group sizes, 8 prompts x 8 (``grpo``), 16 x 4 and 32 x 2 (``grpo-16x4``,
``grpo-32x2``: prompts per rollout is the candidate explanation of VAPO 64x1's higher mean under protocol 1, a
difference whose interval included 0); at 64 prompts x 1, VAPO with its
learned critic (``no-group-sampling``), with the exact value P(correct | prefix) as a frozen critic
(``oracle-64x1``, ``trl_vapo.demo.oracle``: how much a perfect critic buys) and with none (``critic-free-64x1``:
values 0 and lambda 1, so each token's advantage is its completion's return minus the rollout's mean, whitened);
VAPO with the paper's settings where the budget allows them (``vapo-paper``: 4 prompts x 16, alpha 0.05, critic
learning rate 2x the actor's); and vanilla PPO. Every arm is compared with the best-tuned GRPO and with no critic
(``critic-free-64x1``), every ablation with VAPO, and the learned critic at 64x1 with the exact value
(``PAIRED_WITH``); each pair once. ``aggregate`` also gives, from the same runs, each arm's training time and peak
memory as ratios to the best-tuned GRPO's and the share of the exact value's gain over no critic it reaches.

Tasks: ``demo`` (the shipped cold-start model, ``trl_vapo.demo.data``) and ``chains`` (``trl_vapo.demo.chains``,
longer chains with free tokens; cold-start model ``benchmarks/models/chains_sft``).

Equal sample budgets: every run generates exactly ``rollouts x 64`` training samples. Value-pretraining rollouts
count: VAPO spends 15 of its rollouts on them (or its variant's number; patience off, so always exactly that many)
and the rest on RL; GRPO and VAPO without value pretraining spend all of them on RL. Group sampling off keeps 64
samples per rollout (64 prompts x 1).

Tuning: the tuning seeds are never reported, and tuning runs are scored on a validation set of held-out problems
disjoint from the reporting set. VAPO, PPO and GRPO each get the same budget, six runs per task and tuning seed: the
same sweep of the actor learning rate (critic lr 10x the actor's, as in the recipe) and three recipe variants of
their own at the recipe's rate or one they name (``TUNING_VARIANTS``: for VAPO, protocol 1's choice of a short value
pretraining with four critic passes per rollout, and the critic probes' two candidates, 20 value-pretraining rollouts
of eight passes over a replay window with the full critic copy or with the shared-base LoRA critic, whose policy is a
LoRA adapter at 10x the actor rate; for PPO more critic passes, with and without value clipping, and a higher rate;
for GRPO more PPO epochs, batch-level reward scaling and a higher rate). VAPO's variants were revised for protocol 2
before any of its tuning runs (protocol 1's ``critic-x4`` and ``critic-x4-noclip`` lost on both tasks). The
criterion is the validation avg@k averaged over the last two evaluation points and the tuning seeds (ties: the
recipe, then the lower learning rate). The choices are written to ``<out>/chosen.json`` and frozen before any
reporting run; the ablations use VAPO's choice untuned, as the paper's ablations do, and so do the oracle,
critic-free and paper arms (an arm with a frozen value function drops the choice's critic settings); the two other
GRPO arms are tuned as GRPO is, each with its own six runs. (So the primary comparison's comparator, the best of the
three tuned GRPO arms, had 18 tuning runs per task behind it against VAPO's six: GRPO also chose its batch shape, as
the README says; its effect on the comparison was not measured; written after protocol 2's reporting runs.) The tuning
budget is per arm: an arm added to the comparison gets the same six runs per task and tuning seed before any reporting
run, and a variant singled out on reporting seeds is not a result on them: it goes through tuning and fresh reporting
seeds.

Reporting: every method on every task with each reporting seed, scored on the reporting set; mean and sample
standard deviation over seeds. Evaluation at the start, every ``eval_every`` rollouts and at the end: avg@k at
temperature 1 (top-p 1) on the same problems, sampled with a fixed seed from a private random-number stream (the
training stream is saved and restored, so evaluating never changes a run), greedy pass@1 at the end. While VAPO
pretrains its critic the policy is frozen, so those points carry the start's score forward without sampling.
Evaluation and the credit statistics are excluded from the wall-time axis, which measures training only; VAPO runs
with ``plot_diagnostics=False`` (under protocol 1 it drew its plots, at the end of value pretraining and of training,
inside its clock). Every record names the code it ran (``code_commit``).

Credit assignment (diagnostic only; it changes nothing in training): on every RL rollout, the per-token advantage
each method's loss uses (VAPO: whitened GAE advantages; GRPO: the group-normalised sequence advantage on every
token), split by where ``trl_vapo.demo.chains.first_wrong_index`` puts the first wrong step of each wrong completion:
the decisive token, the tokens before and after it, and the tokens of correct completions (``credit_assignment``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # imported by path too (the tests), not only run as a script

from _launch import run_dir, worker_env, write_json  # noqa: E402

CHAINS_MODEL_DIR = ROOT / "benchmarks" / "models" / "chains_sft"

PROTOCOL = {
    "tasks": ["demo", "chains"],
    "rollouts": 35,  # x 64 samples = 2,240 per run; VAPO's value-pretraining rollouts count
    "samples_per_rollout": 64,
    "eval_every": 5,  # rollouts (320 samples)
    "eval_k": 4,
    "eval_problems": 200,  # reporting set: build_split("held_out", 200), the demo's evaluation set
    "validation_problems": 200,  # tuning set: the next 200 unique held-out problems
    "eval_seed": 1234,
    "protocol": 2,  # protocol 1 (reporting seeds 0, 1, 2) named no primary metric and no decision rule
    "reporting_seeds": [2000, 2001, 2002, 2003, 2004],  # at least 5 per arm, fresh
    # The arms that decide whether any critic helps here get 10 (the 5-seed interval's half-width is about 0.05):
    "decisive_arms": ["oracle-64x1", "critic-free-64x1", "best-grpo"],
    "decisive_seeds": [2000, 2001, 2002, 2003, 2004, 2005, 2006, 2007, 2008, 2009],
    "spent_seeds": [0, 1, 2],  # reported under protocol 1: never reported again
    "tuning_seeds": [1000],
    "tuned_methods": ["vapo", "ppo", "grpo", "grpo-16x4", "grpo-32x2"],  # the others take VAPO's choice
    "lr_grid": [3e-5, 1e-4, 3e-4],
    "critic_lr_ratio": 10.0,
    "tuning_criterion": "validation avg@k, mean of the last two evaluation points and the tuning seeds",
    "primary_metrics": ["final held-out avg@k", "area under the held-out avg@k curve / samples"],
    "decision_rule": "better only if the 95% t interval of the mean per-seed difference excludes 0; "
    "otherwise no measurable difference",
    "primary_comparator": "best-grpo: of the GRPO arms (8x8, 16x4, 32x2), the one whose frozen choice scored best "
    "on validation by the tuning criterion (a tie: the larger group), frozen in chosen.json before reporting",
    "amendments": [
        "2026-11-26, before any reporting run: the primary comparator is the best-tuned GRPO arm (best-grpo), not "
        "GRPO 8x8; the decisive arms (oracle-64x1, critic-free-64x1, best-grpo) get 10 reporting seeds, 2000-2009, "
        "because 5 seeds gave intervals of half-width about 0.05; no-group-sampling stays an untuned ablation "
        "(VAPO's choice), labelled so in every table, and is not a primary comparison.",
    ],
}
BEST_GRPO = "best-grpo"
"""An arm name for `--methods` that stands, per task, for the GRPO arm frozen as `chosen.json`'s `best-grpo`."""

ARMS = [
    "vapo",
    "grpo",
    "grpo-16x4",
    "grpo-32x2",
    "no-group-sampling",
    "critic-free-64x1",
    "oracle-64x1",
    "vapo-paper",
    "ppo",
]
"""The arms that separate the hypotheses about the critic (the ablations besides are config switches of VAPO)."""
CRITIC_PROBE_SEEDS = (1000, 1001, 1002)
"""The seeds `bench_critic.py`'s probes ran with (the benchmark's tuning seed and two more): its probes chose the
critic settings of VAPO's tuned variants, so these are tuning seeds, never reporting ones."""

QUICK = {  # the smoke test: every arm on chains, VAPO and GRPO on the demo, tiny budgets, in one process
    "tasks": ["demo", "chains"],
    "methods_by_task": {"demo": ["vapo", "grpo"], "chains": ARMS},
    "rollouts": 2,
    "samples_per_rollout": 16,  # e.g. 2 prompts x 8, 4 optimizer steps of 4
    "eval_every": 1,
    "eval_k": 2,
    "eval_problems": 2,
    "reporting_seeds": [0],
    "decisive_seeds": [0],
    "value_pretrain_steps": 1,
    # Chains' completions cut to 48 of their 160 tokens (generation is most of the smoke test's time): every one is cut
    # before its answer (62-141 tokens), so the chains runs train on constant rewards (a slip still falls within them,
    # for the credit statistics; at 80 tokens some answer, at 9 s more). The demo's are kept whole: its runs carry the
    # rewards (cut, its GRPO run never answers and never reaches its final accuracy).
    "max_completion_length": {"chains": 48},
}

# The demo recipe as it stood when the protocol was fixed (the training fields only): the base every method is tuned
# from. trl_vapo.cli.DEMO_DEFAULTS has since become the tuning stage's choice for VAPO (pretrain5-critic-x4).
VAPO_RECIPE = {
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "steps_per_generation": 4,  # 4 optimizer steps of 16 samples per rollout of 64
    "num_generations": 8,
    "value_pretrain_steps": 15,
    "value_pretrain_patience": None,  # always exactly 15 rollouts: equal sample budgets
    "learning_rate": 1e-4,
    "length_adaptive_alpha": 0.5,
}
MAX_COMPLETION_LENGTH = {"demo": 96, "chains": 160}  # longest correct completion: 83 and 141 tokens

_ALL_OFF = {
    "value_pretrain_steps": 0,
    "lam_critic": 0.95,
    "lam_actor": 0.95,
    "length_adaptive_alpha": None,
    "loss_type": "sequence",
    "epsilon_high": 0.2,
    "nll_coef": 0.0,
    "num_generations": 1,
}
GRPO_METHODS = ("grpo", "grpo-16x4", "grpo-32x2")
"""TRL's GRPOTrainer at three group sizes: 8 prompts x 8 samples (the recipe's), 16 x 4 and 32 x 2."""
VALUE_FUNCTIONS = ("zero", "oracle")
"""Frozen value functions an arm can use instead of the learned critic (``value_model`` in its overrides)."""
CRITIC_FIELDS = (
    "critic_num_iterations",
    "cliprange_value",
    "critic_learning_rate",
    "value_pretrain_steps",
    "value_pretrain_num_iterations",
    "value_pretrain_replay",
)
"""The settings of a learned critic, dropped from a tuning variant when the arm has a frozen value function."""
METHODS: dict[str, dict] = {
    # name: VAPOConfig overrides on top of the recipe (GRPOConfig overrides for GRPO_METHODS); `value_model` names a
    # frozen value function, `critic_lr_ratio` replaces the protocol's critic-to-actor learning-rate ratio
    "vapo": {},
    "no-value-pretrain": {"value_pretrain_steps": 0},
    "no-decoupled-gae": {"lam_critic": 0.95},  # critic targets with the actor's lambda (0.95)
    "no-length-adaptive": {"length_adaptive_alpha": None},  # fixed lambda_actor 0.95
    "sequence-loss": {"loss_type": "sequence"},
    "no-clip-higher": {"epsilon_high": 0.2},
    "no-positive-nll": {"nll_coef": 0.0},
    "no-group-sampling": {"num_generations": 1},  # 64 prompts x 1 sample per rollout
    "ppo": _ALL_OFF,
    "grpo": {},
    "grpo-16x4": {"num_generations": 4},
    "grpo-32x2": {"num_generations": 2},
    # 64 prompts x 1 without a critic: every token's advantage is the completion's return minus the rollout's mean
    # return, over the returns' standard deviation (values 0, lambda 1, advantages whitened over the rollout's tokens)
    "critic-free-64x1": {"num_generations": 1, "lam_actor": 1.0, "length_adaptive_alpha": None, "value_model": "zero"},
    # 64 x 1 with the exact value P(correct | prefix) (trl_vapo.demo.oracle), VAPO's settings otherwise
    "oracle-64x1": {"num_generations": 1, "value_model": "oracle"},
    # the paper's settings where this budget allows them: 4 prompts x 16 samples, alpha 0.05, critic lr 2x the
    # actor's (its 50 value-pretraining steps do not fit in 35 rollouts: the recipe's stay)
    "vapo-paper": {"num_generations": 16, "length_adaptive_alpha": 0.05, "critic_lr_ratio": 2.0},
}
# The tuning budget beyond the learning-rate sweep: the same number of recipe variants for every tuned method, run
# at the recipe's learning rate (or the one a variant names). VAPO's and PPO's give the critic more training per
# sample (the diagnostics show a weak critic: explained variance 0.1-0.2 after value pretraining, ~0 in RL); GRPO's
# are its own usual levers. VAPO's were revised for protocol 2 before any of its tuning runs: protocol 1's
# `critic-x4` and `critic-x4-noclip` lost on both tasks and gave their slots to the critic probes' candidates
# (benchmarks/README.md, "Critic tuning, for a critic that learns": tuning seeds 1000-1002, policy frozen), which
# reach half of the exact value's explained variance on chains by the 20th value-pretraining rollout.
TUNING_VARIANTS: dict[str, dict[str, dict]] = {
    "vapo": {
        # Protocol 1's choice on both tasks, the demo's default since: a short value pretraining, four critic passes.
        "pretrain5-critic-x4": {"critic_num_iterations": 4, "value_pretrain_steps": 5},
        # The critic probes' best full critic copy: 20 value-pretraining rollouts, each fit in eight passes of
        # critic lr 1e-4 over a window of it and the 7 before it; four critic passes per RL rollout at the same rate.
        "replay-pretrain20": {
            "value_pretrain_steps": 20,
            "value_pretrain_num_iterations": 8,
            "value_pretrain_replay": 7,
            "critic_learning_rate": 1e-4,
            "critic_num_iterations": 4,
        },
        # The probes' best critic of all: the shared-base LoRA critic (rank 16, alpha 32, every linear layer) at
        # critic lr 1e-3, with the same pretraining. Its policy is a LoRA adapter too, at 10x the recipe's actor
        # rate: LoRA's best rate is about 10x full fine-tuning's at alpha 32 ("LoRA Without Regret", Schulman et
        # al., Thinking Machines, 2025).
        "lora-replay-pretrain20": {
            "lora_r": 16,
            "learning_rate": 1e-3,
            "value_pretrain_steps": 20,
            "value_pretrain_num_iterations": 8,
            "value_pretrain_replay": 7,
            "critic_learning_rate": 1e-3,
            "critic_num_iterations": 4,
        },
    },
    "ppo": {
        "critic-x4": {"critic_num_iterations": 4},
        "critic-x4-noclip": {"critic_num_iterations": 4, "cliprange_value": None},
        "lr2e-4": {"learning_rate": 2e-4},
    },
    "grpo": {
        "iterations-2": {"num_iterations": 2},
        "scale-batch": {"scale_rewards": "batch"},
        "lr2e-4": {"learning_rate": 2e-4},
    },
}

LABELS = {
    "vapo": "VAPO",
    "no-value-pretrain": "w/o value pretraining",
    "no-decoupled-gae": "w/o decoupled GAE",
    "no-length-adaptive": "w/o length-adaptive GAE",
    "sequence-loss": "w/o token-level loss",
    "no-clip-higher": "w/o clip-higher",
    "no-positive-nll": "w/o positive-example NLL",
    "no-group-sampling": "w/o group sampling",
    "ppo": "PPO (all seven off)",
    "grpo": "GRPO (TRL, DAPO-style)",
    "grpo-16x4": "GRPO 16x4",
    "grpo-32x2": "GRPO 32x2",
    "critic-free-64x1": "critic-free 64x1",
    "oracle-64x1": "oracle critic 64x1",
    "vapo-paper": "VAPO, paper's settings",
}


ORACLE, CRITIC_FREE = "oracle-64x1", "critic-free-64x1"
PAIRED_WITH = {ORACLE: ("no-group-sampling",)}
"""Comparisons beyond each arm's against the best-tuned GRPO and no critic (and each ablation's against VAPO): the
learned critic against the exact value, both at 64x1."""


def choice_owner(method: str) -> str:
    """Whose frozen choice an arm reports with: its own if it is tuned, else VAPO's (an untuned arm)."""
    return method if method in PROTOCOL["tuned_methods"] else "vapo"


def label(method: str) -> str:
    """An arm's name in every table and plot; an untuned arm (VAPO's choice) says so."""
    name = LABELS.get(method, method)
    return name if choice_owner(method) == method else f"{name} (untuned)"


def method_family(method: str) -> str:
    """Whose tuning variants a method uses: its own (``TUNING_VARIANTS``), GRPO's for every GRPO arm, else VAPO's."""
    if method in TUNING_VARIANTS:
        return method
    return "grpo" if method in GRPO_METHODS else "vapo"


@dataclass(frozen=True)
class RunSpec:
    """Everything one run depends on; its JSON file name follows from it."""

    stage: str  # "tune" or "report"
    task: str
    method: str
    seed: int
    learning_rate: float
    rollouts: int
    eval_every: int
    eval_k: int
    eval_problems: int
    eval_set: str  # "test" (the reporting set) or "validation" (the tuning set)
    validation_problems: int = 0
    eval_seed: int = 1234
    critic_lr_ratio: float = 10.0
    samples_per_rollout: int = 64  # in 4 optimizer steps of a quarter each
    value_pretrain_steps: int | None = None  # None: the recipe's 15
    variant: str = ""  # a TUNING_VARIANTS entry of the method (for ablations: of VAPO); "": the recipe
    max_completion_length: int | None = None  # None: the task's (MAX_COMPLETION_LENGTH); --quick's shorter

    def completion_length(self) -> int:
        return self.max_completion_length or MAX_COMPLETION_LENGTH[self.task]

    def path(self, out: Path) -> Path:
        if self.stage == "report":
            name = f"seed{self.seed}.json"
        else:
            name = f"{self.variant or 'recipe'}_lr{self.learning_rate:g}_seed{self.seed}.json"
        return out / self.stage / self.task / self.method / name

    def overrides(self) -> dict:
        """The config fields this run changes from the recipe: its method's, on top of its variant's."""
        # Ablations and the untuned arms follow VAPO's variant, the GRPO arms GRPO's.
        variant = dict(TUNING_VARIANTS[method_family(self.method)][self.variant]) if self.variant else {}
        variant.pop("learning_rate", None)  # already the spec's
        if "value_model" in METHODS[self.method]:  # a frozen value function: no critic to tune
            variant = {k: v for k, v in variant.items() if k not in CRITIC_FIELDS}
        return {**variant, **METHODS[self.method]}


# ---------------------------------------------------------------------------------------------------------------------
# Pure pieces: the credit-assignment statistic, learning-rate choice, aggregation
# ---------------------------------------------------------------------------------------------------------------------


def credit_assignment(
    advantages: Sequence[Sequence[float]], first_wrong: Sequence[int | None], lengths: Sequence[int]
) -> dict[str, float]:
    """Mean advantage at the first wrong step's decisive token against everywhere else, for one rollout.

    ``advantages[i]`` are completion ``i``'s per-token advantages (at least ``lengths[i]`` of them: its tokens, EOS
    included); ``first_wrong[i]`` is the index of its first wrong step's decisive token, ``None`` for a correct chain.
    Wrong completions whose decisive token lies past their last token (cut at the length limit) are only counted.

    Returns means over tokens of ``at_first_wrong``, ``wrong_before`` / ``wrong_after`` (the other tokens of wrong
    completions, before and after the decisive one), ``wrong_other`` (both), ``correct`` (all tokens of correct
    completions), and ``slip_rank``: per wrong completion, the share of its other tokens whose advantage is above the
    decisive token's (ties count half), averaged; 1 means the decisive token always gets the lowest advantage, 0.5 no
    localisation (a sequence-level advantage gives exactly 0.5). NaN where a group is empty.
    """
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    ranks, unlocated = [], 0
    for values, wrong_at, length in zip(advantages, first_wrong, lengths):
        values = [float(v) for v in values[:length]]
        if wrong_at is None:
            sums["correct"] += sum(values)
            counts["correct"] += len(values)
            continue
        if wrong_at >= length:
            unlocated += 1
            continue
        at = values[wrong_at]
        before, after = values[:wrong_at], values[wrong_at + 1 :]
        for key, group in (("at_first_wrong", [at]), ("wrong_before", before), ("wrong_after", after)):
            sums[key] += sum(group)
            counts[key] += len(group)
        others = before + after
        if others:
            ranks.append(sum(1.0 if v > at else 0.5 if v == at else 0.0 for v in others) / len(others))
    sums["wrong_other"] = sums["wrong_before"] + sums["wrong_after"]
    counts["wrong_other"] = counts["wrong_before"] + counts["wrong_after"]
    stats = {
        key: sums[key] / counts[key] if counts[key] else math.nan
        for key in ("at_first_wrong", "wrong_before", "wrong_after", "wrong_other", "correct")
    }
    stats["slip_rank"] = sum(ranks) / len(ranks) if ranks else math.nan
    stats["num_wrong"] = counts["at_first_wrong"]
    stats["num_wrong_unlocated"] = unlocated
    stats["num_correct"] = sum(1 for w in first_wrong if w is None)
    return stats


def value_drop_at_first_wrong(
    values: Sequence[Sequence[float]], first_wrong: Sequence[int | None], lengths: Sequence[int]
) -> float:
    """The mean change of the value across the decisive token of wrong completions, ``V(s_{w+1}) - V(s_w)`` with
    ``w`` its index (``values[i][t]`` read before token ``t``; completions without a token after ``w`` left out): a
    credit statistic read from the values, free of the lambda^(T-t) shape GAE gives advantages. A critic that
    locates the slip drops there as the oracle does (``oracle_drop``); one that predicts nothing does not move. NaN
    when no completion counts."""
    drops = [
        float(v[w + 1]) - float(v[w])
        for v, w, length in zip(values, first_wrong, lengths)
        if w is not None and w + 1 < length
    ]
    return statistics.mean(drops) if drops else math.nan


def completion_texts(tokenizer, completion_ids: Sequence[Sequence[int]], lengths: Sequence[int]) -> list[str]:
    """Each completion's text with one character per token up to its EOS (excluded); any other special token
    becomes ``\\0``, which no correct chain contains, so indices stay token positions for a character tokenizer."""
    special = set(tokenizer.all_special_ids)
    eos = tokenizer.eos_token_id
    texts = []
    for ids, length in zip(completion_ids, lengths):
        ids = list(ids[:length])
        if ids and ids[-1] == eos:
            ids = ids[:-1]
        texts.append("".join("\0" if i in special else tokenizer.convert_ids_to_tokens(i) for i in ids))
    return texts


def choose_settings(records: list[dict]) -> dict[str, dict[str, dict]]:
    """The protocol's choice per task and tuned method: the (learning rate, variant) with the best validation avg@k
    averaged over the last two evaluation points and over tuning seeds; ties go to the recipe, then the lower rate."""
    scores: dict[tuple, list[float]] = defaultdict(list)
    for record in records:
        spec = record["spec"]
        accuracies = [point["avg@k"] for point in record["points"]]
        key = (spec["task"], spec["method"], spec.get("variant", ""), spec["learning_rate"])
        scores[key].append(statistics.mean(accuracies[-2:]))
    best: dict[str, dict[str, tuple]] = defaultdict(dict)
    for (task, method, variant, lr), values in sorted(scores.items(), key=lambda item: (item[0][2] != "", item[0])):
        score = statistics.mean(values)
        if method not in best[task] or score > best[task][method][2]:
            best[task][method] = (lr, variant, score)
    return {
        task: {
            method: {"learning_rate": lr, "variant": variant, "validation": score}
            for method, (lr, variant, score) in methods.items()
        }
        for task, methods in best.items()
    }


def choose_best_grpo(choices: dict[str, dict]) -> dict | None:
    """The primary comparator of one task: of the GRPO arms, the one whose choice scored best on validation (the
    tuning criterion); a tie goes to the larger group (8x8, then 16x4). ``None`` until all three are chosen."""
    if not all(method in choices for method in GRPO_METHODS):
        return None
    method = max(GRPO_METHODS, key=lambda m: (choices[m]["validation"], -GRPO_METHODS.index(m)))
    return {"method": method, "validation": choices[method]["validation"]}


def freeze_choices(chosen: dict, frozen: dict) -> dict:
    """``keep_frozen``, then each task's best-tuned GRPO where all three GRPO arms are chosen and none is frozen yet:
    what ``chosen.json`` holds after a tuning stage."""
    merged = keep_frozen(chosen, frozen)
    for choices in merged.values():
        if BEST_GRPO not in choices and (best := choose_best_grpo(choices)):
            choices[BEST_GRPO] = best
    return merged


def keep_frozen(chosen: dict, frozen: dict) -> dict:
    """``frozen`` (an earlier ``chosen.json``) with the choices of ``chosen`` it lacks, per task and method: a choice
    once written is never re-chosen, and methods tuned since (e.g. one ``--methods`` at a time) are added."""
    return {task: {**chosen.get(task, {}), **frozen.get(task, {})} for task in sorted({*chosen, *frozen})}


def format_tuning(records: list[dict], chosen: dict | None) -> str:
    """Every tuning run's validation score (the criterion of ``choose_settings``), the chosen setting marked."""
    lines = ["tuning: validation avg@k, mean of the last two evaluation points (* = chosen, frozen in chosen.json)"]
    header = f"{'task':8s}{'method':11s}{'variant':24s}{'lr':>8s}{'seed':>6s}{'validation':>12s}{'final':>8s}"
    lines += [header, "-" * len(header)]
    for record in sorted(
        records, key=lambda r: tuple(str(r["spec"].get(k, "")) for k in ("task", "method", "variant"))
    ):
        spec = record["spec"]
        accuracies = [point["avg@k"] for point in record["points"]]
        pick = (chosen or {}).get(spec["task"], {}).get(spec["method"], {})
        mark = (
            "*"
            if (pick.get("variant"), pick.get("learning_rate")) == (spec.get("variant", ""), spec["learning_rate"])
            else ""
        )
        lines.append(
            f"{spec['task']:8s}{spec['method']:11s}{spec.get('variant') or 'recipe':24s}{spec['learning_rate']:>8g}"
            f"{spec['seed']:>6d}{statistics.mean(accuracies[-2:]):>12.3f}{accuracies[-1]:>8.3f} {mark}".rstrip()
        )
    for task, choices in sorted((chosen or {}).items()):
        best = choices.get(BEST_GRPO)
        lines.append(
            f"{task}: best-tuned GRPO (the primary comparator): "
            + (f"{best['method']} (validation {best['validation']:.3f})" if best else "not chosen yet")
        )
    return "\n".join(lines)


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def area_under_curve(points: list[dict]) -> float:
    """The area under a run's held-out curve per sample (protocol 2's second primary metric):

        AUC = (1 / S) * sum_i (s_i - s_{i-1}) * (acc_i + acc_{i-1}) / 2        (trapezoids, s_0 = 0, S = s_last)

    the run's mean avg@k over its sample budget (value-pretraining points carry the start's score)."""
    total = sum((b["samples"] - a["samples"]) * (a["avg@k"] + b["avg@k"]) / 2 for a, b in zip(points, points[1:]))
    return total / points[-1]["samples"] if len(points) > 1 and points[-1]["samples"] > 0 else math.nan


def t_quantile(probability: float, df: float) -> float:
    """The ``probability`` quantile (above 0.5) of Student's t with ``df`` degrees of freedom (0.975 for 95%
    intervals), by bisection on P(|T| <= t) = 1 - I_{df / (df + t^2)}(df / 2, 1 / 2) = 2 * probability - 1, the
    regularized incomplete beta function ``I`` evaluated by its continued fraction (Numerical Recipes' ``betacf``), so
    that no SciPy is needed."""
    if not 0.5 < probability < 1:
        raise ValueError(f"t_quantile takes a probability in (0.5, 1), got {probability}")

    def incomplete_beta(x: float, a: float, b: float) -> float:
        if x <= 0.0 or x >= 1.0:
            return 0.0 if x <= 0.0 else 1.0
        if x > (a + 1) / (a + b + 2):  # the continued fraction converges fast on this side only
            return 1.0 - incomplete_beta(1.0 - x, b, a)
        front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
        c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        fraction = d
        for m in range(1, 300):
            for numerator in (
                m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
            ):
                d = 1.0 + numerator * d
                d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
                c = 1.0 + numerator / c
                c = c if abs(c) > 1e-300 else 1e-300
                fraction *= c * d
            if abs(c * d - 1.0) < 1e-15:
                break
        return front * fraction / a

    low, high = 0.0, 1000.0
    for _ in range(200):
        mid = (low + high) / 2
        if 1.0 - incomplete_beta(df / (df + mid * mid), df / 2, 0.5) < 2 * probability - 1:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def paired_difference(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, float, int]:
    """``a - b`` over the seeds both ran, paired by seed: the mean difference d and its 95% t interval,
    d ± t_{0.975, n-1} * sd(d_i) / sqrt(n); (d, nan, nan, n) with fewer than two common seeds."""
    diffs = [a[seed] - b[seed] for seed in sorted(set(a) & set(b))]
    if not diffs:
        return math.nan, math.nan, math.nan, 0
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return mean, math.nan, math.nan, len(diffs)
    half = t_quantile(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, mean - half, mean + half, len(diffs)


def paired_ratio(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, float, int]:
    """``a / b`` over the seeds both ran, paired by seed: the geometric mean of the per-seed ratios and its 95% t
    interval, exp(mean(log r_i) ± t_{0.975, n-1} * sd(log r_i) / sqrt(n)) (``paired_difference`` of the logs; a
    ratio's spread is multiplicative); (nan, nan, nan, 0) where a value is missing or not positive."""
    seeds = sorted(set(a) & set(b))
    if not seeds or not all(a[s] > 0 and b[s] > 0 for s in seeds):  # (nan compares False: missing too)
        return math.nan, math.nan, math.nan, 0
    mean, low, high, n = paired_difference({s: math.log(a[s]) for s in seeds}, {s: math.log(b[s]) for s in seeds})
    return math.exp(mean), math.exp(low), math.exp(high), n


def detectable_difference(difference: tuple[float, float, float, int], power: float = 0.8) -> float:
    """The smallest true difference the paired t test of ``difference`` (``paired_difference``'s) detects with
    ``power`` at the 5% level (two-sided): (t_{0.975, n-1} + t_{power, n-1}) * sd(d_i) / sqrt(n), i.e. the interval's
    half-width times (1 + t_{power} / t_{0.975}); nan without an interval."""
    mean, _, high, n = difference
    if math.isnan(high):
        return math.nan
    return (high - mean) * (1 + t_quantile(power, n - 1) / t_quantile(0.975, n - 1))


def samples_to_reach(points: list[dict], target: float) -> int | None:
    """Samples at the first evaluation point whose avg@k reaches ``target``; ``None`` if none does."""
    return next((point["samples"] for point in points if point["avg@k"] >= target), None)


def aggregate(records: list[dict], comparators: dict[str, str] | None = None) -> dict:
    """Per task and method: curves (mean and std over seeds at each evaluation point) and the table's numbers.
    ``comparators``: each task's primary comparator, its best-tuned GRPO arm (GRPO 8x8 where none is given)."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["spec"]["task"], record["spec"]["method"])].append(record)
    summary: dict = {}
    task_order = {task: i for i, task in enumerate(PROTOCOL["tasks"])}
    for (task, method), runs in sorted(groups.items(), key=lambda item: (task_order.get(item[0][0], 99), item[0][1])):
        runs.sort(key=lambda r: r["spec"]["seed"])
        n_points = min(len(r["points"]) for r in runs)
        curve = []
        for i in range(n_points):
            accs = [r["points"][i]["avg@k"] for r in runs]
            times = [r["points"][i]["train_time_s"] for r in runs]
            curve.append(
                {
                    "samples": runs[0]["points"][i]["samples"],
                    "avg@k_mean": statistics.mean(accs),
                    "avg@k_std": _mean_std(accs)[1],
                    "train_time_mean": statistics.mean(times),
                    "train_time_std": _mean_std(times)[1],
                }
            )
        finals = [r["points"][-1]["avg@k"] for r in runs]
        credit_keys = CREDIT_KEYS
        summary.setdefault(task, {})[method] = {
            "seeds": [r["spec"]["seed"] for r in runs],
            "learning_rate": runs[0]["spec"]["learning_rate"],
            "variant": runs[0]["spec"].get("variant", ""),
            "initial": _mean_std([r["points"][0]["avg@k"] for r in runs]),
            "final": _mean_std(finals),
            "final_per_seed": finals,
            "greedy_final": _mean_std([r["points"][-1].get("pass@1", math.nan) for r in runs]),
            "train_time": _mean_std([r["train_time_s"] for r in runs]),
            "train_time_per_seed": [r["train_time_s"] for r in runs],
            # Recorded since protocol 2's reporting runs (None: a run that shared its process with others).
            "peak_rss_mib": _mean_std([r.get("peak_rss_mib") or math.nan for r in runs]),
            "peak_rss_mib_per_seed": [r.get("peak_rss_mib") or math.nan for r in runs],
            "samples": runs[0]["samples"],
            "curve": curve,
            "credit": {key: _mean_std([r["credit_summary"].get(key, math.nan) for r in runs]) for key in credit_keys},
            "auc": _mean_std([area_under_curve(r["points"]) for r in runs]),
            "auc_per_seed": [area_under_curve(r["points"]) for r in runs],
            "points_per_run": [r["points"] for r in runs],
        }
    for task, methods in summary.items():
        comparator = (comparators or {}).get(task, "grpo")
        target = methods[comparator]["final"][0] if comparator in methods else None
        compared: set[frozenset] = set()  # each pair of arms once, in the order of METHODS
        order = [m for m in METHODS if m in methods] + [m for m in methods if m not in METHODS]
        for method in order:
            entry = methods[method]
            reached = [samples_to_reach(points, target) for points in entry["points_per_run"]] if target else []
            hits = [s for s in reached if s is not None]
            entry["comparator"], entry["comparator_frozen"] = comparator, task in (comparators or {})
            entry["grpo_target"] = target
            entry["samples_to_grpo_final"] = (statistics.mean(hits) if hits else None, len(hits), len(reached))
            # The protocol's comparisons, paired by seed: every method against the best-tuned GRPO and against no
            # critic at 64x1, every ablation against VAPO, and the 64x1 arms against each other (what the critic's
            # errors cost: learned vs exact vs none).
            candidates = [comparator, CRITIC_FREE] + ([] if method in GRPO_METHODS else ["vapo"])
            candidates += PAIRED_WITH.get(method, ())
            baselines = []
            for baseline in candidates:
                if baseline in methods and baseline != method and frozenset((method, baseline)) not in compared:
                    compared.add(frozenset((method, baseline)))
                    baselines.append(baseline)
            entry["differences"] = {
                baseline: {
                    metric: paired_difference(
                        dict(zip(entry["seeds"], entry[f"{metric}_per_seed"])),
                        dict(zip(methods[baseline]["seeds"], methods[baseline][f"{metric}_per_seed"])),
                    )
                    for metric in ("final", "auc")
                }
                for baseline in baselines
            }
            # Cost, from the same runs: training time and peak memory as ratios of means to the comparator's, over the
            # seeds both ran, and the per-seed ratios' geometric mean with its 95% interval (paired by seed).
            entry["ratios"], entry["paired_ratios"] = {}, {}
            for key in ("train_time", "peak_rss_mib"):
                arm, base = means_on_common_seeds([entry, methods.get(comparator)], f"{key}_per_seed")
                entry["ratios"][key] = arm / base if base > 0 else math.nan
                other = methods.get(comparator, {})
                entry["paired_ratios"][key] = paired_ratio(
                    dict(zip(entry["seeds"], entry[f"{key}_per_seed"])),
                    dict(zip(other.get("seeds", []), other.get(f"{key}_per_seed", []))),
                )
        for method in order:  # once every pair's difference is in: the share reads the oracle's own
            methods[method]["oracle_share"] = oracle_share(methods, method)
    return summary


def means_on_common_seeds(entries: list[dict | None], key: str) -> list[float]:
    """Each entry's mean of ``key`` (a per-seed list) over the seeds every entry ran (arms run 5 or 10 seeds); nan
    for all where an entry is missing or no seed is common."""
    if any(entry is None for entry in entries):
        return [math.nan] * len(entries)
    seeds = set.intersection(*(set(entry["seeds"]) for entry in entries))
    if not seeds:
        return [math.nan] * len(entries)
    return [statistics.mean(v for s, v in zip(entry["seeds"], entry[key]) if s in seeds) for entry in entries]


def oracle_share(methods: dict, method: str) -> dict[str, float]:
    """What share of the exact value's gain over no critic (both at 64x1) ``method`` reaches, per primary metric:
    (mean(method) - mean(critic-free)) / (mean(oracle) - mean(critic-free)), the means over the seeds the three ran;
    nan where an arm is missing, and where the oracle's gain itself is not measurable (the interval of oracle minus
    critic-free includes 0): a share of a gain that may be 0 is no number. A point estimate: the ratio has no t
    interval."""
    shares = {}
    gains = methods[ORACLE]["differences"].get(CRITIC_FREE, {}) if ORACLE in methods else {}
    for metric in ("final", "auc"):
        _, low, high, _ = gains.get(metric, (math.nan,) * 4)
        if not (low > 0 or high < 0):  # nan too: no interval
            shares[metric] = math.nan
            continue
        arm, floor, ceiling = means_on_common_seeds(
            [methods[method], methods.get(CRITIC_FREE), methods.get(ORACLE)], f"{metric}_per_seed"
        )
        shares[metric] = (arm - floor) / (ceiling - floor) if ceiling != floor else math.nan
    return shares


def _fmt(mean_std: tuple[float, float], digits: int = 3) -> str:
    mean, std = mean_std
    return "-" if math.isnan(mean) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _fmt_number(value: float, width: int, digits: int) -> str:
    """A right-aligned number, or '-' where there is none (nan)."""
    return f"{'-':>{width}s}" if math.isnan(value) else f"{value:>{width}.{digits}f}"


def _fmt_interval(difference: tuple[float, float, float, int]) -> str:
    mean, low, high, _ = difference
    if math.isnan(mean):
        return "-"
    return f"{mean:+.3f}" + ("" if math.isnan(low) else f" [{low:+.3f}, {high:+.3f}]")


def _fmt_ratio(ratio: tuple[float, float, float, int]) -> str:
    mean, low, high, _ = ratio
    if math.isnan(mean):
        return "-"
    return f"{mean:.2f}" + ("" if math.isnan(low) else f" [{low:.2f}, {high:.2f}]")


def format_table(summary: dict, k: int) -> str:
    """The results table: one block per task, one row per method."""
    lines = []
    for task, methods in summary.items():
        first = next(iter(methods.values()))
        target, comparator = first["grpo_target"], LABELS.get(first["comparator"], first["comparator"])
        role = "the primary comparator" if first["comparator_frozen"] else "no best-tuned GRPO frozen: GRPO 8x8"
        lines.append(
            f"\n{task}: held-out avg@{k} (mean ± std over seeds); 'to GRPO' = samples until avg@{k} first "
            f"reaches the final mean of {comparator} ({role})"
            + (f", {target:.3f}" if target is not None else ", not run")
            + "; (untuned) = an arm run with VAPO's frozen choice"
        )
        header = (
            f"{'method':34s}{'lr':>8s}{'n':>3s}{'start':>16s}{'final':>16s}{'greedy final':>16s}"
            f"{'to GRPO':>16s}{'train time s':>16s}{'per seed final':>24s}"
        )
        lines += [header, "-" * len(header)]
        order = [m for m in METHODS if m in methods] + [m for m in methods if m not in METHODS]
        for method in order:
            e = methods[method]
            mean_samples, hits, n = e["samples_to_grpo_final"]
            reach = "-" if not n else f"{mean_samples:.0f} ({hits}/{n})" if hits else f"never (0/{n})"
            seeds = "  " + " ".join(f"{v:.3f}" for v in e["final_per_seed"])
            lines.append(
                f"{label(method):34s}{e['learning_rate']:>8g}{len(e['seeds']):>3d}"
                f"{_fmt(e['initial']):>16s}{_fmt(e['final']):>16s}{_fmt(e['greedy_final']):>16s}{reach:>16s}"
                f"{_fmt(e['train_time'], 0):>16s}{seeds:>24s}"
            )
        lines.append(
            f"\n{task}: differences paired by seed, mean [95% t interval] (protocol 2: 'better' only where the "
            "interval excludes 0; otherwise no measurable difference); 'detectable' = the smallest true difference "
            "these seeds detect with 80% power at the 5% level"
        )
        header = (
            f"{'method':34s}{'baseline':>18s}{'n':>3s}{'final avg@' + str(k):>30s}{'detectable':>12s}"
            f"{'area under the curve':>30s}{'detectable':>12s}"
        )
        lines += [header, "-" * len(header)]
        halves: dict[str, list[float]] = {"final": [], "auc": []}
        for method in order:
            for baseline, metrics in methods[method]["differences"].items():
                cells = ""
                for metric in ("final", "auc"):
                    detectable = detectable_difference(metrics[metric])
                    cells += f"{_fmt_interval(metrics[metric]):>30s}{_fmt_number(detectable, 12, 3)}"
                    if not math.isnan(metrics[metric][2]):
                        halves[metric].append(metrics[metric][2] - metrics[metric][0])
                lines.append(f"{label(method):34s}{baseline:>18s}{metrics['final'][3]:>3d}{cells}")
        count = sum(len(methods[m]["differences"]) for m in order)
        spans = ", ".join(
            f"{name} {min(values):.3f}-{max(values):.3f}"
            for name, values in (("final", halves["final"]), ("area", halves["auc"]))
            if values
        )
        lines.append(
            f"({count} comparisons on {task}, each at 95%, uncorrected for their number"
            + (f"; the intervals' half-widths: {spans})" if spans else ")")
        )
        lines.append(
            f"\n{task}: cost and credit, from the same runs: training time and peak memory (the process's peak RSS) "
            f"as ratios of means to {comparator}'s; the share of the exact value's gain over no critic (both 64x1) "
            "each arm reaches, (arm - critic-free) / (oracle - critic-free) of the means (a point estimate; '-' where "
            "the oracle's gain is not measurable); and the time and memory ratios paired by seed, the geometric mean "
            "of the per-seed ratios [95% t interval]"
        )
        header = (
            f"{'method':34s}{'time x':>10s}{'memory x':>10s}{'peak MiB':>12s}"
            f"{'oracle share, final':>22s}{'oracle share, area':>22s}{'time x, paired':>24s}{'memory x, paired':>24s}"
        )
        lines += [header, "-" * len(header)]
        for method in order:
            e = methods[method]
            share, ratios = e["oracle_share"], e["ratios"]
            lines.append(
                f"{label(method):34s}{_fmt_number(ratios['train_time'], 10, 2)}"
                f"{_fmt_number(ratios['peak_rss_mib'], 10, 2)}{_fmt_number(e['peak_rss_mib'][0], 12, 0)}"
                f"{_fmt_number(share['final'], 22, 2)}{_fmt_number(share['auc'], 22, 2)}"
                + "".join(f"{_fmt_ratio(e['paired_ratios'][key]):>24s}" for key in ("train_time", "peak_rss_mib"))
            )
        lines.append(
            f"\n{task}: credit assignment over RL rollouts (mean ± std over seeds): the mean per-token advantage by "
            "where the first slip is, and the value's drop across the decisive token (learned values; oracle: the "
            "exact value on the same completions)"
        )
        header = (
            f"{'method':34s}{'first wrong':>16s}{'wrong, before':>16s}{'wrong, after':>16s}{'correct':>16s}"
            f"{'slip rank':>16s}{'value drop':>16s}{'oracle drop':>16s}"
        )
        lines += [header, "-" * len(header)]
        keys = ("at_first_wrong", "wrong_before", "wrong_after", "correct", "slip_rank", "value_drop", "oracle_drop")
        for method in order:
            credit = methods[method]["credit"]
            lines.append(f"{label(method):34s}" + "".join(f"{_fmt(credit[key]):>16s}" for key in keys))
    return "\n".join(lines)


# The arms protocol 2 plots together, and protocol 1's token-level loss ablation: tab10's ten hues, one each.
DISTINCT_HUES = (
    "vapo",
    "grpo",
    "ppo",
    "grpo-16x4",
    CRITIC_FREE,
    ORACLE,
    "no-group-sampling",
    "vapo-paper",
    "grpo-32x2",
    "sequence-loss",
)


def arm_color(method: str) -> tuple[float, ...]:
    """One colour per arm, the same in every panel and plot: a hue of its own (tab10) for each arm of
    ``DISTINCT_HUES``, the light shades of tab20 for protocol 1's other ablations. (tab20 by the place in ``METHODS``
    gave neighbouring arms two shades of one hue: the exact value and no critic both pink, PPO and GRPO purple.)"""
    import matplotlib

    if method in DISTINCT_HUES:
        return matplotlib.colormaps["tab10"](DISTINCT_HUES.index(method))
    others = [m for m in METHODS if m not in DISTINCT_HUES]
    return matplotlib.colormaps["tab20"](2 * others.index(method) + 1)


def plot(summary: dict, out: Path, k: int) -> list[Path]:
    """``learning_vs_samples.png`` and ``learning_vs_time.png``: mean avg@k with a ±1 std band, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for axis, xlabel, filename in (
        ("samples", "training samples generated (value pretraining included)", "learning_vs_samples.png"),
        ("train_time_mean", "training wall time, s (evaluation excluded)", "learning_vs_time.png"),
    ):
        tasks = list(summary)
        fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.8), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            comparator = next(iter(summary[task].values()))["comparator"]
            for method in (m for m in METHODS if m in summary[task]):
                color = arm_color(method)
                curve = summary[task][method]["curve"]
                x = [p[axis] for p in curve]
                y = [p["avg@k_mean"] for p in curve]
                s = [p["avg@k_std"] for p in curve]
                main = method in ("vapo", "ppo", comparator, ORACLE, CRITIC_FREE)
                ax.plot(
                    x,
                    y,
                    color=color,
                    lw=2.2 if main else 1.0,
                    ls="-" if main else "--",
                    label=f"{label(method)} (n={len(summary[task][method]['seeds'])})",
                )
                ax.fill_between(  # an accuracy's ±1 std band, kept within [0, 1]
                    x,
                    [max(a - b, 0.0) for a, b in zip(y, s)],
                    [min(a + b, 1.0) for a, b in zip(y, s)],
                    color=color,
                    alpha=0.15 if main else 0.06,
                    lw=0,
                )
            ax.set_title(task)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"held-out avg@{k} (T=1)")
            ax.grid(alpha=0.3)
        for ax in axes[0]:
            ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one run in this process
# ---------------------------------------------------------------------------------------------------------------------


def task_module(task: str):
    """The data module of a task (``build_split``)."""
    from trl_vapo.demo import chains, data

    return {"demo": data, "chains": chains}[task]


def task_model_dir(task: str) -> str:
    from trl_vapo.demo import MODEL_DIR

    return str(MODEL_DIR if task == "demo" else CHAINS_MODEL_DIR)


def eval_dataset(spec: RunSpec):
    """The reporting set (the first ``eval_problems`` unique held-out problems) or the validation set (the next
    ``validation_problems``): disjoint, because a longer draw with the same seed starts with the shorter one."""
    build = task_module(spec.task).build_split
    if spec.eval_set == "test":
        return build("held_out", spec.eval_problems)
    full = build("held_out", spec.eval_problems + spec.validation_problems)
    return full.select(range(spec.eval_problems, len(full)))


def _counting(reward: Callable, counter: list[int]) -> Callable:
    """``reward`` that also counts the completions it scores (skipping VAPOTrainer's empty pre-flight check)."""

    @functools.wraps(reward)
    def counted(*args, completion_ids=None, **kwargs):
        if completion_ids and any(len(ids) for ids in completion_ids):
            counter[0] += len(completion_ids)
        return reward(*args, completion_ids=completion_ids, **kwargs)

    return counted


class LearningCurve(TrainerCallback):
    """A ``TrainerCallback`` that evaluates the policy every ``eval_every_samples`` training samples, at rollout
    boundaries: when a rollout starts, every earlier sample has been trained on. Its clock leaves out evaluation and
    diagnostics.

    ``evaluate(greedy)`` returns an ``EvaluationResult``-like dict; ``samples()`` the samples generated so far;
    ``frozen()`` whether the policy is known unchanged since the start (VAPO's value pretraining). VAPOTrainer calls
    ``on_rollout`` with each rollout; GRPO's rollouts come through ``rollout_started`` (``install_grpo_hook``).
    """

    def __init__(self, evaluate, samples, frozen, eval_every_samples: int):
        self.evaluate, self.samples, self.frozen, self.eval_every = evaluate, samples, frozen, eval_every_samples
        self.points: list[dict] = []
        self.excluded = 0.0  # seconds of evaluation and diagnostics, left out of the training clock
        self.start: float | None = None

    def train_time(self) -> float:
        return time.perf_counter() - self.start - self.excluded

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def record(self, state, trained_samples: int, greedy: bool = False) -> None:
        train_time = self.train_time()
        began = time.perf_counter()
        if self.points and self.frozen() and not greedy:
            result = {key: self.points[0][key] for key in ("avg@k", "pass@k", "mean_length")} | {"evaluated": False}
        else:
            result = self.evaluate(greedy) | {"evaluated": True}
        elapsed = time.perf_counter() - began
        self.exclude(elapsed)
        self.points.append(
            {"samples": trained_samples, "train_time_s": train_time, "step": state.global_step, "eval_s": elapsed}
            | result
        )
        print(
            f"  samples {trained_samples:6d}  train {train_time:7.1f}s  avg@k {result['avg@k']:.3f}"
            + (f"  greedy {result['pass@1']:.3f}" if "pass@1" in result else "")
            + f"  (eval {elapsed:.1f}s)",
            flush=True,
        )

    def rollout_started(self, state, trained_samples: int) -> None:
        """A rollout is about to be trained on; `trained_samples` were generated (and trained on) before it."""
        if trained_samples >= self.points[-1]["samples"] + self.eval_every:
            self.record(state, trained_samples)

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
        self.record(state, 0)
        return control

    def on_rollout(self, args, state, control, *, rollout, **kwargs):
        self.rollout_started(state, self.samples() - len(rollout))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.record(state, self.samples(), greedy=True)
        return control


CREDIT_KEYS = (
    "at_first_wrong",
    "wrong_before",
    "wrong_after",
    "wrong_other",
    "correct",
    "slip_rank",
    "value_drop",
    "oracle_drop",
)
"""The credit statistics each record summarises: ``credit_assignment``'s, and the values' and the oracle's drop at
the first slip (``CreditAssignment.record``)."""


class CreditAssignment(TrainerCallback):
    """Per-rollout credit-assignment statistics from the advantages a trainer's loss uses.

    ``VAPOTrainer`` calls ``on_rollout`` with each rollout as built; GRPO's rollouts come in through ``record``
    (``install_grpo_hook``). A rollout is counted once per optimizer step.
    """

    def __init__(self, tokenizer, curve: LearningCurve):
        self.tokenizer, self.curve = tokenizer, curve
        self.per_rollout: list[dict] = []
        self._seen: set[int] = set()

    def on_rollout(
        self, args, state, control, *, rollout, rows: list[dict] | None = None, phase: str | None = None, **kwargs
    ):
        """VAPO: ``rollout`` is the trainer's ``Rollout`` as built (prompt + completion ids, attention mask, prompt
        length, ``advantages`` whitened as the loss uses them, zeros while the critic pretrains; ``old_values``; its
        ``phase``);
        ``rows`` its data set rows, or ``None`` to decode the prompts from the rollout."""
        phase = phase or getattr(rollout, "phase", "rl")
        # One rollout per optimizer step at most, so the step number names it (an object's id() is reused).
        if phase != "rl" or state.global_step in self._seen:
            return control
        self._seen.add(state.global_step)
        p = rollout.prompt_length
        if rows is not None:
            prompts = [row["prompt"] for row in rows]
        else:
            prompts = [
                self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                for ids, mask in zip(rollout.input_ids[:, :p], rollout.attention_mask[:, :p])
            ]
        self.record(
            prompts=prompts,
            completion_ids=rollout.input_ids[:, p:],
            completion_mask=rollout.attention_mask[:, p:],
            advantages=rollout.advantages,
            values=rollout.old_values,
        )
        return control

    def record(self, *, prompts: list[str], completion_ids, completion_mask, advantages, values=None) -> None:
        """One rollout: ``[N, C]`` tensors of completion ids, mask (1 on each completion's tokens, EOS included),
        per-token advantages and, for a method with values, the values ``V(s_t)``; the time it takes is left out of
        the training clock. Besides ``credit_assignment``'s statistics: ``value_drop`` (the values' drop at the first
        slip, ``value_drop_at_first_wrong``; NaN without values) and ``oracle_drop``, the exact value's drop on the
        same completions (``trl_vapo.demo.oracle`` at the hazards measured on this rollout)."""
        began = time.perf_counter()
        from trl_vapo.demo.chains import first_wrong_index
        from trl_vapo.demo.oracle import measure_hazards, oracle_values

        lengths = completion_mask.sum(dim=1).tolist()
        ids = completion_ids.tolist()
        texts = completion_texts(self.tokenizer, ids, lengths)
        first_wrong = [first_wrong_index(p, t) for p, t in zip(prompts, texts)]
        stats = credit_assignment(advantages.float().tolist(), first_wrong, lengths)
        ended = [bool(n) and row[n - 1] == self.tokenizer.eos_token_id for row, n in zip(ids, lengths)]
        hazards, _ = measure_hazards(prompts, texts, ended)
        exact = [oracle_values(*row, range(n), hazards) for *row, n in zip(prompts, texts, ended, lengths)]
        stats["oracle_drop"] = value_drop_at_first_wrong(exact, first_wrong, lengths)
        learned = values.float().tolist() if values is not None else None
        stats["value_drop"] = value_drop_at_first_wrong(learned, first_wrong, lengths) if learned else math.nan
        self.per_rollout.append(stats)
        self.curve.exclude(time.perf_counter() - began)

    def summary(self) -> dict[str, float]:
        """Each statistic averaged over rollouts (rollouts without such tokens left out); counts summed."""
        out = {}
        for key in CREDIT_KEYS:
            values = [r[key] for r in self.per_rollout if not math.isnan(r[key])]
            out[key] = statistics.mean(values) if values else math.nan
        for key in ("num_wrong", "num_wrong_unlocated", "num_correct"):
            out[key] = sum(r[key] for r in self.per_rollout)
        out["rollouts"] = len(self.per_rollout)
        return out


def install_grpo_hook(trainer, curve: LearningCurve, credit: CreditAssignment) -> None:
    """Feed GRPO's rollouts to ``curve`` and ``credit``: ``_generate_and_score_completions`` makes one rollout, and
    returns its completions and one advantage per sequence, which is every token's advantage. (VAPOTrainer calls
    their ``on_rollout`` itself.)"""
    original = trainer._generate_and_score_completions

    def generate_and_score(inputs):
        curve.rollout_started(trainer.state, curve.samples())
        output = original(inputs)
        mask = output["completion_mask"]
        credit.record(
            prompts=[row["prompt"] for row in inputs],
            completion_ids=output["completion_ids"],
            completion_mask=mask,
            advantages=output["advantages"][:, None] * mask,
        )
        return output

    trainer._generate_and_score_completions = generate_and_score


def lora_config(rank: int | None):
    """VAPO's adapters for ``lora_r: rank`` in a variant or probe, or None (all weights train): rank ``rank``,
    alpha ``2 * rank``, on every linear layer; the policy gets one, the critic another on the same frozen base."""
    if rank is None:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")


def build_trainer(spec: RunSpec, out_dir: str, reward: Callable, extra: dict | None = None):
    """The trainer of ``spec.method`` on ``spec.task`` with the recipe, the protocol's budget and its seed;
    ``extra``: fields on top (``bench_critic.py``'s probes): VAPOConfig's, and ``lora_r`` for LoRA adapters."""
    train = task_module(spec.task).build_split("train", 4096)
    model_dir = task_model_dir(spec.task)
    recipe = dict(VAPO_RECIPE)
    recipe["per_device_train_batch_size"] = spec.samples_per_rollout // recipe["steps_per_generation"]
    if spec.value_pretrain_steps is not None:
        recipe["value_pretrain_steps"] = spec.value_pretrain_steps
    steps_per_rollout = recipe["steps_per_generation"] // recipe["gradient_accumulation_steps"]
    common = {
        "output_dir": out_dir,
        "max_completion_length": spec.completion_length(),
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": spec.learning_rate,
        "max_grad_norm": 1.0,
        "beta": 0.0,
        "bf16": False,
        "gradient_checkpointing": False,
        "model_init_kwargs": {"dtype": "float32"},
        "logging_steps": steps_per_rollout,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": spec.seed,
        "dataloader_num_workers": 0,
    }
    overrides = spec.overrides()
    if spec.method in GRPO_METHODS:
        from trl import GRPOConfig, GRPOTrainer

        grpo = {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "group", **overrides}
        iterations = grpo.pop("num_iterations", 1)
        batch = ["per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation"]
        batch.append("num_generations")
        args = GRPOConfig(
            **common,
            num_iterations=iterations,
            **{k: grpo.pop(k, recipe[k]) for k in batch},
            max_steps=spec.rollouts * steps_per_rollout * iterations,
            lr_scheduler_type="constant",  # VAPO's constant_with_warmup with no warm-up steps
            **grpo,
            disable_dropout=True,
            mask_truncated_completions=False,
            log_completions=False,
            use_vllm=False,
        )
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=train)
        return trainer, steps_per_rollout
    from trl_vapo import VAPOConfig, VAPOTrainer

    # No diagnostic plots: the clock measures training only, as GRPO's (protocol 1's VAPO runs drew them).
    config = {**recipe, **overrides, "plot_diagnostics": False, **(extra or {})}
    lora_r = config.pop("lora_r", None)
    value_model = frozen_value_function(config.pop("value_model", None), model_dir)
    if value_model is not None:
        config["value_pretrain_steps"] = 0  # nothing to pretrain: every rollout is an RL rollout
    pretrain = config["value_pretrain_steps"]
    config.pop("learning_rate")
    critic_lr_ratio = config.pop("critic_lr_ratio", spec.critic_lr_ratio)
    config.setdefault("critic_learning_rate", spec.learning_rate * critic_lr_ratio)  # a variant may name its own
    rl_steps_per_rollout = steps_per_rollout * config.get("critic_num_iterations", 1)
    args = VAPOConfig(**common, **config, max_steps=(spec.rollouts - pretrain) * rl_steps_per_rollout)
    trainer = VAPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=train,
        value_model=value_model,
        peft_config=lora_config(lora_r),
    )
    # The sample budget as the trainer counts it (`trainer.run_plan`): value-pretraining and RL rollouts together.
    plan = trainer.run_plan
    rollouts = plan.pretrain_rollouts + plan.rl_steps // (plan.steps_per_pass * args.critic_num_iterations)
    if rollouts != spec.rollouts:
        raise ValueError(f"{spec.method}: the trainer plans {rollouts} rollouts, the budget is {spec.rollouts}")
    return trainer, plan.steps_per_pass


def zero_value(input_ids, attention_mask, completion_length):
    """The critic-free arm's value function: 0 everywhere (with lambda 1 and whitening, return minus the mean)."""
    import torch

    return torch.zeros(input_ids.shape[0], completion_length)


def frozen_value_function(name: str | None, model_dir: str):
    """The frozen value function ``name`` (``VALUE_FUNCTIONS``) for the model in ``model_dir``, or None."""
    if name is None:
        return None
    if name == "zero":
        return zero_value
    if name == "oracle":
        from transformers import AutoTokenizer

        from trl_vapo.demo.oracle import OracleValue

        return OracleValue(AutoTokenizer.from_pretrained(model_dir))  # math_reward's +1 / -1
    raise ValueError(f"unknown value function {name!r}; known: {VALUE_FUNCTIONS}")


def code_commit() -> str | None:
    """The git commit of the code a run ran (with ``+dirty`` when tracked files had uncommitted changes: untracked
    ones are the records of finished runs), or None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        changed = ["git", "status", "--porcelain", "--untracked-files=no"]
        status = subprocess.run(changed, cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def run_worker(spec: RunSpec) -> dict:
    """Train ``spec``'s method once and return its record (curve, credit statistics, logs)."""
    import torch

    torch.set_num_threads(1)
    from trl_vapo.evaluation import evaluate_policy, random_state_kept
    from trl_vapo.rewards import math_reward

    started = time.perf_counter()
    commit = code_commit()  # the code this process loaded, not what the tree holds when it ends
    kind = "grpo" if spec.method in GRPO_METHODS else "vapo"
    counter = [0]
    out_dir = run_dir(f"bench_learning_{spec.method}_")
    trainer, steps_per_rollout = build_trainer(spec, out_dir, _counting(math_reward, counter))
    tokenizer = trainer.processing_class
    held_out = eval_dataset(spec)

    def policy():
        unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        return unwrapped.policy if kind == "vapo" else unwrapped

    def evaluate(greedy: bool) -> dict:
        # A private random stream: the same evaluation samples at every point, and training's stream untouched
        # (the device's too: `manual_seed` reseeds CUDA, whose state a GPU run's training then restarted from).
        with random_state_kept(trainer.accelerator.device):
            torch.manual_seed(spec.eval_seed)
            result = evaluate_policy(
                policy(),
                tokenizer,
                held_out,
                math_reward,
                k=spec.eval_k,
                temperature=1.0,
                top_p=1.0,
                max_new_tokens=spec.completion_length(),
                batch_size=128,
                greedy=greedy,
            )
        out = {"avg@k": result.avg_at_k, "pass@k": result.pass_at_k, "mean_length": result.mean_length}
        return out | ({"pass@1": result.pass_at_1} if greedy else {})

    def frozen() -> bool:  # VAPO's policy has not been updated yet: value pretraining, or RL before its first step
        progress = getattr(trainer, "progress", None)
        if progress is None:  # GRPO
            return False
        return progress.phase == "value_pretrain" or progress.rl_start_step == trainer.state.global_step

    budget = spec.rollouts * spec.samples_per_rollout
    curve = LearningCurve(evaluate, lambda: counter[0], frozen, spec.eval_every * spec.samples_per_rollout)
    credit = CreditAssignment(tokenizer, curve)
    if kind == "grpo":
        install_grpo_hook(trainer, curve, credit)
    trainer.add_callback(curve)
    trainer.add_callback(credit)  # VAPOTrainer calls its on_rollout with every rollout
    trainer.train()
    if counter[0] != budget:
        raise RuntimeError(f"generated {counter[0]} training samples, the budget is {budget}")
    import torch as _torch
    import transformers
    import trl

    config = json.loads(trainer.args.to_json_string())
    for key in ("output_dir", "logging_dir"):  # a temporary folder
        config.pop(key, None)
    return {
        "spec": asdict(spec),
        "protocol": PROTOCOL,
        "code_commit": commit,
        "trainer": type(trainer).__name__,
        "config": config,  # every field of the trainer's config as it ran
        "value_model": METHODS[spec.method].get("value_model"),  # a frozen value function's name, or None
        "final": curve.points[-1],
        "points": curve.points,
        "samples": counter[0],
        "train_time_s": curve.points[-1]["train_time_s"],
        "excluded_time_s": curve.excluded,
        "total_time_s": time.perf_counter() - started,
        # The process's peak resident memory (Linux: KiB), the CPU runs' memory figure: one run per process (a run of
        # `--jobs 0`, which shares its process, records None instead).
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "credit_per_rollout": credit.per_rollout,
        "credit_summary": credit.summary(),
        "log_history": trainer.state.log_history,
        "machine": {
            "python": platform.python_version(),
            "torch": _torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def plan(stage: str, settings: dict, chosen: dict | None) -> list[RunSpec]:
    """The runs of a stage, interleaved (seed-major, then task, then method) so that background load and the
    machine's state over time hit every method alike."""
    keys = ("rollouts", "samples_per_rollout", "eval_every", "eval_k", "eval_problems", "eval_seed", "critic_lr_ratio")
    base = {key: settings[key] for key in keys} | {"value_pretrain_steps": settings.get("value_pretrain_steps")}
    lengths = settings.get("max_completion_length", {})  # None: the task's own (MAX_COMPLETION_LENGTH)
    runs = []
    if stage == "tune":
        tuning = {"eval_set": "validation", "validation_problems": settings["validation_problems"], **base}
        for seed in settings["tuning_seeds"]:
            for task in settings["tasks"]:
                fields = {**tuning, "max_completion_length": lengths.get(task)}
                for method in [m for m in settings["tuned_methods"] if m in settings.get("methods", METHODS)]:
                    for lr in settings["lr_grid"]:
                        runs.append(RunSpec("tune", task, method, seed, lr, **fields))
                    for variant, changes in TUNING_VARIANTS[method_family(method)].items():
                        lr = changes.get("learning_rate", VAPO_RECIPE["learning_rate"])
                        runs.append(RunSpec("tune", task, method, seed, lr, variant=variant, **fields))
        return runs
    arms = {task: reporting_arms(task, settings, chosen) for task in settings["tasks"]}
    for seed in sorted({seed for task_arms in arms.values() for seeds in task_arms.values() for seed in seeds}):
        for task in settings["tasks"]:
            fields = {"eval_set": "test", **base, "max_completion_length": lengths.get(task)}
            for method, seeds in arms[task].items():
                if seed in seeds:
                    lr, variant = _reporting_choice(task, method, chosen)
                    runs.append(RunSpec("report", task, method, seed, lr, variant=variant, **fields))
    return runs


class MissingChoice(ValueError):
    """A reporting arm whose frozen choice `chosen.json` lacks: reporting it would run another arm's settings."""


def reporting_arms(task: str, settings: dict, chosen: dict | None) -> dict[str, list[int]]:
    """A task's reporting arms, each with its seeds: ``best-grpo`` resolved to the GRPO arm frozen for the task, the
    decisive arms (that one included, by either name) on the decisive seeds, the others on the reporting seeds."""
    best = ((chosen or {}).get(task) or {}).get(BEST_GRPO)
    decisive = set(settings.get("decisive_arms", ()))
    if best is not None and BEST_GRPO in decisive:
        decisive.add(best["method"])
    arms: dict[str, list[int]] = {}
    for method in settings.get("methods_by_task", {}).get(task, settings["methods"]):
        if method == BEST_GRPO:
            if best is None:
                raise MissingChoice(
                    f"{task}: chosen.json has no best-tuned GRPO; tune the three GRPO arms first (--stage tune "
                    f"--tasks {task} --methods {','.join(GRPO_METHODS)})"
                )
            method = best["method"]
        seeds = settings["decisive_seeds"] if method in decisive else settings["reporting_seeds"]
        arms[method] = sorted({*arms.get(method, []), *seeds})
    return arms


def _reporting_choice(task: str, method: str, chosen: dict | None) -> tuple[float, str]:
    """The frozen (learning rate, variant) from tuning: a tuned arm's own, an untuned arm VAPO's; the recipe's without
    tuning. An arm whose choice is not frozen is refused (``MissingChoice``), never run with another's."""
    if chosen is None:
        return VAPO_RECIPE["learning_rate"], ""
    owner = choice_owner(method)
    choice = (chosen.get(task) or {}).get(owner)
    if choice is None:
        whose = "its own" if owner == method else "VAPO's (an untuned arm)"
        raise MissingChoice(
            f"{task}/{method} reports with {whose} frozen choice, and chosen.json has none: run --stage tune "
            f"--tasks {task} --methods {owner} first"
        )
    return choice["learning_rate"], choice["variant"]


def _launch(spec: RunSpec, out: Path) -> tuple[RunSpec, bool, float]:
    path = spec.path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--worker", json.dumps(asdict(spec)), "--result", str(path)]
    began = time.time()
    with open(path.with_suffix(".log"), "w") as log:
        proc = subprocess.run(cmd, check=False, env=worker_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return spec, proc.returncode == 0, time.time() - began


def _run_here(spec: RunSpec, out: Path) -> tuple[RunSpec, bool, float]:
    """One run in this process (``--jobs 0``): no start-up per run, for smoke tests; a failure is printed."""
    path = spec.path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    began = time.time()
    try:
        record = run_worker(spec)
        record["peak_rss_mib"] = None  # the process's peak is every run's so far: not this run's
        write_record(record, path)
    except Exception:  # noqa: BLE001 -- one failed run must not stop the others, as with subprocesses
        import traceback

        traceback.print_exc()
        return spec, False, time.time() - began
    return spec, True, time.time() - began


def write_record(record: dict, path: Path) -> None:
    write_json(path, record)  # atomic: a JSON that exists is a finished run


def run_all(specs: list[RunSpec], out: Path, jobs: int) -> list[RunSpec]:
    """Run the specs whose JSON is missing, ``jobs`` at a time (0: one after another in this process); returns the
    failed ones. A JSON that exists must be the run of its spec (`check_done_runs_match`)."""
    todo = [s for s in specs if not s.path(out).is_file()]
    if not specs:  # `--stage aggregate`: nothing to run, nothing to say
        return []
    check_done_runs_match([s for s in specs if s not in todo], out)
    how = "in this process" if jobs == 0 else f"with {jobs} job(s)"
    print(f"{len(specs) - len(todo)} of {len(specs)} runs already done; running {len(todo)} {how}", flush=True)
    failed = []
    started = time.time()
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        results = map(lambda s: _run_here(s, out), todo) if jobs == 0 else pool.map(lambda s: _launch(s, out), todo)
        for i, (spec, ok, seconds) in enumerate(results):
            status = "ok" if ok else "FAILED" + ("" if jobs == 0 else f" (see {spec.path(out).with_suffix('.log')})")
            print(
                f"  [{time.time() - started:6.0f}s] {i + 1}/{len(todo)} {spec.stage} {spec.task} {spec.method} "
                f"lr {spec.learning_rate:g} seed {spec.seed}: {seconds:.0f}s {status}",
                flush=True,
            )
            if not ok:
                failed.append(spec)
    return failed


def check_done_runs_match(specs: list[RunSpec], out: Path) -> None:
    """Exit with an error naming each finished run whose record is of other settings than its spec: a record's file
    name holds the task, method and seed (and for tuning the rate and variant), not the budget or the evaluation, so
    a `--no-tune` or `--rollouts 10` report into the same folder was skipped as done, then aggregated beside the
    protocol's runs."""
    stale = []
    for spec in specs:
        recorded = json.loads(spec.path(out).read_text())["spec"]
        differ = {
            name: (recorded.get(name), value) for name, value in asdict(spec).items() if recorded.get(name) != value
        }
        if differ:
            said = ", ".join(f"{name} {old!r} (planned {new!r})" for name, (old, new) in differ.items())
            stale.append(f"  {spec.path(out)}: {said}")
    if stale:
        sys.exit(
            f"{len(stale)} finished run(s) in {out} are of other settings than this call plans:\n"
            + "\n".join(stale)
            + "\nGive this call an --out of its own, or move those records away to rerun them."
        )


def load_records(out: Path, stage: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / stage).glob("*/*/*.json"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("all", "tune", "report", "aggregate"), default="all")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "learning")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at once, one process and thread each (0: one by one in this process)"
    )
    parser.add_argument("--tasks", help="comma-separated subset of " + ",".join(PROTOCOL["tasks"]))
    parser.add_argument(
        "--methods",
        help="comma-separated subset of "
        + ",".join(METHODS)
        + f"; {BEST_GRPO}: the GRPO arm frozen as the best-tuned",
    )
    parser.add_argument(
        "--seeds",
        help="reporting seeds of every arm, comma-separated (protocol: 2000-2004; the decisive arms 2000-2009)",
    )
    parser.add_argument("--tuning-seeds", help="comma-separated (protocol: 1000); never reported")
    parser.add_argument("--lr-grid", help="actor learning rates for VAPO, PPO and GRPO (protocol: 3e-5,1e-4,3e-4)")
    parser.add_argument("--rollouts", type=int, help="sample budget in rollouts of 64 (protocol: 35)")
    parser.add_argument("--eval-every", type=int, help="rollouts between evaluations (protocol: 5)")
    parser.add_argument("--eval-problems", type=int, help="held-out problems per evaluation (protocol: 200)")
    parser.add_argument("--no-tune", action="store_true", help="skip tuning; report with the recipe's lr (1e-4)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test in this process: every arm (ARMS) on chains, VAPO and GRPO on the demo, 1 seed, 2 rollouts "
        "of 16, 2 held-out problems",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)

    if opts.worker:
        write_record(run_worker(RunSpec(**json.loads(opts.worker))), Path(opts.result))
        return 0

    settings = {**PROTOCOL, "methods": list(METHODS)}
    if opts.quick:
        settings.update(QUICK)
        opts.no_tune = True
        opts.jobs = 0
    for name, value in (("tasks", opts.tasks), ("methods", opts.methods)):
        if value:
            settings[name] = value.split(",")
    if opts.seeds:
        settings["reporting_seeds"] = settings["decisive_seeds"] = [int(s) for s in opts.seeds.split(",")]
    for name in ("rollouts", "eval_every", "eval_problems"):
        if getattr(opts, name) is not None:
            settings[name] = getattr(opts, name)
    if opts.tuning_seeds:
        settings["tuning_seeds"] = [int(s) for s in opts.tuning_seeds.split(",")]
    if opts.lr_grid:
        settings["lr_grid"] = [float(lr) for lr in opts.lr_grid.split(",")]
    if opts.stage in ("all", "report") and not opts.quick:  # aggregating spent seeds reruns nothing
        # (the protocol's own reporting seeds too: `--tuning-seeds` naming one of them made it a tuning seed)
        tuning_seeds = sorted({*PROTOCOL["tuning_seeds"], *settings["tuning_seeds"], *CRITIC_PROBE_SEEDS})
        reporting = sorted({*settings["reporting_seeds"], *settings["decisive_seeds"]})  # (one list with --seeds)
        spent = [s for s in reporting if s in tuning_seeds + settings["spent_seeds"]]
        if spent:
            named = "--seeds" if opts.seeds else "the protocol's reporting seeds"
            parser.error(
                f"{named} {','.join(map(str, spent))}: a tuning seed ({tuning_seeds}) or one reported "
                f"under protocol 1 ({settings['spent_seeds']}) is never a reporting seed; take fresh ones"
                + ("" if opts.seeds else " (--seeds), or tune on others (--tuning-seeds)")
            )
    if opts.no_tune and BEST_GRPO in settings["methods"] and not opts.quick:
        parser.error(
            f"--no-tune reports every arm at the recipe's settings, and {BEST_GRPO} is a choice tuning makes: drop "
            f"--no-tune (the choice is read from chosen.json), or name a GRPO arm ({', '.join(GRPO_METHODS)})"
        )
    unknown = [m for m in settings["methods"] if m not in METHODS and m != BEST_GRPO]
    unknown += [t for t in settings["tasks"] if t not in PROTOCOL["tasks"]]
    if unknown:
        parser.error(f"unknown methods or tasks: {unknown}")
    if "chains" in settings["tasks"] and not (CHAINS_MODEL_DIR / "config.json").is_file():
        parser.error(
            f"no chains model in {CHAINS_MODEL_DIR}; build it with python -m trl_vapo.demo.train_sft "
            "--task chains --output-dir benchmarks/models/chains_sft"
        )
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; out {out}",
        flush=True,
    )

    chosen_path = out / "chosen.json"
    chosen = None
    if opts.stage in ("all", "tune") and not opts.no_tune:
        failed = run_all(plan("tune", settings, None), out, opts.jobs)
        if failed:
            print(f"{len(failed)} tuning runs failed; not choosing learning rates", file=sys.stderr)
            return 1
        # The arms whose whole sweep is in (a sweep another call is still running is not chosen from half its runs).
        sweep = plan("tune", {**settings, "methods": settings["tuned_methods"]}, None)
        unfinished = {(spec.task, spec.method) for spec in sweep if not spec.path(out).is_file()}
        chosen = choose_settings(
            [
                r
                for r in load_records(out, "tune")
                if r["spec"]["task"] in settings["tasks"]
                and (r["spec"]["task"], r["spec"]["method"]) not in unfinished
            ]
        )
        chosen = freeze_choices(chosen, json.loads(chosen_path.read_text()) if chosen_path.is_file() else {})
        chosen_path.write_text(json.dumps(chosen, indent=2))
        print(f"chosen learning rates (frozen in {chosen_path}): {chosen}", flush=True)
        if opts.stage == "tune":
            return 0
    elif not opts.no_tune and chosen_path.is_file():
        chosen = json.loads(chosen_path.read_text())
    elif opts.stage == "report" and not opts.no_tune:
        parser.error(f"no {chosen_path}: run --stage tune first, or pass --no-tune")

    try:  # every arm resolved, and each one that runs with its frozen choice, before any run
        arms = {task: reporting_arms(task, settings, chosen) for task in settings["tasks"]}
        specs = plan("report", settings, chosen) if opts.stage in ("all", "report") else []
    except MissingChoice as error:
        parser.error(str(error))
    failed = run_all(specs, out, opts.jobs)
    if failed:
        print(f"{len(failed)} reporting runs failed; aggregating the rest", file=sys.stderr)

    tuning = [r for r in load_records(out, "tune") if r["spec"]["task"] in settings["tasks"]]
    if tuning:
        (out / "tuning.txt").write_text(format_tuning(tuning, chosen) + "\n")
        print(f"wrote {out / 'tuning.txt'}")
    # This protocol's runs only: another protocol's seeds in the same folder are not mixed in.
    wanted = {(task, method, seed) for task in arms for method, seeds in arms[task].items() for seed in seeds}
    records = [
        r for r in load_records(out, "report") if (r["spec"]["task"], r["spec"]["method"], r["spec"]["seed"]) in wanted
    ]
    if not records:
        print("no finished reporting runs to aggregate", file=sys.stderr)
        return 0 if tuning and opts.stage == "aggregate" else 1
    comparators = {
        task: choices[BEST_GRPO]["method"] for task, choices in (chosen or {}).items() if BEST_GRPO in choices
    }
    summary = aggregate(records, comparators)
    k = records[0]["spec"]["eval_k"]
    table = format_table(summary, k)
    print(table)
    (out / "table.txt").write_text(table + "\n")
    for methods in summary.values():
        for entry in methods.values():
            entry.pop("points_per_run")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for path in plot(summary, out, k):
        print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
