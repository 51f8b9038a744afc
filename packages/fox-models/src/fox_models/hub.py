"""What makes an exported folder load without ``import fox_models``: transformers' ``auto_map`` in
config.json and tokenizer_config.json, naming classes of the small module ``fox_remote.py`` copied beside
the weights (it imports them from the installed fox-models).

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


def write_remote_module(directory) -> None:
    shutil.copyfile(str(resources.files("fox_models") / f"{MODULE}.py"), Path(directory) / f"{MODULE}.py")


def add_tokenizer_auto_map(directory, class_name: str) -> None:
    """tokenizer_config.json's auto_map (slow and fast class: the same one) and the module beside it."""
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["auto_map"] = {"AutoTokenizer": [f"{MODULE}.{class_name}", f"{MODULE}.{class_name}"]}
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    write_remote_module(directory)
