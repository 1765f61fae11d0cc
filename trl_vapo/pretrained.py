"""How trl-vapo calls `from_pretrained` for every model it loads (the policy, a critic, a reward model): one set of
keyword arguments from the config's `model_init_kwargs`. Below both `modeling` (policy and critic) and `scoring`
(reward models), which import it."""

from __future__ import annotations

from typing import Any

import torch


def with_dtype_named(model_init_kwargs: dict | None) -> dict | None:
    """`model_init_kwargs` with `torch_dtype`, transformers' former name for `dtype` (many configs still use it),
    renamed `dtype`: transformers takes `dtype` over it, so with the float32 default (or `trl-vapo train`'s
    `--dtype`) beside it, `torch_dtype` was silently ignored."""
    if not model_init_kwargs or "torch_dtype" not in model_init_kwargs:
        return model_init_kwargs
    kwargs = dict(model_init_kwargs)
    torch_dtype = kwargs.pop("torch_dtype")
    if _dtype_name(kwargs.get("dtype", torch_dtype)) != _dtype_name(torch_dtype):
        raise ValueError(
            f"model_init_kwargs has both dtype ({kwargs['dtype']!r}) and torch_dtype ({torch_dtype!r}), its former "
            "name: keep dtype."
        )
    kwargs["dtype"] = torch_dtype
    return kwargs


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.bfloat16 and "bfloat16" alike


def from_pretrained_kwargs(args, model_init_kwargs: dict | None = None) -> dict[str, Any]:
    """`from_pretrained` keyword arguments from `args.model_init_kwargs` (or `model_init_kwargs` given instead):
    float32 by default, safetensors only."""
    kwargs = dict(with_dtype_named(args.model_init_kwargs if model_init_kwargs is None else model_init_kwargs) or {})
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


LOOKUP_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
"""The `from_pretrained` keyword arguments that say where a model's files are: a config or a tokenizer of the same
name is looked up with them too."""


def lookup_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Of `kwargs` (:func:`from_pretrained_kwargs`), those that say where the files are, and `trust_remote_code`."""
    return {k: v for k, v in kwargs.items() if k in LOOKUP_KWARGS or k == "trust_remote_code"}


class PickledWeightsOnly(OSError, ValueError):
    """A model whose weights are pickled alone, refused unless asked for: transformers' OSError for weights it did not
    find, and a setting to change (a ValueError, which `trl-vapo train` says in one line), as `io.UnsupportedOperation`
    is both."""


def load_pretrained(model_class, name: str, kwargs: dict[str, Any]):
    """`model_class.from_pretrained(name, **kwargs)` (`kwargs` from :func:`from_pretrained_kwargs`), where a model
    saved only as pickled weights (`pytorch_model.bin`) gets an error that says why safetensors are asked for and
    how to load it; transformers' own asks the user to unset `use_safetensors=True`, which they never set."""
    try:
        return model_class.from_pretrained(name, **kwargs)
    except OSError as error:
        if kwargs.get("use_safetensors") and "safetensors" in str(error):
            raise PickledWeightsOnly(
                f"{error} trl-vapo loads safetensors weights only (`use_safetensors=True`): unpickling a weights "
                f"file can run any code in it. If {name} has pickled weights only (`pytorch_model.bin`) and you trust "
                "them, pass model_init_kwargs={'use_safetensors': False} (on the command line: --model_init_kwargs "
                "'{\"use_safetensors\": false}'; `trl-vapo eval --use_safetensors false`), or save the model once "
                "with `save_pretrained`, which writes safetensors."
            ) from error
        raise
