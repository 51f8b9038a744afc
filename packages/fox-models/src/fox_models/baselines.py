"""The paper's recurrent baselines in the published layout: HGRN2 and DeltaNet.

Configs, parameter names and the forward follow the reference release (model types
``hgrn2-project_fox`` and ``delta_net-project_fox``): pre-norm blocks ``attn_norm``/``attn``/``mlp_norm``/
``mlp`` (SwiGLU, fused ``gate_proj`` [2I, D]) as in FoX, ``model.embeddings``, ``model.norm``, ``lm_head``.
The sequence mixers run flash-linear-attention's kernels on CUDA when it is installed
(``pip install fox-models[baselines]``) and a PyTorch recurrence otherwise (fox_models.recurrent_ops).

Two behaviours of the released code are kept on purpose, because the checkpoints were trained with them:
- HGRN2 stores ``model.lower_bounds`` but its blocks never pass the lower bound to the layer, so every
  layer's forget gate is ``sigmoid(f)`` (``apply_lower_bound=True`` switches the HGRN2 paper's bound on);
- both mixers scale ``q`` by ``head_dim ** -0.5`` (the kernels' default scale).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fox_layers import RMSNorm
from fox_models.cache import LayerCache, ModelFilledLayer
from fox_models.compat import ConfigBase
from fox_models.recurrent_ops import delta_rule, gated_linear_attention, l2_normalize, short_conv


class _RecurrentConfig(ConfigBase):
    def _common(self, vocab_size, hidden_size, num_hidden_layers, hidden_ratio, intermediate_size, hidden_act,
                max_position_embeddings, elementwise_affine, norm_eps, use_cache, initializer_range,
                fuse_cross_entropy, attn_mode):
        if hidden_act not in ("swish", "silu"):
            raise ValueError(f"hidden_act must be 'swish' (SwiGLU), got {hidden_act!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.elementwise_affine = elementwise_affine
        self.norm_eps = norm_eps
        self.use_cache = use_cache
        self.initializer_range = initializer_range
        self.fuse_cross_entropy = fuse_cross_entropy
        self.attn_mode = attn_mode


class HGRN2Config(_RecurrentConfig):
    """HGRN2 (Qin et al. 2024): gated linear attention with forget-gate-tied input gates."""

    model_type = "hgrn2-project_fox"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        num_hidden_layers: int = 24,
        attn_mode: str = "chunk",
        num_heads: int | None = None,
        expand_ratio: int | None = 128,
        use_short_conv: bool = False,
        conv_size: int = 4,
        use_lower_bound: bool = True,
        apply_lower_bound: bool = False,
        hidden_ratio: float = 4,
        intermediate_size: int | None = None,
        hidden_act: str = "swish",
        max_position_embeddings: int = 2048,
        elementwise_affine: bool = True,
        norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        fuse_cross_entropy: bool = True,
        **kwargs,
    ):
        if use_short_conv:
            raise ValueError("use_short_conv=True is not supported for HGRN2 (the paper's HGRN2 has none)")
        if num_heads is None and expand_ratio is None:
            raise ValueError("HGRN2Config needs num_heads or expand_ratio")
        if apply_lower_bound and num_heads is not None and expand_ratio is not None and num_heads * expand_ratio != hidden_size:
            raise ValueError(f"apply_lower_bound needs num_heads * expand_ratio == hidden_size (one bound per forget "
                             f"channel), got {num_heads} * {expand_ratio} != {hidden_size}")
        self._common(vocab_size, hidden_size, num_hidden_layers, hidden_ratio, intermediate_size, hidden_act,
                     max_position_embeddings, elementwise_affine, norm_eps, use_cache, initializer_range,
                     fuse_cross_entropy, attn_mode)
        self.num_heads = num_heads
        self.expand_ratio = expand_ratio
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.use_lower_bound = use_lower_bound
        self.apply_lower_bound = apply_lower_bound
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class DeltaNetConfig(_RecurrentConfig):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule with short convolutions."""

    model_type = "delta_net-project_fox"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        expand_k: float = 1,
        expand_v: float = 1,
        use_gate: bool = False,
        use_short_conv: bool = True,
        conv_size: int = 4,
        use_beta: bool = True,
        use_output_norm: bool = True,
        hidden_ratio: float = 4,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 24,
        num_heads: int = 16,
        attn_mode: str = "chunk",
        qk_norm: str = "l2",
        qk_activation: str = "silu",
        hidden_act: str = "swish",
        max_position_embeddings: int = 2048,
        norm_first: bool = False,
        norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        fuse_cross_entropy: bool = True,
        elementwise_affine: bool = True,
        **kwargs,
    ):
        unsupported = dict(use_gate=(use_gate, False), norm_first=(norm_first, False), qk_norm=(qk_norm, "l2"),
                           qk_activation=(qk_activation, "silu"), use_short_conv=(use_short_conv, True))
        for name, (got, want) in unsupported.items():
            if got != want:
                raise ValueError(f"{name}={got!r} is not supported (the paper's DeltaNet uses {want!r})")
        self._common(vocab_size, hidden_size, num_hidden_layers, hidden_ratio, intermediate_size, hidden_act,
                     max_position_embeddings, elementwise_affine, norm_eps, use_cache, initializer_range,
                     fuse_cross_entropy, attn_mode)
        self.expand_k = expand_k
        self.expand_v = expand_v
        self.use_gate = use_gate
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.use_beta = use_beta
        self.use_output_norm = use_output_norm
        self.num_heads = num_heads
        self.qk_norm = qk_norm
        self.qk_activation = qk_activation
        self.norm_first = norm_first
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class RecurrentState(ModelFilledLayer):
    """What one recurrent layer keeps between calls (a transformers cache layer): named float32/activation
    tensors (scan state, convolution windows) and the number of tokens seen.

    A scan state cannot be cut back to an earlier length. While recording its past
    (``activate_past_recording``, as ``generate()`` does for assisted and prompt-lookup decoding), the layer
    keeps, for each call since the last crop, the state before it and the mixer's input; ``crop`` restores
    the state before the call that holds the new length, and that call's inputs up to the new length are
    replayed through the mixer at the start of the next call. They are exactly what the mixer saw then (the
    kept tokens and everything before them are unchanged), so the rolled-back state is exact.
    """

    is_compileable = False
    supports_early_init = False

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.length = 0
        self.record_past = False
        self._calls: list[tuple[dict, int, torch.Tensor, torch.Tensor | None]] = []  # (tensors, length, h, real)
        self._pending: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __repr__(self):
        return f"RecurrentState(length={self.length}, record_past={self.record_past})"

    def get(self, name):
        return self.tensors.get(name)

    def run(self, mixer, h: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """``mixer(h, real)`` for the mixer input h (B, T, D) and real-token mask (B, T, 1) or None, after the
        inputs a crop left to replay (their outputs are dropped); recorded when recording the past."""
        n = 0
        if self._pending is not None:
            ph, preal = self._pending
            self._pending = None
            n = ph.shape[1]
            if real is not None or preal is not None:
                ones = lambda r, t: torch.ones(t.shape[0], t.shape[1], 1, dtype=torch.bool, device=t.device) if r is None else r
                real = torch.cat([ones(preal, ph), ones(real, h)], dim=1)
            h = torch.cat([ph.to(h.dtype), h], dim=1)
        if self.record_past:
            self._calls.append((dict(self.tensors), self.length - n, h, real))
        out = mixer(h, real)[:, n:]
        if h.shape[1] > 1:  # a state sliced from a chunk's buffer (the convolution window) would keep it alive
            self.tensors = {k: t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
                            for k, t in self.tensors.items()}
        return out

    def activate_past_recording(self) -> None:
        self.record_past = True

    @property
    def is_croppable(self) -> bool:
        return self.record_past

    @property
    def is_initialized(self) -> bool:
        return bool(self.tensors)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens (<= 0, transformers' layer convention): any number of the
        tokens of the calls made since the last crop while recording. crop(0) only frees the records."""
        if tokens_to_remove > 0:
            raise ValueError(f"a cache layer's crop takes the (negative) number of tokens to remove, got {tokens_to_remove}")
        calls = self._calls
        if self._pending is not None:  # a crop not yet replayed: its inputs can be cut again
            calls = calls + [(self.tensors, self.length - self._pending[0].shape[1], *self._pending)]
        self._calls = []
        target = self.length + tokens_to_remove
        if tokens_to_remove == 0:
            return
        start = next((c for c in reversed(calls) if c[1] <= target), None)
        if start is None:
            raise ValueError(f"cannot crop a recurrent state back to {target} tokens: it can be rolled back only over the "
                             "calls made since the last crop while recording its past (activate_past_recording())")
        tensors, before, h, real = start
        self.tensors, self.length = tensors, target
        keep = target - before
        self._pending = (h[:, :keep], None if real is None else real[:, :keep]) if keep > 0 else None

    def _map(self, fn) -> None:
        f = lambda t: None if t is None else fn(t)
        self.tensors = {k: f(t) for k, t in self.tensors.items()}
        self._calls = [({k: f(t) for k, t in d.items()}, n, f(h), f(r)) for d, n, h, r in self._calls]
        if self._pending is not None:
            self._pending = tuple(f(t) for t in self._pending)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device)])

    def reset(self) -> None:
        self.tensors, self.length, self._calls, self._pending = {}, 0, [], None

    def offload(self) -> None:
        if self.tensors:
            self._device = next(iter(self.tensors.values())).device
            self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        device = getattr(self, "_device", None)
        if device is not None:
            self._map(lambda t: t.to(device, non_blocking=True))


class RecurrentCache(LayerCache):
    """Per-layer states of a recurrent model (fixed size, whatever the context length)."""

    state_cls = RecurrentState


def _real_tokens(seq_start, past, B, T, device):
    """(B, T, 1) 1.0 for real tokens, 0.0 for left padding (None when nothing is padded)."""
    if seq_start is None:
        return None
    pos = torch.arange(past, past + T, device=device)
    return (pos[None, :] >= seq_start.to(device)[:, None]).unsqueeze(-1)


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
        shape = (B, T, H, -1)
        o, S = gated_linear_attention(q.view(shape), k.to(i.dtype).view(shape), i.view(shape), log_g.view(shape),
                                      self.head_f_dim ** -0.5, None if state is None else state.get("S"))
        if state is not None:
            state.tensors["S"] = S
        return self.o_proj(self.g_norm(o.reshape(B, T, -1)))


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
        q = l2_normalize(q.view(B, T, H, -1))
        k = l2_normalize(k.view(B, T, H, -1))
        acc = torch.promote_types(x.dtype, torch.float32)
        beta = torch.sigmoid(self.b_proj(x).to(acc)) if self.use_beta else x.new_ones(B, T, H, dtype=acc)
        o, S = delta_rule(q, k, v.view(B, T, H, -1), beta, self.head_k_dim ** -0.5, get("S"))
        if state is not None:
            state.tensors.update(S=S, conv_q=cq, conv_k=ck, conv_v=cv)
        return self.o_proj(self.o_norm(o).reshape(B, T, -1))


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


class RecurrentBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)) (the FoX block, a recurrent mixer)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        from fox_layers import SwiGLUMLP

        mixer = {HGRN2Config.model_type: HGRN2Attention, DeltaNetConfig.model_type: DeltaNetAttention}[config.model_type]
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = mixer(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.hidden_ratio, config.intermediate_size)

    def forward(self, x, real=None, lower_bound=None, state=None):
        mix = lambda h, r: self.attn(h, real=r, state=state, lower_bound=lower_bound)
        h = self.attn_norm(x)
        x = x + (mix(h, real) if state is None else state.run(mix, h, real))
        return x + self.mlp(self.mlp_norm(x))


# ---------------------------------------------------------------------------------------------------
# Models (the LM head, loss convention and generation plumbing are FoX's)

from transformers import initialization as init  # noqa: E402

from fox_models.modeling import _FoxForCausalLMBase, _FoxPreTrainedBase  # noqa: E402


class _RecurrentInit:
    _no_split_modules = ["RecurrentBlock"]
    _supports_sdpa = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, _ConvWeight):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, _RecurrentBackbone) and getattr(module, "lower_bounds", None) is not None:
            init.zeros_(module.lower_bounds)


class _RecurrentBackbone(_RecurrentInit, _FoxPreTrainedBase):
    """Embeddings, recurrent blocks, final norm; blocks are called ``block(x, real, state, lower_bound)``."""

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if getattr(config, "use_lower_bound", False):
            self.lower_bounds = nn.Parameter(torch.zeros(config.num_hidden_layers, config.hidden_size))
        self.layers = nn.ModuleList([RecurrentBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def new_cache(self):
        return RecurrentCache(len(self.layers))

    def _lower_bounds(self):
        """Per-layer lower bounds of the HGRN2 forget gate (layer 0: none), when applied."""
        if not getattr(self.config, "apply_lower_bound", False) or getattr(self, "lower_bounds", None) is None:
            return [None] * len(self.layers)
        p = self.lower_bounds.float().softmax(0)
        lb = p.cumsum(0) - p[0]
        return [None] + [lb[i] for i in range(1, len(self.layers))]

    def forward(self, input_ids=None, attention_mask=None, past_key_values: RecurrentCache | None = None,
                inputs_embeds=None, use_cache: bool | None = None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, cu_seqlens=None, return_dict: bool | None = None, **kwargs):
        if output_attentions:
            raise ValueError(f"output_attentions=True: {type(self).__name__} is a recurrent model and has no "
                             "attention weights")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens (packed sequences) is not supported by the recurrent baselines; "
                             "pass a left-padded batch with attention_mask")
        x, cache, past, seq_start, use_cache, output_hidden_states = self._start(
            input_ids, inputs_embeds, attention_mask, past_key_values, use_cache, output_hidden_states)
        real = _real_tokens(seq_start, past, x.shape[0], x.shape[1], x.device)
        bounds = self._lower_bounds()
        x, hidden, _ = self._run_blocks(x, cache, output_hidden_states, lambda i: (real, bounds[i]))
        if cache is not None:
            for state in cache.layers:
                state.length += x.shape[1]
        out = self._finish(x, hidden, cache, use_cache)
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()


class HGRN2PreTrainedModel(_RecurrentInit, _FoxPreTrainedBase):
    config_class = HGRN2Config


class HGRN2Model(_RecurrentBackbone):
    config_class = HGRN2Config


class HGRN2ForCausalLM(_RecurrentInit, _FoxForCausalLMBase):
    config_class = HGRN2Config
    backbone_cls = HGRN2Model


class DeltaNetPreTrainedModel(_RecurrentInit, _FoxPreTrainedBase):
    config_class = DeltaNetConfig


class DeltaNetModel(_RecurrentBackbone):
    config_class = DeltaNetConfig


class DeltaNetForCausalLM(_RecurrentInit, _FoxForCausalLMBase):
    config_class = DeltaNetConfig
    backbone_cls = DeltaNetModel
