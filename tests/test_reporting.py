"""What a user sees: the completions table, the phase on the progress bar, the model card, `trl-vapo eval` flags.

Pure functions on plain data, printed to real consoles and written to real trackers (offline); no training run
(`test_trackers.py` has those).
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import random
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import yaml

from trl_vapo.model_card import build_model_card, is_hub_id
from trl_vapo.reporting import (
    PhaseProgressCallback,
    build_completions_table,
    completion_token_stats,
    format_plain_table,
    log_completions_to_trackers,
    print_completions_table,
    sample_rows,
    tracker_urls,
)

NAN = float("nan")


def sample_table(step=7, phase="rl"):
    return build_completions_table(
        step=step,
        prompts=["1+1=", [{"role": "user", "content": "What is 2+2?"}], "3+3=", "4+4="],
        completions=["2", [{"role": "assistant", "content": "[bold]4[/bold]"}], "six", ""],
        rewards={"digit_fraction": [1.0, None, NAN, -1.0], "format": [0.5, 0.0, 0.25, 0.0]},
        sequence_rewards=[1.5, 0.0, None, -1.0],
        advantages=[0.25, -0.5, None, 0.0],
        first_values=[0.1, 0.2, 0.3, None],
        last_values=[0.9, -0.8, 0.7, None],
        phase=phase,
    )


# ---------------------------------------------------------------------------------------------------------------------
# The completions table: content
# ---------------------------------------------------------------------------------------------------------------------


def test_table_columns_in_order_with_missing_rewards_as_none():
    table = sample_table()
    assert list(table.columns) == [
        "prompt",
        "completion",
        "digit_fraction",
        "format",
        "reward",
        "advantage",
        "value_first",
        "value_last",
    ]
    assert len(table) == 4 and table.title == "Step 7 (RL)"
    assert table.columns["digit_fraction"] == [1.0, None, None, -1.0]  # None and NaN: both "no score"
    assert table.columns["reward"] == [1.5, 0.0, None, -1.0]
    assert table.columns["value_last"] == [0.9, -0.8, 0.7, None]
    assert table.reward_columns == ["digit_fraction", "format"]


def test_value_pretraining_table_has_no_advantage_column():
    table = build_completions_table(
        step=1,
        prompts=["p"],
        completions=["c"],
        rewards={"r": [1]},
        sequence_rewards=[1],
        advantages=None,
        first_values=[0.5],
        last_values=[0.25],
        phase="value_pretrain",
    )
    assert "advantage" not in table.columns and table.title == "Step 1 (value pretraining)"
    assert table.columns["r"] == [1.0] and isinstance(table.columns["r"][0], float)


def test_reward_function_named_like_a_fixed_column_gets_a_prefix():
    table = build_completions_table(
        step=0, prompts=["p"], completions=["c"], rewards={"reward": [0.5], "prompt": [1.0]}, sequence_rewards=[2.0]
    )
    assert table.columns["rewards/reward"] == [0.5] and table.columns["rewards/prompt"] == [1.0]
    assert table.columns["reward"] == [2.0] and table.columns["prompt"] == ["p"]


def test_a_log_extra_column_named_like_one_of_the_tables_keeps_both():
    """A reward function `judge` that logs its rationales with `log_extra("judge", ...)` (or any `log_extra("reward",
    ...)`): the text replaced the numbers' column, whose conversion to numbers then stopped the run at its first
    completions log. It is `rewards/log_extra/<name>` beside the column; another name is kept as logged."""
    table = build_completions_table(
        step=3,
        prompts=["p", "q"],
        completions=["c", "d"],
        rewards={"judge": [1.0, 0.0]},
        sequence_rewards=[1.0, 0.0],
        advantages=[0.5, -0.5],
        extra_columns={"judge": ["right", "wrong"], "reward": ["x", "y"], "step": ["s", "t"], "why": ["a", "b"]},
    )
    frame = table.to_dataframe()
    assert frame["judge"].tolist() == [1.0, 0.0] and frame["reward"].tolist() == [1.0, 0.0]
    assert frame["rewards/log_extra/judge"].tolist() == ["right", "wrong"]
    assert frame["rewards/log_extra/reward"].tolist() == ["x", "y"] and frame["rewards/log_extra/step"].tolist() == [
        "s",
        "t",
    ]
    assert frame["step"].tolist() == [3, 3] and frame["why"].tolist() == ["a", "b"]


def test_every_processs_share_joins_with_the_extra_columns_any_of_them_logged():
    """A `log_extra` column one process's rows logged and another's did not (a reward function that logs a rationale
    only where it has one) vanished from the joined table of a run on several processes: its rows there are None, as
    GRPOTrainer pads them."""
    from trl_vapo.reporting import CompletionsTable

    def share(prompts, extra):
        rewards, n = {"judge": [1.0] * len(prompts)}, len(prompts)
        return build_completions_table(
            step=3, prompts=prompts, completions=["c"] * n, rewards=rewards, sequence_rewards=[1.0] * n,
            advantages=[0.0] * n, extra_columns=extra,
        )  # fmt: skip

    joined = CompletionsTable.concatenate([share(["p", "q"], {"why": ["a", "b"]}), share(["r"], {"how": ["z"]})])
    assert joined.columns["prompt"] == ["p", "q", "r"]
    assert joined.extra_columns == {"why": ["a", "b", None], "how": [None, None, "z"]}


def test_lists_of_the_wrong_length_are_refused_with_their_names():
    with pytest.raises(ValueError, match=r"one value per prompt \(2\).*digit"):
        build_completions_table(
            step=0, prompts=["a", "b"], completions=["x", "y"], rewards={"digit": [1.0]}, sequence_rewards=[1, 2]
        )


def test_sample_rows_limits_keeps_order_and_leaves_global_random_state_alone():
    assert sample_rows(5, None) == [0, 1, 2, 3, 4]
    assert sample_rows(5, 9) == [0, 1, 2, 3, 4]
    assert sample_rows(5, 0) == [] and sample_rows(5, -1) == []
    random.seed(123)
    expected_next = random.random()
    random.seed(123)
    rows = sample_rows(100, 6, seed=3)
    assert random.random() == expected_next  # the trainer's (resumable) random stream is untouched
    assert len(rows) == 6 and rows == sorted(set(rows)) and all(0 <= i < 100 for i in rows)
    assert sample_rows(100, 6, seed=3) == rows and sample_rows(100, 6, seed=4) != rows


def test_select_keeps_each_row_together():
    table = sample_table()
    picked = table.select(2)
    assert len(picked) == 2 and picked.step == table.step
    for i in range(2):
        j = table.columns["prompt"].index(picked.columns["prompt"][i])
        assert all(picked.columns[name][i] == table.columns[name][j] for name in table.columns)


def test_completion_token_stats_from_rollout_tensors():
    advantages = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])
    # The policy's tokens; row 3's first and last are an environment's (a rollout_func's env_mask).
    action_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 1, 0]])
    loss_mask = action_mask.float()
    loss_mask[1] = 0.0  # row 1 unscored: no advantage
    stats = completion_token_stats(advantages, values, action_mask, loss_mask)
    assert stats["advantages"] == [2.0, None, None, 5.0]
    assert stats["first_values"] == pytest.approx([0.1, 0.4, None, 1.1])
    assert stats["last_values"] == pytest.approx([0.2, 0.4, None, 1.1])
    assert completion_token_stats(None, values, action_mask)["advantages"] is None


def test_dataframe_for_trackers_has_text_and_nan():
    frame = sample_table().to_dataframe()
    assert list(frame.columns)[:3] == ["step", "prompt", "completion"]
    assert frame["step"].tolist() == [7] * 4
    assert frame["prompt"][1] == "USER: What is 2+2?" and frame["completion"][1] == "ASSISTANT: [bold]4[/bold]"
    assert frame["digit_fraction"].dtype == float and math.isnan(frame["digit_fraction"][1])
    assert math.isnan(frame["value_first"][3]) and frame["advantage"][0] == 0.25


# ---------------------------------------------------------------------------------------------------------------------
# The completions table: printed
# ---------------------------------------------------------------------------------------------------------------------


def test_rich_print_shows_the_sample_like_trl():
    pytest.importorskip("rich")
    out = io.StringIO()
    print_completions_table(sample_table(), None, file=out, width=140)
    text = out.getvalue()
    assert "Step 7 (RL)" in text
    for header in ("Prompt", "Completion", "digit_fraction", "format", "Reward", "Advantage", "Value"):
        assert header in text, header
    for value in ("1+1=", "3+3=", "six", "1.50", "-0.50", "0.25", "0.90", "-0.80"):
        assert value in text, value
    assert "[bold]4[/bold]" in text  # completions are text, never rich markup
    assert "USER" in text and "ASSISTANT" in text
    # A plain string's too (a closing tag without its opening one raised rich's MarkupError: a stopped run).
    plain = build_completions_table(
        step=8, prompts=["[i]1+1="], completions=["[/bold] [red]5[/red]"], rewards={"r": [1.0]}, sequence_rewards=[1.0]
    )
    out = io.StringIO()
    print_completions_table(plain, None, file=out, width=140)
    assert "[i]1+1=" in out.getvalue() and "[/bold] [red]5[/red]" in out.getvalue()
    row_of_3 = next(line for line in text.splitlines() if "3+3=" in line)
    assert row_of_3.count(" - ") >= 3  # digit_fraction NaN, reward None, advantage None


def test_rich_print_on_a_narrow_console_keeps_every_column_and_token():
    pytest.importorskip("rich")
    table = build_completions_table(
        step=1,
        prompts=["Compute 7+1+3+5+4+6+2+9."],
        completions=["7+1=8, 8+3=11, 11+5=16. Answer: 37"],
        rewards={"digit_fraction": [1.0]},
        sequence_rewards=[1.0],
        advantages=[0.5],
        first_values=[0.25],
        last_values=[0.75],
    )
    out = io.StringIO()
    print_completions_table(table, None, file=out, width=80)  # rich's width when stdout is not a terminal
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines) and lines[-1].endswith("╯")
    assert all(line.endswith(("│", "╮", "╯")) for line in lines)  # no column cut off at the panel's edge
    # Read each column top to bottom (header and body rows), without spaces: folded text joins up again.
    columns: dict[int, str] = {}
    for line in lines[1:-1]:
        cells = line.replace("┃", "│").split("│")[2:-2]  # inside the panel's and the table's outer borders
        for i, cell in enumerate(cells):
            columns[i] = columns.get(i, "") + cell.replace(" ", "")
    assert len(columns) == 7 and "…" not in "".join(columns.values())
    assert columns[0] == "PromptCompute7+1+3+5+4+6+2+9." and columns[1] == "Completion7+1=8,8+3=11,11+5=16.Answer:37"
    assert columns[2] == "digit_fraction1.00" and columns[4] == "Advantage0.50" and columns[6] == "Value(last)0.75"


def test_rich_print_limited_to_num_completions_to_print():
    pytest.importorskip("rich")
    prompts = [f"prompt-{i:02d}" for i in range(20)]
    table = build_completions_table(
        step=3,
        prompts=prompts,
        completions=[f"completion-{i:02d}" for i in range(20)],
        rewards={"r": [0.0] * 20},
        sequence_rewards=[0.0] * 20,
    )
    out = io.StringIO()
    print_completions_table(table, 3, file=out)
    shown = [p for p in prompts if p in out.getvalue()]
    assert len(shown) == 3
    out = io.StringIO()
    print_completions_table(table, 0, file=out)
    assert out.getvalue() == ""


def test_plain_text_when_rich_is_missing(capsys):
    print_completions_table(sample_table(), 2, use_rich=False)
    printed = capsys.readouterr().out
    assert printed.startswith("===== Step 7 (RL): 2 completion(s)")
    assert printed.count("--- prompt:") == 2 and printed.count("--- completion:") == 2
    full = format_plain_table(sample_table())
    assert "USER: What is 2+2?" in full and "ASSISTANT: [bold]4[/bold]" in full
    assert "digit_fraction -   format 0.00   reward 0.00   advantage -0.50   value_first 0.20" in full
    assert "value_first -   value_last -" in full


@pytest.mark.parametrize("use_rich", [False, True])
def test_the_table_prints_on_a_stream_that_cannot_encode_every_character(use_rich, monkeypatch):
    """Windows' standard output into a pipe or a file is cp1252: a completion's "≥" or CJK text raised
    UnicodeEncodeError in the print, which stopped the run at its completions log (rich's table too, which is what
    prints: rich comes with transformers). What the stream cannot encode prints as "?"."""
    table = build_completions_table(
        step=1, prompts=["x ≥ 2?"], completions=["是 x ≥ 2 €"], rewards={"r": [1.0]}, sequence_rewards=[1.0]
    )
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="cp1252")
    print_completions_table(table, use_rich=use_rich, file=stream, width=100)
    stream.flush()
    printed = raw.getvalue().decode("cp1252")
    assert ("? x ? 2 €" if use_rich else "--- completion:\n? x ? 2 €") in printed
    monkeypatch.setattr(sys, "stdout", None)  # no console at all (pythonw.exe): nothing printed, nothing raised
    print_completions_table(table, use_rich=use_rich)


# ---------------------------------------------------------------------------------------------------------------------
# The completions table: trackers
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tracker", ["trackio", "wandb"])
def test_no_tracker_table_without_a_table_tracker_or_a_live_run(tracker):
    table = sample_table()
    assert log_completions_to_trackers(table, None) == []
    assert log_completions_to_trackers(table, "none") == []
    assert log_completions_to_trackers(table, ["tensorboard"]) == []  # TensorBoard has no tables
    pytest.importorskip(tracker)  # (trackio is in the dev extra; wandb is not)
    assert log_completions_to_trackers(table, [tracker]) == []  # no run started: nothing to log to


def test_table_logged_to_trackio_offline(tmp_path):
    """trackio is local-first: with the hub unreachable (HF_HUB_OFFLINE) it writes a SQLite file under TRACKIO_DIR.

    In a process of its own (forked from the tests' server, which has not imported trackio, offline as the tests are)
    because trackio reads TRACKIO_DIR once, at import."""
    from _script_process import run_code

    pytest.importorskip("trackio")
    script = textwrap.dedent("""
        import json
        import trackio
        from trackio.sqlite_storage import SQLiteStorage
        from trl_vapo.reporting import build_completions_table, log_completions_to_trackers

        table = build_completions_table(
            step=7, prompts=["1+1=", [{"role": "user", "content": "2+2?"}]], completions=["2", "four"],
            rewards={"digit_fraction": [1.0, None]}, sequence_rewards=[1.0, None], advantages=[0.25, None],
            first_values=[0.5, 0.125], last_values=[0.75, None],
        )
        trackio.init(project="vapo-test", name="run", auto_log_cpu=False, auto_log_gpu=False)
        used = log_completions_to_trackers(table, ["tensorboard", "trackio"])
        trackio.finish()
        print(json.dumps({"used": used, "logs": SQLiteStorage.get_logs("vapo-test", "run")}, default=str))
    """)
    result = run_code(script, cwd=tmp_path, env={"TRACKIO_DIR": str(tmp_path / "trackio")}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["used"] == ["trackio"]
    table = report["logs"][0]["completions"]
    assert table["_type"] == "trackio.table"
    rows = table["_value"]
    assert [r["prompt"] for r in rows] == ["1+1=", "USER: 2+2?"] and [r["step"] for r in rows] == [7, 7]
    assert rows[0]["digit_fraction"] == 1.0 and rows[0]["advantage"] == 0.25 and rows[0]["value_last"] == 0.75
    assert rows[1]["completion"] == "four" and rows[1]["digit_fraction"] in ("NaN", None)  # no score: not a number
    assert (tmp_path / "trackio" / "vapo-test.db").is_file()


def test_the_table_reaches_wandbs_interface(monkeypatch):
    """wandb is not in the locked set, so the offline run below skips here: a stand-in module with the parts of
    wandb's interface the table and the card use (`run`, `Table(dataframe=...)`, `log`) runs trl-vapo's wandb code."""
    logged = []
    stand_in = types.ModuleType("wandb")
    stand_in.run, stand_in.log = None, logged.append
    stand_in.Table = lambda dataframe: ("table", dataframe)
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    assert log_completions_to_trackers(sample_table(), ["wandb"]) == [] and not logged  # no run yet
    stand_in.run = types.SimpleNamespace(offline=True, url="https://wandb.ai/me/vapo/runs/1")
    assert log_completions_to_trackers(sample_table(), ["tensorboard", "wandb"]) == ["wandb"]
    [entry] = logged
    kind, frame = entry["completions"]
    assert kind == "table" and frame.equals(sample_table().to_dataframe())
    assert tracker_urls()["wandb"] is None  # an offline run has no page for the model card to link
    stand_in.run.offline = False
    assert tracker_urls()["wandb"] == "https://wandb.ai/me/vapo/runs/1"


def test_table_logged_to_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="vapo-test", dir=str(tmp_path))
    try:
        assert log_completions_to_trackers(sample_table(), ["wandb"]) == ["wandb"]
        assert tracker_urls()["wandb"] is None  # an offline run has no page for the model card to link
    finally:
        wandb.finish()
    files = list((tmp_path / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json"))
    assert len(files) == 1, run.dir
    logged = json.loads(files[0].read_text())
    assert logged["columns"][:3] == ["step", "prompt", "completion"]
    assert len(logged["data"]) == 4 and logged["data"][2][2] == "six"


# ---------------------------------------------------------------------------------------------------------------------
# The phase on the progress bar
# ---------------------------------------------------------------------------------------------------------------------


def test_phase_progress_callback_labels_a_real_tqdm_bar(capsys):
    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import ProgressCallback

    phase = ["value_pretrain"]
    callback = PhaseProgressCallback(lambda: phase[0])
    assert isinstance(callback, ProgressCallback)  # the trainer's early-stop adjustment of the bar's total applies
    state, control = TrainerState(max_steps=6), TrainerControl()
    state.is_world_process_zero = True
    callback.on_train_begin(None, state, control)
    bar = callback.training_bar
    assert bar.desc == "value pretraining: " and str(bar).startswith("value pretraining:")
    for step in (1, 2):
        state.global_step = step
        callback.on_step_end(None, state, control)
    assert bar.n == 2 and bar.desc == "value pretraining: "
    phase[0] = "rl"
    callback.refresh()  # the trainer's call at the phase change
    assert bar.desc == "RL: " and str(bar).startswith("RL:  33%")
    state.global_step = 6
    callback.on_step_end(None, state, control)
    callback.on_train_end(None, state, control)
    assert callback.training_bar is None
    err = capsys.readouterr().err
    assert "value pretraining:" in err and "RL: 100%" in err


def test_phase_progress_callback_without_a_bar_does_nothing():
    callback = PhaseProgressCallback(lambda: "rl")
    callback.refresh()  # disable_tqdm, or not the main process: no bar, no error
    assert callback.training_bar is None


# ---------------------------------------------------------------------------------------------------------------------
# The model card
# ---------------------------------------------------------------------------------------------------------------------


def front_matter(content: str) -> dict:
    assert content.startswith("---\n")
    header, _ = content[4:].split("\n---\n", 1)
    return yaml.safe_load(header)


@pytest.fixture(scope="module")
def vapo_args(tmp_path_factory):
    from trl_vapo import VAPOConfig

    return VAPOConfig(
        output_dir=str(tmp_path_factory.mktemp("card") / "out"),
        report_to="none",
        value_pretrain_steps=15,
        length_adaptive_alpha=0.5,
        num_generations=8,
        per_device_train_batch_size=16,
        max_completion_length=96,
    )


HELD_OUT = {
    "before": {"pass@1": 0.615, "avg@4": 0.401, "pass@4": 0.8, "num_problems": 200, "mean_length": 59.8},
    "after": {"pass@1": 0.98, "avg@4": 0.895, "pass@4": 0.995, "num_problems": 200, "mean_length": 60.1},
    "description": "200 held-out problems, 4 samples each at T=1",
}
HISTORY = [
    {"phase": "value_pretrain", "value/explained_variance": 0.21, "step": 4},
    {"phase": "value_pretrain", "value/explained_variance": 0.34, "step": 8},
    {"phase": "rl", "reward": -0.5, "accuracy": 0.25, "value/explained_variance": 0.30, "step": 12},
    {"phase": "rl", "reward": 0.9, "accuracy": 0.95, "value/explained_variance": 0.60, "step": 140},
    {"train_runtime": 40.0, "step": 140},
]


def test_the_card_names_the_settings_a_run_changed_and_an_early_stop_only_where_it_can_happen(tmp_path):
    """The card's settings reproduce the run: the demo's 4 passes of the critic alone read as 480 policy steps, and
    top_p, vf_coef, ... were left out; `max_steps=-1` said nothing of the epochs that set the length. The early-stop
    clause is there only where the rule can fire (two windows of readings)."""
    from trl_vapo import VAPOConfig
    from trl_vapo.model_card import _other_settings, _vapo_table

    args = VAPOConfig(output_dir=str(tmp_path), report_to="none", critic_num_iterations=4, top_p=0.9, vf_coef=0.5)
    settings = _other_settings(args)
    assert {"`critic_num_iterations=4`", "`top_p=0.9`", "`vf_coef=0.5`", "`num_train_epochs=3.0`"} <= set(settings)
    # Left unset, the critic's passes are num_iterations' (resolved from None): not named as changed.
    unset = " ".join(_other_settings(VAPOConfig(output_dir=str(tmp_path), report_to="none")))
    assert "`critic_num_iterations=" not in unset and "`value_pretrain_num_iterations=" not in unset
    assert not any(s.startswith(("`top_k=", "`whiten_advantages=")) for s in settings)  # at their defaults
    assert "`num_train_epochs=" not in " ".join(_other_settings(VAPOConfig(output_dir=str(tmp_path), max_steps=5)))
    assert "`max_steps=5`" in _other_settings(VAPOConfig(output_dir=str(tmp_path), max_steps=5))
    assert not any(s.startswith("`max_steps=") for s in settings)  # -1, unset: it read as a limit beside the epochs
    for steps, clause in ((19, False), (20, True)):
        table = _vapo_table(VAPOConfig(output_dir=str(tmp_path), value_pretrain_steps=steps), None)
        assert ("stops early when explained variance stops improving, window 10" in table) is clause
    # With a frozen value function no critic learns: its settings and targets are not the run's.
    assert "`critic_learning_rate=" in " ".join(settings)
    frozen = _other_settings(args, frozen_values=True)
    assert not any(s.startswith(("`critic_learning_rate=", "`critic_num_iterations=", "`vf_coef=")) for s in frozen)
    table = _vapo_table(args, {"skipped": "a frozen value function"}, "DigitShareValue")
    assert "none: the values are the frozen value function's (`DigitShareValue`)" in table
    assert "no critic targets" in table and "lam_critic" not in table


def test_card_of_a_local_base_model_never_links_to_the_hub(vapo_args, tmp_path):
    base = str(tmp_path / "my-base")
    os.makedirs(base)
    out = tmp_path / "run"
    card = build_model_card(
        base_model=base,
        output_dir=out,
        args=vapo_args,
        dataset_name=str(tmp_path / "train.jsonl"),
        value_pretraining={"rollouts": 15, "best_explained_variance": 0.36},
        pretrained_critic_dir=out / "value_pretrained_critic",
        held_out=HELD_OUT,
        log_history=HISTORY,
        example_prompt="Compute 7+1+3.\n",
    )
    content = str(card)
    meta = front_matter(content)
    assert "base_model" not in meta and "datasets" not in meta  # local: not hub metadata
    assert "licence" not in meta and "license" not in meta  # unknown: omitted, never `licence: license`
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["model_name"] == "run" and {"trl", "vapo", "trl-vapo"} <= set(meta["tags"])
    assert "None" not in content and "huggingface.co/" + base not in content
    assert f"fine-tuned version of the local model `{base}`" in content
    assert f"local data set `{tmp_path / 'train.jsonl'}`" in content
    assert f'pipeline("text-generation", model="{out.resolve()}"' in content
    assert "prompt = 'Compute 7+1+3.\\n'" in content and "max_new_tokens=96" in content
    # VAPO section: the seven settings
    for needle in (
        # (no early stop: the rule compares two windows of 10 readings, which 15 rollouts do not hold)
        "`value_pretrain_steps=15`: ran 15 rollouts, final explained variance 0.340 (its last reading, taken before "
        "the critic's update on its rollout; best 0.360)",
        "`lam_critic=1.0`, the policy's: length-adaptive (3)",  # lam_actor is not used with alpha set
        "`length_adaptive_alpha=0.5`",
        '`loss_type="token"`',
        "`epsilon=0.2`, `epsilon_high=0.28`",
        "`nll_coef=0.1`",
        "`num_generations=8`",
    ):
        assert needle in content, needle
    # held-out before / after, metrics, critic
    assert "| pass@1 (greedy) | 0.615 | 0.980 |" in content and "| avg@4 (sampled) | 0.401 | 0.895 |" in content
    assert "200 held-out problems, 4 samples each at T=1" in content
    assert "(of those whose k samples were all scored)." in content
    # Problems some of whose samples no reward scored are left out of pass@k: the card says how many.
    from trl_vapo.model_card import _held_out_section

    partly = {**HELD_OUT, "after": {**HELD_OUT["after"], "num_partly_scored": 3}}
    section = _held_out_section(partly)
    assert "all scored; 0 partly scored problems left out before training, 3 after)." in section
    unscored = {**HELD_OUT, "after": {**HELD_OUT["after"], "num_unscored": 2}}  # the after report's set is smaller
    assert (
        "; 0 problems none of whose samples a reward scored left out of avg@k and pass@k before training, 2 after)."
        in _held_out_section(unscored)
    )
    assert (
        "| reward | -0.500 | +0.900 |" in content
        and "140 optimizer steps (8 of value pretraining, 132 of RL)." in content
    )
    assert "separate model" in content and "`critic/`" in content and "`value_pretrained_critic/`" in content
    assert "@article{yue2025vapo" in content and "@software{vonwerra2020trl" in content
    assert "(from the Hub" not in content
    # Pushed: the folder's Hub id too, where the card goes to the branch a Hub `value_model` is read from (main).
    for revision, named in ((None, True), ("main", True), ("v2", False)):
        pushed = build_model_card(
            base_model=base,
            output_dir=out,
            args=vapo_args,
            hub_model_id="me/vapo",
            hub_revision=revision,
            value_pretraining={"rollouts": 15, "best_explained_variance": 0.36},
            pretrained_critic_dir=out / "value_pretrained_critic",
        )
        assert ('(from the Hub: `value_model="me/vapo/value_pretrained_critic"`)' in str(pushed)) == named


def test_the_cli_summary_and_the_model_card_average_the_same_logs(tmp_path):
    """`trl-vapo train`'s summary took the first and last 3 RL logs even when they overlapped; the card took up to 3
    that do not. With 4 logs both now take 2: one run, one pair of start and end numbers."""
    from types import SimpleNamespace

    from trl_vapo.cli import _summary
    from trl_vapo.model_card import _metrics_summary

    logs = [{"phase": "rl", "reward": r, "accuracy": r, "step": i + 1} for i, r in enumerate([0.0, 0.2, 0.6, 1.0])]
    trainer = SimpleNamespace(
        state=SimpleNamespace(log_history=logs, global_step=4),
        progress=SimpleNamespace(value_pretrain_rollouts=0),
        args=SimpleNamespace(output_dir=str(tmp_path)),
    )
    summary = _summary(trainer, None, None, 60.0, demo=False)
    assert "train reward     +0.100 -> +0.800   (mean of the first -> last 2 RL logs)" in summary
    card = _metrics_summary(logs)
    assert "the last 2 RL logging steps" in card and "| reward | +0.100 | +0.800 |" in card
    # A step that judged nothing logs a NaN accuracy: left out of the mean (the summary printed "nan"), and a mean of
    # nothing is "n/a", in both.
    logs[0]["accuracy"] = logs[2]["accuracy"] = logs[3]["accuracy"] = float("nan")
    summary = _summary(trainer, None, None, 60.0, demo=False)
    assert "train accuracy   0.200 -> n/a" in summary
    assert "| accuracy | 0.200 | n/a |" in _metrics_summary(logs)


def test_a_checkpoints_card_names_the_pretrained_critic_without_a_local_path(vapo_args, tmp_path):
    """The card pushed while training is a checkpoint's, and the critic value pretraining left is in the run's
    output_dir, not in the checkpoint: it gave that folder's absolute path (the trainer's home and user name, on the
    Hub, where the folder is not uploaded)."""
    out = tmp_path / "run"
    card = build_model_card(
        base_model="Qwen/Qwen2.5-0.5B-Instruct",
        output_dir=out / "checkpoint-20",
        args=vapo_args,
        hub_model_id="me/vapo",
        value_pretraining={"rollouts": 15, "best_explained_variance": 0.36},
        pretrained_critic_dir=out / "value_pretrained_critic",
        log_history=HISTORY,
    )
    content = str(card)
    named = "the critic as value pretraining left it: `value_pretrained_critic/` in the training run's `output_dir`"
    assert named in content.lower()
    assert str(tmp_path) not in content


def test_the_card_names_the_adapters_kind(vapo_args, tmp_path):
    """An IA3 run's card said "This is a LoRA adapter" and tagged it `lora` (any PEFT type did); the critic adapter,
    of the policy's kind, was "a second LoRA adapter"."""
    from peft import IA3Config, LoraConfig

    from trl_vapo.model_card import adapter_type_name

    assert adapter_type_name(LoraConfig(use_dora=True)) == "LoRA" and adapter_type_name(IA3Config()) == "IA3"
    card = build_model_card(
        base_model="Qwen/Qwen2.5-0.5B-Instruct",
        output_dir=tmp_path / "out",
        args=vapo_args,
        is_adapter=True,
        adapter_type="IA3",
        critic_shares_base=True,
    )
    content = str(card)
    assert "This is a PEFT adapter (IA3) for" in content and "second PEFT adapter (IA3) on the policy's" in content
    assert "lora" not in front_matter(content)["tags"] and "LoRA" not in content


