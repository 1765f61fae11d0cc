"""What the training loop needs from DeepSpeed ZeRO and FSDP2 beyond what accelerate hands it.

* **Per-side gradient clipping under ZeRO.** VAPO clips the actor's and the critic's gradients separately, so a
  spike in one never shrinks the other's update; DeepSpeed only clips the global norm of everything. Under ZeRO
  each rank holds a disjoint partition of every gradient after the step's last backward, so a side's norm is the
  square root of the summed squares over ranks (one all-reduce of a scalar), and clipping scales each rank's
  partition in place. DeepSpeed's own ``gradient_clipping`` is then switched off.
* **Critic-only steps.** Value pretraining and the passes beyond `num_iterations` train the critic alone. Without
  DeepSpeed the policy's gradients are cleared and the optimizer skips it; ZeRO steps flat partitions, where a
  parameter's gradient cannot be cleared, and its Adam would keep moving the policy on zero gradients (momentum, a
  growing step count, weight decay). So the policy's parameter groups are held out of those steps
  (`groups_held_out`): its weights, moments and step count stay exactly as without DeepSpeed. ZenFlow,
  SuperOffload and partial optimizer offload step beyond that reach and are refused for runs with critic-only steps
  (`check_deepspeed_config`).
* **Adam's step count when RL starts.** The policy's step count is still zeroed then (`reset_adam_step`): a no-op for
  a run that held the policy out, it repairs checkpoints written by earlier versions, which stepped the policy through
  value pretraining, and DeepSpeed's fp16 wrappers, which step every group once when they are built. A step count
  with zero moments, which those leave, would scale the first RL updates by a wrong bias correction.
* **Generation under FSDP2.** ``fully_shard`` gathers the root module's own parameters (embeddings, final norm, LM
  head) in the root's forward hook; ``policy.generate`` bypasses that forward, so they are gathered around it (and
  the root is initialised as the root first, through FSDP2's private ``_lazy_init``).

The ZeRO partitions are reached through DeepSpeed's ``safe_get_local_grad`` / ``safe_set_local_grad`` (ZeRO-3)
and each parameter's ``_hp_mapping`` fragment (ZeRO-1/2, what DeepSpeed's own ``safe_get_full_grad`` reads).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import sys
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn


def uses_deepspeed(args) -> bool:
    """DeepSpeed is configured for this run: in the training arguments, or by `accelerate launch --use_deepspeed`."""
    return args.deepspeed is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")


@contextlib.contextmanager
def deepspeed_quiet_unless_used(used: bool) -> Iterator[None]:
    """Keep DeepSpeed's import-time notices off the console of a run that does not use DeepSpeed.

    accelerate imports deepspeed whenever it is installed (`extract_model_from_parallel`, called while transformers'
    Trainer is built), and that import logs its accelerator detection ("Setting accelerator to CPU. If you have GPU
    ..."), noise for a run that never uses it. Meanwhile the "DeepSpeed" logger passes only errors; a run that uses
    DeepSpeed, or a process that imported it already, sees everything as DeepSpeed logs it.
    """
    if used or "deepspeed" in sys.modules:
        yield
        return
    ds_logger = logging.getLogger("DeepSpeed")  # the logger `deepspeed.utils.logging` creates on import

    def errors_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    ds_logger.addFilter(errors_only)
    try:
        yield
    finally:
        ds_logger.removeFilter(errors_only)


@contextlib.contextmanager
def _zero3_fragment(param: nn.Parameter, writes: bool) -> Iterator[torch.Tensor | None]:
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

    fragment = safe_get_local_grad(param)  # a float32 copy of this rank's partition
    yield fragment
    if fragment is not None and writes:  # a copy back (host to device and back under offload): only when written
        safe_set_local_grad(param, fragment)


@contextlib.contextmanager
def _zero12_fragment(param: nn.Parameter, writes: bool) -> Iterator[torch.Tensor | None]:
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        yield None
        return
    fragment = mapping.get_lp_grad_fragment(param._index_in_param_group)  # a view
    if fragment.numel() == param.numel() != mapping.lp_fragment_address.numel:
        # DeepSpeed's BF16 optimizer (ZeRO-1, bf16, grad_accum_dtype fp32) keeps every parameter's whole gradient on
        # every rank: this rank's partition is the part at its address, as DeepSpeed's `get_full_hp_grad` takes it
        # (the whole would count a parameter spanning k partitions k times in the norm).
        address = mapping.lp_fragment_address
        fragment = fragment.view(-1).narrow(0, address.start, address.numel)
    yield fragment


def deepspeed_local_gradients(params: Iterable[nn.Parameter], writes: bool = True) -> Iterator[torch.Tensor]:
    """This rank's partition of each parameter's gradient, between the step's last backward and the engine's step
    (ZeRO-1/2: a view of the optimizer's gradient buffer, on the CPU under optimizer offload; ZeRO-3: a copy).

    With `writes`, writes to the yielded tensors (in place) reach DeepSpeed's gradient buffers; without, the caller
    only reads them (ZeRO-3's copies are not written back).
    """
    for param in params:
        fragment_of = _zero3_fragment if hasattr(param, "ds_id") else _zero12_fragment
        with fragment_of(param, writes) as fragment:
            if fragment is not None and fragment.numel() > 0:
                yield fragment


def clip_deepspeed_gradients_(
    params: list[nn.Parameter],
    max_norm: float | None,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The gradient norm of ``params`` over all ranks, clipped in place to ``max_norm`` (None: not clipped).

        norm = sqrt(sum over ranks of sum |g_partition|^2);   g <- g * min(1, max_norm / (norm + 1e-6))

    the same rule (and epsilon) as ``torch.nn.utils.clip_grad_norm_``. Returns the norm before clipping. ``device``
    is where the sum is reduced (the process's accelerator: NCCL takes no CPU tensor, and a rank may hold no
    fragment of a side's gradients at all, or hold them on the CPU: optimizer offload).
    """
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for fragment in deepspeed_local_gradients(params, writes=False):  # a CPU fragment's sum (0-dim) adds on `device`
        squares = squares + fragment.float().pow(2).sum()
    norm = all_reduce_sum(squares).sqrt()
    if max_norm is not None and torch.isfinite(norm):
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0).item()  # read once: fragments may sit on the CPU
        if coefficient < 1.0:
            for fragment in deepspeed_local_gradients(params):
                fragment.mul_(coefficient)
    return norm


def _optimizer_chain(optimizer: torch.optim.Optimizer) -> list:
    """The optimizer and what it wraps, outermost first: accelerate's > DeepSpeed's ZeRO optimizer > the torch
    optimizer that holds the state and steps."""
    chain = [optimizer]
    while getattr(chain[-1], "optimizer", None) is not None:
        chain.append(chain[-1].optimizer)
    return chain


def stepping_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds the state and steps: the last of `optimizer`'s chain (`_optimizer_chain`)."""
    return _optimizer_chain(optimizer)[-1]


def schedule_the_stepping_optimizer(lr_scheduler, optimizer: torch.optim.Optimizer) -> None:
    """Point `lr_scheduler` at the optimizer that steps, the last of `optimizer`'s chain. Under DeepSpeed's optimizer
    offload accelerate replaces the torch AdamW the schedules were built on by a DeepSpeedCPUAdam over its groups
    (`map_pytorch_optim_to_deepspeed`); both shared the group dicts until a resume's load gave the live optimizer new
    ones, and the schedules went on writing the replaced AdamW's: every rate froze where the resume left it (the
    policy's at 0 where its warm-up began after the resume)."""
    stepping = stepping_optimizer(optimizer)
    if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", stepping) is not stepping:
        lr_scheduler.optimizer = stepping


def _offloading_zero12(optimizer: torch.optim.Optimizer) -> list:
    """The ZeRO-1/2 optimizer in `optimizer`'s chain that offloads to the CPU (`offload_optimizer`), if any."""
    return [part for part in _optimizer_chain(optimizer) if getattr(part, "cpu_offload", False)]


def settle_offloaded_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Wait for ZeRO-1/2's copies of the gradients to the CPU under optimizer offload (issued non-blocking as the
    backward goes; DeepSpeed waits for them only as its step begins) before the partitions are read or written here:
    a copy landing later would overwrite the clipped gradients. No effect on any other optimizer."""
    for part in _offloading_zero12(optimizer):
        if hasattr(part, "_wait_for_offload_copies"):
            part._wait_for_offload_copies()


def mark_offload_overflow(optimizer: torch.optim.Optimizer) -> None:
    """Make ZeRO-1/2 with optimizer offload skip this step. It decides from what it recorded while it copied the
    gradients to the CPU: an overflow flag (`local_overflow`, which bf16 and fp16 read) and each parameter's
    gradient norm (`norm_for_param_grads`, whose NaN sum is an overflow in float32): the NaN that
    `VAPOTrainer._drop_update` writes into the offloaded partitions afterwards would be stepped. Both are set here as
    a NaN gradient sets them (no effect on any other optimizer)."""
    for part in _offloading_zero12(optimizer):
        if hasattr(part, "local_overflow"):
            part.local_overflow = True
            norms = getattr(part, "norm_for_param_grads", None)
            if isinstance(norms, dict):  # read with `.item()`
                norms.update(dict.fromkeys(norms, torch.tensor(math.nan)))


@contextlib.contextmanager
def groups_held_out(optimizer: torch.optim.Optimizer, name: str) -> Iterator[None]:
    """Leave the parameter groups named ``name`` out of every optimizer step taken inside: their weights, moments and
    step count stay as they are, with any wrapper around the optimizer (accelerate's, DeepSpeed ZeRO-1/2/3's).

    ZeRO holds each group's flat float32 partition in the torch optimizer it wraps and steps it through that
    optimizer's ``step`` (one group at a time under ZeRO-1/2): a step pre-hook hides the named groups from it, a
    post-hook puts them back. Copying the untouched float32 weights back to the half-precision ones is exact.
    """
    inner = stepping_optimizer(optimizer)
    if not any(group.get("name") == name for group in inner.param_groups):
        raise ValueError(
            f"No parameter group of the optimizer is named {name!r}, so critic-only steps under DeepSpeed cannot hold "
            f"the policy out of the optimizer step. Name the groups as `trl_vapo.optim.parameter_groups` does."
        )
    hidden: list[list[dict]] = []

    def hide(opt, args, kwargs):
        hidden.append(opt.param_groups)
        opt.param_groups = [group for group in opt.param_groups if group.get("name") != name]

    def restore(opt, args, kwargs):
        opt.param_groups = hidden.pop()

    handles = [inner.register_step_pre_hook(hide), inner.register_step_post_hook(restore)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if hidden:  # a step that raised never ran its post-hook
            inner.param_groups = hidden[0]


def optimizer_states(optimizer: torch.optim.Optimizer, group_name: str) -> list[dict]:
    """The torch optimizer's per-tensor states of the parameter groups named ``group_name``, through any wrapper;
    ZeRO-3 keeps each group's flat float32 shards outside ``param_groups`` between steps, so they are looked up in
    its sub-group table. A tensor not stepped yet has an empty state."""
    chain = _optimizer_chain(optimizer)
    inner = chain[-1]
    groups = {i for i, group in enumerate(inner.param_groups) if group.get("name") == group_name}
    params = [param for i in groups for param in inner.param_groups[i]["params"]]
    zero3 = next((o for o in chain if hasattr(o, "fp32_partitioned_groups_flat")), None)
    if zero3 is not None:
        params += [
            flat
            for i, flat in enumerate(zero3.fp32_partitioned_groups_flat)
            if zero3.sub_group_to_group_id[i] in groups
        ]
    return [inner.state.get(param, {}) for param in params]


def reset_adam_step(optimizer: torch.optim.Optimizer, group_name: str) -> None:
    """Zero the step count of the parameter groups named ``group_name``."""
    for state in optimizer_states(optimizer, group_name):
        if "step" in state:
            step = state["step"]
            state["step"] = torch.zeros_like(step) if torch.is_tensor(step) else 0


def deepspeed_config(args) -> dict | None:
    """The run's DeepSpeed config as a dict, before anything loads: VAPOConfig's ``deepspeed``, or the JSON file an
    accelerate config names (``deepspeed_config_file``). None without DeepSpeed, or when accelerate builds the config
    from its own keys (stage, offload devices), as TRL's bundled ``zero2`` / ``zero3`` configs do."""
    hf_config = getattr(args, "hf_deepspeed_config", None)
    if hf_config is not None:
        return hf_config.config
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if uses_deepspeed(args) and path != "none":
        return json.loads(Path(path).read_text())
    return None


def check_deepspeed_config(args) -> None:
    """Refuse DeepSpeed features that cannot train as VAPOTrainer promises, before any model loads.

    ZenFlow and SuperOffload step the optimizer in DeepSpeed's own CPU threads, and partial optimizer offload steps
    its GPU share through a second optimizer (with unnamed groups, whose learning rates are fixed when the engine
    starts), all past the hooks of ``groups_held_out``: the policy would move on critic-only steps (value pretraining,
    and the passes beyond ``num_iterations``).
    """
    config = deepspeed_config(args) or {}
    if str((config.get("fp16") or {}).get("enabled", False)).lower() == "true":
        # Its loss scaler scales the gradient partitions that VAPO clips per side: the clip read 2^16 times the norm.
        raise ValueError(
            "The DeepSpeed config turns on fp16 (fp16.enabled): fp16 is supported on one process and under DDP, not "
            "with DeepSpeed or FSDP. Set fp16.enabled to false or 'auto' and use bf16 (a GPU from Ampere on), or "
            "float32 with LoRA."
        )
    refuse_deepspeed_mismatches(getattr(args, "hf_deepspeed_config", None))
    zero = config.get("zero_optimization") or {}
    # A skipped step (nothing scored, a non-finite loss: `VAPOTrainer._drop_update`) hands ZeRO NaN gradients, which
    # its stage 1 and 2 find by bf16's overflow check (on by default), or in float32 by their gradient norm: the one
    # of the run's precision turned off, the NaN was stepped into every weight. (Stage 3 always reads the norm.)
    bf16 = (config.get("bf16") or {}).get("enabled", False)
    in_bf16 = str(bf16).lower() == "true" or (str(bf16).lower() == "auto" and bool(args.bf16))
    unchecked = []
    if in_bf16 and str((config.get("bf16") or {}).get("check_grad_overflow", True)).lower() == "false":
        unchecked.append("bf16.check_grad_overflow")
    if not in_bf16 and str(zero.get("compute_grad_norm", True)).lower() == "false":
        unchecked.append("zero_optimization.compute_grad_norm")
    if unchecked and str(zero.get("stage", "")) != "3":
        raise ValueError(
            f"The DeepSpeed config sets {' and '.join(unchecked)} to false: a step VAPOTrainer skips (no completion "
            "scored, a NaN or inf loss) gives ZeRO NaN gradients so that its overflow check skips the update, and "
            "without the check they would be stepped into the weights. Remove the setting (its default is true)."
        )
    offload = zero.get("offload_optimizer") or {}
    features = []
    if zero.get("zenflow") is not None:  # DeepSpeed turns it on for any value but null, `{}` included
        features.append("ZenFlow (zero_optimization.zenflow)")
    if offload.get("super_offload"):
        features.append("SuperOffload (zero_optimization.offload_optimizer.super_offload)")
    if offload.get("device") not in (None, "none") and offload.get("ratio", 1.0) < 1.0:
        features.append(f"partial optimizer offload (zero_optimization.offload_optimizer.ratio={offload['ratio']})")
    critic_only = []
    if args.value_pretrain_steps > 0:
        critic_only.append(f"value pretraining (value_pretrain_steps={args.value_pretrain_steps})")
    if args.critic_num_iterations > args.num_iterations:
        critic_only.append(
            f"the extra critic passes (critic_num_iterations={args.critic_num_iterations} > "
            f"num_iterations={args.num_iterations})"
        )
    if features and critic_only:
        raise ValueError(
            f"The DeepSpeed config turns on {' and '.join(features)}, which steps the optimizer outside the torch "
            "optimizer VAPOTrainer builds: the policy could not be held still on the critic-only steps of "
            f"{' and '.join(critic_only)}. Turn it off, or train without critic-only steps: value_pretrain_steps=0 "
            "and critic_num_iterations equal to num_iterations."
        )


def refuse_deepspeed_mismatches(hf_deepspeed_config) -> None:
    """transformers' error for a DeepSpeed config whose values contradict the training arguments (`gradient_clipping`
    against `max_grad_norm`, `train_micro_batch_size_per_gpu` against `per_device_train_batch_size`, ...): its Trainer
    raises it when DeepSpeed starts (`trainer_config_finalize`), which VAPOTrainer does not call, so such a config
    trained with VAPOConfig's values, silently."""
    mismatches = getattr(hf_deepspeed_config, "mismatches", None)
    if mismatches:
        said = "; ".join(line.removeprefix("- ") for line in mismatches)
        raise ValueError(
            f"These DeepSpeed config values contradict VAPOConfig's: {said}. Set them to 'auto' (filled from "
            "VAPOConfig) or to VAPOConfig's values."
        )


@contextlib.contextmanager
def unwrapped_for_generation(
    model_wrapped: nn.Module, accelerator, gather_zero3: bool, gradient_checkpointing_kwargs: dict | None = None
) -> Iterator[nn.Module]:
    """The actor-critic unwrapped from DDP / DeepSpeed / FSDP to sample from its policy, gradient checkpointing off
    meanwhile: TRL's `unwrap_model_for_generation`, except that under ZeRO-3 with `gather_zero3`
    (`ds3_gather_for_generation`) it gathers the policy's weights alone. TRL gathers every weight of the engine it is
    given, here the critic's too: a separate critic is the policy's size, and its trainable weights are float32, so
    the gathered copy took twice the memory, on a setup chosen because the model hardly fits."""
    unwrapped = accelerator.unwrap_model(model_wrapped)
    checkpointing = unwrapped.is_gradient_checkpointing
    if checkpointing:
        unwrapped.gradient_checkpointing_disable()
    zero3 = getattr(accelerator.state, "deepspeed_plugin", None) is not None and (
        accelerator.state.deepspeed_plugin.zero_stage == 3
    )
    try:
        if zero3 and gather_zero3:
            import deepspeed

            from ._compat import add_hooks, remove_hooks

            with deepspeed.zero.GatheredParameters(list(unwrapped.policy.parameters())):
                remove_hooks(model_wrapped)  # ZeRO-3's fetch and release around each module: gathered already
                try:
                    yield unwrapped
                finally:
                    add_hooks(model_wrapped)
        else:
            yield unwrapped
    finally:
        if checkpointing:
            unwrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs)


