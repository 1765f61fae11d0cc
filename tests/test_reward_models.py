"""GRPOTrainer's whole reward protocol. Reward models in `reward_funcs`: an id or path, or a `PreTrainedModel` for
sequence classification, scored on prompt + completion through its own tokenizer (the first label's logit), alone or
mixed with reward functions (under ZeRO-2/3 and FSDP2, one and two processes: tests/test_distributed.py).
Functions get `trainer_state`, `log_extra` and `log_metric`, in the check before training too; `async def` functions
run concurrently; a sample no function scores is named in a warning."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time

import pytest
import torch
from helpers import make_args, prompts_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_vapo import VAPOTrainer
from trl_vapo.rewards import math_reward
from trl_vapo.scoring import RewardModel, load_reward_models


def one_by_one(model, tokenizer, texts) -> list[float]:
    """Each text alone, unpadded: the score the batched, padded call must give."""
    with torch.no_grad():
        return [
            model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts
        ]


def test_a_reward_model_scores_prompt_and_completion_as_grpo_does(reward_model_dir, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    (scorer,) = load_reward_models(str(reward_model_dir), None, make_args(tmp_path))
    assert isinstance(scorer, RewardModel) and scorer.__name__ == reward_model_dir.name
    # A path with a trailing slash, as a shell completes it: the same name (it was "": `rewards//mean`).
    (slashed,) = load_reward_models(f"{reward_model_dir}/", None, make_args(tmp_path))
    assert slashed.__name__ == reward_model_dir.name
    assert not scorer.model.training and not any(p.requires_grad for p in scorer.model.parameters())
    prompts, completions = ["1+1=", "12+30=", "7+7="], ["2", "42 because 12+30 is 42", ""]
    scores = scorer(prompts=prompts, completions=completions)
    expected = one_by_one(model, tokenizer, [p + c for p, c in zip(prompts, completions)])
    assert scores == pytest.approx(expected, abs=1e-5) and len(set(scores)) == 3
    # Chat data: the conversation through the reward model's own chat template.
    chats = [[{"role": "user", "content": p}] for p in prompts]
    replies = [[{"role": "assistant", "content": c}] for c in completions]
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(chats, replies)]
    assert scorer(prompts=chats, completions=replies) == pytest.approx(one_by_one(model, tokenizer, texts), abs=1e-5)
    # A module with the model's config, not a PreTrainedModel (`torch.compile`'s wrapper; a PEFT classifier), as
    # GRPOTrainer takes it: it was refused. (The eager backend: the wrapper without a compiler.)
    (compiled,) = load_reward_models(torch.compile(model, backend="eager"), [tokenizer], make_args(tmp_path))
    assert isinstance(compiled, RewardModel) and compiled.__name__ == reward_model_dir.name
    assert compiled(prompts=prompts, completions=completions) == pytest.approx(expected, abs=1e-5)


def test_a_prefilled_assistant_message_and_its_continuation_are_scored_as_one_turn(reward_model_dir, tmp_path):
    """The policy continues a chat prompt's final assistant message (TRL's `maybe_apply_chat_template`); the reward
    model read the prefill and the continuation as two closed turns, and functions got the continuation alone. Now the
    completion is the whole turn and the prompt the rest, as GRPOTrainer passed them when it continued prefills."""
    from trl_vapo.scoring import RewardScorer

    seen = {}

    def capture(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [0.0] * len(prompts)

    (reward_model,) = load_reward_models(str(reward_model_dir), None, make_args(tmp_path))
    scorer = RewardScorer([capture, reward_model], conversational=True)
    user = {"role": "user", "content": "12+30="}
    rows = [{"prompt": [user, {"role": "assistant", "content": "It is "}]}, {"prompt": [user]}]
    scores = scorer.score(rows, ["42", "42"])
    assert seen["prompts"] == [[user], [user]]
    assert seen["completions"] == [
        [{"role": "assistant", "content": "It is 42"}],
        [{"role": "assistant", "content": "42"}],
    ]
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    turns = [[user, *completion] for completion in seen["completions"]]
    expected = one_by_one(model, tokenizer, [tokenizer.apply_chat_template(t, tokenize=False) for t in turns])
    assert scores.per_function[:, 1].tolist() == pytest.approx(expected, abs=1e-5)


def test_reward_models_train_alone_and_mixed_with_reward_functions(tiny_model_dir, reward_model_dir, tmp_path):
    dataset = prompts_dataset(16)
    alone = VAPOTrainer(str(tiny_model_dir), str(reward_model_dir), make_args(tmp_path / "a", max_steps=1), dataset)
    alone.train()
    name = reward_model_dir.name
    assert [h[f"rewards/{name}/mean"] for h in alone.state.log_history if "phase" in h][0] != 0.0

    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    args = make_args(tmp_path / "b", max_steps=1, reward_weights=[0.5, 1.0])
    mixed = VAPOTrainer(
        str(tiny_model_dir), [model, math_reward], args, dataset, reward_processing_classes=[tokenizer, None]
    )
    assert mixed.reward_func_names == [name, "math_reward"] and mixed.reward_funcs[0].tokenizer is tokenizer
    mixed.train()
    log = next(h for h in mixed.state.log_history if "phase" in h)
    assert log["reward"] == pytest.approx(
        0.5 * log[f"rewards/{name}/mean"] + log["rewards/math_reward/mean"], abs=1e-5
    )


def test_reward_processing_classes_must_match_reward_funcs(tiny_model_dir, reward_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    with pytest.raises(ValueError, match=r"number of reward processing classes \(2\) must match .* \(1\)"):
        VAPOTrainer(
            str(tiny_model_dir),
            str(reward_model_dir),
            make_args(tmp_path),
            prompts_dataset(),
            reward_processing_classes=[tokenizer, tokenizer],
        )


def test_reward_weights_are_counted_before_a_reward_model_loads(tiny_model_dir, reward_model_dir, tmp_path):
    """Three weights for a reward model and a function were refused once the reward model had loaded (a 7B judge, for a
    count the arguments show). The model's weights here are unreadable: had it loaded, the error would be theirs."""
    import shutil

    judge = shutil.copytree(reward_model_dir, tmp_path / "judge")
    for weights in judge.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    args = make_args(tmp_path / "run", reward_weights=[1.0, 0.5, 0.2])
    with pytest.raises(ValueError, match=r"reward_weights has 3 values but there are 2 reward functions"):
        VAPOTrainer(str(tiny_model_dir), [str(judge), math_reward], args, prompts_dataset())