def test_card_of_a_hub_base_model_and_dataset(vapo_args, tmp_path):
    card = build_model_card(
        base_model="Qwen/Qwen2.5-0.5B-Instruct",
        output_dir=tmp_path / "out",
        args=vapo_args,
        hub_model_id="someone/Qwen2.5-0.5B-GSM8K-VAPO",
        dataset_name="openai/gsm8k",
        dataset_config="main",
        is_adapter=True,
        critic_shares_base=True,
        license="apache-2.0",
        tags=["math"],
        wandb_url="https://wandb.ai/someone/vapo/runs/abc",
        trackio_url="https://someone-vapo.hf.space/?project=p",
    )
    content = str(card)
    meta = front_matter(content)
    assert meta["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct" and meta["datasets"] == ["openai/gsm8k"]
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "peft"
    assert meta["model_name"] == "Qwen2.5-0.5B-GSM8K-VAPO"
    assert {"math", "lora", "base_model:adapter:Qwen/Qwen2.5-0.5B-Instruct"} <= set(meta["tags"])
    assert "[Qwen/Qwen2.5-0.5B-Instruct](https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct)" in content
    assert "[openai/gsm8k](https://huggingface.co/datasets/openai/gsm8k) (`main`) dataset" in content
    assert 'model="someone/Qwen2.5-0.5B-GSM8K-VAPO", device_map="auto")\n' in content  # no "this folder" note
    assert "LoRA adapter on the policy's frozen base" in content and "value_head.safetensors" in content
    assert (
        "](https://wandb.ai/someone/vapo/runs/abc)" in content
        and "](https://someone-vapo.hf.space/?project=p)" in content
    )
    assert "## Evaluation" not in content  # not measured: no section
    # huggingface_hub reads the card back with the same metadata
    path = tmp_path / "README.md"
    card.save(str(path))
    from huggingface_hub import ModelCard

    assert ModelCard.load(str(path)).data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"

    # Pushed to a branch (`hub_revision`): the quick start loads that branch, where it loaded `main`.
    args = copy.copy(vapo_args)
    args.hub_revision = "dev"
    card = build_model_card(base_model="Qwen/Qwen2.5-0.5B", output_dir=tmp_path, args=args, hub_model_id="a/b")
    assert 'pipeline("text-generation", model="a/b", revision="dev", device_map="auto")\n' in str(card)


def test_the_cards_quick_start_runs_and_renders_the_prompt_as_training_did(tiny_model_dir, tmp_path, monkeypatch):
    """A run's chat prompts rendered with `chat_template_kwargs` (Qwen3's `enable_thinking=False`): the quick start
    rendered them with the template's defaults (thinking on: another prompt than the model trained on), and the
    settings named none. It is run here as a reader would, in a fresh namespace, on the saved folder; and a push to
    another branch (`push_to_hub(revision=...)`) writes a card that loads that branch, where it loaded `main`."""
    import transformers.trainer
    from datasets import Dataset
    from helpers import LocalHub, make_args

    from trl_vapo import VAPOTrainer

    def short(completions, **kwargs):
        return [-float(len(completion[0]["content"])) for completion in completions]

    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}]} for i in range(16)]
    args = make_args(tmp_path, max_steps=1, chat_template_kwargs={"enable_thinking": False})
    trainer = VAPOTrainer(str(tiny_model_dir), short, args, Dataset.from_list(rows))
    trainer.save_model()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "`chat_template_kwargs={'enable_thinking': False}`" in card
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert "return_full_text=False, tokenizer_encode_kwargs={'enable_thinking': False})" in code
    rendered = []
    real = type(trainer.processing_class).apply_chat_template
    monkeypatch.setattr(
        type(trainer.processing_class),
        "apply_chat_template",
        lambda self, *a, **kw: rendered.append(kw.get("enable_thinking")) or real(self, *a, **kw),
    )
    exec(code, {})  # (the tiny model answers nonsense: it runs, with the training's rendering)
    assert rendered == [False]

    hub = LocalHub(tmp_path / "hub")
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    trainer.args.hub_model_id = "me/vapo"
    trainer.push_to_hub(revision="v2")
    assert (
        'model="me/vapo", revision="v2", device_map="auto")'
        in (tmp_path / "hub" / "me" / "vapo" / "README.md").read_text()
    )


