"""Per-token cross-entropy without materialising float32 logits for the whole batch.

On CUDA (and in the Triton interpreter) the loss is fused (``fox_models.fused_loss``): per chunk one GEMM
in the compute dtype and one Triton pass, with no float32 copy of the logits. Elsewhere (and for float64)
the chunks run through ``F.cross_entropy`` with activation checkpointing, which casts each chunk's logits
to float32 and keeps its log-softmax for the backward: about four times the memory traffic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fox_layers import use_triton
from fox_models.fused_loss import IGNORE_INDEX, _FusedLinearCrossEntropy

# The lm-head GEMM runs with the vocabulary padded to this multiple: with an odd vocabulary (GPT-2's
# 50257) the logits' rows are not 16-byte aligned and cuBLAS falls back to slow unaligned kernels
# (measured on an H200: the three lm-head GEMMs of a 16k-token step took ~44 ms instead of ~10 ms).
PAD_MULTIPLE = 128


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    if logits.shape[-1] > vocab:  # padding rows of the weight: never the answer, no probability
        logits[:, vocab:] = float("-inf")
    return F.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORE_INDEX)


def per_token_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 8192,
                            pad_multiple: int | None = None, fused: bool | None = None):
    """hidden (B, T, D), lm-head weight (V, D), labels (B, T) -> loss (B, T) float32 (0 where label is -100).

    Logits are made ``chunk_tokens`` rows at a time and remade in the backward pass, so at most one
    chunk's logits exist at once: (chunk_tokens, V) in the compute dtype when ``fused`` (the default on
    CUDA and in the Triton interpreter), float32 otherwise. For the GEMMs the weight is zero-padded to a
    multiple of ``pad_multiple`` rows (default ``PAD_MULTIPLE`` on CUDA, none elsewhere); the padded
    classes get no probability.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    B, T, D = hidden.shape
    vocab = weight.shape[0]
    multiple = pad_multiple or (PAD_MULTIPLE if hidden.is_cuda else 1)
    if vocab % multiple:
        weight = F.pad(weight, (0, 0, 0, -vocab % multiple))
    flat_h, flat_y = hidden.reshape(B * T, D), labels.reshape(B * T)
    if fused is None:
        fused = use_triton(hidden) and hidden.dtype != torch.float64
    if fused:
        return _FusedLinearCrossEntropy.apply(flat_h, weight, flat_y, vocab, chunk_tokens).view(B, T)
    pieces = []
    for s in range(0, B * T, chunk_tokens):
        h, y = flat_h[s : s + chunk_tokens], flat_y[s : s + chunk_tokens]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            pieces.append(checkpoint(_chunk_loss, h, weight, y, vocab, use_reentrant=False))
        else:
            pieces.append(_chunk_loss(h, weight, y, vocab))
    return torch.cat(pieces).view(B, T)
