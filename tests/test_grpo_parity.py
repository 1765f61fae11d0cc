"""What a `GRPOTrainer` user already has works with `VAPOTrainer`: the constructor's arguments, in GRPOTrainer's order
and under its names, and a clear refusal of what VAPO does not take."""

from __future__ import annotations

import inspect

import pytest
from test_trainer import digit_fraction, make_args, prompts_dataset
from transformers import AutoTokenizer
from trl import GRPOTrainer

from trl_vapo import VAPOTrainer


def test_the_constructor_takes_grpo_trainers_parameters_in_its_order():
    grpo = list(inspect.signature(GRPOTrainer.__init__).parameters.values())[1:]
    vapo = inspect.signature(VAPOTrainer.__init__).parameters
    positional = [p.name for p in vapo.values() if p.kind == p.POSITIONAL_OR_KEYWORD][1:]
    assert positional == [p.name for p in grpo]  # a GRPO call, positional or not, binds the same way
    assert vapo["value_model"].kind == inspect.Parameter.KEYWORD_ONLY  # VAPO's own: never taken by position


def test_a_positional_grpo_call_binds_eval_dataset_and_processing_class_where_grpo_does(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    train, evaluation = prompts_dataset(), prompts_dataset(8)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path), train, evaluation, tokenizer)
    assert trainer.processing_class is tokenizer and trainer.eval_dataset is evaluation


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("reward_processing_classes", "reward functions"),
        ("quantization_config", "model_init_kwargs"),
        ("tools", "tool use"),
        ("rollout_func", "generation engines"),
        ("environment_factory", "environments"),
    ],
)
def test_grpo_arguments_vapo_does_not_take_are_refused_before_any_model_loads(tmp_path, name, says):
    with pytest.raises(ValueError, match=f"does not take `{name}`: .*{says}"):
        VAPOTrainer(
            "no/such-model", digit_fraction, make_args(tmp_path), prompts_dataset(), **{name: lambda *a, **k: None}
        )


def test_a_peft_model_the_user_already_wrapped_trains_with_the_critic_on_its_base(tiny_model_dir, tmp_path):
    """`GRPOTrainer(model=get_peft_model(...))`: the user's adapter is the policy's, the critic is a second adapter on
    the same frozen base, and both train."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_vapo.modeling import CRITIC_ADAPTER, POLICY_ADAPTER

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    trainer = VAPOTrainer(model, digit_fraction, make_args(tmp_path), prompts_dataset())
    actor_critic = trainer.actor_critic
    assert actor_critic.shares_base and actor_critic.policy is model
    assert set(model.peft_config) == {POLICY_ADAPTER, CRITIC_ADAPTER} and model.peft_config[POLICY_ADAPTER].r == 4
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert any(f".{POLICY_ADAPTER}." in n for n in changed) and any(f".{CRITIC_ADAPTER}." in n for n in changed)
    assert all("lora_" in n for n in changed)  # the base stays frozen: it is the reference and the critic's too
