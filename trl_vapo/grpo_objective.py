"""The parts of GRPOTrainer's objective that VAPO takes (none is in the VAPO paper, all are off by default): GDPO's
per-function reward normalisation (`multi_objective_aggregation`), the entropy bonus's adaptive control
(`use_adaptive_entropy`), the top-entropy token mask (`top_entropy_quantile`) and the off-policy sequence mask
(`off_policy_mask_threshold`). The mathematics is in `trl_vapo.core` (`group_normalized_rewards`,
`adaptive_entropy_coef`, `high_entropy_mask`, `off_policy_mask`); this is the trainer's side: which scores, tokens,
log-probs and coefficient, and GRPOTrainer's names for them."""

from __future__ import annotations

import math
from typing import Any

import torch

from .core import adaptive_entropy_coef, group_normalized_rewards, high_entropy_mask, off_policy_mask
from .scoring import Scores


class GRPOObjectiveMixin:
    """`VAPOTrainer`'s share of GRPOTrainer's objective settings; reads `args`, `progress` and `accelerator`."""

    def _sequence_rewards(self, scores: Scores, group_size: int) -> torch.Tensor:
        """[N] each completion's reward, which its last token gets: the weighted sum of its scores, or under
        `multi_objective_aggregation="normalize_then_sum"` `core.group_normalized_rewards` of every process's scores
        (a group may span two processes; a collective); 0 where no function gave a score."""
        if self.args.multi_objective_aggregation == "sum_then_normalize":
            return scores.reward
        local = scores.per_function.to(self.accelerator.device)  # NCCL gathers only device tensors
        pooled = self.accelerator.gather(local) if self.accelerator.num_processes > 1 else local
        rewards = group_normalized_rewards(pooled, self.scorer.weights, group_size)
        start = self.accelerator.process_index * len(local)
        return rewards[start : start + len(local)].nan_to_num(0.0).cpu()

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (GRPOTrainer's attribute): `args.entropy_coef`, or under
        `use_adaptive_entropy` the controller's, which the run's progress checkpoints."""
        if self.args.use_adaptive_entropy and self.progress.entropy_coef is not None:
            return self.progress.entropy_coef
        return self.args.entropy_coef

    def _applied_entropy_coef(self) -> float:
        """The coefficient of this step's bonus: under adaptive control, only while the last step's entropy was at
        or below `entropy_target` (none before the first reading), as GRPOTrainer applies it."""
        args, reading = self.args, self.progress.controlled_entropy
        if not args.use_adaptive_entropy:
            return args.entropy_coef
        return self.entropy_coef if reading is not None and reading <= args.entropy_target else 0.0

    def _control_entropy(self, entropy: float) -> None:
        """`core.adaptive_entropy_coef` after an optimizer step that trained the policy: `entropy` is the step's
        token mean, over every process, of the tokens the bonus acts on."""
        args = self.args
        self.progress.entropy_coef = adaptive_entropy_coef(
            self.entropy_coef,
            entropy,
            args.entropy_target,
            args.entropy_coef_delta,
            args.entropy_coef_min,
            args.entropy_coef_max,
        )
        self.progress.controlled_entropy = entropy

    def _token_masks(self, out: dict[str, torch.Tensor], batch: dict[str, Any]) -> dict[str, torch.Tensor | None]:
        """A micro-batch's `entropy_mask` and `off_policy_mask` for `core.vapo_loss` (None where off): the top
        `top_entropy_quantile` of its tokens by entropy; and under `off_policy_mask_threshold` not the negative
        advantages of sequences whose sampler drifted, measured against vLLM's log-probs, else the policy's before
        the rollout's first update (with neither, the policy that sampled is the one training: no drift)."""
        args, mask = self.args, batch["mask"]
        masks = {"entropy_mask": None, "off_policy_mask": None}
        if args.top_entropy_quantile < 1.0:
            top = self.get_high_entropy_mask(out["entropy"], mask, 1.0 - args.top_entropy_quantile)
            masks["entropy_mask"] = top.to(mask.dtype)
        sampler = batch["sampling_logprobs"] if batch["sampling_logprobs"] is not None else batch["old_logprobs"]
        if args.off_policy_mask_threshold is not None and sampler is not None:
            masks["off_policy_mask"] = self.get_off_policy_mask(
                batch["advantages"], out["logprobs"], sampler, mask, args.off_policy_mask_threshold
            )
        return masks

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """GRPOTrainer's method: `core.high_entropy_mask` at the quantile `threshold` (1 - top_entropy_quantile) of
        every process's valid tokens (a collective under data parallelism)."""

        def gather(values: torch.Tensor) -> torch.Tensor:  # processes hold different token counts: pad with NaN
            padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=math.nan)
            gathered = self.accelerator.gather(padded)
            return gathered[~torch.isnan(gathered)]

        return high_entropy_mask(entropies, mask, threshold, gather)

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """GRPOTrainer's static method, in its argument names: `core.off_policy_mask`."""
        return off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold)
