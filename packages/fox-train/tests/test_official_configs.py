"""The 30 LongCrawl64 experiments equal the official configuration files, field by field.

The table below holds the values of the reference repository's ``configs/experiment/longcrawl64/<dir>/<name>.yaml``
(zhixuan-lin/forgetting-transformer), written out by hand; the model rows add the defaults that those files
inherit from the official ``configs/model/*.py``. Each experiment is composed the way ``fox-train
experiment=longcrawl64/<dir>/<name>`` composes it and compared with its row.
"""

from pathlib import Path

import pytest

import fox_train
from fox_train.cli import compose
from fox_train.config import model_config

# Every official experiment: token counts are 2.5, 7, 15 and 45 x 2^30; batch 32 x 16384 tokens.
WARMUP_TOKENS = 268435456  # 256 x 2^20
GLOBAL_BATCH_TOKENS = 32 * 16384
SEQ_LEN = 16384
BETAS = [0.9, 0.95]
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0

# Defaults inherited from the official model configs (configs/model/<model>.py), per fox-models config class.
INHERITED = {
    "ForgettingTransformerConfig": dict(hidden_ratio=4, num_kv_heads=None, window_size=None, intermediate_size=None,
                                        hidden_act="swish", norm_eps=1e-6, initializer_range=0.02,
                                        tie_word_embeddings=False, attention_bias=False, use_output_gate=False,
                                        ogate_act="sigmoid", fgate_type="full", fgate_bias_init=False,
                                        decay_time_min=None, decay_time_max=None, use_output_norm=False, qk_norm=False,
                                        log_pruning_tolerance=None, use_k_shift=False, use_v_shift=False),
    "TransformerConfig": dict(hidden_ratio=4, num_kv_heads=None, window_size=None, intermediate_size=None,
                              hidden_act="swish", norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False,
                              attention_bias=False, use_rope=True),
    "Mamba2Config": dict(layer_norm_epsilon=1e-5, expand=2, conv_kernel=4, n_groups=1, use_bias=False,
                         use_conv_bias=True, hidden_act="silu", initializer_range=0.02, residual_in_fp32=True,
                         time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
                         rescale_prenorm_residual=True, rms_norm=True, chunk_size=256, tie_word_embeddings=False),
    "HGRN2Config": dict(num_heads=None, use_short_conv=False, conv_size=4, use_lower_bound=True, hidden_ratio=4,
                        intermediate_size=None, hidden_act="swish", norm_eps=1e-6, tie_word_embeddings=False,
                        initializer_range=0.02),
    "DeltaNetConfig": dict(expand_k=1, expand_v=1, use_gate=False, use_short_conv=True, conv_size=4, use_beta=True,
                           use_output_norm=True, hidden_ratio=4, intermediate_size=None, qk_norm="l2",
                           qk_activation="silu", hidden_act="swish", norm_first=False, norm_eps=1e-6,
                           tie_word_embeddings=False, initializer_range=0.02),
    # configs/model/samba.py (time_step_rank "auto": ceil(hidden / 16) = 96 at 760M; attn.num_kv_heads None and
    # attn.layers null: attention on the odd layers; norm_eps is a class attribute there, 1e-5 as the config's default)
    "SambaConfig": dict(state_size=16, norm_eps=1e-5, expand=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
                        hidden_act="silu", initializer_range=0.02, residual_in_fp32=False, time_step_rank=96,
                        time_step_scale=1.0, time_step_min=0.001, time_step_max=0.1, time_step_init_scheme="random",
                        time_step_floor=1e-4, num_kv_heads=None, attn_hidden_ratio=4, mamba_hidden_ratio=3,
                        tie_word_embeddings=False, rescale_prenorm_residual=True, intermediate_size=3072),
}

