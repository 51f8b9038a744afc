"""Parallelism and compilation, applied to a model from outside it (as torchtitan composes them).

* The device mesh (``build_mesh``): the world's ranks as a named 2-D mesh ``data`` x ``context``
  (``strategy.context_parallel`` ranks share each sequence; consecutive ranks form a context group).
* Data parallelism through Lightning Fabric (``make_fabric``): DDP, FSDP (each of the model's blocks, as its
  registry entry names them) or FSDP2, over every rank of the world: a context group's ranks hold the same
  parameters and each computes the gradient of its own tokens' loss, so averaging gradients over the whole
  world is averaging over the data ranks' sequences and the context ranks' tokens.
* Context parallelism (``apply_context_parallel``): every Forgetting Attention layer's kernel call is
  replaced by ``fox_kernel.context_parallel.ContextParallel`` over the context group; the trainer feeds each
  rank its zigzag shard of each sequence (``Mesh.shard``) and puts per-position losses back in order
  (``Mesh.unshard``). Models whose registry entry does not declare it (the recurrent baselines) are refused.
* ``compile_blocks``: torch.compile per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch
import torch.distributed as dist

from fox_kernel.context_parallel import ContextParallel, shard_sequence, unshard_sequence
from fox_layers import set_attention_kernel
from fox_models.registry import model_entry
from fox_train import checkpoint as ckpt
from fox_train.config import FSDP_SHARDING, TrainConfig, model_config
from fox_train.errors import first_line


def _check_param_dtype(s) -> None:
    if s.fsdp_param_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"strategy.fsdp_param_dtype must be float32 or bfloat16, got {s.fsdp_param_dtype!r}")


def _fsdp_strategy(s, precision: str, blocks: tuple[type[torch.nn.Module], ...]):
    """FSDP wrapping each block (each module of a class in ``blocks``, the model's registry entry's). Under a
    mixed precision, ``s.fsdp_param_dtype`` = bfloat16 keeps Fabric's policy (bf16 parameters, reductions,
    buffers); float32 gathers float32 parameters, reduces in float32 and lets autocast run the matmuls in
    bf16 (DDP's numerics)."""
    from lightning.fabric.strategies import FSDPStrategy
    from torch.distributed.fsdp import MixedPrecision

    _check_param_dtype(s)
    if s.fsdp_sharding not in FSDP_SHARDING:
        raise ValueError(f"strategy.fsdp_sharding must be one of {FSDP_SHARDING}, got {s.fsdp_sharding!r}")
    mixed = None
    if "mixed" in precision and s.fsdp_param_dtype == "float32":
        mixed = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    return FSDPStrategy(auto_wrap_policy=set(blocks), state_dict_type="full", mixed_precision=mixed,
                        sharding_strategy=s.fsdp_sharding)


def _fsdp2_strategy(s, precision: str):
    """FSDP2 (``fully_shard`` on every block of the model's registry entry, then on the whole model)
    through Fabric's ModelParallelStrategy, checkpoints as one full file like the other strategies'. Under a
    mixed precision, ``s.fsdp_param_dtype`` = bfloat16 gathers bf16 parameters and reduces gradients in
    float32; float32 gathers float32 parameters (autocast runs the matmuls in bf16)."""
    from lightning.fabric.strategies import ModelParallelStrategy

    _check_param_dtype(s)
    if s.fsdp_sharding not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        raise ValueError(f"strategy.fsdp_sharding must be FULL_SHARD or SHARD_GRAD_OP with fsdp2, got {s.fsdp_sharding!r}")
    reshard = s.fsdp_sharding == "FULL_SHARD"
    bf16 = "mixed" in precision and s.fsdp_param_dtype == "bfloat16"

    def parallelize(model, mesh):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = dict(mesh=mesh["data_parallel"], reshard_after_forward=reshard)
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        blocks = model_entry(model).blocks
        for block in [m for m in model.modules() if isinstance(m, blocks)]:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return model

    if isinstance(s.devices, int) and s.devices > 0:
        per_node = s.devices
    elif isinstance(s.devices, (list, tuple)) or (isinstance(s.devices, str) and "," in s.devices):
        per_node = len(s.devices if not isinstance(s.devices, str) else [d for d in s.devices.split(",") if d.strip()])
    else:
        raise ValueError(f"strategy.devices must be a device count or list with fsdp2, got {s.devices!r}")
    return ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=per_node * s.num_nodes,
                                 tensor_parallel_size=1, save_distributed_checkpoint=False)


STRATEGIES = ("single", "ddp", "fsdp", "fsdp2")