# ------------------------------------------------------------------------------------------------- the protocol
def test_a_log_metric_named_as_one_of_vapos_own_is_logged_apart(tiny_model_dir, tmp_path):
    """`log_metric("accuracy", ...)` was averaged into VAPO's own `accuracy` (GRPOTrainer logs none of that name):
    one number of two meanings. Logged as `rewards/log_metric/accuracy`; a name of the user's alone keeps its name,
    in training's logs and in an evaluation's metrics."""

    def judged(completions, log_metric, **kwargs):
        log_metric("accuracy", 7.0)
        log_metric("judge_calls", 3.0)
        return [float(c[:1].isdigit()) for c in completions]

    args = make_args(tmp_path, max_steps=1)
    trainer = VAPOTrainer(str(tiny_model_dir), judged, args, prompts_dataset(), eval_dataset=prompts_dataset(4))
    trainer.train()
    logged = [h for h in trainer.state.log_history if h.get("phase") == "rl"][-1]
    assert logged["rewards/log_metric/accuracy"] == 7.0 and logged["judge_calls"] == 3.0 and logged["accuracy"] <= 1
    metrics = trainer.evaluate()
    assert metrics["eval_rewards/log_metric/accuracy"] == 7.0 and metrics["eval_judge_calls"] == 3.0
    assert metrics["eval_accuracy"] <= 1


def test_several_reward_functions_are_told_which_one_judges_correctness(tiny_model_dir, tmp_path, caplog):
    """With a format reward first and the verifier second, the warning that positive examples come from the weighted
    sum suggested the format reward (the first function) as the one that judges correctness."""

    def short_answer(completions, **kwargs):
        return [float(len(c) < 8) for c in completions]

    with caplog.at_level("WARNING", logger="trl_vapo.trainer"):
        VAPOTrainer(str(tiny_model_dir), [short_answer, math_reward], make_args(tmp_path), prompts_dataset())
    assert "that judge correctness: positive_reward_funcs=['math_reward']." in caplog.text


def test_a_function_using_trainer_state_log_extra_and_log_metric_passes_the_check_and_trains(tiny_model_dir, tmp_path):
    from transformers import TrainerCallback

    from trl_vapo.reporting import rollout_completions_table

    steps = []  # the step of each call's trainer_state

    def progress_reward(completions, trainer_state, log_extra, log_metric, **kwargs):
        steps.append(trainer_state.global_step)
        # TRL's reward schedules read the run's progress so: a ZeroDivisionError in the check before training (its
        # TrainerState had transformers' default max_steps=0), and in `trl-vapo eval`.
        assert 0 <= trainer_state.global_step / trainer_state.max_steps <= 1
        log_extra("length", [len(c) for c in completions])
        log_metric("progress", float(trainer_state.global_step))
        return [float(trainer_state.global_step >= 0) - len(c) / 10 for c in completions]

    rollouts = []

    class Keep(TrainerCallback):
        def on_rollout(self, args, state, control, rollout=None, **kwargs):
            rollouts.append(rollout)

    args = make_args(tmp_path, max_steps=2)
    trainer = VAPOTrainer(str(tiny_model_dir), progress_reward, args, prompts_dataset(), callbacks=[Keep()])
    trainer.train()
    assert [h["progress"] for h in trainer.state.log_history if "phase" in h] == [0.0, 1.0]
    lengths = rollouts[-1].extra_columns["length"]
    table = rollout_completions_table(rollouts[-1], trainer.processing_class, 2)
    assert lengths == [len(c) for c in table.columns["completion"]] and len(lengths) == len(rollouts[-1])
    assert table.text_columns()["length"] == lengths and "length" not in table.columns  # logged, not printed
    assert table.to_dataframe()["length"].tolist() == lengths
    # GRPOTrainer's `_logs`, which callbacks written for it read: the last rollout's table under TRL's keys.
    # Each value against what the rollout holds, not against the table `_logs` is built from.
    logs, rollout = trainer._logs, rollouts[-1]
    completions = trainer.processing_class.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    assert logs["completion"] == completions and logs["extra"]["length"] == lengths == [len(c) for c in completions]
    assert logs["rewards"] == {"progress_reward": pytest.approx([1 - len(c) / 10 for c in completions])}
    mask = rollout.loss_mask.float()
    advantages = (rollout.advantages * mask).sum(dim=1) / mask.sum(dim=1)
    assert logs["advantages"] == pytest.approx(advantages.tolist()) and len(logs["prompt"]) == len(lengths)
    assert logs["images"] == []

    from trl_vapo.evaluation import evaluate_policy

    # `trl-vapo eval` scores with the same functions outside training: they get a trainer_state at step 0.
    steps.clear()
    result = evaluate_policy(
        trainer.model, trainer.processing_class, prompts_dataset(2), progress_reward, k=1, max_new_tokens=4
    )
    assert result.num_problems == 2 and steps and set(steps) == {0}


