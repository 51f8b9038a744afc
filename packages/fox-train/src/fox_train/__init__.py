"""fox-train: Hydra + Lightning Fabric training of FoX models (``fox-train`` console script)."""

from fox_train.config import TrainConfig

__version__ = "0.1.0"
__all__ = ["TrainConfig", "__version__"]
