"""fox-train: configs compose, a short CPU run writes everything, kill + resume equals an uninterrupted run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import fox_models  # noqa: F401  (registers the model types)
from fox_models.fox import FoxBlock
from fox_models.presets import TINY_PRESETS
from fox_train import checkpoint as ckpt
from fox_train.cli import main
from fox_train.data import Sampler
from fox_train.export import export_checkpoint

SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64", "micro_batch_size=4",
         "global_batch_tokens=256", "schedule.warmup_tokens=512", "eval_sequences=4"]


def _fsdp(strategy, precision):
    from fox_train.parallelize import _fsdp_strategy

    return _fsdp_strategy(strategy, precision, (FoxBlock,))


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_unknown_key_is_an_error():
    with pytest.raises(SystemExit, match="bad configuration.*no_such_field"):
        main(["no_such_field=3"])
    with pytest.raises(SystemExit, match="bad configuration"):
        main(["optimizer.learning_rate=1e-3"])


def test_missing_data_path_is_named(tmp_path):
    with pytest.raises(SystemExit, match="data.path '/no/such/corpus' does not exist"):
        main(["data=text", "data.path=/no/such/corpus", f"out_dir={tmp_path}", *SMALL])


def test_recompute_projections_trains_and_needs_fox_attention(tmp_path):
    main([f"out_dir={tmp_path}", "run_name=rc", "model=fox-pro-tiny", "recompute_projections=true",
          "schedule.total_tokens=1024", "log_every=1", "export=false", *SMALL])
    losses = [r["loss"] for r in _records(tmp_path / "rc") if "loss" in r]
    assert len(losses) == 4 and all(np.isfinite(losses))
    with pytest.raises((SystemExit, ValueError), match="recompute_projections: model 'mamba2-tiny' has no"):
        main(["model=mamba2-tiny", "recompute_projections=true", f"out_dir={tmp_path}", *SMALL[3:]])


def test_fsdp_mixed_precision_policies():
    """FSDP under bf16-mixed: Fabric's bf16 policy by default; fsdp_param_dtype=float32 gathers float32
    parameters and reduces in float32 (DDP's numerics); a bad dtype is named."""
    from fox_train.config import StrategyConfig

    assert _fsdp(StrategyConfig(name="fsdp"), "bf16-mixed").mixed_precision is None  # Fabric's policy
    assert _fsdp(StrategyConfig(name="fsdp", fsdp_param_dtype="float32"), "32-true").mixed_precision is None
    mp = _fsdp(StrategyConfig(name="fsdp", fsdp_param_dtype="float32"), "bf16-mixed").mixed_precision_config
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (torch.float32,) * 3
    with pytest.raises(ValueError, match="strategy.fsdp_param_dtype must be"):
        _fsdp(StrategyConfig(name="fsdp", fsdp_param_dtype="fp8"), "bf16-mixed")


def test_fsdp_sharding_strategy():
    from torch.distributed.fsdp import ShardingStrategy

    from fox_train.config import StrategyConfig

    assert _fsdp(StrategyConfig(name="fsdp"), "bf16-mixed").sharding_strategy == ShardingStrategy.FULL_SHARD
    st = _fsdp(StrategyConfig(name="fsdp", fsdp_sharding="SHARD_GRAD_OP"), "bf16-mixed")
    assert st.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
    with pytest.raises(ValueError, match="strategy.fsdp_sharding must be one of"):
        _fsdp(StrategyConfig(name="fsdp", fsdp_sharding="ZERO3"), "bf16-mixed")


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_fsdp_wraps_the_blocks_of_every_model(preset):
    """A run's FSDP strategy wraps each block of its model, as the model's registry entry names them."""
    from fox_models.registry import model_entry
    from fox_train.config import ModelConfig, StrategyConfig, model_config, preset_fields
    from fox_train.parallelize import _fsdp_strategy

    config = model_config(ModelConfig(preset=preset, **preset_fields(preset)))
    strategy = _fsdp_strategy(StrategyConfig(name="fsdp"), "32-true", model_entry(config).blocks)
    policy = strategy._fsdp_kwargs["auto_wrap_policy"]
    model = AutoModelForCausalLM.from_config(config)
    wrapped = [m for m in model.modules() if isinstance(m, tuple(policy._module_classes))]
    assert wrapped == list(model.model.layers)


def test_fsdp2_options_are_checked(tmp_path):
    from fox_train.config import StrategyConfig
    from fox_train.parallelize import _fsdp2_strategy

    with pytest.raises(ValueError, match="strategy.fsdp_sharding must be FULL_SHARD or SHARD_GRAD_OP with fsdp2"):
        _fsdp2_strategy(StrategyConfig(name="fsdp2", devices=2, fsdp_sharding="HYBRID_SHARD"), "bf16-mixed")
    with pytest.raises(ValueError, match="strategy.fsdp_param_dtype must be"):
        _fsdp2_strategy(StrategyConfig(name="fsdp2", devices=2, fsdp_param_dtype="fp8"), "bf16-mixed")
    with pytest.raises(ValueError, match="strategy.devices must be a device count or list with fsdp2"):
        _fsdp2_strategy(StrategyConfig(name="fsdp2", devices="auto"), "bf16-mixed")
    with pytest.raises((SystemExit, ValueError), match="strategy.name must be one of"):
        main(["strategy.name=zero3", f"out_dir={tmp_path}", *SMALL])


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp2_on_two_cpu_processes_follows_one_process_and_resumes_on_one(tmp_path, sharding):
    """FSDP2 (fully_shard) over two gloo processes: the same loss curve as one process at the same global
    batch (float32: equal to rounding), its exported model holds the full weights of its last checkpoint
    (a gathered state dict: the parameters are sharded), and its checkpoint resumes in one process,
    continuing the curve. SHARD_GRAD_OP keeps the parameters gathered after the final evaluation's
    forward unless resharded, which made the last checkpoint fail. One sequence per micro-batch: each
    process accumulates two micro-batches a step, between which SHARD_GRAD_OP keeps its parameters
    gathered (stale gathered parameters after an optimizer step would leave the curve)."""
    args = [f"out_dir={tmp_path}", "model=fox-pro-tiny", "strategy.accelerator=cpu", "schedule.total_tokens=1536",
            "checkpoint_every=3", "eval_every=1000", "log_every=1", *SMALL[:4], "micro_batch_size=1", *SMALL[5:]]
    main([*args, "run_name=one", "export=false"])
    one = {r["step"]: r["loss"] for r in _records(tmp_path / "one") if "loss" in r}
    run = subprocess.run([sys.executable, "-m", "fox_train.cli", *args, "run_name=two", "strategy=fsdp2",
                          "strategy.devices=2", f"strategy.fsdp_sharding={sharding}", "export=true"],
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    final = torch.load(tmp_path / "two" / "checkpoints" / "step-00000006" / "state.pt", weights_only=True)["model"]
    exported = load_file(tmp_path / "two" / "hf" / "model.safetensors")
    assert set(exported) == set(final) and len(final) > 10
    for name, w in final.items():
        assert torch.equal(exported[name], w), name
    two = {r["step"]: r["loss"] for r in _records(tmp_path / "two") if "loss" in r}
    assert sorted(two) == sorted(one) == list(range(1, 7))
    assert one[6] < one[1] - 0.3  # it learns
    for step in one:
        assert abs(two[step] - one[step]) < 1e-4, (step, one[step], two[step])
    (tmp_path / "on1" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "two" / "checkpoints" / "step-00000003", tmp_path / "on1" / "checkpoints" / "step-00000003")
    main([*args, "run_name=on1", "resume=true", "export=false"])
    resumed = {r["step"]: r["loss"] for r in _records(tmp_path / "on1") if "loss" in r}
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert abs(resumed[step] - two[step]) < 1e-4, (step, two[step], resumed[step])


def test_compile_mode_is_checked(tmp_path):
    base = [f"out_dir={tmp_path}", *SMALL]
    with pytest.raises(SystemExit, match="compile_mode must be one of"):
        main(["compile=true", "compile_mode=fastest", *base])
    with pytest.raises(SystemExit, match="compile_mode=.reduce-overhead. needs compile=true"):
        main(["compile_mode=reduce-overhead", *base])
    with pytest.raises(SystemExit, match="works with strategy single or ddp, not .fsdp2."):
        main(["compile=true", "compile_mode=reduce-overhead", "strategy=fsdp2", *base])


def test_activation_memory_budget_is_checked(tmp_path):
    base = [f"out_dir={tmp_path}", *SMALL]
    with pytest.raises(SystemExit, match="activation_memory_budget needs compile=true"):
        main(["activation_memory_budget=0.8", *base])
    with pytest.raises(SystemExit, match=r"activation_memory_budget must be in \(0, 1\], got 1.5"):
        main(["compile=true", "activation_memory_budget=1.5", *base])


def test_activation_memory_budget_keeps_less_for_the_backward_and_the_same_gradients():
    """A compiled FoX (Pro) block under a memory budget saves fewer bytes for its backward (it recomputes
    norms, gates and the token shift) and gives the same output and gradients as without one."""
    import torch._functorch.config as functorch_config

    from fox_models.presets import get_preset
    from fox_train.parallelize import compile_blocks

    def run(budget):
        torch._dynamo.reset()  # a compiled block is partitioned once: drop the previous budget's
        functorch_config.activation_memory_budget = 1.0
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(get_preset("fox-pro-125m", hidden_size=64, num_hidden_layers=1,
                                                            num_heads=2))
        compile_blocks(model, None, budget)
        x = torch.randn(1, 96, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = model.model.layers[0](x)
        y.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return sum(saved.values()), y.detach(), x.grad.clone(), grads

    try:
        full, y1, gx1, g1 = run(None)
        part, y2, gx2, g2 = run(0.5)
    finally:
        functorch_config.activation_memory_budget = 1.0
        torch._dynamo.reset()
    assert part < 0.8 * full, (part, full)
    torch.testing.assert_close(y2, y1)
    torch.testing.assert_close(gx2, gx1, rtol=1e-5, atol=1e-6)
    assert len(g1) == len(g2) > 10
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert gx1.abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_blocks_follow_the_plain_compiled_run(tmp_path):
    """Blocks as CUDA graphs (compile_mode=reduce-overhead), with two micro-batches per step and an
    evaluation every other step, give the loss curve of the default compiled run."""
    runs = {}
    for name, mode in (("plain", "null"), ("graphs", "reduce-overhead")):
        main([f"out_dir={tmp_path}", f"run_name={name}", "model=fox-pro-tiny", "compile=true", f"compile_mode={mode}",
              "global_batch_tokens=512", "schedule.total_tokens=4096", "eval_every=2", "log_every=1", "export=false",
              *[o for o in SMALL if not o.startswith("global_batch_tokens")]])
        recs = _records(tmp_path / name)
        runs[mode] = ([r["loss"] for r in recs if "loss" in r], [r["heldout_loss"] for r in recs if "heldout_loss" in r])
    (train_a, held_a), (train_b, held_b) = runs.values()
    assert len(train_a) == 8 and len(held_a) == 5
    np.testing.assert_allclose(train_b, train_a, rtol=2e-3)
    np.testing.assert_allclose(held_b, held_a, rtol=2e-3)


def test_batch_not_divisible_by_devices():
    with pytest.raises(ValueError, match="multiple of micro_batch_size x devices = 3 x 2"):
        Sampler(100, global_batch=8, micro_batch=3, world_size=2, shuffle=False, seed=0)


def test_twenty_step_cpu_run_writes_everything(tmp_path):
    main([f"out_dir={tmp_path}", "run_name=r", "schedule.total_tokens=5120", "checkpoint_every=10", "eval_every=10",
          "log_every=5", *SMALL])
    run = tmp_path / "r"
    for name in ("config.yaml", "metrics.jsonl", "metrics.csv", "heldout_per_token_loss.png", "hf/config.json",
                 "hf/model.safetensors", "hf/tokenizer_config.json"):
        assert (run / name).exists() and (run / name).stat().st_size > 0, name
    recs = _records(run)
    held = [r["heldout_loss"] for r in recs if "heldout_loss" in r]
    assert len(held) == 3 and held[-1] < held[0]
    train = [r for r in recs if "loss" in r]
    assert train[-1]["step"] == 20 and "loss_pos_0_16" in train[0] and train[0]["tokens_per_s"] > 0
    assert [p.name for p in ckpt.complete_checkpoints(run / "checkpoints")] == ["step-00000020", "step-00000010"]
    # export of the last checkpoint == the exported model; from_pretrained gives the same logits
    export_checkpoint(run / "checkpoints" / "step-00000020", tmp_path / "exported")
    a = AutoModelForCausalLM.from_pretrained(run / "hf")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    ids = torch.randint(0, 50257, (2, 30))
    assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("preset", ["mamba2-tiny", "hgrn2-tiny", "delta_net-tiny", "samba-tiny"])
def test_recurrent_baselines_train_and_export(tmp_path, preset):
    main([f"out_dir={tmp_path}", "run_name=r", f"model={preset}", "schedule.total_tokens=2048", "eval_every=4",
          "checkpoint_every=8", "data.seq_len=32", "micro_batch_size=4", "global_batch_tokens=256",
          "schedule.warmup_tokens=256", "eval_sequences=2", "optimizer.lr=0.01"])
    run = tmp_path / "r"
    held = [r["heldout_loss"] for r in _records(run) if "heldout_loss" in r]
    assert len(held) >= 2 and held[-1] < held[0]
    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert type(model).__name__ == {"mamba2-tiny": "Mamba2ForCausalLM", "hgrn2-tiny": "HGRN2ForCausalLM",
                                    "delta_net-tiny": "DeltaNetForCausalLM", "samba-tiny": "SambaForCausalLM"}[preset]


def test_baseline_ssm_parameters_get_no_weight_decay():
    from fox_train.train import param_groups

    model = fox_models.Mamba2ForCausalLM(fox_models.Mamba2Config(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16, state_size=8, n_groups=1))
    decay, rest = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)].rsplit(".", 1)[-1] for p in rest["params"]} >= {"A_log", "D", "dt_bias", "bias", "weight"}
    assert all(names[id(p)].endswith("weight") for p in decay["params"])
    assert "backbone.layers.0.mixer.norm.weight" in {names[id(p)] for p in rest["params"]}


