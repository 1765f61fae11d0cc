"""DeepSpeed ZeRO-2/3 and FSDP2 with real processes (gloo on CPU), each compared with the same run without them.

Every run is `tests/_train_script.py`: value pretraining (2 rollouts), then RL with one policy pass and three critic
passes over each rollout (`num_iterations=1, critic_num_iterations=3`: the demo recipe also trains the critic more
often than the policy), weight decay, gradient accumulation 2, per-side clipping that bites (`--max-grad-norm 0.05`),
greedy sampling so that every run sees the same completions, a KL penalty (`beta=0.05`, a reference model that
`sync_ref_model` mixes the policy into every 3 steps, placed as TRL places it, and held by each checkpoint). The
reference is one plain process. DeepSpeed must take exactly one optimizer step per trainer step (it stepped after every
micro-batch), keep the step-wide token mean, clip the actor and the critic separately, log both gradient norms, leave
the policy's weights and Adam state untouched on critic-only steps (value pretraining, the extra critic passes: ZeRO
steps every group), resume exactly, and save the models in bf16, the dtype they were loaded in (they train in float32).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _script_process import run_code, run_ranks, run_script
from safetensors.torch import load_file

from trl_vapo.tiny import save_tiny_reward_model

COMMON = [
    "--greedy",
    "--grad-accum",
    "2",
    "--max-grad-norm",
    "0.05",
    "--max-steps",
    "6",
    "--value-pretrain-steps",
    "2",
    "--num-iterations",
    "1",
    "--critic-num-iterations",
    "3",
    "--weight-decay",
    "0.1",
    "--dtype",
    "bfloat16",
    "--beta",
    "0.05",
    "--sync-ref-steps",
    "3",
    # Between the scores of greedy completions (-0.923 to -0.913 for the first rollouts, 2e-3 from any): some groups
    # are positive and some are not, so the NLL loss and its token count over the processes train too.
    "--positive-threshold",
    "-0.918",
    "--dump-state-at",
    "2",
    "8",
]
# Float32 round-off differs with the order of the gradients' reductions; Adam divides by sqrt(v) + 1e-8, which turns
# it into up to a few percent of one update (lr 1e-3) on the weights whose gradients are near 1e-8.
ATOL = {"weight": 5e-5, "exp_avg": 2e-8, "exp_avg_sq": 1e-12}
STEPS = 8  # 2 value-pretraining rollouts x 1 step, then 2 RL rollouts x (1 policy-and-critic + 2 critic-only) steps


def launch(model_dir: Path, output_dir: Path, processes: int, *extra: str) -> subprocess.CompletedProcess:
    """One run of `_train_script.py` on `processes` ranks as torchrun starts them (`run_ranks`; 0: the plain run, one
    process without a process group); every run also scores with a reward model (GRPOTrainer's `reward_funcs` entry),
    which each backend places as TRL places it (a ZeRO-3 inference engine, FSDP2 shards), so its rewards, and the
    whole run, must be the plain run's."""
    reward_model = model_dir.parent / "reward-model"
    if not (reward_model / "config.json").is_file():
        save_tiny_reward_model(reward_model)
    extra = (*extra, "--reward-model", str(reward_model))
    args = ["--model", str(model_dir), "--output-dir", str(output_dir), *COMMON, *extra]
    if processes == 0:  # the plain run: one process, no launcher, no process group
        return run_script(*args, timeout=300)  # as run_ranks: a hung run would spend the GPU suite's whole call
    return run_ranks(*args, processes=processes)


def train(model_dir: Path, output_dir: Path, processes: int, *extra: str) -> Path:
    """`launch`, run to its end."""
    result = launch(model_dir, output_dir, processes, *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    return output_dir


def assert_saved_as_loaded(run: Path) -> None:
    """`save_model` wrote the policy and the critic in bf16, the dtype they were loaded in (they trained in float32):
    the float32 training weights of the last step, rounded once."""
    trained = torch.load(run / "state-8.pt")
    for side, folder in (("policy", run / "final"), ("critic", run / "final" / "critic")):
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16", folder
        for name, value in load_file(folder / "model.safetensors").items():
            assert value.dtype == torch.bfloat16, (side, name)
            assert torch.equal(value, trained[f"weight/{side}.{name}"].bfloat16()), (side, name)


def step_logs(run: Path, name: str = "logs") -> dict[int, dict]:
    lines = (run / f"{name}-rank0.jsonl").read_text().splitlines()
    return {h["step"]: h for h in map(json.loads, lines) if "phase" in h}


def assert_policy_untouched_by_value_pretraining(run: Path, model_dir: Path) -> None:
    """After value pretraining (step 2) the policy has its initial weights (loaded in bf16), bit for bit, and no Adam
    state: it was never stepped, as in the plain run. (Its learning rate is 0 until RL starts, so weight decay cannot
    move it either; what a stepped policy shows here is its step count and, with momentum left over, its moments.)"""
    pretrained = {k: v for k, v in torch.load(run / "state-2.pt").items() if "/policy." in k or k == "adam_step"}
    initial = load_file(model_dir / "model.safetensors")
    assert pretrained.pop("adam_step") == 0
    for key, value in pretrained.items():
        kind, name = key.split("/", 1)
        expected = initial[name.removeprefix("policy.")].bfloat16().float() if kind == "weight" else 0 * value
        assert torch.equal(value, expected), key


def assert_same_state(run: Path, reference: Path) -> None:
    """After the last step (8), the float32 weights of both sides and of the synced reference, and the policy's Adam
    moments and step count are the plain run's: the critic-only passes left the policy alone."""
    expected, got = torch.load(reference / "state-8.pt"), torch.load(run / "state-8.pt")
    assert got.pop("adam_step") == expected.pop("adam_step") == 2  # one policy step per RL rollout
    assert got.keys() == expected.keys()
    assert {key.split("/")[1].split(".")[0] for key in expected} == {"policy", "critic", "reference"}
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=ATOL[key.split("/")[0]], rtol=1e-4, msg=key)


def assert_checkpoint_holds_the_reference(run: Path) -> None:
    """The last checkpoint holds the synced reference model whole: the weights the run itself read at step 8 (gathered
    parameter by parameter, where the checkpoint gathers module by module or through FSDP2's state dict)."""
    saved = load_file(run / "checkpoint-8" / "training_state" / "reference_model.safetensors")
    dumped = {
        k.removeprefix("weight/reference."): v for k, v in torch.load(run / "state-8.pt").items() if "/reference." in k
    }
    assert dumped and set(dumped) <= set(saved)
    for name, value in dumped.items():
        assert torch.equal(saved[name], value), name


def assert_same_training(run: Path, reference: Path) -> None:
    assert_same_state(run, reference)
    assert_saved_as_loaded(run)
    reference_logs, logs = step_logs(reference), step_logs(run)
    assert sorted(logs) == sorted(reference_logs) == list(range(1, STEPS + 1))
    # The KL penalty's reference is the policy before its first update, however it is sharded.
    assert "kl" not in logs[1] and logs[3]["kl"] == reference_logs[3]["kl"] == 0.0
    # Positive examples in some groups only (the NLL loss trains): `accuracy` and `loss/nll` compared below.
    assert 0 < reference_logs[3]["accuracy"] < 1 and reference_logs[3]["loss/nll"] > 0
    # Every step trains the critic; the policy trains on the first pass over each RL rollout only.
    assert [step for step, log in sorted(reference_logs.items()) if "grad_norm/policy" in log] == [3, 6]
    # The reward model scores as in the plain run (its weights gathered or sharded as TRL places them).
    key = "rewards/reward-model/mean"
    scored = [step for step, log in sorted(reference_logs.items()) if key in log]
    assert scored == [step for step, log in sorted(logs.items()) if key in log] and len(scored) >= 3
    for step in scored:
        assert logs[step][key] == pytest.approx(reference_logs[step][key], rel=1e-4), step
    for step, log in logs.items():
        norms = {key: value for key, value in reference_logs[step].items() if key.startswith("grad_norm/")}
        assert "grad_norm/critic" in norms
        assert {key for key in log if key.startswith("grad_norm/")} == norms.keys(), step
        for key, value in norms.items():
            assert log[key] == pytest.approx(value, rel=1e-3), (step, key)
        for key in ("accuracy", "loss/nll"):
            if key in reference_logs[step]:
                assert log[key] == pytest.approx(reference_logs[step][key], rel=1e-3, abs=1e-7), (step, key)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> Path:
    return train(
        tiny_model_dir, tmp_path_factory.mktemp("plain"), 0, "--save-final", "--save-steps", "100", "--held-out", "4"
    )


@pytest.fixture(scope="module")
def zero3_two_ranks(tiny_model_dir, tmp_path_factory) -> Path:
    """ZeRO-3 on two processes, with checkpoints (steps 2, 5, 8) and the final weights: one launch that the
    comparisons with the plain run and the resume test all read (a checkpoint changes no update)."""
    run = tmp_path_factory.mktemp("zero3-2")
    return train(tiny_model_dir, run, 2, "--deepspeed", "3", "--save-final", "--save-steps", "2")


# ZeRO-2 on one process partitions nothing (one rank holds all the optimizer state): it is the plain run with
# DeepSpeed's engine around it, whose stepping the other three cases cover.
@pytest.fixture(scope="module", params=[(2, 2), (1, 3), (2, 3)], ids=lambda p: f"{p[0]}proc-zero{p[1]}")
def deepspeed_run(request, tiny_model_dir, tmp_path_factory) -> Path:
    """One run per (processes, ZeRO stage), read by the tests below."""
    processes, stage = request.param
    if (processes, stage) == (2, 3):
        return request.getfixturevalue("zero3_two_ranks")
    run = tmp_path_factory.mktemp(f"zero{stage}-{processes}")
    # ZeRO-3 on one process generates with its weights left sharded (GRPOConfig's ds3_gather_for_generation=False),
    # parameter by parameter as each layer runs: the same samples, so the same training, as the plain run. It is
    # configured as `accelerate launch --config_file zero3.yaml` configures it (the two-process run: by
    # VAPOConfig(deepspeed=...)), where transformers built every model partitioned (zero3_init_flag).
    sharded = ["--no-ds3-gather", "--deepspeed-launcher"] if stage == 3 else []
    return train(
        tiny_model_dir, run, processes, "--deepspeed", str(stage), "--save-final", "--save-steps", "100", *sharded
    )


def test_deepspeed_value_pretraining_leaves_the_policy_untouched(deepspeed_run, tiny_model_dir):
    assert_policy_untouched_by_value_pretraining(deepspeed_run, tiny_model_dir)


def test_deepspeed_steps_once_per_trainer_step_matches_the_run_without_it_and_saves_as_loaded(
    deepspeed_run, reference
):
    steps = json.loads((deepspeed_run / "steps.json").read_text())
    assert steps["trainer"] == steps["deepspeed"] == STEPS
    assert steps["built_partitioned"] == [False, False]  # whole until placed: the critic copied the policy
    # Sampling gathers the policy's weights whole (ds3_gather_for_generation, the two-process run), never the
    # critic's: TRL's unwrapping gathered the whole engine, the critic too (as large, in float32).
    zero3, gathers = "zero3" in deepspeed_run.name, deepspeed_run.name.startswith("zero3-2")
    assert steps["whole_while_sampling"] == {"policy": gathers or not zero3, "critic": not zero3}
    assert steps["reference_sharded"] == ("zero3" in deepspeed_run.name)  # as the policy: a ZeRO-2 reference is whole
    assert steps["reward_model_sharded"] == [steps["reference_sharded"]]  # placed as TRL places its reward models
    assert steps["sequence_logits_built"] == 0  # the policy's and the reference's log-probs went through tiles
    assert_same_training(deepspeed_run, reference)


def test_deepspeed_resumes_exactly(tiny_model_dir, tmp_path, reference, zero3_two_ranks):
    """ZeRO-3 on two processes, resumed from the checkpoint written when value pretraining ended: the policy's groups
    have no optimizer state yet (they were held out of every step), which DeepSpeed must load as such."""
    assert_checkpoint_holds_the_reference(zero3_two_ranks)
    run = tmp_path / "ds"
    shutil.copytree(zero3_two_ranks, run)
    assert (run / "checkpoint-2" / "deepspeed").is_dir()
    for later in ("checkpoint-5", "checkpoint-8"):  # written by the first run after step 2
        shutil.rmtree(run / later)
    shutil.rmtree(run / "final")  # so that the weights compared below are the resumed run's
    (run / "state-8.pt").unlink()
    (run / "logs-rank0.jsonl").rename(run / "first-rank0.jsonl")
    # Resumed under another ZeRO stage, whose optimizer saves its state in its own layout: DeepSpeed's loader failed
    # deep in its own code.
    refused = launch(tiny_model_dir, run, 2, "--deepspeed", "2", "--save-steps", "100", "--resume")
    stage = "its run's optimizer was AdamW (ZeRO stage 3), this run's is AdamW (ZeRO stage 2) (`optim`"
    assert refused.returncode != 0 and stage in refused.stderr, refused.stderr[-3000:]
    train(tiny_model_dir, run, 2, "--deepspeed", "3", "--save-steps", "100", "--resume", "--save-final")
    resumed = step_logs(run)
    assert sorted(resumed) == [3, 4, 5, 6, 7, 8]
    assert_same_state(run, reference)  # the optimizer state resumed too
    assert_saved_as_loaded(run)


FSDP2_EVALUATED = ["--eval-prompts", "4"]


@pytest.fixture(scope="module")
def fsdp2_two_ranks(tiny_model_dir, tmp_path_factory) -> Path:
    """FSDP2 on two processes, with checkpoints (steps 2, 5, 8) and the final weights: one launch that the comparison
    with the plain run and the resume test both read."""
    flags = ["--fsdp2", "--save-final", "--save-steps", "2", "--held-out", "4", *FSDP2_EVALUATED]
    return train(tiny_model_dir, tmp_path_factory.mktemp("fsdp2-2"), 2, *flags)


def test_fsdp2_samples_trains_and_saves_like_the_run_without_it_as_loaded(tiny_model_dir, fsdp2_two_ranks, reference):
    """Also evaluated during training (FSDP2 shards the actor-critic in place, and `evaluate` took the sharded model
    for one not yet placed: refused), and the held-out report `trl-vapo train` gives after training, on the sharded
    policy and reward model, from every process (the main process alone met the others' shards)."""
    run = fsdp2_two_ranks
    steps = json.loads((run / "steps.json").read_text())
    assert steps["distributed_type"] == "DistributedType.FSDP" and steps["reference_sharded"]
    # Each decode step's forward gathers every layer's shards, a collective: generate() keeps the processes in step
    # until the last one's completions end (synced_gpus) for the modules torch's fully_shard marks as managed (a
    # process whose completions had all ended would leave for the next collective: a hang, which these runs, greedy
    # to the length limit and so in step, would not meet).
    assert steps["generate_synced"]
    # The reward model whole on each process, as GRPOTrainer places it under FSDP (`prepare_model(...,
    # evaluation_mode=True)` shards nothing): sharded, every scoring forward was a collective.
    assert steps["reward_model_sharded"] == [False]
    # Every process samples every prompt, before training and after (the sharded forwards, the reward model's too,
    # need them all: shares of unequal size, or none, hung), the report before training once the models are placed
    # (before `train()` the policy was on the host: a real model's sampling took hours). The plain run's report where
    # it is deterministic (greedy pass@1).
    after = [json.loads((run / f"held_out-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert after[0]["report"]["num_problems"] == 4 and after[1]["report"] is None
    assert after[0]["sampled"] == after[1]["sampled"] and len(after[0]["sampled"]) == 4
    before = [json.loads((run / f"held_out_before-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert before[0]["sampled"] == before[1]["sampled"] and len(before[0]["sampled"]) == 4
    assert before[0]["placed"] and before[1]["placed"]
    plain = json.loads((reference / "held_out_before-rank0.json").read_text())
    assert len(plain["sampled"]) == 4 and before[0]["report"]["num_problems"] == 4 and before[1]["report"] is None
    assert before[0]["report"]["pass@1"] == plain["report"]["pass@1"]
    logged = map(json.loads, (run / "logs-rank0.jsonl").read_text().splitlines())
    evaluated = [h["step"] for h in logged if "eval_loss" in h]
    assert evaluated == [5, 8]  # eval_steps=4: step 4 ends mid-rollout, evaluated at its end
    assert steps["sequence_logits_built"] == 0
    assert_policy_untouched_by_value_pretraining(run, tiny_model_dir)
    assert_same_training(run, reference)
    assert_checkpoint_holds_the_reference(run)


def test_lora_trains_under_zero3_on_two_processes_as_without_it(tiny_model_dir, tmp_path):
    """LoRA, the critic a second adapter on the policy's frozen base with a value head, under ZeRO-3 on two processes
    (the base partitioned, gathered to sample): both adapters, the head and the policy's Adam state after the last
    step are the plain run's, over value pretraining, RL and critic-only passes. (DDP, ZeRO-2 and FSDP2 gave the
    same on 2026-12-01, within 1.5e-8, run once: a launch each is some 10 s of the suite.)"""
    reward_model = tiny_model_dir.parent / "reward-model"
    if not (reward_model / "config.json").is_file():
        save_tiny_reward_model(reward_model)
    common = ["--model", str(tiny_model_dir), "--greedy", "--grad-accum", "2", "--max-steps", "4", "--lora"]
    common += ["--value-pretrain-steps", "2", "--num-iterations", "1", "--critic-num-iterations", "2"]
    common += ["--positive-threshold", "-0.918", "--reward-model", str(reward_model), "--dump-state-at", "6"]
    plain = run_script(*common, "--output-dir", str(tmp_path / "plain"), timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    zero3 = run_ranks(*common, "--output-dir", str(tmp_path / "zero3"), "--deepspeed", "3", processes=2)
    assert zero3.returncode == 0, zero3.stderr[-3000:]
    expected, got = (torch.load(tmp_path / run / "state-6.pt") for run in ("plain", "zero3"))
    assert got.pop("adam_step") == expected.pop("adam_step") == 2  # one policy step per RL rollout
    assert got.keys() == expected.keys()
    sides = {side: [k for k in expected if side in k] for side in (".default.", ".critic.", "value_head.")}
    assert all(sides.values()) and not any("lora" not in k and "value_head" not in k for k in expected)
    policy_b = [k for k in sides[".default."] if k.startswith("weight/") and "lora_B" in k]
    assert policy_b and all(expected[k].abs().sum() > 0 for k in policy_b)  # the policy trained (B starts at 0)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=ATOL[key.split("/")[0]], rtol=1e-4, msg=key)


def test_fsdp2_resumes_exactly(tiny_model_dir, tmp_path, reference, fsdp2_two_ranks):
    """FSDP2 on two processes, resumed from the checkpoint written when value pretraining ended. The optimizer state
    is sharded as the weights are (only the main process's shards were saved), and the weights were loaded whole
    into sharded parameters (an error): both now whole in the checkpoint and sharded again on loading, the policy's
    weights without optimizer state, as they were held out of value pretraining's steps."""
    run = tmp_path / "fsdp2"
    shutil.copytree(fsdp2_two_ranks, run)
    for later in ("checkpoint-5", "checkpoint-8", "final"):  # written by the first run after step 2
        shutil.rmtree(run / later)
    (run / "state-8.pt").unlink()
    (run / "logs-rank0.jsonl").rename(run / "first-rank0.jsonl")
    train(tiny_model_dir, run, 2, "--fsdp2", "--save-steps", "100", "--resume", "--save-final", *FSDP2_EVALUATED)
    assert sorted(step_logs(run)) == [3, 4, 5, 6, 7, 8]
    assert_same_state(run, reference)  # the optimizer state resumed too
    assert_saved_as_loaded(run)


def test_an_fsdp2_optimizer_state_of_other_parameters_is_refused(tmp_path):
    """FSDP2's optimizer state is saved by parameter name and loaded leniently (the policy's weights, held out of
    value pretraining, have none): torch dropped the state of a parameter the run lacks and started Adam afresh for
    one the checkpoint lacks, without a word. The real saving and loading functions, on a model torch's state-dict
    functions take unsharded as they take a sharded one."""
    from trl_vapo.distributed import fsdp2_optimizer_state, load_fsdp2_optimizer_state

    def two_layers(head: str = "1"):
        model = torch.nn.Sequential()
        model.add_module("0", torch.nn.Linear(2, 2))
        model.add_module(head, torch.nn.Linear(2, 1))
        return model, torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}])

    model, optimizer = two_layers()
    model(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    torch.save(fsdp2_optimizer_state(model, optimizer), tmp_path / "optimizer.pt")
    same, same_optimizer = two_layers()
    load_fsdp2_optimizer_state(same, same_optimizer, tmp_path / "optimizer.pt")
    assert [state["step"] for state in same_optimizer.state.values()] == [1, 1, 1, 1]
    other, other_optimizer = two_layers(head="head")
    refused = (
        rf"Cannot resume from {re.escape(str(tmp_path))}: its optimizer state is of other parameters: "
        r"2 saved parameters this run does not train \(1.bias, 1.weight...\); "
        r"2 trained ones it has no state for \(head.bias, head.weight...\)"
    )
    with pytest.raises(ValueError, match=refused):
        load_fsdp2_optimizer_state(other, other_optimizer, tmp_path / "optimizer.pt")
    regrouped = torch.optim.AdamW([{"params": same.parameters()}])  # the same parameters, one group
    with pytest.raises(ValueError, match=r"the same parameters in 2 groups, where this run has 1\. "):
        load_fsdp2_optimizer_state(same, regrouped, tmp_path / "optimizer.pt")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_suite.py runs it there)")
def test_fsdp2_on_one_gpu_trains_like_the_run_without_it(tiny_model_dir, tmp_path, reference):
    """FSDP2 on one CUDA process (NCCL), against the plain run on the same GPU: one process of FSDP2 is what a user
    with one GPU and an FSDP config launches."""
    run = train(tiny_model_dir, tmp_path / "fsdp2-gpu", 1, "--fsdp2", "--save-final", "--save-steps", "100")
    steps = json.loads((run / "steps.json").read_text())
    assert steps["distributed_type"] == "DistributedType.FSDP" and steps["reference_sharded"]
    assert_policy_untouched_by_value_pretraining(run, tiny_model_dir)
    assert_same_training(run, reference)


def test_fsdp2_shards_the_actor_critic_layer_by_layer_where_the_config_names_no_layer_class(tiny_model_dir):
    """TRL's fsdp2.yaml asks for TRANSFORMER_BASED_WRAP and names no class: accelerate then takes the prepared model's
    `_no_split_modules`, which the actor-critic lacked, and sharded it as one unit (gathered whole at each forward).
    accelerate's own policy, on both layouts, now picks every decoder layer of the policy and of the critic."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from helpers import peft_actor_critic
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from trl_vapo.modeling import ActorCritic

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    for model in (ActorCritic(policy, critic=critic), peft_actor_critic(tiny_model_dir)):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        wraps = fsdp2_prepare_auto_wrap_policy(plugin, model)
        layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
        assert len(layers) == (4 if model.critic is not None else 2)  # two layers each: the policy's, the critic's
        assert [m for m in model.modules() if wraps(m)] == layers


FSDP2_BF16_FORWARD = """
import json, sys, tempfile
from types import SimpleNamespace
import torch, torch.distributed as dist
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from trl_vapo.distributed import keep_fsdp2_outputs_as_computed
from trl_vapo.modeling import ActorCritic

folder = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
ids = torch.randint(3, 20, (2, 8), generator=torch.Generator().manual_seed(0))
results = {}
for mode in ("accelerate's", "kept"):
    torch.manual_seed(0)
    critic = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    model = ActorCritic(AutoModelForCausalLM.from_pretrained(folder), critic=critic)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")  # what accelerate sets for `mixed_precision: bf16`
    if mode == "kept":  # (the trainer's accelerator: only the attributes the function reads)
        state = SimpleNamespace(fsdp_plugin=plugin)
        keep_fsdp2_outputs_as_computed(SimpleNamespace(distributed_type=DistributedType.FSDP, state=state))
    for layer in [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]:
        fully_shard(layer, mesh=mesh, mp_policy=plugin.mixed_precision_policy)  # as accelerate's fsdp2_prepare_model
    fully_shard(model, mesh=mesh, mp_policy=plugin.mixed_precision_policy)
    computed_in = []  # the dtype a policy layer's weight computes in
    q_proj = next(m for name, m in model.named_modules() if name.endswith("q_proj"))
    q_proj.register_forward_pre_hook(lambda module, args: computed_in.append(str(module.weight.dtype)))
    out = model(ids, torch.ones_like(ids), 4)
    results[mode] = {k: [str(v.dtype), (v.float() == v.bfloat16().float()).all().item()] for k, v in out.items()}
    results[f"{mode} weights"] = sorted(set(computed_in))
print(json.dumps(results))
dist.destroy_process_group()
"""


def test_fsdp2_in_bf16_gives_the_log_probs_and_values_in_float32(tiny_model_dir, tmp_path):
    """accelerate's FSDP2 mixed precision for `mixed_precision: bf16` casts a sharded model's outputs to bf16: the
    actor-critic's log-probs and values came back rounded (the PPO ratio in steps of 3% near log-prob -4.6), its value
    head computing in bf16 besides. Kept as computed (`keep_fsdp2_outputs_as_computed`, which the trainer calls before
    sharding anything) and the head computing in float32 (`Float32Linear`), they are float32 and not bf16's values,
    while the weights still compute in bf16. One process of gloo on the CPU, sharded as accelerate shards it."""
    proc = run_code(FSDP2_BF16_FORWARD, str(tiny_model_dir), cwd=tmp_path, timeout=120)  # a process group
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outputs["accelerate's"] == {k: ["torch.bfloat16", True] for k in ("logprobs", "entropy", "values")}
    assert outputs["kept"]["logprobs"] == outputs["kept"]["values"] == ["torch.float32", False]
    # (float32 outputs off bf16's grid would hold too for a model computing in float32 throughout)
    assert outputs["kept weights"] == outputs["accelerate's weights"] == ["torch.bfloat16"]


FSDP2_FROZEN_MODEL_RESHARDED = """
import json, sys, tempfile
from types import SimpleNamespace
import torch, torch.distributed as dist
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import AutoModelForCausalLM
from trl_vapo._compat import prepare_frozen_model

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False)
accelerator = SimpleNamespace(  # (the attributes TRL's prepare_fsdp reads)
    distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu")
)
reference = prepare_frozen_model(AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval(), accelerator)
with torch.no_grad():
    reference(torch.tensor([[3, 4, 5]]))
states = {p.sharded_state.name for p in reference._get_fsdp_state()._fsdp_param_group.fsdp_params}
print(json.dumps(sorted(states)))
dist.destroy_process_group()
"""


def test_an_fsdp2_frozen_model_is_resharded_after_each_forward(tiny_model_dir, tmp_path):
    """The KL reference, sharded as TRL shards it (`prepare_fsdp`, the launcher's `reshard_after_forward`): with
    `fsdp_reshard_after_forward: false` it stayed gathered whole from its first forward on (resharded after a
    backward, which a frozen model never runs), a whole model's copy on every GPU beside the policy. One process of
    gloo on the CPU."""
    proc = run_code(FSDP2_FROZEN_MODEL_RESHARDED, str(tiny_model_dir), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["SHARDED"]


FSDP2_LORA_WEIGHTS_GATHERED = """
import json, sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from helpers import peft_actor_critic
from trl_vapo.distributed import fsdp2_state_dict_without, full_state_dict

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
model = peft_actor_critic(sys.argv[1])
model.value_head.register_buffer("kept", torch.arange(3.0))
model.value_head.register_buffer("scratch", torch.ones(2), persistent=False)
whole, skip = {k: v.clone() for k, v in model.state_dict().items()}, model.weights_not_saved()
mesh = init_device_mesh("cpu", (1,))
for layer in model.policy.base_model.model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
gathered, full_tensor = [], DTensor.full_tensor
DTensor.full_tensor = lambda self, *a, **k: gathered.append(self.numel()) or full_tensor(self, *a, **k)
state = full_state_dict(model, True, skip)
DTensor.full_tensor = full_tensor
everything = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
ours = fsdp2_state_dict_without(model, True, ())
embeddings, head = "policy.base_model.model.model.embed_tokens.weight", "policy.base_model.model.lm_head.weight"
apart = lambda a, b: a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
print(json.dumps({
    "kept": sorted(state) == sorted(set(whole) - skip) and all(torch.equal(state[k], whole[k]) for k in state),
    "tied, apart": torch.equal(state[embeddings], state[head]) and apart(state[embeddings], state[head]),
    "share gathered": round(sum(gathered) / sum(p.numel() for p in model.parameters()), 2),
    "as torch's": sorted(ours) == sorted(everything) and all(torch.equal(ours[k], everything[k]) for k in ours),
}))
dist.destroy_process_group()
"""


def test_an_fsdp2_save_gathers_only_the_weights_it_writes(tiny_model_dir, tmp_path):
    """As under ZeRO-3 (`test_a_lora_policys_frozen_base_is_not_gathered_for_saving`): FSDP2's full state dict
    gathered a LoRA policy's frozen base onto the main process at every save. Gathered one tensor at a time, the
    rest is what torch's `get_model_state_dict` gives (tied weights under both names, each a copy; the persistent
    buffers), the same values as the unsharded model's. One process of gloo on the CPU."""
    proc = run_code(FSDP2_LORA_WEIGHTS_GATHERED, str(tiny_model_dir), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("share gathered") < 0.5
    assert result == {"kept": True, "tied, apart": True, "as torch's": True}


FSDP2_FRESH_OPTIMIZER_SAVED = """
import json, sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from trl_vapo.distributed import fsdp2_optimizer_state, load_fsdp2_optimizer_state

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
saved = fsdp2_optimizer_state(model, optimizer)
torch.save(saved, "optimizer.pt")
resumed = torch.optim.AdamW(model.parameters(), lr=0.1)
load_fsdp2_optimizer_state(model, resumed, "optimizer.pt")
counts = {"live": len(optimizer.state), "saved": len(saved["state"]), "resumed": len(resumed.state)}
print(json.dumps({**counts, "groups": len(saved["param_groups"])}))
dist.destroy_process_group()
"""


def test_an_fsdp2_optimizer_saved_before_its_first_step_stays_and_is_saved_without_state(tiny_model_dir, tmp_path):
    """torch's `get_optimizer_state_dict` steps an optimizer without state at learning rate 0 to make one: saved
    before any update (every step so far skipped, or a stop signal in the first), Adam counted a step that never
    happened, in the run and in its checkpoint; it resumes without state. One process of gloo on the CPU."""
    proc = run_code(FSDP2_FRESH_OPTIMIZER_SAVED, str(tiny_model_dir), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"live": 0, "saved": 0, "resumed": 0, "groups": 1}


def test_groups_held_out_leave_their_weights_and_adam_state_alone_and_name_a_missing_group():
    """The hook itself, on the torch AdamW that ZeRO wraps: the held-out group is not stepped (no state, same
    weights) while the other is; the groups are back after the step, also after a step that raised."""
    from trl_vapo.distributed import groups_held_out

    policy, critic = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW(
        [{"params": [policy], "name": "policy"}, {"params": [critic], "name": "critic"}], lr=0.1, weight_decay=0.1
    )
    policy.grad, critic.grad = torch.ones(3), torch.ones(3)
    groups = optimizer.param_groups
    with groups_held_out(optimizer, "policy"):
        optimizer.step()
    assert optimizer.param_groups is groups
    assert torch.equal(policy.detach(), torch.ones(3)) and policy not in optimizer.state
    assert not torch.equal(critic.detach(), torch.ones(3)) and int(optimizer.state[critic]["step"]) == 1

    def failing_step(opt, args, kwargs):
        raise RuntimeError("step failed")

    handle = optimizer.register_step_post_hook(failing_step)
    with pytest.raises(RuntimeError, match="step failed"), groups_held_out(optimizer, "policy"):
        optimizer.step()
    handle.remove()
    assert optimizer.param_groups is groups

    unnamed = torch.optim.AdamW([policy, critic])
    with pytest.raises(ValueError, match="No parameter group of the optimizer is named 'policy'"):
        with groups_held_out(unnamed, "policy"):
            pass


@pytest.mark.parametrize(
    "setup, refused",
    [
        ({"fsdp_version": 1}, "FSDP version 1 is not supported"),
        ({"fsdp_version": 2, "use_static_cache_engine": True}, "use_static_cache_engine=True cannot sample"),
        ({"fsdp_version": 2, "use_static_cache_engine": True, "processes": 1}, None),
        ({"fsdp_version": 2}, None),
        # Layers replayed under the adapter active in backward; Adam's state saved under other names.
        ({"fsdp_version": 2, "activation_checkpointing": True}, "fsdp_activation_checkpointing is not supported"),
        ({"zero_stage": 3, "use_transformers_continuous_batching": True, "gather": False}, "ZeRO-3 shards"),
        ({"zero_stage": 3, "use_transformers_continuous_batching": True, "gather": True}, None),
        ({"zero_stage": 2, "use_transformers_continuous_batching": True, "gather": False}, None),
        ({"zero_stage": 0}, "ZeRO stage 0 is not supported.*zero_stage 1, 2 or 3"),
        ({"zero_stage": 1}, None),
    ],
)
def test_setups_that_would_clip_apart_or_hang_are_refused(tmp_path, monkeypatch, setup, refused):
    """`check_distributed_setup` reads the accelerator's plugins: here a stand-in with their attributes (FSDP is
    set up on GPUs only, FSDP1's wrapping needs one). The engines that stop each process at its own last completion
    would leave the others waiting in a layer's all-gather."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from helpers import make_args

    from trl_vapo.distributed import check_distributed_setup

    setup = dict(setup)
    processes = setup.pop("processes", 2)
    fsdp_version, zero_stage = setup.pop("fsdp_version", None), setup.pop("zero_stage", None)
    checkpointing = setup.pop("activation_checkpointing", False)
    state_dict_type = setup.pop("state_dict_type", "StateDictType.FULL_STATE_DICT")
    args = make_args(tmp_path, ds3_gather_for_generation=setup.pop("gather", True), **setup)
    monkeypatch.setenv("WORLD_SIZE", str(processes))  # what the launcher sets (after the config: it would connect)
    state = SimpleNamespace(
        fsdp_plugin=SimpleNamespace(
            fsdp_version=fsdp_version, activation_checkpointing=checkpointing, state_dict_type=state_dict_type
        ),
        deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage, deepspeed_config={}),
    )
    kind = DistributedType.FSDP if fsdp_version else DistributedType.DEEPSPEED
    accelerator = SimpleNamespace(num_processes=processes, distributed_type=kind, state=state)
    if refused is None:
        check_distributed_setup(accelerator, args)
    else:
        with pytest.raises(ValueError, match=refused):
            check_distributed_setup(accelerator, args)


def test_a_sharded_state_dict_type_is_said_to_be_written_whole(tmp_path, monkeypatch, caplog):
    """accelerate's `fsdp_state_dict_type: SHARDED_STATE_DICT` was ignored without a word: every checkpoint gathers
    the whole weights and optimizer state on the main process."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from helpers import make_args

    from trl_vapo.distributed import check_distributed_setup

    args = make_args(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")  # what the launcher sets (after the config: it would connect)
    for kind, warned in (("StateDictType.SHARDED_STATE_DICT", True), ("StateDictType.FULL_STATE_DICT", False)):
        plugin = SimpleNamespace(fsdp_version=2, activation_checkpointing=False, state_dict_type=kind)
        state = SimpleNamespace(fsdp_plugin=plugin, deepspeed_plugin=None)
        caplog.clear()
        with caplog.at_level("WARNING"):
            check_distributed_setup(
                SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP, state=state), args
            )
        assert ("SHARDED_STATE_DICT is not supported" in caplog.text) == warned


def test_the_gradient_norm_is_reduced_on_the_process_device_wherever_its_fragments_are():
    """NCCL refuses a CPU tensor. A rank without fragments of a side's gradients summed on the CPU, and so did one
    whose fragments are on the CPU (ZeRO's optimizer offload: each fragment a view of the CPU gradient buffer;
    stood in for by a parameter with ZeRO-1/2's mapping to one, the "meta" device standing in for the GPU)."""
    from types import SimpleNamespace

    from trl_vapo.distributed import clip_deepspeed_gradients_

    param = torch.nn.Parameter(torch.zeros(3))
    offloaded = torch.tensor([1.0, 2.0, 2.0])
    address = SimpleNamespace(start=0, numel=3)
    param._hp_mapping = SimpleNamespace(get_lp_grad_fragment=lambda index: offloaded, lp_fragment_address=address)
    param._index_in_param_group = 0
    seen = []
    for params in ([], [param]):
        clip_deepspeed_gradients_(params, None, lambda t: seen.append(t.device) or t, device="meta")
    assert seen == [torch.device("meta")] * 2
    norm = clip_deepspeed_gradients_([param], 1.5, lambda t: t, device="cpu")
    assert norm.item() == 3.0 and torch.allclose(offloaded, torch.tensor([0.5, 1.0, 1.0]), atol=1e-5)  # clipped


def test_the_bf16_optimizers_whole_gradients_give_each_rank_its_partition():
    """DeepSpeed's BF16 optimizer (ZeRO-1 with bf16 and grad_accum_dtype fp32) hands every rank each parameter's whole
    gradient: a parameter spanning two ranks' partitions was counted whole on both (its norm sqrt(2) too large).
    Stand-ins with DeepSpeed's mapping attributes: the two ranks' views of one parameter, each owning half."""
    from types import SimpleNamespace

    from trl_vapo.distributed import deepspeed_local_gradients

    whole = torch.tensor([1.0, 2.0, 2.0, 4.0])  # the BF16 optimizer's flat float32 gradient of a 2 x 2 parameter
    param = torch.nn.Parameter(torch.zeros(2, 2))
    param._index_in_param_group = 0
    parts = []
    for start in (0, 2):  # rank 0's mapping, then rank 1's
        address = SimpleNamespace(start=start, numel=2)
        param._hp_mapping = SimpleNamespace(get_lp_grad_fragment=lambda index: whole, lp_fragment_address=address)
        parts += list(deepspeed_local_gradients([param]))
    assert torch.equal(torch.cat(parts), whole)
    parts[1].mul_(0.5)  # a view: clipping reaches the optimizer's buffer
    assert whole.tolist() == [1.0, 2.0, 1.0, 2.0]


def test_measuring_a_zero3_gradient_norm_writes_nothing_back(monkeypatch):
    """Under ZeRO-3 each fragment is a copy of this rank's partition (host to device and back under offload): the
    norm's pass wrote each back unchanged. Now only clipping writes. DeepSpeed's get and set of a partition stood in
    for (its real ones run in the ZeRO-3 launches above, which clip)."""
    import deepspeed.utils

    from trl_vapo.distributed import clip_deepspeed_gradients_

    param = torch.nn.Parameter(torch.zeros(2))
    param.ds_id = 0
    partition, written = {"grad": torch.tensor([3.0, 4.0])}, []
    monkeypatch.setattr(deepspeed.utils, "safe_get_local_grad", lambda p: partition["grad"].clone())

    def set_partition(param, grad):
        written.append(grad)
        partition["grad"] = grad

    monkeypatch.setattr(deepspeed.utils, "safe_set_local_grad", set_partition)
    assert clip_deepspeed_gradients_([param], 10.0, lambda t: t).item() == 5.0 and written == []
    clip_deepspeed_gradients_([param], 1.0, lambda t: t)
    assert len(written) == 1 and torch.allclose(partition["grad"], torch.tensor([0.6, 0.8]), atol=1e-5)


def test_a_dropped_step_under_zero12_optimizer_offload_is_seen_as_an_overflow():
    """ZeRO-1/2 with optimizer offload decides to skip a step from what it recorded while copying the gradients to the
    CPU: the `local_overflow` flag (bf16, fp16) and each parameter's norm, whose NaN sum is an overflow (float32). The
    NaN that `_drop_update` writes afterwards went unseen, and was stepped. Its copies are waited for before the
    partitions are touched. Stand-ins with the attributes DeepSpeed's optimizers have (offload needs DeepSpeed's CPU
    Adam, and a skipped step's real check a GPU): accelerate's wrapper > the ZeRO optimizer > the torch optimizer."""
    from types import SimpleNamespace

    from trl_vapo.distributed import mark_offload_overflow, settle_offloaded_gradients

    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    for offloaded in (True, False):
        waited = []
        norms = {0: torch.tensor(1.5), 1: torch.tensor(0.5)}
        zero = SimpleNamespace(cpu_offload=offloaded, local_overflow=False, norm_for_param_grads=norms, optimizer=adam)
        zero._wait_for_offload_copies = functools.partial(waited.append, True)
        settle_offloaded_gradients(SimpleNamespace(optimizer=zero))
        mark_offload_overflow(SimpleNamespace(optimizer=zero))
        assert zero.local_overflow == offloaded and waited == [True] * offloaded
        total = sum(norm.item() ** 2 for norm in norms.values())  # as DeepSpeed's norm over the offloaded grads
        assert (total != total) == offloaded  # NaN
    mark_offload_overflow(adam)  # no DeepSpeed: nothing to set
    settle_offloaded_gradients(adam)


def test_zero3_weights_are_gathered_for_saving_one_module_at_a_time(tiny_model_dir, monkeypatch):
    """What a ZeRO-3 checkpoint or `save_model` writes: the model's state dict (tied weights under both names, the
    persistent buffers), gathered module by module (one gather of every parameter put the whole model on each GPU).
    Here the weights are whole (no ZeRO-3 process group on one CPU process), so the gathers read them as they are;
    the ZeRO-3 runs above save through the same function with the weights partitioned."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from trl_vapo.distributed import zero3_full_state_dict

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.register_buffer("counter", torch.arange(3))  # a persistent buffer: saved too
    gathered, gather = [], deepspeed.zero.GatheredParameters

    def recording(params, *args, **kwargs):
        gathered.append(list(params))
        return gather(gathered[-1], *args, **kwargs)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", recording)
    state = zero3_full_state_dict(model, main=True)
    expected = model.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
    assert zero3_full_state_dict(model, main=False) is None
    owners = {id(p): name for name, module in model.named_modules() for p in module.parameters(recurse=False)}
    assert max(len(params) for params in gathered) <= 2  # a linear layer's weight and bias, at most
    assert all(len({owners[id(p)] for p in params}) <= 1 for params in gathered)


def test_a_lora_policys_frozen_base_is_not_gathered_for_saving(tiny_model_dir, tmp_path, monkeypatch):
    """Under ZeRO-3 a save gathered the whole model onto the main process, the LoRA policy's frozen base too (a 70B
    base: 140 GB at every checkpoint), to write its adapters: the weights no save writes are not gathered, and the
    policy, its critic and their value head are written as from the whole weights (the embeddings kept: peft writes
    them with an adapter that targets them, modules_to_save's copies train). One CPU process, as above."""
    import deepspeed
    from helpers import digit_fraction, make_args, peft_actor_critic, prompts_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from trl_vapo import VAPOTrainer
    from trl_vapo.distributed import zero3_full_state_dict
    from trl_vapo.modeling import ActorCritic

    model = peft_actor_critic(tiny_model_dir, modules_to_save=["lm_head"])
    unsaved = model.weights_not_saved()
    gathered, gather = [], deepspeed.zero.GatheredParameters

    def recording(params, *args, **kwargs):
        gathered.extend(params)
        return gather(params, *args, **kwargs)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", recording)
    state = zero3_full_state_dict(model, main=True, skip=unsaved)
    names = {id(p): name for name, p in model.named_parameters()}
    assert unsaved and not {names[id(p)] for p in gathered} & unsaved
    assert sum(p.numel() for p in gathered) < 0.5 * sum(p.numel() for p in model.parameters())
    assert any("embed_tokens" in names[id(p)] for p in gathered)
    for layout, weights in (("gathered", state), ("whole", model.state_dict())):
        model.save_policy(tmp_path / layout, weights)
        model.save_critic(tmp_path / layout / "critic", weights)
    for saved in ("adapter_model.safetensors", "critic/adapter_model.safetensors", "critic/value_head.safetensors"):
        ours, whole = load_file(tmp_path / "gathered" / saved), load_file(tmp_path / "whole" / saved)
        assert ours.keys() == whole.keys() and all(torch.equal(ours[k], whole[k]) for k in whole), saved
    # The trainer's saves leave them out (here, on one process, nothing is gathered: the skip is what is passed).
    import trl_vapo.checkpoint

    skips = []
    monkeypatch.setattr(
        trl_vapo.checkpoint, "gathered_state_dict", lambda model, accelerator, skip: skips.append(skip)
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    args = make_args(tmp_path / "run", max_steps=1)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=lora)
    trainer.save_model(str(tmp_path / "saved"))
    assert skips == [trainer.actor_critic.weights_not_saved()] and skips[0]
    whole_policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # full fine-tuning: every weight is written
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    assert ActorCritic(whole_policy, critic=critic).weights_not_saved() == set()


def test_a_deepspeed_configs_auto_values_follow_a_field_set_after_the_config_was_built(tmp_path):
    """transformers fills a DeepSpeed config's "auto" values as the config is built: a gradient_accumulation_steps set
    after it (as TrainingArguments are set) left DeepSpeed accumulating over the old value, and VAPO over the new one;
    a value the DeepSpeed config gives, which the new field contradicts, is refused as at construction."""
    from trl_vapo import VAPOConfig

    sizes = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    auto = {"zero_optimization": {"stage": 2}} | {key: "auto" for key in sizes}
    fields = dict(per_device_train_batch_size=8, num_generations=4, report_to="none")
    args = VAPOConfig(output_dir=str(tmp_path), deepspeed=auto, **fields)
    args.gradient_accumulation_steps = 4
    args.check_again()
    filled = args.deepspeed_plugin.hf_ds_config.config
    assert [filled[key] for key in sizes] == [8, 4, 32] and args.generation_batch_size == 32
    args = VAPOConfig(output_dir=str(tmp_path), deepspeed={**auto, "gradient_accumulation_steps": 1}, **fields)
    args.gradient_accumulation_steps = 4
    with pytest.raises(ValueError, match=r"contradict VAPOConfig's: .*gradient_accumulation_steps"):
        args.check_again()


def test_the_schedules_write_the_rates_of_the_optimizer_deepspeeds_offload_swaps_in(monkeypatch):
    """Under DeepSpeed's optimizer offload accelerate replaces the torch AdamW the schedules were built on by a
    DeepSpeedCPUAdam over its groups (`map_pytorch_optim_to_deepspeed`); a resume's `load_state_dict` gave that one
    new group dicts, and the schedules went on writing the replaced AdamW's: every rate froze (the policy's at 0 where
    its warm-up began after the resume). accelerate's own mapping runs; DeepSpeedCPUAdam needs its compiled op, so a
    torch Adam stands in for it, and a `SimpleNamespace` for the ZeRO optimizer around it."""
    from types import SimpleNamespace

    import deepspeed.ops.adam
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed

    from trl_vapo.distributed import schedule_the_stepping_optimizer
    from trl_vapo.optim import side_schedules, start_actor_schedule

    class CPUAdamStandIn(torch.optim.Adam):  # DeepSpeedCPUAdam's signature
        def __init__(self, params, lr=1e-3, weight_decay=0.0, adamw_mode=True, **kwargs):
            super().__init__(params, lr=lr, weight_decay=weight_decay)

    monkeypatch.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam", CPUAdamStandIn)
    policy, critic = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    adamw = torch.optim.AdamW([{"params": [policy], "name": "policy"}, {"params": [critic]}], lr=1e-3)
    scheduler = side_schedules(adamw, "linear", lambda total: 4, 10, 5, None)  # a 4-step warm-up each
    live = map_pytorch_optim_to_deepspeed(adamw)
    assert type(live) is CPUAdamStandIn and live is not adamw
    placed = SimpleNamespace(optimizer=SimpleNamespace(optimizer=live))  # accelerate's wrapper > ZeRO's > the CPU Adam
    schedule_the_stepping_optimizer(scheduler, placed)
    live.load_state_dict(live.state_dict())  # a resume: ZeRO's checkpoint load gives the live groups new dicts
    start_actor_schedule(scheduler, live, 0)
    rates = []
    for _ in range(3):
        live.step()
        scheduler.step()
        rates.append([group["lr"] for group in live.param_groups])
    assert rates[-1] == scheduler.get_last_lr()
    assert [r[0] for r in rates] == pytest.approx([2.5e-4, 5e-4, 7.5e-4])  # the actor's warm-up, moving
