"""flash-linear-attention's own model of a recurrent baseline's configuration, for side-by-side speed.

The paper's recurrent baselines (Mamba-2, HGRN2, DeltaNet) were trained with flash-linear-attention's
models; ours keep the released checkpoint format and fields. ``fla_config(config)`` translates one of our
configs into flash-linear-attention's config of the same model (same widths, heads, state, convolution,
MLP and vocabulary, hence the same parameter count), ``fla_model(config)`` builds that model, so a
benchmark can time both in one run, and ``fla_state_dict(state_dict)`` renames our weights into its layout.
Needs ``fox-models[baselines]``.

Two settings of flash-linear-attention 0.6's HGRN2 differ from the released HGRN2: its output norm (a fused
norm + linear) keeps that function's default eps of 1e-5 whatever ``norm_eps`` says (the released configs
say 1e-6), and its blocks apply the learned lower bound of the forget gate (the released blocks do not:
ours with ``apply_lower_bound=True`` does). With both matched the two compute the same function.
"""

from __future__ import annotations

import inspect

# model_type -> (flash-linear-attention's config class, its causal-LM class, our field -> its field where the
# names differ)
_FLA = {
    "mamba2-project_fox": ("Mamba2Config", "Mamba2ForCausalLM", {
        "layer_norm_epsilon": "norm_eps", "time_step_min": "dt_min", "time_step_max": "dt_max",
        "time_step_floor": "dt_init_floor", "time_step_limit": "dt_limit", "rms_norm": "rmsnorm"}),
    "hgrn2-project_fox": ("HGRN2Config", "HGRN2ForCausalLM", {}),
    "delta_net-project_fox": ("DeltaNetConfig", "DeltaNetForCausalLM", {}),
}


def _fla_models():
    try:
        import fla.models
    except ImportError as e:
        raise ImportError("flash-linear-attention is not installed: pip install 'fox-models[baselines]'") from e
    return fla.models


def fla_config(config):
    """flash-linear-attention's config of the same model as ``config`` (a Mamba-2, HGRN2 or DeltaNet config).

    Fields with the same meaning are carried over (renamed where flash-linear-attention names them
    differently); fields flash-linear-attention does not have are dropped, and its own options (fused norms,
    fused SwiGLU, fused loss) keep their defaults, as its users get them.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in _FLA:
        raise ValueError(f"config: flash-linear-attention has a model of {sorted(_FLA)}, got {model_type!r}")
    config_name, _, renamed = _FLA[model_type]
    config_cls = getattr(_fla_models(), config_name)
    accepted = set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}
    fields = {renamed.get(k, k): v for k, v in config.to_dict().items()}
    fields = {k: v for k, v in fields.items() if k in accepted}
    if "dt_limit" in fields:
        fields["dt_limit"] = tuple(fields["dt_limit"])
    return config_cls(**fields)


def fla_model(config):
    """flash-linear-attention's causal LM of the same model as ``config``, freshly initialised."""
    cfg = fla_config(config)
    return getattr(_fla_models(), _FLA[config.model_type][1])(cfg)


def fla_state_dict(state_dict: dict) -> dict:
    """Our weights in flash-linear-attention's layout: the released layout fuses the SwiGLU's gate and up
    projections into one ``mlp.gate_proj`` (gate rows first); flash-linear-attention 0.6 keeps two."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.gate_proj.weight"):
            out[name], out[name.replace("gate_proj", "up_proj")] = tensor.chunk(2, dim=0)
        else:
            out[name] = tensor
    return out
