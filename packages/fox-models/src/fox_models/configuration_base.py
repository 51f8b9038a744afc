"""What every model's config shares. ``_FoxConfigBase`` holds the fields each family has under the same name;
``_FoxLayoutConfig`` adds those of the FoX-layout block (a sequence mixer and a SwiGLU MLP, each after an
RMSNorm) that FoX, the Transformer, HGRN2 and DeltaNet are built of.

A family's config subclasses one of them, sets its own fields and passes every other keyword on; it names a
shared field only where its released default differs (Mamba-2's ``initializer_range=0.1``) or where its own
checks read it (``hidden_size``).

A value a config refuses raises ``ConfigFieldError`` (a ValueError) naming the keyword argument it belongs to,
where there is one, so that a caller can say where that argument was set (fox-train: ``model.hidden_size``,
``model.overrides.norm_eps``).
"""

from __future__ import annotations

import contextlib
import math

import fox_kernel
import fox_layers
from fox_models.compat import ConfigBase


class ConfigFieldError(ValueError):
    """A config's refusal of the value of one keyword argument, ``field``. The message begins with the field's
    name ("hidden_size must be an int >= 1, got -1")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickled (sent between processes) with its field
        return type(self), (self.field, str(self))


@contextlib.contextmanager
def refusing(field: str):
    """A ValueError raised inside (a check of fox_layers or fox_kernel, whose message begins with ``field``)
    becomes a ``ConfigFieldError`` of ``field``."""
    try:
        yield
    except ConfigFieldError:
        raise
    except ValueError as e:
        raise ConfigFieldError(field, str(e)) from None


def require_int(name: str, value, low: int = 1, *, optional: bool = False, field: str | None = None) -> None:
    """``fox_layers.require_int``, refusing as a ``ConfigFieldError`` of ``field`` (default ``name``)."""
    with refusing(field or name):
        fox_layers.require_int(name, value, low, optional=optional)


def require_positive(name: str, value, *, optional: bool = False) -> None:
    """``fox_layers.require_positive``, refusing as a ``ConfigFieldError`` of ``name``."""
    with refusing(name):
        fox_layers.require_positive(name, value, optional=optional)


def require_window_size(window_size) -> None:
    """``fox_kernel.require_window_size``, refusing as a ``ConfigFieldError`` of ``window_size``."""
    with refusing("window_size"):
        fox_kernel.require_window_size(window_size)


def require_divides(name: str, value: int, multiple_name: str, multiple: int, *,
                    field: str | None = None) -> None:
    """``multiple`` (named ``multiple_name``) is a multiple of ``value`` (named ``name``), both ints >= 1; the
    refusal is of ``field`` (default ``multiple_name``)."""
    if multiple % value:
        raise ConfigFieldError(field or multiple_name,
                               f"{multiple_name} must be a multiple of {name} {value}, got {multiple}")


def require_choice(name: str, value, choices: tuple) -> None:
    """``value`` is one of ``choices`` (the values the code that reads the field acts on)."""
    if value not in choices:
        raise ConfigFieldError(name, f"{name} must be one of {choices}, got {value!r}")


def require_ordered(low_name: str, low, high_name: str, high) -> None:
    """``low <= high`` where both are given (a range's bounds)."""
    if low is not None and high is not None and low > high:
        raise ConfigFieldError(low_name, f"{low_name} must be <= {high_name} {high}, got {low}")


class _FoxConfigBase(ConfigBase):
    """The fields of every model: vocabulary, width, depth, activation, initialization, cache, loss, special
    tokens and tying."""

    def __init__(
        self,
        *,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        num_hidden_layers: int = 24,
        hidden_act: str = "swish",
        initializer_range: float = 0.02,
        use_cache: bool = True,
        fuse_cross_entropy: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if hidden_act not in ("swish", "silu"):
            raise ConfigFieldError("hidden_act",
                                   "hidden_act must be 'swish' or 'silu' (the same function), got "
                                   f"{hidden_act!r}")
        require_int("vocab_size", vocab_size)
        require_int("hidden_size", hidden_size)
        require_int("num_hidden_layers", num_hidden_layers)
        if isinstance(initializer_range, bool) or not isinstance(initializer_range, (int, float)) \
                or not math.isfinite(initializer_range) or initializer_range < 0:
            raise ConfigFieldError("initializer_range",
                                   "initializer_range must be a finite number >= 0, got "
                                   f"{initializer_range!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.fuse_cross_entropy = fuse_cross_entropy
        # transformers' own config takes the special tokens and the tying (as arguments in 4.x, kept as given in 5)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class _FoxLayoutConfig(_FoxConfigBase):
    """The fields of the FoX-layout block: the SwiGLU MLP's width (``intermediate_size``; when None, from
    ``hidden_ratio`` by ``fox_layers.intermediate_size_for``), the norms, and the longest sequence."""

    def __init__(
        self,
        *,
        hidden_ratio: float = 4,
        intermediate_size: int | None = None,
        max_position_embeddings: int = 2048,
        elementwise_affine: bool = True,
        norm_eps: float = 1e-6,
        **kwargs,
    ):
        require_positive("hidden_ratio", hidden_ratio, optional=intermediate_size is not None)
        require_int("intermediate_size", intermediate_size, optional=True)
        require_int("max_position_embeddings", max_position_embeddings, optional=True)
        require_positive("norm_eps", norm_eps)
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.elementwise_affine = elementwise_affine
        self.norm_eps = norm_eps
        super().__init__(**kwargs)
