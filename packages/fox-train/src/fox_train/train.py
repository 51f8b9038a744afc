"""The training loop: Lightning Fabric for devices and strategies, our own loop for everything else.

``train`` composes the run from the other modules: the data (``data``), the device mesh, strategy,
compilation and context parallelism (``parallelize``), the warm start (``warm_start``), the run directory,
its config and stop signals (``run_dir``), checkpoints (``checkpoint``), metrics (``metrics``) and the
final Hugging Face export (``export``).
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

import fox_models
from fox_models.registry import no_weight_decay
from fox_train import checkpoint as ckpt
from fox_train.config import SCHEDULES, TrainConfig, check, model_config
from fox_train.data import Sampler, build_sources, make_batch, micro_batch_for, save_token_caches
from fox_train.errors import first_line
from fox_train.export import export_model, full_state_dict
from fox_train.metrics import (
    MetricsWriter,
    flops_per_token,
    peak_flops,
    plot_per_token_loss,
    position_windows,
)
from fox_train.parallelize import (
    Mesh,
    apply_context_parallel,
    build_mesh,
    check_compile,
    check_context_parallel,
    compile_blocks,
    make_fabric,
)
from fox_train.run_dir import Interrupted, RunLog, StopSignals, claim_run_dir, resolve_run_dir, save_config
from fox_train.warm_start import load_init_weights


def lr_at(tokens: int, cfg: TrainConfig) -> float:
    """The learning rate of the step that begins after ``tokens`` training tokens: the official trainer's
    schedules (``schedule.name``), keyed on tokens. The warmup rises linearly from 0 (the first step has lr 0)
    to ``optimizer.lr`` at ``warmup_tokens``; the decays end at ``min_lr_ratio * lr``:
    warmup_cosine: cosine from ``warmup_tokens`` to ``total_tokens``; warmup_linear: linear over the same span;
    warmup_one_minus_sqrt: constant until the last ``anneal_tokens``, then ``lr - (lr - end) sqrt(t / anneal)``;
    constant: ``optimizer.lr`` throughout."""
    s, peak = cfg.schedule, cfg.optimizer.lr
    if s.name == "constant":
        return peak
    if s.name not in SCHEDULES:
        raise ValueError(f"schedule.name must be one of {SCHEDULES}, got {s.name!r}")
    if tokens < s.warmup_tokens:
        return peak * tokens / s.warmup_tokens
    end = peak * s.min_lr_ratio
    if s.name == "warmup_one_minus_sqrt":
        if s.anneal_tokens is None:
            raise ValueError("schedule.anneal_tokens must be set for warmup_one_minus_sqrt")
        since = min(max(tokens - (s.total_tokens - s.anneal_tokens), 0), s.anneal_tokens)
        return peak - (peak - end) * math.sqrt(since / s.anneal_tokens)
    progress = min(1.0, (tokens - s.warmup_tokens) / max(1, s.total_tokens - s.warmup_tokens))
    if s.name == "warmup_linear":
        return peak - (peak - end) * progress
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on every parameter but those the model's registry entry exempts (norm weights, biases
    and the like: ``fox_models.registry.no_weight_decay``)."""
    no_decay = no_weight_decay(model)
    decay = [p for name, p in model.named_parameters() if name not in no_decay]
    rest = [p for name, p in model.named_parameters() if name in no_decay]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _step_begin(graphs: bool) -> None:
    """Before every forward when the blocks are CUDA graphs: tells cudagraph trees that the outputs of the
    previous forward and backward are no longer needed (each micro-batch is a new invocation)."""
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on the training device. To a GPU it goes from pinned memory without waiting: a copy from
    pageable memory would make the host wait for the GPU to finish its queued work (the previous
    micro-batch) before it can queue this one's."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@contextmanager
def _micro_batch(fabric: L.Fabric, model, strategy, last: bool):
    """One micro-batch's forward and backward: gradients are reduced only in the step's last one. FSDP2
    with SHARD_GRAD_OP also keeps the parameters gathered from the step's first forward to its last
    backward (one all-gather per block and step instead of one per micro-batch); they are resharded after
    the last backward, before clipping and the optimizer step read the sharded parameters."""
    if strategy.name == "fsdp2" and strategy.fsdp_sharding == "SHARD_GRAD_OP":
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_reshard_after_backward(last, recurse=False)
    with fabric.no_backward_sync(model, enabled=not last):
        yield


