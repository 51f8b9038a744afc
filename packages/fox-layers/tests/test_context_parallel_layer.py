"""The attention layer under context parallelism, across real processes (gloo, CPU, float64): its kernel
call replaced by ``ContextParallel``, each rank's zigzag shard of the input gives that shard of the
single-process output, and the input's and every parameter's gradient (summed over ranks) equal the
single-process ones. FoX (Pro) (QK-norm, k/v token shift across shard edges, output norm and gate), GQA, and
RoPE attention without a forget gate (global positions), at world sizes 2 and 3."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from fox_kernel.context_parallel import ContextParallel, shard_sequence
from fox_kernel.testing import run_ranks
from fox_layers import ForgettingAttentionLayer

LAYERS = {
    "fox-pro": dict(num_heads=4, num_kv_heads=2, use_output_gate=True, use_output_norm=True, qk_norm=True,
                    use_k_shift=True, use_v_shift=True),
    "transformer-rope": dict(num_heads=3, fgate_type="none", use_rope=True),
}


def _check(world, rank):
    for seed, (name, kwargs) in enumerate(LAYERS.items()):
        torch.manual_seed(seed)
        layer = ForgettingAttentionLayer(24, **kwargs).double()
        for p in layer.parameters():  # random norm weights and biases too, not their ones/zeros init
            torch.nn.init.normal_(p, std=0.3)
        T = 2 * world * 5
        x = torch.randn(2, T, 24, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(2, T, 24, dtype=torch.float64)
        out, _ = layer(x)
        params = list(layer.parameters())
        grads = torch.autograd.grad(out, [x, *params], dout)

        layer.attention_kernel = ContextParallel()
        local = shard_sequence(x.detach(), world, rank).requires_grad_()
        local_out, _ = layer(local)
        local_grads = torch.autograd.grad(local_out, [local, *params], shard_sequence(dout, world, rank))
        for g in local_grads[1:]:
            dist.all_reduce(g)
        # the log gates are float32 (the kernel's contract), so gradients through them round in float32
        tol = dict(rtol=1e-5, atol=1e-7) if layer.fgate_type != "none" else dict(rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(local_out, shard_sequence(out, world, rank), **tol, msg=f"{name} output")
        torch.testing.assert_close(local_grads[0], shard_sequence(grads[0], world, rank), **tol, msg=f"{name} dx")
        names = [n for n, _ in layer.named_parameters()]
        for n, a, e in zip(names, local_grads[1:], grads[1:]):
            torch.testing.assert_close(a, e, **tol, msg=f"{name}: d{n}")


@pytest.mark.parametrize("world", [2, 3])
def test_layer_under_context_parallelism_equals_one_process(world):
    run_ranks(__file__, world)


def test_context_parallel_layer_refuses_padding_and_decoding():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a group of this process
    try:
        layer = ForgettingAttentionLayer(16, 2)
        layer.attention_kernel = ContextParallel()
        with pytest.raises(ValueError, match="context-parallel layer"):
            layer(torch.randn(1, 4, 16), seq_start=torch.tensor([1]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # one rank of test_layer_under_context_parallelism_equals_one_process
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        _check(dist.get_world_size(), dist.get_rank())
    finally:
        dist.destroy_process_group()
    sys.exit(0)
