"""The optimizer and learning-rate schedules of the actor-critic: one AdamW, separate groups and rates per side.

The actor and the critic share no trainable weight: each gets its own parameter groups (with and without weight
decay), learning rate (`learning_rate`, `critic_learning_rate`) and schedule. The critic's schedule runs from the
first step; the actor's starts when value pretraining ends (its warm-up then begins).
"""

from __future__ import annotations

import math

import torch


def parameter_groups(
    actor_critic, decay_names: set[str], learning_rate: float, critic_learning_rate: float, weight_decay: float
) -> list[dict]:
    """AdamW parameter groups named "policy" and "critic", each split by whether weight decay applies."""
    names = {id(p): n for n, p in actor_critic.named_parameters()}
    groups = []
    for side, params, lr in (
        ("policy", actor_critic.policy_parameters(), learning_rate),
        ("critic", actor_critic.critic_parameters(), critic_learning_rate),
    ):
        for with_decay in (True, False):
            selected = [p for p in params if (names[id(p)] in decay_names) == with_decay]
            if selected:
                # (float(): a rate the config derived is a float subclass, which a checkpoint's weights-only load
                # of the optimizer's state refuses)
                groups.append(
                    {
                        "params": selected,
                        "lr": float(lr),
                        "weight_decay": weight_decay if with_decay else 0.0,
                        "name": side,
                    }
                )
    return groups


class Schedule:
    """Learning-rate multiplier for one parameter group, starting at optimizer step `start_step`.

    A callable object rather than a function so that `LambdaLR.state_dict()` saves `start_step` in checkpoints
    (the actor's schedule starts only when value pretraining ends). Formulas as in `transformers.get_scheduler`.
    """

    def __init__(
        self, kind: str, warmup_steps: int, total_steps: int, start_step: int | None = 0, num_cycles: float = 0.5
    ):
        self.kind = str(getattr(kind, "value", kind))  # a plain string: the state loads with weights_only=True
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.start_step = start_step
        self.num_cycles = float(num_cycles)  # cosine's waves (`lr_scheduler_kwargs`); 0.5: down to 0 once

    def __call__(self, step: int) -> float:
        if self.start_step is None or step < self.start_step:
            return 0.0
        step -= self.start_step
        if self.kind == "constant":  # transformers' `constant` has no warm-up, whatever warmup_steps says
            return 1.0
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        if self.kind == "constant_with_warmup":
            return 1.0
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * self.num_cycles * 2.0 * min(progress, 1.0))))  # cosine


def name_groups_by_side(optimizer: torch.optim.Optimizer, actor_critic, holds_policy_out: bool = False) -> None:
    """Name each unnamed group of a user's optimizer "policy" or "critic" where it holds one side's parameters
    alone, as `parameter_groups` names the trainer's own: the actor's schedule then starts with its first update
    and its rate is held at 0 before (its warm-up was spent during value pretraining, and a decay ran over the whole
    run), the logged `learning_rate` is the policy's, and DeepSpeed holds the policy's groups out of critic-only steps.
    A group that mixes both sides stays unnamed: it follows the critic's schedule (never held at 0).

    Refused where it lacks a side's trainable parameters: the critic, which the trainer builds, was left out of an
    optimizer over the policy model's parameters (GRPOTrainer's way), so it never stepped and its gradients, which
    `optimizer.zero_grad()` never cleared, summed over every step, silently.

    ``holds_policy_out``: the run has critic-only steps under DeepSpeed, which hold the groups named "policy" out of
    the optimizer step (`distributed.groups_held_out`): a group holding the policy's parameters under another name (a
    group over both sides) would step them there, and the critic's under "policy" would not step. Refused here, as
    the optimizer is built, not at the first critic-only step after a rollout."""
    policy = {id(p) for p in actor_critic.policy_parameters()}
    critic = {id(p) for p in actor_critic.critic_parameters()}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    sides = {"policy": policy, "critic": critic}
    missing = [f"{len(ids - held)} of the {side}'s {len(ids)}" for side, ids in sides.items() if ids - held]
    if missing:
        raise ValueError(
            f"The optimizer given (`optimizers=`) does not hold {' and '.join(missing)} trainable parameters: they "
            "would never train. The trainer builds the critic: build the trainer without `optimizers`, then set "
            "`trainer.optimizer = YourOptimizer(trainer.actor_critic.parameters(), ...)` (or one group per side: "
            "`policy_parameters()`, `critic_parameters()`) before `train()`."
        )
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        if "name" not in group and ids:
            if ids <= policy:
                group["name"] = "policy"
            elif ids <= critic:
                group["name"] = "critic"
    if not holds_policy_out:
        return
    # A group held out must hold the policy's parameters alone, and no other group any of them.
    mixed = []
    for i, group in enumerate(optimizer.param_groups):
        ids = {id(p) for p in group["params"]}
        if not (ids <= policy if group.get("name") == "policy" else not ids & policy):
            mixed.append(i)
    if mixed:
        raise ValueError(
            f"The optimizer's parameter group(s) {mixed} hold the policy's parameters beside the critic's, or under "
            "a name other than 'policy', or the critic's under 'policy': under DeepSpeed, the critic-only steps "
            "(value pretraining, critic_num_iterations > num_iterations) hold the groups named 'policy' out of the "
            "step, so the policy would move there (or the critic would not). Build one group per side: "
            "`[{'params': trainer.actor_critic.policy_parameters()}, {'params': trainer.actor_critic"
            ".critic_parameters()}]` (each is named for its side; a name given must be 'policy' for the policy's)."
        )


