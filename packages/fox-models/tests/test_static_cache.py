"""The static cache (``generate(..., cache_implementation="static")``): fixed-capacity buffers written in
place, equal to the growing cache token for token; on a GPU its decoding steps replay a CUDA graph."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from fox_models.presets import get_preset
from fox_models.static_cache import StaticFoxCache

TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=97, bos_token_id=1, eos_token_id=2)
FAMILIES = ["fox-pro", "fox-llama", "transformer-llama", "transformer-swa"]
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny_model(family, device="cpu", dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    extra = dict(window_size=5) if family == "transformer-swa" else {}
    config = get_preset(f"{family}-125m", **{**TINY, **extra, **overrides})
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def left_padded(lengths, seed=1, device="cpu"):
    """Random prompts of the given lengths, left-padded to the longest: (ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, 97, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids.to(device), mask.to(device)


def _generate(model, ids, mask, new_tokens, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         output_logits=True, return_dict_in_generate=True, **GREEDY, **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_generates_what_the_growing_cache_does(family):
    """Left-padded batch of odd lengths: the same tokens and the same logits at every step (RoPE positions,
    token shift, sliding window and padding all read from the static buffers)."""
    model = tiny_model(family)
    ids, mask = left_padded([7, 3, 11])
    want_tokens, want_logits = _generate(model, ids, mask, 9)
    tokens, logits = _generate(model, ids, mask, 9, cache_implementation="static")
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    cache = model._static_cache
    assert isinstance(cache, StaticFoxCache) and cache.capacity == 11 + 9 - 1
    assert cache.get_seq_length() == 11 + 9 - 1 and cache.layers[0].k.shape[1] == cache.capacity
    # prefix sums head-major, as the decoding kernel reads best, in every layer
    assert all(layer.c.shape[1] == cache.capacity and layer.c.stride(1) == 1 for layer in cache.layers)
    # a second call of the same shape reuses the buffers (emptied): same result
    buffers = [layer.k.data_ptr() for layer in cache.layers]
    again, again_logits = _generate(model, ids, mask, 9, cache_implementation="static")
    assert model._static_cache is cache and [layer.k.data_ptr() for layer in cache.layers] == buffers
    assert torch.equal(again, want_tokens)
    torch.testing.assert_close(again_logits, want_logits, rtol=1e-5, atol=1e-5)
    # another prompt in the same buffers: no state of the first leaks in
    ids2, mask2 = left_padded([11, 11, 2], seed=5)
    want2, _ = _generate(model, ids2, mask2, 9)
    got2, _ = _generate(model, ids2, mask2, 9, cache_implementation="static")
    assert torch.equal(got2, want2)


@pytest.mark.parametrize("family", FAMILIES)
def test_reused_static_cache_starts_from_nothing_without_padding(family):
    """Prompts without padding (no attention mask), one after another in the same buffers: each call's
    step logits are the full forward's over its own sequence (nothing of the previous call, such as the
    token shift's last token, reaches the next prefill)."""
    model = tiny_model(family)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        ids = torch.randint(3, 97, (2, 6), generator=g)
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, output_logits=True,
                             return_dict_in_generate=True, cache_implementation="static", **GREEDY)
        full = model(out.sequences).logits[:, 5:-1]
        torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-4, atol=1e-4)
        assert torch.equal(out.sequences[:, 6:], full.argmax(-1))


def test_static_cache_forward_equals_the_full_forward():
    """Chunks appended by hand: logits of each chunk equal the full forward's; cached lengths on the host
    and on the device agree."""
    model = tiny_model("fox-pro")
    ids, _ = left_padded([13])
    full = model(ids).logits
    cache = model.static_cache(20)
    chunks, start = [5, 1, 4, 1, 2], 0
    for n in chunks:
        out = model(ids[:, start:start + n], past_key_values=cache).logits
        torch.testing.assert_close(out, full[:, start:start + n], rtol=1e-5, atol=1e-5)
        start += n
        assert cache.get_seq_length() == start
        assert cache.layers[0].cache_seqlens.tolist() == [start]


def test_static_cache_refuses_what_it_cannot_hold():
    model = tiny_model("fox-pro")
    ids, _ = left_padded([6])
    cache = model.static_cache(8)
    model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match=r"^the static cache holds 8 tokens per row; 6 cached \+ 3 new do not fit"):
        model(ids[:, :3], past_key_values=cache)
    llama = tiny_model("fox-llama")
    llama_cache = llama.static_cache(8)
    llama(ids[:, :2], past_key_values=llama_cache)
    for m, c in ((llama, llama_cache), (model, cache)):  # FoX (Pro)'s token shift failed in a torch.cat
        with pytest.raises(ValueError, match=r"^hidden_states has 2 rows but the state holds 1 \(one per sequence"):
            m(torch.cat([ids[:, :1]] * 2), past_key_values=c)
    with pytest.raises(ValueError, match="output_attentions needs the default cache"):
        model(ids[:, :1], past_key_values=cache, output_attentions=True)
    with pytest.raises(ValueError, match="cannot roll back tokens"):
        cache.crop(-2)
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        StaticFoxCache(2, 0)
    mamba = AutoModelForCausalLM.from_config(get_preset("mamba2-125m", **{**TINY, "num_heads": 8, "head_dim": 16}))
    with pytest.raises(ValueError, match="a static cache is for the attention models"):
        mamba.generate(ids, max_new_tokens=2, cache_implementation="static", **GREEDY)


