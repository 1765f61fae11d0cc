"""The static-cache engine (`trl_vapo.static_cache.StaticCacheEngine`): exact against `generate()` and the trainer's
log-probs, its buffers fixed across steps and rollouts, and its decode step traceable as one graph.

CUDA graphs cannot be captured here (no GPU): `torch.compile(..., fullgraph=True, backend="eager")` tracing the decode
step without a graph break stands in for "capturable" on the CPU, and the greedy equality runs on a CUDA GPU too
under `-m cuda` (`benchmarks/gpu_suite.py`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import types

import pytest
import torch
from helpers import (
    GREEDY,
    TEXT_PROMPTS,
    digit_fraction,
    make_args,
    peft_actor_critic,
    prompts_dataset,
    rl_logs,
    token_ids,
    trainer_logprobs,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_vapo import VAPOTrainer
from trl_vapo.generation import (
    EngineSettings,
    SamplingSettings,
    TransformersGenerate,
    build_engine,
    stop_token_ids,
)
from trl_vapo.static_cache import StaticCacheEngine


def _engines(model, tokenizer, stops, **kwargs):
    common = {"pad_token_id": tokenizer.pad_token_id, "stop_token_ids": stops, "logprobs": True}
    return TransformersGenerate(model, **common), StaticCacheEngine(model, **common, **kwargs)


@pytest.mark.parametrize("which", ["tiny", "tiny-lora", "demo", "tiny-eager", "tiny-bf16-autocast"])
def test_greedy_completions_and_logprobs_equal_generate(which, tiny, tiny_model_dir, device):
    """Ragged left-padded prompts, stop tokens that end some rows early (`check_every` 3: rows go on, padded, past
    their stop), the trainer's PEFT policy with its critic adapter alongside, the demo's model and chat prompts,
    eager attention's additive mask, and float32 weights under bf16 autocast (full fine-tuning with `bf16=True`:
    the keys reach the cache in float32, the values in bf16; a cache of one dtype failed on the first step)."""
    model, tokenizer = tiny
    prompts, sampling = token_ids(tokenizer, TEXT_PROMPTS), GREEDY
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list("e "))]
    if which == "tiny-lora":
        torch.manual_seed(0)  # the LoRA A matrices' initialisation
        model = peft_actor_critic(tiny_model_dir).policy
    elif which == "tiny-eager":
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    elif which == "demo":
        from trl_vapo.data import prompt_token_ids
        from trl_vapo.demo import MODEL_DIR
        from trl_vapo.demo.data import build_split

        model, tokenizer = AutoModelForCausalLM.from_pretrained(MODEL_DIR), AutoTokenizer.from_pretrained(MODEL_DIR)
        prompts = prompt_token_ids(tokenizer, list(build_split("held_out", 6)["prompt"]), conversational=True)
        sampling, stops = SamplingSettings(max_new_tokens=96, temperature=0.0), stop_token_ids(tokenizer, model)
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    generate, static = _engines(model, tokenizer, stops, check_every=3)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=which == "tiny-bf16-autocast")
    with autocast:
        expected, got = generate.generate(prompts, sampling=sampling), static.generate(prompts, sampling=sampling)
    assert static.state is not None  # its own decode loop ran, not its fallback (generate(), the expected side)
    assert got.completion_lists() == expected.completion_lists()
    assert (
        torch.equal(got.is_truncated, expected.is_truncated)
        and got.completion_ids.shape == expected.completion_ids.shape
    )
    if which == "demo":
        assert (~got.is_truncated).all()  # every answer ended at EOS
    elif which != "tiny-lora":
        assert (~got.is_truncated).any() and got.is_truncated.any()  # some rows stopped early, some ran out
    mask = expected.completion_mask.bool()
    got_logprobs, expected_logprobs = got.sampler_logprobs[mask], expected.sampler_logprobs[mask]
    if which == "tiny-bf16-autocast":
        # bf16 attention over the static cache's padded slots sums in another order than over the dynamic cache's:
        # nearly all log-probs agree to 2e-4, and a bf16 activation rounded to its neighbour moves a log-prob by a few
        # thousandths (the earlier development CPU: up to 9e-5 apart; an AVX2-only one: 0.0038 at one of 121 tokens).
        difference = (got_logprobs - expected_logprobs).abs()
        assert (difference <= 2e-4).float().mean() >= 0.95 and difference.max() <= 2**-6, difference.max()
    else:
        torch.testing.assert_close(got_logprobs, expected_logprobs, atol=1e-5, rtol=0)  # float32


def test_min_new_tokens_holds_the_stop_tokens_back_as_generate_does(tiny):
    """The stop ids are the greedy first tokens: without `min_new_tokens` every row would stop at once; with 6, none
    stops before its seventh token, as with `generate()`."""
    model, tokenizer = tiny
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    _, probe = _engines(model, tokenizer, [tokenizer.eos_token_id])
    stops = sorted({row[0] for row in probe.generate(prompts, sampling=GREEDY).completion_lists()})
    generate, static = _engines(model, tokenizer, stops)
    assert (static.generate(prompts, sampling=GREEDY).lengths == 1).all()
    sampling = SamplingSettings(max_new_tokens=12, temperature=0.0, generation_kwargs={"min_new_tokens": 6})
    got = static.generate(prompts, sampling=sampling)
    assert got.completion_lists() == generate.generate(prompts, sampling=sampling).completion_lists()
    assert (got.lengths >= 7).all()


def test_sampled_logprobs_are_the_trainers_teacher_forced_logprobs(tiny):
    """Sampling at T=0.7: the returned log-probs are log-softmax(logits / T) at the sampled tokens, as the trainer
    computes them on the finished sequences (to 1e-5)."""
    model, tokenizer = tiny
    engine = StaticCacheEngine(
        model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id], logprobs=True
    )
    prompts = token_ids(tokenizer, TEXT_PROMPTS) * 2
    torch.manual_seed(1)
    out = engine.generate(prompts, sampling=SamplingSettings(max_new_tokens=12, temperature=0.7))
    assert len(set(map(tuple, out.completion_lists()))) > len(TEXT_PROMPTS)  # sampled, not greedy
    trainer = trainer_logprobs(model, tokenizer, prompts, out, temperature=0.7)
    mask = out.completion_mask.bool()
    torch.testing.assert_close(out.sampler_logprobs[mask], trainer[mask], atol=1e-5, rtol=0)
    torch.manual_seed(1)
    assert engine.generate(
        prompts, sampling=SamplingSettings(max_new_tokens=12, temperature=0.7)
    ).completion_lists() == (out.completion_lists())  # seeded
    # generate() with the same seed samples the same completions (benchmarks/README says so): one draw per row and
    # step from the same generator, `multinomial`'s one sample being the race of exponentials the engine runs.
    torch.manual_seed(1)
    generate = TransformersGenerate(
        model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id], logprobs=True
    )
    sampled = generate.generate(prompts, sampling=SamplingSettings(max_new_tokens=12, temperature=0.7))
    assert sampled.completion_lists() == out.completion_lists()


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(temperature=0.9, top_p=0.8),
        dict(temperature=1.0, min_p=0.05),
        dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.02),
    ],  # (greedy: no processor on either side; its decoding equals generate()'s in the tests above)
)
def test_processed_logits_equal_transformers_processors(tiny, settings):
    """On random logits, the engine's processing equals the processors `generate()` builds for the same settings
    (`model._get_logits_processor`, transformers' order)."""
    from trl_vapo.static_cache import DecodeState

    model, tokenizer = tiny
    sampling = SamplingSettings(max_new_tokens=4, **settings)
    config = sampling.generation_config([tokenizer.eos_token_id], tokenizer.pad_token_id)
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=3, encoder_input_ids=None, prefix_allowed_tokens_fn=None,
        logits_processor=None, device="cpu",
    )  # fmt: skip
    state = DecodeState((8, 4, 4, torch.device("cpu"), torch.float32), model.config, [2], 0)
    state.configure(sampling)
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(8, 50, generator=generator)
    expected = processors(torch.zeros(8, 3, dtype=torch.long), logits.clone())
    got = logits.clone()
    for warper in state.warpers:
        got = warper(None, got)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert state.greedy == sampling.greedy
    # The step's own use of them (`sample_and_record`, what a decode step runs): tokens drawn where the processed
    # logits allow, recorded with their log-probs under them.
    torch.manual_seed(0)
    state.sample_and_record(logits.clone())
    drawn, logprobs = state.output_ids[:, 0], state.output_logprobs[:, 0]
    expected_logprobs = expected.log_softmax(-1).gather(-1, drawn[:, None]).squeeze(-1)
    assert torch.isfinite(expected_logprobs).all()
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-6)


