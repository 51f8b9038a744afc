"""The FoX config in the format of the published checkpoints (``zhixuan-lin/*-longcrawl64-48b``), and its
named configs (the paper's models)."""

from __future__ import annotations

import fox_layers
from fox_kernel import check_log_tolerance
from fox_models import preset_fields
from fox_models.compat import CACHE_KWARG
from fox_models.configuration_base import (
    ConfigFieldError,
    _FoxLayoutConfig,
    refusing,
    require_choice,
    require_divides,
    require_int,
    require_ordered,
    require_positive,
    require_window_size,
)

# What ForgettingAttentionLayer acts on (fox_layers exports neither set; tests compare them with the layer's):
# the forget gate's types (per token and head, a learned bias per head, a fixed bias per head, none) and the
# output gate's activations (also those its fused norm-gate kernel computes).
FGATE_TYPES = ("full", "bias_only", "fixed", "none")
OGATE_ACTS = ("sigmoid", "silu")


class _DecoderConfig(_FoxLayoutConfig):
    """Fields shared by the FoX and Transformer configs (heads, window, attention bias, RoPE base)."""

    # transformers' standard names (generation, PEFT and the common tests read them) for the published ones
    attribute_map = {"num_attention_heads": "num_heads"}

    def __init__(
        self,
        *,
        hidden_size: int = 2048,
        num_heads: int = 32,
        num_kv_heads: int | None = None,
        window_size: int | None = None,
        attention_bias: bool = False,
        fuse_norm: bool = True,
        rope_base: float = 500000.0,
        **kwargs,
    ):
        require_window_size(window_size)
        require_int("num_heads", num_heads)
        require_int("num_kv_heads", num_kv_heads, optional=True)
        if num_kv_heads is not None:
            require_divides("num_kv_heads", num_kv_heads, "num_heads", num_heads)
        require_positive("rope_base", rope_base)
        require_int("hidden_size", hidden_size)
        require_divides("num_heads", num_heads, "hidden_size", hidden_size)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.window_size = window_size
        self.attention_bias = attention_bias
        self.fuse_norm = fuse_norm
        self.rope_base = rope_base
        super().__init__(hidden_size=hidden_size, **kwargs)


def require_head_dim(hidden_size: int, num_heads: int, rope: bool) -> None:
    """``fox_layers.require_head_dim``, refusing as a ``ConfigFieldError`` of ``hidden_size`` (the model built
    then failed only at its first forward)."""
    with refusing("hidden_size"):
        fox_layers.require_head_dim(hidden_size, num_heads, rope)


class ForgettingTransformerConfig(_DecoderConfig):
    """FoX (Pro and LLaMA) and Transformer (Pro, ``fgate_type="none"`` + ``use_rope``).

    ``qk_norm_share_param_across_head=None`` (absent in the released configs) means: decided by the
    shape of ``q_norm.weight`` when loading a checkpoint, per-head weights otherwise.
    """

    model_type = "forgetting_transformer-project_fox"
    keys_to_ignore_at_inference = [CACHE_KWARG]  # the outputs' cache, by the installed release's name

    def __init__(
        self,
        *,
        use_rope: bool = False,
        use_output_gate: bool = False,
        ogate_act: str = "sigmoid",
        fgate_type: str = "full",
        fgate_bias_init: bool = False,
        decay_time_min: float | None = None,
        decay_time_max: float | None = None,
        use_output_norm: bool = False,
        qk_norm: bool = False,
        qk_norm_share_param_across_head: bool | None = None,
        use_k_shift: bool = False,
        use_v_shift: bool = False,
        log_pruning_tolerance: float | None = None,
        **kwargs,
    ):
        require_choice("fgate_type", fgate_type, FGATE_TYPES)
        require_choice("ogate_act", ogate_act, OGATE_ACTS)
        require_positive("decay_time_min", decay_time_min, optional=True)
        require_positive("decay_time_max", decay_time_max, optional=True)
        require_ordered("decay_time_min", decay_time_min, "decay_time_max", decay_time_max)
        # a gate bias drawn from decay times (bias_only, fixed, or full with fgate_bias_init) needs both ends
        if (fgate_type in ("bias_only", "fixed") or (fgate_type == "full" and fgate_bias_init)) and \
                (decay_time_min is None or decay_time_max is None):
            init = f"fgate_type={fgate_type!r}" + (" with fgate_bias_init=True" if fgate_type == "full" else "")
            raise ConfigFieldError("decay_time_min",
                                   f"decay_time_min and decay_time_max must both be set for {init} (the "
                                   f"gate bias's decay-time init), got {decay_time_min!r} and "
                                   f"{decay_time_max!r}")
        if log_pruning_tolerance is not None:
            with refusing("log_pruning_tolerance"):
                check_log_tolerance(log_pruning_tolerance)
        self.use_rope = use_rope
        self.use_output_gate = use_output_gate
        self.ogate_act = ogate_act
        self.fgate_type = fgate_type
        self.fgate_bias_init = fgate_bias_init
        self.decay_time_min = decay_time_min
        self.decay_time_max = decay_time_max
        self.use_output_norm = use_output_norm
        self.qk_norm = qk_norm
        self.qk_norm_share_param_across_head = qk_norm_share_param_across_head
        self.use_k_shift = use_k_shift
        self.use_v_shift = use_v_shift
        self.log_pruning_tolerance = log_pruning_tolerance
        super().__init__(**kwargs)
        require_head_dim(self.hidden_size, self.num_heads, self.use_rope)

    def attention_kwargs(self) -> dict:
        """Arguments of ``fox_layers.ForgettingAttentionLayer`` for this config."""
        return dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, use_output_gate=self.use_output_gate,
            ogate_act=self.ogate_act, use_output_norm=self.use_output_norm, norm_eps=self.norm_eps,
            qk_norm=self.qk_norm, qk_norm_share_param_across_head=bool(self.qk_norm_share_param_across_head),
            use_k_shift=self.use_k_shift, use_v_shift=self.use_v_shift, fgate_type=self.fgate_type,
            fgate_bias_init=self.fgate_bias_init, decay_time_min=self.decay_time_min,
            decay_time_max=self.decay_time_max, use_rope=self.use_rope, rope_base=self.rope_base,
            log_pruning_tolerance=self.log_pruning_tolerance, attention_bias=self.attention_bias,
            window_size=self.window_size,
        )


# preset name -> fields (fox_models.presets adds the GPT-2 vocabulary): FoX (Pro and LLaMA), and the
# Transformer (Pro), which is FoX (Pro) without forget gate and with RoPE
PRESETS = preset_fields.PRESETS["fox"]
TINY = preset_fields.TINY["fox"]
