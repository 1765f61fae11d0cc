"""Evaluate a policy the way the VAPO paper reports it: k samples per problem, scored by the same reward functions.

    avg@k   mean over problems of the fraction of its k samples judged correct (the paper's avg@32, T=1.0, top-p 0.7)
    pass@k  fraction of problems with at least one correct sample among k
    pass@1  fraction of problems whose greedy answer is correct

"Correct" means the (weighted) reward is at least `positive_reward_threshold`, as in training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from datasets import Dataset
from transformers import TrainerState
from trl import is_conversational

from .data import prompt_token_ids
from .generation import EngineSettings, GenerationEngine, SamplingSettings, build_engine
from .scoring import RewardScorer


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


Engine = str | EngineSettings | GenerationEngine
"""An engine's name (`"generate"`: transformers' `generate()`, `"continuous_batching"`: its paged engine), its
`EngineSettings`, or a built `GenerationEngine` (e.g. the trainer's vLLM engine)."""


def _engine(engine: Engine, model, tokenizer, batch_size: int) -> GenerationEngine:
    """The engine evaluation samples with, built by `build_engine` (completions stop where training's stop)."""
    if isinstance(engine, GenerationEngine):
        return engine
    settings = engine if isinstance(engine, EngineSettings) else EngineSettings(engine=engine)
    if settings.holds_own_weights:
        raise ValueError(
            "Evaluate with vLLM through a built engine (the trainer's `generation_engine`): it holds the "
            "policy's weights, which these settings cannot give it."
        )
    return build_engine(dataclasses.replace(settings, batch_size=settings.batch_size or batch_size), model, tokenizer)


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
    engine: Engine = "generate",
) -> tuple[list[str], list[int]]:
    """Generate `num_samples` completions per prompt (grouped by prompt); `temperature=0` decodes greedily.

    Prompts are plain text or chat messages, tokenized exactly as the trainer does. Returns the decoded completions
    and their lengths in tokens (stop token included; `max_new_tokens` when cut). `batch_size` applies to the
    `"generate"` engine; continuous batching schedules the requests itself.
    """
    conversational = is_conversational({"prompt": prompts[0]})
    ids = prompt_token_ids(tokenizer, prompts, conversational, chat_template_kwargs)
    repeated = [x for x in ids for _ in range(num_samples)]
    generator = _engine(engine, model, tokenizer, batch_size)
    sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    output = generator.generate(repeated, sampling=sampling, num_generations=num_samples)
    completions = tokenizer.batch_decode(output.completion_lists(), skip_special_tokens=True)
    return completions, output.lengths.tolist()


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
    engine: Engine = "generate",
) -> EvaluationResult:
    """pass@1 (greedy), avg@k and pass@k of `model` on `dataset` (a `prompt` column plus what the rewards read).

    `engine` picks how to sample (see `Engine`); one engine serves both the sampled and the greedy pass.
    """
    rows = dataset.to_list()
    prompts = [row["prompt"] for row in rows]
    scorer = RewardScorer(reward_funcs, reward_weights, is_conversational({"prompt": prompts[0]}))

    def correct(completions: list[str], group: int) -> torch.Tensor:
        # Outside training, functions that read `trainer_state` get one at step 0, as in the check before training.
        scores = scorer.score([row for row in rows for _ in range(group)], completions, trainer_state=TrainerState())
        return scores.is_correct(positive_reward_threshold).float().view(len(rows), group)

    generator = _engine(engine, model, tokenizer, batch_size)
    sampled, lengths = sample_completions(
        model,
        tokenizer,
        prompts,
        num_samples=k,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        engine=generator,
    )
    hits = correct(sampled, k)
    pass_at_1 = float("nan")
    if greedy:
        greedy_completions, _ = sample_completions(
            model,
            tokenizer,
            prompts,
            temperature=0.0,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            engine=generator,
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
