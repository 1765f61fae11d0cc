"""VAPOTrainer end to end on a tiny local model: training, outputs, value pretraining, learning, switches, resume."""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import types
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import (
    CapturingTrainer,
    LocalHub,
    comparable,
    digit_fraction,
    first_char_is_letter,
    make_args,
    prompts_dataset,
    put_in_hub_cache,
    refuse_model_loads,
    rl_logs,
    token_rewards_of,
)
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)

from trl_vapo import VAPOTrainer
from trl_vapo.checkpoint import checkpoint_problem, list_checkpoints, read_marker, write_marker
from trl_vapo.core import compute_gae, explained_variance_plateaued, length_adaptive_lambda
from trl_vapo.metric_names import RL
from trl_vapo.rollout import load_rollouts

# Metrics the issue requires at every logging step (RL phase).
REQUIRED_METRICS = [
    "reward",
    "reward_std",
    "rewards/digit_fraction/mean",
    "rewards/digit_fraction/std",
    "accuracy",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "loss/value",
    "value/explained_variance",
    "value/mean",
    "advantages/mean",
    "lambda_actor/mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/low_min",  # GRPOTrainer's
    "clip_ratio/high_max",  # GRPOTrainer's
    "approx_kl",
    "entropy",
    "loss/nll",
    "positive_fraction",
    "frac_reward_zero_std",  # GRPOTrainer's
    "num_tokens",  # GRPOTrainer's
    "step_time",  # GRPOTrainer's: seconds a step took, its rollout's sampling and scoring in a rollout's first
    "grad_norm",  # the Trainer's
    "completions/mean_terminated_length",  # GRPOTrainer's
    "learning_rate",
    "critic_learning_rate",
    "phase",
]


def stop_on_common_characters(tiny_model_dir) -> dict:
    """Generation kwargs that also stop on a few characters, so a random tiny model's completions vary in length."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    stops = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(list("aeiou"))
    return {"eos_token_id": stops}


# ---------------------------------------------------------------------------------------------------------------------
# End to end: full fine-tuning and LoRA, outputs reload with from_pretrained
# ---------------------------------------------------------------------------------------------------------------------


def test_two_rl_steps_full_finetune_and_outputs_reload(tiny_model_dir, tmp_path):
    args = make_args(tmp_path)
    trainer = CapturingTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
    )
    initial = {n: p.detach().clone() for n, p in trainer.actor_critic.policy.named_parameters()}
    result = trainer.train()
    assert result.global_step == 2
    # GRPOTrainer's speed metrics: its samples are each step's batch (16 completions here), two steps of them.
    runtime = result.metrics["train_runtime"]
    assert result.metrics["train_samples_per_second"] == pytest.approx(2 * 16 / runtime, rel=0.01)
    logs = rl_logs(trainer)
    assert len(logs) == 2
    for key in REQUIRED_METRICS:
        assert key in logs[0], key
    assert all(math.isfinite(h["loss/value"]) for h in logs)
    assert all(0 < h["step_time"] < 60 for h in logs)
    # The last rollout's groups (4 completions a prompt) whose rewards are all alike, as GRPOTrainer counts them.
    groups = trainer._last_rollout.scores.reward.view(-1, 4)
    assert logs[-1]["frac_reward_zero_std"] == (groups.std(dim=1) == 0).float().mean().item()
    # The prompt and completion tokens of both rollouts, as GRPOTrainer counts them; the sides' norms together.
    seen = sum(rollout.attention_mask.sum().item() for _, rollout in trainer.rollouts)
    assert len(trainer.rollouts) == 2 and logs[-1]["num_tokens"] == trainer.state.num_input_tokens_seen == seen
    for log in logs:
        assert log["grad_norm"] == pytest.approx(math.hypot(log["grad_norm/policy"], log["grad_norm/critic"]))
    changed = any(not torch.equal(initial[n], p) for n, p in trainer.actor_critic.policy.named_parameters())
    assert changed, "two RL steps must update the policy"

    out = tmp_path / "final"
    trainer.save_model(str(out))
    policy = AutoModelForCausalLM.from_pretrained(out)
    for name, param in trainer.actor_critic.policy.named_parameters():
        assert torch.equal(policy.get_parameter(name), param.detach()), name
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic")
    assert critic.config.num_labels == 1
    saved = critic.state_dict()
    for name, value in trainer.actor_critic.critic.state_dict().items():
        assert torch.equal(saved[name], value), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    generated = policy.generate(**tokenizer(["1+1="], return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert generated.shape[1] >= 5
    assert (out / "README.md").is_file()
    # A second train() went on from the first run's position and schedules (value pretraining skipped, a decayed rate
    # held at 0): refused, saying how to go on.
    with pytest.raises(RuntimeError, match=r"already ran on this trainer \(to step 2\).*resume_from_checkpoint=True"):
        trainer.train()


def test_a_second_train_under_deepspeed_or_fsdp_is_refused_naming_the_way_to_resume(tiny_model_dir, tmp_path):
    """A call an error stopped left the models placed: DeepSpeed's engine and FSDP2's sharded weights cannot be
    prepared again (DeepSpeed's engine around its own, a checkpoint loaded into sharded weights). The placement is a
    stand-in (no second process here: the flags DeepSpeed and FSDP set); a second call on one process resumes."""
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, max_steps=1), prompts_dataset())
    trainer.models_placed, trainer.is_fsdp_enabled = True, True
    with pytest.raises(
        RuntimeError, match=r"cannot be placed again\. Resume with a new VAPOTrainer, in a new process"
    ):
        trainer.train(resume_from_checkpoint=True)


def test_max_steps_set_on_the_trainers_args_before_train_is_the_runs(tiny_model_dir, tmp_path):
    """transformers' `train()` reads `max_steps` when it starts: set on `trainer.args` after the trainer was built, it
    ran the count the trainer was built with (3 steps for 1). What the trainer's batches were built from is refused
    if changed since, naming what to do."""
    args = make_args(tmp_path, max_steps=3, max_completion_length=2)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    trainer.args.max_steps = 1
    assert trainer.train().global_step == 1 == trainer.state.max_steps
    # Extended by a resume on the same trainer: the schedules are this call's (the first call's ended at step 1, and
    # its linear decay held the policy's rate at 0 for the steps added), as a new trainer's resume has them.
    linear = dict(
        max_steps=1, lr_scheduler_type="linear", save_strategy="steps", save_steps=1, max_completion_length=2
    )
    extended = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path / "c", **linear), prompts_dataset())
    extended.train()
    extended.args.max_steps = 3
    extended.train(resume_from_checkpoint=True)
    fresh = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, make_args(tmp_path / "c", **{**linear, "max_steps": 3}), prompts_dataset()
    )
    fresh.train(resume_from_checkpoint=str(tmp_path / "c" / "out" / "checkpoint-1"))
    rates = [[h["learning_rate"] for h in rl_logs(t) if h["step"] > 1] for t in (extended, fresh)]
    assert rates[0] == rates[1] and rates[0][0] > 0
    other = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path / "b", max_steps=1), prompts_dataset())
    other.args.generation_batch_size *= 2
    with pytest.raises(ValueError, match=r"batches changed after it was built \(prompts_per_rollout of its plan.*new"):
        other.train()
    other.args.generation_batch_size //= 2
    other.train_dataset = prompts_dataset(4)  # the plan counted its prompts, the run read the first set's
    with pytest.raises(ValueError, match=r"^trainer.train_dataset was replaced after the trainer was built: build"):
        other.train()


def test_a_resume_counts_the_epochs_of_its_own_plan(tiny_model_dir, tmp_path):
    """`state.num_train_epochs` (a notebook's progress reads it) was the saved run's after a resume that runs longer:
    transformers sets it, with `max_steps`, from this call's plan after loading the state."""
    settings = dict(save_strategy="steps", save_steps=1, max_completion_length=2)
    first = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, make_args(tmp_path, max_steps=1, **settings), prompts_dataset(8)
    )
    first.train()
    assert first.state.num_train_epochs == 1  # 8 prompts, 4 a rollout: one step of two in the epoch
    longer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, make_args(tmp_path, max_steps=3, **settings), prompts_dataset(8)
    )
    longer.train(resume_from_checkpoint=True)
    assert longer.state.num_train_epochs == 2 == longer.run_plan.epochs(longer.progress)


def test_an_8bit_bitsandbytes_optimizer_keeps_the_embeddings_state_in_32_bits(tiny_model_dir, tmp_path):
    """transformers' `create_optimizer` registers 32-bit Adam state for every embedding under bitsandbytes' 8-bit
    optimizers (GRPOTrainer's too); VAPO's, which builds per-side groups, did not: a full fine-tune's embeddings (the
    policy's and the critic's) kept 8-bit state."""
    import bitsandbytes
    from torch import nn

    args = make_args(tmp_path, optim="adamw_8bit")
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args=args, train_dataset=prompts_dataset())
    trainer.create_optimizer()
    overrides = bitsandbytes.optim.GlobalOptimManager.get_instance().module_weight_config_triple
    embeddings = [m for m in trainer.actor_critic.modules() if isinstance(m, nn.Embedding)]
    assert len(embeddings) == 2  # the policy's and the separate critic's
    for embedding in embeddings:
        assert any(m is embedding and (name, bits) == ("weight", {"optim_bits": 32}) for m, name, bits in overrides)


def test_an_optimizer_whose_rate_has_no_default_is_built_with_each_sides_rate(tiny_model_dir, tmp_path, monkeypatch):
    """transformers' `optim="stable_adamw"` (torch-optimi, not installed here: a stand-in with its signature, `lr`
    without a default) failed as `train()` built it: the default rate was taken out of its arguments. Each side's
    group sets its own rate over it."""

    class NoDefaultRate(torch.optim.AdamW):
        def __init__(self, params, lr, **kwargs):
            super().__init__(params, lr=lr, **kwargs)

    args = make_args(tmp_path, learning_rate=1e-3, critic_learning_rate=3e-3)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args=args, train_dataset=prompts_dataset())
    built = trainer.get_optimizer_cls_and_kwargs(args, trainer.actor_critic)[1]
    monkeypatch.setattr(trainer, "get_optimizer_cls_and_kwargs", lambda *a: (NoDefaultRate, dict(built)))
    optimizer = trainer.create_optimizer()
    assert {group["name"]: group["lr"] for group in optimizer.param_groups} == {"policy": 1e-3, "critic": 3e-3}


def test_data_seed_zero_orders_the_prompts(tiny_model_dir, tmp_path):
    """`data_seed=0` is a seed (`data_seed or seed` took the run's seed instead): the prompts' order is data_seed's."""
    orders = []
    for seed, data_seed in ((1, 0), (0, None), (1, None)):
        args = make_args(tmp_path, seed=seed, data_seed=data_seed)
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
        orders.append([row["prompt"] for row in trainer._prompts.next(trainer.progress, lambda: None)])
    assert orders[0] == orders[1] != orders[2]


def test_unscored_completions_are_no_reading(tiny_model_dir, tmp_path):
    """A step with no scored completion trains nothing: its token means are not logged as zeros (a falling entropy).
    A group's unscored completions are left out of `frac_reward_zero_std`, as GRPOTrainer leaves them (NaN): they
    counted as rewards of 0."""

    def sometimes_unscored(completions, trainer_state=None, **kwargs):
        if trainer_state is not None and trainer_state.global_step == 0:  # the first rollout
            return [None] * len(completions)
        return [None if i % 4 == 0 else float(i % 8 < 4) for i in range(len(completions))]

    args, prompts = make_args(tmp_path, beta=0.04), prompts_dataset()
    trainer = CapturingTrainer(str(tiny_model_dir), sometimes_unscored, args, prompts)
    trainer.train()
    first, second = rl_logs(trainer)
    assert first["rewards/unscored_fraction"] == 1.0 and "entropy" not in first and "loss/policy" not in first
    assert math.isnan(first["kl"])  # no token trained: no reading (it read 0.0, and pulled a window's mean down)
    assert math.isfinite(second["entropy"]) and math.isfinite(second["kl"])
    scores = trainer.rollouts[-1][1].scores
    assert not scores.scored.all() and scores.reward[~scores.scored].eq(0).all()  # an unscored reward reads 0
    assert second["frac_reward_zero_std"] == 1.0  # each group 1, 1, 1 or 0, 0, 0 beside an unscored one


def test_two_rl_steps_lora_shares_one_base_and_reloads(tiny_model_dir, tmp_path):
    from peft import LoraConfig, PeftModel

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = make_args(tmp_path)
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=peft_config,
    )
    model = trainer.actor_critic
    assert model.shares_base and model.critic is None
    assert set(model.policy.peft_config) == {"default", "critic"}
    # One copy of the base weights: only adapters and the value head train.
    base_params = sum(p.numel() for n, p in model.policy.named_parameters() if "lora_" not in n)
    trainable = {id(p) for p in model.policy_parameters() + model.critic_parameters()}
    assert all(not p.requires_grad for n, p in model.policy.named_parameters() if "lora_" not in n)
    assert base_params > 0 and trainable
    before_policy = {n: p.detach().clone() for n, p in model.policy.named_parameters() if ".default." in n}
    before_critic = {n: p.detach().clone() for n, p in model.policy.named_parameters() if ".critic." in n}
    trainer.train(resume_from_checkpoint=False)  # a script's boolean flag, as transformers reads it: a fresh run
    assert any(not torch.equal(before_policy[n], p) for n, p in model.policy.named_parameters() if ".default." in n)
    assert any(not torch.equal(before_critic[n], p) for n, p in model.policy.named_parameters() if ".critic." in n)

    out = tmp_path / "final"
    trainer.save_model(str(out))
    assert (out / "adapter_config.json").is_file() and (out / "critic" / "value_head.safetensors").is_file()
    assert "More Information Needed" not in (out / "README.md").read_text()  # the run's card, not peft's template
    assert not (out / "critic" / "README.md").exists()  # nor peft's template beside the critic adapter
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = trainer.actor_critic.policy(input_ids=ids).logits
        assert torch.allclose(reloaded(input_ids=ids).logits, expected, atol=1e-5)

    # The saved critic is a value_model the trainer takes back.
    again = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=make_args(tmp_path / "again"),
        train_dataset=prompts_dataset(),
        peft_config=peft_config,
        value_model=str(out / "critic"),
    )
    for name, param in again.actor_critic.value_head.state_dict().items():
        assert torch.equal(param, trainer.actor_critic.value_head.state_dict()[name])

    # A new run from the saved folder (what "train() already ran" advises) goes on from the trained adapters: the
    # folder is an adapter, which transformers loaded frozen into its base and a peft_config then re-initialised.
    trained = dict(model.policy.named_parameters())
    continued = VAPOTrainer(
        model=str(out),
        reward_funcs=digit_fraction,
        args=make_args(tmp_path / "continued", value_pretrain_steps=0),
        train_dataset=prompts_dataset(),
        value_model=str(out / "critic"),
    )
    policy = continued.actor_critic.policy
    adapters = {n: p for n, p in policy.named_parameters() if ".default." in n or ".critic." in n}
    assert len(adapters) == len(before_policy) + len(before_critic)
    assert all(torch.equal(p, trained[n]) and p.requires_grad for n, p in adapters.items())
    continued.train()
    assert any(not torch.equal(trained[n], p) for n, p in policy.named_parameters() if ".default." in n)
    with pytest.raises(ValueError, match=r"saved adapter's folder.*leave peft_config out"):
        VAPOTrainer(str(out), digit_fraction, make_args(tmp_path / "x"), prompts_dataset(), peft_config=peft_config)