@contextlib.contextmanager
def fsdp2_unsharded(model: nn.Module) -> Iterator[None]:
    """Gather an FSDP2 root module's own parameters for the duration (no-op for anything else); the decoder layers
    gather theirs in their own forward hooks."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        yield
        return
    if not isinstance(model, FSDPModule):
        yield
        return
    # FSDP2 takes the first module to run forward as the root; `generate` would run the decoder layers first and
    # make them roots, which the real root's first forward then refuses. Initialise the real root now.
    model._get_fsdp_state()._lazy_init()
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


@contextlib.contextmanager
def whole_models_under_zero3(hf_deepspeed_config) -> Iterator[None]:
    """Build models whole, not partitioned, while a ZeRO-3 config is active (no-op otherwise).

    transformers builds every model inside DeepSpeed's ``zero.Init`` once a ZeRO-3 ``TrainingArguments`` exists,
    which partitions the weights as they are created: the critic could then not copy the policy's weights, and the
    policy's fingerprint would read empty shards. Built whole, both are partitioned when the DeepSpeed engine starts.
    """
    from transformers.integrations.deepspeed import (
        is_deepspeed_zero3_enabled,
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    if hf_deepspeed_config is None or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(hf_deepspeed_config)


def is_zero3_partitioned(model: nn.Module) -> bool:
    """Whether ``model``'s weights were created partitioned by ZeRO-3's ``zero.Init``."""
    return any(hasattr(param, "ds_id") for param in model.parameters())


def full_state_dict(model: nn.Module, main: bool = True, skip: Collection[str] = ()) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) weights of an FSDP2 model on the main process, on the CPU (another process gets an empty
    dict), but the weights named in ``skip`` (not gathered: `zero3_full_state_dict`'s); None when not sharded.

    A collective: every rank calls it. Reading unsharded parameters directly does not work under FSDP2: its
    ``state_dict`` hooks reshard them first.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    if not isinstance(model, FSDPModule):
        return None
    if skip:
        return fsdp2_state_dict_without(model, main, skip)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def fsdp2_state_dict_without(model: nn.Module, main: bool, skip: Collection[str]) -> dict[str, torch.Tensor]:
    """`full_state_dict` of an FSDP2 model but the weights in ``skip``, gathered one tensor at a time from its own
    ``state_dict`` (whose hooks reshard it first: shards, no communication): torch's `get_model_state_dict` gathers
    every weight, and its `ignore_frozen_params` drops the frozen embeddings a LoRA adapter may be saved with. A
    weight tied under two names (the LM head and the embeddings) is gathered once, by every rank alike (the ranks'
    gathers must pair up), and held under each name as a copy of its own, as torch's function gives it."""
    from torch.distributed.tensor import DTensor

    state: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}  # each tied weight's first name
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():  # (persistent buffers only, as torch's)
            name = _state_dict_name(name)
            if name in skip:
                continue
            if id(value) in first:
                if main:
                    state[name] = state[first[id(value)]].clone()
                continue
            first[id(value)] = name
            whole = value
            if isinstance(value, DTensor):
                if value.device.type != value.device_mesh.device_type:  # offloaded to the host: gathered on the mesh
                    whole = value.to(value.device_mesh.device_type)
                whole = whole.full_tensor()  # a collective
            if main:
                state[name] = whole.detach().to("cpu", copy=True)  # (a copy: on the CPU, `to` would alias it)
    return state if main else {}


