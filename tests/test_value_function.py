"""A user's own frozen value function as the critic (`value_model=fn`, `trl_vapo.modeling.ValueFunction`).

The value function here is written by hand on the tiny model's tokenizer: the share of digits in the completion so
far, on the reward's [-1, 1] scale (the reward is twice the digit share minus one). What it gives must be exactly what
GAE reads, and nothing of it may train, save or checkpoint.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from helpers import digit_fraction, make_args, prompts_dataset, rl_logs, token_rewards_of
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from trl_vapo import VAPOTrainer, core, evaluation
from trl_vapo.core import compute_gae
from trl_vapo.modeling import ValueFunction


class DigitShareValue(nn.Module):
    """V(prompt, y_<t) = 2 * (digits among y_<t) / t - 1 (0 before the first token), with a parameter that must
    stay untouched (an nn.Module value function is frozen too). Records every call."""

    def __init__(self, tokenizer):
        super().__init__()
        self.digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
        self.scale = nn.Parameter(torch.ones(()))
        self.calls: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def forward(self, input_ids, attention_mask, completion_length):
        self.calls.append((input_ids.clone(), attention_mask.clone(), completion_length))
        completion = input_ids[:, -completion_length:]
        digits = torch.isin(completion, self.digit_ids).float() * attention_mask[:, -completion_length:]
        before = torch.cumsum(digits, dim=1) - digits  # digits among y_<t
        position = torch.arange(completion_length, dtype=torch.float32)
        share = torch.where(position > 0, 2 * before / position.clamp(min=1) - 1, torch.zeros(()))
        return self.scale * share


class Rollouts(TrainerCallback):
    def __init__(self):
        self.rollouts = []

    def on_rollout(self, args, state, control, rollout=None, rows=None, **kwargs):
        self.rollouts.append((rows, rollout))


@pytest.mark.parametrize("layout", ["full", "lora"])
def test_a_frozen_value_function_is_what_gae_reads_and_nothing_of_it_trains(
    tiny_model_dir, tmp_path, layout, monkeypatch
):
    from peft import LoraConfig

    peft_config = None
    if layout == "lora":
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    value_function = DigitShareValue(tokenizer)
    assert isinstance(value_function, ValueFunction)
    seen = Rollouts()
    args = make_args(
        tmp_path,
        max_steps=2,
        value_pretrain_steps=3,  # skipped: nothing to pretrain
        whiten_advantages=False,
        lam_actor=0.9,
        length_adaptive_alpha=None,
        lam_critic=0.8,
        save_strategy="steps",
        save_steps=1,
        gradient_checkpointing=layout == "lora",
    )
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=peft_config,
        callbacks=[seen],
        value_model=value_function,
    )
    model = trainer.actor_critic
    assert not model.learns_values and model.critic is None and model.value_head is None
    assert model.critic_parameters() == []
    assert all(p is not value_function.scale for p in model.parameters())
    policy_before = {n: p.detach().clone() for n, p in model.policy.named_parameters() if p.requires_grad}
    trainer.train()

    # No value pretraining, no value loss; the optimizer holds the policy's weights alone.
    assert [h["phase"] for h in trainer.state.log_history if "phase" in h] == ["rl", "rl"]
    assert all("loss/value" not in h and "grad_norm/critic" not in h for h in rl_logs(trainer))
    assert {g["name"] for g in trainer.optimizer.param_groups} == {"policy"}
    assert not any("critic_learning_rate" in h for h in trainer.state.log_history)  # no critic, no rate of one
    assert any(not torch.equal(policy_before[n], p) for n, p in model.policy.named_parameters() if p.requires_grad)
    assert value_function.scale.item() == 1.0 and value_function.scale.grad is None

    # Called once per rollout with all of its completions, and its values are the rollout's, read by GAE.
    assert len(value_function.calls) == len(seen.rollouts) == 2
    for (rows, rollout), (input_ids, attention_mask, width) in zip(seen.rollouts, list(value_function.calls)):
        assert torch.equal(input_ids, rollout.input_ids) and torch.equal(attention_mask, rollout.attention_mask)
        assert width == rollout.input_ids.shape[1] - rollout.prompt_length
        mask = rollout.loss_mask
        expected = value_function.forward(input_ids, attention_mask, width).detach()
        torch.testing.assert_close(rollout.old_values * mask, expected * mask)
        assert rollout.old_values[mask.bool()].std() > 0, "the values must vary for this test to mean something"
        rewards, _, _ = token_rewards_of(trainer, rows, rollout)
        advantages, _ = compute_gae(rewards, expected * mask, mask, 1.0, 0.9)
        _, returns = compute_gae(rewards, expected * mask, mask, 1.0, 0.8)
        torch.testing.assert_close(rollout.advantages, advantages)
        torch.testing.assert_close(rollout.returns, returns)

    # Evaluation's loss is training's: no value term for a value function that does not learn.
    values_given = []

    def vapo_loss(logprobs, values, *args, **kwargs):
        values_given.append(values is not None)
        return core.vapo_loss(logprobs, values, *args, **kwargs)

    monkeypatch.setattr(evaluation, "vapo_loss", vapo_loss)
    assert math.isfinite(trainer.evaluate(prompts_dataset())["eval_loss"]) and values_given and not any(values_given)

    # Checkpoints and the saved model hold the policy only; the card says where the values came from.
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert not (checkpoint / "critic").exists()
    marker = json.loads((checkpoint / "vapo_state.json").read_text())
    assert marker["run"]["critic"] == "frozen value function (DigitShareValue)"
    out = tmp_path / "final"
    trainer.save_model(str(out))
    assert not (out / "critic").exists()
    card = (out / "README.md").read_text()
    assert "frozen value function (`DigitShareValue`" in card
    # and no critic's settings: none learned (its rate, lambda and pretraining were listed as if one had)
    assert "none: the values are the frozen value function's" in card and "`critic_learning_rate=" not in card
    if layout == "full":
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        for name, param in model.policy.named_parameters():
            assert torch.equal(reloaded.get_parameter(name), param.detach()), name

    # A run resumes from its checkpoint with the same value function.
    value_function.calls.clear()
    resumed = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=make_args(tmp_path, max_steps=3, value_pretrain_steps=3, whiten_advantages=False, lam_actor=0.9),
        train_dataset=prompts_dataset(),
        peft_config=peft_config,
        value_model=value_function,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3 and len(value_function.calls) == 1


def test_a_value_function_refuses_critic_only_passes_before_loading_anything(tmp_path):
    args = make_args(tmp_path, num_iterations=1, critic_num_iterations=2)
    refused = r"critic_num_iterations=2 asks for critic-only passes.*Set critic_num_iterations=1"
    with pytest.raises(ValueError, match=refused):
        VAPOTrainer(
            model=str(tmp_path / "not-loaded"),
            reward_funcs=digit_fraction,
            args=args,
            train_dataset=prompts_dataset(),
            value_model=lambda input_ids, attention_mask, completion_length: None,
        )


def test_a_value_function_of_the_wrong_shape_is_named(tiny_model_dir, tmp_path):
    def one_value_per_completion(input_ids, attention_mask, completion_length):
        return torch.zeros(input_ids.shape[0])

    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=make_args(tmp_path, max_steps=1),
        train_dataset=prompts_dataset(),
        value_model=one_value_per_completion,
    )
    with pytest.raises(ValueError, match=r"one_value_per_completion returned \(16,\); it must return .*\[16, 8\]"):
        trainer.train()


def test_models_are_critics_not_value_functions(tiny_model_dir, tmp_path):
    """A PEFT model or a causal LM is callable too: it must be refused as a critic, never called as a value
    function."""
    from peft import LoraConfig, get_peft_model

    from trl_vapo.modeling import is_value_function

    causal_lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2))
    for model in (causal_lm, peft_model):
        assert not is_value_function(model)
        model.register_forward_pre_hook(lambda *args: pytest.fail("a model was called as a value function"))
    with pytest.raises(ValueError, match="num_labels"):
        VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=make_args(tmp_path),
            train_dataset=prompts_dataset(),
            value_model=causal_lm,
        )


def test_a_value_function_is_no_biased_critic_to_warn_about(tiny_model_dir, tmp_path, caplog):
    """The critic bias watch (advantages correlated with the token position for 3 RL rollouts) read a frozen value
    function's too, and said to pretrain the critic longer or raise its learning rate: neither exists there. Here the
    values fall with the position, so the advantages rise with it in every rollout."""

    def falling(input_ids, attention_mask, completion_length):
        return -torch.arange(completion_length, dtype=torch.float32).expand(input_ids.shape[0], -1)

    args = make_args(tmp_path, max_steps=4, max_completion_length=8)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), value_model=falling)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    correlations = [h["advantages/position_correlation"] for h in rl_logs(trainer)]
    assert len(correlations) >= 3 and all(c > 0.5 for c in correlations)  # what the watch reads
    assert "strongly correlated with the token position" not in caplog.text
