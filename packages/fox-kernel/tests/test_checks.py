"""Bad input raises at the call, naming the argument, the expected and the actual value."""

import pytest
import torch

from fox_kernel import forgetting_attention


def _ok(B=2, T=8, H=4, Hkv=2, D=16):
    return (torch.randn(B, T, H, D), torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D),
            torch.nn.functional.logsigmoid(torch.randn(B, T, H)))


def test_valid_call_works():
    assert forgetting_attention(*_ok()).shape == (2, 8, 4, 16)


@pytest.mark.parametrize(
    "mutate, kwargs, error, pattern",
    [
        (lambda a: (a[0][0], *a[1:]), {}, ValueError, r"q must have 4 dimensions .*got shape \(8, 4, 16\)"),
        (lambda a: (a[0], a[1][:1], a[2], a[3]), {}, ValueError, r"k must have batch size \(q's\) 2, got 1"),
        (lambda a: (a[0], a[1][..., :8], a[2], a[3]), {}, ValueError, r"k must have head dim \(q's\) 16, got 8"),
        (lambda a: (a[0], torch.randn(2, 8, 3, 16), torch.randn(2, 8, 3, 16), a[3]), {}, ValueError, r"multiple of k/v's heads, got Hkv=3"),
        (lambda a: (a[0], a[1], a[2][:, :5], a[3]), {}, ValueError, r"v must have length \(k's\) 8, got 5"),
        (lambda a: (a[0], a[1][:, :5], a[2][:, :5], a[3][:, :5]), {}, ValueError, r"Tq=8 > Tk=5"),
        (lambda a: (*a[:3], a[3].double()), {}, TypeError, r"log_fgate must be float32, got torch.float64"),
        (lambda a: (*a[:3], a[3].bfloat16()), {}, TypeError, r"log_fgate must be float32, got torch.bfloat16"),
        (lambda a: (a[0], a[1].half(), *a[2:]), {}, TypeError, r"k must have q's dtype torch.float32, got torch.float16"),
        (lambda a: (a[0].int(), *a[1:]), {}, TypeError, r"q must be one of .* got int32"),
        (lambda a: (*a[:3], a[3][..., :2]), {}, ValueError, r"log_fgate must have shape \(2, 8, 4\)"),
        (lambda a: tuple(torch.randn(*x.shape[:3], 300) for x in a[:3]) + (a[3],), {}, ValueError, r"head dim must be in \[1, 256\], got 300"),
        (lambda a: ("q", *a[1:]), {}, TypeError, r"q must be a torch.Tensor, got str"),
        (lambda a: a, {"seq_start": torch.tensor([0, 9])}, ValueError, r"seq_start must lie in \[0, 8\].*\[0, 9\]"),
        (lambda a: a, {"seq_start": torch.tensor([-1, 0])}, ValueError, r"seq_start must lie in \[0, 8\]"),
        (lambda a: a, {"seq_start": torch.tensor([0.0, 1.0])}, TypeError, r"seq_start must hold integers, got torch.float32"),
        (lambda a: a, {"seq_start": torch.tensor([0, 1, 2])}, ValueError, r"seq_start must have shape \(2,\), got \(3,\)"),
        (lambda a: a, {"cu_seqlens": torch.tensor([0, 8], dtype=torch.int32)}, ValueError, r"batch size must be 1 .* got 2"),
        (lambda a: a, {"adaptive_threshold": "sometimes"}, ValueError, r"adaptive_threshold must be None"),
        (lambda a: a, {"adaptive_threshold": torch.zeros(3, 4)}, ValueError, r"adaptive_threshold must broadcast to \(2, 4\)"),
        *[(lambda a: a, {"adaptive_threshold": bad}, ValueError,
           rf"adaptive_threshold must be a finite negative number .*got {pattern}$")
          for bad, pattern in ((float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf"), (0.0, "0.0"),
                               (0, "0.0"), (2.5, "2.5"), (True, "1.0"), (torch.tensor([-1.0, 0.5, -2.0, -3.0]), "0.5"),
                               (torch.tensor(float("nan")), "nan"), (torch.full((2, 1), -float("inf")), "-inf"))],
        (lambda a: a, {"adaptive_threshold": torch.ones(2, 4, dtype=torch.bool)}, TypeError,
         r"adaptive_threshold must hold real numbers, got torch.bool"),
        (lambda a: a, {"seq_start": [0, 1]}, TypeError, r"^seq_start must be a torch.Tensor, got list$"),
        (lambda a: a, {"cu_seqlens": [0, 8]}, TypeError, r"^cu_seqlens must be a torch.Tensor, got list$"),
        (lambda a: a, {"options": "fast"}, TypeError, r"^options must be None or a fox_kernel.KernelOptions, got str$"),
        (lambda a: a, {"head_first": "yes"}, TypeError, r"^head_first must be True or False, got 'yes'$"),
        # head-first tensors with the gates left (B, T, H): the message speaks the caller's layout
        (lambda a: (*(x.transpose(1, 2) for x in a[:3]), a[3]), {"head_first": True}, ValueError,
         r"^log_fgate must have shape \(2, 4, 8\) \(B, H, Tk\), got \(2, 8, 4\)$"),
    ],
)
def test_bad_input(mutate, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        forgetting_attention(*mutate(_ok()), **kwargs)


def test_numpy_scalars_are_numbers():
    """A NumPy float32 scale or threshold is a number like a Python float (it was refused as no tensor)."""
    np = pytest.importorskip("numpy")
    args = _ok()
    want = forgetting_attention(*args, adaptive_threshold=-30.0, sm_scale=0.25)
    torch.testing.assert_close(forgetting_attention(*args, adaptive_threshold=np.float32(-30), sm_scale=np.float32(0.25)),
                               want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^adaptive_threshold must be a finite negative number .*got 0.5$"):
        forgetting_attention(*args, adaptive_threshold=np.float32(0.5))


def test_pruning_threshold_names_its_bad_arguments():
    """The public bound checks what the kernels' calls have checked before they reach it: a tolerance of 0
    or more (which ``AutoThreshold`` refuses), packed bounds past q's length (which returned fewer rows),
    head counts that do not divide (a broadcast error deep in torch), a zero key length."""
    from fox_kernel import pruning_threshold

    q, k, _, _ = _ok(B=1, T=17)
    rows = torch.tensor([0, 5, 17], dtype=torch.int32)
    assert pruning_threshold(q, k, 0.25, 17, -10.0, rows=rows).shape == (2, 4)
    for args, kwargs, error, message in (
        ((q, k, 0.25, 17, 0.0), {}, ValueError, r"^log_pruning_tolerance must be a finite negative number .*got 0.0$"),
        ((q, k, 0.25, 17, 5), {}, ValueError, r"^log_pruning_tolerance must be a finite negative number .*got 5$"),
        ((q, k, 0.25, 17), {"rows": torch.tensor([0, 5, 99], dtype=torch.int32)}, ValueError,
         r"^cu_seqlens must start at 0 and end at the packed length 17, got 0..99$"),
        ((q, k[:, :, :1].expand(1, 17, 3, 16), 0.25, 17), {}, ValueError,
         r"^q's 4 heads must be a multiple of k's heads, got Hkv=3$"),
        ((q[0], k, 0.25, 17), {}, ValueError, r"^q must have 4 dimensions \(B, T, H, D\), got shape \(17, 4, 16\)$"),
        ((q.int(), k, 0.25, 17), {}, TypeError, r"^q must be one of "),
        ((q, k, 0.25, 0), {}, ValueError, r"^t_k must be an int >= 1 \(the key length\), got 0$"),
        ((q, k, -1.0, 17), {}, ValueError, r"^sm_scale must be None or a finite positive number, got -1.0$"),
    ):
        with pytest.raises(error, match=message):
            pruning_threshold(*args, **kwargs)


@pytest.mark.parametrize(
    "cu, pattern",
    [
        (torch.tensor([0, 3, 8], dtype=torch.int64), r"cu_seqlens must be int32, got torch.int64"),
        (torch.tensor([0, 5, 3, 8], dtype=torch.int32), r"cu_seqlens must be strictly increasing"),
        (torch.tensor([0, 3, 7], dtype=torch.int32), r"end at the packed length 8, got 0..7"),
        (torch.tensor([[0, 8]], dtype=torch.int32), r"cu_seqlens must be 1-D"),
    ],
)
def test_bad_cu_seqlens(cu, pattern):
    q, k, v, g = _ok(B=1)
    with pytest.raises((ValueError, TypeError), match=pattern):
        forgetting_attention(q, k, v, g, cu_seqlens=cu)


def test_cu_seqlens_with_seq_start_is_refused():
    q, k, v, g = _ok(B=1)
    with pytest.raises(ValueError, match="seq_start and cu_seqlens cannot be combined"):
        forgetting_attention(q, k, v, g, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), seq_start=torch.tensor([0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_tensors_on_different_devices():
    q, k, v, g = _ok()
    with pytest.raises(ValueError, match=r"k must be on cuda:0 like q, got cpu"):
        forgetting_attention(q.cuda(), k, v.cuda(), g.cuda())
    with pytest.raises(TypeError, match=r"q must be one of float16, bfloat16, float32 on cuda, got float64"):
        forgetting_attention(*(x.cuda().double() for x in (q, k, v)), g.cuda())


def test_valid_thresholds_work():
    q, k, v, g = _ok()
    for threshold in (-1e-6, -4, torch.tensor([-1.0, -2.0, -3.0, -4.0]), torch.full((2, 1), -0.5), "auto"):
        assert forgetting_attention(q, k, v, g, adaptive_threshold=threshold).shape == q.shape


def _cache(B=2, T=12, H=4, Hkv=2, D=16):
    from fox_kernel import append_to_cache

    k, v = torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    _, _, c = append_to_cache(None, None, None, k, v, torch.nn.functional.logsigmoid(torch.randn(B, T, H)))
    return torch.randn(B, 3, H, D), k, v, c


def _lens(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "mutate, kwargs, error, pattern",
    [
        # a cache of batch 1 was broadcast against queries of batch 2 (row 0's keys reused)
        (lambda q, k, v, c: (q, k[:1], v[:1], c[:1]), {}, ValueError, r"k_cache must have batch size \(q's\) 2, got 1"),
        (lambda q, k, v, c: (q, k, v[:, :5], c), {}, ValueError, r"v_cache must have k_cache's shape \(2, 12, 2, 16\)"),
        (lambda q, k, v, c: (q, k[..., :8], v[..., :8], c), {}, ValueError, r"k_cache must have head dim \(q's\) 16, got 8"),
        (lambda q, k, v, c: (q[0], k, v, c), {}, ValueError, r"q must have 4 dimensions .*got shape \(3, 4, 16\)"),
        (lambda q, k, v, c: (q, k[0], v[0], c), {}, ValueError, r"k_cache must have 4 dimensions"),
        (lambda q, k, v, c: (q, k, v, c[:1]), {}, ValueError, r"c_cache must be float32 of shape \(2, 12, 4\)"),
        (lambda *a: a, {"cache_seqlens": _lens(0, 12)}, ValueError, r"cache_seqlens must lie in \[3, 12\] .*got values in \[0, 12\]"),
        (lambda *a: a, {"cache_seqlens": _lens(-4, 5)}, ValueError, r"cache_seqlens must lie in \[3, 12\] .*\[-4, 5\]"),
        (lambda *a: a, {"cache_seqlens": _lens(12, 13)}, ValueError, r"cache_seqlens must lie in \[3, 12\] .*\[12, 13\]"),
        (lambda *a: a, {"cache_seqlens": _lens(2, 12)}, ValueError, r"cache_seqlens must lie in \[3, 12\]"),
        (lambda *a: a, {"cache_seqlens": torch.tensor([5, 12])}, ValueError, r"cache_seqlens must be int32"),
        (lambda *a: a, {"seq_start": torch.tensor([0, -1])}, ValueError, r"seq_start must be >= 0, got values in \[-1, 0\]"),
        (lambda *a: a, {"seq_start": torch.tensor([0.0, 1.0])}, TypeError, r"seq_start must hold integers"),
        (lambda *a: a, {"seq_start": torch.tensor([0, 1, 2])}, ValueError, r"seq_start must have shape \(2,\), got \(3,\)"),
        (lambda *a: a, {"adaptive_threshold": 0.0}, ValueError, r"adaptive_threshold must be a finite negative number .*got 0.0"),
        (lambda *a: a, {"adaptive_threshold": float("nan")}, ValueError, r"adaptive_threshold must be a finite .*got nan"),
        (lambda *a: a, {"adaptive_threshold": torch.tensor([[-1.0], [3.0]])}, ValueError, r"got 3.0"),
    ],
)
def test_bad_decode_input(mutate, kwargs, error, pattern):
    from fox_kernel import forgetting_attention_with_kvcache

    with pytest.raises(error, match=pattern):
        forgetting_attention_with_kvcache(*mutate(*_cache()), **kwargs)


def test_decode_rows_longer_than_the_padding_so_far_are_fine():
    """seq_start past the cached length (a chunked prefill of left-padded prompts): that row returns 0."""
    from fox_kernel import forgetting_attention_with_kvcache

    q, k, v, c = _cache()
    out = forgetting_attention_with_kvcache(q, k, v, c, _lens(12, 5), seq_start=torch.tensor([0, 30]),
                                            adaptive_threshold=-8.0)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0


def test_forgetting_attention_refuses_positive_log_gates_and_bad_scales():
    """A positive log gate (a forget gate above 1) and a scale that is not a finite positive number are
    refused at the call on CPU tensors, naming the argument; gates of 0 and below pass."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 7, 2, 8, generator=g)
    lf = -torch.rand(1, 7, 2, generator=g)
    forgetting_attention(q, q, q, lf)
    bad = lf.clone()
    bad[0, 3, 1] = 0.25
    with pytest.raises(ValueError, match=r"log_fgate must be <= 0 .* at \(b, t, h\) = \(0, 3, 1\)"):
        forgetting_attention(q, q, q, bad)
    for scale in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match="sm_scale must be None or a finite positive number"):
            forgetting_attention(q, q, q, lf, sm_scale=scale)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone, for the context-parallel call."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_context_parallel_call_checks_as_forgetting_attention_does(one_rank_group):
    """A positive log gate (which the Triton kernels would turn into NaN or wrong rows on a device), options
    that are no KernelOptions and tensors on another device: one line naming the argument, as
    forgetting_attention's; a valid call equals the plain reference."""
    from fox_kernel import KernelOptions, context_parallel_forgetting_attention
    from fox_kernel.reference import forgetting_attention_ref

    q, k, v, g = _ok()
    torch.testing.assert_close(context_parallel_forgetting_attention(q, k, v, g),
                               forgetting_attention_ref(*(x.double() for x in (q, k, v, g))).float(),
                               rtol=1e-5, atol=1e-5)
    bad = g.clone()
    bad[1, 5, 2] = 0.5
    with pytest.raises(ValueError, match=r"^log_fgate must be <= 0 .* got 0.5 at \(b, t, h\) = \(1, 5, 2\)$"):
        context_parallel_forgetting_attention(q, k, v, bad)
    with pytest.raises(TypeError, match=r"^options must be None or a fox_kernel.KernelOptions, got str$"):
        context_parallel_forgetting_attention(q, k, v, g, options="fast")
    with pytest.raises(ValueError, match=r"^k must be on cpu like q, got meta$"):
        context_parallel_forgetting_attention(q, k.to("meta"), v, g)
    context_parallel_forgetting_attention(q, k, v, g, options=KernelOptions())
    for groups in (0, 3, 2.0, True):  # k has 2 heads: 3 does not divide them
        with pytest.raises(ValueError, match=rf"^head_groups must be a positive divisor of k/v's 2 heads, got {groups!r}$"):
            context_parallel_forgetting_attention(q, k, v, g, head_groups=groups)
