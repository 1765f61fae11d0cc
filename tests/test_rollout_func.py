"""GRPOTrainer's `rollout_func`: completions a user's function samples (a multi-turn episode, an agent server),
trained on as VAPO trains its own, where the tokens an environment wrote (`env_mask` 0) are context, not actions."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers import CapturingTrainer, digit_fraction, make_args, prompts_dataset, rl_logs
from peft import LoraConfig

from trl_vapo import VAPOTrainer
from trl_vapo.generation import read_rollout_func_output
from trl_vapo.scoring import rows_with_fields

ENV_REPLY = "|ok|"  # what the environment answers after the policy's first turn


def two_turn_episodes(calls: list):
    """A rollout_func: the policy answers, the environment replies, the policy answers again, sampled with the
    trainer's own engine; the prompt it shows the policy is its own ("Q: " before the dataset's)."""

    def rollout_func(prompts, trainer):
        calls.append((list(prompts), trainer))
        tokenizer, engine = trainer.processing_class, trainer.generation_engine
        prompt_ids = tokenizer(text=[f"Q: {p}" for p in prompts])["input_ids"]
        first = engine.generate(prompt_ids).completion_lists()
        reply = tokenizer(text=ENV_REPLY)["input_ids"]
        second = engine.generate([p + a + reply for p, a in zip(prompt_ids, first)]).completion_lists()
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [a + reply + b for a, b in zip(first, second)],
            "logprobs": [[0.0] * (len(a) + len(reply) + len(b)) for a, b in zip(first, second)],
            "env_mask": [[1] * len(a) + [0] * len(reply) + [1] * len(b) for a, b in zip(first, second)],
            "turns": [2] * len(prompts),  # one per prompt: each reward call gets its own
            "episode": "two-turn",  # not a list: every completion gets it
        }

    return rollout_func


def test_multi_turn_episodes_train_with_the_environments_tokens_as_context_only(tiny_model_dir, tmp_path):
    calls, seen = [], []

    def reward(completions, turns, episode, **kwargs):
        seen.append((list(completions), list(turns), list(episode)))
        return digit_fraction(completions)

    args = make_args(tmp_path, max_completion_length=6)
    trainer = CapturingTrainer(
        str(tiny_model_dir), reward, args, prompts_dataset(), rollout_func=two_turn_episodes(calls)
    )
    trainer.train()

    # GRPOTrainer's call: this process's prompts as the dataset holds them, each num_generations times in a row.
    prompts, given = calls[0]
    assert given is trainer and len(prompts) == 16 and prompts[:4] == [prompts[0]] * 4 != prompts[4:8]
    completions, turns, episode = seen[0]
    assert turns == [2] * 16 and episode == ["two-turn"] * 16 and all(ENV_REPLY in c for c in completions)
    tokenizer = trainer.processing_class
    for rows, rollout in trainer.rollouts:
        prompt = rollout.input_ids[:, : rollout.prompt_length][rollout.attention_mask[:, : rollout.prompt_length] > 0]
        assert tokenizer.decode(prompt[: 3 + len(rows[0]["prompt"])]) == f"Q: {rows[0]['prompt']}"
        environment = rollout.completion_mask.bool() & ~rollout.action_mask.bool()
        assert environment.sum(dim=1).tolist() == [len(ENV_REPLY)] * len(rollout)
        assert not rollout.loss_mask.bool()[environment].any()
        assert not rollout.advantages[environment].any() and not rollout.returns[environment].any()
        # GAE steps over the reply: with gamma = lam_critic = 1 the critic's target at every action, the first
        # turn's included, is the episode's reward (it sits on the second turn's last token).
        checked = 0
        for i in range(len(rollout)):
            actions = rollout.loss_mask[i].bool()
            if actions.any():
                torch.testing.assert_close(rollout.returns[i][actions], rollout.scores.reward[i].expand(actions.sum()))
                checked += 1
        assert checked > 0
    # Completion lengths count the policy's tokens, as GRPOTrainer counts them.
    first = trainer.rollouts[0][1]
    assert rl_logs(trainer)[0]["completions/mean_length"] == pytest.approx(first.action_mask.sum(1).float().mean())
    # Evaluation samples with it too, on a data set given then: the reward's `turns` comes from the function.
    trained = len(calls)
    metrics = trainer.evaluate(prompts_dataset(4))
    asked = [prompt for prompts, _ in calls[trained:] for prompt in prompts]
    assert asked == [p for p in prompts_dataset(4)["prompt"] for _ in range(4)] and "eval_reward" in metrics


def test_a_grpo_style_rollout_func_samples_with_vllm_and_its_logprobs_are_the_samplers(
    tiny_model_dir, tmp_path, stand_in_vllm, caplog
):
    """With `use_vllm`, a function written for GRPOTrainer samples with `trainer.vllm_generation` (vLLM's stand-in
    here, synced and given the engine's sampling before each call) and returns vLLM's log-probs, which correct the
    loss for the sampler: 0.05 above the trainer's here, as the logged difference says."""

    def with_vllm(prompts, trainer):
        assert trainer.use_vllm  # and vLLM stops where the trainer's engines stop
        assert trainer.vllm_generation.generation_kwargs["stop_token_ids"] == trainer.generation_engine.stop_token_ids
        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        vllm = trainer.vllm_generation
        _, completions, logprobs, _ = vllm.generate(prompts=prompt_ids, images=None, num_generations=1)
        drifted = [[token[0] + 0.05 for token in row] for row in logprobs]
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": drifted}

    args = make_args(tmp_path, max_steps=1, use_vllm=True, vllm_mode="colocate")
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=peft, rollout_func=with_vllm
    )
    trainer.train()
    assert rl_logs(trainer)[0]["sampling/sampling_logp_difference/mean"] == pytest.approx(0.05, abs=1e-4)

    # Without its log-probs (None) there is nothing to correct with: said once (it went silently uncorrected; in
    # GRPOTrainer `old - None` raised), and the run trains on.
    def without_logprobs(prompts, trainer):
        return {**with_vllm(prompts, trainer), "logprobs": None}

    args = make_args(tmp_path / "b", max_steps=2, use_vllm=True, vllm_mode="colocate")
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(), peft_config=peft, rollout_func=without_logprobs
    )
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "returned logprobs=None" in r.getMessage()]
    assert len(said) == 1 and "vllm_importance_sampling_correction=False" in said[0]