def zero3_full_state_dict(model: nn.Module, main: bool, skip: Collection[str] = ()) -> dict[str, torch.Tensor] | None:
    """The whole weights (and persistent buffers) of a ZeRO-3 partitioned ``model`` on the main process, on the CPU,
    keyed as ``model.state_dict()``, but the weights named in ``skip`` (which no save writes: a LoRA policy's frozen
    base, gathered whole onto the main process's memory at every checkpoint); None elsewhere. A collective: every
    rank calls it.

    Gathered one module at a time, as transformers saves a ZeRO-3 model: gathering every parameter at once puts the
    whole model on every GPU, which is what ZeRO-3 was chosen to avoid (the first checkpoint would run out of
    memory). A parameter not partitioned is read as it is.
    """
    import deepspeed

    state: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        params = [(name, p) for name, p in module.named_parameters(recurse=False) if prefix + name not in skip]
        with deepspeed.zero.GatheredParameters([p for _, p in params]):  # read only: no modifier rank
            if main:
                state.update({prefix + name: p.detach().cpu().clone() for name, p in params})
        if main:
            skipped = getattr(module, "_non_persistent_buffers_set", set())
            buffers = module.named_buffers(recurse=False)
            state.update({prefix + name: b.detach().cpu().clone() for name, b in buffers if name not in skipped})
    return state if main else None


