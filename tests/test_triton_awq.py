"""The Triton W4A16 GEMM (kernels/triton_awq.py) against the pure-torch reference: dequantize
in fp32, then matmul. Without a GPU it runs in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), on small shapes; the `gpu` test takes a real layer's shape."""

from __future__ import annotations

import pytest
import torch

from steadylm.layers.awq import AWQLinear, dequantize, pack_int4
from steadylm.memory import linear_bytes
from tests.conftest import triton_device

DEVICE = triton_device("the Triton AWQ GEMM")
CUDA = DEVICE.type == "cuda"

from steadylm.kernels.triton_awq import awq_gemm  # noqa: E402  (after the interpreter is set)

# The interpreter's bf16 tl.dot is wrong (a numpy limitation), so bf16 runs on CUDA only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# Error bound relative to the largest output: fp32 is the reference's own arithmetic; fp16 and
# bf16 round the weight and the output once each (2^-11, 2^-8), with fp32 accumulation.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def random_awq(k: int, n: int, group: int, seed: int = 0):
    """Codes and zero points spread over all 16 values (the top nibble sets the int32's sign
    bit) and positive fp16 scales -> qweight, qzeros, scales on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.int32)
    s = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.002).half()
    return [t.to(DEVICE) for t in (pack_int4(q), pack_int4(z), s)]


def check(x: torch.Tensor, qw, qz, s, group: int, **kw) -> None:
    y = awq_gemm(x, qw, qz, s, group, **kw)
    w = dequantize(qw, qz, s.float(), group)  # (N, K) fp32
    ref = x.float() @ w.t()
    assert y.shape == ref.shape and y.dtype == x.dtype
    err = (y.float() - ref).abs().max() / ref.abs().max()
    assert err < TOL[x.dtype], float(err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("k,n", [(128, 64), (256, 72), (384, 200)])
@pytest.mark.parametrize("m", [1, 3, 17, 40])
def test_matches_reference(m, k, n, group, dtype):
    """N = 72 and 200 end inside a column block (64); M 17 and 40 inside a row block."""
    qw, qz, s = random_awq(k, n, group, seed=m + k + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    check(x, qw, qz, s, group)


@pytest.mark.parametrize("split_k", [2, 5])
def test_split_k_partial_sums(split_k):
    """12 K steps of 32 over 2 programs, or 5 asked (3 steps each: 4 programs)."""
    qw, qz, s = random_awq(384, 72, 32)
    x = torch.randn(3, 384).to(DEVICE)
    check(x, qw, qz, s, 32, split_k=split_k)


def test_prefill_block_and_row_edge():
    """130 rows: the large-M blocks (128 x 128), a second row block holding 2 rows."""
    qw, qz, s = random_awq(256, 136, 64)
    x = torch.randn(130, 256).to(DEVICE, torch.float16)
    check(x, qw, qz, s, 64)


def test_leading_shape_and_strided_input():
    qw, qz, s = random_awq(128, 64, 64)
    rows = torch.randn(2, 5, 256).to(DEVICE)
    check(rows[..., :128], qw, qz, s, 64)  # rows 256 apart: read in place
    check(rows[..., ::2], qw, qz, s, 64)  # K not unit-strided: copied first
    assert awq_gemm(rows[:0, :, :128], qw, qz, s, 64).shape == (0, 5, 64)


def awq_linear(choice: str, group: int = 64) -> AWQLinear:
    """A merged layer (outputs 64 + 80, a bias) loaded through its weight loaders."""
    sizes, k = [64, 80], 256
    layer = AWQLinear(k, sizes, bias=True, group=group).to(DEVICE)
    layer.kernel_choice = choice
    for i, n in enumerate(sizes):
        qw, qz, s = random_awq(k, n, group, seed=i)
        for param, t in ((layer.qweight, qw), (layer.qzeros, qz), (layer.scales, s)):
            param.weight_loader(param, t, i)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(i))
        layer.bias.weight_loader(layer.bias, bias, i)
    layer.process_weights_after_loading()
    return layer


def test_awq_linear_triton_matches_reference():
    ref, tri = awq_linear("reference"), awq_linear("triton")
    assert (ref.kernel.name, tri.kernel.name) == ("reference", "triton-awq")
    x = torch.randn(2, 7, 256).to(DEVICE)
    y_ref, y = ref(x), tri(x)
    err = (y - y_ref).abs().max() / y_ref.abs().max()
    assert err < 1e-5, float(err)
    # The kernel holds the checkpoint's tensors and the module drops its own: counted once.
    assert tri.qweight is None and tri.kernel.owns_weights
    assert tri.weight_bytes() == ref.weight_bytes() == linear_bytes(256, 144, 4, 64) + 144 * 4


def test_auto_keeps_torch_int4_on_cpu():
    if CUDA:
        pytest.skip("checks the CPU's choice")
    assert awq_linear("auto").kernel.name == "torch-int4"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 64])
def test_real_shape_on_gpu(m, dtype):
    """A 5120 -> 1024 layer, group 128, at decode (split K) and prefill sizes; no host sync."""
    qw, qz, s = random_awq(5120, 1024, 128)
    x = torch.randn(m, 5120, device=DEVICE, dtype=dtype)
    awq_gemm(x, qw, qz, s, 128)  # compile outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        awq_gemm(x, qw, qz, s, 128)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(x, qw, qz, s, 128)
    assert awq_linear("auto").kernel.name == "triton-awq"
