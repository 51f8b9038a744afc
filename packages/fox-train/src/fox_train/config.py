"""Structured configs of fox-train (Hydra): every field documented, unknown keys rejected.

Groups: ``model`` (every preset of fox-models, plus tiny CPU models), ``data``, ``optimizer``,
``schedule``, ``strategy`` and ``experiment`` (``conf/experiment``: the 30 official LongCrawl64
experiments under ``longcrawl64/<dir>/<name>``).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import string
from dataclasses import dataclass, field, fields
from operator import attrgetter
from pathlib import Path
from typing import Any, get_args, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from fox_train.errors import first_line


@dataclass
class ModelConfig:
    preset: str = "fox-pro-tiny"
    """A fox-models preset (``fox-pro-760m``, ``transformer-llama-125m``, ``mamba2-360m``, ``samba-760m``...) or a
    tiny CPU model (``fox-pro-tiny``...). ``model=NAME`` selects one and fills the fields below with its values;
    a field set here replaces the preset's."""
    hidden_size: int | None = None
    """The model's fields: set by ``model=NAME`` to the preset's values; None where the field does not belong
    to that kind of model (setting such a field is an error)."""
    num_hidden_layers: int | None = None
    num_heads: int | None = None
    """Attention heads; Mamba-2: SSM heads; SAMBA: the heads of its attention layers."""
    num_kv_heads: int | None = None
    hidden_ratio: float | None = None
    """MLP width ratio (intermediate = 256 * ceil(int(hidden * ratio * 2/3) / 256))."""
    use_rope: bool | None = None
    rope_base: float | None = None
    window_size: int | None = None
    """Sliding-window attention over this many tokens (Transformer-SWA and SAMBA: 2048), for FoX and
    Transformer presets; None: full causal attention."""
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
    log_pruning_tolerance: float | None = None
    """Turn on adaptive computation pruning with this ln(eps) (the paper: -10)."""
    head_dim: int | None = None
    """Mamba-2: size of each SSM head."""
    state_size: int | None = None
    """Mamba-2 and SAMBA: SSM state size."""
    expand: int | None = None
    """Mamba-2 and SAMBA: inner width / hidden."""
    expand_ratio: int | None = None
    """HGRN2: forget-gate (key) size of each head; heads = hidden / expand_ratio."""
    conv_size: int | None = None
    """DeltaNet: short convolution width."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Any other config field, added with a plus: ``+model.overrides.norm_eps=1e-5``."""


MODEL_FIELDS = tuple(f.name for f in fields(ModelConfig) if f.name not in ("preset", "overrides"))

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


SCHEDULES = ("warmup_cosine", "warmup_linear", "warmup_one_minus_sqrt", "constant")


