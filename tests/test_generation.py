"""Tests of `trl_vapo.generation`: stop-token cutting, the three engines, and the importance-sampling metrics.

vLLM cannot be installed on the development machines (no GPU), so the vLLM glue runs against
`StandInVLLMGeneration`: a subclass of TRL's real `trl.generation.vllm_generation.VLLMGeneration` in which only the
parts that need vLLM are replaced. Its `_init_vllm` loads a transformers copy of the checkpoint the policy was loaded
from (what vLLM's `LLM(model=model.name_or_path)` does) behind the attribute path TRL's colocate mode writes weights
to, and its `generate` samples from that copy with transformers and answers in `VLLMGeneration.generate`'s format.
`sync_weights` is TRL's own code (PEFT merge, renaming, unmerge); the stand-in's `load_weights` records what it
receives and copies it into its model by name, failing on a name the model does not have, as vLLM's loader does.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import shutil
import string
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    GREEDY,
    TEXT_PROMPTS,
    StandInVLLMGeneration,
    digit_fraction,
    make_args,
    merged_policy_only,
    peft_actor_critic,
    prompts_dataset,
    token_ids,
    trainer_logprobs,
)
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.import_utils import is_vllm_available

from trl_vapo.core import importance_sampling_weights
from trl_vapo.generation import (
    ContinuousBatching,
    EngineSettings,
    GenerationOutput,
    SamplingSettings,
    TransformersGenerate,
    VLLMEngine,
    build_engine,
    check_engine_available,
    cut_at_stop,
    importance_sampling_metrics,
    stop_token_ids,
)
from trl_vapo.modeling import CRITIC_ADAPTER, POLICY_ADAPTER, ActorCritic

# ---------------------------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from a second intra-op thread; on a shared 2-core machine OpenMP's spinning threads
    made these tests 10-20 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def demo():
    from trl_vapo.data import prompt_token_ids
    from trl_vapo.demo import MODEL_DIR
    from trl_vapo.demo.data import build_split

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompts = list(build_split("held_out", 6)["prompt"])
    return model, tokenizer, prompt_token_ids(tokenizer, prompts, conversational=True)


# ---------------------------------------------------------------------------------------------------------------------
# cut_at_stop and stop ids
# ---------------------------------------------------------------------------------------------------------------------


def _naive_cut(row: list[int], n_valid: int, stops: set[int]) -> tuple[list[int], bool]:
    kept = []
    for token in row[:n_valid]:
        kept.append(token)
        if token in stops:
            return kept, False
    return kept, True


@pytest.mark.parametrize("seed", range(5))
def test_cut_at_stop_matches_a_naive_loop(seed):
    generator = torch.Generator().manual_seed(seed)
    stops, pad_id = [3, 7], 0
    ids = torch.randint(1, 12, (16, 10), generator=generator)
    ids[0] = torch.tensor([3, 5, 7, 3, 1, 1, 1, 1, 1, 1])  # stop at position 0
    ids[1] = torch.tensor([1, 2, 4, 5, 6, 8, 9, 10, 11, 1])  # no stop at all
    ids[2] = torch.tensor([1, 7, 3, 7, 1, 1, 1, 1, 1, 1])  # the second stop id first
    n_valid = torch.randint(0, 11, (16,), generator=generator)
    n_valid[:3] = 10
    valid = torch.arange(10)[None, :] < n_valid[:, None]
    logprobs = -torch.rand(16, 10, generator=generator)
    logprobs[5, -1] = -math.inf  # a filtered token past the cut must not turn into NaN

    out = cut_at_stop(ids, stops, pad_id, valid=valid, logprobs=logprobs)

    for i in range(16):
        kept, truncated = _naive_cut(ids[i].tolist(), int(n_valid[i]), set(stops))
        n = len(kept)
        assert out.completion_ids[i, :n].tolist() == kept
        assert (out.completion_ids[i, n:] == pad_id).all()
        assert out.completion_mask[i].tolist() == [1] * n + [0] * (10 - n)
        assert bool(out.is_truncated[i]) == truncated
        assert torch.equal(out.sampler_logprobs[i, :n], logprobs[i, :n])
        assert (out.sampler_logprobs[i, n:] == 0).all()
    assert out.completion_lists()[0] == [3] and out.completion_lists()[2] == [1, 7]
    assert out.lengths.tolist()[:3] == [1, 10, 2]
    # With the budget known, only a row that used all of it without a stop token ran out of budget.
    budget = cut_at_stop(ids, stops, pad_id, valid=valid, max_new_tokens=10)
    assert budget.is_truncated.tolist() == (out.is_truncated & (out.lengths == 10)).tolist()


def test_stop_token_ids_collects_tokenizer_model_and_kwargs_ids(tiny):
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    eos = tokenizer.eos_token_id
    assert stop_token_ids(tokenizer) == [eos]
    model.generation_config.eos_token_id = [eos, 40]
    assert stop_token_ids(tokenizer, model) == [eos, 40]
    assert stop_token_ids(tokenizer, model, {"eos_token_id": 41, "stop_token_ids": [40, 42]}) == [eos, 40, 41, 42]


# ---------------------------------------------------------------------------------------------------------------------
# transformers generate()
# ---------------------------------------------------------------------------------------------------------------------


def _check_invariants(out: GenerationOutput, n: int, max_new_tokens: int, stops: list[int], pad_id: int) -> None:
    assert out.completion_ids.shape == out.completion_mask.shape and out.completion_ids.shape[0] == n
    assert out.completion_ids.shape[1] <= max_new_tokens and out.is_truncated.shape == (n,)
    for ids, mask, truncated in zip(out.completion_ids.tolist(), out.completion_mask.tolist(), out.is_truncated):
        length = sum(mask)
        assert mask == [1] * length + [0] * (len(mask) - length)  # a prefix
        assert all(t == pad_id for t in ids[length:])
        assert not any(t in stops for t in ids[: length - 1])  # nothing after the first stop token
        if truncated:
            assert length == max_new_tokens and ids[length - 1] not in stops
        else:
            assert ids[length - 1] in stops


def test_transformers_engine_output_invariants(tiny):
    model, tokenizer = tiny
    # Frequent characters as stop tokens, so that sampled completions both stop and run out of budget.
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list("aeiou "))]
    engine = TransformersGenerate(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops, batch_size=4)
    prompts = token_ids(tokenizer, TEXT_PROMPTS) * 3
    torch.manual_seed(0)
    out = engine.generate(prompts, sampling=SamplingSettings(max_new_tokens=16, temperature=1.0))
    _check_invariants(out, len(prompts), 16, stops, tokenizer.pad_token_id)
    assert out.is_truncated.any() and (~out.is_truncated).any()
    assert out.sampler_logprobs is None

    assert model.training is False  # restored as found (from_pretrained models are in eval mode)

    # Batching is invisible: greedy completions in chunks of 4 equal one batch of all prompts.
    whole = TransformersGenerate(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops)
    model.train()  # as the trainer's policy is between rollouts (gradient checkpointing runs in training mode only)
    try:
        a, b = engine.generate(prompts, sampling=GREEDY), whole.generate(prompts, sampling=GREEDY)
        assert model.training is True  # restored as found
    finally:
        model.eval()
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)


def test_a_models_num_return_sequences_does_not_multiply_the_rows(tiny):
    """A checkpoint whose generation_config says `num_return_sequences: 2`: generate() took it (a setting the rollout
    leaves unset) and returned two rows a prompt, which the engine read as the next prompts' completions."""
    model, tokenizer = tiny
    many = copy.deepcopy(model)
    many.generation_config.num_return_sequences = 2
    stops = [tokenizer.eos_token_id]
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    out = TransformersGenerate(many, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops).generate(
        prompts, sampling=GREEDY
    )
    plain = TransformersGenerate(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops).generate(
        prompts, sampling=GREEDY
    )
    assert out.completion_lists() == plain.completion_lists()


