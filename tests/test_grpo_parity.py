"""What a `GRPOTrainer` user already has works with `VAPOTrainer`: the constructor's arguments, in GRPOTrainer's order
and under its names, and a clear refusal of what VAPO does not take."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import warnings
from collections import defaultdict

import pytest
import torch
from helpers import clock_free, comparable, digit_fraction, make_args, prompts_dataset, rl_logs
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import GRPOTrainer

from trl_vapo import VAPOTrainer, core
from trl_vapo import trainer as trainer_module


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
        ("tools", "tool-calling loop is not built in; write the episode as a `rollout_func`"),
        ("environment_factory", "environment loop is not built in; write the episode as a `rollout_func`"),
    ],
)
def test_grpo_arguments_vapo_does_not_take_are_refused_before_any_model_loads(tmp_path, name, says):
    with pytest.raises(ValueError, match=f"does not take `{name}`: .*{says}"):
        VAPOTrainer(
            "no/such-model", digit_fraction, make_args(tmp_path), prompts_dataset(), **{name: lambda *a, **k: None}
        )


def test_an_empty_tools_list_is_no_tools(tiny_model_dir, tmp_path):
    """GRPOTrainer takes `tools=[]` as none (`tools or []`); it was refused as tools."""
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path), prompts_dataset(), tools=[])
    assert trainer.actor_critic is not None
    from trl_vapo.loading import check_grpo_arguments

    check_grpo_arguments(tools=(), environment_factory=None)  # an empty tuple too (it was refused)
    with pytest.raises(ValueError, match="VAPOTrainer does not take `tools`"):
        check_grpo_arguments(tools=(print,))


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


def test_a_peft_model_whose_adapter_has_another_name_is_refused_naming_it(tiny_model_dir, tmp_path):
    """The policy's adapter is the one named "default": another name was a bare KeyError: 'default'."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config, adapter_name="math")
    with pytest.raises(ValueError, match="model is a PeftModel whose adapter is named 'math'; VAPOTrainer trains the"):
        VAPOTrainer(model, digit_fraction, make_args(tmp_path), prompts_dataset())
    # "default" beside another, active one: with a separate critic the other sampled and trained, and "default" was
    # saved untrained. Refused, naming what to call.
    model.add_adapter("default", config)
    model.set_adapter("math")
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    with pytest.raises(ValueError, match=r"active adapter is 'math'.*Call model.set_adapter\('default'\) first"):
        VAPOTrainer(model, digit_fraction, make_args(tmp_path), prompts_dataset(), value_model=critic)


def test_a_model_quantized_by_any_method_trains_only_as_transformers_lets_it(tiny_model_dir, tmp_path):
    """transformers' Trainer refuses a quantized model without adapters, and adapters on a method it cannot train
    (`validate_quantization_for_training`), for every method; VAPO's own check read bitsandbytes' flags alone, and
    transformers' never saw the policy (it is handed the actor-critic). The quantizer is a stand-in with the
    attributes transformers reads (GPTQ, AWQ and torchao need their packages, and most a GPU); a model passed loaded
    ignores a `quantization_config` in `model_init_kwargs` (a warning), so it is no reason to refuse."""
    from types import SimpleNamespace

    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def quantized(trainable: bool):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        config = SimpleNamespace(quant_method="awq")
        model.is_quantized, model.hf_quantizer = (
            True,
            SimpleNamespace(is_trainable=trainable, quantization_config=config),
        )
        return model

    with pytest.raises(ValueError, match=r"The model is quantized \(awq\), and quantized weights cannot be trained"):
        VAPOTrainer(quantized(True), digit_fraction, make_args(tmp_path), prompts_dataset())
    with pytest.raises(ValueError, match="quantized with awq, which transformers cannot train adapters on"):
        VAPOTrainer(quantized(False), digit_fraction, make_args(tmp_path), prompts_dataset(), peft_config=lora)
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    critic.is_quantized = True
    with pytest.raises(ValueError, match="value_model LlamaForSequenceClassification is quantized"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path), prompts_dataset(), value_model=critic)
    asked = make_args(tmp_path, model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_4bit=True)})
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert VAPOTrainer(loaded, digit_fraction, asked, prompts_dataset()).actor_critic.policy is loaded


def test_a_quantization_config_that_dequantizes_or_needs_no_bitsandbytes_is_not_read_as_qlora(
    tiny_model_dir, monkeypatch
):
    """TRL's gpt-oss recipe loads with `Mxfp4Config(dequantize=True)`: bf16 weights (transformers removes the
    quantizer), which GRPOTrainer trains in full; VAPO refused it ("quantized weights cannot be trained"). A GPTQ or
    AWQ config with LoRA was refused where bitsandbytes is not installed, which it never uses (transformers names each
    method's own package as it loads). bitsandbytes' absence is made here (it is installed)."""
    import sys

    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, Mxfp4Config

    from trl_vapo.loading import check_quantization

    model = str(tiny_model_dir)  # a local folder with no adapter in it: a base model to load quantized
    for dequantizing in (Mxfp4Config(dequantize=True), {"quant_method": "mxfp4", "dequantize": True}):
        check_quantization({"quantization_config": dequantizing}, None, model)  # full fine-tuning, as GRPOTrainer
    with pytest.raises(ValueError, match="pass a peft_config"):
        check_quantization({"quantization_config": Mxfp4Config()}, None, model)  # quantized: adapters only
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    check_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4}}, lora, model)
    # (a dict's bitsandbytes method is spelled with its bits, as transformers' `AutoQuantizationConfig` maps it)
    as_dicts = ({"load_in_4bit": True}, {"quant_method": "bitsandbytes_8bit"})
    for qlora in (BitsAndBytesConfig(load_in_4bit=True), *as_dicts):
        with pytest.raises(ImportError, match="needs bitsandbytes"):
            check_quantization({"quantization_config": qlora}, lora, model)


# ---------------------------------------------------------------------------------------------------- the config
def _grpo_init_defaults() -> dict:
    """GRPOConfig's fields with the defaults its `__init__` gives them: the fields a GRPO script may pass (the
    TrainingArguments ones where GRPOConfig changes their default)."""

    from transformers import TrainingArguments
    from trl import GRPOConfig

    inherited = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    defaults = {}
    for f in dataclasses.fields(GRPOConfig):
        if not f.init or f.default is dataclasses.MISSING:
            continue  # output_dir's default is None; the rest has plain defaults
        if f.name not in inherited or inherited[f.name].default != f.default:
            defaults[f.name] = f.default
    return defaults


def test_every_grpo_config_field_is_a_vapo_config_field_and_grpos_defaults_build_one(tmp_path):

    from trl import GRPOConfig

    from trl_vapo import VAPOConfig

    assert {f.name for f in dataclasses.fields(GRPOConfig)} <= {f.name for f in dataclasses.fields(VAPOConfig)}
    defaults = _grpo_init_defaults()
    assert len(defaults) > 60 and defaults["loss_type"] == "dapo" and defaults["scale_rewards"] == "group"
    config = VAPOConfig(output_dir=str(tmp_path), **defaults)
    assert config.loss_type == "token"  # DAPO's aggregation is VAPO's token-level loss
    assert config.pad_to_multiple_of is None  # 'auto' pads on Neuron only
    assert config.epsilon_high == config.epsilon  # GRPO's None: symmetric clipping


@pytest.mark.parametrize(
    ("grpo", "vapo"), [("dapo", "token"), ("bnpo", "token"), ("dr_grpo", "token"), ("grpo", "sequence")]
)
def test_grpo_loss_types_are_vapos_aggregations(tmp_path, grpo, vapo):
    assert make_args(tmp_path, loss_type=grpo).loss_type == vapo
    assert make_args(tmp_path, loss_type="luspo").loss_type == "luspo"  # an aggregation of the same loss: kept


@pytest.mark.parametrize(
    ("grpo", "surrogate", "aggregation"), [("cispo", "cispo", "token"), ("sapo", "sapo", "sequence")]
)
def test_grpos_other_losses_set_the_surrogate_and_grpos_aggregation(tmp_path, grpo, surrogate, aggregation):
    args = make_args(tmp_path, loss_type=grpo)
    assert (args.surrogate, args.loss_type) == (surrogate, aggregation)
    assert make_args(tmp_path, loss_type="vespo", surrogate="vespo").surrogate == "vespo"  # both: the same ask
    with pytest.raises(ValueError, match="loss_type='sapo' sets surrogate='sapo', but surrogate='cispo' is set too"):
        make_args(tmp_path, loss_type="sapo", surrogate="cispo")


