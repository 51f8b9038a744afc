"""The FoX attention layer (LLaMA and Pro variants) and its decoding state."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fox_kernel import (
    append_to_cache,
    forgetting_attention,
    forgetting_attention_with_kvcache,
    pruning,
    require_window_size,
)
from fox_kernel.context_parallel import ContextParallel
from fox_kernel.ops import checks
from fox_layers.checks import require_head_dim, require_int, require_positive
from fox_layers.kernels import owned
from fox_layers.norms import GroupRMSNorm
from fox_layers.rope import apply_rope
from fox_layers.shift import ShiftLinear

FGATE_TYPES = ("full", "bias_only", "fixed", "none")


def decay_time_bias(num_heads: int, t_min: float, t_max: float) -> torch.Tensor:
    """Gate biases with decay times T_h = exp(linspace(ln T_min, ln T_max, H)): logsigmoid(b_h) = -1/T_h.

    Always made on the CPU (also inside a meta-device context) so it can initialise materialised weights.
    """
    require_int("num_heads", num_heads)
    require_positive("t_min", t_min)
    require_positive("t_max", t_max)
    times = torch.exp(torch.linspace(math.log(t_min), math.log(t_max), num_heads, dtype=torch.float64, device="cpu"))
    return (-torch.log(torch.expm1(1.0 / times))).float()


@dataclass
class AttentionState:
    """What one layer keeps between decoding calls, in the kernel's cache format.

    k, v: (B, T, Hkv, D); c: (B, T, H) float32 prefix sums of the log gates; k_shift, v_shift: the last
    token's un-mixed projections (B, Hkv * D) for the token shift; seq_start: (B,) left padding.

    ``record_past``: also keep the un-mixed projections of every cached token (k_history, v_history,
    (B, T, Hkv * D), only for a shifted k or v), so that ``truncate`` can roll the state back to any earlier
    length (speculative decoding). The shift state of a token is its un-mixed projection, which nothing
    else keeps and which cannot be recomputed from the mixed, normalised k and v of the cache; so it is
    recorded, at the cost of one more k/v-sized tensor per shifted projection. Off by default: decoding
    then keeps the last token's only.

    A sliding-window layer drops the tokens no later query can see (``drop_outside``): k, v and c then
    hold the last tokens only, ``dropped`` counts those before them, and ``length`` still counts every
    token seen (RoPE positions and ``seq_start`` stay in sequence positions; ``held_seq_start`` is the left
    padding in positions of the held tokens, what the kernels take).
    """

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    c: torch.Tensor | None = None
    k_shift: torch.Tensor | None = None
    v_shift: torch.Tensor | None = None
    seq_start: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None
    """(B,) int32 tokens cached per row, on the device, for a state whose k, v and c are buffers of a fixed
    capacity (a static cache); None when they hold exactly ``length`` tokens."""
    k_history: torch.Tensor | None = None
    v_history: torch.Tensor | None = None
    record_past: bool = False
    dropped: int = 0

    _batched = ("k", "v", "c", "k_shift", "v_shift", "seq_start", "k_history", "v_history")

    @property
    def held(self) -> int:
        """Tokens in k, v and c."""
        return 0 if self.k is None else self.k.shape[1]

    @property
    def length(self) -> int:
        """Tokens seen: the held ones and the ``dropped`` ones before them."""
        return self.dropped + self.held

    @property
    def held_seq_start(self) -> torch.Tensor | None:
        """The left padding (B,) in positions of the held tokens (0 where it was dropped)."""
        if self.seq_start is None or not self.dropped:
            return self.seq_start
        return (self.seq_start - self.dropped).clamp_min(0)

    def drop_outside(self, window: int) -> None:
        """Keep the last ``window`` tokens (a later query of a ``window``-token sliding window sees at most
        ``window - 1`` of them besides itself) and drop the earlier ones, so the state's memory stays
        O(window) however long the decoding runs. Nothing is dropped while recording the past
        (``truncate`` must be able to roll back) or from fixed-capacity buffers (``cache_seqlens``)."""
        extra = self.held - window
        if extra <= 0 or self.record_past or self.cache_seqlens is not None:
            return
        # views: the next append's concatenation copies them, and frees the larger tensors they slice
        self.k, self.v, self.c = self.k[:, extra:], self.v[:, extra:], self.c[:, extra:]
        self.dropped += extra

    def append(self, k, v, log_fgate, k_unmixed=None, v_unmixed=None) -> None:
        """Add a chunk: k, v (B, Tn, Hkv, D) as attended, log_fgate (B, Tn, H) float32, and the chunk's
        un-mixed projections (B, Tn, Hkv * D) of a shifted k / v (None without a shift)."""
        self.k, self.v, self.c = append_to_cache(self.k, self.v, self.c, k, v, log_fgate, self.held_seq_start)
        self.k, self.v = owned(self.k), owned(self.v)
        for name, unmixed in (("k", k_unmixed), ("v", v_unmixed)):
            if unmixed is None or unmixed.shape[1] == 0:  # an empty chunk leaves the carried token as it was
                continue
            last = unmixed[:, -1]  # a decoding step's (B, 1, N) buffer is small: kept as a view, no copy
            setattr(self, f"{name}_shift", owned(last) if unmixed.shape[1] > 1 else last)
            old = getattr(self, f"{name}_history")
            if not self.record_past:  # a history that stops growing could never be used: free it
                setattr(self, f"{name}_history", None)
            elif old is None:  # recording from the first chunk on, else the history would not cover the cache
                setattr(self, f"{name}_history", owned(unmixed) if self.held == unmixed.shape[1] else None)
            else:
                setattr(self, f"{name}_history", torch.cat([old, unmixed], dim=1))

    @property
    def can_truncate(self) -> bool:
        """Whether ``truncate`` can restore any earlier length: never once tokens were dropped, always without
        a token shift, else only with the history of ``record_past`` covering every cached token."""
        if self.dropped:
            return False
        return all(getattr(self, f"{n}_shift") is None or (h := getattr(self, f"{n}_history")) is not None
                   and h.shape[1] == self.held for n in ("k", "v"))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens, as if the later ones had never been appended."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if length >= self.length:
            return
        if self.dropped:
            raise ValueError(f"cannot truncate a sliding-window state that dropped its first {self.dropped} tokens: "
                             "set record_past=True (Cache.activate_past_recording()) before appending to keep them")
        if not self.can_truncate:
            raise ValueError("cannot truncate a state with a token shift that was not recording its past: set "
                             "record_past=True (Cache.activate_past_recording()) before appending")
        if length == 0:
            self.reset()
            return
        self.k, self.v, self.c = self.k[:, :length], self.v[:, :length], self.c[:, :length]
        for n in ("k", "v"):
            history = getattr(self, f"{n}_history")
            if history is not None:
                setattr(self, f"{n}_history", history[:, :length])
                setattr(self, f"{n}_shift", history[:, length - 1])

    def reset(self) -> None:
        """Empty the state, left padding included (``record_past`` stays)."""
        self.k = self.v = self.c = self.k_shift = self.v_shift = self.k_history = self.v_history = None
        self.seq_start = None
        self.dropped = 0

    def _map(self, fn) -> None:
        for name in self._batched:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search)."""
        self._map(lambda t: t.index_select(0, index.to(t.device)))

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (row b becomes rows b * repeats ... b * repeats + repeats - 1)."""
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))


def prefix_sums(log_fgate: torch.Tensor, seq_start: torch.Tensor | None = None) -> torch.Tensor:
    """c (B, T, H): prefix sums of the log gates (B, T, H) in float64, gates before ``seq_start`` not counted."""
    g = log_fgate.double()
    if seq_start is not None:
        pos = torch.arange(g.shape[1], device=g.device)
        g = torch.where((pos[None, :] >= seq_start.to(g.device)[:, None])[..., None], g, 0.0)
    return g.cumsum(1)


def bare_module(module: nn.Module, cls: type[nn.Module]) -> bool:
    """A plain ``cls`` (exactly that class) without hooks, whose parameters are its whole function, so a
    fused kernel may take them in its place. Anything else (a PEFT/LoRA wrapper, a quantised module, a module
    with forward hooks, or whose forward was replaced on the instance, as accelerate's offloading does to load
    its weights just in time) is called as a module, so what it adds takes effect."""
    return (type(module) is cls and not (module._forward_hooks or module._forward_pre_hooks)
            and "forward" not in module.__dict__)


def bare_linear(module: nn.Module) -> bool:
    """``bare_module`` for nn.Linear: its matmul can join the fused input projection."""
    return bare_module(module, nn.Linear)


def set_attention_kernel(model: nn.Module, kernel) -> int:
    """Make ``kernel`` (``forgetting_attention``'s signature) the kernel call of every
    ``ForgettingAttentionLayer`` in ``model``; ``None`` gives them back the class's ``forgetting_attention``.
    Returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, ForgettingAttentionLayer)]
    for layer in layers:
        if kernel is None:
            layer.__dict__.pop("attention_kernel", None)
        else:
            layer.attention_kernel = kernel
    return len(layers)


