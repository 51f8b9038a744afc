"""transformers' own common model tests, unchanged, on FoX (Pro) and the Transformer (LLaMA).

transformers' ``CausalLMModelTest`` (``ModelTesterMixin``, ``GenerationTesterMixin``, the pipeline, training,
tensor-parallel and FSDP mixins) and its ``CausalLMModelTester`` live in the transformers repository's
``tests/``, which neither the wheel nor the sdist ships whole. ``.ci/fetch_transformers_tests.py`` fetches
them for the installed transformers release into ``.transformers-tests/<version>/`` (ignored by git; CI runs
it before the tests), so they always match the installed release; without that folder this module is
skipped. ``FOX_TRANSFORMERS_TESTS`` may name another such folder.

The testers below are transformers' stock ``CausalLMModelTester`` with these models' classes and the fields
their configs need (SwiGLU's activation, FoX (Pro)'s switches). This module skips nothing itself: every skip
is one of transformers' tests' own (a GPU, a package, ``RUN_SLOW``, a feature these models do not declare).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import unittest
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

from fox_models.fox import (
    ForgettingTransformerConfig,
    ForgettingTransformerForCausalLM,
    ForgettingTransformerModel,
)
from fox_models.preset_fields import PRO
from fox_models.transformer import TransformerConfig, TransformerForCausalLM, TransformerModel

ROOT = Path(__file__).resolve().parents[3]
FOLDER = Path(os.environ.get("FOX_TRANSFORMERS_TESTS") or ROOT / ".transformers-tests" / transformers.__version__)

if not (FOLDER / "tests" / "causal_lm_tester.py").is_file():
    pytest.skip(f"transformers' common tests for release {transformers.__version__} are not in {FOLDER}: "
                "`uv run python .ci/fetch_transformers_tests.py` fetches them (needs github.com)",
                allow_module_level=True)


# The transformers repository's top-level packages its test files import (``tests.*`` and ``utils.*`` from
# the repository's root, ``test_module`` from utils/): generic names, held in sys.modules only while importing.
REPOSITORY_PACKAGES = ("tests", "utils", "test_module")


def import_causal_lm_tester(folder: Path):
    """transformers' ``tests.causal_lm_tester`` from ``folder`` (the repository's layout).

    Its modules import each other as ``tests.*`` (and ``utils.*``, ``test_module``), names this workspace's
    own ``tests/`` folder or another package may already hold in ``sys.modules``: those entries are set aside
    while they are imported and put back after, so the two never mix. ``direct_transformers_import`` (by which
    two of them load transformers from the repository's source tree, absent here) returns the installed
    package, the same release.
    """
    def ours(name):
        return name.split(".")[0] in REPOSITORY_PACKAGES

    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if ours(name)}
    sys.path.insert(0, str(folder))
    try:
        with mock.patch("transformers.utils.direct_transformers_import", lambda *args, **kwargs: transformers):
            return importlib.import_module("tests.causal_lm_tester")
    finally:
        sys.path.remove(str(folder))
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


causal_lm_tester = import_causal_lm_tester(FOLDER)


class _FoxLayoutTester(causal_lm_tester.CausalLMModelTester):
    """The stock tester (its sizes: hidden 32, 2 layers, 2 heads, vocabulary 99, batch 13, length 7)."""

    fields: dict = {}

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **{"hidden_act": "silu", **self.fields, **kwargs})  # the MLP is SwiGLU

    @property
    def config_args(self):
        # the config's fields are keyword arguments of its base classes' __init__ too
        return [name for cls in self.config_class.__mro__ if "__init__" in vars(cls)
                for name in inspect.signature(cls.__init__).parameters]


class FoxProModelTester(_FoxLayoutTester):
    base_model_class = ForgettingTransformerModel
    config_class = ForgettingTransformerConfig
    causal_lm_class = ForgettingTransformerForCausalLM
    fields = PRO


class TransformerModelTester(_FoxLayoutTester):
    base_model_class = TransformerModel
    config_class = TransformerConfig
    causal_lm_class = TransformerForCausalLM


TESTERS = (FoxProModelTester, TransformerModelTester)


@pytest.fixture(autouse=True)
def one_thread():
    """The models are tiny: a second intra-op thread gains nothing and, on a CPU busy with other work (CI runs
    the interpreted kernel tests beside these), waits for the core: 20 ms a training step on one thread,
    400 ms on two, on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def listed_in_transformers_name_tables():
    """transformers' tests decide what to check for a class by looking its name up in transformers' tables of
    its models (backbones in ``MODEL_MAPPING_NAMES``: no loss to train; causal LMs in
    ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: labels, loss, generation); a model in the library is listed there.
    These models register with the Auto classes at import instead, so each test runs with them listed."""
    def names(role):
        return {tester.config_class.model_type: getattr(tester, role).__name__ for tester in TESTERS}

    with mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, names("base_model_class")), \
            mock.patch.dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, names("causal_lm_class")):
        yield


class FoxProModelTest(causal_lm_tester.CausalLMModelTest, unittest.TestCase):
    model_tester_class = FoxProModelTester


class TransformerModelTest(causal_lm_tester.CausalLMModelTest, unittest.TestCase):
    model_tester_class = TransformerModelTester