def test_a_saved_adapter_names_its_base_by_absolute_path_and_revision(tiny_model_dir, tmp_path, monkeypatch):
    """A run from `./models/base` wrote that relative path as the adapter's base (it loaded from that working
    directory alone), and no revision though the base was loaded at one (loading took the default branch's)."""
    from peft import LoraConfig

    monkeypatch.chdir(tiny_model_dir.parent)
    args = make_args(tmp_path, model_init_kwargs={"revision": "main"})
    trainer = VAPOTrainer(tiny_model_dir.name, digit_fraction, args, prompts_dataset(), peft_config=LoraConfig(r=2))
    trainer.save_model(str(tmp_path / "saved"))
    adapter = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_model_dir.resolve()) and adapter["revision"] == "main"


LAYOUTS = [
    "lora-on-embeddings",
    "lora-saving-the-head",
    "lora-on-the-head",
    "frozen-peft-model-and-a-critic",
    "reward-model-as-critic",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_trainable_weight_is_trained_by_exactly_one_side(tiny_model_dir, tmp_path, layout):
    """The optimizer's two groups cover every weight that requires a gradient, and each side has some: a weight left
    out is silently never trained."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from trl_vapo.tiny import save_tiny_reward_model

    kwargs, reward_funcs = {}, digit_fraction
    if layout == "lora-on-embeddings":  # peft keeps an embedding's LoRA in ParameterDicts (`lora_embedding_A.default`)
        kwargs = {"peft_config": LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"])}
        model = str(tiny_model_dir)
    elif layout == "lora-saving-the-head":  # `modules_to_save`: a trainable copy of the LM head, the policy's alone
        kwargs = {"peft_config": LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])}
        model = str(tiny_model_dir)
    elif layout == "lora-on-the-head":  # the head's LoRA the policy's alone too
        kwargs = {"peft_config": LoraConfig(r=4, target_modules=["q_proj", "lm_head"])}
        model = str(tiny_model_dir)
    else:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        critic = AutoModelForSequenceClassification.from_pretrained(save_tiny_reward_model(tmp_path / "rm"))
        if layout == "frozen-peft-model-and-a-critic":  # an SFT adapter as `PeftModel.from_pretrained` loads it
            get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "sft")
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "sft")
            assert not any(p.requires_grad for p in model.parameters())
        else:  # the paper's recipe, one object for both: the reward model is frozen in place
            model, reward_funcs = base, [digit_fraction, critic]
        kwargs = {"value_model": critic}
    trainer = VAPOTrainer(
        model=model, reward_funcs=reward_funcs, args=make_args(tmp_path), train_dataset=prompts_dataset(), **kwargs
    )
    actor_critic = trainer.actor_critic
    policy, critic = actor_critic.policy_parameters(), actor_critic.critic_parameters()
    trainable = {id(p) for p in actor_critic.parameters() if p.requires_grad}
    assert policy and critic and {id(p) for p in policy}.isdisjoint(id(p) for p in critic)
    assert trainable == {id(p) for p in policy + critic}
    groups = trainer.create_optimizer().param_groups  # what steps: the groups, not the sides' lists they came from
    for side, params in (("policy", policy), ("critic", critic)):
        assert sorted(id(p) for g in groups if g["name"] == side for p in g["params"]) == sorted(map(id, params))
    names = {id(p): n for n, p in actor_critic.named_parameters()}
    if layout == "lora-on-the-head":
        adapted = {n for n in names.values() if "lm_head.lora_" in n}
        assert adapted and all(n.endswith(".default.weight") for n in adapted), adapted
        assert any("q_proj.lora_A.critic" in n for n in names.values())
    if layout in ("lora-on-embeddings", "lora-saving-the-head"):  # in a group, and stepped
        marks = ["lora_embedding_A.default", "lora_embedding_B.default", "lora_embedding_B.critic"]
        if layout == "lora-saving-the-head":  # the critic never reads the LM head: a copy of its own would never train
            marks = ["lm_head.modules_to_save.default"]
            assert not any("modules_to_save.critic" in name for name in names.values())
        watched = {names[id(p)]: p for p in policy + critic if any(mark in names[id(p)] for mark in marks)}
        assert {mark for mark in marks if any(mark in name for name in watched)} == set(marks)
        before = {name: p.detach().clone() for name, p in watched.items()}
        trainer.train()
        for mark in marks:
            assert any(not torch.equal(before[n], p) for n, p in watched.items() if mark in n), mark
    if layout == "reward-model-as-critic":  # the reward model scores as it was given
        assert trainer.reward_funcs[1].model is not actor_critic.critic
        trainer.create_model_card(
            output_dir=tmp_path / "card", tags="math"
        )  # one tag as a string, as transformers takes it
        card = (tmp_path / "card" / "README.md").read_text()
        assert f"started from `{tmp_path / 'rm'}` (`value_model`)" in card and "the policy's weights" not in card
        assert "- math\n" in card and "- m\n" not in card  # (it was one tag a letter)
        trainer.create_model_card("my-vapo-model", "my-data")  # TRL's order: the model's name first, not a folder
        card = (Path(trainer.args.output_dir) / "README.md").read_text()
        assert "my-vapo-model" in card and "my-data" in card and not Path("my-vapo-model").exists()


def test_layer_replication_replicates_the_layers_once(tiny_model_dir, tmp_path):
    """peft replicates the layer stack (`layer_replication`) as it adds each adapter, from the stack the first one
    left: the critic's adapter, then the KL reference's, replicated it again, and layers fell out of the policy."""
    from peft import LoraConfig

    config = LoraConfig(r=4, target_modules=["q_proj"], layer_replication=[[0, 1], [0, 2]])  # layers 0, 0, 1
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, make_args(tmp_path, beta=0.1), prompts_dataset(), peft_config=config
    )
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).model.layers
    layers = trainer.actor_critic.policy.base_model.model.model.layers
    weights = [layer.self_attn.q_proj.base_layer.weight for layer in layers]
    assert len(layers) == 3 and weights[0] is weights[1]  # (a second pass: layers 0, 0, 0, the last one dropped)
    assert torch.equal(weights[2], original[1].self_attn.q_proj.weight)
    assert {"default", "critic"} <= set(trainer.actor_critic.policy.peft_config)


def test_a_peft_model_with_a_peft_config_is_refused_and_the_critic_attends_as_the_policy(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    from trl_vapo.tiny import save_tiny_reward_model

    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4))
    with pytest.raises(
        ValueError, match=r"PeftModel \(or a saved adapter.s folder, which loads as one\) and peft_config"
    ):
        VAPOTrainer(wrapped, digit_fraction, make_args(tmp_path), prompts_dataset(), peft_config=LoraConfig(r=8))
    critic = AutoModelForSequenceClassification.from_pretrained(save_tiny_reward_model(tmp_path / "rm"))
    critic.is_loaded_in_4bit = True  # what transformers sets on a bitsandbytes model (which needs a GPU here)
    with pytest.raises(ValueError, match="quantized, and a critic trains all of its weights"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path), prompts_dataset(), value_model=critic)
    # A prompt-learning adapter: the shared-base critic's copy of it never applied (its forward is the base's).
    from peft import PromptTuningConfig

    prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    with pytest.raises(
        ValueError, match=r"adapter is a prompt-learning one \(PromptTuningConfig\): the critic would be a second"
    ):
        VAPOTrainer(
            str(tiny_model_dir), digit_fraction, make_args(tmp_path), prompts_dataset(), peft_config=prompt_tuning
        )
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    eager.config.pad_token_id = eager.generation_config.pad_token_id = None  # as Qwen2.5's config has none
    trainer = VAPOTrainer(eager, digit_fraction, make_args(tmp_path), prompts_dataset())
    assert trainer.actor_critic.critic.config._attn_implementation == "eager"  # to_dict drops it: sdpa before
    # The tokenizer's pad id mirrored onto the policy, as GRPOTrainer does: the saved model pads with it.
    assert eager.config.pad_token_id == eager.generation_config.pad_token_id == trainer.processing_class.pad_token_id


def test_a_prompt_learning_policy_with_a_critic_of_its_own_trains(tiny_model_dir, tmp_path):
    """peft's `set_requires_grad` raises a TypeError for prompt-learning adapters: a prompt-tuned PeftModel given as
    the policy, and a prompt-tuning peft_config with a KL reference (its copy of the adapter, frozen), failed to
    build. Their prompt encoders are set trainable (or frozen) directly."""
    from peft import PromptTuningConfig, get_peft_model

    from trl_vapo.tiny import save_tiny_reward_model

    critic = save_tiny_reward_model(tmp_path / "rm")
    prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    args = make_args(tmp_path, beta=0.1, max_steps=1, learning_rate=1e-2)
    trainer = VAPOTrainer(
        str(tiny_model_dir),
        digit_fraction,
        args,
        prompts_dataset(),
        value_model=str(critic),
        peft_config=prompt_tuning,
    )
    policy = trainer.actor_critic.policy
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n or n.endswith(".default") for n in trainable), trainable
    prompts = {n: p.detach().clone() for n, p in policy.named_parameters() if "prompt_encoder" in n}
    trainer.train()
    moved = [n for n, p in policy.named_parameters() if n in prompts and not torch.equal(p, prompts[n])]
    assert moved and all("default" in n for n in moved), moved  # the policy's prompt trained, the reference's not
    given = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), prompt_tuning)
    given.eval()  # frozen, as `PeftModel.from_pretrained` loads one
    for param in given.parameters():
        param.requires_grad_(False)
    trainer = VAPOTrainer(
        given, digit_fraction, make_args(tmp_path / "given"), prompts_dataset(), value_model=str(critic)
    )
    assert any(p.requires_grad for p in trainer.actor_critic.policy.parameters())


def test_a_policy_that_device_map_spread_or_offloaded_is_refused_by_name(tiny_model_dir, tmp_path):
    """A device_map over several devices (or offloading some weights to the CPU or the disk): the trainer moves the
    model whole and copies its critic from it; it failed at the first step ("Tensor.item() cannot be called on meta
    tensors" here, devices that disagree on several GPUs). As an id with model_init_kwargs, and as a loaded model."""
    placement = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.rotary_emb": "cpu"}
    placement |= {"model.norm": "disk", "lm_head": "disk"}
    offloaded = {"device_map": placement, "offload_folder": str(tmp_path / "offload")}
    refused = "device_map that places it on cpu, disk: VAPOTrainer trains the whole model on each process's device"
    with pytest.raises(ValueError, match=refused):
        VAPOTrainer(
            str(tiny_model_dir), digit_fraction, make_args(tmp_path, model_init_kwargs=offloaded), prompts_dataset()
        )
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, **offloaded)
    with pytest.raises(ValueError, match=refused):
        VAPOTrainer(loaded, digit_fraction, make_args(tmp_path), prompts_dataset())
    # Launched on several processes (GPUs, or XPUs, NPUs, HPUs...), a device_map is the policy's no more: each
    # process loads its copy whole, as GRPOTrainer (`auto` was refused, or `{"": 0}` held every copy on device 0).
    from accelerate.utils import DistributedType

    from trl_vapo.loading import load_policy

    args = make_args(tmp_path, model_init_kwargs=offloaded)
    for launched in (DistributedType.MULTI_GPU, DistributedType.MULTI_XPU, DistributedType.MULTI_NPU):
        state = types.SimpleNamespace(distributed_type=launched)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(args, "distributed_state", state, raising=False)
            policy, _ = load_policy(str(tiny_model_dir), args, args.model_init_kwargs)
        assert {p.device.type for p in policy.parameters()} == {"cpu"}, launched
    # A critic given so (a reward model as loaded): it trained as spread, or failed on its meta tensors.
    placement = {**placement, "score": placement.pop("lm_head")}
    critic = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir, num_labels=1, device_map=placement, offload_folder=str(tmp_path / "offload-critic")
    )
    with pytest.raises(ValueError, match="The value_model was loaded with a " + refused):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path), prompts_dataset(), value_model=critic)
    # One device, named layer by layer: it trains.
    placed = {name: "cpu" for name in placement}
    args = make_args(tmp_path, max_steps=1, model_init_kwargs={"device_map": placed})
    VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset()).train()


def test_the_critics_adapter_starts_as_a_copy_of_an_adapter_given_trained(tiny_model_dir, tmp_path):
    """A PeftModel given with its trained adapter (an SFT run's) is the policy: the critic's adapter starts as its
    copy, as a full fine-tuning's critic copies the policy's weights (it started from the base's features alone). A
    new adapter's (peft_config) starts as peft initialises one: its own random A, B zero."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    torch.manual_seed(0)
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B.default" in name:
                param.normal_()
    adapters = {"given": VAPOTrainer(trained, digit_fraction, make_args(tmp_path), prompts_dataset())}
    fresh = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, make_args(tmp_path), prompts_dataset(), peft_config=config
    )
    adapters["new"] = fresh
    for kind, trainer in adapters.items():
        params = dict(trainer.actor_critic.policy.named_parameters())
        pairs = [(p, params[n.replace(".default.", ".critic.")]) for n, p in params.items() if ".default." in n]
        assert len(pairs) == 8, kind  # A and B of two modules in two layers
        same = [torch.equal(policy, critic) for policy, critic in pairs]
        assert all(same) if kind == "given" else not any(same[::2]), kind  # A: the even ones (named first)


def test_without_args_the_output_dir_is_named_for_the_model_given_as_a_path(tiny_model_dir, tmp_path, monkeypatch):
    """`args=None`, as TRL's trainers take it: a `Path` (an AttributeError: it was read as a loaded model)."""
    monkeypatch.chdir(tmp_path)
    trainer = VAPOTrainer(tiny_model_dir, digit_fraction, train_dataset=prompts_dataset())
    assert trainer.args.output_dir == f"{tiny_model_dir.name}-VAPO"


def test_the_policys_tokenizer_is_looked_up_where_the_policy_was(tiny_model_dir, tmp_path):
    """Without processing_class: a model in a subfolder (`model_init_kwargs` subfolder) finds its tokenizer there
    (looked up at the folder's root, it failed), and an adapter saved alone (peft's `save_pretrained`, no
    tokenizer) its base's (an OSError), as `trl-vapo train` finds it."""
    from peft import LoraConfig, get_peft_model

    shutil.copytree(tiny_model_dir, tmp_path / "repo" / "sub")
    args = make_args(tmp_path, max_steps=1, model_init_kwargs={"subfolder": "sub"})
    VAPOTrainer(str(tmp_path / "repo"), digit_fraction, args, prompts_dataset()).train()
    # The subfolder is the policy's: a critic from elsewhere is not looked up in `<value_model>/sub` (an OSError).
    VAPOTrainer(str(tmp_path / "repo"), digit_fraction, args, prompts_dataset(), value_model=str(tiny_model_dir))
    # A critic from the policy's own checkpoint is read where the policy was (at its root, it was "not a value model"),
    # and its tokenizer not compared with the policy's: it is the policy's (the root's, another one, was refused).
    import string

    from trl_vapo.tiny import build_char_tokenizer

    build_char_tokenizer(string.printable[::-1]).save_pretrained(tmp_path / "repo")
    same = VAPOTrainer(
        str(tmp_path / "repo"), digit_fraction, args, prompts_dataset(), value_model=str(tmp_path / "repo")
    )
    backbone = AutoModelForCausalLM.from_pretrained(tiny_model_dir).base_model.state_dict()
    assert all(
        torch.equal(value, backbone[name]) for name, value in same.actor_critic.critic.base_model.state_dict().items()
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")).save_pretrained(
        tmp_path / "adapter"
    )
    assert not (tmp_path / "adapter" / "tokenizer_config.json").exists()
    trainer = VAPOTrainer(
        str(tmp_path / "adapter"), digit_fraction, make_args(tmp_path, max_steps=1), prompts_dataset()
    )
    assert trainer.processing_class.name_or_path == str(tiny_model_dir)
    trainer.train()


