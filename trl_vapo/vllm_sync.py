"""Pushing the policy's weights to vLLM: the policy alone (never the critic's adapter, head or model), merged on a
copy so that the training weights stay bit-for-bit as they were, under the names vLLM expects.

It subclasses TRL's `VLLMGeneration` (`trl.generation.vllm_generation`) and replaces its private `_iter_named_params`,
using its `_fix_param_name_to_vllm` and `_dist`: a TRL upgrade that renames those breaks this file, and
`tests/test_generation.py` (a stand-in `VLLMGeneration` that loads what it is pushed) fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from .modeling import POLICY_ADAPTER, _causal_lm


def check_policy_only(model: nn.Module) -> None:
    """vLLM must receive the policy, not the actor-critic module (whose critic and value head vLLM cannot load)."""
    if any(isinstance(getattr(model, name, None), nn.Module) for name in ("critic", "value_head")):
        raise TypeError(
            f"VLLMGeneration was given {type(model).__name__}, which holds the critic; pass the policy "
            "(`actor_critic.policy`) so that only its weights are pushed to vLLM."
        )


def check_tied_head_unadapted(model: nn.Module) -> None:
    """vLLM builds a tied LM head from the embeddings it receives: an adapter on the head (LoRA on `lm_head`, or its
    trained copy in `modules_to_save`) would never reach it. The sync pushes the tensor the two share once, under the
    embeddings' name, unmerged (and vLLM skips an `lm_head.` weight of a tied model), so vLLM would sample from the
    untrained head while the trainer scores with the trained one; an adapter on the embeddings, pushed, would become
    vLLM's head too, where the trainer's stays as it was."""
    config = getattr(model, "config", None)
    tied = config is not None and getattr(config.get_text_config(), "tie_word_embeddings", False)
    if not tied or not hasattr(model, "get_output_embeddings"):
        return
    for side, module in (
        ("LM head", model.get_output_embeddings()),
        ("input embeddings", model.get_input_embeddings()),
    ):
        if hasattr(module, "base_layer") or hasattr(module, "modules_to_save"):
            raise ValueError(
                f"use_vllm=True with an adapter on the {side} of a model whose LM head is tied to its embeddings "
                f"({type(_causal_lm(model)).__name__}, tie_word_embeddings=True): vLLM builds one from the other "
                "and would sample from weights the trainer does not score with. Leave `lm_head` and `embed_tokens` "
                "out of target_modules and modules_to_save, or generate with transformers (use_vllm=False)."
            )


def check_policy_adapter_active(model: nn.Module) -> None:
    """TRL merges the active adapter before pushing: it must be the policy's, never the critic's."""
    from accelerate.utils import is_peft_model

    if not is_peft_model(model):  # a full model: nothing to merge
        return
    active = model.active_adapters
    if list(active) != [POLICY_ADAPTER]:
        raise RuntimeError(
            f"The active adapter(s) {list(active)} would be merged into the weights pushed to vLLM; only the policy "
            f"adapter {POLICY_ADAPTER!r} may be active during a weight sync."
        )


def _is_another_adapters_weight(name: str) -> bool:
    """A `modules_to_save` copy of an adapter other than the policy's (the critic's, the KL reference's `ref`)."""
    parts = name.split(".")
    return any(part == "modules_to_save" and parts[i + 1] != POLICY_ADAPTER for i, part in enumerate(parts[:-1]))


