"""Sampling completions, one interface for training and evaluation, four engines picked by config names.

Every engine takes prompt token ids and returns a `GenerationOutput`: completion ids right-padded with the pad token,
their mask (up to and including the first stop token), whether each completion ran out of budget, and, where the
engine computes them, the sampler's log-probabilities of the sampled tokens. Completions are cut by one function,
`cut_at_stop`, at the same stop ids (`stop_token_ids`: the tokenizer's EOS plus the model's generation-config EOS
ids), whichever engine produced them.

| engine                 | chosen by (`GRPOConfig`'s names)       | runs on | sampler log-probs  | `sync_weights`    |
| ---------------------- | -------------------------------------- | ------- | ------------------ | ----------------- |
| `TransformersGenerate` | default                                | any     | if `logprobs=True` | no-op             |
| `ContinuousBatching`   | `use_transformers_continuous_batching` | any     | if `logprobs=True` | no-op             |
| `StaticCacheEngine`    | `use_static_cache_engine`              | any     | if `logprobs=True` | no-op             |
| `VLLMEngine`           | `use_vllm`, `vllm_mode`, `vllm_*`      | GPU     | always             | pushes the policy |

The transformers engines generate with the model a *model provider* yields: a zero-argument callable returning a
context manager (the trainer passes one that unwraps DDP / DeepSpeed / FSDP and enters autocast), or simply a model.
The vLLM engine is glue over TRL's own `trl.generation.vllm_generation.VLLMGeneration`: it generates with vLLM and
pushes the policy's weights to it (base merged with the policy adapter under PEFT, never the critic's adapter, head
or model: `trl_vapo.vllm_sync`). Every caller picks and builds its engine the same way: `EngineSettings` (from a
`VAPOConfig` or `trl-vapo eval`'s arguments), then `build_engine`. `trl_vapo.core.importance_sampling_weights` is
TRL's correction for the mismatch between vLLM's and the trainer's log-probs; `importance_sampling_metrics` here logs
it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from ._compat import is_vllm_available, pad, vllm_generation_class
from .modeling import asks_quantized, is_quantized
from .vllm_fields import VLLM_DEFAULTS, VLLM_OPTIONS
from .vllm_sync import check_policy_adapter_active, check_policy_only, check_tied_head_unadapted, policy_only

ModelProvider = Callable[[], contextlib.AbstractContextManager[nn.Module]]
"""A zero-argument callable returning a context manager that yields the causal LM to generate with."""


# ---------------------------------------------------------------------------------------------------------------------
# What every engine returns, and the one place completions are cut
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class GenerationOutput:
    """Completions of one `generate` call, one row per prompt, in the prompts' order (CPU tensors)."""

    completion_ids: torch.Tensor  # [N, C] long, right-padded with the pad token after the first stop token
    completion_mask: torch.Tensor  # [N, C] long, 1 up to and including the first stop token
    is_truncated: torch.Tensor  # [N] bool, ran out of `max_new_tokens` without a stop token
    sampler_logprobs: torch.Tensor | None = None  # [N, C] float, log-prob of each sampled token (0 at padding)
    # [N, C] long, 1 where the policy sampled the token; 0 where an environment wrote it (a `rollout_func`'s
    # `env_mask`). None: every completion token was sampled.
    action_mask: torch.Tensor | None = None

    @property
    def lengths(self) -> torch.Tensor:
        """[N] completion lengths in tokens, stop token included."""
        return self.completion_mask.sum(dim=1)

    def completion_lists(self) -> list[list[int]]:
        """The completions as lists of token ids, without padding (what reward functions get)."""
        rows = self.completion_ids.cpu().tolist()  # one copy from the device, not one a row
        return [row[:n] for row, n in zip(rows, self.lengths.tolist())]

    def padded(self, pad_to_multiple_of: int | None, pad_id: int) -> GenerationOutput:
        """The completions right-padded to a multiple of `pad_to_multiple_of` columns (None: as they are)."""
        if not pad_to_multiple_of:
            return self
        width = -(-self.completion_ids.shape[1] // pad_to_multiple_of) * pad_to_multiple_of
        return GenerationOutput(
            _pad_columns(self.completion_ids, width, pad_id),
            _pad_columns(self.completion_mask, width, 0),
            self.is_truncated,
            None if self.sampler_logprobs is None else _pad_columns(self.sampler_logprobs, width, 0.0),
            None if self.action_mask is None else _pad_columns(self.action_mask, width, 0),
        )

    def to(self, device: torch.device | str) -> GenerationOutput:
        return GenerationOutput(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
            }
        )


def cut_at_stop(
    token_ids: torch.Tensor,
    stop_ids: Sequence[int] | torch.Tensor,
    pad_id: int,
    valid: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    max_new_tokens: int | torch.Tensor | None = None,
) -> GenerationOutput:
    """Cut each row of `token_ids` [N, C] after its first token in `stop_ids`; pad the rest with `pad_id`.

    `valid` [N, C] marks the generated tokens when rows are right-padded lists of different lengths (a prefix of
    each row; default: all). A row without a stop token keeps all its valid tokens; it is truncated (it ran out of
    budget) when it has `max_new_tokens` of them (one for all, or [N] a row's own; default: whenever it has no stop
    token). `logprobs` [N, C], when given, is returned with zeros past the cut.
    """
    if valid is None:
        valid = torch.ones_like(token_ids, dtype=torch.bool)
    valid = valid.bool()
    stops = torch.as_tensor(list(stop_ids) if not torch.is_tensor(stop_ids) else stop_ids, dtype=token_ids.dtype)
    is_stop = torch.isin(token_ids, stops.to(token_ids.device)) & valid
    has_stop = is_stop.any(dim=1)
    end = torch.where(has_stop, is_stop.int().argmax(dim=1) + 1, valid.sum(dim=1))
    mask = torch.arange(token_ids.shape[1], device=token_ids.device)[None, :] < end[:, None]
    if logprobs is not None:
        logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))  # not a product: -inf * 0 is NaN
    budget = torch.as_tensor(max_new_tokens, device=end.device) if max_new_tokens is not None else None
    truncated = ~has_stop if budget is None else ~has_stop & (end >= budget)
    return GenerationOutput(
        completion_ids=torch.where(mask, token_ids, torch.full_like(token_ids, pad_id)),
        completion_mask=mask.long(),
        is_truncated=truncated,
        sampler_logprobs=logprobs,
    )


def _from_lists(
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]] | None,
    stop_ids,
    pad_id: int,
    max_new_tokens: int | torch.Tensor | None = None,
) -> GenerationOutput:
    """`cut_at_stop` over variable-length completions (continuous batching, vLLM)."""
    ids, valid = _padded_rows(completions, pad_id, torch.long)
    lp = None if logprobs is None else _padded_rows(logprobs, 0.0, torch.float32, ids.shape[1])[0]
    return cut_at_stop(ids, stop_ids, pad_id, valid=valid, logprobs=lp, max_new_tokens=max_new_tokens)


