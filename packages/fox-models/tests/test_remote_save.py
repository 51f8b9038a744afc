"""A folder saved from a model and tokenizer loaded with ``trust_remote_code`` (no ``import fox_models``) holds
``fox_remote.py`` and no copy of fox-models' source, with auto_map naming ``fox_remote`` as before."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import fox_models
from fox_models import hub
from fox_models.presets import get_preset

SAVED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "fox_remote.py"}


def test_remote_code_save_writes_only_fox_remote(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(get_preset("fox-pro-125m", hidden_size=64, num_hidden_layers=2,
                                                        num_heads=2)).eval()
    src, dst = tmp_path / "src", tmp_path / "dst"
    model.save_pretrained(src)
    fox_models.JSONGPT2Tokenizer().save_pretrained(src)
    ids = [[50256, 600, 31, 7, 4242, 17]]
    code = f"""
import json, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
assert "fox_models" not in sys.modules
m = AutoModelForCausalLM.from_pretrained({str(src)!r}, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained({str(src)!r}, trust_remote_code=True)
m.save_pretrained({str(dst)!r})
tok.save_pretrained({str(dst)!r})
again = AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True).eval()
print(json.dumps({{"files": sorted(os.listdir({str(dst)!r})), "logits": again(torch.tensor({ids})).logits.tolist(),
                  "tok": type(AutoTokenizer.from_pretrained({str(dst)!r}, trust_remote_code=True)).__name__}}))
"""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got["files"]) == SAVED  # no configuration.py, modeling.py or tokenizer.py
    config = json.loads((dst / "config.json").read_text())
    assert config["auto_map"] == json.loads((src / "config.json").read_text())["auto_map"]
    assert all(v.startswith("fox_remote.") for v in config["auto_map"].values())
    tok_map = json.loads((dst / "tokenizer_config.json").read_text())["auto_map"]
    assert tok_map == {"AutoTokenizer": ["fox_remote.JSONGPT2Tokenizer", "fox_remote.JSONGPT2Tokenizer"]}
    assert (dst / "fox_remote.py").read_text() == (src / "fox_remote.py").read_text()
    assert got["tok"] == "JSONGPT2Tokenizer"
    torch.testing.assert_close(torch.tensor(got["logits"]), model(torch.tensor(ids)).logits)


def test_registration_is_off_for_fox_models_classes_only():
    cls = hub.remote_class("ForgettingTransformerConfig")
    assert cls is fox_models.ForgettingTransformerConfig
    cls.register_for_auto_class()
    assert cls._auto_class is None

    class MyConfig(fox_models.ForgettingTransformerConfig):  # a user's subclass keeps transformers' behaviour
        pass

    MyConfig.register_for_auto_class()
    assert MyConfig._auto_class == "AutoConfig" and cls._auto_class is None
    with pytest.raises(AttributeError, match="NoSuchClass"):
        hub.remote_class("NoSuchClass")