def test_the_quick_start_of_a_custom_code_model_trusts_its_code_as_training_did(tmp_path):
    """A policy of custom code trained with `trust_remote_code=True`: the card's `pipeline(...)` left it out, and
    transformers refuses to run the model's code without it."""
    from trl_vapo import VAPOConfig

    for trusted in (True, False):
        args = VAPOConfig(output_dir=str(tmp_path), report_to="none", trust_remote_code=trusted)
        card = str(build_model_card(base_model=None, output_dir=tmp_path, args=args, hub_model_id="me/vapo"))
        code = card.split("```python\n", 1)[1].split("```", 1)[0]
        trust = ", trust_remote_code=True" if trusted else ""
        assert f'generator = pipeline("text-generation", model="me/vapo"{trust}, device_map="auto")' in code


def test_card_when_value_pretraining_was_off_or_skipped(vapo_args, tmp_path):
    from trl_vapo import VAPOConfig

    off = VAPOConfig(output_dir=str(tmp_path / "o"), report_to="none", value_pretrain_steps=0)
    content = str(build_model_card(base_model=None, output_dir=tmp_path / "o", args=off))
    assert "off (`value_pretrain_steps=0`)" in content and "whose origin the run did not record" in content
    content = str(
        build_model_card(
            base_model="gpt2",
            output_dir=tmp_path / "s",
            args=vapo_args,
            value_pretraining={"skipped": "the critic came from an earlier value pretraining"},
        )
    )
    assert "skipped: the critic came from an earlier value pretraining" in content
    # GRPO's other losses: the table names the surrogate, and says there is no clip-higher (CISPO: a cap).
    cispo = VAPOConfig(output_dir=str(tmp_path / "c"), report_to="none", loss_type="cispo", epsilon_high=5.0)
    content = str(build_model_card(base_model=None, output_dir=tmp_path / "c", args=cispo))
    assert '`loss_type="token"`, `surrogate="cispo"`' in content
    assert 'none: `surrogate="cispo"` caps the importance weight at `epsilon_high=5.0`' in content