@pytest.mark.parametrize("pad_stops", [False, True], ids=["pad-not-a-stop-token", "pad-is-a-stop-token"])
def test_transformers_engine_ends_rows_that_stopped_on_a_stop_string(tiny, pad_stops):
    """generate() pads a row that stopped on a stop string: the padding is not part of the completion, and the row
    did not run out of budget. Also where the pad token is a stop token (a tokenizer without one gets EOS as its pad;
    Qwen2.5-Instruct's pad is in its EOS list): the first pad was kept as the row's end, a token never sampled."""
    model, tokenizer = tiny
    stops = [tokenizer.eos_token_id] + ([tokenizer.pad_token_id] if pad_stops else [])
    engine = TransformersGenerate(
        model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops, tokenizer=tokenizer
    )
    sampling = SamplingSettings(max_new_tokens=16, generation_kwargs={"stop_strings": ["e", "a"]})
    torch.manual_seed(2)
    out = engine.generate(token_ids(tokenizer, TEXT_PROMPTS) * 3, sampling=sampling)
    texts = tokenizer.batch_decode(out.completion_lists())
    on_string = [t.endswith(("e", "a")) for t in texts]
    assert any(on_string) and not all(on_string)
    for ids, length, truncated, text, stopped in zip(
        out.completion_ids, out.lengths, out.is_truncated, texts, on_string
    ):
        assert tokenizer.pad_token_id not in ids[: length - 1].tolist()
        if ids[length - 1] == tokenizer.pad_token_id:  # sampled as the stop token it is, after no stop string
            before = tokenizer.decode(ids[: length - 1])
            assert pad_stops and not before.endswith(("e", "a")), text
        assert bool(truncated) == (not stopped and ids[length - 1] not in stops and length == 16), text
    # A stop string completed by the last token the budget allows: stopped, not cut (it was marked truncated, and
    # mask_truncated_completions left it out of the loss). Here every character stops, and the budget is one token.
    characters = [t for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if len(t) == 1]
    one = SamplingSettings(max_new_tokens=1, generation_kwargs={"stop_strings": characters})
    out = engine.generate(token_ids(tokenizer, TEXT_PROMPTS) * 3, sampling=one)
    assert out.lengths.tolist() == [1] * len(out.lengths) and not out.is_truncated.any()
    # The same strings in the model's own generation_config: generate() stopped on them (it fills what the engine's
    # config leaves unset), but the completions' ends ignored them: a pad after the string trained as a token (pad a
    # stop token) or every pad did (not). They end as with the strings named; the static cache, which would not stop
    # on them, names them (and generate() samples instead).
    from trl_vapo.static_cache import StaticCacheEngine

    torch.manual_seed(2)
    named = engine.generate(token_ids(tokenizer, TEXT_PROMPTS) * 3, sampling=sampling)
    model.generation_config.stop_strings = ["e", "a"]
    try:
        torch.manual_seed(2)
        inherited = engine.generate(
            token_ids(tokenizer, TEXT_PROMPTS) * 3, sampling=SamplingSettings(max_new_tokens=16)
        )
        assert "stop_strings=['e', 'a']" in StaticCacheEngine.unsupported_settings(SamplingSettings(), model)
    finally:
        model.generation_config.stop_strings = None
    assert inherited.lengths.tolist() == named.lengths.tolist() and torch.equal(
        inherited.is_truncated, named.is_truncated
    )
    # A stop string that begins in the prompt: generate() matches over the prompt and the completion, so the row ends
    # on the token that completes it. Its end read the completion alone: a pad-as-stop after it was kept as the row's
    # end (a token never sampled), and with a budget of one token the row read as cut.
    prompt = token_ids(tokenizer, ["hello world, how are"])
    first = engine.generate(prompt, sampling=SamplingSettings(max_new_tokens=1, temperature=0.0)).completion_lists()[0]
    spanning = "e" + tokenizer.decode(first)  # the prompt's last character, then the first greedy token
    for budget in (16, 1):
        greedy = SamplingSettings(budget, temperature=0.0, generation_kwargs={"stop_strings": [spanning]})
        out = engine.generate(prompt, sampling=greedy)
        assert out.completion_lists() == [first] and not out.is_truncated.any()


@pytest.mark.parametrize("kwargs", [{"num_return_sequences": 2}, {"max_new_tokens": 12}, {"max_time": 5.0}])
def test_evaluation_refuses_generation_kwargs_that_change_what_it_counts(tiny, kwargs):
    """VAPOConfig refuses them; `evaluate_policy` and `trl-vapo eval` pass theirs to the engine, which took them:
    two completions a prompt were cut to the first rows of the batch (each prompt's scored against another's answer),
    and a budget of its own overran `max_new_tokens` (12 tokens of a budget of 5). Every engine refuses them."""
    from trl_vapo.evaluation import sample_completions

    model, tokenizer = tiny
    with pytest.raises(ValueError, match=f"generation_kwargs sets {next(iter(kwargs))}"):
        sample_completions(model, tokenizer, TEXT_PROMPTS[:3], max_new_tokens=5, generation_kwargs=kwargs)