@pytest.mark.parametrize("lora", [True, False], ids=["shared-base-lora", "critic-copy"])
def test_one_pass_per_side_trains_as_one_pass_for_both(tiny_model_dir, tmp_path, monkeypatch, lora):
    """On one process the update runs the policy's forward and backward, then the critic's, so that one side's
    activations are alive at a time (the LoRA step's peak memory, issue 43): the two losses depend on disjoint
    weights, so the weights after training are those of one pass over both."""
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def trained(name, passes_seen):
        trainer = VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            # (lam_critic < 1: the critic trains in the update, not in the scoring pass)
            args=make_args(
                tmp_path / name,
                max_steps=3,
                gradient_accumulation_steps=2,
                per_device_train_batch_size=8,
                lam_critic=0.95,
            ),  # fmt: skip
            train_dataset=prompts_dataset(),
            peft_config=peft_config if lora else None,
        )
        plan = trainer._update_passes
        trainer._update_passes = lambda *a: passes_seen.append(plan(*a)) or passes_seen[-1]
        trainer.train()
        return {n: p.detach().clone() for n, p in trainer.actor_critic.named_parameters() if p.requires_grad}

    split_passes, one_passes = [], []
    split = trained("split", split_passes)
    monkeypatch.setattr(VAPOTrainer, "_update_passes", lambda self, policy, values: [(policy, values)])
    one = trained("one", one_passes)
    assert split_passes and all(p == [(True, False), (False, True)] for p in split_passes)
    assert one_passes and all(p == [(True, True)] for p in one_passes)
    assert split.keys() == one.keys() and len(split) > 2
    for name, value in split.items():
        torch.testing.assert_close(value, one[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("lora", [True, False], ids=["shared-base-lora", "critic-copy"])
def test_the_critic_trains_in_the_scoring_pass_with_one_forward_a_rollout_as_it_trains_in_the_update(
    tiny_model_dir, tmp_path, monkeypatch, lora
):
    """With one optimizer step per rollout, one pass over it and lam_critic=1 (the defaults), the critic's forward of
    the scoring pass (GAE's values) and that of the update compute the same values on the same weights, and its
    targets (Monte-Carlo returns) do not read them: its forward and backward run once a rollout, in the scoring pass
    (`_critic_trains_while_scoring`). The weights after training and the logged losses are those of the critic
    trained in the update; the critic's forwards are half as many."""
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def trained(name):
        trainer = VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=make_args(tmp_path / name, max_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=8),
            train_dataset=prompts_dataset(),
            peft_config=peft_config if lora else None,
        )
        forward, critic_forwards = trainer.actor_critic.forward, []

        def counted(*args, **kwargs):
            critic_forwards.append(torch.is_grad_enabled()) if kwargs.get("with_values", True) else None
            return forward(*args, **kwargs)

        trainer.actor_critic.forward = counted
        trainer.train()
        weights = {n: p.detach().clone() for n, p in trainer.actor_critic.named_parameters() if p.requires_grad}
        losses = [h[key] for h in rl_logs(trainer) for key in ("loss", "loss/value", "loss/policy")]
        return weights, losses, critic_forwards

    scoring, scoring_losses, scoring_forwards = trained("scoring")
    monkeypatch.setattr(VAPOTrainer, "_critic_trains_while_scoring", lambda self, phase: False)
    update, update_losses, update_forwards = trained("update")
    micro_batches = 3 * 2  # 3 rollouts of 16 completions, micro-batches of 8
    assert scoring_forwards == [True] * micro_batches  # once, with its gradient
    assert update_forwards == [False, False, True, True] * 3  # without (the scoring pass's), then with
    assert scoring.keys() == update.keys() and len(scoring) > 2
    for name, value in scoring.items():
        torch.testing.assert_close(value, update[name], rtol=1e-5, atol=1e-6, msg=name)
    assert len(scoring_losses) == 3 * 3 and scoring_losses == pytest.approx(update_losses, rel=1e-5, abs=1e-7)


def test_the_critic_trains_in_the_update_where_a_forward_there_would_differ_from_the_scoring_passs(
    tiny_model_dir, tmp_path
):
    """`_critic_trains_while_scoring` holds for the defaults, and not where the update's critic forward would compute
    other values than the scoring pass's (nor under DeepSpeed and FSDP, whose backward reduces as it runs:
    `_gradients_wait_for_the_step`; under DDP it holds, `test_reliability`)."""
    args = make_args(tmp_path / "default", per_device_train_batch_size=8)
    assert VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())._critic_trains_while_scoring(RL)
    for setting in (
        {"lam_critic": 0.95},  # targets that read the values
        {"critic_num_iterations": 2},  # a second pass, on updated weights
        {"steps_per_generation": 2},  # a second step, on updated weights
        {"disable_dropout": False},  # another dropout mask in each forward
    ):
        args = make_args(tmp_path / "other", per_device_train_batch_size=8, **setting)
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
        assert not trainer._critic_trains_while_scoring(RL), setting


def test_a_train_call_after_an_error_before_the_first_step_starts_as_a_new_trainer(tiny_model_dir, tmp_path):
    """`train()` again on a trainer whose first call an error stopped before its first step (a callback's, a reward
    function's on the first rollout): the stopped call had read its rollout's prompts, and the second started after
    them. It reads from the first prompt, as a new trainer would: the same weights and logs as a run never stopped."""

    class FailsOnce(TrainerCallback):
        failed = False

        def on_rollout(self, args, state, control, rollout=None, rows=None, **kwargs):
            if not self.failed:
                self.failed = True
                raise RuntimeError("a callback's error")

    def trained(trainer):
        weights = {n: p.detach().clone() for n, p in trainer.actor_critic.named_parameters() if p.requires_grad}
        return weights, [{k: v for k, v in log.items() if "time" not in k} for log in rl_logs(trainer)]

    plain_args, args = (make_args(tmp_path / name, max_steps=2) for name in ("plain", "again"))
    plain = VAPOTrainer(str(tiny_model_dir), digit_fraction, plain_args, prompts_dataset())
    plain.train()
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), callbacks=[FailsOnce()])
    with pytest.raises(RuntimeError, match="a callback's error"):
        trainer.train()
    trainer.train()
    (weights, logs), (expected_weights, expected_logs) = trained(trainer), trained(plain)
    assert logs == expected_logs
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name], value, msg=name)


def test_a_train_call_stopped_by_an_error_leaves_nothing_to_the_resumed_call(tiny_model_dir, tmp_path):
    """`train(resume_from_checkpoint=...)` on the trainer whose `train()` an error stopped (as the error after a stop
    advises) took over what that call left: the critic's gradients (its backward runs in a rollout's scoring pass,
    before the optimizer step: an error between the two, a callback's `on_rollout`, the device out of memory in the
    policy's update) were added to its first step, and the stopped rollout's readings, recorded before the error,
    were averaged into the resumed steps' logs. Resumed from an earlier checkpoint, the run ends with the
    uninterrupted run's weights and logs its steps as it."""

    class FailsOnce(TrainerCallback):
        failed = False

        def on_rollout(self, args, state, control, rollout=None, rows=None, **kwargs):
            if state.global_step == 2 and not self.failed:
                self.failed = True
                raise RuntimeError("a callback's error")

    def weights(trainer):
        return {n: p.detach().clone() for n, p in trainer.actor_critic.named_parameters() if p.requires_grad}

    def logs(trainer):  # (the times differ)
        return [{k: v for k, v in log.items() if "time" not in k} for log in rl_logs(trainer)]

    plain = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, make_args(tmp_path / "plain", max_steps=3), prompts_dataset()
    )
    plain.train()
    args = make_args(tmp_path / "stopped", max_steps=3, save_strategy="steps", save_steps=1)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), callbacks=[FailsOnce()])
    with pytest.raises(RuntimeError, match="a callback's error"):
        trainer.train()
    assert any(p.grad is not None for p in trainer.actor_critic.critic_parameters())  # the scoring pass's
    trainer.train(resume_from_checkpoint=str(tmp_path / "stopped" / "out" / "checkpoint-1"))
    assert trainer.state.global_step == 3
    resumed, expected = weights(trainer), weights(plain)
    for name, value in expected.items():
        torch.testing.assert_close(resumed[name], value, msg=name)
    assert len(logs(trainer)) == len(logs(plain)) == 3
    for log, expected_log in zip(logs(trainer), logs(plain)):
        assert log.keys() == expected_log.keys()
        for key, value in expected_log.items():
            assert log[key] == (
                value if isinstance(value, str) else pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True)
            ), key


# ---------------------------------------------------------------------------------------------------------------------
# Value pretraining
# ---------------------------------------------------------------------------------------------------------------------


class PolicySnapshot(TrainerCallback):
    """Records a checksum of the policy's weights at the end of every step (a real Trainer callback)."""

    def __init__(self, trainer_ref):
        self.trainer_ref = trainer_ref
        self.sums = []

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer_ref[0]
        self.sums.append(
            (
                trainer.progress.phase,
                sum(float(p.detach().double().sum()) for p in trainer.actor_critic.policy.parameters()),
            )
        )


