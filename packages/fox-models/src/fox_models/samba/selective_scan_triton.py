"""Triton kernels of Mamba's selective scan (``fox_models.samba.selective_scan`` states the function).

Each program owns one batch row and a block of ``BLOCK_E`` channels with all ``N`` states: the state
(BLOCK_E, N) stays in registers while the program walks over time in tiles of ``BLOCK_T`` steps. Inside a
tile the recurrence ``h_t = a_t h_{t-1} + b_t`` is an associative scan over the tile's rows (pairs (a, b)
composed as affine maps), so a tile costs a log2(BLOCK_T)-deep scan instead of BLOCK_T dependent steps,
and the time loop carries one state from tile to tile.

The forward saves the state at the start of every chunk of ``CHUNK`` steps (float32). The backward
walks the chunks in reverse: it recomputes the tile-start states of one chunk from its saved state into a
small per-program scratch buffer, then runs the chunk's tiles in reverse, each recomputing its states and
scanning the state gradient ``g_t = C_t dy_t + a_{t+1} g_{t+1}`` backwards (a reversed associative scan),
with the gradient at the next tile's first row carried in registers. The gradients of B and C are summed
over channels, so each channel block writes its own partial sum (no atomics: the result does not depend
on scheduling) and the caller adds them up; the same for A, D and the time-step bias over the batch.

Layouts: x, dt and the output (batch, T, E) contiguous; z (batch, T, E) and B, C (batch, T, N) with any
batch and time strides and a unit last stride; A (E, N), D and dt_bias (E,), states (batch, E, N), all
float32 except x, dt, z, B, C and the output. Offsets are int64 wherever a batch or time index multiplies
a stride (batch x T x E passes 2^31 at long contexts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel import cdiv, next_power_of_2

# Time steps between two states the forward saves for the backward (a multiple of every BLOCK_T).
CHUNK = 256
# (BLOCK_T time steps per tile, BLOCK_E channels per program, warps) of each pass. With 8 channels a program,
# a 760M layer (3072 channels) runs 384 programs per sequence, so one 16k-token sequence fills an H100;
# on sm90 neither pass spills registers (ptxas: 72 forward, 216 backward).
FORWARD = (16, 8, 4)
BACKWARD = (16, 8, 4)


@triton.jit
def _compose(a1, b1, a2, b2):
    """The affine map h -> a2 (a1 h + b1) + b2: map 1 applied first."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _softplus(v):
    """log(1 + e^v) in float32, accurate for very negative v: max(v, 0) + log1p(e^-|v|), with log1p(u)
    computed as log(w) u / (w - 1), w = 1 + u (exact to a few ulps; u itself where w rounds to 1)."""
    u = tl.exp(-tl.abs(v))
    w = 1.0 + u
    tiny = w == 1.0
    log1p = tl.where(tiny, u, tl.log(w) * u / tl.where(tiny, 1.0, w - 1.0))
    return tl.maximum(v, 0.0) + log1p


