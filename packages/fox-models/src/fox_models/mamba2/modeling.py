"""Mamba-2's mixer, block and models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from fox_layers import RMSNorm
from fox_models.base import _FoxForCausalLMBase, _FoxPreTrainedBase
from fox_models.compat import GenerationMixin, GradientCheckpointingLayer
from fox_models.mamba2.configuration import Mamba2Config
from fox_models.recurrent import RecurrentState, _RecurrentBackbone, _RecurrentInit
from fox_models.recurrent_ops import head_gated_linear_attention, short_conv


class GatedRMSNorm(nn.Module):
    """RMSNorm(y * silu(z)) over groups of ``group_size`` channels, weight (channels,)."""

    def __init__(self, channels: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.group_size, self.eps = group_size, eps

    def forward(self, y, z):
        acc = torch.promote_types(y.dtype, torch.float32)
        h = y.to(acc) * F.silu(z.to(acc))
        g = h.view(*h.shape[:-1], h.shape[-1] // self.group_size, self.group_size)  # no -1: T may be 0
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (g.view_as(h) * self.weight.to(acc)).to(y.dtype)


class CausalConv1d(nn.Conv1d):
    """The depthwise convolution of the mixer (an nn.Conv1d, with its published parameter names) run as a
    causal convolution with SiLU over (B, T, C) inputs and a carried state; called as a module, never its
    weights read from outside, so hooks that load weights just in time (accelerate's disk offload) see it."""

    def forward(self, x, state=None):
        """x (B, T, C), state (B, W - 1, C) or None -> (y, new state), as ``short_conv``."""
        return short_conv(x, self.weight, state, bias=self.bias)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: Mamba2Config):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.n_groups, self.state_size = config.n_groups, config.state_size
        self.intermediate_size = config.expand * config.hidden_size
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.state_size
        self.time_step_limit = config.time_step_limit
        self.in_proj = nn.Linear(config.hidden_size, self.intermediate_size + self.conv_dim + self.num_heads,
                                 bias=config.use_bias)
        self.conv1d = CausalConv1d(self.conv_dim, self.conv_dim, config.conv_kernel, groups=self.conv_dim,
                                bias=config.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // self.n_groups,
                                 config.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.use_bias)

    def forward(self, x, *, real=None, state: RecurrentState | None = None):
        B, T, _ = x.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.state_size
        z, xbc, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, H], dim=-1)
        if real is not None:  # padded tokens feed zeros to the convolution and nothing to the state
            xbc = xbc * real
        get = (lambda name: None) if state is None else state.get
        xbc, conv_state = self.conv1d(xbc, get("conv"))
        xs, b, c = xbc.split([self.intermediate_size, G * N, G * N], dim=-1)
        acc = torch.promote_types(x.dtype, torch.float32)
        dt = F.softplus(dt.to(acc) + self.dt_bias.to(acc))
        lo, hi = self.time_step_limit
        if (lo, hi) != (0.0, float("inf")):
            dt = dt.clamp(lo, hi)
        if real is not None:
            dt = dt * real
        A = -torch.exp(self.A_log.to(acc))
        xs = xs.view(B, T, H, P).to(acc)
        rep = H // G
        k = b.view(B, T, G, 1, N).expand(B, T, G, rep, N).reshape(B, T, H, N)
        q = c.view(B, T, G, 1, N).expand(B, T, G, rep, N).reshape(B, T, H, N)
        v = xs * dt.unsqueeze(-1)
        y, S = head_gated_linear_attention(q, k, v, dt * A, 1.0, get("S"))
        y = y + xs * self.D.to(acc)[:, None]
        if state is not None:
            state.tensors.update(S=S, conv=conv_state)
        return self.out_proj(self.norm(y.reshape(B, T, H * P).to(x.dtype), z))


class Mamba2Block(GradientCheckpointingLayer):
    def __init__(self, config: Mamba2Config):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(config)

    def forward(self, x, real=None, lower_bound=None, state=None):
        h = self.norm(x.to(self.norm.weight.dtype))
        # the residual stream stays in float32
        residual = x.float() if self.residual_in_fp32 and x.dtype in (torch.float16, torch.bfloat16) else x
        mix = lambda h, r: self.mixer(h, real=r, state=state)
        return residual + (mix(h, real) if state is None else state.run(mix, h, real))


class _Mamba2Init(_RecurrentInit):
    _no_split_modules = ["Mamba2Block"]
    _keep_in_fp32_modules_strict = ["A_log"]  # the decay rates stay float32 in fp16/bf16 models, as released

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Mamba2Mixer):
            c = self.config
            dt = torch.exp(torch.rand(c.num_heads) * (math.log(c.time_step_max) - math.log(c.time_step_min))
                           + math.log(c.time_step_min)).clamp(min=c.time_step_floor)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
            init.copy_(module.A_log, torch.log(torch.arange(1, c.num_heads + 1, dtype=torch.float32)))
            init.ones_(module.D)
        elif isinstance(module, nn.Conv1d):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, GatedRMSNorm):
            init.ones_(module.weight)


class Mamba2PreTrainedModel(_Mamba2Init, _FoxPreTrainedBase):
    config_class = Mamba2Config
    base_model_prefix = "backbone"


class Mamba2Model(_Mamba2Init, _RecurrentBackbone):
    """The released names: ``embeddings``, ``layers`` (norm + mixer), ``norm_f``; the forward is the
    recurrent baselines' (left padding, cache, gradient checkpointing)."""

    config_class = Mamba2Config
    base_model_prefix = "backbone"

    def __init__(self, config: Mamba2Config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Mamba2Block(config) for _ in range(config.num_hidden_layers)])
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False
        self.post_init()

    def final_norm(self, x):
        return self.norm_f(x.to(self.embeddings.weight.dtype))  # the residual stream ran in float32


class Mamba2ForCausalLM(_Mamba2Init, _FoxForCausalLMBase, GenerationMixin):
    """Mamba-2 LM; the backbone lives under ``backbone`` as released (``model`` is an alias)."""

    config_class = Mamba2Config
    base_model_prefix = "backbone"
    _tied_weights_keys = {"lm_head.weight": "backbone.embeddings.weight"}  # with config.tie_word_embeddings only
    backbone_cls = Mamba2Model

    @property
    def model(self):
        return self.backbone