@dataclass
class ScheduleConfig:
    """The official trainer's learning-rate schedules, keyed on tokens seen (see fox_train.train.lr_at)."""

    name: str = "warmup_cosine"
    """warmup_cosine (linear warmup from 0, then cosine), warmup_linear (linear warmup, then linear decay),
    warmup_one_minus_sqrt (linear warmup, constant, then ``1 - sqrt`` over the last ``anneal_tokens``) or
    constant; ``schedule=NAME`` selects one."""
    warmup_tokens: int = 10_240
    """Linear warmup length, in tokens (not used by constant)."""
    total_tokens: int = 245_760
    """Training length in tokens; the decay reaches ``min_lr_ratio * lr`` here."""
    anneal_tokens: int | None = None
    """warmup_one_minus_sqrt only (required there): the length of the final decay, in tokens."""
    min_lr_ratio: float = 0.0
    """The final learning rate as a fraction of ``optimizer.lr`` (the official end_value / peak_value)."""


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
    context_parallel: int = 1
    """Ranks that share each sequence (context parallelism; must divide devices x nodes, and 2 x it must
    divide data.seq_len): each holds two chunks of every sequence (zigzag), so a sequence can be as long
    as all of them hold. The other factor of the world is data parallelism. Attention models only."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    run_name: str | None = None
    """The run directory under ``out_dir`` (Hydra's run directory); default ``<preset>-<source>-<timestamp>``.
    With ``-m`` the jobs run in ``out_dir/<run_name or multirun-<timestamp>>/<job number>``."""
    out_dir: str = "outputs"
    global_batch_tokens: int = 1024
    """Tokens per optimizer step across all devices (reached by gradient accumulation)."""
    micro_batch_size: int = 8
    """Sequences per device per forward pass, at most: lowered (with a printed line) to the largest size that
    divides each data-parallel rank's share of a step's sequences (fox_train.data.micro_batch_for)."""
    seed: int = 0
    eval_every: int = 60
    """Steps between held-out evaluations."""
    eval_sequences: int = 16
    """Held-out sequences per evaluation."""
    log_every: int = 5
    checkpoint_every: int = 60
    keep_last: int = 2
    """Checkpoints kept from the newest back (at least 1)."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""
    resume: bool = False
    """Continue from the newest complete checkpoint of ``run_name`` (the newest run if unset): weights,
    optimizer state and step, under the run's saved ``config.yaml``. Command-line values that differ from
    it are refused, except for the keys in ``RESUMABLE`` (e.g. ``schedule.total_tokens`` to extend a
    finished run). Without ``resume``, a run directory that holds checkpoints is refused."""
    init_from: str | None = None
    """Warm start (fork): begin this run at step 0 with a fresh optimizer from the model weights of another
    run: a checkpoint directory (``outputs/<run>/checkpoints/step-XXXXXXXX``), a run directory (its newest
    complete checkpoint) or a Hugging Face model directory. The architecture must match. With ``resume``,
    a checkpoint of this run, once there is one, wins."""
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
    1.6-2.3% (760M) of their speed on an H100 (docs/performance.md, memory-budgets-h100-s19.json). None: torch's
    default."""
    gradient_checkpointing: bool = False
    recompute_projections: bool = False
    """Selective recomputation in FoX attention layers: keep only each layer's input and the attention's
    q/k/v/output for the backward (see ForgettingTransformerModel.enable_projection_recompute)."""
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "fox"
    export: bool = True
    """Write the Hugging Face model directory (hf/) at the end."""


@functools.cache
def _fox_models_presets() -> dict[str, dict[str, Any]]:
    """Every fox-models preset (the paper's models, then the tiny ones) -> its config fields, from
    ``fox_models/preset_fields.py``, the presets' plain data. That module imports nothing; it is run from its
    file under a private name, since importing it as ``fox_models.preset_fields`` would first import the
    ``fox_models`` package, which loads torch and transformers (seconds of ``fox-train --help``).
    ``find_spec`` of the top-level package only locates it."""
    spec = importlib.util.find_spec("fox_models")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fox-train needs fox-models (the package fox_models was not found)")
    path = Path(next(iter(spec.submodule_search_locations))) / "preset_fields.py"
    module_spec = importlib.util.spec_from_file_location("_fox_train_preset_fields", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return {name: fields for part in (module.PRESETS, module.TINY) for family in part.values()
            for name, fields in family.items()}


def model_fields(values: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields among a model config's ``values`` (None and values of another kind left out:
    DeltaNet's ``qk_norm`` is "l2", not ours to set)."""
    hints = get_type_hints(ModelConfig)
    found = {}
    for k in MODEL_FIELDS:
        value = values.get(k)
        kinds = tuple(t for t in get_args(hints[k]) if t is not type(None))
        if float in kinds:
            kinds += (int,)
        if value is not None and isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
            found[k] = value
    return found


def preset_names() -> list[str]:
    """Every fox-models preset: the paper's models, then the tiny ones."""
    return list(_fox_models_presets())


def preset_fields(name: str) -> dict[str, Any]:
    """The ModelConfig fields of a preset, as ``model=NAME`` fills them in (read without importing torch)."""
    return model_fields(_fox_models_presets()[name])


class _SharedRepo(dict):
    """ConfigStore's repository, deep copied as itself. Hydra deep copies its config repository, ConfigStore
    included, for each config group that ``--help`` lists and for each composition: about 130 copies of every
    stored node (the ``model`` group's presets are most of them), seconds of ``fox-train --help``. Only
    ConfigStore reads and writes the repository, and ``ConfigStore.load`` deep copies the node it returns, so
    sharing it changes no composed config."""

    def __deepcopy__(self, memo):
        return self


def register() -> None:
    cs = ConfigStore.instance()
    if not isinstance(cs.repo, _SharedRepo):
        cs.repo = _SharedRepo(cs.repo)
    cs.store(name="train_schema", node=TrainConfig)
    for name in preset_names():
        cs.store(group="model", name=name, node=ModelConfig(preset=name, **preset_fields(name)))
    for name in ("bundled", "tokens", "text", "longcrawl64", "hf"):
        cs.store(group="data", name=name, node=DataConfig(source=name))
    cs.store(group="optimizer", name="adamw", node=OptimizerConfig())
    for name in SCHEDULES:
        cs.store(group="schedule", name=name, node=ScheduleConfig(name=name))
    for name in ("single", "ddp", "fsdp", "fsdp2"):
        cs.store(group="strategy", name=name, node=StrategyConfig(name=name))


# (key, lowest value): counts and intervals that would otherwise divide by zero, train nothing or delete
# every checkpoint (keep_last=0)
AT_LEAST = (("data.seq_len", 1), ("micro_batch_size", 1), ("global_batch_tokens", 1), ("log_every", 1),
            ("eval_every", 1), ("eval_sequences", 1), ("checkpoint_every", 1), ("keep_last", 1), ("keep_every", 0),
            ("schedule.total_tokens", 1), ("schedule.warmup_tokens", 0), ("schedule.min_lr_ratio", 0),
            ("optimizer.lr", 0), ("optimizer.weight_decay", 0), ("optimizer.grad_clip", 0), ("strategy.num_nodes", 1))


SEED_MAX = 2**32 - 1
ORDERS = ("paper", "shuffled")
FSDP_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")  # torch FSDP's sharding strategies


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_optimizer(o: OptimizerConfig) -> None:
    """AdamW's betas and eps, which torch would refuse at the first step in words that name no setting (or,
    for eps = 0, accept and divide by zero)."""
    betas = list(o.betas) if isinstance(o.betas, (list, tuple)) else o.betas
    if not isinstance(betas, list) or len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {betas!r}")
    if not _number(o.eps) or o.eps <= 0:
        raise ValueError(f"optimizer.eps must be a finite number > 0, got {o.eps!r}")


# Characters of a run name: what Hydra's override parser reads unquoted and every file system stores, so that
# ``run_name=NAME`` on a command line names the same folder that train() writes.
RUN_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "._-+@")


def check_run_name(name: str | None) -> None:
    """``run_name`` names a folder inside ``out_dir``: ASCII letters, digits and ``._-+@``, sub-folders
    separated by ``/`` (a sweep's jobs run in ``NAME/<job>``); no absolute path, no empty, ``.`` or ``..``
    part. ValueError in one line otherwise (the name's repr escapes a newline). None: the default
    name."""
    if name is None:
        return
    parts = name.split("/") if isinstance(name, str) else [""]
    if any(p in ("", ".", "..") or not RUN_NAME_CHARS.issuperset(p) for p in parts):
        raise ValueError(f"run_name must be a plain folder name inside out_dir (ASCII letters, digits and ._-+@, "
                         f"sub-folders joined by /, no '..' or leading /), got {name!r}")


def check(cfg: TrainConfig) -> None:
    """Errors a run would meet late, raised before it starts (ValueError naming the field)."""
    check_run_name(cfg.run_name)
    for key, low in AT_LEAST:
        value = attrgetter(key)(cfg)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low or math.isinf(value):
            raise ValueError(f"{key} must be at least {low}, got {value!r}")
    if cfg.schedule.min_lr_ratio > 1:
        raise ValueError(f"schedule.min_lr_ratio must be in [0, 1], got {cfg.schedule.min_lr_ratio}")
    check_optimizer(cfg.optimizer)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed <= SEED_MAX:
        raise ValueError(f"seed must be an int in [0, {SEED_MAX}] (numpy's seeds), got {cfg.seed!r}")
    if cfg.data.order not in ORDERS:
        raise ValueError(f"data.order must be one of {ORDERS}, got {cfg.data.order!r}")
    if cfg.strategy.fsdp_sharding not in FSDP_SHARDING:  # read by FSDP only: checked whatever the strategy
        raise ValueError(f"strategy.fsdp_sharding must be one of {FSDP_SHARDING}, got {cfg.strategy.fsdp_sharding!r}")
    if not cfg.data.seq_len <= cfg.global_batch_tokens <= cfg.schedule.total_tokens:
        # a step reads global_batch_tokens before it ends: a batch past the run's length is no run (and an
        # absurd one, 2^62 tokens, never finishes step 0)
        raise ValueError(f"global_batch_tokens must be in [data.seq_len, schedule.total_tokens] = "
                         f"[{cfg.data.seq_len}, {cfg.schedule.total_tokens}], got {cfg.global_batch_tokens}")
    if cfg.global_batch_tokens % cfg.data.seq_len:
        raise ValueError(f"global_batch_tokens {cfg.global_batch_tokens} must be a multiple of data.seq_len "
                         f"{cfg.data.seq_len}")
    s = cfg.schedule
    if s.name not in SCHEDULES:
        raise ValueError(f"schedule.name must be one of {SCHEDULES}, got {s.name!r}")
    if s.name == "warmup_one_minus_sqrt":
        if s.anneal_tokens is None or s.anneal_tokens <= 0:
            raise ValueError(f"schedule.anneal_tokens must be a positive token count for warmup_one_minus_sqrt, "
                             f"got {s.anneal_tokens}")
        if s.warmup_tokens + s.anneal_tokens > s.total_tokens:
            raise ValueError(f"schedule.warmup_tokens + schedule.anneal_tokens must not exceed schedule.total_tokens, "
                             f"got {s.warmup_tokens} + {s.anneal_tokens} > {s.total_tokens}")
    model_config(cfg.model)


# keyword arguments transformers' configs take without keeping an attribute of that name
_CONFIG_KEYWORDS = frozenset({"attn_implementation"})


def _is_config_field(config, key: str) -> bool:
    """Whether ``key`` names a field of ``config`` (every keyword of the presets' config classes is kept as an
    attribute) or is one of transformers' config keywords: transformers' configs keep any unknown keyword as
    an attribute that no model reads, so a misspelt override would otherwise train the preset unchanged."""
    return hasattr(config, key) or key in _CONFIG_KEYWORDS


def model_config(cfg: ModelConfig):
    """The fox-models config for a preset name (tiny presets included) with the fields and overrides applied.
    A field the config refuses is named as it is set here: ``model.hidden_size``, ``model.overrides.norm_eps``
    (fox-models' ``ConfigFieldError`` names the keyword argument); a refusal of no one field names the
    preset (``model=NAME: ...``)."""
    from fox_models.configuration_base import ConfigFieldError
    from fox_models.presets import get_preset

    config = get_preset(cfg.preset)
    given = {k: getattr(cfg, k) for k in MODEL_FIELDS if getattr(cfg, k) is not None}
    for where, keys in (("model", given), ("model.overrides", cfg.overrides)):
        for k in keys:
            if not _is_config_field(config, k):
                raise ValueError(f"{where}.{k} is not a field of {cfg.preset} ({type(config).__name__})")
    try:
        return get_preset(cfg.preset, **{**given, **dict(cfg.overrides)})
    except ConfigFieldError as e:
        if e.field in cfg.overrides:
            where = f"model.overrides.{e.field}"
        elif e.field in MODEL_FIELDS:
            where = f"model.{e.field}"
        else:
            raise ValueError(f"model={cfg.preset}: {e}") from None
        # the message begins with the field's name, which becomes the name the command line sets it by
        message = str(e)
        raise ValueError(where + message[len(e.field):] if message.startswith(e.field) else f"{where}: {message}") \
            from None
    except ValueError as e:
        raise ValueError(f"model={cfg.preset}: {e}") from None


# Keys whose value may change when a run resumes (``resume=true key=value``): how long it trains (extending
# a finished run; the learning rate then follows the new schedule from the tokens seen), how it is logged,
# evaluated, checkpointed and exported, and the hardware and speed switches it runs with. Every other key
# (model, data, optimizer, seed, batch, schedule shape) is what the checkpoints were trained under: a
# resumed run keeps the saved value, and a command line that sets another is refused. To change one anyway,
# edit the run's config.yaml, or start a new run from the weights with init_from.
RESUMABLE = ("schedule.total_tokens", "schedule.anneal_tokens", "micro_batch_size", "log_every", "eval_every",
             "eval_sequences", "checkpoint_every", "keep_last", "keep_every", "compile", "compile_mode",
             "activation_memory_budget", "gradient_checkpointing", "recompute_projections", "tensorboard", "wandb",
             "wandb_project", "export", "strategy")
# Keys that locate the run: always the current command line's.
RUN_KEYS = ("resume", "run_name", "out_dir")
_MISSING = object()


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"a.b": value}`` (lists are values; empty dicts have no leaves)."""
    flat = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            flat.update(leaves(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def load_config(path: Path) -> dict:
    """A saved config.yaml as a plain dict, completed with the defaults of fields it lacks."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
    except Exception as e:  # YAML syntax, unknown keys, wrong types
        first = first_line(e)
        raise ValueError(f"{path} is not a fox-train config: {first}") from None
    return OmegaConf.to_container(merged)


