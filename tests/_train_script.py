"""A small VAPO run for tests that need a real separate process: several ranks, `kill -9`, resume.

    python tests/_train_script.py --model DIR --output-dir DIR [--max-steps N] [--resume] [--stall-at STEP]
        [--deepspeed 2|3 | --fsdp2] [--grad-accum N] [--max-grad-norm X] [--save-final [--save-on-main-only]]
        [--num-iterations N] [--critic-num-iterations N] [--weight-decay X] [--dtype D] [--beta X]
        [--dump-state-at STEP ...] [--settings JSON] [--count-critic-forwards]

Every log entry is appended to `<output-dir>/<log-name>-rank<r>.jsonl` as soon as it is logged, so a killed run leaves
what it logged behind. With `--stall-at N`, writing checkpoint N hangs (after its files are written, before it is
published) and `<output-dir>/stalled` appears: the parent can then kill the process mid-checkpoint. With
`--save-final`, the trained policy and critic are saved to `<output-dir>/final` (`save_model`) and
`<output-dir>/steps.json` records the trainer's and DeepSpeed's optimizer-step counts and whether the reference model
is sharded. With `--dump-state-at N`, `<output-dir>/state-<N>.pt` holds the float32 training weights of the policy and
the critic, and the policy's Adam moments and step count, at the end of optimizer step N, gathered from the ZeRO
partitions under DeepSpeed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback

from trl_vapo import VAPOConfig, VAPOTrainer
from trl_vapo.distributed import optimizer_states
from trl_vapo.modeling import _causal_lm
from trl_vapo.signals import TrainingInterrupted


def digit_fraction(prompts, completions, log_metric, **kwargs):
    # A reward function's own metric (TRL's `log_metric`), different on each process (each scores its own prompts):
    # logged as the mean over every process's calls, as GRPOTrainer logs it, it is the one-process run's.
    log_metric("prompts/mean_operands", sum(int(p[:2]) * 100 + int(p[3:5]) for p in prompts) / len(prompts))
    return [2 * sum(ch.isdigit() for ch in c) / max(len(c), 1) - 1 for c in completions]


def prompts():
    # Equal-length prompts: no padding, so one process and two compute the same numbers row by row.
    return Dataset.from_list(
        [{"prompt": f"{a:02d}+{b:02d}=", "answer": str(a + b)} for a in range(10, 18) for b in range(10, 18)]
    )


def force_fsdp2_on_cpu() -> None:
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__

    def init_with_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    state.AcceleratorState.__init__ = init_with_fsdp


def generate_keeps_processes_in_step(policy) -> bool:
    """Whether transformers' generate() on `policy` runs with `synced_gpus` (its own test of it): every process
    takes decode steps until the last one's completions end, which sharded weights gathered layer by layer in each
    step's forward (a collective) need."""
    from transformers.generation import utils

    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    return bool(
        (utils.is_deepspeed_zero3_enabled() or utils.is_fsdp_managed_module(model))
        and utils._get_torch_distributed_world_size() > 1
    )


