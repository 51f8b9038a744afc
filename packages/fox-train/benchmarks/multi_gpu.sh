#!/usr/bin/env bash
# Two-GPU check of fox-train (issue: scale-out): the 125M FoX (Pro) on the bundled corpus at the same
# global batch on 1 GPU, 2 GPUs with DDP and 2 GPUs with FSDP; then the step-20 checkpoints of both
# 2-GPU runs resumed on one GPU. Prints losses and throughput side by side and writes OUT/summary.json.
# Usage: bash packages/fox-train/benchmarks/multi_gpu.sh OUT_DIR
set -euo pipefail
out=${1:-outputs/multi_gpu}
common=(model=fox-pro-125m data.seq_len=2048 global_batch_tokens=65536 micro_batch_size=8
        schedule.total_tokens=2621440 schedule.warmup_tokens=262144 optimizer.lr=2e-3 eval_every=1000
        checkpoint_every=20 keep_last=5 log_every=2 export=false out_dir="$out")
python -m fox_train.cli "${common[@]}" strategy=single run_name=gpu1
python -m fox_train.cli "${common[@]}" strategy=ddp strategy.devices=2 run_name=ddp2
python -m fox_train.cli "${common[@]}" strategy=fsdp strategy.devices=2 run_name=fsdp2
for run in ddp2 fsdp2; do  # resume each 2-GPU run's step-20 checkpoint on one GPU
  mkdir -p "$out/${run}_on1/checkpoints"
  cp -r "$out/$run/checkpoints/step-00000020" "$out/${run}_on1/checkpoints/"
  cp "$out/$run/config.yaml" "$out/${run}_on1/"
  python -m fox_train.cli "${common[@]}" strategy=single run_name=${run}_on1 resume=true
done
python - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
base, summary = None, {}
print(f"{'run':10s} {'loss@8':>8s} {'loss@20':>8s} {'loss@32':>8s} {'loss@40':>8s} {'tokens/s':>10s} {'scaling':>8s}")
for run in ("gpu1", "ddp2", "fsdp2", "ddp2_on1", "fsdp2_on1"):
    recs = [json.loads(l) for l in (out / run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    loss = {r["step"]: r["loss"] for r in recs}
    tps = statistics.median(r["tokens_per_s"] for r in recs if r["step"] > 4)
    base = base or tps
    summary[run] = dict(loss=loss, tokens_per_s=tps, scaling=tps / base)
    cells = " ".join(f"{loss[s]:8.4f}" if s in loss else f"{'-':>8s}" for s in (8, 20, 32, 40))
    print(f"{run:10s} {cells} {tps:10,.0f} {tps / base:8.2f}")
(out / "summary.json").write_text(json.dumps(summary, indent=1))
PY
