"""The learning benchmark (``benchmarks/bench_learning.py``): its statistics, its protocol and a ``--quick`` run."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import TrainerControl, TrainerState

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_learning.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_learning"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


# ---------------------------------------------------------------------------------------------------------------------
# The credit-assignment statistic
# ---------------------------------------------------------------------------------------------------------------------


def _direct(advantages: torch.Tensor, mask: torch.Tensor, first_wrong: list[int | None]) -> dict[str, float]:
    """The same statistic by boolean masks over the padded batch: an independent implementation to check against."""
    n, c = advantages.shape
    positions = torch.arange(c)[None, :].expand(n, c)
    wrong_at = torch.tensor([-1 if w is None else w for w in first_wrong])[:, None]
    valid = mask.bool()
    located = (wrong_at >= 0) & (wrong_at < mask.sum(dim=1, keepdim=True))
    groups = {
        "at_first_wrong": valid & located & (positions == wrong_at),
        "wrong_before": valid & located & (positions < wrong_at),
        "wrong_after": valid & located & (positions > wrong_at),
        "correct": valid & (wrong_at < 0),
    }
    groups["wrong_other"] = groups["wrong_before"] | groups["wrong_after"]
    out = {k: advantages[g].mean().item() if g.any() else math.nan for k, g in groups.items()}
    ranks = []
    for i in range(n):
        if located[i, 0]:
            at = advantages[i, wrong_at[i, 0]]
            others = advantages[i][groups["wrong_other"][i]]
            if len(others):
                ranks.append(((others > at).float() + 0.5 * (others == at).float()).mean().item())
    out["slip_rank"] = sum(ranks) / len(ranks) if ranks else math.nan
    return out


def test_credit_assignment_matches_a_direct_computation_on_a_padded_batch():
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3, 12, 7, 12, 1, 8]
    first_wrong = [2, None, 0, 11, None, 12, 0, 30]  # 12 and 30: past the end (EOS missing, cut), not located
    advantages = torch.randn(len(lengths), 12, generator=generator)
    mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).float()
    padded = advantages.masked_fill(mask == 0, 99.0)  # padding must never leak into any mean
    stats = bench.credit_assignment(padded.tolist(), first_wrong, lengths)
    expected = _direct(advantages, mask, first_wrong)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, abs=1e-6), key
    assert stats["num_wrong"] == 4 and stats["num_wrong_unlocated"] == 2 and stats["num_correct"] == 2


def test_a_sequence_level_advantage_does_not_localise_and_a_critic_like_one_does():
    lengths = [6, 6, 6, 6]
    first_wrong = [1, 4, None, None]
    sequence = [[-1.0] * 6, [-0.5] * 6, [0.7] * 6, [0.2] * 6]
    stats = bench.credit_assignment(sequence, first_wrong, lengths)
    assert stats["slip_rank"] == 0.5
    assert stats["at_first_wrong"] == pytest.approx(stats["wrong_other"])
    localised = [[0, -2.0, 0.1, 0, 0, 0], [0.1, 0, 0, 0.2, -3.0, 0], [0.3] * 6, [0.1] * 6]
    stats = bench.credit_assignment(localised, first_wrong, lengths)
    assert stats["slip_rank"] == 1.0
    assert stats["at_first_wrong"] == pytest.approx(-2.5)
    assert stats["wrong_before"] == pytest.approx((0 + 0.1 + 0 + 0 + 0.2) / 5)


def test_the_value_drop_at_the_first_slip_reads_the_values_across_the_decisive_token():
    values = [[0.5, 0.4, -0.6, -0.7], [0.9, 1.0, 1.0], [0.2, 0.1, 0.0, 0.0]]
    # Row 0 slips at 1: -0.6 - 0.4; row 1 is right; row 2's decisive token is its last: nothing after it to read.
    assert bench.value_drop_at_first_wrong(values, [1, None, 3], [4, 3, 4]) == pytest.approx(-1.0)
    assert math.isnan(bench.value_drop_at_first_wrong(values, [None, None, 3], [4, 3, 4]))


def test_completion_texts_map_tokens_to_characters_and_strip_eos():
    from trl_vapo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    ids = tokenizer("a 00+7=07 uv", add_special_tokens=False).input_ids
    chat = tokenizer.convert_tokens_to_ids("<|im_start|>")
    rows = [ids + [tokenizer.eos_token_id, tokenizer.pad_token_id], ids[:3] + [chat] + ids[4:]]
    texts = bench.completion_texts(tokenizer, rows, [len(ids) + 1, len(ids)])
    assert texts[0] == "a 00+7=07 uv"
    assert texts[1] == "a 0\x00+7=07 uv" and len(texts[1]) == len(ids)


def test_vapo_rollouts_are_counted_once_each_however_they_are_reported():
    """The stop-gap wrapper and a future trainer event may both report a rollout: it counts once; and successive
    rollouts (whose objects may reuse a freed object's id) each count. Only the fields the proposed ``on_rollout``
    event documents are read: ids, attention mask, prompt length, advantages, values and phase."""
    from types import SimpleNamespace

    from trl_vapo.demo.chains import render_prompt
    from trl_vapo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    prompt = render_prompt((7, 5))
    prompt_ids = [tokenizer.pad_token_id] * 2 + tokenizer(prompt, add_special_tokens=False).input_ids  # left-padded
    completion = tokenizer("a 00+7=07 uv", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt_ids + completion])
    attention = (ids != tokenizer.pad_token_id).long()

    def rollout(phase="rl"):
        return SimpleNamespace(
            input_ids=ids,
            attention_mask=attention,
            prompt_length=len(prompt_ids),
            phase=phase,
            advantages=torch.randn(1, len(completion)),
            old_values=torch.randn(1, len(completion)),
        )

    curve = bench.LearningCurve(None, None, None, 64)
    credit = bench.CreditAssignment(tokenizer, curve)
    state, control = TrainerState(), TrainerControl()
    for step, rows in ((0, [{"prompt": prompt}]), (0, None), (4, None), (8, [{"prompt": prompt}]), (8, None)):
        state.global_step = step
        credit.on_rollout(None, state, control, rollout=rollout(), rows=rows)
    state.global_step = 12
    credit.on_rollout(None, state, control, rollout=rollout("value_pretrain"))
    assert len(credit.per_rollout) == 3
    # The completion stops after its first line: wrong at its EOS (index 12), where the second line belongs; the
    # prompt decoded from the rollout (rows=None) gives the same verdict as the data set row.
    assert all(r["num_wrong"] == 1 and r["num_correct"] == 0 for r in credit.per_rollout)


# ---------------------------------------------------------------------------------------------------------------------
# Protocol: plans, the learning-rate choice, the evaluation sets
# ---------------------------------------------------------------------------------------------------------------------


def test_protocol_plan_tunes_every_baseline_alike_and_reports_on_other_seeds():
    settings = {**bench.PROTOCOL, "methods": list(bench.METHODS)}
    tune = bench.plan("tune", settings, None)
    assert {s.eval_set for s in tune} == {"validation"}
    for task in settings["tasks"]:
        grids = {
            m: sorted(s.learning_rate for s in tune if s.task == task and s.method == m and not s.variant)
            for m in settings["tuned_methods"]
        }
        assert set(grids) == {"vapo", "ppo", "grpo", "grpo-16x4", "grpo-32x2"}
        assert all(grid == grids["vapo"] for grid in grids.values())  # the same sweep for each
        budgets = {m: sum(s.task == task and s.method == m for s in tune) for m in settings["tuned_methods"]}
        assert len(set(budgets.values())) == 1  # and the same number of runs
    chosen = {
        task: {
            "vapo": {"learning_rate": 3e-4, "variant": ""},
            "ppo": {"learning_rate": 1e-4, "variant": ""},
            "grpo": {"learning_rate": 3e-5, "variant": ""},
            "grpo-16x4": {"learning_rate": 1e-4, "variant": "scale-batch"},
            "grpo-32x2": {"learning_rate": 1e-4, "variant": ""},
        }
        for task in settings["tasks"]
    }
    report = bench.plan("report", settings, chosen)
    assert {s.seed for s in report}.isdisjoint({s.seed for s in tune})
    # Protocol 2: at least five fresh reporting seeds, none a tuning seed or one reported under protocol 1; the
    # decisive arms ten (no best-tuned GRPO frozen here: the oracle and critic-free arms).
    seeds = set(settings["decisive_seeds"])
    assert set(settings["reporting_seeds"]) < seeds and len(seeds) == 10
    assert seeds.isdisjoint(settings["tuning_seeds"]) and seeds.isdisjoint(settings["spent_seeds"])
    decisive = {"oracle-64x1", "critic-free-64x1"}
    per_task = (len(bench.METHODS) - len(decisive)) * len(settings["reporting_seeds"]) + len(decisive) * len(seeds)
    assert len(report) == len(settings["tasks"]) * per_task
    assert {s.eval_set for s in report} == {"test"}
    lrs = {(s.method, s.learning_rate) for s in report}
    assert ("grpo", 3e-5) in lrs and ("ppo", 1e-4) in lrs and ("no-clip-higher", 3e-4) in lrs
    assert {s.variant for s in report if s.method == "grpo-16x4"} == {"scale-batch"}
    assert len({s.path(Path("out")) for s in tune + report}) == len(tune) + len(report)
    # Group sampling off keeps the samples per rollout; vanilla PPO switches all seven techniques off.
    assert bench.METHODS["no-group-sampling"] == {"num_generations": 1}
    assert set(bench.METHODS["ppo"]) >= {
        "value_pretrain_steps",
        "lam_critic",
        "length_adaptive_alpha",
        "loss_type",
        "epsilon_high",
        "nll_coef",
        "num_generations",
    }


def test_tuning_choice_uses_the_last_two_points_and_prefers_the_recipe_then_the_lower_rate_on_ties():
    def record(task, method, lr, seed, accuracies, variant=""):
        return {
            "spec": {"task": task, "method": method, "learning_rate": lr, "seed": seed, "variant": variant},
            "points": [{"avg@k": a} for a in accuracies],
        }

    records = [
        record("demo", "vapo", 1e-4, 1000, [0.4, 0.9, 0.5, 0.5]),  # a lucky early point does not count: 0.5
        record("demo", "vapo", 3e-4, 1000, [0.4, 0.5, 0.6, 0.7]),  # 0.65
        record("demo", "vapo", 1e-4, 1000, [0.4, 0.5, 0.7, 0.7], variant="critic-x4"),  # 0.7: the best
        record("demo", "grpo", 1e-4, 1000, [0.4, 0.6, 0.6]),
        record("demo", "grpo", 3e-4, 1000, [0.4, 0.6, 0.6]),  # tie: the lower rate wins
        record("demo", "grpo", 1e-4, 1000, [0.4, 0.6, 0.6], variant="scale-batch"),  # tie: the recipe wins
        record("demo", "ppo", 1e-4, 1000, [0.4, 0.8, 0.8]),
        record("demo", "ppo", 1e-4, 1001, [0.4, 0.2, 0.2]),  # averaged over tuning seeds: 0.5
        record("demo", "ppo", 3e-5, 1000, [0.4, 0.55, 0.55]),
    ]
    chosen = bench.choose_settings(records)["demo"]
    assert {m: (c["learning_rate"], c["variant"]) for m, c in chosen.items()} == {
        "vapo": (1e-4, "critic-x4"),
        "grpo": (1e-4, ""),
        "ppo": (3e-5, ""),
    }
    assert chosen["vapo"]["validation"] == pytest.approx(0.7)
    # The tuning table marks exactly the chosen rows.
    table = bench.format_tuning(records, {"demo": chosen}).splitlines()
    marked = [line.split()[:4] for line in table if line.endswith("*")]
    assert marked == [
        ["demo", m, v, lr] for m, v, lr in (("grpo", "recipe", "0.0001"), ("ppo", "recipe", "3e-05"))
    ] + [["demo", "vapo", "critic-x4", "0.0001"]]


def test_every_tuned_method_gets_the_same_tuning_budget():
    settings = {**bench.PROTOCOL, "tasks": ["demo"], "tuning_seeds": [1000]}
    runs = bench.plan("tune", settings, None)
    per_method = {m: sum(r.method == m for r in runs) for m in settings["tuned_methods"]}
    assert len(set(per_method.values())) == 1 and per_method["grpo"] == len(settings["lr_grid"]) + 3
    assert all(r.eval_set == "validation" for r in runs)
    # An ablation inherits VAPO's chosen variant, and its own switch wins over it.
    spec = bench.RunSpec(
        "report", "demo", "no-value-pretrain", 0, 1e-4, 35, 5, 4, 200, "test", variant="pretrain5-critic-x4"
    )
    assert spec.overrides() == {"critic_num_iterations": 4, "value_pretrain_steps": 0}
    # A frozen value function drops the variant's critic settings, not its policy's; the GRPO arms take GRPO's.
    for variant, kept in (("replay-pretrain20", {}), ("lora-replay-pretrain20", {"lora_r": 16})):
        oracle = bench.RunSpec("report", "chains", "oracle-64x1", 0, 1e-4, 35, 5, 4, 200, "test", variant=variant)
        assert oracle.overrides() == {**kept, "num_generations": 1, "value_model": "oracle"}
    grpo = bench.RunSpec("report", "chains", "grpo-32x2", 0, 1e-4, 35, 5, 4, 200, "test", variant="iterations-2")
    assert grpo.overrides() == {"num_iterations": 2, "num_generations": 2}


def test_tuning_one_method_at_a_time_adds_its_choice_and_never_rechooses():
    settings = {**bench.PROTOCOL, "methods": ["vapo", "grpo-16x4", "no-value-pretrain"]}
    assert {s.method for s in bench.plan("tune", settings, None)} == {"vapo", "grpo-16x4"}  # tuned ones only
    frozen = {"demo": {"vapo": {"learning_rate": 1e-4, "variant": ""}}}
    chosen = {
        "demo": {"vapo": {"learning_rate": 3e-4, "variant": ""}, "grpo": {"learning_rate": 3e-5, "variant": ""}},
        "chains": {"vapo": {"learning_rate": 3e-5, "variant": ""}},
    }
    assert bench.keep_frozen(chosen, frozen) == {
        "chains": {"vapo": {"learning_rate": 3e-5, "variant": ""}},
        "demo": {"vapo": {"learning_rate": 1e-4, "variant": ""}, "grpo": {"learning_rate": 3e-5, "variant": ""}},
    }


def test_the_lora_critic_variant_trains_adapters_at_its_own_rates(tmp_path):
    """The tuning variant with the shared-base LoRA critic builds that trainer: a LoRA policy at the variant's actor
    rate, a critic adapter on the same frozen base at its critic rate, and the variant's value pretraining."""
    from trl_vapo.rewards import math_reward

    lr = bench.TUNING_VARIANTS["vapo"]["lora-replay-pretrain20"]["learning_rate"]
    spec = bench.RunSpec("tune", "demo", "vapo", 1000, lr, 35, 5, 4, 0, "validation", variant="lora-replay-pretrain20")
    trainer, _ = bench.build_trainer(spec, str(tmp_path), math_reward)
    args = trainer.args
    assert (args.learning_rate, args.critic_learning_rate) == (1e-3, 1e-3)
    assert (args.value_pretrain_steps, args.value_pretrain_num_iterations, args.value_pretrain_replay) == (20, 8, 7)
    assert args.max_steps == (35 - 20) * 4 * 4  # RL rollouts x optimizer steps x critic passes
    trainable = [name for name, p in trainer.model_wrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name or "value_head" in name for name in trainable)
    assert any("value_head" in name for name in trainable)
    # The full-copy variant names its critic rate; the sweep's runs keep the recipe's ratio.
    replay = bench.RunSpec("tune", "demo", "vapo", 1000, 1e-4, 35, 5, 4, 0, "validation", variant="replay-pretrain20")
    assert bench.build_trainer(replay, str(tmp_path), math_reward)[0].args.critic_learning_rate == 1e-4
    sweep = bench.RunSpec("tune", "demo", "vapo", 1000, 3e-5, 35, 5, 4, 0, "validation")
    assert bench.build_trainer(sweep, str(tmp_path), math_reward)[0].args.critic_learning_rate == pytest.approx(3e-4)


def tuning_record(spec, accuracy: float) -> dict:
    return {"spec": asdict(spec), "points": [{"avg@k": 0.1}, {"avg@k": accuracy}, {"avg@k": accuracy}]}


def test_the_best_tuned_grpo_is_chosen_on_validation_frozen_and_is_the_primary_comparator(tmp_path, capsys):
    """Of the three GRPO arms, the best by the tuning criterion is frozen in chosen.json as `best-grpo`: the arm every
    other is compared with, the one `--methods best-grpo` reports, on the decisive arms' ten seeds."""
    tied = {"grpo": {"validation": 0.6}, "grpo-16x4": {"validation": 0.7}, "grpo-32x2": {"validation": 0.7}}
    assert bench.choose_best_grpo(tied) == {"method": "grpo-16x4", "validation": 0.7}  # a tie: the larger group
    assert bench.choose_best_grpo({m: tied[m] for m in ("grpo", "grpo-32x2")}) is None  # until all three are tuned

    out = tmp_path / "protocol"
    settings = {**bench.PROTOCOL, "tasks": ["demo"], "methods": list(bench.GRPO_METHODS)}
    best_at_1e4 = {"grpo": 0.5, "grpo-16x4": 0.8, "grpo-32x2": 0.6}
    for spec in bench.plan("tune", settings, None):  # every tuning run done: the stage only chooses
        recipe = not spec.variant and spec.learning_rate == 1e-4
        spec.path(out).parent.mkdir(parents=True, exist_ok=True)
        bench.write_record(tuning_record(spec, best_at_1e4[spec.method] if recipe else 0.2), spec.path(out))
    # A sweep not yet whole (another call still running it) is not chosen from, nor the best-tuned GRPO.
    unfinished = next((out / "tune" / "demo" / "grpo-32x2").glob("*.json"))
    kept = unfinished.read_text()
    unfinished.unlink()
    assert bench.main(["--stage", "tune", "--tasks", "demo", "--methods", "grpo", "--out", str(out)]) == 0
    assert set(json.loads((out / "chosen.json").read_text())["demo"]) == {"grpo", "grpo-16x4"}
    (out / "chosen.json").unlink()
    unfinished.write_text(kept)
    tune = ["--stage", "tune", "--tasks", "demo", "--methods", ",".join(bench.GRPO_METHODS), "--out", str(out)]
    assert bench.main(tune) == 0
    chosen = json.loads((out / "chosen.json").read_text())
    assert chosen["demo"]["best-grpo"] == {"method": "grpo-16x4", "validation": pytest.approx(0.8)}
    # Frozen: a later tuning stage adds choices and never re-chooses this one.
    chosen["demo"]["best-grpo"]["method"] = "grpo-32x2"
    (out / "chosen.json").write_text(json.dumps(chosen))
    assert bench.main(tune) == 0
    assert json.loads((out / "chosen.json").read_text())["demo"]["best-grpo"]["method"] == "grpo-32x2"
    chosen["demo"]["best-grpo"]["method"] = "grpo-16x4"
    (out / "chosen.json").write_text(json.dumps(chosen))

    # With no reporting run yet, --stage aggregate still writes tuning.txt, which names the comparator.
    assert bench.main(["--stage", "aggregate", "--tasks", "demo", "--out", str(out)]) == 0
    assert "no finished reporting runs" in capsys.readouterr().err
    assert (
        "demo: best-tuned GRPO (the primary comparator): grpo-16x4 (validation 0.800)"
        in (out / "tuning.txt").read_text()
    )

    # `best-grpo` names that arm; it and the other decisive arms get the ten decisive seeds, by either name.
    arms = bench.reporting_arms("demo", {**bench.PROTOCOL, "methods": ["best-grpo", "grpo", "oracle-64x1"]}, chosen)
    decisive, reporting = bench.PROTOCOL["decisive_seeds"], bench.PROTOCOL["reporting_seeds"]
    assert arms == {"grpo-16x4": decisive, "grpo": reporting, "oracle-64x1": decisive}
    assert bench.reporting_arms("demo", {**bench.PROTOCOL, "methods": ["grpo-16x4"]}, chosen) == {
        "grpo-16x4": decisive
    }

    # Aggregated, every arm is compared with it (paired on the seeds both ran), and the table says so.
    curves = {"grpo": [0.2, 0.5], "grpo-16x4": [0.2, 0.6], "vapo": [0.2, 0.7], "no-group-sampling": [0.2, 0.4]}
    records = [synthetic_record("demo", m, seed, accs) for m, accs in curves.items() for seed in (2000, 2001)]
    summary = bench.aggregate(records, {"demo": "grpo-16x4"})["demo"]
    assert set(summary["grpo"]["differences"]) == {"grpo-16x4"} and summary["grpo-16x4"]["differences"] == {}
    assert set(summary["vapo"]["differences"]) == {"grpo-16x4"}
    assert set(summary["no-group-sampling"]["differences"]) == {"grpo-16x4", "vapo"}
    assert summary["vapo"]["grpo_target"] == pytest.approx(0.6)
    table = bench.format_table(bench.aggregate(records, {"demo": "grpo-16x4"}), 4)
    assert "reaches the final mean of GRPO 16x4 (the primary comparator), 0.600" in table
    # Every table labels the untuned arms: no-group-sampling ran with VAPO's choice.
    rows = [line for line in table.splitlines() if line.startswith(("VAPO ", "GRPO 16x4", "w/o group sampling"))]
    assert sum(line.startswith("w/o group sampling (untuned) ") for line in rows) == 5  # the four tables' rows
    assert not any("(untuned)" in line for line in rows if not line.startswith("w/o group sampling"))
    assert "no best-tuned GRPO frozen: GRPO 8x8" in bench.format_table(bench.aggregate(records), 4)


def test_reporting_refuses_spent_seeds_and_arms_without_their_frozen_choice(tmp_path, capsys):
    chosen = {"demo": {"vapo": {"learning_rate": 1e-4, "variant": "pretrain5-critic-x4", "validation": 0.8}}}
    (tmp_path / "chosen.json").write_text(json.dumps(chosen))

    def refused(*args: str) -> str:
        with pytest.raises(SystemExit) as stop:
            bench.main(["--stage", "report", "--tasks", "demo", "--out", str(tmp_path), *args])
        assert stop.value.code == 2
        return capsys.readouterr().err

    says = "a tuning seed ([1000, 1001, 1002]) or one reported under protocol 1"
    assert f"--seeds 1000: {says}" in refused("--seeds", "2000,1000")
    assert "--seeds 1002:" in refused("--seeds", "1002,2000")  # the critic probes' (bench_critic.py), which tuned too
    assert "--seeds 0,2:" in refused("--seeds", "0,2005,2")
    # Tuning seeds named among the protocol's reporting seeds: refused too (the check ran for --seeds alone).
    assert "the protocol's reporting seeds 2000: a tuning seed ([1000, 1001, 1002, 2000])" in refused(
        "--tuning-seeds", "2000"
    )
    # A tuned arm reports only with its own choice (it fell back to VAPO's, which a PPO or GRPO worker cannot run).
    assert "demo/ppo reports with its own frozen choice, and chosen.json has none: run --stage tune" in refused(
        "--methods", "vapo,ppo"
    )
    assert "demo: chosen.json has no best-tuned GRPO; tune the three GRPO arms first" in refused(
        "--methods", "best-grpo"
    )
    # --no-tune has no tuned choice to resolve best-grpo with: it names the way out, not a tuning it was told to skip.
    assert "--no-tune reports every arm at the recipe's settings, and best-grpo is a choice tuning makes" in refused(
        "--no-tune", "--methods", "best-grpo"
    )
    assert not (tmp_path / "report").exists()  # refused before any run
    # An untuned arm takes VAPO's, and is refused where VAPO has none.
    assert bench._reporting_choice("demo", "no-group-sampling", chosen) == (1e-4, "pretrain5-critic-x4")
    with pytest.raises(bench.MissingChoice, match="chains/no-group-sampling reports with VAPO's"):
        bench._reporting_choice("chains", "no-group-sampling", {"chains": {}})
    # Aggregating protocol 1's spent seeds reruns nothing: allowed.
    assert bench.main(["--stage", "aggregate", "--tasks", "demo", "--seeds", "0,1,2", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("task", ["demo", "chains"])
def test_validation_and_reporting_sets_are_disjoint_held_out_problems(task):
    common = {
        "stage": "tune",
        "task": task,
        "method": "vapo",
        "seed": 0,
        "learning_rate": 1e-4,
        "rollouts": 1,
        "eval_every": 1,
        "eval_k": 1,
        "eval_problems": 200,
        "validation_problems": 200,
    }
    test = bench.eval_dataset(bench.RunSpec(eval_set="test", **common))
    validation = bench.eval_dataset(bench.RunSpec(eval_set="validation", **common))
    assert len(test) == 200 and len(validation) == 200
    assert set(test["prompt"]).isdisjoint(validation["prompt"])
    assert set(test["prompt"]) == set(bench.task_module(task).build_split("held_out", 200)["prompt"])
    trained = set(bench.task_module(task).build_split("train", 4096)["prompt"])  # what every run trains on
    assert trained.isdisjoint(test["prompt"]) and trained.isdisjoint(validation["prompt"])


# ---------------------------------------------------------------------------------------------------------------------
# Protocol 2's statistics: the area under the curve and paired differences with t intervals
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("probability", "df", "quantile"),
    [(0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 4, 2.7764), (0.975, 10, 2.2281), (0.975, 30, 2.0423)]
    + [(0.8, 2, 1.0607), (0.8, 4, 0.9410), (0.8, 9, 0.8834)],  # for the detectable difference (80% power)
)
def test_t_quantile_matches_the_table(probability, df, quantile):
    assert bench.t_quantile(probability, df) == pytest.approx(quantile, abs=1e-4)
    with pytest.raises(ValueError, match=r"in \(0.5, 1\)"):
        bench.t_quantile(1 - probability, df)  # a lower quantile is never what a caller wants here


def test_a_paired_difference_pairs_by_seed_not_by_place():
    """Arms run 5 or 10 seeds, and a run can be missing in the middle: differences pair the seeds both ran. Paired by
    place in the lists, seed 2002's 0.9 would meet seed 2003's 0.5."""
    arm = {2000: 0.8, 2001: 0.7, 2002: 0.9, 2003: 0.6}
    comparator = {2000: 0.7, 2001: 0.6, 2003: 0.5}  # 2002 missing
    mean, low, high, n = bench.paired_difference(arm, comparator)
    assert n == 3 and mean == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)
    summary = bench.aggregate(
        [synthetic_record("demo", "vapo", seed, [0.2, final]) for seed, final in arm.items()]
        + [synthetic_record("demo", "grpo", seed, [0.2, final]) for seed, final in comparator.items()],
        {"demo": "grpo"},
    )["demo"]
    assert summary["vapo"]["differences"]["grpo"]["final"][:2] == pytest.approx((0.1, 0.1))


def test_a_paired_ratio_is_the_geometric_mean_of_the_per_seed_ratios_with_a_t_interval():
    """Times and memory as ratios to the comparator, paired by seed (they were ratios of means, without an
    interval): the interval of the mean log-ratio, taken back by exp, over the seeds both arms ran."""
    arm = {2000: 250.0, 2001: 240.0, 2002: 260.0, 2003: 230.0, 2005: 999.0}  # 2005: the comparator did not run it
    comparator = {2000: 100.0, 2001: 110.0, 2002: 100.0, 2003: 95.0, 2004: 90.0}
    logs = [math.log(arm[s] / comparator[s]) for s in (2000, 2001, 2002, 2003)]
    half = 3.1824 * statistics.stdev(logs) / 2  # t_{0.975, 3} (the table's, to 4 decimals) * sd / sqrt(4)
    mean, low, high, n = bench.paired_ratio(arm, comparator)
    centre = statistics.mean(logs)
    assert n == 4 and mean == pytest.approx(math.exp(centre))
    assert (low, high) == pytest.approx((math.exp(centre - half), math.exp(centre + half)), rel=1e-5)
    assert low < mean < high and mean != pytest.approx(sum(logs) / 4)  # a ratio, not a log
    assert math.isnan(bench.paired_ratio({1: math.nan}, {1: 1.0})[0])  # no peak memory recorded: no ratio
    one = bench.paired_ratio({1: 2.0}, {1: 1.0})
    assert one[0] == pytest.approx(2.0) and math.isnan(one[1]) and one[3] == 1  # one common seed: no interval


def synthetic_record(task, method, seed, accuracies, samples_per_point=320):
    points = [
        {"samples": i * samples_per_point, "avg@k": acc, "train_time_s": float(i), "pass@1": acc}
        for i, acc in enumerate(accuracies)
    ]
    spec = {"task": task, "method": method, "seed": seed, "learning_rate": 1e-4, "variant": ""}
    return {
        "spec": spec,
        "points": points,
        "samples": points[-1]["samples"],
        "train_time_s": 1.0,
        "credit_summary": {},
    }


def test_aggregate_pairs_each_method_with_grpo_and_each_ablation_with_vapo_by_seed():
    curves = {  # per method: per seed, avg@k at 0, 320 and 640 samples
        "grpo": {0: [0.2, 0.4, 0.6], 1: [0.2, 0.5, 0.7], 2: [0.2, 0.3, 0.5]},
        "vapo": {0: [0.2, 0.5, 0.7], 1: [0.2, 0.5, 0.9], 2: [0.2, 0.3, 0.8]},
        "no-clip-higher": {0: [0.2, 0.5, 0.6], 1: [0.2, 0.5, 0.8]},  # seed 2 missing: paired on 0 and 1
    }
    records = [
        synthetic_record("demo", method, seed, accs) for method, runs in curves.items() for seed, accs in runs.items()
    ]
    summary = bench.aggregate(records)["demo"]
    assert summary["grpo"]["differences"] == {}
    assert set(summary["vapo"]["differences"]) == {"grpo"}
    assert set(summary["no-clip-higher"]["differences"]) == {"grpo", "vapo"}

    # VAPO - GRPO, final: per-seed differences 0.1, 0.2, 0.3 -> mean 0.2 +- t(2) * 0.1 / sqrt(3).
    mean, low, high, n = summary["vapo"]["differences"]["grpo"]["final"]
    assert n == 3 and mean == pytest.approx(0.2) and high - mean == pytest.approx(4.30265 * 0.1 / math.sqrt(3), 1e-4)
    assert low == pytest.approx(2 * mean - high)
    # Area under the curve: trapezoids over 640 samples, e.g. grpo seed 0: (0.3 + 0.5) * 320 / 640 = 0.4.
    assert summary["grpo"]["auc_per_seed"][0] == pytest.approx(0.4)
    auc = summary["vapo"]["differences"]["grpo"]["auc"]
    expected = [
        ((0.2 + 2 * v[1] + v[2]) - (0.2 + 2 * g[1] + g[2])) / 4
        for v, g in zip(curves["vapo"].values(), curves["grpo"].values())
    ]
    assert auc[0] == pytest.approx(sum(expected) / 3) and auc[3] == 3
    # The ablation against VAPO on the two seeds both ran: differences -0.1 and -0.1, an interval of width 0.
    mean, low, high, n = summary["no-clip-higher"]["differences"]["vapo"]["final"]
    assert (n, mean, low, high) == (2, pytest.approx(-0.1), pytest.approx(-0.1), pytest.approx(-0.1))
    table = bench.format_table(bench.aggregate(records), 4)
    assert "differences paired by seed" in table and "+0.200 [" in table


def test_aggregate_compares_every_arm_with_no_critic_and_states_cost_oracle_share_and_power():
    finals = {  # per seed; each curve is 0.2 then the final
        "grpo": [0.4, 0.5, 0.6],
        "critic-free-64x1": [0.3, 0.3, 0.3],
        "oracle-64x1": [0.7, 0.9, 0.8, 0.0],  # a fourth seed the others lack (the decisive arms' ten): not compared
        "no-group-sampling": [0.5, 0.5, 0.5],
    }
    cost = {"grpo": (10.0, 1000.0), "critic-free-64x1": (20.0, 1200.0), "oracle-64x1": (20.0, 1500.0)}
    records = []
    for method, per_seed in finals.items():
        for seed, final in enumerate(per_seed):
            record = synthetic_record("demo", method, seed, [0.2, final])
            record["train_time_s"], record["peak_rss_mib"] = (
                (99.0, 9999.0) if seed == 3 else cost.get(method, (30.0, 1100.0))
            )
            records.append(record)
    summary = bench.aggregate(records, {"demo": "grpo"})["demo"]
    # Every arm against the comparator and against no critic at 64x1, the learned and exact critics against each
    # other: each pair once (critic-free's own pairs are its partners' rows).
    assert set(summary["grpo"]["differences"]) == {"critic-free-64x1"}
    assert summary["critic-free-64x1"]["differences"] == {}
    assert set(summary["no-group-sampling"]["differences"]) == {"grpo", "critic-free-64x1"}
    assert set(summary["oracle-64x1"]["differences"]) == {"grpo", "critic-free-64x1", "no-group-sampling"}
    # Oracle - GRPO: per-seed differences 0.3, 0.4, 0.2 (sd 0.1): half-width t(2) 0.1 / sqrt(3); with 80% power the
    # test detects (t_0.975(2) + t_0.8(2)) 0.1 / sqrt(3) and more.
    difference = summary["oracle-64x1"]["differences"]["grpo"]["final"]
    assert difference[2] - difference[0] == pytest.approx(4.3027 * 0.1 / math.sqrt(3), abs=1e-4)
    assert bench.detectable_difference(difference) == pytest.approx((4.3027 + 1.0607) * 0.1 / math.sqrt(3), abs=1e-4)
    # The share of the oracle's gain over no critic, on the seeds the three ran: (0.5 - 0.3) / (0.8 - 0.3) for the
    # learned critic at 64x1.
    assert summary["no-group-sampling"]["oracle_share"]["final"] == pytest.approx(0.4)
    assert summary["oracle-64x1"]["oracle_share"]["final"] == pytest.approx(1.0)
    assert summary["critic-free-64x1"]["oracle_share"]["final"] == pytest.approx(0.0)
    # A gain that is not measurable has no share: here the oracle ends where no critic does, within its interval.
    flat = [r for r in records if r["spec"]["method"] != "oracle-64x1"]
    flat += [
        synthetic_record("demo", "oracle-64x1", seed, [0.2, final]) for seed, final in enumerate([0.3, 0.35, 0.25])
    ]
    flat_summary = bench.aggregate(flat, {"demo": "grpo"})["demo"]
    assert math.isnan(flat_summary["no-group-sampling"]["oracle_share"]["final"])
    assert "oracle's gain is not measurable" in bench.format_table({"demo": flat_summary}, 4)
    # Time and memory from the same runs, as ratios of means to the comparator's over the seeds both ran.
    assert summary["oracle-64x1"]["ratios"] == {"train_time": 2.0, "peak_rss_mib": 1.5}
    assert summary["grpo"]["ratios"] == {"train_time": 1.0, "peak_rss_mib": 1.0}
    table = bench.format_table(bench.aggregate(records, {"demo": "grpo"}), 4)
    assert (
        "(6 comparisons on demo, each at 95%, uncorrected for their number; the intervals' half-widths: final" in table
    )
    rows = [line for line in table.splitlines() if line.startswith("oracle critic 64x1")]  # each block's, in order
    cells = rows[-2].split()[4:]  # the cost block's: peak over 4 seeds; the paired ratios, each seed's the same
    assert cells == ["2.00", "1.50", "3625", "1.00", "1.00", "2.00", "[2.00,", "2.00]", "1.50", "[1.50,", "1.50]"]


def test_learning_curve_evaluates_at_rollout_boundaries():
    samples = [0]
    calls = []

    def evaluate(greedy):
        calls.append(greedy)
        time.sleep(0.2)  # evaluation time must not reach the training clock
        return {"avg@k": 0.1 * len(calls), "pass@k": 0.5, "mean_length": 10.0} | ({"pass@1": 0.3} if greedy else {})

    frozen = [True]
    curve = bench.LearningCurve(evaluate, lambda: samples[0], lambda: frozen[0], eval_every_samples=128)
    state, control = TrainerState(), TrainerControl()
    curve.on_train_begin(None, state, control)
    for rollout in range(5):  # 5 rollouts of 64, 4 optimizer steps each
        samples[0] += 64  # generated, then announced before its first optimizer step
        state.global_step = 4 * rollout
        curve.on_rollout(None, state, control, rollout=[0] * 64)  # anything with the rollout's length
        if rollout == 2:
            frozen[0] = False  # value pretraining ends after three rollouts
    state.global_step = 20
    curve.on_train_end(None, state, control)
    assert [p["samples"] for p in curve.points] == [0, 128, 256, 320]
    assert [p["evaluated"] for p in curve.points] == [True, False, True, True]  # the frozen point reuses the start
    assert curve.points[1]["avg@k"] == curve.points[0]["avg@k"]
    assert calls == [False, False, True] and "pass@1" in curve.points[-1]
    assert [p["step"] for p in curve.points] == [0, 8, 16, 20]
    # (0.6 s evaluated, and at most 0.5 s counted as training: a scheduler's stall is no failure, a leak is)
    assert curve.excluded >= 0.6 and curve.points[-1]["train_time_s"] < 0.5


# ---------------------------------------------------------------------------------------------------------------------
# End to end: --quick
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    if not (bench.CHAINS_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the chains cold-start model is missing from {bench.CHAINS_MODEL_DIR}")
    out = tmp_path_factory.mktemp("quick")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = "".join(p.read_text()[-3000:] for p in out.glob("report/*/*/*.log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    return out, proc.stdout


def test_quick_writes_one_sane_curve_per_run(quick_run):
    out, _ = quick_run
    runs = sorted(out.glob("report/*/*/*.json"))
    expected = {("demo", "vapo"), ("demo", "grpo")} | {("chains", m) for m in bench.ARMS}
    assert {(p.parts[-3], p.parts[-2]) for p in runs} == expected
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bench.ROOT, capture_output=True, text=True).stdout.strip()
    for path in runs:
        record = json.loads(path.read_text())
        assert record["code_commit"] is None if not head else record["code_commit"].split("+")[0] == head
        spec = record["spec"]
        # The record says what ran: the trainer, its whole config, the value function, the final metrics.
        grpo = spec["method"] in bench.GRPO_METHODS
        assert record["trainer"] == ("GRPOTrainer" if grpo else "VAPOTrainer")
        config = record["config"]
        assert config["learning_rate"] == spec["learning_rate"] and config["seed"] == spec["seed"]
        assert config["num_generations"] == bench.METHODS[spec["method"]].get("num_generations", 8)
        assert record["value_model"] == bench.METHODS[spec["method"]].get("value_model")
        assert record["final"] == record["points"][-1]
        assert record["peak_rss_mib"] is None  # runs sharing the driver's process: its peak is not one run's
        budget = spec["rollouts"] * spec["samples_per_rollout"]
        assert record["samples"] == budget  # value pretraining counted: VAPO and GRPO generated alike
        points = record["points"]
        assert [p["samples"] for p in points] == [0, 16, 32]
        assert all(0.0 <= p["avg@k"] <= 1.0 for p in points) and "pass@1" in points[-1]
        times = [p["train_time_s"] for p in points]
        assert times == sorted(times) and times[-1] < record["total_time_s"]
        logs = record["log_history"]
        assert logs
        pretrained = any(h.get("phase") == "value_pretrain" for h in logs)
        assert pretrained == (spec["method"] in ("vapo", "no-group-sampling", "vapo-paper"))
        if pretrained:
            assert points[1]["evaluated"] is False  # after the value-pretraining rollout: the policy is unchanged
        credit = record["credit_summary"]
        assert credit["rollouts"] == (1 if pretrained else 2)  # every RL rollout, and only those
        assert credit["num_wrong"] + credit["num_wrong_unlocated"] + credit["num_correct"] == 16 * credit["rollouts"]
        if spec["method"] in bench.GRPO_METHODS and credit["num_wrong"]:
            assert credit["slip_rank"] == 0.5  # one advantage per sequence: no localisation, by construction
        rl = [h for h in logs if h.get("phase") == "rl"]
        if "value_model" in bench.METHODS[spec["method"]]:  # a frozen value function: nothing of a critic trains
            assert rl and all("loss/value" not in h and "grad_norm/critic" not in h for h in rl)
        if spec["method"] == "critic-free-64x1":
            assert all(h["value/mean"] == 0 and h["lambda_actor/mean"] == 1 for h in rl)
        # The values' drop at the first slip: none for GRPO, the oracle's own for the oracle arm.
        drops = [(r["value_drop"], r["oracle_drop"]) for r in record["credit_per_rollout"]]
        if spec["method"] in bench.GRPO_METHODS:
            assert all(math.isnan(value) for value, _ in drops)
        if spec["method"] == "oracle-64x1":
            assert any(not math.isnan(oracle) for _, oracle in drops), "no slip located: nothing compared"
            assert all(value == pytest.approx(oracle) or math.isnan(oracle) for value, oracle in drops)
        assert all(math.isnan(oracle) or -2 <= oracle < 0 for _, oracle in drops)


def test_every_arm_has_a_colour_of_its_own():
    assert len({bench.arm_color(method) for method in bench.METHODS}) == len(bench.METHODS)
    # The arms protocol 2 plots together are told apart at a glance: no two within 0.25 in RGB (two shades of one
    # hue were 0.20 apart: GRPO's light purple and the exact value's light pink, the other pinks and purples close).
    together = ["vapo", "no-group-sampling", "ppo", *bench.GRPO_METHODS, bench.CRITIC_FREE, bench.ORACLE, "vapo-paper"]
    for a, b in itertools.combinations(together, 2):
        assert math.dist(bench.arm_color(a)[:3], bench.arm_color(b)[:3]) >= 0.25, (a, b)


def test_quick_prints_the_table_and_writes_the_plots(quick_run):
    out, stdout = quick_run
    table = (out / "table.txt").read_text()
    for needle in (
        "demo: held-out avg@2",
        "chains: held-out avg@2",
        "VAPO",
        "GRPO (TRL, DAPO-style)",
        "GRPO 32x2",
        "oracle critic 64x1",
        "critic-free 64x1",
        "credit assignment",
        "slip rank",
    ):
        assert needle in table and needle in stdout
    # Rows, not only the headers that name them: each arm's row, and VAPO's credit-assignment row of each task.
    lines = table.splitlines()
    for arm in ("VAPO", "GRPO (TRL, DAPO-style)", "GRPO 32x2", "oracle critic 64x1", "critic-free 64x1"):
        assert any(line.startswith(f"{arm} ") and any(c.isdigit() for c in line[len(arm) :]) for line in lines), arm
    for task in ("demo", "chains"):
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{task}: credit assignment"))
        assert any(line.startswith("VAPO ") and "±" in line for line in lines[start + 3 : start + 12]), task
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"demo", "chains"}
    # The 64x1 arms are compared pairwise besides against GRPO and VAPO: learned, exact and no critic.
    oracle = summary["chains"]["oracle-64x1"]["differences"]
    assert set(oracle) == {"grpo", "vapo", "no-group-sampling", "critic-free-64x1"}
    assert summary["demo"]["grpo"]["samples_to_grpo_final"][1] == 1  # GRPO reaches its own final accuracy
    for name in ("learning_vs_samples.png", "learning_vs_time.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_quick_resumes_without_rerunning_finished_runs(quick_run, capsys):
    """The driver again on the same output, in this process (the quick_run fixture ran it as a script)."""
    out, _ = quick_run
    before = {p: p.stat().st_mtime for p in out.glob("report/*/*/*.json")}
    assert bench.main(["--quick", "--out", str(out)]) == 0
    assert "11 of 11 runs already done; running 0 in this process" in capsys.readouterr().out
    assert before == {p: p.stat().st_mtime for p in out.glob("report/*/*/*.json")}


def test_a_finished_run_of_other_settings_is_refused_not_skipped(tmp_path):
    """A record is named by task, method and seed: one of another rate or budget in the same folder was taken as the
    planned run's, skipped, and aggregated with the protocol's runs."""
    planned = bench.RunSpec(
        stage="report", task="demo", method="vapo", seed=2000, learning_rate=1e-4, rollouts=35, eval_every=5,
        eval_k=4, eval_problems=200, eval_set="test",
    )  # fmt: skip
    other = dataclasses.replace(planned, learning_rate=3e-4, rollouts=10)
    planned.path(tmp_path).parent.mkdir(parents=True)
    bench.write_record({"spec": dataclasses.asdict(other)}, planned.path(tmp_path))
    with pytest.raises(SystemExit, match=r"learning_rate 0.0003 \(planned 0.0001\), rollouts 10 \(planned 35\)"):
        bench.run_all([planned], tmp_path, jobs=0)
    bench.write_record({"spec": dataclasses.asdict(planned)}, planned.path(tmp_path))
    assert bench.run_all([planned], tmp_path, jobs=0) == []  # its own record: done, nothing run
