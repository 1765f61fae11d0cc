"""The critic for any causal LM: architectures with and without a transformers sequence-classification class, and a
custom-code model from a local folder (`trust_remote_code`), each built tiny from its config and trained."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from helpers import digit_fraction, make_args, prompts_dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
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
    "qwen2": dict(pad_token_id=None),  # as Qwen2.5's config: no pad id (its tokenizer has one)
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1),
    "cohere2": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16),  # no seq. classifier
    "codegen": dict(n_ctx=128, rotary_dim=4),  # none either, and its backbone is `transformer`, not `model`
}


def save_tiny(directory: Path, model_type: str, **config) -> Path:
    """A tiny randomly initialised causal LM of `model_type` with the character tokenizer, saved to `directory`."""
    tokenizer = build_char_tokenizer()
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **SMALL, **{**ids, **config})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_the_critic_of_any_causal_lm_trains_saves_and_loads_back(model_type, tmp_path):
    model_dir = save_tiny(tmp_path / "model", model_type, **ARCHITECTURES[model_type])
    args = make_args(tmp_path, max_steps=1, num_iterations=1)
    trainer = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16))
    # An MoE model's load-balancing loss joins the policy's by default (its config's coefficient), as in GRPOTrainer.
    moe = model_type == "qwen3_moe"
    assert trainer.aux_loss_enabled == moe and trainer.router_aux_loss_coef == (0.001 if moe else 0.0)
    backbone = trainer.actor_critic.policy.base_model.state_dict()
    # The policy's own checkpoint as value_model: its backbone's weights, under whatever prefix it has.
    from_causal_lm = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16), value_model=str(model_dir))
    for critic in (trainer.actor_critic.critic, from_causal_lm.actor_critic.critic):
        assert type(critic).__name__.endswith("ForSequenceClassification") and critic.config.num_labels == 1
        weights = critic.base_model.state_dict()
        assert weights.keys() == backbone.keys()
        assert all(torch.equal(value, backbone[name]) for name, value in weights.items())
    critic = trainer.actor_critic.critic
    initial = {name: value.clone() for name, value in critic.state_dict().items()}
    trainer.train()
    assert any(not torch.equal(value, initial[name]) for name, value in critic.state_dict().items())  # it trained
    # The embeddings the policy trains, the pad's (the EOS's in Qwen2.5) among them: built from a config that had
    # the tokenizer's pad id by then (Qwen2.5's has none), the critic's row of it got no gradient.
    policy_pad = trainer.actor_critic.policy.get_input_embeddings().padding_idx
    assert critic.get_input_embeddings().padding_idx == policy_pad
    if model_type == "qwen2":  # the case: a config without a pad id, given the tokenizer's once the policy was built
        assert (
            policy_pad is None
            and trainer.actor_critic.policy.config.pad_token_id == trainer.processing_class.pad_token_id is not None
        )
    assert any("aux_loss" in h for h in trainer.state.log_history) == moe
    trainer.save_model()
    reloaded = VAPOTrainer(
        str(model_dir), digit_fraction, args, prompts_dataset(16), value_model=str(tmp_path / "out" / "critic")
    )
    assert type(reloaded.actor_critic.critic).__name__ == type(critic).__name__
    # Saved with the pad id in its config, loaded back: it still trains that row, as the policy does.
    assert reloaded.actor_critic.critic.get_input_embeddings().padding_idx == policy_pad
    # The run's folder itself: its root is the trained policy, which loaded as a critic with a new head.
    with pytest.raises(ValueError, match=r"is a trl-vapo run's output \(or checkpoint\) folder, whose root holds the"):
        VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16), value_model=str(tmp_path / "out"))
    trained = trainer.actor_critic.critic.state_dict()
    for name, value in reloaded.actor_critic.critic.state_dict().items():
        assert torch.equal(value, trained[name]), name
    if model_type in ("cohere2", "codegen"):
        assert model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES  # the case this test is for
    # The card says how the critic loads, and it loads so: transformers' class scores a padded batch (the saved
    # config names the pad id, which Qwen2.5's lacks), or, where transformers has no class, trl-vapo alone.
    card = (tmp_path / "out" / "README.md").read_text()
    if model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        assert "one-label `AutoModelForSequenceClassification` (`from_pretrained` loads it)" in card
        saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "critic")
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
        batch = tokenizer(["1+1=2", "12+3="], padding=True, return_tensors="pt")
        assert saved(**batch).logits.shape == (2, 1)
    else:
        assert "transformers has no `AutoModelForSequenceClassification` class for this architecture" in card


def test_the_lora_critics_value_head_reads_the_width_the_lm_head_reads(tmp_path):
    """OPT projects its last hidden states (`project_out`) to `word_embed_proj_dim` before its LM head: the shared
    base's value head, sized by `hidden_size`, failed at the critic's first forward (a shape error); saved and loaded
    back as a critic adapter, likewise."""
    from peft import LoraConfig

    model_dir = save_tiny(tmp_path / "opt", "opt", word_embed_proj_dim=16, ffn_dim=64, do_layer_norm_before=True)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = make_args(tmp_path, max_steps=1)
    trainer = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16), peft_config=lora)
    assert trainer.actor_critic.value_head.summary.in_features == 16 != trainer.model.config.hidden_size
    trainer.train()
    trainer.save_model()
    critic = str(tmp_path / "out" / "critic")
    reloaded = VAPOTrainer(
        str(model_dir), digit_fraction, args, prompts_dataset(16), peft_config=lora, value_model=critic
    )
    assert reloaded.actor_critic.value_head.summary.in_features == 16


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])  # one that converts nothing, one that does
def test_saved_weights_load_back_into_the_model_in_memory_as_a_resume_loads_them(model_type, tmp_path):
    """`save_pretrained` writes transformers' original layout, undoing the weight conversions `from_pretrained`
    applies (Qwen3-MoE's experts one tensor each, where the model holds them stacked): a full fine-tuning run's
    resume read its checkpoint back with `load_state_dict`, and failed on every MoE model."""
    from trl_vapo.modeling import _load_safetensors_into

    saved = AutoModelForCausalLM.from_pretrained(
        save_tiny(tmp_path / "model", model_type, **ARCHITECTURES[model_type])
    )
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(saved.config)
    _load_safetensors_into(other, tmp_path / "model")
    for (name, expected), loaded in zip(saved.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(expected, loaded), name
    # An untied head missing from the files (a cut checkpoint) resumed on the head the model was built with.
    assert not saved.config.tie_word_embeddings
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "model" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "lm_head.weight"}, weights, {"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        _load_safetensors_into(other, tmp_path / "model")


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled-head", "own-forward"])
def test_a_moe_policys_load_balancing_loss_is_the_one_its_own_forward_computes(tmp_path, monkeypatch, tiled):
    """The log-probs' pass returns the routers' load-balancing loss as the model's own forward computes it with
    `output_router_logits=True`, through the tiled head (the backbone alone, then the architecture's function) or,
    where the architecture has no such function, the model's own forward; the log-probs stay the same."""
    from trl_vapo import modeling

    model = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path, "qwen3_moe", **ARCHITECTURES["qwen3_moe"]))
    if not tiled:
        monkeypatch.setattr(modeling, "_load_balancing_loss", lambda causal_lm: None)
    ids = torch.randint(3, 30, (3, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[0, :3] = 0  # a left-padded prompt
    logprobs, _, aux = modeling.completion_logprobs(model, ids, attention, 5, with_aux_loss=True)
    expected = model(input_ids=ids, attention_mask=attention, output_router_logits=True).aux_loss
    torch.testing.assert_close(aux, expected)
    assert aux.requires_grad and torch.equal(logprobs, modeling.completion_logprobs(model, ids, attention, 5))


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_a_policy_whose_load_balancing_function_takes_other_parameters_runs_its_own_forward(moe):
    """Doge's `load_balancing_loss_func` takes `num_keys` before `top_k`: called as Mixtral's, the attention mask
    landed in `top_k`, a TypeError at the first scoring pass. Its own forward computes the loss instead."""
    from transformers import DogeConfig

    from trl_vapo import modeling

    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    experts = dict(is_moe=True, num_experts=4, num_experts_per_tok=2) if moe else {}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DogeConfig(**shape, num_key_value_heads=1, keep_window_size=8, **experts))
    ids = torch.randint(3, 30, (3, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[0, :3] = 0
    _, _, aux = modeling.completion_logprobs(model, ids, attention, 5, with_aux_loss=True)
    expected = model(input_ids=ids, attention_mask=attention, output_router_logits=True).aux_loss
    assert (aux is None) == (expected is None) == (not moe)
    if moe:
        torch.testing.assert_close(aux, expected)


def test_a_moe_policys_load_balancing_loss_joins_its_loss_never_the_critics(tmp_path):
    """`router_aux_loss_coef` weighs the routers' loss in the policy's step: from the same rollout, the policy's
    routers step elsewhere with it than without it, and the critic's step is the same; `aux_loss` is logged, the mean
    over the step's micro-batches, as it joins the loss (and as GRPOTrainer logs it), whatever their token counts."""
    model_dir = save_tiny(tmp_path / "model", "qwen3_moe", **ARCHITECTURES["qwen3_moe"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = {"eos_token_id": [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list("aeiou"))]}
    trained = {}
    for coef in (0.0, 10.0):
        args = make_args(
            tmp_path / str(coef), max_steps=1, num_iterations=1, router_aux_loss_coef=coef,
            per_device_train_batch_size=8, gradient_accumulation_steps=2, generation_kwargs=stops,
        )  # fmt: skip
        trainer = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16))
        assert trainer.aux_loss_enabled == (coef > 0)
        readings = []  # each micro-batch's routers' loss

        def read(module, inputs, out, readings=readings):
            if "aux_loss" in out:
                readings.append(float(out["aux_loss"]))

        trainer.actor_critic.register_forward_hook(read)
        trainer.train()
        logged = [h["aux_loss"] for h in trainer.state.log_history if "aux_loss" in h]
        assert logged == ([pytest.approx(sum(readings) / 2, rel=1e-6)] if coef else [])
        assert len(readings) == (2 if coef else 0)
        trained[coef] = {
            "routers": {
                n: p.detach().clone() for n, p in trainer.actor_critic.policy.named_parameters() if ".gate." in n
            },
            "critic": {n: p.detach().clone() for n, p in trainer.actor_critic.critic.named_parameters()},
        }
    without, weighted = trained[0.0], trained[10.0]
    assert without["routers"] and all(
        not torch.equal(p, weighted["routers"][n]) for n, p in without["routers"].items()
    )
    assert all(torch.equal(p, weighted["critic"][n]) for n, p in without["critic"].items())
    with pytest.raises(ValueError, match="is not a Mixture-of-Experts model"):
        VAPOTrainer(
            str(save_tiny(tmp_path / "dense", "qwen2")), digit_fraction, make_args(tmp_path, router_aux_loss_coef=0.1),
            prompts_dataset(16),
        )  # fmt: skip


CUSTOM_CONFIG = """
from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"
"""
CUSTOM_MODELING = """
from torch import nn
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

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


class TinyCustomForSequenceClassification(TinyCustomPreTrainedModel, LlamaForSequenceClassification):
    def __init__(self, config):  # (not the generic class's, whose `AutoModel.from_config` asks to trust the code)
        TinyCustomPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = TinyCustomModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
"""


def save_custom_code_model(directory: Path, model_type: str = "tiny_custom", classifier: bool = False) -> Path:
    """A model whose code ships in its folder (auto_map), as a hub repo with `trust_remote_code` would; its config
    class under a model type of its own, or a known one's (`llama`: transformers' class for that is not its);
    `classifier`: its code names its own sequence classifier too."""
    model_dir = save_tiny(directory, "llama", tie_word_embeddings=True)
    custom_config = CUSTOM_CONFIG.replace('"tiny_custom"', repr(model_type))
    (model_dir / "configuration_tiny_custom.py").write_text(textwrap.dedent(custom_config))
    (model_dir / "modeling_tiny_custom.py").write_text(textwrap.dedent(CUSTOM_MODELING))
    config = (model_dir / "config.json").read_text()
    import json

    config = json.loads(config)
    config.update(
        model_type=model_type,
        architectures=["TinyCustomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny_custom.TinyCustomConfig",
            "AutoModel": "modeling_tiny_custom.TinyCustomModel",
            "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM",
        }
        | (
            {"AutoModelForSequenceClassification": "modeling_tiny_custom.TinyCustomForSequenceClassification"}
            if classifier
            else {}
        ),
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize("model_type", ["tiny_custom", "llama"])
def test_a_custom_code_model_trains_with_trust_remote_code_and_is_refused_without(tmp_path, model_type):
    """Its critic is built over its own backbone: transformers has no class for its config (under a known model
    type, `AutoModelForSequenceClassification` was asked for one, by the model type, and raised)."""
    model_dir = save_custom_code_model(tmp_path / "custom", model_type)
    if model_type == "tiny_custom":  # (under a known type, transformers loads its own class without the flag)
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
    initial = {name: value.clone() for name, value in critic.state_dict().items()}
    trainer.train()
    assert any("loss/value" in h for h in trainer.state.log_history)
    assert any(not torch.equal(value, initial[name]) for name, value in critic.state_dict().items())  # it trained
    trainer.save_model()
    critic_dir = tmp_path / "out" / "critic"
    reloaded = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16), value_model=str(critic_dir))
    trained = critic.state_dict()
    for name, value in reloaded.actor_critic.critic.state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_trust_remote_code_in_model_init_kwargs_builds_the_critic_from_the_models_own_classifier(tmp_path):
    """`model_init_kwargs={"trust_remote_code": True}` (GRPOConfig's way to ask, which has no field for it) loads the
    policy's code, and the critic built from the policy is the model's own classifier class, as with
    `trust_remote_code=True`, which the field then says: it was trl-vapo's generic class over the custom backbone (the
    field alone was read there), and the card said the critic needs trl-vapo's class to load."""
    model_dir = save_custom_code_model(tmp_path / "custom", classifier=True)
    args = make_args(tmp_path, model_init_kwargs={"trust_remote_code": True})
    assert args.trust_remote_code is True  # what every other load reads (the tokenizer, vLLM)
    with pytest.raises(ValueError, match=r"model_init_kwargs\['trust_remote_code'\] is False and trust_remote_code"):
        make_args(tmp_path, model_init_kwargs={"trust_remote_code": False}, trust_remote_code=True)
    trainer = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset(16))
    critic = trainer.actor_critic.critic
    assert type(critic).__module__.endswith("modeling_tiny_custom"), type(critic).__module__
    assert trainer.run_record.critic_auto_class


