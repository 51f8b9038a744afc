"""Presets: the head sizes and baseline shapes of the official LongCrawl64 configs; their plain data."""

import ast
from pathlib import Path

import pytest

from fox_models import preset_fields, registry
from fox_models.presets import PRESETS, get_preset


@pytest.mark.parametrize("size,heads", [("125m", 12), ("360m", 16), ("760m", 12)])
def test_transformers_use_head_dim_64_below_760m_and_128_at_760m(size, heads):
    for family in ("transformer-llama", "transformer-pro"):
        config = get_preset(f"{family}-{size}")
        assert config.num_heads == heads
        assert config.hidden_size // config.num_heads == (128 if size == "760m" else 64)
    assert get_preset(f"fox-pro-{size}").hidden_size // get_preset(f"fox-pro-{size}").num_heads == 64


@pytest.mark.parametrize("name,fields", [
    ("mamba2-125m", dict(hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, state_size=128)),
    ("mamba2-360m", dict(hidden_size=1024, num_hidden_layers=48, num_heads=32, head_dim=64, state_size=128)),
    ("mamba2-760m", dict(hidden_size=1536, num_hidden_layers=48, num_heads=48, head_dim=64, state_size=128)),
    ("hgrn2-125m", dict(hidden_size=768, num_hidden_layers=12, num_heads=6, expand_ratio=128)),
    ("hgrn2-360m", dict(hidden_size=1024, num_hidden_layers=24, num_heads=8, expand_ratio=128)),
    ("hgrn2-760m", dict(hidden_size=1536, num_hidden_layers=24, num_heads=12, expand_ratio=128)),
    ("delta_net-125m", dict(hidden_size=768, num_hidden_layers=12, num_heads=6)),
    ("delta_net-360m", dict(hidden_size=1024, num_hidden_layers=24, num_heads=8)),
    ("delta_net-760m", dict(hidden_size=1536, num_hidden_layers=24, num_heads=12, conv_size=4)),
    # SAMBA: the attention layers' heads as the Transformers' (head dim 64 below 760M, 128 at 760M)
    ("samba-125m", dict(hidden_size=768, num_hidden_layers=12, num_heads=12, window_size=2048, state_size=16)),
    ("samba-360m", dict(hidden_size=1024, num_hidden_layers=24, num_heads=16, window_size=2048, state_size=16)),
    ("samba-760m", dict(hidden_size=1536, num_hidden_layers=24, num_heads=12, window_size=2048, state_size=16,
                        expand=2, conv_kernel=4, time_step_rank=96, attn_hidden_ratio=4, mamba_hidden_ratio=3)),
])
def test_baseline_presets_at_every_size(name, fields):
    config = get_preset(name)
    assert {k: getattr(config, k) for k in fields} == fields


def test_every_family_has_every_size_and_unknown_names_are_named():
    families = {name.rsplit("-", 1)[0] for name in PRESETS}
    assert families == {"fox-pro", "fox-llama", "transformer-pro", "transformer-llama", "transformer-swa", "mamba2", "hgrn2",
                        "delta_net", "samba"}
    assert len(PRESETS) == 3 * len(families)
    with pytest.raises(ValueError, match="unknown preset 'samba-1b'"):
        get_preset("samba-1b")


def test_the_plain_data_imports_nothing_and_is_every_family_s_presets():
    """fox-train runs fox_models/preset_fields.py from its file, without the fox_models package (torch)."""
    tree = ast.parse(Path(preset_fields.__file__).read_text())
    assert [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))] == []
    # each family's presets are its part of the data, in the registry's order (SAMBA's nest attn)
    assert [list(e.presets) for e in registry.MODELS] == [list(p) for p in preset_fields.PRESETS.values()]
    assert [list(e.tiny) for e in registry.MODELS] == [list(p) for p in preset_fields.TINY.values()]
    samba = get_preset("samba-760m")
    assert samba.attn == dict(num_heads=12, num_kv_heads=None, window_size=2048, layers=None)
