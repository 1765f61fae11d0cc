"""The demo's arithmetic data set and the cold-start model shipped with the package."""

from __future__ import annotations

import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_vapo.demo import MODEL_DIR
from trl_vapo.demo.data import (
    HELD_OUT_PERCENT,
    HELD_OUT_PROBLEMS,
    MAX_TERMS,
    MIN_TERMS,
    SLIP_RATE_SUM_ABOVE_TEN,
    SLIP_RATE_SUM_TEN,
    build_split,
    is_held_out,
    needs_carry,
    render_completion,
    render_prompt,
    running_total_lines,
    sample_problems,
    sample_terms,
    sft_examples,
)
from trl_vapo.evaluation import evaluate_policy, sample_completions
from trl_vapo.rewards import find_last_boxed as extract_boxed
from trl_vapo.rewards import math_reward

LINE = re.compile(r"(\d\d)\+(\d)=(\d\d)")


def parse_chain(completion: str) -> tuple[list[tuple[int, int, int]], str | None]:
    """The ``(total, term, new_total)`` of each line and the boxed answer, asserting the format on the way.

    Also asserts that the chain is connected: it starts from ``00`` and each line starts from the total above it.
    """
    *lines, boxed_line = completion.split("\n")
    steps = []
    for line in lines:
        match = LINE.fullmatch(line)
        assert match, f"malformed line {line!r} in {completion!r}"
        steps.append(tuple(map(int, match.groups())))
    assert [total for total, _, _ in steps] == [0] + [new_total for _, _, new_total in steps[:-1]]
    return steps, extract_boxed(boxed_line)


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------


def test_generators_are_deterministic_and_seeded():
    assert build_split("train", 64)[:] == build_split("train", 64)[:]
    assert sft_examples(64, seed=3) == sft_examples(64, seed=3)
    assert sft_examples(64, seed=3) != sft_examples(64, seed=4)
    assert build_split("held_out", 64, seed=5)["prompt"] != build_split("held_out", 64, seed=6)["prompt"]


def test_train_and_held_out_are_disjoint():
    train = build_split("train", 5000)
    held_out = build_split("held_out", 1000)
    assert set(train["prompt"]).isdisjoint(held_out["prompt"])
    assert len(set(held_out["prompt"])) == len(held_out)  # an evaluation set without repeats
    assert not set(prompt for prompt, _ in sft_examples(5000, seed=0)) & set(held_out["prompt"])
    # The hash sends about the intended share of all problems to the held-out split.
    rng = random.Random(0)
    share = sum(is_held_out(sample_terms(rng)) for _ in range(5000)) / 5000
    assert abs(share - HELD_OUT_PERCENT / 100) < 0.03


def test_rows_have_plain_prompts_and_number_answers():
    for row in build_split("held_out", 200):
        terms = tuple(map(int, re.fullmatch(r"Compute ((?:\d\+)+\d)\.\n", row["prompt"]).group(1).split("+")))
        assert MIN_TERMS <= len(terms) <= MAX_TERMS and len(set(terms)) == len(terms)
        assert row["answer"] == str(sum(terms))


def test_clean_chains_are_correct_and_end_in_the_gold_answer():
    for terms in sample_problems(500, held_out=False, seed=0):
        steps, boxed = parse_chain(render_completion(terms))
        assert [term for _, term, _ in steps] == list(terms)
        assert all(new_total == total + term for total, term, new_total in steps)
        assert boxed == str(sum(terms))


def test_slipped_chains_drop_carries_and_stay_consistent():
    terms = (7, 5, 9, 3)
    assert running_total_lines(terms) == ["00+7=07", "07+5=12", "12+9=21", "21+3=24"]
    # Every carry dropped: 7+5 and then 2+9 lose their carries; 1+3 needs none, so the slip is never consulted.
    always_slip = running_total_lines(terms, slip=lambda total, term: True)
    assert always_slip == ["00+7=07", "07+5=02", "02+9=01", "01+3=04"]
    assert render_completion(terms, slip=lambda total, term: True).endswith("\\boxed{4}")
    assert not needs_carry(21, 3) and needs_carry(12, 9) and needs_carry(1, 9)


