"""The offline demo's ingredients: a procedural arithmetic data set and a tiny cold-start policy in the package.

``data`` generates the problems and ``train_sft`` trains the policy shipped in ``MODEL_DIR``; ``trl-vapo eval --model
DIR`` (without a data set) measures a model on the held-out split.
"""

from __future__ import annotations

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
"""The shipped cold-start policy and its tokenizer, for ``from_pretrained(MODEL_DIR)``; ``train_sft`` rebuilds it."""
