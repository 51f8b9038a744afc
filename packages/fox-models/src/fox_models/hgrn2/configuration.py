"""The HGRN2 config, field names and defaults as released, and its named configs."""

from __future__ import annotations

from fox_models import preset_fields
from fox_models.compat import CACHE_KWARG
from fox_models.configuration_base import ConfigFieldError, _FoxLayoutConfig, require_divides, require_int


class HGRN2Config(_FoxLayoutConfig):
    """HGRN2 (Qin et al. 2024): gated linear attention with forget-gate-tied input gates."""

    model_type = "hgrn2-project_fox"
    keys_to_ignore_at_inference = [CACHE_KWARG]  # the outputs' cache, by the installed release's name

    def __init__(
        self,
        *,
        hidden_size: int = 2048,
        attn_mode: str = "chunk",
        num_heads: int | None = None,
        expand_ratio: int | None = 128,
        use_short_conv: bool = False,
        conv_size: int = 4,
        use_lower_bound: bool = True,
        apply_lower_bound: bool = False,
        **kwargs,
    ):
        if use_short_conv:
            raise ConfigFieldError("use_short_conv", "use_short_conv=True is not supported for HGRN2 (the "
                                                     "paper's HGRN2 has none)")
        if num_heads is None and expand_ratio is None:
            raise ValueError("HGRN2Config needs num_heads or expand_ratio")
        require_int("hidden_size", hidden_size)
        require_int("num_heads", num_heads, optional=True)
        require_int("expand_ratio", expand_ratio, optional=True)
        require_int("conv_size", conv_size)
        # the heads: num_heads, else hidden_size // expand_ratio (modeling.py); each of width hidden / heads
        heads = num_heads if num_heads is not None else hidden_size // expand_ratio
        if heads < 1:
            raise ConfigFieldError("expand_ratio",
                                   f"expand_ratio must be <= hidden_size {hidden_size} (hidden_size // "
                                   f"expand_ratio heads), got {expand_ratio}")
        require_divides("num_heads" if num_heads is not None else "the heads (hidden_size // expand_ratio)", heads,
                        "hidden_size", hidden_size)
        if apply_lower_bound and num_heads is not None and expand_ratio is not None and num_heads * expand_ratio != hidden_size:
            raise ConfigFieldError("apply_lower_bound",
                                   "apply_lower_bound needs num_heads * expand_ratio == hidden_size (one "
                                   f"bound per forget channel), got {num_heads} * {expand_ratio} != "
                                   f"{hidden_size}")
        self.attn_mode = attn_mode
        self.num_heads = num_heads
        self.expand_ratio = expand_ratio
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.use_lower_bound = use_lower_bound
        self.apply_lower_bound = apply_lower_bound
        super().__init__(hidden_size=hidden_size, **kwargs)


# preset name -> fields (fox_models.presets adds the GPT-2 vocabulary)
PRESETS = preset_fields.PRESETS["hgrn2"]
TINY = preset_fields.TINY["hgrn2"]
