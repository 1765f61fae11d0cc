"""Generation throughput of the engines of `trl_vapo.generation` that run here: `generate()`, continuous batching
and the static-cache engine, on the same prompts, sampled as rollouts are (temperature 1); and what one decode step
costs each in operator launches and host synchronisations, the CPU proxy for what bounds a GPU's decode step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_generation.py           # 64 prompts x 96 tokens, 3 repeats
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_generation.py --quick   # 16 prompts x 32 tokens, 1 repeat

Models: the bundled demo policy (0.8M parameters, trained: its answers stop at EOS after 26-83 tokens) and randomly
initialised Llama decoders of about 2.4M and 9.5M parameters (`tiny1024`, about 38M, on request); a random model
samples EOS about once per vocabulary size (104) tokens, so its completions have ragged lengths too. Prompts are the
demo's held-out problems (chat template, 13-23 tokens).
`generate()` gets all prompts in one left-padded batch; continuous batching gets them all as requests (its KV cache
sized to them, see `ContinuousBatching`). One intra-op thread; each engine runs `--warmup` untimed rounds, then
`--repeats` timed rounds interleaved with the other engines'; the table gives the median time and completion
tokens (stop token included) per second.

Per decode step (`--per-step`, printed below the table): the ATen operators dispatched (each one a kernel launch, or
more, on a GPU; counted under a `TorchDispatchMode`) and the host synchronisations among them (`_local_scalar_dense`,
`nonzero` and the like: a read of a device value that waits for the device), over 16 prompts, as the difference
between a 24- and an 8-token run divided by 16 (the prefill cancels), on the demo model with greedy decoding (so
that both runs make every step: no early stop).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

MODELS = {
    # name: None for the bundled demo model, else kwargs of trl_vapo.tiny.build_tiny_llama (randomly initialised)
    "demo": None,
    "tiny256": {"hidden_size": 256, "num_layers": 4, "num_heads": 4},
    "tiny512": {"hidden_size": 512, "num_layers": 4, "num_heads": 8},
    "tiny1024": {"hidden_size": 1024, "num_layers": 4, "num_heads": 16},  # not in the default run
}
DEFAULT_MODELS = "demo,tiny256,tiny512"


def load(name: str):
    """Model and tokenizer: the demo policy from the package, or a random tiny Llama with the character tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_vapo.tiny import build_char_tokenizer, build_tiny_llama

    if MODELS[name] is None:
        from trl_vapo.demo import MODEL_DIR

        return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval(), AutoTokenizer.from_pretrained(MODEL_DIR)
    tokenizer = build_char_tokenizer()
    return build_tiny_llama(tokenizer, **MODELS[name]).eval(), tokenizer


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    from trl_vapo.data import prompt_token_ids
    from trl_vapo.demo.data import build_split

    return prompt_token_ids(tokenizer, list(build_split("held_out", count)["prompt"]), conversational=True)


def engines(model, tokenizer):
    from trl_vapo.generation import ContinuousBatching, TransformersGenerate, stop_token_ids
    from trl_vapo.static_cache import StaticCacheEngine

    common = {"pad_token_id": tokenizer.pad_token_id, "stop_token_ids": stop_token_ids(tokenizer, model)}
    return {
        "generate()": TransformersGenerate(model, **common),
        "continuous batching": ContinuousBatching(model, **common),
        "static cache": StaticCacheEngine(model, **common),
    }


SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero", "equal")
"""ATen operators whose result the host reads (or whose output size depends on the data): each waits for the
device."""