def test_a_rollout_funcs_logprobs_guard_its_drift_without_vllm(tiny_model_dir, tmp_path):
    """A rollout_func's log-probs (an agent server's sampler, not vLLM) are what `off_policy_mask_threshold` measures
    the drift against, as GRPOTrainer reads them whatever the backend: they were dropped without `use_vllm`, and the
    mask the user set did nothing. Here the function says every token had log-prob 0, far above the policy's: every
    sequence drifted past 0.5, so the first step's policy loss leaves out every negative advantage. Without vLLM they
    correct nothing (no importance-sampling weights), as in GRPOTrainer."""
    from test_grpo_parity import _first_step_policy_loss

    def certain(prompts, trainer):
        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        completions = trainer.generation_engine.generate(prompt_ids).completion_lists()
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completions,
            "logprobs": [[0.0] * len(c) for c in completions],
        }

    args = make_args(tmp_path, max_steps=1, whiten_advantages=False, off_policy_mask_threshold=0.5)
    trainer = CapturingTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), rollout_func=certain)
    trainer.train()
    [(_, rollout)] = trainer.rollouts
    assert rollout.sampling_logprobs is not None and rollout.is_weights is None
    negative = (rollout.advantages < 0) & rollout.loss_mask.bool()
    assert negative.any() and (rollout.advantages * rollout.loss_mask > 0).any()
    whole = {"mask": rollout.loss_mask, "advantages": rollout.advantages}
    logged = rl_logs(trainer)[0]["loss/policy"]
    assert logged == pytest.approx(_first_step_policy_loss(whole, (~negative).float()), rel=1e-4, abs=1e-6)


