"""A small VAPO run for tests that need a real separate process: `torchrun`, `kill -9`, resume.

    python tests/_train_script.py --model DIR --output-dir DIR [--max-steps N] [--resume] [--stall-at STEP]

Every log entry is appended to `<output-dir>/<log-name>-rank<r>.jsonl` as soon as it is logged, so a killed run leaves
what it logged behind. With `--stall-at N`, writing checkpoint N hangs (after its files are written, before it is
published) and `<output-dir>/stalled` appears: the parent can then kill the process mid-checkpoint.
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
    return Dataset.from_list([{"prompt": f"{a:02d}+{b:02d}=", "answer": str(a + b)} for a in range(10, 18) for b in range(10, 18)])


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

    def _write_models(self, directory):
        super()._write_models(directory)
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
    args = parser.parse_args()

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = VAPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.global_batch // world,
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


if __name__ == "__main__":
    main()
