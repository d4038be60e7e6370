"""The small-op Triton kernels (kernels/triton_ops.py: RMSNorm with and without the residual
add, SiLU-and-multiply, rotary in place) against their pure-torch references. Without a GPU
they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1); the engine runs them in
tests/models/test_triton_parity.py."""

from __future__ import annotations

import pytest
import torch

from steadylm import kernels, platform
from steadylm.errors import ConfigError
from steadylm.layers.rotary import RotaryEmbedding, rotate_ref
from tests.conftest import triton_device

DEVICE = triton_device("the Triton kernels")
CUDA = DEVICE.type == "cuda"

from steadylm.kernels import triton_ops  # noqa: E402  (after the interpreter is set)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# fp32: the reductions' order; fp16 / bf16: one ulp of the final rounding either way.
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOL[want.dtype]
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


def rand(*shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 2).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 96, 2048])
def test_rms_norm_matches_the_reference(dtype, n):
    x, w = rand(5, n, dtype=dtype), rand(n, dtype=dtype, seed=1)
    close(triton_ops.rms_norm(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_writes_the_rounded_sum_into_the_residual(dtype):
    x, res, w = rand(7, 80, dtype=dtype), rand(7, 80, dtype=dtype, seed=1), rand(80, dtype=dtype)
    want_sum = x + res  # rounded to the dtype, as HF's residual + hidden_states
    got = triton_ops.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(res, want_sum)  # written in place, bit for bit
    close(got, kernels.rms_norm_ref(want_sum, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_heads(dtype):
    """Qwen3's q / k norm: per head over a view of the fused qkv output."""
    qkv = rand(3, 6, 32, dtype=dtype)
    q = qkv[:, 1:4]  # (T, 3 heads, D), row stride 6 * 32
    w = rand(32, dtype=dtype, seed=2)
    got = triton_ops.rms_norm(q, w, 1e-6)
    assert got.shape == q.shape
    close(got, kernels.rms_norm_ref(q.contiguous(), w, 1e-6))


def test_other_ranks_keep_their_shape_as_the_references_do():
    x, w = rand(2, 3, 4, 32, dtype=torch.float32), rand(32, dtype=torch.float32, seed=1)
    close(triton_ops.rms_norm(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6))
    close(triton_ops.rms_norm(x[0, 0, 0], w, 1e-6), kernels.rms_norm_ref(x[0, 0, 0], w, 1e-6))
    close(
        triton_ops.rms_norm(x[..., ::2], w[:16], 1e-6),
        kernels.rms_norm_ref(x[..., ::2], w[:16], 1e-6),
    )
    y = rand(2, 3, 64, dtype=torch.float32)
    got = triton_ops.silu_and_mul(y)
    assert got.shape == (2, 3, 32)
    close(got, kernels.silu_and_mul_ref(y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [48, 1000, 2816])
def test_silu_and_mul_matches_the_reference(dtype, n):
    x = rand(4, 2 * n, dtype=dtype)
    close(triton_ops.silu_and_mul(x), kernels.silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(6, 16), (48, 128), (3, 80)])
def test_rotary_in_place_on_a_qkv_view_matches_the_reference(dtype, heads, head_dim):
    cfg = type("Cfg", (), {"rope_theta": 10000.0})()
    rope = RotaryEmbedding(cfg, head_dim).to(DEVICE)
    positions = torch.tensor([0, 1, 7, 300, 4095], device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = rand(5, heads + 2, head_dim, dtype=dtype)
    x = qkv[:, :heads]  # strided: the v heads stay where they are
    v_before = qkv[:, heads:].clone()
    want = rotate_ref(x.clone(), cos, sin)
    out = triton_ops.rotary_(x, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    close(qkv[:, :heads], want)
    assert torch.equal(qkv[:, heads:], v_before)


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert triton_ops.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)
    q = torch.empty(0, 2, 16, device=DEVICE)
    assert triton_ops.rotary_(q, q[:, :1], q[:, :1]) is q


def test_the_entry_points_pick_triton_on_cuda_only():
    x = torch.randn(2, 8)
    assert kernels.triton_ops_for(x) is None  # CPU tensors: native kernels or references
    if CUDA:
        assert kernels.triton_ops_for(x.cuda()) is triton_ops


def test_steadylm_cuda_kernels_torch_selects_the_references(monkeypatch):
    monkeypatch.setenv("STEADYLM_CUDA_KERNELS", "torch")
    monkeypatch.delitem(kernels._state, "triton", raising=False)
    assert platform.cuda_kernels() == "torch"
    if CUDA:
        assert kernels.triton_ops_for(torch.randn(2, 8, device="cuda")) is None
    monkeypatch.delitem(kernels._state, "triton", raising=False)  # chosen again after the test
    monkeypatch.setenv("STEADYLM_CUDA_KERNELS", "fast")
    with pytest.raises(ConfigError, match="STEADYLM_CUDA_KERNELS"):
        platform.cuda_kernels()
