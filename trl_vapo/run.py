"""The run's counters: how many optimizer steps it takes (`RunPlan`, computed once), where it is (`TrainingProgress`,
saved in every checkpoint) and which prompts come next (`PromptCursor`, which reads and moves the progress's place in
the data). Every step count the trainer, its checkpoints and its progress bar use is read here."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from datasets import IterableDataset

from .metric_names import RL, VALUE_PRETRAIN


def prompts_per_rollout(args) -> int:
    """Prompts a rollout samples (each `num_generations` times): `generation_batch_size / num_generations`."""
    return args.generation_batch_size // args.num_generations


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
    rl_rollouts: int
    rollouts_per_epoch: int | None
    """Rollouts an epoch of a map-style set holds (None: a stream, whose length is unknown)."""

    @classmethod
    def from_config(cls, args, dataset_length: int | None, value_pretraining: bool) -> RunPlan:
        """The plan of `args` (a `VAPOConfig`) over a dataset of `dataset_length` prompts (None: a stream, which
        needs `max_steps`), with or without value pretraining."""
        prompts = prompts_per_rollout(args)
        steps_per_pass = args.steps_per_generation // args.gradient_accumulation_steps
        per_epoch = (dataset_length or 0) // prompts  # rollouts an epoch of a map-style set holds
        steps_per_rl_rollout = args.critic_num_iterations * steps_per_pass
        if args.max_steps > 0:
            rl_steps = args.max_steps
        else:
            # Rounded first: 1.1 epochs of 100 rollouts is 110.00000000000001 in floats, and one more rollout.
            rl_steps = math.ceil(round(args.num_train_epochs * per_epoch, 6)) * steps_per_rl_rollout
        return cls(
            prompts_per_rollout=prompts,
            steps_per_pass=steps_per_pass,
            pretrain_rollouts=args.value_pretrain_steps if value_pretraining else 0,
            steps_per_pretrain_rollout=args.value_pretrain_num_iterations * steps_per_pass,
            rl_steps=rl_steps,
            rl_rollouts=-(-rl_steps // steps_per_rl_rollout),  # (the last one cut by max_steps)
            rollouts_per_epoch=None if dataset_length is None else per_epoch,
        )

    @property
    def pretrain_steps(self) -> int:
        """Value pretraining's optimizer steps, at most (its stop rule may end it earlier)."""
        return self.pretrain_rollouts * self.steps_per_pretrain_rollout

    @property
    def planned_steps(self) -> int:
        """The run's optimizer steps as planned: value pretraining's whole budget, then the RL steps. A run starts
        with this count; `max_steps` corrects it once value pretraining has ended (early or not)."""
        return self.pretrain_steps + self.rl_steps

    def max_steps(self, progress: TrainingProgress) -> int:
        """The run's optimizer steps as `progress` finds it: value pretraining's budget and the RL steps, and once
        value pretraining has ended (at `rl_start_step`, early or not), the steps it took instead of its budget: none
        for a run that started in RL (`rl_start_step` None), whatever budget a resumed run's config names (a run of
        `value_pretrain_steps=0` resumed without it trained 50 rollouts' worth of steps too many). The start of a run,
        the end of value pretraining and a resume all read their `max_steps` here."""
        if progress.phase == RL:
            return (progress.rl_start_step or 0) + self.rl_steps
        return self.planned_steps

    def epochs(self, progress: TrainingProgress) -> int:
        """The epochs of the data the run's rollouts read, as `state.num_train_epochs` reports them and as the loop
        stops at them: transformers' count for `max_steps` too (`ceil(rollouts / rollouts per epoch)`), and its
        `sys.maxsize` for a stream. Value pretraining's rollouts are among them: its budget until it has ended, then
        the rollouts it read (`progress`), as for `max_steps`: a run resumed with a smaller budget (or none) than the
        run that wrote its checkpoint counted this run's, and stopped at the checkpoint's epoch with steps to go."""
        if self.rollouts_per_epoch is None:
            return sys.maxsize
        pretrained = progress.value_pretrain_rollouts
        if progress.phase != RL:
            pretrained = max(pretrained, self.pretrain_rollouts)
        return max(1, -(-(pretrained + self.rl_rollouts) // max(self.rollouts_per_epoch, 1)))


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
    # `use_adaptive_entropy`'s controller: its coefficient (None: `entropy_coef`, not moved yet) and its last reading
    # of the entropy (None: none yet, so no bonus applies)
    entropy_coef: float | None = None
    controlled_entropy: float | None = None
    # The step of the last epoch end (its callbacks, evaluation and checkpoint): a run a stop signal ended at its last
    # step, before the epoch end after its loop, runs it when resumed. -1: none yet; None: a checkpoint from before it
    # was recorded.
    epoch_ended_step: int | None = -1
    # `diagnostics.CriticBiasWatch`'s: the RL rollouts in a row whose advantage the token position drove, and whether
    # it warned
    critic_bias_run: int = 0
    critic_bias_warned: bool = False

    @classmethod
    def from_dict(cls, saved: dict) -> TrainingProgress:
        # Checkpoints of earlier versions carry fields that no longer exist (the old stop rule's best reading).
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{"epoch_ended_step": None, **{key: value for key, value in saved.items() if key in known}})

    def final_explained_variance(self, window: int | None) -> float:
        """The critic's explained variance at the end of value pretraining, as the stop rule reads its level: the
        median of the last finite readings (`final_readings` of them)."""
        finite = [r for r in self.explained_variances if math.isfinite(r)][-(window or 1) :]
        return statistics.median(finite) if finite else math.nan

    def final_readings(self, window: int | None) -> int:
        """How many readings `final_explained_variance` reads: the stop rule's window, or the last one alone."""
        return min(window or 1, sum(math.isfinite(r) for r in self.explained_variances))


class PromptCursor:
    """The prompts of the next rollouts, `prompts_per_rollout` at a time, from `progress.data_epoch` and
    `progress.data_index` on (which it moves): the same on every process and after a resume.

    A map-style dataset is read in an order drawn per epoch (with `shuffle`, the epoch's permutation from one
    generator seeded by `seed`, as GRPOTrainer's sampler draws them; else as stored); the prompts an epoch's last
    rollout cannot fill are left out, and the next rollout starts the next epoch. A stream (`IterableDataset`) is
    read in its order (with `shuffle`, a buffered shuffle seeded by `seed`, as GRPOTrainer shuffles it, again per
    epoch through `set_epoch`); a rollout never mixes two epochs: its epoch ends where the stream does, which `next`
    finds and reports through `on_epoch_end`.
    """

    def __init__(self, dataset, prompts_per_rollout: int, shuffle: bool, seed: int):
        self.dataset, self.count, self.shuffle, self.seed = dataset, prompts_per_rollout, shuffle, seed
        self.streamed = isinstance(dataset, IterableDataset)
        self.restart()

    def restart(self) -> None:
        """Forget what was read ahead: the next rows are where the progress given to `next` says (a resume)."""
        self._order: tuple[int | None, torch.Tensor | None] = (None, None)  # (epoch, its permutation)
        self._generator: torch.Generator | None = None  # where the next epoch's permutation comes from
        self._stream: tuple[int | None, Any] = (None, None)  # (epoch, its iterator at the progress's row)

    def next(self, progress: TrainingProgress, on_epoch_end: Callable[[], bool]) -> list[dict[str, Any]]:
        """The next rollout's prompts (rows of the dataset); `progress` moves past them. `on_epoch_end` is called
        when a stream ends under this rollout, with `progress` at the next epoch's start, before it is read; it says
        whether to go on (False: a stop asked at the epoch's end, and no rows: read, they counted as trained on, and
        a resume from a checkpoint of the stop skipped them)."""
        if self.streamed:
            return self._next_streamed(progress, on_epoch_end)
        if progress.data_index + self.count > len(self.dataset):
            progress.data_epoch += 1
            progress.data_index = 0
        indices = self._epoch_order(progress.data_epoch)[progress.data_index : progress.data_index + self.count]
        progress.data_index += self.count
        columns = self.dataset[indices.tolist()]
        return [dict(zip(columns, values)) for values in zip(*columns.values())]

    def epoch(self, progress: TrainingProgress) -> float:
        """Epochs done, as `TrainerState.epoch` counts them: fractional for a dataset of known length, over the
        prompts an epoch reads (GRPOTrainer's sampler leaves out those a last rollout cannot fill, and its data
        loader's length counts the rollouts: an epoch's last step reads a whole epoch)."""
        if self.streamed:
            return float(progress.data_epoch)
        read_per_epoch = len(self.dataset) // self.count * self.count
        return progress.data_epoch + progress.data_index / read_per_epoch

    def starts_epoch(self, progress: TrainingProgress) -> bool:
        """Whether the next rollout is its epoch's first (a stream's next epoch is found as the rollout reads it)."""
        if self.streamed:
            return progress.data_index == 0
        return progress.data_index == 0 or progress.data_index + self.count > len(self.dataset)

    def skip_to_next_epoch(self, progress: TrainingProgress) -> None:
        """Leave this epoch's remaining prompts: the next rollout starts the next epoch (`should_epoch_stop`)."""
        progress.data_epoch, progress.data_index = progress.data_epoch + 1, 0

    def epochs_read(self, progress: TrainingProgress) -> int:
        """The epochs whose prompts are read: begun and used up, or left (`skip_to_next_epoch`)."""
        return progress.data_epoch + self.epoch_is_over(progress)

    def epoch_is_over(self, progress: TrainingProgress) -> bool:
        """Whether this epoch's prompts are used up: the next rollout starts the next epoch (a stream's epoch ends
        when the stream does, found when the next rollout reads it)."""
        return not self.streamed and progress.data_index + self.count > len(self.dataset)

    def _next_streamed(self, progress: TrainingProgress, on_epoch_end: Callable[[], bool]) -> list[dict[str, Any]]:
        for _ in range(2):
            if self._stream[0] != progress.data_epoch:
                stream = self.dataset.shuffle(seed=self.seed) if self.shuffle else self.dataset
                stream.set_epoch(progress.data_epoch)
                self._stream = (progress.data_epoch, itertools.islice(iter(stream), progress.data_index, None))
            rows = list(itertools.islice(self._stream[1], self.count))
            if len(rows) == self.count:
                progress.data_index += self.count
                return rows
            if progress.data_index == 0:  # a whole epoch short of one rollout: no epoch of it to end (its end's
                break  # evaluation and checkpoint-0, which made the next fresh run refuse the folder)
            # The next epoch first: what `on_epoch_end` saves resumes there (at the old epoch's end, a resume
            # would find that end again and repeat its callbacks, evaluation and checkpoint).
            progress.data_epoch, progress.data_index = progress.data_epoch + 1, 0
            if not on_epoch_end():
                return []
        raise ValueError(
            f"train_dataset streams fewer prompts than one rollout needs ({self.count} = generation_batch_size / "
            "num_generations), after drop_long_prompts' filter where it is set."
        )

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order[0] != epoch:
            size = len(self.dataset)
            if self.shuffle:
                # The epochs' permutations in turn from one generator seeded once (GRPOTrainer's `RepeatSampler`):
                # seeded by `seed + epoch`, seed s's epoch e+1 was seed s+1's epoch e, so runs of neighbouring seeds
                # shared all but one epoch's order. A resume replays the generator from the seed to its epoch.
                if self._generator is None or self._order[0] is None or epoch != self._order[0] + 1:
                    self._generator = torch.Generator().manual_seed(self.seed)
                    for _ in range(epoch):
                        torch.randperm(size, generator=self._generator)
                self._order = (epoch, torch.randperm(size, generator=self._generator))
            else:
                self._order = (epoch, torch.arange(size))
        return self._order[1]
