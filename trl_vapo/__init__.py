"""trl-vapo: VAPO (value-model augmented PPO, arXiv 2504.05118) on the Hugging Face TRL stack."""

__version__ = "0.1.0"

from .config import VAPOConfig  # noqa: E402
from .trainer import VAPOTrainer  # noqa: E402

__all__ = ["VAPOConfig", "VAPOTrainer", "__version__"]