def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    args = [f"out_dir={tmp_path}", "schedule.total_tokens=10240", "checkpoint_every=4", "keep_last=3", "eval_every=1000",
            "log_every=1", *SMALL]
    main([*args, "run_name=straight"])
    straight = {r["step"]: r["loss"] for r in _records(tmp_path / "straight") if "loss" in r}

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fox_train.cli", *args, "run_name=killed"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = tmp_path / "killed" / "checkpoints" / "step-00000012" / ckpt.MARKER
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    main([*args, "run_name=killed", "resume=true"])
    steps = [r["step"] for r in _records(tmp_path / "killed") if "loss" in r]
    assert steps == sorted(set(steps)), "the replayed steps were logged twice"
    resumed = {r["step"]: r["loss"] for r in _records(tmp_path / "killed") if "loss" in r}
    assert set(resumed) == set(straight)
    for step, loss in straight.items():
        assert abs(resumed[step] - loss) <= 1e-6, (step, resumed[step], loss)


def test_corrupt_checkpoint_is_skipped(tmp_path):
    main([f"out_dir={tmp_path}", "run_name=c", "schedule.total_tokens=2048", "checkpoint_every=4", "eval_every=1000",
          *SMALL])
    newest = ckpt.complete_checkpoints(tmp_path / "c" / "checkpoints")[0]
    (newest / "state.pt").write_bytes(b"truncated")
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000008"):
        main([f"out_dir={tmp_path}", "run_name=c", "schedule.total_tokens=2048", "checkpoint_every=4",
              "eval_every=1000", "resume=true", *SMALL])
    # none loads: an error naming each, never a silent restart at step 0
    for path in ckpt.complete_checkpoints(tmp_path / "c" / "checkpoints"):
        (path / "state.pt").write_bytes(b"truncated")
    with pytest.warns(UserWarning), pytest.raises(SystemExit, match=r"^fox-train: resume=true: no checkpoint under .* "
                                                                     r"loads \(step-00000008: .*; step-00000004: "):
        main([f"out_dir={tmp_path}", "run_name=c", "resume=true"])


