"""Reliability: bad input fails early and clearly, crashes lose nothing, two processes agree with one."""

from __future__ import annotations

import collections
import errno
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import _script_process
import pytest
import torch
from _script_process import ScriptProcess, run_ranks, run_script
from datasets import Dataset
from helpers import PoisonedTrainer, clock_free, digit_fraction, make_args, prompts_dataset
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
from transformers.trainer_callback import ExportableState

from trl_vapo import VAPOConfig, VAPOTrainer
from trl_vapo.checkpoint import COMPLETE_MARKER, RUN_DATA_FILE, list_checkpoints
from trl_vapo.rewards import make_math_reward
from trl_vapo.tiny import save_tiny_reward_model
from trl_vapo.trainer import RESUME


def config(tmp_path, **overrides) -> VAPOConfig:
    """`make_args` with half its batch, shorter completions and the critic's rate derived (2 x learning_rate)."""
    settings = dict(per_device_train_batch_size=8, max_completion_length=6, critic_learning_rate=None)
    return make_args(tmp_path, **{**settings, **overrides})


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: a clear error before compute, or a documented handling
# ---------------------------------------------------------------------------------------------------------------------


def test_missing_prompt_column_names_it_and_lists_the_columns(tiny_model_dir, tmp_path):
    data = Dataset.from_list([{"question": "1+1=", "answer": "2"}] * 8)
    with pytest.raises(ValueError, match=r"no 'prompt' column.*\['question', 'answer'\]"):
        VAPOTrainer(model=str(tiny_model_dir), reward_funcs=digit_fraction, args=config(tmp_path), train_dataset=data)


def test_images_in_the_prompts_are_refused_before_any_model_loads(tmp_path):
    """GRPOTrainer passes an `image` column or chat image parts to a vision-language model; this trainer samples
    text prompts only, and left the images out silently. An image part in a later row's messages (its first row's
    text alone: the first row was all that was read) is found too."""
    text = [{"prompt": f"{i}+{i}="} for i in range(8)]
    with_column = Dataset.from_list([{**row, "image": "cat.png"} for row in text])

    def parts(i: int, image: bool) -> list[dict]:
        return [{"type": "image", "text": None}] * image + [{"type": "text", "text": text[i]["prompt"]}]

    in_messages = Dataset.from_list([{"prompt": [{"role": "user", "content": parts(i, True)}]} for i in range(8)])
    in_row_5 = Dataset.from_list([{"prompt": [{"role": "user", "content": parts(i, i == 5)}]} for i in range(8)])
    for data, where in (
        (with_column, "train_dataset has images \\(its 'image' column"),
        (in_messages, "train_dataset \\(row 0\\) has images \\(an image in its chat messages"),
        (in_row_5, "train_dataset \\(row 5\\) has images \\(an image in its chat messages"),
    ):
        with pytest.raises(ValueError, match=rf"{where}\).*text prompts only"):
            VAPOTrainer(model="no/such-model", reward_funcs=digit_fraction, args=config(tmp_path), train_dataset=data)
    with pytest.raises(ValueError, match=r"eval_dataset has images \(its 'image' column\)"):
        VAPOTrainer("no/such-model", digit_fraction, config(tmp_path), prompts_dataset(), with_column)
    chat = Dataset.from_list([{"prompt": [{"role": "user", "content": parts(i, False)}]} for i in range(8)])
    with pytest.raises(ValueError, match=r"eval_dataset \(row 5\) has images \(an image in its chat messages\)"):
        VAPOTrainer("no/such-model", digit_fraction, config(tmp_path), chat, in_row_5)
    # A set mixing text rows (`images: []`, as GRPOTrainer reads a text batch) and image rows: refused, wherever the
    # image is; its text rows alone (every `images` empty, every `image` None) are text, as GRPOTrainer trains them
    # (they were refused for the column's name).
    mixed = Dataset.from_list([{**row, "images": ["cat.png"] if i == 6 else []} for i, row in enumerate(text)])
    with pytest.raises(ValueError, match=r"train_dataset has images \(its 'images' column\)"):
        VAPOTrainer("no/such-model", digit_fraction, config(tmp_path), mixed)
    with pytest.raises(ValueError, match=r"eval_dataset\['mixed'\] has images \(its 'images' column\)"):
        VAPOTrainer("no/such-model", digit_fraction, config(tmp_path), prompts_dataset(), {"mixed": mixed})
    text_only = mixed.select(range(6)).add_column("image", [None] * 6)
    assert text_only["images"] == [[]] * 6
    with pytest.raises(OSError, match="never-loaded"):  # accepted: the model is looked for
        VAPOTrainer(str(tmp_path / "never-loaded"), digit_fraction, config(tmp_path), text_only, text_only)
    # A stream's rows, and `trl-vapo eval`'s, are checked one by one, alike.
    from trl_vapo.data import refuse_images

    for row in ({"prompt": "1+1=", "images": []}, {"prompt": "1+1=", "image": None}):
        refuse_images(row, "a streamed row")
    with pytest.raises(ValueError, match=r"a streamed row has images \(its 'images' column\)"):
        refuse_images({"prompt": "1+1=", "images": ["cat.png"]}, "a streamed row")


def test_images_in_a_streamed_or_evaluated_row_are_refused_where_they_come(tiny_model_dir, tmp_path):
    """A stream's rows are read as training goes: its first row alone is checked up front, and an image part in a
    later row went through a text model's chat template. Each rollout's rows are checked, and `evaluate_policy`'s
    (`trl-vapo eval`) every row."""
    from trl_vapo.evaluation import evaluate_policy

    def chat(i: int, image: bool) -> dict:
        content = [{"type": "image", "text": None}] * image + [{"type": "text", "text": f"{i}+{i}="}]
        return {"prompt": [{"role": "user", "content": content}]}

    def length(completions, **kwargs):
        return [float(len(c[0]["content"])) for c in completions]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (  # a vision-language model's way: the text parts as text (an image part, left out)
        "{% for m in messages %}{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% endif %}"
        "{% endfor %}{% endfor %}"
    )
    rows = Dataset.from_list([chat(i, i == 3) for i in range(16)])
    trainer = VAPOTrainer(
        str(tiny_model_dir), length, config(tmp_path), rows.to_iterable_dataset(), processing_class=tokenizer
    )
    with pytest.raises(ValueError, match=r"from the stream at step 1\) has images \(an image in its chat messages\)"):
        trainer.train()  # the first rollout (rows 0-1) trains; the second holds the image
    assert trainer.state.global_step > 0
    # An eval stream's batch, whole, as every process holds it (one process's share raised alone).
    with pytest.raises(ValueError, match=r"eval_dataset \(a batch read from the stream\) has images"):
        trainer.evaluate(rows.to_iterable_dataset())
    with pytest.raises(ValueError, match=r"evaluate on \(row 3\) has images"):
        evaluate_policy(trainer.model, trainer.processing_class, rows, length, k=1, max_new_tokens=1)


def test_a_system_prompt_or_template_given_with_chat_rows_is_applied_or_refused(tmp_path):
    """`--system_prompt` and `--prompt_template` with a data set whose prompts are chat messages were ignored
    silently: the system prompt now goes first (or is refused where a row has its own), and a template, which formats
    text, is refused."""
    from trl_vapo.data import load_prompt_dataset

    chat = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)} for i in range(4)]
    chat.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = load_prompt_dataset(str(chat), system_prompt="Be brief.")
    assert loaded[1]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    assert load_prompt_dataset(str(chat))[1]["prompt"] == rows[1]["prompt"]  # without one, the rows as they are
    with pytest.raises(ValueError, match=r"--prompt_template formats text, but .*'prompt' holds chat messages"):
        load_prompt_dataset(str(chat), prompt_template="{prompt} Answer in \\boxed{{}}.")
    own = tmp_path / "own.jsonl"
    rows[2]["prompt"] = [{"role": "system", "content": "Think."}, *rows[2]["prompt"]]
    own.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"already starts with a system message \('Think.'\): drop --system_prompt"):
        load_prompt_dataset(str(own), system_prompt="Be brief.")
    # ShareGPT's messages: the chat template's AttributeError (the CLI) or "no message to reply to" (the trainer).
    shared = tmp_path / "sharegpt.jsonl"
    shared.write_text(json.dumps({"prompt": [{"from": "human", "value": "1+1="}], "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"A row's 'prompt' in .* is a list but not chat messages .*'role'"):
        load_prompt_dataset(str(shared))
    # TRL's "messages" format as the prompt: its last message, the reply to learn, would be continued as a prefill.
    messages = tmp_path / "messages.jsonl"
    reply = {"role": "assistant", "content": "2"}
    messages.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="}, reply], "answer": "2"}) + "\n")
    for streaming in (False, True):  # a stream too, before any model loads (it maps rows as they are read)
        with pytest.raises(ValueError, match=r"'messages' messages of .* end with an assistant message .* drop it"):
            load_prompt_dataset(str(messages), prompt_column="messages", streaming=streaming)


def test_an_empty_file_or_split_is_named_and_a_single_files_split_can_be_sliced(tmp_path):
    """An empty .jsonl raised a bare StopIteration from inside `datasets`, a .csv of its header alone said "train
    corresponds to no data": each a line naming the file now. And a slice of a single file's split (`train[:90%]`)
    was refused by `datasets` as a split's name, where a folder's or the Hub's is read."""
    from trl_vapo.data import load_prompt_dataset

    empty, header = tmp_path / "empty.jsonl", tmp_path / "header.csv"
    empty.write_text("")
    header.write_text("question,answer\n")
    for path in (empty, header):
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))} \(train\) has no rows"):
            load_prompt_dataset(str(path), prompt_column="question", chat=False)
    data = tmp_path / "ten.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(10)))
    head = load_prompt_dataset(str(data), split="train[:80%]", prompt_column="question", chat=False)
    tail = load_prompt_dataset(str(data), split="train[80%:]", prompt_column="question", chat=False)
    assert (len(head), len(tail)) == (8, 2) and tail[0]["prompt"] == "8+8="


def test_a_missing_gold_answer_stays_missing(tmp_path):
    """A row without its answer (null) became the text "None", which the math reward took for the gold answer and
    scored -1 silently; left None, the reward says it cannot parse it and leaves the row unscored."""
    from trl_vapo.data import load_prompt_dataset
    from trl_vapo.rewards import math_reward

    data = tmp_path / "gaps.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i}+{i}=", "answer": 2e-5 * i if i else None}) + "\n" for i in range(3))
    )
    loaded = load_prompt_dataset(str(data), prompt_column="question", chat=False)
    assert loaded["answer"] == [None, "0.00002", "0.00004"]  # written out (`str` made "2e-05", not read so)
    # Written into the float column they came from, 2.5e-07 and 2.5e10 came back out as the text "2.5e-7" and
    # "2.5e+10" (Arrow's own formatting), which math-verify does not read as those numbers; a stream never did.
    data.write_text("".join(json.dumps({"question": "x", "answer": gold}) + "\n" for gold in (2.5e-7, 2.5e10, 72.0)))
    for streaming in (False, True):
        rows = load_prompt_dataset(str(data), prompt_column="question", streaming=streaming)
        assert [row["answer"] for row in rows] == ["0.00000025", "25000000000", "72"]
    completions = ["\\boxed{0}", "\\boxed{0.00002}", "\\boxed{0.00005}"]
    assert math_reward(completions=completions, answer=loaded["answer"]) == [None, 1.0, -1.0]
    from decimal import Decimal

    from trl_vapo.data import answer_text

    assert [answer_text(x) for x in (Decimal("0.50"), Decimal("NaN"), 3, "x", None)] == ["0.50", None, "3", "x", None]
    # A missing problem is no prompt: through a chat template it was the text "None".
    rows = [{"question": f"{i}+{i}=" if i else None, "answer": "0"} for i in range(3)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"A row of .*gaps.jsonl \(train\) has no 'question' \(null\)"):
        load_prompt_dataset(str(data), prompt_column="question")
    # Through a template too, which made it "None = ?" (any field it names: here the second row's `topic`).
    rows = [{"question": f"{i}+{i}=", "topic": None if i == 1 else "sums", "answer": "0"} for i in range(3)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"A row of .*gaps.jsonl \(train\) has no 'topic' \(null\)"):
        load_prompt_dataset(str(data), prompt_column="question", prompt_template="{topic}: {question}")
    templated = load_prompt_dataset(str(data), prompt_column="question", prompt_template="{question} = {answer}?")
    assert templated["prompt"][2] == [{"role": "user", "content": "2+2= = 0?"}]  # the gold, by its own name
    # Without --prompt_column, which the template makes of no use: the default `prompt` was required as a column.
    assert load_prompt_dataset(str(data), prompt_template="{question} = {answer}?")["prompt"] == templated["prompt"]


def test_missing_answer_column_of_a_reward_names_it_and_lists_the_columns(tiny_model_dir, tmp_path):
    data = Dataset.from_list([{"prompt": "1+1=", "gold": "2"}] * 8)
    with pytest.raises(ValueError, match=r"math_reward.*'answer'.*'solution'.*gold"):
        VAPOTrainer(
            model=str(tiny_model_dir), reward_funcs=make_math_reward(), args=config(tmp_path), train_dataset=data
        )

    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"needs_solution.*\['solution'\].*\['gold', 'prompt'\]"):
        VAPOTrainer(model=str(tiny_model_dir), reward_funcs=needs_solution, args=config(tmp_path), train_dataset=data)


def test_an_empty_prompt_the_tokenizer_gives_no_token_is_refused_before_training(tiny_model_dir, tmp_path):
    """Without `max_prompt_length` (GRPOConfig's default) nothing tokenized a map-style set up front: an empty text
    prompt, to which the tokenizer adds no token (the tiny one adds no BOS, as Qwen's), failed the rollout (or the
    evaluation) that drew it, at any step of the first epoch, the steps since the last checkpoint lost; with
    `max_prompt_length` set it was refused as the trainer was built. Refused then either way, an eval set's too."""
    rows = prompts_dataset(8).to_list()
    rows[5]["prompt"] = ""
    with_empty = Dataset.from_list(rows)
    unlimited = config(tmp_path, max_prompt_length=None)
    for train, held_out in ((with_empty, None), (prompts_dataset(), {"held_out": with_empty})):
        with pytest.raises(ValueError, match="A prompt has no token: ''"):
            VAPOTrainer(str(tiny_model_dir), digit_fraction, unlimited, train, eval_dataset=held_out)


def test_empty_or_too_small_dataset_gives_the_numbers(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"train_dataset is empty"):
        VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=config(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": [], "answer": []}),
        )
    with pytest.raises(
        ValueError, match=r"has 1 prompts but one rollout needs 2 \(generation_batch_size 8 / num_generations 4\)"
    ) as refused:
        VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=config(tmp_path),
            train_dataset=prompts_dataset(1),
        )
    assert "lower per_device_train_batch_size / steps_per_generation" in str(refused.value)
    # A rollout sized by generation_batch_size is made smaller by it (a smaller batch size leaves it as it is)
    sized = config(tmp_path, generation_batch_size=16, num_generations=4)
    with pytest.raises(ValueError, match=r"one rollout needs 4 .*Add prompts, or lower generation_batch_size, or"):
        VAPOTrainer(
            model=str(tiny_model_dir), reward_funcs=digit_fraction, args=sized, train_dataset=prompts_dataset(3)
        )


def test_batch_not_divisible_by_num_generations_lists_valid_values(tmp_path):
    with pytest.raises(ValueError, match=r"multiple of num_generations \(3\).*Valid num_generations: \[1, 2, 4, 8\]"):
        config(tmp_path, num_generations=3)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"epsilon_high": -0.1}, r"^epsilon must be in \[0, 1\) .*got 0\.2 and -0\.1"),
        ({"lam_actor": 1.2}, r"^lam_actor must be in \[0, 1\], got 1\.2"),
        ({"lam_critic": -0.1}, r"^lam_critic must be in \[0, 1\], got -0\.1"),
        ({"length_adaptive_alpha": 0.0}, "^length_adaptive_alpha must be > 0"),
        ({"nll_coef": -1.0}, "^nll_coef must be >= 0, got -1.0"),
        ({"value_pretrain_steps": -1}, "^value_pretrain_steps must be >= 0, got -1"),
        # Ignored before: the schedules are trl-vapo's own; cosine's num_cycles is the one option they take.
        ({"lr_scheduler_kwargs": {"num_cycles": 1.0}}, "lr_scheduler_type='constant_with_warmup': it takes none"),
        ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"min_lr": 0.0}}, "cosine takes num_cycles only"),
        ({"max_steps": -5}, "^max_steps must be a positive number of RL optimizer steps"),
        ({"num_iterations": 0}, "^num_iterations must be >= 1, got 0"),
        ({"loss_type": "gspo"}, "loss_type must be 'token', 'sequence' or 'luspo'"),
        (
            {"steps_per_generation": 3, "gradient_accumulation_steps": 2},
            r"^steps_per_generation \(3\) must be a multiple of gradient_accumulation_steps \(2\)",
        ),
        ({"learning_rate": -1e-5}, "learning_rate must be >= 0"),  # not critic_learning_rate, its derived default
        ({"weight_decay": -0.1}, "^weight_decay must be >= 0"),
        ({"max_grad_norm": -1.0}, "^max_grad_norm must be >= 0"),
        ({"max_completion_length": 0}, "^max_completion_length must be >= 1, got 0"),
        ({"max_prompt_length": 0}, "^max_prompt_length must be >= 1 or None, got 0"),
        ({"top_k": -1}, "^top_k must be >= 0"),
        ({"repetition_penalty": 0.0}, "^repetition_penalty must be > 0"),
        # Accepted before, and stepped wrongly: transformers' optimizers that step outside `optimizer.step()`.
        ({"optim": "schedule_free_adamw"}, "optim='schedule_free_adamw' is not supported.*train\\(\\)"),
        ({"optim": "adalomo"}, "optim='adalomo' is not supported.*inside the backward"),
        ({"optim": "galore_adamw_layerwise"}, "optim='galore_adamw_layerwise' is not supported"),
        ({"optim": "apollo_adamw"}, "optim='apollo_adamw' is not supported"),
        ({"optim": "adamw_torch_8bit"}, "optim='adamw_torch_8bit' is not supported.*rates as tensors"),  # torchao
        # Accepted before, and a silent no-op or a wrong run.
        ({"drop_long_prompts": True}, "drop_long_prompts=True .* max_prompt_length, which is unset"),
        (  # every evaluation reward 0 (a group of 1 standardised), while accuracy read right
            {"multi_objective_aggregation": "normalize_then_sum", "num_generations_eval": 1},
            "num_generations_eval >= 2 or unset",
        ),
        (  # the lowest eval_loss: mostly the critic's error
            {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
            "load_best_model_at_end=True needs metric_for_best_model.*'accuracy'",
        ),
    ],
)
def test_config_values_out_of_range_fail_at_config_time(tmp_path, overrides, needle):
    with pytest.raises(ValueError, match=needle):
        config(tmp_path, **overrides)


