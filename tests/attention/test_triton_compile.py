"""Every Triton kernel specialisation steadylm launches compiles for an NVIDIA GPU (sm_90, the
H200; sm_89, the RTX 4090), checked on the CPU through Triton's own CUDA compiler
(tests/triton_ptx.py). The interpreter tests check what the kernels compute; this checks that
the compiler accepts them, which the interpreter never does."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _nvidia_backend() -> bool:
    return importlib.util.find_spec("triton") is not None and (
        importlib.util.find_spec("triton.backends.nvidia") is not None
    )


@pytest.mark.skipif(not _nvidia_backend(), reason="triton with its NVIDIA backend is not installed")
@pytest.mark.parametrize("sm", [90, 89])
def test_every_kernel_compiles_for_the_gpu(sm, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, never a cache hit
    proc = subprocess.run(
        [sys.executable, "-m", "tests.triton_ptx", str(sm)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["failures"] == [], "\n".join(report["failures"])
    assert proc.returncode == 0
    # every kernel compiled: store, attention (with and without the split), merge, AWQ, MoE, and
    # the small ops of a decoder layer
    assert set(report["kernels"]) == {
        "_store_kv_kernel",
        "_attention_kernel",
        "_merge_segments_kernel",
        "_awq_gemm_kernel",
        "_moe_gemm_kernel",
        "_moe_awq_gemm_kernel",
        "_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_rotary_kernel",
    }
    # quantization divides with IEEE rounding, as torch's quantize_kv
    assert report["store_divisions"] == ["div.rn.f32"]
