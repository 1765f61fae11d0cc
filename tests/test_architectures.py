"""The critic for any causal LM: architectures with and without a transformers sequence-classification class, and a
custom-code model from a local folder (`trust_remote_code`), each built tiny from its config and trained."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from test_trainer import digit_fraction, make_args, prompts_dataset
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from trl_vapo import VAPOTrainer
from trl_vapo.tiny import build_char_tokenizer

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)
ARCHITECTURES = {
    "qwen2": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1),
    "cohere2": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16),  # no seq. classifier
    "codegen": dict(n_ctx=128, rotary_dim=4),  # none either, and its backbone is `transformer`, not `model`
}


def save_tiny(directory: Path, model_type: str, **config) -> Path:
    """A tiny randomly initialised causal LM of `model_type` with the character tokenizer, saved to `directory`."""
    tokenizer = build_char_tokenizer()
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **SMALL, **ids, **config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_the_critic_of_any_causal_lm_trains_saves_and_loads_back(model_type, tmp_path, caplog):
    model_dir = save_tiny(tmp_path / "model", model_type, **ARCHITECTURES[model_type])
    args = make_args(tmp_path, max_steps=1, num_iterations=1)
    with caplog.at_level("WARNING"):
        trainer = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16))
    # GRPOTrainer adds an MoE model's load-balancing loss by default; VAPO says it does not.
    assert ("is a Mixture-of-Experts model" in caplog.text) == (model_type == "qwen3_moe")
    backbone = trainer.actor_critic.policy.base_model.state_dict()
    # The policy's own checkpoint as value_model: its backbone's weights, under whatever prefix it has.
    from_causal_lm = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16), value_model=str(model_dir))
    for critic in (trainer.actor_critic.critic, from_causal_lm.actor_critic.critic):
        assert type(critic).__name__.endswith("ForSequenceClassification") and critic.config.num_labels == 1
        weights = critic.base_model.state_dict()
        assert weights.keys() == backbone.keys()
        assert all(torch.equal(value, backbone[name]) for name, value in weights.items())
    critic = trainer.actor_critic.critic
    trainer.train()
    trainer.save_model()
    reloaded = VAPOTrainer(
        str(model_dir), digit_fraction, args, prompts_dataset(16), value_model=str(tmp_path / "out" / "critic")
    )
    assert type(reloaded.actor_critic.critic).__name__ == type(critic).__name__
    trained = trainer.actor_critic.critic.state_dict()
    for name, value in reloaded.actor_critic.critic.state_dict().items():
        assert torch.equal(value, trained[name]), name
    if model_type in ("cohere2", "codegen"):
        assert model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES  # the case this test is for


CUSTOM_CONFIG = """
from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"
"""
CUSTOM_MODELING = """
from transformers import LlamaForCausalLM, LlamaModel, LlamaPreTrainedModel

from .configuration_tiny_custom import TinyCustomConfig


class TinyCustomPreTrainedModel(LlamaPreTrainedModel):
    config_class = TinyCustomConfig


class TinyCustomModel(TinyCustomPreTrainedModel, LlamaModel):
    pass


class TinyCustomForCausalLM(TinyCustomPreTrainedModel, LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = TinyCustomModel(config)
        self.post_init()
"""


def save_custom_code_model(directory: Path) -> Path:
    """A model whose code ships in its folder (auto_map), as a hub repo with `trust_remote_code` would."""
    model_dir = save_tiny(directory, "llama", tie_word_embeddings=True)
    (model_dir / "configuration_tiny_custom.py").write_text(textwrap.dedent(CUSTOM_CONFIG))
    (model_dir / "modeling_tiny_custom.py").write_text(textwrap.dedent(CUSTOM_MODELING))
    config = (model_dir / "config.json").read_text()
    import json

    config = json.loads(config)
    config.update(
        model_type="tiny_custom",
        architectures=["TinyCustomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny_custom.TinyCustomConfig",
            "AutoModel": "modeling_tiny_custom.TinyCustomModel",
            "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM",
        },
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_a_custom_code_model_trains_with_trust_remote_code_and_is_refused_without(tmp_path):
    model_dir = save_custom_code_model(tmp_path / "custom")
    with pytest.raises(ValueError, match="trust_remote_code"):
        VAPOTrainer(str(model_dir), digit_fraction, make_args(tmp_path), prompts_dataset(16))
    args = make_args(tmp_path, max_steps=1, num_iterations=1, trust_remote_code=True)
    trainer = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16))
    assert type(trainer.actor_critic.policy).__name__ == "TinyCustomForCausalLM"
    critic = trainer.actor_critic.critic  # built over the custom backbone: transformers has no class for it
    assert (
        type(critic).__name__ == "TinyCustomForSequenceClassification"
        and type(critic.model).__name__ == "TinyCustomModel"
    )
    trainer.train()
    assert any("loss/value" in h for h in trainer.state.log_history)
    trainer.save_model()
    critic_dir = tmp_path / "out" / "critic"
    reloaded = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16), value_model=str(critic_dir))
    trained = critic.state_dict()
    for name, value in reloaded.actor_critic.critic.state_dict().items():
        assert torch.equal(value, trained[name]), name