def test_first_tokens_follow_the_softmax_chi_square(tiny):
    """4,000 first tokens of one prompt at T=0.25 against softmax(logits / T): Pearson's chi-square over the tokens
    expected at least 5 times (the rest pooled), below the 0.999 quantile (Wilson-Hilferty's approximation)."""
    model, tokenizer = tiny
    prompt = token_ids(tokenizer, ["ab"])[0]
    engine = StaticCacheEngine(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id])
    torch.manual_seed(0)
    n = 4000
    first = engine.generate([prompt] * n, sampling=SamplingSettings(max_new_tokens=1, temperature=0.25))
    with torch.no_grad():
        probs = (model(torch.tensor([prompt])).logits[0, -1] / 0.25).softmax(-1).double()
    counts = torch.bincount(first.completion_ids[:, 0], minlength=probs.shape[0]).double()
    expected = n * probs
    big = expected >= 5
    observed, expected = counts[big], expected[big]
    if not big.all():  # the rare tokens pooled into one bin
        observed = torch.cat([observed, counts[~big].sum()[None]])
        expected = torch.cat([expected, n * probs[~big].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    assert big.sum() >= 5  # a distribution with several likely tokens, so the test has power
    dof = len(observed) - 1
    quantile = dof * (1 - 2 / (9 * dof) + 3.0902 * math.sqrt(2 / (9 * dof))) ** 3  # z = 3.0902 at 0.999
    assert statistic < quantile, (statistic, quantile)


@pytest.mark.parametrize("greedy", [True, False])
def test_logits_that_are_not_finite_are_an_error_not_token_0(tiny, greedy):
    """Sampled from NaN logits, the exponential race's argmax is token 0 and decoding went on: a rollout of token 0s,
    scored and trained on. `generate()`'s sampler stops there; so does this engine, naming what it met."""
    model, tokenizer = tiny
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.get_output_embeddings().weight[5].fill_(math.nan)  # one vocabulary row: every logit vector has a NaN
    engine = StaticCacheEngine(broken, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id])
    sampling = SamplingSettings(max_new_tokens=4, temperature=0.0 if greedy else 1.0)
    with pytest.raises(RuntimeError, match=r"logits are NaN or infinite \(sequence 0, token 0; \d+ tokens in all\)"):
        engine.generate(token_ids(tokenizer, ["ab", "cd"]), sampling=sampling)
    if not greedy:
        with pytest.raises(RuntimeError, match="probability tensor contains"):  # generate() refuses them too
            TransformersGenerate(
                broken, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id]
            ).generate(token_ids(tokenizer, ["ab"]), sampling=sampling)