@pytest.mark.parametrize("world", [1, 2])
def test_sampler_resumes_at_the_right_batch(world):
    ref = Sampler(50, global_batch=8, micro_batch=2, world_size=1, shuffle=True, seed=3)
    s = Sampler(50, global_batch=8, micro_batch=2, world_size=world, shuffle=True, seed=3)
    for step in (0, 5, 6, 17):  # 17 crosses into a later epoch
        expected = [i for a in range(ref.accum_steps) for i in ref.indices(step, a, 0)]
        got = [i for a in range(s.accum_steps) for r in range(world) for i in s.indices(step, a, r)]
        assert got == expected
        fresh = Sampler(50, global_batch=8, micro_batch=2, world_size=world, shuffle=True, seed=3)
        assert [fresh.indices(step, a, r) for a in range(s.accum_steps) for r in range(world)] == \
               [s.indices(step, a, r) for a in range(s.accum_steps) for r in range(world)]
    assert len(set(i for st in range(6) for a in range(8) for i in ref.indices(st, a % 4, 0))) == 48


def test_text_tokens_and_hf_sources(tmp_path):
    """The other data sources: a text folder, a token file made by `fox-train tokenize`, a saved HF dataset."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"{i:02d}.txt").write_text(f"Document {i}. " + "And it came to pass in those days. " * 40)
    main([f"out_dir={tmp_path}", "run_name=text", "data=text", f"data.path={docs}", "schedule.total_tokens=1024",
          "eval_every=1000", "checkpoint_every=1000", "export=false", *SMALL])
    main(["tokenize", str(docs), str(tmp_path / "tokens.npy")])
    main([f"out_dir={tmp_path}", "run_name=tok", "data=tokens", f"data.path={tmp_path / 'tokens.npy'}",
          "schedule.total_tokens=1024", "eval_every=1000", "checkpoint_every=1000", "export=false", *SMALL])
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [p.read_text() for p in sorted(docs.iterdir())]}).save_to_disk(str(tmp_path / "hf"))
    main([f"out_dir={tmp_path}", "run_name=hf", "data=hf", f"data.path={tmp_path / 'hf'}", "schedule.total_tokens=1024",
          "eval_every=1000", "checkpoint_every=1000", "export=false", *SMALL])
    for run in ("text", "tok", "hf"):
        recs = _records(tmp_path / run)
        assert [r["step"] for r in recs if "loss" in r][-1] == 4, run
    tokens = np.load(tmp_path / "tokens.npy")
    assert tokens.dtype == np.uint16 and (tokens == 50256).sum() == 12  # one EOT after each document


def _lc64(path, docs=5, length=256):
    zarr = pytest.importorskip("zarr")
    arr = zarr.open(str(path), mode="w", shape=(docs, length), chunks=(1, 64), dtype="uint16")
    arr[:] = (np.arange(docs)[:, None] * 1000 + np.arange(length)[None, :]).astype(np.uint16)
    return path


def test_longcrawl64_paper_order_and_training(tmp_path):
    from fox_train.data import LongCrawl64Sequences

    train = _lc64(tmp_path / "train.zarr")
    held = _lc64(tmp_path / "heldout.zarr", docs=3)
    seqs = LongCrawl64Sequences(str(train), 64)
    assert len(seqs) == 20
    # the first chunk of every document comes before any second chunk
    assert [int(seqs.get(i)[0]) for i in range(7)] == [0, 1000, 2000, 3000, 4000, 64, 1064]
    assert seqs.get(6).tolist() == list(range(1064, 1128))
    with pytest.raises(ValueError, match="must divide the document length 256"):
        LongCrawl64Sequences(str(train), 100)
    main([f"out_dir={tmp_path}", "run_name=lc", "data=longcrawl64", f"data.path={train}", f"data.heldout_path={held}",
          "schedule.total_tokens=768", "eval_every=1000", "checkpoint_every=1000", "export=false", *SMALL])
    assert [r["step"] for r in _records(tmp_path / "lc") if "loss" in r][-1] == 3
