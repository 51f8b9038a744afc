"""Mamba-2 baseline in the released layout (``mamba2-project_fox``, Hugging Face Mamba-2 names).

``backbone.embeddings``, ``backbone.layers.{i}.norm`` + ``.mixer`` (``in_proj``, ``conv1d`` with bias,
``dt_bias``, ``A_log``, ``D``, gated ``norm``, ``out_proj``), ``backbone.norm_f``, ``lm_head``. Per head h
with state (head_dim x state_size): ``S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T``,
``y_t = S_t C_t + D_h x_t``, ``dt = softplus(W_dt x + dt_bias)``, ``A = -exp(A_log)``; the output is
``RMSNorm(y * silu(z))`` (normalised after the gate, per group). The scan is gated linear attention with
a per-head scalar decay (fox_models.recurrent_ops: flash-linear-attention on CUDA when installed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from fox_layers import RMSNorm
from fox_models.baselines import RecurrentState, _RecurrentBackbone, _RecurrentInit
from fox_models.compat import ConfigBase
from fox_models.modeling import _FoxForCausalLMBase, _FoxPreTrainedBase
from fox_models.recurrent_ops import gated_linear_attention, short_conv


class Mamba2Config(ConfigBase):
    """Mamba-2 (Dao & Gu 2024), field names and defaults as in the released configs."""

    model_type = "mamba2-project_fox"

    def __init__(
        self,
        num_heads: int = 64,
        head_dim: int = 64,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        state_size: int = 64,
        num_hidden_layers: int = 48,
        layer_norm_epsilon: float = 1e-5,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        expand: int = 2,
        conv_kernel: int = 4,
        n_groups: int = 8,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        hidden_act: str = "silu",
        initializer_range: float = 0.1,
        residual_in_fp32: bool = True,
        time_step_rank="auto",
        time_step_min: float = 0.001,
        time_step_max: float = 0.1,
        time_step_floor: float = 1e-4,
        time_step_limit=(0.0, float("inf")),
        rescale_prenorm_residual: bool = True,
        use_cache: bool = True,
        rms_norm: bool = True,
        chunk_size: int = 256,
        fuse_cross_entropy: bool = True,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if num_heads * head_dim != expand * hidden_size:
            raise ValueError(f"num_heads * head_dim must equal expand * hidden_size, got {num_heads} * {head_dim} "
                             f"!= {expand} * {hidden_size}")
        if num_heads % n_groups:
            raise ValueError(f"num_heads {num_heads} must be divisible by n_groups {n_groups}")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be 'silu', got {hidden_act!r}")
        if not rms_norm:
            raise ValueError("rms_norm=False is not supported (the released Mamba-2 uses the gated RMSNorm)")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.state_size = state_size
        self.num_hidden_layers = num_hidden_layers
        self.layer_norm_epsilon = layer_norm_epsilon
        self.conv_kernel = conv_kernel
        self.expand = expand
        self.use_bias = use_bias
        self.use_conv_bias = use_conv_bias
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.time_step_rank = math.ceil(hidden_size / 16) if time_step_rank == "auto" else time_step_rank
        self.time_step_min = time_step_min
        self.time_step_max = time_step_max
        self.time_step_floor = time_step_floor
        self.time_step_limit = tuple(time_step_limit)
        self.rescale_prenorm_residual = rescale_prenorm_residual
        self.residual_in_fp32 = residual_in_fp32
        self.use_cache = use_cache
        self.n_groups = n_groups
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.rms_norm = rms_norm
        self.chunk_size = chunk_size
        self.fuse_cross_entropy = fuse_cross_entropy
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class GatedRMSNorm(nn.Module):
    """RMSNorm(y * silu(z)) over groups of ``group_size`` channels, weight (channels,)."""

    def __init__(self, channels: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.group_size, self.eps = group_size, eps

    def forward(self, y, z):
        acc = torch.promote_types(y.dtype, torch.float32)
        h = y.to(acc) * F.silu(z.to(acc))
        g = h.view(*h.shape[:-1], -1, self.group_size)
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
        log_decay = (dt * A).unsqueeze(-1).expand(B, T, H, N)
        v = xs * dt.unsqueeze(-1)
        y, S = gated_linear_attention(q.to(acc), k.to(acc), v, log_decay, 1.0, get("S"))
        y = y + xs * self.D.to(acc)[:, None]
        if state is not None:
            state.tensors.update(S=S, conv=conv_state)
        return self.out_proj(self.norm(y.reshape(B, T, -1).to(x.dtype), z))


class Mamba2Block(nn.Module):
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
        PreTrainedModel.__init__(self, config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Mamba2Block(config) for _ in range(config.num_hidden_layers)])
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False
        self.post_init()

    def final_norm(self, x):
        return self.norm_f(x.to(self.embeddings.weight.dtype))  # the residual stream ran in float32


class Mamba2ForCausalLM(_Mamba2Init, _FoxForCausalLMBase):
    """Mamba-2 LM; the backbone lives under ``backbone`` as released (``model`` is an alias)."""

    config_class = Mamba2Config
    base_model_prefix = "backbone"
    _tied_weights_keys = {"lm_head.weight": "backbone.embeddings.weight"}  # with config.tie_word_embeddings only

    def __init__(self, config: Mamba2Config):
        PreTrainedModel.__init__(self, config)
        self.backbone = Mamba2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def model(self):
        return self.backbone