def _padded_rows(
    rows: Sequence[Sequence], value, dtype: torch.dtype, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged `rows` as one `[N, width]` tensor right-padded with `value` (width: the longest row's, at least one
    column, so that every tensor has a completion axis), and the mask of the rows' own entries."""
    width = width or max(1, *map(len, rows))
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(list(row), dtype=dtype)
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    return out, torch.arange(width)[None, :] < lengths[:, None]


def set_generation_ids(model: nn.Module, **ids: Any) -> None:
    """Set token ids (`pad_token_id`, `eos_token_id`) on `model`'s generation config, keeping a config as loaded
    savable: transformers validates a config changed since it was loaded strictly when saving, and refuses one whose
    published flags it only warns about unchanged (`temperature` or `top_p` without `do_sample=True`), so the first
    checkpoint of a run on such a model failed after its steps. The ids alone change nothing of that validation."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    as_loaded = getattr(config, "_original_object_hash", None) == hash(config)
    for name, value in ids.items():
        setattr(config, name, value)
    if as_loaded:
        config._original_object_hash = hash(config)


def stop_token_ids(tokenizer, model: nn.Module | None = None, generation_kwargs: dict | None = None) -> list[int]:
    """The ids a completion stops at: the tokenizer's EOS, the model generation config's EOS ids (e.g. Qwen's
    `<|im_end|>` and `<|endoftext|>`), and any `eos_token_id` / `stop_token_ids` in `generation_kwargs`.

    Training and evaluation both cut here, so a completion ends at the same token whichever code sampled it.
    """
    ids: list[Any] = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for extra in (configured, *((generation_kwargs or {}).get(k) for k in ("eos_token_id", "stop_token_ids"))):
        if extra is not None:
            ids += list(extra) if isinstance(extra, (list, tuple)) else [extra]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


# ---------------------------------------------------------------------------------------------------------------------
# Sampling settings
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class SamplingSettings:
    """How to sample: TRL's sampling fields (`temperature=0` decodes greedily)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.generation_kwargs.get("do_sample") is False

    @classmethod
    def from_config(cls, args) -> SamplingSettings:
        """The rollout settings of a `VAPOConfig`."""
        return cls(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            # GRPOConfig's `cache_implementation` is a GenerationConfig field, as TRL passes it.
            generation_kwargs={
                **({"cache_implementation": args.cache_implementation} if args.cache_implementation else {}),
                **(args.generation_kwargs or {}),
            },
        )

    def generation_config(self, stop_ids: Sequence[int], pad_id: int) -> GenerationConfig:
        """The `GenerationConfig` of the transformers engines; `generation_kwargs` override the other fields."""
        kwargs: dict[str, Any] = (
            {"do_sample": False}
            if self.greedy
            else {
                "do_sample": True,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
                "min_p": self.min_p,
            }
        )
        kwargs.update(
            max_new_tokens=self.max_new_tokens,
            repetition_penalty=self.repetition_penalty,
            pad_token_id=pad_id,
            eos_token_id=list(stop_ids),
            bos_token_id=None,
            use_cache=True,
            disable_compile=True,
            num_return_sequences=1,  # one completion a prompt row, whatever the model's generation_config says
        )
        # The stop ids already include any eos_token_id of generation_kwargs (see `stop_token_ids`). Greedy
        # (temperature 0) keeps do_sample off: generation_kwargs' do_sample=True sampled there, at the model's
        # temperature and top-k 50, where the static-cache engine and vLLM decoded greedily.
        named = {"eos_token_id", "stop_token_ids", *(("do_sample",) if self.greedy else ())}
        kwargs.update({k: v for k, v in self.generation_kwargs.items() if k not in named})
        return GenerationConfig(**kwargs)


EXACT_CACHES = (None, "static", "dynamic")
"""The `cache_implementation`s whose values the static-cache engine's own static cache reproduces (`generate()`'s
default is dynamic); another (quantized: other values; offloaded: less device memory) stays with `generate()`."""

# The settings of a GenerationConfig that make `generate()` sample from other than softmax(logits / temperature), each
# with when it does: the warpers (applied only when sampling), then the processors (greedy decoding too).
WARPER_SETTINGS = {
    "top_p": lambda v: v is not None and v < 1.0,
    "top_k": lambda v: v is not None and v > 0,
    "min_p": lambda v: v is not None and v > 0,
    "top_h": lambda v: v is not None and v > 0,
    "typical_p": lambda v: v is not None and v < 1.0,
    "epsilon_cutoff": lambda v: v is not None and v > 0,
    "eta_cutoff": lambda v: v is not None and v > 0,
}
PROCESSOR_SETTINGS = {
    "num_beams": lambda v: v is not None and v > 1,
    "repetition_penalty": lambda v: v is not None and v != 1.0,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
    "no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "min_length": lambda v: v is not None and v > 0,
    "min_new_tokens": lambda v: v is not None and v > 0,
    "bad_words_ids": lambda v: bool(v),
    "suppress_tokens": lambda v: bool(v),
    "begin_suppress_tokens": lambda v: bool(v),
    "sequence_bias": lambda v: bool(v),
    "forced_bos_token_id": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,
    "exponential_decay_length_penalty": lambda v: v is not None,
    "guidance_scale": lambda v: v is not None and v != 1.0,
    "watermarking_config": lambda v: v is not None,
    # Decoding modes generate() takes from them (DoLa, contrastive search, constrained beams: transformers 5 runs
    # them from the Hub's code, or raises) and token healing, which rewrites the prompt's end.
    "dola_layers": lambda v: v is not None,
    "penalty_alpha": lambda v: v is not None and v > 0,
    "constraints": lambda v: bool(v),
    "force_words_ids": lambda v: bool(v),
    "token_healing": lambda v: bool(v),
}


def _with_model_defaults(config: GenerationConfig, model):
    """The value `generate()` uses for a setting of `config`: its own, or where it leaves one unset (None), the
    model's `generation_config`'s (transformers' `_prepare_generation_config`)."""
    defaults = getattr(model, "generation_config", None)

    def value(name):
        mine = getattr(config, name, None)
        return mine if mine is not None else getattr(defaults, name, None)

    return value


def off_policy_sampling_settings(config: GenerationConfig, model, temperature: float) -> list[str]:
    """Sampling settings, in `config` or inherited from the model's `generation_config`, that move the sampling
    distribution away from softmax(logits / temperature), which is what the losses' log-probabilities assume."""
    value = _with_model_defaults(config, model)
    changes = {
        "do_sample": lambda v: v is False,
        **WARPER_SETTINGS,
        **PROCESSOR_SETTINGS,
        "temperature": lambda v: v is not None and not math.isclose(v, temperature),
    }
    return [f"{name}={value(name)!r}" for name, changed in changes.items() if changed(value(name))]


def model_generation_settings(sampling: SamplingSettings, model) -> list[str]:
    """The settings of the model's own `generation_config` that `generate()` applies to samples drawn with
    `sampling` (which leaves them unset), each as ``name=value``: what an engine that builds its sampling from
    `sampling` alone (the static cache, continuous batching) would leave out."""
    config = sampling.generation_config((), 0)
    defaults = getattr(model, "generation_config", None)  # (a PeftModel's is its base model's)
    stops = {"stop_strings": bool, "max_time": lambda v: v is not None}  # where generate() stops: no processor
    settings = {**({} if sampling.greedy else WARPER_SETTINGS), **PROCESSOR_SETTINGS, **stops}
    inherited = {name: getattr(defaults, name, None) for name in settings if getattr(config, name, None) is None}
    return [f"{name}={value!r}" for name, value in inherited.items() if settings[name](value)]


def warn_off_policy_sampling(sampling: SamplingSettings, model, stop_ids: Sequence[int], pad_id: int) -> None:
    """Warn, naming each, about rollout sampling settings the losses do not model (`off_policy_sampling_settings`);
    `model`: the one whose `generation_config` the engine applies where the settings leave a value unset (None: the
    engine applies the settings alone, as vLLM does)."""
    config = sampling.generation_config(stop_ids, pad_id)
    off_policy = off_policy_sampling_settings(config, model, sampling.temperature)
    if off_policy:
        logging.getLogger(__name__).warning(
            f"Rollouts are sampled with {', '.join(off_policy)}, which the losses do not model: log-probabilities "
            f"are computed from softmax(logits / {sampling.temperature}) alone, so the samples are off-policy and the "
            "PPO ratio and the positive-example NLL are biased. Train with plain temperature sampling (top_p=1.0, "
            "top_k=0, min_p=None, repetition_penalty=1.0); evaluate with top-p if you like (`trl-vapo eval`)."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------------------------------


def as_model_provider(model: nn.Module | ModelProvider) -> ModelProvider:
    """A model provider for `model`: a model is yielded as is, a provider is returned unchanged."""
    if isinstance(model, nn.Module):  # a module is callable too: test it first
        return lambda: contextlib.nullcontext(model)
    if not callable(model):
        raise TypeError(f"Expected a model or a zero-argument callable returning a context manager, got {model!r}.")
    return model


def ends_on_stop_string(text: str, last_token_start: int, stop_strings: Sequence[str]) -> bool:
    """Whether one of `stop_strings` ends within the last token of `text` (the characters from `last_token_start`):
    where transformers' `StopStringCriteria` stops, a stop string's end may fall inside that token (`"</answer"`
    then `">\n"` stops on `"</answer>"`)."""
    return any(s in text and text.rfind(s) + len(s) > last_token_start for s in stop_strings)


def stop_string_contexts(prompt_ids: Sequence[list[int]], stop_strings: Sequence[str]) -> list[list[int]]:
    """Each prompt's last tokens, as many as a stop string has characters and 8 more: all of the prompt a stop string
    that ends in the completion can begin in (a token decodes to a character or more; the margin keeps the cut's own
    rendering, a partial character or a word's leading space, away from it), where decoding each whole prompt per
    row would cost as much as the prompts are long."""
    longest = max(map(len, stop_strings)) + 8
    return [list(prompt[-longest:]) for prompt in prompt_ids]


def untruncate_stop_string_ends(
    output: GenerationOutput, tokenizer, stop_strings: Sequence[str], prompt_ids: Sequence[list[int]] | None = None
) -> None:
    """A row that ended on a stop string with the last token its budget allowed stopped: it did not run out of budget
    (`cut_at_stop` knows stop tokens alone, and marked it truncated: `mask_truncated_completions` left it out).
    `prompt_ids`: each row's prompt, where the engine matched stop strings over the prompt and the completion
    (transformers' `StopStringCriteria`; vLLM's matches the completion alone)."""
    cut = output.is_truncated.nonzero().flatten().tolist()  # only these can change: decoded, the others not
    if not cut:
        return
    rows = output.completion_lists()
    before = [list(prompt_ids[i]) if prompt_ids is not None else [] for i in cut]
    texts = tokenizer.batch_decode([p + rows[i] for p, i in zip(before, cut)])
    before_last = tokenizer.batch_decode([p + rows[i][:-1] for p, i in zip(before, cut)])
    for i, text, before in zip(cut, texts, before_last):
        if ends_on_stop_string(text, len(before), stop_strings):
            output.is_truncated[i] = False


@contextlib.contextmanager
def _inference(model: nn.Module) -> Iterator[None]:
    """Sampling mode without gradients, restored afterwards: `modeling.generation_mode` (eval mode, except for
    bitsandbytes 4-bit layers, which would stop passing gradients)."""
    from .modeling import generation_mode

    with generation_mode(model), torch.no_grad():
        yield


def _generated_mask(ids: torch.Tensor, stop_ids: Sequence[int], pad_id: int, stop_strings: bool) -> torch.Tensor:
    """[N, C] mask of the tokens `generate()` produced. It pads a row that ended on a stop string with `pad_id`, so
    with `stop_strings` a row without a stop token ends at its last non-pad token (unless the pad token is itself a
    stop token: then `cut_at_stop` ends the row there, and `TransformersGenerate` takes that pad back where the
    text before it ends on a stop string). Without stop strings nothing but a stop token ends a
    row, and a trailing pad token is one the model sampled."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    if not stop_strings or pad_id in stop_ids:
        return torch.ones_like(ids, dtype=torch.bool)
    last_real = torch.where(ids != pad_id, positions + 1, 0).amax(dim=1)
    return positions[None, :] < last_real[:, None]


class GenerationEngine:
    """Samples completions for token-id prompts. Subclasses implement `_generate`.

    Args:
        pad_token_id: pads the completions.
        stop_token_ids: a completion ends after the first of these (see `stop_token_ids`).
        sampling: the default `SamplingSettings` (each `generate` call may pass others).
    """

    name = "engine"

    def __init__(self, *, pad_token_id: int, stop_token_ids: Sequence[int], sampling: SamplingSettings | None = None):
        if not stop_token_ids:
            raise ValueError("At least one stop token id is needed, or completions could never end.")
        self.pad_token_id = pad_token_id
        self.stop_token_ids = list(stop_token_ids)
        self.sampling = sampling or SamplingSettings()

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        sampling: SamplingSettings | None = None,
        num_generations: int = 1,
    ) -> GenerationOutput:
        """One completion per prompt. `num_generations` > 1 says the prompts come in runs of that many identical
        copies (group sampling), which vLLM's server mode uses to sample them as one request; other engines ignore it.
        """
        if not prompt_ids:
            raise ValueError("No prompts to generate from.")
        sampling = sampling or self.sampling
        problem = generation_kwargs_problem(sampling.generation_kwargs)  # (VAPOConfig refuses them; a caller may not)
        if problem:
            raise ValueError(problem)
        return self._generate([list(p) for p in prompt_ids], sampling, num_generations)

    def _generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings, num_generations: int):
        raise NotImplementedError

    def sync_weights(self, step: int | None = None) -> None:
        """Make the engine sample from the current policy. A no-op for engines that read the policy's weights."""

    def weights_changed(self) -> None:
        """The policy's weights changed outside an optimizer step (a checkpoint loaded into it, the trainer's placing:
        cast, sharded): the next `sync_weights` pushes them whatever its step. A no-op for engines that read the
        policy's weights."""

    def prepare_backend(self) -> None:
        """Set the engine's sampling (`self.sampling`, its stop ids) on the backend it drives, for a caller that
        samples with that backend directly: a `rollout_func` with `trainer.vllm_generation`. A no-op for the engines
        that take their settings at each call."""


class TransformersGenerate(GenerationEngine):
    """transformers' `generate()` on left-padded batches: the default engine.

    Args:
        model: the causal LM, or a model provider (see `ModelProvider`).
        batch_size: prompts per `generate()` call (None: all at once).
        logprobs: also return the sampler's log-probs (from the processed scores: after temperature, top-k/p).
        tokenizer: passed to `generate()`, which needs it for `stop_strings` in `generation_kwargs`.
        pad_to_multiple_of: the prompts' padded width a multiple of it (GRPOConfig's `pad_to_multiple_of`: a
            compiler that builds one program per input shape, Neuron's, builds fewer).
    """

    name = "generate"

    def __init__(
        self,
        model: nn.Module | ModelProvider,
        *,
        batch_size: int | None = None,
        logprobs: bool = False,
        tokenizer=None,
        pad_to_multiple_of: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.model_provider = as_model_provider(model)
        self.batch_size = batch_size
        self.logprobs = logprobs
        self.tokenizer = tokenizer
        self.pad_to_multiple_of = pad_to_multiple_of

    def _generate(self, prompt_ids, sampling, num_generations):
        config = sampling.generation_config(self.stop_token_ids, self.pad_token_id)
        config.return_dict_in_generate = config.output_scores = self.logprobs
        with self.model_provider() as model, _inference(model):
            # The model's own generation_config may name stop strings: generate() applies them (it fills what
            # `config` leaves unset), so the completions' ends below read them too.
            config.stop_strings = _with_model_defaults(config, model)("stop_strings")
            device = next(model.parameters()).device
            ids, logprobs = in_batches(
                prompt_ids,
                self.batch_size,
                lambda batch: self._generate_chunk(model, batch, config, device),
                self.pad_token_id,
            )
        valid = _generated_mask(ids, self.stop_token_ids, self.pad_token_id, bool(config.stop_strings))
        output = cut_at_stop(
            ids, self.stop_token_ids, self.pad_token_id, valid, logprobs, max_new_tokens=sampling.max_new_tokens
        )
        if config.stop_strings and self.tokenizer is not None:
            strings = [config.stop_strings] if isinstance(config.stop_strings, str) else list(config.stop_strings)
            if self.pad_token_id in self.stop_token_ids:
                # generate() pads a row that ended on a stop string with the pad token, here a stop token too:
                # `cut_at_stop` kept the first pad as the row's end, a token the policy never sampled (the reward
                # would land on it, and it would train). The row ends on the stop string, as vLLM ends it. The
                # string is matched as generate() matched it, over the prompt and the completion: one that begins in
                # the prompt (`"\n\n"` after a prompt ending in `"\n"`) stopped the row too.
                decode = self.tokenizer.decode
                tails = stop_string_contexts(prompt_ids, strings)
                padded = [
                    len(row) > 1
                    and row[-1] == self.pad_token_id
                    and ends_on_stop_string(decode(tail + row[:-1]), len(decode(tail + row[:-2])), strings)
                    for tail, row in zip(tails, output.completion_lists())
                ]
                if any(padded):
                    ends = output.lengths - torch.tensor(padded, dtype=output.lengths.dtype)
                    valid = torch.arange(ids.shape[1])[None, :] < ends[:, None]
                    output = cut_at_stop(
                        ids, self.stop_token_ids, self.pad_token_id, valid, logprobs, sampling.max_new_tokens
                    )
            untruncate_stop_string_ends(output, self.tokenizer, strings, stop_string_contexts(prompt_ids, strings))
        return output

    def _generate_chunk(self, model, prompt_ids, config, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        multiple = self.pad_to_multiple_of
        prompts = [torch.tensor(x) for x in prompt_ids]
        input_ids = pad(prompts, padding_value=self.pad_token_id, padding_side="left", pad_to_multiple_of=multiple)
        attention_mask = pad([torch.ones_like(x) for x in prompts], padding_side="left", pad_to_multiple_of=multiple)
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            **({"tokenizer": self.tokenizer} if self.tokenizer is not None else {}),
        )
        sequences = output.sequences if self.logprobs else output
        completions = sequences[:, input_ids.shape[1] :]
        logprobs = None
        if self.logprobs:
            # `scores` are the processed logits the token was sampled from, as vLLM's "processed_logprobs". A step at
            # a time: stacked, the float32 log-softmax of every step was two more [N, steps, vocabulary] tensors
            # (40 GB each at 64 x 1,024 tokens of a 152k vocabulary).
            logprobs = torch.stack(
                [
                    step.float().log_softmax(dim=-1).gather(-1, completions[:, t, None]).squeeze(-1)
                    for t, step in enumerate(output.scores)
                ],
                dim=1,
            ).cpu()
        return completions.cpu(), logprobs


def in_batches(
    prompt_ids: list[list[int]],
    batch_size: int | None,
    generate: Callable[[list[list[int]]], tuple[torch.Tensor, torch.Tensor | None]],
    pad_id: int,
    one_shape: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`generate` (a batch of prompts -> its completions' ids and log-probs, or None) on `batch_size` prompts at a
    time (None: all at once), the batches' columns padded to the widest (ids with `pad_id`, log-probs with 0).
    `one_shape`: a short last batch takes copies of its first prompt, dropped after, so that every batch has one
    shape (buffers and a CUDA graph kept for it serve them all, where a smaller one was allocated and captured
    anew)."""
    size = batch_size or len(prompt_ids)
    parts = []
    for start in range(0, len(prompt_ids), size):
        batch = prompt_ids[start : start + size]
        padded = batch + batch[:1] * (size - len(batch)) if one_shape and len(prompt_ids) > size else batch
        ids, logprobs = generate(padded)
        parts.append((ids[: len(batch)], None if logprobs is None else logprobs[: len(batch)]))
    width = max(ids.shape[1] for ids, _ in parts)
    ids = torch.cat([_pad_columns(ids, width, pad_id) for ids, _ in parts])
    if parts[0][1] is None:
        return ids, None
    return ids, torch.cat([_pad_columns(logprobs, width, 0.0) for _, logprobs in parts])


def _pad_columns(x: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


class ContinuousBatching(GenerationEngine):
    """transformers' paged-attention continuous-batching engine (`model.generate_batch`), as TRL's
    `use_transformers_continuous_batching`.

    Requests join and leave the running batch one by one, so a batch never waits for its longest completion, and no
    prompt is padded. The repetition penalty is not supported (transformers would silently drop it).

    Args:
        model: the causal LM, or a model provider.
        config: keyword arguments of `transformers.generation.ContinuousBatchingConfig`
            (`transformers_continuous_batching_config`). As in TRL, `max_memory_percent` defaults to 0.5, leaving
            accelerator memory for training. On CPU, unless `num_blocks` is given, the KV cache is sized to the
            request (prompts x (longest prompt + max_new_tokens)): transformers would otherwise reserve 60% of the
            machine's RAM and build attention masks over all of it at every step (17 s instead of 0.8 s for 8 demo
            prompts).
        logprobs: also return the sampler's log-probs (of the processed logits, as vLLM's "processed_logprobs").

    transformers runs the batches in a background thread, where autocast (thread-local) does not reach: the model
    computes in its weights' dtype (TRL casts the model to bf16 first; this engine leaves the weights alone).
    """

    name = "continuous_batching"

    def __init__(
        self,
        model: nn.Module | ModelProvider,
        *,
        config: dict[str, Any] | None = None,
        logprobs: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        _check_continuous_batching_available()
        _check_continuous_batching_sampling(self.sampling)
        self.model_provider = as_model_provider(model)
        self.config = dict(config or {})
        self.logprobs = logprobs

    def _generate(self, prompt_ids, sampling, num_generations):
        generation_config = sampling.generation_config(self.stop_token_ids, self.pad_token_id)
        with self.model_provider() as model, _inference(model):
            _check_continuous_batching_sampling(sampling, model)
            results = model.generate_batch(
                prompt_ids,
                generation_config=generation_config,
                continuous_batching_config=self._batching_config(model, prompt_ids, sampling.max_new_tokens),
                progress_bar=False,
            )
        outputs = list(results.values())
        failed = [o.request_id for o in outputs if o.error is not None]
        if len(outputs) != len(prompt_ids) or failed:
            # generate_batch only logs a failed or lost request: a rollout must not silently lose samples.
            raise RuntimeError(
                f"Continuous batching returned {len(outputs)} of {len(prompt_ids)} completions"
                + (f"; failed: {failed[:5]} ({outputs[0].error if failed else ''})" if failed else "")
                + ". See transformers' log above; `transformers_continuous_batching_config` sizes the cache."
            )
        logprobs = [o.logprobs for o in outputs] if self.logprobs else None
        completions = [o.generated_tokens for o in outputs]
        return _from_lists(completions, logprobs, self.stop_token_ids, self.pad_token_id, sampling.max_new_tokens)

    def _batching_config(self, model: nn.Module, prompt_ids: list[list[int]], max_new_tokens: int):
        from transformers.generation import ContinuousBatchingConfig

        kwargs = dict(self.config)
        kwargs.setdefault("max_memory_percent", 0.5)  # TRL's training-aware default (transformers: 0.9)
        if self.logprobs:
            kwargs["return_logprobs"] = True
        if next(model.parameters()).device.type == "cpu" and kwargs.get("num_blocks") is None:
            page_size = kwargs.get("page_size") or ContinuousBatchingConfig.page_size
            blocks_per_request = math.ceil((max(map(len, prompt_ids)) + max_new_tokens) / page_size) + 1
            kwargs["num_blocks"] = len(prompt_ids) * blocks_per_request
        return ContinuousBatchingConfig(**kwargs)


def _check_continuous_batching_available() -> None:
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.8.0"):
        raise ImportError(
            f"use_transformers_continuous_batching needs transformers>=5.8.0 (installed: {transformers.__version__}). "
            "Upgrade with `pip install --upgrade transformers`."
        )


def _check_continuous_batching_sampling(sampling: SamplingSettings, model: nn.Module | None = None) -> None:
    """Refuse what transformers' continuous batching would silently ignore (in `sampling`, and in the model's own
    `generation_config` where `model` is given)."""
    inherited = model_generation_settings(sampling, model) if model is not None else []
    if inherited:
        raise ValueError(
            f"The model's generation_config sets {', '.join(inherited)}, which generate() applies and transformers' "
            "continuous batching would drop silently. Clear them (model.generation_config.<name> = None), or "
            "generate with the default engine."
        )
    if sampling.generation_kwargs.get("stop_strings"):
        raise ValueError(
            "generation_kwargs['stop_strings'] is not supported by transformers' continuous batching (it has no "
            "stopping criteria). Name stop tokens in generation_kwargs['eos_token_id'], or use the default engine."
        )
    # Per request it runs the temperature, top-k and top-p warpers; it drops the other processors (the repetition
    # penalty, min_new_tokens: a first token that stops ends the completion) or runs them on one token per row
    # (no_repeat_ngram_size), whether set as fields or in generation_kwargs.
    config = sampling.generation_config((), 0)
    given = {name: getattr(config, name, None) for name in PROCESSOR_SETTINGS}
    active = [name for name, value in given.items() if PROCESSOR_SETTINGS[name](value)]
    if active:
        named = [
            f"{name}={given[name]!r}" + " (generation_kwargs)" * (name in sampling.generation_kwargs)
            for name in active
        ]
        raise ValueError(
            f"{', '.join(named)}: not supported by transformers' continuous batching, which would drop or misapply it "
            "silently. Remove it (repetition_penalty=1.0), or generate with use_vllm or the default engine."
        )


class VLLMEngine(GenerationEngine):
    """vLLM through TRL's `VLLMGeneration` (`use_vllm=True`, server or colocate mode).

    `sync_weights(step)` pushes the policy's weights to vLLM once per optimizer step with TRL's code (gathering,
    renaming, server or colocate transfer): under PEFT, the base weights merged with the *active* adapter, which must
    be the policy's, so that the critic adapter never reaches vLLM (see `policy_only` for what differs from TRL).

    Args:
        vllm_generation: a `VLLMGeneration` (or an object with its interface) built on the policy alone, never the
            actor-critic module.
    """

    name = "vllm"

    def __init__(self, vllm_generation, **kwargs):
        super().__init__(**kwargs)
        check_policy_only(vllm_generation.model)
        self.vllm_generation = vllm_generation
        self._synced_step: int | None = None
        self._context_length: int | None = None
        self._context_known = False

    def sync_weights(self, step: int | None = None) -> None:
        """Push the policy's weights to vLLM, unless they were already pushed at this optimizer `step`."""
        if step is not None and step == self._synced_step:
            return
        check_policy_adapter_active(self.vllm_generation.model)
        self.vllm_generation.sync_weights()
        self._synced_step = step

    def weights_changed(self) -> None:
        self._synced_step = None
        # TRL's server mode announces the weights' names, dtypes and shapes at its first sync and streams every later
        # one against that list; a first sync before the trainer placed the models (`trl-vapo train`'s held-out
        # report) announced float32 weights that DeepSpeed's bf16 then cast: announced again.
        if getattr(self.vllm_generation, "_weight_metadata", None) is not None:
            self.vllm_generation._weight_metadata = None

    def prepare_backend(self) -> None:
        _apply_sampling(self.vllm_generation, self.sampling, self.stop_token_ids)

    def warn_unprocessed_server_logprobs(self) -> None:
        """Warn, as GRPOTrainer does, when a vLLM server reports log-probs other than "processed_logprobs": the
        importance-sampling correction divides by them, and raw log-probs ignore the temperature and top-p/top-k
        the token was sampled with. Colocated vLLM is built with "processed_logprobs"; the server is the user's."""
        client = getattr(self.vllm_generation, "vllm_client", None)  # the main process's, in server mode
        if client is None:
            return
        mode = client.get_server_info()["model_config"]["logprobs_mode"]
        if mode != "processed_logprobs":
            logging.getLogger(__name__).warning(
                f"The vLLM server runs with `--logprobs-mode {mode}`, which biases the importance-sampling "
                "correction. Restart it with `--logprobs-mode processed_logprobs`, or set "
                "`vllm_importance_sampling_correction=False`."
            )

    def context_length(self) -> int | None:
        """The length of prompt and completion at which vLLM ends a completion. A colocated engine's:
        `vllm_max_model_length` where set, else the one vLLM derived from the model (its model config). A server's:
        its own (`--max-model-len`, or derived), from its `/server_info`, read by the main process, which alone holds
        the client, once, and shared: every process samples together; `vllm_max_model_length` only where the server
        does not say (TRL passes that field to a colocated engine alone: a server's context is the server's). A
        completion ended there is out of budget, not finished (read as finished where this length was wrong: a wrong
        answer, not masked by `mask_truncated_completions`)."""
        if not self._context_known:
            vllm = self.vllm_generation
            context = getattr(vllm, "max_model_length", None)
            if getattr(vllm, "mode", None) == "server":
                from .distributed import decided_on_main

                def ask() -> int | None:
                    return vllm.vllm_client.get_server_info().get("model_config", {}).get("max_model_len")

                context = decided_on_main(ask, vllm.accelerator) or context
            elif context is None:
                context = vllm.llm.llm_engine.model_config.max_model_len
            self._context_length, self._context_known = context, True
        return self._context_length

    def _generate(self, prompt_ids, sampling, num_generations):
        if getattr(self.vllm_generation, "mode", None) == "colocate":  # (evaluation's per-call kwargs meet it here)
            problem = colocated_vllm_seed_problem(sampling.generation_kwargs, num_generations)
            if problem:
                raise ValueError(problem)
        _apply_sampling(self.vllm_generation, sampling, self.stop_token_ids)
        _, completion_ids, logprobs, _ = self.vllm_generation.generate(
            prompts=prompt_ids, images=None, num_generations=num_generations
        )
        sampler = None
        if logprobs is not None:
            # One entry per token: [sampled token's log-prob] with logprobs=0; vLLM reports NaN as None.
            sampler = [[math.nan if lp is None or lp[0] is None else lp[0] for lp in row] for row in logprobs]
        budget = sampling.max_new_tokens
        context = self.context_length()
        if context is not None:  # vLLM ends a completion where the prompt and it fill the context: out of budget too
            budget = torch.tensor([min(budget, context - len(prompt)) for prompt in prompt_ids])
        output = _from_lists(completion_ids, sampler, self.stop_token_ids, self.pad_token_id, budget)
        strings = self.vllm_generation.generation_kwargs.get("stop")  # (`_apply_sampling` renamed stop_strings)
        if strings:  # as generate()'s: a row that ended on one with its last allowed token stopped
            untruncate_stop_string_ends(output, self.vllm_generation.processing_class, strings)
        return output


def sampling_seed(args, process_index: int) -> int:
    """The seed of a process's random generators once the trainer is built: `seed + process_index` (each process
    samples its own completions, as GRPOTrainer seeds them), one per tensor-parallel group under colocated vLLM
    (`seed + process_index // vllm_tensor_parallel_size`). The processes of a group run one vLLM engine together: they
    must draw the same random numbers, which vLLM draws from the process's generator for requests without a seed of
    their own (TRL seeds the group alike for this; its engine start seeds each process with the group's index)."""
    group = args.vllm_tensor_parallel_size if args.use_vllm and args.vllm_mode == "colocate" else 1
    return args.seed + process_index // group


def _apply_sampling(vllm_generation, sampling: SamplingSettings, stop_ids: Sequence[int]) -> None:
    """Set a call's sampling on `VLLMGeneration`, which reads these attributes at every `generate`."""
    vllm_generation.temperature = 0.0 if sampling.greedy else sampling.temperature  # vLLM: 0 is greedy
    vllm_generation.top_p = sampling.top_p
    vllm_generation.top_k = sampling.top_k  # 0 is "off" for vLLM too (TRL passes its default 0)
    vllm_generation.min_p = sampling.min_p or 0.0
    vllm_generation.repetition_penalty = sampling.repetition_penalty
    vllm_generation.max_completion_length = sampling.max_new_tokens
    kwargs = {k: v for k, v in sampling.generation_kwargs.items() if k not in ("eos_token_id", "do_sample")}
    # vLLM stops at its own EOS; name every stop id so that it ends completions where the other engines do.
    kwargs["stop_token_ids"] = list(stop_ids)
    if "min_new_tokens" in kwargs:  # transformers' name; vLLM's SamplingParams takes `min_tokens`
        kwargs["min_tokens"] = kwargs.pop("min_new_tokens")
    if kwargs.get("stop_strings"):  # transformers' name; vLLM's is `stop`, and transformers keeps the string
        strings = kwargs.pop("stop_strings")
        kwargs["stop"] = [strings] if isinstance(strings, str) else list(strings)
        kwargs.setdefault("include_stop_str_in_output", True)
    vllm_generation.generation_kwargs = kwargs


# ---------------------------------------------------------------------------------------------------------------------
# Choosing and building an engine: the one way in
# ---------------------------------------------------------------------------------------------------------------------

ENGINES = ("generate", "continuous_batching", "static_cache", "vllm")
ENGINE_FLAGS = {
    "vllm": "use_vllm",
    "continuous_batching": "use_transformers_continuous_batching",
    "static_cache": "use_static_cache_engine",
}
"""The config's flag that names each engine but `generate()` (TRL's, and trl-vapo's `use_static_cache_engine`)."""


@dataclass
class EngineSettings:
    """Which engine samples, and how: what `build_engine` builds from.

    Built from a `VAPOConfig` (`from_config`: training, and evaluation during or after it) or from `trl-vapo eval`'s
    arguments (`from_eval_args`), or directly (`EngineSettings(engine="continuous_batching")`).

    Args:
        engine: one of `ENGINES`: transformers' `generate()`, its continuous-batching engine, the static-cache
            engine, or vLLM.
        sampling: the default sampling settings (a call to `generate` may pass others).
        batch_size: prompts per `generate()` call or static-cache batch (None: all at once).
        continuous_batching_config: keyword arguments of transformers' `ContinuousBatchingConfig`.
        vllm: `VLLMGeneration`'s options (`VLLM_OPTIONS`, plus `trust_remote_code`).
        rollout_size: sequences sampled per rollout over all processes (vLLM's `max_num_seqs` is a process's share).
        quantization_config: the policy's, if it is loaded quantized (vLLM refuses it).
        pad_to_multiple_of: `generate()`'s prompts padded to a multiple of it (GRPOConfig's field, as TRL pads them).
        cuda_graph: the static-cache engine captures its decode step as a CUDA graph on a CUDA device (`placed`
            turns it off under DeepSpeed and FSDP, whose hooks gather the weights inside the forward).
        compile_step: the static-cache engine compiles its decode step with torch.compile (`static_cache_compile`).
        keep_buffers: the static-cache engine keeps its cache and graph between calls (`placed` turns it off for
            training: the update between two rollouts needs that memory).
        auto: the engine was not named (`use_static_cache_engine=None`): `placed` picks the static-cache engine on a
            CUDA device without DeepSpeed or FSDP, for an unquantized base and no `cache_implementation` but
            `EXACT_CACHES` (on an H200, one run: a VAPO LoRA step in 0.34x the time, 23x the tokens/s in generation).
    """

    engine: str = "generate"
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    batch_size: int | None = None
    continuous_batching_config: dict[str, Any] | None = None
    vllm: dict[str, Any] = field(default_factory=dict)
    rollout_size: int | None = None
    quantization_config: Any = None
    pad_to_multiple_of: int | None = None
    cuda_graph: bool = True
    compile_step: bool = False
    keep_buffers: bool = True
    auto: bool = False

    @property
    def holds_own_weights(self) -> bool:
        """The engine samples from its own copy of the policy (vLLM's), which the trainer's engine receives after each
        update: a model handed to `build_engine` alone is not what it would sample from."""
        return self.engine == "vllm"

    def placed(self, device_type: str, sharded: bool, model: nn.Module | None = None) -> EngineSettings:
        """These settings for a trainer on `device_type` whose weights DeepSpeed or FSDP place (`sharded`), sampling
        from `model`: the engine the user left to the default (`auto`), the CUDA graph, and buffers released between
        rollouts."""
        engine = self.engine
        # Not for a quantized base, asked for or loaded so (a checkpoint saved quantized): bitsandbytes' kernels were
        # not captured on a GPU yet (named, it runs; a failed capture falls back to the eager step with a warning).
        quantized = asks_quantized(self.quantization_config) or is_quantized(model)
        # Nor where `cache_implementation` asks for another KV cache (offloaded, quantized): the engine's is static.
        other_cache = self.sampling.generation_kwargs.get("cache_implementation") not in EXACT_CACHES
        if (
            self.auto
            and engine == "generate"
            and device_type == "cuda"
            and not sharded
            and not (quantized or other_cache)
        ):
            engine = "static_cache"
        if self.compile_step and engine != "static_cache":  # (left to the default, which is another engine here)
            logging.getLogger(__name__).warning(
                f"static_cache_compile=True has no effect: the rollouts use the {engine} engine here, the "
                "static-cache engine being the default on a CUDA GPU only (use_static_cache_engine=True names it)."
            )
        return dataclasses.replace(self, engine=engine, cuda_graph=self.cuda_graph and not sharded, keep_buffers=False)

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"Unknown generation engine {self.engine!r}: use one of {', '.join(ENGINES)}.")
        if self.engine == "vllm":  # options not given keep their defaults (TRL's)
            self.vllm = {**VLLM_DEFAULTS, "trust_remote_code": False, **self.vllm}
        if self.compile_step and self.engine != "static_cache" and not (self.auto and self.engine == "generate"):
            named = (
                "use_static_cache_engine=False" if self.engine == "generate" else f"{ENGINE_FLAGS[self.engine]}=True"
            )
            raise ValueError(
                f"static_cache_compile=True compiles the static-cache engine's decode step, and {named} samples with "
                "another engine: drop one of them."
            )

    @staticmethod
    def _engine_named_by(args) -> str:
        """The engine TRL's flags `use_vllm` and `use_transformers_continuous_batching`, and trl-vapo's
        `use_static_cache_engine`, choose."""
        if args.use_vllm and args.use_transformers_continuous_batching:
            raise ValueError("use_vllm and use_transformers_continuous_batching are both set; choose one engine.")
        chosen = [flag for flag in ENGINE_FLAGS.values() if getattr(args, flag, False)]
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)} are set together; choose one engine.")
        if args.use_vllm:
            return "vllm"
        if getattr(args, "use_static_cache_engine", False):
            return "static_cache"
        return "continuous_batching" if args.use_transformers_continuous_batching else "generate"

    @classmethod
    def from_config(cls, args) -> EngineSettings:
        """The rollout engine of a `VAPOConfig` (TRL's field names: `use_vllm`, `vllm_*`,
        `use_transformers_continuous_batching`; trl-vapo's `use_static_cache_engine`)."""
        return cls(
            engine=cls._engine_named_by(args),
            auto=args.use_static_cache_engine is None,
            sampling=SamplingSettings.from_config(args),
            continuous_batching_config=args.transformers_continuous_batching_config,
            vllm={
                **{name: getattr(args, f"vllm_{name}") for name in VLLM_OPTIONS},
                "trust_remote_code": args.trust_remote_code,
            },
            rollout_size=args.generation_batch_size,
            quantization_config=(args.model_init_kwargs or {}).get("quantization_config"),
            pad_to_multiple_of=args.pad_to_multiple_of,
            compile_step=args.static_cache_compile,
        )

    @classmethod
    def from_eval_args(cls, args) -> EngineSettings:
        """The engine of `trl-vapo eval` (`cli.EvalArguments`, its JSON flags parsed into mappings); vLLM options it
        does not take keep their defaults (`VLLM_DEFAULTS`)."""
        vllm = {name: getattr(args, f"vllm_{name}") for name in VLLM_OPTIONS if hasattr(args, f"vllm_{name}")}
        return cls(
            engine=cls._engine_named_by(args),
            auto=getattr(args, "use_static_cache_engine", False) is None,  # (`placed` picks it, as training's)
            sampling=SamplingSettings(
                max_new_tokens=args.max_completion_length,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k or 0,
                min_p=args.min_p,
                repetition_penalty=args.repetition_penalty,
                generation_kwargs=dict(args.generation_kwargs or {}),
            ),
            batch_size=args.batch_size,
            continuous_batching_config=args.transformers_continuous_batching_config,
            vllm={**vllm, "trust_remote_code": args.trust_remote_code},
            rollout_size=args.batch_size,
            compile_step=getattr(args, "static_cache_compile", False),
        )

    def vllm_generation_kwargs(self, num_processes: int) -> dict[str, Any]:
        """Keyword arguments of `VLLMGeneration`, as `GRPOTrainer` builds them.

        `max_num_seqs` is this process's share of a rollout (GRPO: `per_device_train_batch_size *
        vllm_tensor_parallel_size * steps_per_generation`, the same number); `logprobs=0` asks for the sampled token's
        log-prob only, which the importance-sampling correction needs.
        """
        if self.rollout_size is None:
            raise ValueError("EngineSettings(engine='vllm') needs rollout_size: the sequences sampled per rollout.")
        sampling = self.sampling
        return {
            **self.vllm,
            "max_num_seqs": self.rollout_size // num_processes * self.vllm["tensor_parallel_size"],
            "repetition_penalty": sampling.repetition_penalty,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "max_completion_length": sampling.max_new_tokens,
            "logprobs": 0,
            "generation_kwargs": sampling.generation_kwargs,
        }


