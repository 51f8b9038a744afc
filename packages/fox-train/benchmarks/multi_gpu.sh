#!/usr/bin/env bash
# Multi-GPU check of fox-train (issue: scale-out): the 125M FoX (Pro) on the bundled corpus at the same
# global batch on 1 GPU and on NGPU GPUs (default 2) with DDP and FSDP; then the step-20 checkpoints of the
# NGPU-GPU runs resumed on one GPU. Prints losses and throughput side by side and writes OUT/summary.json.
# Each run has its own log (OUT/<run>.log) and time limit (RUN_TIMEOUT seconds, default 300), so one
# that hangs or fails is reported and the others still run.
# Runs (N = NGPU): gpu1, ddpN, fsdpN (FSDP, FullyShardedDataParallel), fullyshardN (strategy=fsdp2: FSDP2's
# fully_shard), and the same two with SHARD_GRAD_OP (parameters kept gathered from the forward to the
# backward: no all-gather in the backward), fsdpN_grad and fullyshardN_grad; the default is
# "gpu1 ddpN fsdpN". RESUME=0 skips the resumed runs.
# Usage: [PYTHON=python3] [NGPU=2] [RUNS="gpu1 ddp2 fsdp2"] bash packages/fox-train/benchmarks/multi_gpu.sh OUT_DIR \
#        [overrides, e.g. strategy.fsdp_param_dtype=float32]
# The paper's batch (0.5M tokens a step, 16k context; on 2 x H200 DDP 1.99x, FSDP with SHARD_GRAD_OP 1.94x,
# docs/performance.md):
#   RESUME=0 RUNS="gpu1 ddp2 fsdp2_grad" bash packages/fox-train/benchmarks/multi_gpu.sh OUT compile=true \
#     data.seq_len=16384 global_batch_tokens=524288 micro_batch_size=1 schedule.total_tokens=5242880 \
#     schedule.warmup_tokens=1048576 log_every=1 checkpoint_every=1000 eval_sequences=4
set -uo pipefail
out=${1:-outputs/multi_gpu}
shift || true
limit=${RUN_TIMEOUT:-300}
n=${NGPU:-2}
mkdir -p "$out"
common=(model=fox-pro-125m data.seq_len=2048 global_batch_tokens=65536 micro_batch_size=8
        schedule.total_tokens=2621440 schedule.warmup_tokens=262144 optimizer.lr=2e-3 eval_every=1000
        checkpoint_every=20 keep_last=5 log_every=2 export=false out_dir="$out" "$@")
run() {  # run NAME OVERRIDES...: one training run, its log, its exit status
  local name=$1; shift
  local t0=$SECONDS
  timeout "$limit" "${PYTHON:-python}" -m fox_train.cli "${common[@]}" "$@" run_name="$name" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (log: $out/$name.log)"
  [ $rc -eq 0 ] || tail -c 2000 "$out/$name.log" | tr '\r' '\n' | tail -15
}
runs=" ${RUNS:-gpu1 ddp$n fsdp$n} "  # a subset, e.g. RUNS="fsdp2" with strategy.fsdp_param_dtype=float32
[[ $runs == *" gpu1 "* ]] && run gpu1 strategy=single
[[ $runs == *" ddp$n "* ]] && run ddp$n strategy=ddp strategy.devices=$n
[[ $runs == *" fsdp$n "* ]] && run fsdp$n strategy=fsdp strategy.devices=$n
[[ $runs == *" fullyshard$n "* ]] && run fullyshard$n strategy=fsdp2 strategy.devices=$n
[[ $runs == *" fsdp${n}_grad "* ]] && run fsdp${n}_grad strategy=fsdp strategy.devices=$n strategy.fsdp_sharding=SHARD_GRAD_OP
[[ $runs == *" fullyshard${n}_grad "* ]] && run fullyshard${n}_grad strategy=fsdp2 strategy.devices=$n \
  strategy.fsdp_sharding=SHARD_GRAD_OP
for src in ddp$n fsdp$n fullyshard$n fsdp${n}_grad fullyshard${n}_grad; do  # resume each multi-GPU run's step-20 checkpoint on one GPU
  [[ $runs == *" $src "* && ${RESUME:-1} != 0 ]] || continue
  if [ -d "$out/$src/checkpoints/step-00000020" ]; then
    mkdir -p "$out/${src}_on1/checkpoints"
    cp -r "$out/$src/checkpoints/step-00000020" "$out/${src}_on1/checkpoints/"
    cp "$out/$src/config.yaml" "$out/${src}_on1/"
    run "${src}_on1" strategy=single resume=true
  else
    echo "${src}_on1: skipped ($src wrote no step-20 checkpoint)"
  fi
done
"${PYTHON:-python}" - "$out" "$n" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
base, summary = None, {}
print(f"{'run':20s} {'loss@8':>8s} {'loss@20':>8s} {'loss@32':>8s} {'loss@40':>8s} {'tokens/s':>10s} {'scaling':>8s}")
n = sys.argv[2]
names = (f"ddp{n}", f"fsdp{n}", f"fullyshard{n}", f"fsdp{n}_grad", f"fullyshard{n}_grad")
for run in ("gpu1", *names, *(f"{n}_on1" for n in names)):
    path = out / run / "metrics.jsonl"
    recs = [json.loads(l) for l in path.read_text().splitlines() if '"loss"' in l] if path.exists() else []
    if not recs:
        print(f"{run:20s} no metrics")
        continue
    loss = {r["step"]: r["loss"] for r in recs}
    tps = statistics.median(r["tokens_per_s"] for r in recs if r["step"] > 4 or len(recs) < 3)
    base = base or tps
    summary[run] = dict(loss=loss, tokens_per_s=tps, scaling=tps / base)
    cells = " ".join(f"{loss[s]:8.4f}" if s in loss else f"{'-':>8s}" for s in (8, 20, 32, 40))
    print(f"{run:20s} {cells} {tps:10,.0f} {tps / base:8.2f}")
(out / "summary.json").write_text(json.dumps(summary, indent=1))
PY
