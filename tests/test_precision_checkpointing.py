"""Training as users run it on one GPU: gradient checkpointing, bf16 mixed precision, QLoRA, on the CPU and (the
`cuda` parameters, `pytest -m cuda`) on a CUDA GPU where there is one.

bf16 runs on the CPU through `use_cpu=True, bf16=True` (CPU autocast): the same code path as CUDA autocast.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import PoisonedTrainer, digit_fraction, make_args, prompts_dataset, rl_logs
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainerCallback

from trl_vapo import VAPOConfig, VAPOTrainer


def lora_config(**kwargs) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", **kwargs)


def decoder_layers(trainer) -> list[torch.nn.Module]:
    """The decoder layers that run with gradients: the policy's, and the separate critic's when there is one."""
    model = trainer.actor_critic
    policy = model.policy.get_base_model() if hasattr(model.policy, "get_base_model") else model.policy
    layers = list(policy.model.layers)
    if model.critic is not None:
        layers += list(model.critic.model.layers)
    return layers


def counting(forward, calls: list[int]):
    def counted(*args, **kwargs):
        calls[0] += torch.is_grad_enabled()
        return forward(*args, **kwargs)

    return counted


def trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.actor_critic.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------------------------------------------------------
# Gradient checkpointing
# ---------------------------------------------------------------------------------------------------------------------


def test_the_critics_adapter_switch_computes_as_peft_switches_without_walking_the_model(tiny_model_dir, monkeypatch):
    """Each critic forward ran under peft's `set_adapter`, twice (in and back), with the adapters' `requires_grad`
    restored after each: about 30 ms a switch at Qwen2.5-0.5B shapes, two per micro-batch of the scoring pass and the
    update. The switch now sets what `set_adapter` leaves in each layer (read from it once per set of adapters):
    the same values, the same trainable weights, and `set_adapter` is not called again; a reference adapter added
    later is read then."""
    from helpers import peft_actor_critic
    from peft import PeftModel

    from trl_vapo.modeling import CRITIC_ADAPTER, POLICY_ADAPTER

    actor_critic = peft_actor_critic(tiny_model_dir, modules_to_save=["input_layernorm"])
    policy = actor_critic.policy
    ids = torch.randint(3, 50, (2, 9))
    mask = torch.ones_like(ids)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    policy.set_adapter(CRITIC_ADAPTER)  # peft's own switch, for the expected values
    with torch.no_grad():
        hidden = policy.get_base_model().base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        expected = actor_critic.value_head(hidden[:, -5:-1]).float()
    policy.set_adapter(POLICY_ADAPTER)
    policy.set_requires_grad([POLICY_ADAPTER, CRITIC_ADAPTER], True)
    with torch.no_grad():
        logprobs = actor_critic(ids, mask, 4, with_values=False, with_entropy=False)["logprobs"]
        first = actor_critic(ids, mask, 4, with_policy=False)["values"]  # reads each adapter's states
    monkeypatch.setattr(PeftModel, "set_adapter", lambda *a, **k: pytest.fail("set_adapter walked the model"))
    with torch.no_grad():
        again = actor_critic(ids, mask, 4, with_policy=False)["values"]
        after = actor_critic(ids, mask, 4, with_values=False, with_entropy=False)["logprobs"]
    assert torch.equal(first, expected) and torch.equal(again, expected)
    assert torch.equal(after, logprobs)  # back under the policy's adapter (its LoRA and its norm copies)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    assert policy.active_adapter == POLICY_ADAPTER
    monkeypatch.undo()
    actor_critic.add_reference_adapter()  # a copy of the policy's adapter: it computes as the policy
    with torch.no_grad(), actor_critic._reference_adapter():
        assert policy.active_adapter == "ref"
        reference = actor_critic(ids, mask, 4, with_values=False, with_entropy=False)["logprobs"]
    assert torch.equal(reference, logprobs) and policy.active_adapter == POLICY_ADAPTER
    # Moved away from the policy's, the reference adapter's layers compute as peft's own switch to it says.
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B.ref" in name:
                param.add_(0.05 * torch.randn_like(param))
        policy.set_adapter("ref")
        expected = actor_critic(ids, mask, 4, with_values=False, with_entropy=False)["logprobs"]
        policy.set_adapter(POLICY_ADAPTER)
    policy.set_requires_grad([POLICY_ADAPTER, CRITIC_ADAPTER], True)
    with torch.no_grad(), actor_critic._reference_adapter():
        reference = actor_critic(ids, mask, 4, with_values=False, with_entropy=False)["logprobs"]
    assert torch.equal(reference, expected) and not torch.equal(reference, logprobs)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable


@pytest.mark.parametrize(
    "lora, on_the_model",
    [(None, False), ({}, False), ({"modules_to_save": ["input_layernorm"]}, False), ({}, True)],
    ids=["full", "lora-shared-critic", "lora-shared-critic-modules-to-save", "lora-given-checkpointed"],
)
def test_gradient_checkpointing_recomputes_and_gives_the_same_updates(
    tiny_model_dir, tmp_path, lora, on_the_model, device
):
    """Same greedy rollouts, same optimizer steps (value pretraining, then RL with two steps per rollout): identical
    weights with and without checkpointing, and with it every decoder layer runs forward twice per update (once
    more in backward). With the shared-base critic this holds only if the recomputation replays each layer under the
    adapter (policy or critic) that ran its forward: its LoRA matrices, and its copies of `modules_to_save` modules
    inside the layers (each adapter trains its own copy of every layer's norm here). `on_the_model`: checkpointing
    is switched on in the model given (transformers' reentrant default, as peft's prepare_model_for_kbit_training
    does), not by `gradient_checkpointing`: the layers replay under their adapters from the start of training (the
    engine's re-enabling after each generation made the updates right here, not with an engine that never pauses
    checkpointing, vLLM's or a rollout_func's own)."""
    from functools import partial

    replaying = []  # at the start of training: whether every checkpointed layer recomputes under its adapters
    layers = []  # the run's decoder layers
    hooks = []  # the forward hooks on the input embeddings (checkpointing's input-requires-grad), at the start

    def embedding_hooks(trainer):
        models = (trainer.actor_critic.policy, trainer.actor_critic.critic)
        return sum(len(m.get_input_embeddings()._forward_hooks) for m in models if m is not None)

    class AtTrainBegin(TrainerCallback):
        def __init__(self):
            self.trainer = None

        def on_train_begin(self, args, state, control, **kwargs):
            functions = [getattr(layer, "_gradient_checkpointing_func", None) for layer in layers]
            replaying.append(all(isinstance(f, partial) and "context_fn" in f.keywords for f in functions))
            hooks.append(embedding_hooks(self.trainer))

    def run(checkpointing: bool):
        args = make_args(
            tmp_path / f"gc-{checkpointing}",
            use_cpu=device == "cpu",
            bf16=False,  # float32 on a GPU too (bf16 is its default there): the comparison is of the recomputation
            max_steps=2,
            value_pretrain_steps=1,
            per_device_train_batch_size=8,
            steps_per_generation=2,
            gradient_checkpointing=checkpointing and not on_the_model,
            generation_kwargs={"do_sample": False},
        )
        model = str(tiny_model_dir)
        if checkpointing and on_the_model:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
            model.gradient_checkpointing_enable()
        trainer = VAPOTrainer(
            model=model,
            reward_funcs=digit_fraction,
            args=args,
            train_dataset=prompts_dataset(),
            peft_config=lora_config(**lora) if lora is not None else None,
            callbacks=[at_begin := AtTrainBegin()],
        )
        at_begin.trainer = trainer
        calls = [0]
        layers[:] = decoder_layers(trainer)
        for layer in layers:
            # Count the MLP's forward itself: module hooks do not fire in torch's checkpoint recomputation.
            layer.mlp.forward = counting(layer.mlp.forward, calls)
        trainer.train()
        # Checkpointing is off for each generation and on again after it: no hook left behind each time.
        assert embedding_hooks(trainer) == hooks[-1], (embedding_hooks(trainer), hooks)
        return trainable(trainer), calls[0], trainer.actor_critic.is_gradient_checkpointing

    plain, plain_calls, plain_on = run(False)
    checkpointed, checkpointed_calls, on = run(True)
    assert on and not plain_on
    assert replaying == [False, lora is not None]  # (a full fine-tuning's layers recompute as they are)
    assert checkpointed_calls == 2 * plain_calls > 0
    assert plain.keys() == checkpointed.keys()
    # CUDA's backward kernels may sum in another order each run (atomics): round-off, which Adam's division by
    # sqrt(v) turns into a fraction of one update on weights with gradients near 1e-8 (as in test_distributed.py).
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if device == "cpu" else {"rtol": 1e-4, "atol": 5e-5}
    for name in plain:
        assert checkpointed[name].device.type == device
        torch.testing.assert_close(checkpointed[name], plain[name], **tolerance, msg=name)


def test_transformers_own_checkpointing_options_take_effect(tmp_path):
    """`gradient_checkpointing_kwargs={"every_n_layers": 2, "offload": True}`, transformers' own keys, which its
    Trainer takes out of the dict: they were passed on to `torch.utils.checkpoint` and dropped, every layer
    checkpointed. (On the CPU `offload` has nothing to move, and is left out: transformers would ask for pinned
    memory, which needs an accelerator.)"""
    from trl_vapo.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "four-layers", num_layers=4)
    args = make_args(
        tmp_path,
        max_steps=1,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"every_n_layers": 2, "offload": True},
    )
    trainer = VAPOTrainer(
        model=str(model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=lora_config(),  # the critic an adapter on the same layers, replayed under its adapter
    )
    trainer.train()
    assert [layer.gradient_checkpointing for layer in decoder_layers(trainer)] == [True, False, True, False]
    assert trainer.state.global_step == 1 and trainer.progress.skipped_steps == 0


def test_reentrant_checkpointing_with_the_shared_base_critic_is_refused(tiny_model_dir, tmp_path):
    args = make_args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=lora_config(),
    )
    with pytest.raises(ValueError, match="use_reentrant=False"):
        trainer.train()


# ---------------------------------------------------------------------------------------------------------------------
# Mixed precision: float32 weights, bf16 compute
# ---------------------------------------------------------------------------------------------------------------------


def test_torch_dtype_is_read_as_dtype(tiny_model_dir, tmp_path):
    """`torch_dtype`, transformers' former name for `dtype` (many configs still use it), was silently ignored:
    transformers takes `dtype` over it, and the trainer passes dtype=float32 unless told."""
    args = make_args(tmp_path, model_init_kwargs={"torch_dtype": "bfloat16"})
    assert args.model_init_kwargs == {"dtype": "bfloat16"}
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=lora_config())
    frozen = [p for p in trainer.actor_critic.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    with pytest.raises(ValueError, match=r"both dtype \('float32'\) and torch_dtype \('bfloat16'\).*keep dtype"):
        make_args(tmp_path, model_init_kwargs={"dtype": "float32", "torch_dtype": "bfloat16"})
    both = make_args(tmp_path, model_init_kwargs={"dtype": torch.bfloat16, "torch_dtype": "bfloat16"})  # one dtype
    assert both.model_init_kwargs == {"dtype": "bfloat16"}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-shared-critic"])
def test_a_bf16_model_trains_float32_weights_in_bf16_at_the_paper_learning_rate(
    tiny_model_dir, tmp_path, lora, device
):
    """Rolled out by the static-cache engine, the default on a CUDA GPU, on the CPU too: full fine-tuning's float32
    weights under bf16 autocast hand its cache float32 keys and bf16 values (its first GPU run failed there)."""
    args = make_args(
        tmp_path,
        bf16=True,
        use_cpu=device == "cpu",
        use_static_cache_engine=True,
        model_init_kwargs={"dtype": "bfloat16"},
        learning_rate=1e-6,
        critic_learning_rate=2e-6,
        max_steps=2,
    )
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=lora_config() if lora else None,
    )
    model = trainer.actor_critic
    before = trainable(trainer)
    assert before and all(p.dtype == torch.float32 for p in before.values())
    assert {n for n in before if "value_head" in n or "score" in n}, "the value head is trainable"
    if lora:  # the frozen base stays in bf16
        frozen = [p for p in model.parameters() if not p.requires_grad]
        assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)

    # A layer with float32 weights (a frozen bf16 base layer computes in bf16 with or without autocast).
    compute_dtypes = []
    layer = decoder_layers(trainer)[0]
    hooked = layer.self_attn.q_proj.lora_A["default"] if lora else layer.mlp.gate_proj
    assert hooked.weight.dtype == torch.float32
    hooked.register_forward_hook(lambda module, inputs, output: compute_dtypes.append(output.dtype))
    trainer.train()
    assert set(compute_dtypes) == {torch.bfloat16}, "the layers compute in bf16 under autocast"
    assert {p.device.type for p in model.parameters()} == {device}

    after = trainable(trainer)
    moved = sum(int((after[n] != before[n]).sum()) for n in before)
    total = sum(p.numel() for p in before.values())
    assert moved / total > 0.95, f"only {moved}/{total} trainable weights moved at lr 1e-6"
    # Stored in bf16, almost none of these updates would have survived the rounding (weights not near zero, that is:
    # LoRA's B starts at zero, where bf16 still resolves steps of 1e-6).
    large = {n: before[n].abs() > 1e-3 for n in before}
    kept_in_bf16 = sum(int(((after[n].bfloat16() != before[n].bfloat16()) & large[n]).sum()) for n in before)
    assert kept_in_bf16 / sum(int(m.sum()) for m in large.values()) < 0.05

    if (
        not lora
    ):  # saved as loaded: bf16 files and config, the float32 weights rounded once (the adapters stay float32)
        trainer.save_model(str(tmp_path / "saved"))
        for folder, prefix in ((tmp_path / "saved", "policy."), (tmp_path / "saved" / "critic", "critic.")):
            assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
            saved = load_file(folder / "model.safetensors")
            assert {v.dtype for v in saved.values()} == {torch.bfloat16}, folder
            for name, value in saved.items():
                assert torch.equal(value, after[prefix + name].bfloat16().cpu()), name


def test_without_autocast_a_bf16_lora_base_trains_its_modules_to_save_in_bf16_with_a_warning(
    tiny_model_dir, tmp_path, caplog
):
    """bf16=False (the CPU's default) and a bf16 LoRA base with `modules_to_save` (the LM head): cast to float32, the
    head's trainable copy met the bf16 base's hidden states without autocast and the first rollout failed (a dtype
    error). It trains in bf16, as peft leaves it (GRPOTrainer's run), with a warning naming it and the way to float32;
    a full model loaded in bf16 still trains whole in float32 (every layer in float32: no dtype meets another)."""
    import logging

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM"
    )
    args = make_args(tmp_path, bf16=False, model_init_kwargs={"dtype": "bfloat16"}, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=lora)
    head = trainer.actor_critic.policy.base_model.model.lm_head.modules_to_save["default"]
    assert head.weight.dtype == torch.bfloat16 and head.weight.requires_grad
    warned = [r.getMessage() for r in caplog.records if "set bf16=True to keep them in float32" in r.getMessage()]
    assert len(warned) == 1 and "modules_to_save.default.weight" in warned[0]
    before = head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(head.weight, before)  # it trained
    args = make_args(tmp_path / "full", bf16=False, model_init_kwargs={"dtype": "bfloat16"}, max_steps=1)
    full = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    assert all(p.dtype == torch.float32 for p in full.actor_critic.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------------------------------
# QLoRA: 4-bit base, shared-base critic
# ---------------------------------------------------------------------------------------------------------------------


def qlora_args(tmp_path, device: str = "cpu", **overrides) -> VAPOConfig:
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    return make_args(
        tmp_path,
        bf16=True,
        use_cpu=device == "cpu",
        gradient_checkpointing=True,
        value_pretrain_steps=1,
        max_steps=2,
        model_init_kwargs={"quantization_config": quantization, "dtype": "bfloat16"},
        **overrides,
    )


def test_qlora_trains_both_adapters_and_the_value_head_on_a_4bit_base(tiny_model_dir, tmp_path, device):
    import bitsandbytes as bnb

    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=qlora_args(tmp_path, device),
        train_dataset=prompts_dataset(),
        peft_config=lora_config(),
    )
    model = trainer.actor_critic
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.policy.modules())
    # The frozen weights that are not 4-bit (embeddings, LM head, norms) stay as loaded, bf16: peft's
    # `prepare_model_for_kbit_training` cast them to float32, and the activations and the KV cache with them.
    frozen = [p for p in model.policy.parameters() if not p.requires_grad and p.dtype.is_floating_point]
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}
    before = trainable(trainer)
    trainer.train()
    after = trainable(trainer)
    for side in (".default.", ".critic.", "value_head."):
        names = [n for n in before if side in n]
        assert names and any(not torch.equal(before[n], after[n]) for n in names), f"{side} did not train"
    assert all(p.dtype == torch.float32 for p in after.values())
    assert {p.device.type for p in after.values()} == {device}
    logs = rl_logs(trainer)
    assert len(logs) == 2 and all("grad_norm/policy" in h and "grad_norm/critic" in h for h in logs)  # max_steps=2


def test_an_evaluation_keeps_a_qlora_bases_4bit_layers_in_train_mode(tiny_model_dir, tmp_path):
    """bitsandbytes (0.50) on a CPU with AVX512-BF16 repacks a 4-bit layer the first time it runs in eval mode
    without gradients, and the repacked layer passes no gradient back: training's rollouts sample in
    `generation_mode`, which keeps those layers in train mode, but an evaluation put the whole model in eval mode,
    and every adapter below a repacked layer stopped learning after the first one, silently. (This machine's CPU may
    not repack: the test reads the layers' modes while the evaluation's completions are scored.)"""
    import bitsandbytes as bnb

    modes, built = [], []

    def reward(completions, **kwargs):
        if built:  # (not the reward's check as the trainer is built)
            model = built[0].actor_critic
            layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
            modes.append((model.training, {layer.training for layer in layers}))
        return digit_fraction(completions, **kwargs)

    args = qlora_args(tmp_path, per_device_eval_batch_size=4, num_generations_eval=2)
    trainer = VAPOTrainer(
        str(tiny_model_dir), reward, args, prompts_dataset(), prompts_dataset(2), peft_config=lora_config()
    )
    built.append(trainer)
    was_training = trainer.actor_critic.training
    trainer.evaluate()
    assert modes and all(mode == (False, {True}) for mode in modes)  # the rest in eval mode: no dropout
    assert trainer.actor_critic.training == was_training


def test_qlora_without_adapters_or_without_bitsandbytes_fails_before_loading(tmp_path, monkeypatch):
    args = qlora_args(tmp_path)
    with pytest.raises(ValueError, match="pass a peft_config"):
        VAPOTrainer(model="no/such-model", reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset())
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` meets where it is missing
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        VAPOTrainer(
            model="no/such-model",
            reward_funcs=digit_fraction,
            args=args,
            train_dataset=prompts_dataset(),
            peft_config=lora_config(),
        )


class WeightsAtStepEnds(TrainerCallback):
    """Keeps the trainer's trainable weights after each step, by step."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        trainable = [p.detach().clone() for p in self.trainer.actor_critic.parameters() if p.requires_grad]
        self.trainer.weights_by_step[state.global_step] = trainable

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.optimizer_hooks.append(("pre", state.global_step))

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.optimizer_hooks.append(("post", state.global_step))


def test_fp16_unscales_once_for_both_sides_and_an_overflow_only_lowers_the_scale(tiny_model_dir, tmp_path, device):
    """fp16, for GPUs without bf16 (a T4, a V100): the loss is scaled, and the gradients unscaled once a step
    before the policy's and the critic's are clipped apart (torch refuses a second unscale: the first step crashed).
    A gradient the scale overflows skips the update and lowers the scale, as under transformers' Trainer, and is no
    non-finite step (patience 1 here); the scale is checkpointed and resumed. On CUDA accelerate's scaler is replaced
    by one that starts from a chosen scale. On the CPU accelerate gives fp16 neither autocast nor a scaler: the
    stand-in is torch's CPU GradScaler and fp16 autocast, put where accelerate puts them on a GPU."""
    import math

    def train(name, init_scale, max_steps=2, poisoned=(), unscored=(), **overrides):
        args = make_args(tmp_path / name, fp16=True, use_cpu=device == "cpu", max_steps=max_steps, **overrides)
        PoisonedTrainer.poisoned = set(poisoned)  # those rollouts' losses are NaN

        def reward(completions, trainer_state, **kwargs):  # None (unscored) at the steps in `unscored` (0-based)
            scores = digit_fraction(completions, **kwargs)
            return [None] * len(scores) if trainer_state.global_step in unscored else scores

        trainer = PoisonedTrainer(str(tiny_model_dir), reward, args, prompts_dataset())
        trainer.weights_by_step, trainer.optimizer_hooks = {}, []
        trainer.add_callback(WeightsAtStepEnds(trainer))
        trainer.accelerator.native_amp = True  # fp16 autocast (accelerate's own on a GPU)
        scaler = torch.amp.GradScaler(device, init_scale=init_scale, backoff_factor=2.0**-10, growth_interval=10**6)
        trainer.accelerator.scaler = scaler
        trainer.train(resume_from_checkpoint=overrides.get("resume_from_checkpoint"))
        return trainer

    unscaled, scaled = train("one", 1.0), train("scaled", 2.0**16)
    # Unscaled once: the gradient norms without a scale (twice would read 1/65536 of them, never 65536 times them).
    scaled_norms = [h["grad_norm/policy"] for h in rl_logs(scaled)] + [h["grad_norm/critic"] for h in rl_logs(scaled)]
    norms = [h["grad_norm/policy"] for h in rl_logs(unscaled)] + [h["grad_norm/critic"] for h in rl_logs(unscaled)]
    assert scaled_norms == pytest.approx(norms, rel=1e-2) and scaled.progress.skipped_steps == 0

    saved = dict(save_strategy="steps", save_steps=4)
    overflowed = train("overflow", 2.0**40, max_steps=4, nonfinite_loss_patience=1, **saved)
    finite = [math.isfinite(h["grad_norm"]) for h in rl_logs(overflowed)]
    skipped = overflowed.progress.skipped_steps
    assert not finite[0] and finite[-1] and skipped == finite.count(False)  # overflows first, then trains
    assert overflowed.accelerator.scaler.get_scale() == 2.0 ** (40 - 10 * skipped)
    # The callbacks' optimizer hooks around each step's optimizer step, the scaler's skipped ones too (the Trainer's)
    assert overflowed.optimizer_hooks == [(hook, step) for step in range(4) for hook in ("pre", "post")]
    resumed = train("overflow", 1.0, max_steps=5, resume_from_checkpoint=True)
    assert resumed.state.global_step == 5 and resumed.accelerator.scaler.get_scale() == 2.0 ** (40 - 10 * skipped)

    # A NaN loss is the model's, not the scale's: a non-finite step, counted; the scaler's step is closed all the same
    # (its next unscale would be refused) at the same scale, and the next step trains.
    poisoned = train("nan", 2.0**8, max_steps=3, poisoned={1})
    assert ["loss" in h for h in rl_logs(poisoned)] == [True, False, True]  # (the skipped step's: no reading)
    assert poisoned.progress.skipped_steps == 1 and math.isfinite(rl_logs(poisoned)[-1]["grad_norm"])
    assert poisoned.accelerator.scaler.get_scale() == 2.0**8
    # A step with nothing scored is skipped without an optimizer step (Adam's momentum would move the weights).
    unscored = train("unscored", 2.0**8, max_steps=2, unscored={1})
    before, after = unscored.weights_by_step[1], unscored.weights_by_step[2]
    assert unscored.progress.skipped_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, after))
