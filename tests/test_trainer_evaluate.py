"""Evaluation during training, as GRPOTrainer evaluates: `eval_dataset` in every form it takes, TRL's eval knobs
(`eval_strategy`, `eval_steps`, `eval_on_start`, `per_device_eval_batch_size`, `num_generations_eval`), and
`trainer.evaluate()` before, during and after training."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
from helpers import EARLY_STOPPING, CapturingTrainer, LocalHub, digit_fraction, make_args, prompts_dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_vapo import VAPOTrainer
from trl_vapo.checkpoint import checkpoint_problem
from trl_vapo.core import explained_variance
from trl_vapo.metric_names import EVAL


def eval_args(tmp_path, **overrides):
    settings = dict(per_device_eval_batch_size=4, num_generations_eval=2)
    return make_args(tmp_path, **{**settings, **overrides})


def streamed(dataset):
    return IterableDataset.from_generator(lambda: iter(dataset.to_list()))


def eval_dataset_of(kind: str, first: int = 0):
    """An eval set of the form `kind`: three prompts from the `first`-th; in a dict, `data1` those and `data2` the
    three after them, so that each entry's prompts tell which one was evaluated."""
    rows = prompts_dataset(first + 6)
    part, other = rows.select(range(first, first + 3)), rows.select(range(first + 3, first + 6))
    if "iterable" in kind:
        part, other = streamed(part), streamed(other)
    if kind in ("dataset", "iterable_dataset"):
        return part
    if kind in ("dataset_dict", "iterable_dataset_dict"):
        return (IterableDatasetDict if "iterable" in kind else DatasetDict)({"data1": part, "data2": other})
    return {"data1": part, "data2": other}  # dict_of_dataset, dict_of_iterable_dataset


def prompts_of(dataset) -> set[str]:
    entries = dataset.values() if isinstance(dataset, dict) else [dataset]
    return {row["prompt"] for entry in entries for row in entry}


KINDS = ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset", "dict_of_iterable"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_eval_dataset_form_grpo_takes_evaluates_at_init_and_passed_to_evaluate(tiny_model_dir, tmp_path, kind):
    """TRL's `test_init_with_eval_dataset` and `test_evaluate_with_eval_dataset`: given at init, `evaluate()` uses it
    (a dict entry by entry, or one entry by name); passed to `evaluate`, it overrides the trainer's. The reward
    records the prompts it scored: each evaluation's must be its data set's."""
    dataset, passed = eval_dataset_of(kind), eval_dataset_of(kind, first=10)
    reward = RecordingReward()
    trainer = VAPOTrainer(str(tiny_model_dir), reward, eval_args(tmp_path), prompts_dataset(), dataset)
    single = kind in ("dataset", "iterable_dataset")
    prefixes = ["eval"] if single else ["eval_data1", "eval_data2"]

    def scored(evaluate) -> tuple[dict, set[str]]:
        reward.calls.clear()
        metrics = evaluate()
        return metrics, {prompt for call in reward.calls for prompt in call["prompts"]}

    for (metrics, prompts), expected in (
        (scored(trainer.evaluate), dataset),
        (scored(lambda: trainer.evaluate(passed)), passed),
    ):
        assert prompts == prompts_of(expected)
        for prefix in prefixes:
            assert math.isfinite(metrics[f"{prefix}_loss"])
            assert -1 <= metrics[f"{prefix}_reward"] <= 1
            assert metrics[f"{prefix}_samples_per_second"] > 0
        assert set(prefixes) == {key.rsplit("_", 1)[0] for key in metrics if key.endswith("_loss")}
    if not single:
        by_name, prompts = scored(lambda: trainer.evaluate("data2", metric_key_prefix="eval_data2"))
        assert prompts == prompts_of(dataset["data2"]) and prompts.isdisjoint(prompts_of(dataset["data1"]))
        assert set(by_name) - {"epoch"} == {key for key in trainer.evaluate() if key.startswith("eval_data2_")}
        with pytest.raises(KeyError, match="'data3' is not one of the trainer's eval datasets"):
            trainer.evaluate("data3")