def test_buffers_keep_their_addresses_across_steps_and_rollouts(tiny):
    model, tokenizer = tiny
    engine = StaticCacheEngine(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id])
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    sampling = SamplingSettings(max_new_tokens=10, temperature=1.0)

    def addresses():
        state = engine.state
        tensors = [state.tokens, state.positions, state.slot, state.step, state.key_mask, state.output_ids]
        tensors += [state.output_logprobs, state.finished]
        tensors += [t for layer in state.cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
        return [t.data_ptr() for t in tensors]

    engine.generate(prompts, sampling=sampling)
    first = addresses()
    seen = []
    step = type(engine.state).decode_step

    def recording(state, model):
        step(state, model)
        seen.append(addresses())

    type(engine.state).decode_step = recording
    try:
        engine.generate(list(reversed(prompts)), sampling=sampling)  # the same shape: the same buffers
    finally:
        type(engine.state).decode_step = step
    assert len(seen) == 9 and all(a == first for a in seen)
    engine.generate(prompts[:2], sampling=sampling)  # another shape: new buffers, the old ones released
    assert engine.state.key[0] == 2


def test_the_decode_step_traces_as_one_graph(tiny):
    """The CPU proxy for "capturable as a CUDA graph": dynamo traces the whole step (the model's forward on the static
    cache, processing, the draw, the in-place updates) with fullgraph=True, and the traced step continues the rollout
    exactly as the eager step does."""
    model, tokenizer = tiny
    engine = StaticCacheEngine(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id])
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    sampling = SamplingSettings(max_new_tokens=8, temperature=0.0)
    expected = engine.generate(prompts, sampling=sampling).completion_lists()
    step = type(engine.state).decode_step
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager", dynamic=False)
    type(engine.state).decode_step = compiled
    try:
        got = engine.generate(prompts, sampling=sampling).completion_lists()
    finally:
        type(engine.state).decode_step = step
        torch._dynamo.reset()
    assert got == expected


def test_a_weight_update_and_the_lora_policy_are_seen_by_the_next_rollout(tiny_model_dir):
    """The engine reads the live weights: after an in-place update of the policy adapter (what an optimizer step
    does), the next rollout is the updated policy's (equal to generate() on it, different from before)."""
    policy = peft_actor_critic(tiny_model_dir).policy
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generate, static = _engines(policy, tokenizer, [tokenizer.eos_token_id])
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    before = static.generate(prompts, sampling=GREEDY)
    assert static.state is not None  # its own decode loop ran on the LoRA policy, not its fallback (generate())
    assert before.completion_lists() == generate.generate(prompts, sampling=GREEDY).completion_lists()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B.default" in name:
                param.add_(0.5 * torch.randn_like(param))
    after = static.generate(prompts, sampling=GREEDY)
    assert after.completion_lists() == generate.generate(prompts, sampling=GREEDY).completion_lists()
    assert after.completion_lists() != before.completion_lists()


def test_a_capture_is_stale_where_an_adapter_computes_otherwise(tiny):
    """The key a captured step is replayed under (CUDA only: the graph itself runs in the `-m cuda` tests) changes
    where the adapters compute otherwise: off inside `disable_adapter()`, merged, at another scale. The step replayed
    the adapter's computation there (an engine keeping its buffers outside the trainer, which recaptures each
    rollout)."""
    from peft import LoraConfig, get_peft_model

    from trl_vapo.static_cache import capture_key

    model = get_peft_model(copy.deepcopy(tiny[0]), LoraConfig(r=2, target_modules=["q_proj"]))
    key = capture_key(model)
    assert capture_key(model) == key
    with model.disable_adapter():
        assert capture_key(model) != key
    assert capture_key(model) == key
    from peft.helpers import rescale_adapter_scale

    with rescale_adapter_scale(model, 0.5):  # each layer's scaling, a Python float
        assert capture_key(model) != key
    assert capture_key(model) == key
    model.merge_adapter()
    assert capture_key(model) != key


def test_a_transformers_models_own_adapters_are_in_the_capture_key(tiny):
    """Adapters attached with transformers' own API (`add_adapter`, `load_adapter`) on a plain model: `set_adapter`
    and `disable_adapters` flip their layers' flags and keep every parameter's address, and the key (read from a
    PeftModel's alone) did not change: a kept graph replayed the adapter it was captured with."""
    from peft import LoraConfig

    from trl_vapo.static_cache import capture_key

    model = copy.deepcopy(tiny[0])
    for name in ("a", "b"):
        model.add_adapter(LoraConfig(r=2, target_modules=["q_proj"]), adapter_name=name)
    model.set_adapter("a")
    key = capture_key(model)
    model.set_adapter("b")
    assert capture_key(model) != key
    model.set_adapter("a")
    assert capture_key(model) == key
    model.disable_adapters()
    assert capture_key(model) != key


def test_buffers_built_for_one_attention_are_not_reused_for_another(tiny_model_dir, tiny):
    """The buffers were kept across a switch of the attention (`set_attn_implementation`): eager attention adds its
    mask, and the bool mask built for sdpa added 1 or 0, masking nothing (the pads and empty slots attended)."""
    tokenizer = tiny[1]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    generate, static = _engines(model, tokenizer, [tokenizer.eos_token_id])
    static.generate(prompts, sampling=GREEDY)
    model.set_attn_implementation("eager")
    got, expected = (engine.generate(prompts, sampling=GREEDY) for engine in (static, generate))
    assert static.state.eager
    assert got.completion_lists() == expected.completion_lists()
    torch.testing.assert_close(got.sampler_logprobs, expected.sampler_logprobs, rtol=1e-5, atol=1e-6)


def test_every_batch_of_a_call_has_the_calls_shape(tiny):
    """Each batch's prompt width was its own longest prompt's (rounded up to `prompt_bucket`): batches of one call
    allocated buffers (and on a GPU captured a graph) anew whenever their longest prompts fell in other buckets."""
    model, tokenizer = tiny
    prompts = sorted(token_ids(tokenizer, TEXT_PROMPTS), key=len, reverse=True)  # the longest in the first batch
    assert len(prompts[0]) > max(map(len, prompts[4:]))
    _, whole = _engines(model, tokenizer, [tokenizer.eos_token_id], prompt_bucket=1)
    _, batched = _engines(model, tokenizer, [tokenizer.eos_token_id], prompt_bucket=1, batch_size=4)
    made = []
    original = batched._state_for

    def state_for(*args):
        state = original(*args)
        made.append(state) if not made or made[-1] is not state else None
        return state

    batched._state_for = state_for
    assert batched.generate(prompts, sampling=GREEDY).completion_lists() == (
        whole.generate(prompts, sampling=GREEDY).completion_lists()
    )
    assert len(made) == 1 and made[0].width == len(prompts[0])