@pytest.mark.parametrize("surrogate", ["cispo", "sapo", "vespo"])
def test_grpos_other_losses_train_on_vapos_advantages(tiny_model_dir, tmp_path, surrogate):
    """Each of GRPO's other per-token objectives trains the policy from VAPO's critic's advantages, with the
    gradient accumulated over two micro-batches and a second pass over each rollout (off-policy: ratios other than
    1), takes its parameters from the config, and logs GRPOTrainer's statistic for it (SAPO has none)."""
    settings = dict(surrogate=surrogate, epsilon_high=5.0, gradient_accumulation_steps=2, num_iterations=2)
    settings.update(sapo_temperature_pos=2.0, sapo_temperature_neg=0.5, vespo_k_pos=1.5, vespo_lambda_neg=2.5)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, **settings), prompts_dataset())
    mask = torch.ones(2, 3)
    given = trainer._loss_settings("rl", mask, torch.zeros(2))
    assert given["surrogate"] == surrogate and given["surrogate_params"] == {
        "sapo_temperature_pos": 2.0,
        "sapo_temperature_neg": 0.5,
        "vespo_shape": (1.5, 3.0, 3.0, 2.5),
    }
    before = {n: p.detach().clone() for n, p in trainer.actor_critic.policy.named_parameters()}
    trainer.train()
    after = dict(trainer.actor_critic.policy.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before), "some policy weight did not move"
    logs = rl_logs(trainer)
    assert logs and all(math.isfinite(h["loss/policy"]) for h in logs)
    statistic = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean"}.get(surrogate)
    assert all((statistic in h) for h in logs) if statistic else not any("clip_ratio/region_mean" in h for h in logs)
    if surrogate == "vespo":  # phi(1) = 1 on the first pass over a rollout; the second pass's ratios move it
        assert all(0 < h["vespo/phi_seq_mean"] for h in logs)
        assert any(h["vespo/phi_seq_mean"] != pytest.approx(1.0, abs=1e-6) for h in logs)
    assert any(h["approx_kl"] > 0 for h in logs)  # the second passes were off-policy


def test_the_clip_shares_extremes_are_logged_under_grpos_names(tiny_model_dir, tmp_path, monkeypatch):
    """GRPOTrainer's `clip_ratio/low_min` and `clip_ratio/high_max`: the smallest and largest share of a sequence's
    tokens clipped, over the step's sequences (two micro-batches here), beside the token means. A second pass over
    each rollout with a narrow clip range clips some tokens."""
    settings = dict(epsilon=0.02, epsilon_high=0.02, learning_rate=0.05, gradient_accumulation_steps=2)
    args = make_args(tmp_path, num_iterations=2, max_steps=4, **settings)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    micro_batches = defaultdict(list)  # each step's micro-batches' extremes, as `core.vapo_loss` gave them

    def vapo_loss(*args, **kwargs):
        loss, stats = core.vapo_loss(*args, **kwargs)
        if "clip_ratio/low_min" in stats:
            extremes = stats["clip_ratio/low_min"].item(), stats["clip_ratio/high_max"].item()
            micro_batches[trainer.state.global_step + 1].append(extremes)
        return loss, stats

    monkeypatch.setattr(trainer_module, "vapo_loss", vapo_loss)
    trainer.train()
    logs = rl_logs(trainer)
    assert len(logs) == 4 and all(len(micro_batches[log["step"]]) == 2 for log in logs)
    for log in logs:  # the step's: the smallest of its micro-batches' minima, the largest of their maxima
        lows, highs = zip(*micro_batches[log["step"]])
        assert log["clip_ratio/low_min"] == pytest.approx(min(lows))
        assert log["clip_ratio/high_max"] == pytest.approx(max(highs))
        assert 0 <= log["clip_ratio/low_min"] <= log["clip_ratio/low_mean"] <= 1
        assert 0 <= log["clip_ratio/high_mean"] <= log["clip_ratio/high_max"] <= 1
    assert [log["clip_ratio/high_max"] > log["clip_ratio/high_mean"] for log in logs] == [False, True, False, True]
    assert any(len(set(micro_batches[log["step"]])) == 2 for log in logs)  # the micro-batches differ somewhere


def test_cispos_cap_below_one_is_named(tiny_model_dir, tmp_path, caplog):
    """GRPO reads `epsilon_high` as CISPO's cap on the weight itself: VAPO's 0.28 would cap every weight below 1."""
    with caplog.at_level("WARNING", logger="trl_vapo.trainer"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, loss_type="cispo"), prompts_dataset())
    assert "0.28 caps every weight below 1" in caplog.text
    # GRPO ignores `delta` under its other losses (no clipped ratio to cap): a GRPO config with one still runs.
    assert make_args(tmp_path, loss_type="cispo", epsilon_high=5.0, delta=2.0).delta == 2.0
    with pytest.raises(ValueError, match="delta must be > 1 \\+ epsilon_high"):
        make_args(tmp_path, epsilon_high=5.0, delta=2.0)
    # A GRPO config's epsilon=0.2 with delta=1.25, which GRPO's symmetric default accepts: the error names the fix.
    with pytest.raises(ValueError, match="epsilon_high defaults to VAPO's clip-higher 0.28") as refused:
        make_args(tmp_path, epsilon=0.2, delta=1.25)
    assert make_args(tmp_path, epsilon=0.2, epsilon_high=None, delta=1.25).delta == 1.25, refused.value


def _another_value(default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    return 1 if default is None else "something-else"


def test_each_grpo_setting_vapo_does_not_have_is_refused_naming_it_and_what_vapo_does(tmp_path):
    from trl_vapo.grpo_fields import GRPO_ONLY

    for name, (default, instead, *also) in GRPO_ONLY.items():
        value = _another_value(default)
        if also and value in also[0]:  # every value of its type is accepted (a bool, both ways): another type
            value = "something-else"
        with pytest.raises(ValueError, match="GRPO features VAPO does not have") as error:
            make_args(tmp_path, **{name: value})
        assert f"{name}={value!r}: {instead}" in str(error.value), name


def test_all_refused_grpo_settings_come_in_one_error(tmp_path):
    with pytest.raises(ValueError) as error:
        make_args(
            tmp_path,
            max_tool_calling_iterations=3,
            use_liger_kernel=True,
            liger_kernel_config={"fused_linear_cross_entropy": True},
        )
    message = str(error.value)
    assert "max_tool_calling_iterations=3" in message
    assert '"fused_linear_cross_entropy": True}' in message and "tiled kernel" in message


def test_use_liger_kernel_applies_ligers_layer_kernels_to_the_policy_as_grpo_does(
    tiny_model_dir, tmp_path, monkeypatch
):
    """GRPOTrainer (TRL 1.16) takes `use_liger_kernel` with a deprecation warning and applies Liger's layer kernels
    only (not its fused cross-entropy, which would replace the forward its fused head runs; VAPO's tiled head is
    the same case). Without liger-kernel, the trainer says so before the model loads. liger-kernel needs Triton and
    a GPU: here a stand-in for transformers' `apply_liger_kernel` (its real interface) records what it patches."""
    import trl_vapo.loading as loading_module
    import trl_vapo.trainer as trainer_module

    with pytest.warns(FutureWarning, match="`use_liger_kernel=True` is deprecated"):
        args = make_args(tmp_path, use_liger_kernel=True, liger_kernel_config={"rms_norm": True})
    assert args.liger_kernel_config == {"rms_norm": True, "fused_linear_cross_entropy": False}
    with warnings.catch_warnings(record=True) as again:  # the trainer reads the config again: said once a config
        warnings.simplefilter("always")
        args.check_again()
    assert not [w for w in again if "use_liger_kernel" in str(w.message)]
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        VAPOTrainer(str(tmp_path / "no-such-model"), digit_fraction, args, prompts_dataset(8))

    patched = []
    monkeypatch.setattr(loading_module, "is_liger_kernel_available", lambda: True)  # checked before loading
    monkeypatch.setattr(trainer_module, "apply_liger_kernel", lambda model, config: patched.append((model, config)))
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(8))
    [(model, config)] = patched
    assert model is trainer.actor_critic.policy and config == args.liger_kernel_config


def test_grpo_settings_that_mean_what_vapo_does_are_accepted(tiny_model_dir, tmp_path, caplog):
    """Accepted so that a GRPO config runs, and said where set otherwise than GRPO's default: a Dr. GRPO config's
    `scale_rewards='none'` changed nothing without a word."""
    from trl_vapo.grpo_fields import grpo_setting_warnings

    dr_grpo = make_args(tmp_path, scale_rewards="none", router_aux_loss_coef=0.0, log_multimodal=False)
    assert grpo_setting_warnings(make_args(tmp_path)) == []
    with caplog.at_level("WARNING", logger="trl_vapo.trainer"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, dr_grpo, prompts_dataset(8))
    assert "GRPOConfig's scale_rewards='none': VAPO does not scale rewards, whichever of the three" in caplog.text
    make_args(tmp_path, scale_rewards=False)  # GRPOConfig's boolean spelling of 'none'
    assert make_args(tmp_path, scale_rewards="False").scale_rewards == "none"  # as `--scale_rewards False` gives it
    make_args(tmp_path, use_bias_correction_kl=False)  # a penalty in the reward: neither value reweights it
    make_args(tmp_path, scale_rewards="batch")  # VAPO's advantages are whitened over the rollout: batch scaling
    # A GRPO config's epsilon alone, above VAPO's epsilon_high (GRPOConfig's follows epsilon): the clip reversed.
    (reversed_clip,) = grpo_setting_warnings(make_args(tmp_path, epsilon=0.3))
    assert reversed_clip.startswith("epsilon_high=0.28 is below epsilon=0.3: the ratio's upper clip")
    assert grpo_setting_warnings(make_args(tmp_path, epsilon=0.3, epsilon_high=None)) == []  # symmetric: 0.3
    assert grpo_setting_warnings(make_args(tmp_path, epsilon=0.28)) == []