@pytest.mark.parametrize(
    "name,expected",
    [
        ("gpt2", True),
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("/abs/model", False),
        ("./model", False),
        ("a/b/c", False),
        ("data.jsonl", False),
        ("~/model", False),
        (None, False),
        ("", False),
    ],
)
def test_hub_ids_and_local_paths(name, expected):
    assert is_hub_id(name) is expected


def test_existing_local_folder_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("org/model")
    assert not is_hub_id("org/model")


# ---------------------------------------------------------------------------------------------------------------------
# `trl-vapo eval`: --max_completion_length, with --max_new_tokens as an alias, and a training YAML
# ---------------------------------------------------------------------------------------------------------------------


def _eval(argv, tmp_path):
    from trl_vapo.cli import main
    from trl_vapo.demo import MODEL_DIR

    scores = tmp_path / "scores.json"
    code = main(
        [
            "eval",
            "--model",
            str(MODEL_DIR),
            "--num_prompts",
            "2",
            "--k",
            "1",
            "--batch_size",
            "4",
            "--output_json",
            str(scores),
            *argv,
        ]
    )
    return code, (json.loads(scores.read_text()) if scores.is_file() else None)


@pytest.mark.parametrize("flag", ["--max_completion_length", "--max_new_tokens"])
def test_eval_length_flag_and_its_alias(flag, tmp_path, capsys):
    code, scores = _eval([flag, "3"], tmp_path)
    assert code == 0
    assert scores["num_problems"] == 2 and scores["mean_length"] == 3  # every answer is longer: cut at 3 tokens