def make_fabric(cfg: TrainConfig) -> L.Fabric:
    """Lightning Fabric for ``cfg.strategy``: devices, precision and the data-parallel strategy."""
    s = cfg.strategy
    gpu = torch.cuda.is_available() and s.accelerator in ("auto", "gpu", "cuda")
    precision = s.precision or ("bf16-mixed" if gpu else "32-true")
    if s.name not in STRATEGIES:
        raise ValueError(f"strategy.name must be one of {STRATEGIES}, got {s.name!r}")
    strategy = {"single": "auto", "ddp": "ddp"}.get(s.name)
    if s.name == "fsdp":
        strategy = _fsdp_strategy(s, precision, model_entry(model_config(cfg.model)).blocks)
    elif s.name == "fsdp2":
        strategy = _fsdp2_strategy(s, precision)
    # FSDP and FSDP2 write their full checkpoint with torch.save themselves
    plugins = [ckpt.DirectTorchIO()] if s.name in ("single", "ddp") else None
    try:
        return L.Fabric(accelerator=s.accelerator, devices=s.devices, num_nodes=s.num_nodes, strategy=strategy,
                        precision=precision, plugins=plugins)
    except (RuntimeError, ValueError) as e:  # an accelerator or devices this machine does not have
        first = first_line(e)
        raise ValueError(f"strategy.accelerator={s.accelerator} strategy.devices={s.devices}: {first}") from None


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the compile modes that run CUDA graphs


def check_compile(cfg: TrainConfig) -> bool:
    """Validate compile/compile_mode; True when the blocks run as CUDA graphs."""
    if cfg.compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {cfg.compile_mode!r}")
    if cfg.compile_mode is not None and not cfg.compile:
        raise ValueError(f"compile_mode={cfg.compile_mode!r} needs compile=true")
    budget = cfg.activation_memory_budget
    if budget is not None:
        if not cfg.compile:
            raise ValueError("activation_memory_budget needs compile=true (the compiled blocks' partitioner applies it)")
        if not 0 < budget <= 1:
            raise ValueError(f"activation_memory_budget must be in (0, 1], got {budget!r}")
    graphs = cfg.compile and cfg.compile_mode in CUDA_GRAPH_MODES
    if graphs and cfg.strategy.name not in ("single", "ddp"):
        raise ValueError(f"compile_mode={cfg.compile_mode!r} (CUDA graphs) works with strategy single or ddp, "
                         f"not {cfg.strategy.name!r}")
    return graphs


def compile_blocks(model, mode: str | None = None, memory_budget: float | None = None) -> None:
    """torch.compile every block of ``model`` (in ``mode``); ``memory_budget``: inductor's activation memory
    budget for them (see TrainConfig.activation_memory_budget; process-wide, read when a block compiles)."""
    if memory_budget is not None:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = memory_budget
    for block in model.model.layers:
        block.compile(mode=mode)


@dataclass(frozen=True)
class Mesh:
    """This rank's place on the ``data`` x ``context`` mesh."""

    data: int
    """Data-parallel degree: how many groups of ranks take different sequences."""
    context: int
    """Context-parallel degree: how many ranks share each sequence."""
    data_rank: int
    context_rank: int
    context_group: dist.ProcessGroup | None = None

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's zigzag shard of whole sequences x (B, T, ...) (x itself without context parallelism)."""
        return x if self.context == 1 else shard_sequence(x, self.context, self.context_rank, dim=1)

    def unshard(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequences (B, T, ...) from every context rank's shard x (a collective of the context group)."""
        return x if self.context == 1 else unshard_sequence(x.contiguous(), self.context_group, dim=1)


def build_mesh(cfg: TrainConfig, world_size: int, rank: int, device_type: str) -> Mesh:
    """The mesh of ``world_size`` ranks with ``cfg.strategy.context_parallel`` ranks per sequence."""
    cp = cfg.strategy.context_parallel
    if world_size % cp:
        raise ValueError(f"strategy.context_parallel={cp} must divide the number of processes "
                         f"(devices x nodes = {world_size})")
    if cp == 1:
        return Mesh(world_size, 1, rank, 0)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size // cp, cp), mesh_dim_names=("data", "context"))
    return Mesh(world_size // cp, cp, mesh.get_local_rank("data"), mesh.get_local_rank("context"),
                mesh["context"].get_group())


def check_context_parallel(cfg: TrainConfig) -> None:
    """Refuse a context-parallel run a model or sequence length cannot take, naming the field."""
    cp = cfg.strategy.context_parallel
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"strategy.context_parallel must be an int >= 1, got {cp!r}")
    if cp == 1:
        return
    if cfg.data.seq_len % (2 * cp):
        raise ValueError(f"data.seq_len must be a multiple of 2 x strategy.context_parallel = {2 * cp} (each rank "
                         f"holds two equal chunks of every sequence), got {cfg.data.seq_len}")
    entry = model_entry(model_config(cfg.model))
    if not entry.context_parallel:
        raise ValueError(f"strategy.context_parallel={cp}: model {cfg.model.preset!r} "
                         f"({entry.config_class.model_type}) does not run context-parallel (recurrent layers "
                         "carry a state along the sequence); use the attention models (FoX, the Transformer)")


def apply_context_parallel(model: torch.nn.Module, mesh: Mesh) -> int:
    """Replace the kernel call of every Forgetting Attention layer of ``model`` by context-parallel attention
    over ``mesh.context_group``; returns how many layers. Nothing changes without context parallelism."""
    if mesh.context == 1:
        return 0
    return set_attention_kernel(model, ContextParallel(mesh.context_group))