def test_a_config_read_back_builds_the_same_config(tmp_path):
    """`VAPOConfig(**args.to_dict())` (a saved run's args read back) has both rollout sizes set: agreeing, they are
    taken (GRPOConfig refuses even these); disagreeing, the error names both."""
    from dataclasses import fields

    args = make_args(tmp_path, gradient_accumulation_steps=2, steps_per_generation=4, loss_type="sapo")
    init = {f.name for f in fields(type(args)) if f.init}
    saved = {k: v for k, v in args.to_dict().items() if k in init and k != "push_to_hub_token"}
    again = type(args)(**saved)
    assert (again.generation_batch_size, again.steps_per_generation) == (64, 4) == (args.generation_batch_size, 4)
    assert (again.surrogate, again.loss_type) == ("sapo", "sequence")
    with pytest.raises(ValueError, match=r"generation_batch_size \(48\) and steps_per_generation \(4\) disagree"):
        make_args(tmp_path, generation_batch_size=48, steps_per_generation=4)


def test_grpos_deprecated_spellings_set_what_they_stand_for(tmp_path):
    with pytest.warns(FutureWarning, match="use_transformers_continuous_batching"):
        assert make_args(tmp_path, use_transformers_paged=True).use_transformers_continuous_batching
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_clip_max"):
        assert make_args(tmp_path, vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0


def test_a_truncating_importance_sampling_mode_needs_a_bound_only_with_the_correction_on(tmp_path):
    """GRPOConfig asks `*_truncate` modes for a bound only where the correction runs (off, the mode is never read):
    VAPO refused the settings with the correction off."""
    from trl import GRPOConfig

    unbounded = {"vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": None}
    for mode in ("token_truncate", "sequence_truncate"):
        off = {**unbounded, "vllm_importance_sampling_mode": mode, "vllm_importance_sampling_correction": False}
        GRPOConfig(output_dir=str(tmp_path), bf16=False, **off)
        assert make_args(tmp_path, **off).vllm_importance_sampling_mode == mode
        with pytest.raises(ValueError, match="needs vllm_importance_sampling_clip_min or"):
            make_args(tmp_path, **{**off, "vllm_importance_sampling_correction": True})


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"cache_implementation": "static", "use_vllm": True}, "cache_implementation='static' sets"),
        ({"cache_implementation": "static", "use_transformers_continuous_batching": True}, "paged"),
        ({"ds3_gather_for_generation": False, "use_vllm": True}, "vLLM needs the policy's whole weights"),
        # Nothing to compare at: no checkpoint was ever written (transformers accepts it).
        ({"save_strategy": "best"}, "save_strategy='best' writes a checkpoint when metric_for_best_model improves"),
        ({"save_strategy": "best", "metric_for_best_model": "reward"}, "and eval_strategy"),
        # vLLM's own refusals, which came once it started, after the policy loaded.
        ({"use_vllm": True, "vllm_tensor_parallel_size": 0}, "vllm_tensor_parallel_size must be >= 1, got 0"),
        (  # TRL's check, which came once every model had loaded
            {"use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 2},
            r"vllm_tensor_parallel_size \(2\) must divide the number of processes \(1\)",
        ),
        # Below 1 a share of max_steps to transformers: a negative one logged or saved at the last step alone.
        ({"logging_steps": -5}, r"logging_steps must be > 0 \(a number of steps, or a share of max_steps"),
        ({"save_strategy": "steps", "save_steps": -100}, "save_steps must be > 0"),
        ({"use_vllm": True, "vllm_gpu_memory_utilization": 1.5}, r"in \(0, 1\]; got 1.5"),
        (
            {"use_vllm": True, "vllm_max_model_length": 60, "max_prompt_length": 32, "max_completion_length": 64},
            r"vllm_max_model_length \(60\) is shorter than a prompt \(max_prompt_length 32\) plus max_completion",
        ),
        # One seed for every request: each group's copies identical. A server gives the n samples seed + index.
        ({"use_vllm": True, "generation_kwargs": {"seed": 3}}, "generation_kwargs sets a seed, with colocated vLLM"),
        # vLLM's SamplingParams refuses n > 1 when greedy: a 400 at every rollout.
        (
            {"use_vllm": True, "vllm_mode": "server", "generation_kwargs": {"do_sample": False}},
            "Greedy sampling .* with a vLLM server and num_generations > 1.* drop do_sample=False from generation_kw",
        ),
        (  # the evaluation's copies too: its first evaluation failed
            {
                "use_vllm": True,
                "vllm_mode": "server",
                "generation_kwargs": {"do_sample": False},
                "num_generations": 1,
                "num_generations_eval": 4,
                "eval_strategy": "steps",
                "per_device_eval_batch_size": 4,
            },
            r"num_generations > 1 \(or num_generations_eval, with evaluation\)",
        ),
        (  # an evaluation before the first step alone
            {
                "use_vllm": True,
                "vllm_mode": "server",
                "generation_kwargs": {"do_sample": False},
                "num_generations": 1,
                "num_generations_eval": 4,
                "eval_on_start": True,
                "per_device_eval_batch_size": 4,
            },
            r"num_generations > 1 \(or num_generations_eval, with evaluation\)",
        ),
        # A budget of its own hid the completions it cut: not marked truncated (that budget is max_completion_length).
        (
            {"generation_kwargs": {"max_new_tokens": 64}},
            "generation_kwargs sets max_new_tokens: the completions' token",
        ),
        ({"generation_kwargs": {"max_tokens": 64}}, r"Set max_completion_length \(max_new_tokens\) instead"),
        # k samples per request: k x N completions for N rows, refused by the reward check or a torch.cat later.
        ({"generation_kwargs": {"num_return_sequences": 2}}, "generation_kwargs sets num_return_sequences: each "),
        (
            {"use_vllm": True, "generation_kwargs": {"n": 4}},
            "sets n: .* Leave it out; set num_generations \\(k, num_samples\\) for more",
        ),
        # n=1 too: TRL's vLLM server client sets n to a prompt's copies, then updates it with generation_kwargs (one
        # completion per prompt came back where G were read: other prompts' completions, or none).
        ({"use_vllm": True, "generation_kwargs": {"n": 1}}, "generation_kwargs sets n: each prompt's completions"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of must be a whole number >= 1"),
        # A number field holding another kind: failed later, in a comparison's TypeError or where it indexes.
        ({"learning_rate": "1e-6"}, r"learning_rate must be a number, got '1e-6' \(a str\)"),
        ({"max_completion_length": 512.0}, r"max_completion_length must be a whole number, got 512.0 \(a float\)"),
        ({"max_prompt_length": True}, r"max_prompt_length must be a whole number or None, got True \(a bool\)"),
        ({"num_generations_eval": 0}, "num_generations_eval must be >= 1"),
        # NaN passed every range check (each comparison False): no completion was ever positive (the NLL loss never
        # trained), value pretraining never stopped early; an infinite number of epochs failed once the model loaded.
        ({"positive_reward_threshold": float("nan")}, "^positive_reward_threshold must be a number, got nan.$"),
        ({"value_pretrain_min_delta": float("nan")}, "value_pretrain_min_delta must be a number, got nan"),
        ({"num_train_epochs": float("inf")}, "num_train_epochs must be > 0 and finite, got inf"),
        # Sizes: accepted, they trained on nonsense (-8) or failed after the models loaded (0: an IndexError).
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be a whole number >= 1, got 0"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be a whole number >= 1, got 0"),
        ({"generation_batch_size": -8}, "generation_batch_size must be a whole number >= 1, got -8"),
        ({"steps_per_generation": -8}, "steps_per_generation must be a whole number >= 1, got -8"),
        ({"per_device_eval_batch_size": 0}, "per_device_eval_batch_size must be a whole number >= 1"),
        ({"epsilon": 1.5}, r"epsilon must be in \[0, 1\)"),
        ({"vllm_importance_sampling_clip_max": -1.0}, "vllm_importance_sampling_clip_max > 0"),
        ({"positive_reward_funcs": []}, "positive_reward_funcs=\\[\\] names no function"),
        # Not JSON: accepted, then a TypeError while the trainer was built ('str' object is not a mapping).
        ({"generation_kwargs": "do_sample=False"}, "generation_kwargs must be a dict or a JSON object, got 'do_sa"),
        ({"model_init_kwargs": "dtype=bfloat16"}, """e.g. model_init_kwargs='{"dtype": "bfloat16"}'"""),
        ({"reward_weights": [1.0, float("nan")]}, r"reward_weights must be finite numbers, got \[1.0, nan\]"),
        ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile must be in \[0, 1\]"),
        ({"multi_objective_aggregation": "sum"}, "multi_objective_aggregation must be 'sum_then_normalize' or"),
        ({"surrogate": "gspo"}, "surrogate must be one of 'ppo', 'cispo', 'sapo', 'vespo'"),
        ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, "sapo_temperature_pos and sapo_temperature_neg must"),
        (
            {"loss_type": "vespo", "use_vllm": True, "vllm_importance_sampling_mode": "sequence_mask"},
            "needs vllm_importance_sampling_mode 'token_truncate' or 'token_mask'",
        ),
        ({"multi_objective_aggregation": "normalize_then_sum", "num_generations": 1}, "needs num_generations >= 2"),
        ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold must be >= 0"),
        ({"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min <="),
        # GRPOConfig's own refusals; enable_jit_checkpoint's SIGTERM handler would replace VAPOTrainer's.
        ({"auto_find_batch_size": True}, "auto_find_batch_size=True is not supported"),
        ({"enable_jit_checkpoint": True}, "enable_jit_checkpoint=True is not supported"),
        # transformers' accelerator settings that VAPO's plan never saw: a run of 0 steps; a batch never split.
        (
            {"accelerator_config": {"gradient_accumulation_kwargs": {"num_steps": 4}}},
            "sets num_steps=4: .* Set gradient_accumulation_steps=4 instead",
        ),
        ({"accelerator_config": {"split_batches": True}}, "split_batches=True is not supported"),
    ],
)
def test_grpo_settings_that_cannot_go_together_say_why(tmp_path, settings, says):
    with pytest.raises(ValueError, match=says):
        make_args(tmp_path, **settings)


