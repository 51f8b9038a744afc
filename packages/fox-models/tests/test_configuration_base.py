"""The shared config fields: every family's config takes them from one base, with its released defaults, and
the special tokens and tying reach transformers' config (and config.json)."""

import pytest

from fox_models.configuration_base import _FoxConfigBase
from fox_models.registry import MODELS

# model_type -> released defaults of (hidden_size, num_hidden_layers, hidden_act, initializer_range, pad_token_id)
RELEASED_DEFAULTS = {
    "forgetting_transformer-project_fox": (2048, 24, "swish", 0.02, None),
    "transformer-project_fox": (2048, 24, "swish", 0.02, None),
    "mamba2-project_fox": (2048, 48, "silu", 0.1, 0),
    "hgrn2-project_fox": (2048, 24, "swish", 0.02, None),
    "delta_net-project_fox": (2048, 24, "swish", 0.02, None),
    "samba-project_fox": (2304, 18, "silu", 0.02, 0),
}
SHARED = ("hidden_size", "num_hidden_layers", "hidden_act", "initializer_range", "pad_token_id")

by_type = pytest.mark.parametrize("entry", MODELS, ids=lambda e: e.config_class.model_type)


def test_every_registered_model_has_released_defaults():
    assert set(RELEASED_DEFAULTS) == {e.config_class.model_type for e in MODELS}


@by_type
def test_shared_fields_come_from_the_base_with_each_family_s_defaults(entry):
    config = entry.config_class()
    assert isinstance(config, _FoxConfigBase)
    assert tuple(getattr(config, k) for k in SHARED) == RELEASED_DEFAULTS[config.model_type]
    assert (config.vocab_size, config.use_cache, config.fuse_cross_entropy) == (32000, True, True)
    assert (config.bos_token_id, config.eos_token_id, config.tie_word_embeddings) == (1, 2, False)


@by_type
def test_special_tokens_and_tying_are_saved(entry):
    config = entry.config_class(vocab_size=100, pad_token_id=3, bos_token_id=4, eos_token_id=5,
                                tie_word_embeddings=True)
    saved = config.to_diff_dict()
    assert {k: saved[k] for k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id",
                                  "tie_word_embeddings")} == dict(vocab_size=100, pad_token_id=3, bos_token_id=4,
                                                                  eos_token_id=5, tie_word_embeddings=True)
    assert entry.config_class.from_dict(config.to_dict()).to_diff_dict() == saved


@by_type
def test_hidden_act_is_checked_for_every_family(entry):
    with pytest.raises(ValueError, match="hidden_act must be 'swish' or 'silu'.*got 'gelu'"):
        entry.config_class(hidden_act="gelu")


@by_type
def test_fields_are_keyword_only(entry):
    with pytest.raises(TypeError):
        entry.config_class(32000)
