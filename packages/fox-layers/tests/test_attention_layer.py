"""The FoX attention layer gives the same function in every mode: full pass, prefill + decoding,
uneven chunked prefill, left padding, packed varlen. Errors are measured against a float64 run."""

import math
import re

import pytest
import torch

from fox_layers import AttentionState, ForgettingAttentionLayer
from fox_layers.rope import apply_rope

HIDDEN = 48
VARIANTS = {
    "llama": dict(num_heads=4),
    "pro": dict(num_heads=4, qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True, use_v_shift=True),
    "pro_gqa": dict(num_heads=4, num_kv_heads=2, qk_norm=True, use_output_gate=True, use_output_norm=True,
                    use_k_shift=True, use_v_shift=True),
    "pro_rope_nogate": dict(num_heads=4, qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True,
                            use_v_shift=True, fgate_type="none", use_rope=True),
    "bias_only": dict(num_heads=4, fgate_type="bias_only", decay_time_min=2.0, decay_time_max=64.0),
    "fixed": dict(num_heads=4, fgate_type="fixed", decay_time_min=2.0, decay_time_max=64.0, use_k_shift=True),
    "full_bias_init_silu": dict(num_heads=4, fgate_bias_init=True, decay_time_min=2.0, decay_time_max=64.0,
                                use_output_gate=True, ogate_act="silu", use_rope=True),
    "shared_qk_norm": dict(num_heads=4, qk_norm=True, qk_norm_share_param_across_head=True),
    "pro_window": dict(num_heads=4, num_kv_heads=2, qk_norm=True, use_output_gate=True, use_output_norm=True,
                       use_k_shift=True, use_v_shift=True, window_size=6),
    "swa_rope_nogate": dict(num_heads=4, fgate_type="none", use_rope=True, window_size=5),
}


def _layer(variant, seed=0):
    torch.manual_seed(seed)
    layer = ForgettingAttentionLayer(HIDDEN, **VARIANTS[variant])
    layer.reset_fgate_bias()
    with torch.no_grad():  # non-trivial norm weights and gates
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return layer


