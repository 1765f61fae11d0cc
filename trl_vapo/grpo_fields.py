"""GRPOConfig's fields that VAPOConfig takes so a GRPO user's config runs unchanged: GRPO's loss-type names for VAPO's
ways of averaging the loss and for its per-token objectives, the fields of GRPO features VAPO does not have, accepted
at GRPO's default and refused otherwise with what VAPO does instead (`VAPOConfig._validate`), and GRPOTrainer's
warnings about its loss settings."""

from __future__ import annotations

from dataclasses import field

# GRPOConfig's loss types that are VAPO's two aggregations: DAPO's is VAPO's token-level loss (one mean over the
# optimizer step's tokens); BNPO's (each micro-batch's tokens) and Dr. GRPO's (a constant, B x L_max) normalisers are
# not that mean's multiples: BNPO weighs a short micro-batch's tokens more, Dr. GRPO's scale moves with the step's
# token count (VAPOConfig's `loss_type` help says so).
GRPO_LOSS_TYPES = {"dapo": "token", "bnpo": "token", "dr_grpo": "token", "grpo": "sequence"}
# GRPOConfig's loss types with another per-token objective than PPO's clipped one: (VAPOConfig's `surrogate`, the
# aggregation GRPOTrainer gives that loss).
GRPO_SURROGATE_LOSS_TYPES = {"cispo": ("cispo", "token"), "sapo": ("sapo", "sequence"), "vespo": ("vespo", "token")}


GRPO_ONLY: dict[str, tuple] = {  # field: (GRPO's default, what VAPO does instead[, other accepted values])
    "scale_rewards": (
        "group",
        "VAPO does not scale rewards, whichever of the three is set: its advantages come from the critic (GAE), "
        "whitened over the rollout's tokens with `whiten_advantages`. True and False, GRPO's old spellings of "
        "'group' and 'none', are accepted too.",
        ("none", "batch"),
    ),
    "use_bias_correction_kl": (
        True,
        "VAPO's KL (`beta`) is a per-token penalty in the reward, not a loss term to reweight: False (no reweighting, "
        "GRPO's setting before DeepSeek-V3.2's correction) is accepted too.",
        (False,),
    ),
    "max_tool_calling_iterations": (
        None,
        "VAPO has no built-in tool loop: write the episode, tools included, as a rollout_func (the README's "
        "Custom rollouts).",
    ),
    "log_completions_hub_repo": (
        None,
        "VAPO does not upload completions to the Hub: `log_completions` logs them to wandb or trackio.",
    ),
}


def grpo_only_field(name: str):
    """A GRPOConfig field of a feature VAPO does not have (`GRPO_ONLY`): accepted at GRPO's default (and the other
    values listed there), else refused by `VAPOConfig._validate` with what VAPO does instead."""
    default, instead, *also = GRPO_ONLY[name]
    accepted = " and ".join(repr(value) for value in (default, *(also[0] if also else ())))
    where = f"GRPO's default ({default!r}) only" if not also else f"{accepted} only (GRPO's default first)"
    return field(default=default, metadata={"help": f"GRPOConfig's field, accepted at {where}: {instead}"})


def grpo_setting_warnings(args) -> list[str]:
    """GRPOTrainer's warnings about loss settings that run but miss what their paper set up, in its words; and each
    GRPO_ONLY field set to a value VAPO accepts other than GRPO's default (`scale_rewards='none'`, Dr. GRPO's), which
    changes nothing here (the refused values never reach here)."""
    warnings = [
        f"GRPOConfig's {name}={getattr(args, name)!r}: {instead}"
        for name, (default, instead, *_) in GRPO_ONLY.items()
        if getattr(args, name) != default
    ]
    if args.surrogate == "ppo" and args.epsilon_high < args.epsilon:
        # (a GRPO config's `epsilon` alone: GRPOConfig's epsilon_high follows it, VAPO's default is 0.28)
        warnings.append(
            f"epsilon_high={args.epsilon_high} is below epsilon={args.epsilon}: the ratio's upper clip (1 + "
            "epsilon_high) is nearer 1 than its lower one, the reverse of clip-higher (VAPO's epsilon_high is 0.28 "
            "whatever epsilon is; GRPOConfig's follows epsilon). Set epsilon_high, or None for epsilon's value."
        )
    if args.loss_type == "luspo" and args.importance_sampling_level != "sequence":
        warnings.append(
            "When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to mirror the "
            "paper's setup."
        )
    if args.surrogate == "vespo" and args.importance_sampling_level != "token":
        warnings.append(
            "VESPO computes sequence-level importance weights internally. `importance_sampling_level` should be "
            "set to `'token'` (the default)."
        )
    if args.surrogate == "cispo" and args.epsilon_high < 1.0:
        warnings.append(
            f"With the 'cispo' loss, epsilon_high is the importance weight's upper bound itself (eps_max), not 1 + "
            f"epsilon_high: {args.epsilon_high} caps every weight below 1. MiniMax-M1 and ScaleRL use 5.0."
        )
    if args.importance_sampling_level == "sequence" and args.loss_type == "token" and args.surrogate != "vespo":
        warnings.append(  # GRPOTrainer's warning for its token-summed losses
            "With importance_sampling_level='sequence', the 'token' loss sums per-token contributions, which "
            "weights each sequence by its completion length instead of optimizing the per-sequence objective. To "
            "reproduce the GSPO paper's setup, set loss_type='sequence'."
        )
    return warnings