def check_engine_available(settings: EngineSettings, model: Any = None) -> None:
    """Raise a clear error for an engine this machine or these settings cannot run: call it before loading any model.

    vLLM without vLLM installed says `pip install vllm`; a bad `vllm_mode`, vLLM with a quantized base (the settings'
    `quantization_config`, or ``model`` when an instance is given), the settings continuous batching would
    silently ignore (repetition penalty, `stop_strings`), and `generation_kwargs` the engine's sampler has no field
    for are refused.
    """
    problem = generation_kwargs_problem(settings.sampling.generation_kwargs)  # (`trl-vapo eval`: before loading)
    if problem:
        raise ValueError(problem)
    if settings.engine == "vllm":
        quantized = asks_quantized(settings.quantization_config) or is_quantized(model)
        if quantized:
            # Syncing would merge the policy adapter into packed 4-bit weights: vLLM would receive packed uint8
            # under bf16 names, and the live base would come back re-quantized.
            raise ValueError(
                "use_vllm=True cannot be used with a quantized base (bitsandbytes 4-bit / 8-bit and the like): the "
                "policy's weights cannot be synced to vLLM from it. Generate with transformers instead "
                "(use_vllm=False, or use_transformers_continuous_batching=True), or use vLLM with LoRA on an "
                "unquantized bf16 base."
            )
        mode = settings.vllm.get("mode")
        if mode not in ("server", "colocate"):
            raise ValueError(f"vllm_mode must be 'server' or 'colocate', got {mode!r}.")
        if not is_vllm_available():
            raise ImportError(
                "use_vllm=True needs vLLM, which is not installed. Install it with `pip install vllm` (TRL supports "
                "vLLM 0.22 to 0.31; `pip install trl[vllm]` picks a matching version), or set use_vllm=False to "
                "generate with transformers."
            )
        _check_vllm_sampling_keys(settings.sampling)
    else:
        _check_transformers_sampling_keys(settings.sampling)
    if settings.engine == "continuous_batching":
        _check_continuous_batching_available()
        _check_continuous_batching_sampling(settings.sampling)
        if (settings.continuous_batching_config or {}).get("seed") is not None:
            # transformers seeds torch's global generator with it each time a batch starts (`set_tp_seed`)
            raise ValueError(
                "transformers_continuous_batching_config sets a seed, which transformers passes to "
                "torch.manual_seed at every rollout: each would draw the same random numbers, the trainer's shuffles "
                "too. Leave it out: the trainer seeds each process once (`seed`)."
            )


