"""Look inside a FoX model: forget gates, decay times, forget-gate and attention matrices, pruning.

    stats = gate_statistics(model, input_ids)          # per layer and head, from one forward pass
    F = forget_matrix(capture, layer=3, head=5)         # exp(c_i - c_j), (T, T)
    A = attention_matrix(capture, layer=3, head=5)      # softmax(s q.k + log F), (T, T), blockwise

All of it is computed from the attention layers' own projections (``ForgettingAttentionLayer.project``),
captured with forward hooks during one forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fox_kernel import DEFAULT_LOG_TOLERANCE, pruning_bound
from fox_layers import ForgettingAttentionLayer

LOG_EPS = DEFAULT_LOG_TOLERANCE  # ln eps = -10 of the pruning bound (fox_kernel.pruning_bound)


class NoForgetGateError(ValueError):
    """Raised for models without a forget gate (Transformer baselines, fgate_type='none')."""


@dataclass
class LayerCapture:
    q: torch.Tensor  # (T, H, D), batch row 0, on the CPU
    k: torch.Tensor  # (T, H, D), repeated to query heads, on the CPU
    log_fgate: torch.Tensor  # (T, H) float32, on the CPU
    layer: ForgettingAttentionLayer


def attention_layers(model) -> list[ForgettingAttentionLayer]:
    return [m for m in model.modules() if isinstance(m, ForgettingAttentionLayer)]


def has_forget_gate(model) -> bool:
    return any(layer.fgate_type != "none" for layer in attention_layers(model))


@torch.no_grad()
def capture(model, input_ids: torch.Tensor) -> list[LayerCapture]:
    """Run the model once on input_ids (1, T) and keep each layer's q, k and log gates (float32)."""
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no FoX attention layers")
    if not has_forget_gate(model):
        raise NoForgetGateError(f"{type(model).__name__} has no forget gate (fgate_type='none'): nothing to inspect")
    captured: list[LayerCapture] = []

    def hook(layer, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        q, k, _, lf, _, _ = layer.project(x[:1])
        group = layer.num_heads // layer.num_kv_heads
        # on the CPU: the analyses below build (T, T) matrices and loop over tiles, which a GPU does not speed up
        captured.append(LayerCapture(q[0].float().cpu(), k[0].float().repeat_interleave(group, dim=1).cpu(),
                                     lf[0].float().cpu(), layer))

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    try:
        model(input_ids=input_ids[:1], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return captured


def decay_time(log_fgate: torch.Tensor) -> torch.Tensor:
    """-1 / mean(log f) over positions, per head: (T, H) -> (H,). inf for a gate of exactly 1."""
    mean = log_fgate.double().mean(0)
    return torch.where(mean < 0, -1.0 / mean, torch.full_like(mean, math.inf)).float()


def pruning_fraction(cap: LayerCapture, block: int = 128, log_eps: float = LOG_EPS) -> torch.Tensor:
    """Per head, the fraction of causal (query block, key block) tiles that pruning would skip.

    A tile left of the diagonal is skipped when its largest bias c_first_query - c_last_key is below
    ``fox_kernel.pruning_bound`` (delta = -(2U + ln T) + ln eps) with the U the layer's kernel call uses:
    from the QK-norm weights when the layer has QK-norm, else U = max|q| max|k| s.
    """
    q, k, lf = cap.q, cap.k, cap.log_fgate
    T, H, D = q.shape
    c = torch.cumsum(lf.double(), dim=0)  # (T, H)
    delta = cap.layer.pruning_threshold(T, log_eps)
    if isinstance(delta, torch.Tensor):
        delta = delta[0].detach().double().cpu()
    else:
        u = q.norm(dim=-1).amax(0) * k.norm(dim=-1).amax(0) * D**-0.5
        delta = pruning_bound(u.double(), T, log_eps)
    nb = -(-T // block)
    skipped = torch.zeros(H, dtype=torch.float64)
    total = 0
    for qb in range(nb):
        first = qb * block
        for kb in range(qb + 1):
            total += 1
            if kb * block + block - 1 >= first:  # the diagonal tile is always computed
                continue
            skipped += (c[first] - c[kb * block + block - 1] < delta).double()
    return (skipped / total).float()


def gate_statistics(model, input_ids: torch.Tensor, block: int = 128) -> list[list[dict]]:
    """stats[layer][head]: mean log f, decay time, quantiles of f, pruning fraction."""
    out = []
    for cap in capture(model, input_ids):
        f = cap.log_fgate.exp()
        qs = torch.quantile(f.double(), torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64), dim=0)
        times, pruned = decay_time(cap.log_fgate), pruning_fraction(cap, block)
        out.append([
            {"mean_log_f": float(cap.log_fgate[:, h].mean()), "decay_time": float(times[h]),
             "f_quantiles": {p: float(qs[i, h]) for i, p in enumerate(("p5", "p25", "p50", "p75", "p95"))},
             "pruned_fraction": float(pruned[h])}
            for h in range(cap.log_fgate.shape[1])
        ])
    return out


def forget_matrix(cap: LayerCapture, head: int) -> torch.Tensor:
    """F_ij = exp(c_i - c_j) for j <= i, else 0: (T, T) float32."""
    c = torch.cumsum(cap.log_fgate[:, head].double(), dim=0)
    diff = c[:, None] - c[None, :]
    T = len(c)
    return torch.where(torch.ones(T, T, dtype=torch.bool).tril(), diff.exp(), torch.zeros_like(diff)).float()


def attention_matrix(cap: LayerCapture, head: int, block: int = 512) -> torch.Tensor:
    """softmax(s q_i.k_j + c_i - c_j) over j <= i for one head, computed ``block`` query rows at a time."""
    q, k = cap.q[:, head].double(), cap.k[:, head].double()
    c = torch.cumsum(cap.log_fgate[:, head].double(), dim=0)
    T, D = q.shape
    out = torch.zeros(T, T, dtype=torch.float32)
    for s in range(0, T, block):
        e = min(T, s + block)
        scores = q[s:e] @ k.T * D**-0.5 + c[s:e, None] - c[None, :]
        rows = torch.arange(s, e)[:, None]
        scores = scores.masked_fill(torch.arange(T)[None, :] > rows, float("-inf"))
        out[s:e] = torch.softmax(scores, dim=-1).float()
    return out