def test_a_lam_actor_that_length_adaptive_gae_overrides_is_named():
    """With `length_adaptive_alpha` set (the default), each completion's lambda is 1 - 1/(alpha l): `lam_actor` is
    not read, and a user who set it is told so (its help and the docs' "vanilla PPO" recipe set both)."""
    with pytest.warns(UserWarning, match=r"lam_actor=0.9 is not used: with length_adaptive_alpha=0.05") as warned:
        args = VAPOConfig(output_dir="unused", lam_actor=0.9, report_to="none")
    assert [w.filename for w in warned] == [__file__]  # where the user built it
    # Checked again where the trainer is built (for the fields set since): the same warning is not given twice.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args.check_again()
    args.lam_actor = 0.8
    with pytest.warns(UserWarning, match=r"lam_actor=0.8 is not used") as warned:
        args.check_again()
    assert [w.filename for w in warned] == [__file__]
    # A derived default's refusal says it was derived; one set after the config was built is not.
    args.learning_rate, args.critic_learning_rate = 0.0, 0.0
    with pytest.raises(ValueError, match=r"critic_learning_rate must be > 0, got 0.0.$"):
        args.check_again()
    args.critic_learning_rate = None
    with pytest.raises(ValueError, match=r"got 0.0 \(2 x learning_rate=0.0, its default\).$"):
        args.check_again()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        VAPOConfig(output_dir="unused", lam_actor=0.9, length_adaptive_alpha=None, report_to="none")


def test_long_prompts_are_counted_once_then_truncated_or_dropped(tiny_model_dir, tmp_path, caplog):
    data = Dataset.from_list([{"prompt": ("9" * 30 if i % 4 == 0 else f"{i}+1="), "answer": "1"} for i in range(32)])
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        trainer = VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=config(tmp_path, max_prompt_length=10),
            train_dataset=data,
        )
    warnings = [r.message for r in caplog.records if "max_prompt_length" in r.message]
    assert len(warnings) == 1 and "8 of 32" in warnings[0] and "truncated from the left" in warnings[0]
    assert len(trainer.train_dataset) == 32
    assert [len(x) for x in trainer._tokenize_prompts(["9" * 30])] == [10]
    # An evaluation set's prompts are not counted ahead: their first cut is said, once, apart from training's (it
    # was never said once a training prompt had been); `trl-vapo eval`'s (evaluate_policy) too.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        for _ in range(2):
            assert [len(x) for x in trainer._tokenize_prompts(["8" * 40], evaluated=True)] == [10]
    assert [r.message.removeprefix("[RANK 0] ") for r in caplog.records] == [
        "An evaluation prompt of 40 tokens is longer than max_prompt_length=10: it and any later such prompt are "
        "truncated from the left (said once; drop_long_prompts drops training prompts only). Raise "
        "max_prompt_length or set it to None to keep them whole."
    ]
    from trl_vapo.evaluation import sample_completions

    with pytest.warns(UserWarning, match=r"1 of 2 prompts are longer than max_prompt_length=10 tokens: truncated"):
        sample_completions(
            trainer.model, trainer.processing_class, ["1+1=", "9" * 30], max_new_tokens=1, max_prompt_length=10
        )

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        dropping = VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=config(tmp_path, max_prompt_length=10, drop_long_prompts=True),
            train_dataset=data,
        )
    assert len(dropping.train_dataset) == 24
    assert any("Dropped 8 of 32" in r.message for r in caplog.records)
    dropping.train()  # and it trains on what is left
    # A drop that leaves too few says so (it said only "train_dataset is empty", of a data set of 32 prompts).
    short = config(tmp_path, max_prompt_length=1, drop_long_prompts=True)
    told = r"drop_long_prompts=True: Dropped 32 of 32 training prompts longer than max_prompt_length=1 .* Then: "
    with pytest.raises(ValueError, match=told + "train_dataset is empty"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, short, data)

    # A stream is not counted ahead: its first prompt cut is said, once; and by default nothing is cut (as GRPO).
    caplog.clear()
    streamed = data.to_iterable_dataset()
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, config(tmp_path, max_prompt_length=10), streamed)
        assert not [r for r in caplog.records if "max_prompt_length" in r.message]
        assert [len(x) for x in trainer._tokenize_prompts(["1+1=", "9" * 30, "8" * 40])] == [4, 10, 10]
        trainer._tokenize_prompts(["7" * 50])
    warnings = [r.message for r in caplog.records if "max_prompt_length" in r.message]
    assert [w.removeprefix("[RANK 0] ") for w in warnings] == [
        "A prompt of 40 tokens is longer than max_prompt_length=10: it and any later such prompt are truncated from "
        "the left (said once). Raise max_prompt_length or set it to None to keep them whole."
    ]
    unlimited = VAPOTrainer(str(tiny_model_dir), digit_fraction, config(tmp_path / "whole"), streamed)
    assert unlimited.args.max_prompt_length is None
    assert [len(x) for x in unlimited._tokenize_prompts(["9" * 600])] == [600]


def test_tokenizer_problems(tiny_model_dir, tmp_path, caplog, monkeypatch):
    chat = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}] * 8)

    def refuse(*args, **kwargs):  # a tokenizer given is checked before the policy loads (minutes for a large one)
        raise AssertionError("the policy loaded before the tokenizer given was checked")

    monkeypatch.setattr("trl_vapo.trainer.load_policy", refuse)
    no_template = AutoTokenizer.from_pretrained(tiny_model_dir)
    no_template.chat_template = None

    def constant(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="no chat template"):
        VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=constant,
            args=config(tmp_path),
            train_dataset=chat,
            processing_class=no_template,
        )

    no_eos = AutoTokenizer.from_pretrained(tiny_model_dir)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="no EOS token"):
        VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=config(tmp_path),
            train_dataset=prompts_dataset(32),
            processing_class=no_eos,
        )

    # A vision model's processor (GRPOTrainer takes one): named, where `.eos_token_id` was an AttributeError.
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, extra_special_tokens={"image_token": "<image>"})
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tokenizer)
    with pytest.raises(TypeError, match=r"processor \(LlavaProcessor\).*processing_class=processor.tokenizer"):
        VAPOTrainer(
            str(tiny_model_dir), digit_fraction, config(tmp_path), prompts_dataset(32), processing_class=processor
        )

    monkeypatch.undo()  # (a tokenizer it serves: the policy loads)
    no_pad = AutoTokenizer.from_pretrained(tiny_model_dir)
    no_pad.pad_token = None
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        trainer = VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=config(tmp_path),
            train_dataset=prompts_dataset(32),
            processing_class=no_pad,
        )
    assert trainer.processing_class.pad_token == trainer.processing_class.eos_token
    assert sum("no pad token" in r.message for r in caplog.records) == 1
    trainer.train()


def test_reward_function_that_raises_names_itself_and_the_sample(tiny_model_dir, tmp_path):
    def fragile(completions, answer, **kwargs):
        return [1 / len(c) for c in completions]  # an empty completion divides by zero

    with pytest.raises(ValueError, match=r"fragile.*ZeroDivisionError.*first failing sample.*\"answer\": \"0\""):
        VAPOTrainer(
            model=str(tiny_model_dir), reward_funcs=fragile, args=config(tmp_path), train_dataset=prompts_dataset(32)
        )

    def breaks_later(completions, answer, **kwargs):
        if any(len(c) > 0 for c in completions):
            raise KeyError("boom")
        return [0.0] * len(completions)

    trainer = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=breaks_later, args=config(tmp_path), train_dataset=prompts_dataset(32)
    )
    with pytest.raises(RuntimeError, match=r"'breaks_later' raised KeyError.*first failing sample \(#0"):
        trainer.train()


def test_a_reward_that_reads_the_batch_by_groups_passes_the_check_before_training(tiny_model_dir, tmp_path):
    """A group-relative reward (GRPO recipes rank a completion within its prompt's group) reads the batch as
    [prompts, num_generations]: the check before training called it on one row, where the reshape fails, and refused
    it. It is called on one group, as a rollout holds them."""
    import numpy as np

    def rank_in_group(completions, **kwargs):
        lengths = np.array([len(c) for c in completions], dtype=float).reshape(-1, 4)
        return (lengths.argsort(axis=1).argsort(axis=1) / 3.0).ravel().tolist()

    args = make_args(tmp_path, max_steps=1, num_generations=4)
    trainer = VAPOTrainer(str(tiny_model_dir), rank_in_group, args, prompts_dataset(16))
    trainer.train()
    assert trainer.state.log_history[0]["reward"] == pytest.approx(0.5)  # ranks 0, 1/3, 2/3, 1 in every group


def test_a_reward_function_that_fails_once_on_a_batch_says_so(tiny_model_dir, tmp_path, monkeypatch):
    """A function that fails on the batch (a timeout, a rate limit) but on none of its completions called alone: the
    error says that it was retried one by one and that no completion failed alone, and what to do. The search stops
    after a few samples (`FAILING_SAMPLE_SEARCH`): a judge refused by a rate limit was called on every sample of the
    rollout, one by one, before the error was raised."""
    from trl_vapo import scoring

    calls = []

    def flaky(completions, trainer_state, **kwargs):
        calls.append(len(completions))
        if len(completions) == 8 and calls.count(8) == 1:  # a rollout's first batch (the check's is one group of 4)
            raise TimeoutError("the judge did not answer")
        return [0.5] * len(completions)

    trainer = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=flaky, args=config(tmp_path), train_dataset=prompts_dataset(32)
    )
    monkeypatch.setattr(scoring, "FAILING_SAMPLE_SEARCH", (3, 30.0))
    with pytest.raises(
        RuntimeError,
        match=r"'flaky' raised TimeoutError on the batch of 8: the judge did not answer -- "
        r"but on none of the first 3 of its completions called alone.*a transient failure",
    ):
        trainer.train()
    assert calls[-4:] == [8, 1, 1, 1]


def test_reward_function_returning_the_wrong_count_is_an_error(tiny_model_dir, tmp_path):
    def short(completions, **kwargs):
        return [0.0] * (len(completions) - 1)

    with pytest.raises(ValueError, match=r"'short' returned 3 values for 4 completions"):  # (checked on a group)
        VAPOTrainer(
            model=str(tiny_model_dir), reward_funcs=short, args=config(tmp_path), train_dataset=prompts_dataset(32)
        )


def test_nan_and_inf_rewards_are_masked_warned_and_counted(tiny_model_dir, tmp_path, caplog):
    """NaN and inf count as no score, and their share is logged on every rollout: 0 on a rollout with none (logged
    only where there were some, its average over a logging window would overstate them)."""

    def sometimes_nan(completions, trainer_state, **kwargs):
        if trainer_state.global_step % 2:  # every other rollout is clean
            return [0.5] * len(completions)
        return [math.nan if i % 4 == 0 else (math.inf if i % 4 == 1 else 0.5) for i in range(len(completions))]

    trainer = VAPOTrainer(
        model=str(tiny_model_dir), reward_funcs=sometimes_nan, args=config(tmp_path), train_dataset=prompts_dataset(32)
    )
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        trainer.train()
    assert sum("NaN or inf" in r.message for r in caplog.records) == 1
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == trainer.state.max_steps >= 2
    shares = [h["rewards/sometimes_nan/non_finite_fraction"] for h in logs]
    assert shares == [0.5 if i % 2 == 0 else 0.0 for i in range(len(logs))]
    assert [h["rewards/unscored_fraction"] for h in logs] == shares
    assert all(h["reward"] == 0.5 and math.isfinite(h["loss/value"]) for h in logs)


def test_a_rollout_no_reward_function_scored_moves_no_weight(tiny_model_dir, tmp_path, caplog):
    """No completion of the first rollout is scored (the function returns None for each): its step is skipped and
    counted, without an optimizer step (Adam's momentum and weight decay would move the weights on zero gradients);
    the next rollouts, scored, train."""

    def scores_after_the_first_rollout(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 0:  # the first rollout (and the check before training)
            return [None] * len(completions)
        return [0.5 + 0.1 * (i % 3) for i in range(len(completions))]

    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=scores_after_the_first_rollout,
        args=config(tmp_path, max_steps=3, weight_decay=0.1),
        train_dataset=prompts_dataset(32),
    )
    weights = []

    class Weights(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            weights.append([p.detach().clone() for p in trainer.actor_critic.parameters() if p.requires_grad])

    trainer.add_callback(Weights())
    before = [p.detach().clone() for p in trainer.actor_critic.parameters() if p.requires_grad]
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(weights[0], before))  # step 1: nothing moved
    assert not all(torch.equal(a, b) for a, b in zip(weights[-1], before))  # steps 2-3 trained
    steps = [h for h in trainer.state.log_history if "skipped_steps" in h]
    assert [h["skipped_steps"] for h in steps] == [1, 1, 1]
    assert "Step 1: no completion in it was scored by ['scores_after_the_first_rollout']" in caplog.text


def test_a_step_whose_completions_were_all_truncated_says_so(tiny_model_dir, tmp_path, caplog):
    """Under `mask_truncated_completions` a step whose completions were all cut at `max_completion_length` trains
    nothing: the warning named only unscored completions ("each returned None"), sending users to their rewards."""
    args = config(tmp_path, max_steps=1, max_completion_length=1, mask_truncated_completions=True)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32))
    with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
        trainer.train()
    assert "or each one scored was truncated at max_completion_length (mask_truncated_completions=True)" in caplog.text


def test_a_run_in_which_nothing_was_scored_fails_naming_the_reward_functions(tiny_model_dir, tmp_path):
    def never(completions, **kwargs):
        return [None] * len(completions)

    ended = []

    class End(TrainerCallback):  # where trackers close their runs: before the error, not never
        def on_train_end(self, args, state, control, **kwargs):
            ended.append(state.global_step)

    trainer = VAPOTrainer(str(tiny_model_dir), never, config(tmp_path), prompts_dataset(32), callbacks=[End()])
    before = [p.detach().clone() for p in trainer.actor_critic.parameters() if p.requires_grad]
    with pytest.raises(
        RuntimeError, match=r"No completion was scored in this run \(2 steps.*reward function \(never\)"
    ):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(trainer.actor_critic.parameters(), before))
    assert trainer.progress.skipped_steps == 2 and ended == [2]
    # A longer run stops after its first rollouts of 32 prompts (and 3 rollouts) at least: nothing trained, the policy
    # samples alike, and every update to the end would be skipped (value pretraining's 50 rollouts, then RL's).
    args = config(tmp_path, max_steps=40, value_pretrain_steps=4, num_generations=2, per_device_train_batch_size=16)
    trainer = VAPOTrainer(str(tiny_model_dir), never, args, prompts_dataset(64))
    with pytest.raises(RuntimeError, match=r"\(4 steps, every update skipped; stopped after 4 rollouts of 32 prompts"):
        trainer.train()


def test_value_model_paths_that_are_not_value_models(tiny_model_dir, tmp_path, caplog, monkeypatch):
    from helpers import refuse_model_loads

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    with monkeypatch.context() as before_loading:  # refused before the policy loads (they were once it had loaded)
        refuse_model_loads(before_loading)
        with pytest.raises(FileNotFoundError, match="does not exist"):
            VAPOTrainer(
                model=str(tiny_model_dir),
                reward_funcs=digit_fraction,
                args=config(tmp_path),
                train_dataset=prompts_dataset(32),
                value_model=str(tmp_path / "nowhere" / "critic"),
            )
        with pytest.raises(ValueError, match=r"not a value model.*notes.txt"):
            VAPOTrainer(
                model=str(tiny_model_dir),
                reward_funcs=digit_fraction,
                args=config(tmp_path),
                train_dataset=prompts_dataset(32),
                value_model=str(junk),
            )
    three = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
    three.save_pretrained(tmp_path / "three")
    with pytest.raises(ValueError, match="num_labels=3") as refusal:
        VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=config(tmp_path),
            train_dataset=prompts_dataset(32),
            value_model=str(tmp_path / "three"),
        )
    # The remedy the error gives loads (`num_labels=1` alone raises on the head's shape) and is taken.
    assert "ignore_mismatched_sizes=True" in str(refusal.value)
    one = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "three", num_labels=1, ignore_mismatched_sizes=True
    )

    def with_critic(value_model, **kwargs) -> VAPOTrainer:
        return VAPOTrainer(
            str(tiny_model_dir),
            digit_fraction,
            config(tmp_path),
            prompts_dataset(32),
            value_model=value_model,
            **kwargs,
        )

    with_critic(one)
    # A frozen one (a reward model another trainer used, which froze it) sat in no optimizer group and never learned.
    one.requires_grad_(False)
    with pytest.raises(ValueError, match=r"has no trainable weight .* Call value_model.requires_grad_\(True\)"):
        with_critic(one)
    one.requires_grad_(True)
    # Another family's reward model as the critic (the paper's start), with a smaller vocabulary: the policy's ids
    # past its embeddings were an index error at the first rollout's values.
    narrow_config = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).config
    narrow_config.vocab_size = 16
    narrow = AutoModelForSequenceClassification.from_config(narrow_config)
    with pytest.raises(ValueError, match=r"embeds 16 tokens, and the policy's tokenizer has \d+: the critic reads"):
        with_critic(narrow)
    # An encoder's classifier (the char tokenizer's vocabulary: no tokenizer to refuse it): bidirectional, its value
    # before a token had read the tokens after it; RoBERTa's head besides pools the first token's state.
    from transformers import BertConfig, RobertaConfig

    shape = dict(vocab_size=one.config.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    shape.update(intermediate_size=32, num_labels=1)
    bert = AutoModelForSequenceClassification.from_config(BertConfig(**shape))
    with pytest.raises(ValueError, match=r"BertForSequenceClassification attends to later tokens \(.*is not causal\)"):
        with_critic(bert)
    roberta = AutoModelForSequenceClassification.from_config(RobertaConfig(**shape, is_decoder=True))
    with pytest.raises(ValueError, match=r"layer on the backbone's hidden states \(its head is a RobertaClassif"):
        with_critic(roberta)
    # DeBERTa's attention names no direction, and its classifier is linear, behind a pooler of the first token
    from transformers import DebertaV2Config

    deberta = AutoModelForSequenceClassification.from_config(DebertaV2Config(**shape))
    with pytest.raises(ValueError, match=r"hidden states \(\['pooler'\] before it\), and the critic reads"):
        with_critic(deberta)
    # As many tokens, numbered otherwise (another family's reward model of the same vocabulary size): its values
    # were read from other tokens' embeddings, silently. Its saved tokenizer says so.
    import string

    from trl_vapo.tiny import build_char_tokenizer

    policy_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    alphabet = "".join(reversed(dict.fromkeys(string.printable)))
    foreign = build_char_tokenizer(alphabet)
    assert len(foreign) == len(policy_tokenizer) and foreign.get_vocab() != policy_tokenizer.get_vocab()
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    critic.save_pretrained(tmp_path / "foreign")
    foreign.save_pretrained(tmp_path / "foreign")
    weights = (tmp_path / "foreign" / "model.safetensors").read_bytes()
    (tmp_path / "foreign" / "model.safetensors").write_bytes(b"not read")  # refused before the weights load
    with pytest.raises(
        ValueError, match=r"foreign's tokenizer numbers \d+ of the policy's \d+ tokens otherwise, e.g."
    ):
        with_critic(tmp_path / "foreign")
    (tmp_path / "foreign" / "model.safetensors").write_bytes(weights)
    # The same reward model loaded by the user and given as a model: read from the folder it was loaded from.
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "foreign")
    with pytest.raises(ValueError, match=r"foreign's tokenizer numbers \d+ of the policy's \d+ tokens otherwise"):
        with_critic(loaded)
    # Its own tokenizer (the policy's family) is taken; a token the policy's tokenizer added and the critic's lacks
    # is warned (the critic never learned it).
    build_char_tokenizer().save_pretrained(tmp_path / "foreign")
    critic.resize_token_embeddings(len(policy_tokenizer) + 8)
    critic.save_pretrained(tmp_path / "foreign")
    policy_tokenizer.add_tokens(["<tool_result>"])
    with caplog.at_level(logging.WARNING):
        with_critic(tmp_path / "foreign", processing_class=policy_tokenizer)
    assert "lacks or numbers otherwise 1 token(s) the policy's tokenizer added ('<tool_result>')" in caplog.text