def test_a_reward_schedule_reads_the_planned_steps_in_an_evaluation_before_training(tiny_model_dir, tmp_path):
    """A reward function that schedules on `trainer_state.global_step / trainer_state.max_steps` raised
    ZeroDivisionError in an evaluation before `train()` (and `trl-vapo train`'s held-out report before training):
    the state was transformers' fresh one, max_steps 0. It reads the run's planned steps, at step 0."""
    seen = []

    def scheduled(completions, trainer_state, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        weight = trainer_state.global_step / trainer_state.max_steps
        return [weight * len(c) for c in completions]

    args = eval_args(tmp_path, max_steps=3)
    trainer = VAPOTrainer(str(tiny_model_dir), scheduled, args, prompts_dataset(), prompts_dataset(8))
    trainer.evaluate()
    assert seen[-1] == (0, trainer.run_plan.planned_steps) and trainer.run_plan.planned_steps >= 3


def test_a_dict_of_eval_sets_is_checked_once_not_at_every_evaluation(tiny_model_dir, tmp_path):
    """The reward functions run on empty completions once, when the trainer checks its data; each evaluation of a
    dict of eval sets checked every entry again (the reward model or judge called anew, a passing failure of it
    fatal), where a single eval set is not checked again."""
    reward = RecordingReward()
    trainer = VAPOTrainer(
        str(tiny_model_dir), reward, eval_args(tmp_path), prompts_dataset(), eval_dataset_of("dict_of_dataset")
    )

    def checks() -> int:
        return sum(all(length == 0 for length in call["lengths"]) for call in reward.calls)

    at_init = checks()
    assert at_init >= 1
    metrics = trainer.evaluate()
    trainer.evaluate()
    assert checks() == at_init
    assert {"eval_data1_loss", "eval_data2_loss"} <= set(metrics)
    # Their metrics are logged by data set: a metric_for_best_model without one was a KeyError at the first
    # evaluation during training, after the steps before it.
    assert "eval_data2_reward" in metrics

    def during_training(metric: str) -> VAPOTrainer:
        args = eval_args(tmp_path, eval_strategy="steps", metric_for_best_model=metric)
        return VAPOTrainer(str(tiny_model_dir), reward, args, prompts_dataset(), eval_dataset_of("dict_of_dataset"))

    for metric in ("eval_data2_reward", "data1_reward"):
        during_training(metric)
    with pytest.raises(ValueError, match=r"metric_for_best_model='reward' names no data set .* \(eval_data1_reward, "):
        during_training("reward")


def test_an_empty_prompt_the_tokenizer_adds_no_token_to_is_named(tiny_model_dir, tmp_path, caplog):
    """An empty text prompt is warned about up front; where the tokenizer adds no token to it (the tiny one adds no
    BOS, as Qwen's), the rollout that drew it sampled its completions from padding alone (here: silently), or,
    first in its batch, failed in the embedding on a float tensor of no ids. Named now."""
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, eval_args(tmp_path), prompts_dataset())
    held_out = Dataset.from_list([{"prompt": "1+1=", "answer": "2"}, {"prompt": "", "answer": "0"}])
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match=r"A prompt has no token: '' \(the tok"):
        trainer.evaluate(held_out)
    assert "empty prompt(s) (rows [1])" in caplog.text


def test_evaluate_on_a_set_of_its_own_keeps_trainings_random_stream(tiny_model_dir, tmp_path):
    """`trainer.evaluate(dataset)` checks the set as the trainer's own are checked, calling the reward functions:
    outside the evaluation's kept random state, one that draws random numbers moved training's stream."""
    import random

    def noisy(completions, **kwargs):
        random.random()
        return digit_fraction(completions, **kwargs)

    trainer = VAPOTrainer(str(tiny_model_dir), noisy, eval_args(tmp_path), prompts_dataset())
    state = random.getstate()
    trainer.evaluate(prompts_dataset(4))
    assert random.getstate() == state


class RecordingReward:
    """`digit_fraction`, keeping what it was called with and what it returned."""

    __name__ = "recording"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        rewards = digit_fraction(completions)
        self.calls.append({"prompts": prompts, "lengths": [len(x) for x in completion_ids], "rewards": rewards})
        return rewards


class CapturingEvalTrainer(VAPOTrainer):
    def _make_rollout(self, rows, phase, *args, **kwargs):
        rollout = super()._make_rollout(rows, phase, *args, **kwargs)
        if phase == EVAL:
            self.eval_rollouts = getattr(self, "eval_rollouts", []) + [rollout]
        return rollout


