"""The one place that imports TRL helpers living outside TRL's public API.

TRL exports its trainers and data utilities from `trl`, but the tensor helpers below live in `trl.trainer.utils`
and `trl.models.utils`, which may move between releases. Import them from here so a TRL upgrade breaks this file,
not the trainer.
"""

from trl.cli.accelerate_config import resolve_accelerate_config_argument
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import (
    disable_dropout_in_model,
    entropy_from_logits,
    generate_model_card,
    get_config_model_id,
    pad,
    selective_log_softmax,
)

__all__ = [
    "disable_dropout_in_model",
    "entropy_from_logits",
    "generate_model_card",
    "get_config_model_id",
    "pad",
    "resolve_accelerate_config_argument",
    "selective_log_softmax",
    "unwrap_model_for_generation",
]