def _x(B, T, seed=1, dtype=torch.float32):
    return torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _close(actual, exact, tol=1e-4):
    err = (actual.double() - exact.double()).abs().max().item()
    assert err <= tol * max(1.0, exact.abs().max().item()), err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_pass_matches_float64(variant):
    layer = _layer(variant)
    x = _x(2, 37)
    out, _ = layer(x)
    exact, _ = _layer(variant).double()(x.double())
    _close(out, exact)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("chunks", [[23, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [5, 11, 1, 7, 10], [0, 5, 0, 11, 1, 0, 7, 10]],
                         ids=["decode", "uneven", "empty-chunks"])
def test_prefill_and_decoding_match_full_pass(variant, chunks):
    layer = _layer(variant)
    x = _x(2, sum(chunks))
    exact, _ = _layer(variant).double()(x.double())
    state = AttentionState()
    outs, start = [], 0
    for n in chunks:
        out, state = layer(x[:, start : start + n], state=state)
        outs.append(out)
        start += n
    assert state.length == sum(chunks)
    _close(torch.cat(outs, dim=1), exact)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_left_padding_matches_each_row_alone(variant):
    layer = _layer(variant)
    T = 30
    seq_start = torch.tensor([0, 9, 26])
    x = _x(3, T).requires_grad_()
    out, _ = layer(x, seq_start=seq_start)
    out_grad = torch.randn_like(out)
    mask = (torch.arange(T)[None, :] >= seq_start[:, None]).float()[..., None]
    (dx,) = torch.autograd.grad(out, x, out_grad * mask)
    for b, s in enumerate(seq_start.tolist()):
        xb = x.detach()[b : b + 1, s:].clone().requires_grad_()
        alone, _ = layer(xb)
        _close(out[b : b + 1, s:], alone)
        (dxb,) = torch.autograd.grad(alone, xb, out_grad[b : b + 1, s:])
        _close(dx[b : b + 1, s:], dxb)
        if s > 0:
            assert dx[b, :s].abs().max() == 0  # padding does not leak into real tokens
    # Decoding after a left-padded prefill continues each row as if alone.
    state = AttentionState()
    layer(x.detach()[:, : T - 3], seq_start=seq_start, state=state)
    steps = [layer(x.detach()[:, t : t + 1], state=state)[0] for t in range(T - 3, T)]
    _close(torch.cat(steps, dim=1), out.detach()[:, T - 3 :])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("chunks", [[4, 26], [0, 4, 26], [9, 1, 20], [3, 5, 1, 21]])
def test_chunked_prefill_of_left_padded_rows_matches_the_full_pass(variant, chunks):
    """A chunked prefill whose first chunks end inside a row's left padding (9 and 26 tokens of it here):
    those rows are all padding so far, and every chunk's output equals the full pass's."""
    layer = _layer(variant)
    seq_start = torch.tensor([0, 9, 26])
    x = _x(3, sum(chunks))
    full, _ = layer(x, seq_start=seq_start)
    state, outs, start = AttentionState(), [], 0
    for n in chunks:
        outs.append(layer(x[:, start:start + n], seq_start=seq_start, state=state)[0])
        start += n
    _close(torch.cat(outs, dim=1), full)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_varlen_matches_each_sequence_alone(variant):
    layer = _layer(variant)
    lengths = [5, 1, 17, 9]
    cu = torch.tensor([0, 5, 6, 23, 32], dtype=torch.int32)
    x = _x(1, sum(lengths)).requires_grad_()
    out, _ = layer(x, cu_seqlens=cu)
    out_grad = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, out_grad)
    params = dict(layer.named_parameters())
    grads_packed = torch.autograd.grad(layer(x.detach(), cu_seqlens=cu)[0], list(params.values()), out_grad,
                                       allow_unused=True)
    grads_alone = [torch.zeros_like(p) for p in params.values()]
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        xs = x.detach()[:, s:e].clone().requires_grad_()
        alone, _ = layer(xs)
        _close(out[:, s:e], alone)
        (dxs,) = torch.autograd.grad(alone, xs, out_grad[:, s:e], retain_graph=True)
        _close(dx[:, s:e], dxs)
        for acc, g in zip(grads_alone, torch.autograd.grad(alone, list(params.values()), out_grad[:, s:e], allow_unused=True)):
            if g is not None:
                acc += g
    for gp, ga in zip(grads_packed, grads_alone):
        if gp is not None:
            _close(gp, ga, tol=1e-4)


def test_gradients_match_float64():
    layer = _layer("pro_gqa")
    x = _x(2, 21).requires_grad_()
    out, _ = layer(x)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], g)
    layer64 = _layer("pro_gqa").double()
    x64 = x.detach().double().requires_grad_()
    out64, _ = layer64(x64)
    grads64 = torch.autograd.grad(out64, [x64, *layer64.parameters()], g.double())
    for a, e in zip(grads, grads64):
        _close(a, e, tol=2e-4)


