"""What makes an exported folder load without ``import fox_models``: transformers' ``auto_map`` in
config.json and tokenizer_config.json, naming classes of the small module ``fox_remote.py`` copied beside
the weights (it imports them from the installed fox-models, through ``remote_class``).

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    pipeline("text-generation", model=folder, trust_remote_code=True)

This module imports nothing of fox_models: ``fox_models.registry`` hands it the classes (``register``), so
the models' ``save_pretrained`` and the tokenizer can import it without an import circle.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

MODULE = "fox_remote"

_AUTO_MAPS: dict[str, dict[str, str]] = {}
"""model_type -> config.json's auto_map (filled by ``register``)."""
_CLASSES: dict[str, type] = {}
"""Every class that ``fox_remote`` hands out, by name (filled by ``register``)."""


def register(config_class: type | None = None, model_class: type | None = None, lm_class: type | None = None,
             tokenizer_class: type | None = None) -> None:
    """Make a model's config, backbone and causal-LM classes (and a tokenizer class) reachable through
    ``fox_remote`` and ``auto_map``. ``fox_models.registry`` calls it for every entry of ``MODELS``."""
    if config_class is not None:
        _AUTO_MAPS[config_class.model_type] = {"AutoConfig": f"{MODULE}.{config_class.__name__}",
                                               "AutoModel": f"{MODULE}.{model_class.__name__}",
                                               "AutoModelForCausalLM": f"{MODULE}.{lm_class.__name__}"}
        for cls in (config_class, model_class, lm_class):
            _CLASSES[cls.__name__] = cls
    if tokenizer_class is not None:
        _CLASSES[tokenizer_class.__name__] = tokenizer_class


def auto_map(config) -> dict[str, str]:
    """config.json's auto_map: the config, backbone and causal-LM classes registered for the config's type."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _AUTO_MAPS:
        raise ValueError(f"{type(config).__name__} is not a registered fox_models model (model_type "
                         f"{model_type!r}; registered: {', '.join(_AUTO_MAPS)})")
    return dict(_AUTO_MAPS[model_type])


def remote_class(name: str) -> type:
    """The class ``fox_remote.<name>`` of an auto_map: a registered config, backbone or causal-LM class, or the
    tokenizer, with transformers' auto-class registration turned off for it.

    transformers registers every class that remote code hands it (``register_for_auto_class``), and a
    registered class's ``save_pretrained`` copies the source file defining it (``configuration.py``,
    ``tokenizer.py``) beside the weights and points auto_map at that copy. fox-models' classes write an
    auto_map naming ``fox_remote`` and this module themselves, so for them registration does nothing: a folder
    saved from a model loaded with ``trust_remote_code`` is the folder ``import fox_models`` would save.
    Subclasses defined elsewhere are registered as transformers does."""
    if name not in _CLASSES:
        raise AttributeError(f"module {MODULE!r} has no attribute {name!r}")
    cls = _CLASSES[name]
    if "register_for_auto_class" not in vars(cls):
        cls.register_for_auto_class = classmethod(_registration_for(cls, cls.register_for_auto_class.__func__))
    return cls


def _registration_for(own: type, register):
    def register_for_auto_class(cls, *args, **kwargs):
        if cls is not own:  # a subclass of a fox-models class: transformers' registration
            register(cls, *args, **kwargs)

    return register_for_auto_class


def write_remote_module(directory) -> None:
    shutil.copyfile(str(resources.files("fox_models") / f"{MODULE}.py"), Path(directory) / f"{MODULE}.py")


def add_tokenizer_auto_map(directory, class_name: str) -> None:
    """tokenizer_config.json's auto_map (slow and fast class: the same one) and the module beside it."""
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["auto_map"] = {"AutoTokenizer": [f"{MODULE}.{class_name}", f"{MODULE}.{class_name}"]}
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    write_remote_module(directory)