def gathered_state_dict(
    model: nn.Module | None, accelerator, skip: Collection[str] = ()
) -> dict[str, torch.Tensor] | None:
    """The whole weights of a model that ZeRO-3 partitions or FSDP2 shards (a DeepSpeed engine or accelerate's
    wrapper too), gathered on the main process's CPU, keyed as its own ``state_dict()`` (another process gets None or
    an empty dict); None for a model that is whole, whose parameters read as they are. The weights named in ``skip``
    are left out (not gathered). A collective: every rank calls it."""
    inner = accelerator.unwrap_model(model) if model is not None else None  # DeepSpeed's engine: its `module`
    if inner is not None and is_zero3_partitioned(inner):
        return zero3_full_state_dict(inner, accelerator.is_main_process, skip)
    return full_state_dict(inner, accelerator.is_main_process, skip)


def placed_state_dict(model: nn.Module, accelerator) -> dict[str, torch.Tensor] | None:
    """The whole weights of a model that `prepare_frozen_model` placed (partitioned under ZeRO-3, sharded by FSDP2,
    or whole on the device), on the main process's CPU; None elsewhere. A collective: every rank calls it."""
    whole = gathered_state_dict(model, accelerator)
    if not accelerator.is_main_process:
        return None
    if whole is not None:
        return whole
    return {
        name: tensor.detach().cpu().clone() for name, tensor in accelerator.unwrap_model(model).state_dict().items()
    }


