"""The run's counters (`trl_vapo/run.py`): the plan's step counts against a count of the steps a rollout loop takes,
and the prompt cursor's order, epochs and resume on map-style and streamed datasets. The plan against real runs
(early stop, resume, stream, extra critic passes): `test_trainer.py` and `test_grpo_parity.py`."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from trl_vapo.metric_names import RL, VALUE_PRETRAIN
from trl_vapo.run import PromptCursor, RunPlan, TrainingProgress


def _args(**overrides):
    args = dict(
        generation_batch_size=16,
        num_generations=4,
        steps_per_generation=4,
        gradient_accumulation_steps=2,
        max_steps=-1,
        num_train_epochs=2.5,
        critic_num_iterations=3,
        value_pretrain_steps=5,
        value_pretrain_num_iterations=2,
    )
    return SimpleNamespace(**{**args, **overrides})


def _steps_of_a_loop(args, dataset_length: int, value_pretraining: bool, early_after: int | None = None) -> int:
    """Optimizer steps counted the naive way: rollout by rollout, pass by pass, step by step."""
    prompts = args.generation_batch_size // args.num_generations
    steps_per_pass = args.steps_per_generation // args.gradient_accumulation_steps
    steps = 0
    pretrain_rollouts = args.value_pretrain_steps if value_pretraining else 0
    for rollout in range(pretrain_rollouts):
        if early_after is not None and rollout == early_after:
            break
        for _ in range(args.value_pretrain_num_iterations):
            steps += steps_per_pass
    rl_steps = 0
    if args.max_steps > 0:
        return steps + args.max_steps
    for _ in range(math.ceil(args.num_train_epochs * (dataset_length // prompts))):
        for _ in range(args.critic_num_iterations):
            rl_steps += steps_per_pass
    return steps + rl_steps


@pytest.mark.parametrize("value_pretraining", [True, False])
@pytest.mark.parametrize("overrides", [{}, {"max_steps": 7}, {"num_train_epochs": 1, "critic_num_iterations": 1}])
def test_the_plan_counts_the_steps_a_loop_takes(value_pretraining, overrides):
    args = _args(**overrides)
    plan = RunPlan.from_config(args, 21, value_pretraining)
    start = TrainingProgress(phase=VALUE_PRETRAIN if value_pretraining else RL)
    assert plan.max_steps(start) == _steps_of_a_loop(args, 21, value_pretraining)
    if value_pretraining:  # stopped early after 2 of 5 rollouts: the plan follows the steps taken
        early = TrainingProgress(phase=RL, rl_start_step=2 * plan.steps_per_pretrain_rollout)
        assert plan.max_steps(early) == _steps_of_a_loop(args, 21, True, early_after=2)


@pytest.mark.parametrize(
    ("overrides", "value_pretraining", "epochs"),
    [
        ({"num_train_epochs": 2.5}, False, 3),  # 5 rollouts an epoch (21 prompts, 4 a rollout), 13 of them
        ({"num_train_epochs": 2}, True, 3),  # and value pretraining's 5 first: 15 rollouts
        ({"max_steps": 7}, False, 1),  # 2 steps a pass, 3 passes a rollout: 7 steps in 2 rollouts (the 3rd cut)
        ({"max_steps": 60}, False, 2),  # 10 rollouts
        ({"max_steps": 60}, True, 3),  # 15
    ],
)
def test_the_plan_counts_the_epochs_it_reads_as_transformers_reports_them(overrides, value_pretraining, epochs):
    """`state.num_train_epochs`: with `max_steps` it was 1 whatever the run read (a run at epoch 5.25 of "1")."""
    start = TrainingProgress(phase=VALUE_PRETRAIN if value_pretraining else RL)
    assert RunPlan.from_config(_args(**overrides), 21, value_pretraining).epochs(start) == epochs
    assert RunPlan.from_config(_args(max_steps=9), None, value_pretraining).epochs(start) == sys.maxsize  # a stream


def test_the_epochs_count_the_value_pretraining_rollouts_read_once_it_has_ended():
    """Value pretraining's budget until it ends, then the rollouts it read, whatever this run's config says (a run
    resumed with `value_pretrain_steps=0` counted none, and stopped short): 5 rollouts an epoch, 10 of RL."""
    plan = RunPlan.from_config(_args(max_steps=60, value_pretrain_steps=5), 21, value_pretraining=False)
    assert plan.epochs(TrainingProgress(phase=RL)) == 2
    assert plan.epochs(TrainingProgress(phase=RL, value_pretrain_rollouts=6, rl_start_step=6)) == 4  # 16 rollouts
    planned = RunPlan.from_config(_args(max_steps=60, value_pretrain_steps=5), 21, value_pretraining=True)
    assert planned.epochs(TrainingProgress(phase=VALUE_PRETRAIN, value_pretrain_rollouts=2)) == 3  # its budget, 5
    assert planned.epochs(TrainingProgress(phase=VALUE_PRETRAIN, value_pretrain_rollouts=7)) == 4  # a budget lowered
    assert planned.epochs(TrainingProgress(phase=RL, value_pretrain_rollouts=1, rl_start_step=1)) == 3  # ended early


def test_a_fraction_of_epochs_is_its_rollouts_without_float_round_off():
    # 1.1 epochs of 100 rollouts: 1.1 * 100 is 110.00000000000001 in floats, whose ceiling ran a 111th rollout.
    plan = RunPlan.from_config(_args(num_train_epochs=1.1, critic_num_iterations=1), 400, value_pretraining=False)
    assert plan.max_steps(TrainingProgress(phase=RL)) == 110 * plan.steps_per_pass


def test_a_stream_is_planned_by_max_steps():
    plan = RunPlan.from_config(_args(max_steps=9), None, value_pretraining=False)
    assert plan.max_steps(TrainingProgress(phase=RL)) == 9 and plan.prompts_per_rollout == 4


def _prompts(n: int) -> Dataset:
    return Dataset.from_list([{"prompt": f"p{i}"} for i in range(n)])


def test_the_cursor_reads_each_epoch_in_its_order_and_resumes_where_progress_says():
    data, progress, ended = _prompts(10), TrainingProgress(), []
    cursor = PromptCursor(data, 4, shuffle=True, seed=3)
    read = [[r["prompt"] for r in cursor.next(progress, lambda: ended.append(1))] for _ in range(4)]
    # 10 prompts, 4 a rollout: two rollouts an epoch, the 2 left over unused; each epoch its own permutation
    first, second = read[0] + read[1], read[2] + read[3]
    assert len(set(first)) == len(set(second)) == 8 and first != second
    assert (progress.data_epoch, progress.data_index) == (1, 8) and cursor.epoch_is_over(progress)
    # The epochs read: 2.0, an epoch's 8 prompts each (GRPOTrainer's sampler leaves the 2 out too); a map-style
    # epoch ends in the trainer
    assert cursor.epoch(progress) == 2.0 and not ended
    assert cursor.epoch(TrainingProgress(data_epoch=1, data_index=4)) == 1.5
    again = PromptCursor(data, 4, shuffle=True, seed=3)  # a resumed run: the same rows from the saved place
    assert [r["prompt"] for r in again.next(TrainingProgress(data_epoch=1, data_index=4), lambda: None)] == read[3]
    third = [r["prompt"] for r in cursor.next(progress, lambda: None)]  # the generator drawn on, not replayed
    fresh = PromptCursor(data, 4, shuffle=True, seed=3).next(TrainingProgress(data_epoch=2), lambda: None)
    assert third == [r["prompt"] for r in fresh] != read[0]
    plain = PromptCursor(data, 4, shuffle=False, seed=3)
    assert [r["prompt"] for r in plain.next(TrainingProgress(), lambda: None)] == ["p0", "p1", "p2", "p3"]


def test_runs_of_neighbouring_seeds_share_no_epochs_order():
    """Each epoch's permutation was seeded by `seed + epoch`: seed 1's second epoch was seed 2's first, so runs of
    seeds 1, 2, 3 over three epochs read two of their three epochs in a shared order, and their outcomes were not the
    independent draws that a comparison over seeds assumes."""
    data = _prompts(20)

    def order(seed: int, epoch: int) -> list[str]:
        cursor = PromptCursor(data, 20, shuffle=True, seed=seed)
        return [r["prompt"] for r in cursor.next(TrainingProgress(data_epoch=epoch), lambda: None)]

    orders = {(seed, epoch): order(seed, epoch) for seed in (1, 2, 3) for epoch in range(3)}
    assert len({tuple(o) for o in orders.values()}) == 9
    first = torch.randperm(20, generator=torch.Generator().manual_seed(2)).tolist()
    assert orders[(2, 0)] == [f"p{i}" for i in first]  # the first epoch's order is the seed's first permutation


def test_a_stream_ends_its_epoch_where_it_runs_out_and_one_too_short_is_refused():
    stream, progress, ended = _prompts(6).to_iterable_dataset(), TrainingProgress(), []
    cursor = PromptCursor(stream, 4, shuffle=False, seed=0)
    go_on = lambda: ended.append(progress.data_epoch) or True  # noqa: E731
    rows = [[r["prompt"] for r in cursor.next(progress, go_on)] for _ in range(2)]
    assert rows == [["p0", "p1", "p2", "p3"], ["p0", "p1", "p2", "p3"]]  # a rollout never mixes two epochs
    # `on_epoch_end` sees the progress at the next epoch's start: a checkpoint it writes resumes there.
    assert ended == [1] and cursor.epoch(progress) == 1.0
    # A stop asked at the epoch's end: nothing read of the next (read, its rows counted as trained on).
    stopping = PromptCursor(_prompts(6).to_iterable_dataset(), 4, shuffle=False, seed=0)
    at = TrainingProgress()
    assert len(stopping.next(at, lambda: True)) == 4 and stopping.next(at, lambda: False) == []
    assert (at.data_epoch, at.data_index) == (1, 0)
    cursor.restart()  # forgets its iterator: reads again from the progress's place
    assert [r["prompt"] for r in cursor.next(TrainingProgress(data_index=2), lambda: None)] == ["p2", "p3", "p4", "p5"]
    short = PromptCursor(_prompts(3).to_iterable_dataset(), 4, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="streams fewer prompts than one rollout needs"):
        short.next(TrainingProgress(), lambda: ended.append("short"))
    assert "short" not in ended  # no epoch of it ended: its evaluation and checkpoint-0 ran, twice, before the error
    assert [r["prompt"] for r in stream] == [f"p{i}" for i in range(6)]  # the dataset itself reads whole, in order