async def slow_digits(completions, **kwargs):
    await asyncio.sleep(0.4)
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


async def slow_length(completions, **kwargs):
    await asyncio.sleep(0.4)
    return [float(len(c)) for c in completions]


def test_async_reward_functions_run_concurrently_and_name_a_failing_sample(tiny_model_dir, tmp_path):
    from trl_vapo.scoring import RewardScorer

    class SlowJudge:  # an async callable object, in a functools.partial (GRPOTrainer awaits it too)
        async def __call__(self, completions, bonus, **kwargs):
            await asyncio.sleep(0.4)
            return [bonus + (c == "4") for c in completions]

    judge = functools.partial(SlowJudge(), bonus=0.5)
    scorer = RewardScorer([slow_digits, slow_length, judge, lambda completions, **kw: [1.0] * len(completions)])
    rows = [{"prompt": "1+1="}, {"prompt": "2+2="}]
    start = time.perf_counter()
    scores = scorer.score(rows, ["2 is it", "4"])
    assert time.perf_counter() - start < 1.1  # three 0.4 s functions at once, not one after the other (1.2 s)
    assert scores.per_function.tolist() == [[1.0, 7.0, 0.5, 1.0], [1.0, 1.0, 1.5, 1.0]]

    async def fails_on_four(completions, **kwargs):
        return [1 / (c != "4") for c in completions]

    with pytest.raises(RuntimeError, match=r"'fails_on_four' raised ZeroDivisionError.*#1 of the batch.*2\+2="):
        RewardScorer(fails_on_four).score(rows, ["2", "4"])
    trainer = VAPOTrainer(str(tiny_model_dir), slow_length, make_args(tmp_path, max_steps=1), prompts_dataset())
    trainer.train()
    assert any("rewards/slow_length/mean" in h for h in trainer.state.log_history)


def test_an_async_function_reads_its_own_copy_of_the_batch_and_a_forked_process_runs_its_own_loop():
    """Async functions read the message lists as given, not as a synchronous judge that appends to them left them
    (they read the same lists, and ran beside the synchronous ones). And a forked process (a data loader
    worker, a launcher's child) waited forever on the parent's event loop, whose thread it does not have."""
    from trl_vapo.scoring import RewardScorer

    seen = []

    async def reads_late(prompts, completions, **kwargs):
        await asyncio.sleep(0.2)  # reads after the synchronous judge has run
        seen.append([len(p) for p in prompts] + [len(c) for c in completions])
        return [1.0 if lock is env else 0.5 for lock in kwargs["env"]]

    def appends(prompts, completions, **kwargs):  # a judge that keeps its verdict in the conversation
        for messages in (*prompts, *completions):
            messages.append({"role": "user", "content": "judged"})
        return [0.0] * len(prompts)

    # A rollout function's field the row carries as it is: an environment's handle, which no copy can be made of.
    env = threading.Lock()
    rows = [{"prompt": [{"role": "user", "content": f"{n}+{n}="}], "env": env} for n in (1, 2)]
    scorer = RewardScorer([appends, reads_late], conversational=True)  # (the synchronous one runs first)
    assert scorer.score(rows, ["2", "4"]).per_function.tolist() == [[0.0, 1.0], [0.0, 1.0]]
    assert seen == [[1, 1, 1, 1]]  # the batch as given: one message each

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: scores with the parent's scorer, whose loop was started above
        try:
            scores = RewardScorer(slow_digits).score([{"prompt": "1+1="}], ["2"]).per_function.tolist()
            os.write(write, json.dumps(scores).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked process's async reward function never returned (the parent's event loop)")
        time.sleep(0.05)
    assert json.loads(os.read(read, 1000)) == [[1.0]]