class ForgettingAttentionLayer(nn.Module):
    """Forgetting Attention with the FoX (Pro) options: QK-norm, key/value shift, output gate and output norm.

    Submodule names follow the published checkpoints: q_proj, k_proj / v_proj (Linear, or ShiftLinear
    with ``linear`` and ``shift_proj``), o_proj, fgate_proj, ogate_proj, output_norm, q_norm, k_norm.
    """

    attention_kernel = staticmethod(forgetting_attention)
    """The kernel call, ``forgetting_attention``'s signature. Replaced from outside per instance, e.g. by a
    ``fox_kernel.context_parallel.ContextParallel``, which makes the layer run on its rank's zigzag shard of
    a sequence split across a process group (the token shift then takes the previous shard's last token and
    RoPE the tokens' global positions)."""

    fuse_input_projections: bool = True
    """Project the input with one matmul against the concatenated q/k/v/gate weights (the parameters stay
    separate, as in the checkpoints). Set per instance or per subclass to use one matmul per module."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        use_output_gate: bool = False,
        ogate_act: str = "sigmoid",
        use_output_norm: bool = False,
        norm_eps: float = 1e-6,
        qk_norm: bool = False,
        qk_norm_share_param_across_head: bool = False,
        use_k_shift: bool = False,
        use_v_shift: bool = False,
        fgate_type: str = "full",
        fgate_bias_init: bool = False,
        decay_time_min: float | None = None,
        decay_time_max: float | None = None,
        use_rope: bool = False,
        rope_base: float = 500000.0,
        log_pruning_tolerance: float | None = None,
        attention_bias: bool = False,
        window_size: int | None = None,
    ):
        super().__init__()
        require_int("hidden_size", hidden_size)
        require_int("num_heads", num_heads)
        require_int("num_kv_heads", num_kv_heads, optional=True)
        for name, value in (("decay_time_min", decay_time_min), ("decay_time_max", decay_time_max)):
            require_positive(name, value, optional=True)
        if decay_time_min is not None and decay_time_max is not None and decay_time_min > decay_time_max:
            raise ValueError(f"decay_time_min must be <= decay_time_max {decay_time_max}, got {decay_time_min}")
        require_positive("rope_base", rope_base)
        require_positive("norm_eps", norm_eps)
        num_kv_heads = num_kv_heads or num_heads
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden_size {hidden_size} must be a multiple of num_heads {num_heads}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        require_head_dim(hidden_size, num_heads, use_rope)
        if fgate_type not in FGATE_TYPES:
            raise ValueError(f"fgate_type must be one of {FGATE_TYPES}, got {fgate_type!r}")
        require_window_size(window_size)
        if log_pruning_tolerance is not None:
            pruning.check_log_tolerance(log_pruning_tolerance)
        if ogate_act not in ("sigmoid", "silu"):
            raise ValueError(f"ogate_act must be 'sigmoid' or 'silu', got {ogate_act!r}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.kv_dim = num_kv_heads * self.head_dim
        self.use_output_gate = use_output_gate
        self.ogate_act = ogate_act
        self.use_output_norm = use_output_norm
        self.qk_norm = qk_norm
        self.use_k_shift = use_k_shift
        self.use_v_shift = use_v_shift
        self.fgate_type = fgate_type
        self.use_rope = use_rope
        self.rope_base = rope_base
        self.log_pruning_tolerance = log_pruning_tolerance
        self.window_size = window_size
        """Sliding window: each query sees its ``window_size`` most recent keys (itself included); None: all."""
        self.recompute_projections = False
        """Training memory: keep only the layer's input and the attention's q/k/v/output for the backward,
        and recompute the projections, token shift, QK-norm and the output norm/gate/projection there."""

        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=attention_bias)
        make_kv = (
            lambda shift: ShiftLinear(hidden_size, self.kv_dim, num_kv_heads, bias=attention_bias)
            if shift
            else nn.Linear(hidden_size, self.kv_dim, bias=attention_bias)
        )
        self.k_proj = make_kv(use_k_shift)
        self.v_proj = make_kv(use_v_shift)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=attention_bias)

        needs_times = fgate_type in ("bias_only", "fixed") or (fgate_type == "full" and fgate_bias_init)
        if needs_times and (decay_time_min is None or decay_time_max is None):
            raise ValueError(f"fgate_type={fgate_type!r} with a decay-time init needs decay_time_min and decay_time_max")
        self.decay_times = (decay_time_min, decay_time_max) if needs_times else None
        if fgate_type == "full":
            self.fgate_proj = nn.Linear(hidden_size, num_heads, bias=True)
            # read by models' weight init, which reaches the Linear itself (transformers 5 skips modules that
            # hold no parameters directly, such as this layer with a full gate)
            self.fgate_proj.decay_times = self.decay_times
        elif fgate_type == "bias_only":
            self.fgate_bias = nn.Parameter(torch.zeros(num_heads))
        elif fgate_type == "fixed":
            self.register_buffer("fgate_bias", torch.zeros(num_heads))
        if use_output_gate:
            self.ogate_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        if use_output_norm:
            self.output_norm = GroupRMSNorm(num_heads, hidden_size, eps=norm_eps)
        if qk_norm:
            shared = qk_norm_share_param_across_head
            self.q_norm = GroupRMSNorm(num_heads, hidden_size, eps=1e-5, share_across_groups=shared)
            self.k_norm = GroupRMSNorm(num_kv_heads, self.kv_dim, eps=1e-5, share_across_groups=shared)
        self.reset_fgate_bias()

    def reset_fgate_bias(self, copy_=torch.Tensor.copy_) -> None:
        """Set the gate bias to the decay-time init (``full`` with ``fgate_bias_init``, ``bias_only``, ``fixed``).

        Models re-apply this after drawing their weights (``copy_`` lets them skip loaded tensors).
        """
        if self.decay_times is None:
            return
        target = self.fgate_proj.bias if self.fgate_type == "full" else self.fgate_bias
        if target.is_meta:
            return
        with torch.no_grad():
            copy_(target, decay_time_bias(self.num_heads, *self.decay_times).to(target.device, target.dtype))

    def log_fgate(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H) float32 log forget gates for hidden states x (B, T, hidden)."""
        B, T, _ = x.shape
        if self.fgate_type == "full":
            return F.logsigmoid(self.fgate_proj(x).float())
        if self.fgate_type == "none":
            return torch.zeros(B, T, self.num_heads, dtype=torch.float32, device=x.device)
        return F.logsigmoid(self.fgate_bias.float()).expand(B, T, self.num_heads)

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The ``ContextParallel`` the layer's kernel call was replaced with, or None."""
        kernel = self.attention_kernel
        return kernel if isinstance(kernel, ContextParallel) else None

    def _positions(self, B, T, past, seq_start, cu_seqlens, device):
        """RoPE positions (B, T); ``past`` is an int, or a (B, 1) tensor of cached lengths (static cache).
        Under context parallelism, the global positions of the rank's tokens."""
        cp = self.context_parallel
        if cp is not None:
            return cp.positions(T, device)[None].expand(B, T)
        pos = (torch.arange(T, device=device)[None, :] + past).expand(B, T)
        if seq_start is not None:
            pos = (pos - seq_start[:, None]).clamp_min(0)
        if cu_seqlens is not None:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
            starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=T)
            pos = pos - starts[None]
        return pos

    def pruning_threshold(self, T_k: int, log_tolerance: float | None = None):
        """The adaptive_threshold this layer passes to the kernel for ``T_k`` keys (``fox_kernel.pruning``):
        None (no pruning); with QK-norm a (1, H) tensor, the bound from the norm weights; else an
        ``AutoThreshold``, the bound the kernel takes from the q/k norms. ``log_tolerance`` replaces the
        layer's own ``log_pruning_tolerance`` (ln eps)."""
        log_tolerance = self.log_pruning_tolerance if log_tolerance is None else log_tolerance
        if log_tolerance is None:
            return None
        if not self.qk_norm:
            return pruning.AutoThreshold(log_tolerance)
        group = self.num_heads // self.num_kv_heads
        wk = self.k_norm.max_abs_weight().repeat_interleave(group)
        return pruning.threshold_from_qk_norm(self.q_norm.max_abs_weight(), wk, self.head_dim, T_k, log_tolerance)

    def _input_linears(self, with_ogate: bool):
        """(name, Linear) of every projection of the layer's input, in the order of the fused matmul."""
        kv = lambda p: p.linear if isinstance(p, ShiftLinear) else p
        out = [("q", self.q_proj), ("k", kv(self.k_proj)), ("v", kv(self.v_proj))]
        if with_ogate and self.use_output_gate:
            out.append(("g", self.ogate_proj))
        out += [(f"{n}_shift", p.shift_proj) for n, p in (("k", self.k_proj), ("v", self.v_proj))
                if isinstance(p, ShiftLinear)]
        if self.fgate_type == "full":
            out.append(("f", self.fgate_proj))
        return out

    def _input_projections(self, x: torch.Tensor, with_ogate: bool) -> dict[str, torch.Tensor]:
        """All projections of x by name; with ``fuse_input_projections``, as one matmul against the
        concatenated weights, split afterwards.

        One large matmul instead of up to seven (three of them only num_heads wide, which run far from
        the GPU's peak) reads x once and launches two kernels fewer per projection in the backward.
        The concatenation is a copy of the weights (a few MB) per call.
        """
        linears = self._input_linears(with_ogate)
        # torch 2.11's inductor fails to generate the fused form's inference graph (a Triton codegen
        # TypeError in get_block_shape, seen in fox-train's evaluation on an H200); the fusion is for training.
        if (not self.fuse_input_projections or (torch.compiler.is_compiling() and not torch.is_grad_enabled())
                or not all(bare_linear(m) for _, m in linears)):
            return {name: m(x) for name, m in linears}
        weights = [m.weight for _, m in linears]
        sizes = [m.out_features for _, m in linears]
        # Rows padded to 16 bytes keep every slice usable by TMA loads and SDPA's fused kernels (the
        # narrow gate projections come last, so the wide slices start aligned when head_dim is a multiple of 8).
        pad = -sum(sizes) % 8
        if pad:
            weights.append(x.new_zeros(pad, x.shape[-1], dtype=weights[0].dtype))
        # Biases (the forget gate's) are added to their slices, where they fuse into the next op: as the
        # matmul's bias they cost a broadcast copy over the whole (T, N) output first.
        y = F.linear(x, torch.cat(weights)).split(sizes + [pad], dim=-1)
        return {name: part if m.bias is None else part + m.bias.to(part.dtype)
                for (name, m), part in zip(linears, y)}

    def project(self, x, seq_start=None, cu_seqlens=None, past: int = 0, k_state=None, v_state=None):
        """Queries, keys, values and log forget gates for hidden states x (B, T, hidden).

        Returns q (B, T, H, D), k and v (B, T, Hkv, D) after shift, QK-norm and RoPE, log_fgate (B, T, H)
        float32, and the new token-shift states. ``past``: tokens already cached (positions of x).
        """
        return self._project(x, seq_start, cu_seqlens, past, k_state, v_state)[:6]

    def _project(self, x, seq_start=None, cu_seqlens=None, past: int = 0, k_state=None, v_state=None,
                 with_ogate: bool = False, whole_chunk_states: bool = False, rope_past=None):
        """``project`` plus, with ``with_ogate``, the output gate's logits (or None), from the same matmul.
        ``whole_chunk_states``: the shift states returned are the chunk's un-mixed projections (B, T, kv_dim)
        rather than their last row (a recording ``AttentionState`` keeps them all). ``rope_past``: the
        cached lengths as a (B, 1) device tensor for RoPE (a static cache, whose step is replayed as a
        CUDA graph), instead of the int ``past``."""
        B, T, _ = x.shape
        y = self._input_projections(x, with_ogate)
        k, k_shift = y["k"], None
        if "k_shift" in y:
            k, k_shift = self._mix(self.k_proj, k, y["k_shift"], k_state, seq_start, cu_seqlens, past)
            k_shift = y["k"] if whole_chunk_states else k_shift
        v, v_shift = y["v"], None
        if "v_shift" in y:
            v, v_shift = self._mix(self.v_proj, v, y["v_shift"], v_state, seq_start, cu_seqlens, past)
            v_shift = y["v"] if whole_chunk_states else v_shift
        q = y["q"]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            pos = self._positions(B, T, past if rope_past is None else rope_past, seq_start, cu_seqlens, x.device)
            q, k = apply_rope(q, pos, self.rope_base), apply_rope(k, pos, self.rope_base)
        log_fgate = F.logsigmoid(y["f"].float()) if "f" in y else self.log_fgate(x)
        return q, k, v, log_fgate, k_shift, v_shift, y.get("g")

    def _mix(self, proj: ShiftLinear, cur, s, state, seq_start, cu_seqlens, past):
        """``proj.mix``; under context parallelism each of the rank's two chunks starts from the token
        before it, which another rank may hold (``ContextParallel.previous_tokens``)."""
        cp = self.context_parallel
        if cp is None:
            return proj.mix(cur, s, state, seq_start, cu_seqlens, past)
        before = cp.previous_tokens(cur)
        half = cur.shape[1] // 2
        parts = [proj.mix(cur[:, rows], s[:, rows], before[:, i])[0]
                 for i, rows in enumerate((slice(0, half), slice(half, None)))]
        return torch.cat(parts, dim=1), cur[:, -1]

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        seq_start: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        state: AttentionState | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, AttentionState | None]:
        """hidden_states (B, T, hidden) -> (output (B, T, hidden), updated state or None).

        seq_start: (B,) left padding (first real position, in cache positions); cu_seqlens: packed
        sequences (B = 1). Pass an ``AttentionState`` (empty for a prefill) to decode; it is updated in place.
        ``output_attentions``: compute the attention explicitly (``attention_weights``, no pruning; slow and
        O(T^2) memory) and return (output, state, weights (B, H, T, T_keys)).
        """
        x = hidden_states
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"hidden_states must be (B, T, hidden_size={self.hidden_size}), got {got}")
        B, T, _ = x.shape
        if cu_seqlens is not None and state is not None:
            raise ValueError("cu_seqlens (packed training batches) cannot be combined with a decoding state")
        # the kernel's checks, before RoPE positions and token shifts read these (values where reading them
        # costs no wait for the GPU; the kernel reads a CUDA cu_seqlens for its launch and checks it there)
        if cu_seqlens is not None:
            checks.check_cu_seqlens(cu_seqlens, B, T, checks.values_checkable(cu_seqlens))
        if seq_start is not None:
            checks.check_seq_start(seq_start, B, None, checks.values_checkable(seq_start))
        cp = self.context_parallel
        if cp is not None and (state is not None or seq_start is not None or output_attentions):
            raise ValueError("a context-parallel layer takes whole sequences split across ranks: no decoding state, "
                             "seq_start (padding) or output_attentions")
        if state is not None and not isinstance(state, AttentionState):
            raise TypeError(f"state must be an AttentionState or None, got {type(state).__name__}")
        past = 0 if state is None else state.length
        if state is not None and state.k is not None and state.k.shape[0] != B:
            raise ValueError(f"hidden_states has {B} rows but the state holds {state.k.shape[0]} (one per sequence "
                             "being decoded)")
        # a state filled by a layer of other sizes would fail in the token shift's or the cache's concatenation
        if state is not None and state.k is not None and tuple(state.k.shape[2:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"state holds keys of (num_kv_heads, head_dim) = {tuple(state.k.shape[2:])}, this layer's "
                             f"are {(self.num_kv_heads, self.head_dim)}")
        if state is not None and state.seq_start is None and seq_start is not None:
            state.seq_start = seq_start
        if state is not None:
            seq_start = state.seq_start
        recompute = (self.recompute_projections and state is None and torch.is_grad_enabled() and x.requires_grad
                     and not output_attentions)
        if recompute:  # the projections' outputs (pre-norm q and k, pre-shift k and v) are not kept
            q, k, v, log_fgate, k_shift, v_shift = checkpoint(
                self.project, x, seq_start, cu_seqlens, use_reentrant=False
            )
            g = None
        else:
            q, k, v, log_fgate, k_shift, v_shift, g = self._project(
                x, seq_start, cu_seqlens, past, state and state.k_shift, state and state.v_shift, with_ogate=True,
                whole_chunk_states=True, rope_past=None if state is None or state.cache_seqlens is None
                else state.cache_seqlens[:, None],
            )
        dtype = v.dtype
        if output_attentions:
            c = prefix_sums(log_fgate, seq_start)
            if state is not None:
                state.append(k, v, log_fgate, k_shift, v_shift)
                if past > 0:  # the cache's prefix sums are float32
                    k, v, c, seq_start = state.k, state.v, state.c, state.held_seq_start
            weights = self.attention_weights(q, k, c, seq_start, cu_seqlens)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)
            o = torch.einsum("bhij,bjhd->bihd", weights, v.to(weights.dtype)).to(q.dtype)
            self._drop_outside_window(state)
            return self._output(o.reshape(B, T, self.hidden_size).to(dtype), x, g), state, weights
        if state is None or past == 0:
            T_k = T if cp is None else T * cp.world_size
            # zero_gates=False: the log gates are logsigmoid of finite logits (or of the fixed biases), never
            # -inf, so the kernel launches none of its passes for gates of exactly 0
            # the first chunk of a chunked prefill may end before a row's left padding does: its start is
            # then this chunk's end (all padding, rows of 0), and the state keeps the real one for later chunks
            first_starts = seq_start if state is None or seq_start is None else seq_start.clamp(max=T)
            o = self.attention_kernel(
                q, k.to(q.dtype), v.to(q.dtype), log_fgate, seq_start=first_starts, cu_seqlens=cu_seqlens,
                adaptive_threshold=self.pruning_threshold(T_k), window_size=self.window_size, zero_gates=False,
            )
        if state is not None:
            state.append(k, v, log_fgate, k_shift, v_shift)
            if past > 0:
                o = forgetting_attention_with_kvcache(q.to(state.k.dtype), state.k, state.v, state.c, state.cache_seqlens,
                                                      seq_start=state.held_seq_start, window_size=self.window_size)
            self._drop_outside_window(state)
        o = o.reshape(B, T, self.hidden_size).to(dtype)
        if recompute:  # the gate logits and the normalised, gated output are not kept
            return checkpoint(self._output, o, x, use_reentrant=False), state
        return self._output(o, x, g), state

    def _drop_outside_window(self, state: AttentionState | None) -> None:
        """A sliding-window layer's state keeps only the tokens later queries can see."""
        if state is not None and self.window_size is not None:
            state.drop_outside(self.window_size)

    def attention_weights(self, q, k, c, seq_start=None, cu_seqlens=None) -> torch.Tensor:
        """softmax(s q_i.k_j + c_i - c_j) over the keys j each query i may see, in at least float32:
        (B, H, Tq, Tk). q (B, Tq, H, D) are the last Tq of the Tk positions of k (B, Tk, Hkv, D) and of the
        prefix sums c (B, Tk, H); keys before ``seq_start`` (left padding) and in other packed sequences
        (``cu_seqlens``) are masked, and rows of padding queries are 0 (as the kernel's outputs)."""
        B, Tq, H, D = q.shape
        Tk = k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        k = k.repeat_interleave(H // k.shape[2], dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q.to(acc), k.to(acc)) * D**-0.5
        c = c.transpose(1, 2)  # (B, H, Tk)
        scores = scores + (c[..., Tk - Tq:, None] - c[..., None, :]).to(acc)
        kpos = torch.arange(Tk, device=q.device)
        qpos = kpos[Tk - Tq:]
        allowed = kpos[None, :] <= qpos[:, None]
        if self.window_size is not None:
            allowed = allowed & (kpos[None, :] > qpos[:, None] - self.window_size)
        allowed = allowed[None]  # (1, Tq, Tk)
        if seq_start is not None:
            allowed = allowed & (kpos[None, None, :] >= seq_start.to(q.device)[:, None, None])
        if cu_seqlens is not None:
            seq = torch.bucketize(kpos, cu_seqlens[1:].to(q.device), right=True)
            allowed = allowed & (seq[qpos][:, None] == seq[None, :])[None]
        allowed = allowed[:, None]  # (B or 1, 1, Tq, Tk)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.where(allowed.any(-1, keepdim=True), probs, 0.0)  # rows of padding queries: 0, not NaN

    def _output(self, o: torch.Tensor, x: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """Output norm and gate (FoX Pro), then the output projection. ``g``: the gate's logits if the
        fused input projection already made them."""
        if g is None and self.use_output_gate:
            g = self.ogate_proj(x)
        if self.use_output_norm:
            o = self.output_norm(o, g, self.ogate_act)  # norm and gate fused on GPU
        elif g is not None:
            o = o * (torch.sigmoid(g) if self.ogate_act == "sigmoid" else F.silu(g))
        return self.o_proj(o)
