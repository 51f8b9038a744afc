"""FoX models load published-format directories, compute the right function, round-trip, generate."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import fox_models
from fox_kernel.reference import forgetting_attention_ref
from fox_models.presets import PRESETS, get_preset

V, D, H, L = 97, 32, 4, 2
VARIANTS = {
    "fox-pro": dict(qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True, use_v_shift=True,
                    hidden_ratio=3.5),
    "fox-pro-legacy-qknorm": dict(qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True,
                                  use_v_shift=True, hidden_ratio=3.5),
    "fox-llama": dict(),
    "transformer-pro": dict(qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True,
                            use_v_shift=True, fgate_type="none", use_rope=True, hidden_ratio=3.5),
}


def _published_dir(tmp_path, variant, seed=0):
    """Write config.json + model.safetensors by hand, names and shapes as in the published checkpoints."""
    g = torch.Generator().manual_seed(seed)
    opts = VARIANTS[variant]
    pro, legacy = opts.get("qk_norm", False), variant.endswith("legacy-qknorm")
    inter = 256 * -(-int(D * opts.get("hidden_ratio", 4) * 2 / 3) // 256)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3
    sd = {"model.embeddings.weight": r(V, D), "model.norm.weight": 1 + r(D), "lm_head.weight": r(V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "attn_norm.weight"] = 1 + r(D)
        sd[p + "mlp_norm.weight"] = 1 + r(D)
        sd[p + "mlp.gate_proj.weight"] = r(2 * inter, D)
        sd[p + "mlp.down_proj.weight"] = r(D, inter)
        sd[p + "attn.q_proj.weight"] = r(D, D)
        sd[p + "attn.o_proj.weight"] = r(D, D)
        for kv in ("k", "v"):
            if pro:
                sd[p + f"attn.{kv}_proj.linear.weight"] = r(D, D)
                sd[p + f"attn.{kv}_proj.shift_proj.weight"] = r(H, D)
            else:
                sd[p + f"attn.{kv}_proj.weight"] = r(D, D)
        if opts.get("fgate_type", "full") == "full":
            sd[p + "attn.fgate_proj.weight"] = r(H, D)
            sd[p + "attn.fgate_proj.bias"] = r(H) + 2
        if pro:
            sd[p + "attn.ogate_proj.weight"] = r(D, D)
            sd[p + "attn.output_norm.weight"] = 1 + r(D)
            n = D // H if legacy else D
            sd[p + "attn.q_norm.weight"] = 1 + r(n)
            sd[p + "attn.k_norm.weight"] = 1 + r(n)
    config = dict(fox_models.ForgettingTransformerConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L,
                                                         num_heads=H, **opts).to_dict())
    config.pop("qk_norm_share_param_across_head")  # the released configs do not have it
    config["architectures"] = ["ForgettingTransformerForCausalLM"]
    d = tmp_path / variant
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    return d, {k: v.double() for k, v in sd.items()}, opts


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, base=500000.0):
    T, Dh = x.shape[1], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]
    return x * cos + torch.cat([-x[..., Dh // 2 :], x[..., : Dh // 2]], -1) * sin


def _independent_logits(sd, opts, ids, legacy):
    """The model's function written out from the raw tensors, in float64."""
    x = sd["model.embeddings.weight"][ids]
    B, T = ids.shape
    heads = lambda t: t.view(B, T, H, D // H)
    for i in range(L):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "attn_norm.weight"], 1e-6)
        q = h @ sd[p + "attn.q_proj.weight"].T
        kv = []
        for name in ("k", "v"):
            if opts.get("qk_norm"):
                raw = h @ sd[p + f"attn.{name}_proj.linear.weight"].T
                a = torch.sigmoid(h @ sd[p + f"attn.{name}_proj.shift_proj.weight"].T)[..., None]
                prev = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], 1)
                kv.append((a * heads(prev) + (1 - a) * heads(raw)).reshape(B, T, D))
            else:
                kv.append(h @ sd[p + f"attn.{name}_proj.weight"].T)
        k, v = kv
        if opts.get("qk_norm"):
            wq, wk = sd[p + "attn.q_norm.weight"], sd[p + "attn.k_norm.weight"]
            if not legacy:
                wq, wk = wq.view(H, D // H), wk.view(H, D // H)
            q = _rms(heads(q), wq, 1e-5).reshape(B, T, D)
            k = _rms(heads(k), wk, 1e-5).reshape(B, T, D)
        q, k, v = heads(q), heads(k), heads(v)
        if opts.get("use_rope"):
            q, k = _rope(q), _rope(k)
        if opts.get("fgate_type", "full") == "full":
            lf = F.logsigmoid(h @ sd[p + "attn.fgate_proj.weight"].T + sd[p + "attn.fgate_proj.bias"])
        else:
            lf = torch.zeros(B, T, H, dtype=torch.float64)
        o = forgetting_attention_ref(q, k, v, lf).reshape(B, T, D)
        if opts.get("use_output_norm"):
            o = _rms(o.view(B, T, H, D // H), sd[p + "attn.output_norm.weight"].view(H, D // H), 1e-6).reshape(B, T, D)
        if opts.get("use_output_gate"):
            o = o * torch.sigmoid(h @ sd[p + "attn.ogate_proj.weight"].T)
        x = x + o @ sd[p + "attn.o_proj.weight"].T
        h = _rms(x, sd[p + "mlp_norm.weight"], 1e-6)
        gate, up = (h @ sd[p + "mlp.gate_proj.weight"].T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["model.norm.weight"], 1e-6) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_published_directory_loads_and_computes_the_right_function(tmp_path, variant):
    d, sd, opts = _published_dir(tmp_path, variant)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert type(model).__name__ == "ForgettingTransformerForCausalLM"
    if opts.get("qk_norm"):
        assert model.config.qk_norm_share_param_across_head == variant.endswith("legacy-qknorm")
    ids = torch.randint(0, V, (2, 23), generator=torch.Generator().manual_seed(1))
    logits = model(ids).logits
    expected = _independent_logits(sd, opts, ids, variant.endswith("legacy-qknorm"))
    torch.testing.assert_close(logits.double(), expected, rtol=1e-4, atol=1e-4)
    # save_pretrained writes the same format back; the round trip is exact
    out = tmp_path / "saved"
    model.save_pretrained(out)
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(sd)
    for k in sd:
        assert torch.equal(saved[k].double(), sd[k].float().double()), k
    again = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(again(ids).logits, logits)


@pytest.mark.parametrize("variant", ["fox-pro", "fox-pro-legacy-qknorm"])
def test_published_weights_load_from_a_state_dict(tmp_path, variant, monkeypatch):
    """``from_pretrained(None, config=..., state_dict=...)`` (transformers' in-memory load) reads whether the
    QK-norm weight is shared from the given weights and looks up no file."""
    from safetensors.torch import load_file

    d, sd, opts = _published_dir(tmp_path, variant)

    def no_lookup(*args, **kwargs):
        raise AssertionError("from_pretrained looked up a file for weights given in memory")

    monkeypatch.setattr("transformers.utils.cached_file", no_lookup)
    config = fox_models.ForgettingTransformerConfig.from_pretrained(d)
    assert config.qk_norm_share_param_across_head is None
    model = fox_models.ForgettingTransformerForCausalLM.from_pretrained(
        None, config=config, state_dict=load_file(str(d / "model.safetensors")))
    assert model.config.qk_norm_share_param_across_head == variant.endswith("legacy-qknorm")
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = _independent_logits(sd, opts, ids, variant.endswith("legacy-qknorm"))
    torch.testing.assert_close(model(ids).logits.double(), expected, rtol=1e-4, atol=1e-4)


def test_loss_convention_and_hidden_states(tmp_path):
    d, _, _ = _published_dir(tmp_path, "fox-pro")
    model = AutoModelForCausalLM.from_pretrained(d)
    labels = torch.randint(0, V, (2, 17))
    ids = torch.roll(labels, 1, dims=1)
    ids[:, 0] = 1
    out = model(ids, labels=labels, output_hidden_states=True, per_token_loss=True)
    assert out.logits is None and out.loss.shape == (2, 17)
    logits = model(ids).logits
    torch.testing.assert_close(out.loss, F.cross_entropy(logits.transpose(1, 2), labels, reduction="none"))
    assert len(out.hidden_states) == L + 1


def test_hugging_face_loss_convention_and_tuples(tmp_path):
    d, _, _ = _published_dir(tmp_path, "fox-pro")
    model = AutoModelForCausalLM.from_pretrained(d)
    ids = torch.randint(0, V, (3, 14), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that is not scored
    labels[2, 9:] = -100
    out = model(ids, labels=labels)
    assert out.loss.dim() == 0 and out.logits.shape == (3, 14, V)
    ref = F.cross_entropy(out.logits[:, :-1].double().reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss.double(), ref)
    scored = int((labels[:, 1:] != -100).sum())
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(2 * scored)).loss
    torch.testing.assert_close(summed * 2, out.loss)  # the Trainer's token count across micro-batches
    out.loss.backward()
    assert model.lm_head.weight.grad is not None
    loss, logits = model(ids, labels=labels, return_dict=False)[:2]
    torch.testing.assert_close(loss, out.loss)
    torch.testing.assert_close(logits, out.logits)
    assert isinstance(model(ids, return_dict=False), tuple)
    torch.testing.assert_close(model(ids, position_ids=torch.arange(14)[None].expand(3, -1)).logits, model(ids).logits)


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    d, _, _ = _published_dir(tmp_path, "fox-pro")
    model = AutoModelForCausalLM.from_pretrained(d)
    model.train()
    ids = torch.randint(0, V, (2, 15))
    grads = []
    for mode in ("plain", "blocks", "projections"):
        model.zero_grad()
        if mode == "blocks":
            model.gradient_checkpointing_enable()
        if mode == "projections":
            model.gradient_checkpointing_disable()
            assert model.enable_projection_recompute() == model.config.num_hidden_layers
        model(ids, labels=ids).loss.mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("variant", ["fox-pro", "transformer-pro"])
def test_cached_generation_equals_full_recompute(tmp_path, variant):
    d, _, _ = _published_dir(tmp_path, variant)
    model = AutoModelForCausalLM.from_pretrained(d)
    prompt = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    seq = prompt
    for _ in range(12):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)
    torch.manual_seed(0)
    sampled = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=20, eos_token_id=None, pad_token_id=0)
    assert sampled.shape == (1, 17) and torch.equal(sampled[:, :9], prompt)


def test_left_padded_batch_generates_like_each_prompt_alone(tmp_path, check_left_padded_generation):
    d, _, _ = _published_dir(tmp_path, "fox-pro")
    model = AutoModelForCausalLM.from_pretrained(d)
    g = torch.Generator().manual_seed(5)
    check_left_padded_generation(model, [torch.randint(3, V, (n,), generator=g) for n in (4, 11, 7)], 10)


@pytest.mark.parametrize("variant", ["fox-llama", "fox-pro", "transformer-pro"])
def test_right_and_left_padding_give_the_unpadded_outputs(tmp_path, variant):
    d, _, _ = _published_dir(tmp_path, variant)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(3, V, (n,), generator=g) for n in (9, 5, 7)]
    T = 9
    for side in ("right", "left"):
        ids = torch.zeros(3, T, dtype=torch.long)
        mask = torch.zeros(3, T, dtype=torch.long)
        for b, s in enumerate(seqs):
            cols = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
            ids[b, cols], mask[b, cols] = s, 1
        logits = model(ids, attention_mask=mask).logits
        for b, s in enumerate(seqs):
            cols = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
            torch.testing.assert_close(logits[b, cols], model(s[None]).logits[0], atol=2e-5, rtol=1e-4)
        labels = torch.where(mask.bool(), ids, -100)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        ref = torch.stack([model(s[None], labels=s[None]).loss * (len(s) - 1) for s in seqs]).sum() / sum(len(s) - 1 for s in seqs)
        if side == "right":  # a right-padded row's scored tokens are its own; left padding shifts nothing in
            torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)


