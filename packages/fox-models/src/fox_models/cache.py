"""The decoding caches of the models, as transformers ``Cache`` objects.

``FoxCache`` holds one ``FoxCacheLayer`` per layer: a ``fox_layers.AttentionState`` (K, V, gate prefix sums,
token-shift states and left padding, in the kernel's cache format) that is also a transformers cache layer.
So ``generate()`` can reorder it (beam search), repeat and select its rows, and crop it (assisted and
prompt-lookup decoding roll back the tokens they reject).

Cropping a FoX (Pro) layer needs the token-shift state of the new last token, its un-mixed k and v
projections; the cache keeps them for every token only while recording its past
(``activate_past_recording()``, which ``generate()`` calls for assisted and prompt-lookup decoding).
A model without a token shift (FoX LLaMA, the Transformers) can always be cropped.

A layer's K/V tensors ``k``/``v`` are (B, T, Hkv, D), the layout the Forgetting Attention kernels read and
append to (fox_kernel's decoding kernels and the prefill write tokens along the second axis); the model reads
and writes them itself and never calls ``Cache.update``. ``keys``/``values`` are the same tensors in
transformers' layout (B, Hkv, T, D), as views (no copy) for tools that read a cache layer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from fox_layers import AttentionState


class ModelFilledLayer(CacheLayerMixin):
    """A transformers cache layer that the model's own forward fills (never ``Cache.update``), holding
    ``length`` tokens and growing without a preset limit."""

    def lazy_initialization(self, key_states, value_states) -> None:
        raise NotImplementedError(f"a {type(self).__name__} is filled by the model's forward")

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(f"a {type(self).__name__} is filled by the model's forward")

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1


class FoxCacheLayer(AttentionState, ModelFilledLayer):
    """One FoX attention layer's state as a transformers cache layer."""

    is_compileable = False
    supports_early_init = False  # shapes depend on the layer (shift, GQA), not on transformers' (B, H, T, D)

    def __repr__(self):
        return f"{type(self).__name__}(length={self.length}, record_past={self.record_past})"

    @property
    def is_croppable(self) -> bool:
        return self.can_truncate

    @property
    def is_initialized(self) -> bool:
        return self.k is not None

    @property
    def keys(self):
        """K in transformers' layout (B, Hkv, T, D): a view of ``k``."""
        return None if self.k is None else self.k.transpose(1, 2)

    @property
    def values(self):
        """V in transformers' layout (B, Hkv, T, D): a view of ``v``."""
        return None if self.v is None else self.v.transpose(1, 2)

    def activate_past_recording(self) -> None:
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' layer convention: remove ``-tokens_to_remove`` tokens (a number <= 0)."""
        if tokens_to_remove > 0:
            raise ValueError(f"a cache layer's crop takes the (negative) number of tokens to remove, got {tokens_to_remove}")
        self.truncate(max(self.length + tokens_to_remove, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device)])

    def offload(self) -> None:
        if self.k is not None:
            self._device = self.k.device
            self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        device = getattr(self, "_device", None)
        if device is not None and self.k is not None and self.k.device != device:
            self._map(lambda t: t.to(device, non_blocking=True))


class LayerCache(Cache):
    """A transformers ``Cache`` of one ``state_cls`` per layer, made empty for ``num_layers`` layers."""

    state_cls: type = FoxCacheLayer

    def __init__(self, num_layers: int):
        super().__init__(layers=[self.state_cls() for _ in range(num_layers)])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens when it is <= 0 (transformers 5's convention); keep the first
        ``tokens_to_remove`` tokens when it is > 0 (4.x's ``crop(max_length)``)."""
        if tokens_to_remove > 0:
            tokens_to_remove = min(tokens_to_remove - self.get_seq_length(), 0)
        super().crop(tokens_to_remove)


class FoxCache(LayerCache):
    """K, V, gate prefix sums and token-shift states of every layer, plus the batch's left padding."""
