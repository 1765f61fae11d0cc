"""The harder benchmark task (``trl_vapo.demo.chains``) and the first-wrong-step locator for both tasks."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from trl_vapo.demo import chains, data
from trl_vapo.evaluation import sample_completions
from trl_vapo.rewards import find_last_boxed, math_reward
from trl_vapo.tiny import build_char_tokenizer

LINE = re.compile(r"([a-j]) (\d\d)\+(\d)=(\d\d) ([uvwxyz]{2})")


def parse_chain(completion: str) -> tuple[list[tuple[str, int, int, int, str]], str | None]:
    """``(tag, total, term, new_total, filler)`` per line and the boxed answer, asserting the format."""
    *lines, boxed_line = completion.split("\n")
    steps = []
    for line in lines:
        match = LINE.fullmatch(line)
        assert match, f"malformed line {line!r} in {completion!r}"
        tag, total, term, new_total, filler = match.groups()
        steps.append((tag, int(total), int(term), int(new_total), filler))
    assert "".join(step[0] for step in steps) == chains.TAGS[: len(steps)]
    assert [step[1] for step in steps] == [0] + [step[3] for step in steps[:-1]]
    return steps, find_last_boxed(boxed_line)


def test_generators_are_deterministic_seeded_and_disjoint():
    assert chains.sft_examples(64, seed=3) == chains.sft_examples(64, seed=3)
    assert chains.sft_examples(64, seed=3) != chains.sft_examples(64, seed=4)
    train, held_out = chains.build_split("train", 5000), chains.build_split("held_out", 1000)
    assert set(train["prompt"]).isdisjoint(held_out["prompt"])
    assert len(set(held_out["prompt"])) == len(held_out)
    assert not {prompt for prompt, _ in chains.sft_examples(5000, seed=0)} & set(held_out["prompt"])
    rng = random.Random(0)
    share = sum(chains.is_held_out(chains.sample_terms(rng)) for _ in range(5000)) / 5000
    assert abs(share - data.HELD_OUT_PERCENT / 100) < 0.03
    # The demo's prompts never parse as chains prompts and vice versa: the tasks cannot be mixed up.
    assert chains.parse_prompt(data.render_prompt((7, 5)))[0] == "demo"
    assert chains.parse_prompt(chains.render_prompt((7, 5)))[0] == "chains"


def test_problems_are_long_chains_with_repeats():
    terms = chains.sample_problems(2000, held_out=False, seed=0)
    assert {len(t) for t in terms} == set(range(chains.MIN_TERMS, chains.MAX_TERMS + 1))
    assert all(chains.MIN_DIGIT <= d <= chains.MAX_DIGIT for t in terms for d in t)
    assert sum(len(set(t)) < len(t) for t in terms) > 1000  # repeats are common
    for row in chains.build_split("held_out", 200):
        _, parsed = chains.parse_prompt(row["prompt"])
        assert row["answer"] == str(sum(parsed))


def test_sft_chains_have_the_format_free_fillers_and_slip_rates():
    correct, slipped = [], {True: [], False: []}
    fillers = []
    lengths = []
    for prompt, completion in chains.sft_examples(3000, seed=0):
        steps, boxed = parse_chain(completion)
        _, terms = chains.parse_prompt(prompt)
        assert [step[2] for step in steps] == list(terms)
        assert boxed == str(steps[-1][3])
        for _, total, term, new_total, filler in steps:
            fillers.append(filler)
            dropped = new_total == total + term - 10
            assert dropped or new_total == total + term
            if data.needs_carry(total, term):
                slipped[total % 10 + term == 10].append(dropped)
            else:
                assert not dropped
        correct.append(boxed == str(sum(terms)))
        lengths.append(len(completion))
    assert 0.15 < sum(correct) / len(correct) < 0.35
    for sums_to_ten, rate in ((True, chains.SLIP_RATE_SUM_TEN), (False, chains.SLIP_RATE_SUM_ABOVE_TEN)):
        assert abs(sum(slipped[sums_to_ten]) / len(slipped[sums_to_ten]) - rate) < 0.04
    # Free tokens: every filler letter appears about equally often in both positions.
    for position in range(chains.FILLER_LENGTH):
        counts = [sum(f[position] == letter for f in fillers) for letter in chains.FILLER_LETTERS]
        assert max(counts) < 1.15 * min(counts)
    assert min(lengths) >= 61 and max(lengths) <= chains.MAX_COMPLETION_TOKENS - 1


def test_tokenizer_round_trips_chains_text_one_token_per_character():
    tokenizer = build_char_tokenizer()
    prompt, completion = chains.sft_examples(1, seed=0)[0]
    ids = tokenizer(prompt + completion, add_special_tokens=False).input_ids
    assert len(ids) == len(prompt + completion)
    assert tokenizer.decode(ids) == prompt + completion


def test_first_wrong_index_on_chains():
    terms = (7, 5, 9, 5)  # carries at 07+5 and 12+9 (and 21+5 needs none)
    prompt = chains.render_prompt(terms)
    fillers = ["uv", "zz", "xy", "wu"]
    clean = chains.render_completion(terms, fillers)
    assert chains.first_wrong_index(prompt, clean) is None
    # Any commentary is correct: the fillers are free.
    assert chains.first_wrong_index(prompt, chains.render_completion(terms, ["yy"] * 4)) is None
    # Drop the first carry (line 1, "b 07+5=02"): the decisive token is that line's tens digit.
    first_only = chains.render_completion(terms, fillers, slip=lambda total, term: total == 7)
    assert first_only.split("\n")[1] == "b 07+5=02 zz"
    assert chains.first_wrong_index(prompt, first_only) == 13 * 1 + 7
    # Drop only the second carry (line 2): the earlier lines are still right.
    second_only = chains.render_completion(terms, fillers, slip=lambda total, term: total == 12)
    assert chains.first_wrong_index(prompt, second_only) == 13 * 2 + 7
    # A filler outside the alphabet, a wrong tag, an early EOS, a run-on past the answer.
    assert chains.first_wrong_index(prompt, clean[:10] + "a" + clean[11:]) == 10
    assert chains.first_wrong_index(prompt, clean.replace("c 12", "d 12")) == 26
    assert chains.first_wrong_index(prompt, clean[:40]) == 40
    assert chains.first_wrong_index(prompt, clean + "\n") == len(clean)
    assert chains.first_wrong_index(prompt, "") == 0


def test_first_wrong_index_on_the_demo_task_against_a_direct_search():
    """For the demo the correct chain is unique: the index is where a completion first differs from it."""
    rng = random.Random(0)
    for prompt, completion in data.sft_examples(500, seed=1):
        _, terms = chains.parse_prompt(prompt)
        gold = data.render_completion(terms)
        if rng.random() < 0.3:  # also cut some completions short
            completion = completion[: rng.randrange(len(completion))]
        direct = next((i for i, (a, b) in enumerate(zip(completion, gold)) if a != b), None)
        if direct is None and len(completion) != len(gold):
            direct = min(len(completion), len(gold))
        assert chains.first_wrong_index(prompt, completion) == direct
        if direct is not None and direct < len(completion) and completion.count("\n") == gold.count("\n"):
            # A slipped line: the decisive character is the tens digit of a new total (offset 5 of an 8-char line).
            assert direct % 8 == 5


def test_first_wrong_index_rejects_other_prompts():
    with pytest.raises(ValueError, match="not a demo or chains prompt"):
        chains.first_wrong_index("What is 2+2?", "4")
    with pytest.raises(ValueError, match="need one filler per line"):
        chains.render_completion((1, 2), ["uv"])


# ---------------------------------------------------------------------------------------------------------------------
# The cold-start model for the benchmark (benchmarks/models/chains_sft)
# ---------------------------------------------------------------------------------------------------------------------

CHAINS_MODEL_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "models" / "chains_sft"


@pytest.fixture(scope="module")
def chains_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(CHAINS_MODEL_DIR), AutoTokenizer.from_pretrained(CHAINS_MODEL_DIR)


def test_chains_model_is_small_and_writes_the_format(chains_model):
    model, tokenizer = chains_model
    assert sum(p.numel() for p in model.parameters()) <= 5_000_000
    assert (CHAINS_MODEL_DIR / "model.safetensors").stat().st_size < 8 * 2**20
    prompts = list(chains.build_split("held_out", 24)["prompt"])
    completions, lengths = sample_completions(model, tokenizer, prompts, temperature=0.0, max_new_tokens=160)
    assert max(lengths) < 160  # every greedy chain stops at EOS
    for prompt, completion in zip(prompts, completions):
        steps, _ = parse_chain(completion)
        assert len(steps) == len(chains.parse_prompt(prompt)[1])


def test_chains_model_leaves_room_for_reinforcement_learning(chains_model):
    """Sampled accuracy well below 1 while pass@8 is high, and wrong samples go wrong by dropping a carry."""
    model, tokenizer = chains_model
    torch.manual_seed(0)
    held_out = chains.build_split("held_out", 48)
    # One sampling pass (T = 1) for both checks: avg@8 and pass@8 as `evaluate_policy` counts them, then the slips.
    completions, _ = sample_completions(
        model, tokenizer, list(held_out["prompt"]), num_samples=8, max_new_tokens=160, batch_size=384
    )
    answers = [answer for answer in held_out["answer"] for _ in range(8)]
    correct = torch.tensor(math_reward(completions=completions, answer=answers)).view(48, 8) > 0
    avg_at_8, pass_at_8 = correct.float().mean().item(), correct.any(dim=1).float().mean().item()
    assert 0.15 < avg_at_8 < 0.5
    assert pass_at_8 > avg_at_8 + 0.3
    dropped = other = 0
    for i, completion in enumerate(completions):
        prompt = held_out[i // 8]["prompt"]
        wrong_at = chains.first_wrong_index(prompt, completion)
        if wrong_at is None:
            continue
        pattern = chains.correct_pattern(prompt)
        expected = pattern[wrong_at] if 0 < wrong_at < min(len(completion), len(pattern)) else ""
        if expected.isdigit() and completion[wrong_at - 1] == "=" and completion[wrong_at] == str(int(expected) - 1):
            dropped += 1  # the tens digit of a new total, one too low: a dropped carry
        else:
            other += 1
    assert dropped > 0 and other <= 0.1 * (dropped + other)