def test_micro_batches_hold_rows_of_similar_lengths_in_the_steps_and_the_scoring_pass(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Each micro-batch is cut to its longest completion (`trim_padding`): split in a step's random order, nearly
    every one is as long as the longest of all (for lengths uniform in 100-1024, 8 micro-batches of 8: 1.65x the
    completions' tokens computed; 64 of 8: 1.80x); split in length order, 1.09x (1.10x). The step's loss sums the
    same tokens (normalised by the step's count), and the scoring pass writes each row's scores back by its index."""
    from trl_vapo import modeling
    from trl_vapo.rollout import Rollout

    steps, scored = [], []  # each micro-batch's completion lengths, in the order they ran
    micro_batch, trim = Rollout.micro_batch, modeling.trim_padding

    def recorded_micro_batch(self, rows, spans=None):
        steps.append(self.lengths[rows].tolist())
        assert spans is not None  # the step's one read of the widths, not one read a micro-batch
        return micro_batch(self, rows, spans)

    def recorded_trim(input_ids, attention_mask, prompt_length, rows, *args):
        scored.append(attention_mask[rows, prompt_length:].sum(dim=1).tolist())
        return trim(input_ids, attention_mask, prompt_length, rows, *args)

    monkeypatch.setattr(Rollout, "micro_batch", recorded_micro_batch)
    monkeypatch.setattr(
        modeling, "trim_padding", recorded_trim
    )  # the scoring pass's (the critic's, with its backward)
    args = make_args(
        tmp_path, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=4,
        generation_kwargs=stop_on_common_characters(tiny_model_dir),
    )  # fmt: skip
    sorted_run = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    sorted_run.train()
    assert len(steps) == 8 and len(scored) == 8  # per rollout: 4 micro-batches of 4 rows, in each pass
    for batches in (steps[:4], steps[4:], scored[:4], scored[4:]):
        lengths = [n for batch in batches for n in batch]
        assert lengths == sorted(lengths) and len(set(lengths)) > 1, lengths
    # The same run in the rows' own order: the same losses, values and weights (up to float sums' order).
    import trl_vapo.trainer

    for module in (modeling, trl_vapo.trainer):
        monkeypatch.setattr(module, "length_sorted", lambda rows, lengths: rows)
    same = ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "generation_kwargs")
    unsorted_args = make_args(tmp_path / "unsorted", **{name: getattr(args, name) for name in same})
    unsorted_run = VAPOTrainer(str(tiny_model_dir), digit_fraction, unsorted_args, prompts_dataset())
    unsorted_run.train()
    for ours, theirs in zip(rl_logs(sorted_run), rl_logs(unsorted_run), strict=True):
        for key in ("loss", "loss/value", "value/mean", "advantages/mean"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    for (name, ours), theirs in zip(
        sorted_run.actor_critic.named_parameters(), unsorted_run.actor_critic.parameters(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6, msg=name)


class NormRecordingTrainer(VAPOTrainer):
    """Keeps each step's gradient norms as `_clip_gradients` measured them."""

    def _clip_gradients(self, with_policy):
        norms = super()._clip_gradients(with_policy)
        self.step_norms = getattr(self, "step_norms", []) + [{key: float(norm) for key, norm in norms.items()}]
        return norms


def test_a_log_holds_its_last_steps_gradient_norms_as_the_trainer_logs_them(tiny_model_dir, tmp_path):
    """transformers.Trainer logs the gradient norm of the step a log ends, not a mean over the log's steps (one fp16
    overflow's inf would fill a window's mean): with logging_steps=2, the second step's, each side and both."""
    args = make_args(tmp_path, max_steps=4, logging_steps=2)
    trainer = NormRecordingTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    trainer.train()
    logs = [h for h in rl_logs(trainer) if "grad_norm" in h]
    assert [h["step"] for h in logs] == [2, 4] and len(trainer.step_norms) == 4
    assert trainer.step_norms[0] != trainer.step_norms[1]
    for log, norms in zip(logs, trainer.step_norms[1::2]):
        assert set(norms) == {"grad_norm/policy", "grad_norm/critic"}
        for key, norm in norms.items():
            assert log[key] == pytest.approx(norm, rel=1e-6), key
        assert log["grad_norm"] == pytest.approx(math.hypot(*norms.values()), rel=1e-6)


def test_the_saved_model_stops_where_training_stopped(tiny_model_dir, tmp_path):
    """The saved generation config named the model's EOS ids only: `generate()` or a pipeline on `output_dir` (the
    model card's quick start) ran past a stop token training's completions ended at (`generation_kwargs`' here; a
    tokenizer's end of turn that the base model's config lacks), where `trl-vapo eval` stopped. A model whose
    published generation config sets `temperature` and `top_p` without `do_sample` (which transformers saves back
    unchanged, with a warning) is saved too: the ids set made it "changed", validated strictly, and refused."""
    from transformers import AutoTokenizer, GenerationConfig

    model_dir = tmp_path / "published"
    shutil.copytree(tiny_model_dir, model_dir)
    published = json.loads((model_dir / "generation_config.json").read_text())
    published.pop("do_sample", None)
    (model_dir / "generation_config.json").write_text(json.dumps({**published, "temperature": 0.6, "top_p": 0.9}))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    newline = tokenizer("\n", add_special_tokens=False).input_ids[0]
    assert newline != tokenizer.eos_token_id
    args = make_args(tmp_path, max_steps=1, generation_kwargs={"stop_token_ids": [newline]})
    trainer = VAPOTrainer(str(model_dir), digit_fraction, args, prompts_dataset())
    trainer.save_model(str(tmp_path / "saved"))
    saved = GenerationConfig.from_pretrained(tmp_path / "saved")
    assert saved.eos_token_id == [tokenizer.eos_token_id, newline]
    assert (saved.temperature, saved.top_p, saved.pad_token_id) == (0.6, 0.9, tokenizer.pad_token_id)


def test_a_token_in_the_loading_settings_is_never_written_or_logged(tmp_path):
    """`model_init_kwargs={"token": ...}` (a gated base) was written verbatim into `vapo_config.json`, in every
    checkpoint and saved model and pushed with them, and into the trackers' run config; transformers hides only
    fields named `*_token`."""
    args = make_args(tmp_path, model_init_kwargs={"token": "hf_secret", "dtype": "float32"}, hub_token="hf_other")
    written = args.to_json_string() + json.dumps(args.to_sanitized_dict())
    assert "hf_secret" not in written and "hf_other" not in written
    assert args.to_dict()["model_init_kwargs"] == {"token": "<TOKEN>", "dtype": "float32"}
    assert args.model_init_kwargs["token"] == "hf_secret"  # what loading reads is untouched


def test_logging_strategy_no_logs_nothing_at_the_end_of_value_pretraining(tiny_model_dir, tmp_path):
    """transformers logs nothing under `logging_strategy="no"`; the end of value pretraining logged its readings
    anyway (an entry for every tracker, a row in `log_history`); and the RL steps' readings, held for the run,
    went into the summary row (`train()`'s metrics), averaged. The summary is transformers' own, `total_flos` too."""
    args = make_args(tmp_path, max_steps=1, value_pretrain_steps=1, logging_strategy="no", max_completion_length=2)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    result = trainer.train()
    assert len(trainer.state.log_history) == 1 and "train_runtime" in trainer.state.log_history[0]  # the summary
    expected = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos"}
    assert set(trainer.state.log_history[0]) == expected | {"epoch", "step"}
    assert set(result.metrics) == expected | {"epoch"} and not trainer._metrics


def test_the_steps_after_the_last_log_are_logged_at_the_runs_end(tiny_model_dir, tmp_path):
    """Logged every 2 steps, a run of 3: step 3's readings went into the summary row alone, which has no phase, so
    the curves, the model card and the command's summary (which read the phased logs) left them out. They are logged
    at step 3, and stay in the summary row, averaged as GRPOTrainer's (TRL's own tests read `log_history[-1]`'s
    `rewards/<name>/mean`: five of them failed while the row lacked them)."""
    args = make_args(tmp_path, max_steps=3, logging_steps=2, max_completion_length=2)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    trainer.train()
    assert [(h["step"], h["phase"]) for h in trainer.state.log_history if "phase" in h] == [(2, "rl"), (3, "rl")]
    summary, last = trainer.state.log_history[-1], trainer.state.log_history[-2]
    assert "train_runtime" in summary and "phase" not in summary
    assert summary["reward"] == last["reward"] and summary["rewards/digit_fraction/mean"] == last["reward"]


def test_a_users_optimizer_is_named_by_side_and_refused_where_it_leaves_a_side_out(tiny_model_dir, tmp_path):
    """An optimizer over the policy model's parameters (`optimizers=`, GRPOTrainer's way) left out the critic, which
    the trainer builds: it never stepped, and its gradients summed over every step, silently; refused before the
    first rollout, saying how to build one. One of the user's own groups per side, unnamed, followed the critic's
    schedule: the policy's warm-up ran during value pretraining and its logged rate was not 0 there; each is named
    for its side, as the trainer's own groups are."""
    from transformers import AutoModelForCausalLM

    args = make_args(tmp_path, max_steps=2, value_pretrain_steps=2, warmup_steps=2, lr_scheduler_type="linear")
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    given = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    trainer = VAPOTrainer(policy, digit_fraction, args, prompts_dataset(), optimizers=(given, None))
    with pytest.raises(ValueError, match=r"does not hold \d+ of the critic's \d+ trainable parameters: .*set"):
        trainer.train()
    assert trainer.state.num_input_tokens_seen == 0  # refused before a rollout was sampled
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    sides = trainer.actor_critic.policy_parameters(), trainer.actor_critic.critic_parameters()
    trainer.optimizer = torch.optim.AdamW([{"params": params} for params in sides], lr=1e-3)
    trainer.train()
    assert [group["name"] for group in trainer.optimizer.param_groups] == ["policy", "critic"]
    rates = [(h["phase"], h["learning_rate"]) for h in trainer.state.log_history if "phase" in h]
    assert [rate for phase, rate in rates if phase == "value_pretrain"] == [0.0, 0.0]
    assert [phase for phase, _ in rates].count("rl") == 2 and rates[-1][1] > 0

    # Under DeepSpeed a critic-only step holds the groups named "policy" out of the optimizer step: one group over
    # both sides is refused as the optimizer is built (transformers' `deepspeed_init` builds it before the first
    # rollout), not at the first critic-only step. DeepSpeed's launch is left out (its hold-out is tested in
    # test_distributed.py): the flag transformers sets for it is set by hand.
    def one_group(ac):
        return [{"params": list(ac.parameters())}]

    def named(*names):  # one group per side, named
        sides = lambda ac: (ac.policy_parameters(), ac.critic_parameters())  # noqa: E731
        return lambda ac: [{"params": p, "name": n} for p, n in zip(sides(ac), names, strict=True)]

    cases = [  # (settings, groups, DeepSpeed, the groups refused)
        ({"value_pretrain_steps": 2}, one_group, True, "[0]"),
        ({"value_pretrain_steps": 2}, one_group, False, None),
        ({"value_pretrain_steps": 0}, one_group, True, None),
        ({"value_pretrain_steps": 0, "critic_num_iterations": 2}, one_group, True, "[0]"),
        ({"value_pretrain_steps": 2}, named("actor", "critic"), True, "[0]"),  # the policy's under another name
        ({"value_pretrain_steps": 2}, named("policy", "policy"), True, "[1]"),  # the critic's under 'policy'
        ({"value_pretrain_steps": 2}, named("policy", "value"), True, None),
    ]
    for settings, groups, deepspeed, refused in cases:
        args = make_args(tmp_path, max_steps=2, **settings)
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
        trainer.optimizer = torch.optim.AdamW(groups(trainer.actor_critic), lr=1e-3)
        trainer.is_deepspeed_enabled = deepspeed
        if refused:
            with pytest.raises(ValueError, match=rf"group\(s\) \{refused[:-1]}\] hold the policy's .* one group per"):
                trainer.create_optimizer()
        else:
            trainer.create_optimizer()


def test_value_pretraining_lowers_value_loss_raises_explained_variance_and_freezes_policy(tiny_model_dir, tmp_path):
    args = make_args(
        tmp_path,
        per_device_train_batch_size=32,
        max_completion_length=2,
        max_steps=1,
        value_pretrain_steps=40,
        value_pretrain_patience=None,
        critic_learning_rate=1e-2,
    )
    ref = []
    snapshot = PolicySnapshot(ref)
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=first_char_is_letter,
        args=args,
        train_dataset=prompts_dataset(),
        callbacks=[snapshot],
    )
    ref.append(trainer)
    initial = sum(float(p.detach().double().sum()) for p in trainer.actor_critic.policy.parameters())
    trainer.train()
    pre = [h for h in trainer.state.log_history if h.get("phase") == "value_pretrain"]
    assert len(pre) == 40
    losses = [h["loss/value"] for h in pre]
    evs = [h["value/explained_variance"] for h in pre]
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8 - 0.1
    assert sum(evs[-8:]) / 8 > sum(evs[:8]) / 8 + 0.15
    assert all("loss/policy" not in h for h in pre)
    # No advantage is computed while the policy waits: none is logged (a 0.0 would read as a well-centred critic).
    assert not any("advantages/mean" in h or "lambda_actor/mean" in h for h in pre)
    assert all("advantages/mean" in h and "lambda_actor/mean" in h for h in rl_logs(trainer))
    # The policy is frozen during value pretraining and moves at the first RL step.
    pretrain_sums = [s for phase, s in snapshot.sums if phase == "value_pretrain"]
    assert len(pretrain_sums) == 40 and all(s == initial for s in pretrain_sums)
    assert snapshot.sums[-1][0] == "rl" and snapshot.sums[-1][1] != initial
    # The pretrained critic is saved and, passed back as value_model, skips the phase.
    saved = tmp_path / "out" / "value_pretrained_critic"
    assert (saved / "vapo_value_pretraining.json").is_file()
    again = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=first_char_is_letter,
        args=make_args(tmp_path / "again", max_steps=1, value_pretrain_steps=5, max_completion_length=2),
        train_dataset=prompts_dataset(),
        value_model=str(saved),
    )
    again.train()
    assert [h["phase"] for h in again.state.log_history if "phase" in h] == ["rl"]
    # Loaded in bf16 as the policy is (the one-GPU setup): the critic is the float32 one saved, bit for bit, not its
    # rounding (most of a pretraining's updates at the paper's rate are below bf16's resolution).
    args = make_args(tmp_path / "bf16", max_steps=1, max_completion_length=2, model_init_kwargs={"dtype": "bfloat16"})
    in_bf16 = VAPOTrainer(str(tiny_model_dir), first_char_is_letter, args, prompts_dataset(), value_model=str(saved))
    critic = in_bf16.actor_critic.critic.state_dict()
    weights = load_file(saved / "model.safetensors")
    assert {value.dtype for value in weights.values()} == {torch.float32}
    assert all(torch.equal(critic[name], value) for name, value in weights.items())
    assert in_bf16.actor_critic.loaded_dtypes["critic"]["score.weight"] == torch.bfloat16  # saved back as loaded
    # The same critic pushed with its run (`push_to_hub`): `owner/name/value_pretrained_critic`, read from the Hugging
    # Face cache (offline, as these tests run; online it is downloaded there first). By its id, the record beside it
    # was unread: value pretraining ran again, unsaid.
    cache = tmp_path / "hub-cache"
    put_in_hub_cache(cache, "me/run", {"value_pretrained_critic": saved})
    in_cache = {"cache_dir": str(cache)}
    args = make_args(
        tmp_path / "hub", max_steps=1, value_pretrain_steps=5, max_completion_length=2, model_init_kwargs=in_cache
    )
    hub_id = "me/run/value_pretrained_critic"
    from_hub = VAPOTrainer(str(tiny_model_dir), first_char_is_letter, args, prompts_dataset(), value_model=hub_id)
    assert from_hub.run_record.critic_pretrained
    assert from_hub.run_record.critic_source == hub_id  # the card names the id given
    critic = from_hub.actor_critic.critic.state_dict()
    assert all(torch.equal(critic[name], value) for name, value in weights.items())


def test_a_hub_repository_that_is_a_runs_or_lacks_the_folder_named_is_refused_before_loading(
    tiny_model_dir, tmp_path, monkeypatch
):
    """`owner/name` whose root is a pushed run's policy (its critic in `critic/`) loaded that policy as the critic with
    a new head, the trained critic unread; a folder the repository lacks read as a local path. Refused before a
    model loads; a repository whose root is a model is loaded by `from_pretrained` as before."""
    cache = tmp_path / "hub-cache"
    put_in_hub_cache(cache, "me/run", {"": tiny_model_dir, "critic": tiny_model_dir})
    put_in_hub_cache(cache, "me/run", {"last-checkpoint": tiny_model_dir, "last-checkpoint/critic": tiny_model_dir})
    put_in_hub_cache(cache, "me/reward-model", {"": tiny_model_dir})
    args = make_args(tmp_path, max_steps=1, model_init_kwargs={"cache_dir": str(cache)})
    refuse_model_loads(monkeypatch)
    # (named as the policy too: the policy's own checkpoint, read where the policy is, was not looked at)
    for model in (str(tiny_model_dir), "me/run"):
        with pytest.raises(ValueError, match="me/run is a trl-vapo run's repository .* critic is me/run/critic; pass"):
            VAPOTrainer(model, digit_fraction, args, prompts_dataset(), value_model="me/run")
    # A checkpoint of it, refused before its optimizer state downloads.
    with pytest.raises(ValueError, match="critic is me/run/last-checkpoint/critic; pass"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), value_model="me/run/last-checkpoint")
    with pytest.raises(ValueError, match="value_model me/run/critc is neither a local folder nor a model"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), value_model="me/run/critc")
    from trl_vapo.loading import resolve_value_model

    assert resolve_value_model("me/reward-model", args, same_checkpoint=False) == "me/reward-model"
    assert resolve_value_model("me/run/critic", args, same_checkpoint=False).is_dir()
    # A local path mistyped (its first folder is here), or a Path: named as one that does not exist, not looked up.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "exp1").mkdir(parents=True)
    for typo in ("runs/exp1/critc", tmp_path / "runs" / "exp1" / "critc"):
        with pytest.raises(FileNotFoundError, match=f"value_model path {typo} does not exist"):
            VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), value_model=typo)


def test_value_pretraining_stops_when_windowed_explained_variance_stalls(tiny_model_dir, tmp_path):
    """It stops at the first rollout where `explained_variance_plateaued` holds on the readings so far, not before."""
    args = make_args(
        tmp_path,
        max_completion_length=2,
        max_steps=1,
        value_pretrain_steps=30,
        value_pretrain_patience=2,
        value_pretrain_min_delta=0.02,
        critic_learning_rate=1e-2,
        save_strategy="steps",
        save_steps=0.5,  # half the run: the run that took place, not the planned budget's 31 steps
    )

    class NotebookBar(TrainerCallback):
        """A stand-in for transformers' `NotebookProgressCallback` (IPython, which it imports, is not installed here):
        its tracker, built with the planned total at the run's start, as the notebook's is."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.training_tracker = types.SimpleNamespace(total=state.max_steps)

    notebook = NotebookBar()
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=first_char_is_letter,
        args=args,
        train_dataset=prompts_dataset(),
        callbacks=[notebook],
    )
    trainer.train()
    assert notebook.training_tracker.total == trainer.state.max_steps  # the steps taken (the plan's: 31 and more)
    half = math.ceil(trainer.state.max_steps / 2)
    assert trainer.state.save_steps == half  # from the step value pretraining ended at
    readings = [h["value/explained_variance"] for h in trainer.state.log_history if h.get("phase") == "value_pretrain"]
    assert 4 <= len(readings) < 30
    assert explained_variance_plateaued(readings, 2, 0.02)
    assert not any(explained_variance_plateaued(readings[:n], 2, 0.02) for n in range(len(readings)))
    # The plan's budget of 30 rollouts gave way to the steps value pretraining took, then the one RL step.
    plan = trainer.run_plan
    assert trainer.state.global_step == trainer.state.max_steps == plan.max_steps(trainer.progress)
    assert plan.max_steps(trainer.progress) == len(readings) * plan.steps_per_pretrain_rollout + 1
    assert plan.pretrain_steps == 30 * plan.steps_per_pretrain_rollout
    record = json.loads((tmp_path / "out" / "value_pretrained_critic" / "vapo_value_pretraining.json").read_text())
    assert record["rollouts"] == len(readings)
    assert record["final_explained_variance"] == pytest.approx(sum(readings[-2:]) / 2)


def test_a_card_written_during_value_pretraining_reports_this_runs_not_an_earlier_runs(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A fresh run in a folder without checkpoints finds an earlier run's `value_pretrained_critic/`: the card of a
    checkpoint (or of a run stopped) during this run's value pretraining reported that run's outcome, and its critic
    as the one to reuse. A push uploads the folder with the run whose card names it (by its Hub id), not beside
    another run's card."""
    import transformers.trainer

    hub = LocalHub(tmp_path / "hub")
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)

    class StopAtTheFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    settings = dict(max_completion_length=2, max_steps=1, value_pretrain_patience=None)
    earlier = VAPOTrainer(
        str(tiny_model_dir),
        first_char_is_letter,
        make_args(tmp_path, value_pretrain_steps=2, **settings),
        prompts_dataset(),
    )
    earlier.train()
    assert (tmp_path / "out" / "value_pretrained_critic" / "vapo_value_pretraining.json").is_file()
    earlier.args.hub_model_id = "me/earlier"
    earlier.push_to_hub()
    assert (tmp_path / "hub" / "me" / "earlier" / "value_pretrained_critic" / "vapo_value_pretraining.json").is_file()
    card = (tmp_path / "hub" / "me" / "earlier" / "README.md").read_text()
    assert '(from the Hub: `value_model="me/earlier/value_pretrained_critic"`)' in card
    fresh = VAPOTrainer(
        str(tiny_model_dir),
        first_char_is_letter,
        make_args(tmp_path, value_pretrain_steps=30, **settings),
        prompts_dataset(),
        callbacks=[StopAtTheFirstStep()],
    )
    fresh.train()
    assert fresh.progress.phase == "value_pretrain" and fresh.progress.value_pretrain_rollouts == 1
    fresh.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "ran 1 rollout" in card and "ran 2 rollouts" not in card
    assert "value_pretrained_critic/" not in card
    fresh.args.hub_model_id = "me/fresh"
    fresh.push_to_hub()
    assert (tmp_path / "hub" / "me" / "fresh" / "README.md").is_file()
    assert not (tmp_path / "hub" / "me" / "fresh" / "value_pretrained_critic").exists()


