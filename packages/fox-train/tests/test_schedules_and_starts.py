"""The official trainer's learning-rate schedules (hand-computed values) and warm starts from another run."""

import json
import math

import pytest
import torch

from fox_train.cli import compose, main
from fox_train.config import check
from fox_train.train import lr_at

# peak 1.0, warmup 100, total 1100 tokens, end 0.1
SCHEDULE = ["optimizer.lr=1.0", "schedule.warmup_tokens=100", "schedule.total_tokens=1100", "schedule.min_lr_ratio=0.1"]
SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64", "micro_batch_size=4",
         "global_batch_tokens=256", "schedule.warmup_tokens=512", "eval_sequences=4", "eval_every=1000", "log_every=1"]

# tokens -> lr, by hand: warmup t/100; cosine 0.1 + 0.45 (1 + cos(pi p)), p = (t - 100) / 1000;
# linear 1 - 0.9 p; one-minus-sqrt (anneal 400, from 700): 1 - 0.9 sqrt((t - 700) / 400)
EXPECTED = {
    "warmup_cosine": {0: 0.0, 50: 0.5, 100: 1.0, 350: 0.1 + 0.45 * (1 + math.sqrt(0.5)), 600: 0.55, 1100: 0.1,
                      5000: 0.1},
    "warmup_linear": {0: 0.0, 50: 0.5, 100: 1.0, 350: 0.775, 600: 0.55, 1100: 0.1, 5000: 0.1},
    "warmup_one_minus_sqrt": {0: 0.0, 50: 0.5, 100: 1.0, 500: 1.0, 700: 1.0, 800: 0.55,
                              1000: 1 - 0.9 * math.sqrt(0.75), 1100: 0.1, 5000: 0.1},
    "constant": {0: 1.0, 50: 1.0, 600: 1.0, 5000: 1.0},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_schedule_values(name):
    cfg = compose([f"schedule={name}", *SCHEDULE, "schedule.anneal_tokens=400"])
    assert cfg.schedule.name == name
    for tokens, lr in EXPECTED[name].items():
        assert lr_at(tokens, cfg) == pytest.approx(lr, abs=1e-12), (tokens, lr_at(tokens, cfg), lr)


def test_schedule_fields_are_checked(tmp_path):
    with pytest.raises(ValueError, match="schedule.anneal_tokens must be a positive token count"):
        check(compose(["schedule=warmup_one_minus_sqrt"]))
    with pytest.raises(ValueError, match="must not exceed schedule.total_tokens, got 100 \\+ 1001 > 1100"):
        check(compose(["schedule=warmup_one_minus_sqrt", *SCHEDULE, "schedule.anneal_tokens=1001"]))
    with pytest.raises(ValueError, match="schedule.name must be one of"):
        check(compose(["schedule.name=step"]))
    with pytest.raises(SystemExit, match="fox-train: schedule.name must be one of"):
        main(["schedule.name=step", f"out_dir={tmp_path}"])


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_warm_start_takes_the_weights_and_starts_at_step_zero(tmp_path):
    """A run started with init_from=<checkpoint> holds the source's weights at step 0 (its first held-out
    loss is the source's last), then trains from step 0 on its own schedule with a fresh optimizer."""
    main([f"out_dir={tmp_path}", "run_name=src", "schedule.total_tokens=1024", "checkpoint_every=4", "export=false",
          *SMALL])
    source = tmp_path / "src" / "checkpoints" / "step-00000004"
    held_src = [r["heldout_loss"] for r in _records(tmp_path / "src") if "heldout_loss" in r]
    for name, init in (("fork", source), ("fork-run", tmp_path / "src")):
        main([f"out_dir={tmp_path}", f"run_name={name}", f"init_from={init}", "schedule=constant", "optimizer.lr=1e-3",
              "schedule.total_tokens=512", "export=false", *SMALL])
        recs = _records(tmp_path / name)
        held = [r["heldout_loss"] for r in recs if "heldout_loss" in r]
        assert held[0] == pytest.approx(held_src[-1], rel=1e-6)
        train = [r for r in recs if "loss" in r]
        assert [r["step"] for r in train] == [1, 2] and train[0]["lr"] == 1e-3
        saved = torch.load(tmp_path / name / "checkpoints" / "step-00000002" / "state.pt", weights_only=True)
        assert saved["step"] == 2
        # a fresh optimizer: its Adam step count is this run's two steps, not the source's six
        assert {int(s["step"]) for s in saved["optimizer"]["state"].values()} == {2}


def test_warm_start_errors_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="fox-train: init_from '/no/such/run' is not a checkpoint directory"):
        main([f"out_dir={tmp_path}", "init_from=/no/such/run", *SMALL])
    main([f"out_dir={tmp_path}", "run_name=src", "schedule.total_tokens=256", *SMALL])
    with pytest.raises(SystemExit, match="fox-train: init_from .* does not fit model"):
        main([f"out_dir={tmp_path}", f"init_from={tmp_path / 'src'}", *SMALL[:2], "model.num_heads=4", *SMALL[3:]])
    hf = tmp_path / "src" / "hf"
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(SystemExit, match=rf"^fox-train: init_from '{hf}': .*config.json has model_type 'llama', this "
                                         rf"run's model is '{config['model_type']}'$"):
        main([f"out_dir={tmp_path}", "run_name=other", f"init_from={hf}", "schedule.total_tokens=256", *SMALL])
    (hf / "config.json").write_text('{"model_type": ')
    with pytest.raises(SystemExit, match=rf"^fox-train: init_from '{hf}': .*config.json cannot be read: Expecting value"):
        main([f"out_dir={tmp_path}", "run_name=broken", f"init_from={hf}", "schedule.total_tokens=256", *SMALL])
    (hf / "config.json").write_text(json.dumps(config))
    main([f"out_dir={tmp_path}", "run_name=fork", f"init_from={hf}", "schedule.total_tokens=256", "export=false", *SMALL])
    assert not (tmp_path / "other" / "config.yaml").exists() and not (tmp_path / "broken" / "config.yaml").exists()