def test_lora_bias_training_with_the_shared_base_critic_is_refused_and_a_separate_critic_trains_it(tmp_path):
    """`LoraConfig(bias="all")` makes the base's biases (Qwen2's q/k/v projections') trainable. With the shared-base
    critic they were in neither side's optimizer (they never moved, silently), and they are shared by the policy, the
    critic and the KL reference: refused, saying what to do. With a separate critic they are the policy's, and train
    as in GRPOTrainer."""
    from peft import LoraConfig

    model_dir = save_tiny(tmp_path / "model", "qwen2")
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], bias="all", task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"LoraConfig\(bias='all'\) makes the base's biases trainable.*bias='none'"):
        VAPOTrainer(str(model_dir), digit_fraction, make_args(tmp_path), prompts_dataset(16), peft_config=config)
    args = make_args(tmp_path, max_steps=1, num_iterations=1)
    separate = VAPOTrainer(
        str(model_dir), digit_fraction, args, prompts_dataset(16), peft_config=config, value_model=str(model_dir)
    )
    policy = separate.actor_critic.policy
    biases = {n: p.detach().clone() for n, p in policy.named_parameters() if n.endswith("q_proj.base_layer.bias")}
    assert biases and all(policy.get_parameter(n).requires_grad for n in biases)
    separate.train()
    assert all(not torch.equal(policy.get_parameter(n), value) for n, value in biases.items())
    # With a KL penalty they would move its reference too (the base with adapters off): refused.
    with pytest.raises(ValueError, match=r"beta > 0 with \d+ trainable weights of the policy's base .*bias='all'"):
        VAPOTrainer(
            str(model_dir),
            digit_fraction,
            make_args(tmp_path, beta=0.04),
            prompts_dataset(16),
            peft_config=config,
            value_model=str(model_dir),
        )


