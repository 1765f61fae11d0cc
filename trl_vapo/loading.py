"""Building the actor-critic from what the user passed: the policy (an id, a path or a model, quantized or not, with
its adapter), and the critic beside it (copied from the policy, a saved critic, a model, or a frozen value
function), with the classifier class for architectures transformers has none for; and the trainer's arguments about
them, checked before anything loads. The module itself (:class:`~trl_vapo.modeling.ActorCritic`) and what it computes
are :mod:`trl_vapo.modeling`'s."""

from __future__ import annotations

import inspect
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.logging import get_logger
from safetensors.torch import load_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
from transformers.utils import find_adapter_config_file, is_liger_kernel_available

from ._compat import get_config_model_id
from .modeling import (
    CRITIC_ADAPTER,
    CRITIC_SUBFOLDER,
    POLICY_ADAPTER,
    VALUE_HEAD_FILE,
    VALUE_PRETRAINING_FILE,
    ActorCritic,
    ValueHead,
    asks_bitsandbytes,
    asks_quantized,
    check_only_adapters_train,
    check_value_model,
    copy_adapter_weights,
    is_peft_model,
    is_quantized,
    is_value_function,
    keep_trainable_weights_in_float32,
    rewrites_base,
    second_adapter_config,
    set_adapters_trainable,
    value_function_name,
    value_pretraining_record,
)
from .pretrained import LOOKUP_KWARGS, from_pretrained_kwargs, load_pretrained, lookup_kwargs

if TYPE_CHECKING:
    from .config import VAPOConfig

logger = get_logger(__name__)  # the main process only: these run on every process of a multi-process run


def has_sequence_classifier(config, trust_remote_code: bool = False) -> bool:
    """Whether `AutoModelForSequenceClassification` has a class for ``config``'s architecture."""
    if trust_remote_code and "AutoModelForSequenceClassification" in (getattr(config, "auto_map", None) or {}):
        return True
    # By the config's class, as `from_config` and `from_pretrained` look it up: a custom-code config that subclasses a
    # known one (LlamaConfig) has its own backbone, under its own model type or the known one's (by model type, the
    # latter raised "Unrecognized configuration class").
    return type(config) in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING


def sequence_classifier_class(backbone_class: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """``<Arch>ForSequenceClassification`` for an architecture transformers has none for: transformers'
    ``GenericForSequenceClassification`` (what its own Llama, Qwen, ... classes are: the backbone under the
    architecture's ``base_model_prefix`` and a linear ``score``) over ``backbone_class`` (``LlamaModel``-like), so its
    weights are laid out as a future transformers class would lay them out."""
    pretrained = next(c for c in backbone_class.__mro__[1:] if issubclass(c, PreTrainedModel))

    def __init__(self, config):
        pretrained.__init__(self, config)
        self.num_labels = config.num_labels
        setattr(self, self.base_model_prefix, backbone_class(config))
        self.score = nn.Linear(config.get_text_config().hidden_size, self.num_labels, bias=False)
        self.post_init()

    name = backbone_class.__name__.removesuffix("Model") + "ForSequenceClassification"
    attributes = {"__init__": __init__, "__module__": __name__, "base_model_prefix": pretrained.base_model_prefix}
    return type(name, (GenericForSequenceClassification, pretrained), attributes)


def critic_from_policy(policy: PreTrainedModel, trust_remote_code: bool = False) -> PreTrainedModel:
    """A one-label sequence-classification model whose backbone is a copy of the policy's backbone."""
    config = policy.config.__class__.from_dict(policy.config.to_dict())
    config.num_labels = 1
    config.problem_type = "regression"
    # `to_dict` leaves out the attention kernel the policy was loaded with (eager for Gemma-2's softcap, flash): the
    # critic's backbone runs the policy's.
    attention = {"attn_implementation": policy.config._attn_implementation}
    # Built where the policy is: its random initialisation, soon overwritten but for the head, took 18.7 s of a 0.5B
    # trainer's start on a GPU machine's CPU.
    with torch.device(next(policy.parameters()).device):
        if has_sequence_classifier(config, trust_remote_code):
            critic = AutoModelForSequenceClassification.from_config(
                config, dtype=policy.dtype, trust_remote_code=trust_remote_code, **attention
            )
        else:
            critic_class = sequence_classifier_class(type(policy.base_model))
            critic = critic_class._from_config(config, dtype=policy.dtype, **attention)
    missing, unexpected = critic.base_model.load_state_dict(policy.base_model.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"Could not initialise the critic from the policy's backbone ({type(policy).__name__}): missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}. Pass a `value_model` explicitly."
        )
    # The head of a freshly built classifier is random (std = initializer_range): small values, non-zero gradients.
    return critic


def check_quantization(model_init_kwargs: dict | None, peft_config, model=None) -> None:
    """Fail before loading anything when a quantized model is asked for where it cannot train (a saved adapter,
    `model`, trains its own on the quantized base: QLoRA on)."""
    asked = (model_init_kwargs or {}).get("quantization_config")
    if not asks_quantized(asked) or not isinstance(model, (str, os.PathLike)):
        return  # (a model passed loaded ignores model_init_kwargs, with a warning: its quantization is its own)
    if peft_config is None and not is_saved_adapter(model, model_init_kwargs):
        raise ValueError(
            "model_init_kwargs asks for a quantized model, and quantized weights cannot be trained: pass a "
            "peft_config (e.g. LoraConfig(r=16), or --use_peft on the command line) to train adapters on it (QLoRA)."
        )
    if not asks_bitsandbytes(asked):
        return  # (GPTQ, AWQ, torchao, FP8, ...: transformers names the package each needs as it loads)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ImportError(
            "4-bit / 8-bit loading (load_in_4bit, QLoRA) needs bitsandbytes: `pip install bitsandbytes` (it runs on "
            "NVIDIA GPUs and on CPUs), or drop the quantization to train LoRA on a bf16 base."
        ) from None


