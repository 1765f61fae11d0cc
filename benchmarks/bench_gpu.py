"""VAPO against TRL's GRPOTrainer at real model sizes: step time split, tokens/s and peak GPU memory.

    .venv/bin/python benchmarks/bench_gpu.py                      # on a CUDA GPU: Qwen2.5-0.5B and -1.5B shapes
    .venv/bin/python benchmarks/bench_gpu.py --sizes 0.5B --methods vapo-lora,grpo-lora --steps 3
    .venv/bin/python benchmarks/bench_gpu.py --smoke              # the same code, tiny model, on CPU (a test runs it)
    .venv/bin/python benchmarks/bench_gpu.py --static-memory --sizes 0.5B     # weight/optimizer bytes, any machine
    .venv/bin/python benchmarks/bench_gpu.py --logits-memory --sizes 0.5B     # the log-prob step's memory, any machine
    .venv/bin/python benchmarks/bench_gpu.py --step-memory                    # one fp32 LoRA step's memory, on CPU
    .venv/bin/python benchmarks/bench_gpu.py --adapter-switch --sizes 0.5B    # the critic adapter switch's host time

Models are randomly initialised from configs with the real shapes of Qwen2.5-0.5B and Qwen2.5-1.5B (nothing is
downloaded), with a byte-level BPE tokenizer trained on the spot (the model keeps Qwen's 151,936-token vocabulary,
so the LM head costs what it costs). Every run is a fresh subprocess, so peak memory is its own.

Methods, all bf16 with gradient checkpointing (VAPO: float32 trainable weights under bf16 compute; GRPOTrainer trains
the bf16 model as handed to it):
    vapo-full   VAPOTrainer, full fine-tuning: policy + a separate critic copied from it
    vapo-lora   VAPOTrainer, LoRA r=16 on all linear layers, the critic a second adapter on the same base
    vapo-lora-generate  the same, generating with transformers' `generate()` (`use_static_cache_engine=False`)
    grpo-full   TRL GRPOTrainer, full fine-tuning
    grpo-lora   TRL GRPOTrainer, the same LoRA
    grpo-lora-static  the same, generating with transformers' static cache (`cache_implementation="static"`): the
                other transformers engine GRPOTrainer offers; its decode step is not compiled (TRL 1.16 builds its
                GenerationConfig with `disable_compile=True`)
VAPO's other rows run its defaults: on a CUDA GPU the static-cache engine generates (its decode step a CUDA graph), on
the CPU `generate()`; each row names the engine that ran (`engine`).
Same batch for all: `--prompts` x `--generations` completions per optimizer step (one rollout per step, micro-batches
of `--micro-batch`), completions forced to `--completion-length` tokens (`min_new_tokens`), the same reward (a
hash of the completion, +1/-1: scoring is not what is measured), `beta=0`, lr 1e-6, VAPO without value pretraining.

Printed per method: median step time over the steps after `--warmup`, split into generation, scoring (rewards, and
the no-grad pass for old log-probs and values, GAE) and update (forward, loss, backward, clipping, optimizer);
completion tokens per second; peak GPU memory (`torch.cuda.max_memory_allocated`; on CPU, the process's peak RSS), and
the ratios of VAPO to GRPO in the same mode. A run that fails is a FAILED row: the others still run, and the
driver exits 1 at the end. Targets (issue "The first GPU run's findings"): VAPO LoRA peak memory at
most 1.15x GRPO LoRA; a VAPO step at most 1.1x GRPO's at these lengths (1.3x before that issue).

`--static-memory` measures, on whatever device is there (the CPU here), what does not depend on the batch: the bytes
of the weights (trainable and frozen, by dtype) and of the optimizer state, read off the tensors after one real
optimizer step (one prompt, two 8-token completions); gradients take the trainable weights' bytes again.

`--logits-memory` measures, on whatever device is there, the memory of the step that made VAPO's peak 3.5x GRPO's on
the H100: from a micro-batch's last hidden states (bf16, `--micro-batch` x `--completion-length`) through a frozen
LM head (Qwen's 152k vocabulary) to per-token log-probs and entropies and back. The ways (`LOGPROB_PATHS`): trl-vapo's
(`lm_head_logprobs_and_entropy`: the head in tiles), TRL's fused head as GRPOTrainer calls it (`trl-fused`), TRL's
`selective_log_softmax` + `entropy_from_logits` on the bf16 logits (`trl`, GRPOTrainer's path before its fused
head), and the two that trl-vapo used before: chunks of the logits (`token_logprobs_and_entropy`) and an fp32
log-softmax. Each runs in a fresh process; printed: peak memory above what the inputs and the head take (CUDA:
allocator peak; CPU: peak RSS) and the seconds the step took.

`--step-memory` reproduces, on the CPU, the end-to-end comparison: one LoRA optimizer step (one prompt, 8
completions forced to 256 tokens, one micro-batch, float32, gradient checkpointing) of VAPO (the shared-base critic)
and of GRPOTrainer on the smoke model's body with Qwen's 151,936-token vocabulary (`smoke-152k`; `--sizes` for
others), each in a fresh process; printed: the peak resident memory above the process's at the start of training.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import WorkerFailed, launch_worker, phase_line, run_dir, versions, write_json  # noqa: E402
from bench_trainer import _instrument, _Timers  # noqa: E402  (the same method timers as the CPU benchmark)

# Qwen2.5 shapes (config.json of Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B).
QWEN25 = {
    "0.5B": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    "1.5B": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
    ),
    "smoke": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}
# The smoke model's body with Qwen's vocabulary: the LM head and the logits weigh what they weigh at real sizes.
QWEN25["smoke-152k"] = QWEN25["smoke"]
METHODS = ("vapo-full", "vapo-lora", "vapo-lora-generate", "grpo-full", "grpo-lora", "grpo-lora-static")
PARTS = {
    "generation": ("generate", "tokenize"),
    "scoring": ("reward", "old logp/values fwd", "GAE + whiten", "advantages + metrics", "metrics"),
    "update": ("update forward", "loss", "backward", "grad clip", "optimizer"),
}


def qwen_config(size: str):
    from transformers import Qwen2Config

    vocab = 2048 if size == "smoke" else 151936
    return Qwen2Config(
        vocab_size=vocab,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        hidden_act="silu",
        **QWEN25[size],
    )


def byte_level_tokenizer(vocab_size: int = 2000):
    """A byte-level BPE tokenizer trained on synthetic text, as GPT-2 / Qwen tokenizers are built (smaller)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    corpus = [
        f"Problem {i}: compute {i} + {7 * i} and simplify x^2 - {i * i}. The answer is {8 * i}." for i in range(3000)
    ]
    bpe.train_from_iterator(corpus, vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>")


def hash_reward(completions, **kwargs):
    """+1 or -1 from a hash of the completion: free to compute, so the scoring column measures the trainers."""
    return [1.0 if hashlib.md5(str(c).encode()).digest()[0] % 2 else -1.0 for c in completions]


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one method, one size, in this process
# ---------------------------------------------------------------------------------------------------------------------


def run_worker(opts) -> dict:
    started = time.perf_counter()
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()
    phases = {"start": time.perf_counter() - started}  # imports and CUDA init; then where the rest goes
    timers = _Timers()
    _instrument(opts.method, timers)
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):  # initialised where it trains (27 s on the H200 machine's CPU)
        model = AutoModelForCausalLM.from_config(
            qwen_config(opts.size), dtype=torch.float32 if opts.fp32 else torch.bfloat16
        )
    phases["model"] = time.perf_counter() - started - sum(phases.values())
    prompts = [f"Problem {i}: compute {i} + {3 * i}, then explain." for i in range(opts.prompts * (opts.steps + 1))]
    dataset = Dataset.from_list([{"prompt": p} for p in prompts])
    completions = opts.prompts * opts.generations
    common = dict(
        output_dir=run_dir(f"bench_gpu_{opts.method}_"),
        per_device_train_batch_size=opts.micro_batch,
        gradient_accumulation_steps=completions // opts.micro_batch,
        steps_per_generation=completions // opts.micro_batch,
        num_generations=opts.generations,
        num_iterations=1,
        max_completion_length=opts.completion_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"min_new_tokens": opts.completion_length},
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=0.0,
        bf16=not opts.fp32,
        use_cpu=not cuda,
        gradient_checkpointing=True,
        max_steps=opts.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    peft_config = lora if "-lora" in opts.method else None
    static = opts.method.endswith("-static")  # GRPOTrainer with transformers' static cache
    if opts.method.startswith("vapo"):
        from trl_vapo import VAPOConfig, VAPOTrainer

        trainer_class = VAPOTrainer
        engine = False if opts.method.endswith("-generate") else None  # None: VAPO's default for the device
        # No diagnostic PNGs: the run times training, and GRPOTrainer draws none.
        args = VAPOConfig(**common, value_pretrain_steps=0, use_static_cache_engine=engine, plot_diagnostics=False)
    else:
        from trl import GRPOConfig, GRPOTrainer

        trainer_class = GRPOTrainer
        args = GRPOConfig(
            **common,
            loss_type="dapo",
            epsilon_high=0.28,
            disable_dropout=True,
            log_completions=False,
            mask_truncated_completions=False,
            use_vllm=False,
            scale_rewards="group",
            cache_implementation="static" if static else None,
        )
    trainer = trainer_class(
        model=model,
        reward_funcs=hash_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    phases["trainer"] = time.perf_counter() - started - sum(phases.values())

    record: dict = {"step_s": [], "parts": [], "phases": phases}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.last = time.perf_counter()
            timers.flush()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            record["step_s"].append(now - self.last)
            record["parts"].append(timers.flush())
            self.last = now

    trainer.add_callback(StepTimer())
    before = reset_peak_memory()
    trainer.train()
    record["peak_bytes"] = peak_memory()
    record["peak_growth_bytes"] = record["peak_bytes"] - before
    record["static"] = static_bytes(trainer)
    record["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    engine = getattr(trainer, "generation_engine", None)  # VAPO's; GRPOTrainer calls generate() (use_vllm=False)
    record["engine"] = type(engine).__name__ if engine is not None else f"generate(){', static cache' * static}"
    phases["train"] = sum(record["step_s"])
    phases["total"] = time.perf_counter() - started
    trained = getattr(trainer, "actor_critic", trainer.model)  # VAPO's: policy and critic; GRPO's: the policy
    record["trainable"] = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    record["tokens_per_step"] = completions * opts.completion_length
    return record


def static_bytes(trainer) -> dict[str, int]:
    """Bytes held whatever the batch: weights by kind and dtype, optimizer state (and gradients: the trainable
    bytes)."""
    import torch

    seen, out = set(), {"trainable": 0, "frozen": 0, "trainable_float32": 0, "optimizer_state": 0}
    for param in getattr(trainer, "actor_critic", trainer.model).parameters():  # VAPO's policy and critic
        if id(param) in seen:
            continue
        seen.add(id(param))
        size = param.numel() * param.element_size()
        out["trainable" if param.requires_grad else "frozen"] += size
        out["trainable_float32"] += size if param.requires_grad and param.dtype == torch.float32 else 0
    for state in trainer.optimizer.state.values():
        out["optimizer_state"] += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return out


def static_table(records: dict) -> str:
    gib = 2**30
    header = (
        f"{'size':6s}{'method':11s}{'frozen GiB':>12s}{'trainable GiB':>15s}{'(float32)':>11s}"
        f"{'grads GiB':>11s}{'Adam GiB':>10s}{'total GiB':>11s}"
    )
    lines = [header, "-" * len(header)]
    for (size, method), r in records.items():
        s = r["static"]
        total = s["frozen"] + 2 * s["trainable"] + s["optimizer_state"]
        lines.append(
            f"{size:6s}{method:11s}{s['frozen'] / gib:>12.2f}{s['trainable'] / gib:>15.2f}"
            f"{'yes' if s['trainable'] == s['trainable_float32'] else 'no':>11s}{s['trainable'] / gib:>11.2f}"
            f"{s['optimizer_state'] / gib:>10.2f}{total / gib:>11.2f}"
        )
    return "\n".join(lines)


LOGPROB_PATHS = ("trl-vapo", "trl-fused", "trl", "logits-chunked", "fp32-log-softmax")


def reset_peak_memory() -> int:
    """Start a new peak here; returns the bytes in use now (CUDA: allocated; CPU: resident set)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    # Linux: writing 5 to clear_refs resets the process's peak resident set (VmHWM) to its current size.
    Path("/proc/self/clear_refs").write_text("5")
    return _proc_status_bytes("VmRSS")


def peak_memory() -> int:
    """The peak since :func:`reset_peak_memory`."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _proc_status_bytes("VmHWM")


def _proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def logits_memory_worker(opts) -> dict:
    """Peak bytes of LM head -> log-probs and entropy -> backward for one micro-batch, by ``opts.method``."""
    import torch
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    from trl_vapo._compat import TiledLogProbs, entropy_from_logits, selective_log_softmax
    from trl_vapo.core import lm_head_logprobs_and_entropy, token_logprobs_and_entropy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    shape = QWEN25[opts.size]
    vocab, batch, length = 151936, opts.micro_batch, opts.completion_length
    head = torch.nn.Linear(shape["hidden_size"], vocab, bias=False, dtype=torch.bfloat16, device=device)
    head.requires_grad_(False)  # a LoRA run's head is frozen: the gradient goes to the hidden states
    hidden = torch.randn(batch, length + 1, shape["hidden_size"], dtype=torch.bfloat16, device=device)
    hidden.requires_grad_()
    index = torch.randint(0, vocab, (batch, length), device=device)
    before = reset_peak_memory()
    started = time.perf_counter()
    if opts.method == "trl-vapo":  # trl_vapo.modeling.completion_logprobs: the hidden states through the head in tiles
        logprobs, _ = lm_head_logprobs_and_entropy(hidden[:, :-1], head.weight, None, index, with_entropy=True)
    elif opts.method == "trl-fused":  # GRPOTrainer's fused head (`add_fused_lm_head`), as it calls the kernel
        logprobs, *_ = TiledLogProbs.apply(
            hidden[:, :-1].reshape(-1, hidden.shape[-1]),
            head.weight,
            None,
            index.reshape(-1),
            1.0,
            _CHUNKED_LOGPROB_CHUNK_SIZE,
            None,
            1.0,
            ("log_probs", "entropy"),
        )
    else:
        logits = head(hidden)[:, :-1, :]
        if opts.method == "logits-chunked":  # completion_logprobs before the tiled head: chunks of the logits
            logprobs, _ = token_logprobs_and_entropy(logits, index, with_entropy=True)
        elif opts.method == "fp32-log-softmax":  # completion_logprobs before token_logprobs_and_entropy
            logits = logits.float()
            logprobs = selective_log_softmax(logits, index)
            with torch.no_grad():
                entropy_from_logits(logits)
        else:  # TRL's selective_log_softmax + entropy_from_logits: GRPOTrainer's path before its fused head
            logprobs = selective_log_softmax(logits, index)
            with torch.no_grad():
                entropy_from_logits(logits)
        del logits
    logprobs.sum().backward()
    peak = peak_memory() - before  # synchronises CUDA: the time below is the computation's
    logits_bytes = batch * length * vocab * 2
    return {
        "peak_bytes": peak,
        "seconds": time.perf_counter() - started,
        "logits_bytes": logits_bytes,
        "device": device,
        # What each path computed, the same numbers whichever it is: the log-probs' sum and its gradient's norm.
        "logprob_sum": logprobs.detach().float().sum().item(),
        "grad_norm": hidden.grad.float().norm().item(),
    }


def logits_memory_table(records: dict) -> str:
    lines = [
        f"{'size':6s}{'path':18s}{'peak GiB':>10s}{'/ bf16 logits':>15s}{'/ trl-fused':>13s}{'/ trl':>8s}"
        f"{'seconds':>9s}"
    ]
    for (size, path), r in records.items():
        ratios = []
        for base in ("trl-fused", "trl"):
            other = records.get((size, base))
            ratios.append(f"{r['peak_bytes'] / other['peak_bytes']:.2f}x" if other and other["peak_bytes"] else "-")
        lines.append(
            f"{size:6s}{path:18s}{r['peak_bytes'] / 2**30:>10.2f}{r['peak_bytes'] / r['logits_bytes']:>14.2f}x"
            f"{ratios[0]:>13s}{ratios[1]:>8s}{r['seconds']:>9.2f}"
        )
    return "\n".join(lines)


def adapter_switch_times(size: str, repeats: int = 20) -> dict[str, float]:
    """Milliseconds of one switch of the shared-base LoRA critic's adapter and back (what each critic forward does),
    at `size`'s shapes with LoRA on every linear layer, on the CPU (host work only: no tensor is computed): VAPO's
    (`ActorCritic._adapter`) and peft's `set_adapter` with `set_requires_grad` restoring both adapters, each way (what
    it did before). The vocabulary is cut to 2,048 (it costs memory, not switch time)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_vapo.modeling import CRITIC_ADAPTER, POLICY_ADAPTER, ActorCritic, ValueHead

    config = qwen_config(size)
    config.vocab_size = 2048
    torch.manual_seed(0)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    policy = get_peft_model(AutoModelForCausalLM.from_config(config), lora)
    policy.add_adapter(CRITIC_ADAPTER, lora)
    policy.set_requires_grad([POLICY_ADAPTER, CRITIC_ADAPTER], True)
    actor_critic = ActorCritic(policy, value_head=ValueHead(config.hidden_size))

    def vapo():
        with actor_critic._adapter(CRITIC_ADAPTER):
            pass

    def peft_switch():
        for adapter in (CRITIC_ADAPTER, POLICY_ADAPTER):
            policy.set_adapter(adapter)
            policy.set_requires_grad([POLICY_ADAPTER, CRITIC_ADAPTER], True)

    times = {}
    for name, switch in (("vapo", vapo), ("peft set_adapter", peft_switch)):
        switch()  # (VAPO's first switch reads each adapter's states from set_adapter)
        started = time.perf_counter()
        for _ in range(repeats):
            switch()
        times[name] = 1000 * (time.perf_counter() - started) / repeats
    times["modules"] = sum(1 for _ in policy.modules())
    return times


def step_memory_table(records: dict) -> str:
    lines = [f"{'size':11s}{'method':11s}{'peak growth MB':>16s}{'/ GRPO':>8s}{'step s':>8s}"]
    for (size, method), r in records.items():
        base = records.get((size, "grpo-" + method.split("-")[1]))
        ratio = f"{r['peak_growth_bytes'] / base['peak_growth_bytes']:.2f}x" if base else "-"
        lines.append(
            f"{size:11s}{method:11s}{r['peak_growth_bytes'] / 2**20:>16,.0f}{ratio:>8s}{sum(r['step_s']):>8.1f}"
        )
    return "\n".join(lines)


def summarise(record: dict, warmup: int) -> dict:
    steps = record["step_s"][warmup:] or record["step_s"]
    parts = record["parts"][warmup:] or record["parts"]
    split = {name: statistics.median(sum(p.get(k, 0.0) for k in keys) for p in parts) for name, keys in PARTS.items()}
    median = statistics.median(steps)
    return {
        "step_s": median,
        **split,
        "tokens_per_s": record["tokens_per_step"] / median,
        "peak_gib": record["peak_bytes"] / 2**30,
        "peak_growth_gib": record["peak_growth_bytes"] / 2**30,  # above the memory in use as training began
        "trainable": record["trainable"],
        "device": record["device"],
        "engine": record["engine"],
        "phases": record["phases"],
    }


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def launch(opts, size: str, method: str) -> dict:
    args = ["--worker", "--size", size, "--method", method]
    for key in ("steps", "prompts", "generations", "completion_length", "micro_batch"):
        args += [f"--{key.replace('_', '-')}", str(getattr(opts, key))]
    args += [flag for flag in ("--logits-memory", "--fp32") if getattr(opts, flag[2:].replace("-", "_"))]
    started = time.perf_counter()
    record = launch_worker(__file__, args, f"{size}/{method}", one_thread=False)
    if "phases" in record:
        record["phases"]["process"] = time.perf_counter() - started
    return record


def table(results: dict, sizes: list[str], methods: list[str]) -> str:
    header = (
        f"{'size':6s}{'method':17s}{'trainable':>14s}{'step s':>9s}{'gen s':>8s}{'score s':>9s}{'update s':>10s}"
        f"{'tok/s':>9s}{'peak GiB':>10s}{'step/GRPO':>11s}{'mem/GRPO':>10s}"
    )
    lines = [header, "-" * len(header)]
    for size in sizes:
        for method in methods:
            r = results[(size, method)]
            if "error" in r:
                lines.append(f"{size:6s}{method:17s}  FAILED: {r['error']}")
                continue
            base = results.get((size, "grpo-" + method.split("-")[1]))
            base = base if base and "error" not in base else None
            step_ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
            mem_ratio = f"{r['peak_gib'] / base['peak_gib']:.2f}x" if base else "-"
            lines.append(
                f"{size:6s}{method:17s}{r['trainable']:>14,d}{r['step_s']:>9.2f}{r['generation']:>8.2f}"
                f"{r['scoring']:>9.2f}{r['update']:>10.2f}{r['tokens_per_s']:>9.0f}{r['peak_gib']:>10.2f}"
                f"{step_ratio:>11s}{mem_ratio:>10s}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.5B,1.5B")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (= rollouts)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 prompts x 2, 8 tokens, 2 steps: on CPU")
    parser.add_argument("--static-memory", action="store_true", help="weights and optimizer bytes after one tiny step")
    parser.add_argument("--logits-memory", action="store_true", help="peak memory of the log-prob step, by path")
    parser.add_argument(
        "--step-memory", action="store_true", help="peak memory growth of one fp32 LoRA step, VAPO and GRPO, on CPU"
    )
    parser.add_argument(
        "--adapter-switch", action="store_true", help="host time of one critic adapter switch, VAPO's and peft's (CPU)"
    )
    parser.add_argument("--fp32", action="store_true", help="float32 weights and compute instead of bf16 autocast")
    parser.add_argument("--json", help="also write the summaries here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        record = logits_memory_worker(opts) if opts.logits_memory else run_worker(opts)
        Path(opts.result).write_text(json.dumps(record))
        return
    unknown = [m for m in opts.methods.split(",") if m not in METHODS]
    unknown += [size for size in opts.sizes.split(",") if size not in QWEN25]
    if unknown:  # before any worker starts: a typo is not a failed run minutes later
        parser.error(f"unknown methods or sizes {unknown}; methods: {', '.join(METHODS)}; sizes: {', '.join(QWEN25)}")
    if opts.smoke:
        opts.sizes, opts.prompts, opts.generations, opts.completion_length = "smoke", 2, 2, 8
        opts.micro_batch, opts.steps, opts.warmup = 2, 2, 1
    if opts.static_memory:
        opts.prompts, opts.generations, opts.completion_length, opts.micro_batch, opts.steps = 1, 2, 8, 2, 1
    if opts.step_memory:
        opts.methods = "vapo-lora,grpo-lora" if opts.methods == ",".join(METHODS) else opts.methods
        opts.sizes = "smoke-152k" if opts.sizes == "0.5B,1.5B" else opts.sizes
        opts.prompts, opts.generations, opts.completion_length, opts.micro_batch = 1, 8, 256, 8
        opts.steps, opts.warmup, opts.fp32 = 1, 0, True
        records = {(size, m): launch(opts, size, m) for size in opts.sizes.split(",") for m in opts.methods.split(",")}
        print("one LoRA step: 8 completions of 256 tokens, vocabulary 151,936, float32; peak memory above the start")
        print(step_memory_table(records))
        return
    if opts.adapter_switch:
        for size in opts.sizes.split(","):
            times = adapter_switch_times(size)
            print(
                f"{size}: one critic adapter switch and back, {times['modules']:,} modules, LoRA on every linear "
                f"layer, CPU: VAPO {times['vapo']:.2f} ms, peft set_adapter + set_requires_grad "
                f"{times['peft set_adapter']:.1f} ms"
            )
        return
    if opts.logits_memory:
        records = {(size, path): launch(opts, size, path) for size in opts.sizes.split(",") for path in LOGPROB_PATHS}
        print(f"micro-batch {opts.micro_batch} x {opts.completion_length} tokens, vocabulary 151,936, bf16 logits")
        print(logits_memory_table(records))
        return

    import torch  # the device's name (transformers and trl: their versions alone)

    sizes, methods = opts.sizes.split(","), opts.methods.split(",")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{versions('torch', 'transformers', 'trl')}, device {device}")
    print(
        f"per step: {opts.prompts} prompts x {opts.generations} completions of {opts.completion_length} tokens, "
        f"micro-batch {opts.micro_batch}; {opts.steps} steps per run, first {opts.warmup} left out; bf16, "
        "gradient checkpointing"
    )
    results, records, started = {}, {}, time.time()
    for size in sizes:
        for method in methods:
            try:
                records[(size, method)] = launch(opts, size, method)
            except WorkerFailed as failure:  # one failed run must not cost the others (GRPO's side of the ratios)
                results[(size, method)] = {"error": str(failure)}
                print(f"  [{time.time() - started:5.0f}s] {size} {method}: FAILED ({failure})", flush=True)
            else:
                results[(size, method)] = summarise(records[(size, method)], opts.warmup)
                print(
                    f"  [{time.time() - started:5.0f}s] {size} {method}: {results[(size, method)]['step_s']:.2f} "
                    f"s/step ({results[(size, method)]['engine']}); {phase_line(results[(size, method)]['phases'])}",
                    flush=True,
                )
            if opts.json:  # after each run: a call cut short (the GPU machine's limit) keeps the runs that ended
                write_json(Path(opts.json), {f"{s}/{m}": r for (s, m), r in results.items()}, indent=2)
    print()
    print(static_table(records) if opts.static_memory else table(results, sizes, methods))
    failed = [f"{size}/{method}" for (size, method), r in results.items() if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(results)} runs failed: {', '.join(failed)} (their output is above)")


if __name__ == "__main__":
    main()