def test_value_pretrainings_last_readings_are_logged_as_its_own(tiny_model_dir, tmp_path):
    """Value pretraining ends at step 3, between logs (every 2 steps): its last step's readings were averaged into
    the first RL log, labelled `rl`. They are logged when it ends, as value pretraining's."""
    args = make_args(tmp_path, max_steps=3, value_pretrain_steps=3, value_pretrain_patience=None, logging_steps=2)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    trainer.train()
    logged = [(h["step"], h["phase"]) for h in trainer.state.log_history if "phase" in h]
    assert logged == [(2, "value_pretrain"), (3, "value_pretrain"), (4, "rl"), (6, "rl")]


def test_value_pretraining_readings_without_variance_do_not_stop_it(tiny_model_dir, tmp_path):
    # A constant reward leaves nothing to explain (NaN explained variance): no evidence of a stall, the budget runs.
    args = make_args(tmp_path, max_steps=1, value_pretrain_steps=4, value_pretrain_patience=1)
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=lambda completions, **kw: [1.0] * len(completions),
        args=args,
        train_dataset=prompts_dataset(),
    )
    trainer.train()
    phases = [h["phase"] for h in trainer.state.log_history if "phase" in h]
    assert phases == ["value_pretrain"] * 4 + ["rl"]


def test_value_pretraining_is_unclipped_regression_and_rl_clips(tiny_model_dir, tmp_path):
    # Two optimizer steps per rollout: in the second, the critic has moved away from the rollout's values by more
    # than the tiny clip range, so RL clips; value pretraining must not.
    args = make_args(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=2,
        max_steps=4,
        value_pretrain_steps=3,
        value_pretrain_patience=None,
        cliprange_value=1e-4,
        critic_learning_rate=1e-2,
    )
    trainer = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=first_char_is_letter, args=args, train_dataset=prompts_dataset()
    )
    trainer.train()
    pretraining = [h["value/clip_ratio"] for h in trainer.state.log_history if h.get("phase") == "value_pretrain"]
    rl = [h["value/clip_ratio"] for h in rl_logs(trainer)]
    assert len(pretraining) == 6 and all(r == 0 for r in pretraining)
    assert max(rl) > 0


def test_a_critic_pretrained_for_another_policy_is_pretrained_again(tiny_model_dir, tmp_path, caplog):
    from trl_vapo.tiny import save_tiny_model

    first = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=first_char_is_letter,
        train_dataset=prompts_dataset(),
        args=make_args(tmp_path / "a", max_steps=1, value_pretrain_steps=1),
    )
    first.train()
    critic = tmp_path / "a" / "out" / "value_pretrained_critic"
    other_model = save_tiny_model(tmp_path / "other", seed=123)
    with caplog.at_level("WARNING"):
        second = VAPOTrainer(
            model=str(other_model),
            reward_funcs=first_char_is_letter,
            train_dataset=prompts_dataset(),
            args=make_args(tmp_path / "b", max_steps=1, value_pretrain_steps=2, value_pretrain_patience=None),
            value_model=str(critic),
        )
    assert "value pretraining runs again" in caplog.text
    second.train()
    assert [h["phase"] for h in second.state.log_history if "phase" in h] == ["value_pretrain"] * 2 + ["rl"]
    # The same policy, other returns: another reward, another temperature (a critic predicts the returns of the
    # rewards and the sampling it was pretrained under); the same ones skip value pretraining.
    record = json.loads((critic / "vapo_value_pretraining.json").read_text())
    assert record["value_targets"]["reward_funcs"] == ["first_char_is_letter"]
    for rewards, settings, again in (
        (first_char_is_letter, {}, False),
        (digit_fraction, {}, True),
        (first_char_is_letter, {"max_prompt_length": 3}, True),  # the prompts cut: other states
        (first_char_is_letter, {"temperature": 0.7}, True),
    ):
        caplog.clear()
        args = make_args(tmp_path / "c", max_steps=1, value_pretrain_steps=2, **settings)
        with caplog.at_level("WARNING"):
            third = VAPOTrainer(str(tiny_model_dir), rewards, args, prompts_dataset(), value_model=str(critic))
        assert third.run_record.critic_pretrained is not again
        assert ("was value-pretrained for other returns than this run's" in caplog.text) is again
        # Pretrained for 1 of this run's 2 rollouts (a shorter run's critic): it skips all the same, and says so.
        assert ("for 1 rollout(s), fewer than this run's value_pretrain_steps=2" in caplog.text) is not again
    assert "temperature 1.0 there, 0.7 here" in caplog.text
    # Stopped early by its own rule under this run's budget (value_pretrain_patience): no shorter run's critic, and no
    # warning, whose advice (leave value_model unset) would stop at the same point again.
    assert record["budget"] == 1
    (critic / "vapo_value_pretraining.json").write_text(json.dumps({**record, "budget": 2}))
    caplog.clear()
    with caplog.at_level("WARNING"):
        args = make_args(tmp_path / "d", max_steps=1, value_pretrain_steps=2)
        VAPOTrainer(str(tiny_model_dir), first_char_is_letter, args, prompts_dataset(), value_model=str(critic))
    assert "fewer than this run's value_pretrain_steps" not in caplog.text


def test_a_new_adapters_random_initialisation_is_no_other_policy_for_a_pretrained_critic(tiny_model_dir, tmp_path):
    """A new LoRA adapter computes as its base (B is zero), but its A is drawn with the run's seed: the fingerprint
    a value-pretrained critic records took it in, and a run with another seed pretrained that critic again. A
    trained adapter does change the policy."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def fingerprint(seed, model=str(tiny_model_dir), peft_config=lora):
        args = make_args(tmp_path, seed=seed, max_steps=1)
        trainer = VAPOTrainer(model, digit_fraction, args, prompts_dataset(), peft_config=peft_config)
        return trainer.run_record.policy_fingerprint

    assert fingerprint(1) == fingerprint(2)

    def given_adapter(b: float):  # the same A (seeded), B as given
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(b)
        return model

    assert fingerprint(1, given_adapter(0.01), None) != fingerprint(1, given_adapter(0.0), None)


def test_the_base_weights_digest_leaves_every_adapter_out_and_tells_bases_apart(tiny_model_dir):
    """What a checkpoint records of its base model (a resume onto other weights is refused): the same for the model
    alone and with adapters on it (peft's wrapping renames the weights; a trained adapter is the checkpoint's to
    restore), and for a cast that keeps the values; another weight, or a cast that rounds them, differs."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_vapo.modeling import policy_fingerprints

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    policy, digest = policy_fingerprints(base)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    wrapped = get_peft_model(copy.deepcopy(base), lora)
    wrapped.add_adapter("critic", lora)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.fill_(0.3)  # trained
    assert policy_fingerprints(wrapped)[1] == digest
    assert policy_fingerprints(wrapped)[0] != policy  # the policy's digest takes its adapter in (not the critic's)

    other = copy.deepcopy(base)
    with torch.no_grad():
        other.model.layers[1].self_attn.o_proj.weight[3, 2] *= 1.01
    assert policy_fingerprints(other)[1] != digest
    rounded = copy.deepcopy(base).to(torch.bfloat16)  # the tiny model's float32 weights are not bf16 values
    assert policy_fingerprints(rounded)[1] != digest
    assert policy_fingerprints(rounded.float())[1] == policy_fingerprints(rounded)[1]


def test_an_entropy_bonus_moves_the_policys_step_not_the_critics_and_delta_reaches_the_loss(
    tiny_model_dir, tmp_path, monkeypatch
):
    """GRPOConfig's static `entropy_coef`: from the same rollout, the policy steps elsewhere with the bonus than
    without it, the critic the same; `loss/entropy_bonus` is logged, and GRPOTrainer's `policy_loss` and
    `entropy_coef`. `delta` reaches the policy loss (each of the step's calls of `vapo_loss`: with one pass over an
    on-policy rollout the ratio is 1, which no cap changes, so the step cannot show it)."""
    import trl_vapo.trainer

    deltas = []
    loss = trl_vapo.trainer.vapo_loss

    def recording(logprobs, *args, **settings):
        if logprobs is not None:  # the policy's (the critic's pass in the scoring pass gets none)
            deltas.append(settings.get("delta"))
        return loss(logprobs, *args, **settings)

    monkeypatch.setattr(trl_vapo.trainer, "vapo_loss", recording)
    trained = {}
    for coef in (0.0, 0.5):
        args = make_args(tmp_path / str(coef), max_steps=1, num_iterations=1, entropy_coef=coef, delta=4.0)
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
        deltas.clear()
        trainer.train()
        assert deltas and set(deltas) == {4.0}
        assert any("loss/entropy_bonus" in h for h in trainer.state.log_history) == (coef > 0)
        logged = [h for h in trainer.state.log_history if "loss/policy" in h]
        assert logged and [(h.get("policy_loss"), h.get("entropy_coef")) for h in logged] == [
            (h["loss/policy"], 0.5) if coef else (None, None) for h in logged
        ]
        trained[coef] = [
            {n: p.detach().clone() for n, p in side.named_parameters()}
            for side in (trainer.actor_critic.policy, trainer.actor_critic.critic)
        ]
    (policy, critic), (policy_bonus, critic_bonus) = trained[0.0], trained[0.5]
    assert any(not torch.equal(p, policy_bonus[n]) for n, p in policy.items())
    assert all(torch.equal(p, critic_bonus[n]) for n, p in critic.items())


def test_a_synced_reference_mixes_in_the_policy_every_ref_model_sync_steps(tiny_model_dir, tmp_path):
    """GRPOConfig's `sync_ref_model` (TR-DPO): at every `ref_model_sync_steps`-th step the reference becomes
    alpha x policy + (1 - alpha) x reference, and not in between; refused without a KL term or with PEFT."""
    from peft import LoraConfig
    from transformers import TrainerCallback

    settings = dict(max_steps=2, num_iterations=1, beta=0.1, ref_model_mixup_alpha=0.25, ref_model_sync_steps=2)
    policy_at = {}

    class Record(TrainerCallback):  # runs before the sync: the trainer adds its callback last
        def on_step_end(self, args, state, control, model=None, **kwargs):
            policy_at[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    args = make_args(tmp_path, sync_ref_model=True, **settings)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), callbacks=[Record()])
    initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, initial[n]) for n, p in policy_at[1].items())  # the policy moved at step 1
    for name, ref in trainer.ref_model.named_parameters():
        torch.testing.assert_close(ref, 0.25 * policy_at[2][name] + 0.75 * initial[name], msg=name)
    with pytest.raises(ValueError, match="`sync_ref_model=True` while `beta=0.0`"):
        make_args(tmp_path, sync_ref_model=True, beta=0.0)
    with pytest.raises(NotImplementedError, match="PEFT model"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=LoraConfig(r=2))
    # A saved adapter's path, which loads as a PeftModel: no reference model was built, and nothing synced.
    lora = VAPOTrainer(
        str(tiny_model_dir),
        digit_fraction,
        make_args(tmp_path / "lora"),
        prompts_dataset(),
        peft_config=LoraConfig(r=2),
    )
    lora.save_model(str(tmp_path / "adapter"))
    with pytest.raises(NotImplementedError, match="PEFT model"):
        VAPOTrainer(str(tmp_path / "adapter"), digit_fraction, args, prompts_dataset())


def test_a_synced_reference_resumes_as_it_was(tiny_model_dir, tmp_path, caplog):
    """With sync_ref_model the reference moves with the policy: a checkpoint holds it, and the resumed run computes
    its KL penalty against it, as the uninterrupted run does (it restarted from the initial policy)."""
    settings = dict(max_steps=3, num_iterations=1, beta=0.5, sync_ref_model=True, ref_model_mixup_alpha=0.5)
    settings.update(ref_model_sync_steps=1, save_strategy="steps", save_steps=2)

    def run(name, resume=None):
        args = make_args(tmp_path / name, **settings)
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run("full")
    checkpoint = tmp_path / "full" / "out" / "checkpoint-2"
    # The tensors only a resume reads are in a folder of their own: at the root, a model loader that takes every
    # *.safetensors beside config.json (vLLM's) read them as the policy's weights.
    assert [p.name for p in checkpoint.glob("*.safetensors")] == ["model.safetensors"]
    state = {p.name for p in (checkpoint / "training_state").iterdir()}
    assert state == {"reference_model.safetensors", "rng_state_0.safetensors"}
    # Resumed from a copy laid out as before that folder (the files at the root), it resumes as exactly.
    old_layout = tmp_path / "resumed" / "out" / "checkpoint-2"
    shutil.copytree(checkpoint, old_layout)
    for name in state:
        (old_layout / "training_state" / name).rename(old_layout / name)
    (old_layout / "training_state").rmdir()
    with caplog.at_level(logging.WARNING, logger="trl_vapo.checkpoint"):
        resumed = run("resumed", resume=True)
    assert not [m for m in caplog.messages if "is missing" in m]
    caplog.clear()
    kl = [[h["kl"] for h in comparable(trainer.state.log_history)] for trainer in (resumed, full)]
    assert kl[0] == kl[1] and len(set(kl[1])) == 3  # (the checkpoint's history, then step 3's)
    for side in ("actor_critic", "ref_model"):
        expected = getattr(full, side).state_dict()
        for name, value in getattr(resumed, side).state_dict().items():
            assert torch.equal(value, expected[name]), (side, name)
    # A checkpoint whose marker lists it, without it (a partial copy): refused, naming the file. It resumed with a
    # warning, the KL's reference restarted as the initial policy, where an earlier whole checkpoint may be at hand.
    (checkpoint / "training_state" / "reference_model.safetensors").unlink()
    shutil.rmtree(tmp_path / "full" / "out" / "checkpoint-3")
    with pytest.raises(ValueError, match=r"checkpoint-2: missing training_state/reference_model.safetensors"):
        run("full", resume=str(checkpoint))
    # An older trl-vapo's checkpoint (its marker lists no training state), or sync_ref_model=False's: resumed with a
    # warning naming the file.
    marker = read_marker(checkpoint)
    del marker["training_state"]
    write_marker(checkpoint, marker)
    with caplog.at_level(logging.WARNING, logger="trl_vapo.checkpoint"):
        run("full", resume=str(checkpoint))
    assert any("reference_model.safetensors is missing" in m for m in caplog.messages), caplog.messages