def test_evaluate_scores_every_prompt_and_reports_grpos_metrics_and_the_critics(tiny_model_dir, tmp_path):
    """Five prompts x `num_generations_eval` 2 in batches of `per_device_eval_batch_size` 4 completions: three
    batches (the last one of one prompt), each prompt once; the metrics are what the reward function saw."""
    reward = RecordingReward()
    # A stop string ends some completions (terminated: GRPO's terminated-length metrics), the budget others.
    args = eval_args(tmp_path, nll_coef=0.0, generation_kwargs={"stop_strings": ["7", "5"]})
    trainer = CapturingEvalTrainer(str(tiny_model_dir), reward, args, prompts_dataset(), prompts_dataset(5))
    reward.calls.clear()  # the check before training
    metrics = trainer.evaluate()

    assert [len(call["prompts"]) for call in reward.calls] == [4, 4, 2]
    # The rates count prompts, as transformers' evaluation loop counts GRPOTrainer's eval rows, and batches.
    runtime = metrics["eval_runtime"]
    assert metrics["eval_samples_per_second"] == pytest.approx(5 / runtime, rel=0.01, abs=0.002)
    assert metrics["eval_steps_per_second"] == pytest.approx(3 / runtime, rel=0.01, abs=0.002)
    prompts = [p for call in reward.calls for p in call["prompts"]]
    assert prompts == [f"{i}+{i}=" for i in range(5) for _ in range(2)]
    rewards = torch.tensor([r for call in reward.calls for r in call["rewards"]])
    lengths = torch.tensor([n for call in reward.calls for n in call["lengths"]], dtype=torch.float)
    batch_means = [torch.tensor(call["rewards"]).mean() for call in reward.calls]
    assert metrics["eval_reward"] == pytest.approx(torch.stack(batch_means).mean().item(), abs=1e-6)  # as GRPO
    assert metrics["eval_rewards/recording/mean"] == pytest.approx(metrics["eval_reward"])
    # VAPO's accuracy pooled over the completions (a mean of the batches' weighed the last batch's prompt double).
    assert metrics["eval_accuracy"] == pytest.approx((rewards >= args.positive_reward_threshold).float().mean().item())

    def only_the_last_prompt(prompts, **kwargs):  # correct on "4+4=", the last batch's only prompt
        return [float(p == "4+4=") for p in prompts]

    pooled = VAPOTrainer(str(tiny_model_dir), only_the_last_prompt, args, prompts_dataset(), prompts_dataset(5))
    assert pooled.evaluate()["eval_accuracy"] == pytest.approx(2 / 10)  # not (0 + 0 + 1) / 3
    assert metrics["eval_reward_std"] > 0 and rewards.numel() == 10
    assert metrics["eval_completions/min_length"] == lengths.min().item()
    assert metrics["eval_completions/max_length"] == lengths.max().item()
    rollouts = trainer.eval_rollouts
    ended = torch.cat([r.action_mask.sum(dim=1)[~r.truncated] for r in rollouts]).float()
    # The extremes over the batches' terminated completions, not a mean of each batch's (one batch has none: NaN).
    per_batch = [r.action_mask.sum(dim=1)[~r.truncated].float() for r in rollouts]
    assert any(b.numel() == 0 for b in per_batch)
    minima = [b.min().item() for b in per_batch if b.numel()]
    assert len(minima) > 1 and sum(minima) / len(minima) != ended.min().item()
    assert metrics["eval_completions/min_terminated_length"] == ended.min().item()
    assert metrics["eval_completions/max_terminated_length"] == ended.max().item()

    # The critic's explained variance pooled over every completion (not a mean of the batches'), and the loss:
    # with nll_coef 0 and advantages whitened per batch, VAPO's loss at ratio 1 is vf_coef x the value loss.
    assert len(rollouts) == 3
    values = torch.cat([r.old_values[r.loss_mask.bool()] for r in rollouts])
    returns = torch.cat([r.returns[r.loss_mask.bool()] for r in rollouts])
    pooled = explained_variance(values, returns, torch.ones_like(values)).item()
    assert metrics["eval_value/explained_variance"] == pytest.approx(pooled, rel=1e-5)
    value_losses = [0.5 * ((r.old_values - r.returns) ** 2 * r.loss_mask).sum() / r.loss_mask.sum() for r in rollouts]
    expected_loss = args.vf_coef * torch.stack(value_losses).mean().item()
    assert metrics["eval_loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-7)
    assert all(r.old_logprobs is not None for r in rollouts)  # the policy's log-probs, for the loss

    # GRPOTrainer's `eval_entropy`: each batch's token mean of the policy's entropy at the sampling temperature,
    # averaged over the batches; each token's, from the policy's logits here.
    policy = trainer.actor_critic.policy
    means = []
    for r in rollouts:
        with torch.no_grad():
            positions = (r.attention_mask.cumsum(dim=1) - 1).clamp(min=0)
            logits = policy(r.input_ids, attention_mask=r.attention_mask, position_ids=positions).logits.float()
        logits = logits[:, r.prompt_length - 1 : -1] / args.temperature
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        torch.testing.assert_close(r.entropy * r.loss_mask, entropy * r.loss_mask, rtol=1e-4, atol=1e-5)
        means.append(((entropy * r.loss_mask).sum() / r.loss_mask.sum()).item())
    assert metrics["eval_entropy"] == pytest.approx(sum(means) / len(means), rel=1e-4)


def test_accuracy_counts_a_correct_completion_that_mask_truncated_completions_keeps_from_the_loss(
    tiny_model_dir, tmp_path
):
    """mask_truncated_completions masks the loss only, as in GRPOTrainer: a correct completion cut at
    max_completion_length is correct in `accuracy` and `eval_accuracy` (it counted as wrong), and it is no positive
    example for the NLL loss (it does not train)."""

    def always_right(completions, **kwargs):
        return [1.0] * len(completions)

    args = eval_args(tmp_path, max_steps=1, max_completion_length=2, mask_truncated_completions=True)
    trainer = CapturingTrainer(str(tiny_model_dir), always_right, args, prompts_dataset(), prompts_dataset(4))
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "accuracy" in h]
    assert logged["completions/clipped_ratio"] > 0.5  # most completions were cut
    assert logged["accuracy"] == 1.0
    (_, rollout), *_ = trainer.rollouts
    cut = rollout.truncated
    assert cut.any() and rollout.is_correct[cut].all()
    assert rollout.loss_mask[cut].sum() == 0 and not rollout.is_positive[cut].any()  # it does not train
    metrics = trainer.evaluate()
    assert metrics["eval_completions/clipped_ratio"] > 0.5 and metrics["eval_accuracy"] == 1.0