def test_greedy_stays_greedy_whatever_generation_kwargs_say(tiny):
    """temperature 0 with `generation_kwargs={"do_sample": True}`: generate() sampled (at the model's temperature,
    top-k 50) where this engine and vLLM decode greedily."""
    model, tokenizer = tiny
    sampling = SamplingSettings(max_new_tokens=8, temperature=0.0, generation_kwargs={"do_sample": True})
    assert sampling.generation_config([tokenizer.eos_token_id], tokenizer.pad_token_id).do_sample is False
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    generate, static = _engines(model, tokenizer, [tokenizer.eos_token_id])
    torch.manual_seed(0)
    assert generate.generate(prompts, sampling=sampling).completion_lists() == (
        static.generate(prompts, sampling=sampling).completion_lists()
    )


def test_batch_size_sizes_the_static_batch(tiny):
    """`batch_size` prompts a static batch, as generate()'s per call (evaluation's prompts x k samples were one batch,
    its cache sized for all of them): the same greedy completions, a cache of at most that many rows."""
    model, tokenizer = tiny
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    _, whole = _engines(model, tokenizer, [tokenizer.eos_token_id])
    _, batched = _engines(model, tokenizer, [tokenizer.eos_token_id], batch_size=4)
    assert len(prompts) == 6  # a batch of 4, then one of 2 filled up to 4 (one shape: the kept buffers serve both)
    expected = whole.generate(prompts, sampling=GREEDY)
    got = batched.generate(prompts, sampling=GREEDY)
    assert got.completion_lists() == expected.completion_lists()
    torch.testing.assert_close(got.sampler_logprobs, expected.sampler_logprobs, rtol=1e-5, atol=1e-6)
    assert whole.state.tokens.shape[0] == len(prompts) and batched.state.tokens.shape[0] == 4


def test_the_cache_is_freed_with_the_state_without_waiting_for_the_cycle_collector(tiny):
    """The engine lets its state go between rollouts to make room for the update: its keys and values must go then,
    not when Python's cycle collector next runs (each layer held itself through a bound method)."""
    import gc
    import weakref

    model, tokenizer = tiny
    _, static = _engines(model, tokenizer, [tokenizer.eos_token_id], keep_buffers=True)
    static.generate(token_ids(tokenizer, TEXT_PROMPTS), sampling=GREEDY)
    buffers = [weakref.ref(t) for layer in static.state.cache.layers for t in (layer.keys, layer.values)]
    gc.disable()
    try:
        static.state = None
        assert buffers and all(ref() is None for ref in buffers)
    finally:
        gc.enable()


def test_a_step_torch_compile_cannot_compile_runs_as_written_with_one_warning(tiny, caplog, monkeypatch):
    """`compile_step=True` where dynamo gives up (its recompile limit, 8 shapes: prompt-width buckets times the
    evaluation's settings; a graph break; a backend error): the rollout goes on with the step as written, exactly,
    says so once, and later rollouts do not compile again. A stand-in for `torch.compile` raises dynamo's own
    exception on the first call, as the compiled step does when the limit is hit (inductor's real compile of the step
    takes minutes on this CPU; the compiled step itself runs under `-m cuda`)."""
    model, tokenizer = tiny
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    sampling = SamplingSettings(max_new_tokens=8, temperature=0.0)
    compiles = []

    def give_up(fn, **options):
        compiles.append(options)

        def compiled(*args):
            raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")

        return compiled

    expected = _engines(model, tokenizer, [tokenizer.eos_token_id])[1].generate(prompts, sampling=sampling)
    monkeypatch.setattr(torch, "compile", give_up)
    _, static = _engines(model, tokenizer, [tokenizer.eos_token_id], compile_step=True, keep_buffers=False)
    with caplog.at_level(logging.WARNING, logger="trl_vapo.static_cache"):
        got = [static.generate(prompts, sampling=sampling) for _ in range(2)]
    assert all(g.completion_lists() == expected.completion_lists() for g in got)
    assert all(torch.equal(g.sampler_logprobs, expected.sampler_logprobs) for g in got)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("The decode step could not be compiled (FailOnRecompile")
    assert len(compiles) == 1 and static.compile_step is False  # the second rollout's state compiled nothing


