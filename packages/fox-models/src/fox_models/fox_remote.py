"""The code of an exported model folder, for ``trust_remote_code=True``: the classes that config.json's and
tokenizer_config.json's ``auto_map`` name come from the installed fox-models (``pip install fox-models``), so
loading runs no code from the folder itself beyond these lines, and a folder never carries a stale copy of
the model."""

from fox_models import JSONGPT2Tokenizer  # noqa: F401  (named by tokenizer_config.json's auto_map)
from fox_models.registry import classes_by_name


def __getattr__(name: str) -> type:
    """config.json's auto_map classes: the config, backbone and causal-LM class of every registered model."""
    try:
        return classes_by_name()[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
