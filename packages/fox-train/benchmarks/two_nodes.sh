#!/usr/bin/env bash
# fox-train on two torchrun "nodes" of NPROC GPUs each (default 2), both on this host, as a cluster runs it:
# a c10d rendezvous on localhost, node 0 on the first NPROC GPUs and node 1 on the next NPROC
# (CUDA_VISIBLE_DEVICES), data-parallel training with a checkpoint, then the same command with resume=true
# and a longer run. The reference is one process group on 2*NPROC GPUs of the same host (strategy=ddp) on
# the same batches; the constant learning-rate schedule makes a run's steps independent of its length, so
# the nodes' 3 steps + 2 resumed steps compare step by step with the reference's 5. Prints both loss
# columns and writes OUT/summary.json. Each launch has its own time limit (RUN_TIMEOUT seconds, default 240).
# Usage: [PYTHON=python3] [NPROC=2] [MODEL=fox-pro-125m] [SEQ_LEN=16384] bash packages/fox-train/benchmarks/two_nodes.sh OUT_DIR [overrides]
set -uo pipefail
out=${1:-outputs/two_nodes}
shift || true
out=$(mkdir -p "$out" && cd "$out" && pwd)
nproc=${NPROC:-2}
limit=${RUN_TIMEOUT:-240}
py=${PYTHON:-python}
world=$((2 * nproc))
seq=${SEQ_LEN:-16384}
batch=$((world * 2 * seq))  # two sequences per rank and step
common=(model=${MODEL:-fox-pro-125m} data.seq_len=$seq micro_batch_size=2 global_batch_tokens=$batch schedule=constant
        optimizer.lr=1e-3 eval_every=1000 eval_sequences=4 log_every=1 checkpoint_every=2 keep_last=5
        export=false out_dir="$out" "$@")

nodes() {  # nodes RUN_NAME TOTAL_TOKENS [more overrides]: one launch of both nodes; 0 when both exit 0
  local name=$1 total=$2; shift 2
  local pids=() rc=0 t0=$SECONDS port=$((29500 + RANDOM % 1000))
  for node in 0 1; do
    local first=$((node * nproc)) devices
    devices=$(seq -s, "$first" $((first + nproc - 1)))
    CUDA_VISIBLE_DEVICES=$devices timeout "$limit" "$py" -m torch.distributed.run --nnodes=2 \
      --nproc_per_node="$nproc" --node_rank=$node --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:$port \
      --rdzv_id=fox-$name-$total -m fox_train.cli "${common[@]}" strategy=ddp strategy.devices="$nproc" \
      strategy.num_nodes=2 run_name="$name" schedule.total_tokens="$total" "$@" > "$out/$name-$total-node$node.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  echo "nodes $name to $total tokens: exit $rc after $((SECONDS - t0)) s (logs: $out/$name-$total-node*.log)"
  [ $rc -eq 0 ] || { tail -c 1500 "$out/$name-$total-node0.log" | tr '\r' '\n' | tail -12; }
  return $rc
}

t0=$SECONDS
timeout "$limit" "$py" -m fox_train.cli "${common[@]}" strategy=ddp strategy.devices=$world run_name=one-host \
  schedule.total_tokens=$((5 * batch)) > "$out/one-host.log" 2>&1
echo "one host, $world GPUs: exit $? after $((SECONDS - t0)) s (log: $out/one-host.log)"
nodes nodes $((3 * batch)) && nodes nodes $((5 * batch)) resume=true
grep -h "GLOBAL_RANK\|resumed from" "$out"/nodes-*-node*.log | sort -u | head -12

"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def losses(run):
    path = out / run / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["loss"] for r in recs if "loss" in r}
one, nodes = losses("one-host"), losses("nodes")
ckpts = sorted(p.name for p in (out / "nodes" / "checkpoints").glob("step-*")) if (out / "nodes").exists() else []
print(f"{'step':>4s} {'one host':>10s} {'two nodes':>10s}")
for step in sorted(set(one) | set(nodes)):
    print(f"{step:4d} {one.get(step, float('nan')):10.4f} {nodes.get(step, float('nan')):10.4f}")
common = sorted(set(one) & set(nodes))
worst = max((abs(one[s] - nodes[s]) for s in common), default=None)
print(f"checkpoints of the nodes' run: {ckpts}; largest loss difference: {worst}")
(out / "summary.json").write_text(json.dumps(dict(one_host=one, nodes=nodes, checkpoints=ckpts,
                                                  max_abs_loss_difference=worst), indent=1))
PY
