"""vLLM's options (TRL's `VLLMGeneration`'s, with TRL's defaults): each a `vllm_<name>` field of `VAPOConfig` and of
`trl-vapo eval`'s arguments, one default and one help for both. No heavy imports: the command line's help reads it."""

from __future__ import annotations

from dataclasses import field
from typing import Any

VLLM_FIELDS: dict[str, tuple[Any, str]] = {
    "mode": (
        "colocate",
        "'server': send generation requests to a separate vLLM server (start it with `trl vllm-serve`). "
        "'colocate': run vLLM in the training processes, sharing the GPUs.",
    ),
    "model_impl": ("vllm", "Model implementation for vLLM: 'vllm' or 'transformers'."),
    "enable_sleep_mode": (False, "Offload vLLM's weights and cache during the optimizer step (colocate mode)."),
    "structured_outputs_regex": (None, "Regex for vLLM structured outputs. None: disabled."),
    "server_base_url": (
        None,
        "Base URL of the vLLM server (e.g. 'http://localhost:8000'); overrides host and port.",
    ),
    "server_host": ("0.0.0.0", "Host of the vLLM server."),
    "server_port": (8000, "Port of the vLLM server."),
    "server_timeout": (240.0, "Seconds to wait for the vLLM server to be up before raising."),
    "group_port": (51216, "Port of the weight-update group shared with the vLLM server."),
    "gpu_memory_utilization": (0.3, "GPU memory share vLLM may use (colocate mode)."),
    "max_model_length": (None, "vLLM's context window: at least the longest prompt plus max_completion_length."),
    "tensor_parallel_size": (1, "Tensor-parallel size of vLLM (colocate mode)."),
}

VLLM_DEFAULTS: dict[str, Any] = {name: default for name, (default, _) in VLLM_FIELDS.items()}
"""`VLLMGeneration`'s options and their defaults (TRL's); what an engine is not given keeps its default."""
VLLM_OPTIONS = tuple(VLLM_DEFAULTS)


def vllm_field(name: str):
    """The dataclass field `vllm_<name>`: its default and help."""
    default, help_text = VLLM_FIELDS[name]
    return field(default=default, metadata={"help": help_text})
