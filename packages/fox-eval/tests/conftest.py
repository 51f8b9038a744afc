import pytest

from fox_eval.cli import OFFLINE_VARIABLES


@pytest.fixture(autouse=True)
def _restore_offline_variables(monkeypatch):
    """``fox-eval`` sets the Hub's offline switches for its process; give each test the environment it began with."""
    for var in OFFLINE_VARIABLES:
        monkeypatch.setenv(var, "1")
        monkeypatch.delenv(var)
