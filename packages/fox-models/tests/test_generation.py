"""Generation through transformers' cache protocol: assisted and prompt-lookup decoding roll the cache back
(``crop``) and must give plain greedy decoding's tokens; beam search reorders it; the cache is a
transformers ``Cache`` (CPU, tiny models)."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache

from fox_models.presets import get_preset

TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=97, bos_token_id=1, eos_token_id=2)
FAMILIES = ["fox-pro", "fox-llama", "transformer-pro", "transformer-llama"]
BASELINES = {"mamba2": dict(num_heads=8, head_dim=16, state_size=16), "hgrn2": dict(num_heads=2, expand_ratio=16),
             "delta_net": dict(num_heads=2), "samba": dict(num_heads=2, state_size=4)}
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny_model(family, seed=0, **overrides):
    """Baselines in float64: their chunked and step-by-step recurrences round differently."""
    torch.manual_seed(seed)
    config = get_preset(f"{family}-125m", **{**TINY, **BASELINES.get(family, {}), **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    return model.double() if family in BASELINES else model


def prompt(batch=1, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 97, (batch, 4), generator=g)
    return motif.repeat(1, length // 4 + 1)[:, :length]  # repeats: prompt lookup finds candidates


@pytest.mark.parametrize("family", FAMILIES + list(BASELINES))
def test_cache_is_a_transformers_cache_and_crops_exactly(family):
    """After crop the cache equals the cache of the shorter prefix, shift states included, and decoding
    from it gives the logits of a full forward (recurrent states: after the replay of the next call)."""
    model = tiny_model(family)
    ids = prompt(2, 11)
    cache = model.model.new_cache()
    assert isinstance(cache, Cache)
    cache.activate_past_recording()
    model(ids[:, :5], past_key_values=cache)
    model(ids[:, 5:9], past_key_values=cache)
    assert cache.get_seq_length() == 9 and cache.is_croppable
    cache.crop(-3)
    assert cache.get_seq_length() == 6
    short = model.model.new_cache()
    model(ids[:, :6], past_key_values=short)
    for a, b in zip(cache.layers, short.layers) if family not in BASELINES else ():
        for name in ("k", "v", "c", "k_shift", "v_shift"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                torch.testing.assert_close(x, y, msg=name)
    step = model(ids[:, 6:11], past_key_values=cache).logits
    torch.testing.assert_close(step, model(ids).logits[:, 6:], rtol=1e-4, atol=1e-5)
    if family in BASELINES:
        cache.crop(-5)  # back to 6 tokens: the last call began at 5
        cache.crop(-1)
        with pytest.raises(ValueError, match="rolled back only over the calls"):
            cache.crop(-1)  # the state before token 5 is gone
    else:
        cache.crop(4)  # a positive number: the length to keep (transformers 4.x's crop(max_length))
        assert cache.get_seq_length() == 4


def test_crop_needs_the_recorded_past_with_a_token_shift_or_a_recurrence():
    model = tiny_model("fox-pro")
    cache = model.model.new_cache()
    model(prompt(1, 6), past_key_values=cache)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="record_past"):
        cache.crop(-1)
    plain = tiny_model("fox-llama")
    cache = plain.model.new_cache()
    plain(prompt(1, 6), past_key_values=cache)
    assert cache.is_croppable  # no token shift: K, V and the prefix sums are all there is
    cache.crop(-2)
    assert cache.get_seq_length() == 4
    recurrent = tiny_model("hgrn2")
    cache = recurrent.model.new_cache()
    recurrent(prompt(1, 6), past_key_values=cache)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-1)


@pytest.mark.parametrize("family", FAMILIES + list(BASELINES))
def test_assisted_decoding_equals_greedy(family):
    model = tiny_model(family)
    ids = prompt(1, 12)
    plain = model.generate(ids, max_new_tokens=12, **GREEDY)
    for assistant in (tiny_model(family), tiny_model(family, seed=5), tiny_model("fox-llama", seed=7),
                      tiny_model("hgrn2", seed=8).float()):
        assisted = model.generate(ids, assistant_model=assistant, max_new_tokens=12, **GREEDY)
        assert torch.equal(assisted, plain)


@pytest.mark.parametrize("family", FAMILIES + list(BASELINES))
def test_prompt_lookup_decoding_equals_greedy(family):
    model = tiny_model(family)
    ids = prompt(1, 16)
    plain = model.generate(ids, max_new_tokens=16, **GREEDY)
    lookup = model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=16, **GREEDY)
    assert torch.equal(lookup, plain)


@pytest.mark.parametrize("family", ["fox-pro", "transformer-llama", "mamba2", "delta_net"])
def test_beam_search_sequences_score_like_full_forwards(family):
    """Each returned beam's score is its summed log-probability under a full forward (no cache), which
    holds only if the cache followed every beam's reordering."""
    model = tiny_model(family)
    ids = prompt(2, 7)
    out = model.generate(ids, num_beams=3, num_return_sequences=3, max_new_tokens=6, output_scores=True,
                         return_dict_in_generate=True, length_penalty=0.0, **GREEDY)
    seqs = out.sequences
    logp = model(seqs).logits.float().log_softmax(-1)
    new = seqs[:, 7:]
    scores = logp[:, 6:-1].gather(-1, new[..., None])[..., 0].sum(-1)
    torch.testing.assert_close(scores, out.sequences_scores, rtol=1e-4, atol=1e-4)