def test_vf_coef_only_moves_the_critics_clipping_threshold(tiny_model_dir, tmp_path):
    """With AdamW, (vf_coef=0.1, max_grad_norm=1) and (vf_coef=1, max_grad_norm=10) train the critic alike: the
    clip acts on vf_coef x grad L_V. With the same max_grad_norm, vf_coef=1 clips 10x harder and trains differently.
    (Adam's epsilon is made negligible: it is the only other place where the gradient's scale shows.)"""

    def pretrained_critic(name, vf_coef, max_grad_norm):
        args = make_args(
            tmp_path / name,
            max_steps=2,
            value_pretrain_steps=3,
            value_pretrain_patience=None,
            vf_coef=vf_coef,
            max_grad_norm=max_grad_norm,
            critic_learning_rate=1e-2,
            generation_kwargs={"do_sample": False},
            adam_epsilon=1e-15,
        )
        trainer = VAPOTrainer(
            model=str(tiny_model_dir), reward_funcs=first_char_is_letter, args=args, train_dataset=prompts_dataset()
        )
        trainer.train()
        norms = [h["grad_norm/critic"] for h in trainer.state.log_history if h.get("phase") == "value_pretrain"]
        return {n: p.detach().clone() for n, p in trainer.actor_critic.critic.named_parameters()}, norms

    scaled, norms = pretrained_critic("a", 0.1, 1.0)
    assert max(norms) > 1.0, "the clip must bite for this test to say anything"
    same, _ = pretrained_critic("b", 1.0, 10.0)
    harder, _ = pretrained_critic("c", 1.0, 1.0)
    for name in scaled:
        torch.testing.assert_close(same[name], scaled[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(not torch.allclose(harder[n], scaled[n], rtol=1e-4, atol=1e-6) for n in scaled)


def test_extra_critic_passes_train_the_critic_alone(tiny_model_dir, tmp_path):
    """critic_num_iterations=3 with num_iterations=1: per rollout, one pass of joint steps, then two passes of
    critic-only steps that leave the policy untouched. One epoch of one rollout's prompts: the run plan's count."""

    sums = ParameterSums()
    args = make_args(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=2,
        max_steps=-1,
        num_train_epochs=1,
        critic_num_iterations=3,
    )
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(args.generation_batch_size // args.num_generations),
        callbacks=[sums],
    )
    sums.trainer = trainer
    assert trainer.run_plan.rl_steps == 6 and trainer.run_plan.pretrain_steps == 0
    trainer.train()
    assert trainer.state.global_step == 6  # one rollout: 3 passes x 2 steps
    policy, critic = zip(*sums.steps)
    assert policy[0] != policy[1] and len(set(policy[1:])) == 1, "only the first pass moves the policy"
    assert len(set(critic)) == 6, "every step moves the critic"
    logs = rl_logs(trainer)
    assert ["loss/policy" in h for h in logs] == [True, True, False, False, False, False]
    assert ["grad_norm/policy" in h for h in logs] == [True, True, False, False, False, False]
    each_step = logs
    with pytest.raises(TypeError, match="resume_from_chekpoint"):  # a misspelt keyword: was a fresh run
        trainer.train(resume_from_chekpoint=True)
    # Logged every three steps, each log's last step critic-only: `grad_norm` is that step's (the critic's), and each
    # side's is its last step's in the window: the policy's of step 2 in the first log (it was dropped, and with a
    # log on each rollout's last step the policy's norm was never logged), none in the second (steps 4-6).
    args.logging_steps, args.output_dir = 3, str(tmp_path / "every-3")
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(args.generation_batch_size // args.num_generations),
    )
    trainer.train()
    logs = rl_logs(trainer)
    assert [h["step"] for h in logs] == [3, 6] and ["grad_norm/policy" in h for h in logs] == [True, False]
    assert all(h["grad_norm"] == pytest.approx(h["grad_norm/critic"]) for h in logs)
    assert logs[0]["grad_norm/policy"] == pytest.approx(each_step[1]["grad_norm/policy"])  # step 2's
    assert all("loss/value" in h for h in logs)


def test_value_pretraining_makes_its_own_number_of_passes(tiny_model_dir, tmp_path):
    """value_pretrain_num_iterations=3 with num_iterations=1: each value-pretraining rollout gets three shuffled passes
    of critic-only steps (the plan counts them), RL one pass; unset, it follows num_iterations."""

    assert make_args(tmp_path, num_iterations=2).value_pretrain_num_iterations == 2
    with pytest.raises(ValueError, match="value_pretrain_num_iterations must be >= 1"):
        make_args(tmp_path, value_pretrain_num_iterations=0)
    sums = ParameterSums()
    args = make_args(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=2,
        max_steps=2,
        value_pretrain_steps=2,
        value_pretrain_patience=None,
        value_pretrain_num_iterations=3,
    )
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(),
        callbacks=[sums],
    )
    sums.trainer = trainer
    assert trainer.run_plan.pretrain_steps == 12  # 2 rollouts x 3 passes x 2 steps
    trainer.train()
    assert trainer.state.global_step == 14  # and one RL rollout of one pass
    policy, critic = zip(*sums.steps)
    assert set(policy[:12]) == {sums.initial[0]} and policy[12] != policy[11], "the policy moves only in RL"
    assert len(set(critic)) == 14, "every step moves the critic"
    phases = [h["phase"] for h in trainer.state.log_history if "phase" in h]
    assert phases == ["value_pretrain"] * 12 + ["rl"] * 2


def test_value_pretraining_replay_draws_each_pass_from_the_last_rollouts(tiny_model_dir, tmp_path):
    """value_pretrain_replay=2: the critic's steps on value-pretraining rollout i draw from rollouts i-2..i, padded
    into one rollout whose every row is the original row (same tokens, mask and returns after trimming); each pass is
    still one rollout's worth of rows, so the steps are as many and as large; RL trains on its own rollout."""

    class ReplayTrainer(CapturingTrainer):
        def _optimizer_step(self, rollout, rows, *args):
            self.steps = getattr(self, "steps", []) + [(rollout, rows)]
            super()._optimizer_step(rollout, rows, *args)

    with pytest.raises(ValueError, match="value_pretrain_replay must be >= 0"):
        make_args(tmp_path, value_pretrain_replay=-1)
    args = make_args(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=2,
        max_steps=2,
        value_pretrain_steps=4,
        value_pretrain_patience=None,
        value_pretrain_num_iterations=2,
        value_pretrain_replay=2,
        max_completion_length=12,
        generation_kwargs=stop_on_common_characters(tiny_model_dir),  # completions of several lengths
    )
    # Prompts of 2 to 17 characters, so that the rollouts' prompt widths differ.
    prompts = Dataset.from_list([{"prompt": "1+" * (i % 8) + f"{i}=", "answer": "0"} for i in range(64)])
    trainer = ReplayTrainer(model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts)
    trainer.train()
    rollouts = [rollout for _, rollout in trainer.rollouts]
    assert len(rollouts) == 5 and len(trainer.steps) == 4 * 4 + 2  # 4 rollouts x 2 passes x 2 steps, then RL
    assert all(len(rows) == 8 for _, rows in trainer.steps)
    widths = {(rollout.prompt_length, rollout.loss_mask.shape[1]) for rollout in rollouts[:4]}
    assert len(widths) > 1, f"widths must differ to test padding: {widths}"
    for i in range(5):
        trained = {id(step_rollout) for step_rollout, _ in trainer.steps[4 * i : 4 * i + 4]}
        assert len(trained) == 1
        merged = trainer.steps[4 * i][0]
        window = [rollouts[i]] if i == 4 else rollouts[max(0, i - 2) : i + 1]
        assert len(merged) == 16 * len(window)
        for k, original in enumerate(window):
            for j in range(16):
                a, b = merged.micro_batch(torch.tensor([16 * k + j])), original.micro_batch(torch.tensor([j]))
                for key in ("input_ids", "attention_mask", "mask", "returns", "completion_length"):
                    assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (i, k, j, key)
    drawn = torch.cat([rows for _, rows in trainer.steps[8:12]])  # rollout 2's steps, over rollouts 0-2
    assert (drawn < 32).any(), "the earlier rollouts train the critic again"


def test_a_checkpoint_older_than_value_pretrain_num_iterations_resumes_a_run_with_the_same_passes(tmp_path):
    """A fingerprint written before the key existed made `num_iterations` value-pretraining passes: a run with as
    many resumes from it, one with other passes is refused, naming the key."""
    from trl_vapo.checkpoint import check_resumable

    old = {"model": "m", "num_iterations": 2, "deepspeed": False}
    check_resumable(
        tmp_path, old, {"num_iterations": 2, "critic_num_iterations": 2, "value_pretrain_num_iterations": 2}
    )
    with pytest.raises(ValueError, match="value_pretrain_num_iterations: checkpoint 2, this run 8"):
        check_resumable(
            tmp_path, old, {"num_iterations": 2, "critic_num_iterations": 2, "value_pretrain_num_iterations": 8}
        )


def parameter_sum(params) -> float:
    return sum(float(p.detach().double().sum()) for p in params)


class ParameterSums(TrainerCallback):
    """After every optimizer step: the sums of the policy's and of the critic's parameters (set `trainer` first)."""

    def __init__(self):
        self.trainer, self.initial, self.steps = None, None, []

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.actor_critic
        self.initial = (parameter_sum(model.policy_parameters()), parameter_sum(model.critic_parameters()))

    def on_step_end(self, args, state, control, **kwargs):
        model = self.trainer.actor_critic
        self.steps.append((parameter_sum(model.policy_parameters()), parameter_sum(model.critic_parameters())))


# ---------------------------------------------------------------------------------------------------------------------
# Sampling the losses can model
# ---------------------------------------------------------------------------------------------------------------------


def test_sampling_settings_the_log_probs_do_not_see_are_named_in_a_warning(tiny_model_dir, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    def warning_for(model, **overrides):
        caplog.clear()
        with caplog.at_level("WARNING"):
            VAPOTrainer(
                model=model,
                reward_funcs=digit_fraction,
                args=make_args(tmp_path, **overrides),
                train_dataset=prompts_dataset(),
            )
        return [r.getMessage() for r in caplog.records if "off-policy" in r.getMessage()]

    assert warning_for(str(tiny_model_dir)) == []
    (message,) = warning_for(str(tiny_model_dir), top_p=0.9, repetition_penalty=1.1)
    assert "top_p=0.9" in message and "repetition_penalty=1.1" in message
    # Inherited from the model's own generation config (as Qwen's top_k=20, min_p, ...):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config.min_p = 0.05
    (message,) = warning_for(model)
    assert "min_p=0.05" in message


def test_completions_end_at_a_stop_token_or_at_the_last_token_before_padding():
    from trl_vapo.generation import _generated_mask, cut_at_stop

    def cut(ids, stops, pad, stop_strings):
        out = cut_at_stop(ids, stops, pad, valid=_generated_mask(ids, stops, pad, stop_strings))
        return out.completion_ids, out.completion_mask

    pad, stops = 0, [1, 7]
    generated = torch.tensor(
        [
            [5, 6, 1, 9, 9],  # ends at the stop token (the tail is whatever came after)
            [5, 6, 6, 0, 0],  # ended by a stop string: generate() padded the rest
            [5, 6, 6, 6, 6],  # cut by the length limit
            [7, 0, 0, 0, 0],  # the second stop id, first position
            [0, 0, 0, 0, 0],  # nothing at all
        ]
    )
    ids, mask = cut(generated, stops, pad, stop_strings=True)
    assert mask.sum(dim=1).tolist() == [3, 3, 5, 1, 0]
    for row, length in zip(range(len(generated)), mask.sum(dim=1).tolist()):
        assert ids[row, :length].tolist() == generated[row, :length].tolist()
        assert (ids[row, length:] == pad).all()
    # Without stop strings nothing but a stop token ends a row: a trailing pad token was sampled and trains.
    _, mask = cut(generated, stops, pad, stop_strings=False)
    assert mask.sum(dim=1).tolist() == [3, 5, 5, 1, 5]
    # When the pad token is a stop token (pad = EOS), the first one is the EOS and trains.
    _, mask = cut(torch.tensor([[5, 0, 0]]), [0], 0, stop_strings=True)
    assert mask.tolist() == [[1, 1, 0]]


def test_stop_strings_train_no_padding(tiny_model_dir, tmp_path):
    args = make_args(tmp_path, max_completion_length=12, generation_kwargs={"stop_strings": ["a", "e", "o"]})
    trainer = CapturingTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
    )
    trainer.train()
    pad = trainer.processing_class.pad_token_id
    stopped = 0  # completions a stop string ended early, which generate() pads out to the batch's length
    for _, rollout in trainer.rollouts:
        completions = rollout.input_ids[:, rollout.prompt_length :]
        trained = rollout.attention_mask[:, rollout.prompt_length :].bool()
        assert not (completions[trained] == pad).any(), "a pad token inside a completion would train"
        texts = trainer.processing_class.batch_decode(rollout.completion_ids)
        stopped += sum(
            len(ids) < 12 and text.endswith(("a", "e", "o")) for ids, text in zip(rollout.completion_ids, texts)
        )
    assert stopped > 0


# ---------------------------------------------------------------------------------------------------------------------
# It learns
# ---------------------------------------------------------------------------------------------------------------------


def test_mean_reward_rises_on_a_learnable_task(tiny_model_dir, tmp_path):
    args = make_args(tmp_path, max_steps=25, value_pretrain_steps=3, learning_rate=1e-2, critic_learning_rate=1e-2)
    trainer = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
    )
    trainer.train()
    rewards = [h["reward"] for h in rl_logs(trainer)]
    assert len(rewards) == 25
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.5, rewards


# ---------------------------------------------------------------------------------------------------------------------
# Each technique switch changes what it should
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [None, 0.5])
@pytest.mark.parametrize("lam_critic", [1.0, 0.9])
def test_decoupled_and_length_adaptive_gae_wiring(tiny_model_dir, tmp_path, alpha, lam_critic):
    args = make_args(
        tmp_path,
        max_steps=1,
        whiten_advantages=False,
        length_adaptive_alpha=alpha,
        lam_actor=0.7,
        lam_critic=lam_critic,
        gamma=0.95,  # (not the paper's 1.0: a gamma left out of the GAE calls would show)
        max_completion_length=12,
        generation_kwargs=stop_on_common_characters(tiny_model_dir),
    )
    trainer = CapturingTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
    )
    trainer.train()
    rows, rollout = trainer.rollouts[0]
    rewards, lengths, _ = token_rewards_of(trainer, rows, rollout)
    mask = rollout.loss_mask
    expected_lam = torch.full((len(rows),), 0.7) if alpha is None else length_adaptive_lambda(lengths, alpha)
    if alpha is not None:
        assert len(set(expected_lam.tolist())) > 1, "lengths must differ for this test to mean something"
    advantages, _ = compute_gae(rewards, rollout.old_values, mask, 0.95, expected_lam)
    _, returns = compute_gae(rewards, rollout.old_values, mask, 0.95, lam_critic)
    torch.testing.assert_close(rollout.advantages, advantages)
    torch.testing.assert_close(rollout.returns, returns)
    logged = rl_logs(trainer)[0]["lambda_actor/mean"]
    assert logged == pytest.approx(expected_lam.mean().item(), abs=1e-6)


@pytest.mark.parametrize("loss_type", ["token", "sequence"])
def test_loss_type_weights_tokens_or_sequences(tiny_model_dir, tmp_path, loss_type):
    # First step of a rollout: new log-probs equal the old ones, so the surrogate is -A and the loss is the weighted
    # mean of -A that loss_type names.
    args = make_args(
        tmp_path,
        max_steps=1,
        whiten_advantages=False,
        loss_type=loss_type,
        nll_coef=0.0,
        max_completion_length=12,
        generation_kwargs=stop_on_common_characters(tiny_model_dir),
    )
    trainer = CapturingTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
    )
    trainer.train()
    _, rollout = trainer.rollouts[0]
    mask, adv = rollout.loss_mask, rollout.advantages
    token_mean = -(adv * mask).sum() / mask.sum()
    sequence_mean = -((adv * mask).sum(1) / mask.sum(1)).mean()
    assert not torch.isclose(token_mean, sequence_mean, atol=1e-3)
    expected = token_mean if loss_type == "token" else sequence_mean
    assert rl_logs(trainer)[0]["loss/policy"] == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)


