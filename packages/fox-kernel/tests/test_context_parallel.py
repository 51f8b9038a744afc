"""Context-parallel Forgetting Attention across real processes (gloo, CPU, float64) against the
single-process call on the whole sequence: the output and every gradient, world sizes 2, 3 and 4, GQA, odd
chunk lengths and head dims, a sliding window, pruning thresholds; the zigzag layout and its inverse, and
the token before each chunk (a token shift's halo) with its gradient."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from fox_kernel import forgetting_attention
from fox_kernel.context_parallel import (
    ContextParallel,
    context_parallel_forgetting_attention,
    default_head_groups,
    shard_sequence,
    unshard_sequence,
)
from fox_kernel.testing import random_log_fgate, run_ranks

CASES = [  # B, chunk, H, Hkv, D, keywords, head groups (None: the default, one group at these lengths)
    (2, 7, 3, 1, 12, {}, None),
    (1, 5, 4, 2, 16, {"window_size": 9}, None),
    (2, 4, 2, 2, 8, {"adaptive_threshold": -3.0}, None),
    (1, 6, 2, 1, 8, {"adaptive_threshold": "auto", "sm_scale": 0.3}, None),
    # the heads gathered in groups, one after the other: GQA heads stay with their key/value head, a
    # per-head threshold and the "auto" bound follow their heads
    (1, 5, 4, 2, 16, {"window_size": 9}, 2),
    (2, 4, 4, 4, 8, {"adaptive_threshold": torch.tensor([-3.0, -1.5, -4.0, -2.0])}, 2),
    (1, 6, 6, 3, 8, {"adaptive_threshold": "auto"}, 3),
]


def _inputs(B, T, H, Hkv, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, Hkv, D, generator=g, dtype=torch.float64)
    lf = random_log_fgate((B, T, H), generator=g)
    return q, k, v, lf


def _check_attention(world, rank):
    for seed, (B, chunk, H, Hkv, D, kw, groups) in enumerate(CASES):
        T = 2 * world * chunk
        full = [x.requires_grad_() for x in _inputs(B, T, H, Hkv, D, seed)]
        out = forgetting_attention(*full, **kw)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + seed), dtype=out.dtype)
        grads = torch.autograd.grad(out, full, dout)

        local = [shard_sequence(x.detach(), world, rank).requires_grad_() for x in full]
        local_out = context_parallel_forgetting_attention(*local, **kw, head_groups=groups)
        local_grads = torch.autograd.grad(local_out, local, shard_sequence(dout, world, rank))
        case = f"case {seed} ({B=}, {T=}, {H=}, {Hkv=}, {D=}, {kw}, {groups=}) rank {rank}/{world}"
        torch.testing.assert_close(local_out, shard_sequence(out, world, rank), rtol=1e-10, atol=1e-12, msg=case)
        for name, a, e in zip(("dq", "dk", "dv", "dlog_fgate"), local_grads, grads):
            # the gates are float32, and so is their gradient: the sums over chunks and ranks round in float32
            tol = {"rtol": 1e-5, "atol": 1e-6} if e.dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
            torch.testing.assert_close(a, shard_sequence(e, world, rank), **tol, msg=f"{name}: {case}")


def _check_layout_and_halo(world, rank):
    x = torch.randn(2, 4 * world, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    local = shard_sequence(x, world, rank)
    torch.testing.assert_close(unshard_sequence(local), x, rtol=0, atol=0)
    cp = ContextParallel()
    positions = cp.positions(local.shape[1])
    torch.testing.assert_close(local, x[:, positions], rtol=0, atol=0)
    # previous_tokens against the whole sequence shifted by one (zero first), values and gradients
    leaf = local.clone().requires_grad_()
    before = cp.previous_tokens(leaf)
    shifted = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
    chunk = local.shape[1] // 2
    torch.testing.assert_close(before, shifted[:, positions[[0, chunk]]], rtol=0, atol=0)
    w = torch.randn(2, 2 * world, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    (before * w[:, [rank, 2 * world - 1 - rank]]).sum().backward()
    # the token at global position p feeds the halo of chunk p // chunk + 1 when it is that chunk's last
    expected = torch.zeros_like(x)
    for g in range(2 * world - 1):
        expected[:, (g + 1) * chunk - 1] = w[:, g + 1]
    torch.testing.assert_close(leaf.grad, shard_sequence(expected, world, rank), rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_context_parallel_equals_one_process(world):
    run_ranks(__file__, world)


def _check_cuda_bf16(world, rank):
    """At 16k tokens in bfloat16 on NCCL: the context-parallel output and gradients are as close to a
    float32 single-GPU call as the bfloat16 single-GPU call is (its own rounding noise)."""
    torch.cuda.set_device(rank)
    for H, Hkv, D, groups in ((12, 12, 64, None), (8, 2, 128, None), (8, 2, 128, 2)):
        T = 16384
        q, k, v, lf = (x.cuda() for x in _inputs(1, T, H, Hkv, D, seed=D))
        dout = torch.randn(1, T, H, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64).cuda()

        def run(fn, dtype, shard):
            xs = [(shard(x) if shard else x).to(dtype).requires_grad_() for x in (q, k, v)]
            g = (shard(lf) if shard else lf).requires_grad_()
            out = fn(*xs, g)
            grads = torch.autograd.grad(out, [*xs, g], (shard(dout) if shard else dout).to(dtype))
            return [out, *grads]

        shard = lambda x: shard_sequence(x, world, rank)
        exact = [shard(x).double() for x in run(forgetting_attention, torch.float32, None)]
        single = [shard(x).double() for x in run(forgetting_attention, torch.bfloat16, None)]
        split = [x.double() for x in run(lambda *a: context_parallel_forgetting_attention(*a, head_groups=groups),
                                         torch.bfloat16, shard)]
        for name, e, a, b in zip(("out", "dq", "dk", "dv", "dlog_fgate"), exact, single, split):
            noise, err = (a - e).abs().max().item(), (b - e).abs().max().item()
            assert err <= 1.5 * noise + 1e-6 * e.abs().max().item(), \
                f"{name} (H={H}, D={D}, {groups=}): {err} vs bf16 noise {noise}"
            print(f"rank {rank} H={H} Hkv={Hkv} D={D} {groups=} {name}: context-parallel error {err:.3g}, "
                  f"single-GPU {noise:.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_on_gpus_within_bf16_noise(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    run_ranks(__file__, world, "cuda")


def test_shard_sequence_refuses_lengths_that_do_not_split():
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size = 4"):
        shard_sequence(torch.zeros(1, 6, 2), 2, 0)
    with pytest.raises(ValueError, match="rank must lie in \\[0, 2\\)"):
        shard_sequence(torch.zeros(1, 8, 2), 2, 2)
    x = torch.zeros(1, 8, 2)
    for args, error, message in (
        ((x, 0, 0), ValueError, r"^world_size must be >= 1, got 0$"),
        ((x, True, 0), TypeError, r"^world_size must be an int, got True$"),
        ((x, 2, 1.0), TypeError, r"^rank must be an int, got 1.0$"),
        ((x, 2, 0, 5), ValueError, r"^dim must be an int in \[-3, 3\) for x of shape \(1, 8, 2\), got 5$"),
        ((x.tolist(), 2, 0), TypeError, r"^x must be a torch.Tensor, got list$"),
    ):
        with pytest.raises(error, match=message):
            shard_sequence(*args)


def test_unshard_sequence_refuses_shards_of_odd_length():
    """A shard is two chunks of equal length: an odd one would be cut unevenly and the sequence put back out
    of order (before the all-gather, so no process group is needed to refuse it)."""
    with pytest.raises(ValueError, match=r"^a shard holds two chunks of equal length: x's length along dim 1 must "
                                         r"be even, got 5$"):
        unshard_sequence(torch.zeros(1, 5, 2))
    with pytest.raises(ValueError, match=r"^dim must be an int in \[-1, 1\) "):
        unshard_sequence(torch.zeros(4))


def test_default_head_groups_fit_the_budget():
    """The fewest groups, a divisor of the key/value heads, whose whole-sequence K|V fits the budget; one
    group per head when even one head's does not."""
    one_head = 2 * 1000 * 2 * 64 * 2  # B=2, T=1000, K|V of D=64 in bf16
    assert default_head_groups(12, 1000, 2, 64, 2, budget=12 * one_head) == 1
    assert default_head_groups(12, 1000, 2, 64, 2, budget=12 * one_head - 1) == 2
    assert default_head_groups(12, 1000, 2, 64, 2, budget=5 * one_head) == 3  # 4 heads a group would not fit
    assert default_head_groups(12, 1000, 2, 64, 2, budget=one_head - 1) == 12
    assert default_head_groups(7, 1000, 2, 64, 2, budget=6 * one_head) == 7  # 7 is prime
    assert default_head_groups(12, 2**20, 1, 128, 2) == 12  # 1M tokens: 512 MiB a head against 256 MiB


def test_needs_an_initialised_process_group():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        context_parallel_forgetting_attention(q, q, q, torch.zeros(1, 4, 2))


if __name__ == "__main__":  # one rank of test_context_parallel_equals_one_process (or of the CUDA test)
    cuda = sys.argv[1:] == ["cuda"]
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.set_num_threads(1)
    try:
        if cuda:
            _check_cuda_bf16(dist.get_world_size(), dist.get_rank())
        else:
            _check_attention(dist.get_world_size(), dist.get_rank())
            _check_layout_and_halo(dist.get_world_size(), dist.get_rank())
    finally:
        dist.destroy_process_group()
    sys.exit(0)