# (experiment, model preset, lr, total tokens, tokens per micro-batch (official grad_acc_tokens),
#  gradient checkpointing, model fields the official file sets)
OFFICIAL = [
    ("forgetting_transformer/pro_125m_2b", "fox-pro-125m", 0.002, 2684354560, 32768, False,
     dict(hidden_size=768, num_hidden_layers=12, num_heads=12, use_rope=False, rope_base=500000, use_v_shift=True, use_k_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, hidden_ratio=3.5)),
    ("forgetting_transformer/pro_360m_7b", "fox-pro-360m", 0.002, 7516192768, 16384, False,
     dict(hidden_size=1024, num_hidden_layers=24, num_heads=16, use_rope=False, rope_base=500000, use_v_shift=True, use_k_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, hidden_ratio=3.5)),
    ("forgetting_transformer/pro_760m_16b", "fox-pro-760m", 0.001, 16106127360, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=24, use_rope=False, rope_base=500000, use_v_shift=True, use_k_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, hidden_ratio=3.5)),
    ("forgetting_transformer/pro_760m_48b", "fox-pro-760m", 0.002, 48318382080, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=24, use_rope=False, rope_base=500000, use_v_shift=True, use_k_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, hidden_ratio=3.5)),
    ("forgetting_transformer/llama_125m_2b", "fox-llama-125m", 0.002, 2684354560, 32768, False,
     dict(hidden_size=768, num_hidden_layers=12, num_heads=12, use_rope=False, rope_base=500000)),
    ("forgetting_transformer/llama_360m_7b", "fox-llama-360m", 0.002, 7516192768, 16384, False,
     dict(hidden_size=1024, num_hidden_layers=24, num_heads=16, use_rope=False, rope_base=500000)),
    ("forgetting_transformer/llama_760m_16b", "fox-llama-760m", 0.001, 16106127360, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=24, use_rope=False, rope_base=500000)),
    ("forgetting_transformer/llama_760m_48b", "fox-llama-760m", 0.001, 48318382080, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=24, use_rope=False, rope_base=500000)),
    ("transformer/llama_125m_2b", "transformer-llama-125m", 0.002, 2684354560, 32768, False,
     dict(hidden_size=768, num_hidden_layers=12, num_heads=12, rope_base=500000)),
    ("transformer/llama_360m_7b", "transformer-llama-360m", 0.002, 7516192768, 16384, False,
     dict(hidden_size=1024, num_hidden_layers=24, num_heads=16, rope_base=500000)),
    ("transformer/llama_760m_16b", "transformer-llama-760m", 0.001, 16106127360, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=12, rope_base=500000)),
    ("transformer/llama_760m_48b", "transformer-llama-760m", 0.0005, 48318382080, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=12, rope_base=500000)),
    ("transformer/pro_125m_2b", "transformer-pro-125m", 0.002, 2684354560, 32768, False,
     dict(hidden_size=768, num_hidden_layers=12, num_heads=12, rope_base=500000, use_rope=True, fgate_type='none', use_v_shift=True, use_k_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, hidden_ratio=3.5)),
    ("transformer/pro_360m_7b", "transformer-pro-360m", 0.002, 7516192768, 16384, False,
     dict(hidden_size=1024, num_hidden_layers=24, num_heads=16, rope_base=500000, use_rope=True, fgate_type='none', use_v_shift=True, use_k_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, hidden_ratio=3.5)),
    ("transformer/pro_760m_16b", "transformer-pro-760m", 0.001, 16106127360, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=12, rope_base=500000, use_rope=True, fgate_type='none', use_v_shift=True, use_k_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, hidden_ratio=3.5)),
    ("transformer/pro_760m_48b", "transformer-pro-760m", 0.001, 48318382080, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=12, rope_base=500000, use_rope=True, fgate_type='none', use_v_shift=True, use_k_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, hidden_ratio=3.5)),
    ("mamba2/125m_2b", "mamba2-125m", 0.002, 2684354560, 32768, False,
     dict(head_dim=64, state_size=128, num_heads=24, num_hidden_layers=24, hidden_size=768)),
    ("mamba2/360m_7b", "mamba2-360m", 0.002, 7516192768, 16384, False,
     dict(head_dim=64, state_size=128, num_heads=32, num_hidden_layers=48, hidden_size=1024)),
    ("mamba2/760m_16b", "mamba2-760m", 0.001, 16106127360, 16384, True,
     dict(head_dim=64, state_size=128, num_heads=48, num_hidden_layers=48, hidden_size=1536)),
    ("mamba2/760m_48b", "mamba2-760m", 0.002, 48318382080, 16384, True,
     dict(head_dim=64, state_size=128, num_heads=48, num_hidden_layers=48, hidden_size=1536)),
    ("hgrn2/125m_2b", "hgrn2-125m", 0.002, 2684354560, 32768, False,
     dict(hidden_size=768, expand_ratio=128, num_hidden_layers=12)),
    ("hgrn2/360m_7b", "hgrn2-360m", 0.002, 7516192768, 16384, False,
     dict(hidden_size=1024, expand_ratio=128, num_hidden_layers=24)),
    ("hgrn2/760m_16b", "hgrn2-760m", 0.001, 16106127360, 16384, True,
     dict(hidden_size=1536, expand_ratio=128, num_hidden_layers=24)),
    ("hgrn2/760m_48b", "hgrn2-760m", 0.002, 48318382080, 16384, True,
     dict(hidden_size=1536, expand_ratio=128, num_hidden_layers=24)),
    ("delta_net/125m_2b", "delta_net-125m", 0.002, 2684354560, 16384, False,
     dict(hidden_size=768, num_hidden_layers=12, num_heads=6)),
    ("delta_net/360m_7b", "delta_net-360m", 0.002, 7516192768, 16384, False,
     dict(hidden_size=1024, num_hidden_layers=24, num_heads=8)),
    ("delta_net/760m_16b", "delta_net-760m", 0.001, 16106127360, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=12)),
    ("delta_net/760m_48b", "delta_net-760m", 0.001, 48318382080, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=12)),
    ("samba/760m_16b", "samba-760m", 0.001, 16106127360, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, rope_base=500000, num_heads=12, window_size=2048)),
    ("transformer_swa/760m_16b", "transformer-swa-760m", 0.001, 16106127360, 16384, True,
     dict(hidden_size=1536, num_hidden_layers=24, num_heads=12, rope_base=500000, window_size=2048)),
]


