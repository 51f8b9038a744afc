"""The Mamba-2 config, field names and defaults as released, and its named configs."""

from __future__ import annotations

import math

from fox_models import preset_fields
from fox_models.configuration_base import (
    ConfigFieldError,
    _FoxConfigBase,
    require_int,
    require_ordered,
    require_positive,
)


class Mamba2Config(_FoxConfigBase):
    """Mamba-2 (Dao & Gu 2024), field names and defaults as in the released configs."""

    model_type = "mamba2-project_fox"

    def __init__(
        self,
        *,
        num_heads: int = 64,
        head_dim: int = 64,
        hidden_size: int = 2048,
        state_size: int = 64,
        num_hidden_layers: int = 48,
        layer_norm_epsilon: float = 1e-5,
        pad_token_id: int = 0,
        expand: int = 2,
        conv_kernel: int = 4,
        n_groups: int = 8,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        hidden_act: str = "silu",
        initializer_range: float = 0.1,
        residual_in_fp32: bool = True,
        time_step_rank="auto",
        time_step_min: float = 0.001,
        time_step_max: float = 0.1,
        time_step_floor: float = 1e-4,
        time_step_limit=(0.0, float("inf")),
        rescale_prenorm_residual: bool = True,
        rms_norm: bool = True,
        chunk_size: int = 256,
        **kwargs,
    ):
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                            ("state_size", state_size), ("expand", expand), ("conv_kernel", conv_kernel),
                            ("n_groups", n_groups), ("chunk_size", chunk_size)):
            require_int(name, value)
        require_positive("layer_norm_epsilon", layer_norm_epsilon)
        require_positive("time_step_min", time_step_min)
        require_positive("time_step_max", time_step_max)
        require_ordered("time_step_min", time_step_min, "time_step_max", time_step_max)
        if time_step_rank != "auto":
            require_int("time_step_rank", time_step_rank)
        if num_heads * head_dim != expand * hidden_size:
            raise ConfigFieldError("num_heads",
                                   f"num_heads * head_dim must equal expand * hidden_size, got {num_heads} "
                                   f"* {head_dim} != {expand} * {hidden_size}")
        if num_heads % n_groups:
            raise ConfigFieldError("num_heads",
                                   f"num_heads {num_heads} must be divisible by n_groups {n_groups}")
        if not rms_norm:
            raise ConfigFieldError("rms_norm", "rms_norm=False is not supported (the released Mamba-2 uses "
                                               "the gated RMSNorm)")
        self.state_size = state_size
        self.layer_norm_epsilon = layer_norm_epsilon
        self.conv_kernel = conv_kernel
        self.expand = expand
        self.use_bias = use_bias
        self.use_conv_bias = use_conv_bias
        self.time_step_rank = math.ceil(hidden_size / 16) if time_step_rank == "auto" else time_step_rank
        self.time_step_min = time_step_min
        self.time_step_max = time_step_max
        self.time_step_floor = time_step_floor
        self.time_step_limit = tuple(time_step_limit)
        self.rescale_prenorm_residual = rescale_prenorm_residual
        self.residual_in_fp32 = residual_in_fp32
        self.n_groups = n_groups
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.rms_norm = rms_norm
        self.chunk_size = chunk_size
        super().__init__(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, hidden_act=hidden_act,
                         initializer_range=initializer_range, pad_token_id=pad_token_id, **kwargs)


# preset name -> fields (fox_models.presets adds the GPT-2 vocabulary)
PRESETS = preset_fields.PRESETS["mamba2"]
TINY = preset_fields.TINY["mamba2"]