def test_async_functions_start_after_the_synchronous_ones_and_not_after_one_that_failed():
    """As GRPOTrainer: the async functions start once the synchronous ones have ended. They started first, and ran
    beside them: an object the two share that is not thread-safe (a fast tokenizer: "Already borrowed") failed, and a
    synchronous function's error left the judges running (billed) with no one to read them."""
    from trl_vapo.scoring import RewardScorer

    ended, began = [], []

    def slow_sync(completions, **kwargs):
        time.sleep(0.3)
        ended.append(time.perf_counter())
        return [1.0] * len(completions)

    async def judge(completions, **kwargs):
        began.append(time.perf_counter())
        return [0.5] * len(completions)

    rows = [{"prompt": "1+1="}, {"prompt": "2+2="}]
    assert RewardScorer([judge, slow_sync]).score(rows, ["2", "4"]).per_function.tolist() == [[0.5, 1.0]] * 2
    assert len(began) == len(ended) == 1 and began[0] >= ended[0]

    def fails(completions, **kwargs):
        raise KeyError("answer")

    with pytest.raises(RuntimeError, match="'fails' raised KeyError"):
        RewardScorer([judge, fails]).score(rows, ["2", "4"])
    time.sleep(0.1)  # (a judge scheduled on the loop's thread would have begun by now)
    assert len(began) == 1


