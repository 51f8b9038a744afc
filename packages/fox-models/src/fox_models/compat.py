"""Every difference between transformers versions that this package cares about, in one place."""

from __future__ import annotations

import transformers
from transformers import GenerationMixin

try:  # transformers >= 5 renamed the config base class
    from transformers import PreTrainedConfig as ConfigBase
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers import PretrainedConfig as ConfigBase

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

__all__ = ["ConfigBase", "GenerationMixin", "TRANSFORMERS_MAJOR"]