def test_a_checkpoint_a_callback_asks_for_on_evaluate_is_written(tiny_model_dir, tmp_path):
    """transformers reads `control.should_save` after `on_evaluate`: a callback may ask for a checkpoint there (of
    the weights just evaluated). It was read before the evaluation, and the request was dropped."""
    from transformers import TrainerCallback

    class SaveWhatWasEvaluated(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            control.should_save = True

    args = eval_args(tmp_path, max_steps=3, eval_strategy="steps", eval_steps=2, save_strategy="no")
    trainer = VAPOTrainer(
        str(tiny_model_dir),
        digit_fraction,
        args,
        prompts_dataset(),
        prompts_dataset(2),
        callbacks=[SaveWhatWasEvaluated()],
    )
    trainer.train()
    assert (tmp_path / "out" / "checkpoint-2").is_dir()


def test_evaluating_during_training_never_changes_what_trains(tiny_model_dir, tmp_path):
    """`eval_on_start` and `eval_strategy="steps"` over one value-pretraining step and four RL steps: evaluations at
    steps 0, 2, 4 and 5 (the last, as transformers evaluates when training ends between two `eval_steps`), logged
    apart from training's metrics; the trained weights are bit for bit those of the same run without evaluation."""
    common = dict(max_steps=4, per_device_train_batch_size=8, value_pretrain_steps=1)

    def train(tmp, **evaluation):
        trainer = VAPOTrainer(
            str(tiny_model_dir),
            digit_fraction,
            eval_args(tmp, **common, **evaluation),
            prompts_dataset(),
            prompts_dataset(3),
        )
        trainer.train()
        return trainer

    plain = train(tmp_path / "plain")
    evaluated = train(tmp_path / "evaluated", eval_strategy="steps", eval_steps=2, eval_on_start=True)
    for (name, a), b in zip(plain.actor_critic.state_dict().items(), evaluated.actor_critic.state_dict().values()):
        assert torch.equal(a, b), name
    evaluations = [h for h in evaluated.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evaluations] == [0, 2, 4, 5]
    assert all(not any(k.startswith("eval_") for k in h) for h in evaluated.state.log_history if "phase" in h)
    assert all("phase" not in h and "loss" not in h and "reward" not in h for h in evaluations)
    # GRPOTrainer's `eval_num_tokens`: the tokens trained on so far (the last training log's count at that step).
    trained = {h["step"]: h["num_tokens"] for h in evaluated.state.log_history if "num_tokens" in h}
    assert [h["eval_num_tokens"] for h in evaluations] == [0, trained[2], trained[4], trained[5]] and trained[5] > 0
    assert evaluated.actor_critic.training  # back in training mode after each evaluation
    after = evaluated.evaluate()
    assert math.isfinite(after["eval_loss"])  # and after training
    # What `log` adds, as transformers' `evaluate` returns it (its `log` writes into the metrics): the epoch.
    assert after["epoch"] == evaluated.state.epoch == evaluated.state.log_history[-1]["epoch"]
    assert evaluated.state.log_history[-1]["step"] == 5 and "eval_reward" in evaluated.state.log_history[-1]


def test_the_command_lines_held_out_report_leaves_the_random_state_as_it_was(tiny_model_dir, tmp_path):
    """`trl-vapo train --eval_num_prompts N` scores the policy before training (`_held_out_report`), which sampled
    from training's random stream: the run trained on other rollouts than the same command without the report. It
    samples in batches of a rollout's size (what the run showed fits), not 64."""
    import random
    from types import SimpleNamespace

    import numpy as np

    from trl_vapo.cli import _held_out_report

    def draws(completions, **kwargs):  # a stochastic judge: Python's and NumPy's generators too
        return [float(random.random() < 2 and np.random.rand() < 2) for _ in completions]

    args = eval_args(tmp_path, max_steps=1, per_device_train_batch_size=4, num_generations=4)
    trainer = VAPOTrainer(str(tiny_model_dir), draws, args, prompts_dataset())
    batches = []  # the sequences of each generation step: at most a rollout's (4), which the run showed fit
    trainer.actor_critic.policy.register_forward_pre_hook(
        lambda module, inputs, kwargs: batches.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    report = _held_out_report(trainer, prompts_dataset(8), SimpleNamespace(eval_k=2), trainer.reward_funcs)
    assert report["num_problems"] == 8
    assert max(batches) == 4  # (in evaluate_policy's batches of 64, all 16 samples at once)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()


def test_the_held_out_report_before_training_samples_on_every_process_with_vllm(
    tiny_model_dir, tmp_path, stand_in_vllm, monkeypatch
):
    """Before training only the main process scored the policy, the others going on into `train`: with vLLM, whose
    calls are collectives (a server gathers every process's requests; a tensor-parallel group samples together), the
    main process waited for them forever, and its weight push left the others' record of it behind. Here one process
    and the vLLM stand-in (vLLM cannot run here, nor its collectives): the report as a process other than the main one
    makes it. Without vLLM such a process samples its share of the prompts (all of them, as the only process:
    `test_distributed`'s FSDP2 run splits them between two) and leaves the result to the main one."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from trl_vapo.cli import _held_out_report

    args = eval_args(tmp_path, max_steps=1, use_vllm=True, vllm_mode="colocate")
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    monkeypatch.setattr(Accelerator, "is_main_process", property(lambda self: False))
    vllm = trainer.generation_engine.vllm_generation
    pushes, sample = vllm.pushes, vllm.generate
    calls = []
    monkeypatch.setattr(vllm, "generate", lambda *a, **k: calls.append(1) or sample(*a, **k))
    assert _held_out_report(trainer, prompts_dataset(2), SimpleNamespace(eval_k=2), trainer.reward_funcs) is None
    assert vllm.pushes > pushes and calls  # synced and sampled, as the main process
    plain = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, eval_args(tmp_path / "plain", max_steps=1), prompts_dataset()
    )
    sampled, generate = [], type(plain.generation_engine).generate
    monkeypatch.setattr(
        type(plain.generation_engine),
        "generate",
        lambda self, prompts, **k: sampled.append(len(prompts)) or generate(self, prompts, **k),
    )
    assert _held_out_report(plain, prompts_dataset(2), SimpleNamespace(eval_k=2), plain.reward_funcs) is None
    assert sampled == [4, 2]  # 2 prompts x k=2, then greedy


def test_the_held_out_reports_before_and_after_training_sample_in_the_runs_precision(tiny_model_dir, tmp_path):
    """The report before training (the models not yet placed) sampled without the run's autocast: a fully fine-tuned
    policy, kept in float32 to train, was scored in float32 before and in bf16 after, and the printed gain mixed in
    the change of precision. bf16 on the CPU (CPU autocast): the path CUDA's autocast takes."""
    from types import SimpleNamespace

    from trl_vapo.cli import _held_out_report, held_out_report_before_training

    args = eval_args(tmp_path, max_steps=1, bf16=True, use_cpu=True)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    autocast = []
    trainer.actor_critic.policy.register_forward_pre_hook(
        lambda module, inputs: autocast.append(torch.is_autocast_enabled("cpu"))
    )
    assert not trainer.models_placed
    before = held_out_report_before_training(trainer, prompts_dataset(2), SimpleNamespace(eval_k=1), None)
    assert before() is not None and autocast and all(autocast), autocast
    trainer.train()
    autocast.clear()
    assert _held_out_report(trainer, prompts_dataset(2), SimpleNamespace(eval_k=1), trainer.reward_funcs)
    assert autocast and all(autocast)


def test_colocated_vllm_refuses_a_seed_for_a_prompts_copies(tiny_model_dir, tmp_path, stand_in_vllm):
    """`evaluate_policy` with the trainer's colocated vLLM engine and a `seed` in its `generation_kwargs` (which the
    config never sees): each of a prompt's k copies is one request sampled with that seed, identical samples. The
    engine refuses it (vLLM's stand-in: vLLM cannot run here)."""
    from trl_vapo.evaluation import evaluate_policy

    args = eval_args(tmp_path, max_steps=1, use_vllm=True, vllm_mode="colocate")
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    policy, tokenizer, engine = trainer.actor_critic.policy, trainer.processing_class, trainer.generation_engine
    with pytest.raises(ValueError, match="sets a seed, with colocated vLLM: each of a prompt's 2 copies"):
        evaluate_policy(
            policy, tokenizer, prompts_dataset(1), digit_fraction, k=2, engine=engine, generation_kwargs={"seed": 3}
        )
    assert evaluate_policy(
        policy, tokenizer, prompts_dataset(1), digit_fraction, k=1, max_new_tokens=2, engine=engine,
        generation_kwargs={"seed": 3},
    ).num_problems == 1  # fmt: skip


def test_no_scheduled_evaluation_runs_during_value_pretraining(tiny_model_dir, tmp_path):
    """The policy does not change while the critic pretrains: evaluating it then read the initial policy again and
    again, and `EarlyStoppingCallback` compared that noise, which could end the run before its first update. And
    `predict`, which failed in transformers' collator, says what to call instead."""
    settings = dict(max_steps=1, value_pretrain_steps=2, per_device_train_batch_size=8)
    args = eval_args(tmp_path, **settings, eval_strategy="steps", eval_steps=1)
    # Four prompts, two a rollout: value pretraining ends as the epoch does, whose end (in RL by then) evaluated the
    # initial policy on the request value pretraining's last step had left.
    for train_dataset in (prompts_dataset(), prompts_dataset(4)):
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, train_dataset, prompts_dataset(3))
        trainer.train()
        assert [h["step"] for h in trainer.state.log_history if "phase" in h] == [1, 2, 3]  # two of value pretraining
        assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [3], len(train_dataset)
    # By epoch: the epoch that value pretraining's last rollout ends (the phase RL by then) evaluated the initial
    # policy, the first reading early stopping and `save_strategy="best"` compared the trained ones with.
    args = eval_args(tmp_path / "epoch", **{**settings, "max_steps": 2}, eval_strategy="epoch")
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(4), prompts_dataset(3))
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [4]  # the next epoch's end
    with pytest.raises(NotImplementedError, match=r"no predict\(\).*trainer.evaluate\(test_dataset"):
        trainer.predict(prompts_dataset(3))