def is_saved_adapter(model, model_init_kwargs: dict | None) -> bool:
    """Whether `model` names a saved PEFT adapter (an `adapter_config.json`, local or on the Hub), looked up with the
    loading options that say where (`cache_dir`, `local_files_only`, `revision`, `subfolder`, ...), as transformers'
    `from_pretrained` looks for one."""
    if not isinstance(model, (str, os.PathLike)):
        return False
    where = inspect.signature(find_adapter_config_file).parameters
    options = {key: value for key, value in (model_init_kwargs or {}).items() if key in where and key != "model_id"}
    return find_adapter_config_file(str(model), **options) is not None


def policy_tokenizer(model, model_id: str, args, model_init_kwargs: dict | None = None):
    """The tokenizer of the policy `load_policy` loaded from `model`, when none is given: looked up where the policy
    was, with the same options (`cache_dir`, `revision`, `token`, `subfolder`, ...: without them, the tokenizer of
    another cache or branch, or none); for an adapter's folder saved without one, its base model's
    (`adapter_base_of`)."""
    if not isinstance(model, (str, os.PathLike)):  # a model given loaded: its config names where it came from
        return AutoTokenizer.from_pretrained(model_id, trust_remote_code=args.trust_remote_code)
    where = lookup_kwargs(from_pretrained_kwargs(args, model_init_kwargs))
    base = adapter_base_of(model_id, where)
    if base is not None:  # another repository: the adapter's revision and subfolder are not its (its own revision is)
        base_where = {key: value for key, value in where.items() if key not in ("revision", "subfolder")}
        return AutoTokenizer.from_pretrained(base[0], **base_where, revision=base[1])
    return AutoTokenizer.from_pretrained(model_id, **where)


def adapter_base_of(model: str, where: dict | None = None) -> tuple[str, str | None] | None:
    """For a PEFT adapter saved without a tokenizer (peft's `save_pretrained` and `push_to_hub` write none), in a
    local folder or on the Hub, its base model and revision, where the tokenizer is; None for any other model. A
    ValueError for an adapter that names no base. `where`: the options the model is loaded with (`LOOKUP_KWARGS`):
    the adapter of that `revision` and `subfolder` (another branch's may name another base, or be none)."""
    where = {key: value for key, value in (where or {}).items() if key in LOOKUP_KWARGS and value is not None}
    if Path(model).expanduser().is_dir():
        folder = Path(model).expanduser() / where.get("subfolder", "")
        adapter = folder / "adapter_config.json"
        if not adapter.is_file() or (folder / "tokenizer_config.json").is_file():
            return None
    else:  # a Hub id (the adapter's repository held no tokenizer: an OSError where its base's was at hand)
        adapter = hub_file(model, "adapter_config.json", where)
        if adapter is None or hub_file(model, "tokenizer_config.json", where) is not None:
            return None
    config = json.loads(adapter.read_text())
    if not config.get("base_model_name_or_path"):
        raise ValueError(f"{model} is a PEFT adapter with neither a tokenizer nor a base_model_name_or_path")
    return config["base_model_name_or_path"], config.get("revision")


def hub_file(repo_id: str, filename: str, where: dict | None = None) -> Path | None:
    """`filename` of the Hub model `repo_id` (downloaded, or from the cache offline), or None where there is none:
    not a repository id, no such file, a Hub out of reach (loading the model then says why). `where`: `revision`,
    `subfolder`, `cache_dir`, `token`, ... as `from_pretrained` takes them."""
    import huggingface_hub

    takes = inspect.signature(huggingface_hub.hf_hub_download).parameters  # (not `proxies`, which 1.x dropped)
    options = {key: value for key, value in (where or {}).items() if key in takes and key != "filename"}
    try:
        return Path(huggingface_hub.hf_hub_download(repo_id, filename, **options))
    except Exception:  # (HFValidationError, EntryNotFoundError, LocalEntryNotFoundError, a connection's: the same)
        return None


def load_policy(model, args, model_init_kwargs: dict | None = None) -> tuple[nn.Module, str]:
    """The policy (a causal LM) and its name: loaded from an id or path (with `model_init_kwargs`, default
    `args.model_init_kwargs`), or the instance given; on one device (`check_on_one_device`)."""
    policy, model_id = _loaded_policy(model, args, model_init_kwargs)
    check_on_one_device(policy)
    return policy, model_id


def check_on_one_device(model: nn.Module, what: str = "policy") -> None:
    """A model (the policy, or a critic given as a model) that `device_map` spread over several devices, or offloaded
    in part (to the CPU or the disk), is refused: the trainer moves each model whole onto its process's device, the
    critic beside the policy (a crash later: inputs sent to devices the weights had left, offloaded weights read as
    meta tensors)."""
    placed = getattr(model, "hf_device_map", None) or {}
    devices = sorted({str(device) for device in placed.values()})
    if len(devices) > 1 or set(devices) & {"disk", "meta"}:
        raise ValueError(
            f"The {what} was loaded with a device_map that places it on {', '.join(devices)}: VAPOTrainer trains the "
            "whole model on each process's device, the critic beside the policy. Load it without device_map "
            "(model_init_kwargs device_map=None); for a model too large for one device, shard it with DeepSpeed "
            "ZeRO-3 or FSDP2 (`accelerate launch`), or train LoRA adapters on a 4-bit base (QLoRA)."
        )