def _step_end(fabric: L.Fabric, step_loss: torch.Tensor, grad_norm, received: int) -> tuple[float, float, int]:
    """(this step's loss, mean over ranks; the gradient norm, 0.0 without clipping; the stop signal, agreed by
    all ranks so that each stops after the same step): one all-reduce, without Fabric's barrier, and one
    read back to the host a step. The loss and norm are divided by the world size before the sum (the norm
    is the same on every rank), the signals counted per kind (SIGTERM wins)."""
    world = fabric.world_size
    if grad_norm is None:
        grad_norm = torch.zeros((), device=step_loss.device)
    elif hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    # the flags are filled on the device: a tensor made from a host list would be a copy from pageable
    # memory, which waits for the GPU to finish the step before the all-reduce is even queued
    flags = [step_loss.new_full((), float(received == s), dtype=torch.float32) for s in (signal.SIGINT, signal.SIGTERM)]
    values = torch.stack([step_loss.float() / world, grad_norm.float().to(step_loss.device) / world, *flags])
    if world > 1:
        torch.distributed.all_reduce(values)
    loss, norm, sigint, sigterm = values.tolist()
    return loss, norm, (signal.SIGTERM if sigterm else signal.SIGINT if sigint else 0)


def _keep_grad_storage(model) -> None:
    """Give every trainable parameter a zero gradient that stays (zero_grad(set_to_none=False) after it).

    With CUDA-graph blocks a parameter's first gradient is an output of a backward graph, and autograd
    keeps that very tensor as ``.grad``; the next micro-batch's graphs overwrite it (gradient accumulation
    then read garbage, and cudagraph trees stop with "accessing tensor output of CUDAGraphs that has been
    overwritten"). With a gradient already in place, autograd adds into it instead."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


@torch.no_grad()
def evaluate(fabric, model, source, n: int, batch: int, graphs: bool = False,
             mesh: Mesh | None = None) -> tuple[float, np.ndarray]:
    """Mean held-out loss and the per-position loss L(i) over the first n sequences (all ranks agree). Under
    context parallelism each rank of a context group scores its shard of every sequence."""
    model.eval()
    n = min(n, len(source))
    total = None
    for s in range(0, n, batch):
        inputs, labels = make_batch(source, list(range(s, min(n, s + batch))))
        if mesh is not None:
            inputs, labels = mesh.shard(inputs), mesh.shard(labels)
        _step_begin(graphs)
        loss = model(input_ids=inputs.to(fabric.device), labels=labels.to(fabric.device), per_token_loss=True,
                     use_cache=False).loss.float()
        part = loss.sum(0, keepdim=True)
        total = part if total is None else total + part
    model.train()
    reshard(model)
    if mesh is not None:
        total = mesh.unshard(total)
    per_pos = (total[0] / n).cpu().numpy()
    return float(per_pos.mean()), per_pos


def reshard(model) -> None:
    """Free the gathered parameters that FSDP2 keeps after a forward without a backward (an evaluation)
    when it does not reshard after the forward (SHARD_GRAD_OP): they take memory, and a checkpoint needs
    the sharded ones."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch: no FSDP2
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def train(cfg: TrainConfig, record=None) -> Path:
    """Run training; returns the run directory. Raises Interrupted after SIGINT / SIGTERM (a checkpoint of
    the last step is saved). Nothing in the run directory is written until every check has passed (data,
    model, warm start, the checkpoint to resume from): a refused call leaves the folder as it was. ``record``
    (``run_dir -> None``), if given, writes the caller's own files at that same moment (the CLI's Hydra
    record). The run's messages (warm start, resume, Fabric's, the final ``done:``) are printed by global
    rank 0 and appended to ``<run>/fox-train.log``, as is the reason a run that was accepted stops."""
    with RunLog() as log:
        try:
            run_dir = _run(cfg, record, log)
        except Interrupted as e:
            log.write(f"fox-train: {e}")
            raise
        except (OSError, ValueError, ImportError) as e:
            log.write(f"fox-train: {first_line(e)}")
            raise
        log.print(f"done: {run_dir}")
    return run_dir