def test_a_foreign_cache_is_refused_clearly():
    from transformers import DynamicCache

    model = tiny_model("fox-pro")
    with pytest.raises(TypeError, match="FoxCache"):
        model(prompt(1, 4), past_key_values=DynamicCache())
    with pytest.raises(TypeError, match="FoxCache"):
        model.generate(prompt(1, 4), past_key_values=DynamicCache(), max_new_tokens=2, **GREEDY)


@pytest.mark.parametrize("family", FAMILIES + list(BASELINES))
def test_the_cache_does_not_keep_the_prefill_buffers_alive(family):
    """Cached tensors are not views into the prompt's projection outputs (one fused matmul for q, k, v and
    the gates; the convolution's input window), which would keep them alive for every layer."""
    model = tiny_model(family)
    cache = model.model.new_cache()
    with torch.no_grad():
        model(prompt(2, 40), past_key_values=cache)
    for layer in cache.layers:
        tensors = layer.tensors.values() if hasattr(layer, "tensors") else [
            t for t in (layer.k, layer.v, layer.c, layer.k_shift, layer.v_shift) if t is not None]
        for t in tensors:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("family", ["transformer-swa", "fox-pro", "samba"])
def test_windowed_caches_hold_the_window_and_decode_as_greedy(family):
    """A sliding-window model's default cache keeps the last W tokens of each attention layer however long
    the generation (memory O(W)), decodes the tokens of a full forward pass, left padding included, and keeps
    every token where prompt lookup may roll it back."""
    W = 5
    model = tiny_model(family, window_size=W)
    ids = prompt(batch=2, length=9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4 * W, return_dict_in_generate=True, **GREEDY)
    layers = [layer for layer in out.past_key_values.layers if hasattr(layer, "held")]
    assert layers and all(layer.held == W and layer.length == ids.shape[1] + 4 * W - 1 for layer in layers)
    full_mask = torch.cat([mask, torch.ones(2, 4 * W, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        again = model(out.sequences, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1].argmax(-1)
    assert torch.equal(again, out.sequences[:, ids.shape[1]:])
    lookup = model.generate(ids[:1], prompt_lookup_num_tokens=3, max_new_tokens=3 * W, **GREEDY)
    assert torch.equal(lookup, model.generate(ids[:1], max_new_tokens=3 * W, **GREEDY))
