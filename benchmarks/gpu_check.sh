#!/usr/bin/env bash
# The one prepared device check for a lent GPU (an H200), under 8 minutes all told:
#   1. versions (nvidia-smi, torch, triton, transformers)
#   2. python -m pytest -q -m gpu tests          (the GPU-only tests)
#   3. the Triton kernel tests (attention, AWQ, MoE, small ops) and the decode-graph tests, compiled
#      for the device
#   4. python benchmarks/gpu_check.py --out "$OUT" (parity, kernels at real shapes, decode
#      benchmarks, memory: $OUT/gpu_check.json and $OUT/gpu_check.md, which it also prints)
# Each step runs under `timeout` (its cap, or whatever is left of TOTAL_S), its full output goes
# to $OUT/<step>.log, a failed step is recorded and the rest still run; the exit status is
# non-zero if any step failed. gpu_check.py gets what the tests left, as its --budget-s.
#   OUT=bench_out/gpu_check bash benchmarks/gpu_check.sh
# The device machine has no fastapi / pydantic / xgrammar: the server tests (tests/entrypoints,
# none of them marked gpu) are not collected, and steadylm runs from this checkout (PYTHONPATH).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out/gpu_check}
mkdir -p "$OUT"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=$(command -v python || command -v python3)
TOTAL_S=${GPU_CHECK_TOTAL_S:-450}
START=$SECONDS
FAILED=()
SUMMARY=()

left() { echo $((TOTAL_S - (SECONDS - START))); }

step() { # NAME CAP_S COMMAND...: run under timeout, log to $OUT/NAME.log, record the outcome
  local name=$1 cap=$2 rc=0 t0=$SECONDS
  shift 2
  local t
  t=$(left)
  [ "$cap" -lt "$t" ] && t=$cap
  if [ "$t" -lt 15 ]; then
    FAILED+=("$name (no time left)")
    return
  fi
  echo "=== $name (timeout ${t}s) ==="
  timeout -k 10 "$t" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  SUMMARY+=("$name: exit $rc after $((SECONDS - t0))s")
  echo "=== $name: exit $rc after $((SECONDS - t0))s ==="
  [ "$rc" -eq 0 ] || FAILED+=("$name (exit $rc$([ "$rc" -ge 124 ] && echo ', timed out'))")
}

VERSIONS='
import subprocess, sys, torch, transformers
try:
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout)
except (OSError, subprocess.SubprocessError) as exc:
    print(f"nvidia-smi: {exc}")
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "not installed"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {tv}, transformers {transformers.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
'

step versions 60 "$PY" -c "$VERSIONS"
step pytest_gpu 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests \
  --ignore=tests/entrypoints --continue-on-collection-errors
step pytest_kernels 170 "$PY" -m pytest -q -p no:cacheprovider \
  tests/attention/test_triton_attention.py tests/test_triton_awq.py tests/test_triton_moe.py tests/test_triton_ops.py \
  tests/engine/test_decode_graphs.py
# what is left, less a margin for writing the report after a SIGTERM
BUDGET=$(($(left) - 30))
step gpu_check 600 "$PY" benchmarks/gpu_check.py --out "$OUT" --budget-s "$BUDGET"

echo
echo "gpu_check.sh: $((SECONDS - START))s; results in $OUT (gpu_check.json, gpu_check.md, *.log)"
printf '  %s\n' "${SUMMARY[@]}"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED: ${FAILED[*]}"
  exit 1
fi
echo "all steps passed"
