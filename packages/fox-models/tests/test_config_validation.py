"""Config fields out of range raise one ValueError line naming the field, what was expected and what came (a
ConfigFieldError carrying the field's keyword argument where one field is refused); the released and preset
configs still build. Token ids outside the vocabulary are named as such (CPU tensors)."""

import pickle

import pytest

from fox_models.configuration_base import ConfigFieldError
from fox_models.delta_net.configuration import DeltaNetConfig
from fox_models.fox.configuration import ForgettingTransformerConfig
from fox_models.hgrn2.configuration import HGRN2Config
from fox_models.mamba2.configuration import Mamba2Config
from fox_models.presets import PRESETS, TINY_PRESETS, get_preset
from fox_models.registry import MODELS
from fox_models.samba.configuration import SambaConfig
from fox_models.transformer.configuration import TransformerConfig

by_family = pytest.mark.parametrize("cls", [e.config_class for e in MODELS], ids=lambda c: c.model_type)
LAYOUT = [ForgettingTransformerConfig, TransformerConfig, HGRN2Config, DeltaNetConfig]


def _one_line(error):
    assert "\n" not in str(error.value)


@by_family
@pytest.mark.parametrize("field, value, expected", [
    ("num_hidden_layers", -1, "an int >= 1"), ("num_hidden_layers", 0, "an int >= 1"),
    ("vocab_size", 0, "an int >= 1"), ("vocab_size", -5, "an int >= 1"), ("vocab_size", 12.5, "an int >= 1"),
    ("hidden_size", -1, "an int >= 1"), ("hidden_size", 0, "an int >= 1"),
    ("initializer_range", -0.02, "a finite number >= 0"),
])
def test_shared_fields_out_of_range(cls, field, value, expected):
    with pytest.raises(ConfigFieldError, match=rf"^{field} must be {expected}, got {value!r}$") as error:
        cls(**{field: value})
    _one_line(error)
    assert error.value.field == field


@pytest.mark.parametrize("cls", LAYOUT, ids=lambda c: c.model_type)
@pytest.mark.parametrize("field, value, expected", [
    ("norm_eps", -1, "a finite number > 0"), ("norm_eps", 0.0, "a finite number > 0"),
    ("norm_eps", float("nan"), "a finite number > 0"), ("hidden_ratio", 0, "a finite number > 0"),
    ("hidden_ratio", -2.0, "a finite number > 0"), ("intermediate_size", 0, "an int >= 1 or None"),
    ("max_position_embeddings", -1, "an int >= 1 or None"),
])
def test_layout_fields_out_of_range(cls, field, value, expected):
    with pytest.raises(ConfigFieldError, match=rf"^{field} must be {expected}, got {value!r}$") as error:
        cls(**{field: value})
    _one_line(error)
    assert error.value.field == field


def test_hidden_ratio_may_be_none_with_an_intermediate_size():
    assert ForgettingTransformerConfig(hidden_ratio=None, intermediate_size=512).intermediate_size == 512