def policy_only(vllm_generation_cls: type) -> type:
    """A subclass of `vllm_generation_cls` (TRL's `VLLMGeneration`) whose weight sync pushes the policy alone and
    leaves the training weights bit-for-bit as they were.

    Under FSDP, before the trainer has sharded the policy (`trl-vapo train`'s held-out report before training), its
    parameters are read as they are: TRL's FSDP2 path reads each as a DTensor (an AttributeError on a whole one).

    Two changes to TRL's `_iter_named_params` under PEFT:

    * TRL skips LoRA matrices and renames the policy's `modules_to_save.default` copies, but passes any other
      adapter's `modules_to_save` copy to vLLM under a name vLLM does not know: the critic's, the KL reference's
      (`ref`). They are dropped.
    * TRL merges the active adapter into the base in place and unmerges it after the push. In bf16 `W + BA - BA`
      is not `W`: one sync moves about 15% of the base weights by a rounding step, and the errors accumulate (after
      100 syncs of a tiny Llama the largest change was 20% of the mean |weight|; trl issue #6688). Here the base is
      also the critic's and the reference policy's, so each layer is merged, copied and restored from a saved copy
      instead, one layer at a time (FSDP keeps TRL's path).
    """

    class PolicyOnlyVLLMGeneration(vllm_generation_cls):
        def _iter_named_params(self):
            from accelerate.utils import is_peft_model

            if is_peft_model(self.model) and not self._dist.is_fsdp:
                params = _exactly_merged_params(self.model, self._dist, self._fix_param_name_to_vllm)
            elif self._dist.is_fsdp and not _is_sharded(self.model):  # (FSDP with PEFT is refused: no adapter)
                params = ((self._fix_param_name_to_vllm(n), p.data) for n, p in self.model.named_parameters())
            else:
                params = super()._iter_named_params()
            for name, param in params:  # run to the end: TRL's generator unmerges after its last item
                if not _is_another_adapters_weight(name):
                    yield name, param

    name = f"PolicyOnly{vllm_generation_cls.__name__}"
    PolicyOnlyVLLMGeneration.__name__ = PolicyOnlyVLLMGeneration.__qualname__ = name
    return PolicyOnlyVLLMGeneration


def _is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 has sharded `model`'s parameters (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters())


def _exactly_merged_params(model: nn.Module, dist, fix_name: Callable) -> Iterator[tuple[str, torch.Tensor]]:
    """TRL's PEFT weight stream (names as vLLM expects them, adapter matrices left out), with each adapted layer's
    weights merged on a copy: the layer is merged, its weights cloned, then unmerged and restored exactly."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer) and hasattr(m, "base_layer")}
    # As TRL: merging needs whole tensors, so ZeRO-3 gathers every parameter first (a no-op otherwise).
    with dist.gather_params(list(model.parameters())):
        merged: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            if model.prefix in name or "original_module" in name or "trainable_tokens_delta" in name:
                # adapter matrices, the base copy of modules_to_save (as TRL skips them), and the new tokens' rows of
                # `trainable_token_indices` (merged into the embedding below)
                continue
            vllm_name = fix_name(  # (`token_adapter`: the wrapper `trainable_token_indices` puts around the embedding)
                name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".token_adapter", ""),
                extra_prefixes=["modules_to_save.default."],
            )
            owner, found, _ = name.partition(".base_layer.")
            if found and owner in layers:
                if name not in merged:
                    merged.update(_merge_on_copy(owner, layers[owner]))
                yield vllm_name, merged.pop(name)
            else:
                yield vllm_name, param.data


def _merge_on_copy(owner: str, layer: nn.Module) -> dict[str, torch.Tensor]:
    """The merged base weights of one adapted layer (its active adapter: the policy's), leaving the layer as it was.

    peft nests the wrappers of two parameters of one module (LoRA's `target_parameters` on an MoE's experts: the
    outer's `base_layer` is the inner wrapper), and each merges its own parameter: all of them are merged (the outer
    alone left the inner parameter's LoRA out of vLLM's weights). An LN-tuning layer's merge swaps its trained copy
    in as `base_layer`: the weights are read after the merge (those before it were the untrained norm)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    chain = [layer]
    while isinstance(chain[-1].base_layer, BaseTunerLayer):
        chain.append(chain[-1].base_layer)
    base = {f"{owner}.base_layer.{n}": p for n, p in layer.base_layer.named_parameters()}
    saved = {n: p.data.clone() for n, p in base.items()}
    merged = []
    try:
        for tuner in chain:
            tuner.merge()  # peft's own merge: LoRA scaling, DoRA, fan_in_fan_out, LoRA bias
            merged.append(tuner)
        return {f"{owner}.base_layer.{n}": p.data.clone() for n, p in layer.base_layer.named_parameters()}
    finally:
        for tuner in reversed(merged):
            if tuner.merged:
                tuner.unmerge()
        for n, p in base.items():
            p.data.copy_(saved[n])
