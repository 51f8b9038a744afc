#!/usr/bin/env bash
# The GPU checks of a change, in one go, on a host with torch, triton and a CUDA GPU (the packages run
# from source): the `gpu` tests of each package, then the benchmarks the docs quote. Each step has its own
# time limit, so one that hangs or runs long does not take the rest with it; every log, JUnit report and
# JSON lands in OUT, and a summary line per step in OUT/summary.txt.
#
#   bash scripts/gpu_checks.sh [OUT] [STEP ...]
#   e.g. bash scripts/gpu_checks.sh gpu-out tests-kernel bench-attention
#
# STEP (default: all, in this order): tests-kernel tests-layers tests-models bench-attention bench-window
# train-step baselines generate; `tests` runs the gpu tests of every package in one pytest over
# GPU_CHECKS_WORKERS processes (pytest-xdist, default 8: the whole suite took 5.5 min on an H200, the
# processes compiling their kernels side by side). GPU_CHECKS_TIMEOUT (seconds, default 900) limits each step.
# GPU_CHECKS_BEFORE=DIR, a folder holding an older tree's packages/ (e.g. from
# `git archive REV packages | tar -x -C DIR`): each benchmark step also runs that tree's benchmark on its
# sources, right after this tree's, into OUT/<step>-before.json (a before/after pair from one machine).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-checks}
shift || true
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests-kernel tests-layers tests-models bench-attention bench-window train-step baselines generate)
limit=${GPU_CHECKS_TIMEOUT:-900}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
sources() { local root=$1; echo "$root/packages/fox-kernel/src:$root/packages/fox-layers/src:$root/packages/fox-models/src:$root/packages/fox-train/src:$root/packages/fox-eval/src"; }
extra=${PYTHONPATH:-}
export PYTHONPATH="$(sources .)${extra:+:$extra}"
before=${GPU_CHECKS_BEFORE:-}
if [ -n "$before" ] && [ ! -d "$before/packages" ]; then
  echo "gpu_checks.sh: GPU_CHECKS_BEFORE=$before holds no packages/ folder" >&2
  exit 2
fi

command_of() {
  case "$1" in
    tests) echo "python3 -m pytest -m gpu -q -p no:cacheprovider -n ${GPU_CHECKS_WORKERS:-8} -rfE packages/fox-kernel/tests packages/fox-layers/tests packages/fox-models/tests packages/fox-train/tests --junitxml=$out/tests.xml" ;;
    tests-kernel) echo "python3 -m pytest -m gpu -q -p no:cacheprovider packages/fox-kernel/tests --junitxml=$out/tests-kernel.xml" ;;
    tests-layers) echo "python3 -m pytest -m gpu -q -p no:cacheprovider packages/fox-layers/tests --junitxml=$out/tests-layers.xml" ;;
    tests-models) echo "python3 -m pytest -m gpu -q -p no:cacheprovider packages/fox-models/tests --junitxml=$out/tests-models.xml" ;;
    bench-attention) echo "python3 packages/fox-kernel/benchmarks/bench_attention.py --quick --out $out/bench-attention.json" ;;
    bench-window) echo "python3 packages/fox-kernel/benchmarks/bench_window.py --quick --out $out/bench-window.json" ;;
    train-step) echo "python3 packages/fox-train/benchmarks/train_throughput.py --sizes 125m --compile --steps 10 --warmup 3 --models '=FoX (Pro)' '=FoX (LLaMA)' '=Transformer (LLaMA, SDPA)' --out $out/train-step-125m.json" ;;
    baselines) echo "python3 packages/fox-train/benchmarks/train_throughput.py --baselines --sizes 760m --steps 6 --warmup 2 --out $out/baselines-760m.json" ;;
    generate) echo "python3 packages/fox-models/benchmarks/generate.py --size 125m --batch 1 32 --prompt 2048 16384 --static --out $out/generate-125m.json" ;;
    *) return 1 ;;
  esac
}

run_step() {  # name, command, python path
  echo "== $1: $2"
  local start rc
  start=$(date +%s)
  PYTHONPATH="$3" timeout "$limit" bash -c "$2" > "$out/$1.log" 2>&1
  rc=$?
  echo "$1 rc=$rc $(( $(date +%s) - start ))s $(tail -n 1 "$out/$1.log")" | tee -a "$out/summary.txt"
}

for step in "${steps[@]}"; do
  command_of "$step" > /dev/null || { echo "gpu_checks.sh: unknown step '$step'" >&2; exit 2; }
done
for step in "${steps[@]}"; do
  cmd=$(command_of "$step")
  run_step "$step" "$cmd" "$PYTHONPATH"
  if [ -n "$before" ] && [[ $step != tests* ]]; then  # the older tree's own script, on its own sources
    old=${cmd//packages\//$before/packages/}
    run_step "$step-before" "${old//$out\/$step/$out/$step-before}" "$(sources "$before")${extra:+:$extra}"
  fi
done