@pytest.mark.parametrize("cls, kwargs, pattern", [
    (ForgettingTransformerConfig, dict(decay_time_min=10.0, decay_time_max=2.0),
     r"decay_time_min must be <= decay_time_max 2.0, got 10.0"),
    (ForgettingTransformerConfig, dict(decay_time_min=-1.0), r"decay_time_min must be a finite number > 0 or None"),
    (ForgettingTransformerConfig, dict(decay_time_max=float("inf")), r"decay_time_max must be a finite number > 0"),
    (ForgettingTransformerConfig, dict(hidden_size=100, num_heads=3), r"hidden_size must be a multiple of num_heads 3, got 100"),
    (ForgettingTransformerConfig, dict(num_heads=-4), r"num_heads must be an int >= 1, got -4"),
    (ForgettingTransformerConfig, dict(num_heads=8, num_kv_heads=3), r"num_heads must be a multiple of num_kv_heads 3, got 8"),
    (ForgettingTransformerConfig, dict(num_kv_heads=0), r"num_kv_heads must be an int >= 1 or None, got 0"),
    (ForgettingTransformerConfig, dict(rope_base=0.0), r"rope_base must be a finite number > 0, got 0.0"),
    (ForgettingTransformerConfig, dict(log_pruning_tolerance=2.0), r"log_pruning_tolerance must be a finite negative"),
    (TransformerConfig, dict(hidden_size=96, num_heads=7), r"hidden_size must be a multiple of num_heads 7, got 96"),
    # built, then failed at the first forward (RoPE's pairs of channels; the kernel's head dims)
    (TransformerConfig, dict(hidden_size=126, num_heads=2),
     r"hidden_size / num_heads \(the head dim\) must be even with RoPE, got 126 / 2 = 63"),
    (ForgettingTransformerConfig, dict(use_rope=True, hidden_size=130, num_heads=2),
     r"hidden_size / num_heads \(the head dim\) must be even with RoPE, got 130 / 2 = 65"),
    (ForgettingTransformerConfig, dict(hidden_size=1200, num_heads=2),
     r"hidden_size / num_heads \(the head dim\) must be at most 256, got 1200 / 2 = 600"),
    (TransformerConfig, dict(num_heads=0), r"num_heads must be an int >= 1, got 0"),
    (DeltaNetConfig, dict(num_heads=3), r"int\(hidden_size \* expand_k\) must be a positive multiple of num_heads 3"),
    (DeltaNetConfig, dict(expand_v=0), r"expand_v must be a finite number > 0, got 0"),
    (DeltaNetConfig, dict(num_heads=-1), r"num_heads must be an int >= 1, got -1"),
    (HGRN2Config, dict(num_heads=3), r"hidden_size must be a multiple of num_heads 3, got 2048"),
    (HGRN2Config, dict(expand_ratio=-1), r"expand_ratio must be an int >= 1 or None, got -1"),
    (HGRN2Config, dict(expand_ratio=4096), r"expand_ratio must be <= hidden_size 2048 .*got 4096"),
    (Mamba2Config, dict(n_groups=0), r"n_groups must be an int >= 1, got 0"),
    (Mamba2Config, dict(state_size=-1), r"state_size must be an int >= 1, got -1"),
    (Mamba2Config, dict(layer_norm_epsilon=-1e-5), r"layer_norm_epsilon must be a finite number > 0"),
    (Mamba2Config, dict(time_step_min=0.5, time_step_max=0.1), r"time_step_min must be <= time_step_max 0.1, got 0.5"),
    (Mamba2Config, dict(hidden_size=-1), r"hidden_size must be an int >= 1, got -1"),
    (SambaConfig, dict(num_heads=0), r"attn num_heads must be an int >= 1, got 0"),
    (SambaConfig, dict(num_heads=5), r"hidden_size must be a multiple of attn num_heads 5, got 2304"),
    (SambaConfig, dict(num_heads=4, num_kv_heads=3), r"attn num_heads must be a multiple of attn num_kv_heads 3"),
    (SambaConfig, dict(state_size=0), r"state_size must be an int >= 1, got 0"),
    (SambaConfig, dict(norm_eps=-1.0), r"norm_eps must be a finite number > 0, got -1.0"),
    (SambaConfig, dict(mamba_hidden_ratio=0), r"mamba_hidden_ratio must be a finite number > 0 or None, got 0"),
])
def test_family_fields_out_of_range(cls, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as error:
        cls(**kwargs)
    _one_line(error)


@pytest.mark.parametrize("cls, kwargs, field", [
    (ForgettingTransformerConfig, dict(hidden_size=100, num_heads=3), "hidden_size"),
    (ForgettingTransformerConfig, dict(num_heads=8, num_kv_heads=3), "num_heads"),
    (ForgettingTransformerConfig, dict(fgate_type="nope"), "fgate_type"),
    (ForgettingTransformerConfig, dict(fgate_type="bias_only"), "decay_time_min"),
    (ForgettingTransformerConfig, dict(log_pruning_tolerance=2.0), "log_pruning_tolerance"),
    (ForgettingTransformerConfig, dict(window_size=0), "window_size"),
    (DeltaNetConfig, dict(use_gate=True), "use_gate"),
    (HGRN2Config, dict(expand_ratio=4096), "expand_ratio"),
    (HGRN2Config, dict(use_short_conv=True), "use_short_conv"),
    (Mamba2Config, dict(num_heads=3), "num_heads"),
    (Mamba2Config, dict(time_step_min=0.5, time_step_max=0.1), "time_step_min"),
    (SambaConfig, dict(num_heads=4, window_size=0), "window_size"),
    (SambaConfig, dict(num_heads=0), "attn"),
    (SambaConfig, dict(attn=dict(num_heads=4, layers=[1])), "attn"),
    (SambaConfig, dict(time_step_init_scheme="nope"), "time_step_init_scheme"),
])
def test_a_refused_value_names_its_keyword_argument(cls, kwargs, field):
    """The field a caller names in its own terms (fox-train: ``model.overrides.use_gate``); the message begins
    with it."""
    with pytest.raises(ConfigFieldError) as error:
        cls(**kwargs)
    assert error.value.field == field and str(error.value).startswith(field)
    copy = pickle.loads(pickle.dumps(error.value))
    assert (copy.field, str(copy)) == (field, str(error.value))


@pytest.mark.parametrize("cls, kwargs", [
    (DeltaNetConfig, dict(num_heads=3)),  # int(hidden_size * expand_k) and num_heads
    (HGRN2Config, dict(num_heads=None, expand_ratio=None)),  # one of two
])
def test_a_refusal_of_no_one_field_is_a_plain_value_error(cls, kwargs):
    with pytest.raises(ValueError) as error:
        cls(**kwargs)
    assert not isinstance(error.value, ConfigFieldError)


@pytest.mark.parametrize("name", PRESETS + TINY_PRESETS)
def test_every_preset_builds_and_round_trips(name):
    config = get_preset(name)
    assert type(config).from_dict(config.to_dict()).to_diff_dict() == config.to_diff_dict()


@pytest.mark.parametrize("name", ["fox-pro-tiny", "transformer-llama-tiny"])
def test_input_ids_outside_the_vocabulary_name_the_range(name):
    import torch

    from fox_models.registry import model_entry

    torch.manual_seed(0)
    config = get_preset(name, vocab_size=50)
    model = model_entry(config).lm_class(config).eval()
    ids = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
        for bad, got in ((50, r"\[\d+, 50\]"), (-1, r"\[-1, \d+\]")):
            wrong = ids.clone()
            wrong[1, 3] = bad
            with pytest.raises(ValueError, match=rf"^input_ids must lie in \[0, vocab_size\) = \[0, 50\), got values in {got}$"):
                model(wrong)
