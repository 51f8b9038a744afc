"""DeltaNet's sequence mixer and models."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init

from fox_layers import RMSNorm, bare_module, norm_gate
from fox_models.base import _FoxForCausalLMBase, _FoxPreTrainedBase
from fox_models.compat import GenerationMixin
from fox_models.delta_net.configuration import DeltaNetConfig
from fox_models.recurrent import RecurrentState, _MixerBackbone, _RecurrentInit
from fox_models.recurrent_ops import delta_rule, short_conv


class DeltaNetAttention(nn.Module):
    """q, k, v through causal short convolutions + SiLU, q and k L2-normalised, beta = sigmoid(W_b x);
    the delta rule per head; RMSNorm per head; W_o."""

    def __init__(self, config: DeltaNetConfig, layer_idx: int):
        super().__init__()
        D, H = config.hidden_size, config.num_heads
        self.key_dim, self.value_dim = int(D * config.expand_k), int(D * config.expand_v)
        if self.key_dim % H or self.value_dim % H:
            raise ValueError(f"key/value dims {self.key_dim}/{self.value_dim} must be divisible by num_heads {H}")
        self.num_heads, self.head_k_dim, self.head_v_dim = H, self.key_dim // H, self.value_dim // H
        self.use_beta = config.use_beta
        self.q_proj = nn.Linear(D, self.key_dim, bias=False)
        self.k_proj = nn.Linear(D, self.key_dim, bias=False)
        self.v_proj = nn.Linear(D, self.value_dim, bias=False)
        if self.use_beta:
            self.b_proj = nn.Linear(D, H, bias=False)
        W = config.conv_size
        self.q_conv1d = _ConvWeight(self.key_dim, W)
        self.k_conv1d = _ConvWeight(self.key_dim, W)
        self.v_conv1d = _ConvWeight(self.value_dim, W)
        self.o_norm = RMSNorm(self.head_v_dim, eps=config.norm_eps)
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)

    def forward(self, x, *, real=None, state: RecurrentState | None = None, lower_bound=None):
        B, T, _ = x.shape
        H = self.num_heads
        get = (lambda name: None) if state is None else state.get
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if real is not None:  # padded inputs must not reach real tokens through the convolutions
            q, k, v = q * real, k * real, v * real
        q, cq = self.q_conv1d(q, get("conv_q"))
        k, ck = self.k_conv1d(k, get("conv_k"))
        v, cv = self.v_conv1d(v, get("conv_v"))
        if real is not None:
            v = v * real
        acc = torch.promote_types(x.dtype, torch.float32)
        beta = torch.sigmoid(self.b_proj(x).to(acc)) if self.use_beta else x.new_ones(B, T, H, dtype=acc)
        # sizes spelled out (no -1): a chunk of 0 tokens has 0 elements, from which -1 cannot be inferred
        keys, values = (B, T, H, self.head_k_dim), (B, T, H, self.head_v_dim)
        o, S = delta_rule(q.view(keys), k.view(keys), v.view(values), beta, self.head_k_dim ** -0.5, get("S"),
                          l2_normalize_qk=True)
        if state is not None:
            state.tensors.update(S=S, conv_q=cq, conv_k=ck, conv_v=cv)
        return self.o_proj(self._head_norm(o))

    def _head_norm(self, o):
        """``o_norm`` on each head of o (B, T, H, Dv), flattened to (B, T, H * Dv): one fused pass on CUDA
        (the weight shared by the heads) while o_norm is a plain RMSNorm without hooks; otherwise called as a
        module."""
        norm = self.o_norm
        if bare_module(norm, RMSNorm) and norm.weight is not None:
            return norm_gate(o.flatten(-2), norm.weight, None, self.num_heads, norm.eps)
        return norm(o).flatten(-2)


class _ConvWeight(nn.Module):
    """A causal depthwise convolution with SiLU, weight (C, 1, W) under the published name ``<x>_conv1d.weight``.

    Called as a module (never its weight read from outside), so hooks that load weights just in time
    (accelerate's disk offload) see it."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        nn.init.normal_(self.weight, std=1 / math.sqrt(width))

    def forward(self, x, state=None):
        """x (B, T, C), state (B, W - 1, C) or None -> (y, new state), as ``short_conv``."""
        return short_conv(x, self.weight, state)


class _DeltaNetInit(_RecurrentInit):
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, _ConvWeight):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)


class DeltaNetPreTrainedModel(_DeltaNetInit, _FoxPreTrainedBase):
    config_class = DeltaNetConfig


class DeltaNetModel(_DeltaNetInit, _MixerBackbone):
    config_class = DeltaNetConfig
    mixer_cls = DeltaNetAttention


class DeltaNetForCausalLM(_DeltaNetInit, _FoxForCausalLMBase, GenerationMixin):
    config_class = DeltaNetConfig
    backbone_cls = DeltaNetModel
