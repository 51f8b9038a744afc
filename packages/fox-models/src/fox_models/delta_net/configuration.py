"""The DeltaNet config, field names and defaults as released, and its named configs."""

from __future__ import annotations

from fox_models import preset_fields
from fox_models.compat import CACHE_KWARG
from fox_models.configuration_base import ConfigFieldError, _FoxLayoutConfig, require_int, require_positive


class DeltaNetConfig(_FoxLayoutConfig):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule with short convolutions."""

    model_type = "delta_net-project_fox"
    keys_to_ignore_at_inference = [CACHE_KWARG]  # the outputs' cache, by the installed release's name

    def __init__(
        self,
        *,
        hidden_size: int = 2048,
        expand_k: float = 1,
        expand_v: float = 1,
        use_gate: bool = False,
        use_short_conv: bool = True,
        conv_size: int = 4,
        use_beta: bool = True,
        use_output_norm: bool = True,
        num_heads: int = 16,
        attn_mode: str = "chunk",
        qk_norm: str = "l2",
        qk_activation: str = "silu",
        norm_first: bool = False,
        **kwargs,
    ):
        unsupported = dict(use_gate=(use_gate, False), norm_first=(norm_first, False), qk_norm=(qk_norm, "l2"),
                           qk_activation=(qk_activation, "silu"), use_short_conv=(use_short_conv, True))
        for name, (got, want) in unsupported.items():
            if got != want:
                raise ConfigFieldError(name, f"{name}={got!r} is not supported (the paper's DeltaNet uses "
                                             f"{want!r})")
        require_int("hidden_size", hidden_size)
        require_int("num_heads", num_heads)
        require_positive("expand_k", expand_k)
        require_positive("expand_v", expand_v)
        require_int("conv_size", conv_size)
        for name, expand in (("expand_k", expand_k), ("expand_v", expand_v)):
            dim = int(hidden_size * expand)
            if dim < num_heads or dim % num_heads:
                raise ValueError(f"int(hidden_size * {name}) must be a positive multiple of num_heads {num_heads} "
                                 f"(the heads' width), got {dim}")
        self.expand_k = expand_k
        self.expand_v = expand_v
        self.use_gate = use_gate
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.use_beta = use_beta
        self.use_output_norm = use_output_norm
        self.num_heads = num_heads
        self.attn_mode = attn_mode
        self.qk_norm = qk_norm
        self.qk_activation = qk_activation
        self.norm_first = norm_first
        super().__init__(hidden_size=hidden_size, **kwargs)


# preset name -> fields (fox_models.presets adds the GPT-2 vocabulary)
PRESETS = preset_fields.PRESETS["delta_net"]
TINY = preset_fields.TINY["delta_net"]
