"""The locally built tiny model and tokenizer load back with the Auto classes users call, unchanged."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_vapo.tiny import EOS_TOKEN, PAD_TOKEN, build_char_tokenizer


def test_tokenizer_round_trips_through_auto_tokenizer(tiny_model_dir):
    built = build_char_tokenizer()
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Q: 12 + 34 =\n  Let's add: 12+34 = 46. \\boxed{46}"
    assert loaded(text).input_ids == built(text).input_ids
    assert loaded.decode(loaded(text).input_ids) == text  # spaces and newlines survive the save/load
    assert loaded.eos_token == EOS_TOKEN and loaded.pad_token == PAD_TOKEN
    assert loaded.pad_token_id != loaded.eos_token_id
    assert loaded.padding_side == "left"


def test_chat_template_renders_a_generation_prompt(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_loads_and_generates_until_eos(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert 10_000 < n_params < 2_000_000
    assert model.config.model_type == "llama"
    batch = tokenizer(["1+1=", "12+30="], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    # Random weights sample EOS about once in 100 tokens: biased to about one in six, the rows end at different steps.
    out = model.generate(**batch, max_new_tokens=8, do_sample=True, sequence_bias={(tokenizer.eos_token_id,): 3.0})
    assert out.shape[0] == 2 and out.shape[1] <= batch.input_ids.shape[1] + 8
    # generate() knows where a completion ends, and pads what follows: the saved generation config names both.
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id is not None
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id is not None
    rows = out[:, batch.input_ids.shape[1] :].tolist()
    assert any(tokenizer.eos_token_id in row[:-1] for row in rows)  # a row ended before the longest one
    for row in rows:
        if tokenizer.eos_token_id in row:
            after = row[row.index(tokenizer.eos_token_id) + 1 :]
            assert set(after) <= {tokenizer.pad_token_id}, row
