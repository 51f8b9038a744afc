"""SAMBA's selective scan on one GPU: the Triton kernels against the chunked PyTorch scan, and the tiles.

At one shape (default: a 760M Mamba layer on one 16k-token sequence: batch 1, T 16384, 3072 channels,
state 16, bf16 inputs laid out as the model passes them: z a half of in_proj's output, B and C slices of
x_proj's) it times forward and forward+backward of

* ``selective_scan_triton`` (the kernels' default tiles) and ``selective_scan_chunked`` (PyTorch);
* ``mamba_ssm``'s CUDA ``selective_scan_fn`` (the reference's kernel), when that package is installed;
* each pass of the Triton kernels alone at other tile shapes (BLOCK_T, BLOCK_E, warps), to choose them;
* a whole SAMBA Mamba mixer (in_proj to out_proj) at 760M under bf16 autocast, for the scan's share.

Prints a table and writes JSON.

    python packages/fox-models/benchmarks/bench_selective_scan.py --out selective-scan-h100.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.testing import do_bench

from fox_models.samba import selective_scan_triton as kernels
from fox_models.samba.selective_scan import selective_scan_chunked, selective_scan_triton

FORWARD_TILES = [(16, 8, 4), (16, 16, 8), (16, 16, 4), (8, 16, 4), (32, 8, 4), (8, 8, 2)]
BACKWARD_TILES = [(16, 8, 4), (16, 16, 8), (8, 16, 4), (8, 8, 4), (16, 8, 8)]


def inputs(batch, T, E, N):
    """Inputs in the model's layout, leaves that require grad (A, D, dt_bias float32)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    bf = torch.bfloat16
    xz = r(batch, T, 2 * E).to(bf).requires_grad_()
    dbc = r(batch, T, 2 * N + 8).to(bf).requires_grad_()
    x = r(batch, T, E).to(bf).requires_grad_()
    dt = (r(batch, T, E) - 4).to(bf).requires_grad_()
    A = (-torch.exp(r(E, N))).requires_grad_()
    D, bias = r(E).requires_grad_(), r(E).requires_grad_()
    return dict(x=x, dt=dt, A=A, B=dbc[..., :N], C=dbc[..., N:2 * N], D=D, z=xz[..., E:], dt_bias=bias)


def fwd_and_fwd_bwd(fn, args):
    dout = torch.randn_like(args["x"])
    leaves = [t for t in args.values() if t.is_leaf] + [args["z"]._base, args["B"]._base]

    def fwd():
        with torch.no_grad():
            return fn(**args)

    def fwd_bwd():
        out, _ = fn(**args)
        torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dout)

    fwd_bwd()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return dict(fwd_ms=do_bench(fwd), fwd_bwd_ms=do_bench(fwd_bwd), extra_peak_gib=peak)


def mamba_ssm_row(args):
    """The reference's CUDA kernel (channels-first layout), if installed."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError:
        return None
    t = lambda v: v.detach().transpose(1, 2).contiguous().requires_grad_()
    a = dict(u=t(args["x"]), delta=t(args["dt"]), A=args["A"], B=t(args["B"]), C=t(args["C"]), D=args["D"],
             z=t(args["z"]), delta_bias=args["dt_bias"])
    dout = torch.randn_like(a["u"])

    def fwd():
        with torch.no_grad():
            return selective_scan_fn(**a, delta_softplus=True)

    def fwd_bwd():
        out = selective_scan_fn(**a, delta_softplus=True)
        torch.autograd.grad(out, [v for v in a.values() if v.requires_grad], dout)

    return dict(fwd_ms=do_bench(fwd), fwd_bwd_ms=do_bench(fwd_bwd), extra_peak_gib=None)


def tile_rows(args):
    """Each pass alone at each tile shape (the forward saving its states, as in training)."""
    plain = {k: v.detach() for k, v in args.items()}
    order = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")
    fwd_in = [plain[k] for k in order]
    _, _, states = kernels.scan_forward(*fwd_in, None, True)
    dout = torch.randn_like(plain["x"])
    rows = []
    for tiles in FORWARD_TILES:
        ms = do_bench(lambda tiles=tiles: kernels.scan_forward(*fwd_in, None, True, blocks=tiles))
        rows.append(dict(pass_="forward", tiles=tiles, ms=ms))
    for tiles in BACKWARD_TILES:
        ms = do_bench(lambda tiles=tiles: kernels.scan_backward(dout, *fwd_in, states, blocks=tiles))
        rows.append(dict(pass_="backward", tiles=tiles, ms=ms))
    return rows


def mixer_row(batch, T):
    """A SAMBA 760M Mamba mixer (in_proj to out_proj), bf16 autocast, forward+backward."""
    from fox_models.presets import get_preset
    from fox_models.samba import MambaMixer

    mixer = MambaMixer(get_preset("samba-760m")).cuda()
    h = torch.randn(batch, T, mixer.in_proj.in_features, device="cuda", requires_grad=True)

    def fwd_bwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = mixer(h)
        out.float().sum().backward()

    return dict(fwd_bwd_ms=do_bench(fwd_bwd))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--channels", type=int, default=3072)
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--out", default="selective_scan.json")
    a = ap.parse_args()
    args = inputs(a.batch, a.seqlen, a.channels, a.state)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    shape = dict(batch=a.batch, T=a.seqlen, channels=a.channels, state=a.state, dtype="bfloat16",
                 forward_tiles=kernels.FORWARD, backward_tiles=kernels.BACKWARD, chunk=kernels.CHUNK)
    impls = {"triton": fwd_and_fwd_bwd(selective_scan_triton, args)}
    try:
        impls["pytorch chunked"] = fwd_and_fwd_bwd(selective_scan_chunked, args)
    except torch.OutOfMemoryError:
        impls["pytorch chunked"] = dict(fwd_ms=None, fwd_bwd_ms=None, extra_peak_gib=None, note="out of memory")
    torch.cuda.empty_cache()
    reference = mamba_ssm_row(args)
    if reference is not None:
        impls["mamba_ssm selective_scan_fn"] = reference
    tiles = tile_rows(args)
    mixer = mixer_row(a.batch, a.seqlen)

    print(" | ".join(f"{k}={v}" for k, v in {**env, **shape}.items()))
    fmt = lambda v, w, p=2: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}s}"
    print(f"{'scan':28s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'extra GiB':>10s} {'vs triton':>10s}")
    for name, r in impls.items():
        ratio = r["fwd_bwd_ms"] / impls["triton"]["fwd_bwd_ms"] if r["fwd_bwd_ms"] else None
        print(f"{name:28s} {fmt(r['fwd_ms'], 8)} {fmt(r['fwd_bwd_ms'], 11)} {fmt(r['extra_peak_gib'], 10)} "
              f"{fmt(ratio, 9)}x {r.get('note', '')}")
    print(f"\n{'pass':9s} {'BLOCK_T, BLOCK_E, warps':>24s} {'ms':>8s}")
    for r in tiles:
        print(f"{r['pass_']:9s} {str(r['tiles']):>24s} {r['ms']:8.3f}")
    print(f"\nSAMBA-760M Mamba mixer fwd+bwd (bf16 autocast): {mixer['fwd_bwd_ms']:.2f} ms")
    with open(a.out, "w") as f:
        json.dump(dict(env=env, shape=shape, scans=impls, tiles=tiles, mixer_760m=mixer), f, indent=1)


if __name__ == "__main__":
    main()
