"""fox-models: Hugging Face models of the Forgetting Transformer and its baselines.

One folder a model family (``fox``, ``transformer``, ``mamba2``, ``hgrn2``, ``delta_net``, ``samba``), one
list of them (``fox_models.registry``). Importing this package registers the configs, models and tokenizer
with the transformers Auto classes.
"""

from fox_models.cache import FoxCache
from fox_models.delta_net import DeltaNetConfig, DeltaNetForCausalLM, DeltaNetModel
from fox_models.fox import (
    ForgettingTransformerConfig,
    ForgettingTransformerForCausalLM,
    ForgettingTransformerModel,
)
from fox_models.hgrn2 import HGRN2Config, HGRN2ForCausalLM, HGRN2Model
from fox_models.mamba2 import Mamba2Config, Mamba2ForCausalLM, Mamba2Model
from fox_models.registry import register_auto_classes
from fox_models.samba import SambaConfig, SambaForCausalLM, SambaModel
from fox_models.tokenizer import JSONGPT2Tokenizer, gpt2_tokenizer
from fox_models.transformer import TransformerConfig, TransformerForCausalLM, TransformerModel

__version__ = "0.1.0"

register_auto_classes()

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
    "SambaConfig",
    "SambaForCausalLM",
    "SambaModel",
    "TransformerConfig",
    "TransformerForCausalLM",
    "TransformerModel",
    "gpt2_tokenizer",
    "__version__",
]