def test_one_value_where_a_list_is_expected_is_a_list_of_one(tmp_path):
    """A YAML scalar (`positive_reward_funcs: accuracy`): each of its characters was a function's name."""
    assert make_args(tmp_path, positive_reward_funcs="accuracy").positive_reward_funcs == ["accuracy"]
    assert make_args(tmp_path, reward_weights=0.5).reward_weights == [0.5]


def watched(no_sync, entered: list, model):
    entered.append(model)
    return no_sync(model)


def test_sync_each_batch_reduces_every_micro_batchs_gradients(tiny_model_dir, tmp_path):
    """accelerate's `sync_each_batch` (accelerator_config's gradient_accumulation_kwargs) was ignored: each micro-batch
    but a step's last ran under the accelerator's `no_sync`, which DDP's and FSDP's accumulation spend the memory in
    that it is set to spare. `no_sync` is watched (on one process it leaves the model as it is)."""
    for sync_each_batch in (False, True):
        accumulation = {"gradient_accumulation_kwargs": {"sync_each_batch": True}} if sync_each_batch else {}
        args = make_args(
            tmp_path / str(sync_each_batch),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=1,
            accelerator_config=accumulation,
        )
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(8))
        entered = []
        trainer.accelerator.no_sync = functools.partial(watched, trainer.accelerator.no_sync, entered)
        trainer.train()
        assert bool(entered) is not sync_each_batch, (sync_each_batch, len(entered))


def test_training_arguments_that_act_only_in_transformers_loop_are_named_when_set(tiny_model_dir, tmp_path, caplog):
    """Accepted and silently ignored: the DataLoader settings, `skip_memory_metrics`, `debug`, ... (VAPOTrainer's own
    loop replaces transformers'); NEFTune, which GRPOTrainer applies, is refused (noise in the updates' log-probs)."""
    from trl_vapo.config import settings_without_effect

    assert settings_without_effect(make_args(tmp_path)) == []
    assert settings_without_effect(make_args(tmp_path, use_cpu=True)) == []  # (transformers' own pinning off)
    args = make_args(tmp_path, dataloader_pin_memory=False, skip_memory_metrics=False, debug="underflow_overflow")
    assert [s.split("=")[0] for s in settings_without_effect(args)] == [
        "debug",
        "skip_memory_metrics",
        "dataloader_pin_memory",
    ]
    more = make_args(tmp_path, label_names=["labels"], prediction_loss_only=True, average_tokens_across_devices=False)
    assert settings_without_effect(more) == [
        "label_names=['labels']",
        "prediction_loss_only=True",
        "average_tokens_across_devices=False",
    ]
    with caplog.at_level("WARNING"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(8))
    assert "skip_memory_metrics=False, dataloader_pin_memory=False: these TrainingArguments act in" in caplog.text
    with pytest.raises(ValueError, match="neftune_noise_alpha=5.0 is not supported"):
        make_args(tmp_path, neftune_noise_alpha=5.0)


def test_sequence_parallelism_is_refused_as_grpo_refuses_it(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match="cp_size > 1 or sp_size > 1 .sequence parallelism. is not supported"):
        make_args(tmp_path, parallelism_config=ParallelismConfig(cp_size=2))


def test_the_command_line_parses_grpos_fields(tmp_path):
    from trl_vapo.cli import _parser

    flags = ["--output_dir", str(tmp_path), "--pad_to_multiple_of", "8", "--loss_type", "dr_grpo"]
    flags += ["--scale_rewards", "none", "--cast_lm_head_to_fp32", "--ds3_gather_for_generation", "false"]
    _, config, _, _ = _parser().parse_args_and_config(flags)
    assert (config.pad_to_multiple_of, config.loss_type, config.scale_rewards) == (8, "token", "none")
    assert config.cast_lm_head_to_fp32 and not config.ds3_gather_for_generation
    _, config, _, _ = _parser().parse_args_and_config(["--output_dir", str(tmp_path), "--pad_to_multiple_of", "auto"])
    assert config.pad_to_multiple_of is None


def test_cache_implementation_reaches_generate(tiny_model_dir, tmp_path, monkeypatch):
    """GRPOConfig's `cache_implementation` is the rollouts' GenerationConfig field, as `generate()` receives it from
    the engine, and a static cache samples what the dynamic one samples."""

    from transformers import AutoModelForCausalLM

    from trl_vapo.generation import EngineSettings, SamplingSettings, build_engine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    caches = []  # the cache each generate() call was asked for
    generate = model.generate
    monkeypatch.setattr(
        model, "generate", lambda **k: caches.append(k["generation_config"].cache_implementation) or generate(**k)
    )
    prompt_ids = [tokenizer("12+3=")["input_ids"]]
    completions = []
    for cache in ("static", None):
        settings = SamplingSettings.from_config(make_args(tmp_path, cache_implementation=cache))
        greedy = dataclasses.replace(settings, max_new_tokens=6, temperature=0)
        engine = build_engine(EngineSettings(sampling=greedy), model, tokenizer)
        completions.append(engine.generate(prompt_ids).completion_ids)
    assert caches == ["static", None]
    assert torch.equal(*completions)


def test_pad_to_multiple_of_pads_every_forward_and_changes_no_number(tiny_model_dir, tmp_path):
    """Every forward pass that scores or trains (values, old log-probs, updates) sees a multiple of 8 tokens, and so
    do generate()'s prompts (as TRL pads them: they were not), and the run's losses are the unpadded run's: padding
    is masked out."""
    widths, prompt_widths = [], []

    def record(module, args, kwargs):
        width = kwargs["input_ids"].shape[1]
        if kwargs.get("use_cache") is False:  # the scoring and update passes
            widths.append(width)
        elif width > 1:  # generate()'s first step reads the prompts (each later one, a token)
            prompt_widths.append(width)

    logs = {}
    for multiple in (None, 8):
        args = make_args(
            tmp_path / str(multiple), pad_to_multiple_of=multiple, max_completion_length=5, num_iterations=2
        )
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
        handle = trainer.actor_critic.policy.model.register_forward_pre_hook(record, with_kwargs=True)
        widths.clear(), prompt_widths.clear()
        trainer.train()
        handle.remove()
        logs[multiple] = [h for h in trainer.state.log_history if "loss" in h]
        if multiple:
            assert widths and all(w % multiple == 0 for w in widths), widths
            assert prompt_widths and all(w % multiple == 0 for w in prompt_widths), prompt_widths
        else:  # without it, the widths are whatever the batch needs
            assert any(w % 8 for w in widths) and any(w % 8 for w in prompt_widths)
    assert len(logs[None]) == 2
    for padded, plain in zip(logs[8], logs[None], strict=True):
        for key in ("loss/policy", "loss/value", "grad_norm/policy", "grad_norm/critic"):
            assert padded[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


def test_log_unique_prompts_keeps_each_prompts_first_row():
    from trl_vapo.reporting import build_completions_table

    table = build_completions_table(
        step=1,
        prompts=["a", "a", "b", "a", "c", "b"],
        completions=["1", "2", "3", "4", "5", "6"],
        rewards={"f": [0.0] * 6},
        sequence_rewards=[0.0] * 6,
    )
    unique = table.unique_prompts()
    assert unique.columns["prompt"] == ["a", "b", "c"] and unique.columns["completion"] == ["1", "3", "5"]


def test_cast_lm_head_to_fp32_computes_the_head_in_float32_under_bf16_autocast(tiny_model_dir):
    """GRPOConfig's `cast_lm_head_to_fp32` (ScaleRL): the tiled head's log-probs are those of float32 logits from
    the bf16 hidden states (without it, the bf16 logits' rounding shows); generation's forward gives float32 logits;
    the tied embeddings, cast with the head, still output bf16."""
    from transformers import AutoModelForCausalLM

    from trl_vapo.modeling import Float32Linear, cast_lm_head_to_fp32, completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def error() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = completion_logprobs(model, ids, mask, 5, temperature=0.7)
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -6:-1]
        logits = hidden.double() @ model.lm_head.weight.double().T / 0.7
        expected = logits.log_softmax(-1).gather(-1, ids[:, -5:, None]).squeeze(-1)
        return (got.double() - expected).abs().max().item()

    in_bf16 = error()
    cast_lm_head_to_fp32(model)
    assert type(model.lm_head) is Float32Linear and model.lm_head.weight.dtype == torch.float32
    assert error() < 1e-5 < 1e-4 < in_bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(input_ids=ids).logits.dtype == torch.float32
        assert model.model.embed_tokens(ids).dtype == torch.bfloat16


