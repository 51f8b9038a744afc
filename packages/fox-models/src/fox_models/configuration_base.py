"""What every model's config shares. ``_FoxConfigBase`` holds the fields each family has under the same name;
``_FoxLayoutConfig`` adds those of the FoX-layout block (a sequence mixer and a SwiGLU MLP, each after an
RMSNorm) that FoX, the Transformer, HGRN2 and DeltaNet are built of.

A family's config subclasses one of them, sets its own fields and passes every other keyword on; it names a
shared field only where its released default differs (Mamba-2's ``initializer_range=0.1``) or where its own
checks read it (``hidden_size``).
"""

from __future__ import annotations

from fox_models.compat import ConfigBase


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
            raise ValueError(f"hidden_act must be 'swish' or 'silu' (the same function), got {hidden_act!r}")
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
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.elementwise_affine = elementwise_affine
        self.norm_eps = norm_eps
        super().__init__(**kwargs)
