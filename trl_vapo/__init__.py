"""trl-vapo: VAPO (value-model augmented PPO, arXiv 2504.05118) on the Hugging Face TRL stack."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["VAPOConfig", "VAPOTrainer", "__version__"]

if TYPE_CHECKING:
    from .config import VAPOConfig
    from .trainer import VAPOTrainer


def __getattr__(name: str):
    # Lazy: `import trl_vapo.rewards` (e.g. in a reward worker) must not pay for importing transformers.
    if name == "VAPOConfig":
        from .config import VAPOConfig

        return VAPOConfig
    if name == "VAPOTrainer":
        from .trainer import VAPOTrainer

        return VAPOTrainer
    raise AttributeError(f"module 'trl_vapo' has no attribute {name!r}")
