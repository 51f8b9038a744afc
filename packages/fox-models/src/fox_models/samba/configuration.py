"""The SAMBA config, field names and defaults as in the reference implementation, and its named configs."""

from __future__ import annotations

import math

from fox_models import preset_fields
from fox_models.compat import CACHE_KWARG
from fox_models.configuration_base import (
    ConfigFieldError,
    _FoxConfigBase,
    require_divides,
    require_int,
    require_ordered,
    require_positive,
    require_window_size,
)

_ATTN_KEYS = ("num_heads", "num_kv_heads", "window_size", "layers")


class SambaConfig(_FoxConfigBase):
    """SAMBA (Ren et al. 2024): Mamba layers and sliding-window attention layers, alternating.

    ``attn`` describes the attention layers as the reference does: ``{"num_heads", "num_kv_heads",
    "window_size", "layers"}``; ``layers: None`` puts attention on the odd layers (1, 3, 5, ...) and Mamba on
    the even ones, the reference's only layout; ``attn: None`` makes every layer a Mamba layer. Every layer
    has a SwiGLU MLP, of width ratio ``attn_hidden_ratio`` after attention and ``mamba_hidden_ratio`` after
    Mamba. ``num_heads``, ``num_kv_heads`` and ``window_size`` (attributes and keyword arguments) read and
    set the entries of ``attn``; a keyword argument left at None keeps the entry of ``attn``.
    """

    model_type = "samba-project_fox"
    keys_to_ignore_at_inference = [CACHE_KWARG]  # the outputs' cache, by the installed release's name
    attribute_map = {"num_attention_heads": "num_heads"}

    def __init__(
        self,
        *,
        hidden_size: int = 2304,
        state_size: int = 16,
        num_hidden_layers: int = 18,
        norm_eps: float = 1e-5,
        pad_token_id: int | None = 0,
        expand: int = 2,
        conv_kernel: int = 4,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        hidden_act: str = "silu",
        residual_in_fp32: bool = False,
        time_step_rank="auto",
        time_step_scale: float = 1.0,
        time_step_min: float = 0.001,
        time_step_max: float = 0.1,
        time_step_init_scheme: str = "random",
        time_step_floor: float = 1e-4,
        max_position_embeddings: int | None = 2048,
        attn: dict | None = None,
        attn_hidden_ratio: float | None = 4,
        mamba_hidden_ratio: float | None = 3,
        rescale_prenorm_residual: bool = False,
        fuse_norm: bool = True,
        rope_base: float = 500000.0,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        window_size: int | None = None,
        **kwargs,
    ):
        if residual_in_fp32:
            raise ConfigFieldError("residual_in_fp32",
                                   "residual_in_fp32=True is not supported (the reference SAMBA block adds "
                                   "its residual in the activations' dtype)")
        for name, value in (("hidden_size", hidden_size), ("state_size", state_size), ("expand", expand),
                            ("conv_kernel", conv_kernel)):
            require_int(name, value)
        require_positive("norm_eps", norm_eps)
        require_positive("time_step_min", time_step_min)
        require_positive("time_step_max", time_step_max)
        require_ordered("time_step_min", time_step_min, "time_step_max", time_step_max)
        if time_step_rank != "auto":
            require_int("time_step_rank", time_step_rank)
        require_positive("attn_hidden_ratio", attn_hidden_ratio, optional=True)
        require_positive("mamba_hidden_ratio", mamba_hidden_ratio, optional=True)
        require_int("max_position_embeddings", max_position_embeddings, optional=True)
        require_positive("rope_base", rope_base)
        if time_step_init_scheme not in ("random", "constant"):
            raise ConfigFieldError("time_step_init_scheme",
                                   f"time_step_init_scheme must be 'random' or 'constant', got "
                                   f"{time_step_init_scheme!r}")
        intermediate_size = kwargs.pop("intermediate_size", None)  # written by save_pretrained: expand * hidden
        if intermediate_size is not None and intermediate_size != expand * hidden_size:
            raise ConfigFieldError("intermediate_size",
                                   f"intermediate_size must be expand * hidden_size = "
                                   f"{expand * hidden_size}, got {intermediate_size}")
        attn = None if attn is None else dict(attn)
        given = {k: v for k, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                                   ("window_size", window_size)) if v is not None}
        if given:
            attn = {**(attn or {"layers": None}), **given}
        if attn is not None:
            unknown = set(attn) - set(_ATTN_KEYS)
            if unknown:
                raise ConfigFieldError("attn",
                                       f"attn has unknown keys {sorted(unknown)}; known: {list(_ATTN_KEYS)}")
            if attn.get("num_heads") is None:
                raise ConfigFieldError("attn", "attn must give num_heads (the heads of the attention layers)")
            if attn.get("layers") is not None:
                raise ConfigFieldError("attn",
                                       f"attn['layers'] must be None (attention on the odd layers, the "
                                       f"reference's only layout), got {attn['layers']!r}")
            attn = {k: attn.get(k) for k in _ATTN_KEYS}
            require_window_size(attn["window_size"])
            require_int("attn num_heads", attn["num_heads"], field="attn")
            require_int("attn num_kv_heads", attn["num_kv_heads"], optional=True, field="attn")
            require_divides("attn num_heads", attn["num_heads"], "hidden_size", hidden_size)
            if attn["num_kv_heads"] is not None:
                require_divides("attn num_kv_heads", attn["num_kv_heads"], "attn num_heads",
                                attn["num_heads"], field="attn")
        self.state_size = state_size
        self.norm_eps = norm_eps
        self.expand = expand
        self.intermediate_size = expand * hidden_size
        self.conv_kernel = conv_kernel
        self.use_bias = use_bias
        self.use_conv_bias = use_conv_bias
        self.residual_in_fp32 = residual_in_fp32
        self.time_step_rank = math.ceil(hidden_size / 16) if time_step_rank == "auto" else time_step_rank
        self.time_step_scale = time_step_scale
        self.time_step_min = time_step_min
        self.time_step_max = time_step_max
        self.time_step_init_scheme = time_step_init_scheme
        self.time_step_floor = time_step_floor
        self.max_position_embeddings = max_position_embeddings
        self.attn = attn
        self.attn_hidden_ratio = attn_hidden_ratio
        self.mamba_hidden_ratio = mamba_hidden_ratio
        self.rescale_prenorm_residual = rescale_prenorm_residual
        self.fuse_norm = fuse_norm
        self.rope_base = rope_base
        super().__init__(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, hidden_act=hidden_act,
                         pad_token_id=pad_token_id, **kwargs)

    def _set_attn(self, key: str, value) -> None:
        if self.attn is None and value is None:
            return
        self.attn = {**(self.attn or dict.fromkeys(_ATTN_KEYS)), key: value}

    @property
    def num_heads(self) -> int | None:
        """Heads of the attention layers (None without attention layers)."""
        return None if self.attn is None else self.attn["num_heads"]

    @num_heads.setter
    def num_heads(self, value):
        self._set_attn("num_heads", value)

    @property
    def num_kv_heads(self) -> int | None:
        return None if self.attn is None else self.attn["num_kv_heads"]

    @num_kv_heads.setter
    def num_kv_heads(self, value):
        self._set_attn("num_kv_heads", value)

    @property
    def window_size(self) -> int | None:
        """The attention layers' sliding window (each query sees this many keys, itself included)."""
        return None if self.attn is None else self.attn["window_size"]

    @window_size.setter
    def window_size(self, value):
        require_window_size(value)
        self._set_attn("window_size", value)

    def is_attention_layer(self, layer_idx: int) -> bool:
        return self.attn is not None and layer_idx % 2 == 1

    def mlp_ratio(self, layer_idx: int) -> float:
        """The MLP width ratio after layer ``layer_idx``'s mixer (4 where the reference's is None)."""
        ratio = self.attn_hidden_ratio if self.is_attention_layer(layer_idx) else self.mamba_hidden_ratio
        return 4 if ratio is None else ratio


def _nested(fields: dict) -> dict:
    """A preset's fields with the attention layers' (flat in ``fox_models.preset_fields``) under ``attn``, as
    the reference's configs give them."""
    flat = {k: v for k, v in fields.items() if k not in _ATTN_KEYS}
    return dict(flat, attn={k: fields.get(k) for k in _ATTN_KEYS})


# preset name -> fields (fox_models.presets adds the GPT-2 vocabulary)
PRESETS = {name: _nested(fields) for name, fields in preset_fields.PRESETS["samba"].items()}
TINY = {name: _nested(fields) for name, fields in preset_fields.TINY["samba"].items()}
