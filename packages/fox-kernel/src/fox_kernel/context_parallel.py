"""Context parallelism: one sequence split across the ranks of a process group.

Layout (``zigzag``). A sequence of length T is cut into 2N chunks of C = T / (2N) tokens; rank r holds
chunks r and 2N-1-r, concatenated, so its local length is 2C. Under the causal mask every rank then does
the same attention work (a contiguous split would leave the last rank about twice the mean).
``shard_sequence`` and ``unshard_sequence`` make and undo this layout.

Attention (``context_parallel_forgetting_attention``), the all-gather scheme Llama 3 trained with:
1. one all-gather brings every rank K and V (concatenated, one collective) and one the log forget gates
   of the whole sequence;
2. each local chunk of queries is one ordinary call of the kernel with fewer queries than keys: the
   queries are end-aligned to the keys up to their chunk's end. The kernel computes the prefix sums of the
   gates itself, over exactly the keys it reads, so ``c_i - c_j`` is the sum of the gates between j and i
   as in the single-device call. Every call starts at the sequence's first key, so its prefix sums are
   the single-device call's, rounding included: a long sequence keeps exactly the precision the kernel has
   on one device at that length. With a sliding window the kernel skips the key tiles wholly before the
   window, as on one device;
3. the backward gathers K, V and the gates again (nothing of the whole sequence is kept between the passes:
   a rank holds one layer's full K/V only while that layer runs), runs the kernel's backward per chunk,
   sums the gradients of K, V and the gates over the chunks in float32 and reduce-scatters them to their
   owners (the adjoint of the all-gather). The gates' gradient of the kernel already holds the reverse
   prefix sum over the keys of the call, so the sum over chunks and ranks is the exact gradient.

Memory. What a rank holds of the whole sequence does not shrink with more ranks, so the heads are taken in
groups (``head_groups``; by default the fewest groups whose whole-sequence K|V fits ``GATHER_BYTES``): steps
1-3 run once per group of key/value heads (with their query heads), so a rank holds one group's gathered K|V
(and, in the backward, their float32 gradients, twice that) at a time. At 1,572,864 tokens of a 12-head,
D=128 model in bf16 that is 0.8 GB and 1.6 GB per head instead of 9.7 GB and 19 GB for all heads at once; up
to about 43k tokens of the same model (6 KB a token for all heads) one group takes every head and nothing
changes. More groups mean more, smaller collectives and kernel calls with fewer heads.

Adaptive computation pruning works as on one device: each chunk's call skips the key blocks whose decay
makes them negligible (with ``"auto"``, the bound uses that call's own number of keys, which are all the
keys its queries see, so the eps guarantee holds). Those blocks are not computed; they are still
gathered, as the all-gather sends whole shards.

Everything here uses ``torch.distributed`` only; the gloo backend works on the CPU (float64 included).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fox_kernel.ops import checks, dispatch
from fox_kernel.ops.call import AttentionCall
from fox_kernel.ops.forgetting_attention import pruning_args
from fox_kernel.options import KernelOptions, current_options

__all__ = [
    "GATHER_BYTES",
    "ContextParallel",
    "context_parallel_forgetting_attention",
    "default_head_groups",
    "shard_sequence",
    "unshard_sequence",
    "zigzag_chunks",
]


GATHER_BYTES = 256 * 2**20
"""The default bound on one head group's whole-sequence K|V that a rank gathers at a time (bytes)."""


