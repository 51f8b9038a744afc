"""fox-train as a Hydra application: --help, --cfg job (YAML), -m sweeps with one run directory per job,
one-line errors."""

import json
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from fox_train.cli import compose, main
from fox_train.config import TrainConfig

SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64", "micro_batch_size=4",
         "global_batch_tokens=256", "schedule.warmup_tokens=256", "schedule.total_tokens=512", "eval_sequences=4",
         "log_every=1", "export=false"]


def test_cfg_job_prints_the_composed_config_with_the_model_fields(capsys):
    args = ["experiment=longcrawl64/transformer/llama_125m_2b", "data.path=/data/lc64/train.zarr"]
    main(["--cfg", "job", *args])
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["model"]
    assert model["preset"] == "transformer-llama-125m"
    assert (model["hidden_size"], model["num_hidden_layers"], model["num_heads"], model["rope_base"]) == (768, 12, 12, 5e5)
    assert printed["optimizer"]["lr"] == 0.002 and printed["schedule"]["total_tokens"] == 2684354560
    # what is printed is the whole config: it gives back the same TrainConfig
    assert OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), printed)) == compose(args)


def test_console_script_prints_yaml():
    out = subprocess.run([sys.executable, "-m", "fox_train.cli", "model=mamba2-360m", "--cfg", "job"],
                         capture_output=True, text=True, check=True).stdout
    model = yaml.safe_load(out)["model"]
    assert (model["hidden_size"], model["num_hidden_layers"], model["num_heads"], model["head_dim"],
            model["state_size"]) == (1024, 48, 32, 64, 128)


def test_help_lists_groups_experiments_and_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for text in ("fox-train tokenize", "fox-train export", "-m optimizer.lr=",
                 "experiment/longcrawl64/forgetting_transformer: llama_125m_2b",
                 "schedule: constant, warmup_cosine, warmup_linear, warmup_one_minus_sqrt", "samba-760m"):
        assert text in out, text


def test_multirun_sweep_writes_one_run_directory_per_job(tmp_path):
    main(["-m", f"out_dir={tmp_path}", "run_name=sweep", "optimizer.lr=1e-3,2e-3", *SMALL])
    for job, lr in ((0, 1e-3), (1, 2e-3)):
        run = tmp_path / "sweep" / str(job)
        assert OmegaConf.load(run / "config.yaml").optimizer.lr == lr
        assert (run / ".hydra" / "overrides.yaml").exists()
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss" in r]
        assert [r["step"] for r in steps] == [1, 2] and steps[-1]["lr"] == pytest.approx(lr)
    # each job owns its directory: the same sweep again is refused job by job, with resume=true it resumes
    with pytest.raises(SystemExit, match=r"^fox-train: .*sweep/\d already holds checkpoints"):
        main(["-m", f"out_dir={tmp_path}", "run_name=sweep", "optimizer.lr=1e-3,2e-3", *SMALL])
    main(["-m", f"out_dir={tmp_path}", "run_name=sweep", "resume=true", "optimizer.lr=1e-3,2e-3", *SMALL])
    for job, lr in ((0, 1e-3), (1, 2e-3)):
        run = tmp_path / "sweep" / str(job)
        assert OmegaConf.load(run / "config.yaml").optimizer.lr == lr
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == [1, 2]


def test_errors_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^fox-train: bad configuration: In 'config': Could not find 'model/nope'$"):
        main(["model=nope"])
    # an experiment that does not exist is refused, not skipped (the default run would train instead)
    with pytest.raises(SystemExit, match=r"^fox-train: bad configuration: .*Could not find 'experiment/repro/nope'$"):
        main(["experiment=repro/nope"])
    with pytest.raises(SystemExit, match=r"^fox-train: Only one of --run, --multirun, --cfg"):
        main(["-m", "optimizer.lr=1e-3,2e-3", "--cfg", "job"])
    with pytest.raises(SystemExit, match=r"^fox-train: bad configuration: Error merging override model.state_size=abc: Value 'abc'"):
        main(["model.state_size=abc"])
    with pytest.raises(SystemExit, match=r"^fox-train: model.state_size is not a field of fox-pro-tiny"):
        main([f"out_dir={tmp_path}", "model.state_size=16", *SMALL])
    # a failing job of a sweep
    with pytest.raises(SystemExit, match=r"^fox-train: data.path '/no/such/corpus' does not exist"):
        main(["-m", f"out_dir={tmp_path}", "data=text", "data.path=/no/such/corpus", "optimizer.lr=1e-3,2e-3", *SMALL])


def test_tokenize_errors_name_its_input_argument(tmp_path):
    """``fox-train tokenize INPUT OUTPUT.npy`` takes no data.path: its errors name the argument ``input``."""
    for make, error in ((lambda p: None, "does not exist"), (lambda p: p.mkdir(), "holds no .txt files")):
        missing = tmp_path / f"corpus-{len(error)}"
        make(missing)
        with pytest.raises(SystemExit, match=rf"^fox-train tokenize: input '.*{missing.name}' {error}$"):
            main(["tokenize", str(missing), str(tmp_path / "t.npy")])
    assert not (tmp_path / "t.npy").exists()
