"""trl-vapo's static-cache engine: a decode loop on transformers' `StaticCache` whose step has fixed shapes and no host
synchronisation, captured as a CUDA graph on a GPU (gpt-fast's loop), sampling exactly as `generate()` does. The other
engines, and the one way to choose and build any of them (`EngineSettings`, `build_engine`), are
:mod:`trl_vapo.generation`'s."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from torch import nn

from .generation import (
    EXACT_CACHES,
    GenerationEngine,
    GenerationOutput,
    ModelProvider,
    SamplingSettings,
    TransformersGenerate,
    _inference,
    as_model_provider,
    cut_at_stop,
    in_batches,
    model_generation_settings,
)
from .modeling import _adapter_layers, is_peft_model


class StaticCacheEngine(GenerationEngine):
    """A decode loop on transformers' `StaticCache` and the model's own forward (gpt-fast's loop), exact and built to
    be captured: `use_static_cache_engine`.

    Per batch shape (rows, prompt width rounded up to `prompt_bucket`, `max_new_tokens`) every buffer is allocated
    once and reused by later calls of that shape: the cache (reset in place), the last tokens, their positions, the
    key mask over the cache, the output ids and log-probs, the finished flags and the step counter. The left-padded
    prompts are prefilled with the model's own mask; then each decode step (`_decode_step`, fixed shapes, no host
    synchronisation) feeds the last tokens, processes the logits on the device in transformers' order
    (`min_new_tokens`, temperature, top-k, top-p, min-p: transformers' own warpers), draws an exact categorical sample
    (argmax of p / E with E ~ Exp(1): the exponential race, no sort and no host read), records the token and its
    log-prob, and pads the rows that have stopped. Whether every row has stopped is read every `check_every` steps.

    Settings it cannot serve exactly (`unsupported_settings`: the repetition penalty, stop strings, generation
    keyword arguments it does not know) go to `generate()`, with one warning naming them: never a silently different
    distribution. The log-probs returned are the sampler's: log-softmax of the processed logits at the sampled token.

    Args:
        model: the causal LM (sdpa or eager attention), or a model provider.
        logprobs: also return the sampler's log-probs.
        check_every: decode steps between two reads of "have all rows stopped?" (each read waits for the device).
        prompt_bucket: prompt widths are rounded up to a multiple of this, so that rollouts share buffers.
        cuda_graph: on a CUDA device, capture the decode step as a CUDA graph (after one eager step on a side stream)
            and replay it: one launch per token instead of one per kernel. The graph is taken again when its capture
            key changes (`capture_key`: the parameters' addresses, the active adapter, autocast, training mode);
            optimizer steps update the weights in place, so the graph samples from the updated policy.
        compile_step: compile the decode step with `torch.compile` (fixed shapes, full graph, no CUDA graphs of its
            own) before it is captured or run; opt-in, and not bit-exact with the eager step (fused kernels round
            differently).
        keep_buffers: keep the buffers (the KV cache: 0.4 GiB for 64 x 530 tokens at Qwen2.5-0.5B shapes) and the
            graph for the next call of the same shape; False frees them after each call (training: the update
            between two rollouts needs the memory; the next rollout allocates and captures again).
        batch_size: prompts per static batch (None: all at once), as `generate()`'s per call: the cache is sized
            for the batch (evaluation's 200 prompts x 4 samples were one batch of 800 rows).
        tokenizer: passed to the `generate()` fallback (stop strings need it).
        chosen_for_you: the engine was a GPU's default (`EngineSettings.auto`), not named: a rollout it sends to
            `generate()` is said at INFO, not as a warning.
    """

    name = "static_cache"
    KNOWN_KWARGS = frozenset(
        {"min_new_tokens", "do_sample", "eos_token_id", "stop_token_ids", "cache_implementation", "disable_compile"}
    )
    """`generation_kwargs` it serves: the rest (stop strings, processors) go to `generate()`. Of `cache_implementation`
    the values in `EXACT_CACHES` only."""

    def __init__(
        self,
        model: nn.Module | ModelProvider,
        *,
        logprobs: bool = False,
        check_every: int = 16,
        prompt_bucket: int = 16,
        cuda_graph: bool = True,
        compile_step: bool = False,
        keep_buffers: bool = True,
        batch_size: int | None = None,
        tokenizer=None,
        chosen_for_you: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if check_every < 1 or prompt_bucket < 1:
            raise ValueError(f"check_every and prompt_bucket must be >= 1, got {check_every} and {prompt_bucket}.")
        self.model_provider = as_model_provider(model)
        self.logprobs = logprobs
        self.check_every = check_every
        self.prompt_bucket = prompt_bucket
        self.cuda_graph = cuda_graph
        self.compile_step = compile_step
        self.keep_buffers = keep_buffers
        self.batch_size = batch_size
        self.fallback = TransformersGenerate(
            model, logprobs=logprobs, tokenizer=tokenizer, batch_size=batch_size, **kwargs
        )
        self.state: DecodeState | None = None
        self._warned: set[str] = set()
        self.chosen_for_you = chosen_for_you

    @staticmethod
    def unsupported_settings(sampling: SamplingSettings, model: nn.Module) -> list[str]:
        """What this engine cannot sample exactly, each as ``name=value``: it would change the distribution."""
        unsupported = [
            f"{k}={v!r}"
            for k, v in sampling.generation_kwargs.items()
            if k not in StaticCacheEngine.KNOWN_KWARGS or (k == "cache_implementation" and v not in EXACT_CACHES)
        ]
        adapter = getattr(model, "active_peft_config", None)
        if adapter is not None and adapter.is_prompt_learning:  # virtual tokens: their own cache slots and masks
            unsupported.append(f"peft_type={adapter.peft_type.value}")
        model = _causal_lm_of(model)
        keeps_cache = getattr(type(model), "_supports_default_dynamic_cache", None)
        if keeps_cache is not None and not keeps_cache():  # RWKV's recurrent state: the cache would be ignored
            unsupported.append(f"model={type(model).__name__} (no transformers Cache)")
        if hasattr(type(model), "create_masks_for_generate"):
            # generate() has such a model build its own masks for a static cache (BLOOM's ALiBi bias reads a 2D mask
            # as long as the cache); the engine's masks are transformers' common ones: its first step failed.
            unsupported.append(f"model={type(model).__name__} (its own generation masks)")
        if sampling.repetition_penalty != 1.0:
            unsupported.append(f"repetition_penalty={sampling.repetition_penalty}")
        unsupported += model_generation_settings(sampling, model)  # what generate() takes from the model's config
        config = model.config.get_text_config()
        if getattr(config, "alibi", False) is True:  # Falcon's ALiBi bias, built from a 2D mask as wide as the keys:
            unsupported.append("alibi=True")  # the static cache's mask is wider (the first step failed)
        attention = getattr(config, "_attn_implementation", None)
        if attention not in ("sdpa", "eager"):
            unsupported.append(f"attn_implementation={attention!r}")
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:  # the key mask covers the whole cache: no sliding windows, no linear layers
            unsupported.append(f"layer_types={sorted(kinds)}")
        elif getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
            unsupported.append(f"sliding_window={config.sliding_window}")  # Mistral's, Phi-3's: no layer_types
        return unsupported

    def _generate(self, prompt_ids, sampling, num_generations):
        with self.model_provider() as model:  # entered once: under ZeRO-3 it gathers the weights
            unsupported = self.unsupported_settings(sampling, model)
            if not unsupported:
                # One prompt width for every batch of the call: the buffers and graph kept serve them all (a batch
                # whose longest prompt fell in another bucket allocated and captured anew).
                width = -(-max(map(len, prompt_ids)) // self.prompt_bucket) * self.prompt_bucket
                try:
                    ids, logprobs = in_batches(
                        prompt_ids,
                        self.batch_size,
                        lambda batch: self._decode(model, batch, sampling, width),
                        self.pad_token_id,
                        one_shape=True,
                    )
                finally:
                    if not self.keep_buffers:  # at the call's end: its batches share one shape's buffers and graph
                        self.state = None
        if unsupported:
            key = ", ".join(unsupported)
            if key not in self._warned:
                self._warned.add(key)
                import logging

                # Chosen as a GPU's default (`use_static_cache_engine=None`): generate(), the other default, is no
                # surprise to warn of; named by the user, it is.
                logging.getLogger(__name__).log(
                    logging.INFO if self.chosen_for_you else logging.WARNING,
                    f"The static-cache engine cannot sample with {key} exactly: these rollouts use generate().",
                )
            return self.fallback._generate(prompt_ids, sampling, num_generations)
        out = cut_at_stop(
            ids,
            self.stop_token_ids,
            self.pad_token_id,
            logprobs=logprobs if self.logprobs else None,
            max_new_tokens=sampling.max_new_tokens,
        )
        width = max(1, int(out.lengths.max()))  # as generate(): as wide as the longest completion
        return GenerationOutput(
            out.completion_ids[:, :width],
            out.completion_mask[:, :width],
            out.is_truncated,
            None if out.sampler_logprobs is None else out.sampler_logprobs[:, :width],
        )

    def _decode(self, model, prompt_ids, sampling, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled ids and their log-probs [N, steps run] (CPU): prefill (prompts left-padded to `width`), then
        decode steps until every row has stopped (read every `check_every` steps) or `max_new_tokens`."""
        device = next(model.parameters()).device
        # On the model's GPU: a capture (its side stream, `torch.cuda.graph`) is of the current device's stream, where
        # a model on another GPU runs its kernels eagerly, and the empty graph captured would have been replayed.
        on_its_gpu = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with _inference(model), on_its_gpu:
            state = self._state_for(model, prompt_ids, sampling, width)
            state.sample_and_record(state.prefill(model, prompt_ids, self.pad_token_id))
            capture = capture_key(model) if self.cuda_graph and state.tokens.device.type == "cuda" else None
            steps = 1
            while steps < sampling.max_new_tokens:
                if steps % self.check_every == 0 and bool(state.finished.all()):
                    break
                state.advance(model, capture)
                steps += 1
            # Copies (`.cpu()` of a CPU tensor is the tensor): the next batch of the same shape writes these buffers.
            ids = state.output_ids[:, :steps].to("cpu", copy=True)
            logprobs = state.output_logprobs[:, :steps].to("cpu", copy=True)
        # What failed once fails again (the same step): later states, one per rollout in training, do not retry it,
        # warn again or leave a failed capture's memory again.
        self.cuda_graph = self.cuda_graph and not state.capture_failed
        self.compile_step = self.compile_step and state.compiled_step is not None
        _check_finite(logprobs)
        return ids, logprobs

    def _state_for(self, model, prompt_ids, sampling, width: int) -> DecodeState:
        """This batch shape's buffers: the last call's when the shape, device, dtype and attention are the same."""
        parameter = next(model.parameters())
        autocast = torch.is_autocast_enabled(parameter.device.type) and torch.get_autocast_dtype(parameter.device.type)
        # The cache takes its dtypes from the first forward: the weights' dtype and autocast's decide them. The mask
        # is built for the attention as the buffers were (eager adds it: a bool mask after a switch masked nothing).
        attention = getattr(_causal_lm_of(model).config, "_attn_implementation", None)
        key = (len(prompt_ids), width, sampling.max_new_tokens, parameter.device, parameter.dtype, autocast, attention)
        if self.state is None or self.state.key != key:
            self.state = None  # the old cache and graph go before the new ones are allocated
            self.state = DecodeState(
                key, _causal_lm_of(model).config, self.stop_token_ids, self.pad_token_id, self.compile_step
            )
        self.state.configure(sampling)
        return self.state


def capture_key(model: nn.Module) -> tuple:
    """What a captured decode step depends on besides its buffers: the parameters' storage (a graph reads the
    addresses it was captured with; in-place optimizer steps keep them), the active adapter, what each adapter layer
    computes (`_tuner_states`), autocast and training mode. A step captured under another key is stale."""
    # A PeftModel's adapters (transformers' own `active_adapters()` raises on a model without one; its adapters'
    # layers, loaded with `load_adapter`, are in `_tuner_states`)
    adapter = getattr(model, "active_adapters", None) if is_peft_model(model) else None
    device = next(model.parameters()).device.type
    return (
        tuple(p.data_ptr() for p in model.parameters()),
        str(adapter() if callable(adapter) else adapter),
        _tuner_states(model),
        torch.is_autocast_enabled(device),
        torch.get_autocast_dtype(device),
        model.training,
    )


def _tuner_states(model: nn.Module) -> str:
    """Each adapter layer's active adapters, whether its adapters are off (peft's `disable_adapter()`), merged into
    the base, and its scaling (`set_scale`, a Python float a graph holds as captured): the step replayed the
    adapter's computation inside `disable_adapter()`, or at the old scale. A PeftModel's, or a transformers model's
    own (`load_adapter`, `set_adapter`, `disable_adapters`), which flip the same layers' flags."""
    states = [
        (
            module.active_adapters,
            module.disable_adapters,
            getattr(module, "merged", None),  # (a `modules_to_save` wrapper merges nothing)
            sorted(getattr(module, "scaling", {}).items()),
        )
        for module in _adapter_layers(model)
    ]
    return repr(states)


def _allocate_keys_and_values(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """A `StaticLayer`'s first update: its buffers, the values' in the values' own dtype. transformers allocates both
    in the keys' dtype, which fails under autocast for float32 weights (full fine-tuning in bf16): the keys leave
    RoPE in float32 (bf16 projection times float32 cos/sin) while the values leave their projection in bf16, and
    `index_copy_` refuses a mixed pair. `generate()`'s dynamic cache keeps each as it comes, and so does this one
    (attention under autocast casts both to bf16 either way)."""
    type(layer).lazy_initialization(layer, key_states, value_states)
    # (the instance's override, a method bound to the layer, was a reference cycle: the cache went with the engine's
    # state only when Python's cycle collector next ran, after the update it was let go to make room for)
    del layer.lazy_initialization
    if layer.values.dtype != value_states.dtype:
        layer.values = torch.zeros_like(layer.values, dtype=value_states.dtype)
        torch._dynamo.mark_static_address(layer.values)  # as transformers marks its own: a fixed address to capture


def _causal_lm_of(model: nn.Module) -> nn.Module:
    """The module holding the config (a PeftModel's base model has the same config)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _autocast_without_cache() -> contextlib.AbstractContextManager:
    """The CUDA autocast in force, with its cast cache off."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def _check_finite(logprobs: torch.Tensor) -> None:
    """An error where a sampled token's log-prob is NaN or infinite: the logits it was drawn from were (a finished
    row's are 0). The sampler's argmax then picks token 0 from them, and the rollout would train on such tokens;
    `generate()`'s `torch.multinomial` stops there. Read from the host copy the results make anyway: no extra sync."""
    bad = (~torch.isfinite(logprobs)).nonzero()
    if len(bad):
        row, step = bad[0].tolist()
        raise RuntimeError(
            f"The policy's logits are NaN or infinite (sequence {row}, token {step}; {len(bad)} tokens in all): "
            "nothing can be sampled from them. The weights have likely diverged (a NaN in an update) or float16 "
            "overflowed: compute in bfloat16 or float32, or resume from an earlier checkpoint."
        )


class DecodeState:
    """The buffers of one batch shape and the step that updates them in place (see `StaticCacheEngine`)."""

    def __init__(self, key: tuple, config, stop_ids: Sequence[int], pad_id: int, compile_step: bool = False):
        from transformers import StaticCache

        rows, width, max_new_tokens, device = key[:4]
        self.key, self.width, self.max_new_tokens, self.pad_id = key, width, max_new_tokens, pad_id
        self.cache = StaticCache(config=config, max_cache_len=width + max_new_tokens)
        for layer in self.cache.layers:  # keys and values each in their own dtype, as generate()'s cache keeps them
            layer.lazy_initialization = _allocate_keys_and_values.__get__(layer)
        self.eager = getattr(config, "_attn_implementation", None) == "eager"
        long = {"dtype": torch.long, "device": device}
        self.tokens = torch.full((rows, 1), pad_id, **long)  # the last sampled tokens, the next step's input
        self.positions = torch.zeros((rows, 1), **long)  # their position ids
        self.slot = torch.zeros((1,), **long)  # the cache slot they are written to (= width + step - 1)
        self.step = torch.zeros((1,), **long)  # tokens sampled so far
        self.key_mask = torch.zeros((rows, width + max_new_tokens), dtype=torch.bool, device=device)
        self.output_ids = torch.full((rows, max_new_tokens), pad_id, **long)
        self.output_logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
        self.finished = torch.zeros((rows,), dtype=torch.bool, device=device)
        self.stop_ids = torch.tensor(list(stop_ids), **long)
        self.min_new_tokens = torch.zeros((), **long)
        self.stop_columns: torch.Tensor | None = None  # [vocabulary] bool, the stop ids' columns of the logits
        self.warpers: list = []
        self.greedy = True
        # Fixed shapes, one graph, and no CUDA graphs of its own (`advance` captures it).
        self.compiled_step = (
            torch.compile(type(self).decode_step, dynamic=False, fullgraph=True) if compile_step else None
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_key: tuple | None = None
        self.sampling_signature: tuple | None = None  # the settings `configure` built the warpers from
        self.warmed_up = False
        self.capturing = False  # within `advance`'s capture: a failure there is the capture's
        self.capture_failed = False

    def configure(self, sampling: SamplingSettings) -> None:
        """transformers' warpers for these settings, in `generate()`'s order (`_get_logits_processor`)."""
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        signature = (sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
        if signature != self.sampling_signature:  # a captured step holds the last settings' warpers: take it again
            self.graph, self.sampling_signature = None, signature
            self.warmed_up = False  # (after a warm-up: a compiled step compiles for the new warpers there, not in it)
        self.greedy = sampling.greedy
        self.min_new_tokens.fill_(int(sampling.generation_kwargs.get("min_new_tokens") or 0))
        warpers = []
        if not self.greedy:
            if sampling.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k:
                warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
            if sampling.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
            if sampling.min_p is not None:
                warpers.append(MinPLogitsWarper(min_p=sampling.min_p))
        self.warpers = warpers

    def prefill(self, model: nn.Module, prompt_ids: list[list[int]], pad_id: int) -> torch.Tensor:
        """Reset every buffer in place, run the left-padded prompts through the model with its own mask (as
        `generate()`'s first step), and return the last position's logits."""
        device = self.tokens.device
        ids = torch.full((len(prompt_ids), self.width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompt_ids), self.width), dtype=torch.long)
        for row, prompt in enumerate(prompt_ids):
            if prompt:
                ids[row, -len(prompt) :] = torch.tensor(prompt)
                mask[row, -len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        self.cache.reset()
        self.key_mask.zero_()
        self.key_mask[:, : self.width] = mask.bool()
        self.output_ids.fill_(self.pad_id)
        self.output_logprobs.zero_()
        self.finished.zero_()
        self.step.zero_()
        self.slot.fill_(self.width)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # generate()'s at the tokens (no pad is read)
        self.positions.copy_(mask.sum(-1, keepdim=True))  # the first generated token's position
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        return logits[:, -1]

    def advance(self, model: nn.Module, capture: tuple | None) -> None:
        """One decode step: eager without a capture key; else the captured graph's replay, capturing it first when
        there is none for this key (after one eager warm-up step on a side stream, which keeps lazy initialisations
        out of the capture)."""
        if capture is None or self.capture_failed:
            self._step(model)
        elif self.graph is not None and self.graph_key == capture:
            self.graph.replay()
        elif not self.warmed_up or self.graph_key not in (None, capture):
            # Under the capture's autocast (without its cache, below): a compiled step guards on the cache's setting
            # and would otherwise compile again inside the capture, where a new kernel's first launch cannot run.
            self.graph = None  # a stale graph's memory goes first
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with _autocast_without_cache(), torch.cuda.stream(side):
                self._step(model)
            torch.cuda.current_stream().wait_stream(side)
            self.warmed_up, self.graph_key = True, None
        else:
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
            try:
                # Autocast's cache would hand the capture casts made before it, which a replay never refreshes.
                # "thread_local": a CUDA call of another thread meanwhile (a DataLoader's pin-memory thread) neither
                # breaks the capture nor raises there (the default, "global", does both; transformers' continuous
                # batching captures so too).
                self.capturing = True
                with _autocast_without_cache(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self._step(model)
            except Exception as error:  # nothing ran: capture records kernels without running them
                import logging

                # torch.cuda.graph's exit ends the capture before it restores the stream, and a failed capture
                # raises there: its capture stream would stay current for the rest of the run.
                torch.cuda.set_stream(stream)
                self.capture_failed = True
                logging.getLogger(__name__).warning(
                    f"The decode step could not be captured as a CUDA graph ({type(error).__name__}: {error}); it "
                    "runs eagerly from here on."
                )
                self._step(model)
                return
            finally:
                self.capturing = False
            self.graph, self.graph_key = graph, capture
            graph.replay()

    def _step(self, model: nn.Module) -> None:
        if self.compiled_step is not None:
            try:
                self.compiled_step(self, model)
                return
            except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as error:
                # torch.compile failed before the step ran (a graph break, a backend error, or its recompile limit,
                # 8 shapes: prompt-width buckets, evaluation's settings): the step runs as written from here on.
                if self.capturing:  # the capture's failure (`advance`), then this again outside it
                    raise
                import logging

                logging.getLogger(__name__).warning(
                    f"The decode step could not be compiled ({type(error).__name__}: {str(error)[:300]}); it runs "
                    "uncompiled from here on."
                )
                self.compiled_step = None
        self.decode_step(model)

    def decode_step(self, model: nn.Module) -> None:
        """One token for every row, fixed shapes, no host synchronisation: the step a CUDA graph can capture."""
        self.key_mask.index_fill_(1, self.slot, True)  # the slot the fed token's keys go to
        mask = self.key_mask[:, None, None, :]
        if self.eager:  # eager attention adds its mask: 0 where attended, the dtype's minimum elsewhere
            dtype = self.cache.layers[0].keys.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        logits = model(
            input_ids=self.tokens,
            attention_mask=mask,
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
        ).logits
        self.sample_and_record(logits[:, -1])
        self.positions.add_(1)
        self.slot.add_(1)

    def sample_and_record(self, logits: torch.Tensor) -> None:
        """Process the logits, draw the next tokens, record them and their log-probs at column `step`."""
        scores = logits.float()
        if self.stop_columns is None or self.stop_columns.shape[0] != scores.shape[-1]:
            self.stop_columns = torch.isin(torch.arange(scores.shape[-1], device=scores.device), self.stop_ids)
        too_early = (self.step < self.min_new_tokens) & self.stop_columns
        scores = scores.masked_fill(too_early, -math.inf)  # transformers' MinNewTokensLengthLogitsProcessor
        for warper in self.warpers:
            scores = warper(None, scores)
        if self.greedy:
            tokens = scores.argmax(dim=-1)
        else:  # the exponential race: argmax p / E, E ~ Exp(1), is a draw from p
            probs = scores.softmax(dim=-1)
            tokens = (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)
        logprobs = scores.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        tokens = tokens.masked_fill(self.finished, self.pad_id)
        logprobs = logprobs.masked_fill(self.finished, 0.0)
        self.output_ids.index_copy_(1, self.step, tokens[:, None])
        self.output_logprobs.index_copy_(1, self.step, logprobs[:, None])
        self.finished |= torch.isin(tokens, self.stop_ids)
        self.tokens.copy_(tokens[:, None])
        self.step.add_(1)