def test_eval_strategy_epoch_evaluates_and_saves_at_each_epoch_end(tiny_model_dir, tmp_path):
    """Ten prompts, four per rollout: two epochs of two rollouts (two prompts left over each time); the "epoch"
    strategies evaluate, checkpoint and log at the end of each, at epochs 1 and 2. Resumed when it is over, the run
    does nothing more."""
    args = eval_args(
        tmp_path,
        per_device_train_batch_size=16,
        max_steps=-1,
        num_train_epochs=2,
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_strategy="epoch",
    )
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(10), prompts_dataset(2))
    trainer.train()
    evaluations = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [(h["epoch"], h["step"]) for h in evaluations] == [(1.0, 2), (2.0, 4)]
    assert [(h["epoch"], h["step"]) for h in trainer.state.log_history if "phase" in h] == [(1.0, 2), (2.0, 4)]
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    trainer.train(resume_from_checkpoint=True)
    history = trainer.state.log_history
    assert trainer.state.global_step == 4 and [h["step"] for h in history if "eval_loss" in h or "phase" in h] == [
        2,
        2,
        4,
        4,
    ]  # nothing logged, evaluated or saved again


def test_the_epoch_end_after_the_loop_is_in_the_checkpoint_of_its_step(tiny_model_dir, tmp_path, monkeypatch):
    """The run ends at max_steps mid-epoch, its step's checkpoint written (save_steps) before the epoch end that
    transformers runs after its loop, whose evaluation (eval_strategy="epoch") makes that step the best: the
    checkpoint's trainer state has its log, the best metric and the best checkpoint (itself). It had the state before
    them, which a resume read (the epoch end is not run again): a stale best metric, the evaluation gone from the
    history. The Hub's copy (`last-checkpoint/`) is uploaded again: its upload, queued as it was written, held them
    as they were before."""
    import transformers.trainer

    hub = LocalHub(tmp_path / "hub")
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    args = eval_args(
        tmp_path,
        max_steps=3,
        eval_strategy="epoch",
        save_strategy="steps",
        save_steps=3,
        metric_for_best_model="reward",
    )
    args.push_to_hub, args.hub_model_id, args.hub_strategy = True, "me/run", "checkpoint"
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), prompts_dataset(2))
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert trainer.state.best_global_step == 3 and trainer.state.best_model_checkpoint == str(checkpoint)
    for folder in (checkpoint, tmp_path / "hub" / "me" / "run" / "last-checkpoint"):
        saved = json.loads((folder / "trainer_state.json").read_text())
        assert saved["best_metric"] == trainer.state.best_metric, folder
        assert saved["best_model_checkpoint"] == str(checkpoint), folder
        assert [h["step"] for h in saved["log_history"] if "eval_loss" in h] == [3], folder
        assert json.loads((folder / "vapo_state.json").read_text())["progress"]["epoch_ended_step"] == 3, folder
    assert checkpoint_problem(checkpoint) is None


