"""Every standard output and input: attention weights, inputs_embeds generation, keyword arguments through
generate(); torch.export and disk offload (CPU, tiny models)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from fox_models.presets import get_preset

TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, num_kv_heads=2, vocab_size=97, bos_token_id=1,
            eos_token_id=2)
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny_model(family="fox-pro", seed=0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(get_preset(f"{family}-125m", **{**TINY, **overrides})).eval()


def reference_weights(model, ids, seq_start=None):
    """Each layer's attention weights in float64 from its own q, k and gates, one (i, j) at a time:
    exp(s q_i.k_j + c_i - c_j) / sum over the visible j, c counting the real tokens' gates only. The
    layers' inputs come from the explicit path's forward (the kernel's CPU path rounds c to float32)."""
    inputs = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a, kw: inputs.append(a[0]), with_kwargs=True)
             for b in model.model.layers]
    model(ids, use_cache=False, output_attentions=True, attention_mask=None if seq_start is None else
          (torch.arange(ids.shape[1])[None] >= seq_start[:, None]).long())
    for h in hooks:
        h.remove()
    out = []
    for block, x in zip(model.model.layers, inputs):
        layer = block.attn
        q, k, _, lf, _, _ = layer.project(x, seq_start=seq_start)
        B, T, H, D = q.shape
        k = k.repeat_interleave(H // k.shape[2], dim=2)
        start = torch.zeros(B, dtype=torch.long) if seq_start is None else seq_start
        w = torch.zeros(B, H, T, T, dtype=torch.float64)
        for b in range(B):
            s0 = int(start[b])
            for h in range(H):
                c = torch.cat([torch.zeros(s0), lf[b, s0:, h].double()]).cumsum(0)
                for i in range(s0, T):
                    logits = torch.stack([q[b, i, h].double() @ k[b, j, h].double() * D**-0.5 + c[i] - c[j]
                                          for j in range(s0, i + 1)])
                    w[b, h, i, s0:i + 1] = torch.softmax(logits, 0)
        out.append(w)
    return out


@pytest.mark.parametrize("family", ["fox-pro", "fox-llama", "transformer-pro", "transformer-llama"])
def test_output_attentions_match_a_float64_reference(family):
    model = tiny_model(family).double()
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    out = model(ids, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 10, 10)
    for got, want in zip(out.attentions, reference_weights(model, ids)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.logits, model(ids).logits)  # the exact path computes the same function
    # left padding: padded keys get no weight, padded queries are rows of 0
    seq_start = torch.tensor([0, 3])
    mask = (torch.arange(10)[None] >= seq_start[:, None]).long()
    padded = model(ids, attention_mask=mask, output_attentions=True)
    for got, want in zip(padded.attentions, reference_weights(model, ids, seq_start)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert padded.attentions[0][1, :, :3].abs().max() == 0
    torch.testing.assert_close(padded.logits[:, 3:], model(ids, attention_mask=mask).logits[:, 3:])


def test_output_attentions_with_a_cache_and_in_generate():
    model = tiny_model().double()
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    full = model(ids, output_attentions=True).attentions
    cache = model.model.new_cache()
    model(ids[:, :6], past_key_values=cache)
    step = model(ids[:, 6:], past_key_values=cache, output_attentions=True).attentions
    for a, b in zip(step, full):
        assert a.shape == (1, 4, 3, 9)
        torch.testing.assert_close(a, b[:, :, 6:], rtol=1e-6, atol=1e-9)  # the cache keeps c in float32
    out = model.generate(ids, max_new_tokens=3, output_attentions=True, return_dict_in_generate=True, **GREEDY)
    assert len(out.attentions) == 3 and out.attentions[1][0].shape == (1, 4, 1, 10)


def test_output_attentions_tuples_and_the_recurrent_models_refuse():
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 5))
    out = model(ids, output_attentions=True, return_dict=False)
    assert isinstance(out, tuple) and len(out[-1]) == 2
    recurrent = tiny_model("hgrn2", num_heads=2, expand_ratio=16, num_kv_heads=None)
    with pytest.raises(ValueError, match="no attention weights"):
        recurrent(ids, output_attentions=True)