def test_a_rollout_funcs_output_becomes_an_engines():
    output = {
        "prompt_ids": [[1, 2], [3], [4]],
        "completion_ids": [[5, 9, 6], [7], []],  # 9 ends a turn: the first completion is taken whole
        "logprobs": [[-0.5, None, -0.25], [-1.0], []],
        "env_mask": [[1, 0, 1], [1], []],
        "tool": "calculator",
    }
    prompt_ids, sample, fields = read_rollout_func_output(output, 3, stop_ids=[9], pad_id=0, keep_logprobs=True)
    assert prompt_ids == [[1, 2], [3], [4]] and fields == {"tool": "calculator"}
    assert sample.completion_ids.tolist() == [[5, 9, 6], [7, 0, 0], [0, 0, 0]]
    assert sample.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert sample.action_mask.tolist() == [[1, 0, 1], [1, 0, 0], [0, 0, 0]]
    assert sample.is_truncated.tolist() == [True, True, False]  # no stop token last; an empty one ran out of nothing
    assert sample.sampler_logprobs[0, 0] == -0.5 and math.isnan(sample.sampler_logprobs[0, 1])
    assert read_rollout_func_output(output, 3, [6], 0, keep_logprobs=False)[1].is_truncated.tolist()[0] is False
    output["logprobs"] = [[0.0], [0.0], [0.0]]  # not read without vLLM's correction, as GRPOTrainer leaves them
    assert read_rollout_func_output(output, 3, [9], 0, keep_logprobs=False)[1].sampler_logprobs is None
    output["logprobs"] = None  # none known: nothing to correct with, even with vLLM's correction on
    assert read_rollout_func_output(output, 3, [9], 0, keep_logprobs=True)[1].sampler_logprobs is None
    output["logprobs"] = [[0.0], [0.0], [0.0]]
    with pytest.raises(ValueError, match="`logprobs` for prompt 0 has 1 entries for its 3 completion tokens"):
        read_rollout_func_output(output, 3, [9], 0, keep_logprobs=True)
    # Rows as tensors (slices of generate()'s output) read as lists: `bool()` of a row raised, and a one-token row's
    # stop token was never found (a tensor is hashed by identity), the row always truncated.
    tensors = {**output, "logprobs": None, "env_mask": None}
    tensors["prompt_ids"] = [torch.tensor(row) for row in output["prompt_ids"]]
    tensors["completion_ids"] = [torch.tensor([5, 9, 6]), torch.tensor([9]), torch.tensor([], dtype=torch.long)]
    prompt_ids, sample, _ = read_rollout_func_output(tensors, 3, stop_ids=[9], pad_id=0, keep_logprobs=False)
    assert prompt_ids == [[1, 2], [3], [4]] and sample.is_truncated.tolist() == [True, False, False]
    # Log-probs and an environment mask as one tensor each (`bool()` of it raised "ambiguous"): read as their rows.
    square = {**tensors, "completion_ids": torch.tensor([[5, 9], [7, 9], [4, 4]])}
    square["logprobs"], square["env_mask"] = torch.full((3, 2), -0.5), torch.tensor([[1, 0], [1, 1], [0, 1]])
    sample = read_rollout_func_output(square, 3, stop_ids=[9], pad_id=0, keep_logprobs=True)[1]
    assert (
        sample.action_mask.tolist() == [[1, 0], [1, 1], [0, 1]] and sample.sampler_logprobs.tolist()[0] == [-0.5] * 2
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"logprobs": None}, r"must return keys \['logprobs'\]"),  # GRPOTrainer's words
        ({"completion_ids": [[5]]}, "returned 1 `completion_ids` for the 2 prompts"),
        ({"env_mask": [[1], [1, 0]]}, "`env_mask` for prompt 1 has 2 entries for its 1 completion tokens"),
        # A `generate()` output's whole sequences: the prompts would train as sampled tokens.
        (
            {"prompt_ids": [[1, 2], [3, 4]], "completion_ids": [[1, 2, 5], [3, 4, 6]]},
            "completion_ids that each begin with their prompt's ids: they must hold the completion's tokens alone",
        ),
        (  # a batched generate()'s rows: the shorter prompt left-padded (pad id 0)
            {"prompt_ids": [[1, 2, 3], [4, 5]], "completion_ids": [[1, 2, 3, 7], [0, 4, 5, 6]]},
            "completion_ids that each begin with their prompt's ids",
        ),
    ],
)
def test_a_rollout_funcs_output_that_does_not_fit_is_refused_naming_what(change, says):
    output = {"prompt_ids": [[1], [2]], "completion_ids": [[5], [6]], "logprobs": [[0.0], [0.0]]}
    output.update(change)
    output = {key: value for key, value in output.items() if value is not None}
    with pytest.raises(ValueError, match=says):
        read_rollout_func_output(output, 2, [9], 0, keep_logprobs=False)
    with pytest.raises(TypeError, match="must return a dict"):
        read_rollout_func_output([output], 2, [9], 0, keep_logprobs=False)