def generation_kwargs_problem(generation_kwargs: dict[str, Any]) -> str | None:
    """Why `generation_kwargs` may not be sampled with, or None: it sets what the caller counts. The token budget (the
    trainer's `max_completion_length`, evaluation's `max_new_tokens`), which also tells a completion cut by the
    budget from one that ended; a clock, whose cut reads as an end; a prompt's number of completions (each prompt's
    completions are `num_generations`, evaluation's `k`, which the engine asks for itself, and the batches, the groups
    and the prompts they are scored against are counted in), and the pad token (the tokenizer's, by which the
    completions' ends are found). And a `do_sample` that is not a bool."""
    budget = sorted(set(generation_kwargs) & {"max_new_tokens", "max_length", "max_tokens"})
    if budget:
        return (
            f"generation_kwargs sets {', '.join(budget)}: the completions' token budget is max_completion_length "
            "(evaluate_policy's max_new_tokens), which also tells a completion cut by the budget from one that ended "
            "(mask_truncated_completions, completions/clipped_ratio). Set max_completion_length (max_new_tokens) "
            "instead."
        )
    if "max_time" in generation_kwargs:
        return (
            "generation_kwargs sets max_time: a completion the clock stops would count as one that ended (it is cut "
            "short of max_completion_length without a stop token), so mask_truncated_completions would train on it "
            "and completions/clipped_ratio miss it. Bound the completions with max_completion_length instead."
        )
    if "pad_token_id" in generation_kwargs:  # (generate() took it; the completions' cut and mask read the tokenizer's)
        return (
            "generation_kwargs sets pad_token_id: the completions are padded with the tokenizer's pad token, which "
            "the trainer reads to find where each one ends (with another, the padding after a stop string counted as "
            "sampled tokens, scored and trained on). Set the tokenizer's pad token instead (tokenizer.pad_token)."
        )
    sample = generation_kwargs.get("do_sample", True)
    if not isinstance(sample, bool):  # the engines read `is False` (greedy), transformers' generate() truthiness
        return (
            f"generation_kwargs sets do_sample={sample!r}: give true or false (the engines would disagree on whether "
            f"{sample!r} samples)."
        )
    # vLLM's `n` and `best_of` at any value: TRL's server client sets `n` to a prompt's copies, then updates the
    # request's sampling with these kwargs (`n=1` asked for one completion per prompt where num_generations are read).
    samples = sorted(
        k
        for k in set(generation_kwargs) & {"num_return_sequences", "n", "best_of"}
        if k != "num_return_sequences" or generation_kwargs[k] != 1
    )
    if samples:
        return (
            f"generation_kwargs sets {', '.join(samples)}: each prompt's completions are num_generations "
            "(trl-vapo eval's k, sample_completions' num_samples), which the batches and the groups are counted in, "
            "and the engine asks for them itself. Leave it out; set num_generations (k, num_samples) for more."
        )
    return None


