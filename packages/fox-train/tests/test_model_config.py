"""``model_config``: a value the model's config refuses is named as the command line sets it
(``model.FIELD``, ``model.overrides.FIELD``), by the field fox-models' ConfigFieldError carries; a refusal of
no one field (or of one fox-train does not set) names the preset."""

import pytest

from fox_train.config import ModelConfig, model_config, preset_fields


@pytest.mark.parametrize("preset, fields, overrides, message", [
    ("fox-pro-tiny", dict(hidden_size=-1), {}, "model.hidden_size must be an int >= 1, got -1"),
    ("fox-pro-tiny", dict(num_heads=3), {}, "model.hidden_size must be a multiple of num_heads 3, got 128"),
    ("fox-pro-tiny", {}, dict(norm_eps=-1), "model.overrides.norm_eps must be a finite number > 0, got -1"),
    ("fox-pro-tiny", dict(fgate_type="bias_only"), {},
     "model.decay_time_min and decay_time_max must both be set for fgate_type='bias_only' (the gate bias's "
     "decay-time init), got None and None"),
    ("delta_net-tiny", {}, dict(use_gate=True),
     "model.overrides.use_gate=True is not supported (the paper's DeltaNet uses False)"),
    ("mamba2-tiny", {}, dict(rms_norm=False),
     "model.overrides.rms_norm=False is not supported (the released Mamba-2 uses the gated RMSNorm)"),
    ("samba-tiny", {}, dict(attn=dict(num_heads=2, layers=[1])),
     "model.overrides.attn['layers'] must be None (attention on the odd layers, the reference's only layout), "
     "got [1]"),
    # the config's own names: attn (SAMBA's attention layers), which fox-train sets through num_heads
    ("samba-tiny", dict(num_heads=0), {}, "model=samba-tiny: attn num_heads must be an int >= 1, got 0"),
    ("delta_net-tiny", dict(num_heads=3), {},
     "model=delta_net-tiny: int(hidden_size * expand_k) must be a positive multiple of num_heads 3 (the heads' "
     "width), got 128"),
])
def test_a_refused_model_field_is_named_as_set(preset, fields, overrides, message):
    cfg = ModelConfig(preset=preset, **{**preset_fields(preset), **fields}, overrides=overrides)
    with pytest.raises(ValueError) as error:
        model_config(cfg)
    assert str(error.value) == message


def test_a_field_the_preset_lacks_is_named():
    with pytest.raises(ValueError, match=r"^model.state_size is not a field of fox-pro-tiny "
                                         r"\(ForgettingTransformerConfig\)$"):
        model_config(ModelConfig(preset="fox-pro-tiny", **preset_fields("fox-pro-tiny"), state_size=16))


@pytest.mark.parametrize("preset, key", [("fox-pro-tiny", "norm_epsilon"), ("transformer-llama-tiny", "qk_norm"),
                                          ("mamba2-tiny", "fgate_type")])
def test_an_override_the_preset_lacks_is_named(preset, key):
    """transformers' configs keep unknown keywords as attributes no model reads: a misspelt override (or one of
    another family) is refused rather than training the preset unchanged."""
    cfg = ModelConfig(preset=preset, **preset_fields(preset), overrides={key: 1})
    with pytest.raises(ValueError, match=rf"^model.overrides.{key} is not a field of {preset} \(\w+Config\)$"):
        model_config(cfg)


@pytest.mark.parametrize("preset, overrides", [
    ("fox-pro-tiny", dict(norm_eps=1e-5, tie_word_embeddings=True, attn_implementation="eager")),
    ("hgrn2-tiny", dict(use_lower_bound=False)),
    ("transformer-llama-tiny", dict(initializer_range=0.01, output_hidden_states=True)),
])
def test_overrides_of_real_fields_are_applied(preset, overrides):
    config = model_config(ModelConfig(preset=preset, **preset_fields(preset), overrides=overrides))
    for key, value in overrides.items():
        assert getattr(config, "_attn_implementation" if key == "attn_implementation" else key) == value
