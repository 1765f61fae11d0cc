"""Tiny causal language models and tokenizers built locally, with nothing downloaded.

The tests, the offline demo and the benchmarks use these to exercise exactly the code a user runs
(``save_pretrained`` here, ``from_pretrained`` in the trainer) on a laptop CPU.

The tokenizer is character-level over printable ASCII plus chat special tokens, with a ChatML-style chat
template. The model is a Llama-architecture decoder. (A ``qwen2`` model type would make transformers 5's
``AutoTokenizer`` swap in ``Qwen2Tokenizer``, whose pre-tokenizer silently drops the spaces of a
character-level vocabulary; the Llama type keeps the tokenizer as saved.)
"""

from __future__ import annotations

import string
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|im_end|>"
CHAT_START_TOKEN = "<|im_start|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, CHAT_START_TOKEN, UNK_TOKEN]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_char_tokenizer(alphabet: str = string.printable) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of ``alphabet`` plus the special tokens.

    Characters outside the alphabet map to ``<|unk|>``. ``pad`` and ``eos`` are distinct tokens, padding is on the
    left (as generation needs) and a ChatML chat template is set.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = "".join(dict.fromkeys(alphabet))  # de-duplicate, keep order
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(alphabet))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[CHAT_START_TOKEN],
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama decoder sized for ``tokenizer`` (about 80k parameters at the defaults)."""
    import torch

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def save_tiny_model(output_dir: str | Path, **model_kwargs) -> Path:
    """Build a character tokenizer and a tiny Llama, save both with ``save_pretrained`` and return the folder."""
    output_dir = Path(output_dir)
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(tokenizer, **model_kwargs)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def save_tiny_reward_model(output_dir: str | Path, seed: int = 1) -> Path:
    """A randomly initialised one-label Llama sequence classifier (a reward model) with the character tokenizer,
    saved with ``save_pretrained``; returns the folder. Its scores are small and vary with the text."""
    import torch

    output_dir = Path(output_dir)
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        LlamaForSequenceClassification(config).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
