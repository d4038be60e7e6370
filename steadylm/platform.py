"""Device facts in one place: which device, which dtype, how much memory, and the CPU
process settings that decide speed there. Environment variables are read here and only here:

- `STEADYLM_CPU_GEMM`: `onednn` (default) or `torch`, the dense matmul on the CPU.
- `STEADYLM_CPU_MALLOC`: `tuned` (default) or `default`, see `tune_cpu_allocator`.
- `STEADYLM_CPU_KERNELS`: `native` (default) or `torch`, the fused CPU kernels (steadylm/kernels).
- `STEADYLM_CPU_AMX_GEMV`: `on` (default) or `off`, see `cpu_amx_gemv`.
- `STEADYLM_CPU_LM_HEAD_SCREEN`: `on` (default) or `off`, see `cpu_lm_head_screen`.
- `STEADYLM_CPU_HUGEPAGES`: `on` (default), `collapse` or `off`, see `advise_huge_pages`,
  `collapse_huge_pages` and `torch_huge_pages` (read once more where `import steadylm` runs:
  steadylm/__init__.py).
- `STEADYLM_CPU_OMP_THREADS_BIND`: `nobind` (default), `auto` or a CPU list, see
  `cpu_threads_bind`.
- `STEADYLM_CPU_PREFILL_GEMM`: `native` (default) or `onednn`, see `cpu_prefill_gemm`.
- `STEADYLM_CPU_DECODE_LAYERS`: `native` (default) or `modules`: a decode step's decoder
  layers in one native call (`kernels.decode_layers`), or module by module.
- `STEADYLM_CUDA_KERNELS`: `triton` (default) or `torch`, the small-op kernels on CUDA
  (steadylm/kernels/triton_ops.py: RMSNorm, SiLU-and-multiply, rotary).
- `STEADYLM_ATTENTION_BACKEND`: `auto` (default: Triton on CUDA where triton imports, else the
  torch reference), `torch` or `triton` (vLLM users know it as `VLLM_ATTENTION_BACKEND`).
- `STEADYLM_CACHE_DIR` (default `$XDG_CACHE_HOME/steadylm`, else `~/.cache/steadylm`): what
  steadylm derives once per file and reuses, such as a GGUF file's converted tokenizer and
  config (steadylm/gguf_file.py); see `cache_dir`.
- `TRITON_INTERPRET=1` (Triton's own): Triton kernels run on CPU tensors in Triton's
  interpreter; the tests use it to check every kernel against its torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Iterable

import torch

from steadylm.config import ModelConfig, parse_dtype
from steadylm.errors import ConfigError
from steadylm.memory import DeviceMemory

logger = logging.getLogger(__name__)
_allocator_tuned = False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={name!r} but CUDA is not available; use device='cpu'", param="device"
        )
    return dev


def resolve_dtype(name: str, mc: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype on CUDA. On CPU it is bfloat16 for a bfloat16
    checkpoint when the CPU has native bf16 instructions (AVX512-BF16 or AMX), where oneDNN's
    bf16 matmuls measured 1.9-4x faster than fp32, and float32 otherwise (an fp32 checkpoint,
    or a CPU that would emulate bf16, as AVX2 ones do)."""
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        if mc.torch_dtype == "bfloat16" and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    dtype = parse_dtype(mc.torch_dtype if mc.torch_dtype in ("float16", "bfloat16") else "bfloat16")
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16
    return dtype


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where there is none), read
    once: the attention backend asks on every step."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_onednn_bf16() -> bool:
    """Whether oneDNN can prepack bf16 weights here: it needs AVX512 BW/VL/DQ or
    AVX-NE-CONVERT (an AVX2-only CPU raises in mkldnn_reorder_linear_weight)."""
    flags = _cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def cpu_has_native_bf16() -> bool:
    """Whether /proc/cpuinfo lists avx512_bf16 or amx_bf16 (x86; False elsewhere)."""
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_amx_bf16() -> bool:
    """Whether /proc/cpuinfo lists amx_bf16 (Intel Xeon 4th generation on): oneDNN runs bf16
    matmuls on AMX tiles there."""
    return "amx_bf16" in _cpu_flags()


def cpu_flags_key() -> str:
    """Identifies the CPU's instruction set, for code compiled with -march=native."""
    import platform as _py_platform

    return _py_platform.machine() + ":" + " ".join(sorted(_cpu_flags()))


def device_memory(device: torch.device) -> DeviceMemory:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(torch.cuda.get_device_name(device), total, free)
    total, avail = _meminfo()
    return DeviceMemory("cpu", total, avail)


