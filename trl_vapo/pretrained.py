"""How trl-vapo calls `from_pretrained` for every model it loads (the policy, a critic, a reward model): one set of
keyword arguments from the config's `model_init_kwargs`. Below both `modeling` (policy and critic) and `scoring`
(reward models), which import it."""

from __future__ import annotations

from typing import Any

import torch


def from_pretrained_kwargs(args, model_init_kwargs: dict | None = None) -> dict[str, Any]:
    """`from_pretrained` keyword arguments from `args.model_init_kwargs` (or `model_init_kwargs` given instead):
    float32 by default, safetensors only."""
    kwargs = dict((args.model_init_kwargs if model_init_kwargs is None else model_init_kwargs) or {})
    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"model_init_kwargs['dtype'] must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}."
            )
        dtype = getattr(torch, dtype)
    kwargs["dtype"] = dtype
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs.setdefault("use_safetensors", True)  # never unpickle weights unless the user asks
    return kwargs