def _loaded_policy(model, args, model_init_kwargs: dict | None) -> tuple[nn.Module, str]:
    if isinstance(model, (str, os.PathLike)):
        # A local folder by its absolute path: a saved adapter names its base by this path (a relative one loads
        # from the run's working directory alone), and so do the model card and the value-pretraining record.
        local = Path(model).expanduser()
        model_id = str(local.resolve()) if local.is_dir() else str(model)
        kwargs = from_pretrained_kwargs(args, model_init_kwargs)
        launched = getattr(getattr(args, "distributed_state", None), "distributed_type", None)
        if launched not in (None, "NO"):  # (GPUs and other accelerators alike: MULTI_XPU, MULTI_NPU, MULTI_HPU, ...)
            # Each process's copy on its own device, as GRPOTrainer does for CUDA: "auto" spread it (refused),
            # `{"": 0}` put every process's copy on the first device until it was moved.
            kwargs["device_map"] = None
        if is_saved_adapter(model_id, kwargs):
            # A PEFT adapter (a LoRA run's output): transformers loads it into its base frozen, as a plain model, and
            # a peft_config then re-initialised it: the run started from the base, the adapter's training lost. Its
            # adapter trains on, as a PeftModel given as `model` does.
            from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel

            if not kwargs.get("subfolder"):
                return load_pretrained(AutoPeftModelForCausalLM, model_id, {**kwargs, "is_trainable": True}), model_id
            # In a subfolder (a run's checkpoint in a repository): `AutoPeftModel` hands its options to the base's
            # `from_pretrained` too, and the base was looked for in the adapter's subfolder. The base as the
            # adapter's config names it (its own revision), the adapter from where it is.
            where = lookup_kwargs(kwargs)
            config = PeftConfig.from_pretrained(model_id, **where)
            base_kwargs = {key: value for key, value in kwargs.items() if key not in ("subfolder", "revision")}
            base_kwargs["revision"] = config.revision
            base = load_pretrained(AutoModelForCausalLM, config.base_model_name_or_path, base_kwargs)
            where.pop("trust_remote_code", None)  # (the base's loading option, not a file's place)
            return PeftModel.from_pretrained(base, model_id, is_trainable=True, **where), model_id
        policy = load_pretrained(AutoModelForCausalLM, model_id, kwargs)
        if kwargs.get("subfolder") and local.is_dir():
            # The base a new adapter's config names (peft reads `name_or_path`, which transformers leaves without
            # the subfolder): the saved adapter did not load back, its base looked for in the repository's root.
            policy.name_or_path = str(Path(model_id) / kwargs["subfolder"])
        return policy, model_id
    if isinstance(model, nn.Module) and hasattr(model, "config"):
        if any(hasattr(param, "ds_id") for param in model.parameters()):
            raise ValueError(
                "The model was created partitioned by DeepSpeed ZeRO-3 (it was loaded after a ZeRO-3 VAPOConfig "
                "existed), so the critic cannot copy its weights. Pass the model id or path as `model`, or load the "
                "model before creating the VAPOConfig."
            )
        if args.model_init_kwargs:
            logger.warning(
                "model_init_kwargs is ignored for the policy: it is already instantiated (the critic and reward "
                "models loaded from a path or id still load with it)."
            )
        return model, get_config_model_id(model.config)
    raise TypeError(f"model must be a model id, a path or a PreTrainedModel, got {type(model).__name__}.")


def is_fresh_lora(peft_config) -> bool:
    """Whether a new adapter of `peft_config` computes exactly as its base: a LoRA at peft's default initialisation
    (B zero; A random), without `layer_replication` (which changes the layer stack)."""
    from peft import LoraConfig

    return (
        isinstance(peft_config, LoraConfig)
        and peft_config.init_lora_weights is True
        and not getattr(peft_config, "layer_replication", None)
    )


