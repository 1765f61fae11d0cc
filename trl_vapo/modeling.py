"""The critic (value model) and the actor-critic module the trainer optimises.

Two layouts:

* **Separate critic** (full fine-tuning, the default): a ``*ForSequenceClassification`` model with one label, whose
  backbone starts as a copy of the policy's weights and whose scalar head (``score``) is freshly initialised with
  small random weights. It is a standard transformers model: it saves with ``save_pretrained`` and loads with
  ``AutoModelForSequenceClassification.from_pretrained(path)``. For the architectures transformers has no such class
  for (Cohere, Granite, GLM-4-MoE, NemotronH, custom code, ...) it is the same model, built by
  :func:`trl_vapo.loading.sequence_classifier_class` over the architecture's backbone (:mod:`trl_vapo.loading` builds
  the critic of each layout from what the user passed).
* **Shared base** (PEFT): one frozen base model carries two adapters, ``"default"`` for the policy and ``"critic"``
  for the critic, plus a separate linear value head. The reference policy is the base with adapters disabled. One
  copy of the weights instead of three is what lets a 0.5B-1.5B model train on one consumer GPU.
* **A user's value function** (:class:`ValueFunction`): any callable giving the values of a batch of completions,
  frozen. GAE reads its values; nothing of it is trained, saved or checkpointed. It is how a known or hand-built
  value (an oracle, a baseline, a critic trained elsewhere) replaces the learned critic, e.g. to measure what the
  critic's errors cost.

Either way, ``ActorCritic.forward`` returns per-token log-probabilities of the completion under the policy and the
critic's values V(s_t) for the same positions, in one call, so DDP and DeepSpeed see a single model and a single
optimizer (with one parameter group per side).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from accelerate.logging import get_logger
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
)

from ._compat import disable_dropout_in_model, maybe_gather_lm_head_ctx
from .core import exact, lm_head_logprobs_and_entropy, token_logprobs_and_entropy

logger = get_logger(__name__)  # the main process only: these run on every process of a multi-process run

POLICY_ADAPTER = "default"
CRITIC_ADAPTER = "critic"
REFERENCE_ADAPTER = "ref"  # GRPOTrainer's name: a frozen copy of a given adapter, the KL penalty's reference
CRITIC_SUBFOLDER = "critic"
VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_PRETRAINING_FILE = "vapo_value_pretraining.json"


def of_adapter(name: str, adapter: str) -> bool:
    """Whether the parameter called `name` belongs to the PEFT adapter `adapter`: a LoRA matrix (``...lora_A.critic
    .weight``) and a weight peft keeps in a ParameterDict (``...lora_embedding_A.critic``, ``...trainable_tokens_delta
    .critic``, IA3's vectors) alike, which a test for ``.critic.`` would miss."""
    return adapter in name.split(".")


def rewrites_base(config) -> bool:
    """Whether peft's initialisation of an adapter of `config` rewrites the base weights: PiSSA, CorDA, OLoRA, LoftQ
    and LoRA-GA move part of each base weight into the adapter (the base then computes another function, which the
    adapter restores). peft's default, Gaussian, EVA, orthogonal and MiCA leave the base as it is."""
    init = getattr(config, "init_lora_weights", True)
    return isinstance(init, str) and init.lower().startswith(("pissa", "corda", "olora", "loftq", "lora_ga"))


def second_adapter_config(config):
    """A copy of the policy adapter's config for another adapter on the same base (the critic's, the reference's):
    peft initialises an added adapter by its config, and an initialisation that rewrites the base (PiSSA, OLoRA, ...)
    would run again and change the policy under its own trained adapter. The copy initialises as peft's default
    (B zero): it never touches the base. Nor does it replicate layers (`layer_replication`): peft replicates the
    layer stack as it adds each adapter, from the stack the first one left (a second pass over [[0, 16], [8, 24]]
    of 24 layers dropped layers 16-23 from the policy, its critic and the sampling)."""
    import copy

    config = copy.deepcopy(config)
    if rewrites_base(config):
        config.init_lora_weights = True
    if getattr(config, "layer_replication", None):
        config.layer_replication = None
    return config


def set_adapters_trainable(policy, adapters: str | list[str], trainable: bool) -> None:
    """peft's `PeftModel.set_requires_grad`, which raises a TypeError for prompt-learning adapters (prompt tuning,
    prefix tuning, P-tuning): their prompt encoders' weights are set here."""
    names = [adapters] if isinstance(adapters, str) else list(adapters)
    if not any(policy.peft_config[name].is_prompt_learning for name in names):
        policy.set_requires_grad(names, trainable)
        return
    for param_name, param in policy.named_parameters():
        if any(of_adapter(param_name, name) for name in names):
            param.requires_grad_(trainable)


def copy_adapter_weights(model: nn.Module, source: str, target: str) -> None:
    """Copy adapter `source`'s weights into adapter `target`'s of the same shapes (those `target` has: the critic's
    adapter has no LM-head copy)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if of_adapter(name, source):
                twin = params.get(".".join(target if part == source else part for part in name.split(".")))
                if twin is not None:
                    twin.copy_(param)


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but keep plain models importable without it
        return False
    return isinstance(model, PeftModel)


class ValueHead(nn.Module):
    """Scalar value head V(s) = w . h_s + b of the shared-base (PEFT) critic.

    Initialised with small random weights: a zero head would give the critic adapter no gradient at all.
    """

    def __init__(self, hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.summary = Float32Linear(hidden_size, 1)
        nn.init.normal_(self.summary.weight, std=init_std)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return value_head_forward(self.summary, hidden_states)


def value_head_forward(head: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``head(hidden_states)`` in float32, outside autocast, squeezed to ``[B, T]``: a :class:`Float32Linear` head
    (the shared-base critic's, a separate critic's linear ``score``: `ActorCritic` makes it one) computes in float32
    whatever its weights' dtype, which DeepSpeed's bf16 and FSDP2's mixed precision make bf16; another head computes
    in its own dtype.

    Under bf16 a linear layer computes in bf16: values near 1 would be spaced 2^-8 apart, the size of the TD errors
    V(s_{t+1}) - V(s_t) whose sum over some alpha * l tokens is the policy's advantage. The base's hidden states stay
    as autocast made them; only the head (hidden x 1) computes in float32.
    """
    if isinstance(head, Float32Linear):  # called as a module: ZeRO-3's and FSDP2's hooks gather its weights
        return head(hidden_states).squeeze(-1)
    dtype = next(head.parameters()).dtype
    if not dtype.is_floating_point:  # a quantized head computes as its kernels do
        return head(hidden_states).squeeze(-1)
    with torch.autocast(hidden_states.device.type, enabled=False):
        return head(hidden_states.to(dtype)).squeeze(-1)


def _sequence_classification_head(model: PreTrainedModel) -> nn.Module:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(
        f"{type(model).__name__} has no `score` or `classifier` head: a value model must be an "
        "`AutoModelForSequenceClassification` model with `num_labels=1`."
    )


@runtime_checkable
class ValueFunction(Protocol):
    """A frozen value function, passed as ``VAPOTrainer(..., value_model=fn)`` in place of a learned critic.

    Called without gradients, once per rollout with all of this process's completions::

        values = fn(input_ids, attention_mask, completion_length)

    ``input_ids`` / ``attention_mask``: ``[B, P + C]`` on the training device, each row the prompt (left-padded to
    ``P`` columns) then the completion (right-padded to ``C = completion_length`` columns); the completion ends with
    its stop token, if it has one, and the mask is 0 on padding. Returns ``[B, C]`` values (any device, any float
    dtype): ``values[i, t] = V(prompt_i, completion_i[:t])``, the expected return before the completion's token ``t``,
    the same quantity the learned critic predicts (``ActorCritic.forward``). Columns past a completion's end are
    ignored. The trainer's GAE reads them as the critic's values, in the rollout and in evaluation; there is no
    value pretraining, no value loss and no critic-only pass. A ``torch.nn.Module`` works too: it is neither
    trained, moved to a device, nor saved.
    """

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int
    ) -> torch.Tensor: ...


def is_value_function(value_model: Any) -> bool:
    """Whether ``value_model`` is a :class:`ValueFunction`: a callable that is not a path or a transformers or PEFT
    model (those are critics to train, checked by :func:`check_value_model`)."""
    if isinstance(value_model, (str, os.PathLike, PreTrainedModel)) or is_peft_model(value_model):
        return False
    return callable(value_model) and not isinstance(getattr(value_model, "config", None), PretrainedConfig)


