"""generate() against full forwards on every supported transformers release (CI runs this file on the lowest
and the newest): greedy decoding gives the argmax of a full forward without a cache at every step, alone and
in a left-padded batch; the cache is taken under its current name (``cache``) and its older one
(``past_key_values``); an attention mask of the wrong length is refused. Tiny random models of odd shapes."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from fox_models.compat import CACHE_KWARG, output_cache
from fox_models.presets import get_preset

VOCAB = 101
# odd widths, head counts and depths: 3 heads of 16, grouped K/V, 3 layers
SHAPES = dict(hidden_size=48, num_hidden_layers=3, num_heads=3, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
FAMILIES = {"fox-pro": dict(), "fox-llama": dict(), "transformer-pro": dict(),
            "transformer-llama": dict(num_heads=3, num_kv_heads=1)}
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny_model(family, seed=0):
    torch.manual_seed(seed)
    config = get_preset(f"{family}-125m", **{**SHAPES, **FAMILIES[family]})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger random weights than the init's, so that argmax ties are unlikely
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def tokens(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def recompute(model, prompt, new_tokens):
    """Greedy continuation by full forwards without a cache: (1, len + new_tokens)."""
    seq = prompt[None]
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return seq


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generate_equals_full_recompute(family):
    model = tiny_model(family)
    prompt = tokens(7, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(prompt[None], max_new_tokens=11, **GREEDY)
    assert torch.equal(out, recompute(model, prompt, 11))
    # the model hands generate() its cache under the name this release reads: no renaming, no warning
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("family", ["fox-pro", "transformer-pro", "transformer-llama"])
def test_left_padded_batch_generates_the_full_recompute_of_each_prompt(family):
    model = tiny_model(family, seed=2)
    prompts = [tokens(n, seed=10 + n) for n in (5, 9, 2)]
    width, new = max(len(p) for p in prompts), 6
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, **GREEDY)
    for i, p in enumerate(prompts):
        assert torch.equal(out[i, width:], recompute(model, p, new)[0, len(p):]), i


def test_the_cache_is_taken_under_either_name():
    model = tiny_model("fox-pro")
    ids = tokens(8, seed=3)[None]
    full = model(ids).logits
    for name in ("cache", "past_key_values"):
        cache = model.model.new_cache()
        first = model(ids[:, :5], **{name: cache})
        assert output_cache(first) is cache and cache.get_seq_length() == 5
        rest = model(ids[:, 5:], **{name: cache}).logits
        torch.testing.assert_close(torch.cat([first.logits, rest], 1), full, atol=1e-4, rtol=1e-4)
        backbone = model.model(ids[:, :5], **{name: model.model.new_cache()})
        assert output_cache(backbone).get_seq_length() == 5
    with pytest.raises(ValueError, match="not both"):
        model(ids, cache=model.model.new_cache(), past_key_values=model.model.new_cache())
    assert CACHE_KWARG in ("cache", "past_key_values")


def test_generate_continues_a_given_cache_under_either_name():
    model = tiny_model("transformer-pro")
    prompt = tokens(6, seed=4)
    want = recompute(model, prompt, 5)
    for name in ("cache", "past_key_values"):
        cache = model.model.new_cache()
        out = model.generate(prompt[None], max_new_tokens=5, **{name: cache}, **GREEDY)
        assert torch.equal(out, want), name
        assert cache.get_seq_length() == 6 + 5 - 1  # the last token is not fed back


@pytest.mark.parametrize("width", [9, 5, 3])
def test_an_attention_mask_of_the_wrong_length_is_refused(width):
    model = tiny_model("fox-llama")
    ids = tokens(6, seed=5)[None]
    with pytest.raises(ValueError, match=rf"^attention_mask must have shape \(1, 6\) .*got \(1, {width}\)$"):
        model(ids, attention_mask=torch.ones(1, width, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"attention_mask must have shape \(1, 6\) .*got \(1, {width}\)"):
        model.model(ids, attention_mask=torch.ones(1, width, dtype=torch.long))
    cache = model.model.new_cache()
    model(ids, cache=cache)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(1, 8\) \(batch, 6 cached \+ 2 new"):
        model(tokens(2, seed=6)[None], attention_mask=torch.ones(1, width, dtype=torch.long), cache=cache)


def test_generate_refuses_a_mask_shorter_than_the_prompt():
    model = tiny_model("fox-pro")
    ids = tokens(6, seed=7)[None]
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(1, 6\) .*got \(1, 4\)"):
        model.generate(ids, attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, **GREEDY)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(2, 6\) .*got \(1, 6\)"):
        model(ids.expand(2, -1), attention_mask=torch.ones(1, 6, dtype=torch.long))


@pytest.mark.parametrize("name", ["mamba2-tiny", "hgrn2-tiny", "delta_net-tiny"])
def test_recurrent_backbones_take_the_cache_under_either_name(name):
    """A recurrent backbone continues from the cache it is given as ``cache`` or as ``past_key_values``: two
    chunks through the cache give the hidden states of one pass over both."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(get_preset(name, vocab_size=101)).eval()
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        full = model.model(ids).last_hidden_state
        for key in ("cache", "past_key_values"):
            cache = model.model.new_cache()
            first = model.model(ids[:, :5], use_cache=True, **{key: cache}).last_hidden_state
            second = model.model(ids[:, 5:], use_cache=True, **{key: cache}).last_hidden_state
            assert cache.get_seq_length() == 9, key
            torch.testing.assert_close(torch.cat([first, second], dim=1), full, rtol=1e-4, atol=1e-5)
