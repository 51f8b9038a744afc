"""SAMBA: the reference implementation's config.json and weight names load and compute the right function
(written out here from the raw tensors, float64), its initialisation, the loss conventions, gradient
checkpointing, decoding with a cache, left padding, and the Triton scan against the PyTorch scan on a GPU."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import fox_models
from fox_models.presets import get_preset
from fox_models.samba import SambaCache

V, D, L, N, W = 61, 32, 4, 4, 5  # vocabulary, hidden, layers (2 Mamba, 2 attention), state, window
E, R, HEADS = 2 * D, math.ceil(D / 16), 2


def released_config(**overrides):
    """config.json as the reference's SambaConfig.save_pretrained writes it (time_step_rank resolved,
    intermediate_size stored, the attention layers as the ``attn`` dict)."""
    return dict(model_type="samba-project_fox", architectures=["SambaForCausalLM"], vocab_size=V, hidden_size=D,
                state_size=N, num_hidden_layers=L, norm_eps=1e-5, pad_token_id=None, bos_token_id=1,
                eos_token_id=2, expand=2, conv_kernel=4, use_bias=False, use_conv_bias=True, hidden_act="silu",
                initializer_range=0.02, residual_in_fp32=False, time_step_rank=R, time_step_scale=1.0,
                time_step_min=0.001, time_step_max=0.1, time_step_init_scheme="random", time_step_floor=1e-4,
                max_position_embeddings=None, intermediate_size=E,
                attn=dict(num_kv_heads=None, num_heads=HEADS, window_size=W, layers=None), attn_hidden_ratio=4,
                mamba_hidden_ratio=3, rescale_prenorm_residual=True, use_cache=True, fuse_norm=True,
                fuse_cross_entropy=True, tie_word_embeddings=False, rope_base=500000.0, **overrides)


def mlp_width(ratio):
    return 256 * math.ceil(int(D * ratio * 2 / 3) / 256)


def released_state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3
    sd = {"backbone.embeddings.weight": r(V, D), "backbone.norm_f.weight": 1 + r(D), "lm_head.weight": r(V, D)}
    for i in range(L):
        p = f"backbone.layers.{i}."
        sd[p + "mixer_norm.weight"] = 1 + r(D)
        sd[p + "mlp_norm.weight"] = 1 + r(D)
        inter = mlp_width(4 if i % 2 else 3)
        sd[p + "mlp.gate_proj.weight"] = r(2 * inter, D)
        sd[p + "mlp.down_proj.weight"] = r(D, inter)
        m = p + "mixer."
        if i % 2:
            for n in "qkvo":
                sd[m + f"{n}_proj.weight"] = r(D, D)
        else:
            sd[m + "in_proj.weight"] = r(2 * E, D)
            sd[m + "conv1d.weight"] = r(E, 1, 4) * 2
            sd[m + "conv1d.bias"] = r(E)
            sd[m + "x_proj.weight"] = r(R + 2 * N, E)
            sd[m + "dt_proj.weight"] = r(E, R)
            sd[m + "dt_proj.bias"] = r(E) - 1
            sd[m + "A_log"] = torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(E, 1) + r(E, N)
            sd[m + "D"] = 1 + r(E)
            sd[m + "out_proj.weight"] = r(D, E)
    return sd


def released_dir(tmp_path, seed=0):
    d = tmp_path / "samba"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(released_config()))
    sd = released_state_dict(seed)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    return d, {k: v.double() for k, v in sd.items()}


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, base=500000.0):
    """Non-interleaved RoPE at positions 0..T-1: pairs (j, j + d/2) rotated by t * base^(-2j/d)."""
    T, d = x.shape[1], x.shape[-1]
    angle = torch.arange(T, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _mamba(sd, m, h):
    """Mamba (v1) from the raw tensors: one step per token."""
    B, T, _ = h.shape
    xs, z = (h @ sd[m + "in_proj.weight"].T).chunk(2, -1)
    conv = F.conv1d(F.pad(xs.transpose(1, 2), (3, 0)), sd[m + "conv1d.weight"], sd[m + "conv1d.bias"], groups=E)
    xs = F.silu(conv).transpose(1, 2)
    dt, Bm, Cm = (xs @ sd[m + "x_proj.weight"].T).split([R, N, N], -1)
    delta = F.softplus(dt @ sd[m + "dt_proj.weight"].T + sd[m + "dt_proj.bias"])
    A = -torch.exp(sd[m + "A_log"])
    state = torch.zeros(B, E, N, dtype=h.dtype)
    ys = []
    for t in range(T):
        state = torch.exp(delta[:, t, :, None] * A) * state + (delta[:, t] * xs[:, t])[..., None] * Bm[:, t, None]
        ys.append((state * Cm[:, t, None]).sum(-1))
    y = (torch.stack(ys, 1) + xs * sd[m + "D"]) * F.silu(z)
    return y @ sd[m + "out_proj.weight"].T


def _window_attention(sd, m, h):
    """Softmax attention over the W latest keys (the query's own included), RoPE on q and k."""
    B, T, _ = h.shape
    q, k, v = ((h @ sd[m + f"{n}_proj.weight"].T).view(B, T, HEADS, D // HEADS) for n in "qkv")
    q, k = _rope(q), _rope(k)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D // HEADS)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    scores = scores.masked_fill(~((j <= i) & (j > i - W)), float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(B, T, D)
    return o @ sd[m + "o_proj.weight"].T


def samba_logits(sd, ids):
    x = sd["backbone.embeddings.weight"][ids]
    for i in range(L):
        p = f"backbone.layers.{i}."
        h = _rms(x, sd[p + "mixer_norm.weight"])
        x = x + (_window_attention if i % 2 else _mamba)(sd, p + "mixer.", h)
        gate, up = (_rms(x, sd[p + "mlp_norm.weight"]) @ sd[p + "mlp.gate_proj.weight"].T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["backbone.norm_f.weight"]) @ sd["lm_head.weight"].T


def test_released_directory_loads_and_computes_the_right_function(tmp_path):
    d, sd = released_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)
    assert type(model).__name__ == "SambaForCausalLM"
    assert [b.is_attention for b in model.backbone.layers] == [False, True, False, True]
    ids = torch.randint(0, V, (2, 23), generator=torch.Generator().manual_seed(1))  # 23 > W: windows slide
    torch.testing.assert_close(model(ids).logits, samba_logits(sd, ids), rtol=1e-9, atol=1e-9)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["attn"] == released_config()["attn"] and saved["model_type"] == "samba-project_fox"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float64)
    assert set(again.state_dict()) == set(sd)
    for k, v in again.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_the_window_and_the_layer_layout_matter(tmp_path):
    d, sd = released_dir(tmp_path)
    ids = torch.randint(0, V, (1, 17), generator=torch.Generator().manual_seed(2))
    windowed = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)(ids).logits
    full = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, window_size=64)(ids).logits
    torch.testing.assert_close(windowed[:, :W], full[:, :W])  # the first W queries see every key either way
    assert (windowed[:, W:] - full[:, W:]).abs().max() > 1e-3


