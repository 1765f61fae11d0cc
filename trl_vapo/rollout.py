"""One generation round on one process: everything the updates and the metrics need, built once by the trainer.

`VAPOTrainer._make_rollout` samples, scores, values and computes advantages, then builds a `Rollout`;
`rollout_metrics` turns it into the logged statistics (over all processes).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence

import torch

from .core import AllReduce, explained_variance, masked_mean
from .metric_names import ACCURACY, EXPLAINED_VARIANCE, REWARD, VALUE_PRETRAIN
from .modeling import trim_padding
from .scoring import Scores


@dataclasses.dataclass
class Rollout:
    """One generation round on this process (no gradients). `N` completions of up to `C` tokens."""

    phase: str  # VALUE_PRETRAIN, RL or EVAL
    input_ids: torch.Tensor  # [N, P + C] prompt (left-padded) followed by completion (right-padded)
    attention_mask: torch.Tensor  # [N, P + C]
    prompt_length: int  # P
    truncated: torch.Tensor  # [N] bool: reached max_completion_length without a stop
    scores: Scores  # the reward functions' verdicts
    action_mask: torch.Tensor  # [N, C] completion tokens the policy sampled (not an environment's: `env_mask`)
    loss_mask: torch.Tensor  # [N, C] the actions that train (scored completions)
    is_correct: torch.Tensor  # [N] bool: scored with a reward >= positive_reward_threshold (`accuracy`)
    is_positive: torch.Tensor  # [N] bool: correct and trains (the NLL loss; not a truncated one it masks)
    old_values: torch.Tensor  # [N, C] V(s_t) before any update
    returns: torch.Tensor  # [N, C] the critic's targets
    raw_advantages: torch.Tensor  # [N, C] GAE advantages (zeros during value pretraining)
    advantages: torch.Tensor  # [N, C] what the policy loss uses: whitened when configured
    lambda_actor: torch.Tensor  # [N] each completion's GAE lambda
    old_logprobs: torch.Tensor | None = None  # [N, C]; None: each sample trains the policy that sampled it
    ref_logprobs: torch.Tensor | None = None  # [N, C] under the reference policy, when beta > 0
    is_weights: torch.Tensor | None = None  # [N, C] or [N, 1] importance-sampling weights of another sampler
    sampling_logprobs: torch.Tensor | None = None  # [N, C] another sampler's (vLLM's), for off_policy_mask_threshold
    sampling_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    extra_columns: dict[str, list] = dataclasses.field(default_factory=dict)  # reward functions' `log_extra`
    pad_to_multiple_of: int | None = None  # P and C are multiples of it, and so is every micro-batch's width
    group_size: int = 1  # completions per prompt, consecutive rows (over all processes, in rank order)
    # The loss statistics of the critic's part of the update when it ran in the scoring pass (its gradients wait in
    # `.grad`: `VAPOTrainer._critic_trains_while_scoring`); taken by the rollout's one optimizer step.
    critic_step: dict[str, torch.Tensor] | None = None
    entropy: torch.Tensor | None = None  # [N, C] the policy's per-token entropy, in evaluation (GRPOTrainer logs it)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_mask(self) -> torch.Tensor:
        """[N, C] the generated tokens (up to and including the stop token)."""
        return self.attention_mask[:, self.prompt_length :]

    @property
    def lengths(self) -> torch.Tensor:
        """[N] completion lengths in tokens, an environment's tokens included."""
        return self.completion_mask.sum(dim=1)

    @property
    def completion_ids(self) -> list[list[int]]:
        ids = self.input_ids[:, self.prompt_length :]
        return [row[:n].tolist() for row, n in zip(ids, self.lengths.tolist())]

    def micro_batch(
        self, rows: torch.Tensor, spans: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor | int | None]:
        """The model inputs of `rows` (indices, on the CPU; see `trim_padding`, and its `spans`) and their training
        targets, cut to the same length: what `ActorCritic.forward` and `core.vapo_loss` take."""
        index = rows.to(
            self.input_ids.device, non_blocking=True
        )  # (a CPU index is copied, and waited for, at each use)
        input_ids, attention_mask, length = trim_padding(
            self.input_ids, self.attention_mask, self.prompt_length, rows, self.pad_to_multiple_of, spans, index
        )
        rows = index

        def cut(x):
            return None if x is None else x[rows, :length] if x.shape[-1] > 1 else x[rows]

        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "completion_length": length,
            "mask": self.loss_mask[rows, :length],
            "old_logprobs": cut(self.old_logprobs),
            "old_values": self.old_values[rows, :length],
            "returns": self.returns[rows, :length],
            "advantages": self.advantages[rows, :length],
            "is_positive": self.is_positive[rows],
            "is_weights": cut(self.is_weights),
            "sampling_logprobs": cut(self.sampling_logprobs),
        }