def colocated_vllm_seed_problem(generation_kwargs: dict[str, Any], copies: int) -> str | None:
    """Why colocated vLLM may not sample a prompt's `copies` with `generation_kwargs`, or None: a `seed` there. TRL's
    colocate mode makes each copy a request of its own, each sampled with that seed: the copies are identical."""
    if copies > 1 and "seed" in generation_kwargs:
        return (
            f"generation_kwargs sets a seed, with colocated vLLM: each of a prompt's {copies} copies is one request, "
            "each sampled with that seed, so they would be identical (a group with no advantage to learn from, pass@k "
            "equal to avg@k). Leave it out and set `seed` (--seed), which seeds each process."
        )
    return None


def _check_transformers_sampling_keys(sampling: SamplingSettings) -> None:
    """Refuse `generation_kwargs` that transformers' `GenerationConfig` has no field for (vLLM's `presence_penalty`,
    `seed`, `stop`, ...): it keeps them as attributes, and `generate()` samples as if they were not there."""
    known = set(GenerationConfig().__dict__) | {"stop_token_ids"}  # (trl-vapo's: stop ids, for every engine)
    unknown = sorted(set(sampling.generation_kwargs) - known)
    if unknown:
        raise ValueError(
            f"generation_kwargs {unknown}: transformers' GenerationConfig has no such field (vLLM's SamplingParams "
            "may), so generate() would sample as if they were not given. Use GenerationConfig's names (with "
            "use_vllm=True, vLLM's); a seed is the config's `seed`."
        )


