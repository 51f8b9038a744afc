"""fox-train: Hydra + Lightning Fabric training of FoX models (``fox-train`` console script)."""

__version__ = "0.1.0"