def concatenate_rollouts(rollouts: Sequence[Rollout]) -> Rollout:
    """The rollouts as one, for the critic's steps over several value-pretraining rollouts
    (`value_pretrain_replay`): every ``[N, P + C]`` tensor's prompt part left-padded and completion part right-padded
    to the widest, every ``[N, C]`` one right-padded. The rest is the last rollout's: `pad_to_multiple_of` (a run's
    setting, the same in each), and what no critic step reads: the rewards' verdicts (its rows alone), sampling
    metrics, extra columns, `group_size`, `critic_step` and `entropy` (its metrics were logged from it before; not
    for `rollout_metrics`)."""
    newest = rollouts[-1]
    if len(rollouts) == 1:
        return newest
    prompt_width = max(r.prompt_length for r in rollouts)
    completion_width = max(r.loss_mask.shape[1] for r in rollouts)

    def joined(name: str) -> torch.Tensor | None:
        parts = [getattr(r, name) for r in rollouts]
        if any(part is None for part in parts):
            return None
        per_token = name != "is_weights" or any(part.shape[1] > 1 for part in parts)  # [N, 1]: one per sequence
        padded = []
        for rollout, part in zip(rollouts, parts):
            completion_padding = completion_width - rollout.loss_mask.shape[1]
            if name in ("input_ids", "attention_mask"):  # [N, P + C]: prompts are left-padded, completions right
                part = torch.nn.functional.pad(part, (prompt_width - rollout.prompt_length, completion_padding))
            elif part.dim() == 2 and per_token:  # [N, C]
                part = torch.nn.functional.pad(part, (0, completion_padding))
            padded.append(part)
        return torch.cat(padded)

    fields = ("input_ids", "attention_mask", "truncated", "action_mask", "loss_mask", "is_correct", "is_positive")
    fields += ("old_values", "returns")
    fields += ("raw_advantages", "advantages", "lambda_actor", "old_logprobs", "ref_logprobs", "is_weights")
    fields += ("sampling_logprobs",)
    return dataclasses.replace(newest, prompt_length=prompt_width, **{name: joined(name) for name in fields})


_SAVED_SCORES = ("per_function", "reward", "scored", "verdict", "non_finite")


def save_rollouts(rollouts: Sequence[Rollout], path: str) -> None:
    """`rollouts` as one safetensors file (value pretraining's replay window in a checkpoint): every tensor, the
    scores' included, under ``<index>.<field>``; the rest in the metadata. Left out: the reward functions' extra
    columns (any Python objects; logged already, read by no update)."""
    from safetensors.torch import save_file

    tensors, settings = {}, []
    for index, rollout in enumerate(rollouts):
        fields = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}
        fields |= {f"scores.{name}": getattr(rollout.scores, name) for name in _SAVED_SCORES}
        tensors |= {
            f"{index}.{name}": value.detach().to("cpu", copy=True).contiguous()  # (copies: two may share memory)
            for name, value in fields.items()
            if isinstance(value, torch.Tensor)
        }
        settings.append(
            {
                "phase": rollout.phase,
                "prompt_length": rollout.prompt_length,
                "pad_to_multiple_of": rollout.pad_to_multiple_of,
                "group_size": rollout.group_size,
                "sampling_metrics": rollout.sampling_metrics,
                "score_names": rollout.scores.names,
            }
        )
    save_file(tensors, path, metadata={"rollouts": json.dumps(settings)})