def test_loss_convention_and_gradient_checkpointing(tmp_path):
    d, _ = released_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(d)
    labels = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(2))
    ids = torch.roll(labels, 1, dims=1)
    ids[:, 0] = 1
    out = model(ids, labels=labels, per_token_loss=True)
    assert out.logits is None and out.loss.shape == (2, 13)
    logits = model(ids).logits
    torch.testing.assert_close(out.loss, F.cross_entropy(logits.transpose(1, 2), labels, reduction="none"))
    model.train()
    params = [p for _, p in model.named_parameters()]
    grads = torch.autograd.grad(model(ids, labels=labels).loss, params)
    assert all(g.abs().sum() > 0 for g in grads)
    model.gradient_checkpointing_enable()
    for a, b in zip(grads, torch.autograd.grad(model(ids, labels=labels).loss, params)):
        torch.testing.assert_close(a, b)


def test_cached_generation_equals_full_recompute(tmp_path):
    d, _ = released_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)
    prompt = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    seq = prompt
    for _ in range(10):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)
    # the logits of a chunked prefill and single steps equal the full forward's
    full = model(seq, use_cache=False).logits
    cache = model.model.new_cache()
    assert isinstance(cache, SambaCache)
    parts = [model(seq[:, a:b], past_key_values=cache, use_cache=True).logits
             for a, b in ((0, 5), (5, 6), (6, 7), (7, 17))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.get_seq_length() == 17 and all(layer.get_seq_length() == 17 for layer in cache.layers)


def test_left_padded_batch_generates_like_each_prompt_alone(tmp_path, check_left_padded_generation):
    d, _ = released_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    check_left_padded_generation(model, [torch.randint(3, V, (n,), generator=g) for n in (4, 9, 6)], 8)


def test_lora_on_every_projection_is_in_the_function(tmp_path):
    """LoRA adapters on every linear of the Mamba and attention mixers: the adapted model computes what
    the merged one (plain linears holding W + BA) computes, and every adapter gets a gradient."""
    peft = pytest.importorskip("peft")
    d, _ = released_dir(tmp_path)
    targets = ["in_proj", "x_proj", "dt_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"]
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64),
                                peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False))
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(4))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    for target in targets:
        grads = [p.grad for n, p in model.named_parameters() if f".{target}.lora_" in n]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), target
    model.eval()
    adapted = model(input_ids=ids).logits
    merged = model.merge_and_unload()
    assert type(merged.backbone.layers[0].mixer.dt_proj) is torch.nn.Linear
    torch.testing.assert_close(adapted, merged(ids).logits, rtol=1e-10, atol=1e-10)


