"""The generation engines inside the trainer and `trl-vapo eval`: continuous batching trains and resumes exactly; the
vLLM glue pushes the policy (never the critic) once per optimizer step and corrects the loss for the sampler.

vLLM cannot be installed here (no GPU): the vLLM test runs the trainer against `StandInVLLMGeneration` from
`test_generation.py`, a subclass of TRL's real `VLLMGeneration` whose vLLM parts are replaced by transformers (its
`sync_weights` is TRL's own code), with TRL's `is_vllm_available` answering yes.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import (
    EARLY_STOPPING,
    CapturingTrainer,
    StandInVLLMGeneration,
    comparable,
    digit_fraction,
    make_args,
    merged_policy_only,
    prompts_dataset,
    rl_logs,
)
from peft import LoraConfig

from trl_vapo import VAPOTrainer
from trl_vapo.cli import main as cli_main


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def test_continuous_batching_trains_end_to_end_and_resumes_exactly(tiny_model_dir, tmp_path):
    def run(resume=None):
        args = make_args(
            tmp_path,
            max_steps=3,
            value_pretrain_steps=2,
            value_pretrain_patience=None,
            save_strategy="steps",
            save_steps=2,
            num_iterations=2,
            use_transformers_continuous_batching=True,
            bf16=True,  # training computes under bf16 autocast; the engine's background thread runs without it
            use_cpu=True,
        )
        trainer = VAPOTrainer(
            model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset()
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run()
    assert type(full.generation_engine).__name__ == "ContinuousBatching"
    assert [h["phase"] for h in full.state.log_history if "phase" in h] == ["value_pretrain"] * 4 + ["rl"] * 3
    # The first update's ratio is against log-probs the training forward recomputed: exactly 1, as with generate().
    assert rl_logs(full)[0]["approx_kl"] == 0.0
    lengths = [h["completions/mean_length"] for h in rl_logs(full) if "completions/mean_length" in h]
    assert lengths and all(n > 0 for n in lengths)
    resumed = run(resume=str(tmp_path / "out" / "checkpoint-4"))
    after = [h for h in comparable(resumed.state.log_history) if h["step"] > 4]
    assert after == [h for h in comparable(full.state.log_history) if h["step"] > 4] and len(after) == 3


def test_the_models_own_sampling_settings_are_said_as_the_engine_applies_them(
    tiny_model_dir, tmp_path, stand_in_vllm, caplog
):
    """A model whose generation_config sets min_p: `generate()` samples with it (off the losses' policy: said), vLLM
    does not (said by its engine). With vLLM the trainer said both: that rollouts sample with min_p=0.05, and that
    vLLM leaves it out."""
    import logging
    import shutil

    from transformers import GenerationConfig

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = GenerationConfig.from_pretrained(model_dir)
    config.do_sample, config.min_p = True, 0.05  # (as Qwen2.5-Instruct's sets top_p, top_k, repetition_penalty)
    config.save_pretrained(model_dir)
    said = {}
    for engine, settings in (("generate", {}), ("vllm", {"use_vllm": True, "vllm_mode": "colocate"})):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trl_vapo.generation"):
            VAPOTrainer(str(model_dir), digit_fraction, make_args(tmp_path / engine, **settings), prompts_dataset())
        said[engine] = caplog.text
    assert "Rollouts are sampled with min_p=0.05, which the losses do not model" in said["generate"]
    assert "Rollouts are sampled with" not in said["vllm"]
    assert "The model's generation_config sets min_p=0.05, which generate() applies and vLLM does not" in said["vllm"]


def test_vllm_engine_gets_the_policy_once_per_step_and_its_rollouts_carry_the_correction(
    tiny_model_dir, tmp_path, stand_in_vllm
):
    # Two optimizer steps per rollout, three rollouts: the policy changes between rollouts, so every rollout but the
    # first (value pretraining's frozen policy) samples from freshly pushed weights.
    args = make_args(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=2,
        max_steps=4,
        value_pretrain_steps=1,
        value_pretrain_patience=None,
        use_vllm=True,
        vllm_mode="colocate",
        learning_rate=1e-2,
    )
    trainer = CapturingTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=lora(),
    )
    sampler = trainer.generation_engine.vllm_generation
    assert isinstance(sampler, StandInVLLMGeneration)
    syncs = []  # (the optimizer step asked for, load_weights calls vLLM received by then)
    sync = trainer.generation_engine.sync_weights

    def recording_sync(step=None):
        sync(step)
        syncs.append((step, sampler.pushes))

    trainer.generation_engine.sync_weights = recording_sync
    trainer.train()

    # One sync per rollout, each at a new optimizer step (value pretraining's frozen policy, then after steps 2 and
    # 4), and each one pushes the whole policy.
    assert [step for step, _ in syncs] == [-1, 2, 4]
    per_sync = syncs[0][1]
    assert per_sync > 0 and [pushes for _, pushes in syncs] == [per_sync, 2 * per_sync, 3 * per_sync]
    # What vLLM holds is the policy (base merged with the policy adapter), never the critic adapter.
    expected = merged_policy_only(trainer.actor_critic.policy)
    sync(step=None)
    assert set(sampler.received) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(sampler.received[name], value, atol=1e-6, rtol=0, msg=name)
    # RL rollouts carry TRL's importance-sampling weights (sequence_mask by default) and log them.
    rl_rollouts = [r for _, r in trainer.rollouts if r.phase == "rl"]
    assert rl_rollouts and all(r.is_weights is not None and r.is_weights.shape[1] == 1 for r in rl_rollouts)
    assert sum("sampling/importance_sampling_ratio/mean" in h for h in rl_logs(trainer)) == len(rl_rollouts)


def test_the_best_checkpoint_loaded_at_the_end_reaches_vllm(tiny_model_dir, tmp_path, stand_in_vllm):
    """`load_best_model_at_end` loads the best checkpoint after the last step's evaluation had pushed the last weights
    to vLLM at that step: the next sampling (the command line's held-out report, an `evaluate()`) pushed nothing, the
    step unchanged, and scored the last weights. It pushes the best ones."""
    from transformers import EarlyStoppingCallback

    args = make_args(
        tmp_path, per_device_eval_batch_size=4, num_generations_eval=2, use_vllm=True, vllm_mode="colocate",
        **EARLY_STOPPING,
    )  # fmt: skip
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(), prompts_dataset(3), peft_config=lora(),
        callbacks=[EarlyStoppingCallback(early_stopping_patience=1)],
    )  # fmt: skip
    trainer.train()
    assert int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1]) < trainer.state.global_step
    sampler = trainer.generation_engine.vllm_generation
    pushes = sampler.pushes
    trainer.generation_engine.sync_weights(trainer.state.global_step)  # as the next rollout or evaluation asks
    assert sampler.pushes > pushes
    for name, value in merged_policy_only(trainer.actor_critic.policy).items():  # the best weights, loaded
        torch.testing.assert_close(sampler.received[name], value, atol=1e-6, rtol=0, msg=name)


def test_the_policy_loss_is_weighted_by_the_samplers_mismatch(tiny_model_dir, tmp_path, stand_in_vllm, monkeypatch):
    """A sampler whose log-prob of every token is 0.05 above the trainer's: with `token_truncate` each token's weight
    is exp(-0.05), and the first step's policy loss (ratio 1, advantages not whitened) is exp(-0.05) times the loss
    without the correction. (The stand-in samples with the trainer's own weights, whose weights read 1: leaving them
    out of the loss passed the test above.)"""
    generate = StandInVLLMGeneration.generate

    def drifted(self, *args, **kwargs):
        prompts, completions, logprobs, token_ids = generate(self, *args, **kwargs)
        return prompts, completions, [[[lp + 0.05 for lp in tok] for tok in row] for row in logprobs], token_ids

    monkeypatch.setattr(StandInVLLMGeneration, "generate", drifted)

    def first_step(correction: bool) -> dict:
        args = make_args(
            tmp_path / str(correction),
            max_steps=1,
            whiten_advantages=False,
            use_vllm=True,
            vllm_mode="colocate",
            vllm_importance_sampling_correction=correction,
            vllm_importance_sampling_mode="token_truncate",
        )
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=lora())
        trainer.train()
        return rl_logs(trainer)[0]

    corrected, plain = first_step(True), first_step(False)
    assert corrected["sampling/sampling_logp_difference/mean"] == pytest.approx(0.05, abs=1e-4)
    assert abs(plain["loss/policy"]) > 1e-3
    assert corrected["loss/policy"] == pytest.approx(math.exp(-0.05) * plain["loss/policy"], rel=1e-4)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_a_vllm_server_without_processed_logprobs_is_warned_about(
    tiny_model_dir, tmp_path, stand_in_vllm, monkeypatch, caplog, mode
):
    """The server's `/server_info` as TRL's `VLLMClient.get_server_info` returns it (stand-in: no server here)."""
    from types import SimpleNamespace

    stand_in_init = StandInVLLMGeneration._init_vllm

    def init(self):
        stand_in_init(self)
        self.vllm_client = SimpleNamespace(get_server_info=lambda: {"model_config": {"logprobs_mode": mode}})

    monkeypatch.setattr(StandInVLLMGeneration, "_init_vllm", init)
    args = make_args(tmp_path, use_vllm=True, vllm_mode="server")
    with caplog.at_level("WARNING"):
        VAPOTrainer(model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset())
    warned = [r.getMessage() for r in caplog.records if "--logprobs-mode" in r.getMessage()]
    assert len(warned) == (mode != "processed_logprobs") and all(mode in message for message in warned)


def test_the_processes_of_a_colocated_vllm_group_share_their_sampling_seed(
    tiny_model_dir, tmp_path, stand_in_vllm, monkeypatch
):
    """Each process seeds its generators apart (as GRPOTrainer's `set_seed(seed, device_specific=True)`), but the
    processes of one colocated vLLM tensor-parallel group run one engine and must draw alike: the trainer seeded them
    apart after the engine's start had seeded them alike, so a group's processes fed different tokens into one forward.
    A vLLM server's processes do not sample (the server does)."""
    from trl_vapo.generation import sampling_seed

    plain = make_args(tmp_path, seed=7)
    assert [sampling_seed(plain, rank) for rank in range(4)] == [7, 8, 9, 10]
    vllm = {"use_vllm": True, "seed": 7}
    colocated = make_args(tmp_path, vllm_mode="colocate", **vllm)
    colocated.vllm_tensor_parallel_size = 2  # (as on 4 processes: on this one process the config refuses it)
    assert [sampling_seed(colocated, rank) for rank in range(4)] == [7, 7, 8, 8]
    server = make_args(tmp_path, vllm_mode="server", vllm_tensor_parallel_size=2, **vllm)
    assert [sampling_seed(server, rank) for rank in range(4)] == [7, 8, 9, 10]
    # The trainer seeds its process so once built: as process 1 (a stand-in for the second of two processes: the
    # accelerator's index, which the trainer reads), with its own seed, not `args.seed` it loaded the models under.
    from accelerate import Accelerator

    monkeypatch.setattr(Accelerator, "process_index", property(lambda self: 1))
    VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, seed=11), prompts_dataset())
    drawn = torch.rand(4)
    torch.manual_seed(12)
    assert torch.equal(drawn, torch.rand(4))


def test_generation_kwargs_vllm_does_not_take_are_refused_before_anything_loads(tmp_path, stand_in_vllm, monkeypatch):
    """vLLM's `SamplingParams` is a struct of fixed fields: a transformers-only key in `generation_kwargs` was a
    TypeError at the first colocated rollout (a server ignores it). vLLM cannot be installed here: a stand-in module
    whose `SamplingParams` carries field names of the real msgspec struct in `__struct_fields__`, which the check
    reads (a subset of them is enough here). transformers' names that the engine renames (`min_new_tokens`,
    `stop_strings`) pass."""
    import sys
    from types import ModuleType

    from trl_vapo.generation import EngineSettings, check_engine_available

    vllm = ModuleType("vllm")
    vllm.SamplingParams = type("SamplingParams", (), {"__struct_fields__": (
        "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
        "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
        "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "logits_processors",
        "include_stop_str_in_output", "truncate_prompt_tokens", "output_kind", "guided_decoding", "logit_bias",
        "allowed_token_ids", "extra_args", "bad_words",
    )})  # fmt: skip
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    refused = make_args(tmp_path, use_vllm=True, generation_kwargs={"no_repeat_ngram_size": 3, "top_k": 5})
    with pytest.raises(ValueError, match=r"generation_kwargs \['no_repeat_ngram_size'\]: vLLM's SamplingParams"):
        check_engine_available(EngineSettings.from_config(refused))
    renamed = {"min_new_tokens": 4, "stop_strings": ["</answer>"], "presence_penalty": 0.5, "do_sample": True}
    check_engine_available(EngineSettings.from_config(make_args(tmp_path, use_vllm=True, generation_kwargs=renamed)))
    # Fields vLLM has that the trainer needs as its requests leave them: `logprobs` > 0 gave the most likely token's
    # log-prob as the sampled one's (the importance-sampling correction's input), None turned the correction off.
    monkeypatch.delitem(sys.modules, "vllm")  # refused whether or not vLLM is installed
    for owned, says in (({"logprobs": 5}, "logprobs"), ({"truncate_prompt_tokens": 8}, "shortened prompt")):
        with pytest.raises(
            ValueError, match=rf"generation_kwargs sets {next(iter(owned))}, which the trainer needs.*{says}"
        ):
            check_engine_available(
                EngineSettings.from_config(make_args(tmp_path, use_vllm=True, generation_kwargs=owned))
            )


def test_a_clock_on_the_rollouts_is_refused_and_another_kv_cache_keeps_generate(tmp_path):
    """`max_time` stopped completions short of the budget without a stop token: counted as ended, trained on under
    mask_truncated_completions. A `cache_implementation` other than static (offloaded, quantized) was replaced by the
    static-cache engine's full cache on a GPU without a word: `generate()` keeps it."""
    from trl_vapo.generation import EngineSettings

    with pytest.raises(ValueError, match="generation_kwargs sets max_time: a completion the clock stops"):
        make_args(tmp_path, generation_kwargs={"max_time": 30.0})
    # Another pad id than the tokenizer's: generate() padded with it, the trainer cut and masked by the tokenizer's.
    with pytest.raises(ValueError, match="generation_kwargs sets pad_token_id: the completions are padded with the"):
        make_args(tmp_path, generation_kwargs={"pad_token_id": 0})
    for sample in (0, "false", None):  # `generate()` read 0 as greedy where the others sampled
        with pytest.raises(ValueError, match=rf"generation_kwargs sets do_sample={sample!r}: give true or false"):
            make_args(tmp_path, generation_kwargs={"do_sample": sample})
    for cache, engine in ((None, "static_cache"), ("static", "static_cache"), ("offloaded", "generate")):
        settings = EngineSettings.from_config(make_args(tmp_path, cache_implementation=cache))
        assert settings.placed("cuda", sharded=False).engine == engine


def test_use_vllm_without_vllm_fails_before_the_model_loads(tmp_path):
    args = make_args(tmp_path, use_vllm=True)
    with pytest.raises(ImportError, match="pip install vllm"):
        VAPOTrainer(model="no/such-model", reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset())


def test_eval_takes_the_training_engine_flags(tmp_path, capsys, monkeypatch):
    import trl_vapo.generation as generation
    from trl_vapo.demo import MODEL_DIR

    built = []  # the engines `trl-vapo eval` samples with
    build_engine = generation.build_engine
    monkeypatch.setattr(generation, "build_engine", lambda *a, **k: built.append(build_engine(*a, **k)) or built[-1])
    out = tmp_path / "scores.json"
    code = cli_main(
        [
            "eval",
            "--model",
            str(MODEL_DIR),
            "--num_prompts",
            "4",
            "--k",
            "2",
            "--max_completion_length",
            "96",
            "--use_transformers_continuous_batching",
            "--output_json",
            str(out),
        ]
    )
    assert code == 0
    assert [type(engine) for engine in built] == [generation.ContinuousBatching]
    scores = json.loads(out.read_text())
    assert scores["num_problems"] == 4 and 0 <= scores["avg@2"] <= 1
    assert cli_main(["eval", "--model", str(MODEL_DIR), "--use_vllm"]) == 2
    assert "pip install vllm" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
@pytest.mark.parametrize("adapted", ["target_modules", "modules_to_save"])
def test_vllm_with_an_adapter_on_a_head_tied_to_the_embeddings_is_refused(
    tiny_model_dir, tmp_path, stand_in_vllm, adapted, module
):
    """The tiny model ties its head to its embeddings (as Qwen2.5 up to 3B and Llama-3.2 do): vLLM builds that head
    from the embeddings, which the sync pushes once, unmerged, so an adapter on the head never reached vLLM's
    sampling; one on the embeddings became vLLM's head too, where the trainer's stayed as it was."""
    on_side = {"target_modules": ["q_proj", "v_proj", module]} if adapted == "target_modules" else {}
    on_side |= {"modules_to_save": [module]} if adapted == "modules_to_save" else {}
    peft_config = LoraConfig(r=4, lora_alpha=8, **{"target_modules": ["q_proj", "v_proj"], **on_side})
    args = make_args(tmp_path, use_vllm=True, vllm_mode="colocate")
    side = "LM head" if module == "lm_head" else "input embeddings"
    with pytest.raises(ValueError, match=f"adapter on the {side} of a model whose LM head is tied to its embeddings"):
        VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=args,
            train_dataset=prompts_dataset(),
            peft_config=peft_config,
        )


