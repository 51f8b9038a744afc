"""The code of an exported model folder, for ``trust_remote_code=True``: the classes that config.json's and
tokenizer_config.json's ``auto_map`` name come from the installed fox-models (``pip install fox-models``), so
loading runs no code from the folder itself beyond these lines, and a folder never carries a stale copy of
the model: saving a model or tokenizer loaded this way writes this module again, never the files that
define its classes (see ``fox_models.hub.remote_class``)."""

from fox_models import hub


def __getattr__(name: str) -> type:
    """auto_map's classes: the config, backbone and causal-LM class of every registered model, and the
    tokenizer."""
    return hub.remote_class(name)