def test_cast_lm_head_to_fp32_trains_a_lora_on_a_bf16_base_and_refuses_an_adapter_on_the_head(
    tiny_model_dir, tmp_path
):
    from peft import LoraConfig

    from trl_vapo.modeling import Float32Linear

    def trainer(target_modules):
        args = make_args(tmp_path, cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "bfloat16"})
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, task_type="CAUSAL_LM")
        return VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=lora)

    lora_trainer = trainer(["q_proj", "v_proj"])
    head = lora_trainer.actor_critic.policy.get_base_model().lm_head
    assert type(head) is Float32Linear and head.weight.dtype == torch.float32
    lora_trainer.train()
    logs = rl_logs(lora_trainer)
    assert len(logs) == 2 and all(math.isfinite(h["loss/policy"]) for h in logs)  # max_steps=2, no pretraining
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32=True needs the LM head to be a plain linear layer"):
        trainer(["q_proj", "lm_head"])
    # Full fine-tuning of a bf16 model with a tied head: the critic and what `save_model` writes stay bf16.
    args = make_args(tmp_path, cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "bfloat16"})
    full = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset()).actor_critic
    assert type(full.policy.lm_head) is Float32Linear
    assert {*full.loaded_dtypes["policy"].values(), *full.loaded_dtypes["critic"].values()} == {torch.bfloat16}


# ------------------------------------------------------------------------------------------- what users hold
def test_trainer_model_is_the_policy_as_in_grpo_and_callbacks_get_it(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, TrainerCallback

    seen = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen.append(model)

    trainer = VAPOTrainer(
        str(tiny_model_dir),
        digit_fraction,
        make_args(tmp_path, max_steps=1),
        prompts_dataset(),
        callbacks=[Recorder()],
    )
    causal_lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert trainer.model is trainer.actor_critic.policy and trainer.model.lm_head is not None
    assert [n for n, _ in trainer.model.named_parameters()] == [n for n, _ in causal_lm.named_parameters()]
    trainer.train()
    assert seen == [trainer.model]


def test_a_streamed_dataset_trains_as_the_same_rows_in_order_and_resumes(tiny_model_dir, tmp_path):
    """An `IterableDataset` gives the run a map-style dataset read in order gives (epochs wrap: 8 prompts, 4 per
    rollout, 5 rollouts), and a resume from a checkpoint continues with the rows after it."""
    settings = dict(max_steps=5, shuffle_dataset=False, save_strategy="steps", save_steps=2)

    def run(name, dataset, resume=None):
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path / name, **settings), dataset)
        trainer.train(resume_from_checkpoint=resume)
        assert trainer.state.global_step == trainer.run_plan.max_steps(trainer.progress) == 5  # a stream's plan too
        if name == "streamed" and resume is None:
            trainer.save_model()  # the model card's quick start shows the stream's first prompt
            assert "0+0=" in (tmp_path / name / "out" / "README.md").read_text()
        # The steps' logs; `epoch` is whole for a stream, whose length is unknown.
        return [
            {k: v for k, v in clock_free(h).items() if k != "epoch"} for h in trainer.state.log_history if "phase" in h
        ]

    mapped = run("mapped", prompts_dataset(8))
    streamed = run("streamed", prompts_dataset(8).to_iterable_dataset())
    assert len(streamed) == 5 and streamed == mapped
    checkpoint = tmp_path / "streamed" / "out" / "checkpoint-2"
    resumed = run("streamed", prompts_dataset(8).to_iterable_dataset(), resume=str(checkpoint))
    assert [h for h in resumed if h["step"] > 2] == streamed[2:]


def test_a_rollouts_sampling_and_scoring_run_inside_its_first_steps_callbacks(tiny_model_dir, tmp_path):
    """GRPOTrainer generates inside its training step, so a callback that times or profiles steps from
    `on_step_begin` to `on_step_end` sees the sampling and scoring: VAPO's rollout (two steps each here) belongs to its
    first step the same way."""
    from transformers import TrainerCallback

    events = []

    class Events(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            events.append("begin")

        def on_rollout(self, args, state, control, rollout=None, rows=None, **kwargs):  # once the rollout is scored
            events.append("rollout")

        def on_step_end(self, args, state, control, **kwargs):
            events.append("end")

    args = make_args(tmp_path, max_steps=4, steps_per_generation=2, gradient_accumulation_steps=1)
    VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), callbacks=[Events()]).train()
    assert events == ["begin", "rollout", "end", "begin", "end"] * 2


def test_epochs_begin_and_end_for_the_callbacks_where_the_data_does_streamed_or_not(tiny_model_dir, tmp_path):
    """8 prompts, 4 a rollout: an epoch is 2 steps. The epoch strategies evaluate and save at its end, with
    `on_epoch_begin` and `on_epoch_end` around it, as transformers calls them. A stream's end is found as the next
    rollout reads it: its evaluation and checkpoint waited for that rollout (step 3's weights, named checkpoint-3),
    and `on_epoch_begin` was never called."""
    from transformers import TrainerCallback

    from trl_vapo.checkpoint import list_checkpoints

    settings = dict(max_steps=5, shuffle_dataset=False, save_strategy="epoch", eval_strategy="epoch")
    settings.update(per_device_eval_batch_size=4, num_generations_eval=2)

    trainers = []

    def run(name, dataset, resume=None, stop=False):
        events = []

        class Epochs(TrainerCallback):
            def on_epoch_begin(self, args, state, control, **kwargs):
                events.append(("begin", state.global_step))

            def on_epoch_end(self, args, state, control, **kwargs):
                events.append(("end", state.global_step))
                control.should_training_stop = stop

            def on_evaluate(self, args, state, control, **kwargs):
                events.append(("evaluate", state.global_step))

        args = make_args(tmp_path / name, **settings)
        trainer = VAPOTrainer(
            str(tiny_model_dir), digit_fraction, args, dataset, prompts_dataset(2), callbacks=[Epochs()]
        )
        trainer.train(resume_from_checkpoint=resume)
        trainers.append(trainer)
        return events, [c.name for c in list_checkpoints(tmp_path / name / "out")]

    epochs = [("begin", 0), ("end", 2), ("evaluate", 2), ("begin", 2), ("end", 4), ("evaluate", 4), ("begin", 4)]
    epochs += [("end", 5), ("evaluate", 5)]  # training ends mid-epoch: transformers ends that epoch too
    expected = (epochs, ["checkpoint-2", "checkpoint-4", "checkpoint-5"])
    assert run("mapped", prompts_dataset(8)) == expected
    assert run("streamed", prompts_dataset(8).to_iterable_dataset()) == expected
    # Resumed from the first epoch's checkpoint: the second epoch begins (a stream's saved position was the first
    # epoch's end, which the resumed run found again: its end, evaluation and checkpoint a second time).
    for name, dataset in (("mapped", prompts_dataset(8)), ("streamed", prompts_dataset(8).to_iterable_dataset())):
        resumed, _ = run(name, dataset, resume=str(tmp_path / name / "out" / "checkpoint-2"))
        assert resumed == epochs[3:], name
    # Stopped at the first epoch's end (EarlyStoppingCallback with eval_strategy="epoch"): no epoch begins after it
    # (a stream began the next one, as its first rows were read, and never ended it).
    for name, dataset in (("mapped", prompts_dataset(8)), ("streamed", prompts_dataset(8).to_iterable_dataset())):
        stopped, _ = run(f"{name}-stopped", dataset, stop=True)
        assert stopped == epochs[:3], name
        # Its position: the next epoch's start. A stream read the next epoch's first rollout, never trained on, and
        # a checkpoint of the stop (a signal's) resumed past it.
        progress = trainers[-1].progress
        assert (progress.data_epoch, progress.data_index) == ((1, 0) if name == "streamed" else (0, 8)), name


def test_a_stop_asked_at_an_epochs_begin_reads_no_prompt(tiny_model_dir, tmp_path):
    """A callback's `should_training_stop` at the second epoch's begin: the rollout's prompts were read all the same
    (and trained on by no step), and the run's position, which its checkpoint saves, was past them."""
    from transformers import TrainerCallback

    class StopAtTheSecondEpoch(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step > 0

    args = make_args(tmp_path, max_steps=5, shuffle_dataset=False)
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(8), callbacks=[StopAtTheSecondEpoch()]
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert (trainer.progress.data_epoch, trainer.progress.data_index) == (0, 8)  # the first epoch's end, read whole


def test_the_epoch_moves_with_each_optimizer_step_as_grpos_does(tiny_model_dir, tmp_path):
    """Eight prompts, four a rollout, two optimizer steps a rollout (and two passes): each step reads its share of the
    prompts, so `state.epoch` moves by step, as GRPOTrainer's data loader moves it (every step logged the rollout's
    end: 0.5, 0.5, 0.5, 0.5, 1.0, ...). It never moves back: while a rollout samples it reads the last step's, as
    GRPOTrainer's does (it read the rollout's end there, 0.5, then 0.125 after its first step)."""
    from transformers import TrainerCallback

    seen = []

    class Epochs(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append(state.epoch or 0.0)

        def on_step_end(self, args, state, control, **kwargs):
            seen.append(state.epoch)

    batch = dict(per_device_train_batch_size=8, steps_per_generation=2, num_iterations=2)
    trainer = VAPOTrainer(
        str(tiny_model_dir),
        digit_fraction,
        make_args(tmp_path, max_steps=8, **batch),
        prompts_dataset(8),
        callbacks=[Epochs()],
    )
    trainer.train()
    epochs = [h["epoch"] for h in trainer.state.log_history if "phase" in h]
    assert epochs == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0])
    assert seen == sorted(seen) and seen[:2] == pytest.approx([0.0, 0.125])
    # Ten prompts, four a rollout: each epoch reads eight (the sampler leaves two out), and its last step reads a
    # whole epoch, as GRPOTrainer's (its data loader counts the rollouts); over the ten it read 0.4, 0.8, 1.4, 1.8.
    one_step = dict(per_device_train_batch_size=16, steps_per_generation=1)
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, make_args(tmp_path / "ten", max_steps=4, **one_step), prompts_dataset(10)
    )
    trainer.train()
    epochs = [h["epoch"] for h in trainer.state.log_history if "phase" in h]
    assert epochs == pytest.approx([0.5, 1.0, 1.5, 2.0])