def test_a_stop_string_may_end_inside_the_last_token():
    """transformers' `StopStringCriteria` stops where a stop string ends inside the last token (a BPE token such as
    `">\n"` after `"</answer"`); the character tokenizer here has no such token, so the rule is checked on text."""
    from trl_vapo.generation import ends_on_stop_string

    assert ends_on_stop_string("x</answer>\n", len("x</answer"), ["</answer>"])  # ends inside ">\n"
    assert ends_on_stop_string("x</answer>", len("x</answer"), ["</answer>"])  # ends with it
    assert not ends_on_stop_string("</answer> more", len("</answer> mo"), ["</answer>"])  # ended tokens before
    assert not ends_on_stop_string("", 0, ["</answer>"])


def test_transformers_engine_logprobs_are_the_trainers_on_policy(tiny):
    """With logprobs=True the sampler's log-probs equal the trainer's (same model, same temperature): on-policy, the
    importance-sampling weights are 1."""
    model, tokenizer = tiny
    stops = [tokenizer.eos_token_id]
    engine = TransformersGenerate(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops, logprobs=True)
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    torch.manual_seed(1)
    out = engine.generate(prompts, sampling=SamplingSettings(max_new_tokens=12, temperature=0.7))
    trainer = trainer_logprobs(model, tokenizer, prompts, out, temperature=0.7)
    mask = out.completion_mask.float()
    torch.testing.assert_close(out.sampler_logprobs * mask, trainer * mask, atol=1e-4, rtol=0)
    weights = importance_sampling_weights(trainer, out.sampler_logprobs, mask, "token_truncate", 3.0, None)
    torch.testing.assert_close(weights[mask.bool()], torch.ones(int(mask.sum())), atol=1e-3, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# transformers continuous batching
# ---------------------------------------------------------------------------------------------------------------------


def _both_engines(model, tokenizer, stops, **kwargs):
    common = {"pad_token_id": tokenizer.pad_token_id, "stop_token_ids": stops}
    return TransformersGenerate(model, **common, **kwargs), ContinuousBatching(model, **common, **kwargs)


@pytest.mark.parametrize("which", ["tiny", "tiny-lora", "demo"])
def test_continuous_batching_greedy_equals_generate(which, tiny, demo, tiny_model_dir, device):
    """Continuous batching (paged attention) and `generate()` give the same greedy completions and log-probs, on the
    CPU and on a CUDA GPU."""
    if which == "demo":
        model, tokenizer, prompts = demo
        sampling = SamplingSettings(max_new_tokens=96, temperature=0.0)  # the demo's answers end at EOS
    else:
        model, tokenizer = tiny
        if which == "tiny-lora":  # the trainer's PEFT policy, with its critic adapter alongside
            model = peft_actor_critic(tiny_model_dir).policy
        prompts, sampling = token_ids(tokenizer, TEXT_PROMPTS), GREEDY
    if device != "cpu":
        model = copy.deepcopy(model).to(device)  # the module's shared models stay on the CPU
    stops = stop_token_ids(tokenizer, model)
    generate, batching = _both_engines(model, tokenizer, stops, logprobs=True)
    expected, got = generate.generate(prompts, sampling=sampling), batching.generate(prompts, sampling=sampling)
    assert got.completion_lists() == expected.completion_lists()
    assert torch.equal(got.is_truncated, expected.is_truncated)
    mask = expected.completion_mask.bool()
    torch.testing.assert_close(got.sampler_logprobs[mask], expected.sampler_logprobs[mask], atol=1e-4, rtol=0)
    if which == "demo":
        assert (~got.is_truncated).all()  # every answer stopped at EOS: the cut is exercised


def test_continuous_batching_sampling_respects_budget_and_stop_ids(tiny):
    model, tokenizer = tiny
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list("aeiou "))]
    engine = ContinuousBatching(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops)
    prompts = token_ids(tokenizer, TEXT_PROMPTS) * 4
    sampling = SamplingSettings(max_new_tokens=10, temperature=1.0, top_p=0.9)
    attention = model.config._attn_implementation
    torch.manual_seed(3)
    first = engine.generate(prompts, sampling=sampling)
    _check_invariants(first, len(prompts), 10, stops, tokenizer.pad_token_id)
    assert first.is_truncated.any() and (~first.is_truncated).any()
    assert len(set(map(tuple, first.completion_lists()))) > len(TEXT_PROMPTS)  # sampled, not greedy
    torch.manual_seed(3)
    assert engine.generate(prompts, sampling=sampling).completion_lists() == first.completion_lists()  # seeded
    torch.manual_seed(4)  # by torch's seed: an engine that seeded itself with a constant drew these again
    assert engine.generate(prompts, sampling=sampling).completion_lists() != first.completion_lists()
    assert model.config._attn_implementation == attention and not model.training  # the model is left as found


