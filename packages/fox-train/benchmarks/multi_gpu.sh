#!/usr/bin/env bash
# Two-GPU check of fox-train (issue: scale-out): the 125M FoX (Pro) on the bundled corpus at the same
# global batch on 1 GPU, 2 GPUs with DDP and 2 GPUs with FSDP; then a 2-GPU (DDP) checkpoint resumed on
# one GPU. Usage: bash packages/fox-train/benchmarks/multi_gpu.sh OUT_DIR
set -euo pipefail
out=${1:-outputs/multi_gpu}
common=(model=fox-pro-125m data.seq_len=2048 global_batch_tokens=65536 micro_batch_size=8
        schedule.total_tokens=2621440 schedule.warmup_tokens=262144 optimizer.lr=2e-3 eval_every=1000
        checkpoint_every=20 keep_last=5 log_every=2 export=false out_dir="$out")
python -m fox_train.cli "${common[@]}" strategy=single run_name=gpu1
python -m fox_train.cli "${common[@]}" strategy=ddp strategy.devices=2 run_name=ddp2
python -m fox_train.cli "${common[@]}" strategy=fsdp strategy.devices=2 run_name=fsdp2
# resume the DDP run's step-20 checkpoint on one GPU
mkdir -p "$out/ddp2_on1/checkpoints"
cp -r "$out/ddp2/checkpoints/step-00000020" "$out/ddp2_on1/checkpoints/"
cp "$out/ddp2/config.yaml" "$out/ddp2_on1/"
python -m fox_train.cli "${common[@]}" strategy=single run_name=ddp2_on1 resume=true
