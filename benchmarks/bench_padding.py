"""Padding the update computes: a step's completions split into micro-batches as drawn, or in length order.

    .venv/bin/python benchmarks/bench_padding.py            # 200 draws of lengths per layout
    .venv/bin/python benchmarks/bench_padding.py --quick    # 10 draws (tests/test_benchmarks.py runs it)

Each micro-batch is cut to its longest completion (`trl_vapo.modeling.trim_padding`), so it computes rows x that
length completion positions. Split in a step's random order (`torch.randperm`, as the trainer draws a step's rows),
nearly every micro-batch holds a long completion; split in length order (`trl_vapo.modeling.length_sorted`, what
the trainer does unless `top_entropy_quantile < 1`), each holds rows of similar lengths. Printed, per layout (rows
per step, rows per micro-batch): the positions computed over the completions' own tokens, the mean over draws of
completion lengths uniform in [--shortest, --longest] with its 95% t interval. A count, not a timing: what a
position costs depends on the device (on a GPU a shorter micro-batch is not proportionally faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trl_vapo.modeling import length_sorted, trim_padding  # noqa: E402

LAYOUTS = ((64, 8), (128, 16), (512, 64))  # (rows per optimizer step, rows per micro-batch): 8 micro-batches
T_975 = {9: 2.262, 199: 1.972}  # Student's t, two-sided 95%, by degrees of freedom (else the normal's 1.96)


def computed_ratio(lengths: torch.Tensor, rows_per_micro_batch: int, sorted_rows: bool, generator) -> float:
    """Completion positions the micro-batches compute, over the completions' tokens, for one step's `lengths`."""
    prompt_length = 1
    attention_mask = torch.zeros(len(lengths), prompt_length + int(lengths.max()), dtype=torch.long)
    attention_mask[:, :prompt_length] = 1
    for row, length in enumerate(lengths.tolist()):
        attention_mask[row, prompt_length : prompt_length + length] = 1
    input_ids = torch.zeros_like(attention_mask)
    rows = torch.randperm(len(lengths), generator=generator)
    if sorted_rows:
        rows = length_sorted(rows, lengths)
    computed = 0
    for micro_batch in rows.split(rows_per_micro_batch):
        _, _, completion_length = trim_padding(input_ids, attention_mask, prompt_length, micro_batch)
        computed += len(micro_batch) * completion_length
    return computed / int(lengths.sum())


def interval(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% t interval."""
    t = T_975.get(len(values) - 1, 1.96)
    return statistics.mean(values), t * statistics.stdev(values) / len(values) ** 0.5


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=200, help="draws of completion lengths per layout")
    parser.add_argument("--quick", action="store_true", help="10 draws")
    parser.add_argument("--shortest", type=int, default=100)
    parser.add_argument("--longest", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    draws = 10 if opts.quick else opts.draws
    generator = torch.Generator().manual_seed(opts.seed)
    print(
        f"completion lengths uniform in [{opts.shortest}, {opts.longest}], {draws} draws per layout, seed "
        f"{opts.seed}: completion positions computed / completion tokens (mean, 95% interval)"
    )
    print(f"{'rows/step':>9} {'per micro-batch':>15} {'as drawn':>16} {'length order':>16}")
    results = {}
    for rows, per_micro_batch in LAYOUTS:
        ratios = {"as drawn": [], "length order": []}
        for _ in range(draws):
            lengths = torch.randint(opts.shortest, opts.longest + 1, (rows,), generator=generator)
            ratios["as drawn"].append(computed_ratio(lengths, per_micro_batch, False, generator))
            ratios["length order"].append(computed_ratio(lengths, per_micro_batch, True, generator))
        summary = {name: interval(values) for name, values in ratios.items()}
        results[f"{rows}/{per_micro_batch}"] = summary
        cells = " ".join(f"{mean:>9.3f} +- {half:.3f}" for mean, half in summary.values())
        print(f"{rows:>9} {per_micro_batch:>15} {cells}")
    return results


if __name__ == "__main__":
    main()
