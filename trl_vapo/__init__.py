"""trl-vapo: VAPO (value-model augmented PPO, arXiv 2504.05118) on the Hugging Face TRL stack."""

import logging
from typing import TYPE_CHECKING

# bitsandbytes, which peft imports where it is installed, warns at import on CPUs that an optional kernel package
# (fetched from the Hub) is missing ("Failed to load CPU gemm_4bit_forward ..."): it changes nothing for training and
# would be the first line of every run and every error. Unless the user set that logger's level themselves.
_BNB_CPU_LOGGER = logging.getLogger("bitsandbytes.backends.cpu.ops")
if _BNB_CPU_LOGGER.level == logging.NOTSET:
    _BNB_CPU_LOGGER.setLevel(logging.ERROR)

__version__ = "0.1.0"
__all__ = ["VAPOConfig", "VAPOTrainer", "__version__"]

if TYPE_CHECKING:
    from .config import VAPOConfig
    from .trainer import VAPOTrainer


def __getattr__(name: str):
    # Lazy: `import trl_vapo.rewards` (e.g. a script that only scores) must not pay for importing transformers.
    if name == "VAPOConfig":
        from .config import VAPOConfig

        return VAPOConfig
    if name == "VAPOTrainer":
        from .trainer import VAPOTrainer

        return VAPOTrainer
    raise AttributeError(f"module 'trl_vapo' has no attribute {name!r}")