def test_auto_resumes_where_there_is_a_checkpoint_and_starts_afresh_where_there_is_none(tiny_model_dir, tmp_path):
    """A preemptible job is requeued with one command, before its first checkpoint or after: `latest` refused the
    first (no checkpoint), no resume the second (an earlier run's checkpoints). `auto` takes each as it comes."""
    from trl_vapo.cli import UsageError, _check_resume

    out = tmp_path / "out"
    _check_resume(str(out), "auto")  # the command line's check before any model loads: nothing to refuse
    with pytest.raises(UsageError, match="no complete checkpoint"):
        _check_resume(str(out), True)

    def run(max_steps: int) -> VAPOTrainer:
        args = config(tmp_path, save_strategy="steps", save_steps=1, max_steps=max_steps)
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32))
        trainer.train(resume_from_checkpoint="auto")
        return trainer

    first = run(1)  # a fresh run
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-1"]
    assert [h["step"] for h in first.state.log_history if "phase" in h] == [1]
    second = run(2)  # resumed from checkpoint-1: its first step is 2
    assert [h["step"] for h in second.state.log_history if "phase" in h] == [1, 2]
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    with open(out / "vapo_logs.jsonl") as logs:
        assert [json.loads(line)["step"] for line in logs if '"phase"' in line] == [1, 2]  # step 1 trained once


def test_a_run_resumed_from_an_earlier_checkpoint_rotates_away_the_run_it_went_back_on(tiny_model_dir, tmp_path):
    """Resumed from checkpoint-1 while a later one of the run it went back on is there (`checkpoint-9`, a copy standing
    in for it): rotation kept that one (the highest step) and deleted this run's own, so a requeued job
    (`resume_from_checkpoint=True`) resumed the abandoned run. It is rotated first (transformers, by the folders'
    times, rotates checkpoint-1 first here: the abandoned run's stays, and a requeued job resumes it)."""
    import shutil

    out = tmp_path / "out"

    def run(**resume) -> VAPOTrainer:
        args = config(tmp_path, save_strategy="steps", save_steps=1, save_total_limit=2, max_steps=2)
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32))
        trainer.train(**resume)
        return trainer

    run()
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-9")
    run(resume_from_checkpoint=str(out / "checkpoint-1"))  # writes checkpoint-2 again, then rotates
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]


def test_resuming_a_checkpoint_of_another_model_or_layout_is_refused(tiny_model_dir, tmp_path):
    from trl_vapo.tiny import save_tiny_model

    first = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path, save_strategy="steps", save_steps=1, max_steps=1),
        train_dataset=prompts_dataset(32),
    )
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    other_model = save_tiny_model(tmp_path / "bigger", hidden_size=32)
    second = VAPOTrainer(
        model=str(other_model),
        reward_funcs=digit_fraction,
        args=config(tmp_path, max_steps=2),
        train_dataset=prompts_dataset(32),
    )
    with pytest.raises(ValueError, match="model_config_sha256"):
        second.train(resume_from_checkpoint=str(checkpoint))
    third = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path, max_steps=2, num_generations=8),
        train_dataset=prompts_dataset(32),
    )
    with pytest.raises(ValueError, match=r"num_generations: checkpoint 4, this run 8"):
        third.train(resume_from_checkpoint=str(checkpoint))
    with pytest.raises(ValueError, match="not a complete trl-vapo checkpoint"):
        third.train(resume_from_checkpoint=str(tmp_path))
    # FSDP saves the optimizer state keyed by parameter name, one process and DDP by index: FSDP's loader found no
    # name among the indices and dropped every parameter's Adam state, silently.
    from trl_vapo.checkpoint import check_resumable, read_marker

    saved = read_marker(checkpoint)["run"]
    first.is_fsdp_enabled = True
    with pytest.raises(ValueError, match=r"fsdp: checkpoint False, this run True.*launcher \(DeepSpeed, FSDP or"):
        check_resumable(checkpoint, saved, first._fingerprint())
    del saved["fsdp"]  # an earlier version's checkpoint, which did not record it: taken as this run's
    check_resumable(checkpoint, saved, first._fingerprint())
    # An older trl-vapo seeded each epoch's order by seed + epoch: its epoch 0 is this version's, and from an epoch's
    # start a resume goes on in this version's order; partway through a later epoch it would read other prompts.
    from trl_vapo.checkpoint import ONE_GENERATOR

    fingerprint = first._fingerprint()
    assert fingerprint["data_order"] == f"shuffled with seed 0 (data_seed, else seed){ONE_GENERATOR}"
    saved["data_order"] = fingerprint["data_order"].removesuffix(ONE_GENERATOR)
    check_resumable(checkpoint, saved, fingerprint, {"data_epoch": 0, "data_index": 8})
    check_resumable(checkpoint, saved, fingerprint, {"data_epoch": 2, "data_index": 0})
    with pytest.raises(ValueError, match=r"8 prompts into epoch 1, whose order the trl-vapo that wrote it drew by"):
        check_resumable(checkpoint, saved, fingerprint, {"data_epoch": 1, "data_index": 8})
    # An optimizer state of other parameters (an older trl-vapo's critic adapter also adapted an LM head named in
    # target_modules, which the fingerprint does not record): torch's error said a group "doesn't match the size".
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    group = state["param_groups"][0]["params"]
    group.append(max(i for g in state["param_groups"] for i in g["params"]) + 1)
    torch.save(state, checkpoint / "optimizer.pt")
    fourth = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path, max_steps=2),
        train_dataset=prompts_dataset(32),
    )
    named = rf"checkpoint-1: its optimizer state holds \[{len(group)}, 5, 16, 5\] .* trains \[{len(group) - 1}, "
    with pytest.raises(ValueError, match=named):
        fourth.train(resume_from_checkpoint=str(checkpoint))


def test_a_nonfinite_step_is_skipped_and_counted(tiny_model_dir, tmp_path):
    PoisonedTrainer.poisoned = {1}
    trainer = PoisonedTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path, max_steps=4),
        train_dataset=prompts_dataset(32),
    )
    before = {n: p.detach().clone() for n, p in trainer.actor_critic.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == 4 and trainer.progress.skipped_steps == 1
    logs = [h for h in trainer.state.log_history if "phase" in h]
    assert [h["skipped_steps"] for h in logs] == [0, 1, 1, 1]
    assert math.isfinite(result.training_loss)  # the skipped step's NaN made it NaN for the rest of the run
    # Logged every two steps: the skipped step's readings are none, as transformers' `logging_nan_inf_filter` leaves
    # such a step's loss out (its NaN made the log's `loss` NaN, an inf inf); its gradient norms stay the last step's.
    PoisonedTrainer.poisoned = {1}
    trainer = PoisonedTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path / "every-2", max_steps=4, logging_steps=2),
        train_dataset=prompts_dataset(32),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "phase" in h]
    assert [h["step"] for h in logs] == [2, 4] and logs[0]["skipped_steps"] == 1
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["loss/value"]) for h in logs)
    assert not math.isfinite(logs[0]["grad_norm"])
    # The log file is strict JSON: the norm is null there (`NaN`, `Infinity`: Python's own, which strict readers
    # reject).
    written = Path(trainer.args.output_dir, "vapo_logs.jsonl").read_text().splitlines()
    strict = [
        json.loads(line, parse_constant=lambda constant: pytest.fail(f"{constant} in the log")) for line in written
    ]
    assert [h["grad_norm"] for h in strict if "phase" in h][0] is None
    assert all(torch.isfinite(p).all() for p in trainer.actor_critic.parameters())
    assert any(not torch.equal(before[n], p) for n, p in trainer.actor_critic.named_parameters())


def test_a_skipped_step_does_not_delay_the_actors_warm_up(tiny_model_dir, tmp_path):
    # Value pretraining's second rollout is skipped; RL starts at step 2 either way, and the actor's warm-up over 4
    # steps must start there: rates 0, 1/4, 2/4, 3/4 of the learning rate at RL steps 1-4.
    PoisonedTrainer.poisoned = {1}
    args = config(
        tmp_path,
        max_steps=4,
        value_pretrain_steps=2,
        value_pretrain_patience=None,
        lr_scheduler_type="linear",
        warmup_steps=4,
        learning_rate=1e-3,
    )

    class CountsSteps(TrainerCallback):  # the optimizer's callbacks at every step, a skipped one too (Trainer's)
        calls = collections.Counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.calls["pre"] += 1

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.calls["step"] += 1

    trainer = PoisonedTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=args,
        train_dataset=prompts_dataset(32),
        callbacks=[CountsSteps()],
    )
    trainer.train()
    assert trainer.progress.skipped_steps == 1 and trainer.progress.rl_start_step == 2
    assert CountsSteps.calls == {"pre": trainer.state.global_step, "step": trainer.state.global_step}
    rates = [h["learning_rate"] for h in trainer.state.log_history if h.get("phase") == "rl"]
    assert rates == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4])
    assert trainer.lr_scheduler.last_epoch == trainer.state.global_step


def test_a_resume_naming_another_value_pretraining_budget_keeps_the_runs_length_and_the_critics_schedule(
    tiny_model_dir, tmp_path
):
    """Once value pretraining has ended, the run's length and the critic's schedule are the run's, whatever budget a
    resume names. A run of value_pretrain_steps=0 resumed without it (the phase is RL: nothing pretrains) planned the
    default budget's steps on top of max_steps and trained them; a run that pretrained, resumed with
    value_pretrain_steps=0, gave the critic's decaying rate this run's length (RL alone): 0 before the run's end, and
    counted the epochs of this run's rollouts alone (RL's 4, on a set of one rollout an epoch): having read 5 epochs,
    it stopped at the checkpoint's step, 4 steps short."""
    save = dict(save_strategy="steps", save_steps=1, value_pretrain_patience=None)
    started_in_rl = config(tmp_path / "rl", max_steps=2, value_pretrain_steps=0, **save)
    VAPOTrainer(str(tiny_model_dir), digit_fraction, args=started_in_rl, train_dataset=prompts_dataset(32)).train()
    resumed = VAPOTrainer(
        str(tiny_model_dir),
        digit_fraction,
        args=config(tmp_path / "rl", max_steps=4, value_pretrain_steps=2, **save),
        train_dataset=prompts_dataset(32),
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == resumed.state.max_steps == 4

    pretrained = config(tmp_path / "vp", max_steps=2, value_pretrain_steps=3, lr_scheduler_type="linear", **save)
    one_rollout = prompts_dataset(2)  # (2 prompts x 4 completions: a rollout an epoch)
    first = VAPOTrainer(str(tiny_model_dir), digit_fraction, args=pretrained, train_dataset=one_rollout)
    first.train()
    rl_start = first.progress.rl_start_step
    assert rl_start > 0
    resumed = VAPOTrainer(
        str(tiny_model_dir),
        digit_fraction,
        args=config(tmp_path / "vp", max_steps=4, value_pretrain_steps=0, lr_scheduler_type="linear", **save),
        train_dataset=one_rollout,
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == resumed.state.max_steps == rl_start + 4
    critic = [
        s for g, s in zip(resumed.optimizer.param_groups, resumed.lr_scheduler.lr_lambdas) if g["name"] == "critic"
    ]
    assert {schedule.total_steps for schedule in critic} == {rl_start + 4}
    rates = [h["critic_learning_rate"] for h in resumed.state.log_history if "critic_learning_rate" in h]
    assert rates[-1] > 0  # linear over the run: above 0 until its end (it was 0 from step 4 on)


@pytest.mark.parametrize("kind", ["constant_with_warmup", "constant", "linear", "cosine", "cosine-1.0"])
def test_each_schedule_is_transformers_own_shifted_to_where_its_side_starts(kind):
    """`Schedule` follows `transformers.get_scheduler`, multiplier for multiplier over a whole run (`constant` has no
    warm-up, whatever warmup_steps says), started at the step its side starts (the actor's: after value
    pretraining), and 0 before it."""
    from transformers import get_scheduler

    from trl_vapo.optim import Schedule

    warmup, total, start = 3, 10, 4
    kind, *cycles = kind.split("-")  # cosine-1.0: `lr_scheduler_kwargs={"num_cycles": 1.0}`, down and up again
    options = {"num_cycles": float(cycles[0])} if cycles else {}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    reference = get_scheduler(
        kind, optimizer, num_warmup_steps=warmup, num_training_steps=total, scheduler_specific_kwargs=options
    )
    expected = []
    for _ in range(total):
        expected.append(reference.get_last_lr()[0])
        optimizer.step()
        reference.step()
    ours = Schedule(kind, warmup, total, start_step=start, **options)
    assert [ours(step) for step in range(start)] == [0.0] * start
    assert [ours(start + step) for step in range(total)] == pytest.approx(expected, abs=1e-12)


def test_consecutive_nonfinite_steps_stop_the_run_and_keep_the_last_checkpoint(tiny_model_dir, tmp_path):
    PoisonedTrainer.poisoned = {2, 3, 4, 5}
    args = config(tmp_path, max_steps=8, save_strategy="steps", save_steps=1, nonfinite_loss_patience=3)
    trainer = PoisonedTrainer(
        model=str(tiny_model_dir), reward_funcs=digit_fraction, args=args, train_dataset=prompts_dataset(32)
    )
    stopped = r"3 optimizer steps since the last update applied.*checkpoint-\d+, is intact"
    with pytest.raises(RuntimeError, match=stopped):
        trainer.train()
    checkpoints = list_checkpoints(tmp_path / "out")
    assert checkpoints[-1].name == "checkpoint-4"  # steps 3 and 4 were skipped but still checkpointed...
    # ... and the last checkpoint holds finite weights and resumes.
    resumed = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path, max_steps=6),
        train_dataset=prompts_dataset(32),
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6 and all(torch.isfinite(p).all() for p in resumed.model.parameters())


class StepCounter(TrainerCallback, ExportableState):
    def __init__(self, steps: int = 0):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def state(self) -> dict:
        return {"args": {"steps": self.steps}, "attributes": {}}


def test_a_resume_takes_this_runs_intervals_and_the_callbacks_saved_states_where_asked(tiny_model_dir, tmp_path):
    """A run resumed with another `save_steps` saves at the new interval (it kept the checkpoint's, silently), and
    with `restore_callback_states_from_checkpoint` a stateful callback continues from its saved state (it restarted
    from its own), as transformers' Trainer restores them, each of two of one class to its own; without it, the
    callbacks keep theirs."""
    first = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=prompts_dataset(32),
        callbacks=[StepCounter(), StepCounter(100)],
    )
    first.train()
    assert [c.name for c in list_checkpoints(tmp_path / "out")] == ["checkpoint-2"]
    for restore, counted in ((True, 4), (False, 2)):
        for later in list_checkpoints(tmp_path / "out")[1:]:
            shutil.rmtree(later)
        args = config(tmp_path, max_steps=4, save_strategy="steps", save_steps=1)
        args.restore_callback_states_from_checkpoint = restore
        resumed = VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=args,
            train_dataset=prompts_dataset(32),
            callbacks=[StepCounter(), StepCounter(100)],
        )
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
        assert [c.name for c in list_checkpoints(tmp_path / "out")][:3] == [
            "checkpoint-2",
            "checkpoint-3",
            "checkpoint-4",
        ]
        counters = [cb.steps for cb in resumed.callback_handler.callbacks if isinstance(cb, StepCounter)]
        assert counters == [counted, 100 + counted], restore


# ---------------------------------------------------------------------------------------------------------------------
# Faults: nothing lost
# ---------------------------------------------------------------------------------------------------------------------


def read_logs(output_dir: Path, rank: int = 0, name: str = "logs") -> list[dict]:
    path = output_dir / f"{name}-rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_logged_step(output_dir: Path) -> int:
    """The last step a running `_train_script.py` logged (0 before any; a line being written is not read)."""
    path = output_dir / "logs-rank0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:  # the line still being written
            break
    return max(steps)


def step_logs(logs: list[dict]) -> dict[int, dict]:
    """The per-step training logs by step (the last one per step wins: a resumed run re-logs nothing earlier)."""
    return {h["step"]: clock_free(h) for h in logs if "phase" in h}


def assert_logged(logs: dict[int, dict], keys) -> None:
    """Each of `keys` in some RL step's log: `assert_same_log` passes over a key neither log has, so a renamed
    metric would leave a comparison of `keys` without a word."""
    logged = set().union(*(entry for entry in logs.values() if entry.get("phase") == "rl"))
    assert not set(keys) - logged, f"never logged: {sorted(set(keys) - logged)}"


def assert_same_log(got: dict, expected: dict, keys=None, rel: float = 0.0, context: str = "") -> None:
    """Equal log entries, NaN equal to NaN; exact unless `rel` is given."""
    keys = keys if keys is not None else sorted(set(got) | set(expected))
    for key in keys:
        if key not in expected and key not in got:
            continue
        a, b = got.get(key), expected.get(key)
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            continue
        if rel and isinstance(a, float) and isinstance(b, float):
            assert a == pytest.approx(b, rel=rel, abs=rel / 10), (context, key, a, b)
        else:
            assert a == b, (context, key, a, b)


def start_script(model_dir: Path, out: Path, *args: str, default_sigint: bool = False) -> ScriptProcess:
    """`_train_script.py` in a process of its own, in the background (`LONG_RUN`, then `args`)."""
    return _script_process.start_script(
        "--model", model_dir, "--output-dir", out, *LONG_RUN, *args, default_sigint=default_sigint
    )


