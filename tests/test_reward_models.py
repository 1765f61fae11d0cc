"""Reward models in `reward_funcs`, as GRPOTrainer takes them: an id or path, or a `PreTrainedModel` for sequence
classification, scored on prompt + completion through its own tokenizer (the first label's logit), alone or mixed with
reward functions. (Under DeepSpeed ZeRO-2/3 and FSDP2, with one and two processes: tests/test_distributed.py.)"""

from __future__ import annotations

import pytest
import torch
from test_trainer import make_args, prompts_dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from trl_vapo import VAPOTrainer
from trl_vapo.rewards import math_reward
from trl_vapo.scoring import RewardModel, load_reward_models
from trl_vapo.tiny import save_tiny_reward_model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("reward-model"))


def one_by_one(model, tokenizer, texts) -> list[float]:
    """Each text alone, unpadded: the score the batched, padded call must give."""
    with torch.no_grad():
        return [
            model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts
        ]


def test_a_reward_model_scores_prompt_and_completion_as_grpo_does(reward_model_dir, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    (scorer,) = load_reward_models(str(reward_model_dir), None, make_args(tmp_path))
    assert isinstance(scorer, RewardModel) and scorer.__name__ == reward_model_dir.name
    assert not scorer.model.training and not any(p.requires_grad for p in scorer.model.parameters())
    prompts, completions = ["1+1=", "12+30=", "7+7="], ["2", "42 because 12+30 is 42", ""]
    scores = scorer(prompts=prompts, completions=completions)
    expected = one_by_one(model, tokenizer, [p + c for p, c in zip(prompts, completions)])
    assert scores == pytest.approx(expected, abs=1e-5) and len(set(scores)) == 3
    # Chat data: the conversation through the reward model's own chat template.
    chats = [[{"role": "user", "content": p}] for p in prompts]
    replies = [[{"role": "assistant", "content": c}] for c in completions]
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(chats, replies)]
    assert scorer(prompts=chats, completions=replies) == pytest.approx(one_by_one(model, tokenizer, texts), abs=1e-5)


def test_reward_models_train_alone_and_mixed_with_reward_functions(tiny_model_dir, reward_model_dir, tmp_path):
    dataset = prompts_dataset(16)
    alone = VAPOTrainer(str(tiny_model_dir), str(reward_model_dir), make_args(tmp_path / "a", max_steps=1), dataset)
    alone.train()
    name = reward_model_dir.name
    assert [h[f"rewards/{name}/mean"] for h in alone.state.log_history if "phase" in h][0] != 0.0

    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    args = make_args(tmp_path / "b", max_steps=1, reward_weights=[0.5, 1.0])
    mixed = VAPOTrainer(
        str(tiny_model_dir), [model, math_reward], args, dataset, reward_processing_classes=[tokenizer, None]
    )
    assert mixed.reward_func_names == [name, "math_reward"] and mixed.reward_funcs[0].tokenizer is tokenizer
    mixed.train()
    log = next(h for h in mixed.state.log_history if "phase" in h)
    assert log["reward"] == pytest.approx(
        0.5 * log[f"rewards/{name}/mean"] + log["rewards/math_reward/mean"], abs=1e-5
    )


def test_reward_processing_classes_must_match_reward_funcs(tiny_model_dir, reward_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    with pytest.raises(ValueError, match=r"number of reward processing classes \(2\) must match .* \(1\)"):
        VAPOTrainer(
            str(tiny_model_dir),
            str(reward_model_dir),
            make_args(tmp_path),
            prompts_dataset(),
            reward_processing_classes=[tokenizer, tokenizer],
        )