def count_ops(engine, prompts, max_new_tokens: int) -> tuple[int, int]:
    """(operators dispatched, host synchronisations) of one greedy generation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trl_vapo.generation import SamplingSettings

    class Counter(TorchDispatchMode):
        ops = syncs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.ops += 1
            Counter.syncs += func.__name__.split(".")[0] in SYNC_OPS
            return func(*args, **(kwargs or {}))

    with Counter():
        engine.generate(prompts, sampling=SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0))
    return Counter.ops, Counter.syncs


def per_step(model_name: str = "demo", num_prompts: int = 16, short: int = 8, long: int = 24) -> list[dict]:
    """Operators and host synchronisations per decode step, for each engine (see the module docstring)."""
    from trl_vapo.generation import SamplingSettings

    model, tokenizer = load(model_name)
    prompts = prompts_for(tokenizer, num_prompts)
    rows = []
    for name, engine in engines(model, tokenizer).items():
        if name == "continuous batching":  # its steps run in a background thread, out of the dispatch mode's reach
            continue
        engine.generate(prompts, sampling=SamplingSettings(max_new_tokens=2))  # warm: first-call set-up uncounted
        (ops_short, syncs_short), (ops_long, syncs_long) = (count_ops(engine, prompts, n) for n in (short, long))
        steps = long - short
        rows.append(
            {
                "engine": name,
                "ops_per_step": (ops_long - ops_short) / steps,
                "syncs_per_step": (syncs_long - syncs_short) / steps,
            }
        )
    return rows


def run(model_name: str, num_prompts: int, max_new_tokens: int, warmup: int, repeats: int) -> list[dict]:
    from trl_vapo.generation import SamplingSettings

    model, tokenizer = load(model_name)
    prompts = prompts_for(tokenizer, num_prompts)
    sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=1.0)
    timed = engines(model, tokenizer)
    times: dict[str, list[float]] = {name: [] for name in timed}
    tokens: dict[str, list[int]] = {name: [] for name in timed}
    for round_ in range(warmup + repeats):
        order = list(timed) if round_ % 2 == 0 else list(reversed(timed))  # interleaved: shared load hits both
        for name in order:
            torch.manual_seed(round_)
            start = time.perf_counter()
            out = timed[name].generate(prompts, sampling=sampling)
            elapsed = time.perf_counter() - start
            if round_ >= warmup:
                times[name].append(elapsed)
                tokens[name].append(int(out.lengths.sum()))
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for name in timed:
        seconds = statistics.median(times[name])
        generated = statistics.median(tokens[name])
        rows.append(
            {
                "model": model_name,
                "params": params,
                "engine": name,
                "tokens": generated,
                "seconds": seconds,
                "tokens_per_s": generated / seconds,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens, no warmup, 1 repeat")
    parser.add_argument("--no-per-step", dest="per_step", action="store_false", help="skip the per-step counts")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.warmup, args.repeats = 16, 32, 0, 1
    torch.set_num_threads(1)

    import transformers

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} thread, load average {os.getloadavg()[0]:.1f}; "
        f"{args.prompts} prompts x {args.max_new_tokens} new tokens, T=1, median of {args.repeats}"
    )
    print(f"\n{'model':<9}{'params':>8}  {'engine':<21}{'tokens':>7}{'time':>9}{'tokens/s':>10}{'vs generate()':>15}")
    print("-" * 79)
    for model_name in args.models.split(","):
        rows = run(model_name, args.prompts, args.max_new_tokens, args.warmup, args.repeats)
        reference = rows[0]["tokens_per_s"]
        for row in rows:
            print(
                f"{row['model']:<9}{row['params'] / 1e6:>7.1f}M  {row['engine']:<21}{row['tokens']:>7.0f}"
                f"{row['seconds']:>8.2f}s{row['tokens_per_s']:>10,.0f}{row['tokens_per_s'] / reference:>14.2f}x"
            )
    if args.per_step:
        print("\nper decode step (demo model, 16 prompts, greedy, a 24-token run minus an 8-token run, / 16):")
        print(f"{'engine':<21}{'operators':>10}{'host syncs':>12}")
        for row in per_step():
            print(f"{row['engine']:<21}{row['ops_per_step']:>10.1f}{row['syncs_per_step']:>12.2f}")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