def test_value_pretraining_that_ends_with_an_epoch_is_logged_once_at_that_step(tiny_model_dir, tmp_path):
    """Logged by epoch, value pretraining that ends as an epoch does: its readings were logged (labelled
    value_pretrain), then the epoch's end logged a second, empty entry at the same step labelled rl, which the
    trackers drew and the plots read in place of the first. Once a step, as transformers logs."""
    args = eval_args(tmp_path, max_steps=-1, num_train_epochs=1, value_pretrain_steps=2, logging_strategy="epoch")
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(8))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "phase" in h]
    assert [(h["step"], h["phase"]) for h in logs] == [(2, "value_pretrain"), (4, "rl")]
    assert "value/explained_variance" in logs[0]


def test_with_several_steps_a_rollout_the_evaluation_waits_for_the_checkpoint_that_holds_its_weights(
    tiny_model_dir, tmp_path
):
    """Two optimizer steps a rollout and `eval_steps=3`: the evaluation asked at step 3 runs when the rollout ends,
    with the checkpoint, so the best checkpoint is named (mid-rollout, it evaluated step 3's weights, the rollout's
    checkpoint held step 4's, and `best_model_checkpoint` stayed None)."""
    args = eval_args(
        tmp_path,
        max_steps=4,
        steps_per_generation=2,
        gradient_accumulation_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        metric_for_best_model="loss",
        save_strategy="best",
    )
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), prompts_dataset(3))
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [4]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / "checkpoint-4")
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == ["checkpoint-4"]