@pytest.mark.parametrize("variant", ["pro", "pro_gqa", "llama", "full_bias_init_silu"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_input_projection_matches_separate_linears(variant, bias):
    """The layer projects its input with one matmul against the concatenated weights (zero-padded rows
    to 16 bytes); it must equal the modules applied one by one, outputs and weight gradients alike."""
    torch.manual_seed(3)
    layer = ForgettingAttentionLayer(HIDDEN, attention_bias=bias, **VARIANTS[variant]).double()
    x = _x(2, 19, dtype=torch.float64).requires_grad_()
    q, k, v, lf, ks, vs, g = layer._project(x, with_ogate=True)
    sep_k, sep_ks = layer.k_proj(x) if layer.use_k_shift else (layer.k_proj(x), None)
    sep_v, sep_vs = layer.v_proj(x) if layer.use_v_shift else (layer.v_proj(x), None)
    sep_q = layer.q_proj(x)
    if layer.qk_norm:
        sep_q, sep_k = layer.q_norm(sep_q), layer.k_norm(sep_k)
    sep = [sep_q, sep_k, sep_v, layer.log_fgate(x)]
    if layer.use_rope:
        pos = torch.arange(19).expand(2, 19)
        rope = lambda t, h: apply_rope(t.view(2, 19, h, -1), pos, layer.rope_base)
        sep[0], sep[1] = rope(sep[0], layer.num_heads), rope(sep[1], layer.num_kv_heads)
    fused = [q, k, v, lf]
    if layer.use_output_gate:
        fused.append(g)
        sep.append(layer.ogate_proj(x))
    else:
        assert g is None
    for a, e in zip(fused, sep):
        torch.testing.assert_close(a.reshape(e.shape), e, rtol=1e-12, atol=1e-12)
    for a, e in ((ks, sep_ks), (vs, sep_vs)):
        assert (a is None) == (e is None)
        if a is not None:
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    w = [torch.randn_like(t) for t in fused]
    params = [p for p in layer.parameters() if p.requires_grad]
    got = torch.autograd.grad(sum((a.reshape(b.shape) * b).sum() for a, b in zip(fused, w)), [x, *params], allow_unused=True)
    ref = torch.autograd.grad(sum((a.reshape(b.shape) * b).sum() for a, b in zip(sep, w)), [x, *params], allow_unused=True)
    for (name, _), a, e in zip([("x", None), *layer.named_parameters()], got, ref):
        assert (a is None) == (e is None), name
        if a is not None:
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("grad", [False, True])
def test_compiled_layer_matches_eager_with_and_without_grad(grad):
    """Compiled without gradients the layer projects with one matmul per module (inductor on torch 2.11
    could not generate the fused form's inference graph); both forms give the eager layer's output."""
    layer = _layer("pro")
    x = _x(2, 29)
    with torch.no_grad():
        exact, _ = layer(x)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.set_grad_enabled(grad):
        out, _ = compiled(x)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-6)


def _saved_bytes(fn):
    """Bytes autograd keeps for the backward while fn runs (distinct storages)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("variant", ["pro", "pro_gqa", "pro_rope_nogate", "llama"])
def test_projection_recompute_same_gradients_less_memory(variant):
    """recompute_projections: the same output and gradients (float64, varlen too), and the layer keeps
    less for the backward: at least the pre-norm q and k, the pre-shift k and v and the gate logits."""
    B, T = 2, 29
    layer = _layer(variant).double()
    x = _x(B, T, dtype=torch.float64).requires_grad_()
    cot = torch.randn(B, T, HIDDEN, dtype=torch.float64)
    results = {}
    for recompute in (False, True):
        layer.recompute_projections = recompute
        out, saved = _saved_bytes(lambda: layer(x)[0])
        grads = torch.autograd.grad(out, [x, *layer.parameters()], cot)
        results[recompute] = (out, grads, saved)
    (out0, grads0, saved0), (out1, grads1, saved1) = results[False], results[True]
    torch.testing.assert_close(out1, out0, rtol=0, atol=1e-12)
    for a, b in zip(grads1, grads0):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    hidden_tensor = B * T * HIDDEN * 8
    fewer = 5 if variant.startswith("pro") else 1  # llama: the o_proj input is no longer kept (the output is)
    # the checkpoint keeps the layer's input itself (not seen by the hook): count it
    assert saved1 + hidden_tensor <= saved0 - fewer * hidden_tensor, (saved0, saved1)
    # packed sequences through the recomputed path
    cu = torch.tensor([0, 11, 12, 29], dtype=torch.int32)
    xp = x.detach()[:1].clone().requires_grad_()
    outs = {}
    for recompute in (False, True):
        layer.recompute_projections = recompute
        out = layer(xp, cu_seqlens=cu)[0]
        outs[recompute] = (out, torch.autograd.grad(out, [xp, *layer.parameters()], cot[:1]))
    for a, b in zip([outs[True][0], *outs[True][1]], [outs[False][0], *outs[False][1]]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_shared_qk_norm_accepts_head_dim_weights():
    layer = _layer("shared_qk_norm")
    sd = layer.state_dict()
    assert sd["q_norm.weight"].shape == (HIDDEN // 4,) and sd["k_norm.weight"].shape == (HIDDEN // 4,)
    sd["q_norm.weight"] = torch.linspace(0.5, 1.5, HIDDEN // 4)
    layer.load_state_dict(sd)
    per_head = ForgettingAttentionLayer(HIDDEN, num_heads=4, qk_norm=True)
    with pytest.raises(RuntimeError, match="q_norm.weight"):
        per_head.load_state_dict(sd)
    # The shared weight acts on every head like a per-head weight repeated across heads.
    sd_full = dict(sd)
    sd_full["q_norm.weight"] = sd["q_norm.weight"].repeat(4)
    sd_full["k_norm.weight"] = sd["k_norm.weight"].repeat(4)
    per_head.load_state_dict(sd_full)
    x = _x(1, 12)
    _close(per_head(x)[0], layer(x)[0], tol=1e-6)


def test_pruning_from_qk_norm_weights_stays_close():
    torch.manual_seed(0)
    kw = dict(VARIANTS["pro"], fgate_bias_init=True, decay_time_min=1.0, decay_time_max=4.0)
    exact = ForgettingAttentionLayer(HIDDEN, **kw)
    exact.reset_fgate_bias()
    pruned = ForgettingAttentionLayer(HIDDEN, **kw, log_pruning_tolerance=-10.0)
    pruned.load_state_dict(exact.state_dict())
    thr = pruned.pruning_threshold(200)
    assert thr.shape == (1, 4) and (thr < 0).all()
    x = _x(1, 200)
    _close(pruned(x)[0], exact(x)[0], tol=1e-3)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["no-qk-norm", "qk-norm"])
@pytest.mark.parametrize("log_tolerance", [-10.0, -0.5])
def test_any_pruning_tolerance_prunes_with_or_without_qk_norm(monkeypatch, qk_norm, log_tolerance):
    """The layer prunes by the bound of its own log_pruning_tolerance, with or without QK-norm: its attention
    output equals the float64 computation pruned by that bound (from the q/k norms, or from the QK-norm
    weights), a loose tolerance really drops weight and -10 stays within its eps."""
    from fox_kernel import forgetting_attention, pruning

    torch.manual_seed(0)
    layer = ForgettingAttentionLayer(HIDDEN, 4, qk_norm=qk_norm, fgate_bias_init=True, decay_time_min=0.5,
                                     decay_time_max=2.0, log_pruning_tolerance=log_tolerance)
    layer.reset_fgate_bias()
    with torch.no_grad():  # small logits: the bound is tight, so a loose tolerance drops visible weight
        for name, p in layer.named_parameters():
            if name in ("q_norm.weight", "k_norm.weight", "q_proj.weight", "k_proj.weight"):
                p.mul_(0.2)
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return forgetting_attention(*args, **kwargs)

    monkeypatch.setattr(layer, "attention_kernel", spy)  # the layer's one replaceable kernel call
    with torch.no_grad():
        layer(_x(1, 200))
    (q, k, v, lf), kwargs = calls[0]
    # the layer promises the kernel no gate of exactly 0: its log gates are logsigmoid of finite logits
    assert kwargs["zero_gates"] is False and torch.isfinite(lf).all()
    T, D = q.shape[1], layer.head_dim
    q64, k64, v64 = q.double(), k.double(), v.double()
    if qk_norm:
        wq, wk = layer.q_norm.max_abs_weight().double(), layer.k_norm.max_abs_weight().double()
        delta = pruning.threshold_from_qk_norm(wq, wk, D, T, log_tolerance)
        assert isinstance(kwargs["adaptive_threshold"], torch.Tensor)
    else:
        delta = pruning.pruning_threshold(q64, k64, D**-0.5, T, log_tolerance)
        assert kwargs["adaptive_threshold"] == pruning.AutoThreshold(log_tolerance)
    with torch.no_grad():
        pruned = forgetting_attention(q, k, v, lf, adaptive_threshold=kwargs["adaptive_threshold"])
        exact = forgetting_attention(q64, k64, v64, lf, adaptive_threshold=delta)
        unpruned = forgetting_attention(q64, k64, v64, lf)
    _close(pruned, exact, tol=1e-5)
    change = (exact - unpruned).abs().max().item()
    if log_tolerance == -10.0:
        assert change <= 2 * math.exp(-10.0) * v.abs().max().item() + 1e-9
    else:
        assert change > 1e-3


def test_pruning_tolerance_is_checked():
    with pytest.raises(ValueError, match="log_pruning_tolerance"):
        ForgettingAttentionLayer(HIDDEN, 4, log_pruning_tolerance=0.0)


def test_fixed_gate_decay_times():
    layer = _layer("fixed")
    lf = layer.log_fgate(_x(1, 3))
    expected = -1.0 / torch.exp(torch.linspace(torch.log(torch.tensor(2.0)), torch.log(torch.tensor(64.0)), 4))
    torch.testing.assert_close(lf[0, 0], expected, rtol=1e-5, atol=1e-6)
    assert "fgate_bias" in dict(layer.named_buffers()) and "fgate_bias" not in dict(layer.named_parameters())


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="fgate_type must be one of"):
        ForgettingAttentionLayer(32, 4, fgate_type="sometimes")
    with pytest.raises(ValueError, match="num_heads 4 must be a multiple of num_kv_heads 3"):
        ForgettingAttentionLayer(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="needs decay_time_min and decay_time_max"):
        ForgettingAttentionLayer(32, 4, fgate_type="fixed")


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=0), "num_heads must be an int >= 1, got 0"),  # was a ZeroDivisionError
    (dict(hidden_size=0), "hidden_size must be an int >= 1, got 0"),  # built a layer of width 0
    (dict(hidden_size=-8), "hidden_size must be an int >= 1, got -8"),  # "negative dimension -8" from nn.Linear
    (dict(num_kv_heads=0.5), "num_kv_heads must be an int >= 1 or None, got 0.5"),
    (dict(fgate_bias_init=True, decay_time_min=10.0, decay_time_max=2.0),
     "decay_time_min must be <= decay_time_max 2.0, got 10.0"),  # built with the decay times reversed
    (dict(fgate_bias_init=True, decay_time_min=-1.0, decay_time_max=2.0),
     "decay_time_min must be a finite number > 0 or None, got -1.0"),  # "math domain error"
    (dict(use_rope=True, rope_base=-1.0), "rope_base must be a finite number > 0, got -1.0"),  # built
    (dict(use_output_norm=True, norm_eps=-1.0), "norm_eps must be a finite number > 0, got -1.0"),  # built
    # built, then failed at the first forward (RoPE's pairs; the kernel's head dims)
    (dict(hidden_size=12, use_rope=True), "hidden_size / num_heads (the head dim) must be even with RoPE, got 12 / 4 = 3"),
    (dict(hidden_size=1200), "hidden_size / num_heads (the head dim) must be at most 256, got 1200 / 4 = 300"),
])
def test_sizes_times_bases_and_epsilons_out_of_range_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ForgettingAttentionLayer(**{"hidden_size": 32, "num_heads": 4, **kwargs})


@pytest.mark.parametrize("variant", ["llama", "pro_rope_nogate"])
def test_bad_starts_and_packed_bounds_are_named_before_rope_and_shifts_read_them(variant):
    """RoPE positions and the token shift read cu_seqlens and seq_start before the kernel checked them: a
    size mismatch or a negative repeat deep in torch, or a list's missing attribute."""
    layer = _layer(variant)
    x = _x(1, 7)
    for cu, message in ((torch.tensor([0, 5, 9], dtype=torch.int32), "cu_seqlens must start at 0 and end at the packed "
                         "length 7, got 0..9"),
                        (torch.tensor([0, 5, 3, 7], dtype=torch.int32), "cu_seqlens must be strictly increasing, got "
                         "[0, 5, 3, 7]")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            layer(x, cu_seqlens=cu)
    with pytest.raises(TypeError, match=r"^seq_start must be a torch.Tensor, got list$"):
        layer(_x(2, 7), seq_start=[1, 0])
    with pytest.raises(ValueError, match=r"^seq_start must be >= 0, got values in \[-1, 0\]$"):
        layer(_x(2, 7), seq_start=torch.tensor([-1, 0]))


@pytest.mark.parametrize("variant", ["llama", "pro"])
def test_decoding_another_batch_than_the_state_holds_is_named(variant):
    """With a token shift the mismatch surfaced as a torch.cat size error; without one it named the cache."""
    layer, state = _layer(variant), AttentionState()
    layer(_x(2, 7), state=state)
    with pytest.raises(ValueError, match=r"^hidden_states has 3 rows but the state holds 2 \(one per sequence"):
        layer(_x(3, 1), state=state)


def test_hidden_states_of_another_width_are_named():
    """A tensor concatenation deep in the projections reported the mismatch without naming the input."""
    layer = ForgettingAttentionLayer(32, 4)
    for x in (torch.randn(1, 5, 16), torch.randn(5, 32)):
        with pytest.raises(ValueError, match=re.escape(f"hidden_states must be (B, T, hidden_size=32), got {tuple(x.shape)}")):
            layer(x)


@pytest.mark.parametrize("variant", ["llama", "pro"])
def test_a_state_of_another_type_or_layer_is_named(variant):
    """Another object failed on a missing ``length``; a state filled by a layer of other kv heads in a
    concatenation of the token shift or the cache."""
    layer, state = _layer(variant), AttentionState()
    with pytest.raises(TypeError, match=r"^state must be an AttentionState or None, got dict$"):
        layer(_x(2, 7), state={})
    ForgettingAttentionLayer(HIDDEN, **{**VARIANTS[variant], "num_kv_heads": 2})(_x(2, 7), state=state)
    with pytest.raises(ValueError, match=r"^state holds keys of \(num_kv_heads, head_dim\) = \(2, 12\), this "
                                         r"layer's are \(4, 12\)$"):
        layer(_x(2, 1), state=state)


def test_rope_and_decay_time_arguments_are_named():
    """RoPE of a 3-D x gave a 4-D result without a word; an odd D or 1-D positions failed in a broadcast;
    a time <= 0 was a "math domain error"."""
    from fox_layers import decay_time_bias

    pos = torch.arange(5).expand(2, 5)
    for x in (torch.randn(2, 5, 8), torch.randn(2, 5, 3, 7)):
        with pytest.raises(ValueError, match=re.escape(f"x must be (B, T, H, D) with D even (pairs are rotated), got "
                                                       f"{tuple(x.shape)}")):
            apply_rope(x, pos, 10000.0)
    with pytest.raises(ValueError, match=re.escape("positions must be (B, T) = (2, 5) for x (2, 5, 3, 8), got (5,)")):
        apply_rope(torch.randn(2, 5, 3, 8), torch.arange(5), 10000.0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)  # (1, T) positions: the same rotation for every row
    torch.testing.assert_close(apply_rope(x, pos[:1], 10000.0), apply_rope(x, pos, 10000.0), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^base must be a finite number > 0, got 0.0$"):
        apply_rope(x, pos, 0.0)
    with pytest.raises(ValueError, match=r"^t_min must be a finite number > 0, got -1.0$"):
        decay_time_bias(4, -1.0, 2.0)
    with pytest.raises(ValueError, match=r"^num_heads must be an int >= 1, got 0$"):
        decay_time_bias(0, 1.0, 2.0)


@pytest.mark.parametrize("variant", ["llama", "pro"])
def test_an_empty_sequence_gives_an_empty_output(variant):
    """T = 0 (the token shift's reshape and the norm's failed on zero tokens): an empty output, as the
    float64 run of the same layer gives."""
    out, _ = _layer(variant)(_x(2, 0))
    exact, _ = _layer(variant).double()(_x(2, 0).double())
    assert out.shape == exact.shape == (2, 0, HIDDEN)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["llama", "pro", "pro_gqa", "pro_rope_nogate"])
@pytest.mark.parametrize("mode", ["fp32", "bf16-autocast"])
def test_gpu_fp32_and_bf16_autocast(variant, mode):
    """On the GPU (Triton attention, fused shift and norm + gate): full pass and prefill + decoding vs float64."""
    layer = _layer(variant).cuda()
    x = _x(2, 300).cuda()
    exact, _ = _layer(variant).double()(x.double().cpu())
    tol = 1e-4 if mode == "fp32" else 3e-2
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if mode != "fp32" else torch.autocast("cuda", enabled=False)
    with ctx:
        full, _ = layer(x)
        state = AttentionState()
        parts = [layer(x[:, :290], state=state)[0]] + [layer(x[:, t : t + 1], state=state)[0] for t in range(290, 300)]
    _close(full.float().cpu(), exact, tol)
    _close(torch.cat(parts, dim=1).float().cpu(), exact, tol)
    g = torch.randn_like(full)
    with ctx:
        xg = x.clone().requires_grad_()
        out, _ = layer(xg)
    (dx,) = torch.autograd.grad(out, xg, g)
    x64 = x.double().cpu().requires_grad_()
    out64, _ = _layer(variant).double()(x64)
    (dx64,) = torch.autograd.grad(out64, x64, g.double().cpu())
    _close(dx.float().cpu(), dx64, tol * 3)


@pytest.mark.parametrize("variant", ["pro_window", "swa_rope_nogate"])
def test_window_matches_the_explicit_attention_weights(variant):
    """The windowed kernel path against the layer's materialised softmax (``output_attentions``), whose
    weights must vanish outside the band i - W < j <= i and sum to 1 inside it."""
    layer = _layer(variant)
    x = _x(2, 29)
    out, _ = layer(x)
    explicit, _, weights = layer(x, output_attentions=True)
    _close(out, explicit)
    W = layer.window_size
    i = torch.arange(29)[:, None]
    j = torch.arange(29)[None, :]
    assert weights[..., ~((j <= i) & (j > i - W))].abs().max() == 0
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
    wide = _layer(variant)
    wide.window_size = None
    assert (wide(x)[0] - out).abs().max() > 1e-3  # the window changes the function


@pytest.mark.parametrize("variant", ["pro_window", "swa_rope_nogate"])
@pytest.mark.parametrize("explicit", [False, True], ids=["kernel", "output_attentions"])
def test_window_state_keeps_only_the_window(variant, explicit):
    """A windowed layer's decoding state holds the last W tokens whatever the length (memory O(W)), counts
    the dropped ones (RoPE positions, left padding) and still gives the full pass's outputs, left padding
    longer than the window included; it cannot be rolled back once it dropped tokens."""
    layer = _layer(variant)
    W, T = layer.window_size, 31
    seq_start = torch.tensor([0, 12])
    x = _x(2, T)
    exact, _ = _layer(variant).double()(x.double(), seq_start=seq_start)
    state, outs, start = AttentionState(), [], 0
    for n in [14, 1, 1, 3, 1, 1, 1, 1, 1, 7]:
        out = layer(x[:, start : start + n], seq_start=seq_start, state=state, output_attentions=explicit)
        if explicit:
            assert out[2].shape[-1] == min(start, W) + n  # the weights cover the held keys only
        outs.append(out[0])
        start += n
        assert state.held == min(start, W) and state.length == start and state.dropped == start - state.held
    valid = torch.arange(T)[None, :] >= seq_start[:, None]
    _close(torch.cat(outs, dim=1) * valid[..., None], exact * valid[..., None])
    with pytest.raises(ValueError, match="dropped its first"):
        state.truncate(T - 2)


def test_window_state_recording_its_past_keeps_every_token():
    """While recording its past (assisted decoding may roll back), a windowed state drops nothing."""
    layer = _layer("pro_window")
    state = AttentionState(record_past=True)
    layer(_x(1, 20), state=state)
    layer(_x(1, 1, seed=2), state=state)
    assert state.held == 21 and state.dropped == 0 and state.can_truncate
    state.truncate(15)
    assert state.length == 15


def test_set_attention_kernel_replaces_and_restores_every_layer():
    from fox_kernel import forgetting_attention
    from fox_layers import set_attention_kernel

    torch.manual_seed(0)
    model = torch.nn.ModuleList([_layer("pro", seed=1), _layer("llama", seed=2)])

    def run(x):
        return model[1](model[0](x)[0])[0]

    x = _x(2, 37)
    with torch.no_grad():
        want = run(x)
    calls = []

    def spy(q, k, v, log_fgate, **kwargs):
        calls.append(q.shape)
        return forgetting_attention(q, k, v, log_fgate, **kwargs)

    assert set_attention_kernel(model, spy) == 2
    with torch.no_grad():
        got = run(x)
    assert len(calls) == 2 and calls[0][:2] == (2, 37)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert set_attention_kernel(model, None) == 2
    with torch.no_grad():
        run(x)
    assert len(calls) == 2  # the class's kernel again: the spy is gone