@pytest.mark.parametrize("steps_per_rollout", [1, 2])
def test_a_callback_ends_an_epoch_early_with_should_epoch_stop(tiny_model_dir, tmp_path, steps_per_rollout):
    """transformers' `control.should_epoch_stop` (it was never read): the epoch ends after the step that asked for
    it, with its callbacks and epoch strategies, and the next rollout starts the next epoch from its first prompts.
    With two steps a rollout, its second step does not run (transformers' epoch loop ends at once; here the second
    step ran, and its own `on_step_end` took the request back)."""
    from helpers import CapturingTrainer
    from transformers import TrainerCallback

    ended = []

    class StopTheFirstEpoch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_epoch_stop = state.global_step == 1

        def on_epoch_end(self, args, state, control, **kwargs):
            ended.append((state.global_step, state.epoch))

    batch = {"per_device_train_batch_size": 16 // steps_per_rollout, "steps_per_generation": steps_per_rollout}
    args = make_args(
        tmp_path, max_steps=1 + 2 * steps_per_rollout, shuffle_dataset=False, **batch
    )  # 8 prompts, 4 a rollout
    trainer = CapturingTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(8), callbacks=[StopTheFirstEpoch()]
    )
    trainer.train()
    prompts = [[row["prompt"] for row in rows][::4] for rows, _ in trainer.rollouts]
    assert prompts[1] == prompts[0] != prompts[2]  # the second epoch, from its first prompts
    assert ended[0] == (1, 1.0)
    # The planned epochs end the run, as transformers' epoch loop ends it: max_steps' 2 epochs, the first cut short,
    # end a step early (a third epoch began, to make up the steps).
    ended.clear()
    args = make_args(tmp_path / "planned", max_steps=4 * steps_per_rollout, shuffle_dataset=False, **batch)
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(8), callbacks=[StopTheFirstEpoch()]
    )
    trainer.train()
    assert trainer.state.global_step == 1 + 2 * steps_per_rollout and [e for _, e in ended] == [1.0, 2.0]


def test_streamed_data_takes_grpos_loader_settings(tiny_model_dir, tmp_path, caplog):
    """As GRPOTrainer: a stream (train or eval) refuses `dispatch_batches=True` with TRL's message and sets it
    False; a streamed train set sets `dataloader_num_workers` to 0 with TRL's warning, a streamed eval set alone
    leaves a map-style train set's workers."""
    stream = prompts_dataset(8).to_iterable_dataset()
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        VAPOTrainer(
            str(tiny_model_dir), digit_fraction,
            make_args(tmp_path, accelerator_config={"dispatch_batches": True}, max_steps=-1),  # said before max_steps
            stream,
        )  # fmt: skip
    with caplog.at_level("WARNING"):
        args = make_args(tmp_path, dataloader_num_workers=4)
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, stream)
    assert trainer.args.accelerator_config.dispatch_batches is False and trainer.args.dataloader_num_workers == 0
    assert "overriding the provided value (4)" in caplog.text
    args = make_args(tmp_path, dataloader_num_workers=4, per_device_eval_batch_size=4)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(8), stream)
    assert trainer.args.dataloader_num_workers == 4 and trainer.args.accelerator_config.dispatch_batches is False


def test_a_shuffled_stream_is_reshuffled_each_epoch(tiny_model_dir, tmp_path):
    """With `shuffle_dataset` (the default), a stream is shuffled as GRPOTrainer shuffles it (a buffered shuffle
    seeded by `seed`) and again, differently, in the next epoch: each epoch is every prompt once. The same seed reads
    the same order (a resume skips the rows read before it in that order), another seed another."""

    def two_epochs(seed: int) -> list[list[str]]:
        args = make_args(tmp_path, per_device_train_batch_size=8, seed=seed)  # 2 prompts x 4 completions a rollout
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(8).to_iterable_dataset())
        return [[row["prompt"] for _ in range(4) for row in trainer._next_rows()[::4]] for _ in range(2)]

    epochs = two_epochs(42)
    assert all(sorted(epoch) == sorted(f"{i}+{i}=" for i in range(8)) for epoch in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != [f"{i}+{i}=" for i in range(8)]
    assert two_epochs(42) == epochs and two_epochs(1)[0] != epochs[0]


def test_a_streamed_dataset_needs_max_steps_and_a_prompt_column(tmp_path):
    with pytest.raises(ValueError, match="IterableDataset .* set max_steps"):
        VAPOTrainer(
            "no/such-model", digit_fraction, make_args(tmp_path, max_steps=-1), prompts_dataset().to_iterable_dataset()
        )
    stream = prompts_dataset().rename_column("prompt", "question").to_iterable_dataset()
    with pytest.raises(ValueError, match="no 'prompt' column; its columns are \\['answer', 'question'\\]"):
        VAPOTrainer("no/such-model", digit_fraction, make_args(tmp_path), stream)


def test_quantization_config_loads_the_model_quantized_as_grpo_takes_it(tiny_model_dir, tmp_path):
    import bitsandbytes as bnb
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = make_args(tmp_path, bf16=True, use_cpu=True)
    trainer = VAPOTrainer(
        str(tiny_model_dir),
        digit_fraction,
        args,
        prompts_dataset(),
        quantization_config=quantization,
        peft_config=lora,
    )
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
    assert args.model_init_kwargs is None  # the config the user holds is left as it is
    # Its saved adapter goes on training on the quantized base, without a peft_config (it has its adapter).
    trainer.save_model(str(tmp_path / "qlora"))
    again = VAPOTrainer(
        str(tmp_path / "qlora"), digit_fraction, args, prompts_dataset(), quantization_config=quantization
    )
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in again.model.modules())
    assert again.actor_critic.shares_base and any(
        p.requires_grad for n, p in again.model.named_parameters() if ".default." in n
    )
    with pytest.raises(ValueError, match="pass a peft_config"):  # before a reward model loads, as the policy
        VAPOTrainer("no/such-model", "no/such-reward-model", args, prompts_dataset(), quantization_config=quantization)
    both = make_args(tmp_path, model_init_kwargs={"quantization_config": quantization})
    with pytest.raises(ValueError, match="both as a trainer argument and in args.model_init_kwargs"):
        VAPOTrainer("no/such-model", digit_fraction, both, prompts_dataset(), quantization_config=quantization)


@pytest.mark.parametrize("reward_funcs", [None, []])
def test_reward_funcs_are_optional_where_grpo_makes_them_optional_with_grpos_error(tmp_path, reward_funcs):
    """GRPOTrainer's `reward_funcs` defaults to None, for an environment's `get_reward`; VAPO takes no environment,
    so without reward functions it fails as GRPOTrainer does without either, before any model loads."""
    assert inspect.signature(VAPOTrainer.__init__).parameters["reward_funcs"].default is None
    with pytest.raises(ValueError, match="No reward source provided. Pass `reward_funcs`"):
        VAPOTrainer("no/such-model", reward_funcs, make_args(tmp_path), prompts_dataset())
    with pytest.raises(ValueError, match="No reward source provided"):
        VAPOTrainer("no/such-model", args=make_args(tmp_path), train_dataset=prompts_dataset())


def test_logs_during_value_pretraining_give_each_row_an_advantage_as_grpo_logs_do(tiny_model_dir, tmp_path):
    """A value-pretraining rollout has no advantages: `_logs["advantages"]` was empty beside its prompts, and a
    callback that builds GRPOTrainer's table from `_logs` (a DataFrame, as GRPOTrainer's `log` does) failed. It holds
    NaN for each row then, as GRPOTrainer's holds NaN where a reward is missing."""
    import pandas as pd
    from transformers import TrainerCallback

    from trl_vapo.metric_names import VALUE_PRETRAIN

    seen, trainers = [], []

    class Read(TrainerCallback):
        def on_rollout(self, args, state, control, rollout=None, **kwargs):
            seen.append((rollout.phase, trainers[0]._logs))

    args = make_args(tmp_path, max_steps=1, value_pretrain_steps=1, value_pretrain_patience=None)
    trainers.append(VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(8), callbacks=[Read()]))
    trainers[0].train()
    phase, logs = seen[0]
    assert phase == VALUE_PRETRAIN and len(logs["advantages"]) == len(logs["prompt"]) > 0
    assert all(math.isnan(a) for a in logs["advantages"])
    table = {"prompt": logs["prompt"], "completion": logs["completion"], **logs["rewards"]}
    assert len(pd.DataFrame({**table, "advantage": logs["advantages"]})) == len(logs["prompt"])


def test_steps_per_generation_off_gradient_accumulation_is_refused_saying_why(tmp_path):
    """GRPOTrainer accepts any steps_per_generation; VAPO trains each rollout in whole optimizer steps."""
    with pytest.raises(ValueError, match=r"steps_per_generation \(3\) must be a multiple of .* whole optimizer steps"):
        make_args(tmp_path, per_device_train_batch_size=4, steps_per_generation=3, gradient_accumulation_steps=2)