def test_mismatched_state_dict_names_the_keys(tmp_path):
    d, sd, _ = _published_dir(tmp_path, "fox-llama")
    sd = {k: v.float() for k, v in sd.items()}
    sd["model.layers.0.attn.extra.weight"] = torch.zeros(2)
    del sd["model.layers.1.attn.o_proj.weight"]
    model = AutoModelForCausalLM.from_pretrained(d)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*layers\.1\.attn\.o_proj\.weight(.|\n)*Unexpected key\(s\).*attn\.extra"):
        model.load_state_dict(sd)


def test_unknown_model_type_is_a_clear_error(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "forgetting_transformer-project_typo"}))
    with pytest.raises(ValueError, match="forgetting_transformer-project_typo"):
        AutoConfig.from_pretrained(d)


def test_transformer_llama_rope_is_right_after_from_pretrained(tmp_path):
    cfg = fox_models.TransformerConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_heads=H)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "t")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    ids = torch.randint(0, V, (2, 40))
    logits = loaded(ids).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, model(ids).logits)
    # SDPA path (no padding) equals the kernel path (padding mask of all ones forces the FoX kernel)
    padded = loaded(ids, attention_mask=torch.ones_like(ids), use_cache=True).logits
    torch.testing.assert_close(padded, logits, rtol=1e-4, atol=1e-4)


