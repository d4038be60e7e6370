"""Linear layers. Each parameter carries a `weight_loader(param, tensor, shard_id)`.

Merged layers (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) take one matmul where the
checkpoint has several; their loader copies each checkpoint shard into its row range.

After loading, a dense layer on the CPU hands its weight to a `LinearKernel`: oneDNN's matmul on
a weight prepacked once into oneDNN's blocked layout (what vLLM's CPU backend does too), which
measured 2-4x faster than `F.linear` (MKL) for fp32 on an AMD Zen 4 CPU at every batch size, and
faster for bf16 too. Up to 64 rows (decode batches, short prefills; 4 on AVX2-only CPUs) the
same packed buffer is read in place by `kernels.packed_linear`, a GEMV that streamed the
weights at 0.86-0.93 of a plain memory read's rate where oneDNN's matmul reached 0.75-0.81 on
AVX-512, and 0.78 against 0.65 on an AVX2-only CPU (fp32), and at 8-64 rows ran 1.3-1.6x (8-16
rows) to 1.04-1.09x (64) oneDNN's matmul (docs/benchmarks.md); one copy stays. Above 64
rows fp32 weights stay on the same kernel on AVX-512 CPUs (its GEMV up to 256 rows, a blocked
GEMM above: the same FMAs in the same order, so a row's bits never depend on the batch;
`STEADYLM_CPU_PREFILL_GEMM=onednn` keeps oneDNN's matmul there). `STEADYLM_CPU_GEMM=torch`
keeps plain `F.linear` (the reference).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from steadylm import kernels, parallel, platform
from steadylm.layers.shard import Split, check_shape, copy_rows, materialize

logger = logging.getLogger(__name__)


def default_weight_loader(param: nn.Parameter, loaded, shard_id: object = None) -> None:
    """A parameter every rank holds whole (norms)."""
    check_shape(loaded, param.shape)
    param.data.copy_(materialize(loaded))


class LinearKernel:
    """A linear layer's weight after loading, in the layout its matmul wants:
    y (..., N) = x (..., K) @ W^T (+ b). Dense (below) and int4 (layers/awq.py) kernels."""

    name = "base"
    owns_weights = True  # its tensors replace the module's parameters (count them once)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the kernel holds (its packed weights, scales, bias)."""
        return [t for t in vars(self).values() if isinstance(t, torch.Tensor)]

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class OneDNNDenseKernel(LinearKernel):
    """oneDNN matmul on a weight reordered once into its blocked layout (CPU, fp32 / bf16)."""

    name = "onednn"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        # Where packed_linear can read self.weight in place (None: oneDNN only), and for up
        # to how many rows (its GEMV; fp32 on AVX-512: every count, see packed_linear_max_rows).
        self.gemv_address = kernels.packed_linear_address(weight, self.weight)
        self.gemv_max_rows = (
            0
            if self.gemv_address is None
            else kernels.packed_linear_max_rows(self.gemv_address, self.in_features, weight.dtype)
        )

    @classmethod
    def tied(cls, weight: torch.Tensor) -> tuple[OneDNNDenseKernel, object] | None:
        """An LM head tied to the embedding, on the CPU: its packed kernel and a reader of the
        embedding's rows out of the same buffer (`kernels.packed_rows_reader`), so one copy
        serves both. None where the packed layout cannot be read back (the dense weight stays
        and the head runs F.linear, 2-3x slower at 1-16 rows)."""
        if not cls.supports(weight):
            return None
        try:
            kernel = cls(weight, None)
        except RuntimeError:
            return None
        if kernel.gemv_address is None:
            return None
        n, k = weight.shape
        return kernel, kernels.packed_rows_reader(
            kernel.weight, n, k, weight.dtype, kernel.gemv_address
        )

    def add_screen(self, weight: torch.Tensor) -> bool:
        """Keep an int8 copy of the weight for `greedy_tokens` (an LM head's; see
        kernels.build_screen) where the CPU and the layout take it; returns whether it did."""
        if self.bias is not None or not kernels.screen_supported(weight, self.gemv_address):
            return False
        self.screen_codes, self.screen_stats = kernels.build_screen(weight)
        return True

    def greedy_tokens(self, x: torch.Tensor) -> list[int] | None:
        """Each row's argmax of `apply(x)`, the same tokens, through the int8 copy
        (kernels.screened_argmax); None without one, where the full logits are not
        packed_linear's (more rows than it takes), or where the screen declines."""
        codes = getattr(self, "screen_codes", None)
        rows = x.shape[0]
        if codes is None or x.dim() != 2:
            return None
        if not 0 < rows <= min(self.gemv_max_rows, kernels.SCREEN_MAX_ROWS):
            return None
        return kernels.screened_argmax(x, codes, self.screen_stats, self.gemv_address)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and (
                weight.dtype == torch.float32
                or (weight.dtype == torch.bfloat16 and platform.cpu_onednn_bf16())
            )
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and platform.cpu_gemm() == "onednn"
        )

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        rows = x2.shape[0]
        if 0 < rows <= self.gemv_max_rows:
            y = kernels.packed_linear(x2, self.gemv_address, self.out_features, self.bias)
        else:
            padded = row_bucket(rows)
            if padded != rows:  # (padded, K): zero rows, sliced off the result below
                x2 = F.pad(x2, (0, 0, 0, padded - rows))
            y = torch.ops.mkldnn._linear_pointwise(x2, self.weight, self.bias, "none", [], "")
            y = y[:rows]
        return y.view(*shape, self.out_features)