def load_placed_state_dict(model: nn.Module, accelerator, state: dict[str, torch.Tensor]) -> None:
    """Load ``state``, the whole weights that `placed_state_dict` returned, into ``model`` placed as it was (every
    rank passes the whole state). Under ZeRO-3 one module at a time: the main process's copy is partitioned again."""
    inner = accelerator.unwrap_model(model)
    if is_zero3_partitioned(inner):
        import deepspeed

        for module_name, module in inner.named_modules():
            prefix = f"{module_name}." if module_name else ""
            params = list(module.named_parameters(recurse=False))
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0), torch.no_grad():
                for name, param in params:
                    param.copy_(state[prefix + name])
            for name, buffer in module.named_buffers(recurse=False):
                if prefix + name in state:
                    buffer.copy_(state[prefix + name])
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = ()  # noqa: N806 (torch without FSDP2: nothing is sharded)
    if isinstance(inner, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(inner, state, options=StateDictOptions(full_state_dict=True))
        return
    inner.load_state_dict(state)


def fsdp2_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole state of an FSDP2 model's optimizer (``accelerator.prepare``'s wrapper or the torch optimizer),
    keyed by parameter name, on the main process's CPU (empty elsewhere). A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    inner = stepping_optimizer(optimizer)
    fresh = not inner.state
    state = get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if fresh:
        # torch makes a state to save by stepping a fresh optimizer at learning rate 0 on zero gradients
        # (`_init_optim_state`): Adam's step count at 1 with zero moments, in the live optimizer and in the file, and
        # the first real update's bias correction counted a step that never happened (a run whose steps so far were
        # all skipped, or stopped by a signal in its first one). None was made: none is kept, none is saved.
        inner.state.clear()
        state["state"] = {}
    return state


