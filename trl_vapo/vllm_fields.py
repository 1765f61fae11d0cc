"""vLLM's options (TRL's `VLLMGeneration`'s, with TRL's defaults): each a `vllm_<name>` field of `VAPOConfig` and of
`trl-vapo eval`'s arguments, one default and one help for both. No heavy imports: the command line's help reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    "max_model_length": (
        None,
        "vLLM's context window (colocate mode; a server's is its own `--max-model-len`): at least the longest prompt "
        "plus max_completion_length (None: vLLM's own, from the model). A completion vLLM ends there counts as "
        "truncated, as one at max_completion_length.",
    ),
    "tensor_parallel_size": (1, "Tensor-parallel size of vLLM (colocate mode)."),
}

VLLM_DEFAULTS: dict[str, Any] = {name: default for name, (default, _) in VLLM_FIELDS.items()}
"""`VLLMGeneration`'s options and their defaults (TRL's); what an engine is not given keeps its default."""
VLLM_OPTIONS = tuple(VLLM_DEFAULTS)


def vllm_field(name: str):
    """The dataclass field `vllm_<name>`: its default and help."""
    default, help_text = VLLM_FIELDS[name]
    return field(default=default, metadata={"help": help_text})


@dataclass
class VLLMOptions:
    """vLLM's options as `vllm_<name>` fields: a base of `VAPOConfig` and of `trl-vapo eval`'s arguments."""

    vllm_mode: str = vllm_field("mode")
    vllm_model_impl: str = vllm_field("model_impl")
    vllm_enable_sleep_mode: bool = vllm_field("enable_sleep_mode")
    vllm_structured_outputs_regex: str | None = vllm_field("structured_outputs_regex")
    vllm_server_base_url: str | None = vllm_field("server_base_url")
    vllm_server_host: str = vllm_field("server_host")
    vllm_server_port: int = vllm_field("server_port")
    vllm_server_timeout: float = vllm_field("server_timeout")
    vllm_group_port: int = vllm_field("group_port")
    vllm_gpu_memory_utilization: float = vllm_field("gpu_memory_utilization")
    vllm_max_model_length: int | None = vllm_field("max_model_length")
    vllm_tensor_parallel_size: int = vllm_field("tensor_parallel_size")