def test_tokenizers_work_offline(tmp_path):
    tok = fox_models.gpt2_tokenizer()
    assert tok("Hello world")["input_ids"] == [15496, 995]
    jt = fox_models.JSONGPT2Tokenizer()
    text = 'A "quoted" line\nand a tab\t.'
    ids = jt(text)["input_ids"]
    assert ids[0] == 50256  # BOS
    assert ids[1:] == tok(json.dumps(text)[1:-1])["input_ids"]
    assert jt.decode(ids, skip_special_tokens=True) == text
    # A directory in the published tokenizer format loads through AutoTokenizer.
    from fox_models.tokenizer import gpt2_vocab_and_merges

    vocab, merges = gpt2_vocab_and_merges()
    d = tmp_path / "tok"
    d.mkdir()
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "JSONGPT2Tokenizer", "add_bos_token": True}))
    auto = AutoTokenizer.from_pretrained(d)
    assert type(auto).__name__ == "JSONGPT2Tokenizer"
    assert auto(text)["input_ids"] == ids


@pytest.mark.parametrize("name", PRESETS)
def test_presets_instantiate_on_meta_with_paper_sizes(name):
    config = get_preset(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for k, p in model.named_parameters() if not k.endswith("embeddings.weight"))
    size = {"125m": 125e6, "360m": 360e6, "760m": 760e6}[name.rsplit("-", 1)[1]]
    assert abs(n - size) / size < 0.1, (name, n)
    if name.endswith("760m"):
        assert abs(n - 760e6) / 760e6 < 0.03, (name, n)


@pytest.mark.parametrize("fgate_type", ["full", "bias_only", "fixed"])
def test_decay_time_gate_bias_init_survives_the_weight_init(fgate_type):
    """fgate_bias_init: every layer's gate bias is the decay-time init after from_config (a full gate's
    bias lives on its Linear, whose own init zeroes it first)."""
    from fox_layers import decay_time_bias

    config = get_preset("fox-pro-tiny", fgate_type=fgate_type, fgate_bias_init=True, decay_time_min=2,
                        decay_time_max=300)
    model = AutoModelForCausalLM.from_config(config)
    for block in model.model.layers:
        attn = block.attn
        bias = attn.fgate_proj.bias if fgate_type == "full" else attn.fgate_bias
        torch.testing.assert_close(bias.detach(), decay_time_bias(attn.num_heads, 2, 300))
        assert bias.abs().min() > 0