def test_the_table_and_the_configs_are_the_same_thirty_experiments():
    root = Path(fox_train.__file__).parent / "conf" / "experiment" / "longcrawl64"
    found = sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))
    assert len(OFFICIAL) == 30
    assert found == sorted(row[0] for row in OFFICIAL)


def _model_value(config, key):
    if key == "use_rope" and type(config).__name__ == "TransformerConfig":
        return True  # the Transformer (LLaMA) always uses RoPE: no switch
    if key == "num_heads" and type(config).__name__ == "HGRN2Config" and config.num_heads is not None:
        assert config.num_heads == config.hidden_size // config.expand_ratio
        return None  # official: None, meaning hidden / expand_ratio heads
    return getattr(config, key)


@pytest.mark.parametrize("name,preset,lr,tokens,micro_tokens,checkpointing,model",
                         OFFICIAL, ids=[row[0] for row in OFFICIAL])
def test_experiment_equals_the_official_config(name, preset, lr, tokens, micro_tokens, checkpointing, model):
    cfg = compose([f"experiment=longcrawl64/{name}", "data.path=/data/lc64/train.zarr"])
    assert cfg.model.preset == preset
    assert cfg.optimizer.lr == lr
    assert cfg.optimizer.betas == BETAS and cfg.optimizer.weight_decay == WEIGHT_DECAY
    assert cfg.optimizer.grad_clip == GRAD_CLIP
    assert cfg.schedule.name == "warmup_cosine" and cfg.schedule.min_lr_ratio == 0.0
    assert cfg.schedule.warmup_tokens == WARMUP_TOKENS and cfg.schedule.total_tokens == tokens
    assert cfg.global_batch_tokens == GLOBAL_BATCH_TOKENS and cfg.data.seq_len == SEQ_LEN
    assert cfg.micro_batch_size * SEQ_LEN == micro_tokens
    assert cfg.gradient_checkpointing == checkpointing
    assert cfg.data.source == "longcrawl64" and cfg.data.order == "paper" and cfg.strategy.name == "fsdp"
    config = model_config(cfg.model)
    expected = {**INHERITED[type(config).__name__], **model}
    assert {k: _model_value(config, k) for k in expected} == expected
    if name.startswith("samba/"):  # the official attn dict, and Mamba on the even layers
        assert config.attn == dict(num_heads=12, num_kv_heads=None, window_size=2048, layers=None)
        assert [config.is_attention_layer(i) for i in range(4)] == [False, True, False, True]