def default_head_groups(kv_heads: int, total_len: int, batch: int, head_dim: int, itemsize: int,
                budget: int = GATHER_BYTES) -> int:
    """The fewest groups (a divisor of ``kv_heads``) whose whole-sequence K|V (``batch`` x ``total_len`` x
    heads of the group x 2 ``head_dim`` x ``itemsize`` bytes) fits ``budget``; one group per head when even
    one head's does not."""
    per_head = batch * total_len * 2 * head_dim * itemsize
    for groups in range(1, kv_heads + 1):
        if kv_heads % groups == 0 and per_head * (kv_heads // groups) <= budget:
            return groups
    return kv_heads


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialised (dist.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def zigzag_chunks(world_size: int, rank: int) -> tuple[int, int]:
    """The global indices of the two chunks (of 2 * world_size) that ``rank`` holds, in local order."""
    return rank, 2 * world_size - 1 - rank


def shard_sequence(x: torch.Tensor, world_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of a whole sequence ``x`` along ``dim`` (its length a multiple of
    2 * world_size): chunks r and 2N-1-r, concatenated."""
    checks.require_tensor("x", x)
    for name, n in (("world_size", world_size), ("rank", rank), ("dim", dim)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int, got {n!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
    _check_dim(x, dim)
    T = x.shape[dim]
    if T % (2 * world_size):
        raise ValueError(f"the sequence length must be a multiple of 2 * world_size = {2 * world_size} along "
                         f"dim {dim}, got {T}")
    chunks = x.chunk(2 * world_size, dim=dim)
    first, second = zigzag_chunks(world_size, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def _by_chunk(parts, dim: int) -> list[torch.Tensor]:
    """Views of every rank's shard (``parts[r]`` is rank r's) by global chunk: index g is chunk g of the
    sequence."""
    world = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * world)
    for r, part in enumerate(parts):
        first, second = zigzag_chunks(world, r)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return chunks


def _from_rank_order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's shard (``parts[r]`` is rank r's)."""
    return torch.cat(_by_chunk(parts, dim), dim=dim)


def _to_rank_order(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    """(world, *x.shape with dim's length / world): every rank's shard of the whole ``x``, stacked."""
    return torch.stack([shard_sequence(x, world, r, dim) for r in range(world)])


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    world, _ = _world(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _reduce_scatter(stacked: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks of ``stacked`` (world, ...), returning this rank's slice ``[rank]``. NCCL reduce-scatters;
    backends without it (gloo) all-reduce the whole tensor and keep their slice."""
    world, rank = _world(group)
    if dist.get_backend(group) == "nccl":
        out = torch.empty_like(stacked[0])
        dist.reduce_scatter_tensor(out, stacked.contiguous(), group=group)
        return out
    stacked = stacked.contiguous()
    dist.all_reduce(stacked, group=group)
    return stacked[rank]


def _check_dim(x: torch.Tensor, dim) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim!r}")


def unshard_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's zigzag shard ``x`` (an all-gather; no gradient). A shard holds
    two chunks of equal length, so its length along ``dim`` is even."""
    checks.require_tensor("x", x)
    _check_dim(x, dim)
    if x.shape[dim] % 2:
        raise ValueError(f"a shard holds two chunks of equal length: x's length along dim {dim} must be even, got "
                         f"{x.shape[dim]}")
    return _from_rank_order(_all_gather(x, group), dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather of every rank's shard into the whole sequence along dim 1; the backward sums the
    gradients of all ranks and returns this rank's shard of them."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return unshard_sequence(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        world, _ = _world(ctx.group)
        return _reduce_scatter(_to_rank_order(grad, world, 1), ctx.group), None


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """The whole sequence (B, T, ...) from every rank's zigzag shard (B, T / N, ...), with gradients."""
    return _GatherSequence.apply(x, group)


def _gather_kvg(k, v, log_fgate, group):
    """The whole sequence's K, V (one collective for both) and log gates."""
    kv = unshard_sequence(torch.cat([k, v], dim=-1), group)
    K, V = kv.split(k.shape[-1], dim=-1)
    return K, V, unshard_sequence(log_fgate, group)


def _chunk_calls(world: int, rank: int, T_local: int):
    """(local query slice, last key + 1) of each of this rank's two chunks: its queries see the keys before
    that end. Every call starts at key 0, so that the kernel's prefix sums are the single-device call's
    (with a sliding window the kernel never reads the key tiles wholly before the window)."""
    C = T_local // 2
    for i, g in enumerate(zigzag_chunks(world, rank)):
        yield slice(i * C, (i + 1) * C), (g + 1) * C


def _head_slices(groups: int, kv_heads: int, heads: int):
    """(key/value head slice, query head slice) of each group: a key/value head with its GQA query heads."""
    per, rep = kv_heads // groups, heads // kv_heads
    for j in range(groups):
        yield slice(j * per, (j + 1) * per), slice(j * per * rep, (j + 1) * per * rep)


def _part(x: torch.Tensor, heads: slice, whole: int) -> torch.Tensor:
    """``x[:, :, heads]`` as its own dense tensor (``x`` itself when the slice is every head)."""
    return x if heads.stop - heads.start == whole else x[:, :, heads].contiguous()


def _group_call(call: AttentionCall, heads: slice, whole: int) -> AttentionCall:
    """``call`` for the query heads ``heads`` of ``whole``: its threshold's columns of those heads."""
    if call.threshold is None or heads.stop - heads.start == whole:
        return call
    return dataclasses.replace(call, threshold=call.threshold[:, heads].contiguous())


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_fgate, group, call: AttentionCall, groups):
        world, rank = _world(group)
        H, Hkv = q.shape[2], k.shape[2]
        out = torch.empty_like(q)
        lses, bounds = [], []
        for kv_heads, q_heads in _head_slices(groups, Hkv, H):
            K, V, G = _gather_kvg(_part(k, kv_heads, Hkv), _part(v, kv_heads, Hkv),
                                  _part(log_fgate, q_heads, H), group)
            q_part, part_call = _part(q, q_heads, H), _group_call(call, q_heads, H)
            for rows, end in _chunk_calls(world, rank, q.shape[1]):
                o, lse, bound = dispatch.forward(q_part[:, rows], K[:, :end], V[:, :end], G[:, :end], part_call)
                out[:, rows, q_heads] = o
                lses.append(lse)
                bounds.append(bound)  # the chunk's resolved "auto" bound, or the group's threshold
            del K, V, G
        _, ctx.call_rest = call.saved(None)  # each chunk's backward takes its own bound
        ctx.save_for_backward(q, k, v, log_fgate, out, *lses, *bounds)
        ctx.group, ctx.groups = group, groups
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, log_fgate, out, *saved = ctx.saved_tensors
        lses, bounds = saved[:len(saved) // 2], saved[len(saved) // 2:]
        group, groups = ctx.group, ctx.groups
        world, rank = _world(group)
        B, T_local, Hkv, D = k.shape
        H = q.shape[2]
        C = T_local // 2
        dq, dk, dv, dg = (torch.empty_like(x) for x in (q, k, v, log_fgate))
        n = 0  # the forward's chunk calls, in order
        for kv_heads, q_heads in _head_slices(groups, Hkv, H):
            K, V, G = _gather_kvg(_part(k, kv_heads, Hkv), _part(v, kv_heads, Hkv),
                                  _part(log_fgate, q_heads, H), group)
            q_part, do_part, out_part = (_part(x, q_heads, H) for x in (q, dout, out))
            # The gradients of every rank's K|V and gates of this head group, summed here in float32 and laid
            # out in rank order (world, B, 2C, ...), so that the reduce-scatter hands each rank its own
            # without another copy.
            acc = torch.promote_types(k.dtype, torch.float32)
            dkv_all = k.new_zeros((world, B, T_local, K.shape[2], 2 * D), dtype=acc)
            dg_all = log_fgate.new_zeros((world, B, T_local, G.shape[2]),
                                         dtype=torch.promote_types(G.dtype, torch.float32))
            kv_chunks, g_chunks = _by_chunk(dkv_all.unbind(0), 1), _by_chunk(dg_all.unbind(0), 1)
            for rows, end in _chunk_calls(world, rank, T_local):
                bwd_call = AttentionCall.from_saved((None, None, bounds[n]), ctx.call_rest)
                dq_i, dk_i, dv_i, dg_i = dispatch.backward(do_part[:, rows].contiguous(), q_part[:, rows], K[:, :end],
                                                           V[:, :end], G[:, :end], out_part[:, rows].contiguous(),
                                                           lses[n], bwd_call)
                n += 1
                dq[:, rows, q_heads] = dq_i
                for g in range(end // C):
                    keys = slice(g * C, (g + 1) * C)
                    kv_chunks[g][..., :D] += dk_i[:, keys]
                    kv_chunks[g][..., D:] += dv_i[:, keys]
                    g_chunks[g] += dg_i[:, keys]
                del dk_i, dv_i, dg_i
            del K, V, G
            dkv = _reduce_scatter(dkv_all, group)
            del dkv_all
            dk[:, :, kv_heads], dv[:, :, kv_heads] = dkv[..., :D], dkv[..., D:]
            dg[:, :, q_heads] = _reduce_scatter(dg_all, group)
        return dq, dk, dv, dg, None, None, None


@torch.compiler.disable  # collectives inside an autograd.Function: run eagerly under torch.compile
def context_parallel_forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    sm_scale: float | None = None,
    adaptive_threshold=None,
    window_size: int | None = None,
    options: KernelOptions | None = None,
    head_groups: int | None = None,
    zero_gates: bool = True,
) -> torch.Tensor:
    """Forgetting Attention of one sequence split across the ranks of ``group`` (default: the world).

    Each rank passes its zigzag shard (``shard_sequence``) of q (B, T/N, H, D), k and v (B, T/N, Hkv, D) and
    log_fgate (B, T/N, H) float32, and gets its shard of the output; forward and every gradient equal those
    of ``forgetting_attention`` on the whole sequence (up to the order of floating-point sums). Every rank
    must call it with the same shapes and arguments.

    ``sm_scale``, ``adaptive_threshold``, ``window_size``, ``options`` and ``zero_gates`` are those of
    ``forgetting_attention`` (a threshold tensor broadcasts to (B, H)). Left padding (``seq_start``) and
    packed batches (``cu_seqlens``) are not taken: separate packed documents by gates of exactly 0
    (log gate -inf), which the kernel computes exactly. ``head_groups``: in how many groups of key/value
    heads the whole sequence is gathered, one after the other (a divisor of k's heads; None: the fewest whose
    whole-sequence K|V fits ``GATHER_BYTES``).
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("log_fgate", log_fgate)):
        checks.require_tensor(name, x)
        checks.require_rank(name, x, 3 if name == "log_fgate" else 4, "(B, T, H)" if name == "log_fgate"
                            else "(B, T, H, D)")
    checks.require_options(options)
    checks.require_same_device(q.device, k=k, v=v, log_fgate=log_fgate)
    world, _ = _world(group)
    B, T, H, D = q.shape
    if k.shape[:2] != (B, T) or v.shape != k.shape or k.shape[-1] != D:
        raise ValueError(f"k and v must have shape ({B}, {T}, Hkv, {D}) like q's shard, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if tuple(log_fgate.shape) != (B, T, H):
        raise ValueError(f"log_fgate must have shape {(B, T, H)} (B, T, H), got {tuple(log_fgate.shape)}")
    if log_fgate.dtype != torch.float32:
        raise TypeError(f"log_fgate must be float32, got {log_fgate.dtype}")
    checks.require_qkv_dtype(q, k, v)
    if T % 2:
        raise ValueError(f"a rank's shard holds two chunks of equal length: its length must be even, got {T}")
    if H % k.shape[2]:
        raise ValueError(f"q's {H} heads must be a multiple of k/v's heads, got Hkv={k.shape[2]}")
    Hkv = k.shape[2]
    if head_groups is None:
        head_groups = default_head_groups(Hkv, T * world, B, D, k.element_size())
    elif isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1 or Hkv % head_groups:
        raise ValueError(f"head_groups must be a positive divisor of k/v's {Hkv} heads, got {head_groups!r}")
    window = checks.check_window_size(window_size, T * world)
    options = options if options is not None else current_options()
    value_checks = not torch.compiler.is_compiling()  # each rank reads its own shard's gates
    if value_checks:
        checks.check_log_gates_at_most_zero("log_fgate", log_fgate, options.check_gates)
    checks.check_zero_gates_promise("log_fgate", log_fgate, zero_gates, options.check_gates, value_checks)
    sm_scale = D**-0.5 if sm_scale is None else checks.check_sm_scale(sm_scale)
    threshold, auto_log_eps = pruning_args(adaptive_threshold, q, k, sm_scale, None)
    # one description for every chunk's kernel call (each head group's takes its threshold's columns)
    call = AttentionCall(float(sm_scale), threshold=threshold, auto_log_eps=auto_log_eps, window=window,
                         options=options, zero_gates=zero_gates)
    q, k, v = (x.contiguous() for x in (q, k, v))
    return _ContextParallelAttention.apply(q, k, v, log_fgate.contiguous(), group, call, head_groups)


@dataclass(frozen=True)
class ContextParallel:
    """What a layer needs to run on its rank's zigzag shard of a sequence split across ``group``.

    Called like ``forgetting_attention`` (q, k, v, log_fgate and its keywords), it runs
    ``context_parallel_forgetting_attention``; a layer also asks it for the global positions of its tokens
    (RoPE) and the previous token of each of them (a token shift), which crosses shard edges."""

    group: dist.ProcessGroup | None = None
    head_groups: int | None = None
    """See ``context_parallel_forgetting_attention``."""
    world_size: int = field(init=False)
    rank: int = field(init=False)

    def __post_init__(self):  # read once: the layer's compiled code then sees plain numbers
        world, rank = _world(self.group)
        object.__setattr__(self, "world_size", world)
        object.__setattr__(self, "rank", rank)

    def __call__(self, q, k, v, log_fgate, *, seq_start=None, cu_seqlens=None, sm_scale=None,
                 adaptive_threshold=None, window_size=None, options=None, zero_gates=True):
        if seq_start is not None or cu_seqlens is not None:
            raise ValueError("context parallelism takes neither seq_start nor cu_seqlens: separate packed "
                             "documents by gates of exactly 0")
        return context_parallel_forgetting_attention(q, k, v, log_fgate, self.group, sm_scale=sm_scale,
                                                     adaptive_threshold=adaptive_threshold,
                                                     window_size=window_size, options=options,
                                                     head_groups=self.head_groups, zero_gates=zero_gates)

    def positions(self, T_local: int, device=None) -> torch.Tensor:
        """(T_local,) int64: the global position of each of this rank's tokens."""
        C = T_local // 2
        first, second = zigzag_chunks(self.world_size, self.rank)
        local = torch.arange(C, device=device)
        return torch.cat([local + first * C, local + second * C])

    @torch.compiler.disable  # a collective inside an autograd.Function: eager under torch.compile
    def previous_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 2, C): the token before each of this rank's two chunks (zero before the sequence's first),
        from the last tokens of every rank's chunks (one small all-gather, with gradients), for x (B, T_local,
        C) laid out as ``shard_sequence`` makes it."""
        world, rank = self.world_size, self.rank
        half = x.shape[1] // 2
        lasts = torch.stack([x[:, half - 1], x[:, -1]], dim=1)  # (B, 2, C): the last token of each local chunk
        every = gather_sequence(lasts, self.group)  # (B, 2N, C): chunk g's last token at index g
        zero = torch.zeros_like(every[:, :1])
        before = torch.cat([zero, every[:, :-1]], dim=1)  # index g: the token before chunk g
        first, second = zigzag_chunks(world, rank)
        return before[:, [first, second]]
