#!/usr/bin/env bash
# Tensor parallelism: W1 and W2 at tp=1 and tp=2, side by side in one session, with the time
# rank 0 spends inside the model's all-reduces per step (allreduce_ms_per_step) and in the
# broadcast of each step's call to the workers (broadcast_ms_per_step).
#
#   bash benchmarks/tp.sh [MODEL_DIR] [TPS...]      e.g. bash benchmarks/tp.sh bench_out/llama-110m 1 2
#
# On CPU, tp=1 runs one process with every core; tp=N runs N ranks with cores/N threads each.
# On a multi-GPU machine the same command runs with --device cuda (set DEVICE=cuda) and NCCL.
# Runs are serialised under one flock, so nothing else benchmarks at the same time.
set -euo pipefail
MODEL=${1:-bench_out/llama-110m}
shift || true
TPS=${*:-1 2}
DEVICE=${DEVICE:-auto}
RUNS=${RUNS:-5}
OUT=${OUT:-bench_out/tp}
mkdir -p "$OUT"
[ -d "$MODEL" ] || python benchmarks/make_bench_model.py "$MODEL"
for w in W1 W2; do
  for tp in $TPS; do
    flock /tmp/steadylm-bench.lock \
      steadylm --log-level WARNING bench offline --model "$MODEL" --workload "$w" --tp "$tp" \
      --device "$DEVICE" --max-total-tokens 65536 --runs "$RUNS" --json "$OUT/${w}_tp${tp}.json"
  done
done