class WeightsByStep(TrainerCallback):
    """The trainer's weights (policy and critic) after each step."""

    def __init__(self):
        self.trainer, self.weights = None, {}

    def on_step_end(self, args, state, control, **kwargs):
        model = self.trainer.actor_critic
        self.weights[state.global_step] = {name: p.detach().clone() for name, p in model.state_dict().items()}


def test_the_best_metric_drives_early_stopping_the_best_checkpoints_and_the_weights_at_the_end(
    tiny_model_dir, tmp_path, caplog
):
    """`metric_for_best_model="loss"` with `save_strategy="best"`, `load_best_model_at_end` and TRL's usual
    `EarlyStoppingCallback`, as transformers' Trainer runs them: a checkpoint at each evaluation that lowers
    `eval_loss`, `best_model_checkpoint` the last of them, training stopped at the first evaluation that does not
    improve (patience 1), and the trainer ends with the best checkpoint's weights (policy and critic), not the last
    step's, which `save_model` then writes."""
    from transformers import EarlyStoppingCallback

    args = eval_args(tmp_path, **EARLY_STOPPING)
    by_step = WeightsByStep()
    stop = EarlyStoppingCallback(early_stopping_patience=1)
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(), prompts_dataset(3), callbacks=[stop, by_step]
    )
    by_step.trainer = trainer
    trainer.train()
    losses = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    improving, lowest = [], math.inf
    for step, loss in losses:
        if loss >= lowest:
            break
        improving.append(step)
        lowest = loss
    assert 1 <= len(improving) < len(losses)  # an evaluation that did not improve...
    assert losses[-1][0] == trainer.state.global_step == losses[len(improving)][0] < 8  # ...stopped training there
    assert trainer.state.best_metric == lowest
    assert sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*")) == improving
    assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / f"checkpoint-{improving[-1]}")
    best = int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1])
    last = trainer.state.global_step
    assert best < last, "the run must end after its best checkpoint for this test to mean something"
    weights = trainer.actor_critic.state_dict()
    assert all(torch.equal(weights[name], value) for name, value in by_step.weights[best].items())
    assert not all(torch.equal(weights[name], value) for name, value in by_step.weights[last].items())
    trainer.save_model(str(tmp_path / "final"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    policy = trainer.actor_critic.policy
    assert all(torch.equal(p, policy.get_parameter(name)) for name, p in saved.named_parameters())
    # A best checkpoint that is gone (deleted, not copied along with a resumed run) is said, and the weights stay:
    # as transformers' Trainer, not a FileNotFoundError after the whole run.
    shutil.rmtree(trainer.state.best_model_checkpoint)
    policy.get_parameter(next(iter(dict(policy.named_parameters())))).data.add_(1.0)  # (not the best's any more)
    before = {name: value.clone() for name, value in trainer.actor_critic.state_dict().items()}
    with caplog.at_level(logging.WARNING):
        trainer._load_best_model()
    assert "is gone: the run ends with the weights it trained last" in caplog.text
    assert all(torch.equal(value, before[name]) for name, value in trainer.actor_critic.state_dict().items())


def test_one_checkpoint_kept_ends_a_run_with_the_best_alone_and_its_metrics_name_the_epoch(tiny_model_dir, tmp_path):
    """transformers ends a run with `save_total_limit=1` and a best checkpoint by deleting the others (the rotation
    kept the newest beside the best, for a resume): both stayed. And `train()`'s metrics carry `epoch`, which
    transformers' `log` writes into them (a copy was logged)."""
    from trl_vapo.checkpoint import list_checkpoints

    settings = {**EARLY_STOPPING, "save_strategy": "steps", "save_steps": 1, "save_total_limit": 1, "max_steps": 3}
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, eval_args(tmp_path, **settings), prompts_dataset(), prompts_dataset(3)
    )
    result = trainer.train()
    best = trainer.state.best_model_checkpoint
    assert not best.endswith(f"-{trainer.state.global_step}"), "the best must not be the last for this to mean much"
    assert [c.name for c in list_checkpoints(tmp_path / "out")] == [best.rsplit("/", 1)[1]]
    assert result.metrics["epoch"] == trainer.state.epoch > 0


def test_a_scheduler_that_steps_on_a_metric_is_refused_before_the_first_rollout(tiny_model_dir, tmp_path):
    """ReduceLROnPlateau (transformers steps it with an evaluation's metric) was stepped without one after the first
    rollout had been sampled and trained on: a TypeError."""
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path), prompts_dataset())
    sides = trainer.actor_critic
    trainer.optimizer = torch.optim.AdamW(
        [{"params": list(sides.policy_parameters()), "name": "policy"}, {"params": list(sides.critic_parameters())}]
    )
    trainer.lr_scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(trainer.optimizer)
    with pytest.raises(ValueError, match="lr_scheduler is a ReduceLROnPlateau, which steps on an evaluation's metric"):
        trainer.train()
    assert trainer.state.num_input_tokens_seen == 0  # no rollout was sampled (a step counts at the rollout's end)