# Value pretraining (2 rollouts x 2 steps), then 60 RL steps: time to die in. A step of the tiny model takes 10-50 ms
# here, so the run lasts about 2 s after its first checkpoint (step 2).
LONG_RUN = ["--max-steps", "60"]


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir, tmp_path_factory):
    """An uninterrupted run, logged step by step."""
    out = tmp_path_factory.mktemp("reference")
    result = run_script("--model", str(tiny_model_dir), "--output-dir", str(out), *LONG_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return step_logs(read_logs(out))


def test_kill_9_at_a_random_point_then_resume_matches_the_uninterrupted_run(tiny_model_dir, tmp_path, reference_run):
    out = tmp_path / "killed"
    process = start_script(tiny_model_dir, out)
    deadline = time.time() + 240
    while not list_checkpoints(out) and time.time() < deadline:  # wait for a first complete checkpoint
        time.sleep(0.02)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 0.4))  # then die anywhere: mid-step, mid-checkpoint, ...
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    last = list_checkpoints(out)[-1]
    # Killed after a checkpoint's files and marker were written, before its renames: the resume publishes it.
    written = [
        int(re.match(r"\.checkpoint-(\d+)\.", p.name)[1])
        for p in out.glob(".checkpoint-*.tmp")
        if (p / COMPLETE_MARKER).is_file()
    ]

    result = run_script(
        "--model", str(tiny_model_dir), "--output-dir", str(out), *LONG_RUN, "--resume", "--log-name", "resumed"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed_from = max([int(last.name.split("-")[1]), *written])
    logs = step_logs(read_logs(out, name="resumed"))
    total = max(reference_run)
    assert sorted(logs) == list(range(resumed_from + 1, total + 1))
    for step in logs:
        context = f"step {step} after resuming from checkpoint-{resumed_from}"
        assert_same_log(logs[step], reference_run[step], context=context)


def test_a_marker_write_cut_short_leaves_no_marker(tmp_path, monkeypatch):
    """The completion marker was written in place: a stop between the file's creation and its write (a kill -9, a
    power loss before the flush) left an empty marker, in a folder that looked complete by it. The kill -9 test above
    met it once: it counted that folder as written, and the resume, rightly, passed it over as unreadable. Written
    beside it now, on the disk, then renamed in place: whole, or not there."""
    from trl_vapo.checkpoint import write_marker

    real = Path.write_text

    def killed_mid_write(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2])
        raise KeyboardInterrupt  # (a kill -9 has no handler: the write stops here)

    monkeypatch.setattr(Path, "write_text", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        write_marker(tmp_path, {"progress": {"phase": "rl"}})
    assert not (tmp_path / COMPLETE_MARKER).exists()
    monkeypatch.undo()
    write_marker(tmp_path, {"progress": {"phase": "rl"}})
    assert json.loads((tmp_path / COMPLETE_MARKER).read_text()) == {"progress": {"phase": "rl"}}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_at_a_random_point_checkpoints_and_the_resumed_run_matches(
    tiny_model_dir, tmp_path, reference_run, signum
):
    """SIGTERM (a preemption, `scancel`) or SIGINT anywhere after the first checkpoint: the run finishes its rollout,
    writes a checkpoint at the last step it logged, names it in one line and exits with 128 + the signal; resumed
    with `resume_from_checkpoint=True`, it logs the uninterrupted run's steps (resumed after SIGTERM: the checkpoint
    is the same whichever signal asked for it)."""
    out = tmp_path / "signalled"
    process = start_script(
        tiny_model_dir,
        out,
        "--save-steps",
        "5",
        # pytest-xdist's workers ignore SIGINT, and an ignored signal stays ignored in their children (as under
        # nohup): the run would rightly ignore it too. A run started from a terminal has it at its default.
        default_sigint=True,
    )
    # Once a random step from 5 to 14 of 64 is logged (a checkpoint is written every 5): wherever the run then is,
    # mid-rollout, mid-checkpoint or between steps, with 50 or more steps to go.
    signal_after = random.Random(os.getpid() + signum).randint(5, 14)
    deadline = time.time() + 240
    while last_logged_step(out) < signal_after and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr[-3000:]
    logged = max(step_logs(read_logs(out)))
    last = list_checkpoints(out)[-1]
    assert last.name == f"checkpoint-{logged}" and logged < max(reference_run)  # nothing trained is lost
    name = signal.Signals(signum).name
    assert f"Stopped by {name} at step {logged}: {last} holds every step so far" in stderr
    if signum != signal.SIGTERM:
        return

    result = run_script(
        "--model", str(tiny_model_dir), "--output-dir", str(out), *LONG_RUN, "--resume", "--log-name", "resumed"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logs = step_logs(read_logs(out, name="resumed"))
    assert sorted(logs) == list(range(logged + 1, max(reference_run) + 1))
    for step in logs:
        assert_same_log(logs[step], reference_run[step], context=f"step {step} after resuming from {last.name}")


def test_each_spelling_of_resume_from_checkpoint_reads_as_python_and_the_command_line_mean_it(tmp_path, monkeypatch):
    from trl_vapo.checkpoint import resume_request

    monkeypatch.chdir(tmp_path)
    given = [True, "true", "Latest", "yes", "1", None, False, "false", "None", "", "no", "0", "out/checkpoint-3"]
    assert [resume_request(x) for x in given] == [True] * 5 + [None] * 7 + ["out/checkpoint-3"]
    (tmp_path / "latest").mkdir()
    (tmp_path / "no").mkdir()
    assert resume_request("latest") == "latest" and resume_request("no") == "no"  # a folder of that name is it


@pytest.mark.parametrize("word", ["latest", "true", "True"])
def test_resume_from_checkpoint_latest_or_true_as_a_string_is_the_newest_checkpoint(tiny_model_dir, tmp_path, word):
    """`trl-vapo train --resume_from_checkpoint latest` (or `true`) reaches `train` as a string: the newest
    checkpoint, as `True` is, not a path named "latest"."""
    first = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path, save_strategy="steps", save_steps=1),
        train_dataset=prompts_dataset(32),
    )
    first.train()
    again = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path, save_strategy="steps", save_steps=1, max_steps=3),
        train_dataset=prompts_dataset(32),
    )
    trained = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trained.append(state.global_step)

    again.add_callback(Steps())
    again.train(resume_from_checkpoint=word)
    assert trained == [3]  # steps 1 and 2 came from checkpoint-2


def test_a_repeated_sigterm_is_one_request_and_a_later_one_stops_at_once(tiny_model_dir, tmp_path):
    """A launcher forwards the signal its job got (a worker sees it twice within milliseconds): that is one request.
    One more, `SIGNAL_REPEAT_WINDOW` seconds later, ends the run at once (here, hung writing checkpoint 2). The window
    is 1.5 s here (5 s by default: the test waited it out)."""
    window = 1.5
    out = tmp_path / "twice"
    process = start_script(tiny_model_dir, out, "--stall-at", "2", "--signal-repeat-window", str(window))
    deadline = time.time() + 240
    while not (out / "stalled").exists() and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    time.sleep(window / 2)
    assert process.poll() is None, "a repeat within the window ended the run"
    time.sleep(window + 1)  # (past the window however late the first signal was handled)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM
    assert "SIGTERM: finishing this rollout" in stderr and "already stopping after this rollout" in stderr


def test_on_several_processes_a_stop_ends_each_once_the_main_ones_run_end_is_done(tiny_model_dir, tmp_path):
    """Stopped by a signal, the processes other than the main one exited once the checkpoint was written, while the
    main one still ended the run: uploaded the checkpoint to the Hub (waited for: the stop's one copy off a machine
    that goes), closed its trackers. A launcher that sees a worker exit with the signal's code stops the others
    (torchrun's agent, Slurm's step; `run_ranks` as they do): the main process was killed in its upload. Each now
    exits once the main one is done."""
    out = tmp_path / "stopped"
    args = ["--model", str(tiny_model_dir), "--output-dir", str(out), "--max-steps", "4", "--value-pretrain-steps"]
    args += ["0", "--num-iterations", "1", "--save-steps", "100", "--stop-at", "1", "--slow-stop", "1.5"]
    stopped = run_ranks(*args, processes=2, timeout=150, grace=0.5)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "Stopped by SIGTERM at step 1" in stopped.stderr, stopped.stderr[-3000:]
    assert (out / "train_end-rank0").is_file(), "the main process was stopped before its run's end was done"
    assert list_checkpoints(out) == [out / "checkpoint-1"]


def test_the_output_dir_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path, caplog):
    """The lock is the operating system's (`flock`), not the file's contents: a file no live process locks is taken
    over whatever it names (a dead PID, a PID reused since, another host, nothing), and of two runs taking over one
    lock file at once exactly one gets it."""
    from trl_vapo.run_lock import RUN_LOCK, output_dir_lock, refusal

    lock = tmp_path / RUN_LOCK
    with output_dir_lock(tmp_path):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        with pytest.raises(RuntimeError, match=f"Another run is writing to {tmp_path}: PID {os.getpid()}") as held:
            with output_dir_lock(tmp_path):
                pass
        assert "delete" not in str(held.value)  # this host's holder is alive: no way round it is offered
    # A holder on another host may be a lost node whose lock the file server keeps (NFS): the way on is named.
    elsewhere = refusal(tmp_path, {"pid": 7, "host": "gone-node", "started": "yesterday"})
    assert "If gone-node is gone (a lost or deleted node)" in elsewhere and f"delete {lock}" in elsewhere
    assert "If its host is gone" in refusal(tmp_path, {})  # a holder that died before naming itself
    assert not lock.exists()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = socket.gethostname()
    for left in (
        {"pid": int(gone.stdout), "host": here},
        {"pid": os.getppid(), "host": here},  # a PID reused by a live process that holds nothing
        {"pid": 1, "host": "another-host", "started": "then"},
        None,  # a holder that died before it wrote its name: taken, nothing to say
    ):
        lock.write_text("" if left is None else json.dumps(left))
        caplog.clear()
        with caplog.at_level(logging.WARNING), output_dir_lock(tmp_path):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert ("Taking over the lock of a run that is gone" in caplog.text) == (left is not None), left

    lock.write_text(json.dumps({"pid": int(gone.stdout), "host": here}))
    # The holder keeps the lock until its stdin closes, after both have said their line: a holder that let go after
    # a second let a racer that started later (a loaded machine) take it too.
    take = (
        "import sys; from trl_vapo.run_lock import output_dir_lock\n"
        "try:\n    with output_dir_lock(sys.argv[1]):\n        print('held', flush=True); sys.stdin.read()\n"
        "except RuntimeError as refused:\n    print(refused, flush=True)\n"
    )
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", take, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    said = sorted(racer.stdout.readline().strip() for racer in racers)
    for racer in racers:
        racer.communicate(timeout=120)
    assert said[1] == "held" and said[0].startswith(f"Another run is writing to {tmp_path}: PID "), said


def test_a_process_the_run_forked_does_not_keep_its_lock_after_it_dies(tmp_path):
    """A `flock` belongs to the open file, which a forked child (a reward function's `multiprocessing` worker) shares:
    the run died and its hung worker kept the lock, and every later run there was refused naming a dead PID. The
    child closes its copy at the fork; where a process keeps one anyway, the refusal says the PID is gone and how to
    find what holds it."""
    from trl_vapo.run_lock import RUN_LOCK, live_holder, refusal

    dies = (
        "import os, sys, time\nfrom trl_vapo.run_lock import output_dir_lock\n"
        "with output_dir_lock(sys.argv[1]):\n"
        "    child = os.fork()\n"
        "    if child == 0:\n"  # (its fork handlers have run once fork returns here: then it says it is ready)
        "        open(sys.argv[2] + '.ready', 'w').close()\n        time.sleep(60)\n        os._exit(0)\n"
        "    while not os.path.exists(sys.argv[2] + '.ready'):\n        time.sleep(0.01)\n"
        "    open(sys.argv[2], 'w').write(str(child))\n    os._exit(0)\n"  # dies holding it, as SIGKILL leaves a run
    )
    subprocess.run([sys.executable, "-c", dies, str(tmp_path), str(tmp_path / "child")], timeout=60, check=True)
    child = int((tmp_path / "child").read_text())
    try:
        assert os.kill(child, 0) is None and live_holder(tmp_path) is None  # the worker lives, the folder is free
    finally:
        os.kill(child, signal.SIGKILL)
    gone = json.loads((tmp_path / RUN_LOCK).read_text())["pid"]
    said = refusal(tmp_path, {"pid": gone, "host": socket.gethostname()})
    assert f"PID {gone} is gone, and a process it started keeps the lock (`fuser -v {tmp_path / RUN_LOCK}`" in said
    assert "is gone" not in refusal(tmp_path, {"pid": os.getpid(), "host": socket.gethostname()})


def test_a_lock_file_this_user_cannot_open_is_named(tmp_path, monkeypatch):
    """Another user's run left its lock file (or the folder is not this user's to write): a bare PermissionError with
    a traceback. A file's permissions do not bind root, as these tests may run: the refused open is a stand-in."""
    from trl_vapo import run_lock

    def refused(path, flags, mode=0o777):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(run_lock.os, "open", refused)
    with pytest.raises(
        RuntimeError, match=r"Cannot open the run lock .* \(Permission denied\): .* another user's run"
    ):
        with run_lock.output_dir_lock(tmp_path):
            pass


def test_a_run_ending_removes_its_own_lock_file_not_one_a_later_run_holds(tmp_path):
    """A lock file deleted while its run lives (the refusal's way on, for a holder taken for gone) lets another run
    lock a new one; the first run, ending, removed whatever file was at the path: the second's, and a third run
    could start beside the second."""
    from trl_vapo.run_lock import RUN_LOCK, output_dir_lock

    with output_dir_lock(tmp_path):
        (tmp_path / RUN_LOCK).unlink()
        with output_dir_lock(tmp_path):
            pass  # a run that ends first removes its own file
        second = output_dir_lock(tmp_path)
        second.__enter__()
    try:
        assert (tmp_path / RUN_LOCK).is_file()
        with pytest.raises(RuntimeError, match=f"Another run is writing to {tmp_path}"):
            with output_dir_lock(tmp_path):
                pass
    finally:
        second.__exit__(None, None, None)
    assert not (tmp_path / RUN_LOCK).exists()


def test_a_lock_file_unreadable_as_the_run_ends_leaves_the_runs_own_error_and_closes_the_lock(tmp_path):
    """The release read the lock file's path and let any error but "not found" out: on a mount lost as the run ends
    (NFS's ESTALE, EIO) that error replaced the one in flight (a stop signal's, whose exit code a launcher reads), and
    the descriptor stayed open. Here the path fails as a lost mount's would: the output dir was replaced by a file."""
    from trl_vapo import run_lock

    out = tmp_path / "out"
    with pytest.raises(KeyError, match="the run's own error"):
        with run_lock.output_dir_lock(out):
            (fd,) = run_lock._HELD
            shutil.rmtree(out)
            out.write_text("not a folder")  # os.stat(out / RUN_LOCK): NotADirectoryError, an OSError
            raise KeyError("the run's own error")
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)


def test_a_command_holds_the_output_dir_until_its_model_is_saved(tiny_model_dir, tmp_path):
    """`trl-vapo train` evaluates and saves after `train()`: the lock was released when `train()` returned, and a run
    started then took the folder and removed the model being saved as a stopped run's debris. The command holds it
    around all of that (`holding_output_dir`), and `train()` inside holds it once."""
    from trl_vapo.run_lock import live_holder

    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, max_steps=1), prompts_dataset())
    out = trainer.args.output_dir
    with trainer.holding_output_dir():
        trainer.train()
        assert live_holder(out)["pid"] == os.getpid()  # still held after train()
    assert live_holder(out) is None
    # The same from Python (TRL's `trainer.train(); trainer.save_model()`): `save_model` holds it while it writes.
    holders = []
    write_models = trainer._write_models
    trainer._write_models = lambda *a, **k: holders.append(live_holder(out)) or write_models(*a, **k)
    # An earlier `trl-vapo train`'s data flags in the folder describe its model, not this one: they go with it.
    (Path(out) / RUN_DATA_FILE).write_text('{"dataset_name": "earlier.jsonl"}')
    trainer.save_model()
    assert not (Path(out) / RUN_DATA_FILE).exists()
    trainer.save_model(str(tmp_path / "elsewhere"))  # another folder: the run's is not held for it
    assert [h and h["pid"] for h in holders] == [os.getpid(), None] and live_holder(out) is None


def test_an_smb_lock_refuses_a_second_run_and_its_holder_reads_its_own_lock_file(tmp_path, monkeypatch, caplog):
    """CIFS (Linux 5.5 on) makes `flock` an SMB byte-range lock: a conflict is EACCES, not EWOULDBLOCK, and a read of
    the locked file through any other descriptor is refused with EACCES, its holder's too. EACCES was read as a file
    system without locks (a second run went on unlocked, writing the first one's checkpoints), and a run that took
    over a crashed run's lock read it through a new descriptor (a PermissionError: no run could start there). No SMB
    mount here: `flock` and the lock file's reads by path raise as CIFS's do (a stand-in with the real errors)."""
    import fcntl

    from trl_vapo.run_lock import RUN_LOCK, live_holder, output_dir_lock

    lock = tmp_path / RUN_LOCK
    lock.write_text(json.dumps({"pid": 1, "host": "node-7", "started": "yesterday"}))  # a crashed run's
    read_bytes, read_text = Path.read_bytes, Path.read_text

    def smb_read(read):
        def refused(path, *args, **kwargs):
            if path.name == RUN_LOCK:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return read(path, *args, **kwargs)

        return refused

    monkeypatch.setattr(Path, "read_bytes", smb_read(read_bytes))
    monkeypatch.setattr(Path, "read_text", smb_read(read_text))
    with caplog.at_level(logging.WARNING), output_dir_lock(tmp_path) as locked:
        assert locked is True
    assert "Taking over the lock of a run that is gone ({'pid': 1, 'host': 'node-7'" in caplog.text

    def smb_flock(fd, operation):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(fcntl, "flock", smb_flock)  # another run holds it
    lock.write_text("{}")
    with pytest.raises(RuntimeError, match=f"^Another run is writing to {re.escape(str(tmp_path))}"):
        with output_dir_lock(tmp_path):
            pass
    assert live_holder(tmp_path) == {}  # (held, its holder unreadable: the command's early refusal says so too)


def test_a_folder_that_cannot_be_locked_runs_unlocked_and_its_debris_stays(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    """A file system without locks (ENOLCK on some network mounts): the run goes on with a warning, told it holds no
    lock (so it removes nothing another run may be writing), and its own errors carry no trace of the lock's."""
    import fcntl

    from trl_vapo.checkpoint import remove_debris
    from trl_vapo.run_lock import output_dir_lock

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(ValueError) as raised, caplog.at_level(logging.WARNING):
        with output_dir_lock(tmp_path) as locked:
            assert locked is False
            raise ValueError("training failed")
    assert raised.value.__context__ is None and "cannot be locked" in caplog.text
    # A trainer in such a folder leaves another run's half-written checkpoint where it is (one of another host, of a
    # process of this host that runs, or named by no process), and removes those of this host's runs that are gone
    # (a job killed mid-checkpoint at each preemption left a full checkpoint each time, kept for good).
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, config(tmp_path / "run"), prompts_dataset(8))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host, out = socket.gethostname(), Path(trainer.args.output_dir)
    writing = [".checkpoint-3.tmp", f".checkpoint-4.{host}-{os.getppid()}.tmp", f".checkpoint-5.node-9-{gone.pid}.tmp"]
    for name in [*writing, f".checkpoint-6.{host}-{gone.pid}.tmp", f".checkpoint-2.{host}-{gone.pid}.del"]:
        (out / name).mkdir(parents=True)
    with trainer.holding_output_dir():
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".checkpoint")) == sorted(writing)
    # Windows tells no process's end by `os.kill(pid, 0)`, which sends a Ctrl+C: psutil says there (every PID was
    # taken as alive, and no gone run's folder was ever removed). A stand-in for psutil's Windows `pid_exists`
    # (OpenProcess), whose POSIX form, here, would call os.kill.
    import psutil

    from trl_vapo.checkpoint import _of_a_run_gone_from_this_host

    with pytest.MonkeyPatch.context() as windows:
        windows.setattr(os, "name", "nt")
        windows.setattr(os, "kill", lambda pid, sig: pytest.fail("os.kill called on Windows"))
        windows.setattr(psutil, "pid_exists", lambda pid: pid != gone.pid)
        assert _of_a_run_gone_from_this_host(out / f".checkpoint-6.{host}-{gone.pid}.tmp")
        assert not _of_a_run_gone_from_this_host(out / f".checkpoint-4.{host}-{os.getppid()}.tmp")
        # (this run's PID: the run that wrote it is gone, Windows reusing PIDs soon; it was kept there)
        assert _of_a_run_gone_from_this_host(out / f".checkpoint-7.{host}-{os.getpid()}.tmp")
    shutil.rmtree(tmp_path / "run")
    monkeypatch.undo()
    names = [
        ".checkpoint-3.tmp",
        ".checkpoint-4.host-1.tmp",
        ".checkpoint-4.host-1.old",
        ".value_pretrained_critic.h-2.tmp",
        ".save_model.host-7.tmp",  # a save_model killed mid-write: a full model copy, kept forever before
        ".checkpoint-2.host-1.del",  # a rotation's removal cut short (it left checkpoint-2, without its marker)
    ]
    kept = [".other.tmp", "checkpoint-6", ".checkpoint-x.tmp", ".save_models.tmp"]
    for name in names + kept:
        (tmp_path / name).mkdir()
    with output_dir_lock(tmp_path) as locked:
        # Older unnamed folders too; an .old without its checkpoint but incomplete (no marker) is not put back.
        assert locked is True and remove_debris(tmp_path) == (sorted(names), [], [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)

    # A run stopped between publish's two renames (replacing checkpoint-6's folder) left the whole old checkpoint
    # as .old and the new one as .tmp: the old one goes back in place, not into the bin with the rest.
    (tmp_path / "checkpoint-6").rename(tmp_path / ".checkpoint-6.host-1.old")
    (tmp_path / ".checkpoint-6.host-1.old" / "model.safetensors").write_text("weights")
    (tmp_path / ".checkpoint-6.host-1.old" / "vapo_state.json").write_text("{}")  # its completion marker
    (tmp_path / ".checkpoint-6.host-1.tmp").mkdir()
    with output_dir_lock(tmp_path):
        assert remove_debris(tmp_path) == ([".checkpoint-6.host-1.tmp"], ["checkpoint-6"], [])
    assert (tmp_path / "checkpoint-6" / "model.safetensors").read_text() == "weights"
    # The same for the value-pretrained critic (a later run's value_model): it was removed with the new one, and lost.
    old_critic = tmp_path / ".value_pretrained_critic.host-1.old"
    old_critic.mkdir()
    (old_critic / "vapo_value_pretraining.json").write_text("{}")  # its record, written last
    (tmp_path / ".value_pretrained_critic.host-1.tmp").mkdir()
    with output_dir_lock(tmp_path):
        assert remove_debris(tmp_path) == ([".value_pretrained_critic.host-1.tmp"], ["value_pretrained_critic"], [])
    assert (tmp_path / "value_pretrained_critic" / "vapo_value_pretraining.json").is_file()


@pytest.fixture(scope="module")
def two_checkpoints(tiny_model_dir, tmp_path_factory) -> Path:
    """A short run's output_dir with checkpoint-1 and checkpoint-2 (policy, critic copy, optimizer, scheduler)."""
    out = tmp_path_factory.mktemp("two-checkpoints")
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(out, save_strategy="steps", save_steps=1),
        train_dataset=prompts_dataset(32),
    )
    trainer.train()
    return out / "out"