def test_eval_takes_a_training_yaml(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("max_completion_length: 4\nlearning_rate: 1.0e-5\nlora_r: 8\nvalue_pretrain_steps: 3\n")
    code, scores = _eval(["--config", str(config)], tmp_path)
    assert code == 0 and scores["mean_length"] == 4
    config.write_text("max_completion_length: 4\nnot_a_setting: 1\n")
    code, _ = _eval(["--config", str(config)], tmp_path)
    assert code == 2 and "--not_a_setting" in capsys.readouterr().err


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_a_fresh_run_in_a_used_output_dir_has_its_own_log_and_card(tiny_model_dir, tmp_path, monkeypatch):
    """A second run in the output_dir of an earlier one: `trl-vapo plot` read the earlier run's later steps spliced
    after this run's (`vapo_logs.jsonl` was only appended to), and the model card reported the earlier run's value
    pretraining, and pointed at its critic, for a run that did none. On Windows, with the log open in a program
    that shares no deletion (a tail, an editor), the new log's replace of it is refused: it is written over in
    place (the PermissionError stopped the run at its first log); a stand-in for Windows' refusal here."""
    from helpers import digit_fraction, make_args, prompts_dataset

    from trl_vapo import VAPOTrainer
    from trl_vapo.checkpoint import PRETRAINED_CRITIC_DIR
    from trl_vapo.diagnostics import read_logs
    from trl_vapo.modeling import VALUE_PRETRAINING_FILE

    out = tmp_path / "out"
    first = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, max_steps=2), prompts_dataset())
    first.train()
    assert [entry["step"] for entry in read_logs(out) if "phase" in entry] == [1, 2]
    (out / PRETRAINED_CRITIC_DIR).mkdir()  # as an earlier run's value pretraining left it
    record = {"rollouts": 50, "final_explained_variance": 0.6}
    (out / PRETRAINED_CRITIC_DIR / VALUE_PRETRAINING_FILE).write_text(json.dumps(record))

    replace = os.replace

    def log_held_open(source, target):
        if Path(target).name == "vapo_logs.jsonl":
            raise PermissionError(13, "The process cannot access the file because it is being used")
        return replace(source, target)

    monkeypatch.setattr(os, "replace", log_held_open)
    second = VAPOTrainer(str(tiny_model_dir), digit_fraction, make_args(tmp_path, max_steps=1), prompts_dataset())
    second.train()
    monkeypatch.undo()
    assert not list(out.glob(".vapo_logs.jsonl*"))
    logged = [entry for entry in read_logs(out) if "phase" in entry]
    assert [entry["step"] for entry in logged] == [1]
    assert logged[0]["loss"] == next(h["loss"] for h in second.state.log_history if "loss" in h)
    second.save_model(str(out))
    card = (out / "README.md").read_text()
    assert "off (`value_pretrain_steps=0`)" in card
    assert "ran 50" not in card and PRETRAINED_CRITIC_DIR not in card


