"""Evaluate a policy the way the VAPO paper reports it: k samples per problem, scored by the same reward functions.

    avg@k   mean over problems of the fraction of its k samples judged correct (the paper's avg@32, T=1.0, top-p 0.7)
    pass@k  fraction of problems with at least one correct sample among k
    pass@1  fraction of problems whose greedy answer is correct

"Correct" means the (weighted) reward is at least `positive_reward_threshold`, as in training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from datasets import Dataset
from trl import is_conversational

from ._compat import pad
from .data import prompt_token_ids


@dataclass
class EvaluationResult:
    pass_at_1: float
    avg_at_k: float
    pass_at_k: float
    k: int
    num_problems: int
    mean_length: float

    def as_dict(self) -> dict[str, float]:
        return {
            "pass@1": self.pass_at_1,
            f"avg@{self.k}": self.avg_at_k,
            f"pass@{self.k}": self.pass_at_k,
            "num_problems": self.num_problems,
            "mean_length": self.mean_length,
        }


@torch.no_grad()
def sample_completions(
    model,
    tokenizer,
    prompts: Sequence,
    *,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int = 64,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[str], list[int]]:
    """Generate `num_samples` completions per prompt (grouped by prompt); `temperature=0` decodes greedily.

    Prompts are plain text or chat messages, tokenized exactly as the trainer does. Returns the decoded completions
    and their lengths in tokens (EOS included; `max_new_tokens` when cut).
    """
    conversational = is_conversational({"prompt": prompts[0]})
    ids = prompt_token_ids(tokenizer, prompts, conversational, chat_template_kwargs)
    repeated = [x for x in ids for _ in range(num_samples)]
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0 else {"do_sample": False}
    eos = tokenizer.eos_token_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    completions, lengths = [], []
    for start in range(0, len(repeated), batch_size):
        chunk = repeated[start : start + batch_size]
        input_ids = pad([torch.tensor(x) for x in chunk], padding_value=tokenizer.pad_token_id, padding_side="left")
        attention = pad([torch.ones(len(x), dtype=torch.long) for x in chunk], padding_side="left")
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
            **sampling,
        )
        for row in output[:, input_ids.shape[1] :].tolist():
            length = row.index(eos) + 1 if eos in row else len(row)
            lengths.append(length)
            completions.append(tokenizer.decode(row[:length], skip_special_tokens=True))
    model.train(was_training)
    return completions, lengths


def evaluate_policy(
    model,
    tokenizer,
    dataset: Dataset,
    reward_funcs: Callable | list[Callable],
    *,
    k: int = 8,
    temperature: float = 1.0,
    top_p: float = 0.7,
    max_new_tokens: int = 256,
    batch_size: int = 64,
    reward_weights: list[float] | None = None,
    positive_reward_threshold: float = 0.5,
    greedy: bool = True,
) -> EvaluationResult:
    """pass@1 (greedy), avg@k and pass@k of `model` on `dataset` (a `prompt` column plus what the rewards read)."""
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    weights = reward_weights or [1.0] * len(funcs)
    rows = dataset.to_list()
    prompts = [row["prompt"] for row in rows]

    def correct(completions: list[str], group: int) -> torch.Tensor:
        repeated_rows = [row for row in rows for _ in range(group)]
        if is_conversational({"prompt": prompts[0]}):
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        columns = {key: [row[key] for row in repeated_rows] for key in rows[0] if key != "prompt"}
        total = torch.zeros(len(repeated_rows))
        for func, weight in zip(funcs, weights):
            values = func(prompts=[row["prompt"] for row in repeated_rows], completions=completions, **columns)
            total += weight * torch.tensor([float("nan") if v is None else float(v) for v in values]).nan_to_num(0.0)
        return (total >= positive_reward_threshold).float().view(len(rows), group)

    sampled, lengths = sample_completions(
        model, tokenizer, prompts, num_samples=k, temperature=temperature, top_p=top_p,
        max_new_tokens=max_new_tokens, batch_size=batch_size,
    )
    hits = correct(sampled, k)
    pass_at_1 = float("nan")
    if greedy:
        greedy_completions, _ = sample_completions(
            model, tokenizer, prompts, temperature=0.0, max_new_tokens=max_new_tokens, batch_size=batch_size
        )
        pass_at_1 = correct(greedy_completions, 1).mean().item()
    return EvaluationResult(
        pass_at_1=pass_at_1,
        avg_at_k=hits.mean().item(),
        pass_at_k=hits.max(dim=1).values.mean().item(),
        k=k,
        num_problems=len(rows),
        mean_length=sum(lengths) / len(lengths),
    )
