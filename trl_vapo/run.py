"""The run's counters: how many optimizer steps it takes (`RunPlan`, computed once) and where it is
(`TrainingProgress`, saved in every checkpoint). Every step count the trainer, its checkpoints and its progress bar
use is read here."""

from __future__ import annotations

import dataclasses
import math

from .rollout import RL, VALUE_PRETRAIN


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The step counts of a run, from its config, its dataset's length and whether value pretraining runs.

    A rollout samples ``prompts_per_rollout`` prompts x ``num_generations`` completions; one pass over it is
    ``steps_per_pass`` optimizer steps (``steps_per_generation / gradient_accumulation_steps``). Value pretraining
    runs ``pretrain_rollouts`` rollouts of ``value_pretrain_num_iterations`` passes each (fewer when its stop rule
    ends it early). RL runs ``max_steps`` steps, or, by epochs, ``ceil(num_train_epochs x rollouts per epoch)``
    rollouts of ``critic_num_iterations`` passes each (the first ``num_iterations`` of them also train the policy).
    """

    prompts_per_rollout: int
    steps_per_pass: int
    pretrain_rollouts: int
    steps_per_pretrain_rollout: int
    rl_steps: int

    @classmethod
    def from_config(cls, args, dataset_length: int | None, value_pretraining: bool) -> RunPlan:
        """The plan of `args` (a `VAPOConfig`) over a dataset of `dataset_length` prompts (None: a stream, which
        needs `max_steps`), with or without value pretraining."""
        prompts_per_rollout = args.generation_batch_size // args.num_generations
        steps_per_pass = args.steps_per_generation // args.gradient_accumulation_steps
        if args.max_steps > 0:
            rl_steps = args.max_steps
        else:
            rollouts = math.ceil(args.num_train_epochs * ((dataset_length or 0) // prompts_per_rollout))
            rl_steps = rollouts * args.critic_num_iterations * steps_per_pass
        return cls(
            prompts_per_rollout=prompts_per_rollout,
            steps_per_pass=steps_per_pass,
            pretrain_rollouts=args.value_pretrain_steps if value_pretraining else 0,
            steps_per_pretrain_rollout=args.value_pretrain_num_iterations * steps_per_pass,
            rl_steps=rl_steps,
        )

    @property
    def pretrain_steps(self) -> int:
        """Value pretraining's optimizer steps, at most (its stop rule may end it earlier)."""
        return self.pretrain_rollouts * self.steps_per_pretrain_rollout

    def max_steps(self, progress: TrainingProgress) -> int:
        """The run's optimizer steps as `progress` finds it: value pretraining's budget and the RL steps, and once
        value pretraining has ended (at `rl_start_step`, early or not), the steps it took instead of its budget. The
        start of a run, the end of value pretraining and a resume all read their `max_steps` here."""
        if progress.phase == RL and progress.rl_start_step is not None:
            return progress.rl_start_step + self.rl_steps
        return self.pretrain_steps + self.rl_steps


@dataclasses.dataclass
class TrainingProgress:
    """Where the run is, beyond `TrainerState`: saved in every checkpoint as `vapo_state.json`."""

    phase: str = VALUE_PRETRAIN
    value_pretrain_rollouts: int = 0
    explained_variances: list[float] = dataclasses.field(default_factory=list)  # one reading per pretraining rollout
    rl_start_step: int | None = None
    data_epoch: int = 0
    data_index: int = 0
    skipped_steps: int = 0  # updates dropped: a NaN/inf loss or gradient, or no token to train on
    consecutive_nonfinite_steps: int = 0
    scored_completions: int = 0  # over every process and rollout: 0 at the end of a run means nothing trained

    @classmethod
    def from_dict(cls, saved: dict) -> TrainingProgress:
        # Checkpoints of earlier versions carry fields that no longer exist (the old stop rule's best reading).
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in saved.items() if key in known})

    def final_explained_variance(self, window: int | None) -> float:
        """The critic's explained variance at the end of value pretraining: the mean of the last finite readings."""
        finite = [r for r in self.explained_variances if math.isfinite(r)][-(window or 1) :]
        return sum(finite) / len(finite) if finite else math.nan