def test_an_async_function_that_fails_on_the_batch_stops_as_one_that_is_not_async():
    """An async function that raised on the batch was called again on the whole batch, and a result of that second
    call (a paid judge billed twice) was used without a word, where a function that is not async stopped the run."""
    from trl_vapo.scoring import RewardScorer

    calls = []

    async def flaky_judge(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 1:
            raise TimeoutError("the judge did not answer")
        return [1.0] * len(completions)

    rows = [{"prompt": "1+1="}, {"prompt": "2+2="}]
    with pytest.raises(RuntimeError, match=r"'flaky_judge' raised TimeoutError on the batch of 2: the judge did not"):
        RewardScorer(flaky_judge).score(rows, ["2", "4"])
    assert calls == [2, 1, 1]  # the batch, then each completion alone to name a failing one: never the batch again


@pytest.mark.parametrize(
    "returned, named",
    [
        (0.5, "returned float (0.5); it must return a list of one float (or None) per completion"),
        (torch.tensor(0.5), "returned Tensor ("),  # (`rewards.mean()`: a 0-d tensor has __len__, which raises)
        ("1.0", 'returned str ("1.0"); it must return a list'),
        ((x for x in [1.0, 1.0]), "returned generator"),
        ([1.0, "right"], 'returned str ("right") as a value; it must return a list of one float'),
        ([1.0, [1.0]], "returned list ([1.0]) as a value"),
    ],
)
def test_a_reward_function_returning_no_list_of_numbers_is_named(returned, named):
    """A scalar, a string, a generator or a value that is no number: a bare TypeError or ValueError (`len()` of a
    float, `float("right")`) that named no function."""
    from trl_vapo.scoring import RewardScorer

    def judge(completions, **kwargs):
        return returned

    with pytest.raises(ValueError) as raised:
        RewardScorer(judge).score([{"prompt": "1+1="}, {"prompt": "2+2="}], ["2", "4"])
    assert str(raised.value).startswith("Reward function 'judge' ") and named in str(raised.value)
    import numpy as np

    def judge(completions, **kwargs):  # an array of numpy's numbers: taken
        return np.array([1, 0])

    assert RewardScorer(judge).score([{"prompt": "1+1="}, {"prompt": "2+2="}], ["2", "4"]).reward.tolist() == [1, 0]


def test_a_sample_no_function_scores_is_named_in_grpos_warning(caplog):
    from trl_vapo.scoring import RewardScorer

    def only_even(prompts, completions, **kwargs):
        return [None if p.startswith("1") else 1.0 for p in prompts]

    with caplog.at_level("WARNING"):
        scores = RewardScorer(only_even).score(
            [{"prompt": "0+0=", "answer": "0"}, {"prompt": "1+1=", "answer": "2"}], ["0", "3"]
        )
    assert scores.scored.tolist() == [True, False]
    assert "All reward functions returned None for the following kwargs" in caplog.text
    assert "'prompt': '1+1='" in caplog.text and "'completion': '3'" in caplog.text


def starts_with_one(completions, **kwargs):  # the verifier: 1 correct, 0 wrong, None where it cannot judge
    return [None if c == "x" else float(c.startswith("1")) for c in completions]


def says_ok(completions, **kwargs):  # a format reward
    return [float(c.endswith("ok")) for c in completions]


def test_positives_are_judged_by_the_reward_functions_named_for_it(tiny_model_dir, tmp_path, caplog):
    """The NLL loss imitates the positives, which were read from the sum of every reward function: a wrong answer
    with the format reward counted as correct. `positive_reward_funcs` names the functions that judge; without it,
    a run with several functions is warned."""
    from trl_vapo.scoring import RewardScorer

    rows, completions = [{"prompt": "1+0="}] * 4, ["1 ok", "2 ok", "1", "x"]
    every = RewardScorer([starts_with_one, says_ok]).score(rows, completions)
    assert every.is_correct(0.5).tolist() == [True, True, True, False]  # "2 ok": wrong, formatted, "correct"
    judged = RewardScorer([starts_with_one, says_ok], positive_reward_funcs=["starts_with_one"]).score(
        rows, completions
    )
    assert judged.is_correct(0.5).tolist() == [True, False, True, False]
    assert judged.reward.tolist() == every.reward.tolist()  # what trains is the same sum
    with pytest.raises(ValueError, match=r"names \['verifier'\], which are not reward functions here"):
        RewardScorer([starts_with_one, says_ok], positive_reward_funcs=["verifier"])

    with caplog.at_level("WARNING"):
        VAPOTrainer(str(tiny_model_dir), [starts_with_one, says_ok], make_args(tmp_path), prompts_dataset())
    assert "positive_reward_funcs=['starts_with_one']" in caplog.text
    caplog.clear()
    args = make_args(tmp_path, positive_reward_funcs=["starts_with_one"])
    with caplog.at_level("WARNING"):
        trainer = VAPOTrainer(str(tiny_model_dir), [starts_with_one, says_ok], args, prompts_dataset())
    assert "positive_reward_funcs" not in caplog.text
    trainer.train()
    verdict = trainer._last_rollout.scores.verdict  # the verifier's own score decided the rollout's positives
    assert verdict is not None and verdict.tolist() == trainer._last_rollout.scores.per_function[:, 0].tolist()


def test_a_threshold_no_judged_completion_can_reach_is_refused_before_training():
    """`positive_reward_threshold` is read against the judges' weighted reward: `reward_weights=[0.4]` on the math
    reward (+1 right, -1 wrong) made a right answer 0.4, under the default 0.5, so no completion was ever correct
    (`accuracy` 0, no NLL loss), silently. Refused where every judge says its range (the built-in math rewards);
    functions of unknown range pass."""
    from trl_vapo.rewards import make_math_reward
    from trl_vapo.scoring import RewardScorer

    math = make_math_reward()
    math.__name__ = "math_reward"
    told = r"positive_reward_threshold=0.5 is above .* \(math_reward: 0.4, .*at most 0.4"
    with pytest.raises(ValueError, match=told):
        RewardScorer([math], reward_weights=[0.4]).check_threshold_reachable(0.5)
    RewardScorer([math], reward_weights=[0.4]).check_threshold_reachable(0.4)
    RewardScorer([math]).check_threshold_reachable(0.5)
    # A format reward beside it, not judging: the judge's range alone decides; judging, its unknown range passes.
    RewardScorer([math, says_ok], [0.4, 1.0]).check_threshold_reachable(0.5)
    with pytest.raises(ValueError, match="math_reward: 0.4"):
        RewardScorer([math, says_ok], [0.4, 1.0], positive_reward_funcs=["math_reward"]).check_threshold_reachable(0.5)


def test_accuracy_counts_the_completions_the_judge_scored_in_training_as_in_evaluation(tiny_model_dir, tmp_path):
    """With `positive_reward_funcs`, a completion only a format reward scored (the judge had no reference answer) is
    neither right nor wrong: `evaluate_policy` left it out of its accuracy while training's `accuracy` and
    `trainer.evaluate()`'s `eval_accuracy` counted it wrong."""

    def judge(completions, answer, **kwargs):  # every completion it can judge is right; half it cannot
        return [None if int(a) % 4 else 1.0 for a in answer]

    def format_reward(completions, **kwargs):
        return [0.1] * len(completions)

    args = make_args(tmp_path, positive_reward_funcs=["judge"], max_steps=1, per_device_eval_batch_size=8)
    data = prompts_dataset(16)
    trainer = VAPOTrainer(str(tiny_model_dir), [judge, format_reward], args, data, eval_dataset=data.select(range(8)))
    trainer.train()
    scores = trainer._last_rollout.scores
    assert 0 < scores.judged.sum() < scores.scored.sum() == len(scores.scored)  # the format reward scored all
    logged = [h["accuracy"] for h in trainer.state.log_history if "accuracy" in h]
    assert logged == [1.0]
    assert trainer.evaluate()["eval_accuracy"] == 1.0


def test_chat_completions_are_the_messages_the_tokenizers_response_template_reads(tiny_model_dir, tmp_path):
    """GRPOTrainer passes a chat completion to the reward functions as the message the tokenizer's response template
    parses from its tokens (the reasoning apart from the content: Gemma 4's tokenizers ship one, TRL's
    `add_response_schema` sets one); VAPOTrainer passed the decoded text as the content, in training and in the
    held-out evaluation alike. Without a template the decoded text is still the content."""
    import copy

    from datasets import Dataset
    from trl.chat_template_utils import qwen3_template

    from trl_vapo.evaluation import evaluate_policy
    from trl_vapo.rewards import think_boxed_format_reward
    from trl_vapo.scoring import RewardScorer, parsed_completions

    seen = []

    def records(completions, **kwargs):
        seen.extend(completions)
        return [1.0] * len(completions)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = copy.deepcopy(qwen3_template)  # ChatML, as the tiny tokenizer's chat template
    template["defaults"] = {"role": "assistant", "read_by": "response_template"}  # marks a parsed message
    tokenizer.response_template = template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True)
    ids = tokenizer("<think>sum</think>2<|im_end|>", add_special_tokens=False)["input_ids"]
    (message,) = parsed_completions(tokenizer, [ids], lambda: [prompt])
    assert message == {"role": "assistant", "read_by": "response_template", "reasoning_content": "sum", "content": "2"}
    assert think_boxed_format_reward([[{**message, "content": "\\boxed{2}"}]]) == [1.0]  # the reasoning is the block
    # A prefill: the parser reads it from the prompt's tokens, so the message holds it once (it was prepended again).
    messages = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "The answer is"}]
    prefilled = tokenizer.apply_chat_template(messages, continue_final_message=True)
    (message,) = parsed_completions(tokenizer, [tokenizer(" 2<|im_end|>")["input_ids"]], lambda: [prefilled])
    scorer = RewardScorer([records], conversational=True)
    seen.clear()
    scorer.score([{"prompt": messages}], [message])
    assert seen == [[{"role": "assistant", "read_by": "response_template", "content": "The answer is 2"}]]
    # A completion the parser cannot read (a malformed tool call): TRL's fallback, the decoded completion alone, is
    # text, to which the prefill is joined (as a message it was not: the prefill was nowhere).
    malformed = tokenizer(' 2 <tool_call>\n{"name": bad json\n</tool_call><|im_end|>')["input_ids"]
    (fallback,) = parsed_completions(tokenizer, [malformed], lambda: [prefilled])
    seen.clear()
    scorer.score([{"prompt": messages}], [fallback])
    assert seen[0][0]["content"].startswith("The answer is 2 <tool_call>") and "read_by" not in seen[0][0]

    chat = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+{i}="}]} for i in range(16)])
    args = make_args(tmp_path, max_steps=1)
    trainer = VAPOTrainer(str(tiny_model_dir), records, args, chat, processing_class=tokenizer)
    seen.clear()  # the check before training passes empty completions, not sampled ones
    trainer.train()
    assert seen and all(len(c) == 1 and c[0]["read_by"] == "response_template" for c in seen)
    seen.clear()
    model = trainer.accelerator.unwrap_model(trainer.model)
    evaluate_policy(model, tokenizer, chat.select(range(2)), records, k=2, max_new_tokens=4)
    assert len(seen) == 2 * 2 + 2 and all(c[0]["read_by"] == "response_template" for c in seen)
    tokenizer.response_template = None
    seen.clear()
    evaluate_policy(model, tokenizer, chat.select(range(2)), records, k=1, max_new_tokens=4)
    assert seen and all(set(c[0]) == {"role", "content"} for c in seen)