def test_the_completions_that_reward_functions_logged_stay_in_logs_after_training(tiny_model_dir, tmp_path):
    """GRPOTrainer's `_logs` (callbacks written for it read it) holds the last rollout's completions and the columns
    reward functions logged with `log_extra`, also once that rollout's table has been logged; and a trainer without
    data fails with GRPOTrainer's words."""

    def first_characters(completions, log_extra, **kwargs):
        log_extra("start", [c[:5] for c in completions])
        return [float(len(c)) for c in completions]

    args = make_args(tmp_path, log_completions=True, max_steps=1)
    trainer = VAPOTrainer(str(tiny_model_dir), first_characters, args, prompts_dataset(8))
    assert trainer._logs["extra"] == {} and trainer._logs["completion"] == []
    trainer.train()
    logs = trainer._logs
    assert len(logs["completion"]) == args.generation_batch_size
    assert logs["extra"]["start"] == [c[:5] for c in logs["completion"]]
    assert logs["rewards"]["first_characters"] == [float(len(c)) for c in logs["completion"]]
    # And the table in `output_dir/completions/`, as GRPOTrainer writes it: one parquet file per logged rollout.
    import pandas as pd

    [written] = (tmp_path / "out" / "completions").glob("*.parquet")
    assert written.name == "completions_00001.parquet"
    frame = pd.read_parquet(written)
    assert frame["completion"].tolist() == logs["completion"] and frame["start"].tolist() == logs["extra"]["start"]
    assert frame["first_characters"].tolist() == logs["rewards"]["first_characters"] and set(frame["step"]) == {1}
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        VAPOTrainer(str(tiny_model_dir), first_characters, args)


# ---------------------------------------------------------------------------------------------------------------------
# GRPOConfig's policy-token filters and adaptive entropy control, on VAPO's loss
# ---------------------------------------------------------------------------------------------------------------------


def _first_step_policy_loss(batch: dict, keep=None) -> float:
    """The first step's PPO term from its micro-batch or rollout (`mask` and `advantages`; ratio 1, advantages not
    whitened): the mean of -A over the step's tokens, a filtered-out token counting with 0."""
    mask = batch["mask"]
    keep = torch.ones_like(mask) if keep is None else keep
    return (-(batch["advantages"] * mask * keep).sum() / mask.sum()).item()


def test_top_entropy_quantile_trains_the_policy_on_the_highest_entropy_fifth_of_the_tokens(tiny_model_dir, tmp_path):
    """GRPOConfig's `top_entropy_quantile` (Beyond the 80/20 Rule): the first step's policy loss is the mean of -A
    over the tokens whose entropy is in the top 20% of the micro-batch's, the others counting as 0."""
    from helpers import CapturingTrainer

    args = make_args(tmp_path, max_steps=1, whiten_advantages=False, top_entropy_quantile=0.2)
    trainer = CapturingTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    filters = []
    token_masks = trainer._token_masks

    def recording(out, batch):
        masks = token_masks(out, batch)
        filters.append((masks["entropy_mask"], out["entropy"].detach(), batch))
        return masks

    trainer._token_masks = recording
    trainer.train()
    [(keep, entropy, batch)] = filters  # one micro-batch: the whole rollout, its rows shuffled
    mask = batch["mask"]
    valid = entropy[mask.bool()]
    assert 0 < keep.sum() <= math.ceil(0.2 * valid.numel()) + 1
    assert torch.equal(keep.bool(), mask.bool() & (entropy >= torch.quantile(valid, 0.8)))
    logged = rl_logs(trainer)[0]["loss/policy"]
    assert logged == pytest.approx(_first_step_policy_loss(batch, keep), rel=1e-4, abs=1e-6)
    assert logged != pytest.approx(_first_step_policy_loss(batch), rel=1e-3)


@pytest.mark.parametrize("threshold", [0.01, 0.1])
def test_off_policy_mask_drops_negative_advantages_only_where_the_sampler_drifted_past_the_threshold(
    tiny_model_dir, tmp_path, stand_in_vllm, monkeypatch, threshold
):
    """GRPOConfig's `off_policy_mask_threshold` (DeepSeek-V3.2): a vLLM sampler whose log-prob of every token is 0.05
    above the trainer's drifted 0.05 per token. Under a threshold of 0.01 the first step's policy loss leaves out
    every negative advantage; under 0.1 it keeps every token."""
    from helpers import CapturingTrainer, StandInVLLMGeneration
    from peft import LoraConfig

    generate = StandInVLLMGeneration.generate

    def drifted(self, *args, **kwargs):
        prompts, completions, logprobs, token_ids = generate(self, *args, **kwargs)
        return prompts, completions, [[[lp + 0.05 for lp in tok] for tok in row] for row in logprobs], token_ids

    monkeypatch.setattr(StandInVLLMGeneration, "generate", drifted)
    args = make_args(
        tmp_path,
        max_steps=1,
        whiten_advantages=False,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_importance_sampling_correction=False,
        off_policy_mask_threshold=threshold,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = CapturingTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=lora)
    trainer.train()
    [(_, rollout)] = trainer.rollouts
    assert rollout.sampling_logprobs is not None
    negative = (rollout.advantages < 0) & rollout.loss_mask.bool()
    assert negative.any() and (rollout.advantages * rollout.loss_mask > 0).any()
    keep = None if threshold > 0.05 else (~negative).float()
    logged = rl_logs(trainer)[0]["loss/policy"]
    whole = {"mask": rollout.loss_mask, "advantages": rollout.advantages}
    assert logged == pytest.approx(_first_step_policy_loss(whole, keep), rel=1e-4, abs=1e-6)


def test_adaptive_entropy_moves_the_coefficient_each_step_applies_it_below_the_target_and_resumes(
    tiny_model_dir, tmp_path
):
    """GRPOConfig's `use_adaptive_entropy` (Skywork-OR1): with a target above the tiny model's entropy the coefficient
    climbs by `entropy_coef_delta` after every step and the bonus applies from the second step (the first has no
    reading yet); a resumed run goes on from the checkpointed coefficient. With a target below it, the coefficient
    falls to `entropy_coef_min` and the bonus never applies."""
    settings = dict(
        max_steps=3,
        entropy_coef=0.01,
        use_adaptive_entropy=True,
        entropy_target=50.0,
        entropy_coef_delta=0.005,
        save_strategy="steps",
        save_steps=2,
    )
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, **settings), prompts_dataset())
    trainer.train()
    logs = rl_logs(trainer)
    assert [h["entropy_coef"] for h in logs] == pytest.approx([0.015, 0.02, 0.025])
    assert trainer.entropy_coef == pytest.approx(0.025)
    assert ["loss/entropy_bonus" in h for h in logs] == [False, True, True]

    resumed = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, **settings), prompts_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.entropy_coef == pytest.approx(0.025)
    assert [h for h in comparable(resumed.state.log_history) if h["step"] == 3] == [
        h for h in comparable(trainer.state.log_history) if h["step"] == 3
    ]

    settings.update(entropy_target=0.0, save_strategy="no", output_dir=str(tmp_path / "below"))
    below = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, **settings), prompts_dataset())
    below.train()
    logs = rl_logs(below)
    assert [h["entropy_coef"] for h in logs] == pytest.approx([0.005, 0.0, 0.0])
    assert not any("loss/entropy_bonus" in h for h in logs)