def test_nll_switch(tiny_model_dir, tmp_path):
    logs = {}
    for coef in (0.0, 0.1):
        args = make_args(tmp_path / str(coef), max_steps=1, nll_coef=coef, positive_reward_threshold=-0.5)
        trainer = VAPOTrainer(
            model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
        )
        trainer.train()
        logs[coef] = rl_logs(trainer)[0]
    assert "loss/nll" not in logs[0.0]
    assert logs[0.1]["loss/nll"] > 0  # digit-heavy completions exist and count as positive
    # Same seed, same rollout: the total loss differs by exactly mu * NLL.
    assert logs[0.1]["reward"] == logs[0.0]["reward"]
    assert logs[0.1]["loss"] - logs[0.0]["loss"] == pytest.approx(0.1 * logs[0.1]["loss/nll"], rel=1e-4)


def test_vanilla_ppo_is_a_config(tiny_model_dir, tmp_path):
    args = make_args(
        tmp_path,
        max_steps=1,
        value_pretrain_steps=0,
        lam_critic=0.95,
        lam_actor=0.95,
        length_adaptive_alpha=None,
        loss_type="sequence",
        epsilon_high=None,
        nll_coef=0.0,
        num_generations=1,
    )
    assert args.epsilon_high == args.epsilon == 0.2
    trainer = CapturingTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
    )
    trainer.train()
    rows, _ = trainer.rollouts[0]
    assert len({row["prompt"] for row in rows}) == len(rows)  # one sample per prompt
    log = rl_logs(trainer)[0]
    assert log["lambda_actor/mean"] == pytest.approx(0.95)
    assert "loss/nll" not in log
    assert not (tmp_path / "out" / "value_pretrained_critic").exists()


def test_group_sampling_repeats_each_prompt(tiny_model_dir, tmp_path):
    args = make_args(tmp_path, max_steps=1, num_generations=8)
    trainer = CapturingTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
    )
    trainer.train()
    rows, _ = trainer.rollouts[0]
    prompts = [row["prompt"] for row in rows]
    assert len(prompts) == 16 and len(set(prompts)) == 2
    assert all(prompts.count(p) == 8 for p in set(prompts))


# ---------------------------------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------------------------------


# Two optimizer steps per rollout, every value-pretraining step run, a checkpoint every 2 steps: resumed mid-phase.
RESUMABLE = dict(value_pretrain_patience=None, save_strategy="steps", save_steps=2, num_iterations=2)


class DrawsAtTrainBegin(TrainerCallback):
    """A callback that draws random numbers as a run begins (a tracker's setup naming its run): the uninterrupted
    run drew them before its first step, a resumed one drew them from the restored state, and every sample after
    differed from the uninterrupted run's."""

    def on_train_begin(self, args, state, control, **kwargs):
        torch.rand(4)
        random.random()


@pytest.mark.parametrize("peft", [False, True])
def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path, peft, caplog):
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def run(
        output, resume=None, prompts=64, checked_first=False, lora=None, model=tiny_model_dir, data=None,
        rewards=digit_fraction, train=True, **settings,
    ):  # fmt: skip
        args = make_args(tmp_path / output, max_steps=3, value_pretrain_steps=2, **RESUMABLE, **settings)
        trainer = VAPOTrainer(
            model=str(model),
            reward_funcs=rewards,
            args=args,
            train_dataset=data or prompts_dataset(prompts),
            peft_config=lora or peft_config,
            callbacks=[DrawsAtTrainBegin()],
        )
        if checked_first or not train:  # as `trl-vapo train` checks the resume before the held-out report and `train`
            trainer.resume_point(resume)
        if train:
            trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run("full")
    # 2 pretraining rollouts x 2 iterations = 4 steps, then 3 RL steps.
    assert full.state.global_step == 7
    assert [h["phase"] for h in full.state.log_history if "phase" in h] == ["value_pretrain"] * 4 + ["rl"] * 3
    checkpoint = tmp_path / "full" / "out" / "checkpoint-4"
    assert (checkpoint / "vapo_state.json").is_file()
    assert not (checkpoint / "README.md").exists()  # peft's template card, which a checkpoint's push published
    # A fresh run over them would share their list: save_total_limit deleted its own first, a resume took theirs.
    with pytest.raises(ValueError, match=r"holds an earlier run's checkpoints \(\.\.\., checkpoint-4, checkpoint-6, "):
        run("full")
    # Other training data: the saved position indexes another order (prompts would be skipped or repeated).
    with pytest.raises(ValueError, match=r"train_prompts: checkpoint 64, this run 48"):
        run("full", resume=str(checkpoint), prompts=48)
    # Another order of the same prompts: the position would skip some and repeat others.
    order = (
        r"data_order: checkpoint 'shuffled with seed 0 \(data_seed, else seed\), each epoch the next permutation of "
        r"one generator', this run 'shuffled with seed 7 "
    )
    with pytest.raises(ValueError, match=order):
        run("full", resume=str(checkpoint), data_seed=7)
    from trl_vapo.checkpoint import data_order  # the same order, whichever field holds its seed

    assert data_order(make_args(tmp_path, seed=42)) == data_order(make_args(tmp_path, seed=1, data_seed=42))
    # A stream's position counts the rows its long-prompt filter let through: resumed with another filter, it skipped
    # or repeated prompts without a word (a data set's count differs instead: `train_prompts`).
    long = dict(max_prompt_length=16)
    kept, dropped = (data_order(make_args(tmp_path, **long, drop_long_prompts=d), True) for d in (False, True))
    assert kept != dropped and dropped.endswith("its prompts longer than 16 tokens dropped (drop_long_prompts)")
    assert data_order(make_args(tmp_path, **long, drop_long_prompts=True)) == data_order(make_args(tmp_path, **long))
    # Another model of the same architecture (one weight differs): the checkpoint's adapter or weights were trained
    # on the first, and its architecture's name alone would not tell them apart.
    from transformers import AutoModelForCausalLM

    other_base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        other_base.model.layers[0].mlp.up_proj.weight[0, 0] += 0.5
    shutil.copytree(tiny_model_dir, tmp_path / "other-base")  # its tokenizer too
    other_base.save_pretrained(tmp_path / "other-base")
    with pytest.raises(ValueError, match=r"base_weights: the model's weights are not those the checkpoint's run"):
        run("full", resume=str(checkpoint), model=tmp_path / "other-base")
    # Another optimizer: SGD loaded Adam's state, found no momentum in it and restarted it, without a word.
    with pytest.raises(ValueError, match=r"its run's optimizer was AdamW, this run's is SGD \(`optim`, the"):
        run("full", resume=str(checkpoint), optim="sgd")
    from trl_vapo.checkpoint import same_optimizer_state  # Adam's moments under another name; another ZeRO layout

    assert same_optimizer_state("AdamW (ZeRO stage 2)", "DeepSpeedCPUAdam (ZeRO stage 2)")  # offload on at a resume
    assert not same_optimizer_state("AdamW (ZeRO stage 2)", "AdamW (ZeRO stage 3)")
    if peft:  # another rank: the saved adapter would not load into its shapes (a traceback after the model loaded)
        other = LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        with pytest.raises(ValueError, match=r"policy_adapter: r checkpoint 4, this run 8"):
            run("full", resume=str(checkpoint), lora=other)

    # Other prompts of the same number (another file, another --system_prompt), other rewards: the saved position
    # read other prompts without a word. A run may change them on purpose (a curriculum): warned of, not refused.
    def other_reward(completions, **kwargs):
        return digit_fraction(completions, **kwargs)

    other_prompts = Dataset.from_list([{"prompt": f"{i}*1=", "answer": str(i)} for i in range(64)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_vapo.checkpoint"):
        run("full", resume=str(checkpoint), data=other_prompts, train=False)
        run("full", resume=str(checkpoint), rewards=[digit_fraction, other_reward], train=False)
    prompts_changed, rewards_changed = (m for m in caplog.messages if "whose run had other inputs" in m)
    assert "its training prompts differ from this run's" in prompts_changed and "reward" not in prompts_changed
    assert (
        "its reward functions were ['digit_fraction'], this run's are ['digit_fraction', 'other_reward']"
        in (rewards_changed)
        and "its reward weights were [1.0], this run's are [1.0, 1.0]" in rewards_changed
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_vapo.checkpoint"):
        resumed = run("full", resume=str(checkpoint))
    assert "other inputs" not in caplog.text
    assert resumed.state.global_step == 7 == resumed.run_plan.max_steps(resumed.progress)  # resumed mid-plan
    # The log file is the resumed run's history: the checkpoint's, then its own (not the abandoned steps besides).
    logged = (tmp_path / "full" / "out" / "vapo_logs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in logged] == json.loads(json.dumps(resumed.state.log_history, default=str))
    after = [h for h in comparable(resumed.state.log_history) if h["step"] > 4]
    expected = [h for h in comparable(full.state.log_history) if h["step"] > 4]
    assert len(after) == 3
    assert after == expected
    if peft:
        return

    # The newest checkpoint damaged (a full disk, a partial copy): resume_from_checkpoint=True warns, naming it, and
    # resumes from the newest one that reads; the run ends with the uninterrupted run's weights.
    out = tmp_path / "full" / "out"
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-7"]
    for damaged in (out / "checkpoint-7" / "model.safetensors", out / "checkpoint-6" / "optimizer.pt"):
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    # A copy without its random state (`training_state/`, left behind): not whole, passed over (it was resumed from
    # with a warning, its samples not the saved run's).
    (out / "checkpoint-4" / "training_state" / "rng_state_0.safetensors").unlink()
    with pytest.raises(ValueError, match=r"Cannot resume from .*checkpoint-7: model.safetensors"):
        run("full", resume=str(out / "checkpoint-7"))  # named explicitly: an error naming the file, nothing trained
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_vapo.checkpoint"):
        again = run("full", resume=True, checked_first=True)
    warned = [m for m in caplog.messages if "cannot be read" in m]  # once each (twice when checked first, before)
    assert len(warned) == 3 and "checkpoint-7 cannot be read (model.safetensors" in warned[0], warned
    assert "checkpoint-6 cannot be read (optimizer.pt" in warned[1], warned
    assert "checkpoint-4 cannot be read (missing training_state/rng_state_0.safetensors)" in warned[2], warned
    assert not [m for m in caplog.messages if "is missing" in m]
    assert [h for h in comparable(again.state.log_history) if h["step"] > 2] == [  # resumed at step 2
        h for h in comparable(full.state.log_history) if h["step"] > 2
    ]
    expected_weights = full.actor_critic.state_dict()
    for name, value in again.actor_critic.state_dict().items():
        assert torch.equal(value, expected_weights[name]), name


def test_a_resume_in_value_pretraining_replays_the_same_window(tiny_model_dir, tmp_path):
    """`value_pretrain_replay`: the critic's steps draw from the last rollouts, which a checkpoint holds; a resume
    mid-pretraining trained on its first rollout alone (other rows, another random stream) and ended elsewhere."""

    def run(resume=None, value_pretrain_steps=3):
        args = make_args(
            tmp_path, max_steps=2, value_pretrain_steps=value_pretrain_steps, value_pretrain_replay=2, **RESUMABLE
        )
        trainer = VAPOTrainer(
            model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset(64)
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run()
    out = tmp_path / "out"
    assert [h["phase"] for h in full.state.log_history if "phase" in h] == ["value_pretrain"] * 6 + ["rl"] * 2
    # Checkpoint 4 follows the second pretraining rollout: the window the third one adds to is both.
    window = out / "checkpoint-4" / "training_state" / "value_pretrain_replay_0.safetensors"
    saved = load_rollouts(str(window), torch.device("cpu"))
    assert len(saved) == 2 and all(len(r) == len(full._last_rollout) for r in saved)
    assert not (out / "checkpoint-8" / "training_state" / "value_pretrain_replay_0.safetensors").exists()  # RL: none
    partial = tmp_path / "partial"  # a copy without it: not whole (a resume's window would start anew)
    shutil.copytree(out / "checkpoint-4", partial)
    (partial / "training_state" / window.name).unlink()
    assert checkpoint_problem(partial) == f"missing training_state/{window.name}"
    expected = [h for h in comparable(full.state.log_history) if h["step"] > 4]
    weights = {k: v.clone() for k, v in full.actor_critic.state_dict().items()}
    for stale in ("checkpoint-6", "checkpoint-8"):
        shutil.rmtree(out / stale)
    resumed = run(resume=str(out / "checkpoint-4"))
    assert [h for h in comparable(resumed.state.log_history) if h["step"] > 4] == expected
    for name, value in resumed.actor_critic.state_dict().items():
        assert torch.equal(value, weights[name]), name
    # Resumed with a budget that its two rollouts spend (or none): RL starts at once, for its max_steps. The plan
    # counted this run's budget: with 0, the run ended at once, its RL never trained (step 4 >= 0 + 2).
    for budget in (2, 0):
        shorter = run(resume=str(out / "checkpoint-4"), value_pretrain_steps=budget)
        assert [h["phase"] for h in shorter.state.log_history if "phase" in h and h["step"] > 4] == ["rl"] * 2
        assert shorter.state.global_step == 6 and shorter.progress.rl_start_step == 4
        shorter.create_model_card(output_dir=tmp_path / f"card-{budget}")  # what ran, not "off"
        card = (tmp_path / f"card-{budget}" / "README.md").read_text()
        assert f"`value_pretrain_steps={budget}`{' on resuming' if budget == 0 else ''}: ran 2 rollouts" in card


def test_a_randomised_pissa_initialisation_is_refused_before_anything_loads(tmp_path):
    """PiSSA's fast SVD (`pissa_niter_4`) is drawn at random, and peft draws it again when the saved adapter loads (or
    a resume rebuilds it): the trained adapter sat on another residual base (logits 0.18 apart on the tiny model)."""
    from peft import LoraConfig

    lora = LoraConfig(r=2, init_lora_weights="pissa_niter_4", task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa_niter_4': its fast SVD is drawn at random"):
        VAPOTrainer("no/such-model", digit_fraction, make_args(tmp_path), prompts_dataset(), peft_config=lora)


@pytest.mark.parametrize("layout", ["full", "full-bf16", "lora", "lora-pissa", "given-adapter"])
def test_kl_penalty_uses_the_initial_policy_as_reference(tiny_model_dir, tmp_path, layout):
    peft_config, model = None, str(tiny_model_dir)
    adapters = ("lora", "lora-pissa", "given-adapter")
    if layout in adapters:
        from peft import LoraConfig, get_peft_model

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    if layout == "lora-pissa":  # part of each base weight moved into the adapter: the base alone is a residual
        peft_config.init_lora_weights = "pissa"
    if layout == "given-adapter":  # a trained adapter (an SFT run's): the base alone is not the initial policy
        # (with dropout, as SFT adapters are saved: disable_dropout reaches the reference's copy too, KL 0 at first)
        trained = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.5)
        model, peft_config = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), trained), None
    # bf16: the reference is the policy as it trains (float32 weights), not the bf16 checkpoint: the first KL is 0.
    dtype = {"model_init_kwargs": {"dtype": "bfloat16"}} if layout == "full-bf16" else {}
    args = make_args(tmp_path, max_steps=3, beta=0.1, learning_rate=1e-2, value_pretrain_steps=1, **dtype)
    trainer = CapturingTrainer(
        model=model, reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset(), peft_config=peft_config
    )
    # With PEFT the reference is the base with adapters off (a new LoRA computes as it), or a frozen copy of the
    # adapter (given trained, or PiSSA's): no copy of the base.
    assert (trainer.ref_model is None) == (layout in adapters)
    reference = {n: p.detach().clone() for n, p in trainer.actor_critic.named_parameters() if ".ref." in n}
    assert bool(reference) == (layout in ("lora-pissa", "given-adapter")) and not any(
        p.requires_grad for n, p in trainer.actor_critic.named_parameters() if ".ref." in n
    )
    critic = {n: p.detach().clone() for n, p in trainer.actor_critic.named_parameters() if ".critic." in n}
    assert bool(critic) == (layout in adapters)  # the shared-base critic's adapter
    # Without PEFT the reference is a model of its own: the initial policy's weights, kept (a reference that
    # followed the policy would still read a first KL of 0).
    initial = {n: p.detach().clone() for n, p in trainer.actor_critic.policy.named_parameters()}
    ref_model = {} if trainer.ref_model is None else dict(trainer.ref_model.named_parameters())
    assert all(torch.equal(p.to(initial[n].dtype), initial[n]) for n, p in ref_model.items()) and (
        bool(ref_model) == (layout not in adapters)
    )
    trainer.train()
    for name, param in trainer.actor_critic.named_parameters():  # the copy never trains
        assert name not in reference or (torch.equal(param, reference[name]) and not param.requires_grad), name
    for name, param in ref_model.items():  # nor the reference model
        assert torch.equal(param.to(initial[name].dtype), initial[name]) and not param.requires_grad, name
    assert any(not torch.equal(p, initial[n]) for n, p in trainer.actor_critic.policy.named_parameters())
    # The reference pass (the base with adapters off, or the copy) leaves the critic's adapter trainable: it trained.
    for name, param in trainer.actor_critic.named_parameters():
        assert name not in critic or (param.requires_grad and not torch.equal(param, critic[name])), name
    phases = [rollout.phase for _, rollout in trainer.rollouts]
    assert phases[0] == "value_pretrain" and phases[1:] == ["rl"] * (len(phases) - 1)
    # Value pretraining's policy is the reference (its copy, or the base a new LoRA computes as): no log-prob pass
    # for a KL of 0.
    pretraining = trainer.rollouts[0][1]
    assert pretraining.old_logprobs is None and pretraining.ref_logprobs is None
    kls = [h["kl"] for h in rl_logs(trainer)]
    assert kls[0] == 0.0  # the first rollout comes from the reference policy itself
    assert kls[-1] != 0.0
    # GRPOTrainer's estimate, exp(r) - r - 1 (r = log ref - log policy), over each rollout's trained tokens
    rl = [rollout for _, rollout in trainer.rollouts if rollout.phase == "rl"]
    for kl, rollout in zip(kls, rl, strict=True):
        r = (rollout.ref_logprobs - rollout.old_logprobs)[rollout.loss_mask.bool()]
        assert kl == pytest.approx((r.exp() - r - 1).mean().item(), rel=1e-5, abs=1e-9) and kl >= 0
    no_kl = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=make_args(tmp_path / "b"),
        train_dataset=prompts_dataset(),
    )
    assert no_kl.ref_model is None


class SlowHub(LocalHub):
    """`LocalHub` whose uploads stay in progress until `release` is set (or 30 s pass): a slow connection."""

    def __init__(self, root):
        import threading

        super().__init__(root)
        self.release = threading.Event()

    def upload_folder(self, **kwargs):
        import threading
        from concurrent.futures import Future

        super().upload_folder(**kwargs)
        pending = Future()
        threading.Thread(target=lambda: (self.release.wait(30), pending.set_result(None)), daemon=True).start()
        return pending


def test_push_to_hub_that_cannot_reach_its_repository_is_refused_before_a_model_loads(
    tiny_model_dir, tmp_path, monkeypatch
):
    """`push_to_hub=True` offline, without a token or without write access failed in `Trainer.__init__` (its
    `init_hf_repo`), after the policy, the critic and the reward models had loaded. The Hub cannot be reached here:
    the stand-in's `create_repo` raises what huggingface_hub raises offline."""
    import transformers.trainer
    from huggingface_hub.errors import OfflineModeIsEnabled

    class OfflineHub(LocalHub):
        def create_repo(self, repo_id, **kwargs):
            raise OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/repos/create: offline mode is on.")

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: OfflineHub(tmp_path / "hub"))
    refuse_model_loads(monkeypatch)
    args = make_args(tmp_path, push_to_hub=True, hub_model_id="me/vapo")
    with pytest.raises(ValueError, match=r"push_to_hub=True, and the Hub repository 'me/vapo' could not be created "
                       r"or found: Cannot reach .*offline mode is on\. Log in with write access"):  # fmt: skip
        VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())


