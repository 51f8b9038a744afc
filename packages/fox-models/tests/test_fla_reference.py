"""flash-linear-attention's model of a baseline's config is the same model: same parameters, same shapes, and
with our weights the same function (through the Triton interpreter on the CPU, compiled on a GPU)."""

import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from fox_kernel.testing import assert_close_to_reference, run_interpreted
from fox_models.presets import get_preset

pytest.importorskip("fla.models")

from fox_models.fla_reference import fla_config, fla_model, fla_state_dict  # noqa: E402

KINDS = ["mamba2", "hgrn2", "delta_net"]
SIZES = ["tiny", "125m", "360m", "760m"]


def _shapes(state_dict):
    return {name: tuple(t.shape) for name, t in state_dict.items()}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_fla_model_has_our_parameters(kind, size):
    config = get_preset(f"{kind}-{size}")
    with torch.device("meta"):
        ours = AutoModelForCausalLM.from_config(config)
        theirs = fla_model(config)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert _shapes(fla_state_dict(ours.state_dict())) == _shapes(theirs.state_dict())


@pytest.mark.parametrize("kind", KINDS)
def test_fla_config_carries_every_shared_field(kind):
    config = get_preset(f"{kind}-760m")
    theirs = fla_config(config)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "bos_token_id", "eos_token_id",
                  "tie_word_embeddings", "initializer_range"):
        assert getattr(theirs, field) == getattr(config, field), field
    if kind == "mamba2":
        pairs = {"norm_eps": "layer_norm_epsilon", "dt_min": "time_step_min", "dt_max": "time_step_max",
                 "dt_init_floor": "time_step_floor", "state_size": "state_size", "n_groups": "n_groups",
                 "head_dim": "head_dim", "expand": "expand", "conv_kernel": "conv_kernel", "chunk_size": "chunk_size"}
        assert tuple(theirs.dt_limit) == tuple(config.time_step_limit)
    else:
        pairs = {"norm_eps": "norm_eps", "num_heads": "num_heads", "hidden_ratio": "hidden_ratio",
                 "use_short_conv": "use_short_conv", "conv_size": "conv_size", "hidden_act": "hidden_act"}
        pairs.update({"expand_ratio": "expand_ratio", "use_lower_bound": "use_lower_bound"} if kind == "hgrn2" else
                     {"qk_norm": "qk_norm", "qk_activation": "qk_activation", "use_beta": "use_beta",
                      "use_output_norm": "use_output_norm", "use_gate": "use_gate"})
    for theirs_name, ours_name in pairs.items():
        assert getattr(theirs, theirs_name) == getattr(config, ours_name), theirs_name


def test_fla_config_names_what_it_cannot_translate():
    with pytest.raises(ValueError, match="config: flash-linear-attention has a model of"):
        fla_config(get_preset("fox-pro-tiny"))


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FUNCTION_CASES = [
    pytest.param("cpu", id="interpreted", marks=pytest.mark.skipif(not INTERPRET, reason="runs under TRITON_INTERPRET=1")),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu,
                                           pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


@pytest.fixture
def one_autotune_config(monkeypatch):
    """The interpreter cannot time kernels: flash-linear-attention's autotuned kernels take their first config."""
    if INTERPRET:
        from triton.runtime.autotuner import Autotuner

        run = Autotuner.run

        def first_config(self, *args, **kwargs):
            self.configs = self.configs[:1]
            return run(self, *args, **kwargs)

        monkeypatch.setattr(Autotuner, "run", first_config)


@pytest.mark.parametrize("device", FUNCTION_CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_fla_model_computes_our_function(kind, device, one_autotune_config):
    """Our weights in flash-linear-attention's model give our logits (float32, its Triton kernels), measured
    against our model in float64. HGRN2 with two settings of flash-linear-attention 0.6's (the released
    checkpoints have neither): its output norm keeps eps 1e-5 whatever ``norm_eps`` says, and its blocks apply
    the learned lower bound of the forget gate (ours with ``apply_lower_bound=True``)."""
    hgrn2 = dict(norm_eps=1e-5, apply_lower_bound=True) if kind == "hgrn2" else {}
    overrides = dict(num_hidden_layers=2, vocab_size=101, **hgrn2)
    config = get_preset(f"{kind}-tiny", **overrides)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norm weights and HGRN2 lower bounds
        for name, p in ours.named_parameters():
            if "norm" in name and name.endswith("weight") or name.endswith("lower_bounds"):
                p.add_(0.2 * torch.randn_like(p))
    theirs = fla_model(config).eval()
    theirs.load_state_dict(fla_state_dict(ours.state_dict()))
    ids = torch.randint(0, 101, (2, 61), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = copy.deepcopy(ours).double()(ids).logits
        same = ours(ids).logits
        got = theirs.to(device)(ids.to(device)).logits.cpu()
    assert_close_to_reference(got, exact, same, name=f"{kind} logits", factor=4.0)


def test_fla_models_in_the_interpreter():
    if INTERPRET:
        pytest.skip("already inside the interpreted run")
    run_interpreted(__file__, select="interpreted", timeout=900)