def _meminfo() -> tuple[int, int]:
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except OSError:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages
    return info["MemTotal"], info.get("MemAvailable", info["MemFree"])


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _choice(var: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(var, allowed[0])
    if value not in allowed:
        raise ConfigError(f"{var}={value!r} is not one of {', '.join(allowed)}", param=var)
    return value


def cpu_gemm() -> str:
    """'onednn': dense CPU linears run oneDNN on weights prepacked at load; 'torch': F.linear."""
    return _choice("STEADYLM_CPU_GEMM", ("onednn", "torch"))


def cpu_prefill_gemm() -> str:
    """`STEADYLM_CPU_PREFILL_GEMM`: `native` (default) or `onednn`, what runs fp32 linears of
    more than 64 rows (prefills, large decode batches) on AVX-512 CPUs: steadylm's kernel over
    the packed weight (`kernels.packed_linear`: its GEMV up to 256 rows, a blocked GEMM
    above), or oneDNN's matmul."""
    return _choice("STEADYLM_CPU_PREFILL_GEMM", ("native", "onednn"))


def cpu_allreduce() -> str:
    """'shm': tp ranks on one CPU machine all-reduce through shared memory; 'gloo': always gloo."""
    return _choice("STEADYLM_CPU_ALLREDUCE", ("shm", "gloo"))


def cpu_amx_gemv() -> str:
    """`STEADYLM_CPU_AMX_GEMV`: `on` (default) or `off`, whether bf16 linears of 1-16 rows
    in AMX's weight layout run the native GEMV on AMX's tiles (else its vector row tiles up
    to 6 rows, oneDNN's matmul above)."""
    return _choice("STEADYLM_CPU_AMX_GEMV", ("on", "off"))


def cpu_lm_head_screen() -> str:
    """`STEADYLM_CPU_LM_HEAD_SCREEN`: `on` (default) or `off`, whether a greedy step's tokens
    come through the int8 copy of the LM head, checked exactly (kernels.screened_argmax), on
    CPUs with AMX's int8 tiles; `off` computes every logit (and keeps no copy)."""
    return _choice("STEADYLM_CPU_LM_HEAD_SCREEN", ("on", "off"))


def cpu_has_amx_int8() -> bool:
    """Whether /proc/cpuinfo lists amx_int8 (and amx_tile)."""
    return {"amx_int8", "amx_tile"} <= _cpu_flags()


def _cpu_list(text: str) -> list[int]:
    """CPUs written as `taskset -c` and vLLM write them: `0-3,8,10-11`."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(part)
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def cpu_threads_bind(threads: int, rank: int = 0, ranks: int = 1) -> list[int] | None:
    """`STEADYLM_CPU_OMP_THREADS_BIND` (vLLM's `VLLM_CPU_OMP_THREADS_BIND`): the CPUs whose
    i-th takes the i-th of a rank's `threads` OpenMP threads (`kernels.bind_threads`), or None
    to leave them to the OS.

    - `nobind` (default): None. Pinned or not, W1's steps measured level on 2 vCPUs of an
      Intel Xeon (docs/benchmarks.md, twenty-first session), and two engines that each
      pinned themselves on one machine would share CPUs the OS could have spread them over.
    - `auto`: the CPUs this process may run on, one per thread, when there are exactly as
      many as its ranks' threads (rank r takes the r-th run of `threads`); else None.
    - a CPU list, `0-3` or `0,2,4,6`, with one list per local rank after `|` (`0-1|2-3`): to
      keep an engine off the CPUs of another, or its tensor-parallel ranks off each other's.
    """
    value = os.environ.get("STEADYLM_CPU_OMP_THREADS_BIND", "nobind").strip()
    if value == "nobind" or not hasattr(os, "sched_getaffinity"):
        return None
    if value == "auto":
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) != threads * ranks:
            return None
        return allowed[rank * threads : (rank + 1) * threads]
    parts = value.split("|")
    try:
        cpus = _cpu_list(parts[rank]) if len(parts) == ranks else None
    except ValueError as exc:
        raise ConfigError(
            f"STEADYLM_CPU_OMP_THREADS_BIND={value!r}: {str(exc)!r} is not a CPU or a range "
            "of CPUs (auto, nobind, or a list such as 0-3 or 0,2,4,6)",
            param="STEADYLM_CPU_OMP_THREADS_BIND",
        ) from None
    if cpus is None or len(cpus) < threads or len(set(cpus)) != len(cpus):
        raise ConfigError(
            f"STEADYLM_CPU_OMP_THREADS_BIND={value!r} needs one list of {threads} distinct "
            f"CPUs or more for each of the {ranks} local rank(s), separated by '|'",
            param="STEADYLM_CPU_OMP_THREADS_BIND",
        )
    return cpus[:threads]


def cpu_kernels() -> str:
    """'native': steadylm's fused CPU kernels (built once per machine); 'torch': references."""
    return _choice("STEADYLM_CPU_KERNELS", ("native", "torch"))


def cpu_decode_layers() -> str:
    """'native': a CPU decode step runs its decoder layers in one native call where the model
    takes it (models/llama.py); 'modules': layer by layer through the modules."""
    return _choice("STEADYLM_CPU_DECODE_LAYERS", ("native", "modules"))


def cuda_kernels() -> str:
    """'triton': the small ops of a layer run as steadylm's Triton kernels on CUDA; 'torch':
    their references."""
    return _choice("STEADYLM_CUDA_KERNELS", ("triton", "torch"))


def triton_interpreted() -> bool:
    """Whether Triton kernels run in Triton's interpreter (on CPU tensors). Triton reads the
    variable when a kernel is defined, so it must be set before steadylm's kernels import."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(device: torch.device) -> bool:
    """Whether steadylm's Triton kernels can run on `device`: compiled on CUDA, or interpreted
    on the CPU under TRITON_INTERPRET=1."""
    if device.type not in ("cuda", "cpu") or (device.type == "cpu" and not triton_interpreted()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attention_backend(device: torch.device) -> str:
    """The attention backend for `device`: `STEADYLM_ATTENTION_BACKEND` (auto / torch /
    triton); auto is Triton on CUDA where it can run, the torch reference otherwise."""
    choice = _choice("STEADYLM_ATTENTION_BACKEND", ("auto", "torch", "triton"))
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if choice == "triton" and not triton_usable(device):
        raise ConfigError(
            f"STEADYLM_ATTENTION_BACKEND=triton cannot run on {device.type}: Triton kernels "
            "need a CUDA device (or TRITON_INTERPRET=1 on the CPU, for tests)",
            param="STEADYLM_ATTENTION_BACKEND",
        )
    return choice


_HUGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
_MADV_HUGEPAGE = 14  # from Linux's mman-common.h
_MADV_COLLAPSE = 25  # Linux 6.1 and later
_HUGEPAGES = ("on", "collapse", "off")


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """A CPU tensor's buffer: (address, bytes), oneDNN's packed weights included."""
    if t.is_mkldnn:
        return int(torch.ops.mkldnn.data_ptr(t)), int(torch.ops.mkldnn._nbytes(t))
    return t.data_ptr(), t.numel() * t.element_size()


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask Linux to back a large, long-lived CPU buffer (the KV cache, the weights) with
    transparent huge pages: the whole 2 MiB pages inside it (MADV_HUGEPAGE; the system's THP
    mode is usually `madvise`, which does nothing without it). Every decode step streams these
    buffers, and the hardware prefetchers stop at each 4 KiB page: one core read 23-28 GB/s in
    4 KiB pages and ~33 in 2 MiB ones on a Zen 4 VM (docs/benchmarks.md). Pages not yet
    touched (the KV cache) fault in as huge pages; written ones (the weights) are merged by the
    kernel's khugepaged in the background, or collapsed at load (`collapse_huge_pages`).
    Returns the bytes advised: 0 when off (`STEADYLM_CPU_HUGEPAGES=off`), not a CPU tensor,
    under 2 MiB, or refused (no THP)."""
    if cpu_huge_pages() == "off" or t.device.type != "cpu":
        return 0
    addr, nbytes = _extent(t)
    start, end = -(-addr // _HUGE) * _HUGE, (addr + nbytes) // _HUGE * _HUGE
    if end <= start:
        return 0
    libc = _libc()
    if libc is None:
        return 0
    return end - start if libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0 else 0


def cpu_huge_pages() -> str:
    """`STEADYLM_CPU_HUGEPAGES`: `on`, `collapse` or `off` (`collapse_huge_pages`)."""
    return _choice("STEADYLM_CPU_HUGEPAGES", _HUGEPAGES)


def collapse_huge_pages(tensors: Iterable[torch.Tensor], min_bytes: int = 64 << 10) -> int:
    """Huge pages for the weights at load. `STEADYLM_CPU_HUGEPAGES=on` (the default) advises
    the whole 2 MiB pages inside each tensor (`advise_huge_pages`); torch's flag
    (`torch_huge_pages`) has already given most of them huge pages as oneDNN packed them, but
    not a buffer's ends, nor a bf16 qkv or o_proj of the bench model (1.97 and 1.18 MB, no
    whole 2 MiB page inside): 145-168 of its 249 MB of bf16 weights sat in huge pages.
    `collapse` also rounds every CPU tensor of `min_bytes` or more out to whole 2 MiB pages,
    merges them with their neighbours, and collapses them now (MADV_COLLAPSE, Linux 6.1+;
    where the kernel cannot, the advice alone stands): all of those weights but one edge
    page, in 0.1-0.3 s and ~2 MiB more resident memory. Not the default: W1's steps measured
    level with it over three sets of alternating processes (bf16 ahead in 4 of 6 pairs, then
    behind in 6 of 6 in a slow period, then level; fp32 level; docs/benchmarks.md,
    twenty-first session). `off` does nothing. Returns the bytes advised (`on`) or collapsed
    (`collapse`)."""
    choice = cpu_huge_pages()
    tensors = [t for t in tensors if t.device.type == "cpu"]
    if choice == "off" or not tensors:
        return 0
    if choice == "on":
        return sum(advise_huge_pages(t) for t in tensors)
    libc = _libc()
    if libc is None:
        return 0
    spans = []
    for t in tensors:
        addr, nbytes = _extent(t)
        if nbytes >= min_bytes:
            spans.append((addr // _HUGE * _HUGE, -(-(addr + nbytes) // _HUGE) * _HUGE))
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    done = 0
    for lo, hi in merged:
        libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)
        # Page by page: the range's first or last page, lying partly outside the heap
        # (past its top, say) fails alone, not the whole range.
        for page in range(lo, hi, _HUGE):
            if libc.madvise(page, _HUGE, _MADV_COLLAPSE) == 0:
                done += _HUGE
    return done


def torch_huge_pages() -> bool:
    """Whether torch's CPU allocator backs its buffers of 2 MiB and more with transparent huge
    pages (torch's own `THP_MEM_ALLOC_ENABLE`: MADV_HUGEPAGE on each before its first touch).
    `import steadylm` sets it unless `STEADYLM_CPU_HUGEPAGES` is `off` (a value the user set
    is kept); torch reads it once, at its first CPU allocation (of any size), so a process
    that made a CPU tensor before importing steadylm keeps 4 KiB pages.

    A prefill's activations are tens of MB a tensor and a GEMM touches one 4 KiB page per
    output row for every 64 columns, so in 4 KiB pages its loads and stores walk the page
    tables (nested ones, in a VM) again and again: a GEMM with the blocked GEMM's tiles at
    4096 x 768 x 2304 ran at 223-243 GFLOP/s with its operands in 4 KiB pages and 267-302 in
    2 MiB ones (2 threads of an Intel Xeon with AMX, a standalone build). The weights and KV
    cache are advised at load too, but buffers already written wait for khugepaged, which
    merged ~10 MB of a 440 MB model in 20 s; torch's flag gives the weights huge pages as
    oneDNN packs them (~720 MB of the bench model's process right after load);
    `STEADYLM_CPU_HUGEPAGES=collapse` their ends too (`collapse_huge_pages`)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "0") not in ("", "0")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once, its madvise typed (None off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def tune_cpu_allocator() -> bool:
    """Keep freed memory in the process instead of handing it back to the OS (glibc mallopt:
    no mmap for large blocks, no heap trimming). A prefill's activations are tens of MB per
    tensor; by default glibc maps and unmaps each one, and every first touch page-faults
    again: measured on a 2-vCPU VM, a fresh (4096, 2048) fp32 multiply took 20 ms instead of
    3 ms. Peak memory is unchanged (the plan reserves the activations); what changes is that the
    process keeps it, as with the tcmalloc / jemalloc preload vLLM's CPU backend recommends.

    One arena for every thread (M_ARENA_MAX 1): glibc gives each thread that allocates its own
    arena, made of 64 MiB heaps, so a block larger than that from any thread but the main one
    (the server's and the pipeline's engine thread) is mapped for each allocation and unmapped
    at its free, whatever the thresholds say. A 16 x 256 prefill of the bench model (a 64 MiB
    gate/up output) page-faulted ~6,900 times per prefill on such a thread, 0 on the main
    thread, and its TTFT was ~10% longer (2.12 against 1.91 s, fp32 on 2 vCPUs). Returns
    whether the settings took effect; a no-op off glibc."""
    global _allocator_tuned
    if _allocator_tuned or _choice("STEADYLM_CPU_MALLOC", ("tuned", "default")) != "tuned":
        return _allocator_tuned
    libc = _libc()
    try:
        m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # glibc's malloc.h
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1  # blocks up to 1 GiB from the heap
        ok = ok and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1
        ok = ok and libc.mallopt(m_arena_max, 1) == 1
    except AttributeError:  # no glibc (None), or a libc without mallopt
        ok = False
    _allocator_tuned = ok
    logger.debug("glibc malloc tuned for large activations: %s", ok)
    return ok


def cache_dir() -> str:
    """Where steadylm keeps what it derives once per file (`STEADYLM_CACHE_DIR`, else
    `$XDG_CACHE_HOME/steadylm`, else `~/.cache/steadylm`); created by the writer."""
    explicit = os.environ.get("STEADYLM_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "steadylm")