def test_a_checkpoint_neither_waits_for_an_upload_nor_deletes_the_folder_it_reads(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A Hub upload still running at the next checkpoint: training went on waiting for it (on every process: a
    multi-GPU run's collectives time out after ddp_timeout), at every save. Now the checkpoint it reads is kept past
    save_total_limit until it ends, and rotated away after the run's last upload."""
    import transformers.trainer

    hub = SlowHub(tmp_path / "hub")
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    seen = {}

    class AtTheLastSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 3:
                seen["uploading"] = not trainer.push_in_progress.is_done()
                seen["checkpoints"] = [c.name for c in list_checkpoints(args.output_dir)]
                hub.release.set()

    pushing = dict(push_to_hub=True, hub_model_id="me/vapo", save_strategy="steps", save_steps=1, save_total_limit=1)
    args = make_args(tmp_path, max_steps=3, per_device_train_batch_size=8, **pushing)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), callbacks=[AtTheLastSave()])
    trainer.train()
    assert seen == {"uploading": True, "checkpoints": ["checkpoint-1", "checkpoint-3"]}  # step 1's upload
    assert [c.name for c in list_checkpoints(args.output_dir)] == ["checkpoint-3"]


def test_the_checkpoint_a_sigterm_writes_is_pushed_even_behind_a_slow_upload(tiny_model_dir, tmp_path, monkeypatch):
    """A SIGTERM with an upload still running: the stop's checkpoint was not pushed (one upload at a time unless
    `hub_always_push`), and on a preemptible machine whose disk goes with it `last-checkpoint/` held an older step.
    Now the stop writes its checkpoint at once (the launcher's kill comes some 30 s after the signal: not after
    the running upload), queues its push behind the running one and waits for both."""
    import os
    import signal
    import threading

    import transformers.trainer

    from trl_vapo.signals import TrainingInterrupted

    hub = SlowHub(tmp_path / "hub")
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    seen = {}

    class PreemptedAtStepTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:  # step 1's upload still runs; no checkpoint at this rollout's end
                control.should_save = False
                fallback = threading.Timer(10.0, hub.release.set)  # (the old order waited for it: failing, not hung)
                fallback.daemon = True
                fallback.start()
                os.kill(os.getpid(), signal.SIGTERM)

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:  # the stop's checkpoint, written while step 1's upload still runs
                seen["uploading"] = not trainer.push_in_progress.is_done()
                hub.release.set()

    pushing = dict(push_to_hub=True, hub_model_id="me/vapo", hub_strategy="checkpoint", save_strategy="steps")
    args = make_args(tmp_path, max_steps=4, save_steps=1, per_device_train_batch_size=8, **pushing)
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), callbacks=[PreemptedAtStepTwo()]
    )
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    assert seen == {"uploading": True}
    assert "Training in progress, step 2, checkpoint" in hub.commits
    assert trainer.push_in_progress.is_done()  # waited for before the stop
    state = json.loads((tmp_path / "hub" / "me" / "vapo" / "last-checkpoint" / "trainer_state.json").read_text())
    assert state["global_step"] == 2


def test_a_sigterm_at_a_model_only_checkpoint_pushes_the_whole_one(tiny_model_dir, tmp_path, monkeypatch):
    """`save_only_model`: the strategy's checkpoint at the stop's step is model-only, and its upload still runs when
    the stop writes the whole one in its folder, which was taken for uploaded already: `last-checkpoint/` on the Hub
    held the model alone, nothing to resume from, while the stop said its checkpoint holds every step."""
    import os
    import signal
    import threading

    import transformers.trainer

    from trl_vapo.signals import TrainingInterrupted

    hub = SlowHub(tmp_path / "hub")
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)

    class PreemptedAtStepTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:  # step 1's upload ends; step 2's, the model-only one, will still run
                hub.release.set()
                trainer.push_in_progress.wait_until_done()
                hub.release = threading.Event()
                fallback = threading.Timer(2.0, lambda: hub.release.set())
                fallback.daemon = True
                fallback.start()
                os.kill(os.getpid(), signal.SIGTERM)

    pushing = dict(push_to_hub=True, hub_model_id="me/vapo", hub_strategy="checkpoint", save_strategy="steps")
    batch = dict(save_steps=1, save_only_model=True, per_device_train_batch_size=8)
    args = make_args(tmp_path, max_steps=4, **batch, **pushing)
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), callbacks=[PreemptedAtStepTwo()]
    )
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    assert hub.commits.count("Training in progress, step 2, checkpoint") == 2  # the model-only one, then the whole
    uploaded = tmp_path / "hub" / "me" / "vapo" / "last-checkpoint"
    assert (uploaded / "optimizer.pt").is_file()
    assert "model_only" not in json.loads((uploaded / "vapo_state.json").read_text())


def test_a_sigterm_whose_upload_fails_says_so(tiny_model_dir, tmp_path, monkeypatch):
    """The stop's upload is the checkpoint's one copy on a machine whose disk goes with it: one that failed (a
    token, a quota) was waited for and then said nothing, the stop's line saying the same as for one that ended."""
    import os
    import signal
    from concurrent.futures import Future

    import transformers.trainer

    from trl_vapo.signals import TrainingInterrupted

    class FailingHub(LocalHub):
        def upload_folder(self, **kwargs):
            failed = Future()
            failed.set_exception(OSError("quota exceeded"))
            return failed

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FailingHub(tmp_path / "hub"))

    class Preempted(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)

    pushing = dict(push_to_hub=True, hub_model_id="me/vapo", hub_strategy="checkpoint")
    args = make_args(tmp_path, max_steps=4, per_device_train_batch_size=8, **pushing)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), callbacks=[Preempted()])
    with pytest.raises(TrainingInterrupted) as stopped:
        trainer.train()
    assert str(stopped.value).endswith(
        "An upload to the Hub (me/vapo) failed, OSError: quota exceeded; the Hub may not hold this step."
    )


def test_push_to_hub_uploads_each_checkpoint_and_the_saved_model_as_transformers_does(
    tiny_model_dir, tmp_path, monkeypatch
):
    """`push_to_hub=True` pushes while training (`hub_strategy`) and on `save_model`, as the Trainer does: the
    repository's root is a model that loads (policy, critic, tokenizer, card), without the training state, and
    `last-checkpoint/` is a checkpoint a run resumes from. Both were missing: the trainer's own checkpoint and save
    never pushed, so `trl-vapo train --push_to_hub` made an empty repository."""
    import transformers.trainer

    hub = LocalHub(tmp_path / "hub")
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    pushing = dict(push_to_hub=True, hub_model_id="me/vapo", hub_strategy="checkpoint", save_strategy="steps")
    args = make_args(tmp_path, save_steps=1, per_device_train_batch_size=8, **pushing)
    trainer = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset(16)
    )
    trainer.train()
    repo = tmp_path / "hub" / "me" / "vapo"
    assert 'model="me/vapo"' in (repo / "README.md").read_text()  # a card before save_model (GRPOTrainer's)
    # The shards and index of an earlier push (a checkpoint's float32 weights, of another shard count than the final
    # model's): left beside the final model.safetensors, vLLM loads what their index names.
    stale = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "critic/model.safetensors.index.json"]
    stale += ["adapter_config.json", "critic/adapter_config.json"]  # an earlier LoRA run's: loaded over the model
    for name in stale:
        (repo / name).write_text("{}")
    with trainer.holding_output_dir():  # as `trl-vapo train` saves: the run's lock is there
        assert (Path(args.output_dir) / ".vapo_run.lock").is_file()
        debris = Path(args.output_dir) / ".checkpoint-9.another-run.tmp"  # a checkpoint another run is writing
        debris.mkdir()
        (debris / "model.safetensors").write_bytes(b"half")
        trainer.save_model()
    assert hub.commits == [
        "Training in progress, step 1",
        "Training in progress, step 1, checkpoint",
        "Training in progress, step 2",
        "Training in progress, step 2, checkpoint",
        "Model save",
    ]
    AutoModelForCausalLM.from_pretrained(repo)
    AutoModelForSequenceClassification.from_pretrained(repo / "critic")
    assert 'model="me/vapo"' in (repo / "README.md").read_text()
    root = {p.name for p in repo.iterdir()}
    assert not root & {"optimizer.pt", "scheduler.pt", "trainer_state.json", "vapo_state.json", ".vapo_run.lock"}
    assert not [name for name in root if name.startswith(("checkpoint-", "."))]  # nor the lock, nor the debris
    assert not [name for name in stale if (repo / name).exists()]
    assert (repo / "last-checkpoint" / "model.safetensors").is_file()
    # A file being written in the checkpoint as it is pushed (the marker's rewrite at an epoch's end): listed, then
    # gone when read, it failed the upload.
    checkpoint = Path(args.output_dir) / "checkpoint-2"
    (checkpoint / ".vapo_state.json.tmp").write_text("{}")
    trainer._push_from_checkpoint(str(checkpoint), always=True)
    assert not list(repo.rglob(".vapo_state.json.tmp"))

    more = make_args(tmp_path / "resumed", max_steps=3, per_device_train_batch_size=8)
    resumed = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=more, train_dataset=prompts_dataset(16)
    )
    resumed.train(resume_from_checkpoint=str(repo / "last-checkpoint"))
    assert resumed.state.global_step == 3
    assert [h["step"] for h in resumed.state.log_history if "phase" in h] == [1, 2, 3]  # 1-2 read from the Hub


def test_a_peft_config_that_is_no_peft_config_is_refused_before_loading(tiny_model_dir, tmp_path):
    """A dict (`peft_config={"r": 16}`) failed with an AttributeError reading one of its fields; GRPOTrainer names
    the type it needs."""
    with pytest.raises(TypeError, match=r"peft_config must be a peft.PeftConfig, .* got dict: .*LoraConfig\(\*\*"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path), prompts_dataset(), peft_config={"r": 16})


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_initialisation_that_rewrites_the_base_runs_once(tiny_model_dir, tmp_path, init):
    """PiSSA, OLoRA, ... move part of each base weight into the adapter. The critic's adapter (and the KL reference's)
    took the policy adapter's config, so peft ran that initialisation again on the shared base: the policy under its
    own adapter computed another function before its first rollout. The base is rewritten once; the policy computes
    as the loaded model, and so do the critic's backbone (a copy of the policy adapter on the residual base) and the
    reference adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    lora.init_lora_weights = init
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[3, 7, 11, 5, 9, 2, 14, 6]])
    with torch.no_grad():
        expected = loaded(ids, output_hidden_states=True)

    def computes_as_loaded(policy, adapter):
        policy.set_adapter(adapter)
        with torch.no_grad():
            out = policy(ids, output_hidden_states=True)
        policy.set_adapter("default")
        torch.testing.assert_close(out.hidden_states[-1], expected.hidden_states[-1], atol=1e-4, rtol=1e-4)

    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, make_args(tmp_path, max_steps=1), prompts_dataset(), peft_config=lora
    )
    policy = trainer.actor_critic.policy
    computes_as_loaded(policy, "default")
    computes_as_loaded(policy, "critic")
    # With a KL penalty the reference is a copy of the adapter: the base with adapters off is the residual, which
    # the KL pulled the policy toward from its first step.
    args = make_args(tmp_path / "kl-new", max_steps=1, beta=0.04)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=lora)
    computes_as_loaded(trainer.actor_critic.policy, "ref")
    # An adapter given, trained (here: as initialised), with a KL penalty: the reference is a copy of it.
    given = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    args = make_args(tmp_path / "kl", max_steps=1, beta=0.04)
    trainer = VAPOTrainer(given, digit_fraction, args, prompts_dataset())
    policy = trainer.actor_critic.policy
    assert "ref" in policy.peft_config
    for adapter in ("default", "critic", "ref"):
        computes_as_loaded(policy, adapter)
