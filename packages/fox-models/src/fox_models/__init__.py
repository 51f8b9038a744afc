"""fox-models: Hugging Face models of the Forgetting Transformer and its baselines.

Importing this package registers the configs, models and tokenizer with the transformers Auto classes.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from fox_models.baselines import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    DeltaNetModel,
    HGRN2Config,
    HGRN2ForCausalLM,
    HGRN2Model,
)
from fox_models.cache import FoxCache
from fox_models.configuration import ForgettingTransformerConfig, TransformerConfig
from fox_models.mamba2 import Mamba2Config, Mamba2ForCausalLM, Mamba2Model
from fox_models.modeling import (
    ForgettingTransformerForCausalLM,
    ForgettingTransformerModel,
    TransformerForCausalLM,
    TransformerModel,
)
from fox_models.tokenizer import JSONGPT2Tokenizer, gpt2_tokenizer

__version__ = "0.1.0"

for _config, _model, _lm in (
    (ForgettingTransformerConfig, ForgettingTransformerModel, ForgettingTransformerForCausalLM),
    (TransformerConfig, TransformerModel, TransformerForCausalLM),
    (HGRN2Config, HGRN2Model, HGRN2ForCausalLM),
    (DeltaNetConfig, DeltaNetModel, DeltaNetForCausalLM),
    (Mamba2Config, Mamba2Model, Mamba2ForCausalLM),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)
    AutoTokenizer.register(_config, fast_tokenizer_class=JSONGPT2Tokenizer, exist_ok=True)

__all__ = [
    "DeltaNetConfig",
    "DeltaNetForCausalLM",
    "DeltaNetModel",
    "HGRN2Config",
    "HGRN2ForCausalLM",
    "HGRN2Model",
    "FoxCache",
    "ForgettingTransformerConfig",
    "ForgettingTransformerForCausalLM",
    "ForgettingTransformerModel",
    "JSONGPT2Tokenizer",
    "Mamba2Config",
    "Mamba2ForCausalLM",
    "Mamba2Model",
    "TransformerConfig",
    "TransformerForCausalLM",
    "TransformerModel",
    "gpt2_tokenizer",
    "__version__",
]