def test_held_out_evaluation_gives_the_rewards_the_token_ids_as_training_does(tiny_model_dir):
    """A reward that reads `completion_ids` (TRL's overlong punishment, repetition penalty) was given empty lists by
    the held-out evaluation (`trl-vapo eval`, the report of `trl-vapo train`): it scored other than in training."""
    from datasets import Dataset
    from transformers import TrainerState

    from trl_vapo.evaluation import evaluate_policy

    def has_ids(completions, completion_ids, trainer_state, **kwargs):
        assert trainer_state.global_step == 7  # the state given, not a fresh one at step 0
        # Each completion's own sampled tokens (not the prompt's, not placeholders).
        assert [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids] == completions
        return [float(len(ids) > 0) for ids in completion_ids]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    data = Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(3)])
    result = evaluate_policy(
        model, tokenizer, data, has_ids, k=2, max_new_tokens=4, trainer_state=TrainerState(global_step=7)
    )
    assert result.avg_at_k == result.pass_at_1 == 1.0


def test_a_reward_model_scores_in_batches_and_loads_in_its_saved_dtype(tmp_path):
    """A reward model ran one forward over every sequence it was given: an evaluation set at k samples a prompt was
    one padded batch of thousands. And it loaded in float32 (the trained models' default), where GRPOTrainer loads
    it as saved: twice the memory for a bf16 model."""
    from trl_vapo import VAPOConfig
    from trl_vapo.tiny import save_tiny_reward_model

    path = save_tiny_reward_model(tmp_path / "rm")
    AutoModelForSequenceClassification.from_pretrained(path).to(torch.bfloat16).save_pretrained(tmp_path / "rm-bf16")
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp_path / "rm-bf16")
    args = VAPOConfig(output_dir=str(tmp_path / "o"), report_to="none")
    (scorer,) = load_reward_models([str(tmp_path / "rm-bf16")], None, args)
    assert scorer.model.dtype == torch.bfloat16
    # The policy's repository's own files (a subfolder of it, a variant) are not the reward model's: it was looked
    # for in `<reward model>/<subfolder>`. (Its revision is, as GRPOTrainer takes it: the tokenizers' test below.)
    init = {"dtype": "float32", "subfolder": "sft", "variant": "ema", "device_map": {"": "cpu"}}
    args = VAPOConfig(output_dir=str(tmp_path / "o"), report_to="none", model_init_kwargs=init)
    (scorer,) = load_reward_models([str(path)], None, args)
    assert scorer.model.dtype == torch.float32  # as the user asks
    sizes = []
    scorer.model.register_forward_hook(lambda module, inputs, out: sizes.append(out.logits.shape[0]))
    prompts, completions = [f"{i}+{i}=" for i in range(5)], [str(2 * i) * (i + 1) for i in range(5)]
    whole = scorer(prompts, completions)
    scorer.batch_size = 2
    assert scorer(prompts, completions) == pytest.approx(whole, abs=1e-5) and sizes == [5, 2, 2, 1]