def load_rollouts(path: str, device: torch.device) -> list[Rollout]:
    """The rollouts `save_rollouts` wrote, their tensors on `device` (the scores' on the CPU, where they live)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as handle:
        settings = json.loads(handle.metadata()["rollouts"])
    by_rollout: list[dict[str, torch.Tensor]] = [{} for _ in settings]
    for key, value in load_file(path).items():  # `<index>.<field>`
        index, name = key.split(".", 1)
        by_rollout[int(index)][name] = value
    rollouts = []
    for saved, mine in zip(settings, by_rollout):
        scores = Scores(
            names=saved["score_names"],
            **{name: mine.pop(f"scores.{name}", None) for name in _SAVED_SCORES},
        )
        fields = {name: value.to(device) for name, value in mine.items()}
        rollouts.append(
            Rollout(
                phase=saved["phase"],
                prompt_length=saved["prompt_length"],
                pad_to_multiple_of=saved["pad_to_multiple_of"],
                group_size=saved["group_size"],
                sampling_metrics=saved["sampling_metrics"],
                scores=scores,
                **fields,
            )
        )
    return rollouts


def rollout_metrics(
    rollout: Rollout, gather: Callable, all_reduce: AllReduce | None, counted: torch.Tensor | None = None
) -> dict[str, float]:
    """The rollout's statistics over all processes: rewards, accuracy, lengths, the critic and the advantages.
    `counted`: this process's rows to count (an evaluation's repeated prompts are not; whole groups, out of the loss
    mask already, which the masked statistics read); default all."""
    device = rollout.loss_mask.device
    kept = None if counted is None else gather(counted.to(device))

    def gathered(tensor: torch.Tensor) -> torch.Tensor:  # the scores live on the CPU; NCCL gathers only device tensors
        tensor = gather(tensor.to(device))
        return tensor if kept is None else tensor[kept]

    scores = rollout.scores
    scored, judged = gathered(scores.scored), gathered(scores.judged)
    trains = gathered(rollout.loss_mask.sum(dim=1) > 0)
    is_correct, is_positive = gathered(rollout.is_correct), gathered(rollout.is_positive)
    rewards = gathered(scores.reward)[scored]
    lengths = gathered(rollout.action_mask.sum(dim=1)).float()  # the policy's tokens, as GRPOTrainer counts them
    truncated = gathered(rollout.truncated)
    ended = lengths[~truncated]  # GRPOTrainer's terminated completions (NaN where none ended, TRL logs 0)
    per_function = gathered(scores.per_function)
    non_finite = gathered(scores.non_finite)
    mask = rollout.loss_mask
    metrics = {
        REWARD: _mean(rewards),
        "reward_std": _std(rewards),
        # Over the completions judged for correctness; a truncated correct answer counts (TRL masks only the loss)
        ACCURACY: _mean(is_correct[judged].float()),
        "positive_fraction": _mean(is_positive[trains].float()),
        "rewards/unscored_fraction": 1.0 - scored.float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": _mean(ended),
        "completions/min_terminated_length": _min(ended),
        "completions/max_terminated_length": _max(ended),
        # NaN where no token trains (all unscored, or truncated and masked): no reading, as the accuracy's
        "value/mean": masked_mean(rollout.old_values, mask, all_reduce=all_reduce, empty=math.nan).item(),
        EXPLAINED_VARIANCE: explained_variance(rollout.old_values, rollout.returns, mask, all_reduce).item(),
    }
    if rollout.phase != VALUE_PRETRAIN:  # value pretraining computes no advantage (zeros, not a reading)
        metrics["advantages/mean"] = masked_mean(
            rollout.raw_advantages, mask, all_reduce=all_reduce, empty=math.nan
        ).item()
        metrics["lambda_actor/mean"] = _mean(gathered(rollout.lambda_actor)[trains])
    non_finite_fractions = non_finite.float().mean(dim=0).tolist()  # scored as None; one host read for all
    for j, name in enumerate(scores.names):
        column = per_function[:, j]
        column = column[~torch.isnan(column)]
        metrics[f"rewards/{name}/mean"] = _mean(column)
        metrics[f"rewards/{name}/std"] = _std(column)
        metrics[f"rewards/{name}/non_finite_fraction"] = non_finite_fractions[j]
    if rollout.group_size > 1:  # GRPOTrainer's: the share of groups whose scored completions got the same reward
        all_rewards = gathered(scores.reward)
        grouped = torch.where(scored, all_rewards, torch.full_like(all_rewards, math.nan)).view(-1, rollout.group_size)
        spread = _nanstd(grouped.float())  # an unscored completion is NaN, as in GRPOTrainer: not a reward of 0
        metrics["frac_reward_zero_std"] = spread.isclose(torch.zeros_like(spread)).float().mean().item()
    if rollout.ref_logprobs is not None:
        # GRPOTrainer's estimator of KL(policy || reference), exp(r) - r - 1 with r = log ref - log policy: never
        # negative, where the per-token penalty the reward is charged (beta * -r, the same KL's estimate) can read so
        log_ratio = rollout.ref_logprobs - rollout.old_logprobs
        kl = log_ratio.exp() - log_ratio - 1  # (NaN where no token trains: no reading, as `value/mean`'s)
        metrics["kl"] = masked_mean(kl, mask, all_reduce=all_reduce, empty=math.nan).item()
    if rollout.entropy is not None:  # an evaluation's: GRPOTrainer's `eval_entropy`, the token mean
        metrics["entropy"] = masked_mean(rollout.entropy, mask, all_reduce=all_reduce, empty=math.nan).item()
    metrics.update(reduce_sampling_metrics(rollout.sampling_metrics, gather, mask.device))
    return metrics


def reduce_sampling_metrics(metrics: dict[str, float], gather: Callable, device: torch.device) -> dict[str, float]:
    """This process's `sampling/*` metrics reduced over all processes as TRL reduces them: the mean of the
    processes' `.../mean`, the largest `.../max`, the smallest `.../min` (a process's NaN left out)."""
    if not metrics:
        return {}
    keys = sorted(metrics)
    values = gather(torch.tensor([metrics[key] for key in keys], dtype=torch.float32, device=device))
    reduced = {}
    for key, column in zip(keys, values.view(-1, len(keys)).T):
        column = column[~torch.isnan(column)]
        if column.numel() == 0:
            reduced[key] = math.nan
        elif key.endswith("/max"):
            reduced[key] = column.max().item()
        elif key.endswith("/min"):
            reduced[key] = column.min().item()
        else:
            reduced[key] = column.mean().item()
    return reduced


def _mean(values: torch.Tensor) -> float:
    return values.float().mean().item() if values.numel() else math.nan


def _std(values: torch.Tensor) -> float:
    return values.float().std().item() if values.numel() > 1 else math.nan


def _min(values: torch.Tensor) -> float:
    return values.float().min().item() if values.numel() else math.nan


def _max(values: torch.Tensor) -> float:
    return values.float().max().item() if values.numel() else math.nan


def _nanstd(rows: torch.Tensor) -> torch.Tensor:
    """Each row's standard deviation over its non-NaN entries, with Bessel's correction (TRL's `nanstd`): NaN for a
    row with fewer than two."""
    count = (~rows.isnan()).sum(dim=1)
    squares = (rows - rows.nanmean(dim=1, keepdim=True)).pow(2).nansum(dim=1)
    return torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.full_like(squares, math.nan)).sqrt()