def value_function_name(value_function: ValueFunction) -> str:
    """A function's own name, else its class's: what messages and the model card call it."""
    name = getattr(value_function, "__name__", None)
    return name if isinstance(name, str) else type(value_function).__name__


def _config_value(quantization_config: Any, key: str) -> Any:
    """A field of a transformers quantization config, or of its dict (None where it has none)."""
    if isinstance(quantization_config, dict):
        return quantization_config.get(key)
    return getattr(quantization_config, key, None)


def asks_quantized(quantization_config: Any) -> bool:
    """Whether loading with `quantization_config` (a transformers quantization config, or its dict) gives quantized
    weights: not with one that dequantizes as it loads (TRL's gpt-oss recipe, `Mxfp4Config(dequantize=True)`: the
    weights load in bf16 and transformers removes the quantizer)."""
    return quantization_config is not None and not _config_value(quantization_config, "dequantize")


def asks_bitsandbytes(quantization_config: Any) -> bool:
    """Whether `quantization_config` (a config or its dict) loads with bitsandbytes (4-bit / 8-bit: QLoRA), read as
    transformers' `AutoQuantizationConfig.from_dict` reads it: the `load_in_4bit` / `load_in_8bit` flags first, then
    a `quant_method` of bitsandbytes (its dict spellings `bitsandbytes_4bit` / `bitsandbytes_8bit` too)."""
    if any(_config_value(quantization_config, key) for key in ("load_in_4bit", "load_in_8bit")):
        return True
    method = _config_value(quantization_config, "quant_method")
    return str(method or "").startswith("bitsandbytes")  # (QuantizationMethod is a str enum)


def is_quantized(model: nn.Module) -> bool:
    """Whether `model` (a PEFT model's base too) holds quantized weights, by any method transformers knows
    (bitsandbytes 4-bit / 8-bit, GPTQ, AWQ, torchao, FP8, ...), asked for by `quantization_config` or saved so."""
    return any(getattr(model, flag, False) for flag in ("is_quantized", "is_loaded_in_4bit", "is_loaded_in_8bit"))


def check_value_model(model: nn.Module) -> None:
    """Raise a clear error unless ``model`` is a sequence-classification model with exactly one output."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"value_model must be a path, a model id, a PreTrainedModel or a value function (a callable, see "
            f"`trl_vapo.modeling.ValueFunction`), got {type(model).__name__}."
        )
    num_labels = getattr(model.config, "num_labels", None)
    if num_labels != 1:
        raise ValueError(
            f"value_model {type(model).__name__} has num_labels={num_labels}; a value model outputs one scalar per "
            "token. Load it with `AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, "
            "ignore_mismatched_sizes=True)`: its head starts afresh, its body as trained."
        )
    head = _sequence_classification_head(model)
    backbone = model.base_model
    # The text decoder's attention (a multimodal model's vision tower attends both ways, as it should)
    text = backbone.get_decoder() if hasattr(backbone, "get_decoder") else backbone
    attends_ahead = next((n for n, m in text.named_modules() if getattr(m, "is_causal", None) is False), None)
    if attends_ahead is not None:
        # V(s_t) is read from the hidden state before token t: a bidirectional one has seen the tokens after t, the
        # completion's answer among them (the values fit, and the advantages read nothing).
        raise ValueError(
            f"value_model {type(model).__name__} attends to later tokens ({attends_ahead} is not causal): an encoder "
            "(BERT, RoBERTa, DeBERTa, ...) reads the whole completion at every token, and a critic's value before a "
            "token must not see it. Use a decoder-only model's `AutoModelForSequenceClassification` (the policy's "
            "family), or leave value_model out to build the critic from the policy."
        )
    if not isinstance(head, nn.Linear) or not head_reads_the_backbone(model, head):
        weighted = [(n, c) for n, c in model.named_children() if next(c.parameters(), None) is not None]
        others = [n for n, c in weighted if c is not head and c is not backbone]
        how = f"its head is a {type(head).__name__}" if not isinstance(head, nn.Linear) else f"{others} before it"
        raise ValueError(
            f"value_model {type(model).__name__} scores through more than one linear layer on the backbone's hidden "
            f"states ({how}), and the critic reads a value at every token through that one layer. Use a "
            "decoder-only model's `AutoModelForSequenceClassification` (a linear `score`), or leave value_model out "
            "to build the critic from the policy."
        )
    if not any(param.requires_grad for param in model.parameters()):
        # It would sit in no optimizer group: value pretraining failed in backward ("element 0 of tensors does not
        # require grad"), and without it RL ran on a critic that never learned.
        raise ValueError(
            f"value_model {type(model).__name__} has no trainable weight (requires_grad is False throughout: frozen "
            "by requires_grad_(False), or used as another trainer's reward model, which freezes it), and a critic "
            "trains. Call value_model.requires_grad_(True), or pass a value function (a callable, see "
            "`trl_vapo.modeling.ValueFunction`) for values that do not learn."
        )
    if is_quantized(model):
        raise ValueError(
            f"value_model {type(model).__name__} is quantized, and a critic trains all of its weights: load it in "
            "bfloat16 or float32, or leave value_model out to train a critic adapter on the quantized policy's base."
        )


class Float32Linear(nn.Linear):
    """A linear layer that computes in float32 whatever the input's or its weights' dtype or the autocast: the LM head
    under GRPOConfig's ``cast_lm_head_to_fp32`` (ScaleRL), so that the logits, and the PPO ratio, carry no bf16
    rounding; the value heads (`value_head_forward`)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden_states.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(hidden_states.float(), self.weight.float(), bias)


def cast_lm_head_to_fp32(model: nn.Module) -> None:
    """Store ``model``'s LM head in float32 and compute it in float32 (a :class:`Float32Linear`), as TRL's
    ``cast_lm_head_to_fp32``. A head tied to the input embeddings is cast with them; their output keeps its dtype."""
    causal_lm = _causal_lm(model)
    head = causal_lm.get_output_embeddings()
    if type(head) is Float32Linear:  # cast already (a second trainer on the same model)
        return
    if type(head) is not nn.Linear:
        raise ValueError(
            f"cast_lm_head_to_fp32=True needs the LM head to be a plain linear layer, but it is a "
            f"{type(head).__name__}: a PEFT adapter on the head (`target_modules` or `modules_to_save` with "
            "'lm_head') or a quantized head. Leave the head out of the adapter, or set cast_lm_head_to_fp32=False."
        )
    dtype = head.weight.dtype
    head.float()  # in place: a weight tied to the embeddings stays one parameter
    head.__class__ = Float32Linear
    embeddings = causal_lm.get_input_embeddings()
    if embeddings is not None and embeddings.weight is head.weight and dtype != torch.float32:
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))


def value_target_settings(args, reward_names: list[str]) -> dict[str, Any]:
    """What the returns a critic is pretrained to predict depend on, besides the policy's weights: the rewards (which
    functions, how weighted and combined), how the completions are sampled (temperature, top-p/top-k/min-p, the
    repetition penalty, the token budget, `generation_kwargs`, the chat template's), how much of each prompt the
    policy reads (`max_prompt_length`) and the discount. The data set is not compared. A
    value-pretraining record keeps them; a critic pretrained under others predicts other returns (the functions' own
    settings, such as a math reward's score for a wrong answer, are not seen here)."""
    weights = args.reward_weights or [1.0] * len(reward_names)
    sampling = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length")
    sampling += ("max_prompt_length",)  # a prompt cut from the left: other states
    settings = {
        "reward_funcs": list(reward_names),
        "reward_weights": [float(w) for w in weights],
        "multi_objective_aggregation": args.multi_objective_aggregation,  # the reward the critic sees
        **{key: getattr(args, key) for key in sampling},
        "generation_kwargs": args.generation_kwargs,  # stop strings, ...
        "chat_template_kwargs": args.chat_template_kwargs,  # enable_thinking, ...
        "gamma": args.gamma,
    }
    return json.loads(json.dumps(settings, sort_keys=True, default=str))  # as the record reads back