@pytest.mark.parametrize(
    "fault, named",
    [
        ("empty optimizer.pt", "optimizer.pt: ValueError: empty file"),
        ("empty scheduler.pt", "scheduler.pt: ValueError: empty file"),
        ("no model.safetensors", "missing model.safetensors"),
        ("no critic/", "missing critic/model.safetensors"),
        ("sharded model.safetensors", "missing model-00002-of-00002.safetensors"),  # its second shard not copied
        ("trainer_state.json {}", "trainer_state.json: ValueError: no global_step"),
        # its completion marker itself, cut short (a partial copy of output_dir): it was an error, not passed over
        ("empty vapo_state.json", "vapo_state.json: JSONDecodeError: Expecting value: line 1 column 1 (char 0)"),
    ],
)
def test_a_checkpoint_that_looks_whole_but_is_not_is_passed_over(two_checkpoints, tmp_path, caplog, fault, named):
    """Files a resume reads that are missing, empty (a power loss before the data reached the disk) or without the
    step (`{}`): the checkpoint is named unreadable and the newest one that reads is taken; named explicitly, it is
    an error naming the file, before anything loads."""
    from trl_vapo.checkpoint import checkpoint_problem, newest_resumable_checkpoint

    out = tmp_path / "out"
    shutil.copytree(two_checkpoints, out)
    newest = out / "checkpoint-2"
    what, _, name = fault.partition(" ")
    if what == "empty":
        (newest / name).write_bytes(b"")
    elif what == "no":
        target = newest / name.rstrip("/")
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    elif what == "sharded":  # a large model's weights, in shards: one of them is not there
        (newest / name).rename(newest / "model-00001-of-00002.safetensors")
        shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        (newest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    else:
        (newest / "trainer_state.json").write_text("{}")
    assert checkpoint_problem(newest) == named and checkpoint_problem(out / "checkpoint-1") is None
    with caplog.at_level(logging.WARNING, logger="trl_vapo.checkpoint"):
        assert newest_resumable_checkpoint(out, warn=False) == out / "checkpoint-1"  # the command line's early look
        assert not caplog.text
        assert newest_resumable_checkpoint(out) == out / "checkpoint-1"
    assert f"Checkpoint {newest} cannot be read ({named})" in caplog.text


def test_a_checkpoint_a_stop_left_whole_before_its_renames_is_published_and_resumed_from(
    two_checkpoints, tiny_model_dir, tmp_path, caplog, monkeypatch
):
    """A stop while `publish` flushed a written checkpoint to the disk, before its renames (Slurm's SIGKILL after the
    grace time, another rank's timeout), left it whole as `.tmp`, and the next run removed it as debris: the work
    since the checkpoint before was lost. Published instead, over the `.old` it was replacing; one with a file that
    does not read is still removed. The command line looks for the checkpoint to resume from before it takes the
    lock, which publishes it: `train` looks again."""
    from trl_vapo.checkpoint import remove_debris
    from trl_vapo.run_lock import output_dir_lock

    out = tmp_path / "one" / "out"
    shutil.copytree(two_checkpoints, out)
    (out / "checkpoint-2").rename(out / ".checkpoint-2.host-1.tmp")
    # checkpoint-1 being replaced by a save of the same step (a stop signal's after a model-only one): set aside as
    # .old, the new one whole as .tmp
    shutil.copytree(out / "checkpoint-1", out / ".checkpoint-1.host-2.tmp")
    (out / ".checkpoint-1.host-2.tmp" / "newer").write_text("the replacement")
    (out / "checkpoint-1").rename(out / ".checkpoint-1.host-2.old")
    shutil.copytree(out / ".checkpoint-2.host-1.tmp", out / ".checkpoint-3.host-1.tmp")
    (out / ".checkpoint-3.host-1.tmp" / "optimizer.pt").write_bytes(b"")  # its flush cut short by a power loss
    with output_dir_lock(out):
        removed, restored, published = remove_debris(out)
    assert (removed, restored, published) == (
        [".checkpoint-1.host-2.old", ".checkpoint-3.host-1.tmp"],
        [],
        ["checkpoint-1", "checkpoint-2"],
    )
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint", ".checkpoint"))) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    assert (out / "checkpoint-1" / "newer").is_file()

    second = tmp_path / "two"
    shutil.copytree(two_checkpoints, second / "out")
    (second / "out" / "checkpoint-2").rename(second / "out" / ".checkpoint-2.host-1.tmp")
    args = config(second, save_strategy="steps", save_steps=1)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32))
    assert trainer.resume_point(True)[0] == str(second / "out" / "checkpoint-1")  # before the lock: not yet there
    rollouts = []
    make_rollout = trainer._make_rollout
    trainer._make_rollout = lambda *a, **k: rollouts.append(1) or make_rollout(*a, **k)
    with caplog.at_level(logging.WARNING), trainer.holding_output_dir():
        trainer.train(resume_from_checkpoint=True)
    assert "Published checkpoint-2, which a stopped run wrote whole." in caplog.text
    assert trainer.state.global_step == 2 and not rollouts  # resumed at step 2: nothing left to train

    # The run's only checkpoint left so: before the lock there is none (`trl-vapo train --resume_from_checkpoint true`
    # refused the run, "no complete checkpoint"); the lock publishes it and `train` resumes from it.
    from trl_vapo.cli import UsageError, _check_resume

    third = tmp_path / "three"
    shutil.copytree(two_checkpoints, third / "out")
    shutil.rmtree(third / "out" / "checkpoint-1")
    (third / "out" / "checkpoint-2").rename(third / "out" / ".checkpoint-2.host-1.tmp")
    _check_resume(str(third / "out"), True)
    args = config(third, save_strategy="steps", save_steps=1)
    import fcntl

    def no_locks(fd, operation):  # a file system without locks: nothing is published, the run is not a fresh one
        raise OSError(errno.ENOLCK, "No locks available")

    with monkeypatch.context() as patched:
        patched.setattr(fcntl, "flock", no_locks)
        unlocked = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32))
        assert unlocked.resume_point(True) == (None, None)
        with pytest.raises(ValueError, match="resume_from_checkpoint=True but no complete checkpoint"):
            unlocked.train(resume_from_checkpoint=True)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32))
    assert trainer.resume_point(True) == (None, None)
    with trainer.holding_output_dir():
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 2 and (third / "out" / "checkpoint-2" / "vapo_state.json").is_file()
    shutil.rmtree(third / "out" / "checkpoint-2")  # nothing to resume, nothing to publish: the error, before loading
    with pytest.raises(UsageError, match="resume_from_checkpoint=True but no complete checkpoint"):
        _check_resume(str(third / "out"), True)


def test_an_empty_model_card_leaves_a_checkpoint_whole(two_checkpoints, tmp_path):
    """The Hub's model card is written into a checkpoint after it is published: a power loss then can leave it
    empty, and the checkpoint (every file a resume reads whole) was passed over as damaged."""
    from trl_vapo.checkpoint import checkpoint_problem

    out = tmp_path / "out"
    shutil.copytree(two_checkpoints, out)
    (out / "checkpoint-2" / "README.md").write_bytes(b"")
    assert checkpoint_problem(out / "checkpoint-2") is None
    (out / "checkpoint-2" / "critic" / "README.md").write_bytes(b"")  # one inside is not the card
    assert checkpoint_problem(out / "checkpoint-2") == "critic/README.md: ValueError: empty file"
    (out / "checkpoint-2" / "critic" / "README.md").unlink()
    # The marker's and the trainer state's rewrites at an epoch's end, cut before their rename: each file is whole
    # (the old or the new), and no resume reads the rest.
    (out / "checkpoint-2" / f".{COMPLETE_MARKER}.tmp").write_bytes(b"")
    (out / "checkpoint-2" / ".trainer_state.json.tmp").write_bytes(b"")
    assert checkpoint_problem(out / "checkpoint-2") is None
    (out / "checkpoint-2" / "critic" / ".trainer_state.json.tmp").write_bytes(b"")  # not where it is rewritten
    assert checkpoint_problem(out / "checkpoint-2") == "critic/.trainer_state.json.tmp: ValueError: empty file"
    # A rewrite that fails leaves the file as it was, and nothing beside it.
    from trl_vapo.checkpoint import write_whole

    before = (out / "checkpoint-2" / "trainer_state.json").read_bytes()

    def fails(path):
        path.write_text("{")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_whole(out / "checkpoint-2", "trainer_state.json", fails)
    assert (out / "checkpoint-2" / "trainer_state.json").read_bytes() == before
    assert not (out / "checkpoint-2" / ".trainer_state.json.tmp").exists()


@pytest.mark.parametrize("spelling", ["relative", "other working directory", "link"])
def test_rotation_keeps_the_best_checkpoint_however_its_path_was_spelt(tmp_path, monkeypatch, spelling):
    """`save_total_limit` never deletes the best checkpoint: the state saved by the first run spells its path as that
    run's `output_dir` did, and a resumed run may spell `output_dir` otherwise (relative, from another working
    directory, through a link). Before, the spellings were compared, and the best checkpoint was deleted."""
    from trl_vapo.checkpoint import COMPLETE_MARKER, rotate_checkpoints

    out = tmp_path / "runs" / "out"
    for step in (1, 2, 3, 4):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / COMPLETE_MARKER).write_text("{}")
    monkeypatch.chdir(tmp_path / "runs")
    best = "out/checkpoint-2"  # as the first run, started in runs/ with output_dir="out", saved it
    if spelling == "relative":  # the first run's output_dir was absolute; the resumed run's is "out"
        best = str(out / "checkpoint-2")
    if spelling == "other working directory":  # resumed from runs/'s parent with output_dir="runs/out"
        monkeypatch.chdir(tmp_path)
    output_dir = {"relative": Path("out"), "other working directory": Path("runs/out"), "link": tmp_path / "alias"}
    output_dir = output_dir[spelling]
    if spelling == "link":
        output_dir.symlink_to(out)
    rotate_checkpoints(output_dir, save_total_limit=2, keep=[output_dir / "checkpoint-4", Path(best)])
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]


def test_a_run_resumed_from_a_copy_keeps_the_copys_best_checkpoint(tmp_path):
    """The saved state names the best checkpoint by the first run's path: resumed from a copy of its `output_dir`
    (a move to faster disk, a colleague's copy), rotation kept the original's folder of that name and deleted the
    copy's, and `load_best_model_at_end` read the original's, gone with it once the original was cleaned up."""
    from trl_vapo.checkpoint import COMPLETE_MARKER, checkpoint_in, rotate_checkpoints

    original, copy = tmp_path / "a", tmp_path / "b"
    for step in (1, 2, 3, 4):
        (original / f"checkpoint-{step}").mkdir(parents=True)
        (original / f"checkpoint-{step}" / COMPLETE_MARKER).write_text("{}")
    shutil.copytree(original, copy)
    best = original / "checkpoint-2"  # as the state saved in the original run names it
    assert checkpoint_in(copy, best) == copy / "checkpoint-2"
    rotate_checkpoints(copy, save_total_limit=2, keep=[copy / "checkpoint-4", best])
    assert [p.name for p in list_checkpoints(copy)] == ["checkpoint-2", "checkpoint-4"]
    assert len(list_checkpoints(original)) == 4  # the original is not this run's to rotate
    shutil.rmtree(copy / "checkpoint-2")
    assert checkpoint_in(copy, best) == best  # the copy has none of that name: the path as saved


def test_rotation_keeps_as_many_checkpoints_as_the_limit_when_the_best_one_is_gone(tmp_path):
    """A best checkpoint that is no longer there (deleted by hand, or of a run resumed from a copy elsewhere) takes
    no place among the `save_total_limit` kept: it used to, and one checkpoint too many was deleted."""
    from trl_vapo.checkpoint import COMPLETE_MARKER, rotate_checkpoints

    out = tmp_path / "out"
    for step in (1, 2, 3, 4):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / COMPLETE_MARKER).write_text("{}")
    rotate_checkpoints(out, save_total_limit=2, keep=[out / "checkpoint-4", tmp_path / "elsewhere" / "checkpoint-9"])
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3", "checkpoint-4"]


def test_a_rotation_cut_short_leaves_debris_that_the_next_run_removes(tmp_path, monkeypatch):
    """A rotated checkpoint leaves the checkpoints' names in one rename before its files go: a removal cut short (a
    kill, an `.nfs` file still open) left a `checkpoint-N` without its marker, which no later rotation listed and no
    debris removal matched (a full checkpoint's disk, for good)."""
    from trl_vapo import checkpoint
    from trl_vapo.run_lock import output_dir_lock

    out = tmp_path / "out"
    for step in (1, 2, 3):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "model.safetensors").write_text("weights")
        (out / f"checkpoint-{step}" / checkpoint.COMPLETE_MARKER).write_text("{}")
    with monkeypatch.context() as cut_short:
        cut_short.setattr(checkpoint.shutil, "rmtree", lambda *args, **kwargs: None)  # killed before any file went
        checkpoint.rotate_checkpoints(out, save_total_limit=1, keep=[out / "checkpoint-3"])
    left = sorted(p.name for p in out.iterdir() if p.name != "checkpoint-3")
    assert [re.sub(r"^(\.checkpoint-\d)\..+\.del$", r"\1.RUN.del", name) for name in left] == [
        ".checkpoint-1.RUN.del",
        ".checkpoint-2.RUN.del",
    ]
    with output_dir_lock(out):
        assert checkpoint.remove_debris(out) == (left, [], [])
    assert [p.name for p in out.iterdir()] == ["checkpoint-3"]


def test_save_only_model_checkpoints_hold_the_weights_and_are_not_resumed_from(tiny_model_dir, tmp_path):
    """`save_only_model=True` (ignored before: every checkpoint held the optimizer state too) writes the policy, the
    critic and the state, not the optimizer, schedules or random state; such a checkpoint starts a new run from its
    weights, and a resume from it is refused in one line. The checkpoint a SIGTERM writes is whole: it exists to be
    resumed from."""
    from transformers import AutoModelForCausalLM

    from trl_vapo.signals import TrainingInterrupted

    args = config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, save_only_model=True)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    trainer.train()
    out = tmp_path / "out"
    saved = list_checkpoints(out)
    assert [c.name for c in saved] == ["checkpoint-1", "checkpoint-2"]
    for checkpoint in saved:
        names = {p.name for p in checkpoint.iterdir()}
        assert {"model.safetensors", "trainer_state.json", "critic"} <= names
        assert not names & {"optimizer.pt", "scheduler.pt", "training_state", "rng_state_0.safetensors"}
    AutoModelForCausalLM.from_pretrained(saved[-1])
    with pytest.raises(ValueError, match=r"Cannot resume from .*checkpoint-2: it was saved with save_only_model=True"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset()).train(str(saved[-1]))
    with pytest.raises(ValueError, match="no checkpoint in .* can be read"):
        VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset()).train(True)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, during the rollout

    shutil.rmtree(out)
    stopped = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), callbacks=[Stop()])
    with pytest.raises(TrainingInterrupted):
        stopped.train()
    whole = list_checkpoints(out)[-1]
    assert whole.name == "checkpoint-1" and (whole / "optimizer.pt").is_file() and (whole / "scheduler.pt").is_file()
    # Resumed to step 3 keeping one checkpoint: the model-only ones of steps 2 and 3 rotated the whole one away, and
    # with it the only way to resume; the newest resumable one is now kept besides the newest.
    more = config(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, save_only_model=True, save_total_limit=1)
    resumed = VAPOTrainer(str(tiny_model_dir), digit_fraction, more, prompts_dataset())
    resumed.train(True)
    assert resumed.state.global_step == 3
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-3"]
    again = VAPOTrainer(str(tiny_model_dir), digit_fraction, more, prompts_dataset())
    assert again.resume_point(True)[0] == str(whole)