def test_a_card_written_during_value_pretraining_reads_its_stop_rules_mean(tiny_model_dir, tmp_path):
    """A card written while value pretraining runs (a checkpoint's, pushed with it) took the last log's mean, of as
    many readings as `logging_steps` held, and called it "its last reading": it reads what the stop rule reads, the
    median of its last `value_pretrain_patience` readings, as the card at the phase's end does."""
    from helpers import digit_fraction, make_args, prompts_dataset
    from transformers import TrainerCallback

    from trl_vapo import VAPOTrainer

    cards = {}

    class CardAtStepFour(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                trainer.create_model_card()
                readings = trainer.progress.explained_variances
                cards["card"] = (Path(args.output_dir) / "README.md").read_text()
                cards["expected"] = sorted(readings[-3:])[1], len(readings), trainer.progress.value_pretrain_rollouts

    args = make_args(tmp_path, max_steps=1, value_pretrain_steps=6, value_pretrain_patience=3, logging_steps=3)
    trainer = VAPOTrainer(str(tiny_model_dir), digit_fraction, args, prompts_dataset(), callbacks=[CardAtStepFour()])
    trainer.train()
    median, count, rollouts = cards["expected"]
    assert count == 4  # one reading a rollout's end, one step a rollout: the log at step 3 held the first three
    said = f"ran {rollouts} rollouts, final explained variance {median:.3f} (median of its last 3 readings, each taken"
    assert said in cards["card"], cards["card"]


def test_a_rollout_where_no_token_trains_reads_no_value_and_no_advantage():
    """Every completion unscored (or truncated and masked): the critic's mean value and the mean advantage read 0.0,
    a reading of nothing that pulled a log window's mean toward 0 beside the NaN of the accuracy and of lambda."""
    from trl_vapo.metric_names import RL
    from trl_vapo.rollout import Rollout, rollout_metrics
    from trl_vapo.scoring import Scores

    n, c = 4, 3
    nothing = torch.zeros(n, dtype=torch.bool)
    rollout = Rollout(
        phase=RL,
        input_ids=torch.ones(n, 1 + c, dtype=torch.long),
        attention_mask=torch.ones(n, 1 + c, dtype=torch.long),
        prompt_length=1,
        truncated=nothing,
        scores=Scores(torch.full((n, 1), math.nan), torch.zeros(n), nothing, ["r"]),
        action_mask=torch.ones(n, c, dtype=torch.long),
        loss_mask=torch.zeros(n, c),
        is_correct=nothing,
        is_positive=nothing,
        old_values=torch.full((n, c), 0.7),
        returns=torch.zeros(n, c),
        raw_advantages=torch.full((n, c), 0.3),
        advantages=torch.zeros(n, c),
        lambda_actor=torch.ones(n),
        group_size=2,
    )
    metrics = rollout_metrics(rollout, lambda tensor: tensor, None)
    for name in ("value/mean", "advantages/mean", "accuracy", "lambda_actor/mean"):
        assert math.isnan(metrics[name]), name
    rollout.loss_mask[0] = 1  # one completion's tokens train: its readings
    metrics = rollout_metrics(rollout, lambda tensor: tensor, None)
    assert metrics["value/mean"] == pytest.approx(0.7) and metrics["advantages/mean"] == pytest.approx(0.3)


def test_the_card_says_how_many_readings_the_final_explained_variance_averages():
    """With the paper's `value_pretrain_patience=None` the final explained variance is the last reading alone, which
    the card called "the mean of its last readings"; with the stop rule's window, the median of that many."""
    from trl_vapo.model_card import _value_pretraining_outcome
    from trl_vapo.run import TrainingProgress

    progress = TrainingProgress()
    progress.explained_variances = [0.1, math.nan, 0.2, 0.9]
    assert (progress.final_readings(None), progress.final_readings(2), progress.final_readings(10)) == (1, 2, 3)
    assert progress.final_explained_variance(None) == 0.9
    assert progress.final_explained_variance(3) == 0.2  # the median (the mean, 0.4, moved with one reading)
    for window, said in ((None, "(its last reading, taken"), (2, "(median of its last 2 readings, each taken")):
        record = {
            "rollouts": 4,
            "final_explained_variance": progress.final_explained_variance(window),
            "final_readings": progress.final_readings(window),
            "final_statistic": "median",
        }
        assert said in _value_pretraining_outcome(record), _value_pretraining_outcome(record)
    # A record of an earlier version (the mean, the statistic unnamed) is said to hold the mean.
    earlier = {"rollouts": 4, "final_explained_variance": 0.4, "final_readings": 3}
    assert "(mean of its last 3 readings, each taken" in _value_pretraining_outcome(earlier)
