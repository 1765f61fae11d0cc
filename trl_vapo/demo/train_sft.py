"""Train the demo's cold-start policy: a tiny Llama fine-tuned on chains of thought that sometimes slip.

    python -m trl_vapo.demo.train_sft --output-dir trl_vapo/demo/model
    python -m trl_vapo.demo.train_sft --task chains --output-dir benchmarks/models/chains_sft   # the harder variant

Reproduces the model shipped in ``trl_vapo/demo/model`` (one CPU thread, deterministic for a given seed). The
completions come from :func:`trl_vapo.demo.data.sft_examples`, where a share of carries is dropped on purpose, so
the model learns both the correct step and the slip and samples each at about the data's rate: reinforcement
learning then has a gap it can close within a few dozen steps.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch

from ..evaluation import evaluate_policy
from ..rewards import math_reward
from ..tiny import build_char_tokenizer, build_tiny_llama
from . import chains, data

MAX_POSITIONS = 256
"""Room for the longest prompt (27 tokens; chains: 45) plus a generation budget well past the longest completion (83;
chains: 141)."""

TASKS = {"demo": data, "chains": chains}
"""Data modules by ``--task``: each has ``sft_examples`` and ``build_split``."""
EVAL_MAX_NEW_TOKENS = {"demo": 96, "chains": 160}


def tokenize_example(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Token ids of ``prompt + completion + EOS`` and labels that train on the completion and EOS only."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    completion_ids = tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids


def length_bucketed_batches(examples: list[tuple[list[int], list[int]]], batch_size: int, rng: random.Random):
    """Batches of examples of similar length (little padding), in random order; each example is used once."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), rng.random()))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return [[examples[i] for i in batch] for batch in batches]


def collate(batch: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch into ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_token_id)
    labels = torch.full((len(batch), width), -100)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(row_labels)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def learning_rate(step: int, total_steps: int, peak: float, warmup_steps: int) -> float:
    """Linear warm-up to ``peak``, then cosine decay to a tenth of it."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace):
    """Build the tokenizer and model, run the SFT loop, and return both."""
    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(
        tokenizer,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=MAX_POSITIONS,
        seed=args.seed,
    )
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)

    pairs = TASKS[args.task].sft_examples(args.num_examples, seed=args.seed)
    examples = [tokenize_example(tokenizer, p, c) for p, c in pairs]
    batches = length_bucketed_batches(examples, args.batch_size, random.Random(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    warmup_steps = max(1, len(batches) // 20)

    model.train()
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, len(batches), args.learning_rate, warmup_steps)
        loss = model(**collate(batch, tokenizer.pad_token_id)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == len(batches) - 1:
            elapsed = time.perf_counter() - start
            print(f"step {step + 1}/{len(batches)} loss {loss.item():.4f} ({elapsed:.0f}s)", flush=True)
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--task", choices=sorted(TASKS), default="demo", help="demo, or the harder chains variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-examples", type=int, default=96_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--eval-problems", type=int, default=256, help="held-out problems for the final report")
    args = parser.parse_args(argv)
    if args.eval_problems < 1:  # before the minutes of training (the report at the end had nothing to score)
        parser.error(f"--eval-problems must be >= 1, got {args.eval_problems}")

    torch.set_num_threads(1)  # deterministic, and the demo machine's cores are shared
    model, tokenizer = train(args)
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)

    held_out = TASKS[args.task].build_split("held_out", args.eval_problems)
    result = evaluate_policy(
        model,
        tokenizer,
        held_out,
        math_reward,
        k=8,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=EVAL_MAX_NEW_TOKENS[args.task],
    )
    print(
        f"held-out ({result.num_problems} problems): greedy {result.pass_at_1:.3f}, sampled at T=1 "
        f"{result.avg_at_k:.3f}, pass@8 {result.pass_at_k:.3f}, mean length {result.mean_length:.1f} tokens",
        flush=True,
    )


if __name__ == "__main__":
    main()