def test_continuous_batching_refuses_what_it_would_ignore(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="repetition_penalty"):
        ContinuousBatching(
            model, pad_token_id=0, stop_token_ids=[1], sampling=SamplingSettings(repetition_penalty=1.1)
        )
    settings = EngineSettings("continuous_batching", SamplingSettings(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="repetition_penalty"):
        check_engine_available(settings)
    settings = EngineSettings("continuous_batching", SamplingSettings(generation_kwargs={"stop_strings": ["\n\n"]}))
    with pytest.raises(ValueError, match="stop_strings"):
        check_engine_available(settings)
    suppressing = copy.deepcopy(model)  # the model's own generation_config, which generate() applies
    suppressing.generation_config.suppress_tokens = [5, 6]
    settings = EngineSettings("continuous_batching", SamplingSettings())
    with pytest.raises(ValueError, match=r"generation_config sets suppress_tokens=\[5, 6\], which generate\(\) app"):
        build_engine(settings, suppressing, tokenizer)
    # Dropped there (a first token that stops ended the completion; no penalty), or run on one token per row
    # (no_repeat_ngram_size), as fields or in generation_kwargs (which were let through).
    for key, value in [
        ("min_new_tokens", 6),
        ("min_length", 6),
        ("repetition_penalty", 1.2),
        ("no_repeat_ngram_size", 2),
    ]:
        settings = EngineSettings("continuous_batching", SamplingSettings(generation_kwargs={key: value}))
        with pytest.raises(
            ValueError, match=rf"{key}={value} \(generation_kwargs\): not supported by transformers' c"
        ):
            check_engine_available(settings)
    # A seed of its own: transformers seeds torch's global generator with it as each batch starts, so every rollout
    # drew the same random numbers (the trainer's shuffles too).
    settings = EngineSettings("continuous_batching", continuous_batching_config={"seed": 3})
    with pytest.raises(ValueError, match="sets a seed, which transformers passes to torch.manual_seed at every"):
        check_engine_available(settings)
    check_engine_available(EngineSettings("continuous_batching", continuous_batching_config={"seed": None}))


def test_continuous_batching_restores_the_training_mode(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ContinuousBatching(model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id])
    engine.generate(token_ids(tokenizer, TEXT_PROMPTS[:2]), sampling=GREEDY)
    assert model.training  # generate_batch leaves the model in eval mode; the engine puts it back


# ---------------------------------------------------------------------------------------------------------------------
# vLLM through TRL's VLLMGeneration, with a stand-in for vLLM itself
# ---------------------------------------------------------------------------------------------------------------------


def _vllm_args(**overrides) -> EngineSettings:
    from trl_vapo.config import VAPOConfig

    fields = {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "max_completion_length": 16,
        "generation_batch_size": 8,
        "temperature": 1.0,
    }
    return EngineSettings.from_config(VAPOConfig(output_dir="unused", report_to="none", **{**fields, **overrides}))


def _vllm_engine(actor_critic, tokenizer, **overrides) -> VLLMEngine:
    from accelerate import Accelerator

    return build_engine(
        _vllm_args(**overrides),
        actor_critic.policy,
        tokenizer,
        policy=actor_critic.policy,
        accelerator=Accelerator(),
        vllm_generation_cls=StandInVLLMGeneration,
    )


def test_vllm_sync_pushes_the_base_merged_with_the_policy_adapter_only(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    actor_critic = peft_actor_critic(tiny_model_dir)
    policy = actor_critic.policy
    engine = _vllm_engine(actor_critic, tokenizer)
    assert isinstance(engine, VLLMEngine)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}

    engine.sync_weights(step=0)

    received = engine.vllm_generation.received
    expected = merged_policy_only(policy)
    assert set(received) == set(expected) == set(dict(engine.vllm_generation.sampler.named_parameters()))
    for name, value in expected.items():
        torch.testing.assert_close(received[name], value, atol=1e-6, rtol=0, msg=name)
    # Both adapters really change the weights, so the comparison above can tell them apart.
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    base_q = before[f"base_model.model.{q_proj[: -len('.weight')]}.base_layer.weight"]
    with_critic = copy.deepcopy(policy)
    with_critic.delete_adapter(POLICY_ADAPTER)
    critic_merged = dict(with_critic.merge_and_unload().named_parameters())[q_proj]
    assert not torch.allclose(received[q_proj], base_q, atol=1e-3)
    assert not torch.allclose(received[q_proj], critic_merged, atol=1e-3)
    # TRL unmerges after the push: the training weights are back (up to float rounding of W + BA - BA).
    for name, param in policy.named_parameters():
        torch.testing.assert_close(param.detach(), before[name], atol=1e-6, rtol=0, msg=name)
    assert not any(getattr(m, "merged", False) for m in policy.modules())


@pytest.mark.parametrize("adapter", ["lora-on-two-expert-parameters", "ln-tuning", "lora-trainable-tokens"])
def test_vllm_sync_merges_nested_and_swapping_adapters_as_peft_merges_them(tmp_path, adapter):
    """Adapters whose merge the sync's own one-layer merge got wrong: LoRA on two parameters of one module (peft
    nests their wrappers, each merging its own: the inner parameter reached vLLM without its LoRA; gpt-oss's LoRA
    recipes target its experts so), LN tuning (its merge swaps in the trained norm: the untrained one reached
    vLLM), and LoRA with `trainable_token_indices` (new tokens' embeddings: the embedding reached vLLM under its
    wrapper's name, `embed_tokens.token_adapter.weight`, and the delta too, names vLLM does not have). Against peft's
    `merge_and_unload` of the policy adapter alone; the training weights stay as they were."""
    from peft import LNTuningConfig, LoraConfig, get_peft_model
    from transformers import AutoConfig

    from trl_vapo.modeling import ActorCritic, ValueHead
    from trl_vapo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, head_dim=8)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
    config = AutoConfig.for_model("qwen3_moe", **shape, **moe, num_key_value_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    if adapter == "ln-tuning":
        peft_config = LNTuningConfig(target_modules=["input_layernorm", "post_attention_layernorm"])
    elif adapter == "lora-trainable-tokens":
        peft_config = LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices=[3, 5])
    else:
        peft_config = LoraConfig(
            r=2, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"]
        )
    policy = get_peft_model(base, peft_config)
    policy.add_adapter(CRITIC_ADAPTER, peft_config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # both adapters change the weights they wrap
        for name, param in policy.named_parameters():
            if "lora_B" in name or "ln_tuning_layers" in name or "trainable_tokens_delta" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    engine = _vllm_engine(ActorCritic(policy, value_head=ValueHead(32)), tokenizer)

    engine.sync_weights(step=0)

    received, expected = engine.vllm_generation.received, merged_policy_only(policy)
    assert set(received) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(received[name], value, atol=1e-6, rtol=0, msg=name)
    plain = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "base").named_parameters())
    changed = {name for name, value in expected.items() if not torch.allclose(value, plain[name], atol=1e-3)}
    adapted = {"lora-on-two-expert-parameters": "experts", "ln-tuning": "layernorm"}.get(adapter, "")
    assert changed and all(adapted in name for name in changed)
    if adapter == "lora-trainable-tokens":
        assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"} <= changed
    for name, param in policy.named_parameters():
        torch.testing.assert_close(param.detach(), before[name], atol=0, rtol=0, msg=name)


def test_vllm_gets_transformers_generation_kwargs_under_its_own_names():
    """`VLLMGeneration` passes `generation_kwargs` to vLLM's `SamplingParams` as they are: transformers' names that
    vLLM spells otherwise are renamed (`min_new_tokens` was an unexpected keyword at the first rollout, where the
    continuous-batching engine's refusal of it recommends vLLM)."""
    from types import SimpleNamespace

    from trl_vapo.generation import _apply_sampling

    sampler = SimpleNamespace()
    kwargs = {"min_new_tokens": 4, "stop_strings": "</answer>", "do_sample": True, "eos_token_id": 9, "seed": 3}
    _apply_sampling(sampler, SamplingSettings(max_new_tokens=32, generation_kwargs=kwargs), [2, 9])
    assert sampler.generation_kwargs == {
        "min_tokens": 4,
        "stop": ["</answer>"],
        "include_stop_str_in_output": True,
        "stop_token_ids": [2, 9],
        "seed": 3,
    }
    assert sampler.max_completion_length == 32