def add_policy_adapter(policy: nn.Module, peft_config, revision: str | None = None) -> nn.Module:
    """The policy with a trainable adapter from `peft_config` (none: as it is). A quantized model needs one (QLoRA).
    `revision`: the base's, which the saved adapter names (else loading it takes the base's default branch)."""
    # What transformers' Trainer checks (`validate_quantization_for_training`), which never sees the policy: it is
    # handed the actor-critic module. Any quantization method (bitsandbytes, GPTQ, AWQ, torchao, FP8, ...).
    quantized = is_quantized(policy)
    quantizer = getattr(policy, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", "4-bit or 8-bit")
    method = getattr(method, "value", method)
    qat = getattr(quantizer, "is_qat_trainable", False)  # trains its own weights (transformers lets it)
    if quantized and peft_config is None and not is_peft_model(policy) and not qat:
        raise ValueError(
            f"The model is quantized ({method}), and quantized weights cannot be trained: pass a peft_config "
            "(e.g. LoraConfig(r=16)) to train adapters on the frozen quantized base (QLoRA)."
        )
    if quantized and quantizer is not None and not quantizer.is_trainable:
        raise ValueError(
            f"The model is quantized with {method}, which transformers cannot train adapters on: load it unquantized "
            "(bfloat16), or quantized with bitsandbytes (load_in_4bit) for QLoRA."
        )
    if is_peft_model(policy) and POLICY_ADAPTER not in policy.peft_config:
        raise ValueError(
            f"model is a PeftModel whose adapter is named {', '.join(map(repr, policy.peft_config))}; VAPOTrainer "
            f"trains the adapter named {POLICY_ADAPTER!r} (what `get_peft_model(base, config)` names it) and adds the "
            "critic's beside it: wrap the base without `adapter_name`, or pass the base model with peft_config."
        )
    if is_peft_model(policy) and policy.active_adapter != POLICY_ADAPTER:
        raise ValueError(
            f"model is a PeftModel whose active adapter is {policy.active_adapter!r}: VAPOTrainer trains, samples "
            f"and saves the adapter named {POLICY_ADAPTER!r} (with a separate critic, {policy.active_adapter!r} "
            f"would have sampled and trained, and {POLICY_ADAPTER!r} been saved untrained). Call "
            f"model.set_adapter({POLICY_ADAPTER!r}) first, or pass a PeftModel of the adapter to train alone."
        )
    if is_peft_model(policy):
        if peft_config is not None:  # GRPOTrainer's error: the adapter to train would be ambiguous
            raise ValueError(
                "model is a PeftModel (or a saved adapter's folder, which loads as one) and peft_config is given too: "
                "train the model's own adapter (leave peft_config out; --use_peft false), or merge and unload it, "
                "save that base model, and pass the base with the new peft_config."
            )
        # `PeftModel.from_pretrained` loads an adapter frozen (is_trainable=False): the policy would train nothing.
        set_adapters_trainable(policy, POLICY_ADAPTER, True)
        return policy
    if peft_config is None:
        return policy
    from peft import get_peft_model

    # No `prepare_model_for_kbit_training` for a quantized base (GRPOTrainer calls none either): it would cast every
    # frozen weight that is not 4-bit (embeddings, LM head, norms) to float32, and with them the activations and the
    # KV cache, twice bf16's memory. The norms compute in float32 inside anyway, the adapters and the value head train
    # in float32 under autocast, and the trainer switches checkpointing on, adapter-aware.
    return get_peft_model(policy, peft_config, revision=revision)


def _critic_adapter_config(policy) -> Any:
    """The policy adapter's config for the critic's (`second_adapter_config`: initialised without touching the
    base), without the LM head in `modules_to_save` or in a list of `target_modules`: the critic reads the
    backbone's hidden states into its value head and never the LM head, whose trainable copy (a vocabulary x hidden
    float32 matrix, 2.2 GB at 7B) or LoRA (and their Adam state) would never train."""
    config = second_adapter_config(policy.peft_config[POLICY_ADAPTER])
    head = policy.get_output_embeddings()
    head_name = next((name.rsplit(".", 1)[-1] for name, module in policy.named_modules() if module is head), None)
    if config.modules_to_save and head_name in config.modules_to_save:
        config.modules_to_save = [name for name in config.modules_to_save if name != head_name] or None
    targets = config.target_modules
    if isinstance(targets, (list, set, tuple)) and head_name in targets and len(targets) > 1:  # (a regex: as given)
        config.target_modules = type(targets)(name for name in targets if name != head_name)
    return config


def head_input_width(policy: nn.Module) -> int:
    """The width of the hidden states the policy's LM head reads, which the shared-base value head reads too: the
    output embeddings' input width where they have one (OPT projects its last hidden states to
    `word_embed_proj_dim` first: a head of `hidden_size` failed at the critic's first forward), else the text
    config's `hidden_size`."""
    head = policy.get_output_embeddings()
    width = getattr(head, "in_features", None)
    return width if isinstance(width, int) else policy.config.get_text_config().hidden_size


def build_actor_critic(
    policy: nn.Module,
    value_model,
    args,
    fingerprint: str,
    value_targets: dict[str, Any] | None = None,
    adapter_given: bool = False,
    policys_checkpoint: bool = False,
) -> tuple[ActorCritic, bool]:
    """The actor-critic module, and whether its critic comes from a previous value pretraining of this policy, under
    the same `value_targets` (`modeling.value_target_settings`: the rewards, the sampling, the discount).

    ``value_model`` None: a critic initialised from the policy (a second adapter on its base under PEFT). A path or
    id: a saved critic (an adapter with a value head, or a one-label sequence classifier). A model: used as is. A
    :class:`ValueFunction`: frozen values instead of a critic. `adapter_given`: the policy came with its adapter (an
    SFT run's), which the critic's starts as a copy of. `policys_checkpoint`: `value_model` names the id or path the
    policy was loaded from (read at the policy's revision and subfolder).
    """
    shared = is_peft_model(policy)
    if is_value_function(value_model):
        return ActorCritic(policy, value_function=value_model), False
    if value_model is None:
        if shared:
            check_only_adapters_train(policy)  # (before peft's own refusal of a second adapter with a bias)
            policy.add_adapter(CRITIC_ADAPTER, _critic_adapter_config(policy))
            if adapter_given or rewrites_base(policy.peft_config[POLICY_ADAPTER]):
                # The critic starts from the policy's function, as a full fine-tuning's critic copies the policy's
                # weights: with the policy adapter's weights where they are the policy (a trained adapter given: from
                # the base's alone, it read features the policy had moved on from) or the base is a residual
                # (PiSSA, OLoRA, ...); a new LoRA's B is zero, and the critic's on the untouched base computes alike.
                copy_adapter_weights(policy, POLICY_ADAPTER, CRITIC_ADAPTER)
            set_adapters_trainable(policy, [POLICY_ADAPTER, CRITIC_ADAPTER], True)
            text_config = policy.config.get_text_config()  # a multimodal config keeps its sizes there
            head = ValueHead(head_input_width(policy), getattr(text_config, "initializer_range", 0.02))
            return ActorCritic(policy, value_head=head.to(policy.device)), False
        return ActorCritic(policy, critic=critic_from_policy(policy, args.trust_remote_code)), False

    if not isinstance(value_model, (str, os.PathLike)):
        check_value_model(value_model)
        check_on_one_device(value_model, "value_model")
        return ActorCritic(policy, critic=value_model), False
    kwargs = critic_loading_kwargs(args, same_checkpoint=policys_checkpoint)
    path = Path(value_model).expanduser() / (kwargs.get("subfolder") or "")  # (`check_value_model_path` checked it)
    pretrained = _pretrained_for_this_policy(path, fingerprint, args.value_pretrain_steps, value_targets)
    if (path / "adapter_config.json").is_file() and (path / VALUE_HEAD_FILE).is_file():
        if not shared:
            raise ValueError(
                f"value_model {path} is a critic adapter, which needs the policy's base: pass the same peft_config "
                "you trained it with."
            )
        check_only_adapters_train(policy)
        policy.load_adapter(str(path), adapter_name=CRITIC_ADAPTER, is_trainable=True)
        set_adapters_trainable(policy, [POLICY_ADAPTER, CRITIC_ADAPTER], True)
        actor_critic = ActorCritic(policy, value_head=ValueHead(head_input_width(policy)).to(policy.device))
        actor_critic.value_head.load_state_dict(load_file(path / VALUE_HEAD_FILE))
        return actor_critic, pretrained
    config = AutoConfig.from_pretrained(str(value_model), **lookup_kwargs(kwargs))
    is_classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    extra = {} if is_classifier else {"num_labels": 1}
    if has_sequence_classifier(config, kwargs["trust_remote_code"]):
        critic_class = AutoModelForSequenceClassification
    else:  # the class `critic_from_policy` built, over this config's backbone class
        critic_class = sequence_classifier_class(_backbone_class(config, kwargs["trust_remote_code"]))
    critic = load_pretrained(critic_class, str(value_model), {**kwargs, **extra})
    check_value_model(critic)
    actor_critic = ActorCritic(policy, critic=critic)  # the dtypes as loaded: what `save_model` writes back
    if value_pretraining_record(path) is not None and keep_trainable_weights_in_float32(critic)[0]:
        # Value pretraining saved it in float32, its training weights: loaded in the policy's half precision, its
        # updates (1e-4 or less on weights of 0.02, at the paper's critic rate) rounded back to where it started.
        actor_critic.load_critic(path)
    return actor_critic, pretrained


CHECKPOINT_ONLY_KWARGS = ("quantization_config", "revision", "subfolder", "variant", "gguf_file", "device_map")
"""The policy's loading options that belong to its checkpoint alone, not to a critic loaded from another: a critic
trains all of its weights (never quantized); `model_revision`, `subfolder`, `variant` and `gguf_file` name files of
the policy's repository (a critic looked up in `<value_model>/<subfolder>` failed); a `device_map` was written for the
policy's modules, and the trainer places the critic beside the policy."""


def critic_loading_kwargs(args, same_checkpoint: bool = False) -> dict[str, Any]:
    """`from_pretrained` keyword arguments for a critic loaded from a path or id: the policy's
    (:func:`from_pretrained_kwargs`: its dtype, `trust_remote_code`, and where files are looked up: `cache_dir`,
    `local_files_only`, `token`, ...) but `CHECKPOINT_ONLY_KWARGS`; for the policy's own checkpoint
    (`same_checkpoint`: `value_model` names the id or path the policy was loaded from), its files' options too (its
    `revision`, `subfolder`, `variant`: without them, the default branch's weights or none)."""
    own = ("revision", "subfolder", "variant", "gguf_file") if same_checkpoint else ()
    dropped = [k for k in CHECKPOINT_ONLY_KWARGS if k not in own]
    return {k: v for k, v in from_pretrained_kwargs(args).items() if k not in dropped}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "tekken.json")