def test_a_signal_during_the_evaluation_after_the_loop_stops_with_a_checkpoint(tiny_model_dir, tmp_path):
    """A run that ends mid-epoch (max_steps) ends that epoch after its loop, as transformers does, with the evaluation
    `eval_strategy="epoch"` asks for: minutes on a large eval set. A SIGTERM then ended the process at once (the
    handler covered the loop alone), every step lost under save_strategy="no"; it now stops as during the loop,
    with a checkpoint to resume from."""
    from trl_vapo.signals import TrainingInterrupted

    class Stop(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, during the evaluation

    evaluated = dict(per_device_eval_batch_size=4, num_generations_eval=2)
    args = config(tmp_path, max_steps=2, eval_strategy="epoch", **evaluated)
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), prompts_dataset(2), callbacks=[Stop()]
    )
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    assert any("eval_loss" in h for h in trainer.state.log_history)  # the evaluation ran to its end
    assert [c.name for c in list_checkpoints(tmp_path / "out")] == ["checkpoint-2"]
    # Resumed, it has nothing left to run: the epoch end is done (evaluated once, not again).
    resumed = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), prompts_dataset(2))
    resumed.train(resume_from_checkpoint=True)
    assert sum("eval_loss" in h for h in resumed.state.log_history) == 1

    # A signal during the last rollout stopped the run before that epoch end, and its resume, at the last step, never
    # ran it (no evaluation, and no checkpoint from save_strategy="epoch"): it runs when resumed.
    class StopAtTheEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    args = config(tmp_path / "last", max_steps=2, eval_strategy="epoch", save_strategy="epoch", **evaluated)
    stopped = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), prompts_dataset(2), callbacks=[StopAtTheEnd()]
    )
    with pytest.raises(TrainingInterrupted):
        stopped.train()
    assert not any("eval_loss" in h for h in stopped.state.log_history)
    resumed = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), prompts_dataset(2))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2 and any("eval_loss" in h for h in resumed.state.log_history)
    # Under save_strategy="steps" the resume that runs it saves nothing: the checkpoint it resumed from records it,
    # else every later resume from it (a requeued job's) ran that epoch end and its evaluation again.
    args = config(tmp_path / "steps", max_steps=2, eval_strategy="epoch", save_strategy="steps", save_steps=1)
    stopped = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), prompts_dataset(2), callbacks=[StopAtTheEnd()]
    )
    with pytest.raises(TrainingInterrupted):
        stopped.train()

    class Evaluations(TrainerCallback):
        count = 0

        def on_evaluate(self, args, state, control, **kwargs):
            Evaluations.count += 1

    for evaluations in (1, 0):
        Evaluations.count = 0
        resumed = VAPOTrainer(
            str(tiny_model_dir),
            digit_fraction,
            args,
            prompts_dataset(32),
            prompts_dataset(2),
            callbacks=[Evaluations()],
        )
        resumed.train(resume_from_checkpoint=True)
        assert Evaluations.count == evaluations
        # (the second's history is the checkpoint's, which the first's epoch end rewrote with its evaluation)
        assert sum("eval_loss" in h for h in resumed.state.log_history) == 1

    # A run that ended whole, its last checkpoint written by the save strategy before that epoch end: its resume has
    # nothing to run (its record says the epoch end ran).
    class EpochEnds(TrainerCallback):
        ends = 0

        def on_epoch_end(self, args, state, control, **kwargs):
            EpochEnds.ends += 1

    args = config(
        tmp_path / "whole", max_steps=2, eval_strategy="epoch", save_strategy="steps", save_steps=1, **evaluated
    )
    VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), prompts_dataset(2)).train()
    again = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), prompts_dataset(2), callbacks=[EpochEnds()]
    )
    again.train(resume_from_checkpoint=True)
    assert EpochEnds.ends == 0


def test_a_stop_signal_logs_the_steps_since_the_last_log_and_ends_the_callbacks_run(tiny_model_dir, tmp_path):
    """With `logging_steps` > 1, the steps since the last log were dropped by a stop signal (their metrics never
    reached the history, the checkpoint or the trackers), and `on_train_end` never ran: TensorBoard's writer, which
    flushes every two minutes, was never closed. transformers' own stop on SIGTERM ends its loop, with both."""
    from trl_vapo.signals import TrainingInterrupted

    class StopAtStepTwo(TrainerCallback):
        ended = 0

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_train_end(self, args, state, control, **kwargs):
            StopAtStepTwo.ended += 1

    args = config(tmp_path, max_steps=4, logging_steps=3, save_strategy="no")
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), callbacks=[StopAtStepTwo()])
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    [logged] = [h for h in trainer.state.log_history if "reward" in h]
    assert logged["step"] == 2 and StopAtStepTwo.ended == 1
    saved = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert [h["step"] for h in saved["log_history"] if "reward" in h] == [2]


def test_torch_empty_cache_steps_empties_the_device_cache_every_n_steps(tiny_model_dir, tmp_path, monkeypatch):
    """`torch_empty_cache_steps`, ignored before (the trainer runs its own loop, not transformers' training step). The
    cache it empties is the GPU allocator's, which this machine has not: the call is counted here, around the real
    function, and the GPU's effect is transformers' own."""
    from trl_vapo import trainer as trainer_module

    emptied, real = [], trainer_module.clear_device_cache

    def counted(*args, **kwargs):
        emptied.append(run.state.global_step)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "clear_device_cache", counted)
    args = config(tmp_path, max_steps=4, torch_empty_cache_steps=2)
    run = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    run.train()
    assert emptied == [1, 3]  # during steps 2 and 4 (global_step counts the steps done)


def test_a_checkpoint_is_on_the_disk_before_it_is_published(tmp_path, monkeypatch):
    """Every file and folder of a checkpoint is fsynced before the rename that makes it complete, and the rename's
    folder after it: a power loss cannot leave a published checkpoint with zero-byte files."""
    from trl_vapo import checkpoint

    tmp, final = tmp_path / ".checkpoint-3.tmp", tmp_path / "checkpoint-3"
    (tmp / "critic").mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "critic/model.safetensors", "vapo_state.json"):
        (tmp / name).write_bytes(b"x")
    synced, real = [], os.fsync

    def recording(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), final.exists()))
        real(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", recording)
    checkpoint.publish(tmp, final)
    before = {path for path, published in synced if not published}
    assert {str(tmp / n) for n in ("model.safetensors", "optimizer.pt", "critic/model.safetensors")} <= before
    assert {str(tmp), str(tmp / "critic")} <= before
    assert (str(tmp_path), True) in synced and final.is_dir()

    def files_only(fd):  # a file system that cannot flush a folder: the checkpoint is published all the same
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", files_only)
    shutil.copytree(final, tmp)
    checkpoint.publish(tmp, tmp_path / "checkpoint-4")
    assert (tmp_path / "checkpoint-4" / "vapo_state.json").is_file() and not tmp.exists()


def test_an_adapter_trained_on_a_repositorys_subfolder_loads_back(tiny_model_dir, tmp_path):
    """A base loaded from a local repository's subfolder (`model_init_kwargs={"subfolder": "sft"}`): the saved
    adapter named the repository's root as its base (transformers leaves the subfolder out of `name_or_path`), and
    did not load back."""
    from peft import AutoPeftModelForCausalLM, LoraConfig

    shutil.copytree(tiny_model_dir, tmp_path / "repo" / "sft")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = config(tmp_path, model_init_kwargs={"subfolder": "sft"})
    trainer = VAPOTrainer(str(tmp_path / "repo"), digit_fraction, args, prompts_dataset(32), peft_config=lora)
    trainer.save_model(str(tmp_path / "adapter"))
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    assert loaded.peft_config["default"].base_model_name_or_path == str((tmp_path / "repo" / "sft").resolve())
    # The adapter itself in a subfolder (a checkpoint in a repository of runs) trains on: its base was looked for in
    # the adapter's subfolder too (`AutoPeftModel` hands that option to the base's `from_pretrained`).
    shutil.copytree(tmp_path / "adapter", tmp_path / "runs" / "checkpoint-5")
    again = config(tmp_path / "again", model_init_kwargs={"subfolder": "checkpoint-5"})
    resumed = VAPOTrainer(str(tmp_path / "runs"), digit_fraction, again, prompts_dataset(32))
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    state = resumed.actor_critic.policy.state_dict()
    assert saved and all(
        torch.equal(state[name.replace(".weight", ".default.weight")], v) for name, v in saved.items()
    )
    assert any(p.requires_grad for n, p in resumed.actor_critic.policy.named_parameters() if ".default." in n)


def test_a_full_model_saved_where_an_adapter_was_leaves_no_adapter_to_load_instead(tiny_model_dir, tmp_path):
    """A full fine-tune saved into the folder of an earlier LoRA save: the adapter's files go, or `from_pretrained`
    (and `trl-vapo eval`) would load the adapter on its base instead of the model this run trained. An adapter saved
    over full weights leaves them (its config says what loads; the folder may hold the base model itself)."""
    from peft import LoraConfig

    final = tmp_path / "final"
    full = VAPOTrainer(str(tiny_model_dir), digit_fraction, config(tmp_path / "a"), prompts_dataset(32))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    adapter = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, config(tmp_path / "b"), prompts_dataset(32), peft_config=lora
    )
    full.save_model(str(final))
    adapter.save_model(str(final))
    names = {p.name for p in final.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "model.safetensors"} <= names
    full.save_model(str(final))
    names = {p.name for p in final.iterdir()}
    assert "model.safetensors" in names and not {"adapter_config.json", "adapter_model.safetensors"} & names
    # Full weights saved over full weights sharded otherwise: the earlier shards go, or they would be pushed along
    # (and an earlier whole file beside new shards is what `from_pretrained` loads).
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (final / name).write_text("an earlier save's")
    full.save_model(str(final))
    names = {p.name for p in final.iterdir()}
    assert (
        "model.safetensors" in names
        and not {"model-00001-of-00002.safetensors", "model.safetensors.index.json"} & names
    )

    # A run with a frozen value function saves no critic: an earlier save's would stay beside its policy (and be
    # pushed with it), though its card names none.
    def zero(input_ids, attention_mask, completion_length):
        return torch.zeros(len(input_ids), completion_length)

    frozen = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, config(tmp_path / "c"), prompts_dataset(32), value_model=zero
    )
    assert (final / "critic").is_dir()
    frozen.save_model(str(final))
    assert (final / "model.safetensors").is_file() and not (final / "critic").exists()


def test_save_model_on_a_full_disk_leaves_the_folder_as_it_was(tiny_model_dir, tmp_path, monkeypatch):
    """The critic and the tokenizer are written beside the folder with the policy and moved in together: a disk that
    fills up mid-save leaves no policy without its critic or tokenizer, and the error propagates."""
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path),
        train_dataset=prompts_dataset(32),
    )
    final = tmp_path / "final"

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer.processing_class, "save_pretrained", disk_full)  # after the policy and the critic
    with pytest.raises(OSError, match="No space left"):
        trainer.save_model(str(final))
    assert not final.exists() and not list(tmp_path.glob(".final*"))
    monkeypatch.undo()
    trainer.save_model(str(final))
    assert {"model.safetensors", "critic", "tokenizer_config.json", "README.md"} <= {p.name for p in final.iterdir()}
    here = tmp_path / "here"  # `save_model(".")`: a folder with no name of its own in the path given
    here.mkdir()
    monkeypatch.chdir(here)
    trainer.save_model(".")
    assert (here / "model.safetensors").is_file() and (here / "critic").is_dir()

    # A folder that is a mount point: its parent is another file system, where no file can be renamed into it.
    # (A stand-in for the mount, which a test cannot make: os.replace fails across it as the kernel would, EXDEV.)
    from trl_vapo import checkpoint

    mount, rename = tmp_path / "mount", os.replace
    mount.mkdir()

    def across_the_mount(src, dst, *args, **kwargs):
        if (Path(dst).resolve().is_relative_to(mount)) != (Path(src).resolve().is_relative_to(mount)):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(checkpoint.os, "replace", across_the_mount)
    trainer.save_model(str(mount))
    assert (mount / "model.safetensors").is_file() and not list(mount.glob(".save_model*"))


def test_a_resume_from_an_older_checkpoint_warns_of_the_newer_ones(tiny_model_dir, two_checkpoints, tmp_path, caplog):
    """Going back to checkpoint-1 while checkpoint-2 (another course) is there: the run warns that a later
    `resume_from_checkpoint=True` would take checkpoint-2 until this run writes over it. Not where checkpoint-2 does
    not read: `resume_from_checkpoint=True` passes over it (the warning named it as the one it would take)."""
    out = tmp_path / "out"
    for damaged in (False, True):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(two_checkpoints, out)
        if damaged:
            (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
        caplog.clear()
        trainer = VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=config(tmp_path, max_steps=1),
            train_dataset=prompts_dataset(32),
        )
        with caplog.at_level(logging.WARNING):
            trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
        for said in (
            "Resuming from checkpoint-1 while",
            "newer checkpoints of another course: checkpoint-2",
            "resume_from_checkpoint=True would take checkpoint-2",
        ):
            assert (said in caplog.text) is not damaged, (said, damaged)
    # From a copy elsewhere, into the folder that holds checkpoint-2: said all the same (it read the copy's folder).
    shutil.copytree(two_checkpoints / "checkpoint-1", tmp_path / "copy" / "checkpoint-1")
    (out / "checkpoint-2" / "trainer_state.json").write_text(
        (two_checkpoints / "checkpoint-2" / "trainer_state.json").read_text()
    )
    caplog.clear()
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, config(tmp_path, max_steps=1), prompts_dataset(32))
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=str(tmp_path / "copy" / "checkpoint-1"))
    assert f"while {out} holds newer checkpoints of another course: checkpoint-2" in caplog.text


def test_a_resume_with_changed_rates_trains_at_them_and_its_config_says_so(tiny_model_dir, two_checkpoints, tmp_path):
    """Learning rates, weight decay and the schedule given at resume take effect from the next step (they were
    silently the saved run's while the new checkpoints' config named the new ones); the step count and the actor's
    start stay the saved run's. The settings a resume cannot change are refused by name (test above)."""
    out = tmp_path / "out"
    shutil.copytree(two_checkpoints, out)
    shutil.rmtree(out / "checkpoint-2")
    tiny = json.loads((out / "checkpoint-1" / "vapo_config.json").read_text())
    assert tiny["learning_rate"] == 1e-3
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(
            tmp_path,
            save_strategy="steps",
            save_steps=1,
            learning_rate=5e-5,
            critic_learning_rate=2e-4,
            weight_decay=0.05,
            lr_scheduler_type="constant",
        ),
        train_dataset=prompts_dataset(32),
    )
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    step2 = next(h for h in trainer.state.log_history if h.get("step") == 2 and "phase" in h)
    assert step2["learning_rate"] == 5e-5 and step2["critic_learning_rate"] == 2e-4
    groups = trainer.optimizer.param_groups
    assert {g["name"]: g["lr"] for g in groups} == {"policy": 5e-5, "critic": 2e-4}
    assert {g["weight_decay"] for g in groups} == {0.05, 0.0}
    saved = json.loads((out / "checkpoint-2" / "vapo_config.json").read_text())
    assert saved["learning_rate"] == 5e-5 and saved["critic_learning_rate"] == 2e-4