def test_reward_functions_are_named_as_grpo_names_them_and_each_name_once(caplog):
    """A `functools.partial` was named "partial" (GRPOTrainer unwraps it); two functions of one name shared one
    metric and one table column, the second overwriting the first. Two math rewards of one name are warned: what
    each logs itself (its no-answer rate, its answer column) goes under its own name, which they share."""
    import functools

    from trl_vapo.rewards import make_math_reward
    from trl_vapo.scoring import check_reward_funcs

    def length_reward(completions, scale=1.0, **kwargs):
        return [scale * len(c) for c in completions]

    funcs = [functools.partial(length_reward), functools.partial(length_reward, scale=-0.01), math_reward]
    with caplog.at_level("WARNING"):
        assert check_reward_funcs(funcs)[1] == ["length_reward", "length_reward_2", "math_reward"]
    assert "named" not in caplog.text
    with caplog.at_level("WARNING"):
        funcs = [math_reward, make_math_reward(answer_column="solution")]
        assert check_reward_funcs(funcs)[1] == ["math_reward", "math_reward_2"]
    assert "Two reward functions are named 'math_reward'" in caplog.text and "name=..." in caplog.text


GRPO_SCRIPT = """
import asyncio
import functools

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer


async def async_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def progress_reward(completions, trainer_state, **kwargs):
    return [min(trainer_state.global_step / 10, 1.0) * len(c) / 8 for c in completions]


dataset = Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(32)])
args = GRPOConfig(
    output_dir=OUTPUT_DIR,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    max_steps=2,
    logging_steps=1,
    report_to="none",
    disable_tqdm=True,
)
trainer = GRPOTrainer(
    model=MODEL, reward_funcs=[REWARD_MODEL, async_reward, progress_reward], args=args, train_dataset=dataset
)
trainer.train()
trainer.save_model()
"""


def test_a_grpo_script_with_a_reward_model_an_async_and_a_stateful_function_trains_with_only_the_import_changed(
    tiny_model_dir, reward_model_dir, tmp_path
):
    script = GRPO_SCRIPT.replace(
        "from trl import GRPOConfig, GRPOTrainer",
        "from trl_vapo import VAPOConfig as GRPOConfig, VAPOTrainer as GRPOTrainer",
    )
    assert script != GRPO_SCRIPT
    namespace = {"MODEL": str(tiny_model_dir), "REWARD_MODEL": str(reward_model_dir), "OUTPUT_DIR": str(tmp_path)}
    exec(compile(script, "grpo_script.py", "exec"), namespace)
    names = namespace["trainer"].reward_func_names
    assert names == [reward_model_dir.name, "async_reward", "progress_reward"]
    # GRPOTrainer's attribute: the reward model's tokenizer, None for the functions.
    tokenizer, *functions = namespace["trainer"].reward_processing_classes
    assert tokenizer is namespace["trainer"].reward_funcs[0].tokenizer is not None and functions == [None, None]
    assert namespace["trainer"].state.global_step >= 2
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "critic" / "model.safetensors").is_file()


FSDP2_ONE_PROCESS = """
import json, sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl_vapo.scoring import RewardModel

folder = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
model = AutoModelForSequenceClassification.from_pretrained(folder)
mesh = init_device_mesh("cpu", (1,))
for layer in model.model.layers:  # as TRL's prepare_fsdp shards a frozen model: each decoder layer, then the root
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
scorer = RewardModel(model, AutoTokenizer.from_pretrained(folder))
scores = [scorer(prompts=["1+1=", "12+30="], completions=["2", "42"]) for _ in range(2)]
print(json.dumps(scores))
dist.destroy_process_group()
"""


def test_a_reward_model_under_fsdp2_scores_on_one_process(reward_model_dir, tmp_path):
    """FSDP2 on one process (a user with one GPU and an FSDP config) gathers the reward model's weights into buffers
    it keeps across calls, and reads their version counters: a reward call under `torch.inference_mode()` made those
    buffers inference tensors and raised "Inference tensors do not track version counter" (first GPU run, issue 43).
    The one-process path is the same on CPU and CUDA (two processes take another path, which checks), so this CPU run
    reproduces it; tests/test_distributed.py trains with FSDP2 on one GPU under `-m cuda`."""
    import json

    from _script_process import run_code

    proc = run_code(FSDP2_ONE_PROCESS, str(reward_model_dir), cwd=tmp_path, timeout=120)  # a process group
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    expected = one_by_one(model, AutoTokenizer.from_pretrained(reward_model_dir), ["1+1=2", "12+30=42"])
    assert first == second == pytest.approx(expected, abs=1e-5)