CRITIC_TOKENIZER_FIX = (
    "the critic reads the policy's token ids, so it needs the policy's tokenizer (a critic or reward model of the "
    "policy's family; without value_model the critic starts from the policy)"
)


def check_critic_vocabulary(critic: nn.Module, tokenizer) -> None:
    """Refuse a critic whose embeddings have fewer rows than the policy's tokenizer has tokens: it reads the policy's
    token ids (the paper starts it from a reward model, which may be another family's), and an id past its rows is an
    index error mid-rollout, or a device-side assert on a GPU. (`check_critic_tokenizer` compares the vocabularies
    themselves, where the critic's tokenizer is saved with it.)"""
    try:
        rows = critic.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):  # custom code without the accessor: nothing to check against
        return
    if rows < len(tokenizer):
        name = critic.config.name_or_path or type(critic).__name__
        raise ValueError(
            f"value_model {name} embeds {rows:,} tokens, and the policy's tokenizer has {len(tokenizer):,}: "
            f"{CRITIC_TOKENIZER_FIX}."
        )


def check_critic_tokenizer(value_model, tokenizer, args, policys_checkpoint: bool = False) -> None:
    """Before its weights load: refuse a `value_model` (a path or model id, or a model loaded from one) saved with a
    tokenizer that gives any of the policy's tokens another id (a reward model of another family, as many tokens or
    more: its values would be read from other tokens' embeddings, silently). Tokens the policy's tokenizer added (a
    chat template's) that the critic's lacks or numbers otherwise are warned: the critic has not learned them. The
    policy's own checkpoint (`policys_checkpoint`) is not compared: it is read where the policy's tokenizer was
    (another branch's or folder's tokenizer was compared)."""
    if policys_checkpoint:
        return
    if isinstance(value_model, nn.Module):  # (a reward model of another family the user loaded): where it came from
        value_model = getattr(value_model, "name_or_path", None) or None  # (None: built from a config)
    critic_tokenizer = _saved_tokenizer(value_model, args)
    if critic_tokenizer is None:
        return
    theirs, added = critic_tokenizer.get_vocab(), tokenizer.get_added_vocab()
    differ = [(token, i) for token, i in tokenizer.get_vocab().items() if theirs.get(token) != i]
    renumbered = sorted((i, token) for token, i in differ if token not in added)
    if renumbered:
        examples = ", ".join(f"{token!r} (policy {i}, critic {theirs.get(token)})" for i, token in renumbered[:3])
        raise ValueError(
            f"value_model {value_model}'s tokenizer numbers {len(renumbered):,} of the policy's {len(tokenizer):,} "
            f"tokens otherwise, e.g. {examples}: {CRITIC_TOKENIZER_FIX}."
        )
    if differ:
        logger.warning(
            f"value_model {value_model}'s tokenizer lacks or numbers otherwise {len(differ)} token(s) the policy's "
            f"tokenizer added ({', '.join(repr(token) for token, _ in differ[:5])}): the critic reads them from "
            "embeddings it never learned."
        )