def test_a_saved_adapter_that_lacks_weights_is_refused_when_a_resume_loads_it(tiny_model_dir, tmp_path):
    """A resume loads the policy's and the critic's adapters with peft's `set_peft_model_state_dict`, which loads
    what matches and says what did not: left unread, a cut adapter file resumed with the weights the adapter was built
    with, silently."""
    from helpers import peft_actor_critic
    from peft import PromptTuningConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification

    from trl_vapo.modeling import ActorCritic

    # Whole files load, a prompt-tuning policy's too (peft loads its embeddings on a path of their own, and calls the
    # file's key unexpected and the model's missing: a resume of such a run refused itself).
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompt_tuned = get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    ActorCritic(prompt_tuned, critic=critic).save_policy(tmp_path / "prompt")
    ActorCritic(prompt_tuned, critic=critic).load_policy(tmp_path / "prompt")
    model = peft_actor_critic(tiny_model_dir)
    model.save_policy(tmp_path / "policy")
    model.save_critic(tmp_path / "critic")
    model.load_policy(tmp_path / "policy")
    model.load_critic(tmp_path / "critic")
    for folder, adapter in (("policy", "default"), ("critic", "critic")):
        file = tmp_path / folder / "adapter_model.safetensors"
        weights = load_file(file)
        cut = sorted(weights)[0]
        save_file({k: v for k, v in weights.items() if k != cut}, file, {"format": "pt"})
        with pytest.raises(ValueError, match=rf"do not match the model's '{adapter}' adapter: missing \['"):
            (model.load_policy if folder == "policy" else model.load_critic)(tmp_path / folder)


def test_dropout_a_model_keeps_as_a_number_is_off_too(tmp_path):
    """`disable_dropout`: OPT's dropout (0.1 in facebook/opt-*), its layerdrop and Qwen2's attention dropout are
    numbers its forward passes to `nn.functional.dropout` (or draws against) in training mode, not `nn.Dropout`
    modules, which TRL's `disable_dropout_in_model` alone sets: the scoring pass and the update drew other masks."""
    for model_type, config in (
        ("opt", dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.3, attention_dropout=0.3, layerdrop=0.5)),
        ("qwen2", dict(attention_dropout=0.3, pad_token_id=None)),
    ):
        model_dir = save_tiny(tmp_path / model_type, model_type, **config)
        trainer = VAPOTrainer(
            str(model_dir), digit_fraction, make_args(tmp_path / f"{model_type}-run"), prompts_dataset(8)
        )
        ids = torch.randint(3, 20, (2, 12))
        for model in (trainer.actor_critic.policy, trainer.actor_critic.critic):
            model.train()
            torch.manual_seed(0)
            first = model(input_ids=ids).logits
            assert torch.equal(model(input_ids=ids).logits, first), (model_type, type(model).__name__)