def test_vllm_sync_leaves_a_bf16_base_bit_exact(tiny_model_dir):
    """The base is shared with the critic adapter and the reference policy: a sync must not round it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    actor_critic = peft_actor_critic(tiny_model_dir, modules_to_save=["norm"], dtype=torch.bfloat16)
    policy = actor_critic.policy
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    engine = _vllm_engine(actor_critic, tokenizer)
    for step in range(3):
        engine.sync_weights(step=step)
    for name, param in policy.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
    expected = merged_policy_only(policy)
    assert set(engine.vllm_generation.received) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(engine.vllm_generation.received[name], value, atol=0, rtol=0, msg=name)


def test_trls_in_place_merge_rounds_a_bf16_base(tiny_model_dir):
    """Why `policy_only` merges on a copy: TRL's own sync (merge_adapter, push, unmerge_adapter) changes bf16 base
    weights (trl issue #6688). If this starts failing, TRL restores the base itself and the copy can go."""
    from accelerate import Accelerator

    policy = peft_actor_critic(tiny_model_dir, dtype=torch.bfloat16).policy
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trl_only = StandInVLLMGeneration(model=policy, accelerator=Accelerator(), processing_class=None)
    trl_only.sync_weights()
    changed = [n for n, p in policy.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any(".base_layer." in n for n in changed)


def test_vllm_with_an_adapter_under_fsdp_is_refused_before_the_policy_loads(tiny_model_dir, tmp_path, monkeypatch):
    """Under FSDP the sync keeps TRL's path, which merges the adapter into the sharded base in place (the rounding
    above, on the base the critic's adapter and the KL reference compute on too): refused, before anything loads."""
    from peft import LoraConfig

    import trl_vapo.trainer
    from trl_vapo import VAPOTrainer

    def refuse(*args, **kwargs):
        raise AssertionError("the policy loaded")

    monkeypatch.setattr(trl_vapo.trainer, "load_policy", refuse)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # as `accelerate launch` with an FSDP config sets it
    args = make_args(tmp_path, use_vllm=True)
    with pytest.raises(ValueError, match="use_vllm with a PEFT adapter under FSDP is not supported: the weight sync"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=LoraConfig(r=2))
    # A saved adapter's folder, which loads as a PeftModel with its adapter trainable, too.
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    get_peft_model(model, LoraConfig(r=2)).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="use_vllm with a PEFT adapter under FSDP is not supported: the weight sync"):
        VAPOTrainer(str(tmp_path / "adapter"), digit_fraction, args, prompts_dataset())


def test_vllm_engine_samples_the_synced_policy(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    actor_critic = peft_actor_critic(tiny_model_dir, seed=1)
    policy = actor_critic.policy
    engine = _vllm_engine(actor_critic, tokenizer)
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    reference = TransformersGenerate(policy, pad_token_id=tokenizer.pad_token_id, stop_token_ids=engine.stop_token_ids)
    stale = engine.generate(prompts, sampling=GREEDY)  # before any sync, vLLM holds the bare base checkpoint

    engine.sync_weights(step=0)
    out = engine.generate(prompts, sampling=GREEDY, num_generations=1)

    assert out.completion_lists() == reference.generate(prompts, sampling=GREEDY).completion_lists()
    assert stale.completion_lists() != out.completion_lists()
    # The sampler's log-probs come back, zero past the cut, equal to the trainer's on-policy.
    trainer = trainer_logprobs(policy, tokenizer, prompts, out, temperature=1.0)
    mask = out.completion_mask.bool()
    torch.testing.assert_close(out.sampler_logprobs[mask], trainer[mask], atol=1e-4, rtol=0)
    assert (out.sampler_logprobs[~mask] == 0).all()


def test_a_vllm_completion_ending_on_a_stop_string_with_its_last_allowed_token_stopped(tiny_model_dir):
    """As generate()'s: a stop string completed by the last token the budget allows stopped the completion; vLLM's
    was marked truncated (no stop token last, at the budget), and mask_truncated_completions left it out of the loss.
    Every one-character token a stop string, a budget of one token: each completion ends on a stop string."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = _vllm_engine(peft_actor_critic(tiny_model_dir, seed=1), tokenizer)
    characters = [t for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if len(t) == 1]
    one = dataclasses.replace(GREEDY, max_new_tokens=1, generation_kwargs={"stop_strings": characters})
    out = engine.generate(token_ids(tokenizer, TEXT_PROMPTS), sampling=one)
    assert out.lengths.tolist() == [1] * len(TEXT_PROMPTS) and not out.is_truncated.any()
    cut = engine.generate(token_ids(tokenizer, TEXT_PROMPTS), sampling=dataclasses.replace(one, generation_kwargs={}))
    assert (cut.is_truncated == (cut.completion_ids[:, 0] != tokenizer.eos_token_id)).all()  # without: cut


@pytest.mark.parametrize("given", [True, False], ids=["vllm_max_model_length", "the-models-own"])
def test_a_vllm_completion_cut_by_the_context_length_is_truncated(tiny_model_dir, tmp_path, given):
    """vLLM ends a completion where the prompt and it fill its context, short of max_completion_length and without a
    stop token: out of budget, as one that reaches max_completion_length (it was taken as finished, and
    `mask_truncated_completions` trained on it). The context is `vllm_max_model_length`, or unset (the default),
    the one vLLM derives from the model's config (`max_position_embeddings`), read from vLLM's engine: the cut was
    then taken as finished."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = token_ids(tokenizer, TEXT_PROMPTS)
    context = max(map(len, prompts)) + 4  # the longest prompt has room for 4 tokens, the shortest for more
    model_dir = tiny_model_dir
    if not given:  # a model whose own context is that short
        model_dir = tmp_path / "short-context"
        shutil.copytree(tiny_model_dir, model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    actor_critic = peft_actor_critic(model_dir, seed=1)
    engine = _vllm_engine(actor_critic, tokenizer, vllm_max_model_length=context if given else None)
    assert engine.context_length() == context
    # A server's: its `/server_info` (a stand-in client; the real one needs a GPU's vLLM), whatever
    # `vllm_max_model_length` says (TRL gives that to a colocated engine alone: the server cuts at its own).
    served = _vllm_engine(actor_critic, tokenizer, vllm_max_model_length=context if given else None)
    served.vllm_generation.mode = "server"
    served.vllm_generation.vllm_client = SimpleNamespace(
        get_server_info=lambda: {"model_config": {"max_model_len": 99, "logprobs_mode": "processed_logprobs"}}
    )
    assert served.context_length() == 99
    never_stop = dataclasses.replace(GREEDY, max_new_tokens=16, generation_kwargs={"eos_token_id": []})
    engine.stop_token_ids = [tokenizer.pad_token_id]  # a token the tiny model does not sample: no completion stops
    out = engine.generate(prompts, sampling=never_stop)
    lengths = out.completion_mask.sum(dim=1).tolist()
    assert lengths == [min(16, context - len(p)) for p in prompts] and min(lengths) == 4
    assert out.is_truncated.all()


def assert_received_as_is(engine, policy) -> None:
    """vLLM (the stand-in) received every weight of `policy`, as it is, and nothing else."""
    expected = dict(policy.named_parameters())
    assert set(engine.vllm_generation.received) == set(expected)
    for name, value in expected.items():
        assert torch.equal(engine.vllm_generation.received[name], value.detach()), name


def test_vllm_sync_pushes_a_full_policy_as_is(tiny_model_dir):
    """Without PEFT (separate critic model), the policy's own weights go to vLLM, and the critic's never."""
    from trl_vapo.loading import critic_from_policy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        policy.model.layers[0].self_attn.q_proj.weight.add_(0.5)  # a trained policy: no longer the checkpoint
    critic = critic_from_policy(policy)
    with torch.no_grad():  # a trained critic: its backbone no longer the policy's, so a push of it would show
        for weight in critic.parameters():
            weight.add_(1.0)
    actor_critic = ActorCritic(policy, critic=critic)
    engine = _vllm_engine(actor_critic, tokenizer)
    engine.sync_weights(step=0)
    assert_received_as_is(engine, policy)


def test_vllm_sync_under_fsdp_before_the_policy_is_sharded_pushes_it_as_is(tiny_model_dir):
    """`trl-vapo train --eval_num_prompts N` under FSDP2 with vLLM samples its held-out report before training, before
    the trainer shards the policy: TRL's FSDP2 path read each parameter as a DTensor (`full_tensor()`, an
    AttributeError on a whole one). Under FSDP (set here on TRL's own helper, as accelerate's plugin sets it; the
    sharded path needs processes, `test_distributed`) a policy not yet sharded is pushed as it is."""
    from trl_vapo.loading import critic_from_policy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = _vllm_engine(ActorCritic(policy, critic=critic_from_policy(policy)), tokenizer)
    engine.vllm_generation._dist.fsdp_version = 2
    assert engine.vllm_generation._dist.is_fsdp
    engine.sync_weights(step=0)
    assert_received_as_is(engine, policy)


def test_a_vllm_server_is_told_the_weights_dtypes_again_once_the_trainer_places_them(tiny_model_dir):
    """TRL's server mode announces the pushed weights' names, dtypes and shapes once, at its first sync, and streams
    every later sync against that list. `trl-vapo train --eval_num_prompts N` syncs before training, before the
    trainer places the models, which DeepSpeed's bf16 casts: the later syncs broadcast bf16 tensors announced as
    float32. Placing the models (`weights_changed`, as `_train` calls it) has them announced again. A stand-in client
    checks each tensor against the announcement (the real one needs a server and its NCCL group)."""
    from trl_vapo.loading import critic_from_policy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = _vllm_engine(ActorCritic(policy, critic=critic_from_policy(policy)), tokenizer)
    announced = []

    def update_named_params(metadata, named_params):
        for (name, dtype, shape), (sent, tensor) in zip(metadata, named_params, strict=True):
            assert (name, dtype, shape) == (sent, str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        announced.append({dtype for _, dtype, _ in metadata})

    vllm = engine.vllm_generation
    vllm.mode, vllm.vllm_client = "server", SimpleNamespace(update_named_params=update_named_params)
    vllm.vllm_client.reset_prefix_cache = lambda: None
    engine.sync_weights(step=0)  # before training
    policy.to(torch.bfloat16)  # placed, as DeepSpeed's bf16 places it
    engine.weights_changed()
    engine.sync_weights(step=0)
    assert announced == [{"float32"}, {"bfloat16"}]


def test_vllm_sync_once_per_step(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    actor_critic = peft_actor_critic(tiny_model_dir)
    engine = _vllm_engine(actor_critic, tokenizer)
    stand_in = engine.vllm_generation
    engine.sync_weights(step=0)
    pushed = stand_in.pushes
    engine.sync_weights(step=0)  # gradient accumulation: same optimizer step, nothing to push
    assert stand_in.pushes == pushed
    with torch.no_grad():  # an update of the policy adapter
        for name, param in actor_critic.policy.named_parameters():
            if f"lora_B.{POLICY_ADAPTER}." in name:
                param.add_(0.1)
    engine.sync_weights(step=1)
    assert stand_in.pushes > pushed
    for name, value in merged_policy_only(actor_critic.policy).items():
        torch.testing.assert_close(stand_in.received[name], value, atol=1e-6, rtol=0, msg=name)


def test_vllm_sync_leaves_out_the_other_adapters_modules_to_save(tiny_model_dir):
    """With `modules_to_save`, each adapter has its own copy of those modules; TRL renames the policy's copy and
    would pass the critic's and the KL reference's (`ref`, a given adapter's frozen copy) on under names vLLM does not
    know (the stand-in's load_weights raises KeyError)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    actor_critic = peft_actor_critic(tiny_model_dir, modules_to_save=["norm"])
    actor_critic.add_reference_adapter()
    assert any(".modules_to_save.ref." in name for name, _ in actor_critic.policy.named_parameters())
    engine = _vllm_engine(actor_critic, tokenizer)
    engine.sync_weights(step=0)
    expected = merged_policy_only(actor_critic.policy)
    assert set(engine.vllm_generation.received) == set(expected)
    torch.testing.assert_close(engine.vllm_generation.received["model.norm.weight"], expected["model.norm.weight"])


def test_vllm_engine_refuses_the_actor_critic_and_an_active_critic_adapter(tiny_model_dir):
    from accelerate import Accelerator

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    actor_critic = peft_actor_critic(tiny_model_dir)
    with pytest.raises(TypeError, match="actor_critic.policy"):
        build_engine(
            _vllm_args(),
            actor_critic,
            tokenizer,
            policy=actor_critic,
            accelerator=Accelerator(),
            vllm_generation_cls=StandInVLLMGeneration,
        )
    engine = _vllm_engine(actor_critic, tokenizer)
    actor_critic.policy.set_adapter(CRITIC_ADAPTER)
    with pytest.raises(RuntimeError, match="critic"):
        engine.sync_weights(step=0)
    assert engine.vllm_generation.pushes == 0


def test_vllm_generation_kwargs_follow_grpo_trainer(tiny_model_dir):
    """The stand-in was built with exactly the keyword arguments GRPOTrainer passes, from TRL's field names."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = _vllm_engine(
        peft_actor_critic(tiny_model_dir),
        tokenizer,
        vllm_mode="colocate",
        top_p=0.9,
        vllm_gpu_memory_utilization=0.4,
    )
    generation = engine.vllm_generation
    assert generation.mode == "colocate" and generation.gpu_memory_utilization == 0.4 and generation.top_p == 0.9
    assert generation.max_num_seqs == 8 and generation.logprobs == 0 and generation.max_completion_length == 16
    assert generation.server_port == 8000 and generation.enable_sleep_mode is False  # VAPOConfig's (TRL's) defaults


def test_vllm_says_it_samples_without_the_models_own_generation_settings(tiny_model_dir, caplog):
    """generate() takes what the config leaves unset from the model's generation_config (min_p here); vLLM, through
    TRL's VLLMGeneration, samples with the settings it is given alone: said, naming them (it was silent)."""
    actor_critic = peft_actor_critic(tiny_model_dir)
    actor_critic.policy.generation_config.min_p = 0.1
    with caplog.at_level(logging.WARNING, logger="trl_vapo.generation"):
        _vllm_engine(actor_critic, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert any("generation_config sets min_p=0.1, which generate() applies and vLLM" in m for m in caplog.messages)


@pytest.mark.skipif(is_vllm_available(), reason="vLLM is installed here")
def test_use_vllm_without_vllm_says_how_to_install_it(tiny):
    _, tokenizer = tiny
    args = _vllm_args()
    with pytest.raises(ImportError, match="pip install vllm"):
        check_engine_available(args)
    # build_engine checks first: no model is needed (nor touched) to get the message.
    with pytest.raises(ImportError, match="pip install vllm"):
        build_engine(args, model=lambda: pytest.fail("the model was used"), tokenizer=tokenizer)


def test_check_engine_available_accepts_the_defaults_and_refuses_two_engines():
    from trl_vapo.config import VAPOConfig

    config = VAPOConfig(output_dir="unused", report_to="none")
    default = EngineSettings.from_config(config)
    check_engine_available(default)  # generate(): always available
    # The config's sampling, vLLM options and rollout size, each read from its own field; the rest the defaults.
    assert default.sampling == SamplingSettings(config.max_completion_length, config.temperature, config.top_p)
    assert default.vllm["mode"] == config.vllm_mode == "colocate" and default.vllm["server_port"] == 8000
    assert default.rollout_size == config.generation_batch_size
    assert default.engine == "generate" and default == EngineSettings(
        sampling=default.sampling, vllm=default.vllm, rollout_size=default.rollout_size, auto=True
    )
    with pytest.raises(ValueError, match="choose one"):
        EngineSettings.from_config(SimpleNamespace(use_vllm=True, use_transformers_continuous_batching=True))
    with pytest.raises(ValueError, match="vllm_mode"):
        check_engine_available(EngineSettings("vllm", vllm={"mode": "remote"}))
    with pytest.raises(ValueError, match="Unknown generation engine 'sglang'"):
        EngineSettings("sglang")
    by_hand = EngineSettings("vllm", vllm={"mode": "server"})  # the other options: VAPOConfig's (TRL's) defaults
    assert by_hand.vllm["mode"] == "server" and by_hand.vllm["server_port"] == 8000
    with pytest.raises(ValueError, match="rollout_size"):
        by_hand.vllm_generation_kwargs(num_processes=1)


def test_build_engine_picks_by_trl_field_names(tiny):
    model, tokenizer = tiny
    from trl_vapo.config import VAPOConfig

    base = {"output_dir": "unused", "report_to": "none", "max_completion_length": 8, "generation_batch_size": 8}
    default = build_engine(EngineSettings.from_config(VAPOConfig(**base)), model, tokenizer)
    batching = build_engine(
        EngineSettings.from_config(
            VAPOConfig(
                **base,
                use_transformers_continuous_batching=True,
                transformers_continuous_batching_config={"page_size": 32},
            )
        ),
        model,
        tokenizer,
    )
    assert type(default) is TransformersGenerate and type(batching) is ContinuousBatching
    assert batching.config == {"page_size": 32} and default.sampling.max_new_tokens == 8
    assert default.stop_token_ids == [tokenizer.eos_token_id]


# ---------------------------------------------------------------------------------------------------------------------
# Importance-sampling metrics (the weights themselves are `trl_vapo.core`'s, tested in test_core.py)
# ---------------------------------------------------------------------------------------------------------------------


def test_importance_sampling_metrics():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    sampler = torch.tensor([[-1.5, -2.0, math.nan], [-0.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights = importance_sampling_weights(trainer, sampler, mask, "token_truncate", 3.0)
    metrics = importance_sampling_metrics(trainer, sampler, weights, mask)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(0.5)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(1.0 / 4)  # NaN left out
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.5))
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-0.5))
    # No scored token on this process: NaN, which the reduction over processes leaves out (0.0 would pull means down).
    empty = importance_sampling_metrics(trainer, sampler, weights, torch.zeros_like(mask))
    assert all(math.isnan(value) for value in empty.values())
    # Sequence weights: a completion that does not train (truncated and masked, unscored) is left out; its masked
    # difference would read exp(0) = 1 whatever the samplers did.
    drifted = torch.full((3, 2), -1.0), torch.full((3, 2), -1.3)
    kept = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    weights = importance_sampling_weights(*drifted, kept, "sequence_truncate", 3.0)
    metrics = importance_sampling_metrics(*drifted, weights, kept)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.6))  # 2 tokens x 0.3
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(0.3))  # not 1


def _rollout_metrics_on_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo processes: a small rollout whose `sampling/*` readings differ by rank, through
    `rollout_metrics` with the real collectives (accelerate's `gather` is an all-gather concatenated on dim 0)."""
    import json

    import torch.distributed as dist

    from trl_vapo.metric_names import RL
    from trl_vapo.rollout import Rollout, rollout_metrics
    from trl_vapo.scoring import Scores

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def gather(tensor):
        parts = [torch.empty_like(tensor) for _ in range(2)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def all_reduce(tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    n, c = 2, 3
    zeros = torch.zeros(n, c)
    rollout = Rollout(
        phase=RL,
        input_ids=torch.ones(n, 1 + c, dtype=torch.long),
        attention_mask=torch.ones(n, 1 + c, dtype=torch.long),
        prompt_length=1,
        truncated=torch.zeros(n, dtype=torch.bool),
        scores=Scores(torch.ones(n, 1), torch.ones(n), torch.ones(n, dtype=torch.bool), ["r"]),
        action_mask=torch.ones(n, c, dtype=torch.long),
        loss_mask=torch.ones(n, c),
        is_correct=torch.ones(n, dtype=torch.bool),
        is_positive=torch.ones(n, dtype=torch.bool),
        old_values=zeros,
        returns=zeros,
        raw_advantages=zeros,
        advantages=zeros,
        lambda_actor=torch.ones(n),
        sampling_metrics={  # rank 0, rank 1
            "sampling/sampling_logp_difference/mean": [0.1, 0.3][rank],
            "sampling/sampling_logp_difference/max": [0.5, 0.2][rank],
            "sampling/importance_sampling_ratio/min": [0.9, 0.7][rank],
            "sampling/importance_sampling_ratio/mean": [1.0, math.nan][rank],  # a process without a reading
        },
    )
    metrics = rollout_metrics(rollout, gather, all_reduce)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({k: v for k, v in metrics.items() if k.startswith("sampling")})
    )
    dist.destroy_process_group()


def test_sampling_metrics_are_reduced_over_processes(tmp_path):
    """Two real processes (gloo): every process logs the same `sampling/*` values, reduced as TRL reduces them."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:  # a free port: the OS's pick, as the other tests' forked ranks take theirs
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(_rollout_metrics_on_rank, args=(port, str(tmp_path)), nprocs=2, start_method="fork")
    expected = {
        "sampling/sampling_logp_difference/mean": pytest.approx(0.2),
        "sampling/sampling_logp_difference/max": pytest.approx(0.5),
        "sampling/importance_sampling_ratio/min": pytest.approx(0.7),
        "sampling/importance_sampling_ratio/mean": pytest.approx(1.0),
    }
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation uses the engines and their stop ids
# ---------------------------------------------------------------------------------------------------------------------


def test_evaluation_cuts_at_the_generation_configs_eos_ids(tiny_model_dir):
    """Training stops at every EOS id of the generation config; evaluation now does too (it used to stop only at
    the tokenizer's EOS)."""
    from trl_vapo.evaluation import sample_completions

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    free, lengths = sample_completions(model, tokenizer, TEXT_PROMPTS, temperature=0.0, max_new_tokens=12)
    # Make the first character of the first greedy completion a stop token of the generation config.
    stop_char = free[0][0]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(stop_char)]
    cut, cut_lengths = sample_completions(model, tokenizer, TEXT_PROMPTS, temperature=0.0, max_new_tokens=12)
    assert cut_lengths[0] == 1 and cut[0] == stop_char
    for text, full in zip(cut, free):
        assert full.startswith(text) and (text == full or text.endswith(stop_char))
    assert max(lengths) == 12
    # Training's generation_kwargs name stop tokens too: `sample_completions` (and `evaluate_policy`) built their
    # engine without them and sampled past where training's completions end.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    stops = {"eos_token_id": [tokenizer.convert_tokens_to_ids(stop_char)]}
    kwargs = dict(temperature=0.0, max_new_tokens=12, generation_kwargs=stops)
    assert sample_completions(model, tokenizer, TEXT_PROMPTS, **kwargs) == (cut, cut_lengths)


@pytest.mark.parametrize("overrides", [{"do_sample": False}, {"temperature": 1e-3}, {"top_p": 1e-6}])
def test_a_sampled_evaluation_samples_as_its_arguments_say_whatever_trainings_generation_kwargs(
    tiny_model_dir, overrides
):
    """`evaluate_policy` (the held-out report, `trl-vapo eval`) passes training's generation_kwargs on for where
    completions end; applied last, their own sampling settings replaced the pass's: avg@k at "temperature 1.0" was k
    copies of one completion. The pass samples as its arguments say; the greedy pass is greedy either way."""
    from trl_vapo.evaluation import sample_completions

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    kwargs = dict(num_samples=8, max_new_tokens=8, generation_kwargs=overrides)
    torch.manual_seed(0)
    sampled, _ = sample_completions(model, tokenizer, TEXT_PROMPTS[:1], temperature=1.0, top_p=1.0, **kwargs)
    assert len(set(sampled)) > 1
    greedy, _ = sample_completions(model, tokenizer, TEXT_PROMPTS[:1], temperature=0.0, **kwargs)
    assert len(set(greedy)) == 1


@pytest.mark.parametrize("engine", ["continuous_batching", "static_cache"])  # each against generate()
def test_evaluation_engines_agree_greedily(engine, demo, caplog):
    from trl_vapo.demo.data import build_split
    from trl_vapo.evaluation import sample_completions

    model, tokenizer, _ = demo
    prompts = list(build_split("held_out", 6)["prompt"])
    reference, ref_lengths = sample_completions(model, tokenizer, prompts, temperature=0.0, max_new_tokens=96)
    with caplog.at_level(logging.INFO):
        texts, lengths = sample_completions(
            model, tokenizer, prompts, temperature=0.0, max_new_tokens=96, engine=engine
        )
    assert "use generate()" not in caplog.text  # the engine's own sampling, not its fallback (the reference's)
    assert texts == reference and lengths == ref_lengths
    assert all("\\boxed{" in t for t in texts)
    assert set(string.digits) & set("".join(texts))


def test_evaluation_builds_its_engine_through_build_engine_and_refuses_a_vllm_name(tiny, monkeypatch):
    import trl_vapo.evaluation as evaluation
    from trl_vapo.static_cache import StaticCacheEngine

    model, tokenizer = tiny
    built = []  # (the settings `build_engine` got, the engine it built)
    build_engine = evaluation.build_engine
    monkeypatch.setattr(
        evaluation, "build_engine", lambda s, *a, **k: built.append((s, build_engine(s, *a, **k))) or built[-1][1]
    )
    settings = EngineSettings(engine="static_cache", sampling=SamplingSettings(max_new_tokens=4), batch_size=2)
    prompts = ["1+2=", "a"]
    completions, lengths = evaluation.sample_completions(model, tokenizer, prompts, max_new_tokens=4, engine=settings)
    assert len(completions) == 2 and max(lengths) <= 4
    [(given, engine)] = built
    assert given == settings and isinstance(engine, StaticCacheEngine)
    with pytest.raises(ValueError, match="built engine"):
        evaluation.sample_completions(model, tokenizer, ["a"], engine="vllm")