def _saved_tokenizer(value_model, args):
    """The tokenizer saved with `value_model` (a path or model id), looked up with the run's loading options; None
    where there is none to compare with (not a path or id, a critic folder saved without one)."""
    from transformers import AutoTokenizer

    if not isinstance(value_model, (str, os.PathLike)):
        return None
    path = Path(value_model).expanduser()
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    kwargs = critic_loading_kwargs(args)
    try:
        return AutoTokenizer.from_pretrained(str(path if path.exists() else value_model), **lookup_kwargs(kwargs))
    except Exception as error:  # noqa: BLE001 - none in the repository, a backend not installed: nothing to compare
        logger.warning(f"value_model {value_model}: no tokenizer to compare the policy's with ({error}).")
        return None


def _backbone_class(config, trust_remote_code: bool) -> type[PreTrainedModel]:
    """The backbone (``base_model``) class of ``config``'s causal LM: AutoModel's, or, for custom code that maps
    only ``AutoModelForCausalLM``, the causal LM's own backbone (both built on the meta device: no weights)."""
    with torch.device("meta"):
        try:
            return type(AutoModel.from_config(config, trust_remote_code=trust_remote_code))
        except ValueError:
            return type(AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code).base_model)


def _pretrained_for_this_policy(
    path: Path, fingerprint: str, value_pretrain_steps: int, value_targets: dict[str, Any] | None = None
) -> bool:
    """Whether the critic at `path` was value-pretrained against this run's initial policy, for the same returns.

    A critic pretrained against another policy, or under other rewards, sampling or discount (`value_targets`),
    predicts other returns: starting RL from it would skip the phase VAPO needs. It is then used as an initialisation
    and value pretraining runs again.
    """
    record = value_pretraining_record(path)
    if record is None:
        return False
    if "policy_fingerprint" not in record:  # written by trl-vapo 0.1, which did not record it
        logger.warning(f"{path} does not record which policy it was pretrained against; trusting that it is this one.")
        return True
    if record["policy_fingerprint"] == fingerprint:
        saved, current = record.get("value_targets") or {}, value_targets or {}  # older records: not kept
        changed = sorted(key for key in saved.keys() & current.keys() if saved[key] != current[key])
        rollouts, budget = record.get("rollouts"), record.get("budget")
        shorter_budget = not isinstance(budget, int) or budget < value_pretrain_steps  # (not its stop rule's end)
        if not changed and isinstance(rollouts, int) and rollouts < value_pretrain_steps and shorter_budget:
            # A smoke test's critic reused by the real run would skip its whole budget unsaid.
            logger.warning(
                f"value_model {path} was value-pretrained against this policy for these returns, for {rollouts} "
                f"rollout(s), fewer than this run's value_pretrain_steps={value_pretrain_steps} (a shorter run's, or "
                "an early stop by value_pretrain_patience): this run skips value pretraining and starts RL from it. "
                "To pretrain for the whole budget, leave value_model unset."
            )
        if not changed:
            return True
        logger.warning(
            f"value_model {path} was value-pretrained for other returns than this run's: "
            + ", ".join(f"{key} {saved[key]!r} there, {current[key]!r} here" for key in changed)
            + f". It starts from those weights{_pretrains_again(value_pretrain_steps)}."
        )
        return False
    logger.warning(
        f"value_model {path} was value-pretrained against the policy {record.get('policy')!r}, whose weights differ "
        f"from this run's policy: it starts from those weights{_pretrains_again(value_pretrain_steps)}."
    )
    return False


def _pretrains_again(value_pretrain_steps: int) -> str:
    if value_pretrain_steps > 0:
        return f" and value pretraining runs again (value_pretrain_steps={value_pretrain_steps})"
    return ", with no value pretraining for this run's returns (value_pretrain_steps=0)"


def names_the_policys_checkpoint(value_model: Any, model: Any) -> bool:
    """Whether `value_model` names the id or path the policy `model` was loaded from (then read where the policy was:
    its revision, subfolder, variant)."""
    by_name = isinstance(model, (str, os.PathLike)) and isinstance(value_model, (str, os.PathLike))
    return by_name and str(value_model) == str(model)