def test_settings_it_cannot_serve_go_to_generate_with_one_warning(tiny, caplog):
    model, tokenizer = tiny
    generate, static = _engines(model, tokenizer, [tokenizer.eos_token_id])
    sampling = SamplingSettings(max_new_tokens=8, temperature=0.0, repetition_penalty=1.3)
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    with caplog.at_level(logging.WARNING, logger="trl_vapo.generation"):
        got = [static.generate(prompts, sampling=sampling) for _ in range(2)]
    assert [r.getMessage() for r in caplog.records].count(
        "The static-cache engine cannot sample with repetition_penalty=1.3 exactly: these rollouts use generate()."
    ) == 1
    assert got[0].completion_lists() == generate.generate(prompts, sampling=sampling).completion_lists()
    assert static.state is None  # the engine's own loop never ran
    # Chosen as a GPU's default, not named: generate(), the other default, is said at INFO, not warned of.
    chosen = build_engine(
        EngineSettings(engine="static_cache", sampling=sampling, auto=True), model, tokenizer, policy=model
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trl_vapo.static_cache"):
        chosen.generate(prompts, sampling=sampling)
    assert [r.levelno for r in caplog.records if "cannot sample with" in r.getMessage()] == [logging.INFO]
    stop_strings = SamplingSettings(max_new_tokens=8, generation_kwargs={"stop_strings": ["e"]})
    assert StaticCacheEngine.unsupported_settings(stop_strings, model) == ["stop_strings=['e']"]
    # Another KV cache than its own (a quantized one's values differ): accepted, and sampled without, silently.
    for cache, refused in (("quantized", ["cache_implementation='quantized'"]), ("static", []), ("dynamic", [])):
        cached = SamplingSettings(max_new_tokens=8, generation_kwargs={"cache_implementation": cache})
        assert StaticCacheEngine.unsupported_settings(cached, model) == refused
    sliding = copy.deepcopy(model)
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    assert StaticCacheEngine.unsupported_settings(GREEDY, sliding) == [
        "layer_types=['full_attention', 'sliding_attention']"
    ]
    from peft import PromptTuningConfig, get_peft_model

    # Prompt learning's virtual tokens take cache slots and mask columns of their own: the first decode step failed.
    prompted = get_peft_model(copy.deepcopy(model), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert StaticCacheEngine.unsupported_settings(GREEDY, prompted) == ["peft_type=PROMPT_TUNING"]
    generate, static = _engines(prompted, tokenizer, [tokenizer.eos_token_id])
    assert static.generate(prompts, sampling=GREEDY).completion_lists() == (
        generate.generate(prompts, sampling=GREEDY).completion_lists()
    )
    assert static.state is None  # generate() sampled: the engine's own loop never ran
    windowed = copy.deepcopy(model)  # Mistral's and Phi-3's configs name a window but no layer_types
    windowed.config.sliding_window = 4096
    assert StaticCacheEngine.unsupported_settings(GREEDY, windowed) == ["sliding_window=4096"]
    # A model that keeps no transformers Cache (RWKV's recurrent state): its forward ignored the engine's cache, which
    # the engine then read empty (an AttributeError mid-rollout); it samples with generate().
    from transformers import RwkvConfig, RwkvForCausalLM

    shape = dict(hidden_size=16, num_hidden_layers=2, attention_hidden_size=16, intermediate_size=32)
    recurrent = RwkvForCausalLM(RwkvConfig(vocab_size=model.config.vocab_size, context_length=64, **shape))
    expected = ["model=RwkvForCausalLM (no transformers Cache)"]
    assert StaticCacheEngine.unsupported_settings(GREEDY, recurrent) == expected
    generate, static = _engines(recurrent, tokenizer, [tokenizer.eos_token_id])
    assert static.generate(prompts, sampling=GREEDY).completion_lists() == (
        generate.generate(prompts, sampling=GREEDY).completion_lists()
    )
    assert static.state is None  # generate() sampled: the engine's own loop never ran
    # A model that builds its own masks for generate() (`create_masks_for_generate`): BLOOM's ALiBi bias, built from a
    # 2D mask as long as the cache, failed in the engine's first step (a bias as wide as the prompt).
    from transformers import BloomConfig, BloomForCausalLM

    alibi = BloomForCausalLM(BloomConfig(vocab_size=model.config.vocab_size, hidden_size=16, n_layer=2, n_head=2))
    expected = ["model=BloomForCausalLM (its own generation masks)"]
    assert StaticCacheEngine.unsupported_settings(GREEDY, alibi) == expected
    generate, static = _engines(alibi.eval(), tokenizer, [tokenizer.eos_token_id])
    assert static.generate(prompts, sampling=GREEDY).completion_lists() == (
        generate.generate(prompts, sampling=GREEDY).completion_lists()
    )
    assert static.state is None  # generate() sampled: the engine's own loop never ran
    # Falcon's ALiBi (`alibi=True`, falcon-rw), with transformers' common masks: the bias, as wide as the prompt, met
    # the static cache's mask in the first step (a RuntimeError of tensor sizes mid-rollout).
    from transformers import FalconConfig, FalconForCausalLM

    falcon = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, new_decoder_architecture=False)
    falcon = FalconForCausalLM(FalconConfig(vocab_size=model.config.vocab_size, alibi=True, **falcon)).eval()
    assert StaticCacheEngine.unsupported_settings(GREEDY, falcon) == ["alibi=True"]
    generate, static = _engines(falcon, tokenizer, [tokenizer.eos_token_id])
    assert static.generate(prompts, sampling=GREEDY).completion_lists() == (
        generate.generate(prompts, sampling=GREEDY).completion_lists()
    )
    assert static.state is None  # generate() sampled: the engine's own loop never ran
    # The model's own generation_config, which generate() applies where the rollout's settings leave a field unset
    # (the engine sampled without it): its processors always, its warpers when sampling.
    ngram = copy.deepcopy(model)
    ngram.generation_config.no_repeat_ngram_size, ngram.generation_config.min_p = 1, 0.1
    assert StaticCacheEngine.unsupported_settings(GREEDY, ngram) == ["no_repeat_ngram_size=1"]
    sampled = SamplingSettings(max_new_tokens=8)
    assert StaticCacheEngine.unsupported_settings(sampled, ngram) == ["min_p=0.1", "no_repeat_ngram_size=1"]
    modes = copy.deepcopy(model)  # a decoding mode (DoLa) and token healing: the engine sampled plainly
    modes.generation_config.dola_layers, modes.generation_config.token_healing = "high", True
    assert StaticCacheEngine.unsupported_settings(GREEDY, modes) == ["dola_layers='high'", "token_healing=True"]
    guided = copy.deepcopy(model)  # classifier-free guidance and a time limit, which generate() applies too
    guided.generation_config.guidance_scale, guided.generation_config.max_time = 1.5, 30.0
    assert StaticCacheEngine.unsupported_settings(GREEDY, guided) == ["guidance_scale=1.5", "max_time=30.0"]
    generate, static = _engines(ngram, tokenizer, [tokenizer.eos_token_id])
    assert static.generate(prompts, sampling=GREEDY).completion_lists() == (
        generate.generate(prompts, sampling=GREEDY).completion_lists()
    )
    assert static.state is None  # generate() sampled: the engine's own loop never ran


def test_the_trainer_rolls_out_with_it_on_policy(tiny_model_dir, tmp_path):
    """`use_static_cache_engine=True` picks the engine; the first update's ratio is exactly 1 (`approx_kl` 0), as with
    the default engine: the trainer's log-probs are of the tokens sampled."""
    args = make_args(tmp_path, max_steps=2, use_static_cache_engine=True)
    trainer = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
    )
    assert type(trainer.generation_engine).__name__ == "StaticCacheEngine"
    assert not trainer.generation_engine.keep_buffers  # the update between two rollouts gets the memory back
    # The engine's own log-probs of what it sampled, which the trainer's must equal (`approx_kl` is 0 at a rollout's
    # first update whatever was sampled: the old log-probs are the ones computed then): read through the
    # sampler-mismatch metrics of the importance-sampling correction.
    trainer.generation_engine.logprobs = True
    trainer.train()
    assert trainer.generation_engine.state is None
    logs = rl_logs(trainer)
    assert logs[0]["approx_kl"] == 0.0 and all(h["completions/mean_length"] > 0 for h in logs)
    assert all(h["sampling/sampling_logp_difference/max"] < 1e-4 for h in logs)
    settings = EngineSettings.from_config(make_args(tmp_path, use_static_cache_engine=True))
    assert settings.engine == "static_cache"
    with pytest.raises(ValueError, match="use_transformers_continuous_batching and use_static_cache_engine"):
        EngineSettings.from_config(
            make_args(tmp_path, use_static_cache_engine=True, use_transformers_continuous_batching=True)
        )
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    assert isinstance(build_engine(EngineSettings(engine="static_cache"), model, tokenizer), StaticCacheEngine)
    assert math.isfinite(logs[-1]["loss"])