@pytest.mark.parametrize("sharded", [{"fsdp": "full_shard"}, {"deepspeed": {"zero_optimization": {"stage": 2}}}])
def test_load_best_model_at_end_is_refused_where_the_weights_are_sharded(tmp_path, sharded):
    with pytest.raises(ValueError, match="load_best_model_at_end=True is not supported under.*best_model_checkpoint"):
        eval_args(
            tmp_path,
            eval_strategy="steps",
            save_strategy="steps",
            load_best_model_at_end=True,
            metric_for_best_model="loss",
            **sharded,
        )


def test_eval_settings_and_data_are_checked_before_any_model_loads(tmp_path):
    def build(args, eval_dataset, reward=digit_fraction):
        VAPOTrainer("no/such-model", reward, args, prompts_dataset(), eval_dataset)

    with pytest.raises(ValueError, match="eval_strategy='steps' asks for evaluation .* no eval_dataset was given"):
        build(make_args(tmp_path, eval_strategy="steps", eval_steps=1), None)
    with pytest.raises(ValueError, match="eval_on_start=True evaluates before the first step, but no eval_dataset"):
        build(make_args(tmp_path, eval_on_start=True), None)  # (transformers' Trainer: at the start of training)
    with pytest.raises(
        ValueError, match=r"eval_dataset\['b'\] has no 'prompt' column; its columns are \['answer', 'text'\]"
    ):
        build(make_args(tmp_path), {"a": prompts_dataset(2), "b": prompts_dataset(2).rename_column("prompt", "text")})
    with pytest.raises(ValueError, match="eval_dataset is empty"):
        build(make_args(tmp_path), prompts_dataset(2).select([]))

    def needs_answer(completions, answer, **kwargs):
        return [1.0 for _ in completions]

    with pytest.raises(ValueError, match=r"needs the column\(s\) \['answer'\]"):
        build(make_args(tmp_path), prompts_dataset(2).remove_columns("answer"), needs_answer)


def test_an_eval_set_in_another_prompt_format_than_the_train_sets_is_refused_before_any_model_loads(
    tiny_model_dir, tmp_path
):
    """The trainer formats every prompt as the train set's first row: plain-text training with a chat eval set
    crashed in the tokenizer at the first evaluation (hours in), and chat training with a plain eval set evaluated
    prompts without their chat template. Refused at construction, and in `evaluate(eval_dataset=...)`."""
    plain = prompts_dataset()
    chat = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in plain])
    for train, evaluated, says in (
        (plain, chat, "chat messages and train_dataset's are plain text"),
        (chat, plain, "plain text and train_dataset's are chat messages"),
    ):
        with pytest.raises(ValueError, match=rf"eval_dataset's prompts are {says}.*'role': 'user'"):
            VAPOTrainer("no/such-model", digit_fraction, eval_args(tmp_path), train, evaluated)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, eval_args(tmp_path), plain)
    with pytest.raises(ValueError, match=r"eval_dataset's prompts are chat messages"):
        trainer.evaluate(eval_dataset=chat)


def test_a_metric_for_best_model_no_evaluation_logs_fails_at_the_first_evaluation_with_the_steps_so_far_saved(
    tiny_model_dir, tmp_path
):
    """A misspelt `metric_for_best_model` is known only at the first evaluation (a reward's `log_metric` names come
    from the reward itself): transformers' KeyError lists the names, and the step trained before it is saved (the
    error was raised past the trainer's save on an error, and the run left no checkpoint)."""
    args = eval_args(
        tmp_path, eval_strategy="steps", eval_steps=1, metric_for_best_model="acuracy", save_strategy="no"
    )
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), prompts_dataset(3))
    with pytest.raises(KeyError, match="'eval_acuracy', which is not found .* 'eval_accuracy'"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == ["checkpoint-1"]