def test_dataset_columns_never_replace_what_the_trainer_passes_to_reward_functions():
    """As GRPOTrainer: `prompt`, `completion` and `completion_ids` columns are not passed (a reference completion
    column once replaced nothing, but reached `**kwargs`), and a column named like an argument the trainer passes
    (`completions`, `trainer_state`, ...) is refused before any compute, naming it and the rename: it used to replace
    the generated completions silently."""
    from trl_vapo.scoring import RewardScorer

    seen = {}

    def records(prompts, completions, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, kwargs=kwargs)
        return [1.0] * len(completions)

    row = {"prompt": "1+1=", "completion": "reference 2", "completion_ids": [9, 9], "answer": "2"}
    scorer = RewardScorer(records)
    scorer.check(row)
    scorer.score([row], ["generated 2"], [[5, 6]])
    assert seen["prompts"] == ["1+1="] and seen["completions"] == ["generated 2"]
    assert seen["completion_ids"] == [[5, 6]]
    assert seen["kwargs"]["answer"] == ["2"] and "completion" not in seen["kwargs"]

    for column in ("completions", "prompts", "trainer_state"):
        with pytest.raises(ValueError, match=rf"column\(s\) \['{column}'\].*rename_column\('{column}', 'reference_"):
            scorer.check({"prompt": "1+1=", column: "x"})


def test_the_tokenizers_are_loaded_at_the_revision_their_models_are(tmp_path, monkeypatch):
    """model_init_kwargs' revision: the policy and a reward model named by id load their tokenizers at it too, as
    GRPOTrainer does (they came from the default branch, whose chat template or special tokens may differ). The
    revisions are in a local hub cache, as `from_pretrained` leaves them; nothing is downloaded."""
    import huggingface_hub.constants

    from trl_vapo.tiny import save_tiny_model, save_tiny_reward_model

    cache = tmp_path / "hub"
    for name, save in (("policy", save_tiny_model), ("judge", save_tiny_reward_model)):
        repo = cache / f"models--org--{name}"
        for ref, commit in (("main", "a" * 40), ("v1", "b" * 40)):
            save(repo / "snapshots" / commit)
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / ref).write_text(commit)
        tokenizer = AutoTokenizer.from_pretrained(repo / "snapshots" / ("b" * 40))
        tokenizer.chat_template = "v1: {{ messages }}"
        tokenizer.save_pretrained(repo / "snapshots" / ("b" * 40))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    args = make_args(tmp_path, model_init_kwargs={"revision": "v1"})
    trainer = VAPOTrainer("org/policy", ["org/judge"], args, prompts_dataset())
    assert trainer.processing_class.chat_template == "v1: {{ messages }}"
    assert trainer.reward_processing_classes[0].chat_template == "v1: {{ messages }}"


@pytest.mark.parametrize("template_opens_think", [True, False])
def test_the_functions_that_read_it_are_told_where_the_prompt_opened_a_think_block(
    tiny_model_dir, tmp_path, template_opens_think
):
    """A chat template that ends the prompt with `<think>` (DeepSeek-R1's) leaves a completion cut off while thinking
    without any tag: the trainer reads the prompt's tokens and passes `prompt_opens_think` to the functions that say
    they read it (`math_reward`), in training and in evaluation, and to no other (a user's function gets TRL's
    arguments). A template that closes the block it opens (Qwen3's `enable_thinking=False`) leaves it closed."""
    from datasets import Dataset

    from trl_vapo.evaluation import evaluate_policy

    seen = {"reads": [], "plain": []}

    def reads(completions, **kwargs):
        seen["reads"].append(kwargs.get("prompt_opens_think"))
        return [0.0] * len(completions)

    def plain(completions, **kwargs):
        seen["plain"].append("prompt_opens_think" in kwargs)
        return [0.0] * len(completions)

    reads.reads_prompt_opens_think = True
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    think = "<think>\n" if template_opens_think else "<think>\n\n</think>\n\n"
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}" + think + "{% endif %}"
    )
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+{i}="}]} for i in range(8)])
    args = make_args(tmp_path, max_steps=1, per_device_train_batch_size=8)
    trainer = VAPOTrainer(str(tiny_model_dir), [reads, plain], args, rows, processing_class=tokenizer)
    trainer.train()
    evaluate_policy(trainer.model, tokenizer, rows.select(range(2)), [reads, plain], k=2, max_new_tokens=2)
    called = [flags for flags in seen["reads"] if flags]  # (the check before training scores no real prompt)
    assert len(called) == (3 if template_opens_think else 0)  # the rollout, the sampled and the greedy pass
    assert all(flags == [True] * len(flags) for flags in called)
    assert not any(seen["plain"])


def test_logs_key_the_rewards_by_function_name_where_the_table_renames_the_column(tiny_model_dir, tmp_path):
    """A reward function named as one of the completions table's own columns (`advantage`) is `rewards/advantage`
    there; GRPOTrainer's `_logs["rewards"]`, which callbacks read, keys it by the function's name."""

    def advantage(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = VAPOTrainer(str(tiny_model_dir), advantage, make_args(tmp_path, max_steps=1), prompts_dataset())
    trainer.train()
    completions = trainer._logs["completion"]
    assert trainer._logs["rewards"] == {"advantage": [float(len(c)) for c in completions]}