def test_static_cache_compile_compiles_the_trainers_decode_step(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """`static_cache_compile=True` compiles the engine's decode step in training (the option was the engine's
    alone: no config reached it); beside another engine named it is refused, and where the default engine is
    another (the CPU's generate()) it warns that it does nothing. torch.compile runs with dynamo's eager backend
    here (inductor compiles the step for minutes on this CPU; the compiled step itself runs under `-m cuda`)."""
    compiles = []
    compile_ = torch.compile

    def eager_backend(function, **options):
        compiles.append(options)
        return compile_(function, **{**options, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", eager_backend)
    args = make_args(tmp_path, max_steps=1, use_static_cache_engine=True, static_cache_compile=True)
    trainer = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
    )
    torch._dynamo.reset()
    try:
        trainer.train()
    finally:
        torch._dynamo.reset()
    assert compiles and all(c["dynamic"] is False and c["fullgraph"] is True for c in compiles)
    assert trainer.generation_engine.compile_step  # compiled: not given up as a step dynamo cannot trace
    assert rl_logs(trainer)[0]["completions/mean_length"] > 0
    with pytest.raises(ValueError, match=r"static_cache_compile=True .* use_vllm=True samples with another engine"):
        EngineSettings.from_config(make_args(tmp_path, use_vllm=True, static_cache_compile=True))
    with pytest.raises(ValueError, match=r"and use_static_cache_engine=False samples"):
        EngineSettings.from_config(make_args(tmp_path, use_static_cache_engine=False, static_cache_compile=True))
    auto = EngineSettings.from_config(make_args(tmp_path, static_cache_compile=True))
    with caplog.at_level(logging.WARNING, logger="trl_vapo.generation"):
        assert auto.placed("cpu", sharded=False).engine == "generate"
    assert "static_cache_compile=True has no effect: the rollouts use the generate engine here" in caplog.text


# ---------------------------------------------------------------------------------------------------------------------
# CUDA graphs (a CUDA GPU: `pytest -m cuda`, run by benchmarks/gpu_suite.py)
# ---------------------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_suite.py)")


def _random_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz +=0123456789"
    lengths = torch.randint(1, 30, (n,), generator=generator).tolist()
    texts = ["".join(letters[i] for i in torch.randint(0, len(letters), (k,), generator=generator)) for k in lengths]
    return token_ids(tokenizer, texts)


def _on_cuda(model_dir, prompts: int, seed: int, max_new_tokens: int, temperature: float = 0.0, dtype=None):
    """The tiny model on the GPU (in `dtype`, or as saved), `prompts` random prompts, the engines' common arguments
    and the sampling settings of a CUDA test."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, **({"dtype": dtype} if dtype else {})).cuda()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    common = {"pad_token_id": tokenizer.pad_token_id, "stop_token_ids": [tokenizer.eos_token_id], "logprobs": True}
    sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature)
    return model, _random_prompts(tokenizer, prompts, seed), common, sampling


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "float32-bf16-autocast"])
def test_the_captured_step_equals_the_eager_step_bit_for_bit(tiny_model_dir, dtype, record_property):
    """64 prompts x 64 greedy tokens: the replayed CUDA graph gives the eager step's tokens and log-probs exactly, also
    for float32 weights under bf16 autocast (the trainer's rollout with `bf16=True`: the capture's casts are taken
    without autocast's cache, each replay casts the live weights); the memory the engine holds after the rollout (its
    buffers and the graph's pool) is recorded (JUnit property `engine_bytes_<dtype>`)."""
    autocast = dtype == "float32-bf16-autocast"
    model, prompts, common, sampling = _on_cuda(tiny_model_dir, 64, 0, 64, dtype=torch.float32 if autocast else dtype)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        eager = StaticCacheEngine(model, cuda_graph=False, **common).generate(prompts, sampling=sampling)
        engine = StaticCacheEngine(model, **common)
        before = torch.cuda.memory_allocated()
        captured = engine.generate(prompts, sampling=sampling)
    assert engine.state.graph is not None and not engine.state.capture_failed
    record_property(f"engine_bytes_{str(dtype).split('.')[-1]}", torch.cuda.memory_allocated() - before)
    assert torch.equal(captured.completion_ids, eager.completion_ids)
    assert torch.equal(captured.sampler_logprobs, eager.sampler_logprobs)
    assert captured.completion_ids.shape[1] > 32  # the graph replayed many steps


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (none of this project's machines)")
def test_a_model_on_another_gpu_than_the_current_one_is_captured_on_its_own(tiny_model_dir):
    """The model on `cuda:1`, the current device `cuda:0` (a script that put its reward model there): the capture
    was of device 0's stream, the step's kernels ran eagerly on device 1, and the empty graph was replayed (pads).
    Not run yet: the GPU machines lent so far have one GPU."""
    model, prompts, common, sampling = _on_cuda(tiny_model_dir, 8, 0, 32)
    model = model.to("cuda:1")
    eager = StaticCacheEngine(model, cuda_graph=False, **common).generate(prompts, sampling=sampling)
    with torch.cuda.device(0):
        engine = StaticCacheEngine(model, **common)
        captured = engine.generate(prompts, sampling=sampling)
    assert engine.state.graph is not None and not engine.state.capture_failed
    assert torch.equal(captured.completion_ids, eager.completion_ids)


@pytest.mark.cuda
@needs_cuda
def test_each_replay_draws_fresh_random_numbers_as_the_eager_step_does(tiny_model_dir):
    """Sampling at temperature 1 through the graph: the random numbers are the default CUDA generator's, which a
    replay advances as an eager step does (each kernel's offset is captured relative to the generator's), so from one
    seed the captured rollout draws what the eager one draws, token for token past the first steps. A graph that
    replayed the numbers of its capture would part from it there."""
    model, prompts, common, sampling = _on_cuda(tiny_model_dir, 32, 3, 48, temperature=1.0)
    rollouts = {}
    for cuda_graph in (False, True):
        engine = StaticCacheEngine(model, cuda_graph=cuda_graph, **common)
        torch.manual_seed(0)
        rollouts[cuda_graph] = engine.generate(prompts, sampling=sampling)
    assert engine.state.graph is not None and not engine.state.capture_failed
    assert rollouts[True].completion_ids.shape[1] > 8  # past the eager warm-up step, into the replays
    assert torch.equal(rollouts[True].completion_ids, rollouts[False].completion_ids)
    assert torch.equal(rollouts[True].sampler_logprobs, rollouts[False].sampler_logprobs)


@pytest.mark.cuda
@needs_cuda
def test_a_step_that_cannot_be_captured_runs_eagerly_on_the_callers_stream(tiny_model_dir, caplog):
    """A model whose forward synchronises with the host (a `.item()`; transformers' dynamic RoPE does so) cannot be
    captured: the rollout goes on eagerly, exactly, warns once, and leaves the caller's CUDA stream current
    (`torch.cuda.graph`'s exit raises before it restores its own); later rollouts do not try again."""
    model, prompts, common, sampling = _on_cuda(tiny_model_dir, 16, 4, 32)
    expected = StaticCacheEngine(model, cuda_graph=False, **common).generate(prompts, sampling=sampling)
    model.register_forward_hook(lambda module, args, output: output.logits.sum().item())  # a host sync
    engine = StaticCacheEngine(model, keep_buffers=False, **common)
    stream = torch.cuda.current_stream()
    with caplog.at_level(logging.WARNING, logger="trl_vapo.static_cache"):
        got = [engine.generate(prompts, sampling=sampling) for _ in range(2)]
    assert torch.cuda.current_stream() == stream
    assert all(g.completion_lists() == expected.completion_lists() for g in got)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "could not be captured as a CUDA graph" in warnings[0]
    assert engine.cuda_graph is False


@pytest.mark.cuda
@needs_cuda
def test_the_graph_sees_weight_updates_and_is_taken_again_for_another_adapter(tiny_model_dir):
    """An in-place update of the policy adapter (an optimizer step) reaches the next rollout through the same graph;
    making another adapter active changes the capture key, and the step is captured again."""
    torch.manual_seed(0)
    policy = peft_actor_critic(tiny_model_dir).policy.cuda()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generate, static = _engines(policy, tokenizer, [tokenizer.eos_token_id])
    prompts = _random_prompts(tokenizer, 16, seed=1)
    sampling = SamplingSettings(max_new_tokens=32, temperature=0.0)
    before = static.generate(prompts, sampling=sampling)
    graph = static.state.graph
    assert (
        graph is not None
        and before.completion_lists() == generate.generate(prompts, sampling=sampling).completion_lists()
    )
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B.default" in name:
                param.add_(0.5 * torch.randn_like(param))
    after = static.generate(prompts, sampling=sampling)
    assert static.state.graph is graph  # the same graph, the updated weights
    assert after.completion_lists() == generate.generate(prompts, sampling=sampling).completion_lists()
    assert after.completion_lists() != before.completion_lists()
    policy.set_adapter("critic")
    try:
        critic = static.generate(prompts, sampling=sampling)
        from trl_vapo.static_cache import capture_key

        # captured again under the new key (a graph of None, the step left eager, passed `is not graph`)
        assert static.state.graph not in (None, graph) and static.state.graph_key == capture_key(policy)
        assert critic.completion_lists() == generate.generate(prompts, sampling=sampling).completion_lists()
    finally:
        policy.set_adapter("default")


@pytest.mark.cuda
@needs_cuda
def test_the_compiled_and_captured_step_follows_the_eager_step(tiny_model_dir, record_property):
    """`compile_step=True`: torch.compile's fused kernels round differently, so greedy completions may part from the
    eager step's; recorded as the first diverging position (JUnit property), required equal on most rows."""
    model, prompts, common, sampling = _on_cuda(tiny_model_dir, 64, 2, 64)
    eager = StaticCacheEngine(model, cuda_graph=False, **common).generate(prompts, sampling=sampling)
    engine = StaticCacheEngine(model, compile_step=True, **common)
    compiled = engine.generate(prompts, sampling=sampling)
    assert engine.state.compiled_step is not None  # compiled, not fallen back to the step as written
    assert engine.state.graph is not None and not engine.state.capture_failed  # and captured
    width = min(eager.completion_ids.shape[1], compiled.completion_ids.shape[1])
    differs = (eager.completion_ids[:, :width] != compiled.completion_ids[:, :width]).any(dim=0)
    first = int(differs.int().argmax()) if differs.any() else -1
    record_property("compiled_first_diverging_position", first)
    same_rows = (eager.completion_ids[:, :width] == compiled.completion_ids[:, :width]).all(dim=1).float().mean()
    assert same_rows >= 0.9, (first, float(same_rows))


def test_the_default_engine_is_the_static_cache_engine_on_a_cuda_gpu_without_sharding(tmp_path):
    """`use_static_cache_engine=None` (the default): the static-cache engine on CUDA unless DeepSpeed or FSDP place
    the weights, generate() on the CPU (as fast or faster there: benchmarks/README.md); a named engine stays named,
    and under DeepSpeed or FSDP the static-cache engine runs without a CUDA graph. A trainer never keeps the
    engine's buffers between rollouts."""
    default = EngineSettings.from_config(make_args(tmp_path))
    assert default.auto and default.engine == "generate"
    assert default.placed("cuda", sharded=False).engine == "static_cache"
    assert default.placed("cuda", sharded=True).engine == "generate"
    assert default.placed("cpu", sharded=False).engine == "generate"
    assert not default.placed("cpu", sharded=False).keep_buffers and default.keep_buffers
    off = EngineSettings.from_config(make_args(tmp_path, use_static_cache_engine=False))
    assert not off.auto and off.placed("cuda", sharded=False).engine == "generate"
    named = EngineSettings.from_config(make_args(tmp_path, use_static_cache_engine=True))
    assert named.placed("cpu", sharded=True).engine == "static_cache"
    assert named.placed("cuda", sharded=False).cuda_graph and not named.placed("cuda", sharded=True).cuda_graph
    quantized = dataclasses.replace(default, quantization_config={"load_in_4bit": True})
    assert quantized.placed("cuda", sharded=False).engine == "generate"  # QLoRA: not captured on a GPU yet
    # A config that dequantizes as it loads (TRL's gpt-oss recipe) gives bf16 weights: captured as any
    dequantized = dataclasses.replace(default, quantization_config={"quant_method": "mxfp4", "dequantize": True})
    assert dequantized.placed("cuda", sharded=False).engine == "static_cache"
    saved_quantized = types.SimpleNamespace(is_loaded_in_4bit=True)  # a checkpoint saved in 4 bits, as transformers
    assert default.placed("cuda", sharded=False, model=saved_quantized).engine == "generate"  # marks it once loaded
    batching = EngineSettings.from_config(make_args(tmp_path, use_transformers_continuous_batching=True))
    assert batching.placed("cuda", sharded=False).engine == "continuous_batching"
    # `trl-vapo eval` chooses as training does (it had no such flag: generate() on a GPU too, 8.8-25.7x slower on the
    # H200 record).
    from trl_vapo.cli import EvalArguments

    evaluated = EngineSettings.from_eval_args(EvalArguments())
    assert evaluated.auto and evaluated.placed("cuda", sharded=False).engine == "static_cache"
    assert evaluated.placed("cpu", sharded=False).engine == "generate"
    named_off = EngineSettings.from_eval_args(EvalArguments(use_static_cache_engine=False))
    assert named_off.placed("cuda", sharded=False).engine == "generate"


def test_kept_buffers_follow_a_change_of_sampling_settings(tiny, device):
    """The buffers are kept for the next call of the same shape, but not the step built for the last call's sampling
    settings (a captured graph would replay them: on CUDA, the graph is captured again): greedy after sampling is
    greedy, as generate() is."""
    model, tokenizer = tiny
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    generate, static = _engines(model, tokenizer, [tokenizer.eos_token_id])
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    sampled = SamplingSettings(max_new_tokens=24, temperature=1.3, top_k=5)
    static.generate(prompts, sampling=sampled)
    signature, graph = static.state.sampling_signature, static.state.graph
    assert (graph is not None) == (device == "cuda")
    got = static.generate(prompts, sampling=GREEDY)
    assert static.state.sampling_signature != signature and not static.state.warpers
    assert static.state.graph is None if device == "cpu" else static.state.graph not in (None, graph)
    assert got.completion_lists() == generate.generate(prompts, sampling=GREEDY).completion_lists()


def test_buffers_are_freed_after_each_call_without_keep_buffers(tiny, monkeypatch):
    model, tokenizer = tiny
    engine = StaticCacheEngine(
        model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id], keep_buffers=False
    )
    kept = StaticCacheEngine(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id])
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    assert (
        engine.generate(prompts, sampling=GREEDY).completion_lists()
        == kept.generate(prompts, sampling=GREEDY).completion_lists()
    )
    assert engine.state is None and kept.state is not None
    # Freed at the call's end, not after each of its batches: the batches share one shape, whose buffers and CUDA
    # graph were allocated and captured anew for each (`trl-vapo eval --batch_size`, the held-out report).
    import trl_vapo.static_cache as static_cache

    built = []
    real = static_cache.DecodeState

    class Counted(real):
        def __init__(self, *args, **kwargs):
            built.append(args[0])
            super().__init__(*args, **kwargs)

    batched = StaticCacheEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=[tokenizer.eos_token_id],
        keep_buffers=False,
        batch_size=2,
    )
    monkeypatch.setattr(static_cache, "DecodeState", Counted)  # the real one, counted
    out = batched.generate(prompts, sampling=GREEDY)  # 6 prompts: 3 batches of 2
    assert len(built) == 1 and batched.state is None
    assert out.completion_lists() == kept.generate(prompts, sampling=GREEDY).completion_lists()