def test_static_cache_crops_without_a_token_shift():
    """FoX (LLaMA) has no token shift: cropping sets the lengths back, and decoding goes on exactly."""
    model = tiny_model("fox-llama")
    ids, _ = left_padded([10])
    full = model(ids).logits
    cache = model.static_cache(12)
    model(ids[:, :8], past_key_values=cache)
    cache.crop(-3)
    assert cache.get_seq_length() == 5 and cache.layers[1].cache_seqlens.tolist() == [5]
    torch.testing.assert_close(model(ids[:, 5:10], past_key_values=cache).logits, full[:, 5:10], rtol=1e-5, atol=1e-5)


def test_static_cache_beam_search_equals_the_growing_cache():
    model = tiny_model("fox-pro")
    ids, mask = left_padded([6, 4])
    kwargs = dict(max_new_tokens=5, num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=0,
                  attention_mask=mask)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kwargs), model.generate(ids, **kwargs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decoding_equals_eager_decoding(family, dtype):
    """Replayed steps (of the step not compiled) give the eager static cache's logits (the same kernels, so
    bit for bit) and the growing cache's tokens; a second call replays the graph captured by the first."""
    model = tiny_model(family, device="cuda", dtype=dtype, hidden_size=128, num_heads=2)
    ids, mask = left_padded([37, 5, 64], device="cuda")
    want, want_logits = _generate(model, ids, mask, 20)
    tokens, logits = _generate(model, ids, mask, 20, cache_implementation="static", disable_compile=True)
    cache = model._static_cache
    assert cache._graph is not None and cache.compile_config is None
    cache.graphs = False
    eager, eager_logits = _generate(model, ids, mask, 20, cache_implementation="static", disable_compile=True)
    torch.testing.assert_close(logits, eager_logits, rtol=0, atol=0)
    assert torch.equal(tokens, eager)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(logits, want_logits, rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert torch.equal(tokens, want)
    cache.graphs = True
    graph = cache._graph[1]
    again, _ = _generate(model, ids, mask, 20, cache_implementation="static", disable_compile=True)
    assert cache._graph[1] is graph and torch.equal(again, tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decoding_step_equals_the_eager_step(family):
    """On a GPU generate() compiles the static cache's decoding step before capturing it (transformers'
    auto-compile switch): its logits equal the eager step's up to rounding, its tokens the growing
    cache's, also for a second prompt of another length and padding."""
    model = tiny_model(family, device="cuda", dtype=torch.float32, hidden_size=128, num_heads=2)
    for lengths, seed in (([37, 5, 64], 1), ([12, 30, 3], 2)):
        ids, mask = left_padded(lengths, seed=seed, device="cuda")
        want, _ = _generate(model, ids, mask, 20)
        eager, eager_logits = _generate(model, ids, mask, 20, cache_implementation="static", disable_compile=True)
        tokens, logits = _generate(model, ids, mask, 20, cache_implementation="static")
        cache = model._static_cache
        assert cache.compile_config is not None and cache._graph is not None
        torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(tokens, want) and torch.equal(eager, want)


def test_generate_chooses_whether_the_static_step_is_compiled(monkeypatch):
    """transformers' auto-compile switch decides: on a GPU the static cache gets a compile config (the given
    one, or transformers' default), with disable_compile=True or on the CPU none; the whole forward is never
    handed to transformers' compiler."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    from fox_models.compat import CACHE_KWARG

    model = tiny_model("fox-llama")
    cache = model.static_cache(8)
    kwargs = {CACHE_KWARG: cache}  # generate()'s model_kwargs
    assert model._valid_auto_compile_criteria(kwargs, GenerationConfig()) is False
    assert cache.compile_config is None  # on the CPU
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    assert model._valid_auto_compile_criteria(kwargs, GenerationConfig()) is False
    assert isinstance(cache.compile_config, CompileConfig)
    mine = CompileConfig(fullgraph=True, backend="eager")
    model._valid_auto_compile_criteria(kwargs, GenerationConfig(compile_config=mine))
    assert cache.compile_config is mine
    model._valid_auto_compile_criteria(kwargs, GenerationConfig(compile_config=mine, disable_compile=True))
    assert cache.compile_config is None
