"""The recurrent baselines (Mamba-2, HGRN2, DeltaNet): published layout, the right function, generation."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import fox_models
from fox_models.recurrent_ops import delta_rule_recurrence, gla_recurrence

V, D, L = 61, 32, 2


def _released_config(kind):
    """config.json as the reference release writes it (its field names; no fields of ours)."""
    if kind == "mamba2":
        return dict(model_type="mamba2-project_fox", architectures=["Mamba2ForCausalLM"], num_heads=4, head_dim=16,
                    vocab_size=V, hidden_size=D, state_size=8, num_hidden_layers=L, layer_norm_epsilon=1e-5,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, expand=2, conv_kernel=4, n_groups=2,
                    use_bias=False, use_conv_bias=True, hidden_act="silu", initializer_range=0.1,
                    residual_in_fp32=True, time_step_rank=2, time_step_min=0.001, time_step_max=0.1,
                    time_step_floor=1e-4, time_step_limit=[0.0, float("inf")], rescale_prenorm_residual=True,
                    use_cache=True, rms_norm=True, chunk_size=256, fuse_cross_entropy=True, tie_word_embeddings=False)
    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, hidden_ratio=4, intermediate_size=None,
                  hidden_act="swish", max_position_embeddings=2048, norm_eps=1e-6, use_cache=True,
                  pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  initializer_range=0.02, fuse_cross_entropy=True, attn_mode="chunk")
    if kind == "hgrn2":
        return dict(common, model_type="hgrn2-project_fox", architectures=["HGRN2ForCausalLM"], num_heads=2,
                    expand_ratio=16, use_short_conv=False, conv_size=4, use_lower_bound=True, elementwise_affine=True)
    return dict(common, model_type="delta_net-project_fox", architectures=["DeltaNetForCausalLM"], expand_k=1,
                expand_v=1, use_gate=False, use_short_conv=True, conv_size=4, use_beta=True, use_output_norm=True,
                num_heads=2, qk_norm="l2", qk_activation="silu", norm_first=False)


def _mamba2_state_dict(r):
    sd = {"backbone.embeddings.weight": r(V, D), "backbone.norm_f.weight": 1 + r(D), "lm_head.weight": r(V, D)}
    for i in range(L):
        p = f"backbone.layers.{i}."
        sd[p + "norm.weight"] = 1 + r(D)
        m = p + "mixer."
        sd[m + "in_proj.weight"] = r(64 + 96 + 4, D)  # z (64), x B C (64 + 2 groups x 2 x 8), dt (4 heads)
        sd[m + "conv1d.weight"] = r(96, 1, 4) * 2
        sd[m + "conv1d.bias"] = r(96)
        sd[m + "dt_bias"] = r(4) - 1
        sd[m + "A_log"] = r(4)
        sd[m + "D"] = 1 + r(4)
        sd[m + "norm.weight"] = 1 + r(64)
        sd[m + "out_proj.weight"] = r(D, 64)
    return sd


def _released_dir(tmp_path, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3
    if kind == "mamba2":
        return _write(tmp_path, kind, _mamba2_state_dict(r))
    inter = 256 * -(-int(D * 4 * 2 / 3) // 256)
    sd = {"model.embeddings.weight": r(V, D), "model.norm.weight": 1 + r(D), "lm_head.weight": r(V, D)}
    if kind == "hgrn2":
        sd["model.lower_bounds"] = r(L, D)
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "attn_norm.weight"] = 1 + r(D)
        sd[p + "mlp_norm.weight"] = 1 + r(D)
        sd[p + "mlp.gate_proj.weight"] = r(2 * inter, D)
        sd[p + "mlp.down_proj.weight"] = r(D, inter)
        sd[p + "attn.o_proj.weight"] = r(D, D)
        if kind == "hgrn2":
            sd[p + "attn.q_proj.weight"] = r(D, D)  # 2 heads x expand ratio 16
            sd[p + "attn.f_proj.weight"] = r(D, D)
            sd[p + "attn.i_proj.weight"] = r(D, D)
            sd[p + "attn.g_norm.weight"] = 1 + r(D)
        else:
            for n in "qkv":
                sd[p + f"attn.{n}_proj.weight"] = r(D, D)
                sd[p + f"attn.{n}_conv1d.weight"] = r(D, 1, 4) * 2
            sd[p + "attn.b_proj.weight"] = r(2, D)
            sd[p + "attn.o_norm.weight"] = 1 + r(D // 2)
    return _write(tmp_path, kind, sd)


def _write(tmp_path, kind, sd):
    d = tmp_path / kind
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_released_config(kind)))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    return d, {k: v.double() for k, v in sd.items()}


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _gla_parallel(q, k, v, log_g, scale):
    """Quadratic form of gated linear attention: o_t = scale sum_{s<=t} (q_t * exp(G_t - G_s)) . k_s v_s."""
    T = q.shape[1]
    G = log_g.cumsum(1)  # (B, T, H, K)
    decay = torch.exp(G[:, :, None] - G[:, None, :])  # (B, t, s, H, K)
    scores = torch.einsum("bthk,btshk,bshk->bhts", q, decay, k)
    scores = scores * torch.tril(torch.ones(T, T, dtype=torch.bool))
    return torch.einsum("bhts,bshv->bthv", scores, v) * scale


def _delta_matrix_form(q, k, v, beta, scale):
    """S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T with explicit matrices; o_t = scale q_t S_t."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=q.dtype)
    eye = torch.eye(K, dtype=q.dtype)
    out = []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t]  # (B, H, K), (B, H)
        A = eye - bt[..., None, None] * kt[..., :, None] @ kt[..., None, :]
        S = A @ S + bt[..., None, None] * kt[..., :, None] @ v[:, t, :, None, :]
        out.append(scale * (q[:, t, :, None, :] @ S)[..., 0, :])
    return torch.stack(out, 1)


