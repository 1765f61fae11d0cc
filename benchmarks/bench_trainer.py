"""Throughput of `trl_vapo.VAPOTrainer` against TRL's `GRPOTrainer`, side by side, same work per optimizer step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_trainer.py            # --steps 20 --warmup 3 --repeats 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_trainer.py --models demo,tiny256 --repeats 3

Every measured run is a fresh subprocess with one intra-op thread (`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`),
and the runs are interleaved (VAPO, GRPO, VAPO value pretraining, then the next repeat in a rotated order) so that
background load on a shared machine hits every trainer alike. A run trains `--steps` optimizer steps; the first
`--warmup` are dropped; its score is the mean wall time of the others, measured between consecutive `on_step_end`
callbacks (so a step includes its generation round; a mean, as tokens per second is total tokens over total time: a
median left out VAPO's recurring slower steps). The table gives the median over repeats of those means, the ratio
against GRPO, and completion tokens generated per second (the ratio of work done per second: the trainers' samples
differ in length where their random states do).

Both trainers get the same model, data, reward function, batch sizes and sampling settings (see `common_args`).
One rollout per optimizer step (`steps_per_generation = gradient_accumulation_steps`, `num_iterations = 1`), TRL's
default regime. Each worker also times the parts of a step (generation, reward, old log-probs / values, GAE,
update forward, loss, backward, gradient clipping, optimizer, logging) by wrapping the trainers' methods from the
outside (nothing in `trl_vapo` is changed); the times are exclusive (a timed call inside another timed call is
subtracted from it), cost a few microseconds per step, and `--breakdown` prints each part's mean over steps (a
part that runs every few steps, such as logging, counts its share).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _launch import launch_worker, run_dir, versions

ROOT = Path(__file__).resolve().parent.parent
TRAINERS = ("vapo", "grpo", "vapo-pretrain")
MODELS = {
    # name: None for the bundled demo model, else kwargs of trl_vapo.tiny.build_tiny_llama (randomly initialised)
    "demo": None,
    "tiny256": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "max_position_embeddings": 512},
}


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one training run in this process
# ---------------------------------------------------------------------------------------------------------------------


class _Timers:
    """Exclusive wall time per label, accumulated per optimizer step."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []  # child time accumulated under each open timer
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, name: str, label, when=None):
        """Replace `owner.name` by a timed version. `label` is a string, or a function of the call's grad mode."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if when is not None and not when():
                return original(*args, **kwargs)
            import torch

            key = label if isinstance(label, str) else label(torch.is_grad_enabled())
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                child = self.stack.pop()
                self.current[key] += elapsed - child
                self.calls[key] += 1
                if self.stack:
                    self.stack[-1] += elapsed

        setattr(owner, name, timed)

    def flush(self) -> dict[str, float]:
        out, self.current = dict(self.current), defaultdict(float)
        return out


def _instrument(kind: str, timers: _Timers) -> None:
    import accelerate
    import accelerate.optimizer
    import trl.trainer.grpo_trainer as grpo_module

    import trl_vapo.modeling as modeling
    import trl_vapo.scoring as scoring
    import trl_vapo.trainer as vapo_module

    # Shared by both trainers.
    timers.wrap(accelerate.Accelerator, "backward", "backward")
    timers.wrap(accelerate.Accelerator, "clip_grad_norm_", "grad clip")
    timers.wrap(accelerate.optimizer.AcceleratedOptimizer, "step", "optimizer")
    if kind.startswith("vapo"):
        T = vapo_module.VAPOTrainer
        timers.wrap(T, "_tokenize_prompts", "tokenize")
        timers.wrap(T, "_generate", "generate")
        timers.wrap(scoring.RewardScorer, "score", "reward")
        timers.wrap(modeling.ActorCritic, "forward", lambda grad: "update forward" if grad else "old logp/values fwd")
        for name in ("decoupled_gae", "masked_whiten", "terminal_rewards"):
            timers.wrap(vapo_module, name, "GAE + whiten")
        timers.wrap(vapo_module, "vapo_loss", "loss")
        timers.wrap(vapo_module, "rollout_metrics", "metrics")
        timers.wrap(T, "_record_step", "metrics")
        timers.wrap(T, "_clip_gradients", "grad clip")
        timers.wrap(T, "log", "logging")
    else:
        G = grpo_module.GRPOTrainer
        timers.wrap(G, "_tokenize_prompts", "tokenize")
        timers.wrap(G, "_generate_single_turn", "generate")
        timers.wrap(G, "_calculate_rewards", "reward")
        timers.wrap(G, "_generate_and_score_completions", "advantages + metrics")
        timers.wrap(
            G, "_get_per_token_logps_and_entropies", lambda grad: "update forward" if grad else "old logp/values fwd"
        )
        timers.wrap(G, "_compute_loss", "loss")
        timers.wrap(G, "log", "logging")


def _count_tokens(reward, counter: list[int]):
    @functools.wraps(reward)
    def counted(*args, completion_ids=None, **kwargs):
        counter[0] += sum(len(c) for c in completion_ids or [])
        return reward(*args, completion_ids=completion_ids, **kwargs)

    return counted


def run_worker(opts) -> dict:
    import torch

    torch.set_num_threads(1)
    from transformers import TrainerCallback

    from trl_vapo.demo.data import build_split
    from trl_vapo.rewards import math_reward

    timers = _Timers()
    _instrument(opts.trainer, timers)
    dataset = build_split("train", 4096)
    if opts.terms:
        # One problem size only: every step then generates about the same number of tokens in both trainers
        # (which draw their prompts in different orders), so per-step times compare like with like.
        dataset = dataset.filter(lambda row: row["prompt"].count("+") + 1 == opts.terms)
    tokens = [0]
    reward = _count_tokens(math_reward, tokens)
    out_dir = run_dir(f"bench_{opts.trainer}_")
    common = common_args(opts, out_dir)

    if opts.trainer.startswith("vapo"):
        from trl_vapo import VAPOConfig, VAPOTrainer

        if opts.trainer == "vapo":
            extra = {"value_pretrain_steps": 0, "max_steps": opts.steps}
        else:  # value pretraining only: more pretraining rollouts than we measure, no early stop
            extra = {"value_pretrain_steps": opts.steps + 1, "value_pretrain_patience": None, "max_steps": 1}
        args = VAPOConfig(**common, **extra, plot_diagnostics=False)  # it times training; GRPOTrainer draws no PNGs
        trainer = VAPOTrainer(model=opts.model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
        phase = lambda: trainer.progress.phase  # noqa: E731
    else:
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(
            **common,
            max_steps=opts.steps,
            # GRPOConfig defaults that would add work VAPOTrainer does not do, set to what VAPOTrainer does (and
            # in common_args: gradient_checkpointing=False, GRPO's default True; bf16=False, GRPO's default True):
            disable_dropout=True,  # VAPOConfig default True (GRPO False); the demo model has no dropout anyway
            loss_type="dapo",  # token-level mean over the optimizer step's tokens, as VAPO's loss_type="token"
            epsilon_high=0.28,  # clip-higher, as VAPO's default
            log_completions=False,  # default False; True would print/gather completion tables
            mask_truncated_completions=False,  # default False, as VAPO's
            cast_lm_head_to_fp32=False,  # default False
            use_liger_kernel=False,  # default False
            use_vllm=False,  # default False: both generate with transformers' generate()
            top_entropy_quantile=1.0,  # default 1.0 (no entropy mask); entropy is still computed, as VAPO does
            scale_rewards="group",  # default; negligible compute
        )
        trainer = GRPOTrainer(model=opts.model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
        phase = lambda: "rl"  # noqa: E731

    record: dict = {"step_s": [], "tokens": [], "phase": [], "parts": []}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.last = time.perf_counter()
            self.tokens = 0
            timers.flush()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            record["step_s"].append(now - self.last)
            record["tokens"].append(tokens[0] - self.tokens)
            record["phase"].append(phase())
            record["parts"].append(timers.flush())
            self.last, self.tokens = now, tokens[0]

    trainer.add_callback(StepTimer())
    n_params = sum(p.numel() for p in getattr(trainer, "actor_critic", trainer.model).parameters())  # VAPO: both sides
    trainer.train()
    record["params"] = n_params
    record["trainer"] = opts.trainer
    record["log_history"] = trainer.state.log_history
    return record


def common_args(opts, out_dir: str) -> dict:
    """Settings shared verbatim by VAPOConfig and GRPOConfig."""
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=opts.batch_size,
        gradient_accumulation_steps=opts.grad_accum,
        steps_per_generation=opts.grad_accum,  # one generation round per optimizer step
        num_generations=opts.num_generations,
        num_iterations=1,
        max_completion_length=opts.max_completion_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=0.0,
        bf16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        logging_steps=opts.logging_steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=opts.seed,
        dataloader_num_workers=0,
        # The generation engine, under TRL's name in both configs.
        use_transformers_continuous_batching=opts.engine == "continuous_batching",
        # Continuous batching's KV cache, sized alike for both: left to transformers on the CPU, it reserves a share
        # of the machine's memory at every generation call (GRPOTrainer paid about 8 s a step for it; trl-vapo's
        # engine sizes it to the batch by itself, as here).
        transformers_continuous_batching_config=(
            {"num_blocks": _cache_blocks(opts)} if opts.engine == "continuous_batching" else None
        ),
    )


def _cache_blocks(opts) -> int:
    """Pages of the continuous-batching KV cache for one generation call: every completion of a step, each with
    room for a prompt of up to 128 tokens and `max_completion_length` new ones (trl-vapo's engine's own rule)."""
    from transformers.generation import ContinuousBatchingConfig

    per_request = -(-(128 + opts.max_completion_length) // ContinuousBatchingConfig.page_size) + 1
    return opts.batch_size * opts.grad_accum * per_request


# ---------------------------------------------------------------------------------------------------------------------
# Driver: build models, run interleaved subprocesses, print the table
# ---------------------------------------------------------------------------------------------------------------------


def _model_dir(name: str, cache: Path) -> str:
    spec = MODELS[name]
    if spec is None:
        from trl_vapo.demo import MODEL_DIR

        return str(MODEL_DIR)
    target = cache / name
    if not (target / "config.json").is_file():
        from trl_vapo.tiny import build_char_tokenizer, build_tiny_llama

        tokenizer = build_char_tokenizer()
        build_tiny_llama(tokenizer, **spec).save_pretrained(target)
        tokenizer.save_pretrained(target)
    return str(target)


def _launch(opts, trainer: str, model_dir: str) -> dict:
    args = ["--worker", "--trainer", trainer, "--model-dir", model_dir]
    for key in (
        "steps",
        "batch_size",
        "grad_accum",
        "num_generations",
        "max_completion_length",
        "logging_steps",
        "seed",
        "terms",
        "engine",
    ):
        args += [f"--{key.replace('_', '-')}", str(getattr(opts, key))]
    return launch_worker(__file__, args, trainer)


def _summarise(record: dict, warmup: int, want_phase: str) -> dict:
    idx = [i for i, p in enumerate(record["phase"]) if p == want_phase][warmup:]
    steps = [record["step_s"][i] for i in idx]
    toks = [record["tokens"][i] for i in idx]
    # Each part's mean over the steps, so that the parts add up to the mean step ("other" is the rest) and a part
    # that runs every few steps (logging) counts.
    keys = {key for i in idx for key in record["parts"][i]}
    part_means = {k: sum(record["parts"][i].get(k, 0.0) for i in idx) / len(idx) for k in keys}
    part_means["other (untimed)"] = sum(steps) / len(steps) - sum(part_means.values())
    return {
        "median_s": statistics.median(steps),
        "mean_s": sum(steps) / len(steps),
        "tokens_per_s": sum(toks) / sum(steps),
        "tokens_per_step": sum(toks) / len(toks),
        # Completion tokens per second of generation alone (the engine's throughput inside training).
        "gen_tokens_per_s": (sum(toks) / len(toks)) / part_means["generate"] if part_means.get("generate") else 0,
        "parts": part_means,
        "n": len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="demo", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps = steps_per_generation")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=96)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--engine",
        choices=("generate", "continuous_batching"),
        default="generate",
        help="generation engine of both trainers: transformers' generate() or its continuous batching",
    )
    parser.add_argument(
        "--terms",
        type=int,
        default=6,
        help="keep only demo problems with this many terms (same work per step); 0: all sizes",
    )
    parser.add_argument("--breakdown", action="store_true", help="also print the per-part step breakdown")
    parser.add_argument("--json", help="write all raw per-step records here")
    # worker-only
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trainer", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.worker:
        record = run_worker(opts)
        with open(opts.result, "w") as f:
            json.dump(record, f)
        return

    models = opts.models.split(",")
    trainers = opts.trainers.split(",")
    cache = Path(tempfile.gettempdir()) / "trl_vapo_bench_models"
    print(
        f"{versions('torch', 'transformers', 'trl')}, {os.cpu_count()} CPUs, OMP_NUM_THREADS=1 per run, load average "
        f"{os.getloadavg()[0]:.2f} at start"
    )
    print(
        f"per step: {opts.batch_size * opts.grad_accum} completions "
        f"({opts.batch_size * opts.grad_accum // opts.num_generations} "
        f"prompts x {opts.num_generations}), batch {opts.batch_size} x grad_accum {opts.grad_accum}, "
        f"max_completion_length {opts.max_completion_length}, "
        f"demo prompts with {opts.terms or 'any number of'} terms; "
        f"{opts.steps} steps per run, first {opts.warmup} dropped, "
        f"{opts.repeats} repeats interleaved; engine: {opts.engine}"
    )
    raw: dict = defaultdict(list)
    results: dict = defaultdict(list)
    params: dict = {}
    started = time.time()
    for model in models:
        model_dir = _model_dir(model, cache)
        for r in range(opts.repeats):
            order = trainers[r % len(trainers) :] + trainers[: r % len(trainers)]
            for trainer in order:
                record = _launch(opts, trainer, model_dir)
                want = "value_pretrain" if trainer.startswith("vapo-pretrain") else "rl"
                summary = _summarise(record, opts.warmup, want)
                results[(model, trainer)].append(summary)
                raw[f"{model}/{trainer}"].append(record)
                params[(model, trainer)] = record["params"]
                print(
                    f"  [{time.time() - started:6.0f}s] {model:8s} {trainer:14s} repeat {r + 1}: "
                    f"{summary['mean_s']:.3f} s/step, {summary['tokens_per_s']:.0f} tok/s",
                    flush=True,
                )

    print()
    header = (
        f"{'trainer':36s}{'model':10s}{'trainable params':>18s}{'mean s/step':>15s}{'ratio vs GRPO':>15s}"
        f"{'tokens/step':>13s}{'tokens/s':>10s}{'ratio tok/s':>13s}{'gen tok/s':>11s}"
    )
    print(header)
    print("-" * len(header))
    for model in models:
        base = results.get((model, "grpo"))
        base_s = statistics.median(s["mean_s"] for s in base) if base else None
        base_t = statistics.median(s["tokens_per_s"] for s in base) if base else None
        for trainer in trainers:
            runs = results[(model, trainer)]
            med = statistics.median(s["mean_s"] for s in runs)
            tps = statistics.median(s["tokens_per_s"] for s in runs)
            tpst = statistics.median(s["tokens_per_step"] for s in runs)
            gen = statistics.median(s["gen_tokens_per_s"] for s in runs)
            ratio = f"{med / base_s:.2f}x" if base_s else "-"
            ratio_t = f"{tps / base_t:.2f}x" if base_t else "-"
            label = {"vapo": "VAPO", "grpo": "GRPO", "vapo-pretrain": "VAPO (value pretrain)"}[trainer]
            print(
                f"{label:36s}{model:10s}{params[(model, trainer)]:>18,d}{med:>15.3f}{ratio:>15s}{tpst:>13.0f}"
                f"{tps:>10.0f}{ratio_t:>13s}{gen:>11.0f}"
            )
        spread = {t: [round(s["mean_s"], 3) for s in results[(model, t)]] for t in trainers}
        print(f"  per-repeat means (s/step): {spread}")

    if opts.breakdown:
        for model in models:
            print(
                f"\nbreakdown, {model}: seconds per step (exclusive; mean over steps, then median over repeats), "
                "share of the mean step"
            )
            parts = {k for t in trainers for s in results[(model, t)] for k in s["parts"]}
            print(f"{'part':24s}" + "".join(f"{t:>30s}" for t in trainers))
            for part in sorted(parts, key=lambda p: (p == "other (untimed)", p)):
                cells = []
                for t in trainers:
                    values = [s["parts"].get(part, 0.0) for s in results[(model, t)]]
                    total = statistics.median(s["mean_s"] for s in results[(model, t)])
                    v = statistics.median(values)
                    cells.append(f"{v:9.4f} ({100 * v / total:4.1f}%)" if v else "-")
                print(f"{part:24s}" + "".join(f"{c:>30s}" for c in cells))
    print(f"\nload average at end {os.getloadavg()[0]:.2f}; wall time {time.time() - started:.0f} s")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(raw, f)


if __name__ == "__main__":
    main()
