"""Bad inputs to every model family end in one line naming the argument, or in a correct result: config values
the attention layer would not act on (``fgate_type``, ``ogate_act``), token ids outside the vocabulary, of a
float dtype or of the wrong rank, and prompts of 0 tokens (issue #49). Tiny models of each family (odd
vocabulary, batch and lengths); correct results are compared with a computation that does not take the path
under test (a full forward, the formula of the output gate)."""

import pytest
import torch

from fox_layers import ForgettingAttentionLayer, attention
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

