"""benchmarks/plot_multi_gpu.py: runs read from a result file in the chosen order, steps as numbers, a PNG
written; a run name the file lacks is refused in one line naming the runs it has."""
import json

import pytest


def test_runs_in_order_and_a_png(tmp_path, benchmark_module):
    data = {"env": {}, "runs": {
        "ddp4": {"loss": {"1": 10.9, "2": 9.5, "10": 6.1}, "tokens_per_s": {"1": 5e4, "2": 8e5, "10": 7.9e5}},
        "gpu1": {"loss": {"1": 10.9, "2": 9.5, "10": 6.1}, "tokens_per_s": {"1": 3e4, "2": 2e5, "10": 2.1e5}},
        "note": "not a run"}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    module = benchmark_module("plot_multi_gpu")
    runs = module.runs_of(data, ["gpu1", "ddp4"])
    assert list(runs) == ["gpu1", "ddp4"]
    assert runs["ddp4"]["loss"] == {1: 10.9, 2: 9.5, 10: 6.1}
    assert list(module.runs_of(data)) == ["ddp4", "gpu1"]
    module.main([str(path), "--out", str(tmp_path / "p.png"), "--runs", "gpu1", "ddp4"])
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match=r"--runs names \['fsdp4'\] not in the file \(it has \['ddp4', 'gpu1'\]\)"):
        module.runs_of(data, ["fsdp4"])