def test_get_high_entropy_mask_pools_every_processs_tokens_padded_with_nan():
    """`trainer.get_high_entropy_mask` under data parallelism: each process's valid entropies, padded to the longest
    with NaN by accelerate's `pad_across_processes` and gathered, set one threshold. Two processes stood in for by an
    accelerator whose gather adds the other process's padded tensor (torch.distributed needs processes)."""
    from types import SimpleNamespace

    other = torch.tensor([5.0, 6.0, 7.0, 8.0, 9.0])  # the other process's five valid entropies

    def pad_across_processes(values, dim, pad_index):
        width = max(len(values), len(other))
        return torch.cat([values, torch.full((width - len(values),), pad_index)])

    def gather(padded):
        return torch.cat([padded, pad_across_processes(other, 0, math.nan)])

    trainer = SimpleNamespace(accelerator=SimpleNamespace(pad_across_processes=pad_across_processes, gather=gather))
    entropies = torch.tensor([[0.0, 10.0, 3.0], [4.0, 2.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # three valid entropies here: 0, 10 and 4
    keep = VAPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold=0.5)
    # The median of [0, 10, 4, 5, 6, 7, 8, 9] is 6.5: of this process's tokens only the 10 is kept.
    assert keep.tolist() == [[False, True, False], [False, False, False]]


def test_normalize_then_sum_standardises_each_reward_function_within_its_group_for_gae(tiny_model_dir, tmp_path):
    """GRPOConfig's `multi_objective_aggregation="normalize_then_sum"` (GDPO): two reward functions, one a hundred
    times the scale of the other; each completion's reward, which its last token gets and GAE carries back to its
    first (gamma = lam_critic = 1: the return there is the reward), is `core.group_normalized_rewards` of its scores.
    The logged reward stays the weighted sum of the scores."""
    from helpers import CapturingTrainer, first_char_is_letter

    from trl_vapo.core import group_normalized_rewards

    def hundredfold_digits(completions, **kwargs):
        return [100 * r for r in digit_fraction(completions)]

    args = make_args(tmp_path, max_steps=1, multi_objective_aggregation="normalize_then_sum", reward_weights=[1, 2])
    funcs = [hundredfold_digits, first_char_is_letter]
    trainer = CapturingTrainer(str(tiny_model_dir), funcs, args, prompts_dataset())
    trainer.train()
    [(_, rollout)] = trainer.rollouts
    scores = rollout.scores.per_function
    expected = group_normalized_rewards(scores, torch.tensor([1.0, 2.0]), args.num_generations)
    torch.testing.assert_close(rollout.returns[:, 0], expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, rollout.scores.reward, atol=1e-2)
    assert rl_logs(trainer)[0]["reward"] == pytest.approx(rollout.scores.reward.mean().item(), rel=1e-5)


def test_a_reward_function_that_edits_its_arguments_changes_no_other_completions(tiny_model_dir, tmp_path):
    """GRPOTrainer's DataLoader builds every row anew, so a reward function may edit what it is given: a judge that
    appends each completion to its prompt's messages, a function that tags its column. Each completion of a group, the
    check before training, an evaluation and `evaluate_policy`'s greedy pass (after its sampled one) read the rows as
    the dataset holds them: the group's copies were one object, so completion k read the k-1 completions before it."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_vapo.evaluation import evaluate_policy

    seen = []

    def judge(prompts, completions, tags, **kwargs):
        for p, c, t in zip(prompts, completions, tags, strict=True):
            seen.append((len(p), len(t)))
            p.append(c[0])
            t.append("judged")
        return [0.0] * len(prompts)

    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "tags": ["x"]} for i in range(8)]
    args = make_args(tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8)
    assert args.num_generations == 4
    trainer = VAPOTrainer(str(tiny_model_dir), judge, args, Dataset.from_list(rows), Dataset.from_list(rows[:2]))
    checked = len(seen)  # the checks before training: a group of copies of the first row, for each dataset
    trainer.train()
    trained = len(seen) - checked
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    evaluate_policy(model, tokenizer, Dataset.from_list(rows[:2]), judge, k=2, max_new_tokens=4)
    evaluated = len(seen) - checked - trained
    assert (checked, trained, evaluated) == (2 * 4, args.generation_batch_size + 2 * 4, 2 * 2 + 2)
    assert set(seen) == {(1, 1)}


def test_a_copy_of_the_config_derives_its_defaults_from_its_own_values(tmp_path):
    """The defaults derived from other fields (the critic's rate, 2 x learning_rate; the critic's passes; the rollout
    size) were written into the fields: a copy with another learning rate (`dataclasses.replace`) kept the critic at
    2 x the old one (0.2 x the actor's, silently), one with more passes or another batch failed naming fields the
    user never set; a hyperparameter search's `setattr` of learning_rate left the critic's. A given value stays."""
    import json

    args = make_args(tmp_path, critic_learning_rate=None, per_device_train_batch_size=16)
    copy = dataclasses.replace(args, learning_rate=1e-5)
    assert copy.critic_learning_rate == pytest.approx(2e-5)
    assert dataclasses.replace(args, num_iterations=2).critic_num_iterations == 2
    resized = dataclasses.replace(args, per_device_train_batch_size=8, gradient_accumulation_steps=2)
    assert (resized.generation_batch_size, resized.steps_per_generation) == (16, 2)
    args.learning_rate = 3e-4  # as transformers' hyperparameter search sets a trial's values
    assert args.critic_learning_rate == pytest.approx(6e-4)
    args.critic_learning_rate = type(args.critic_learning_rate)(7e-4)  # (the search casts to the field's type)
    args.learning_rate = 1e-4
    assert args.critic_learning_rate == 7e-4  # given now: it stays
    given = make_args(tmp_path, critic_learning_rate=5e-4)
    assert dataclasses.replace(given, learning_rate=1e-5).critic_learning_rate == 5e-4
    assert json.loads(json.dumps(copy.to_dict()))["critic_learning_rate"] == pytest.approx(2e-5)  # a number still
    # A plain one where it leaves the config: trackers keep only exact floats as numbers (`to_sanitized_dict`), and a
    # checkpoint's weights-only load refuses the optimizer's state holding a float subclass
    assert type(copy.to_sanitized_dict()["critic_learning_rate"]) is float
    # Clip-higher's bound, None: equal to epsilon (symmetric), followed epsilon only as it was at construction.
    symmetric = make_args(tmp_path, epsilon_high=None)
    assert symmetric.epsilon_high == 0.2 and dataclasses.replace(symmetric, epsilon=0.3).epsilon_high == 0.3
    symmetric.epsilon = 0.1
    assert symmetric.epsilon_high == 0.1
    assert dataclasses.replace(make_args(tmp_path), epsilon=0.1).epsilon_high == 0.28  # the paper's, given


def test_fields_set_after_the_config_was_built_are_read_as_at_construction(tmp_path):
    """`check_again` (the trainer calls it) read the fields set since with `_validate` alone: a GRPO spelling or a
    text value that construction reads was refused by a message listing it as accepted (`loss_type="dapo"`,
    `pad_to_multiple_of="auto"`, `scale_rewards=False`), `report_to="none"` was its letters' trackers, and a
    contradiction construction refuses went through (`load_best_model_at_end` without `metric_for_best_model`)."""
    args = make_args(tmp_path)
    args.loss_type, args.pad_to_multiple_of, args.scale_rewards, args.report_to = "dapo", "auto", False, "none"
    args.positive_reward_funcs = "digit_fraction"
    args.check_again()
    assert (args.loss_type, args.pad_to_multiple_of, args.scale_rewards, args.report_to) == ("token", None, "none", [])
    assert args.positive_reward_funcs == ["digit_fraction"]
    args.loss_type = "cispo"
    args.check_again()
    assert (args.surrogate, args.loss_type) == ("cispo", "token")
    args.check_again()  # nothing set since: the surrogate stays
    assert (args.surrogate, args.loss_type) == ("cispo", "token")
    args.loss_type = "sapo"  # another GRPO loss replaces the surrogate the first set (it was refused as a conflict)
    args.check_again()
    assert (args.surrogate, args.loss_type) == ("sapo", "sequence")
    args.loss_type = "dapo"  # GRPO's clipped PPO surrogate
    args.check_again()
    assert (args.surrogate, args.loss_type) == ("ppo", "token")
    assert json.loads(args.to_json_string())["surrogate"] == "ppo"
    args.surrogate = "vespo"  # given: it stays whatever the aggregation
    args.loss_type = "sequence"
    args.check_again()
    assert (args.surrogate, args.loss_type) == ("vespo", "sequence")
    args.loss_type = "cispo"  # beside the surrogate given: refused
    with pytest.raises(ValueError, match="loss_type='cispo' sets surrogate='cispo', but surrogate='vespo' is set"):
        args.check_again()
    args.surrogate = "ppo"
    args.check_again()
    args.loss_type = "sequence"  # VAPO's aggregation set after a GRPO loss keeps its surrogate
    args.check_again()
    assert (args.surrogate, args.loss_type) == ("cispo", "sequence")
    named = make_args(tmp_path, surrogate="cispo", loss_type="cispo", epsilon_high=5.0)  # the surrogate named too
    named.loss_type = "sapo"
    with pytest.raises(ValueError, match="loss_type='sapo' sets surrogate='sapo', but surrogate='cispo' is set"):
        named.check_again()
    cispo = make_args(tmp_path, loss_type="cispo", epsilon_high=5.0)
    copy = dataclasses.replace(cispo, learning_rate=1e-5)  # a copy passes the derived values: they stay derived
    assert (copy.surrogate, copy.loss_type) == ("cispo", "token")
    copy.loss_type = "sapo"
    copy.check_again()
    assert (copy.surrogate, copy.loss_type) == ("sapo", "sequence")
    args.load_best_model_at_end = True
    with pytest.raises(ValueError, match="load_best_model_at_end=True needs metric_for_best_model"):
        args.check_again()


def test_batch_fields_set_after_the_config_was_built_are_followed_and_checked(tiny_model_dir, tmp_path):
    """TrainingArguments' fields are set after construction too: the rollout size derived from the old ones stayed
    (a run by epochs planned 0 steps and ended without a word; another num_generations failed once the models had
    loaded). The trainer derives the sizes again, and checks them, before anything loads."""
    args = make_args(tmp_path, per_device_train_batch_size=8, max_steps=-1, num_train_epochs=1)
    assert (args.steps_per_generation, args.generation_batch_size) == (1, 8)
    args.gradient_accumulation_steps = 4
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(16))
    assert (args.steps_per_generation, args.generation_batch_size) == (4, 32)
    # 16 prompts, 8 a rollout of 32 completions: two rollouts of one optimizer step (of 4 micro-batches); 0 before.
    assert (trainer.run_plan.prompts_per_rollout, trainer.run_plan.rl_steps) == (8, 2)
    args.num_generations = 64
    with pytest.raises(ValueError, match=r"generation_batch_size \(32 = .*must be a multiple of num_generations \(64"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(16))


def test_include_num_input_tokens_seen_logs_tokens_per_second_as_grpotrainer_does(tiny_model_dir, tmp_path):
    """transformers' training loop gives `Trainer.log` its start, which adds `train_tokens_per_second` to each log row
    with `include_num_input_tokens_seen` on (GRPOTrainer's rows have it): VAPO's rows had the count alone."""
    args = make_args(tmp_path, include_num_input_tokens_seen="all")
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    trainer.train()
    rows = rl_logs(trainer)
    assert len(rows) == 2 and all(r["train_tokens_per_second"] > 0 for r in rows)
    assert rows[-1]["num_input_tokens_seen"] == trainer.state.num_input_tokens_seen > 0
