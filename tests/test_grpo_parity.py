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