def test_initialisation_is_the_reference_one():
    config = get_preset("samba-125m", hidden_size=64, num_hidden_layers=6, num_heads=2, vocab_size=97)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    layers = config.num_hidden_layers
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            bound = 1 / math.sqrt(p.shape[1] * 2 * layers)  # PyTorch's default, scaled by 1/sqrt(2 layers)
        elif name.endswith("dt_proj.weight"):
            bound = config.time_step_rank**-0.5
        elif name.endswith("conv1d.weight") or name.endswith("conv1d.bias"):
            bound = 1 / math.sqrt(config.conv_kernel)
        elif leaf == "weight" and p.dim() == 2 and "embeddings" not in name:
            bound = 1 / math.sqrt(p.shape[1])
        else:
            continue
        assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound, name
    assert abs(model.backbone.embeddings.weight.std().item() - config.initializer_range) < 2e-3
    mixer = model.backbone.layers[0].mixer
    torch.testing.assert_close(mixer.A_log[5], torch.log(torch.arange(1, 17, dtype=torch.float32)))
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))
    dt = F.softplus(mixer.dt_proj.bias)
    assert dt.min() >= config.time_step_min * 0.999 and dt.max() <= config.time_step_max * 1.001
    assert all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in (model.backbone.norm_f,
                                                                          model.backbone.layers[1].mlp_norm))
    assert (model.backbone.layers[1].mlp.gate_proj.weight.shape[0], mixer.in_proj.weight.shape[0]) == (
        2 * 256 * math.ceil(int(64 * 4 * 2 / 3) / 256), 4 * 64)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="layers"):
        fox_models.SambaConfig(attn=dict(num_heads=2, window_size=8, layers=[1, 3]))
    with pytest.raises(ValueError, match="num_heads"):
        fox_models.SambaConfig(attn=dict(window_size=8, layers=None))
    with pytest.raises(ValueError, match="residual_in_fp32"):
        fox_models.SambaConfig(residual_in_fp32=True)
    with pytest.raises(ValueError, match="intermediate_size"):
        fox_models.SambaConfig(hidden_size=64, intermediate_size=100)
    model = AutoModelForCausalLM.from_config(get_preset("samba-tiny", vocab_size=V))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.randint(0, V, (1, 6)), cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="output_attentions"):
        model(torch.randint(0, V, (1, 6)), output_attentions=True)


def test_config_fields_read_and_set_the_attention_dict():
    config = get_preset("samba-760m", num_heads=24, window_size=512)
    assert config.attn == dict(num_heads=24, num_kv_heads=None, window_size=512, layers=None)
    assert (config.num_heads, config.num_attention_heads, config.window_size) == (24, 24, 512)
    mamba_only = fox_models.SambaConfig(hidden_size=64, num_hidden_layers=3)
    assert mamba_only.attn is None and mamba_only.num_heads is None
    model = AutoModelForCausalLM.from_config(mamba_only)
    assert not any(b.is_attention for b in model.backbone.layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_scan_model_matches_the_pytorch_scan(tmp_path, monkeypatch):
    """The model with the Triton scan against the same model with the PyTorch scan run in float64: in
    float32 no further from it than a bfloat16 run of the PyTorch scan, and under bfloat16 autocast within
    twice that run's error."""
    from fox_models.samba import selective_scan

    d, _ = released_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(d).cuda()
    ids = torch.randint(0, V, (2, 300), generator=torch.Generator().manual_seed(7)).cuda()
    with torch.no_grad():
        fast32 = model(ids).logits.double()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fast16 = model(ids).logits.double()
        monkeypatch.setattr(selective_scan, "_use_triton", lambda x: False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            slow16 = model(ids).logits.double()
        exact = model.double().cpu()(ids.cpu()).logits.cuda()  # on the CPU: the attention kernels take 16/32 bits
    err = lambda x: (x - exact).abs().max().item()
    assert err(fast32) <= err(slow16), (err(fast32), err(slow16))
    assert err(fast16) <= 2 * err(slow16) + 1e-3, (err(fast16), err(slow16))