def _l2(x, eps=1e-6):
    """The released kernels' L2 norm: x / sqrt(sum x^2 + 1e-6)."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _causal_conv_silu(x, w):
    W = w.shape[-1]
    xp = F.pad(x.transpose(1, 2), (W - 1, 0))
    return F.silu(F.conv1d(xp, w, groups=x.shape[-1])).transpose(1, 2)


def _mamba2_logits(sd, ids):
    """Mamba-2 in its quadratic (attention-like) form, float64, from the raw tensors."""
    H, P, G, N = 4, 16, 2, 8
    x = sd["backbone.embeddings.weight"][ids]
    B, T, _ = x.shape
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(L):
        m = f"backbone.layers.{i}.mixer."
        h = _rms(x, sd[f"backbone.layers.{i}.norm.weight"], 1e-5)
        z, xbc, dt = (h @ sd[m + "in_proj.weight"].T).split([64, 96, 4], dim=-1)
        W = sd[m + "conv1d.weight"]
        xbc = F.silu(F.conv1d(F.pad(xbc.transpose(1, 2), (3, 0)), W, sd[m + "conv1d.bias"], groups=96)).transpose(1, 2)
        xs, b, c = xbc.split([64, 16, 16], dim=-1)
        xs, b, c = xs.view(B, T, H, P), b.view(B, T, G, N), c.view(B, T, G, N)
        dt = F.softplus(dt + sd[m + "dt_bias"])  # (B, T, H)
        A = -torch.exp(sd[m + "A_log"])
        cum = (dt * A).cumsum(1)  # (B, T, H)
        y = torch.zeros(B, T, H, P, dtype=x.dtype)
        for head in range(H):
            grp = head // (H // G)
            decay = torch.exp(cum[:, :, None, head] - cum[:, None, :, head]) * causal  # (B, t, s)
            cb = torch.einsum("btn,bsn->bts", c[:, :, grp], b[:, :, grp])
            y[:, :, head] = torch.einsum("bts,bs,bsp->btp", decay * cb, dt[:, :, head], xs[:, :, head])
        y = y + xs * sd[m + "D"][:, None]
        gated = (y.reshape(B, T, 64) * F.silu(z)).view(B, T, G, 32)  # RMSNorm per group, after the gate
        gated = (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(B, T, 64)
        x = x + (gated * sd[m + "norm.weight"]) @ sd[m + "out_proj.weight"].T
    return _rms(x, sd["backbone.norm_f.weight"], 1e-5) @ sd["lm_head.weight"].T


def _independent_logits(kind, sd, ids):
    if kind == "mamba2":
        return _mamba2_logits(sd, ids)
    x = sd["model.embeddings.weight"][ids]
    B, T, _ = x.shape
    for i in range(L):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "attn_norm.weight"])
        if kind == "hgrn2":
            q = F.silu(h @ sd[p + "attn.q_proj.weight"].T).view(B, T, 2, 16)
            f = (h @ sd[p + "attn.f_proj.weight"].T).view(B, T, 2, 16)
            vals = (h @ sd[p + "attn.i_proj.weight"].T).view(B, T, 2, 16)
            # the released blocks never pass the lower bound on: forget gate sigmoid(f), input gate 1 - it
            o = _gla_parallel(q, 1 - torch.sigmoid(f), vals, F.logsigmoid(f), 16**-0.5)
            a = _rms(o.reshape(B, T, D), sd[p + "attn.g_norm.weight"]) @ sd[p + "attn.o_proj.weight"].T
        else:
            q, k, v = (_causal_conv_silu(h @ sd[p + f"attn.{n}_proj.weight"].T, sd[p + f"attn.{n}_conv1d.weight"])
                       for n in "qkv")
            q, k = (_l2(t.view(B, T, 2, 16)) for t in (q, k))
            beta = torch.sigmoid(h @ sd[p + "attn.b_proj.weight"].T)
            o = _delta_matrix_form(q, k, v.view(B, T, 2, 16), beta, 16**-0.5)
            a = _rms(o, sd[p + "attn.o_norm.weight"]).reshape(B, T, D) @ sd[p + "attn.o_proj.weight"].T
        x = x + a
        gate, up = (_rms(x, sd[p + "mlp_norm.weight"]) @ sd[p + "mlp.gate_proj.weight"].T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


KINDS = ["mamba2", "hgrn2", "delta_net"]


@pytest.mark.parametrize("kind", KINDS)
def test_released_directory_loads_and_computes_the_right_function(tmp_path, kind):
    d, sd = _released_dir(tmp_path, kind)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)
    assert type(model).__name__ == {"hgrn2": "HGRN2ForCausalLM", "delta_net": "DeltaNetForCausalLM",
                                    "mamba2": "Mamba2ForCausalLM"}[kind]
    ids = torch.randint(0, V, (2, 23), generator=torch.Generator().manual_seed(1))
    want = _independent_logits(kind, sd, ids)
    got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # round trip: same names and values, same function
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float64)
    assert set(again.state_dict()) == set(sd)
    for k, v in again.state_dict().items():
        assert torch.equal(v, sd[k]), k
    torch.testing.assert_close(again(ids).logits, got, rtol=1e-12, atol=1e-12)  # weights equal bit for bit


@pytest.mark.parametrize("kind", KINDS)
def test_loss_convention_and_gradient_checkpointing(tmp_path, kind):
    d, _ = _released_dir(tmp_path, kind)
    model = AutoModelForCausalLM.from_pretrained(d)
    labels = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(2))
    ids = torch.roll(labels, 1, dims=1)
    ids[:, 0] = 1
    out = model(ids, labels=labels, per_token_loss=True)
    assert out.logits is None and out.loss.shape == (2, 13)
    logits = model(ids).logits
    torch.testing.assert_close(out.loss, F.cross_entropy(logits.transpose(1, 2), labels, reduction="none"))
    model.train()
    params = [p for n, p in model.named_parameters() if n != "model.lower_bounds"]  # stored, unused (see module doc)
    grads = torch.autograd.grad(model(ids, labels=labels).loss, params)
    model.gradient_checkpointing_enable()
    ckpt = torch.autograd.grad(model(ids, labels=labels).loss, params)
    for a, b in zip(grads, ckpt):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_generation_equals_full_recompute(tmp_path, kind):
    d, _ = _released_dir(tmp_path, kind)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)
    prompt = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    seq = prompt
    for _ in range(10):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)
    # chunked prefill carries the state (recurrent and convolution) exactly
    full = model(seq, use_cache=False).logits
    cache = model.model.new_cache()
    parts = [model(seq[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in ((0, 5), (5, 6), (6, 17))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_batch_generates_like_each_prompt_alone(tmp_path, kind, check_left_padded_generation):
    d, _ = _released_dir(tmp_path, kind)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    check_left_padded_generation(model, [torch.randint(3, V, (n,), generator=g) for n in (4, 9, 6)], 8)


def test_hgrn2_lower_bound_when_applied(tmp_path):
    d, sd = _released_dir(tmp_path, "hgrn2")
    plain = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)
    bounded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, apply_lower_bound=True)
    ids = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(4))
    lb = sd["model.lower_bounds"].softmax(0)
    lb = lb.cumsum(0) - lb[0]
    assert lb[1].abs().max() > 0.05  # the bound is not negligible here, so the outputs must differ
    assert not torch.allclose(plain(ids).logits, bounded(ids).logits)
    # layer 1 of the bounded model: forget gate lb + (1 - lb) sigmoid(f), recomputed directly
    attn = bounded.model.layers[1].attn
    h = torch.randn(1, 5, D, dtype=torch.float64)
    f = (h @ sd["model.layers.1.attn.f_proj.weight"].T)
    g = lb[1] + (1 - lb[1]) * torch.sigmoid(f)
    q = F.silu(h @ sd["model.layers.1.attn.q_proj.weight"].T).view(1, 5, 2, 16)
    vals = (h @ sd["model.layers.1.attn.i_proj.weight"].T).view(1, 5, 2, 16)
    o = _gla_parallel(q, (1 - g).view(1, 5, 2, 16), vals, g.log().view(1, 5, 2, 16), 16**-0.5)
    want = _rms(o.reshape(1, 5, D), sd["model.layers.1.attn.g_norm.weight"]) @ sd["model.layers.1.attn.o_proj.weight"].T
    torch.testing.assert_close(attn(h, lower_bound=lb[1]), want)


def test_recurrences_match_their_closed_forms():
    g = torch.Generator().manual_seed(6)
    B, T, H, K, Vd = 2, 19, 3, 5, 7
    q, k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64), torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, Vd, generator=g, dtype=torch.float64)
    log_g = F.logsigmoid(torch.randn(B, T, H, K, generator=g, dtype=torch.float64) + 1)
    o, S = gla_recurrence(q, k, v, log_g, 0.4)
    torch.testing.assert_close(o.double(), _gla_parallel(q, k, v, log_g, 0.4), rtol=1e-5, atol=1e-5)
    # splitting the sequence and carrying the state gives the same outputs
    o1, S1 = gla_recurrence(q[:, :8], k[:, :8], v[:, :8], log_g[:, :8], 0.4)
    o2, _ = gla_recurrence(q[:, 8:], k[:, 8:], v[:, 8:], log_g[:, 8:], 0.4, S1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o)
    kn = F.normalize(k, dim=-1)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64))
    o, _ = delta_rule_recurrence(q, kn, v, beta, 0.4)
    torch.testing.assert_close(o.double(), _delta_matrix_form(q, kn, v, beta, 0.4), rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="use_gate"):
        fox_models.DeltaNetConfig(use_gate=True)
    with pytest.raises(ValueError, match="use_short_conv"):
        fox_models.HGRN2Config(use_short_conv=True)
    with pytest.raises(ValueError, match="num_heads \\* head_dim"):
        fox_models.Mamba2Config(hidden_size=64, num_heads=3, head_dim=64)
    with pytest.raises(ValueError, match="apply_lower_bound"):
        fox_models.HGRN2Config(hidden_size=64, num_heads=2, expand_ratio=16, apply_lower_bound=True)
    d, _ = _released_dir(tmp_path, "delta_net")
    model = AutoModelForCausalLM.from_pretrained(d)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.randint(0, V, (1, 6)), cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    right = model(torch.arange(10, 16)[None].expand(2, -1), attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])).logits
    torch.testing.assert_close(right[0, :4], model(torch.arange(10, 14)[None]).logits[0], atol=2e-5, rtol=1e-4)


def _model_on_fla_kernels(tmp_path, kind):
    """The module that picks the kernels, and a released baseline on the GPU; skips without fla's kernels."""
    pytest.importorskip("fla")
    from fox_models import recurrent_ops

    if recurrent_ops._fla_ops() is None:
        pytest.skip("flash-linear-attention kernels unavailable")
    d, _ = _released_dir(tmp_path, kind)
    return recurrent_ops, AutoModelForCausalLM.from_pretrained(d).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_flash_linear_attention_kernels_match_the_recurrence(tmp_path, kind, monkeypatch):
    """flash-linear-attention's chunked kernels against the model's own recurrence run in float64: in
    float32 (the kernels' dots run in TF32) no further from it than a bfloat16 model of the recurrence,
    and under bfloat16 autocast within twice the bfloat16 recurrence's own error."""
    recurrent_ops, model = _model_on_fla_kernels(tmp_path, kind)
    ids = torch.randint(0, V, (2, 300), generator=torch.Generator().manual_seed(7)).cuda()
    with torch.no_grad():
        fast32 = model(ids).logits.double()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fast16 = model(ids).logits.double()
        monkeypatch.setattr(recurrent_ops, "_use_fla", lambda x: False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            slow16 = model(ids).logits.double()
        exact = model.double()(ids).logits
    err = lambda x: (x - exact).abs().max().item()
    assert err(fast32) <= err(slow16), (err(fast32), err(slow16))
    assert err(fast16) <= 2 * err(slow16) + 1e-3, (err(fast16), err(slow16))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_flash_linear_attention_training_gradients_match_the_recurrence(tmp_path, kind, monkeypatch):
    """A training step through flash-linear-attention's kernels (including their backward, which for
    Mamba-2 on Hopper with Triton < 3.7.1 is the per-channel kernel's) gives the parameter gradients of the
    model's own float32 recurrence, within TF32 tolerance relative to the largest gradient."""
    recurrent_ops, model = _model_on_fla_kernels(tmp_path, kind)
    ids = torch.randint(0, V, (2, 200), generator=torch.Generator().manual_seed(3)).cuda()

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}

    fast = grads()
    monkeypatch.setattr(recurrent_ops, "_use_fla", lambda x: False)
    slow = grads()
    assert fast.keys() == slow.keys()
    for name in slow:
        scale = slow[name].abs().max().item() + 1e-12
        assert (fast[name] - slow[name]).abs().max().item() <= 2e-2 * scale, name