class JsonlLogger(TrainerCallback):
    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        with self.path.open("a") as f:
            f.write(json.dumps({**logs, "step": state.global_step, "world_zero": state.is_world_process_zero}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def adam_step_count(optimizer, group_name: str) -> int:
    """The Adam step count of the parameter groups named `group_name` (0 before their first step)."""
    counts = {int(state["step"]) for state in optimizer_states(optimizer, group_name) if "step" in state}
    assert len(counts) <= 1, counts
    return counts.pop() if counts else 0


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class StateDump(TrainerCallback):
    """At the end of the chosen optimizer steps, save the float32 training weights and the policy's optimizer state
    (see the docstring)."""

    def __init__(self, steps: list[int]):
        self.steps, self.trainer = set(steps), None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step not in self.steps:
            return
        trainer = self.trainer
        names = {id(p): n for n, p in trainer.actor_critic.named_parameters()}
        inner = trainer.optimizer
        while getattr(inner, "optimizer", None) is not None:
            inner = inner.optimizer
        dump = {"adam_step": adam_step_count(trainer.optimizer, "policy")}
        zero12 = getattr(trainer.optimizer, "optimizer", None)
        if hasattr(zero12, "_lazy_init_hp_params_optimizer_state"):
            # ZeRO-1/2 links each parameter's view of the optimizer state once, after the first group's first step:
            # groups that had no state then (every other group) keep none. Link again, from today's state (this
            # only rebuilds views: nothing of the training changes).
            zero12._hp_optimizer_states_linked = False
            zero12._lazy_init_hp_params_optimizer_state()
        policy = {id(p) for p in trainer.actor_critic.policy_parameters()}
        for param in [*trainer.actor_critic.policy_parameters(), *trainer.actor_critic.critic_parameters()]:
            name, moments = names[id(param)], ("exp_avg", "exp_avg_sq") if id(param) in policy else ()
            if trainer.is_deepspeed_enabled:  # collectives: every rank gathers
                from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

                dump[f"weight/{name}"] = safe_get_full_fp32_param(param).clone()
                for key in moments:  # no state before the policy's first step
                    value = safe_get_full_optimizer_state(param, key) if dump["adam_step"] else None
                    dump[f"{key}/{name}"] = (
                        torch.zeros(param.ds_shape if hasattr(param, "ds_shape") else param.shape)
                        if value is None
                        else value.clone()
                    )
            else:
                dump[f"weight/{name}"] = full(param.detach()).float().clone()
                for key in moments:
                    dump[f"{key}/{name}"] = full(inner.state.get(param, {}).get(key, torch.zeros_like(param))).clone()
        reference = trainer.accelerator.unwrap_model(trainer.ref_model) if trainer.ref_model is not None else None
        for name, param in reference.named_parameters() if reference is not None else ():
            if hasattr(param, "ds_id"):  # partitioned by ZeRO-3: gathered (a collective)
                import deepspeed

                with deepspeed.zero.GatheredParameters([param]):
                    dump[f"weight/reference.{name}"] = param.detach().float().clone()
            else:
                dump[f"weight/reference.{name}"] = full(param.detach()).float().clone()
        if state.is_world_process_zero:  # on the CPU, whatever the device: the tests compare with saved files
            dump = {key: value.cpu() if torch.is_tensor(value) else value for key, value in dump.items()}
            torch.save(dump, Path(args.output_dir) / f"state-{state.global_step}.pt")


class StallingTrainer(VAPOTrainer):
    stall_at: int | None = None
    whole_while_sampling: dict[str, bool] | None = None  # DeepSpeed: which models' weights were whole while sampling

    @contextlib.contextmanager
    def _generation_model(self):
        with super()._generation_model() as policy:
            if (
                self.whole_while_sampling is None
                and self.is_deepspeed_enabled
                and self.actor_critic.critic is not None
            ):

                def whole(model) -> bool:  # a ZeRO-3 parameter gathered holds its `ds_numel` values, else none
                    return all(p.data.numel() == getattr(p, "ds_numel", p.numel()) for p in model.parameters())

                self.whole_while_sampling = {"policy": whole(policy), "critic": whole(self.actor_critic.critic)}
            yield policy

    def _write_models(self, directory, *args, **kwargs):
        super()._write_models(directory, *args, **kwargs)
        if self.stall_at is not None and directory.name.startswith(f".checkpoint-{self.stall_at}."):
            (Path(self.args.output_dir) / "stalled").touch()
            time.sleep(600)


class StopsItself(TrainerCallback):
    """`--stop-at STEP`: each process sends itself SIGTERM once that step ends (as a job's scheduler signals every
    process), and with `--slow-stop SECONDS` the main process's run end (`on_train_end`: a tracker's last upload, a
    callback's) takes that long, then leaves `train_end-rank0` in the output dir."""

    def __init__(self, at: int | None, slow: float, output_dir: Path):
        self.at, self.slow, self.output_dir = at, slow, output_dir

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, args, state, control, **kwargs):
        if self.at is not None and state.is_world_process_zero:
            time.sleep(self.slow)
            (self.output_dir / "train_end-rank0").touch()


def stop_ids(model: str, characters: str) -> list[int]:
    """The tokenizer's EOS and the ids of `characters`: completions of several lengths from a random tiny model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(characters))]


def sharded(model) -> bool:
    """Partitioned by ZeRO-3 (`ds_id`) or sharded by FSDP2 (DTensors), as the policy is."""
    return model is not None and all(hasattr(p, "ds_id") or hasattr(p, "full_tensor") for p in model.parameters())


def report_held_out(trainer, prompts_count: int, path: Path) -> None:
    """`trl-vapo train`'s held-out report on the first `prompts_count` prompts, k=2: this process's answer (None but
    on the main one) and the prompts it sampled, in `path`."""
    from types import SimpleNamespace

    import trl_vapo.evaluation as evaluation
    from trl_vapo.cli import _held_out_report

    sampled, sample = [], evaluation.sample_completions

    def counted(model, tokenizer, prompts, **kwargs):
        sampled.extend(prompts)
        return sample(model, tokenizer, prompts, **kwargs)

    evaluation.sample_completions = counted
    try:
        held_out = prompts().select(range(prompts_count))
        report = _held_out_report(trainer, held_out, SimpleNamespace(eval_k=2), trainer.reward_funcs)
    finally:
        evaluation.sample_completions = sample
    path.write_text(json.dumps({"report": report, "sampled": sorted(set(sampled))}))


def report_held_out_before_training(trainer, prompts_count: int, resume: bool) -> Callable[[Path], None]:
    """`trl-vapo train`'s held-out report of the policy training starts from (under DeepSpeed and FSDP taken as
    training begins, once the models are placed), written to a path after training: as `report_held_out`, and
    whether the models were placed when it sampled."""
    from types import SimpleNamespace

    import trl_vapo.evaluation as evaluation
    from trl_vapo.cli import held_out_report_before_training

    sampled, placed, sample = [], [], evaluation.sample_completions

    def counted(model, tokenizer, prompts, **kwargs):
        sampled.extend(prompts)
        placed.append(trainer.models_placed)
        return sample(model, tokenizer, prompts, **kwargs)

    evaluation.sample_completions = counted
    held_out = prompts().select(range(prompts_count))
    report = held_out_report_before_training(trainer, held_out, SimpleNamespace(eval_k=2), True if resume else None)

    def write(path: Path) -> None:
        evaluation.sample_completions = sample
        record = {"report": report(), "sampled": sorted(set(sampled)), "placed": bool(placed) and all(placed)}
        path.write_text(json.dumps(record))

    return write


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--value-pretrain-steps", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stall-at", type=int)
    parser.add_argument("--signal-repeat-window", type=float, help="trl_vapo.signals.SIGNAL_REPEAT_WINDOW, seconds")
    parser.add_argument("--stop-at", type=int, help="every process sends itself SIGTERM as this step ends")
    parser.add_argument("--slow-stop", type=float, default=0.0, help="with --stop-at: the main process's run end's s")
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--log-name", default="logs")
    parser.add_argument("--deepspeed", type=int, choices=(2, 3), help="ZeRO stage (DeepSpeed through accelerate)")
    parser.add_argument(
        "--deepspeed-launcher",
        action="store_true",
        help="with --deepspeed: configured as `accelerate launch` with a DeepSpeed config file configures it (TRL's "
        "zero3.yaml: zero3_init_flag), in the environment, not VAPOConfig(deepspeed=...)",
    )
    parser.add_argument("--reward-model", help="a reward model's folder, scored with digit_fraction")
    parser.add_argument("--no-ds3-gather", action="store_true", help="ZeRO-3: generate with the weights sharded")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--fsdp2", action="store_true", help="FSDP2 (forced on CPU processes, see the docstring)")
    parser.add_argument("--save-final", action="store_true")
    parser.add_argument("--save-on-main-only", action="store_true", help="--save-final from the main process alone")
    parser.add_argument("--num-iterations", type=int, default=2)
    parser.add_argument("--critic-num-iterations", type=int)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--dump-state-at", type=int, nargs="*", default=[])
    parser.add_argument("--dtype", help="the dtype to load the model in (model_init_kwargs)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (a reference model when > 0)")
    parser.add_argument("--sync-ref-steps", type=int, help="sync_ref_model every this many steps (with --beta)")
    parser.add_argument("--stop-chars", default="", help="characters that also end a completion (lengths vary)")
    parser.add_argument("--positive-threshold", type=float, help="positive_reward_threshold (default VAPOConfig's)")
    parser.add_argument("--eval-prompts", type=int, default=0, help="evaluate on this many prompts every --eval-steps")
    parser.add_argument("--eval-steps", type=int, default=4, help="eval_steps (none during value pretraining)")
    parser.add_argument("--eval-generations", type=int, default=2, help="num_generations_eval")
    parser.add_argument("--log-completions", action="store_true", help="print every rollout's completions table")
    parser.add_argument("--held-out", type=int, default=0, help="`trl-vapo train`'s report on this many prompts")
    parser.add_argument("--settings", type=json.loads, default={}, help="more VAPOConfig fields, as a JSON object")
    parser.add_argument("--lora", action="store_true", help="LoRA on q_proj and v_proj: the critic an adapter too")
    parser.add_argument(
        "--count-critic-forwards",
        action="store_true",
        help="count them, with and without a gradient, and with the policy's (steps.json)",
    )
    args = parser.parse_args(argv)
    if args.fsdp2:
        force_fsdp2_on_cpu()
    if args.signal_repeat_window is not None:
        import trl_vapo.signals

        trl_vapo.signals.SIGNAL_REPEAT_WINDOW = args.signal_repeat_window

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed = None
    if args.deepspeed:
        # DeepSpeed's CPU backend JIT-compiles its shared-memory op (`deepspeed_shm_comm`, ~25 s, again in every fresh
        # clone) when the first process group starts; only `inference_all_reduce` (tensor-parallel inference) uses it,
        # never training, so these runs go without it: their all-reduces are gloo's either way.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed = {
            "zero_optimization": {"stage": args.deepspeed},
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        }
        if args.deepspeed_launcher:  # `accelerate launch`'s environment for `--config_file zero3.yaml` (or zero2)
            deepspeed = None
            os.environ.update(
                ACCELERATE_USE_DEEPSPEED="true",
                ACCELERATE_DEEPSPEED_ZERO_STAGE=str(args.deepspeed),
                ACCELERATE_DEEPSPEED_ZERO3_INIT="true",
                ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE="none",
                ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE="none",
                ACCELERATE_MIXED_PRECISION="no",
            )
    fsdp = {}
    if args.fsdp2:
        fsdp = {
            "fsdp": "full_shard",
            # As TRL's fsdp2.yaml: the weights loaded on the main process, sent to the others' shards (a load that
            # unties the tiny model's tied head from its embeddings unless the prepared model ties them again).
            "fsdp_config": {
                "fsdp_version": 2,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "cpu_ram_efficient_loading": True,
            },
        }
    config = VAPOConfig(
        output_dir=args.output_dir,
        bf16=False,  # float32 on a GPU too (bf16 is its default there), as every run here and its reference
        deepspeed=deepspeed,
        **fsdp,
        gradient_accumulation_steps=args.grad_accum,
        max_grad_norm=args.max_grad_norm,
        per_device_train_batch_size=args.global_batch // world // args.grad_accum,
        num_generations=4,
        max_completion_length=8,
        max_steps=args.max_steps,
        value_pretrain_steps=args.value_pretrain_steps,
        value_pretrain_patience=None,
        learning_rate=1e-3,
        critic_learning_rate=1e-3,
        num_iterations=args.num_iterations,
        critic_num_iterations=args.critic_num_iterations,
        weight_decay=args.weight_decay,
        beta=args.beta,
        sync_ref_model=args.sync_ref_steps is not None,
        ref_model_sync_steps=args.sync_ref_steps or 1,
        ds3_gather_for_generation=not args.no_ds3_gather,
        model_init_kwargs={"dtype": args.dtype} if args.dtype else None,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps,
        report_to="none",
        disable_tqdm=True,
        plot_diagnostics=False,  # a second or two per run of matplotlib (its import, two figures twice)
        seed=0,
        generation_kwargs={
            **({"do_sample": False} if args.greedy else {}),
            **({"eos_token_id": stop_ids(args.model, args.stop_chars)} if args.stop_chars else {}),
        }
        or None,
        **({"positive_reward_threshold": args.positive_threshold} if args.positive_threshold is not None else {}),
        # Eight completions per evaluation batch over all processes (so one process and two see the same batches).
        eval_strategy="steps" if args.eval_prompts else "no",
        eval_steps=args.eval_steps,
        num_generations_eval=args.eval_generations,
        per_device_eval_batch_size=8 // world,
        log_completions=args.log_completions,
        num_completions_to_print=None,  # all of them
        **args.settings,
    )
    rank = int(os.environ.get("RANK", "0"))
    StallingTrainer.stall_at = args.stall_at
    dump = StateDump(args.dump_state_at)
    trainer = StallingTrainer(
        model=args.model,
        reward_funcs=[digit_fraction, args.reward_model] if args.reward_model else digit_fraction,
        args=config,
        train_dataset=prompts(),
        eval_dataset=prompts().select(range(args.eval_prompts)) if args.eval_prompts else None,
        callbacks=[
            JsonlLogger(Path(args.output_dir) / f"{args.log_name}-rank{rank}.jsonl"),
            dump,
            StopsItself(args.stop_at, args.slow_stop, Path(args.output_dir)),
        ],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        if args.lora
        else None,
    )
    dump.trainer = trainer
    from trl_vapo.distributed import is_zero3_partitioned

    # The models as built, before `train` places them: partitioned by ZeRO-3's `zero.Init`, the critic could not copy
    # the policy's weights (empty tensors), nor the fingerprints read them.
    built_partitioned = [is_zero3_partitioned(m) for m in trainer.actor_critic.children()]
    # The LM heads run as modules only to sample (one position at a time): log-probs go through them in tiles.
    sequence_logits = []
    for model in (trainer.actor_critic.policy, trainer.ref_model):
        if model is not None:
            _causal_lm(model).get_output_embeddings().register_forward_hook(
                lambda module, inputs, out: sequence_logits.append(out.shape[1]) if out.shape[1] > 1 else None
            )
    critic_forwards = {"with_grad": 0, "without_grad": 0, "with_the_policys": 0}
    if args.count_critic_forwards:
        forward = trainer.actor_critic.forward

        def counted(*inputs, **kwargs):
            if kwargs.get("with_values", True):
                critic_forwards["with_grad" if torch.is_grad_enabled() else "without_grad"] += 1
                # (a forward with a gradient for both sides: both sides' activations alive until its backward)
                critic_forwards["with_the_policys"] += torch.is_grad_enabled() and kwargs.get("with_policy", True)
            return forward(*inputs, **kwargs)

        trainer.actor_critic.forward = counted
    if args.held_out:  # as `trl-vapo train` reports before training
        write_before = report_held_out_before_training(trainer, args.held_out, args.resume)
    try:
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    except TrainingInterrupted as stopped:  # SIGTERM / SIGINT: exit as `trl-vapo train` does
        trainer.accelerator.end_training()
        raise SystemExit(stopped.exit_code) from None
    if args.held_out:
        write_before(Path(args.output_dir) / f"held_out_before-rank{rank}.json")
    if args.held_out:  # as `trl-vapo train` reports after training, on every process
        report_held_out(trainer, args.held_out, Path(args.output_dir) / f"held_out-rank{rank}.json")
    if args.save_final:
        if rank == 0 or not args.save_on_main_only:  # (a script's `if trainer.accelerator.is_main_process:`)
            trainer.save_model(str(Path(args.output_dir) / "final"))
        engine = trainer.model_wrapped if trainer.is_deepspeed_enabled else None
        if rank == 0:
            steps = {
                "trainer": trainer.state.global_step,
                "deepspeed": engine.global_steps if engine else None,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "sequence_logits_built": len(sequence_logits),
                # Partitioned by ZeRO-3 (`ds_id`) or sharded by FSDP2 (DTensors), as the policy is.
                "built_partitioned": built_partitioned,
                "whole_while_sampling": trainer.whole_while_sampling,
                "reference_sharded": sharded(trainer.ref_model),
                "reward_model_sharded": [sharded(f.model) for f in trainer.reward_funcs if hasattr(f, "model")],
                "generate_synced": generate_keeps_processes_in_step(trainer.actor_critic.policy),
                "critic_forwards": critic_forwards,  # (with --count-critic-forwards)
            }
            (Path(args.output_dir) / "steps.json").write_text(json.dumps(steps))
    trainer.accelerator.end_training()  # as `trl-vapo train` ends: the process group destroyed before exit


IMPORTED_IN = os.getpid()  # the process that imported this module: the fork server, for a forked run


def main_in_child(argv: list[str], stdout: str, stderr: str, default_sigint: bool, env: dict[str, str]) -> None:
    """`main(argv)` in a process forked from a server that has imported this module (`tests/_script_process.py`): the
    same run as `python _train_script.py ARGV`, its output in the files `stdout` and `stderr`, without the five
    seconds of imports that every fresh interpreter spends."""
    import sys

    _set_up_child(stdout, stderr, default_sigint, env)
    sys.argv = [__file__, *argv]
    main(argv)


def exec_in_child(code: str, argv: list[str], cwd: str, stdout: str, stderr: str, env: dict[str, str]) -> None:
    """`python -c CODE ARGV` run in `cwd`, in a process forked from the server as `main_in_child` is: the code as a
    script's `__main__`, its output in the files `stdout` and `stderr`."""
    import sys

    _set_up_child(stdout, stderr, False, env)
    os.chdir(cwd)
    sys.argv = ["-c", *argv]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


def _set_up_child(stdout: str, stderr: str, default_sigint: bool, env: dict[str, str]) -> None:
    import signal

    if IMPORTED_IN == os.getpid():  # imported here, not inherited: the server's preload failed, and every run pays
        raise RuntimeError("the fork server did not import _train_script (see tests/_script_process.py)")
    if torch.cuda._is_in_bad_fork():  # the server initialised CUDA, which a forked process cannot use again
        raise RuntimeError("the fork server initialised CUDA while importing _train_script: nothing may touch the GPU")
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    if default_sigint:  # as a terminal leaves it; pytest-xdist's workers ignore it, and so would every child
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.update(env)  # a rank's RANK, WORLD_SIZE, MASTER_PORT... (`_script_process.run_ranks`)


if __name__ == "__main__":
    main()
