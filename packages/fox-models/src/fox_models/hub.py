"""What makes an exported folder load without ``import fox_models``: transformers' ``auto_map`` in
config.json and tokenizer_config.json, naming classes of the small module ``fox_remote.py`` copied beside
the weights (it imports them from the installed fox-models, through ``remote_class``).

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    pipeline("text-generation", model=folder, trust_remote_code=True)
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

from fox_models.registry import model_entry

MODULE = "fox_remote"


def auto_map(config) -> dict[str, str]:
    """config.json's auto_map: the config, backbone and causal-LM classes of the config's registry entry."""
    entry = model_entry(config)
    return {"AutoConfig": f"{MODULE}.{entry.config_class.__name__}",
            "AutoModel": f"{MODULE}.{entry.model_class.__name__}",
            "AutoModelForCausalLM": f"{MODULE}.{entry.lm_class.__name__}"}


def remote_class(name: str) -> type:
    """The class ``fox_remote.<name>`` of an auto_map: a registered config, backbone or causal-LM class, or the
    tokenizer, with transformers' auto-class registration turned off for it.

    transformers registers every class that remote code hands it (``register_for_auto_class``), and a
    registered class's ``save_pretrained`` copies the source file defining it (``configuration.py``,
    ``tokenizer.py``) beside the weights and points auto_map at that copy. fox-models' classes write an
    auto_map naming ``fox_remote`` and this module themselves, so for them registration does nothing: a folder
    saved from a model loaded with ``trust_remote_code`` is the folder ``import fox_models`` would save.
    Subclasses defined elsewhere are registered as transformers does."""
    from fox_models.registry import classes_by_name
    from fox_models.tokenizer import JSONGPT2Tokenizer

    classes = {**classes_by_name(), JSONGPT2Tokenizer.__name__: JSONGPT2Tokenizer}
    if name not in classes:
        raise AttributeError(f"module {MODULE!r} has no attribute {name!r}")
    cls = classes[name]
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