def test_drop_long_prompts_with_a_rollout_func_is_said_to_drop_nothing(tiny_model_dir, tmp_path, caplog):
    """A rollout_func's prompt ids are its own, so nothing is dropped: `drop_long_prompts=True` did nothing, and
    said nothing."""

    def rollout(prompts, trainer):  # never called: the trainer is only built
        raise AssertionError

    args = make_args(tmp_path, max_prompt_length=2, drop_long_prompts=True)
    with caplog.at_level("WARNING"):
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), rollout_func=rollout)
    assert len(trainer.train_dataset) == len(prompts_dataset())
    assert "drop_long_prompts=True drops nothing with a rollout_func" in caplog.text


def test_a_rollout_funcs_fields_become_columns_of_new_rows():
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    merged = rows_with_fields(rows, {"env_reward": [0.5, 1.0], "task": "sum"})
    assert merged == [
        {"prompt": "a", "answer": "1", "env_reward": 0.5, "task": "sum"},
        {"prompt": "b", "answer": "2", "env_reward": 1.0, "task": "sum"},
    ]
    assert rows[0] == {"prompt": "a", "answer": "1"}  # the dataset's rows are left as they were
    with pytest.raises(ValueError, match="`env_reward` is a list of 3 for 2 prompts"):
        rows_with_fields(rows, {"env_reward": [0.5, 1.0, 2.0]})
    with pytest.raises(ValueError, match=r"returned the field\(s\) \['completions'\]"):
        rows_with_fields(rows, {"completions": ["x", "y"]})


def test_a_rollout_func_that_is_no_callable_is_refused_before_any_model_loads(tmp_path):
    with pytest.raises(TypeError, match="rollout_func must be a callable"):
        VAPOTrainer("no/such-model", digit_fraction, make_args(tmp_path), prompts_dataset(), rollout_func="vllm")


def test_a_rollout_func_reads_the_sampling_settings_grpotrainer_gives_it(tiny_model_dir, tmp_path):
    """TRL's openenv examples sample with the trainer's own settings (`trainer.temperature`, `trainer.top_k`,
    `trainer.max_completion_length`, `trainer.vllm_mode`, ...): each was an AttributeError at the first rollout."""
    read = {}
    names = [
        "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "vllm_mode",
        "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization", "mask_truncated_completions", "use_vllm",
        "num_generations", "chat_template_kwargs",
    ]  # fmt: skip
    episodes = two_turn_episodes([])

    def rollout_func(prompts, trainer):
        read.update({name: getattr(trainer, name) for name in [*names, "eos_token_ids"]})
        return episodes(prompts, trainer)

    args = make_args(tmp_path, max_completion_length=6, max_steps=1, temperature=0.9, top_k=5, repetition_penalty=1.1)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), rollout_func=rollout_func)
    trainer.train()
    expected = {name: getattr(args, name) for name in names}
    expected["chat_template_kwargs"] = args.chat_template_kwargs or {}  # (GRPOTrainer's: a dict, never None)
    assert {name: read[name] for name in names} == expected
    assert trainer.processing_class.eos_token_id in read["eos_token_ids"]
