"""Every difference between transformers versions that this package cares about, in one place.

The cache argument. transformers names the decoding cache ``cache`` (in ``forward``, ``generate()``'s
``model_kwargs`` and the model outputs' field) since 5.24, and ``past_key_values`` before. ``CACHE_KWARG``
is the name the installed release uses; the models accept both names in their ``forward`` on every
release, and ``generate()`` takes either (``normalize_cache_kwargs`` moves the other one to
``CACHE_KWARG`` before the generation loop reads it)."""

from __future__ import annotations

import transformers
from transformers import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast

try:  # transformers >= 5 renamed the config base class
    from transformers import PreTrainedConfig as ConfigBase
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers import PretrainedConfig as ConfigBase

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

CACHE_KWARG = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
"""The name of the cache in ``forward``'s keywords, ``generate()``'s model_kwargs and the outputs."""

_CACHE_NAMES = ("cache", "past_key_values")


def pick_cache(cache, past_key_values):
    """The cache a ``forward`` was given, under its current name ``cache`` or the older ``past_key_values``
    (one of them; both only if they are the same object)."""
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError("pass the cache once, as cache= (past_key_values= is its older name), not both")
    return past_key_values


def normalize_cache_kwargs(model_kwargs: dict) -> None:
    """Move a cache that ``generate()`` received under the other name to ``CACHE_KWARG``, in place, so that
    the generation loop (which reads and writes only ``CACHE_KWARG``) sees it."""
    for name in _CACHE_NAMES:
        if name != CACHE_KWARG and name in model_kwargs:
            other = model_kwargs.pop(name)
            model_kwargs[CACHE_KWARG] = pick_cache(model_kwargs.get(CACHE_KWARG), other)


def get_cache(model_kwargs: dict):
    """The cache in ``generate()``'s model_kwargs, or None."""
    return model_kwargs.get(CACHE_KWARG)


def set_cache(model_kwargs: dict, cache) -> None:
    """Put ``cache`` in ``generate()``'s model_kwargs, under the name the generation loop reads."""
    model_kwargs[CACHE_KWARG] = cache


def cache_field(cache) -> dict:
    """Keyword for a model output's cache field: ``Output(..., **cache_field(cache))``."""
    return {CACHE_KWARG: cache}


def output_cache(output):
    """The cache field of a model output (``BaseModelOutputWithPast``, ``CausalLMOutputWithPast``)."""
    return getattr(output, CACHE_KWARG)


__all__ = ["CACHE_KWARG", "ConfigBase", "GenerationMixin", "GradientCheckpointingLayer", "TRANSFORMERS_MAJOR", "cache_field", "get_cache",
           "normalize_cache_kwargs", "output_cache", "pick_cache", "set_cache"]