VLLM_FIELDS_LEFT_AS_THEY_ARE = {
    "logprobs": "logprobs (0: the sampled token's) is what the importance-sampling correction reads; more gives "
    "the most likely tokens' first, None none, and the correction turns off",
    "prompt_logprobs": "prompt_logprobs would return the prompt's, which nothing reads",
    "truncate_prompt_tokens": "truncate_prompt_tokens would sample from a shortened prompt while the losses score "
    "the whole one (max_prompt_length cuts prompts for both)",
}


def _check_vllm_sampling_keys(sampling: SamplingSettings) -> None:
    """Refuse `generation_kwargs` that vLLM's `SamplingParams` does not take, as `_apply_sampling` passes them on
    (transformers' names renamed): colocated vLLM raised a TypeError at the first rollout, after the models and vLLM
    loaded, and a server ignores them, sampling otherwise than asked. Checked against the installed vLLM's fields. And
    those the trainer needs as its requests leave them (`VLLM_FIELDS_LEFT_AS_THEY_ARE`), installed or not."""
    passed = SimpleNamespace()
    _apply_sampling(passed, sampling, [])
    # SamplingParams fields the trainer needs as TRL's requests leave them: changed, what it reads back is wrong.
    owned = sorted(set(passed.generation_kwargs) & set(VLLM_FIELDS_LEFT_AS_THEY_ARE))
    if owned:
        raise ValueError(
            f"generation_kwargs sets {', '.join(owned)}, which the trainer needs as its vLLM requests leave them: "
            + "; ".join(VLLM_FIELDS_LEFT_AS_THEY_ARE[name] for name in owned)
            + ". Leave them out."
        )
    try:
        from vllm import SamplingParams
    except ImportError:  # vLLM's own import error comes when the engine starts
        return
    fields = set(getattr(SamplingParams, "__struct_fields__", ()))  # a msgspec struct's fields
    unknown = sorted(set(passed.generation_kwargs) - fields) if fields else []
    if unknown:
        raise ValueError(
            f"generation_kwargs {unknown}: vLLM's SamplingParams has no such field (transformers' generate() has), "
            "so vLLM would refuse them at the first rollout or, as a server, ignore them. Leave them out with "
            "use_vllm=True, or use vLLM's names (SamplingParams)."
        )


