"""Every model of the package, in one list: ``MODELS``, one ``ModelEntry`` a model type.

An entry names the model's config and model classes (registered with transformers' Auto classes when
``fox_models`` is imported, and handed to exported folders' remote code), its named configs
(``fox_models.presets``), and what a trainer needs to know without naming the model's internals: which
modules are its blocks (FSDP wraps each) and which parameters take no weight decay.

    entry = model_entry(model.config)     # or model_entry(model)
    entry.blocks                          # (FoxBlock,)
    no_weight_decay(model)                # {"model.norm.weight", "model.layers.0.attn_norm.weight", ...}
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fox_layers import GroupRMSNorm, RMSNorm
from fox_models import delta_net, fox, hgrn2, hub, mamba2, samba, transformer
from fox_models.recurrent import RecurrentBlock
from fox_models.tokenizer import JSONGPT2Tokenizer


@dataclass(frozen=True)
class ModelEntry:
    config_class: type
    """Its ``model_type`` names the model in config.json."""
    model_class: type
    """The backbone (``AutoModel``)."""
    lm_class: type
    """The causal LM (``AutoModelForCausalLM``)."""
    blocks: tuple[type[nn.Module], ...]
    """The classes of the modules that make up its layers: a trainer wraps each such module (FSDP)."""
    presets: dict[str, dict]
    """The paper's named configs: preset name -> config fields (``fox_models.presets`` adds the vocabulary)."""
    tiny: dict[str, dict]
    """Tiny named configs for tests and CPU smoke runs, in the same form."""
    no_decay_modules: tuple[type[nn.Module], ...] = (RMSNorm, GroupRMSNorm)
    """Every parameter held directly by a module of these classes takes no weight decay..."""
    no_decay_names: tuple[str, ...] = ("bias",)
    """...nor does every parameter whose own name (the last part of its dotted name) is one of these."""
    context_parallel: bool = False
    """Whether one sequence can be split across ranks: every layer that mixes tokens is a Forgetting Attention
    layer, whose kernel call a trainer replaces (``fox_kernel.context_parallel.ContextParallel``)."""


MODELS = (
    ModelEntry(fox.ForgettingTransformerConfig, fox.ForgettingTransformerModel, fox.ForgettingTransformerForCausalLM,
               blocks=(fox.FoxBlock,), presets=fox.PRESETS, tiny=fox.TINY, no_decay_names=("bias", "fgate_bias"),
               context_parallel=True),
    ModelEntry(transformer.TransformerConfig, transformer.TransformerModel, transformer.TransformerForCausalLM,
               blocks=(fox.FoxBlock,), presets=transformer.PRESETS, tiny=transformer.TINY, context_parallel=True),
    ModelEntry(mamba2.Mamba2Config, mamba2.Mamba2Model, mamba2.Mamba2ForCausalLM, blocks=(mamba2.Mamba2Block,),
               presets=mamba2.PRESETS, tiny=mamba2.TINY, no_decay_modules=(RMSNorm, mamba2.GatedRMSNorm),
               no_decay_names=("bias", "A_log", "D", "dt_bias")),
    ModelEntry(hgrn2.HGRN2Config, hgrn2.HGRN2Model, hgrn2.HGRN2ForCausalLM, blocks=(RecurrentBlock,),
               presets=hgrn2.PRESETS, tiny=hgrn2.TINY, no_decay_names=("bias", "lower_bounds")),
    ModelEntry(delta_net.DeltaNetConfig, delta_net.DeltaNetModel, delta_net.DeltaNetForCausalLM,
               blocks=(RecurrentBlock,), presets=delta_net.PRESETS, tiny=delta_net.TINY),
    ModelEntry(samba.SambaConfig, samba.SambaModel, samba.SambaForCausalLM, blocks=(samba.SambaBlock,),
               presets=samba.PRESETS, tiny=samba.TINY, no_decay_names=("bias", "A_log", "D")),
)

_BY_TYPE = {entry.config_class.model_type: entry for entry in MODELS}

for _entry in MODELS:
    hub.register(_entry.config_class, _entry.model_class, _entry.lm_class)
hub.register(tokenizer_class=JSONGPT2Tokenizer)


def model_entry(config_or_model) -> ModelEntry:
    """The entry of a config, or of a model (by its ``config``)."""
    config = getattr(config_or_model, "config", config_or_model)
    model_type = getattr(config, "model_type", None)
    if model_type not in _BY_TYPE:
        raise ValueError(f"{type(config_or_model).__name__} is not a registered fox_models model (model_type "
                         f"{model_type!r}; registered: {', '.join(_BY_TYPE)})")
    return _BY_TYPE[model_type]


def classes_by_name() -> dict[str, type]:
    """Every registered config and model class by its name (the names in config.json's ``auto_map``)."""
    return {cls.__name__: cls for e in MODELS for cls in (e.config_class, e.model_class, e.lm_class)}


def register_auto_classes() -> None:
    """Register every model with AutoConfig, AutoModel and AutoModelForCausalLM, and the GPT-2 tokenizer
    with AutoTokenizer."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    for e in MODELS:
        AutoConfig.register(e.config_class.model_type, e.config_class, exist_ok=True)
        AutoModel.register(e.config_class, e.model_class, exist_ok=True)
        AutoModelForCausalLM.register(e.config_class, e.lm_class, exist_ok=True)
        AutoTokenizer.register(e.config_class, fast_tokenizer_class=JSONGPT2Tokenizer, exist_ok=True)


def no_weight_decay(model: nn.Module) -> set[str]:
    """The names (as ``model.named_parameters()`` gives them) of the parameters that take no weight decay,
    by the model's entry. ``model`` may be wrapped (Fabric, FSDP2) as long as ``model.config`` reaches its
    config."""
    entry = model_entry(model)
    held = {id(p) for m in model.modules() if isinstance(m, entry.no_decay_modules)
            for p in m.parameters(recurse=False)}
    return {name for name, p in model.named_parameters()
            if id(p) in held or name.rpartition(".")[2] in entry.no_decay_names}
