"""What the recurrent baselines (HGRN2, DeltaNet, Mamba-2) share: the decoding state of a recurrent layer, the
FoX-layout block around a sequence mixer and the backbone's forward (left padding, cache, gradient
checkpointing). The LM head, loss convention and generation plumbing are those of every model
(``fox_models.base``); the config fields, those of every config (``fox_models.configuration_base``).

The sequence mixers run flash-linear-attention's kernels on CUDA when it is installed
(``pip install fox-models[baselines]``) and a PyTorch recurrence otherwise (``fox_models.recurrent_ops``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from fox_layers import RMSNorm, SwiGLUMLP
from fox_models.base import _FoxPreTrainedBase
from fox_models.cache import LayerCache, ModelFilledLayer
from fox_models.compat import GradientCheckpointingLayer, pick_cache


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


class RecurrentBlock(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)) (the FoX block, a recurrent mixer
    ``mixer_cls(config, layer_idx)`` as ``attn``)."""

    def __init__(self, config, layer_idx: int, mixer_cls: type[nn.Module]):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = mixer_cls(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.hidden_ratio, config.intermediate_size)

    def forward(self, x, real=None, lower_bound=None, state=None):
        mix = lambda h, r: self.attn(h, real=r, state=state, lower_bound=lower_bound)
        h = self.attn_norm(x)
        x = x + (mix(h, real) if state is None else state.run(mix, h, real))
        return x + self.mlp(self.mlp_norm(x))


class _RecurrentInit:
    _no_split_modules = ["RecurrentBlock"]
    _supports_sdpa = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, _RecurrentBackbone) and getattr(module, "lower_bounds", None) is not None:
            init.zeros_(module.lower_bounds)


class _RecurrentBackbone(_RecurrentInit, _FoxPreTrainedBase):
    """The forward of a recurrent backbone: embeddings, ``layers`` of blocks called
    ``block(x, real, lower_bound, state)``, final norm. Subclasses build the modules in their ``__init__``."""

    def new_cache(self):
        return RecurrentCache(len(self.layers))

    def _lower_bounds(self):
        """Per-layer lower bounds of the HGRN2 forget gate (layer 0: none), when applied."""
        if not getattr(self.config, "apply_lower_bound", False) or getattr(self, "lower_bounds", None) is None:
            return [None] * len(self.layers)
        p = self.lower_bounds.float().softmax(0)
        lb = p.cumsum(0) - p[0]
        return [None] + [lb[i] for i in range(1, len(self.layers))]

    def forward(self, input_ids=None, attention_mask=None, cache: RecurrentCache | None = None,
                inputs_embeds=None, use_cache: bool | None = None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, cu_seqlens=None, return_dict: bool | None = None,
                past_key_values: RecurrentCache | None = None, **kwargs):
        """``past_key_values`` is the older name of ``cache``."""
        if output_attentions:
            raise ValueError(f"output_attentions=True: {type(self).__name__} is a recurrent model and has no "
                             "attention weights")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens (packed sequences) is not supported by the recurrent baselines; "
                             "pass a left-padded batch with attention_mask")
        x, cache, past, seq_start, use_cache, output_hidden_states, order = self._start(
            input_ids, inputs_embeds, attention_mask, pick_cache(cache, past_key_values), use_cache,
            output_hidden_states)
        real = _real_tokens(seq_start, past, x.shape[0], x.shape[1], x.device)
        bounds = self._lower_bounds()
        x, hidden, _ = self._run_blocks(x, cache, output_hidden_states, lambda i: (real, bounds[i]))
        if cache is not None:
            for state in cache.layers:
                state.length += x.shape[1]
        out = self._finish(x, hidden, cache, use_cache, order=order)
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()


class _MixerBackbone(_RecurrentBackbone):
    """Embeddings, optional per-layer forget-gate lower bounds, ``RecurrentBlock``s around ``mixer_cls``,
    final RMSNorm: the layout of HGRN2 and DeltaNet."""

    mixer_cls: type[nn.Module]

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if getattr(config, "use_lower_bound", False):
            self.lower_bounds = nn.Parameter(torch.zeros(config.num_hidden_layers, config.hidden_size))
        self.layers = nn.ModuleList([RecurrentBlock(config, i, self.mixer_cls)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()
