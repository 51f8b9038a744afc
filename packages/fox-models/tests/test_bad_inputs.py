"""Bad inputs to every model family end in one line naming the argument, or in a correct result: config values
the attention layer would not act on (``fgate_type``, ``ogate_act``), token ids outside the vocabulary, of a
float dtype or of the wrong rank, and prompts of 0 tokens (issue #49). Tiny models of each family (odd
vocabulary, batch and lengths); correct results are compared with a computation that does not take the path
under test (a full forward, the formula of the output gate)."""

import pytest
import torch

from fox_layers import ForgettingAttentionLayer, attention
from fox_models import base
from fox_models.fox.configuration import FGATE_TYPES, OGATE_ACTS, ForgettingTransformerConfig
from fox_models.presets import get_preset
from fox_models.registry import MODELS, model_entry

VOCAB = 37
FAMILIES = [next(iter(e.tiny)) for e in MODELS]  # one tiny preset of each family
DECAY_TIMES = dict(decay_time_min=2.0, decay_time_max=50.0)
_models = {}


def _model(preset):
    """The tiny ``preset`` with a vocabulary of ``VOCAB``, eval mode, float64 (built once per test run)."""
    if preset not in _models:
        torch.manual_seed(0)
        config = get_preset(preset, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
        _models[preset] = model_entry(config).lm_class(config).double().eval()
    return _models[preset]


def _ids(batch, n, seed=0):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _one_line(error):
    assert "\n" not in str(error.value), str(error.value)


# ------------------------------------------------------------------------------------ fgate_type, ogate_act


@pytest.mark.parametrize("field, value, allowed", [
    ("fgate_type", "bogus", FGATE_TYPES), ("fgate_type", "Full", FGATE_TYPES), ("fgate_type", None, FGATE_TYPES),
    ("fgate_type", "", FGATE_TYPES), ("ogate_act", "relu", OGATE_ACTS), ("ogate_act", "swish", OGATE_ACTS),
    ("ogate_act", "SiLU", OGATE_ACTS), ("ogate_act", None, OGATE_ACTS), ("ogate_act", 1, OGATE_ACTS),
])
def test_unknown_gate_settings_are_refused_by_the_config(field, value, allowed):
    with pytest.raises(ValueError) as error:
        ForgettingTransformerConfig(**{field: value})
    assert str(error.value) == f"{field} must be one of {allowed}, got {value!r}"
    _one_line(error)


def test_the_configs_allowed_gate_settings_are_the_layers():
    """Every value the config lets through builds the layer, and the layer refuses the values the config refuses."""
    assert FGATE_TYPES == attention.FGATE_TYPES
    assert OGATE_ACTS == ("sigmoid", "silu")
    for act in ("relu", "tanh"):
        with pytest.raises(ValueError, match="ogate_act"):
            ForgettingAttentionLayer(32, 4, ogate_act=act)
    for fgate_type in FGATE_TYPES:
        for act in OGATE_ACTS:
            ForgettingAttentionLayer(32, 4, fgate_type=fgate_type, ogate_act=act, use_output_gate=True, **DECAY_TIMES)


@pytest.mark.parametrize("fgate_type", FGATE_TYPES)
@pytest.mark.parametrize("ogate_act", OGATE_ACTS)
def test_every_allowed_gate_setting_reaches_every_layer(fgate_type, ogate_act):
    config = get_preset("fox-pro-tiny", vocab_size=VOCAB, fgate_type=fgate_type, ogate_act=ogate_act, **DECAY_TIMES)
    model = model_entry(config).lm_class(config).eval()
    layers = [m for m in model.modules() if isinstance(m, ForgettingAttentionLayer)]
    assert len(layers) == config.num_hidden_layers
    assert all(la.fgate_type == fgate_type and la.ogate_act == ogate_act for la in layers)
    with torch.no_grad():
        assert torch.isfinite(model(_ids(2, 5)).logits).all()


@pytest.mark.parametrize("kwargs, init", [
    (dict(fgate_type="bias_only"), "fgate_type='bias_only'"), (dict(fgate_type="fixed"), "fgate_type='fixed'"),
    (dict(fgate_type="fixed", decay_time_min=2.0), "fgate_type='fixed'"),
    (dict(fgate_type="full", fgate_bias_init=True, decay_time_max=9.0), "fgate_type='full' with fgate_bias_init=True"),
])
def test_a_decay_time_init_without_both_times_is_refused_by_the_config(kwargs, init):
    with pytest.raises(ValueError) as error:
        ForgettingTransformerConfig(**kwargs)
    lo, hi = kwargs.get("decay_time_min"), kwargs.get("decay_time_max")
    assert str(error.value) == (f"decay_time_min and decay_time_max must both be set for {init} (the gate bias's "
                                f"decay-time init), got {lo!r} and {hi!r}")
    _one_line(error)


@pytest.mark.parametrize("ogate_act", OGATE_ACTS)
def test_the_output_gate_applies_the_configured_activation(ogate_act):
    """A layer without output norm multiplies by act(ogate_proj(x)) before o_proj: act is the config's."""
    config = get_preset("fox-llama-tiny", vocab_size=VOCAB, use_output_gate=True, ogate_act=ogate_act)
    layer = model_entry(config).lm_class(config).double().eval().model.layers[0].attn
    torch.manual_seed(1)
    o, x = torch.randn(3, 5, 128, dtype=torch.float64), torch.randn(3, 5, 128, dtype=torch.float64)
    g = x @ layer.ogate_proj.weight.T
    act = torch.sigmoid(g) if ogate_act == "sigmoid" else g * torch.sigmoid(g)
    with torch.no_grad():
        torch.testing.assert_close(layer._output(o, x), (o * act) @ layer.o_proj.weight.T, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------ input ids


@pytest.mark.parametrize("preset", FAMILIES)
def test_input_ids_outside_the_vocabulary_are_named_by_every_family(preset):
    model = _model(preset)
    ids = _ids(3, 7)
    for bad in (VOCAB, VOCAB + 5, -1, -100):
        wrong = ids.clone()
        wrong[2, 4] = bad
        lo, hi = int(wrong.min()), int(wrong.max())
        expected = f"input_ids must lie in [0, vocab_size) = [0, {VOCAB}), got values in [{lo}, {hi}]"
        for call in (lambda: model(wrong), lambda: model.model(input_ids=wrong),
                     lambda: model.generate(wrong, max_new_tokens=2, do_sample=False, pad_token_id=0)):
            with torch.no_grad(), pytest.raises(ValueError) as error:
                call()
            assert str(error.value) == expected
            _one_line(error)


@pytest.mark.parametrize("preset", FAMILIES)
def test_a_decoding_step_outside_the_vocabulary_is_named(preset):
    model = _model(preset)
    with torch.no_grad():
        cache = model(_ids(2, 5), use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"^input_ids must lie in \[0, vocab_size\) = \[0, 37\), got values in \[3, 37\]$"):
            model(torch.tensor([[3], [VOCAB]]), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("preset", FAMILIES)
def test_the_ends_of_the_vocabulary_and_int32_ids_give_the_int64_result(preset):
    model = _model(preset)
    ids = _ids(3, 6, seed=2)
    ids[0, 0], ids[1, 5] = 0, VOCAB - 1
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.isfinite(ref).all()
        torch.testing.assert_close(model(ids.to(torch.int32)).logits, ref, rtol=0, atol=0)
        # the same function as the embedding looked up by hand
        emb = model.get_input_embeddings().weight[ids]
        torch.testing.assert_close(model(inputs_embeds=emb).logits, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool, torch.int16, torch.uint8])
def test_input_ids_of_another_dtype_are_a_type_error(preset, dtype):
    model = _model(preset)
    for call in (lambda ids: model(ids), lambda ids: model.model(input_ids=ids)):
        with torch.no_grad(), pytest.raises(TypeError) as error:
            call(_ids(2, 3).to(dtype))
        assert str(error.value) == f"input_ids must be token ids of dtype torch.int64 or torch.int32, got {dtype}"
        _one_line(error)


@pytest.mark.parametrize("preset", FAMILIES)
def test_input_ids_of_the_wrong_rank_or_type_are_named(preset):
    model = _model(preset)
    for ids in (torch.tensor([1, 2, 3]), torch.ones(2, 3, 1, dtype=torch.long), torch.tensor(4)):
        with torch.no_grad(), pytest.raises(ValueError) as error:
            model(ids)
        assert str(error.value) == f"input_ids must be 2-D (batch, tokens), got shape {tuple(ids.shape)}"
    with pytest.raises(TypeError, match=r"^input_ids must be a torch.Tensor of token ids, got list$"):
        model([[1, 2, 3]])
    for shape in ((2, 3, 127), (2, 3), (2, 3, 128, 1)):
        with torch.no_grad(), pytest.raises(ValueError) as error:
            model(inputs_embeds=torch.zeros(shape, dtype=torch.float64))
        assert str(error.value) == (f"inputs_embeds must have shape (batch, tokens, hidden_size=128), got {shape}")
        _one_line(error)


def test_token_values_are_read_only_where_that_costs_no_wait(monkeypatch):
    """Where ``values_checkable`` says no (CUDA tensors, tracing) the ids are not read: the embedding's own
    bounds check is what reports a bad id; dtype and rank are still checked."""
    model = _model(FAMILIES[0])
    monkeypatch.setattr(base, "values_checkable", lambda t: False)
    wrong = _ids(2, 4)
    wrong[1, 1] = VOCAB
    with torch.no_grad():
        with pytest.raises(IndexError):
            model(wrong)
        with pytest.raises(TypeError, match="input_ids must be token ids"):
            model(wrong.float())


# ------------------------------------------------------------------------------------------- empty prompts


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_forward_of_no_tokens_returns_empty_outputs(preset, batch):
    model = _model(preset)
    with torch.no_grad():
        out = model(torch.zeros(batch, 0, dtype=torch.long), output_hidden_states=True)
        assert out.logits.shape == (batch, 0, VOCAB)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        assert all(h.shape == (batch, 0, model.config.hidden_size) for h in out.hidden_states)
        assert model(inputs_embeds=torch.zeros(batch, 0, 128, dtype=torch.float64)).logits.shape == (batch, 0, VOCAB)


@pytest.mark.parametrize("preset", FAMILIES)
def test_a_chunk_of_no_tokens_leaves_the_cache_as_it_was(preset):
    """Empty chunks before, between and after the prompt's chunks: the logits are those of the same chunks
    without the empty ones, and those of one full forward (to float32 accuracy: a decoding cache keeps FoX's
    prefix sums in float32)."""
    model = _model(preset)
    ids = _ids(3, 9, seed=3)
    empty = ids[:, :0]

    def chunked(chunks):
        cache, steps = None, []
        for chunk in chunks:
            out = model(chunk, past_key_values=cache, use_cache=True)
            assert out.logits.shape == (3, chunk.shape[1], VOCAB)
            cache = out.past_key_values
            steps.append(out.logits)
            assert cache.get_seq_length() == sum(s.shape[1] for s in steps)
        return torch.cat(steps, 1)

    with torch.no_grad():
        full = model(ids).logits
        with_empty = chunked([empty, ids[:, :4], empty, ids[:, 4:5], empty, empty, ids[:, 5:], empty])
        without = chunked([ids[:, :4], ids[:, 4:5], ids[:, 5:]])
    torch.testing.assert_close(with_empty, without, rtol=0, atol=0)
    torch.testing.assert_close(with_empty, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("preset", FAMILIES)
def test_generate_refuses_an_empty_prompt_in_one_line(preset):
    model = _model(preset)
    greedy = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    for batch in (1, 2):
        with torch.no_grad(), pytest.raises(ValueError) as error:
            model.generate(torch.zeros(batch, 0, dtype=torch.long), **greedy)
        assert str(error.value) == (f"input_ids must hold at least one token per row for generate(), got shape "
                                    f"({batch}, 0) (start the prompt with the BOS token, bos_token_id=0)")
        _one_line(error)
    with torch.no_grad(), pytest.raises(ValueError, match=r"^inputs_embeds must hold at least one token per row"):
        model.generate(inputs_embeds=torch.zeros(1, 0, 128, dtype=torch.float64), **greedy)
    with torch.no_grad():  # one token is a prompt: greedy generation equals an argmax over full forwards
        ids = torch.tensor([[0]])
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
        ref = ids
        for _ in range(3):
            ref = torch.cat([ref, model(ref).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, ref)


def test_recurrent_ops_take_no_tokens():
    """The short convolution and the scans return empty outputs for 0 tokens and the state they were given."""
    from fox_models.recurrent_ops import (
        delta_rule,
        gated_linear_attention,
        head_gated_linear_attention,
        short_conv,
    )

    torch.manual_seed(0)
    x, w, state = torch.randn(2, 0, 5), torch.randn(5, 1, 4), torch.randn(2, 3, 5)
    y, s = short_conv(x, w, state)
    assert y.shape == (2, 0, 5) and torch.equal(s, state)
    y, s = short_conv(x, w)
    assert y.shape == (2, 0, 5) and torch.equal(s, torch.zeros(2, 3, 5))
    q, v, S = torch.randn(2, 0, 3, 4), torch.randn(2, 0, 3, 6), torch.randn(2, 3, 4, 6)
    o, s = gated_linear_attention(q, q, v, q, 0.5, S)
    assert o.shape == (2, 0, 3, 6) and torch.equal(s, S)
    o, s = head_gated_linear_attention(q, q, v, q[..., 0], 0.5, S)
    assert o.shape == (2, 0, 3, 6) and torch.equal(s, S)
    o, s = delta_rule(q, q, v, q[..., 0], 0.5, S, l2_normalize_qk=True)
    assert o.shape == (2, 0, 3, 6) and torch.equal(s, S)