def resume_conflicts(saved: dict, given: dict, source: Path, keys: set[str] | None = None) -> str | None:
    """The one-line error for the keys (of ``keys``; default all) whose value in ``given`` differs from
    the saved config ``source`` outside ``RESUMABLE``; None when they agree."""
    s, g = leaves(saved), leaves(given)
    names = sorted(k for k in s.keys() | g.keys() if keys is None or _under(k, keys))
    differ = [k for k in names if not _under(k, RESUMABLE + RUN_KEYS) and s.get(k, _MISSING) != g.get(k, _MISSING)]
    if not differ:
        return None
    shown = ", ".join(f"{k} (saved {s.get(k)!r}, given {g.get(k)!r})" for k in differ[:4])
    more = f", also {', '.join(differ[4:])}" if len(differ) > 4 else ""
    return (f"resume=true: the command line conflicts with {source} on {shown}{more}; a run keeps its config "
            f"(keys that may change: fox_train.config.RESUMABLE): drop these overrides, or start another "
            f"run_name (init_from= takes the weights)")


def resumed_config(saved: dict, given: dict, source: Path, keys: set[str]) -> TrainConfig:
    """The config a resumed run trains with: the saved one, with the run's location and the ``RESUMABLE``
    values that the command line set (``keys``) taken from ``given``. ValueError naming the keys that the
    command line sets to values other than the saved ones."""
    message = resume_conflicts(saved, given, source, keys)
    if message:
        raise ValueError(message)
    merged = OmegaConf.create(saved)
    for k, v in leaves(given).items():
        if _under(k, RUN_KEYS) or (_under(k, keys) and _under(k, RESUMABLE)):
            OmegaConf.update(merged, k, v, merge=False)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), merged))