@triton.jit
def _tile(X, DT, Bm, b, i, T, E, N, sbc_b, sbc_t, offs_e, offs_n, e_ok, n_ok, A_en, bias,
          BLOCK_T: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The inputs of tile i of batch row b: x and dt (raw) (BLOCK_T, BLOCK_E) float32, delta (0 outside the
    sequence and the channel block), B (BLOCK_T, BLOCK_N), the pairs (a, b_in) (BLOCK_T, BLOCK_E, BLOCK_N)
    of h_t = a_t h_{t-1} + b_in_t, and the masks and offsets of the tile's rows."""
    offs_t = i * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    te_ok = t_ok[:, None] & e_ok[None, :]
    te = b * T * E + offs_t.to(tl.int64)[:, None] * E + offs_e[None, :]
    x = tl.load(X + te, mask=te_ok, other=0.0).to(tl.float32)
    dt = tl.load(DT + te, mask=te_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt = dt + bias[None, :]
    delta = tl.where(te_ok, _softplus(dt), 0.0)
    tn = b * sbc_b + offs_t.to(tl.int64)[:, None] * sbc_t + offs_n[None, :]
    tn_ok = t_ok[:, None] & n_ok[None, :]
    Bt = tl.load(Bm + tn, mask=tn_ok, other=0.0).to(tl.float32)
    a = tl.exp(delta[:, :, None] * A_en[None, :, :])
    b_in = (delta * x)[:, :, None] * Bt[:, None, :]
    return x, dt, delta, Bt, a, b_in, te, te_ok, tn, tn_ok, offs_t


@triton.jit
def _row(v, r, BLOCK_T: tl.constexpr):
    """Row r of a (BLOCK_T, ...) 3-D tile, as a 2-D tensor."""
    rows = tl.arange(0, BLOCK_T)
    return tl.sum(tl.where((rows == r)[:, None, None], v, 0.0), 0)


@triton.jit
def _fwd_kernel(
    X, DT, Z, Bm, Cm, A, Dp, DT_BIAS, H0, OUT, HT, STATES,
    T, E, N, sz_b, sz_t, sbc_b, sbc_t,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_TILES: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
    SAVE_STATES: tl.constexpr,
):
    pid_e = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_n = tl.arange(0, BLOCK_N)
    e_ok = offs_e < E
    n_ok = offs_n < N
    en_ok = e_ok[:, None] & n_ok[None, :]
    en = offs_e[:, None] * N + offs_n[None, :]
    A_en = tl.load(A + en, mask=en_ok, other=0.0)
    bias = tl.load(DT_BIAS + offs_e, mask=e_ok, other=0.0) if HAS_BIAS else None
    Dv = tl.load(Dp + offs_e, mask=e_ok, other=0.0) if HAS_D else None
    if HAS_H0:
        h = tl.load(H0 + b * E * N + en, mask=en_ok, other=0.0)
    else:
        h = tl.zeros((BLOCK_E, BLOCK_N), dtype=tl.float32)
    n_tiles = tl.cdiv(T, BLOCK_T)
    n_chunks = tl.cdiv(n_tiles, CHUNK_TILES)
    for i in range(0, n_tiles):
        if SAVE_STATES:  # noqa: SIM102 (a constexpr: without it the store is not compiled at all)
            if i % CHUNK_TILES == 0:
                tl.store(STATES + (b * n_chunks + i // CHUNK_TILES) * E * N + en, h, mask=en_ok)
        x, dt, delta, Bt, a, b_in, te, te_ok, tn, tn_ok, offs_t = _tile(
            X, DT, Bm, b, i, T, E, N, sbc_b, sbc_t, offs_e, offs_n, e_ok, n_ok, A_en, bias, BLOCK_T, HAS_BIAS)
        Ct = tl.load(Cm + tn, mask=tn_ok, other=0.0).to(tl.float32)
        a_cum, h_local = tl.associative_scan((a, b_in), 0, _compose)
        hs = a_cum * h[None, :, :] + h_local
        y = tl.sum(hs * Ct[:, None, :], 2)
        if HAS_D:
            y += x * Dv[None, :]
        if HAS_Z:
            z = tl.load(Z + b * sz_b + offs_t.to(tl.int64)[:, None] * sz_t + offs_e[None, :], mask=te_ok,
                        other=0.0).to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(OUT + te, y.to(OUT.dtype.element_ty), mask=te_ok)
        # rows past the end of the sequence are identity maps (delta = 0): the last row is the state at T - 1
        h = _row(hs, BLOCK_T - 1, BLOCK_T)
    tl.store(HT + b * E * N + en, h, mask=en_ok)


@triton.jit
def _bwd_kernel(
    X, DT, Z, Bm, Cm, A, Dp, DT_BIAS, DOUT, STATES, SCRATCH,
    DX, DDT, DZ, DB, DC, DA, DD, DBIAS,
    T, E, N, sz_b, sz_t, sbc_b, sbc_t,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_TILES: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid_e = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_eblocks = tl.num_programs(0)
    batch = tl.num_programs(1)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_n = tl.arange(0, BLOCK_N)
    e_ok = offs_e < E
    n_ok = offs_n < N
    en_ok = e_ok[:, None] & n_ok[None, :]
    en = offs_e[:, None] * N + offs_n[None, :]
    A_en = tl.load(A + en, mask=en_ok, other=0.0)
    bias = tl.load(DT_BIAS + offs_e, mask=e_ok, other=0.0) if HAS_BIAS else None
    Dv = tl.load(Dp + offs_e, mask=e_ok, other=0.0) if HAS_D else None
    # this program's slots of the scratch buffer: one (BLOCK_E, BLOCK_N) state per tile of a chunk
    slots = SCRATCH + (b * n_eblocks + pid_e) * CHUNK_TILES * BLOCK_E * BLOCK_N
    slot = tl.arange(0, BLOCK_E)[:, None] * BLOCK_N + offs_n[None, :]
    # the partial sums over channels of this channel block: (n_eblocks, batch, T, N)
    part = (pid_e * batch + b) * T * N
    dA = tl.zeros((BLOCK_E, BLOCK_N), dtype=tl.float32)
    dD = tl.zeros((BLOCK_E,), dtype=tl.float32)
    dbias = tl.zeros((BLOCK_E,), dtype=tl.float32)
    g = tl.zeros((BLOCK_E, BLOCK_N), dtype=tl.float32)  # dL/dh at the first row of the tile after this one
    n_tiles = tl.cdiv(T, BLOCK_T)
    n_chunks = tl.cdiv(n_tiles, CHUNK_TILES)
    for c_rev in range(0, n_chunks):
        c = n_chunks - 1 - c_rev
        first = c * CHUNK_TILES
        last = tl.minimum(first + CHUNK_TILES, n_tiles)
        # the state at the start of each tile of the chunk, from the chunk's saved state
        h = tl.load(STATES + (b * n_chunks + c) * E * N + en, mask=en_ok, other=0.0)
        for i in range(first, last):
            tl.store(slots + (i - first) * BLOCK_E * BLOCK_N + slot, h)
            _, _, _, _, a, b_in, _, _, _, _, _ = _tile(
                X, DT, Bm, b, i, T, E, N, sbc_b, sbc_t, offs_e, offs_n, e_ok, n_ok, A_en, bias, BLOCK_T, HAS_BIAS)
            a_cum, h_local = tl.associative_scan((a, b_in), 0, _compose)
            h = _row(a_cum, BLOCK_T - 1, BLOCK_T) * h + _row(h_local, BLOCK_T - 1, BLOCK_T)
        tl.debug_barrier()  # the slots are read below by other threads of the program
        for i_rev in range(first, last):
            i = last - 1 - (i_rev - first)
            h0 = tl.load(slots + (i - first) * BLOCK_E * BLOCK_N + slot)
            x, dt, delta, Bt, a, b_in, te, te_ok, tn, tn_ok, offs_t = _tile(
                X, DT, Bm, b, i, T, E, N, sbc_b, sbc_t, offs_e, offs_n, e_ok, n_ok, A_en, bias, BLOCK_T, HAS_BIAS)
            Ct = tl.load(Cm + tn, mask=tn_ok, other=0.0).to(tl.float32)
            a_cum, h_local = tl.associative_scan((a, b_in), 0, _compose)
            hs = a_cum * h0[None, :, :] + h_local
            dy = tl.load(DOUT + te, mask=te_ok, other=0.0).to(tl.float32)
            if HAS_Z:
                y = tl.sum(hs * Ct[:, None, :], 2)
                if HAS_D:
                    y += x * Dv[None, :]
                z = tl.load(Z + b * sz_b + offs_t.to(tl.int64)[:, None] * sz_t + offs_e[None, :], mask=te_ok,
                            other=0.0).to(tl.float32)
                sz = tl.sigmoid(z)
                tl.store(DZ + te, (dy * y * sz * (1.0 + z * (1.0 - sz))).to(DZ.dtype.element_ty), mask=te_ok)
                dy = dy * z * sz
            # a_{t+1} of every row: the next step's decay (1 past the end, where nothing flows back)
            te1_ok = ((offs_t + 1) < T)[:, None] & e_ok[None, :]
            dt1 = tl.load(DT + te + E, mask=te1_ok, other=0.0).to(tl.float32)
            if HAS_BIAS:
                dt1 = dt1 + bias[None, :]
            a_next = tl.exp(tl.where(te1_ok, _softplus(dt1), 0.0)[:, :, None] * A_en[None, :, :])
            # g_t = C_t dy_t + a_{t+1} g_{t+1}, scanned from the tile's last row with g of the next tile
            g_cum, g_local = tl.associative_scan((a_next, dy[:, :, None] * Ct[:, None, :]), 0, _compose,
                                                 reverse=True)
            gs = g_cum * g[None, :, :] + g_local
            # a_t h_{t-1} = h_t - b_in_t: the state before the step, through its decay, without a shifted tile
            decayed = hs - b_in
            gB = tl.sum(gs * Bt[:, None, :], 2)
            ddelta = x * gB + tl.sum(gs * decayed * A_en[None, :, :], 2)
            dx = delta * gB
            if HAS_D:
                dx += dy * Dv[None, :]
                dD += tl.sum(dy * x, 0)
            ddt = ddelta * tl.sigmoid(dt)
            dbias += tl.sum(ddt, 0)
            dA += tl.sum(gs * decayed * delta[:, :, None], 0)
            tl.store(DX + te, dx.to(DX.dtype.element_ty), mask=te_ok)
            tl.store(DDT + te, ddt.to(DDT.dtype.element_ty), mask=te_ok)
            tn_part = part + offs_t.to(tl.int64)[:, None] * N + offs_n[None, :]
            tl.store(DB + tn_part, tl.sum(gs * (delta * x)[:, :, None], 1), mask=tn_ok)
            tl.store(DC + tn_part, tl.sum(hs * dy[:, :, None], 1), mask=tn_ok)
            g = _row(gs, 0, BLOCK_T)
        tl.debug_barrier()  # the next chunk overwrites the slots
    tl.store(DA + b * E * N + en, dA, mask=en_ok)
    if HAS_D:
        tl.store(DD + b * E + offs_e, dD, mask=e_ok)
    if HAS_BIAS:
        tl.store(DBIAS + b * E + offs_e, dbias, mask=e_ok)


def _strides_bc(B: torch.Tensor, C: torch.Tensor):
    """B and C with one (batch, time) stride pair and unit last strides (copies only if needed)."""
    if B.stride() != C.stride() or B.stride(-1) != 1:
        B, C = B.contiguous(), C.contiguous()
    return B, C, B.stride(0), B.stride(1)


def _z_strides(z):
    if z is None:
        return None, 0, 0
    if z.stride(-1) != 1:
        z = z.contiguous()
    return z, z.stride(0), z.stride(1)


def n_chunks(T: int) -> int:
    return cdiv(T, CHUNK)


def scan_forward(x, dt, A, B, C, D, z, dt_bias, initial_state, save_states: bool, blocks=None):
    """-> (out (batch, T, E) in x's dtype, final state (batch, E, N) float32, chunk-start states
    (batch, chunks, E, N) float32, empty without ``save_states``). ``blocks``: (BLOCK_T, BLOCK_E, num_warps)
    instead of ``FORWARD`` (benchmarks)."""
    x, dt = x.contiguous(), dt.contiguous()
    Bt, T, E = x.shape
    N = A.shape[1]
    B, C, sbc_b, sbc_t = _strides_bc(B, C)
    z, sz_b, sz_t = _z_strides(z)
    block_t, block_e, num_warps = blocks or FORWARD
    out = torch.empty_like(x)
    final = x.new_empty(Bt, E, N, dtype=torch.float32)
    states = x.new_empty((Bt, n_chunks(T), E, N) if save_states else (0,), dtype=torch.float32)
    A = A.float().contiguous()
    Dp = None if D is None else D.float().contiguous()
    bias = None if dt_bias is None else dt_bias.float().contiguous()
    h0 = None if initial_state is None else initial_state.float().contiguous()
    grid = (cdiv(E, block_e), Bt)
    _fwd_kernel[grid](
        x, dt, z, B, C, A, Dp, bias, h0, out, final, states,
        T, E, N, sz_b, sz_t, sbc_b, sbc_t,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_N=next_power_of_2(N), CHUNK_TILES=CHUNK // block_t,
        HAS_Z=z is not None, HAS_D=D is not None, HAS_BIAS=dt_bias is not None, HAS_H0=initial_state is not None,
        SAVE_STATES=save_states, num_warps=num_warps,
    )
    return out, final, states


def scan_backward(dout, x, dt, A, B, C, D, z, dt_bias, states, blocks=None):
    """Gradients (dx, ddt, dA, dB, dC, dD, dz, ddt_bias), None for an absent input; dA, dD and ddt_bias
    float32, the others in their input's dtype. ``blocks``: (BLOCK_T, BLOCK_E, num_warps) instead of
    ``BACKWARD``."""
    x, dt, dout = x.contiguous(), dt.contiguous(), dout.contiguous()
    Bt, T, E = x.shape
    N = A.shape[1]
    B_in, C_in = B, C
    B, C, sbc_b, sbc_t = _strides_bc(B, C)
    z, sz_b, sz_t = _z_strides(z)
    block_t, block_e, num_warps = blocks or BACKWARD
    block_n, chunk_tiles = next_power_of_2(N), CHUNK // block_t
    n_eblocks = cdiv(E, block_e)
    f32 = dict(device=x.device, dtype=torch.float32)
    dx, ddt = torch.empty_like(x), torch.empty_like(dt)
    dz = None if z is None else torch.empty(z.shape, device=z.device, dtype=z.dtype)
    dB_part = torch.empty(n_eblocks, Bt, T, N, **f32)
    dC_part = torch.empty(n_eblocks, Bt, T, N, **f32)
    dA = torch.empty(Bt, E, N, **f32)
    dD = None if D is None else torch.empty(Bt, E, **f32)
    dbias = None if dt_bias is None else torch.empty(Bt, E, **f32)
    scratch = torch.empty(Bt * n_eblocks * chunk_tiles * block_e * block_n, **f32)
    A = A.float().contiguous()
    Dp = None if D is None else D.float().contiguous()
    bias = None if dt_bias is None else dt_bias.float().contiguous()
    _bwd_kernel[(n_eblocks, Bt)](
        x, dt, z, B, C, A, Dp, bias, dout, states, scratch,
        dx, ddt, dz, dB_part, dC_part, dA, dD, dbias,
        T, E, N, sz_b, sz_t, sbc_b, sbc_t,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_N=block_n, CHUNK_TILES=chunk_tiles,
        HAS_Z=z is not None, HAS_D=D is not None, HAS_BIAS=dt_bias is not None, num_warps=num_warps,
    )
    return (dx, ddt, dA.sum(0), dB_part.sum(0).to(B_in.dtype), dC_part.sum(0).to(C_in.dtype),
            None if dD is None else dD.sum(0), dz, None if dbias is None else dbias.sum(0))