def test_vllm_with_a_quantized_base_is_refused_before_anything_loads(tiny_model_dir, tmp_path, stand_in_vllm):
    """Syncing a QLoRA policy to vLLM would merge the adapter into packed 4-bit weights (vLLM gets uint8 under bf16
    names, the live base comes back re-quantized): refused, asked for in `model_init_kwargs` or given loaded."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    args = make_args(
        tmp_path, use_vllm=True, vllm_mode="colocate", model_init_kwargs={"quantization_config": quantization}
    )
    with pytest.raises(ValueError, match="use_vllm=True cannot be used with a quantized"):
        # A model path that does not exist: the error comes before anything is loaded.
        VAPOTrainer(
            model=str(tmp_path / "never-loaded"),
            reward_funcs=digit_fraction,
            args=args,
            train_dataset=prompts_dataset(),
            peft_config=lora(),
        )
    # A quantization config that dequantizes at load time (TRL's gpt-oss recipe) gives an unquantized model: not
    # refused, the run gets as far as loading (here a path that does not exist).
    dequantizing = {"quant_method": "mxfp4", "dequantize": True}
    with pytest.raises(OSError, match="never-loaded"):
        VAPOTrainer(
            model=str(tmp_path / "never-loaded"),
            reward_funcs=digit_fraction,
            args=make_args(
                tmp_path, use_vllm=True, vllm_mode="colocate", model_init_kwargs={"quantization_config": dequantizing}
            ),
            train_dataset=prompts_dataset(),
            peft_config=lora(),
        )
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=quantization)
    with pytest.raises(ValueError, match="use_vllm=True cannot be used with a quantized"):
        VAPOTrainer(
            model=loaded,
            reward_funcs=digit_fraction,
            args=make_args(tmp_path, use_vllm=True, vllm_mode="colocate"),
            train_dataset=prompts_dataset(),
            peft_config=lora(),
        )


def test_generation_kwargs_generate_has_no_field_for_are_refused(tmp_path):
    """transformers' `GenerationConfig` keeps a key it has no field for as an attribute, and `generate()` samples as if
    it were not there: vLLM's `presence_penalty`, a `seed` (the config's `seed` seeds the rollouts) changed nothing."""
    from trl_vapo.generation import EngineSettings, check_engine_available

    for engine in ({}, {"use_static_cache_engine": True}):
        refused = make_args(tmp_path, generation_kwargs={"presence_penalty": 0.5, "seed": 3}, **engine)
        with pytest.raises(ValueError, match=r"generation_kwargs \['presence_penalty', 'seed'\]: transformers' Gener"):
            check_engine_available(EngineSettings.from_config(refused))
    taken = {"stop_strings": ["</answer>"], "min_new_tokens": 2, "no_repeat_ngram_size": 3, "stop_token_ids": [5]}
    check_engine_available(EngineSettings.from_config(make_args(tmp_path, generation_kwargs=taken)))