def test_sft_data_mixes_correct_and_slipped_chains_at_the_set_rates():
    correct, slips_by_context = [], {True: [], False: []}  # keyed by "the ones digits sum to exactly ten"
    for _, completion in sft_examples(2000, seed=0):
        steps, boxed = parse_chain(completion)
        assert boxed == str(steps[-1][2])  # the answer always follows from the chain, slipped or not
        for total, term, new_total in steps:
            slipped = new_total == total + term - 10
            assert slipped or new_total == total + term
            if needs_carry(total, term):
                slips_by_context[total % 10 + term == 10].append(slipped)
            else:
                assert not slipped
        correct.append(boxed == str(sum(term for _, term, _ in steps)))
    assert 0.3 < sum(correct) / len(correct) < 0.6
    for sums_to_ten, rate in ((True, SLIP_RATE_SUM_TEN), (False, SLIP_RATE_SUM_ABOVE_TEN)):
        observed = slips_by_context[sums_to_ten]
        assert abs(sum(observed) / len(observed) - rate) < 0.05


def test_response_lengths_grow_with_the_number_of_terms():
    lengths = {n: len(render_completion(tuple(range(1, n + 1)))) for n in range(MIN_TERMS, MAX_TERMS + 1)}
    assert all(lengths[n + 1] > lengths[n] for n in range(MIN_TERMS, MAX_TERMS))
    assert lengths[MIN_TERMS] < 30 and lengths[MAX_TERMS] > 80
    sample = [len(completion) for _, completion in sft_examples(500, seed=0)]
    assert min(sample) < 30 and max(sample) > 80 and len(set(sample)) >= MAX_TERMS - MIN_TERMS + 1


def test_build_split_rejects_unknown_split():
    with pytest.raises(ValueError, match="split must be 'train' or 'held_out', got 'test'"):
        build_split("test", 4)


def test_the_held_out_split_has_as_many_problems_as_said_and_no_more_are_drawn():
    from itertools import permutations

    every = [t for k in range(MIN_TERMS, MAX_TERMS + 1) for t in permutations(range(1, 10), k)]
    assert len(every) == 986_400 and sum(map(is_held_out, every)) == HELD_OUT_PROBLEMS
    with pytest.raises(ValueError, match="The held-out split has 98,329 distinct problems; 98,330 were asked for"):
        build_split("held_out", HELD_OUT_PROBLEMS + 1)  # (drew forever)


# ---------------------------------------------------------------------------------------------------------------------
# The shipped cold-start model
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR), AutoTokenizer.from_pretrained(MODEL_DIR)


def test_shipped_model_files_are_small(shipped):
    model, _ = shipped
    assert 500_000 <= sum(p.numel() for p in model.parameters()) <= 5_000_000
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 8 * 2**20
    assert model.config.model_type == "llama"


def test_shipped_tokenizer_round_trips_demo_text(shipped):
    _, tokenizer = shipped
    text = render_prompt((7, 5, 9, 3)) + render_completion((7, 5, 9, 3))
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_shipped_model_answers_in_the_expected_format(shipped):
    model, tokenizer = shipped
    held_out = build_split("held_out", 32)
    completions, lengths = sample_completions(
        model, tokenizer, list(held_out["prompt"]), temperature=0.0, max_new_tokens=96
    )
    boxed = [extract_boxed(completion) for completion in completions]
    assert sum(answer is not None and answer.isdigit() for answer in boxed) >= 0.9 * len(boxed)
    # Every completion stopped at EOS, before the budget ran out.
    assert max(lengths) < 96


def test_shipped_model_leaves_room_for_reinforcement_learning(shipped):
    """Sampled accuracy is far from perfect while pass@8 is high: the correct chain is in the policy's support."""
    model, tokenizer = shipped
    torch.manual_seed(0)
    result = evaluate_policy(
        model,
        tokenizer,
        build_split("held_out", 48),
        math_reward,
        k=8,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=96,
        batch_size=384,  # one batch (six of 64: 1.3 s more)
        greedy=False,
    )
    assert 0.2 < result.avg_at_k < 0.65
    assert result.pass_at_k > result.avg_at_k + 0.25


def test_the_sft_script_refuses_an_empty_report_before_training(tmp_path, capsys):
    """`--eval-problems 0` trained for minutes, saved, then failed at the report (an empty data set to score)."""
    from trl_vapo.demo import train_sft

    with pytest.raises(SystemExit):
        train_sft.main(["--output-dir", str(tmp_path), "--eval-problems", "0"])
    assert "--eval-problems must be >= 1, got 0" in capsys.readouterr().err and not any(tmp_path.iterdir())