def check_value_model_path(value_model: Any, args: VAPOConfig, same_checkpoint: bool) -> None:
    """Refuse, before anything loads, a `value_model` path that names no value model (it was refused once the policy
    had loaded: minutes for a large one): a trl-vapo run's output folder (its root holds the policy), a folder with
    neither a transformers model nor a trl-vapo critic adapter, a local path that does not exist. `same_checkpoint`:
    it names the policy's own checkpoint, read at the policy's subfolder (`critic_loading_kwargs`)."""
    if not isinstance(value_model, (str, os.PathLike)):
        return
    subfolder = critic_loading_kwargs(args, same_checkpoint=same_checkpoint).get("subfolder") or ""
    path = Path(value_model).expanduser() / subfolder
    critic_adapter = (path / "adapter_config.json").is_file() and (path / VALUE_HEAD_FILE).is_file()
    if (path / CRITIC_SUBFOLDER).is_dir() and not (path / VALUE_HEAD_FILE).is_file():
        # Its root is the trained policy: a full model's loaded as a critic with a new head, the trained critic unread.
        raise ValueError(
            f"value_model {path} is a trl-vapo run's output (or checkpoint) folder, whose root holds the policy: its "
            f"critic is {path / CRITIC_SUBFOLDER}; pass that folder."
        )
    if path.is_dir() and not critic_adapter and not (path / "config.json").is_file():
        raise ValueError(
            f"value_model {path} is not a value model: it has neither a transformers config.json nor a trl-vapo "
            f"critic adapter (adapter_config.json + {VALUE_HEAD_FILE}). Files there: "
            f"{sorted(p.name for p in path.iterdir())[:10]}."
        )
    if not path.exists() and _looks_like_a_path(str(value_model)):
        raise FileNotFoundError(f"value_model path {value_model} does not exist.")


def resolve_value_model(value_model: Any, args: VAPOConfig, same_checkpoint: bool) -> Any:
    """`value_model` as the local folder that the checks and the loading read, where it names a trl-vapo critic on
    the Hub: `owner/name/<folder>` (a pushed run's `critic/` or `value_pretrained_critic/`), or `owner/name` whose
    root is a critic adapter or holds a value-pretraining record. Downloaded to the Hugging Face cache (offline: read
    from it), with the run's loading options (`cache_dir`, `token`, `local_files_only`), from the repository's default
    branch. Those checks read files: from an id, a critic adapter failed to load (no config.json at the root) and a
    pretrained critic's record was unread, so value pretraining ran again, unsaid. A pushed run's repository (or one
    of its checkpoints) named where its critic is meant is refused before anything downloads. Anything else is
    returned as given: a model, a local path, the policy's own checkpoint (`same_checkpoint`), a model id whose root
    is a model (`from_pretrained` reads it)."""
    split = hub_repository_folder(value_model)
    if split is None:  # a model, a local path (`check_value_model_path` says where it does not exist)
        return value_model
    name, (repo_id, folder) = str(value_model), split
    where = critic_loading_kwargs(args, same_checkpoint=same_checkpoint)
    inside = f"{folder}/" if folder else ""
    run_markers = [f"{inside}{CRITIC_SUBFOLDER}/{VALUE_HEAD_FILE}", f"{inside}{CRITIC_SUBFOLDER}/config.json"]
    if any(hub_file(repo_id, marker, where) is not None for marker in run_markers):
        # Its root (or the checkpoint's) is the trained policy: loaded as a critic with a new head, the critic unread.
        raise ValueError(
            f"value_model {name} is a trl-vapo run's repository (or checkpoint) folder, whose root holds the policy: "
            f"its critic is {name}/{CRITIC_SUBFOLDER}; pass that."
        )
    if same_checkpoint:  # read where the policy is, by `from_pretrained`
        return value_model
    if folder:  # a model folder in the repository
        markers = [f"{folder}/config.json", f"{folder}/adapter_config.json"]
    else:  # at its root, a critic adapter or a value-pretrained critic
        markers = [VALUE_PRETRAINING_FILE, VALUE_HEAD_FILE]
    if not any(hub_file(repo_id, marker, where) is not None for marker in markers):
        if folder:
            raise ValueError(
                f"value_model {name} is neither a local folder nor a model folder of the Hub repository {repo_id}: "
                f"no {folder}/config.json nor {folder}/adapter_config.json there, or the Hub is out of reach, or the "
                "repository is private or gated (`hf auth login`, or model_init_kwargs' token)."
            )
        return value_model  # a model at the repository's root: `from_pretrained` reads it
    import huggingface_hub

    takes = inspect.signature(huggingface_hub.snapshot_download).parameters
    options = {key: value for key, value in where.items() if key in takes}
    patterns = [f"{folder}/*"] if folder else None
    snapshot = huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns, **options)
    return Path(snapshot) / folder


_HUB_FOLDER_RE = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<folder>[\w.-]+(?:/[\w.-]+)*))?")


def hub_repository_folder(value_model: Any) -> tuple[str, str] | None:
    """A `value_model` string of the form `owner/name[/folder]` that names no local file, as the Hub repository's id
    and the folder in it ("" for its root); None for anything else: a local path (`./x`, `/x`, `~/x`, `C:/x`, one
    whose first part is a local folder: a mistyped path), a `Path`, an id without an owner, a model."""
    if not isinstance(value_model, str) or Path(value_model.split("/")[0]).expanduser().exists():
        return None
    match = _HUB_FOLDER_RE.fullmatch(value_model)
    return None if match is None else (match["repo"], match["folder"] or "")


def _looks_like_a_path(name: str) -> bool:
    """A hub id is `name` or `org/name`; anything else (`./x`, `/x`, `a/b/c`) was meant as a local path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


# ---------------------------------------------------------------------------------------------------------------------
# The trainer's arguments, checked before anything loads
# ---------------------------------------------------------------------------------------------------------------------


def policy_init_kwargs(model, model_init_kwargs: dict | None, quantization_config) -> dict | None:
    """`args.model_init_kwargs` with the trainer's `quantization_config` in it, as GRPOTrainer takes both (a copy:
    the config is left as it is)."""
    if quantization_config is None:
        return model_init_kwargs
    if not isinstance(model, (str, os.PathLike)):
        logger.warning("quantization_config is ignored: the model is already instantiated (as in GRPOTrainer).")
        return model_init_kwargs
    if "quantization_config" in (model_init_kwargs or {}):
        raise ValueError(
            "quantization_config is set both as a trainer argument and in args.model_init_kwargs: set it in one "
            "place (as in GRPOTrainer)."
        )
    return {**(model_init_kwargs or {}), "quantization_config": quantization_config}


def router_aux_loss_coefficient(policy: nn.Module, args: VAPOConfig) -> float:
    """The weight of a Mixture-of-Experts policy's load-balancing loss, as GRPOTrainer sets it: `router_aux_loss_coef`,
    or the model config's own when None (0 where it declares none); 0 for a dense model, which has no such loss."""
    config = policy.config.get_text_config()
    coef = args.router_aux_loss_coef
    if coef and not hasattr(config, "output_router_logits"):
        raise ValueError(
            f"router_aux_loss_coef={coef} is set but {type(policy).__name__} is not a Mixture-of-Experts model that "
            "returns its router logits, so there is no load-balancing loss to weight: leave it unset."
        )
    if not hasattr(config, "output_router_logits"):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else float(coef)