def side_schedules(
    optimizer: torch.optim.Optimizer,
    kind: str,
    warmup_steps,
    rl_steps: int,
    pretrain_steps: int,
    actor_starts_at: int | None,
    scheduler_kwargs: dict | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` with one `Schedule` per group: the actor's over the RL steps from `actor_starts_at` (None: when
    value pretraining ends), the critic's over all steps. Groups without a "name" (of a user's own optimizer, mixing
    both sides: `name_groups_by_side`) follow the critic's: never held at zero. `warmup_steps(total)` gives the
    warm-up of a schedule of `total` steps; `scheduler_kwargs` (`lr_scheduler_kwargs`): cosine's `num_cycles`."""
    schedules = []
    for group in optimizer.param_groups:
        actor = group.get("name") == "policy"
        total = rl_steps + (0 if actor else pretrain_steps)
        start = actor_starts_at if actor else 0
        schedules.append(Schedule(kind, warmup_steps(total), total, start, **(scheduler_kwargs or {})))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)


def set_critic_length(scheduler, optimizer: torch.optim.Optimizer, total_steps: int) -> None:
    """The critic's schedule over `total_steps`, the run's length once value pretraining has ended (its stop rule,
    or a resumed run's other budget, makes it other than planned): a decaying rate reaches 0 at the run's end, not
    before (a resume with a smaller budget) or never (an early stop). Its warm-up and its position stay."""
    for group, schedule, base_lr in _side_schedules(scheduler, optimizer, actor=False):
        schedule.total_steps = total_steps
        group["lr"] = base_lr * schedule(scheduler.last_epoch)
    rates_set(scheduler, optimizer)


def start_actor_schedule(scheduler, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Start the actor's schedule at optimizer step `step` (the end of value pretraining). A scheduler of the user's
    own (`trainer.lr_scheduler = ...`) knows no sides: said once, where value pretraining ran its steps."""
    started = False
    for group, schedule, base_lr in _side_schedules(scheduler, optimizer, actor=True):
        schedule.start_step = step
        # LambdaLR computed this step's rate before the actor's schedule started: recompute it.
        group["lr"] = base_lr * schedule(scheduler.last_epoch)
        started = True
    rates_set(scheduler, optimizer)
    if not started and step > 0 and any(group.get("name") == "policy" for group in optimizer.param_groups):
        import warnings

        warnings.warn(
            f"The lr_scheduler given ({type(scheduler).__name__}) ran through value pretraining's {step} steps: the "
            "policy did not train meanwhile, but its schedule (a warm-up, a decay) went on, where the trainer's own "
            "starts the policy's when RL starts. Leave lr_scheduler to the trainer (lr_scheduler_type, warmup_steps), "
            "or count value_pretrain_steps' optimizer steps into the one you give.",
            stacklevel=2,
        )


def rates_set(scheduler, optimizer: torch.optim.Optimizer) -> None:
    """The scheduler's record of the rates (`get_last_lr()`, which transformers' callbacks and `_get_learning_rate`
    read, and `scheduler.pt` saves) made the groups' again after they were set from outside a step: it said the
    actor's 0 for a step after RL had started."""
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _side_schedules(scheduler, optimizer: torch.optim.Optimizer, actor: bool):
    """(group, `Schedule`, base rate) of the actor's groups (named "policy") or of the critic's (the others); none
    for a scheduler of the user's own."""
    for group, schedule, base_lr in zip(
        optimizer.param_groups, getattr(scheduler, "lr_lambdas", []), getattr(scheduler, "base_lrs", [])
    ):
        if (group.get("name") == "policy") == actor and isinstance(schedule, Schedule):
            yield group, schedule, base_lr
