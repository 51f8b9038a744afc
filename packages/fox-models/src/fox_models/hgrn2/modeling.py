"""HGRN2's sequence mixer and models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fox_layers import RMSNorm
from fox_models.base import _FoxForCausalLMBase, _FoxPreTrainedBase
from fox_models.compat import GenerationMixin
from fox_models.hgrn2.configuration import HGRN2Config
from fox_models.recurrent import RecurrentState, _MixerBackbone, _RecurrentInit
from fox_models.recurrent_ops import gated_linear_attention


class HGRN2Attention(nn.Module):
    """q = swish(W_q x), forget gate g = sigmoid(W_f x) (input gate 1 - g), values W_i x; gated linear
    attention per head (key size expand_ratio, value size hidden/heads); RMSNorm over all heads; W_o."""

    def __init__(self, config: HGRN2Config, layer_idx: int):
        super().__init__()
        D = config.hidden_size
        num_heads, ratio = config.num_heads, config.expand_ratio
        if ratio is None:
            ratio = D // num_heads
        elif num_heads is None:
            num_heads = D // ratio
        if D % num_heads:
            raise ValueError(f"hidden_size {D} must be divisible by num_heads {num_heads}")
        self.num_heads, self.head_f_dim, self.head_i_dim = num_heads, ratio, D // num_heads
        self.forget_dim = num_heads * ratio
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(D, self.forget_dim, bias=False)
        self.f_proj = nn.Linear(D, self.forget_dim, bias=False)
        self.i_proj = nn.Linear(D, D, bias=False)
        self.g_norm = RMSNorm(D, eps=config.norm_eps, elementwise_affine=config.elementwise_affine)
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x, *, real=None, state: RecurrentState | None = None, lower_bound=None):
        B, T, _ = x.shape
        H = self.num_heads
        q = F.silu(self.q_proj(x))
        f = self.f_proj(x).to(torch.promote_types(x.dtype, torch.float32))
        i = self.i_proj(x)
        if lower_bound is None:
            log_g, k = F.logsigmoid(f), 1 - torch.sigmoid(f)
        else:
            g = lower_bound + (1 - lower_bound) * torch.sigmoid(f)
            log_g, k = g.log(), 1 - g
        if real is not None:  # left padding: no input, no decay
            i = i * real
            log_g = log_g * real
        # sizes spelled out (no -1): a chunk of 0 tokens has 0 elements, from which -1 cannot be inferred
        keys, values = (B, T, H, self.head_f_dim), (B, T, H, self.head_i_dim)
        o, S = gated_linear_attention(q.view(keys), k.to(i.dtype).view(keys), i.view(values), log_g.view(keys),
                                      self.head_f_dim ** -0.5, None if state is None else state.get("S"))
        if state is not None:
            state.tensors["S"] = S
        return self.o_proj(self.g_norm(o.reshape(B, T, H * self.head_i_dim)))


class HGRN2PreTrainedModel(_RecurrentInit, _FoxPreTrainedBase):
    config_class = HGRN2Config


class HGRN2Model(_MixerBackbone):
    config_class = HGRN2Config
    mixer_cls = HGRN2Attention


class HGRN2ForCausalLM(_RecurrentInit, _FoxForCausalLMBase, GenerationMixin):
    config_class = HGRN2Config
    backbone_cls = HGRN2Model
