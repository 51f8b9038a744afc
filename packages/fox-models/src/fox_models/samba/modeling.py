"""SAMBA's Mamba mixer, block, cache and models, in the reference implementation's layout: ``backbone``
with ``embeddings``, ``layers.{i}.mixer_norm / mixer / mlp_norm / mlp`` and ``norm_f``, then ``lm_head``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache

from fox_layers import ForgettingAttentionLayer, RMSNorm, SwiGLUMLP, bare_linear
from fox_models.base import _FoxForCausalLMBase, _FoxPreTrainedBase
from fox_models.cache import FoxCacheLayer, LayerCache
from fox_models.compat import GenerationMixin, GradientCheckpointingLayer, pick_cache
from fox_models.mamba2.modeling import CausalConv1d
from fox_models.recurrent import RecurrentState, _real_tokens
from fox_models.samba.configuration import SambaConfig
from fox_models.samba.selective_scan import selective_scan


class MambaMixer(nn.Module):
    """Mamba (v1): in_proj -> (x, z); x through a causal depthwise convolution and SiLU; x_proj -> (dt of
    rank ``time_step_rank``, B, C); dt_proj; the selective scan with delta = softplus(dt + dt_proj.bias),
    A = -exp(A_log), skip D and output gate silu(z); out_proj."""

    def __init__(self, config: SambaConfig):
        super().__init__()
        D, E, N, R = config.hidden_size, config.intermediate_size, config.state_size, config.time_step_rank
        self.intermediate_size, self.state_size, self.time_step_rank = E, N, R
        self.in_proj = nn.Linear(D, 2 * E, bias=config.use_bias)
        self.conv1d = CausalConv1d(E, E, config.conv_kernel, groups=E, bias=config.use_conv_bias)
        self.x_proj = nn.Linear(E, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, E, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(E, 1))
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, D, bias=config.use_bias)

    def forward(self, x, *, real=None, state: RecurrentState | None = None):
        """x (B, T, hidden); real (B, T, 1) real-token mask (left padding) or None; state: the layer's
        decoding state (convolution window ``conv``, scan state ``S``), updated in place."""
        get = (lambda name: None) if state is None else state.get
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        if real is not None:  # padded tokens feed zeros to the convolution and nothing to the state
            xs = xs * real
        xs, conv_state = self.conv1d(xs, get("conv"))
        if real is not None:
            xs = xs * real
        dt, B, C = self.x_proj(xs).split([self.time_step_rank, self.state_size, self.state_size], dim=-1)
        # dt_proj's bias is added inside the scan in float32 (as the reference's CUDA path does), not
        # rounded with the projection's 16-bit output; a wrapped dt_proj (PEFT/LoRA, hooks) is called as a
        # module, bias included, so what it adds takes effect
        if bare_linear(self.dt_proj):
            dt, dt_bias = F.linear(dt, self.dt_proj.weight), self.dt_proj.bias
        else:
            dt, dt_bias = self.dt_proj(dt), None
        A = -torch.exp(self.A_log.to(torch.promote_types(x.dtype, torch.float32)))  # float64 models: float64
        y, S = selective_scan(xs, dt, A, B, C, self.D, z, dt_bias, get("S"))
        if state is not None:
            state.tensors.update(S=S, conv=conv_state)
        return self.out_proj(y)


def _attention(config: SambaConfig) -> ForgettingAttentionLayer:
    """A sliding-window attention layer of the reference: q/k/v/o projections without bias, RoPE (base
    ``rope_base``), no forget gate, each query seeing its ``window_size`` latest keys."""
    return ForgettingAttentionLayer(config.hidden_size, config.num_heads, config.num_kv_heads, fgate_type="none",
                                    use_rope=True, rope_base=config.rope_base, window_size=config.window_size)


class SambaBlock(GradientCheckpointingLayer):
    """Pre-norm block: x + mixer(mixer_norm(x)), then + mlp(mlp_norm(x)); the mixer is sliding-window
    attention on the attention layers, Mamba on the others."""

    def __init__(self, config: SambaConfig, layer_idx: int):
        super().__init__()
        self.is_attention = config.is_attention_layer(layer_idx)
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mixer = _attention(config) if self.is_attention else MambaMixer(config)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.mlp_ratio(layer_idx))
        if config.rescale_prenorm_residual:  # read by _init_weights (transformers visits the linears themselves)
            residual = self.mixer.o_proj if self.is_attention else self.mixer.out_proj
            for linear in (residual, self.mlp.down_proj):
                linear.init_scale = (2 * config.num_hidden_layers) ** -0.5

    def forward(self, x, seq_start=None, real=None, state=None):
        h = self.mixer_norm(x)
        if self.is_attention:
            a, _ = self.mixer(h, seq_start=seq_start, state=state)
        else:
            mix = lambda h, r: self.mixer(h, real=r, state=state)
            a = mix(h, real) if state is None else state.run(mix, h, real)
        x = x + a
        return x + self.mlp(self.mlp_norm(x))


class SambaCache(LayerCache):
    """One state per layer: the attention layers' keys and values (``FoxCacheLayer``), the Mamba layers'
    convolution window and scan state (``RecurrentState``, fixed size)."""

    def __init__(self, config: SambaConfig):
        Cache.__init__(self, layers=[FoxCacheLayer() if config.is_attention_layer(i) else RecurrentState()
                                     for i in range(config.num_hidden_layers)])


class _SambaInit:
    """The reference's initialisation: PyTorch's defaults for linear and convolution weights and convolution
    biases (U(+-1/sqrt(fan_in))), linear biases 0, the projections into the residual stream (o_proj,
    out_proj, down_proj: their ``init_scale``) 1/sqrt(2 num_hidden_layers) times smaller with
    ``rescale_prenorm_residual``, embeddings N(0, initializer_range), norm weights 1; Mamba's S4D-real A
    (A_log = log n), D = 1, dt_proj weights U(+-time_step_scale/sqrt(time_step_rank)) and a bias that gives
    time steps log-uniform in [time_step_min, time_step_max] (at least time_step_floor).

    transformers calls this for every module that holds parameters itself, children before parents."""

    _no_split_modules = ["SambaBlock"]
    _supports_sdpa = False  # the attention layers run the windowed FoX kernel, not SDPA
    _keep_in_fp32_modules_strict = ["A_log"]  # the decay rates stay float32 in 16-bit models

    def _init_weights(self, module):
        c = self.config
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            bound = 1 / math.sqrt(module.weight[0].numel())  # 1 / sqrt(fan_in)
            scaled = bound * getattr(module, "init_scale", 1.0)
            init.uniform_(module.weight, -scaled, scaled)
            if module.bias is not None:
                if isinstance(module, nn.Conv1d):
                    init.uniform_(module.bias, -bound, bound)
                else:
                    init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=c.initializer_range)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, MambaMixer):
            N, E = c.state_size, c.intermediate_size
            init.copy_(module.A_log, torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(E, 1))
            init.ones_(module.D)
            std = c.time_step_rank**-0.5 * c.time_step_scale
            if c.time_step_init_scheme == "constant":
                init.constant_(module.dt_proj.weight, std)
            else:
                init.uniform_(module.dt_proj.weight, -std, std)
            lo, hi = math.log(c.time_step_min), math.log(c.time_step_max)
            dt = torch.exp(torch.rand(E) * (hi - lo) + lo).clamp(min=c.time_step_floor)
            init.copy_(module.dt_proj.bias, dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


class SambaPreTrainedModel(_SambaInit, _FoxPreTrainedBase):
    config_class = SambaConfig
    base_model_prefix = "backbone"


class SambaModel(_SambaInit, _FoxPreTrainedBase):
    """Embeddings, ``SambaBlock``s, final RMSNorm ``norm_f``."""

    config_class = SambaConfig
    base_model_prefix = "backbone"

    def __init__(self, config: SambaConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([SambaBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm_f = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def new_cache(self):
        return SambaCache(self.config)

    def final_norm(self, x):
        return self.norm_f(x)

    def forward(self, input_ids=None, attention_mask=None, cache: SambaCache | None = None,
                inputs_embeds=None, use_cache: bool | None = None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, cu_seqlens=None, return_dict: bool | None = None,
                past_key_values: SambaCache | None = None, **kwargs):
        """``past_key_values`` is the older name of ``cache``."""
        if output_attentions:
            raise ValueError("output_attentions=True is not supported by SAMBA (half of its layers are Mamba "
                             "layers, which have no attention weights)")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens (packed sequences) is not supported by SAMBA (its Mamba scan runs across "
                             "sequence boundaries); pass a left-padded batch with attention_mask")
        x, cache, past, seq_start, use_cache, output_hidden_states, order = self._start(
            input_ids, inputs_embeds, attention_mask, pick_cache(cache, past_key_values), use_cache,
            output_hidden_states)
        real = _real_tokens(seq_start, past, x.shape[0], x.shape[1], x.device)
        x, hidden, _ = self._run_blocks(x, cache, output_hidden_states, lambda i: (seq_start, real))
        if cache is not None:  # the attention layers' states count their own tokens
            for state in cache.layers:
                if isinstance(state, RecurrentState):
                    state.length += x.shape[1]
        out = self._finish(x, hidden, cache, use_cache, order=order)
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()


class SambaForCausalLM(_SambaInit, _FoxForCausalLMBase, GenerationMixin):
    """SAMBA LM; the backbone lives under ``backbone`` as in the reference (``model`` is an alias)."""

    config_class = SambaConfig
    base_model_prefix = "backbone"
    _tied_weights_keys = {"lm_head.weight": "backbone.embeddings.weight"}  # with config.tie_word_embeddings only
    backbone_cls = SambaModel

    @property
    def model(self):
        return self.backbone