@pytest.mark.parametrize("family", ["fox-pro", "transformer-llama"])
def test_generation_from_inputs_embeds(family):
    model = tiny_model(family)
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    from_ids = model.generate(ids, max_new_tokens=6, **GREEDY)[:, 7:]
    embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=6, **GREEDY)
    assert torch.equal(from_embeds[:, -6:], from_ids)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    torch.testing.assert_close(model(inputs_embeds=embeds, attention_mask=mask).logits[:, 2:],
                               model(ids, attention_mask=mask).logits[:, 2:])


def test_generate_forwards_keyword_arguments():
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 6))
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(set(kw)), with_kwargs=True)
    out = model.generate(ids, max_new_tokens=2, output_hidden_states=True, return_dict_in_generate=True, **GREEDY)
    assert all("output_hidden_states" in kw for kw in seen)
    assert len(out.hidden_states) == 2 and len(out.hidden_states[0]) == 3


BASELINES = {"mamba2": dict(num_heads=8, head_dim=16, state_size=16, num_kv_heads=None),
             "hgrn2": dict(num_heads=2, expand_ratio=16, num_kv_heads=None), "delta_net": dict(num_heads=2, num_kv_heads=None)}


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(ids, attention_mask=mask, use_cache=False).logits


def _padded(batch, length, seed):
    ids = torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[-1, :2] = 0  # left padding
    mask[0, -1] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("family", ["fox-pro", "fox-llama", "transformer-pro", "transformer-llama"])
def test_torch_export_with_dynamic_batch_and_length(family):
    """No data-dependent check runs while exporting (the padding mask is read without a branch); the
    exported program computes the model's function at other shapes and paddings."""
    model = tiny_model(family)
    ids, mask = _padded(2, 9, 0)
    b, t = torch.export.Dim("b", min=1, max=64), torch.export.Dim("t", min=3, max=4096)
    program = torch.export.export(_Logits(model), (ids, mask), dynamic_shapes=({0: b, 1: t}, {0: b, 1: t}), strict=False)
    ids, mask = _padded(3, 13, 1)
    torch.testing.assert_close(program.module()(ids, mask), model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", list(BASELINES))
def test_torch_export_of_the_recurrent_models_at_fixed_shapes(family):
    """The CPU recurrence runs one step per token, so the exported length is fixed."""
    model = tiny_model(family, **BASELINES[family])
    ids, mask = _padded(2, 9, 0)
    program = torch.export.export(_Logits(model), (ids, mask), strict=False)
    ids, mask = _padded(2, 9, 1)
    torch.testing.assert_close(program.module()(ids, mask), model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", ["fox-pro", "transformer-llama", *BASELINES])
def test_disk_offload(tmp_path, family):
    """from_pretrained with a device_map that puts a block and the LM head on disk (accelerate loads each
    module's weights when it is called): the same logits and generation as the model in memory."""
    model = tiny_model(family, **BASELINES.get(family, {}))
    model.save_pretrained(tmp_path / "m")
    root, norm = ("backbone", "norm_f") if family == "mamba2" else ("model", "norm")
    device_map = {f"{root}.embeddings": "cpu", f"{root}.layers.0": "cpu", f"{root}.layers.1": "disk",
                  f"{root}.{norm}": "cpu", "lm_head": "disk"}
    if family == "hgrn2":
        device_map["model.lower_bounds"] = "cpu"
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map,
                                                     offload_folder=str(tmp_path / "offload")).eval()
    assert offloaded.lm_head.weight.device.type == "meta"  # read from disk (the safetensors file) when called
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(offloaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    assert torch.equal(offloaded.generate(ids, max_new_tokens=4, **GREEDY), model.generate(ids, max_new_tokens=4, **GREEDY))


@pytest.mark.parametrize("family", ["fox-pro", "transformer-llama"])
def test_packed_sequences_in_eval_mode_need_no_use_cache_false(family):
    """cu_seqlens in eval mode (use_cache on by default) was refused as "combined with a decoding state",
    which the caller never passed: packed sequences now run without a cache unless one is asked for."""
    model = AutoModelForCausalLM.from_config(get_preset(f"{family}-tiny")).eval()
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu)
        alone = torch.cat([model(ids[:, :5]).logits, model(ids[:, 5:]).logits], dim=1)
    assert packed.past_key_values is None
    torch.testing.assert_close(packed.logits, alone, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cu_seqlens .* cannot be combined with a decoding state"):
        model(ids, cu_seqlens=cu, use_cache=True)
