"""Evaluate a policy the way the VAPO paper reports it: k samples per problem, scored by the same reward functions
(`evaluate_policy`, `trl-vapo eval`); and the trainer's own `evaluate()`, as GRPOTrainer's (`EvaluationMixin`).

    avg@k   mean over problems of the fraction of its k samples judged correct (the paper's avg@32, T=1.0, top-p 0.7)
    pass@k  fraction of problems with at least one correct sample among k
    pass@1  fraction of problems whose greedy answer is correct

"Correct" means the (weighted) reward is at least `positive_reward_threshold`, as in training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import numbers
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from datasets import Dataset, IterableDataset
from transformers import TrainerState
from transformers.trainer_utils import speed_metrics
from trl import is_conversational

from .core import exact, explained_variance, vapo_loss
from .data import (
    check_eval_dataset,
    check_prompts,
    check_streamed_rows,
    left_truncated,
    prompt_token_ids,
    refuse_images,
)
from .generation import EngineSettings, GenerationEngine, SamplingSettings, build_engine, stop_token_ids
from .metric_names import ACCURACY, EVAL, EXPLAINED_VARIANCE
from .modeling import generation_mode
from .reporting import averaged_metrics
from .rollout import Rollout, rollout_metrics
from .scoring import RewardScorer, parsed_completions, prompt_opens_think, repeated_rows


@dataclass
class EvaluationResult:
    pass_at_1: float
    avg_at_k: float
    pass_at_k: float
    k: int
    num_problems: int  # those scored: the estimates' problems
    mean_length: float
    num_unscored: int = 0  # problems none of whose completions was judged (`Scores.judged`: left out of the estimates)
    num_partly_scored: int = 0  # problems some of whose k samples were not judged: in avg@k, left out of pass@k

    def as_dict(self) -> dict[str, float]:
        scores = {"pass@1": self.pass_at_1, f"avg@{self.k}": self.avg_at_k}
        if self.k > 1:  # one sample's pass@1 is avg@1, and its key would overwrite the greedy pass@1
            scores[f"pass@{self.k}"] = self.pass_at_k
        counts = {"num_problems": self.num_problems} | {
            name: count
            for name, count in (("num_unscored", self.num_unscored), ("num_partly_scored", self.num_partly_scored))
            if count
        }
        return {**scores, **counts, "mean_length": self.mean_length}


Engine = str | EngineSettings | GenerationEngine
"""An engine's name (`"generate"`: transformers' `generate()`, `"continuous_batching"`: its paged engine), its
`EngineSettings`, or a built `GenerationEngine` (e.g. the trainer's vLLM engine)."""


def _engine(
    engine: Engine, model, tokenizer, batch_size: int, generation_kwargs: dict | None = None
) -> GenerationEngine:
    """The engine evaluation samples with, built by `build_engine`: completions stop where training's stop (the
    tokenizer's and the model's EOS, and any `eos_token_id` / `stop_token_ids` in `generation_kwargs`)."""
    if isinstance(engine, GenerationEngine):
        return engine
    settings = engine if isinstance(engine, EngineSettings) else EngineSettings(engine=engine)
    if settings.holds_own_weights:
        raise ValueError(
            "Evaluate with vLLM through a built engine (the trainer's `generation_engine`): it holds the "
            "policy's weights, which these settings cannot give it."
        )
    stop_ids = stop_token_ids(tokenizer, model, {**settings.sampling.generation_kwargs, **(generation_kwargs or {})})
    settings = dataclasses.replace(settings, batch_size=settings.batch_size or batch_size)
    return build_engine(settings, model, tokenizer, stop_ids=stop_ids)


SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
"""`generation_kwargs` keys that say how to sample, not where a completion ends: the greedy pass leaves them out."""
NAMED_SAMPLING_KEYS = ("do_sample", "temperature", "top_p")
"""The `generation_kwargs` keys that would undo what a sampled pass is (sampling, at its temperature and top-p: what
the reports say it was): its arguments win. Training's `top_k`, `min_p` and `repetition_penalty` there still apply."""


def sample_completions(
    model,
    tokenizer,
    prompts: Sequence,
    *,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    max_new_tokens: int = 256,
    max_prompt_length: int | None = None,
    batch_size: int = 64,
    chat_template_kwargs: dict | None = None,
    engine: Engine = "generate",
    generation_kwargs: dict | None = None,
    return_ids: bool = False,
) -> tuple[list[str], list[int]] | tuple[list[str], list[int], list[list[int]], list[list[int]]]:
    """Generate `num_samples` completions per prompt (grouped by prompt); `temperature=0` decodes greedily.

    Prompts are plain text or chat messages, tokenized and cut to `max_prompt_length` exactly as the trainer does;
    `top_k`, `min_p` and `repetition_penalty` as training's (`SamplingSettings`). Returns the decoded completions
    and their lengths in tokens (stop token included; `max_new_tokens` when cut), and with `return_ids` their token
    ids (what training gives the reward functions) and each one's prompt tokens. `batch_size` applies to the
    `"generate"` engine; continuous batching schedules the requests itself. `generation_kwargs`: training's
    (`SamplingSettings.generation_kwargs`), where completions end (stop strings, stop tokens); a greedy pass leaves
    out those that say how to sample, a sampled pass `do_sample`, `temperature` and `top_p` (`NAMED_SAMPLING_KEYS`:
    the arguments say how this pass samples, as `evaluate_policy`'s report says it sampled).
    """
    if max_prompt_length is not None and max_prompt_length < 1:  # (VAPOConfig refuses it; a caller of this may not)
        raise ValueError(
            f"max_prompt_length={max_prompt_length}: a prompt keeps at least one token; None keeps it whole"
        )
    conversational = is_conversational({"prompt": prompts[0]})
    ids = prompt_token_ids(tokenizer, prompts, conversational, chat_template_kwargs)
    cut = sum(len(x) > max_prompt_length for x in ids) if max_prompt_length is not None else 0
    if cut:  # issued here, the same text: once a process for a sampled and a greedy pass, a report before and after
        warnings.warn(
            f"{cut} of {len(ids)} prompts are longer than max_prompt_length={max_prompt_length} tokens: truncated "
            "from the left, as training cuts them (drop_long_prompts drops training prompts only). Raise "
            "max_prompt_length or set it to None to keep them whole.",
            stacklevel=1,
        )
    ids = left_truncated(ids, max_prompt_length)
    repeated = [x for x in ids for _ in range(num_samples)]
    generator = _engine(engine, model, tokenizer, batch_size, generation_kwargs)
    kwargs = dict(generation_kwargs or {})
    # Greedy, whatever training sampled with: only where completions end carries over. Sampled: as the arguments
    # say (training's generation_kwargs applied last, and a `temperature` or `do_sample=False` there replaced them).
    dropped = SAMPLING_KEYS if temperature == 0 else NAMED_SAMPLING_KEYS
    kwargs = {key: value for key, value in kwargs.items() if key not in dropped}
    sampling = SamplingSettings(
        max_new_tokens, temperature, top_p, top_k or 0, min_p, repetition_penalty, generation_kwargs=kwargs
    )
    output = generator.generate(repeated, sampling=sampling, num_generations=num_samples)
    completion_ids = output.completion_lists()
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if return_ids:
        return completions, output.lengths.tolist(), completion_ids, repeated
    return completions, output.lengths.tolist()


@contextlib.contextmanager
def random_state_kept(device: torch.device):
    """`torch.random.fork_rng` over the CPU's generator and `device`'s, and Python's and NumPy's generators kept as
    well (a reward function or judge may draw from them): what samples inside leaves the random state as it found
    it, so that evaluating during or before training never changes what trains."""
    import random

    import numpy as np

    rng = {"devices": []} if device.type == "cpu" else {"devices": [device.index or 0], "device_type": device.type}
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(**rng):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def evaluate_policy(
    model,
    tokenizer,
    dataset: Dataset | IterableDataset,
    reward_funcs: Callable | list[Callable],
    *,
    k: int = 8,
    temperature: float = 1.0,
    top_p: float = 0.7,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    max_new_tokens: int = 256,
    max_prompt_length: int | None = None,
    batch_size: int = 64,
    reward_weights: list[float] | None = None,
    positive_reward_threshold: float = 0.5,
    greedy: bool = True,
    engine: Engine = "generate",
    chat_template_kwargs: dict | None = None,
    positive_reward_funcs: list[str] | None = None,
    trainer_state: TrainerState | None = None,
    generation_kwargs: dict | None = None,
    accelerator=None,
) -> EvaluationResult:
    """pass@1 (greedy), avg@k and pass@k of `model` on `dataset` (a `prompt` column plus what the rewards read).

    `accelerator`: with several processes, each samples and scores its share of the prompts (every n-th) and the
    result, the same on every process, covers them all: only where each process holds the whole policy and samples
    alone (not with vLLM, whose calls are collectives, nor with weights FSDP2 or ZeRO-3 sharded).

    `engine` picks how to sample (see `Engine`); one engine serves both the sampled and the greedy pass.
    `chat_template_kwargs`: the chat template's keyword arguments, as in training (`VAPOConfig.chat_template_kwargs`).
    `positive_reward_funcs`: the reward functions that judge correctness, as in training (None: all of them).
    The reward functions get what training gives them (the completions' token ids too), and `trainer_state` (default:
    a state at step 0). `generation_kwargs`: training's (`VAPOConfig.generation_kwargs`), so that completions end
    where training's end (stop strings, stop tokens, `min_new_tokens`); the greedy pass keeps only those and
    `repetition_penalty` (a processor, where `top_k` and `min_p` shape sampling alone). `max_prompt_length`:
    training's, the prompts cut as training cut them.
    """
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:  # else it sampled the whole set, then
        raise ValueError(f"k (samples per prompt) must be a whole number >= 1, got {k!r}")  # failed
    k = int(k)  # (numpy's integers too: a sweep's grid)
    rows = list(dataset) if isinstance(dataset, IterableDataset) else dataset.to_list()
    if not rows:
        raise ValueError("The data set to evaluate on is empty: pass one with at least one prompt.")
    if "prompt" not in rows[0]:
        raise ValueError(f"The data set to evaluate on has no 'prompt' column; its columns are {sorted(rows[0])}.")
    for i, row in enumerate(rows):
        refuse_images(row, f"The data set to evaluate on (row {i})")
    prompts = [row["prompt"] for row in rows]
    check_prompts(prompts, "The data set to evaluate on")
    scorer = RewardScorer(
        reward_funcs, reward_weights, is_conversational({"prompt": prompts[0]}), positive_reward_funcs
    )
    shared = accelerator is not None and accelerator.num_processes > 1
    if shared:  # this process's share (none where there are fewer prompts than processes)
        rows = rows[accelerator.process_index :: accelerator.num_processes]
        prompts = prompts[accelerator.process_index :: accelerator.num_processes]

    # Outside training: step 0 of 1, as in the check before training (a reward schedule divides by max_steps).
    state = trainer_state or TrainerState(max_steps=1)

    def correct(completions: list[str], completion_ids, prompt_ids, group: int) -> tuple[torch.Tensor, ...]:
        """[problems, group] 1.0 where correct, and where a function judging correctness scored the completion."""
        repeated = repeated_rows(rows, group)
        parsed = scorer.conversational and parsed_completions(
            tokenizer, completion_ids, lambda: prompt_ids, completions
        )
        thinking = None if parsed or not scorer.reads_thinking else prompt_opens_think(tokenizer, prompt_ids)
        scores = scorer.score(
            repeated, parsed or completions, completion_ids, trainer_state=state, prompt_opens_think=thinking
        )
        hits = scores.is_correct(positive_reward_threshold).float().view(len(rows), group)
        return hits, scores.judged.view(len(rows), group)

    outcomes = ProblemOutcomes(k)
    if rows:
        generator = _engine(engine, model, tokenizer, batch_size, generation_kwargs)
        settings = dict(
            max_new_tokens=max_new_tokens,
            max_prompt_length=max_prompt_length,
            repetition_penalty=repetition_penalty,
            batch_size=batch_size,
            chat_template_kwargs=chat_template_kwargs,
            generation_kwargs=generation_kwargs,
            return_ids=True,
        )
        sampled, lengths, sampled_ids, sampled_prompts = sample_completions(
            model,
            tokenizer,
            prompts,
            num_samples=k,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            engine=generator,
            **settings,
        )
        hits, scored = correct(sampled, sampled_ids, sampled_prompts, k)
        outcomes.hits, outcomes.scored, outcomes.lengths = hits.tolist(), scored.tolist(), lengths
        if greedy:
            greedy_completions, _, greedy_ids, greedy_prompts = sample_completions(
                model, tokenizer, prompts, temperature=0.0, engine=generator, **settings
            )
            greedy_hits, greedy_scored = correct(greedy_completions, greedy_ids, greedy_prompts, 1)
            outcomes.greedy_hits = greedy_hits.view(-1).tolist()
            outcomes.greedy_scored = greedy_scored.view(-1).tolist()
    if shared:
        from accelerate.utils import gather_object

        outcomes = ProblemOutcomes.joined(k, gather_object([outcomes]))
    return outcomes.result(greedy)


@dataclass
class ProblemOutcomes:
    """What `evaluate_policy` summarises, per problem: each sample's hit and whether it was scored, the greedy
    answer's, and every sample's length. Several processes' shares join into the whole set's."""

    k: int
    hits: list[list[float]] = dataclasses.field(default_factory=list)  # [problems][k], 1.0 where correct
    scored: list[list[bool]] = dataclasses.field(default_factory=list)  # [problems][k], a judging reward scored it
    lengths: list[int] = dataclasses.field(default_factory=list)  # every sample's, in tokens
    greedy_hits: list[float] = dataclasses.field(default_factory=list)  # [problems]; empty without a greedy pass
    greedy_scored: list[bool] = dataclasses.field(default_factory=list)

    @classmethod
    def joined(cls, k: int, shares: Sequence[ProblemOutcomes]) -> ProblemOutcomes:
        fields = ("hits", "scored", "lengths", "greedy_hits", "greedy_scored")
        return cls(k, *(list(itertools.chain.from_iterable(getattr(s, name) for s in shares)) for name in fields))

    def result(self, greedy: bool) -> EvaluationResult:
        # What no reward function scored (None: a problem without a usable reference answer) is left out of every
        # estimate, as training's accuracy leaves it out, rather than counted wrong.
        # (float64: 29 of 40 reads 0.725, not float32's 0.7250000238418579, in the JSON a report writes)
        hits = exact(torch.tensor(self.hits)).view(-1, self.k)
        scored = torch.tensor(self.scored, dtype=torch.bool).view(-1, self.k)
        problems = scored.any(dim=1)
        pass_at_1 = float("nan")
        if greedy:
            greedy_hits = exact(torch.tensor(self.greedy_hits))
            pass_at_1 = greedy_hits[torch.tensor(self.greedy_scored, dtype=torch.bool)].mean().item()
        # avg@k: the mean over problems of each one's share correct among its scored samples (pooled over samples, a
        # problem with one sample scored of k counted k times less).
        shares = (hits * scored).sum(dim=1) / scored.sum(dim=1).clamp(min=1)
        # pass@k: over the problems whose k samples were all scored (`num_partly_scored` says how many are not). A
        # problem whose scored samples all missed may have had its hit among the others: counted a miss it read
        # pass@k low; left out while one whose scored samples hit is counted, high; the scored ones alone read a
        # pass@(scored). Where samples go unscored at random, the problems scored whole estimate it without bias.
        whole = scored.all(dim=1)
        return EvaluationResult(
            pass_at_1=pass_at_1,
            avg_at_k=shares[problems].mean().item(),
            pass_at_k=hits.max(dim=1).values[whole].mean().item(),
            k=self.k,
            num_problems=int(problems.sum()),
            mean_length=sum(self.lengths) / len(self.lengths),
            num_unscored=len(hits) - int(problems.sum()),
            num_partly_scored=int((problems & ~whole).sum()),
        )


class EvaluationMixin:
    """`VAPOTrainer.evaluate`, GRPOTrainer's evaluation with the critic's own metrics: held-out prompts rolled out
    (`_make_rollout`, phase EVAL) and scored as training rolls out and scores, in eval mode, torch's random state
    restored afterwards."""

    def evaluate(
        self,
        eval_dataset: Dataset | IterableDataset | dict | str | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Evaluate the policy and the critic on held-out prompts, as GRPOTrainer evaluates: `num_generations_eval`
        completions per prompt (default `num_generations`), sampled by the training engine with training's sampling
        settings and scored by the training rewards, over every prompt of `eval_dataset` (default: the trainer's; a
        string names an entry of a dict of them; a dict is evaluated entry by entry, prefixed `eval_<name>_`), in
        batches of `per_device_eval_batch_size` completions per process: as many whole groups as fit in a batch over
        the processes, and at least one (a group larger than the batch is sampled whole, where GRPOConfig refuses a
        global eval batch that does not divide into groups).

        Returns, and logs, each prefixed `<metric_key_prefix>_`: what GRPOTrainer logs when it evaluates (`loss`,
        `reward`, `reward_std`, `num_tokens` (the tokens trained on so far), `rewards/<function>/mean` and `/std`,
        `completions/*` lengths, `entropy` (each batch's token mean), `kl` when `beta > 0`, the reward functions' own
        `log_metric`s), and what only a critic shows: `accuracy` (the share of judged completions, those
        `positive_reward_funcs` scored, whose reward is at least `positive_reward_threshold`), the critic's
        `value/explained_variance` on these held-out completions (pooled over the whole set) and `value/mean`. `loss`
        is VAPO's loss at the current weights (`core.vapo_loss`; the policy ratio is 1). Works before, during and after
        training: the models are in eval mode meanwhile, and torch's random state is restored afterwards, so
        evaluating does not change what trains (with the transformers engines; vLLM keeps its own sampler state).
        With `metric_for_best_model`, the evaluations during training track `state.best_metric` (early stopping,
        `save_strategy="best"`, `state.best_model_checkpoint`).
        """
        if isinstance(eval_dataset, str):
            if not isinstance(self.eval_dataset, dict) or eval_dataset not in self.eval_dataset:
                names = sorted(self.eval_dataset) if isinstance(self.eval_dataset, dict) else []
                raise KeyError(f"eval_dataset {eval_dataset!r} is not one of the trainer's eval datasets: {names}.")
            dataset = self.eval_dataset[eval_dataset]
        else:
            dataset = self.eval_dataset if eval_dataset is None else eval_dataset
            if eval_dataset is not None:  # checked here as the trainer's own are checked before any model loads
                # (the reward functions called on it, which may draw random numbers: training's stream is kept)
                with random_state_kept(self.accelerator.device):
                    for row in check_eval_dataset(eval_dataset, self.args, self._conversational).values():
                        if self.rollout_func is None:  # its fields are columns too, which no dataset row shows
                            group = self.args.num_generations_eval or self.args.num_generations
                            self.scorer.check(row, group, self.args.max_steps)
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if not self.models_placed and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            raise ValueError(
                "trainer.evaluate() before train() is not supported under DeepSpeed or FSDP: the models are placed "
                "and sharded when training starts. Set eval_on_start=True to evaluate before the first step."
            )
        if not isinstance(dataset, dict):
            return self._evaluate_one(dataset, metric_key_prefix)
        # DatasetDict, IterableDatasetDict or a dict, entry by entry. Not through `evaluate(part)`: each part would be
        # checked again, the reward functions called on empty completions at every evaluation during training (a
        # judge's passing failure there stopped the run).
        return {
            key: value
            for name, part in dataset.items()
            for key, value in self._evaluate_one(part, f"{metric_key_prefix}_{name}").items()
        }

    def _evaluate_one(self, dataset: Dataset | IterableDataset, metric_key_prefix: str) -> dict[str, float]:
        """`evaluate` on one checked data set: evaluated, logged, and `on_evaluate` called."""
        start = time.time()
        with self._evaluating():
            metrics, num_prompts, num_batches = self._evaluation_loop(dataset)
            metrics = {f"{metric_key_prefix}_{key}": value for key, value in metrics.items()}
            # Samples are prompts, as transformers' evaluation loop counts the rows of GRPOTrainer's eval set.
            metrics.update(speed_metrics(metric_key_prefix, start, num_samples=num_prompts, num_steps=num_batches))
            self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset=None, ignore_keys=None, metric_key_prefix: str = "test"):
        """transformers' `predict` tokenizes a labelled set and runs the model's loss on it, which this trainer's
        prompts and losses do not fit (it failed in the default collator): a policy's predictions are samples, which
        `evaluate` draws and scores."""
        raise NotImplementedError(
            "VAPOTrainer has no predict(): a policy's predictions are samples. Use "
            f"trainer.evaluate(test_dataset, metric_key_prefix={metric_key_prefix!r}) for the rewards, accuracy and "
            "lengths of sampled completions, or generate with trainer.model."
        )

    @contextlib.contextmanager
    def _evaluating(self):
        """Evaluation's own metrics and random state, the models in eval mode (`generation_mode`'s: a QLoRA base's
        4-bit layers stay in train mode, or bitsandbytes repacked them on some CPUs, and every adapter below them
        stopped learning); afterwards, training's pending metrics, its next completions table, its random state and
        the models' mode are as they were."""
        saved = self._metrics, self._last_rollout
        self._metrics, self._last_rollout = defaultdict(list), None
        try:
            with generation_mode(self.actor_critic), random_state_kept(self.accelerator.device):
                yield
        finally:
            self._metrics, self._last_rollout = saved

    def _evaluation_loop(self, dataset: Dataset | IterableDataset) -> tuple[dict[str, float], int, int]:
        """Every prompt of `dataset` once, in batches: each batch is a rollout (`_make_rollout`, phase EVAL) whose
        metrics are averaged over batches as GRPOTrainer averages them, except two of VAPO's own, pooled over all the
        completions: the critic's explained variance and the accuracy. Each prompt counts once: the prompts a last
        batch repeats to split evenly over the processes are left out of every metric but the reward functions' own
        (GRPOTrainer counts them in all but the loss). A batch's mean counts as one whatever its size, as GRPOTrainer's
        does: a short last batch weighs more, and the batch grows with the processes, so the averaged figures can move
        with the process count (the pooled two do not). Returns the metrics, the number of prompts and of batches."""
        args, world = self.args, self.accelerator.num_processes
        all_reduce = self._all_reduce if self._distributed else None
        group = args.num_generations_eval or args.num_generations
        prompts_per_batch = max(1, args.per_device_eval_batch_size * world // group)
        rows, values, returns, num_prompts, num_batches = iter(dataset), [], [], 0, 0
        correct = judged = 0.0
        while batch := list(itertools.islice(rows, prompts_per_batch)):
            if isinstance(dataset, IterableDataset):  # a set's rows were checked up front, a stream's first alone
                check_streamed_rows(batch, "eval_dataset (a batch read from the stream)")
            # Every process takes as many completions (the metrics are collectives): where a last batch does not
            # split evenly, its first prompts are taken again, as accelerate's even batches repeat samples.
            size = next(n for n in itertools.count(len(batch)) if n * group % world == 0)
            share = size * group // world
            rank = self.accelerator.process_index
            real = len(batch) * group  # the rows before the repeated prompts, in the gathered order
            mine = min(max(real - rank * share, 0), share)  # this process's rows among the real ones
            prompts = list(itertools.islice(itertools.cycle(batch), size))
            rows_here = repeated_rows(prompts, group, slice(rank * share, (rank + 1) * share))
            rollout = self._make_rollout(rows_here, EVAL, group, counted=mine)
            verdicts = torch.stack([rollout.is_correct.cpu(), rollout.scores.judged]).to(rollout.loss_mask.device)
            right, graded = self.accelerator.gather(verdicts.T)[:real].sum(dim=0).tolist()  # one collective
            correct, judged = correct + right, judged + graded
            counted = torch.arange(share, device=rollout.loss_mask.device) < mine
            self._record(rollout_metrics(rollout, self.accelerator.gather, all_reduce, counted))
            self._metrics["loss"].append(self._evaluation_loss(rollout))  # the repeats are out of its loss mask
            mask = rollout.loss_mask.bool()
            values.append(rollout.old_values[mask])
            returns.append(rollout.returns[mask])
            num_prompts, num_batches = num_prompts + len(batch), num_batches + 1
        metrics = averaged_metrics(self._metrics)
        for key, column in self._metrics.items():  # the extremes of the whole set, not the mean of the batches'
            name = key.rsplit("/", 1)[-1]
            if name.startswith(("min_", "max_")) and name.endswith("_length"):
                finite = [value for value in column if not math.isnan(value)]  # a batch where none terminated: NaN
                metrics[key] = (min if name.startswith("min_") else max)(finite) if finite else float("nan")
        self._metrics.clear()
        values, returns = torch.cat(values), torch.cat(returns)
        metrics[EXPLAINED_VARIANCE] = explained_variance(values, returns, torch.ones_like(values), all_reduce).item()
        metrics[ACCURACY] = correct / judged if judged else float("nan")
        return metrics, num_prompts, num_batches

    def _evaluation_loss(self, rollout: Rollout) -> float:
        """VAPO's loss (`core.vapo_loss`) on an evaluation rollout at the weights that sampled it, over every
        process's tokens: the critic's value loss on its targets (none for a frozen value function, as in training),
        the policy's loss at ratio 1 (PPO's: minus the mean whitened advantage; the `surrogate`'s own under GRPO's
        other losses) and the positive examples' NLL."""
        batch = rollout.micro_batch(torch.arange(len(rollout)))
        settings = self._loss_settings(EVAL, batch["mask"], batch["is_positive"])
        values = batch["old_values"] if self.actor_critic.learns_values else None  # as training: a frozen one has none
        loss, _ = vapo_loss(batch["old_logprobs"], values, batch, **settings)
        return (self._all_reduce(loss.detach()) / self.accelerator.num_processes).item()
