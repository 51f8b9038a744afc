"""fox-eval: evaluations of FoX models (``fox-eval`` console script)."""

__version__ = "0.1.0"