def test_a_checkpoint_that_cannot_be_written_names_itself_the_free_space_and_what_is_intact(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A full disk during `torch.save` reads "inline_container.cc ... unexpected pos" from torch: the error names
    the checkpoint, the space left and the checkpoints intact, and the half-written folder is removed."""
    real_save = torch.save

    def disk_full_at_the_second_checkpoint(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 3136 vs 3024")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_the_second_checkpoint)
    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=digit_fraction,
        args=config(tmp_path, save_strategy="steps", save_steps=1),
        train_dataset=prompts_dataset(32),
    )
    out = tmp_path / "out"
    with pytest.raises(
        OSError, match=r"Writing checkpoint-2 in .*out failed \(\[enforce fail at inline_container"
    ) as raised:
        trainer.train()
    assert "GiB are free there: a full disk? The checkpoints written before (checkpoint-1) are intact" in str(
        raised.value
    )
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-1"] and not list(out.glob(".checkpoint-2.*"))


def test_checkpoints_that_would_fill_the_disk_are_said_at_the_first(tiny_model_dir, tmp_path, caplog):
    """transformers keeps every checkpoint by default: a long run filled the disk hours in, and failed there. The
    first checkpoint's size times the saves to come, against the disk's real free space: a run planned long enough
    (10^12 steps, a checkpoint each) needs more than any disk here has; save_total_limit bounds it."""

    class StopAtTheFirstSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = True

    for limit, said in ((None, True), (2, False)):
        caplog.clear()
        args = config(tmp_path / str(limit), save_strategy="steps", save_steps=1, save_total_limit=limit)
        args.max_steps = 10**12
        trainer = VAPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=digit_fraction,
            args=args,
            train_dataset=prompts_dataset(32),
            callbacks=[StopAtTheFirstSave()],
        )
        with caplog.at_level(logging.WARNING, logger="trl_vapo.checkpoint"):
            trainer.train()
        warned = [r.getMessage() for r in caplog.records if "checkpoints still to come" in r.getMessage()]
        assert bool(warned) == said, warned
        if said:
            assert re.search(
                r"checkpoint-1 takes [\d,]+ MiB, and the 999,999,999,999 checkpoints still to come \(all kept: "
                r"save_total_limit is unset\) need about [\d,.]+ GiB where [\d,.]+ [GM]iB are free .*: the disk would "
                r"fill mid-run\. Set save_total_limit",
                warned[0],
            )


def test_a_weights_file_that_cannot_be_written_is_named_as_a_full_disk(tmp_path):
    """Every weights file (policy, critic, reference, random state) is safetensors', whose full disk raises
    `SafetensorError`, an `Exception`: it went past the handling as a bare traceback, the half-written folder left.
    The real writer under a real file-size limit (a quota's EFBIG, as a full disk's ENOSPC)."""
    import resource

    from safetensors.torch import save_file

    from trl_vapo.checkpoint import write_errors_named

    final, tmp = tmp_path / "checkpoint-2", tmp_path / ".checkpoint-2.me.tmp"
    tmp.mkdir()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, not the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        with pytest.raises(
            OSError, match=r"Writing checkpoint-2 in .* failed \(Error while serializing: I/O error.*full disk"
        ):
            with write_errors_named(final, tmp):
                save_file({"w": torch.zeros(4096)}, str(tmp / "model.safetensors"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    assert not tmp.exists()
    # Its "I/O error" is also a folder that is not there (a node whose output_dir is not the main process's): not
    # called a full disk.
    with pytest.raises(
        OSError, match=r"\(os error 2\) at path .*\); the checkpoints written before \(none\) are intact"
    ):
        with write_errors_named(final, tmp):
            save_file({"w": torch.zeros(4)}, str(tmp / "model.safetensors"))


def test_a_checkpoint_write_refused_for_another_reason_than_space_is_not_called_a_full_disk(tmp_path):
    """Every OSError was reported as "a full disk? ... Free some space": a folder this process may not write (an
    output_dir another user made), a lost mount. Named as it is; the half-written folder still goes."""
    from trl_vapo.checkpoint import write_errors_named

    final, tmp = tmp_path / "checkpoint-2", tmp_path / ".checkpoint-2.me.tmp"
    tmp.mkdir()
    with pytest.raises(OSError) as raised:
        with write_errors_named(final, tmp):
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp / "optimizer.pt"))
    said = str(raised.value)
    assert said.startswith("Writing checkpoint-2 in") and "Permission denied" in said and "full disk" not in said
    assert "Make the folder writable by this process, then resume with resume_from_checkpoint=True." in said
    assert not tmp.exists()


def test_a_data_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    from trl_vapo.data import _load

    data = tmp_path / "prompts.jsonl"
    data.write_bytes(b'{"prompt": "1+1="}\n{"prompt": "2+2="}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{data}, line 3: byte 0xe9 at column 16 is not UTF-8"):
        _load(str(data), "train", None)


def test_a_hub_data_set_in_datasets_cache_is_not_refused_when_the_hub_is_unreachable(tmp_path, monkeypatch):
    """Offline without HF_HUB_OFFLINE, `datasets` falls back to the data set it prepared before: the probe that
    refuses an unreachable Hub at once must let exactly those through. The cache is the one `datasets` writes
    (a real JSON builder's arrow files, moved to where `load_dataset("Owner/MathSet")` leaves them:
    namespace___snake_cased_name/config/version/commit), and `datasets`' own fallback is the judge."""
    import datasets
    from datasets.load import CachedDatasetModuleFactory
    from datasets.packaged_modules.json.json import Json
    from huggingface_hub import constants

    from trl_vapo.data import _check_hub_reachable

    cache = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    builder = Json(data_files={"train": str(rows)}, dataset_name="MathSet", hash="0123abcd", cache_dir=str(cache))
    builder.download_and_prepare()
    (cache / "math_set").rename(cache / "Owner___math_set")

    for name, cached in (("Owner/MathSet", True), ("Owner/MathSets", False), ("MathSet", False)):
        try:
            CachedDatasetModuleFactory(name, cache_dir=str(cache)).get_module()
            assert cached, f"datasets reads {name} from its cache"
        except FileNotFoundError:
            assert not cached, f"datasets finds no {name} in its cache"
        if cached:
            _check_hub_reachable(name)
        else:
            with pytest.raises(ConnectionError, match=f"Dataset {name} is not a local file .* Hub cannot be reached"):
                _check_hub_reachable(name)


def test_empty_prompts_are_named_in_a_warning_and_chat_prompts_with_nothing_to_answer_refused(tmp_path, caplog):
    from trl_vapo.data import check_train_dataset

    rows = prompts_dataset(n=8).to_list()
    rows[2]["prompt"] = rows[5]["prompt"] = ""
    with caplog.at_level(logging.WARNING, logger="trl_vapo.data"):
        check_train_dataset(Dataset.from_list(rows), config(tmp_path))
    assert "train_dataset has 2 empty prompt(s) (rows [2, 5])" in caplog.text
    # Chat prompts with no message to reply to (none, or a system message alone: `messages[:-1]` of a conversation
    # that is one assistant turn) are refused: the chat template raised an IndexError in the rollout that drew one.
    chat = [{"prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    chat[3]["prompt"], chat[6]["prompt"] = [], [{"role": "system", "content": "Be brief."}]
    chat[7]["prompt"] = [*chat[7]["prompt"], {"role": "developer", "content": "Be brief."}]  # TRL refuses it last
    with pytest.raises(ValueError, match=r"3 chat prompt\(s\) with no message to reply to \(rows \[3, 6, 7\]; the fi"):
        check_train_dataset(Dataset.from_list(chat), config(tmp_path))
    # Lists that are not chat messages (ShareGPT's 'from'/'value'): they were told "no message to reply to", whose
    # filter then raised KeyError: 'role'. And a role the templates do not know ('human') is named.
    share_gpt = [{"prompt": [{"from": "human", "value": row["prompt"]}]} for row in rows]
    with pytest.raises(
        ValueError, match=r"8 prompt\(s\) that are lists but not chat messages .*maybe_convert_to_chatml"
    ):
        check_train_dataset(Dataset.from_list(share_gpt), config(tmp_path))
    # Beside chat rows: Arrow gives every message every key, theirs a 'role' of None.
    mixed = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1="}]}] * 4 + share_gpt[:4])
    assert mixed[4]["prompt"][0]["role"] is None
    with pytest.raises(ValueError, match=r"4 prompt\(s\) that are lists but not chat messages \(rows \[4, 5, 6, 7\]"):
        check_train_dataset(mixed, config(tmp_path))
    converted = [{"prompt": [{"role": "human", "content": m[0]["value"]}]} for m in (r["prompt"] for r in share_gpt)]
    with pytest.raises(ValueError, match=r"8 chat prompt\(s\) .* the first's last role is 'human'\): no message"):
        check_train_dataset(Dataset.from_list(converted), config(tmp_path))
    # A prompt ending with an assistant message is continued (a prefill), where GRPOTrainer opens a new turn: said.
    prefilled = [{"prompt": [*row["prompt"], {"role": "assistant", "content": "It is"}]} for row in chat[:2]]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_vapo.data"):
        check_train_dataset(Dataset.from_list(prefilled + chat[:1] * 6), config(tmp_path))
    assert "train_dataset has 2 chat prompt(s) ending with an assistant message (rows [0, 1])" in caplog.text


def test_rows_without_a_prompt_are_refused_and_every_data_set_is_checked_as_the_train_set(
    tiny_model_dir, tmp_path, caplog
):
    """A JSON-lines row without the 'prompt' key reads as None: it was warned as an "empty prompt" and then crashed
    the rollout that drew it in the tokenizer. Eval sets, streams and `evaluate_policy` had fewer checks than the
    train set: a bare KeyError for a missing column, an AttributeError for a stream, a chat prompt with nothing to
    reply to failing in the chat template at the first evaluation."""
    from datasets import IterableDataset
    from transformers import AutoModelForCausalLM

    from trl_vapo.data import check_eval_dataset, check_train_dataset
    from trl_vapo.evaluation import evaluate_policy

    rows = prompts_dataset(n=8).to_list()
    rows[4]["prompt"] = None
    with pytest.raises(ValueError, match=r"train_dataset has 1 row\(s\) without a prompt \(rows \[4\]: None"):
        check_train_dataset(Dataset.from_list(rows), config(tmp_path))
    with pytest.raises(ValueError, match=r"eval_dataset has 1 row\(s\) without a prompt"):
        check_eval_dataset(Dataset.from_list(rows), config(tmp_path))
    system_only = [{"prompt": [{"role": "system", "content": "Be brief."}], "answer": "1"}]
    with pytest.raises(ValueError, match=r"eval_dataset\['test'\] has 1 chat prompt\(s\) with no message to reply"):
        check_eval_dataset({"test": Dataset.from_list(system_only)}, config(tmp_path))
    stream = IterableDataset.from_generator(lambda: iter(system_only))
    with pytest.raises(ValueError, match=r"train_dataset has 1 chat prompt\(s\) with no message to reply"):
        check_train_dataset(stream, config(tmp_path, max_steps=1))
    with pytest.raises(ValueError, match=r"eval_dataset has 1 chat prompt\(s\) with no message to reply"):
        check_eval_dataset(stream, config(tmp_path))

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    with pytest.raises(ValueError, match=r"The data set to evaluate on has 1 row\(s\) without a prompt"):
        evaluate_policy(model, tokenizer, Dataset.from_list(rows), make_math_reward(), k=1, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"has no 'prompt' column; its columns are \['answer', 'question'\]"):
        evaluate_policy(model, tokenizer, Dataset.from_list([{"question": "1+1=", "answer": "2"}]), make_math_reward())
    # A stream's later rows, as each rollout reads them: the whole rollout's, on every process alike (one process that
    # raised on its share left the others waiting); it was the tokenizer's error, on the process that held the row.
    # The steps trained before are written as a checkpoint first (they were lost since the last one), as a stop
    # signal's are, and said (logged, and in the error's note where Python has notes); the resume from it reads on
    # after the rollout the check refused.
    later = prompts_dataset(n=16).to_list()
    later[5]["prompt"] = None
    stream = IterableDataset.from_generator(lambda: iter(later))
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, config(tmp_path, max_steps=6, shuffle_dataset=False), stream
    )
    with pytest.raises(ValueError) as refused, caplog.at_level(logging.WARNING):
        trainer.train()
    found = re.match(
        r"train_dataset \(the rollout read from the stream at step (\d+)\) has 1 row\(s\) without a prompt",
        str(refused.value),
    )
    step = int(found.group(1))
    checkpoint = tmp_path / "out" / f"checkpoint-{step}"
    assert step > 0 and (checkpoint / "vapo_state.json").is_file()
    said = f"{checkpoint} holds the {step} steps so far: {RESUME}; a resume reads on after this rollout's prompts"
    assert said in caplog.text and (sys.version_info < (3, 11) or said in "".join(refused.value.__notes__))
    resumed = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, config(tmp_path, max_steps=step + 1, shuffle_dataset=False), stream
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == step + 1
    # An empty prompt, which a tokenizer that adds no token (Qwen's; this one's too) cannot sample from: refused as
    # the rollout reads it, the steps so far written first (refused in the rollout, they were lost).
    later[5]["prompt"] = ""
    trainer = VAPOTrainer(
        str(tiny_model_dir), digit_fraction, config(tmp_path / "empty", max_steps=6, shuffle_dataset=False), stream
    )
    assert trainer.processing_class("")["input_ids"] == []
    caplog.clear()
    with pytest.raises(ValueError, match="A prompt has no token: ''"), caplog.at_level(logging.WARNING):
        trainer.train()
    assert re.search(r"checkpoint-[1-9]\d* holds the [1-9]\d* steps so far", caplog.text)
    later[5]["prompt"] = None
    # Its long prompts dropped as they come: the filter read the row first, and the tokenizer failed on it. The row
    # is read again by a resume, as the error says.
    dropping = config(
        tmp_path / "dropping", max_steps=100, max_prompt_length=10, drop_long_prompts=True, shuffle_dataset=False
    )  # (a shuffle buffer reads the whole stream before the first rollout)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, dropping, stream)
    caplog.clear()
    with pytest.raises(ValueError) as refused, caplog.at_level(logging.WARNING):
        trainer.train()
    assert re.match(
        r"train_dataset \(a row read from the stream\) has 1 row\(s\) without a prompt", str(refused.value)
    )
    assert re.search(
        r"checkpoint-\d+ holds the \d+ steps so far: resume with .*; a resume reads this rollout's prompts again: "
        r"mend",
        caplog.text,
    )
    # A stream is evaluated as a data set of its rows.
    good = IterableDataset.from_generator(lambda: iter(prompts_dataset(n=2).to_list()))
    assert evaluate_policy(model, tokenizer, good, make_math_reward(), k=1, max_new_tokens=2).num_problems == 2


def test_an_evaluation_that_fails_mid_run_leaves_the_steps_trained_in_a_checkpoint(tiny_model_dir, tmp_path, caplog):
    """An evaluation runs at a rollout's end, before that step's checkpoint: an error in it (a streamed held-out row
    refused, a reward function's on the held-out rows) stopped the run, every step since the last checkpoint lost. On
    one process they are written first, and the checkpoint is named (logged, and in the error's note)."""
    from datasets import IterableDataset

    held_out = prompts_dataset(n=4).to_list()
    held_out[3]["prompt"] = None  # in the second batch (2 prompts each) of the evaluation at step 2
    stream = IterableDataset.from_generator(lambda: iter(held_out))
    args = config(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=3)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), eval_dataset=stream)
    with pytest.raises(ValueError, match=r"eval_dataset \(a batch read from the stream\) has 1 row\(s\)") as refused:
        with caplog.at_level(logging.WARNING):
            trainer.train()
    assert_steps_so_far_in_a_checkpoint(tmp_path / "out", 2, refused.value, caplog.text)


def assert_steps_so_far_in_a_checkpoint(out: Path, step: int, error: BaseException, log: str, then: str = "") -> Path:
    """A run an error stopped wrote its steps so far as `checkpoint-<step>`, its only one, named in the log and in
    the error's note (with `then`: what a resume reads)."""
    checkpoint = out / f"checkpoint-{step}"
    said = f"{checkpoint} holds the {step} steps so far: {RESUME}{then}."
    assert said in log and (sys.version_info < (3, 11) or error.__notes__ == [said])  # (3.10 has no notes)
    assert list_checkpoints(out) == [checkpoint] and (checkpoint / "vapo_state.json").is_file()
    return checkpoint


def test_a_reward_function_that_fails_mid_run_leaves_the_steps_trained_in_a_checkpoint(
    tiny_model_dir, tmp_path, caplog
):
    """A reward function that raises on a rollout (a judge's timeout, a parser that meets odd output) stopped the run
    with every step since the last checkpoint lost (transformers' default `save_steps` is 500). On one process they
    are written first, named in the log and the error's note, and the run resumes from them."""
    calls = []

    def fails_on_the_third_rollout(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) > 3:  # (the first call is the check of the empty completions when the trainer is built)
            raise ConnectionError("the judge timed out")
        return digit_fraction(completions, **kwargs)

    args = config(tmp_path, max_steps=4, save_strategy="steps", save_steps=100)
    trainer = VAPOTrainer(str(tiny_model_dir), fails_on_the_third_rollout, args, prompts_dataset())
    with pytest.raises(RuntimeError, match="raised ConnectionError: the judge timed out -- first failing") as failed:
        with caplog.at_level(logging.WARNING):
            trainer.train()
    # What a resume reads is said too: on after the failed rollout's prompts, which the checkpoint's position is past
    # (where a checkpoint of this step was written before them, they are read again, and that is said).
    then = "; a resume reads on after this rollout's prompts (they are left out)"
    checkpoint = assert_steps_so_far_in_a_checkpoint(tmp_path / "out", 2, failed.value, caplog.text, then)
    resumed = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset())
    assert resumed.train(resume_from_checkpoint=str(checkpoint)).global_step == 4