def row_bucket(rows: int) -> int:
    """The row count oneDNN's matmul runs for `rows` input rows: exact up to 16, then rounded
    up to one of 8 steps per power of two (at most 12.5% padding rows).

    oneDNN JIT-compiles and caches one primitive per distinct shape (its primitive cache and
    ideep's, 1024 entries each by default). A step's token count takes any value up to
    max_prefill_token_num, so without buckets every new count built new primitives (~4 ms
    each) and the caches filled with them: on the 2-vCPU VM the server's RSS grew by ~500 MB
    over the first minutes of a mixed load (docs/benchmarks.md, soak). With buckets a weight
    shape has at most 8 per power of two (88 row counts from 1 to 8192)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


class Linear(nn.Module):
    """y = x W^T + b, with W stored as (out_features, in_features) like torch and HF.

    `split` says which part of the checkpoint's weight this rank holds (`layers/shard.py`):
    the whole of it (default), rows of each output shard (column-parallel), or input columns
    (row-parallel: the partial outputs are summed over the ranks, then the bias added once).
    `in_features` / `out_features` are this rank's sizes."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        split: Split | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self._build(in_features, split or Split.whole([out_features]), bias, reduce_results)

    def _build(self, in_features: int, split: Split, bias: bool, reduce_results=True) -> None:
        self.split = split
        self.in_features = split.inp.size if split.inp is not None else in_features
        self.full_in_features = in_features
        self.out_features = split.out_features
        self.output_sizes = [s.size for s in split.out]
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        self.reduce = split.inp is not None  # row-parallel: sum the partial outputs
        # vLLM's RowParallelLinear(reduce_results=False): return this rank's partial sum, the
        # caller all-reduces it with others (a MoE block's experts and shared expert: once).
        self.reduce_results = reduce_results
        if bias and self.reduce and not reduce_results:
            raise ValueError("a row-parallel linear with a bias must reduce its results")
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features), requires_grad=False
        )
        self.weight.weight_loader = self._load
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
            self.bias.weight_loader = self._load
        self.kernel: LinearKernel | None = None
        # Tied to the embedding, or a view of a MoE block's stacked experts: keep the dense
        # parameter (no kernel of its own).
        self.shared_weight = False
        # An LM head: also keep an int8 copy for greedy steps (OneDNNDenseKernel.add_screen).
        self.greedy_screen = False

    def _load(self, param: nn.Parameter, loaded, shard_id: object = None) -> None:
        """Copy this rank's part of checkpoint tensor `loaded` (output shard `shard_id` of a
        merged layer) into `param`, reading nothing else."""
        i, rows = self.split.out_shard(shard_id)
        check_shape(loaded, (rows.full, self.full_in_features)[: param.dim()])
        if param.dim() == 2 and self.split.inp is not None:
            loaded = loaded.narrow(1, self.split.inp.start, self.split.inp.size)
        copy_rows(param.data.narrow(0, self.offsets[i], rows.size), loaded, rows)

    def process_weights_after_loading(self) -> None:
        if self.shared_weight or not OneDNNDenseKernel.supports(self.weight):
            return
        fused_bias = self.bias.data if self.bias is not None and not self.reduce else None
        try:
            kernel = OneDNNDenseKernel(self.weight.data, fused_bias)
        except RuntimeError as exc:  # an old or unusual oneDNN build: keep F.linear
            logger.warning("oneDNN linear unavailable (%s); using F.linear", exc)
            return
        if self.greedy_screen and not self.reduce:
            kernel.add_screen(self.weight.data)
        self.kernel = kernel
        del self.weight  # only the packed copy stays
        self.weight = None
        if fused_bias is not None:
            del self.bias
            self.bias = None

    def greedy_tokens(self, x: torch.Tensor) -> list[int] | None:
        """Each row's argmax of forward(x) (x (S, K)) without the full logits where the kernel
        keeps an int8 copy of the weight, else None: compute the logits."""
        if self.kernel is None or self.reduce or not hasattr(self.kernel, "greedy_tokens"):
            return None
        return self.kernel.greedy_tokens(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            if self.kernel is not None:
                return self.kernel.apply(x)
            return F.linear(x, self.weight, self.bias)
        y = self.kernel.apply(x) if self.kernel is not None else F.linear(x, self.weight)
        if not self.reduce_results:
            return y
        y = parallel.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (q/k/v into
    `qkv_proj`, gate/up into `gate_up_proj`): one matmul where the checkpoint has several."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        split: Split | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self._build(in_features, split or Split.whole(output_sizes), bias)


def make_linear(
    cfg,
    in_features: int,
    output_sizes: list[int],
    bias: bool,
    names: list[str],
    split: Split | None = None,
    reduce_results: bool = True,
) -> nn.Module:
    """The linear layer for checkpoint modules `names` (their full dotted names): AWQ when the
    checkpoint is AWQ-quantized and none of them is in modules_to_not_convert, else dense.
    `split`: this rank's part (default: the whole layer); `reduce_results=False`: a
    row-parallel layer returns its partial sums (the caller all-reduces)."""
    split = split or Split.whole(output_sizes)
    quant = cfg.quantization
    if quant:
        from steadylm.layers.awq import AWQLinear, check_awq_config

        group = check_awq_config(quant)
        skip = quant.get("modules_to_not_convert") or []
        if not any(s in n for s in skip for n in names):
            return AWQLinear(in_features, output_sizes, bias, group, split, reduce_results)
    if len(output_sizes) == 1:
        return Linear(in_features, output_sizes[0], bias, split, reduce_results)
    return MergedLinear(in_features, output_sizes, bias, split)
