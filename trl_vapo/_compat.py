"""The one place that imports TRL names outside TRL's public API (anything not in `trl.__all__`).

TRL exports its trainers and data utilities from `trl`, but the helpers below live in `trl.trainer.utils`,
`trl.models.utils`, `trl.kernels`, `trl.generation`, `trl.rewards`, `trl.chat_template_utils` and
`trl.import_utils`, which may move between releases. Import them from here so a TRL upgrade breaks this file, not
the trainer (`tests/test_dependencies.py` fails if another module imports one).
"""

from trl.chat_template_utils import parse_response
from trl.cli.accelerate_config import resolve_accelerate_config_argument
from trl.import_utils import is_vllm_available
from trl.kernels import ChunkedLogProbFunction as TiledLogProbs
from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE as TOKEN_TILE_ROWS
from trl.kernels.chunked_logprob import _use_triton as tiles_fold_with_triton
from trl.models.utils import add_hooks, prepare_deepspeed, prepare_fsdp, remove_hooks
from trl.trainer.utils import (
    disable_dropout_in_model,
    entropy_from_logits,
    generate_model_card,
    get_config_model_id,
    get_trackio_space_url,
    maybe_gather_lm_head_ctx,
    pad,
    selective_log_softmax,
    start_event_loop_in_daemon,
)


def vllm_generation_class() -> type:
    """TRL's `VLLMGeneration` (vLLM generation and weight sync, `trl.generation.vllm_generation`)."""
    from trl.generation.vllm_generation import VLLMGeneration

    return VLLMGeneration


def trl_reward_function(name: str):
    """One of TRL's reward functions (`trl.rewards`), by name."""
    import trl.rewards

    return getattr(trl.rewards, name)


def prepare_frozen_model(model, accelerator, shard: bool = True):
    """A frozen model (the reference policy, a reward model), placed as TRL's trainers place theirs: a DeepSpeed
    inference engine (partitioned under ZeRO-3, whole under ZeRO-1/2); under FSDP sharded (`shard`: the reference, as
    TRL's `prepare_fsdp`) or whole on the device (a reward model: GRPOTrainer's `prepare_model(evaluation_mode=True)`
    shards nothing; sharded, each scoring forward was a collective every process had to join); on the device
    otherwise."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return prepare_deepspeed(model, accelerator)
    if accelerator.distributed_type == DistributedType.FSDP and shard:
        model = prepare_fsdp(model, accelerator)
        if hasattr(model, "set_reshard_after_forward"):  # FSDP2
            # With the launcher's `fsdp_reshard_after_forward: false` (the policy's weights kept between its forward
            # and backward), a frozen model, which runs no backward, stayed gathered whole from its first forward on.
            model.set_reshard_after_forward(True)
        return model
    return model.to(accelerator.device)


__all__ = [
    "TOKEN_TILE_ROWS",
    "tiles_fold_with_triton",
    "TiledLogProbs",
    "add_hooks",
    "disable_dropout_in_model",
    "entropy_from_logits",
    "generate_model_card",
    "get_config_model_id",
    "get_trackio_space_url",
    "is_vllm_available",
    "maybe_gather_lm_head_ctx",
    "pad",
    "parse_response",
    "prepare_frozen_model",
    "remove_hooks",
    "resolve_accelerate_config_argument",
    "selective_log_softmax",
    "start_event_loop_in_daemon",
    "trl_reward_function",
    "vllm_generation_class",
]