def test_kill_9_while_writing_a_checkpoint_leaves_the_previous_one_complete(tiny_model_dir, tmp_path, reference_run):
    out = tmp_path / "stalled"
    process = start_script(tiny_model_dir, out, "--stall-at", "4")
    deadline = time.time() + 240
    while not (out / "stalled").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert (out / "stalled").exists(), "the run never reached checkpoint 4"
    # A second run in the same output_dir (a launch twice, a resume started while the run goes on) is refused by
    # name: it would overwrite the first run's checkpoints, saved model and logs.
    second = run_script("--model", str(tiny_model_dir), "--output-dir", str(out), *LONG_RUN, "--log-name", "second")
    assert second.returncode != 0 and not read_logs(out, name="second")
    assert f"Another run is writing to {out}: PID {process.pid} on {socket.gethostname()}" in second.stderr
    process.send_signal(signal.SIGKILL)
    process.wait()
    # Its half-written folder is named for it (host and PID): no other run could have removed it mid-write.
    assert (out / f".checkpoint-4.{socket.gethostname()}-{process.pid}.tmp").is_dir()
    assert not (out / "checkpoint-4").exists()
    assert json.loads((out / ".vapo_run.lock").read_text())["pid"] == process.pid  # a killed run leaves its lock
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-2"]
    result = run_script(
        "--model", str(tiny_model_dir), "--output-dir", str(out), *LONG_RUN, "--resume", "--log-name", "resumed"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Taking over the lock of a run that is gone" in result.stderr  # its process is gone: a stale lock
    assert not (out / ".vapo_run.lock").exists()  # released when the run ended
    logs = step_logs(read_logs(out, name="resumed"))
    assert sorted(logs) == list(range(3, max(reference_run) + 1))
    for step in logs:
        assert_same_log(logs[step], reference_run[step], context=f"step {step}")
    assert not list(out.glob(".checkpoint-*"))  # the next run, holding the lock, removed the debris


def test_reward_worker_that_hangs_or_dies_does_not_stop_training(tiny_model_dir, tmp_path):
    """math-verify hangs on a power tower and a worker gets SIGKILLed between steps: every batch is still scored."""
    reward = make_math_reward(timeout=1.0, num_workers=1, name="math_reward")
    pool = reward.pool

    def math_with_a_power_tower(completions, answer, **kwargs):
        # The first completion of every batch is a power tower math-verify cannot finish; the rest box their prompt.
        boxed = ["\\boxed{9^{9^{9^{9}}}}"] + [f"\\boxed{{\\frac{{{a}}}{{2}}}}" for a in answer[1:]]
        return reward(completions=boxed, answer=[f"\\frac{{{a}}}{{2}}" for a in answer], **kwargs)

    class KillWorkers(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            for pid in pool.worker_pids():
                os.kill(pid, signal.SIGKILL)

    trainer = VAPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=math_with_a_power_tower,
        args=config(tmp_path, max_steps=2),  # the workers killed after step 1: step 2 is the replacements'
        train_dataset=prompts_dataset(32),
        callbacks=[KillWorkers()],
    )
    started = time.time()
    trainer.train()
    assert trainer.state.global_step == 2
    logs = [h for h in trainer.state.log_history if "reward" in h]
    # 7 of 8 completions per batch are right (+1), the power tower is wrong (-1): mean 0.75, every batch scored.
    assert [h["reward"] for h in logs] == [0.75, 0.75]
    assert time.time() - started < 60


# ---------------------------------------------------------------------------------------------------------------------
# Two processes agree with one
# ---------------------------------------------------------------------------------------------------------------------


def printed_prompts(stdout: str) -> dict[str, set[str]]:
    """The prompts (`12+15=`) in each printed completions table (`log_completions`), by the table's title."""
    tables = re.split(r"(Step \d+ \([^)]*\))", stdout)
    return {title: set(re.findall(r"\b\d\d\+\d\d=", body)) for title, body in zip(tables[1::2], tables[2::2])}


def on_two_ranks(*args):
    return run_ranks(*args, processes=2)


COMPARED = [
    "prompts/mean_operands",  # the reward function's log_metric: both processes' calls, averaged
    "reward",
    "reward_std",
    "frac_reward_zero_std",  # each prompt's group whole over the processes' shares
    "accuracy",
    "completions/mean_length",
    "value/mean",
    "value/explained_variance",
    "advantages/mean",
    "loss/value",
    "loss/policy",
    "loss/nll",
    "loss",
    "grad_norm/policy",
    "grad_norm/critic",
    "entropy",
    "approx_kl",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
]


EVALUATED = [
    "eval_reward",
    "eval_reward_std",
    "eval_accuracy",
    "eval_completions/mean_length",
    "eval_value/mean",
    "eval_value/explained_variance",
    "eval_loss",
]


def test_grpos_objective_settings_train_alike_on_two_processes_and_one(tiny_model_dir, tmp_path):
    """GRPOConfig's token filters and reward aggregation read the whole rollout: the top-entropy quantile is pooled
    over the processes, the off-policy mask and the adaptive entropy coefficient read the step's pooled numbers, and
    GDPO's per-function normalisation gathers each prompt's group. Two processes train as one does."""
    settings = {
        "top_entropy_quantile": 0.5,
        "off_policy_mask_threshold": 1e-4,
        "use_adaptive_entropy": True,
        "entropy_coef": 0.01,
        "entropy_target": 100.0,  # above any entropy of this vocabulary: the coefficient rises by delta each step
        "multi_objective_aggregation": "normalize_then_sum",
        # a narrow clip range for the script's second passes (num_iterations 2): GRPO's clip shares' extremes
        "epsilon": 0.02,
        "epsilon_high": 0.02,
    }
    common = ["--model", str(tiny_model_dir), "--greedy", "--max-steps", "3", "--value-pretrain-steps", "1"]
    reward_model = tiny_model_dir.parent / "reward-model"  # (test_distributed's, where both files run)
    if not (reward_model / "config.json").is_file():
        save_tiny_reward_model(reward_model)
    common += ["--reward-model", str(reward_model), "--stop-chars", "0123", "--settings", json.dumps(settings)]
    single = run_script(*common, "--output-dir", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr[-3000:]
    double = on_two_ranks(*common, "--output-dir", str(tmp_path / "two"))
    assert double.returncode == 0, double.stderr[-3000:]
    one, two = step_logs(read_logs(tmp_path / "one")), step_logs(read_logs(tmp_path / "two"))
    assert sorted(one) == sorted(two)
    rl = [step for step in one if one[step]["phase"] == "rl"]
    assert [one[step]["entropy_coef"] for step in rl] == pytest.approx([0.015, 0.02, 0.025])
    assert any(one[step]["clip_ratio/low_min"] > 0 for step in rl)  # a second pass clipped every sequence some
    keys = [*COMPARED, "entropy_coef", "loss/entropy_bonus"]
    assert_logged(one, keys)
    for step in one:
        assert_same_log(two[step], one[step], keys=keys, rel=1e-4, context=f"step {step}, 2 vs 1 process")


def test_ddp_without_unused_parameter_detection_is_refused_before_value_pretraining(tiny_model_dir, tmp_path):
    """`ddp_find_unused_parameters=False` (GRPO recipes set it for speed) on two processes: value pretraining's
    critic-only forward left the policy's parameters without gradients, and DDP raised at the second step ('Expected
    to have finished reduction in the prior iteration'), the models loaded and a step spent. Refused in the config."""
    settings = json.dumps({"ddp_find_unused_parameters": False})
    run = on_two_ranks("--model", str(tiny_model_dir), "--output-dir", str(tmp_path), "--settings", settings)
    assert run.returncode != 0
    assert "ddp_find_unused_parameters=False on several processes: value pretraining" in run.stderr
    assert "RuntimeError: Expected to have finished" not in run.stderr and not (tmp_path / "checkpoint-2").exists()
    # DDP's static graph, the same contract (the parameters used at every step), declared instead of checked; and
    # PyTorch's static graph fails under `no_sync`, which gradient accumulation uses (its own assert, models loaded).
    settings = json.dumps({"ddp_static_graph": True})
    run = on_two_ranks(
        "--model", str(tiny_model_dir), "--output-dir", str(tmp_path), "--settings", settings, "--grad-accum", "2"
    )
    assert run.returncode != 0 and "ddp_static_graph=True on several processes: DDP's static graph" in run.stderr
    assert "; and gradient_accumulation_steps=2 accumulates under `no_sync`" in run.stderr
    assert "INTERNAL ASSERT FAILED at" not in run.stderr
    # Reentrant checkpointing cannot run with the unused-parameter detection VAPO's DDP needs: the models loaded and
    # the first backward raised ('marked as ready twice').
    reentrant = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    run = on_two_ranks(
        "--model", str(tiny_model_dir), "--output-dir", str(tmp_path), "--settings", json.dumps(reentrant)
    )
    assert run.returncode != 0 and "{'use_reentrant': True} on several processes" in run.stderr
    assert "Expected to mark a variable ready only once" not in run.stderr


def test_a_resume_the_main_process_cannot_choose_stops_every_process_with_its_error(tiny_model_dir, tmp_path):
    """The main process chooses the checkpoint to resume and broadcasts it: an error there other than a ValueError
    (a marker holding JSON null raised AttributeError) left the other process waiting in the broadcast, while the
    main process had raised. Every error now reaches every process, and the main one names the damaged marker."""
    damaged = tmp_path / "checkpoint-2"
    damaged.mkdir(parents=True)
    (damaged / "vapo_state.json").write_text("null")
    run = on_two_ranks("--model", str(tiny_model_dir), "--output-dir", str(tmp_path), "--resume")
    assert run.returncode != 0
    ranks = dict(part.split(" ---\n", 1) for part in run.stderr.split("--- rank ")[1:])
    assert sorted(ranks) == ["0", "1"]
    for rank in ranks.values():
        assert f"but no checkpoint in {tmp_path} can be read" in rank, rank[-2000:]
    assert "vapo_state.json is damaged: a JSON NoneType, not the object a checkpoint writes" in ranks["0"]


def ddp_trains_as_one_process(
    model_dir, out: Path, steps: int, critic_forwards: dict, *flags: str, weights_atol: float = 1e-6
) -> dict:
    """`_train_script.py` with `flags` on one process and under DDP on two (a reward model scoring, so that the
    rewards and returns vary; the models saved from the main process alone, as a script's `if
    trainer.accelerator.is_main_process: trainer.save_model()`), for `steps` steps: both count the critic's forwards
    as `critic_forwards`, and log and train alike (every step's log, both sides' weights after the last step).
    Returns the two-process run's weights."""
    common = ["--model", str(model_dir), "--greedy", "--max-steps", str(steps), "--value-pretrain-steps", "0"]
    common += ["--num-iterations", "1", "--grad-accum", "2", "--dump-state-at", str(steps), "--save-final"]
    common += ["--count-critic-forwards", "--save-steps", "100", *flags]
    reward_model = model_dir.parent / "reward-model"
    if not (reward_model / "config.json").is_file():
        save_tiny_reward_model(reward_model)
    common += ["--reward-model", str(reward_model)]
    single = run_script(*common, "--output-dir", str(out / "one"))
    assert single.returncode == 0, single.stderr[-3000:]
    double = run_ranks(*common, "--output-dir", str(out / "two"), "--save-on-main-only", processes=2, timeout=150)
    assert double.returncode == 0, double.stderr[-3000:]
    for run in ("one", "two"):  # (`critic_forwards` by run where they differ)
        expected = critic_forwards.get(run, critic_forwards)
        assert json.loads((out / run / "steps.json").read_text())["critic_forwards"] == expected, run
    one, two = step_logs(read_logs(out / "one")), step_logs(read_logs(out / "two"))
    assert sorted(one) == sorted(two) == list(range(1, steps + 1))
    # One pass on the weights that sampled: the policy's ratio is 1, its statistics 0 in both runs (compared where
    # they are not: test_grpos_objective_settings_train_alike_on_two_processes_and_one).
    keys = [key for key in COMPARED if key != "approx_kl" and not key.startswith("clip_ratio/")]
    assert_logged(one, keys)
    for step in one:
        assert_same_log(two[step], one[step], keys=keys, rel=1e-4, context=f"step {step}, 2 vs 1 process")
    expected, got = (torch.load(out / run / f"state-{steps}.pt") for run in ("one", "two"))
    assert got.keys() == expected.keys() and any("critic." in key for key in expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=weights_atol, rtol=1e-4, msg=key)
    return got


def test_under_ddp_the_critic_trains_in_the_scoring_pass_and_two_processes_train_as_one(tiny_model_dir, tmp_path):
    """With one optimizer step and one pass per rollout and lam_critic=1 (`_critic_trains_while_scoring`), the
    critic's forward and backward run in the scoring pass under DDP too: its gradients wait under `no_sync` for the
    update's last backward, which reduces them with the policy's though the critic is not in its forward (DDP finds
    unused parameters), with activation checkpointing. Two processes train as one: the weights of both sides after
    the last step, every step's log, and the critic's forwards, one a micro-batch, each with its gradient (the
    update's no-gradient forward of the scoring pass gone). The two-process run saves its model from the main process
    alone (a script's `if trainer.accelerator.is_main_process: trainer.save_model()`), as transformers' save_model
    allows under DDP: it waited in a collective for the other process, here gone ("Connection closed by peer"), and
    saved nothing."""
    # 3 rollouts x 2 micro-batches (16 completions: 2 x 8 on one process, 2 x 4 on each of two)
    forwards = {"with_grad": 6, "without_grad": 0, "with_the_policys": 0}
    got = ddp_trains_as_one_process(
        tiny_model_dir, tmp_path, 3, forwards, "--settings", '{"gradient_checkpointing": true}'
    )
    for side, folder in (("policy", tmp_path / "two" / "final"), ("critic", tmp_path / "two" / "final" / "critic")):
        saved = load_file(folder / "model.safetensors")
        assert saved and all(torch.equal(v, got[f"weight/{side}.{name}"]) for name, v in saved.items()), side


def test_ddps_static_graph_trains_as_one_process(tiny_model_dir, tmp_path):
    """`ddp_static_graph=True` (accepted without value pretraining, extra critic passes or gradient accumulation):
    the critic's backward in the scoring pass, and the update's pass per side, are backwards of a part of the model,
    which the static graph's reducer refuses ('expect_autograd_hooks_ INTERNAL ASSERT FAILED'): one forward and
    backward of both sides a step instead. Two processes train as one."""
    # 2 rollouts x 1 micro-batch: on one process the critic trains in the scoring pass; on two, scored without a
    # gradient, then trained with one, in the policy's pass
    one = {"with_grad": 2, "without_grad": 0, "with_the_policys": 0}
    forwards = {"one": one, "two": {"with_grad": 2, "without_grad": 2, "with_the_policys": 2}}
    settings = '{"ddp_static_graph": true}'
    # The critic's loss summed in another order on each side (its own pass, or the policy's): Adam's division by
    # sqrt(v) + 1e-8 turns the round-off into up to about 1e-5 of a weight (test_distributed's ATOL)
    flags = ("--grad-accum", "1", "--settings", settings)
    ddp_trains_as_one_process(tiny_model_dir, tmp_path, 2, forwards, *flags, weights_atol=5e-5)


def test_under_ddp_the_update_runs_one_pass_per_side_and_two_processes_train_as_one(tiny_model_dir, tmp_path):
    """Where the critic trains in the update (`lam_critic` < 1: its targets read its values), each micro-batch runs a
    pass per side, under DDP as on one process: the policy's activations are gone before the critic's are made (one
    pass for both kept both alive, about 0.4 GB at Qwen2.5-0.5B shapes, 8 x 1,024 tokens). The first pass's backward
    leaves its gradients under `no_sync`, the step's last one reduces them (DDP finds unused parameters): two
    processes train as one."""
    # 2 rollouts x 2 micro-batches, each scored without a gradient and trained with one, the policy apart
    forwards = {"with_grad": 4, "without_grad": 4, "with_the_policys": 0}
    ddp_trains_as_one_process(tiny_model_dir, tmp_path, 2, forwards, "--settings", '{"lam_critic": 0.95}')


def test_two_processes_match_one_with_the_same_global_batch_and_resume(tiny_model_dir, tmp_path):
    common = ["--model", str(tiny_model_dir), "--greedy", "--max-steps", "4", "--value-pretrain-steps", "2"]
    # Evaluated at steps 6 and 8 (every 2 steps after the 4 of value pretraining), each process on its half of the
    # completions: three prompts x 1 in one batch, so that on two processes the first prompt is taken again to split
    # evenly, which every metric must leave out (they counted it twice, but for the accuracy and explained variance).
    # A reward model scores too, so that the rewards and returns vary (greedy completions have no digits).
    common += ["--eval-prompts", "3", "--eval-generations", "1", "--eval-steps", "2"]
    reward_model = tiny_model_dir.parent / "reward-model"  # (test_distributed's, where both files run)
    if not (reward_model / "config.json").is_file():
        save_tiny_reward_model(reward_model)
    common += ["--reward-model", str(reward_model)]
    common += ["--dtype", "bfloat16"]  # trained in float32, saved as loaded
    single = run_script(*common, "--output-dir", str(tmp_path / "one"), "--log-completions")
    assert single.returncode == 0, single.stderr[-3000:]
    double = on_two_ranks(*common, "--output-dir", str(tmp_path / "two"), "--save-final", "--log-completions")
    assert double.returncode == 0, double.stderr[-3000:]
    # The completions table holds the whole rollout, every process's share (it held the main process's alone).
    printed = [printed_prompts(run.stdout) for run in (single, double)]
    assert (
        printed[0] == printed[1] and len(printed[0]) == 4 and {len(p) for p in printed[0].values()} == {4}
    )  # rollouts
    for folder in (tmp_path / "two" / "final", tmp_path / "two" / "final" / "critic"):
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16", folder
        assert {v.dtype for v in load_file(folder / "model.safetensors").values()} == {torch.bfloat16}, folder
    one, two = step_logs(read_logs(tmp_path / "one")), step_logs(read_logs(tmp_path / "two"))
    assert sorted(one) == sorted(two) == list(range(1, 9))
    assert [one[s]["phase"] for s in one] == [two[s]["phase"] for s in two] == ["value_pretrain"] * 4 + ["rl"] * 4
    assert_logged(one, COMPARED)
    for step in one:
        assert_same_log(two[step], one[step], keys=COMPARED, rel=1e-4, context=f"step {step}, 2 vs 1 process")
    one_eval, two_eval = (
        {h["step"]: h for h in read_logs(tmp_path / run) if "eval_loss" in h} for run in ("one", "two")
    )
    assert sorted(one_eval) == sorted(two_eval) == [6, 8]
    for step in one_eval:
        assert not math.isnan(one_eval[step]["eval_value/explained_variance"])
        assert_same_log(two_eval[step], one_eval[step], keys=EVALUATED, rel=1e-4, context=f"eval at step {step}")

    # Checkpoints are written once, with one random-number state per process, and resume on two processes.
    checkpoint = tmp_path / "two" / "checkpoint-4"
    assert sorted(p.name for p in checkpoint.glob("training_state/rng_state_*")) == [
        "rng_state_0.safetensors",
        "rng_state_1.safetensors",
    ]
    assert [c.name for c in list_checkpoints(tmp_path / "two")] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8",
    ]
    for stale in ("checkpoint-6", "checkpoint-8"):
        __import__("shutil").rmtree(tmp_path / "two" / stale)
    resumed = on_two_ranks(*common, "--output-dir", str(tmp_path / "two"), "--resume", "--log-name", "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = step_logs(read_logs(tmp_path / "two", name="resumed"))
    assert sorted(again) == [5, 6, 7, 8]
    # Each process knows its rank after the resume too (the saved state is rank 0's: both logged as the main one).
    for rank in (0, 1):
        assert {h["world_zero"] for h in read_logs(tmp_path / "two", rank, "resumed")} == {rank == 0}, rank
    for step in again:
        assert_same_log(again[step], two[step], context=f"step {step}, resumed on 2 processes")


def test_the_schedulers_last_rates_are_the_groups_after_a_side_starts_or_changes_length():
    """The actor's schedule started (value pretraining ended) and the critic's length set outside a step: the groups'
    rates changed, the scheduler's `get_last_lr()` (what transformers' callbacks read, and `scheduler.pt` holds)
    still said the actor's 0 for a step."""
    from trl_vapo.optim import set_critic_length, side_schedules, start_actor_schedule

    policy, critic = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.AdamW([{"params": [policy], "name": "policy"}, {"params": [critic]}], lr=1e-3)
    scheduler = side_schedules(optimizer, "linear", lambda total: 0, 10, 5, None)
    for _ in range(5):  # value pretraining
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == 0.0
    start_actor_schedule(scheduler, optimizer, 5)
    set_critic_length(scheduler, optimizer, 12)
    rates = [group["lr"] for group in optimizer.param_groups]
    assert rates[0] == pytest.approx(1e-3) and scheduler.get_last_lr() == rates


def test_a_resumed_run_notes_the_resumed_schedules_rates_before_its_first_step(tiny_model_dir, tmp_path):
    """A log before the first step of a resumed run (an epoch's end, met as the run goes on) reads the rates noted
    for it: those of the schedules as built, before the checkpoint moved them (the actor's 0, its schedule not
    started), where the uninterrupted run logs the rates it trains at."""
    from transformers import TrainerCallback

    args = config(tmp_path, max_steps=3, value_pretrain_steps=1, save_strategy="steps", save_steps=2)
    VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32)).train()
    seen = {}

    class Noted(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            seen["noted"] = dict(trainer._step_learning_rates)
            seen["groups"] = {group.get("name"): group["lr"] for group in optimizer.param_groups}

    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(32), callbacks=[Noted()])
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert seen["noted"] == seen["groups"] and seen["groups"]["policy"] > 0


def test_a_scheduler_of_the_users_own_is_said_to_run_through_value_pretraining():
    """The docs hold the policy's rate at 0 until RL: true of the trainer's schedules, whose actor side starts when
    value pretraining ends. A scheduler the user sets knows no sides: its warm-up was spent on value pretraining's
    steps without a word."""
    import warnings

    from transformers import get_constant_schedule_with_warmup

    from trl_vapo.optim import side_schedules, start_actor_schedule

    policy, critic = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    groups = [{"params": [policy], "name": "policy"}, {"params": [critic], "name": "critic"}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    with pytest.warns(UserWarning, match="ran through value pretraining's 5 steps"):
        start_actor_schedule(get_constant_schedule_with_warmup(optimizer, 4), optimizer, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        start_actor_schedule(side_schedules(optimizer, "linear", lambda total: 0, 10, 5, None), optimizer, 5)
        start_actor_schedule(get_constant_schedule_with_warmup(optimizer, 4), optimizer, 0)  # no value pretraining


def test_a_stop_signal_while_the_trained_model_is_saved_acts_once_it_is_whole(
    tiny_model_dir, tmp_path, capfd, monkeypatch
):
    """`trl-vapo train` saves after `train()` (a Slurm time limit's SIGTERM, a Ctrl-C can land there): acting at once,
    the signal cut the save (its files are moved into output_dir one by one: a policy beside an earlier save's critic,
    or none), and the next run removed the rest as debris. Held until the save is whole, it then acts as it would
    have (SIGINT: KeyboardInterrupt). Here the signal comes while the save's files are being written."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, config(tmp_path, max_steps=1), prompts_dataset())
    trainer.train()
    write = trainer._write_models

    def interrupted(directory, *args, **kwargs):
        write(directory, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # (Python's own handler: KeyboardInterrupt where it acts)

    trainer._write_models = interrupted
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, as a command has it (xdist's differs)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.save_model()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as it was
        assert "SIGINT: stopping once the model is saved (sent again 5 s on: stop now)" in capfd.readouterr().err
        AutoModelForCausalLM.from_pretrained(tmp_path / "out")
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "critic")
        # Sent again after the window (here 0 s): it acts at once, in the save (a way out of a long one).
        import trl_vapo.signals

        monkeypatch.setattr(trl_vapo.signals, "SIGNAL_REPEAT_WINDOW", 0.0)
        acted_in_the_save = []

        def twice(directory, *args, **kwargs):
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.01)
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                acted_in_the_save.append(True)
                raise

        trainer._write_models = twice
        with pytest.raises(KeyboardInterrupt):
            trainer.save_model(str(tmp_path / "again"))
        assert acted_in_the_save == [True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_a_stop_signal_with_stderr_gone_is_still_a_request_to_stop():
    """Ctrl-C under `trl-vapo train ... 2>&1 | tee log` ends `tee` too: the handler's notice to the closed pipe raised
    BrokenPipeError (Python ignores SIGPIPE) wherever the main thread was, and the run ended without its checkpoint;
    so did the progress bar's next write to it. Here stderr is a pipe whose reader is gone, and the handler runs (a
    signal to this process); after it, stderr takes writes (the null device's)."""
    from trl_vapo.signals import stop_on_signals

    read, write = os.pipe()
    os.close(read)
    saved = os.dup(2)
    try:
        os.dup2(write, 2)
        with stop_on_signals([signal.SIGUSR1]) as received:
            signal.raise_signal(signal.SIGUSR1)  # (the handler runs before this returns)
            signal.raise_signal(signal.SIGUSR1)  # a repeat: "already stopping", written nowhere too
        assert os.write(2, b"the progress bar\n") == 17  # (to the closed pipe: BrokenPipeError)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)
    assert received.signum == signal.SIGUSR1


def test_stop_signals_the_run_cannot_catch_are_named_before_it_trains(tiny_model_dir, tmp_path, caplog):
    """A stop signal with a handler of its own (submitit's, a user's) or training outside the main thread (a worker
    thread of Ray or of a notebook's runner) ends the run without a checkpoint: said before it trains, where nothing
    was said."""
    import threading

    from trl_vapo.signals import stop_on_signals

    with stop_on_signals() as received:
        assert received.uncaught == {}
    own = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, config(tmp_path, max_steps=1), prompts_dataset())
        with caplog.at_level(logging.WARNING, logger="trl_vapo.trainer"):
            trainer.train()
        said = "These stop signals will not write a checkpoint before the run ends: SIGUSR1 (its handler is "
        assert said + "test_stop_signals_the_run_cannot_catch_are_named_before_it_trains.<locals>.<lambda>'s)" in (
            caplog.text
        )
    finally:
        signal.signal(signal.SIGUSR1, own)
    uncaught = []

    def in_a_thread():
        with stop_on_signals() as received:
            uncaught.append(received.uncaught)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert uncaught == [{name: "training runs outside the main thread" for name in ("SIGTERM", "SIGINT", "SIGUSR1")}]
