"""The code of an exported FoX model folder, for ``trust_remote_code=True``: the classes come from the
installed fox-models (``pip install fox-models``), so loading runs no code from the folder itself beyond
these imports, and a folder never carries a stale copy of the model."""

from fox_models import (  # noqa: F401  (named by config.json's and tokenizer_config.json's auto_map)
    DeltaNetConfig,
    DeltaNetForCausalLM,
    DeltaNetModel,
    ForgettingTransformerConfig,
    ForgettingTransformerForCausalLM,
    ForgettingTransformerModel,
    HGRN2Config,
    HGRN2ForCausalLM,
    HGRN2Model,
    JSONGPT2Tokenizer,
    Mamba2Config,
    Mamba2ForCausalLM,
    Mamba2Model,
    TransformerConfig,
    TransformerForCausalLM,
    TransformerModel,
)
