"""The registry: every model is registered with the Auto classes and remote code, has presets and a tiny
config, names its blocks and the parameters that take no weight decay."""

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import fox_models
from fox_models import fox_remote
from fox_models.presets import PRESETS, TINY_PRESETS, get_preset
from fox_models.registry import MODELS, model_entry, no_weight_decay

# What takes no weight decay, written out here from module class names and parameter names: norm weights,
# biases, FoX's bias-only gate, Mamba-2's per-head SSM parameters and HGRN2's lower bounds.
NORMS = ("RMSNorm", "GroupRMSNorm", "GatedRMSNorm")
NAMES = (".bias", "fgate_bias", ".A_log", ".D", ".dt_bias", "lower_bounds")
DECAY_TIMES = dict(decay_time_min=1.0, decay_time_max=100.0)
# tiny presets with the options that add parameters: biases, a bias-only forget gate
VARIANTS = [(name, {}) for name in TINY_PRESETS] + [
    ("fox-pro-tiny", dict(attention_bias=True, fgate_bias_init=True, **DECAY_TIMES)),
    ("fox-llama-tiny", dict(fgate_type="bias_only", **DECAY_TIMES)),
    ("transformer-llama-tiny", dict(attention_bias=True)),
    ("mamba2-tiny", dict(use_bias=True)),
]


def expected_no_decay(model) -> set[str]:
    held = {id(p) for m in model.modules() if type(m).__name__ in NORMS for p in m.parameters(recurse=False)}
    return {n for n, p in model.named_parameters() if id(p) in held or n.endswith(NAMES)}


@pytest.mark.parametrize("preset,overrides", VARIANTS)
@pytest.mark.parametrize("cls", [AutoModelForCausalLM, AutoModel])
def test_no_weight_decay_is_norms_biases_and_per_head_parameters(preset, overrides, cls):
    model = cls.from_config(get_preset(preset, **overrides))
    no_decay = no_weight_decay(model)
    assert no_decay == expected_no_decay(model)
    assert no_decay and set(dict(model.named_parameters())) - no_decay  # both groups hold parameters


def test_every_model_has_presets_a_tiny_config_and_the_auto_classes():
    assert {e.config_class.model_type for e in MODELS} == {
        "forgetting_transformer-project_fox", "transformer-project_fox", "mamba2-project_fox", "hgrn2-project_fox",
        "delta_net-project_fox", "samba-project_fox"}
    assert len(PRESETS + TINY_PRESETS) == len(set(PRESETS + TINY_PRESETS))
    for e in MODELS:
        assert e.presets and e.tiny, e.config_class.__name__
        for name in (*e.presets, *e.tiny):
            assert type(get_preset(name)) is e.config_class, name
        config = get_preset(next(iter(e.tiny)))
        assert model_entry(config) is e
        assert type(AutoConfig.for_model(e.config_class.model_type)) is e.config_class
        assert type(AutoModel.from_config(config)) is e.model_class
        model = AutoModelForCausalLM.from_config(config)
        assert type(model) is e.lm_class and model_entry(model) is e


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_blocks_are_the_layers(preset):
    """The registered block classes are what the backbone's layers are made of, and what transformers
    must not split across devices."""
    model = AutoModelForCausalLM.from_config(get_preset(preset))
    blocks = model_entry(model).blocks
    assert [m for m in model.modules() if isinstance(m, blocks)] == list(model.model.layers)
    assert {cls.__name__ for cls in blocks} == set(model._no_split_modules)


def test_remote_code_and_the_package_hand_out_every_registered_class():
    """config.json's auto_map names classes of fox_remote; folders exported with an earlier fox_remote.py
    import them from the package's top level."""
    for e in MODELS:
        for cls in (e.config_class, e.model_class, e.lm_class):
            assert getattr(fox_remote, cls.__name__) is cls
            assert getattr(fox_models, cls.__name__) is cls
    assert fox_remote.JSONGPT2Tokenizer is fox_models.JSONGPT2Tokenizer
    with pytest.raises(AttributeError, match="NoSuchModel"):
        fox_remote.NoSuchModel  # noqa: B018


def test_an_unregistered_model_is_named():
    with pytest.raises(ValueError, match="Linear is not a registered fox_models model"):
        model_entry(torch.nn.Linear(2, 2))


def test_transformer_swa_is_the_transformer_with_a_window():
    """Transformer-SWA: positions before the window's end see every earlier token, so their logits equal the
    full Transformer's with the same weights; later ones differ; cached greedy decoding equals the
    full forward pass of its own output."""
    swa_config = get_preset("transformer-swa-tiny")
    W = swa_config.window_size
    torch.manual_seed(0)
    swa = fox_models.TransformerForCausalLM(swa_config).eval()
    full = fox_models.TransformerForCausalLM(get_preset("transformer-swa-tiny", window_size=None)).eval()
    full.load_state_dict(swa.state_dict())
    ids = torch.randint(0, swa_config.vocab_size, (2, 3 * W + 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = swa(ids).logits, full(ids).logits
    torch.testing.assert_close(a[:, :W], b[:, :W])
    assert (a[:, W:] - b[:, W:]).abs().amax(-1).min() > 1e-4
    # without a cache (training, validation, use_cache=False) the window applies too: the SDPA shortcut
    # for plain causal attention ran full attention there
    with torch.no_grad():
        torch.testing.assert_close(swa(ids, use_cache=False).logits, a)
        swa.train()
        torch.testing.assert_close(swa(ids).logits, a)
        swa.eval()
    out = swa.generate(ids[:, :W + 3], max_new_tokens=2 * W, do_sample=False)
    with torch.no_grad():
        again = swa(out).logits[:, W + 2:-1].argmax(-1)
    assert torch.equal(again, out[:, W + 3:])
