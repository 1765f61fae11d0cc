"""A small VAPO run for tests that need a real separate process: `torchrun`, `kill -9`, resume.

    python tests/_train_script.py --model DIR --output-dir DIR [--max-steps N] [--resume] [--stall-at STEP]
        [--deepspeed 2|3 | --fsdp2] [--grad-accum N] [--max-grad-norm X] [--save-final]

Every log entry is appended to `<output-dir>/<log-name>-rank<r>.jsonl` as soon as it is logged, so a killed run leaves
what it logged behind. With `--stall-at N`, writing checkpoint N hangs (after its files are written, before it is
published) and `<output-dir>/stalled` appears: the parent can then kill the process mid-checkpoint. With
`--save-final`, the trained policy and critic are saved to `<output-dir>/final` (`save_model`) and
`<output-dir>/steps.json` records the trainer's and DeepSpeed's optimizer-step counts.

`--fsdp2` runs FSDP2 on CPU processes. accelerate enables FSDP only on GPU-like devices and silently runs plain data
parallelism on CPUs; `force_fsdp2_on_cpu` makes it take the FSDP2 plugin there too. It changes nothing else: the
sharding, the gathers and the trainer are the real ones.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_vapo import VAPOConfig, VAPOTrainer


def digit_fraction(completions, **kwargs):
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


class JsonlLogger(TrainerCallback):
    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        with self.path.open("a") as f:
            f.write(json.dumps({**logs, "step": state.global_step}) + "\n")
            f.flush()
            os.fsync(f.fileno())


class StallingTrainer(VAPOTrainer):
    stall_at: int | None = None

    def _write_models(self, directory, state_dict=None):
        super()._write_models(directory, state_dict)
        if self.stall_at is not None and directory.name == f".checkpoint-{self.stall_at}.tmp":
            (Path(self.args.output_dir) / "stalled").touch()
            time.sleep(600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--value-pretrain-steps", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stall-at", type=int)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--log-name", default="logs")
    parser.add_argument("--deepspeed", type=int, choices=(2, 3), help="ZeRO stage (DeepSpeed through accelerate)")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--fsdp2", action="store_true", help="FSDP2 (forced on CPU processes, see the docstring)")
    parser.add_argument("--save-final", action="store_true")
    args = parser.parse_args()
    if args.fsdp2:
        force_fsdp2_on_cpu()

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
    fsdp = {}
    if args.fsdp2:
        fsdp = {
            "fsdp": "full_shard",
            "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        }
    config = VAPOConfig(
        output_dir=args.output_dir,
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
        num_iterations=2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        generation_kwargs={"do_sample": False} if args.greedy else None,
    )
    rank = int(os.environ.get("RANK", "0"))
    StallingTrainer.stall_at = args.stall_at
    trainer = StallingTrainer(
        model=args.model,
        reward_funcs=digit_fraction,
        args=config,
        train_dataset=prompts(),
        callbacks=[JsonlLogger(Path(args.output_dir) / f"{args.log_name}-rank{rank}.jsonl")],
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.save_final:
        trainer.save_model(str(Path(args.output_dir) / "final"))
        engine = trainer.model_wrapped if trainer.is_deepspeed_enabled else None
        if rank == 0:
            steps = {
                "trainer": trainer.state.global_step,
                "deepspeed": engine.global_steps if engine else None,
                "distributed_type": str(trainer.accelerator.distributed_type),
            }
            (Path(args.output_dir) / "steps.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
