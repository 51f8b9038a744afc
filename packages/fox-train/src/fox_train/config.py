"""Structured configs of fox-train (Hydra): every field documented, unknown keys rejected.

Groups: ``model`` (every preset of fox-models, plus tiny CPU models), ``data``, ``optimizer``,
``schedule``, ``strategy`` and ``experiment`` (the paper's settings, under ``conf/experiment``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from fox_models.presets import PRESETS


@dataclass
class ModelConfig:
    preset: str = "fox-pro-tiny"
    """A fox-models preset (``fox-pro-760m``, ``transformer-llama-125m``...) or a tiny CPU model."""
    hidden_size: int | None = None
    """Fields below replace the preset's when set (None keeps the preset's value)."""
    num_hidden_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    hidden_ratio: float | None = None
    fgate_type: str | None = None
    """full | bias_only | fixed | none."""
    decay_time_min: float | None = None
    decay_time_max: float | None = None
    fgate_bias_init: bool | None = None
    qk_norm: bool | None = None
    use_output_gate: bool | None = None
    use_output_norm: bool | None = None
    use_k_shift: bool | None = None
    use_v_shift: bool | None = None
    use_rope: bool | None = None
    log_pruning_tolerance: float | None = None
    """Turn on adaptive computation pruning with this ln(eps) (the paper: -10)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Any other config field, added with a plus: ``+model.overrides.rope_base=10000``."""


@dataclass
class DataConfig:
    source: str = "bundled"
    """bundled (the King James Bible shipped in fox-train) | tokens (a .npy / .bin token file) | text (a .txt
    file or a folder of them) | longcrawl64 (zarr) | hf (a dataset saved with ``datasets.save_to_disk``)."""
    path: str | None = None
    """Training data (not needed for ``bundled``)."""
    heldout_path: str | None = None
    """Held-out data of the same kind; default: the held-out part of ``path`` (every 11th document)."""
    seq_len: int = 128
    """Tokens per training sequence (the first input token is BOS)."""
    order: str = "paper"
    """longcrawl64 reading order: ``paper`` (the first chunk of every document before any second chunk)
    or ``shuffled``; other sources: ``paper`` = stored order, ``shuffled`` = a seeded permutation."""
    text_field: str = "text"
    """Column holding the text in an hf dataset."""
    token_dtype: str = "uint16"
    """dtype of a raw ``.bin`` token file."""


@dataclass
class OptimizerConfig:
    lr: float = 5e-3
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    """Applied to matrices and embeddings; not to biases, norm weights or bias-only gates."""
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables)."""
    fused: bool | None = None
    """AdamW's fused CUDA kernel (one launch for all parameters, also for FSDP2's DTensors); None: on
    when training on GPUs. False: torch's default (foreach)."""


@dataclass
class ScheduleConfig:
    warmup_tokens: int = 10_240
    """Linear warmup length, in tokens."""
    total_tokens: int = 245_760
    """Training length in tokens; cosine decay to ``min_lr_ratio * lr`` at the end."""
    min_lr_ratio: float = 0.0


