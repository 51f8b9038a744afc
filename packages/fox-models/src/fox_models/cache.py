"""The decoding cache of FoX models: one ``fox_layers.AttentionState`` per layer (kernel cache format)."""

from __future__ import annotations

import torch

from fox_layers import AttentionState


class LayerCache:
    """One state object per layer (``state_cls``), each with ``length`` and ``reorder(index)``."""

    state_cls = AttentionState

    def __init__(self, num_layers: int):
        self.layers = [self.state_cls() for _ in range(num_layers)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def __len__(self) -> int:
        return len(self.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for state in self.layers:
            state.reorder(beam_idx)


class FoxCache(LayerCache):
    """K, V, gate prefix sums and token-shift states of every layer, plus the batch's left padding."""
