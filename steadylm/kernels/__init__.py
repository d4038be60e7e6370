"""Fused CPU kernels for the small ops of a decode step, each beside its pure-torch reference.

A decode step at batch 1 runs ~50 weight matmuls and ~400 small torch ops; in eager torch the
small ops (RMSNorm's five kernels, SiLU-and-multiply, SDPA over a gathered copy of the paged
KV cache) cost 2.1-2.3 ms of a 12 ms step on a 2-vCPU Zen 4 VM, measured with the matmuls
stubbed out, and 1.1-1.2 ms with these kernels. `cpu_ops.cpp` does each in one pass, and
reads the KV cache where it lies (docs/benchmarks.md has the measurements).

The kernels are compiled once per machine and torch version with torch.utils.cpp_extension
(`-O3 -march=native`, cached under torch's extension directory; ~15 s the first time, up to
70 s on 2 vCPUs). The build holds an OS lock, so the lock file of a build killed midway is
cleared by the next start instead of stalling it (`_build_guard`). If that fails (no
compiler, no ninja) the engine logs why and runs the references.
`STEADYLM_CPU_KERNELS=torch` selects the references. CUDA tensors take the Triton kernels of
`triton_ops.py` (one launch per op) where Triton runs, the references otherwise or with
`STEADYLM_CUDA_KERNELS=torch`.

Every entry point takes the same arguments as its reference and falls back to it for inputs
the kernel does not cover (non-contiguous, other dtypes, other devices).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import threading

import torch
import torch.nn.functional as F

from steadylm import platform

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_ops.cpp")
_lock = threading.Lock()
# "ops": the loaded native namespace or None, "error": why not; "triton": triton_ops or None
_state: dict[str, object] = {}


def _build_name() -> str:
    """One build per source (its contents and its path), torch version, torch installation
    and CPU (the code is compiled for this CPU). The installation path and the source's are
    in the build command (include directories, the file compiled): two virtual environments,
    or two checkouts of the same code, sharing one build directory would each see the other's
    command line and rebuild, alternately, on every start."""
    h = hashlib.sha256()
    with open(_SOURCE, "rb") as f:
        h.update(f.read())
    h.update(os.path.realpath(_SOURCE).encode())
    h.update(torch.__version__.encode())
    h.update(os.path.dirname(os.path.realpath(torch.__file__)).encode())
    h.update(platform.cpu_flags_key().encode())
    return "steadylm_cpu_ops_" + h.hexdigest()[:12]


def _build_directory(name: str) -> str:
    """Where torch's cpp_extension builds `name` (its own rule, TORCH_EXTENSIONS_DIR included)."""
    from torch.utils import cpp_extension

    find = getattr(cpp_extension, "_get_build_directory", None)
    if find is not None:
        return find(name, False)
    path = os.path.join(cpp_extension.get_default_build_root(), name)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _build_guard(build_dir: str):
    """Hold an OS lock on the build directory while torch builds or loads there, and clear
    a stale torch lock. torch's own lock is a plain file (`lock`) that a build killed midway
    (Ctrl-C, a timeout, a killed CI job) leaves behind, and every later start then waits on it
    forever. The OS lock dies with its process, and every steadylm builder holds it while it
    holds torch's, so a torch lock seen while holding it belongs to a dead build."""
    with open(os.path.join(build_dir, "steadylm.flock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits only for a live build in another process
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by an interrupted kernel build", stale)
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
        try:
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def native_ops():
    """The compiled `torch.ops.steadylm_cpu` namespace, or None (references run instead)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops, error = None, None
        if platform.cpu_kernels() == "native":
            try:
                from torch.utils.cpp_extension import load

                logger.info("loading steadylm CPU kernels (compiled once per machine)")
                name = _build_name()
                build_dir = _build_directory(name)
                with _build_guard(build_dir):
                    load(
                        name,
                        [_SOURCE],
                        extra_cflags=["-O3", "-march=native", "-fopenmp"],
                        build_directory=build_dir,
                        is_python_module=False,
                        verbose=False,
                    )
                ops = torch.ops.steadylm_cpu
            except Exception as exc:  # no compiler, no ninja, a failed build: run the references
                last = (str(exc).strip().splitlines() or [""])[-1]  # the compiler's verdict
                error = f"{type(exc).__name__}: {last}"
                logger.warning(
                    "steadylm CPU kernels unavailable (%s); running the pure-torch references "
                    "(slower). Set STEADYLM_CPU_KERNELS=torch to skip the build.",
                    error,
                )
        else:
            error = "STEADYLM_CPU_KERNELS=torch"
        _state["error"] = error
        _state["ops"] = ops
        return ops


def status() -> str:
    """'native' or the reason the references run."""
    native_ops()
    return "native" if _state["ops"] is not None else f"torch ({_state['error']})"


def bind_threads(rank: int = 0, ranks: int = 1) -> list[int] | None:
    """Pin the calling thread's OpenMP threads one CPU each (`platform.cpu_threads_bind`),
    the calling thread itself left free: the processes it starts later (tensor-parallel
    workers, a server) inherit its affinity, not one CPU. Run from the thread that runs the
    model's steps (each thread that starts parallel regions has its own team). Returns the
    CPUs, or None where nothing was pinned (`nobind`, shared CPUs, one thread, no native
    kernels)."""
    threads = torch.get_num_threads()
    cpus = platform.cpu_threads_bind(threads, rank, ranks)
    ops = native_ops() if cpus is not None and threads > 1 else None  # no build for nothing
    if ops is None:
        return None
    pinned = ops.bind_omp_threads(cpus, False)
    logger.info("OpenMP threads 1-%d pinned to CPUs %s (%d pinned)", threads - 1, cpus[1:], pinned)
    return cpus if pinned else None


def _native_for(*tensors: torch.Tensor, rows: bool = False):
    """The native ops if every tensor is one they take (checked first: a CUDA tensor never
    triggers the CPU build): contiguous, or with `rows` only unit stride along the last dim."""
    for t in tensors:  # is_cpu / is_cuda: ~5x cheaper than building t.device, per small op
        if not t.is_cpu or t.dtype not in (torch.float32, torch.bfloat16):
            return None
        if not (t.stride(-1) == 1 if rows else t.is_contiguous()):
            return None
    return native_ops()


def _native_rows(x: torch.Tensor):
    """The native ops for x (T, heads, D) with unit stride along D, any other strides (a view
    of the fused qkv output), else None."""
    return _native_for(x, rows=True) if x.dim() == 3 else None


# ---- references ---------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: fp32 math, the weight applied after casting back."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # the same math in one call
    h = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * h.to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale_zero: torch.Tensor | None,
    v_scale_zero: torch.Tensor | None,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    bits: int = 0,
) -> torch.Tensor:
    """Query row t (T, H, D) attends to keys [first, context_lens[t]) of block table row
    token_seq[t] in the paged cache (num_blocks, block_size, Hkv, D), or its uint8 codes and
    scale_zero when bits is 8 or 4 -> (T, H, D). A plain gather-and-SDPA, one row at a time
    (tests only; the reference backend's batched path is in attention/torch_ref.py)."""
    from steadylm.attention.torch_ref import dequantize_kv

    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        n = int(context_lens[t])
        start = max(0, n - window) if window > 0 else 0
        blocks = block_tables[int(token_seq[t]), : -(-n // bs)]
        kv = []
        for data, sz in ((k_cache, k_scale_zero), (v_cache, v_scale_zero)):
            x = data[blocks].flatten(0, 1)[start:n]  # (C, Hkv, D)
            if bits:
                x = dequantize_kv(x, sz[blocks].flatten(0, 1)[start:n], bits)
            kv.append(x.to(q.dtype).transpose(0, 1))
        g = q.shape[1] // hkv
        o = F.scaled_dot_product_attention(q[t].view(hkv, g, -1), *kv, scale=scale)
        out[t] = o.reshape(q.shape[1], -1)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One new token per sequence over an unquantized cache: q (S, H, D) -> (S, H, D)."""
    seqs = torch.arange(q.shape[0])
    return paged_attention_ref(
        q, k_cache, v_cache, None, None, block_tables, seqs, context_lens, scale, window
    )


def triton_ops_for(*tensors: torch.Tensor):
    """steadylm.kernels.triton_ops if every tensor is a CUDA tensor, Triton runs there and
    STEADYLM_CUDA_KERNELS is not `torch` (one kernel per small op of a layer), else None."""
    for t in tensors:
        if not t.is_cuda:
            return None
    if "triton" not in _state:
        _state["triton"] = None
        if platform.cuda_kernels() == "triton" and platform.triton_usable(tensors[0].device):
            from steadylm.kernels import triton_ops

            _state["triton"] = triton_ops
    return _state["triton"]


# ---- entry points -------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    tri = triton_ops_for(x, weight)
    if tri is not None and weight.dtype == x.dtype:
        return tri.rms_norm(x, weight, eps)
    ops = _native_for(x, weight)
    if ops is None or weight.dtype != x.dtype:
        return rms_norm_ref(x, weight, eps)
    return ops.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual). The native kernel updates residual in
    place, as does the Triton one; callers use the returned residual either way."""
    tri = triton_ops_for(x, residual, weight)
    if tri is not None and x.dtype == residual.dtype == weight.dtype and residual.is_contiguous():
        return tri.rms_norm(x, weight, eps, residual), residual
    ops = _native_for(x, residual, weight)
    if ops is None or not (x.dtype == residual.dtype == weight.dtype):
        residual = x + residual
        return rms_norm_ref(residual, weight, eps), residual
    return ops.fused_add_rms_norm(x, residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    tri = triton_ops_for(x)
    if tri is not None:
        return tri.silu_and_mul(x)
    ops = _native_for(x)
    if ops is None:
        return silu_and_mul_ref(x)
    return ops.silu_and_mul(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of (S, V) float32 or bf16 logits: the native op on the CPU (the
    same answer, ties and NaN included; 54 against 224 us for 16 rows of 32,000 on a 2-vCPU
    Zen 4), torch elsewhere. bf16 logits give the answer of their float32 copy."""
    ops = _native_for(x) if x.dim() == 2 and x.shape[1] else None
    return x.argmax(dim=-1) if ops is None else ops.argmax(x)


def native_rotary(x: torch.Tensor):
    """The native in-place rotary op `rotary_(x, cos, sin) -> x` if it takes x (its cos/sin
    layout is the caller's check, `layers.rotary`), else None. Its bits are
    `layers.rotary.rotate_ref`'s: each product and the sum rounded as torch's ops round them."""
    ops = _native_rows(x)
    return None if ops is None else ops.rotary_


def native_store_kv(x: torch.Tensor):
    """The native KV store `store_kv_(cache, scale_zero, x, slots, bits)` for new k or v rows
    x (T, Hkv, D), else None: the caller keeps index_copy_ and `quantize_kv`. Its codes and
    params are the reference's bit for bit."""
    ops = _native_rows(x)
    return None if ops is None else ops.store_kv_


def native_decode_attention(cache_dtype: torch.dtype, device: torch.device):
    """The native paged decode kernel `(q, k_cache, v_cache, block_tables, context_lens, scale,
    window) -> out` for an unquantized cache of this dtype and device, or None: the caller
    keeps its own batched reference (attention/torch_ref.py)."""
    return _native_attention("paged_decode_attention", cache_dtype, device)


def native_paged_attention(dtype: torch.dtype, device: torch.device):
    """The native paged attention kernel `(q, k_cache, v_cache, k_scale_zero, v_scale_zero,
    block_tables, token_seq, context_lens, scale, window, bits) -> out` (prefill and decode
    rows, unquantized or int8 / int4 cache) for a model of this dtype and device, or None: the
    caller keeps its own batched reference (attention/torch_ref.py). Each query row's bits are
    independent of the rest of the batch (cpu_ops.cpp states how)."""
    return _native_attention("paged_attention", dtype, device)


def native_prefill_attention(dtype: torch.dtype, device: torch.device):
    """The native prefill kernel over an unquantized cache `(q, k_cache, v_cache,
    block_tables, token_seq, context_lens, scale, window) -> out` (paged_attention's inputs
    with bits 0; plain dot products in register blocks, for short contexts: each row's
    scores are held whole) for a model of this dtype and device, or None. Each row's bits are
    independent of the rest of the batch, as with paged_attention, but not equal to the
    decode kernel's (cpu_ops.cpp states how)."""
    return _native_attention("prefill_attention", dtype, device)


def _native_attention(name: str, dtype: torch.dtype, device: torch.device):
    """The native attention op `name` for this dtype and device, or None (not the CPU, a
    dtype the kernels do not take, or no native build)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    ops = native_ops()
    return None if ops is None else getattr(ops, name)


def native_decode_layers():
    """The native op running a decode step's Llama decoder layers in one call
    (cpu_ops.cpp `decode_layers`: the same ops as the modules, in their order), or None
    without the native kernels or under `STEADYLM_CPU_DECODE_LAYERS=modules`."""
    if platform.cpu_decode_layers() != "native":
        return None
    ops = native_ops()
    return None if ops is None else ops.decode_layers


# ---- small-batch linear over oneDNN's packed weight ---------------------------------------
LAYOUT32 = 1  # cpu_ops.cpp kLayout32: the low bit of a weight address
AMX = 2  # cpu_ops.cpp kAmx: a 32-column weight whose GEMV runs AMX's tiles (the next bit)


def tag_layout32(address: int) -> int:
    """The address `packed_linear` takes for bf16 weights in 32-column blocks (N / 32, K / 2,
    32, 2), oneDNN's layout where it runs AMX: the buffer's own address (64-byte aligned)
    with its low bit set."""
    if address % 64:
        raise ValueError(f"packed weight at {address:#x} is not 64-byte aligned")
    return address | LAYOUT32


LAYOUT32_MAX_ROWS = 6
UNBOUNDED_ROWS = 2**62  # packed_linear_max_rows: every row count (an int64 for decode_layers)


def packed_linear_max_rows(
    address: int | None = None, k: int | None = None, dtype: torch.dtype | None = None
) -> int:
    """The most rows `packed_linear` takes in place of oneDNN's matmul: where it measured at
    least as fast. Its GEMV's rows (64 with AVX-512, 4 with AVX2: batched decode and short
    prefills), 0 without the native kernels; for a `dtype` of fp32 on an AVX-512 build any
    count (UNBOUNDED_ROWS: past the GEMV's rows its blocked GEMM, see
    `platform.cpu_prefill_gemm`). Other batches stay on oneDNN's matmul.

    For a weight at a tagged address (bf16 in 32-column blocks: oneDNN runs AMX there) with
    k input features: through AMX's tiles (tagged AMX, see `packed_linear_address`), one A
    tile's rows (16); else LAYOUT32_MAX_ROWS, one vector row tile: AMX's matmul costs about
    the same from 1 to 16 rows while the vector GEMV's dot-products grow with them (a decode
    step's 49 bf16 linears, 2 threads of an Intel Xeon with AMX, GEMV / oneDNN: 9.4 /
    12.0-12.6 ms at 1 row, 10.2-10.4 / 12.1-12.3 at 4, 11.4-11.7 / 12.0-12.4 at 6, 12.8-12.9
    / 12.2-12.3 at 8)."""
    ops = native_ops()
    if ops is None:
        return 0
    rows = int(ops.packed_linear_max_rows())
    if (
        dtype == torch.float32
        and rows
        and ops.packed_linear_blocked()
        and platform.cpu_prefill_gemm() == "native"
    ):
        return UNBOUNDED_ROWS
    if address is None or not address & LAYOUT32:
        return rows
    if address & AMX:
        if k is None:
            raise ValueError("packed_linear_max_rows: an AMX-tagged weight needs its k")
        return int(ops.packed_linear_amx_rows(k))
    return min(rows, LAYOUT32_MAX_ROWS)


def _packed_buffer(packed: torch.Tensor, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """The address of an oneDNN (MKLDNN) tensor's buffer and a CPU tensor viewing it as raw
    bits (int32 for fp32, int16 for bf16); the view is valid while `packed` lives."""
    addr = int(torch.ops.mkldnn.data_ptr(packed))
    nbytes = int(torch.ops.mkldnn._nbytes(packed))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    raw = torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=bits)
    return addr, raw


def packed_linear_address(weight: torch.Tensor, packed: torch.Tensor) -> int | None:
    """The address of `packed` (oneDNN's reorder of `weight`, (N, K)) if its buffer holds
    exactly a layout `packed_linear` reads (bf16 in 32-column blocks: tagged, see
    `tag_layout32`), else None (oneDNN's matmul serves every batch).

    oneDNN picks its blocked layout per ISA, shape and version, so it is not assumed: the
    whole buffer is compared bit for bit with the layout built from `weight`, once per layer
    at load time."""
    n, k = weight.shape
    dt = weight.dtype
    if n % 64 or k % 16 or dt not in (torch.float32, torch.bfloat16):
        return None
    ops = _native_for(weight)
    if ops is None:
        return None
    layouts = ops.packed_linear_layouts().split(",")
    if {torch.float32: "f32", torch.bfloat16: "bf16"}[dt] not in layouts:
        return None
    try:
        addr, raw = _packed_buffer(packed, dt)
    except (RuntimeError, AttributeError, ValueError):  # not an MKLDNN tensor, an old torch
        return None
    if raw.numel() != n * k:
        return None
    bits = weight.view(torch.int32 if dt == torch.float32 else torch.int16)
    if dt == torch.float32:  # (N / 64, K, 64)
        expect = bits.view(n // 64, 64, k).transpose(1, 2)
        return addr if torch.equal(raw.view(n // 64, k, 64), expect) else None
    for cols in (64, 32):  # (N / cols, K / 2, cols, 2): 32 where oneDNN runs AMX
        expect = bits.view(n // cols, cols, k // 2, 2).transpose(1, 2)
        if torch.equal(raw.view(n // cols, k // 2, cols, 2), expect):
            if cols == 64:
                return addr
            amx = platform.cpu_amx_gemv() == "on" and ops.packed_linear_amx_rows(k) > 0
            return tag_layout32(addr) | (AMX if amx else 0)
    return None


def packed_rows_reader(packed: torch.Tensor, n: int, k: int, dtype: torch.dtype, address: int):
    """A function ids (T,) -> the rows weight[ids] (T, K) of the (N, K) weight that `packed`
    holds, read back out of its buffer, given the `address` `packed_linear_address` returned
    for it (so the layout is one it verified bit for bit): an embedding tied to an LM head
    shares the head's packed copy instead of keeping the dense one. Keeps `packed` alive."""
    _, raw = _packed_buffer(packed, dtype)
    if dtype == torch.float32:  # (N / 64, K, 64)
        blocks = raw.view(n // 64, k, 64).view(dtype)
        return lambda ids, _keep=packed: blocks[ids // 64, :, ids % 64]
    cols = 32 if address & LAYOUT32 else 64  # (N / cols, K / 2, cols, 2)
    blocks = raw.view(n // cols, k // 2, cols, 2).view(dtype)
    return lambda ids, _keep=packed: blocks[ids // cols, :, ids % cols].reshape(-1, k)


def packed_linear(x: torch.Tensor, address: int, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """y (M, N) = x (M, K) @ W^T (+ bias) for M >= 1 (the caller keeps it to
    `packed_linear_max_rows()`), W at an address `packed_linear_address` returned."""
    return native_ops().packed_linear(x, address, n, bias)


# ---- greedy tokens through an int8 copy of the LM head (cpu_ops.cpp screened_argmax) -------
# The columns whose logits the bound leaves as candidates run the full head's arithmetic
# (16 columns at a time); past this share of the head the screen declines (a flat
# distribution: little to gain).
SCREEN_MAX_BLOCK_SHARE = 2  # a half: past it the full head measured faster
# The most rows (sampling requests) a step screens (a bf16 head: AMX's GEMV's 16 as well,
# its full path above them being oneDNN's). Past it the rows' candidates cover most of the
# head on the bench model (docs/benchmarks.md, twenty-fourth session).
SCREEN_MAX_ROWS = 64


def screen_supported(weight: torch.Tensor, address: int | None) -> bool:
    """Whether a greedy step may take this LM head's tokens from `screened_argmax`: the CPU's
    AMX int8 tiles, a weight packed_linear reads (`address`), K and N multiples of 64, finite
    values, and `STEADYLM_CPU_LM_HEAD_SCREEN` on."""
    if address is None or platform.cpu_lm_head_screen() != "on" or weight.device.type != "cpu":
        return False
    n, k = weight.shape
    if n % 64 or k % 64 or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    ops = _native_for(weight)
    if ops is None or not hasattr(ops, "screened_argmax") or not ops.screened_argmax_available():
        return False
    return bool(torch.isfinite(weight).all())


def screen_bytes(n: int, k: int) -> int:
    """Bytes of the int8 copy `build_screen` makes of an (n, k) LM head."""
    return n * k + n * 3 * 4


def planned_screen_bytes(
    vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, tied: bool, tp: int
) -> int:
    """The bytes the memory plan reserves for an LM head's int8 copy: `screen_bytes` where
    the model will keep one (the conditions of `screen_supported` that are known before
    loading: the CPU, the switch, the shapes, an untied head at tp 1), else 0."""
    if (
        device.type != "cpu"
        or tied
        or tp != 1
        or vocab % 64
        or hidden % 64
        or dtype not in (torch.float32, torch.bfloat16)
        or platform.cpu_lm_head_screen() != "on"
        or platform.cpu_gemm() != "onednn"
        or not platform.cpu_has_amx_int8()
    ):
        return 0
    ops = native_ops()
    if ops is None or not hasattr(ops, "screened_argmax") or not ops.screened_argmax_available():
        return 0
    return screen_bytes(vocab, hidden)


def _round_up_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, never below x."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.tensor(float("inf"))), f)


def build_screen(
    weight: torch.Tensor, rows_per_chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 copy of an (N, K) weight screened_argmax reads: codes q (N / 16, K / 4, 16, 4)
    (per row: round(w / s), s = max|w| / 127, or 1 for a zero row) and stats (3, N) float32:
    s, |w - s q| and |s q| (Euclidean norms in float64, rounded up)."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int8)
    stats = torch.empty(3, n, dtype=torch.float32)
    for lo in range(0, n, rows_per_chunk):
        w = weight[lo : lo + rows_per_chunk].double()
        amax = w.abs().amax(dim=1)
        s = (amax / 127).float()
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(w / s.double()[:, None]).clamp_(-127, 127)
        deq = q * s.double()[:, None]
        stats[0, lo : lo + len(w)] = s
        stats[1, lo : lo + len(w)] = _round_up_f32((w - deq).norm(dim=1))
        stats[2, lo : lo + len(w)] = _round_up_f32(deq.norm(dim=1))
        codes[lo : lo + len(w)] = q.to(torch.int8)
    tiles = codes.view(n // 16, 16, k // 4, 4).transpose(1, 2).contiguous()
    return tiles, stats


def screened_argmax(
    x: torch.Tensor, codes: torch.Tensor, stats: torch.Tensor, address: int
) -> list[int] | None:
    """Each row's argmax of x @ W^T (W the packed weight at `address`): the tokens the full
    logits' argmax gives, bit for bit, or None where the screen declines (run the full head)."""
    max_blocks = max(1, int(stats.shape[1] // 64 / SCREEN_MAX_BLOCK_SHARE))
    out = native_ops().screened_argmax(x.contiguous(), codes, stats, address, max_blocks)
    return None if out.numel() == 0 else out.tolist()