def value_pretraining_record(path: str | os.PathLike) -> dict | None:
    """The record written next to a critic saved by value pretraining, or None if the critic was not pretrained."""
    record = Path(path) / VALUE_PRETRAINING_FILE
    if record.is_file():
        return json.loads(record.read_text())
    return None


def padding_spans(attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """`[N, 2]`, on the CPU: each row's first prompt column (`prompt_length` for a row without a prompt token) and
    completion length, what `trim_padding` cuts and `length_sorted` orders by. Read from the device in one copy, once
    a step: a read per micro-batch waits, each time, for the device to finish all the work queued before it (the
    last micro-batch's backward), and leaves it idle while the next micro-batch's forward is queued."""
    prompt = attention_mask[:, :prompt_length].bool()
    first = torch.where(prompt.any(dim=1), prompt.float().argmax(dim=1), prompt_length)
    lengths = attention_mask[:, prompt_length:].sum(dim=1)
    return torch.stack([first.to(lengths.dtype), lengths], dim=1).cpu()


def trim_padding(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    rows: torch.Tensor,
    pad_to_multiple_of: int | None = None,
    spans: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`input_ids`, `attention_mask` and completion length of `rows` (indices, on the CPU), without the padding all of
    them share. `spans`: `padding_spans` of all rows, read once for many calls (else read here); `index`: `rows` on the
    inputs' device, where the caller has them (else copied here).

    Prompts are left-padded in the first `prompt_length` columns and completions right-padded after them: the columns
    before the earliest prompt token and after the longest completion of these rows are dropped. With
    `pad_to_multiple_of` (when both widths are multiples of it) both parts keep a multiple of it.
    """
    spans = padding_spans(attention_mask, prompt_length) if spans is None else spans
    first_prompt_column = int(spans[rows, 0].min())
    if first_prompt_column == prompt_length:  # no row has a prompt token (a rollout_func's empty prompts): the
        first_prompt_column = 0  # logits before the first completion token come from the prompt's columns, kept
    completion_length = max(int(spans[rows, 1].max()), 1)
    if pad_to_multiple_of:
        first_prompt_column -= first_prompt_column % pad_to_multiple_of
        completion_length = min(
            -(-completion_length // pad_to_multiple_of) * pad_to_multiple_of, attention_mask.shape[1] - prompt_length
        )
    end = prompt_length + completion_length
    if index is None:  # (a CPU index into a GPU tensor is copied, and waited for)
        index = rows.to(input_ids.device, non_blocking=True)
    return input_ids[index, first_prompt_column:end], attention_mask[index, first_prompt_column:end], completion_length


def length_sorted(rows: torch.Tensor, completion_lengths: torch.Tensor) -> torch.Tensor:
    """`rows` (indices, on the CPU) in the order of their completions' lengths (stable): micro-batches split from them
    hold rows of similar lengths, so each, cut to its longest (`trim_padding`), computes few padding positions; split
    in a random order, nearly every micro-batch is as long as the longest of all. What the micro-batches sum (a step's
    loss, normalised by its token count, or each row's scores) is the same; what is taken per micro-batch is not
    (`top_entropy_quantile`'s threshold: the trainer splits as drawn there)."""
    return rows[completion_lengths[rows].cpu().argsort(stable=True)]


def completion_micro_batches(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    batch_size: int,
    pad_to_multiple_of: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """A rollout's rows in micro-batches of `batch_size`, in the order of their completions' lengths
    (`length_sorted`), each cut to its longest (`trim_padding`): `(rows, input_ids, attention_mask,
    completion_length)` each, `rows` on the inputs' device. The lengths are read from the device once."""
    spans = padding_spans(attention_mask, prompt_length)
    for rows in length_sorted(torch.arange(input_ids.shape[0]), spans[:, 1]).split(batch_size):
        index = rows.to(input_ids.device, non_blocking=True)
        yield index, *trim_padding(input_ids, attention_mask, prompt_length, rows, pad_to_multiple_of, spans, index)


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    # Left padding shifts every token; count positions from each row's first real token, as generation does.
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def completion_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_aux_loss: bool = False,
    entropy_grad: bool = False,
):
    """log pi(y_t | x, y_<t) of the last ``completion_length`` tokens under a causal LM, at ``temperature``.

    ``model``: the causal LM, as wrapped (PEFT, a DeepSpeed engine, FSDP2). The completion's hidden states go through
    the LM head in tiles (:func:`~trl_vapo.core.lm_head_logprobs_and_entropy`): the ``[B, T, V]`` logits, 1.2 GB
    for 8 x 256 tokens of Qwen's 152k vocabulary in float32, never exist. A head that is not a plain linear layer
    on the model itself (a LoRA, quantized or offloaded head; BERT-style heads that transform the hidden states
    first) is run as the model runs it, on the completion's positions only. With ``with_entropy`` also returns the
    per-position entropy of the (temperature-scaled) distribution, detached unless ``entropy_grad`` (an entropy
    bonus trains on it). With ``with_aux_loss`` (a
    Mixture-of-Experts model) returns ``(logprobs, entropy, aux_loss)``: the routers' load-balancing loss over the
    whole sequence, as the model's own forward computes it with ``output_router_logits=True``.
    """
    causal_lm = _causal_lm(model)
    targets = input_ids[:, -completion_length:]
    inputs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=_position_ids(attention_mask),
        use_cache=False,
    )
    if with_aux_loss:
        inputs["output_router_logits"] = True
    aux_loss = []  # set by whichever forward runs

    def finish(logprobs, entropy):
        if with_aux_loss:
            return logprobs, entropy, aux_loss[0]
        return (logprobs, entropy) if with_entropy else logprobs

    def from_logits(out):
        # The logits at position p predict token p + 1; fp32 maths happens in chunks, in the logits' dtype.
        logits = out.logits[:, -completion_length - 1 : -1, :]
        aux_loss.append(getattr(out, "aux_loss", None))
        return token_logprobs_and_entropy(logits, targets.to(logits.device), temperature, with_entropy, entropy_grad)

    head = causal_lm.get_output_embeddings()
    balancing_loss = _load_balancing_loss(causal_lm) if with_aux_loss else None
    tiles_fit = _tiles_fit(causal_lm, head)
    if not tiles_fit or (with_aux_loss and balancing_loss is None):
        _say_untiled(causal_lm, head, tiles_fit)
        return finish(*from_logits(model(**inputs, logits_to_keep=completion_length + 1)))

    logit_scale, logit_softcap = _logit_transform(causal_lm.config)

    def tiled_head_forward(**kwargs):
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in ("labels", "return_dict")}
        outputs = causal_lm.base_model(**kwargs)
        if with_aux_loss:
            aux_loss.append(balancing_loss(outputs.router_logits, kwargs["attention_mask"]))
        hidden = outputs.last_hidden_state
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):  # an FSDP2 head sharded on its own: the whole weight, as its forward would
            weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()
        # Position p predicts token p + 1; with `device_map`, the backbone may end on another device.
        hidden = hidden[:, -completion_length - 1 : -1, :].to(weight.device)
        in_float32 = isinstance(head, Float32Linear)  # the tiles compute in the autocast dtype, else hidden's
        with (
            maybe_gather_lm_head_ctx(weight, bias),  # ZeRO-3: the head's forward hook, which never runs, gathers it
            torch.autocast(hidden.device.type, enabled=False) if in_float32 else contextlib.nullcontext(),
        ):
            return lm_head_logprobs_and_entropy(
                hidden.float() if in_float32 else hidden,
                weight,
                bias,
                targets.to(weight.device),
                temperature,
                with_entropy,
                logit_scale=logit_scale,
                logit_softcap=logit_softcap,
                entropy_grad=entropy_grad,
            )

    out = _run_as_forward(model, causal_lm, tiled_head_forward, **inputs)
    # A wrapper may call the model's own forward instead (PEFT prompt learning with its adapter disabled).
    return finish(*(out if isinstance(out, tuple) else from_logits(out)))


def _load_balancing_loss(causal_lm: nn.Module):
    """``fn(router_logits, attention_mask) -> loss``: the load-balancing loss a Mixture-of-Experts causal LM adds in
    its own forward (its module's ``load_balancing_loss_func`` over its expert counts), for the tiled head's path,
    which runs the backbone alone; None where the model has no such function (its own forward then runs)."""
    import sys

    compute = getattr(sys.modules[type(causal_lm).__module__], "load_balancing_loss_func", None)
    experts, top_k = getattr(causal_lm, "num_experts", None), getattr(causal_lm, "num_experts_per_tok", None)
    if compute is None or experts is None or top_k is None:
        return None
    # Called as Mixtral's `(gate_logits, num_experts, top_k, attention_mask)`: a function of other parameters (Doge's
    # takes `num_keys` before `top_k`: the mask landed in `top_k`, a TypeError at the first scoring pass) is the
    # model's own forward's to call.
    if list(inspect.signature(compute).parameters)[1:4] != ["num_experts", "top_k", "attention_mask"]:
        return None
    return lambda router_logits, attention_mask: compute(router_logits, experts, top_k, attention_mask)


_SAID_UNTILED: set[tuple[str, str]] = set()  # (the model's class, the head's): said once each


def _say_untiled(causal_lm: PreTrainedModel, head: nn.Module | None, tiles_fit: bool) -> None:
    """Once per model and head class: the log-probs come from the model's own forward, whose logits over the whole
    vocabulary, `[B, C + 1, V]`, are the update's largest tensor (kept for the backward) where the tiles keep one
    tile; a run sized by the tiled step's memory could run out of it, unsaid."""
    key = (type(causal_lm).__name__, type(head).__name__)
    if key in _SAID_UNTILED or os.environ.get("RANK", "0") != "0":  # (one process says it for all)
        return
    _SAID_UNTILED.add(key)
    if tiles_fit:
        why = f"its router's load-balancing loss is computed by its own forward ({key[0]})"
        fix = "lower per_device_train_batch_size"
    else:
        why = (
            f"its LM head ({key[1]}) is not a plain linear layer over the backbone's output (a LoRA on lm_head, "
            "modules_to_save, a quantized or offloaded head, or a model that transforms the hidden states first)"
        )
        fix = "lower per_device_train_batch_size, or leave lm_head out of target_modules and modules_to_save"
    # (logging's own logger: accelerate's raises where no accelerator was made, as `trl-vapo eval` scores)
    logging.getLogger(__name__).warning(
        "The log-probs are computed from the model's full-vocabulary logits, not through its LM head in tiles: "
        f"{why}. Each micro-batch's [batch, completion, vocabulary] logits are then the update's largest tensor; "
        f"where memory runs short, {fix}."
    )


def _tiles_fit(causal_lm: PreTrainedModel, head: nn.Module | None) -> bool:
    """Whether ``causal_lm``'s logits are ``head(backbone(x))`` up to :func:`_logit_transform`, with ``head`` a plain
    linear layer whose weight the tiles can read: not LoRA, quantized (float8 ones subclass ``nn.Linear``) or
    offloaded (its weight on the meta device outside its forward), reading the backbone's hidden states as they come
    (:func:`head_reads_the_backbone`); and all of its outputs are logits (Inkling's forward drops the padded
    vocabulary's: the tiles' softmax would take them in)."""
    unpadded = getattr(causal_lm.config.get_text_config(), "unpadded_vocab_size", None)
    return (
        type(head) in (nn.Linear, Float32Linear)
        and unpadded in (None, head.out_features)
        and head.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and head.weight.device.type != "meta"
        and head_reads_the_backbone(causal_lm, head)
    )


def head_reads_the_backbone(model: PreTrainedModel, head: nn.Module) -> bool:
    """Whether ``model``'s weights are its backbone ``base_model``'s and ``head``'s alone, both its direct children:
    then ``head`` can only be applied to the backbone's hidden states as they come. Where another child has weights,
    the model's forward passes the hidden states through it first (BERT's and ModernBERT-decoder's dense, activation
    and norm before the linear layer, CLVP's final norm, the Gemma 4 assistant's projections, DeBERTa's pooler):
    reading ``head`` on the backbone alone computes another function, silently (the tiled log-probs: the model's own
    forward runs instead; a given critic's values: refused)."""
    backbone = model.base_model
    if backbone is model or not any(child is head for child in model.children()):
        return False
    return all(
        child is head or child is backbone or next(child.parameters(), None) is None for child in model.children()
    )


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside ``model``: under a DeepSpeed engine (TRL's ZeRO reference) and PEFT's
    wrappers. Not `accelerate`'s `extract_model_from_parallel`: it imports DeepSpeed and walks every module, on each
    micro-batch; an engine can only exist once DeepSpeed is imported."""
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine):
        model = model.module
    return model.get_base_model() if is_peft_model(model) else model


def _logit_transform(config) -> tuple[float, float | None]:
    """``(scale, soft cap)`` a causal LM's forward applies to its head's output ``y``: ``cap * tanh(scale * y / cap)``.

    Read from the config as TRL's ``add_fused_lm_head`` reads it (Cohere's ``logit_scale``, Gemma 2/3's
    ``final_logit_softcapping``, Granite's and MiniCPM3's ``logits_scaling`` divisor, Falcon-H1's
    ``lm_head_multiplier``, ...), and RecurrentGemma's ``logits_soft_cap``, xLSTM's ``output_logit_soft_cap`` and
    Inkling's ``logits_mup_width_multiplier`` divisor, which TRL's leaves out; ``tests/test_logprobs.py`` checks it
    against the models' own forward.
    """
    config = config.get_text_config()
    scale = getattr(config, "logit_scale", None)
    if config.model_type == "mpt" or not isinstance(scale, (int, float)):
        scale = None  # MPT's config holds one (a number, or "inv_sqrt_d_model") that transformers' MPT never applies
    for name in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(config, name, None) if scale is None else scale
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scale = config.logits_scaling if config.model_type == "hyperclovax" else 1 / config.logits_scaling
    if scale is None and getattr(config, "logits_mup_width_multiplier", None) is not None:  # Inkling's divisor
        scale = 1 / config.logits_mup_width_multiplier
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None and config.model_type == "recurrent_gemma":  # (its name for the same cap: 30)
        cap = config.logits_soft_cap
    if cap is None and config.model_type == "xlstm":  # (its name for the same cap: 30)
        cap = config.output_logit_soft_cap
    return (1.0 if scale is None else scale), cap


def _run_as_forward(outer: nn.Module, inner: nn.Module, function, **inputs):
    """``outer(**inputs)`` with ``inner.forward`` replaced by ``function`` for the call.

    ``function`` runs where ``inner``'s forward runs, inside the hooks of whatever wraps it: PEFT's, FSDP2's unsharding
    of the root module's weights (the embeddings and the head), a ZeRO-3 engine's. Calling the backbone directly
    would skip them. (TRL's ``_ForwardRedirection`` does the same, without restoring ``forward`` on an error.)
    """
    own = inner.__dict__.get("forward")  # an instance attribute (a wrapper's) is put back, not deleted
    inner.forward = function
    try:
        return outer(**inputs)
    finally:
        if own is None:
            del inner.forward
        else:
            inner.forward = own


class ActorCritic(nn.Module):
    """Policy and critic as one module: one forward gives the completion's log-probs, entropies and values.

    Args:
        policy: the causal LM (a ``PeftModel`` in the shared-base layout).
        critic: a one-label ``*ForSequenceClassification`` model (the separate-critic layout).
        value_head: the shared-base layout's :class:`ValueHead`.
        value_function: a frozen :class:`ValueFunction` instead of a learned critic.

    Exactly one of ``critic``, ``value_head`` and ``value_function`` is given.
    """

    def __init__(
        self,
        policy: nn.Module,
        critic: PreTrainedModel | None = None,
        value_head: ValueHead | None = None,
        value_function: ValueFunction | None = None,
    ):
        super().__init__()
        if sum(x is not None for x in (critic, value_head, value_function)) != 1:
            raise ValueError(
                "Pass exactly one of `critic` (separate critic), `value_head` (shared-base critic) or "
                "`value_function` (a frozen value function)."
            )
        if value_head is not None and not is_peft_model(policy):
            raise ValueError("A shared-base critic needs a PEFT policy carrying a 'critic' adapter.")
        self.policy = policy
        self.critic = critic
        self.value_head = value_head
        if critic is not None and type(head := _sequence_classification_head(critic)) is nn.Linear:
            head.__class__ = Float32Linear  # float32 values whatever its weights' dtype (`value_head_forward`)
        # A Mixture-of-Experts policy's load-balancing loss comes back with its log-probs (`forward`'s `aux_loss`)
        # when the trainer adds it to the policy's loss (`router_aux_loss_coef`).
        self.with_router_aux_loss = False
        # An entropy bonus (`entropy_coef`) trains on the policy's entropy: it then comes back with its gradient.
        self.with_entropy_grad = False
        # Kept out of the module tree (not a registered submodule, even if it is an nn.Module): frozen, it is neither
        # trained, wrapped by DDP/DeepSpeed/FSDP, moved, nor part of the state dict.
        self.__dict__["value_function"] = value_function
        # The dtypes the full models came in: what `save_model` writes them back in, whatever the backend, while their
        # trainable weights are kept and updated in float32 (`keep_trainable_weights_in_float32`).
        self.loaded_dtypes = {"policy": _tensor_dtypes(policy), "critic": _tensor_dtypes(critic)}

    def tie_weights(self) -> None:
        """Tie each model's tied weights again (a tied LM head to its embeddings): accelerate's FSDP2 preparation with
        `cpu_ram_efficient_loading` (TRL's fsdp2.yaml) loads the weights with `load_state_dict(assign=True)`, which
        unties them, and calls the prepared model's `tie_weights`; left untied, the head stayed out of the
        optimizer, frozen at its first value, while the embeddings trained."""
        for model in (self.policy, self.critic):
            if model is not None and hasattr(model, "tie_weights"):
                model.tie_weights()

    # ------------------------------------------------------------------------------------------------ layout
    @property
    def shares_base(self) -> bool:
        return self.value_head is not None

    @property
    def learns_values(self) -> bool:
        """False when the values come from a frozen :class:`ValueFunction`: no critic to train, save or load."""
        return self.value_function is None

    @property
    def critic_description(self) -> str:
        if self.shares_base:
            return "adapter on the policy's base"
        if self.learns_values:
            return "separate model"
        return f"frozen value function ({value_function_name(self.value_function)})"

    @property
    def config(self):
        return self.policy.config

    @property
    def _no_split_modules(self) -> list[str]:
        """The policy's and the critic's layer classes, which FSDP2 shards one by one: accelerate's
        TRANSFORMER_BASED_WRAP reads the prepared model's `_no_split_modules` where the config names no class (TRL's
        fsdp2.yaml names none). Without them the whole actor-critic was one FSDP unit, gathered whole on every
        process at each forward."""
        names = []
        for model in (self.policy, self.critic):
            base = model.get_base_model() if is_peft_model(model) else model
            names += getattr(base, "_no_split_modules", None) or []
        return list(dict.fromkeys(names))

    @property
    def is_gradient_checkpointing(self) -> bool:
        base = self.policy.get_base_model() if is_peft_model(self.policy) else self.policy
        return any(getattr(m, "gradient_checkpointing", False) for m in base.modules())

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Checkpoint the decoder layers of the policy and the critic (non-reentrant by default, as transformers).

        In the shared-base layout the critic's forward runs the same layers under the ``critic`` adapter, but the
        recomputation in backward runs after the adapter has been switched back: it would replay the layers under
        the policy adapter and give the critic adapter the policy's activations. The checkpoint's ``context_fn``
        records the adapter active when each layer ran forward and restores it for that layer's recomputation.
        """
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        # transformers' own keys (which layers, where their saved activations live), taken out as its Trainer takes
        # them: the rest go to `torch.utils.checkpoint`, which would drop these two silently.
        layer_options = {key: kwargs.pop(key) for key in ("every_n_layers", "offload") if key in kwargs}
        if next(self.policy.parameters()).device.type == "cpu":  # the activations are on the host already (and
            layer_options.pop("offload", None)  # transformers would ask for pinned memory, which needs an accelerator)
        if self.shares_base:
            if kwargs["use_reentrant"]:
                raise ValueError(
                    "gradient_checkpointing_kwargs={'use_reentrant': True} cannot be used with the shared-base LoRA "
                    "critic: reentrant checkpointing cannot replay a layer under the adapter that ran it. Use "
                    "use_reentrant=False (the default)."
                )
            kwargs["context_fn"] = self._replay_under_forward_adapter
        for model in (self.policy, self.critic):
            if model is None:
                continue
            base = model.get_base_model() if is_peft_model(model) else model
            # transformers 5.x renamed the method; the deprecated name warns from 5.20 on.
            enable = getattr(base, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs=kwargs, **layer_options)
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **layer_options)

    def gradient_checkpointing_disable(self) -> None:
        for model in (self.policy, self.critic):
            if model is None:
                continue
            base = model.get_base_model() if is_peft_model(model) else model
            disable = getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable
            disable()
            # The forward hook on the input embeddings that enabling registered: transformers removes it only for a
            # model with an adapter loaded through it, so each generation's pause and re-enable would add one more.
            base.disable_input_require_grads()

    def _adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        return [p for n, p in self.policy.named_parameters() if of_adapter(n, adapter) and p.requires_grad]

    def policy_parameters(self) -> list[nn.Parameter]:
        if self.shares_base:
            return self._adapter_parameters(POLICY_ADAPTER)
        return [p for p in self.policy.parameters() if p.requires_grad]

    def critic_parameters(self) -> list[nn.Parameter]:
        if not self.learns_values:
            return []
        if self.shares_base:
            return self._adapter_parameters(CRITIC_ADAPTER) + list(self.value_head.parameters())
        return [p for p in self.critic.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _adapter(self, name: str):
        """The policy's layers compute as adapter `name` for the duration, then as the policy's again; which weights
        are trainable does not change (one optimizer step updates both adapters)."""
        self._activate(name)
        try:
            yield
        finally:
            self._activate(POLICY_ADAPTER)

    def _activate(self, name: str) -> None:
        """What peft's `set_adapter(name)` leaves in each layer's `_active_adapter` (and the model's and the tuner's
        `active_adapter`), set directly. `set_adapter` walks every module twice and flips every adapter weight's
        `requires_grad`, which then had to be restored: about 30 ms a switch at Qwen2.5-0.5B shapes with LoRA on
        every linear layer (two switches per critic forward, a forward per micro-batch in the scoring pass and in
        the update), against well under a millisecond here. Each adapter's states are read from `set_adapter` once,
        again whenever the adapters change (`add_reference_adapter`)."""
        for layer, state in zip(self._tuner_layers(), self._adapter_states[name]):
            # (a list for some: copied, never shared; set in the instance's dict, as Module.__setattr__ would, faster)
            vars(layer)["_active_adapter"] = copy.copy(state)
        self.policy.active_adapter = self.policy.base_model.active_adapter = name  # (the PeftModel's and the tuner's)

    def _tuner_layers(self) -> list[nn.Module]:
        """`_adapter_layers` of the policy, and each adapter's `_active_adapter` states as `set_adapter` leaves
        them (`self._adapter_states`), read once, again whenever the adapters change."""
        adapters = tuple(self.policy.peft_config)
        if getattr(self, "_adapter_states_of", None) != adapters:
            layers, states = _adapter_layers(self.policy), {}
            trainable = {n for n, p in self.policy.named_parameters() if p.requires_grad}
            for adapter in adapters:
                self.policy.set_adapter(adapter)
                states[adapter] = [copy.copy(layer._active_adapter) for layer in layers]
            self.policy.set_adapter(POLICY_ADAPTER)
            for n, param in self.policy.named_parameters():  # as they were: set_adapter froze the others
                param.requires_grad_(n in trainable)
            self._switch_layers, self._adapter_states, self._adapter_states_of = layers, states, adapters
        return self._switch_layers

    @contextlib.contextmanager
    def _base_alone(self):
        """The policy computes as its base, every adapter off, for the duration (a new adapter's KL reference).

        Not peft's ``disable_adapter()``: leaving it, peft re-enables the adapters with ``set_adapter`` of the active
        one, which leaves only the policy's adapter trainable: the critic's (and its ``modules_to_save`` copies)
        would never train again. Each adapter layer's ``_disable_adapters`` flag is what its forward reads; set
        directly, ``requires_grad`` left alone. Prompt-learning adapters, which peft disables by swapping the
        forward and without touching ``requires_grad``, and adaption prompts (layers of their own) go through peft."""
        config = self.policy.peft_config[self.policy.active_adapter]
        if config.is_prompt_learning or config.is_adaption_prompt:
            with self.policy.disable_adapter():
                yield
            return
        layers = self._tuner_layers()
        was = [layer._disable_adapters for layer in layers]
        for layer in layers:
            vars(layer)["_disable_adapters"] = True
        try:
            yield
        finally:
            for layer, flag in zip(layers, was):
                vars(layer)["_disable_adapters"] = flag

    def _replay_under_forward_adapter(self):
        """A ``torch.utils.checkpoint`` ``context_fn``: a checkpointed layer is recomputed under the adapter that ran
        its forward (the critic's backward runs after its forward switched back to the policy's adapter). Recorded
        by name at the forward, switched by `_activate` only where another adapter is active at the recomputation
        (the critic's side), which sets the layers' ``_active_adapter`` and leaves ``requires_grad`` alone, as it
        must in the middle of a backward pass."""
        forward = self.policy.active_adapter

        @contextlib.contextmanager
        def recompute():
            current = self.policy.active_adapter
            if current == forward:
                yield
                return
            self._activate(forward)
            try:
                yield
            finally:
                self._activate(current)

        return contextlib.nullcontext(), recompute()

    def add_reference_adapter(self) -> None:
        """A frozen copy of the policy adapter as it is now, named `REFERENCE_ADAPTER`: the KL penalty's reference
        when the policy came with a trained adapter (the base alone is not the initial policy then), as GRPOTrainer
        adds its "ref" adapter."""
        self.policy.add_adapter(REFERENCE_ADAPTER, second_adapter_config(self.policy.peft_config[POLICY_ADAPTER]))
        copy_adapter_weights(self.policy, POLICY_ADAPTER, REFERENCE_ADAPTER)
        set_adapters_trainable(self.policy, REFERENCE_ADAPTER, False)

    def _as_reference(self, reference: nn.Module | str):
        """Where the policy computes as `reference` ("base", `REFERENCE_ADAPTER`); nothing for a model of its own."""
        if reference == "base":
            return self._base_alone()
        return self._reference_adapter() if reference == REFERENCE_ADAPTER else contextlib.nullcontext()

    def _reference_adapter(self):
        """The policy computes as `add_reference_adapter`'s copy for the duration; the trainable adapters stay so."""
        return self._adapter(REFERENCE_ADAPTER)

    # ---------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_length: int,
        temperature: float = 1.0,
        with_policy: bool = True,
        with_values: bool = True,
        with_entropy: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Scores the last ``completion_length`` tokens of ``input_ids`` (prompt + completion, prompt left-padded).

        Returns a dict with, for each completion position t (shape ``[B, completion_length]``):
        ``logprobs`` log pi(y_t | x, y_<t) at ``temperature`` and ``entropy`` (detached, when ``with_entropy``) when
        ``with_policy``;
        ``values`` V(x, y_<t), read from the hidden state that precedes y_t, when ``with_values``;
        ``aux_loss`` the routers' load-balancing loss (a scalar) when ``with_policy`` and ``with_router_aux_loss``.
        """
        position_ids = _position_ids(attention_mask)
        outputs: dict[str, torch.Tensor] = {}
        if with_policy:
            aux = self.with_router_aux_loss
            logprobs = completion_logprobs(
                self.policy,
                input_ids,
                attention_mask,
                completion_length,
                temperature,
                with_entropy,
                aux,
                entropy_grad=with_entropy and self.with_entropy_grad,
            )
            if aux:
                outputs["logprobs"], entropy, outputs["aux_loss"] = logprobs
                if with_entropy:
                    outputs["entropy"] = entropy
            elif with_entropy:
                outputs["logprobs"], outputs["entropy"] = logprobs
            else:
                outputs["logprobs"] = logprobs
        if with_values and not self.learns_values:
            outputs["values"] = self.frozen_values(input_ids, attention_mask, completion_length)
        elif with_values:
            hidden = self._critic_hidden_states(input_ids, attention_mask, position_ids)
            hidden = hidden[:, -completion_length - 1 : -1, :]  # V(s_t) reads the state before token t
            if self.shares_base:
                outputs["values"] = self.value_head(hidden).float()
            else:
                outputs["values"] = value_head_forward(_sequence_classification_head(self.critic), hidden).float()
        return outputs

    @torch.no_grad()
    def frozen_values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int
    ) -> torch.Tensor:
        """The :class:`ValueFunction`'s values of these completions, checked, as float32 on ``input_ids``' device."""
        values = self.value_function(input_ids, attention_mask, completion_length)
        expected = (input_ids.shape[0], completion_length)
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != expected:
            got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(
                f"The value function {value_function_name(self.value_function)} returned {got}; it must return a "
                f"tensor of shape [batch, completion_length] = {list(expected)}: the value before each completion "
                "token (see `trl_vapo.modeling.ValueFunction`)."
            )
        values = values.detach().to(device=input_ids.device, dtype=torch.float32)
        return values.masked_fill(attention_mask[:, input_ids.shape[1] - completion_length :] == 0, 0.0)

    def _critic_hidden_states(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        if self.shares_base:
            backbone = self.policy.get_base_model().base_model
            with self._adapter(CRITIC_ADAPTER):
                return backbone(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                ).last_hidden_state
        return self.critic.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state

    @torch.no_grad()
    def score_completions(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        *,
        batch_size: int,
        temperature: float,
        with_policy: bool,
        with_values: bool = True,
        reference: nn.Module | str | None = None,
        autocast=contextlib.nullcontext,
        pad_to_multiple_of: int | None = None,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probs (when ``with_policy``), values (zeros without ``with_values``, for a critic that learns),
        log-probs under ``reference``, and the policy's per-token entropy (when ``with_entropy``, with the policy) of
        the completions after the first ``prompt_length`` columns, without gradients, in micro-batches of
        ``batch_size``, padded to the completions' width. ``reference``: a model,
        ``"base"`` (this policy with its adapters disabled), `REFERENCE_ADAPTER` (this policy with
        `add_reference_adapter`'s copy), or None.
        ``pad_to_multiple_of``: see :func:`trim_padding`."""
        width = input_ids.shape[1] - prompt_length
        learned_values = self.learns_values and with_values
        if self.learns_values:
            values = torch.zeros((input_ids.shape[0], width), device=input_ids.device)
        else:  # one call with the whole rollout: a value function may read the rollout as a whole (the oracle does)
            values = self.frozen_values(input_ids, attention_mask, width)
        logprobs = torch.zeros_like(values) if with_policy else None
        entropy = torch.zeros_like(values) if with_policy and with_entropy else None
        ref = torch.zeros_like(values) if reference is not None else None
        if not (learned_values or with_policy or reference is not None):
            return logprobs, values, ref, entropy  # the value function gave everything asked for: no model forward
        batches = completion_micro_batches(input_ids, attention_mask, prompt_length, batch_size, pad_to_multiple_of)
        for rows, ids, attention, length in batches:
            columns = slice(0, min(length, width))
            with autocast():
                out = self(
                    ids,
                    attention,
                    length,
                    temperature,
                    with_policy=with_policy,
                    with_values=learned_values,
                    with_entropy=entropy is not None,
                )
                if learned_values:
                    values[rows, columns] = out["values"]
                if with_policy:
                    logprobs[rows, columns] = out["logprobs"]
                if entropy is not None:
                    entropy[rows, columns] = out["entropy"]
                if reference is not None:
                    model = self.policy if isinstance(reference, str) else reference
                    with self._as_reference(reference):
                        ref[rows, columns] = completion_logprobs(model, ids, attention, length, temperature)
        return logprobs, values, ref, entropy

    # ---------------------------------------------------------------------------------------- save and load
    def save_critic(
        self, directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None, as_loaded: bool = False
    ) -> None:
        """Write the critic so that `value_model=directory` loads it back (the layout matches this module's).

        ``state_dict``: this module's full weights when they were gathered from shards (FSDP2); otherwise the
        parameters are read directly. ``as_loaded``: a full critic in the dtype it was loaded in (a checkpoint keeps
        the float32 training weights instead, to resume exactly); adapters and the value head as they are.
        """
        directory = Path(directory)
        if not self.learns_values:
            return  # a frozen value function: nothing was trained
        if self.shares_base:
            # peft writes a non-default adapter into `<dir>/<adapter name>`: move it up into `directory`.
            directory.mkdir(parents=True, exist_ok=True)
            self.policy.save_pretrained(
                str(directory), selected_adapters=[CRITIC_ADAPTER], state_dict=_sub_state(state_dict, "policy.")
            )
            nested = directory / CRITIC_ADAPTER
            for item in nested.iterdir():
                os.replace(item, directory / item.name)
            nested.rmdir()
            # peft's template card ("More Information Needed" in every field), which a push would publish: the
            # run's own card, one folder up, says what the critic is and how to load it.
            (directory / "README.md").unlink(missing_ok=True)
            head = _sub_state(state_dict, "value_head.") or self.value_head.state_dict()
            save_file({k: v.detach().cpu().contiguous() for k, v in head.items()}, str(directory / VALUE_HEAD_FILE))
        else:
            dtypes = self.loaded_dtypes["critic"] if as_loaded else None
            _save_pretrained(self.critic, directory, _sub_state(state_dict, "critic.", self.critic), dtypes)
            backbone = type(self.critic.base_model)
            remote = "transformers_modules"  # where transformers puts a checkpoint's own code
            if backbone.__module__.startswith(remote) and not type(self.critic).__module__.startswith(remote):
                # A classifier trl-vapo built over custom code (`loading.sequence_classifier_class`): the backbone's
                # code goes along, as the policy's does, so that `value_model=directory` (with trust_remote_code)
                # loads it back.
                from transformers.dynamic_module_utils import custom_object_save

                custom_object_save(self.critic.base_model, str(directory))

    def load_critic(self, directory: str | os.PathLike) -> None:
        """Load critic weights written by :meth:`save_critic` into this module, in place."""
        directory = Path(directory)
        if not self.learns_values:
            return
        if self.shares_base:
            _load_adapter_into(self.policy, directory, CRITIC_ADAPTER)
            self.value_head.load_state_dict(load_file(directory / VALUE_HEAD_FILE))
        else:
            _load_safetensors_into(self.critic, directory)

    def weights_not_saved(self) -> set[str]:
        """The weights (named as in `state_dict()`) that no save writes: a PEFT policy's frozen base, but its
        embeddings (peft writes them with an adapter that targets or resized them). Its adapters, the value head
        and a separate critic are written; under ZeRO-3 and FSDP2 a save gathers the rest only (the whole base, onto
        the main process's memory, at every checkpoint: a 70B base, 140 GB)."""
        if not is_peft_model(self.policy):
            return set()
        embeddings = {
            id(p)
            for layer in (self.policy.get_input_embeddings(), self.policy.get_output_embeddings())
            if layer is not None
            for p in layer.parameters()
        }
        return {
            f"policy.{name}"
            for name, p in self.policy.named_parameters()
            if not p.requires_grad and id(p) not in embeddings
        }

    def save_policy(
        self, directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None, as_loaded: bool = False
    ) -> None:
        """The policy alone: a full model for `AutoModelForCausalLM`, or the policy adapter for PEFT.

        ``state_dict`` and ``as_loaded`` as in :meth:`save_critic`.
        """
        policy_state = _sub_state(state_dict, "policy.", self.policy)
        if is_peft_model(self.policy):  # the policy adapter alone (not the critic's, nor a reference copy)
            self.policy.save_pretrained(str(directory), state_dict=policy_state, selected_adapters=[POLICY_ADAPTER])
            # peft's template card, as beside the critic: a checkpoint pushed to the Hub (hub_strategy every_save)
            # would replace the run's card with it; `save_model` writes the run's card after this.
            (Path(directory) / "README.md").unlink(missing_ok=True)
        else:
            _save_pretrained(self.policy, directory, policy_state, self.loaded_dtypes["policy"] if as_loaded else None)

    def load_policy(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        if is_peft_model(self.policy):
            _load_adapter_into(self.policy, directory, POLICY_ADAPTER)
        else:
            _load_safetensors_into(self.policy, directory)


def _tensor_dtypes(model: nn.Module | None) -> dict[str, torch.dtype] | None:
    """The dtype of each floating-point tensor of a full model's state dict (None for PEFT models and None)."""
    if model is None or is_peft_model(model):
        return None
    return {name: t.dtype for name, t in model.state_dict().items() if t.is_floating_point()}


def _save_pretrained(
    model: PreTrainedModel,
    directory: str | os.PathLike,
    state_dict: dict[str, torch.Tensor] | None,
    dtypes: dict[str, torch.dtype] | None,
) -> None:
    """``model.save_pretrained``, each floating-point tensor in its dtype in ``dtypes`` (None: as they are) and
    ``config.json``'s ``dtype`` the first one's (as transformers records it). Cast on the CPU, one tensor at a time
    into the new dict: no second copy of the model on the accelerator."""
    if dtypes is None:
        model.save_pretrained(directory, state_dict=state_dict)
        return
    state = state_dict if state_dict is not None else _sub_state(model.state_dict(), "", model)  # tied ones once
    model.save_pretrained(
        directory,
        state_dict={
            k: v.detach().cpu().to(dtypes.get(k, v.dtype)) if v.is_floating_point() else v for k, v in state.items()
        },
    )
    config = copy.deepcopy(model.config)
    config.dtype = next(iter(dtypes.values()))
    config.save_pretrained(directory)


def _sub_state(
    state_dict: dict[str, torch.Tensor] | None, prefix: str, module: nn.Module | None = None
) -> dict[str, torch.Tensor] | None:
    """The entries of a submodule (``prefix`` = its name and a dot) with the prefix removed; None for None.

    With ``module``, a weight it ties under several names (the LM head and the embeddings) is kept once, as
    ``save_pretrained`` keeps it: a gathered state dict holds a separate copy under each name.
    """
    if state_dict is None:
        return None
    duplicates, seen = set(), set()
    for name, param in module.named_parameters(remove_duplicate=False) if module is not None else ():
        if id(param) in seen:
            duplicates.add(name)
        seen.add(id(param))
    return {
        key[len(prefix) :]: value
        for key, value in state_dict.items()
        if key.startswith(prefix) and key[len(prefix) :] not in duplicates
    }


def _trainable_base_weights(policy: nn.Module) -> tuple[list[str], str]:
    """The names of the policy's trainable weights outside its adapters (the base's), and why they train."""
    names = [
        name
        for name, param in policy.named_parameters()
        if param.requires_grad and not of_adapter(name, POLICY_ADAPTER) and not of_adapter(name, CRITIC_ADAPTER)
    ]
    bias = getattr(policy.peft_config.get(POLICY_ADAPTER), "bias", "none")
    cause = f"LoraConfig(bias={bias!r}) makes the base's biases trainable" if bias != "none" else "they train"
    return names, cause


def check_only_adapters_train(policy: nn.Module) -> None:
    """The shared-base layout trains the policy's adapter and the critic's, over a base that the policy, the critic
    and the KL reference all compute with: a trainable base weight would be in neither side's optimizer (it would
    never move, silently), and moving it would move all three."""
    shared, cause = _trainable_base_weights(policy)
    if shared:
        raise ValueError(
            f"{len(shared)} weights of the policy ({', '.join(shared[:2])}, ...) would train in neither the policy's "
            f"adapter nor the critic's: {cause}, and the base is shared by the policy, the critic and the KL "
            "reference. Use bias='none' (peft's default), or a separate critic (value_model=...), or freeze them."
        )


def check_reference_is_frozen(policy: nn.Module) -> None:
    """With PEFT the KL reference is the policy's base (adapters off, or the frozen "ref" copy of the adapter): a base
    weight that trains (a separate critic lets `LoraConfig(bias=...)` train the biases) would move the reference
    with the policy, and the penalty would never see that drift."""
    moving, cause = _trainable_base_weights(policy)
    if moving:
        raise ValueError(
            f"beta > 0 with {len(moving)} trainable weights of the policy's base ({', '.join(moving[:2])}, ...): "
            f"{cause}, and with PEFT the KL reference is that base, which would move with the policy (the penalty "
            "blind to their drift). Use bias='none' (peft's default) or freeze them, or beta=0, or full fine-tuning "
            "(its reference is a frozen copy)."
        )


def _adapter_layers(model: nn.Module) -> list[nn.Module]:
    """The modules that compute as the active adapter says: LoRA's (and other tuners') layers, and the wrappers of
    `modules_to_save` copies (a norm inside each decoder layer, say), each with its own `_active_adapter`."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import AuxiliaryTrainingWrapper

    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


def keep_trainable_weights_in_float32(model: nn.Module, autocast: bool = True) -> tuple[int, list[str]]:
    """Cast every trainable half-precision parameter to float32 in place; returns how many were cast, and the names
    of those left in half precision.

    Mixed precision as verl's FSDP and OpenRLHF's DeepSpeed do it: trainable weights (full policy, critic, value
    head, adapters) are stored and updated in float32 and computed in bf16 under autocast. In bf16 an AdamW update of
    about ``lr = 1e-6`` is below the weights' resolution (a bf16 weight of 0.02 moves in steps of 1.2e-4), so most
    weights would never move. Frozen weights (a LoRA base) keep their dtype.

    Without ``autocast`` (no ``bf16``; ``fp16`` on a CPU) a layer computes in its weights' dtype, and a float32 layer
    among half-precision ones (peft's ``modules_to_save`` copy on a bf16 base, the trainable part of a partly frozen
    model) met half-precision inputs: a dtype error. There only a model (each child of ``model``: the policy, a
    separate critic) that trains whole is cast, and computes in float32 throughout; the others keep their trainable
    half-precision weights, whose names are returned (peft's adapters are float32 already).
    """
    cast, left = 0, []
    for prefix, part in model.named_children() if list(model.children()) else [("", model)]:
        floating = [p for p in part.parameters() if p.is_floating_point()]
        whole = all(p.requires_grad for p in floating)
        for name, param in part.named_parameters(prefix=prefix):
            if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16):
                if autocast or whole:
                    param.data = param.data.float()
                    cast += 1
                else:
                    left.append(name)
    return cast, left


@contextlib.contextmanager
def generation_mode(model: nn.Module):
    """Eval mode for sampling (no dropout), each module's mode restored afterwards.

    bitsandbytes (0.50) on a CPU with AVX512-BF16 repacks a 4-bit layer's weights for inference the first time it
    runs in eval mode without gradients, and the repacked layer then passes no gradient back to its input, so every
    adapter below it stops learning. Its 4-bit layers stay in train mode: they have no dropout, nothing else changes.
    Each module gets its own mode back, not the model's: nested (sampling within an evaluation), the inner exit put
    the 4-bit layers in eval mode for the rest of the outer one.
    """
    import sys

    modes = [(module, module.training) for module in model.modules()]  # parents before their children
    model.eval()
    bnb = sys.modules.get("bitsandbytes")
    if bnb is not None:
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.train()
    try:
        yield model
    finally:
        for module, training in modes:
            if module.training != training:  # (`train` reaches the children, which come later to be set again)
                module.train(training)


def policy_fingerprints(policy: nn.Module) -> tuple[str, str]:
    """Two digests of the policy's weights, in one pass over them:

    - the policy's: its architecture and every weight but the critic adapter's, each with its name (what a saved
      critic was pretrained against);
    - the base model's: its weights alone, every PEFT adapter left out and no names (peft's wrapping renames them):
      what a resumed run must share with the checkpoint's run, whose adapters the checkpoint holds. The same with or
      without an adapter on it, whichever way it was added.

    Sums per tensor rather than a hash of the bytes: a few hundred milliseconds for a 1.5B model, insensitive to
    dtype casts that keep the values (a bf16 checkpoint loaded in float32 matches it loaded in bf16; a float32 one
    loaded in bf16 does not: its weights are rounded).
    """
    import hashlib

    policy_digest, base_digest = hashlib.sha256(), hashlib.sha256()
    config = policy.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
        config.pop(key, None)
    policy_digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    adapters = list(getattr(policy, "peft_config", None) or ())
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if of_adapter(name, CRITIC_ADAPTER):
                continue
            # In chunks: float64 copies of a whole 7B model's embedding would take 9 GB of its GPU at once.
            total = absolute = 0.0
            for chunk in param.detach().reshape(-1).split(1 << 24):
                values = exact(chunk)
                total, absolute = total + values.sum().item(), absolute + values.abs().sum().item()
            weights = f"{tuple(param.shape)}:{total:.6e}:{absolute:.6e}"
            policy_digest.update(f"{name}:{weights}".encode())
            if not any(of_adapter(name, adapter) for adapter in adapters):
                base_digest.update(weights.encode())
    return policy_digest.hexdigest(), base_digest.hexdigest()


def _load_adapter_into(model: nn.Module, directory: Path, adapter_name: str) -> None:
    """Load the adapter weights `save_pretrained` wrote in `directory` into `model`'s adapter `adapter_name`, all of
    them: peft loads what matches and leaves the rest as it was (its result was left unread, and a cut or another
    adapter's file resumed with the weights the adapter was built with, silently). Missing: what peft saves of the
    adapter (`get_peft_model_state_dict`) and the file lacks; unexpected: what peft matched to nothing (a
    prompt-learning adapter's embeddings load on their own path: peft calls them so)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    saved = load_file(directory / "adapter_model.safetensors")
    # (embedding layers aside: peft's "auto" asks the Hub whether to save them, and a file that holds them loads them)
    missing = sorted(
        set(get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)) - set(saved)
    )
    result = set_peft_model_state_dict(model, saved, adapter_name)
    unexpected = [] if model.peft_config[adapter_name].is_prompt_learning else sorted(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(
            f"The adapter weights in {directory} do not match the model's '{adapter_name}' adapter: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}."
        )


def _not_loaded_under_another_name(model: nn.Module, missing: list[str], loaded_names) -> list[str]:
    """The names of `missing` whose tensor was not loaded under another of `model`'s names: a tied head is the
    embeddings' tensor, saved once under their name. (By name, an untied model's missing head was let through too:
    it resumed on the head it was built with.)"""
    tensors = model.state_dict(keep_vars=True)
    loaded = {id(tensors[name]) for name in loaded_names if name in tensors}
    return [name for name in missing if id(tensors.get(name)) not in loaded]


def _load_safetensors_into(model: PreTrainedModel, directory: Path) -> None:
    """Load every ``*.safetensors`` shard of a ``save_pretrained`` folder into ``model`` (strictly, tied weights
    aside)."""
    state: dict[str, torch.Tensor] = {}
    shards = sorted(directory.glob("model*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"No model*.safetensors weights in {directory}.")
    for shard in shards:
        state.update(load_file(shard))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = _not_loaded_under_another_name(model, missing, state)
    if unexpected:
        # `save_pretrained` writes transformers' original layout, undoing the weight conversions `from_pretrained`
        # applies (an MoE's experts one tensor each, which the model holds stacked): read through `from_pretrained`,
        # which converts them, on the CPU in float32, and copied in (for those architectures, a second copy for now).
        del state
        loaded, info = type(model).from_pretrained(
            directory, dtype=torch.float32, device_map="cpu", output_loading_info=True
        )
        if any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")):  # it fills them in
            # (sets, in transformers' loading info: listed, for the message's first five)
            missing, unexpected = sorted(info.get("missing_keys", [])), sorted(info.get("unexpected_keys", []))
            missing = _not_loaded_under_another_name(loaded, missing, set(loaded.state_dict()) - set(missing))
        else:
            missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
            missing = _not_loaded_under_another_name(model, missing, loaded.state_dict())
    if missing or unexpected:
        raise ValueError(
            f"Weights in {directory} do not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}."
        )


_DROPOUT_NUMBER = re.compile(r"dropout|pdrop|layerdrop")


def disable_dropout(model: nn.Module) -> None:
    """Every dropout probability in `model` 0: each `nn.Dropout`'s (TRL's `disable_dropout_in_model`, which
    GRPOTrainer runs) and those a module keeps as a number and uses in training mode alone (`nn.functional.dropout`:
    OPT's `dropout`, the `attention_dropout` of Llama's and Qwen2's attention; OPT's `layerdrop`, which skips whole
    layers at random), which it leaves: with OPT's 0.1 the scoring pass and the update drew other masks, and the
    first pass's ratio was not 1. The config is left as loaded (it is saved with the model); a model that reads its
    config's probability in its forward (Falcon, GPT-Neo, Persimmon) keeps it."""
    disable_dropout_in_model(model)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if type(value) is float and 0 < value <= 1 and _DROPOUT_NUMBER.search(name):  # (a probability)
                setattr(module, name, 0.0)