def check_value_function_settings(value_model: Any, args: VAPOConfig) -> None:
    """A frozen value function (`value_model=fn`) trains nothing: refuse critic-only passes, which would only train a
    critic. (Value pretraining is skipped: `VAPOTrainer._skips_value_pretraining`.)"""
    if is_value_function(value_model) and args.critic_num_iterations > args.num_iterations:
        raise ValueError(
            f"critic_num_iterations={args.critic_num_iterations} asks for critic-only passes over each rollout, but "
            f"value_model is a frozen value function ({value_function_name(value_model)}): there is no critic to "
            f"train. Set critic_num_iterations={args.num_iterations} (= num_iterations) or leave it unset."
        )


def check_trainer_arguments(
    model, args: VAPOConfig, peft_config, value_model: Any, model_init_kwargs: dict | None = None
) -> None:
    """What the trainer's arguments ask for that cannot run, refused before anything loads: a `value_model` path that
    names no value model (`check_value_model_path`), critic-only passes with a frozen value function, a synced
    reference model under PEFT (GRPOTrainer's error), Liger's kernels without liger-kernel."""
    check_value_function_settings(value_model, args)
    check_value_model_path(value_model, args, same_checkpoint=names_the_policys_checkpoint(value_model, model))
    if peft_config is not None:
        from peft import PeftConfig

        if not isinstance(peft_config, PeftConfig):  # (a dict failed later, reading one of its fields)
            raise TypeError(
                f"peft_config must be a peft.PeftConfig, such as LoraConfig(r=16, lora_alpha=32), got "
                f"{type(peft_config).__name__}: build one from a dict with LoraConfig(**settings)."
            )
    init = getattr(peft_config, "init_lora_weights", None)
    if isinstance(init, str) and init.lower().startswith("pissa_niter"):
        raise ValueError(
            f"peft_config has init_lora_weights={init!r}: its fast SVD is drawn at random, and peft draws it again "
            "when the saved adapter loads (and when a resume rebuilds the adapter), so the trained adapter would sit "
            "on another residual base than the one it trained on. Use init_lora_weights='pissa' (the exact SVD, the "
            "same at every load), 'olora', or True."
        )
    task_type = getattr(peft_config, "task_type", None)
    task_type = getattr(task_type, "value", task_type)  # peft's TaskType, a str enum, or a string
    if task_type not in (None, "CAUSAL_LM"):
        raise ValueError(
            f"peft_config has task_type={task_type!r}: the policy is a causal language model, and an adapter of "
            f"that task wraps it in PEFT's model for {task_type} (its own head and forward), whose saved adapter "
            "AutoPeftModelForCausalLM and `trl-vapo eval` refuse to load. Use task_type='CAUSAL_LM' "
            "(`--lora_task_type CAUSAL_LM`), or leave it unset."
        )
    adapter = peft_config if peft_config is not None else getattr(model, "active_peft_config", None)
    if value_model is None and adapter is not None and (adapter.is_prompt_learning or adapter.is_adaption_prompt):
        raise ValueError(
            f"The policy's adapter is a prompt-learning one ({type(adapter).__name__}): the critic would be a second "
            "one on the same base, which the critic's forward (the base's own, without the adapter's virtual tokens "
            "or prompts) never applies, so the critic would train its value head alone. Use an adapter of the "
            "layers' weights (LoraConfig), or give the critic a model of its own (value_model=...)."
        )
    # (a saved adapter's path loads as a PeftModel: no reference model was built, nothing synced, without a word)
    peft = peft_config is not None or is_peft_model(model)
    if args.sync_ref_model and (peft or is_saved_adapter(model, model_init_kwargs)):
        raise NotImplementedError(  # GRPOTrainer's error
            "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. With "
            "PEFT, the reference policy is the base with the adapters disabled: there is no standalone reference "
            "model to synchronize. Use `sync_ref_model=False`, or full fine-tuning for a synced reference model."
        )
    if args.use_liger_kernel and not is_liger_kernel_available():
        raise ImportError(
            "use_liger_kernel=True needs liger-kernel, which is not installed: `pip install liger-kernel` (it "
            "needs a GPU with Triton), or leave use_liger_kernel off."
        )


def check_grpo_arguments(**given: Any) -> None:
    """Refuse, before any model loads, the `GRPOTrainer` arguments VAPO does not take, saying what to do instead."""
    instead = "write the episode as a `rollout_func`, whose `env_mask` marks the tokens the policy did not sample"
    refusals = {
        "tools": f"its tool-calling loop is not built in; {instead}",
        "environment_factory": f"its environment loop is not built in; {instead}",
    }
    for name, value in given.items():
        if value:  # GRPOTrainer's `tools or []`: an empty one (a list, a tuple) is none
            raise ValueError(f"VAPOTrainer does not take `{name}`: {refusals[name]}.")