def build_engine(
    settings: EngineSettings,
    model: nn.Module | ModelProvider,
    tokenizer,
    *,
    policy: nn.Module | None = None,
    accelerator=None,
    stop_ids: Sequence[int] | None = None,
    vllm_generation_cls: type | None = None,
) -> GenerationEngine:
    """The engine `settings` ask for: every caller (training, evaluation, `trl-vapo eval`) builds its engine here.

    Args:
        settings: which engine, its default sampling and its options.
        model: the model, or a model provider, the transformers engines generate with.
        tokenizer: gives the pad and EOS ids.
        policy: the causal LM (a `PeftModel` under PEFT) whose weights vLLM receives; vLLM only. Not the actor-critic.
        accelerator: the trainer's `Accelerator`; vLLM only (default: a new one, as for `trl-vapo eval`).
        stop_ids: where completions end (default: `stop_token_ids(tokenizer, policy, generation_kwargs)`).
        vllm_generation_cls: replaces TRL's `VLLMGeneration` (tests pass a stand-in).
    """
    if policy is None and isinstance(model, nn.Module):
        policy = model
    if vllm_generation_cls is None:
        check_engine_available(settings, policy)  # the loaded policy: a checkpoint may come quantized by its config
    stop_ids = stop_ids or stop_token_ids(tokenizer, policy, settings.sampling.generation_kwargs)
    # A tokenizer without a pad token (Llama's) pads with its EOS, as training sets it (`prepare_tokenizer`); given to
    # `evaluate_policy` as loaded, None failed in the first batch's padding.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    common = {"pad_token_id": pad_id, "stop_token_ids": stop_ids, "sampling": settings.sampling}
    if settings.engine == "vllm":
        if policy is None:
            raise ValueError("The vLLM engine needs the policy model.")
        if accelerator is None:
            from accelerate import Accelerator

            accelerator = Accelerator()
        check_policy_only(policy)  # before vLLM loads anything
        check_tied_head_unadapted(policy)
        inherited = model_generation_settings(settings.sampling, policy)
        if inherited:  # GRPOTrainer's vLLM ignores them too; generate() and the other engines apply or refuse them
            logging.getLogger(__name__).warning(
                f"The model's generation_config sets {', '.join(inherited)}, which generate() applies and vLLM does "
                "not: it samples with the settings the config names alone, as GRPOTrainer's vLLM does. Set them in "
                "the config (min_p, repetition_penalty, generation_kwargs) to sample with them, or clear them "
                "(model.generation_config.<name> = None) to sample alike with every engine."
            )
        vllm_generation = policy_only(vllm_generation_cls or vllm_generation_class())(
            model=policy,
            accelerator=accelerator,
            processing_class=tokenizer,
            **settings.vllm_generation_kwargs(accelerator.num_processes),
        )
        return VLLMEngine(vllm_generation, **common)
    if settings.engine == "continuous_batching":
        if policy is not None:  # before anything is sampled (each call checks its own settings again)
            _check_continuous_batching_sampling(settings.sampling, policy)
        return ContinuousBatching(model, config=settings.continuous_batching_config, **common)
    if settings.engine == "static_cache":
        from .static_cache import StaticCacheEngine  # its module builds on this one's engines

        return StaticCacheEngine(
            model,
            cuda_graph=settings.cuda_graph,
            compile_step=settings.compile_step,
            keep_buffers=settings.keep_buffers,
            batch_size=settings.batch_size,
            tokenizer=tokenizer,
            chosen_for_you=settings.auto,
            **common,
        )
    return TransformersGenerate(
        model,
        batch_size=settings.batch_size,
        tokenizer=tokenizer,
        pad_to_multiple_of=settings.pad_to_multiple_of,
        **common,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Custom rollouts: GRPOTrainer's `rollout_func`
# ---------------------------------------------------------------------------------------------------------------------

ROLLOUT_FUNC_KEYS = ("prompt_ids", "completion_ids", "logprobs")
"""What a `rollout_func` must return, one list per prompt it got (GRPOTrainer's contract)."""


def read_rollout_func_output(
    output: Any, num_prompts: int, stop_ids: Sequence[int], pad_id: int, keep_logprobs: bool
) -> tuple[list[list[int]], GenerationOutput, dict[str, Any]]:
    """A `rollout_func`'s output as an engine's: the prompts' token ids, the completions, and the other fields (the
    reward functions get them as columns).

    `output` holds `prompt_ids`, `completion_ids` and `logprobs` (None: none known), one list per prompt, and may hold
    `env_mask` (per completion token: 1 sampled by the policy, 0 written by an environment), which becomes
    `action_mask`. A completion is taken whole, as GRPOTrainer takes it (a multi-turn one holds stop tokens between
    its turns), and counts as truncated when its last token is no stop (or pad) token. `logprobs` become the
    sampler's log-probs where `keep_logprobs` (vLLM's importance-sampling correction, which GRPOTrainer applies with
    `use_vllm`; the off-policy mask's drift), a None among them NaN (no correction of that token, as for vLLM's).
    """
    if not isinstance(output, dict):
        raise TypeError(f"rollout_func must return a dict, got {type(output).__name__}.")
    missing = sorted(set(ROLLOUT_FUNC_KEYS) - output.keys())
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")  # GRPOTrainer's words
    fields = {key: value for key, value in output.items() if key not in ROLLOUT_FUNC_KEYS}
    env_mask = fields.pop("env_mask", None)
    # Rows of ints, as a rollout_func may give tensors or arrays (`bool(row)` of a tensor raised; a one-token
    # tensor row's last token was never `in` the stop ids: hashed by identity, the row always read truncated).
    completions = [[int(token) for token in row] for row in output["completion_ids"]]
    prompts = [[int(token) for token in row] for row in output["prompt_ids"]]

    def unpadded(row: list[int]) -> list[int]:  # a batched generate()'s row: left padding, then its prompt
        return row[next((i for i, token in enumerate(row) if token != pad_id), len(row)) :]

    if completions and all(len(p) > 1 and unpadded(c)[: len(p)] == p for p, c in zip(prompts, completions)):
        # `generate()`'s sequences (prompt, then completion) as completions: the prompt trained on as if sampled.
        raise ValueError(
            "rollout_func returned completion_ids that each begin with their prompt's ids: they must hold the "
            "completion's tokens alone, as GRPOTrainer reads them (of a `model.generate()` output, "
            "`sequences[:, prompt_length:]`)."
        )
    keep_logprobs = keep_logprobs and output["logprobs"] is not None
    per_prompt = {name: output[name] for name in ROLLOUT_FUNC_KEYS if output[name] is not None}
    if env_mask is not None:
        per_prompt["env_mask"] = env_mask
    for name, rows in per_prompt.items():
        if len(rows) != num_prompts:
            raise ValueError(
                f"rollout_func returned {len(rows)} `{name}` for the {num_prompts} prompts it got: it must return "
                "one per prompt (each prompt comes once per completion: num_generations copies in a row)."
            )
    for name, rows in (("logprobs", output["logprobs"] if keep_logprobs else None), ("env_mask", env_mask)):
        for i, (row, completion) in enumerate(zip(rows if rows is not None else [], completions)):
            if len(row) != len(completion):
                raise ValueError(
                    f"rollout_func's `{name}` for prompt {i} has {len(row)} entries for its {len(completion)} "
                    "completion tokens: it needs one per token."
                )
    ids, mask = _padded_rows(completions, pad_id, torch.long)
    width = ids.shape[1]
    action = None
    if env_mask is not None:
        action = _padded_rows([[int(bool(x)) for x in row] for row in env_mask], 0, torch.long, width)[0]
    logprobs = None
    if keep_logprobs:
        known = [[math.nan if x is None else float(x) for x in row] for row in output["logprobs"]]
        logprobs = _padded_rows(known, 0.0, torch.float32, width)[0]
    ends = set(stop_ids) | {pad_id}
    truncated = torch.tensor([len(row) > 0 and row[-1] not in ends for row in completions], dtype=torch.bool)
    sample = GenerationOutput(ids, mask.long(), truncated, logprobs, action)
    return prompts, sample, fields


# ---------------------------------------------------------------------------------------------------------------------
# Importance-sampling correction of the sampler / trainer mismatch (TRL's vllm_importance_sampling_*)
# ---------------------------------------------------------------------------------------------------------------------


def importance_sampling_metrics(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """This process's share of TRL's `sampling/*` metrics (lines 2860-2896): the mean and max |log-prob
    difference over the tokens that train (`mask`), and the min, mean and max weight (over those tokens, or their
    sequences in sequence modes: a sequence that does not train has the weight exp(0) = 1 of its masked difference).
    TRL reduces them over processes with mean / max / min."""
    delta = (trainer_logprobs - sampler_logprobs).abs()
    delta = delta[mask.bool() & ~torch.isnan(delta)]
    flat = weights[mask.bool().any(dim=-1)].flatten() if weights.shape[-1] == 1 else weights[mask.bool()]

    def stat(x, f):  # NaN without a reading: left out when the processes' values are reduced
        return f(x).item() if x.numel() else math.nan

    return {
        "sampling/sampling_logp_difference/mean": stat(delta, torch.mean),
        "sampling/sampling_logp_difference/max": stat(delta, torch.max),
        "sampling/importance_sampling_ratio/min": stat(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": stat(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": stat(flat, torch.max),
    }
