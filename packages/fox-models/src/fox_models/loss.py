"""Per-token cross-entropy without materialising float32 logits for the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, reduction="none", ignore_index=-100)


def per_token_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 8192):
    """hidden (B, T, D), lm-head weight (V, D), labels (B, T) -> loss (B, T) float32 (0 where label is -100).

    Logits are made ``chunk_tokens`` rows at a time and recomputed in the backward pass, so at most
    (chunk_tokens, V) float32 logits exist at once.
    """
    B, T, D = hidden.shape
    flat_h, flat_y = hidden.reshape(B * T, D), labels.reshape(B * T)
    pieces = []
    for s in range(0, B * T, chunk_tokens):
        h, y = flat_h[s : s + chunk_tokens], flat_y[s : s + chunk_tokens]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            pieces.append(checkpoint(_chunk_loss, h, weight, y, use_reentrant=False))
        else:
            pieces.append(_chunk_loss(h, weight, y))
    return torch.cat(pieces).view(B, T)