def _run(cfg: TrainConfig, record, log: RunLog) -> Path:
    check(cfg)
    check_context_parallel(cfg)
    graphs = check_compile(cfg)
    fabric = make_fabric(cfg)
    fabric.launch()
    log.rank_zero(fabric.is_global_zero)
    mesh = build_mesh(cfg, fabric.world_size, fabric.global_rank, fabric.device.type)
    L.seed_everything(cfg.seed, verbose=False)
    torch.manual_seed(cfg.seed)
    run_dir = resolve_run_dir(cfg)
    if fabric.world_size > 1:
        run_dir = Path(fabric.broadcast(str(run_dir)))
    ckpt_root = run_dir / "checkpoints"
    claim_run_dir(cfg, run_dir)

    config = model_config(cfg.model)
    tokenizer = fox_models.JSONGPT2Tokenizer()
    unsaved_caches: list = []  # written when the run is accepted: a refused run leaves out_dir as it was
    train_src, held_src = build_sources(cfg, tokenizer, str(Path(cfg.out_dir) / ".token-cache"), config.vocab_size,
                                        unsaved_caches)
    seq_len = cfg.data.seq_len
    micro = micro_batch_for(cfg.global_batch_tokens, seq_len, cfg.micro_batch_size, mesh.data)
    if micro != cfg.micro_batch_size:
        sequences = cfg.global_batch_tokens // seq_len
        share = (f"a step's {sequences} sequences" if mesh.data == 1 else
                 f"the {sequences // mesh.data} of a step's {sequences} sequences each of {mesh.data} data-parallel ranks takes")
        log.print(f"micro_batch_size {cfg.micro_batch_size} -> {micro}, which divides {share}")
    sampler = Sampler(len(train_src), cfg.global_batch_tokens // seq_len, micro, mesh.data,
                      shuffle=cfg.data.order == "shuffled", seed=cfg.seed)
    total_steps = max(1, cfg.schedule.total_tokens // cfg.global_batch_tokens)

    # Built on the CPU for every strategy, then moved by fabric.setup: Fabric's init context builds on the
    # GPU for single/DDP but on the CPU for FSDP, whose random numbers differ, so the same seed gave FSDP
    # another starting point (and a loss curve unlike the one-GPU run's).
    with torch.device("cpu"), fabric.strategy.precision.module_init_context():
        model = AutoModelForCausalLM.from_config(config)
    if cfg.init_from:
        log.print(f"warm start from {load_init_weights(model, cfg.init_from)} (model weights only, step 0)")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.recompute_projections:
        switch = getattr(model, "enable_projection_recompute", None)
        if switch is None or not switch():
            raise ValueError(f"recompute_projections: model {cfg.model.preset!r} has no Forgetting Attention layers")
    apply_context_parallel(model, mesh)
    if cfg.compile:
        compile_blocks(model, cfg.compile_mode, cfg.activation_memory_budget)
    n_params = sum(p.numel() for n, p in model.named_parameters() if n != "model.embeddings.weight")
    flops_tok = flops_per_token(config, seq_len, n_params)
    o = cfg.optimizer

    fused = fabric.device.type == "cuda" if o.fused is None else bool(o.fused)

    def adamw(m):
        return torch.optim.AdamW(param_groups(m, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                 fused=fused or None)

    if cfg.strategy.name == "fsdp2":  # fully_shard swaps in new (DTensor) parameters: optimizer after it
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(adamw(model))
    else:
        model, optimizer = fabric.setup(model, adamw(model))

    state = {"model": model, "optimizer": optimizer, "step": 0}
    start = 0
    if cfg.resume:
        found = ckpt.load_newest(fabric, ckpt_root, state)
        if found is None:
            log.print(f"resume=true but no complete checkpoint under {ckpt_root}: starting from step 0")
        else:
            start = found
            log.print(f"resumed from step {start} ({ckpt_root})")
    if fabric.is_global_zero:
        save_token_caches(unsaved_caches)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir)
        if record is not None:
            record(run_dir)
        ckpt.remove_partial(ckpt_root)
        log.open(run_dir)
    fabric.barrier()
    writer = MetricsWriter(run_dir, OmegaConf.to_container(OmegaConf.structured(cfg)), cfg.tensorboard, cfg.wandb,
                           cfg.wandb_project, start) if fabric.is_global_zero else None
    try:
        with StopSignals() as stop:
            per_pos = _train_steps(cfg, fabric, mesh, model, optimizer, state, sampler, train_src, held_src, writer,
                                   run_dir, start, total_steps, flops_tok, graphs, stop)
        full = full_state_dict(fabric, model, cfg.strategy.name) if cfg.export else None
        if fabric.is_global_zero:
            np.save(run_dir / "heldout_per_token_loss.npy", per_pos)
            plot_per_token_loss(per_pos, run_dir / "heldout_per_token_loss.png", f"{run_dir.name}: held-out L(i)")
            if cfg.export:
                export_model(model, tokenizer, run_dir / "hf", state_dict=full)
    finally:
        if writer:
            writer.close()
    fabric.barrier()
    return run_dir


def _train_steps(cfg, fabric, mesh, model, optimizer, state, sampler, train_src, held_src, writer, run_dir, start,
                 total_steps, flops_tok, graphs, stop) -> np.ndarray:
    """Steps ``start`` to ``total_steps`` with their logging, evaluations and checkpoints; returns the
    held-out L(i) of the last evaluation. After a stop signal, saves the step's checkpoint and raises
    Interrupted. Each data rank of ``mesh`` takes its sequences of each step, each context rank its shard of
    them; the loss of a rank is the mean over its tokens, equal in number on every rank, so the gradient
    average over all ranks is that of the mean over the step's tokens."""
    o, ckpt_root = cfg.optimizer, run_dir / "checkpoints"
    peak = peak_flops(fabric.device)
    if start == 0:
        loss0, _ = evaluate(fabric, model, held_src, cfg.eval_sequences, cfg.micro_batch_size, graphs, mesh)
        if writer:
            writer.log({"step": 0, "tokens": 0, "heldout_loss": loss0})

    bar = tqdm(range(start, total_steps), initial=start, total=total_steps, disable=not fabric.is_global_zero,
               desc=run_dir.name, unit="step", dynamic_ncols=True, mininterval=1.0)
    t_last, tok_last = time.perf_counter(), start * cfg.global_batch_tokens
    per_pos = None  # held-out L(i) of the latest evaluation (the last step always evaluates)
    if graphs:
        _keep_grad_storage(model)
    for step in bar:
        tokens = step * cfg.global_batch_tokens
        lr = lr_at(tokens, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros((), device=fabric.device)
        pos_loss = None
        for a in range(sampler.accum_steps):
            inputs, labels = make_batch(train_src, sampler.indices(step, a, mesh.data_rank))
            inputs, labels = (_to_device(mesh.shard(x), fabric.device) for x in (inputs, labels))
            _step_begin(graphs)
            with _micro_batch(fabric, model, cfg.strategy, last=a == sampler.accum_steps - 1):
                loss = model(input_ids=inputs, labels=labels, per_token_loss=True).loss
                fabric.backward(loss.mean() / sampler.accum_steps)
            step_loss += loss.detach().float().mean() / sampler.accum_steps
            pos_loss = loss.detach().float() if pos_loss is None else pos_loss + loss.detach().float()
        # no host wait here (error_if_nonfinite would read the norm back before the optimizer step is
        # queued): the norm is checked at the step's end, before anything of this step is saved
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=o.grad_clip, error_if_nonfinite=False) \
            if o.grad_clip > 0 else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=not graphs)
        state["step"] = step + 1
        done_tokens = (step + 1) * cfg.global_batch_tokens
        last = step + 1 == total_steps
        step_loss, norm, signum = _step_end(fabric, step_loss, grad_norm, stop.received)
        if not math.isfinite(norm):
            raise FloatingPointError(f"step {step + 1}: the gradient norm is {norm}; stopped before saving this "
                                     f"step (checkpoints under {ckpt_root} hold earlier steps)")
        if (step + 1) % cfg.log_every == 0 or last:
            now = time.perf_counter()
            tps = (done_tokens - tok_last) / max(now - t_last, 1e-9)
            t_last, tok_last = now, done_tokens
            record = {"step": step + 1, "tokens": done_tokens, "loss": step_loss, "lr": lr, "tokens_per_s": tps,
                      **position_windows(mesh.unshard(pos_loss) / sampler.accum_steps)}
            if grad_norm is not None:
                record["grad_norm"] = norm
            if peak:
                record["mfu"] = tps * flops_tok / (peak * fabric.world_size)
            bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
            if writer:
                writer.log(record)
        if (step + 1) % cfg.eval_every == 0 or last:
            held, per_pos = evaluate(fabric, model, held_src, cfg.eval_sequences, cfg.micro_batch_size, graphs, mesh)
            if writer:
                writer.log({"step": step + 1, "tokens": done_tokens, "heldout_loss": held})
        saved = (step + 1) % cfg.checkpoint_every == 0 or last
        if saved:
            ckpt.save(fabric, ckpt_root, step + 1, state, cfg.keep_last, cfg.keep_every)
        if signum and not last:
            path = ckpt.step_dir(ckpt_root, step + 1) if saved else ckpt.save(
                fabric, ckpt_root, step + 1, state, cfg.keep_last, cfg.keep_every)
            bar.close()
            raise Interrupted(f"stopped by {signal.Signals(signum).name} after step {step + 1} of {total_steps}, "
                              f"checkpoint {path}; resume=true run_name={cfg.run_name} continues the run",
                              signum, fabric.is_global_zero)
    bar.close()
    if per_pos is None:  # resumed at the end: nothing ran, evaluate once for the plot
        _, per_pos = evaluate(fabric, model, held_src, cfg.eval_sequences, cfg.micro_batch_size, graphs, mesh)
    return per_pos