def _state_dict_name(name: str) -> str:
    """A parameter's name as torch's state dicts give it: without a checkpoint wrapper's or torch.compile's module in
    the path."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def fsdp2_optimizer_state_problem(
    saved: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> str | None:
    """Why `fsdp2_optimizer_state`'s `saved` cannot be the state of `optimizer` (the torch optimizer) over `model`'s
    parameters, or None: its parameter groups name other parameters. The loader must be lenient (``strict=False``:
    the policy's weights held out of value pretraining have no state), and so it drops the saved state of a
    parameter this run lacks and starts Adam afresh for one the saved run lacked, without a word."""
    names = {id(param): _state_dict_name(name) for name, param in model.named_parameters()}
    current = [{names.get(id(param), "?") for param in group["params"]} for group in optimizer.param_groups]
    stored = [set(group["params"]) for group in saved["param_groups"]]
    if stored == current:
        return None
    lacking = sorted(set().union(*stored) - set().union(*current))
    untracked = sorted(set().union(*current) - set().union(*stored))
    differences = []
    if lacking:
        differences.append(f"{len(lacking)} saved parameters this run does not train ({', '.join(lacking[:3])}...)")
    if untracked:
        differences.append(f"{len(untracked)} trained ones it has no state for ({', '.join(untracked[:3])}...)")
    if not differences:
        differences.append(f"the same parameters in {len(stored)} groups, where this run has {len(current)}")
    return (
        f"its optimizer state is of other parameters: {'; '.join(differences)}. The checkpoint's run trained other "
        "modules or adapters: resume with the settings and the trl-vapo version that wrote it, or start a new run"
    )


def load_fsdp2_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Load what `fsdp2_optimizer_state` saved at `path` into the sharded optimizer (every rank reads the file).

    A weight the saved optimizer never stepped (the policy's, held out of value pretraining) gets no state: torch
    gives each one an initial state at step 1 to load into, and Adam's bias correction would then count a step that
    never happened."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    inner = stepping_optimizer(optimizer)
    # Mapped, not read: the processes of a node share the file's pages, where each held a whole copy of the state
    # (twice the weights in float32: 64 GB for an 8B model, on each of 8 processes) to take its shard from.
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if problem := fsdp2_optimizer_state_problem(saved, model, inner):
        raise ValueError(f"Cannot resume from {Path(path).parent}: {problem}")
    set_optimizer_state_dict(model, inner, saved, options=StateDictOptions(full_state_dict=True, strict=False))
    for name, param in model.named_parameters():
        if _state_dict_name(name) not in saved["state"]:
            inner.state.pop(param, None)


def check_distributed_setup(accelerator, args) -> None:
    """Refuse what cannot train as asked (processes that would not talk to each other, a DeepSpeed config with its own
    optimizer) and warn where accelerate silently did something else (no FSDP on CPUs)."""
    import os

    from accelerate.logging import get_logger
    from accelerate.utils import DistributedType

    logger = get_logger(__name__)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RuntimeError(
            f"Launched as {launched} processes (WORLD_SIZE) but training is set up for "
            f"{accelerator.num_processes}: the processes would train separately on the same output_dir. "
            "Launch with `accelerate launch` or `torchrun`, and pass use_cpu=True on a machine without GPUs."
        )
    if args.fsdp and accelerator.distributed_type != DistributedType.FSDP:
        logger.warning(
            f"FSDP was asked for (fsdp={args.fsdp}) but accelerate set up {accelerator.distributed_type}:"
            " it enables FSDP only on GPUs (on CPUs it runs plain data parallelism). The model is not sharded."
        )
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    state_dict_type = str(getattr(accelerator.state.fsdp_plugin, "state_dict_type", None) if fsdp else None)
    if "SHARDED_STATE_DICT" in state_dict_type:
        logger.warning(
            "fsdp_state_dict_type SHARDED_STATE_DICT is not supported: checkpoints hold the whole weights and "
            "optimizer state, gathered on the main process's CPU (a resume maps the file on each process). Set "
            "fsdp_state_dict_type: FULL_STATE_DICT to say so, and leave room for them in the host's memory."
        )
    if fsdp and accelerator.state.fsdp_plugin.fsdp_version == 1:
        raise ValueError(
            "FSDP version 1 is not supported: VAPOTrainer clips the actor's and the critic's gradients apart and "
            "samples from the sharded policy as FSDP2 allows. Set fsdp_version: 2 in the accelerate config (trl-vapo "
            "train --accelerate_config fsdp2)."
        )
    if fsdp and getattr(accelerator.state.fsdp_plugin, "activation_checkpointing", False):
        raise ValueError(
            "fsdp_activation_checkpointing is not supported: accelerate's checkpoint wrappers replay each layer in "
            "the backward pass under whichever adapter is active then (the shared-base critic's gradients would come "
            "from the policy adapter's activations), and rename the parameters the optimizer's state is saved under "
            "(a resume would restart Adam). Set fsdp_activation_checkpointing: false in the accelerate config and "
            "gradient_checkpointing=True (--gradient_checkpointing true), which saves the same memory."
        )
    zero3 = (
        accelerator.distributed_type == DistributedType.DEEPSPEED
        and accelerator.state.deepspeed_plugin.zero_stage == 3
    )
    gathers_per_layer = fsdp or (zero3 and not args.ds3_gather_for_generation)
    from .generation import ENGINE_FLAGS, EngineSettings

    named = EngineSettings._engine_named_by(args)  # (the flag that chose one of these engines, below)
    engine = ENGINE_FLAGS[named] if named in ("static_cache", "continuous_batching") else None
    if gathers_per_layer and engine and accelerator.num_processes > 1:
        # Each decode step's forward gathers the layers' shards, a collective: generate() keeps the processes in step
        # (synced_gpus) until the last one finishes; these engines stop each process at its own last completion.
        raise ValueError(
            f"{engine}=True cannot sample from weights that {'FSDP' if fsdp else 'ZeRO-3'} shards across "
            "processes: a process whose completions end first would stop gathering and the others would wait. "
            "Generate with generate() (leave the flag unset)"
            + ("." if fsdp else ", or gather the weights for generation (ds3_gather_for_generation=True).")
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        if accelerator.state.deepspeed_plugin.zero_stage == 0:
            # Stage 0 steps a plain optimizer (float32) or its fp16-style one (bf16): no parameter is linked to a
            # ZeRO partition, so `deepspeed_local_gradients` finds no gradient to clip or to skip with NaN.
            raise ValueError(
                "DeepSpeed ZeRO stage 0 is not supported: VAPOTrainer clips the actor's and the critic's gradients "
                "apart, and skips a non-finite step, through ZeRO's gradient partitions, which stage 0 does not make "
                "(its steps would go unclipped). Use zero_stage 1, 2 or 3, or plain data parallelism (accelerate "
                "launch without a DeepSpeed config), which trains as stage 0 does."
            )
        # (a config `accelerate launch` names: compared with the arguments when the trainer set up its accelerator)
        refuse_deepspeed_mismatches(getattr(accelerator.state.deepspeed_plugin, "hf_ds_config", None))
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        sections = [k for k in ("optimizer", "scheduler") if k in config]
        if sections:
            raise ValueError(
                f"The DeepSpeed config has {' and '.join(sections)} section(s): VAPOTrainer builds its own AdamW "
                "with separate actor and critic parameter groups, learning rates and schedules. Remove them and "
                "set learning_rate, critic_learning_rate, lr_scheduler_type and warmup_steps in VAPOConfig."
            )


def keep_fsdp2_outputs_as_computed(accelerator) -> None:
    """FSDP2's mixed precision as accelerate sets it (`mixed_precision: bf16`, TRL's fsdp2.yaml) casts every floating
    output of a sharded model to bf16 (`MixedPrecisionPolicy.output_dtype`): the actor-critic's float32 log-probs and
    values came back rounded (2^-5 apart near -4.6: the PPO ratio moved in steps of 3%). Its outputs now keep the dtype
    they are computed in; the weights still compute, and the gradients still reduce, in the configured dtypes."""
    import dataclasses

    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return
    plugin = accelerator.state.fsdp_plugin
    policy = plugin.mixed_precision_policy
    if dataclasses.is_dataclass(policy) and getattr(policy, "output_dtype", None) is not None:
        plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)


def decided_on_main(decide: Callable[[], Any], accelerator) -> Any:
    """``decide()`` run on the main process alone, and its answer on every process; whatever it raises is raised on
    every process (had the main process raised alone, the others would wait in the broadcast until the collective's
    timeout). An exception that does not survive pickling crosses as a RuntimeError naming it."""
    answer, failure = None, None
    if accelerator.is_main_process:
        try:
            answer = decide()
            if accelerator.num_processes > 1:
                pickle.dumps(answer)  # what the broadcast sends: a failure here is raised everywhere, not alone
        except Exception as error:
            failure = error
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        answer, shared = broadcast_object_list([answer, None if failure is None else _crossable(failure)])
        if failure is None and shared is not None:
            raise shared
    if failure is not None:
        raise failure
    return answer


def _crossable(error: Exception) -> Exception:
    """``error`` where it pickles and unpickles (a broadcast sends a pickle), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
