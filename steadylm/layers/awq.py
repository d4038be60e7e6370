"""AWQ 4-bit weights (W4A16), kept in 4 bits: a Triton GEMM on CUDA, torch's int4 matmul on CPU.

Checkpoint format (AutoAWQ, `version: gemm`), for a linear layer with K inputs, N outputs and
group size g:
  qweight int32 (K, N/8)   eight 4-bit codes per int32, in AutoAWQ's interleaved order: nibble
                           i (bits 4i..4i+3) of packed column c holds output column
                           8c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
  qzeros  int32 (K/g, N/8) the zero points, packed the same way
  scales  fp16  (K/g, N)
  dequantized W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]; y = x @ W
(AutoAWQ's `pack` in awq/modules/linear/gemm.py and the `AWQ_ORDER` / `AWQ_REVERSE_ORDER`
constants of its utils/packing_utils.py.)

What runs where, behind `Int4Kernel` (chosen once per layer at load):
- CUDA, where Triton runs: `kernels/triton_awq.py`, a W4A16 GEMM that reads qweight / qzeros /
  scales in place (no repack) and dots in the activation dtype (fp16 / bf16).
- CUDA without Triton: torch's `_weight_int4pack_mm` on the codes repacked into its tile layout.
- CPU: torch's `_weight_int4pack_mm_for_cpu` (activations in bf16: measured fastest on this CPU,
  see docs/benchmarks.md).
- Anywhere a kernel's shape rules are not met: the pure-torch reference (dequantize, then
  matmul). `AWQLinear.kernel_choice` forces "reference" or "triton" (the tests run the Triton
  kernel on CPU tensors in Triton's interpreter).
torch's kernels take the affine form w = (q - 8) * scale + zero, so zero = (8 - z) * s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steadylm import parallel, platform
from steadylm.errors import ModelLoadError
from steadylm.layers.linear import LinearKernel
from steadylm.layers.shard import Split, check_shape, materialize

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def check_awq_config(quant: dict[str, Any]) -> int:
    """Validate a config.json quantization_config; return the group size."""
    method = str(quant.get("quant_method", "")).lower()
    if method != "awq":
        raise ModelLoadError(
            f"quantization_config.quant_method={method!r} is not supported; "
            "steadylm loads AWQ (quant_method 'awq') checkpoints"
        )
    rules = [
        ("bits", quant.get("bits", quant.get("w_bit")), lambda v: v == 4, "only 4-bit AWQ"),
        (
            "zero_point",
            quant.get("zero_point", True),
            lambda v: v is True,
            "only zero_point: true (asymmetric) AWQ",
        ),
        (
            "version",
            str(quant.get("version", "gemm")).lower(),
            lambda v: v == "gemm",
            "only version 'gemm' packing (re-export gemv checkpoints with AutoAWQ as gemm)",
        ),
        ("desc_act", quant.get("desc_act", False), lambda v: not v, "no act-order"),
    ]
    for name, value, ok, what in rules:
        if not ok(value):
            raise ModelLoadError(
                f"quantization_config.{name}={value!r} is not supported: steadylm loads {what}"
            )
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if group == 0 or group < -1:
        raise ModelLoadError(f"quantization_config.group_size={group} is invalid")
    return group


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 (R, C/8) in AWQ order -> int32 codes (R, C) in natural column order."""
    nibbles = (packed[..., None] >> _SHIFTS.to(packed.device)) & 0xF  # (R, C/8, 8)
    return nibbles[..., list(AWQ_REVERSE_ORDER)].flatten(-2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int codes (R, C) in 0..15 -> int32 (R, C/8) in AWQ order (the inverse of unpack_int4)."""
    grouped = codes.to(torch.int64).view(*codes.shape[:-1], -1, 8)[..., list(AWQ_ORDER)]
    packed = (grouped << _SHIFTS.to(torch.int64).to(codes.device)).sum(-1)
    return packed.to(torch.int32)  # wraps the top nibble into the sign bit, as AutoAWQ does


def quantize_rtn(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest AWQ-format quantization of a dense weight (N, K): the checkpoint format
    without AWQ's activation-aware scale search. -> qweight, qzeros, scales (fp16)."""
    wk = w.t().float()  # (K, N)
    k, n = wk.shape
    g = wk.view(k // group, group, n)
    lo, hi = g.amin(1), g.amax(1)  # (K/g, N)
    scales = ((hi - lo) / 15).clamp_min(1e-6).half()
    s = scales.float()
    zeros = torch.clamp(torch.round(-lo / s), 0, 15)
    q = torch.clamp(torch.round(g / s[:, None]) + zeros[:, None], 0, 15).view(k, n)
    return pack_int4(q.int()), pack_int4(zeros.int()), scales


def dequantize(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """-> dense weight (N, K) in scales.dtype, torch's Linear layout."""
    q = unpack_int4(qweight)  # (K, N)
    z = unpack_int4(qzeros)  # (K/g, N)
    k = q.shape[0]
    w = (q.view(k // group, group, -1) - z[:, None, :]) * scales[:, None, :].float()
    return w.view(k, -1).t().to(scales.dtype).contiguous()


class Int4Kernel(LinearKernel):
    """A repacked weight and its matmul: y (M, N) = x (M, K) @ W^T."""

    name = "base"


class ReferenceInt4Kernel(Int4Kernel):
    """Pure torch: keep the codes in 4 bits, dequantize per call, then a dense matmul."""

    name = "reference"
    owns_weights = False  # it computes from the module's own qweight / qzeros / scales

    def __init__(self, qweight, qzeros, scales, group: int, dtype: torch.dtype) -> None:
        self.qweight, self.qzeros, self.scales, self.group = qweight, qzeros, scales, group
        self.dtype = dtype

    def apply(self, x):
        w = dequantize(self.qweight, self.qzeros, self.scales.float(), self.group).to(x.dtype)
        return F.linear(x, w)


class TorchInt4Kernel(Int4Kernel):
    """torch's tinygemm int4 kernels: `_weight_int4pack_mm_for_cpu` / `_weight_int4pack_mm`."""

    name = "torch-int4"

    def __init__(self, qweight, qzeros, scales, group: int) -> None:
        q = unpack_int4(qweight).t().contiguous()  # (N, K) int32
        z = unpack_int4(qzeros).float()  # (K/g, N)
        s = scales.float()
        self.group = group
        self.act_dtype = torch.bfloat16
        self.cuda = q.is_cuda
        if self.cuda:
            k = q.shape[1]
            tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
            u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            self.weight = torch.ops.aten._convert_weight_to_int4pack(u8, tiles)
        else:
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scale_zero = torch.stack([s, (8 - z) * s], dim=-1).to(self.act_dtype).contiguous()

    @staticmethod
    def supports(n: int, k: int, group: int, device: torch.device) -> bool:
        if group not in (32, 64, 128, 256) or k % group:
            return False
        if device.type == "cuda":
            return n % 8 == 0 and k % 32 == 0
        return n % 16 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

    def apply(self, x):
        xa = x.to(self.act_dtype)
        if self.cuda:
            y = torch.ops.aten._weight_int4pack_mm(xa, self.weight, self.group, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xa, self.weight, self.group, self.scale_zero
            )
        return y.to(x.dtype)


class TritonInt4Kernel(Int4Kernel):
    """`kernels/triton_awq.py`'s GEMM on the checkpoint's own tensors (AutoAWQ's layout is
    what it reads). The scales stay fp16: the kernel widens them to fp32 per K step, where a
    bf16 copy would drop 3 of their bits."""

    name = "triton-awq"

    def __init__(
        self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
    ) -> None:
        self.qweight = qweight.contiguous()  # (K, N/8) int32
        self.qzeros = qzeros.contiguous()  # (K/g, N/8) int32
        self.scales = scales.contiguous()  # (K/g, N) fp16
        self.group = group

    @staticmethod
    def supports(n: int, k: int, group: int, device: torch.device) -> bool:
        """A K step of the kernel (a multiple of 32) stays inside one group."""
        return group % 32 == 0 and k % group == 0 and n % 8 == 0 and platform.triton_usable(device)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        from steadylm.kernels.triton_awq import awq_gemm  # triton imports only where used

        return awq_gemm(x, self.qweight, self.qzeros, self.scales, self.group)


class AWQLinear(nn.Module):
    """A (possibly merged) AWQ linear layer. Loads qweight / qzeros / scales per shard, then
    `process_weights_after_loading` hands them to an `Int4Kernel` (repacked for torch's kernels,
    as they are for Triton's); a kernel that owns its copy lets the module drop its own, so
    the weight is held once, at 4 bits."""

    kernel_choice = "auto"  # "auto", or "reference" / "triton" (tests and debugging)

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        group: int,
        split: Split | None = None,
        reduce_results: bool = True,
    ):
        super().__init__()
        group = in_features if group == -1 else group
        split = split or Split.whole(output_sizes)
        self.split = split
        k = split.inp.size if split.inp is not None else in_features
        if in_features % group:
            raise ModelLoadError(
                f"in_features {in_features} is not a multiple of "
                f"quantization_config.group_size={group}"
            )
        if split.inp is not None and (k % group or split.inp.start % group):
            raise ModelLoadError(
                f"tensor parallelism splits this layer's {in_features} inputs into {k} per rank, "
                f"which cuts an AWQ group of {group}; use a tp that divides "
                f"{in_features // group} groups"
            )
        sizes = [s.size for s in split.out]
        for full, size in zip(output_sizes, sizes):
            if size % 8:
                what = f"{full} outputs split into {size} per rank" if size != full else full
                raise ModelLoadError(f"AWQ needs output sizes divisible by 8; got {what}")
        n = sum(sizes)
        self.in_features, self.out_features, self.group = k, n, group
        self.full_in_features = in_features
        self.output_sizes = sizes
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.reduce = split.inp is not None  # row-parallel: sum partial outputs, then the bias
        self.reduce_results = reduce_results  # False: the caller all-reduces (Linear's flag)
        if bias and self.reduce and not reduce_results:
            raise ValueError("a row-parallel linear with a bias must reduce its results")
        g = k // group
        # (param, output dim, output pack, input dim, input pack)
        self.qweight = self._param(torch.empty(k, n // 8, dtype=torch.int32), 8, 1)
        self.qzeros = self._param(torch.empty(g, n // 8, dtype=torch.int32), 8, group)
        self.scales = self._param(torch.empty(g, n, dtype=torch.float16), 1, group)
        self.bias = self._param(torch.empty(n), 1, None) if bias else None
        self.kernel: Int4Kernel | None = None

    def _param(self, t: torch.Tensor, out_pack: int, in_pack: int | None) -> nn.Parameter:
        """A checkpoint tensor laid out (inputs / in_pack, outputs / out_pack), or a bias
        (outputs) when in_pack is None; its loader takes this rank's part of it."""
        p = nn.Parameter(t, requires_grad=False)
        out_dim = 0 if in_pack is None else 1

        def load(param, loaded, shard_id=None):
            i, cols = self.split.out_shard(shard_id)
            expected = [cols.full // out_pack]
            if in_pack is not None:
                expected.insert(0, self.full_in_features // in_pack)
            check_shape(loaded, expected)
            if in_pack is not None and self.split.inp is not None:
                inp = self.split.inp
                loaded = loaded.narrow(0, inp.start // in_pack, inp.size // in_pack)
            loaded = loaded.narrow(out_dim, cols.start // out_pack, cols.size // out_pack)
            start = self.offsets[i] // out_pack
            param.data.narrow(out_dim, start, cols.size // out_pack).copy_(materialize(loaded))

        p.weight_loader = load
        return p

    def process_weights_after_loading(self) -> None:
        self.kernel = self._pick_kernel(self.qweight.data, self.qzeros.data, self.scales.data)
        if self.kernel.owns_weights:
            del self.qweight, self.qzeros, self.scales  # only the kernel's 4-bit copy stays
            self.qweight = self.qzeros = self.scales = None

    def _pick_kernel(self, qw: torch.Tensor, qz: torch.Tensor, sc: torch.Tensor) -> Int4Kernel:
        """auto: Triton on CUDA where it runs, else torch's int4 kernel, else the reference."""
        n, k, group, device = self.out_features, self.in_features, self.group, qw.device
        choice = self.kernel_choice
        if choice == "triton" and not TritonInt4Kernel.supports(n, k, group, device):
            raise ValueError(
                f"AWQLinear.kernel_choice='triton' cannot run on {device.type} for K={k}, "
                f"N={n}, group {group}: it needs Triton (CUDA, or TRITON_INTERPRET=1 on the "
                "CPU) and a group that is a multiple of 32"
            )
        if choice == "triton" or (
            choice == "auto"
            and device.type == "cuda"
            and TritonInt4Kernel.supports(n, k, group, device)
        ):
            return TritonInt4Kernel(qw, qz, sc, group)
        if choice == "auto" and TorchInt4Kernel.supports(n, k, group, device):
            return TorchInt4Kernel(qw, qz, sc, group)
        return ReferenceInt4Kernel(qw, qz, sc, group, sc.dtype)

    def weight_bytes(self) -> int:
        b = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.kernel.num_bytes() + b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.apply(x)
        if self.reduce and self.reduce_results:
            y = parallel.all_reduce(y)
        return y + self.bias if self.bias is not None else y