@dataclass
class StrategyConfig:
    name: str = "single"
    """single | ddp | fsdp | fsdp2 (through Lightning Fabric; fsdp2 is PyTorch's per-parameter
    ``fully_shard`` through Fabric's ModelParallelStrategy)."""
    accelerator: str = "auto"
    devices: Any = 1
    num_nodes: int = 1
    precision: str | None = None
    """Fabric precision; default bf16-mixed on GPU, 32-true on CPU."""
    fsdp_param_dtype: str = "bfloat16"
    """FSDP and FSDP2 under a mixed precision: dtype of the gathered parameters in forward and backward. bfloat16
    (default; Fabric's own policy: bf16 weights, reductions and buffers) halves the all-gather traffic;
    float32 keeps master weights in the compute with bf16 autocast and float32 reductions, as DDP does.
    Both followed the one-GPU loss curve within 0.5% on 2 x H200 (docs/performance.md)."""
    fsdp_sharding: str = "FULL_SHARD"
    """FSDP sharding strategy: FULL_SHARD (parameters, gradients and optimizer state; parameters are
    gathered again in the backward), SHARD_GRAD_OP (keeps gathered parameters from forward to backward:
    fewer all-gathers, more memory; suits small models), HYBRID_SHARD (full sharding within a node,
    replication across nodes) or NO_SHARD. FSDP2 takes FULL_SHARD or SHARD_GRAD_OP (its
    ``reshard_after_forward`` true or false); with SHARD_GRAD_OP it also keeps the parameters gathered
    across a step's micro-batches (one all-gather per step)."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    run_name: str | None = None
    """Directory name under ``out_dir``; default ``<preset>-<source>-<timestamp>``."""
    out_dir: str = "outputs"
    global_batch_tokens: int = 1024
    """Tokens per optimizer step across all devices (reached by gradient accumulation)."""
    micro_batch_size: int = 8
    """Sequences per device per forward pass."""
    seed: int = 0
    eval_every: int = 60
    """Steps between held-out evaluations."""
    eval_sequences: int = 16
    """Held-out sequences per evaluation."""
    log_every: int = 5
    checkpoint_every: int = 60
    keep_last: int = 2
    """Checkpoints kept from the newest back."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""
    resume: bool = False
    """Continue from the newest complete checkpoint of ``run_name`` (the newest run if unset)."""
    compile: bool = False
    """torch.compile each block."""
    compile_mode: str | None = None
    """torch.compile mode of the blocks when ``compile`` is on: None (default), "reduce-overhead" or
    "max-autotune" (both run the blocks as CUDA graphs, which takes the host's kernel launches off the
    step: it matters when the GPU work is small, as with pruning), "max-autotune-no-cudagraphs".
    CUDA graphs are supported with the single and ddp strategies."""
    activation_memory_budget: float | None = None
    """With ``compile``: the fraction (0, 1] of the activations a compiled block may keep for its backward;
    below 1, inductor's partitioner recomputes the cheapest ops (norms, gates, token shift) instead of
    saving their outputs (torch._functorch.config.activation_memory_budget). Any budget from 0.8 to 0.97
    put the 125M and 760M FoX (Pro) under the default Transformer's peak memory, at 0.4-0.7% (125M) and
    1.6-2.3% (760M) of their speed on an H100 (docs/performance.md, session 19). None: torch's default."""
    gradient_checkpointing: bool = False
    recompute_projections: bool = False
    """Selective recomputation in FoX attention layers: keep only each layer's input and the attention's
    q/k/v/output for the backward (see ForgettingTransformerModel.enable_projection_recompute)."""
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "fox"
    export: bool = True
    """Write the Hugging Face model directory (hf/) at the end."""


TINY = {
    "fox-pro-tiny": ("fox-pro-125m", dict(hidden_size=128, num_hidden_layers=2, num_heads=4)),
    "fox-llama-tiny": ("fox-llama-125m", dict(hidden_size=128, num_hidden_layers=2, num_heads=4)),
    "transformer-llama-tiny": ("transformer-llama-125m", dict(hidden_size=128, num_hidden_layers=2, num_heads=2)),
    # the recurrent baselines (a PyTorch recurrence on the CPU: slow, for smoke runs)
    "mamba2-tiny": ("mamba2-760m", dict(hidden_size=128, num_hidden_layers=2, num_heads=4, head_dim=64, state_size=16)),
    "hgrn2-tiny": ("hgrn2-760m", dict(hidden_size=128, num_hidden_layers=2, num_heads=2, expand_ratio=64)),
    "delta_net-tiny": ("delta_net-760m", dict(hidden_size=128, num_hidden_layers=2, num_heads=2)),
}


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name in (*PRESETS, *TINY):
        cs.store(group="model", name=name, node=ModelConfig(preset=name))
    for name in ("bundled", "tokens", "text", "longcrawl64", "hf"):
        cs.store(group="data", name=name, node=DataConfig(source=name))
    cs.store(group="optimizer", name="adamw", node=OptimizerConfig())
    cs.store(group="schedule", name="warmup_cosine", node=ScheduleConfig())
    for name in ("single", "ddp", "fsdp", "fsdp2"):
        cs.store(group="strategy", name=name, node=StrategyConfig(name=name))


def model_config(cfg: ModelConfig):
    """The fox-models config for a preset name (tiny presets included) with the overrides applied."""
    from fox_models.presets import get_preset

    base, extra = TINY.get(cfg.preset, (cfg.preset, {}))
    fields = {k: v for k, v in vars(cfg).items() if k not in ("preset", "overrides") and v is not None}
    return get_preset(base, **{**extra, **fields, **dict(cfg.overrides)})
