"""Transparent huge pages for the CPU's streamed buffers (platform.advise_huge_pages)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from steadylm import platform
from steadylm.attention.torch_ref import TorchAttentionBackend

THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    """The system's THP mode (the bracketed word), None where there is none."""
    try:
        with open(THP_MODE) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
    reason="needs Linux with transparent huge pages enabled (madvise or always)",
)


def _smaps_field(addr: int, field: str) -> str:
    """The first word of `field` in the /proc/self/smaps entry of the mapping holding `addr`."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field + ":":
                return line.split()[1]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _thp_eligible(addr: int) -> bool:
    """Whether the kernel may back the mapping holding `addr` with huge pages."""
    return _smaps_field(addr, "THPeligible") == "1"


@needs_thp
def test_the_kv_cache_is_advised_for_huge_pages(monkeypatch):
    monkeypatch.setenv("STEADYLM_CPU_HUGEPAGES", "on")
    cache = TorchAttentionBackend().allocate(2, 256, 16, 4, 64, torch.float32, torch.device("cpu"))
    for t in (cache.k, cache.v):  # 8 MiB each: whole huge pages around the middle
        middle = t.data_ptr() + t.numel() * t.element_size() // 2
        assert _thp_eligible(middle)


@needs_thp
def test_packed_weights_and_plain_tensors_are_advised(monkeypatch):
    monkeypatch.setenv("STEADYLM_CPU_HUGEPAGES", "on")
    dense = torch.empty(3 << 20, dtype=torch.float32)  # 12 MiB
    got = platform.advise_huge_pages(dense)
    assert 8 << 20 <= got <= 12 << 20 and got % (2 << 20) == 0
    assert _thp_eligible(dense.data_ptr() + (6 << 20))
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(2048, 1024))  # 8 MiB
    assert platform.advise_huge_pages(packed) >= 4 << 20


def _anon_huge(addr: int) -> int:
    """AnonHugePages (bytes) of the mapping holding `addr`."""
    return int(_smaps_field(addr, "AnonHugePages")) << 10


def _written_in_small_pages() -> tuple[mmap.mmap, torch.Tensor, int]:
    """A 4 MiB tensor written in 4 KiB pages, from 1 MiB past a 2 MiB boundary of its own
    mapping: the three huge pages it touches lie inside the mapping, and none is whole inside
    the tensor but the middle one."""
    buf = mmap.mmap(-1, 12 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -(-base // (2 << 20)) * (2 << 20) - base + (1 << 20)
    t = torch.frombuffer(buf, dtype=torch.uint8, count=4 << 20, offset=offset)
    t.fill_(7)
    return buf, t, base


@needs_thp
def test_collapse_puts_weights_in_huge_pages_ends_included(monkeypatch):
    """`STEADYLM_CPU_HUGEPAGES=collapse` leaves a written buffer in huge pages at once, the
    2 MiB pages holding its ends included; `on` (advice only) leaves written pages as they
    are."""
    monkeypatch.setenv("STEADYLM_CPU_HUGEPAGES", "on")
    buf, t, base = _written_in_small_pages()
    assert platform.collapse_huge_pages([t]) == 2 << 20  # the one whole page inside, advised
    if _thp_mode() == "madvise":  # (under "always" the pages were huge from their first touch)
        assert _anon_huge(base) == 0
    monkeypatch.setenv("STEADYLM_CPU_HUGEPAGES", "collapse")
    got = platform.collapse_huge_pages([t, torch.empty(10)])  # the small one is skipped
    if got == 0:
        pytest.skip("this kernel cannot collapse (MADV_COLLAPSE needs Linux 6.1)")
    assert got == 6 << 20 and _anon_huge(base) == 6 << 20
    assert bool((t == 7).all())  # the contents survive the move
    del t
    buf.close()


def test_small_tensors_and_the_switch_advise_nothing(monkeypatch):
    assert platform.advise_huge_pages(torch.empty(1000)) == 0  # no whole 2 MiB page inside
    monkeypatch.setenv("STEADYLM_CPU_HUGEPAGES", "off")
    assert platform.advise_huge_pages(torch.empty(4 << 20)) == 0
    assert platform.collapse_huge_pages([torch.empty(4 << 20)]) == 0
    monkeypatch.setenv("STEADYLM_CPU_HUGEPAGES", "sometimes")
    with pytest.raises(Exception, match="STEADYLM_CPU_HUGEPAGES"):
        platform.advise_huge_pages(torch.empty(4 << 20))


_CHILD = """
import os, sys
sys.path[:0] = [{root!r}]
import steadylm, torch
from tests.test_hugepages import _thp_eligible
x = torch.ones(3 << 20)  # 12 MiB from torch's allocator, after `import steadylm`
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), _thp_eligible(x.data_ptr() + (6 << 20)))
"""


def _child(**env: str) -> list[str]:
    """`import steadylm` in a fresh process with `env` (and no THP_MEM_ALLOC_ENABLE of this
    one's): torch's flag as the child sees it, and whether a large tensor is THP-eligible."""
    import os
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    code = _CHILD.format(root=root)
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@needs_thp
def test_import_steadylm_gives_torchs_large_buffers_huge_pages():
    """torch's allocator backs tensors of 2 MiB and more with huge pages once `import steadylm`
    has run (platform.torch_huge_pages); STEADYLM_CPU_HUGEPAGES=off and a value the user set
    leave torch's flag alone."""
    assert _child(STEADYLM_CPU_HUGEPAGES="on") == ["1", "True"]
    off = _child(STEADYLM_CPU_HUGEPAGES="off")
    assert off[0] == "None"
    kept = _child(STEADYLM_CPU_HUGEPAGES="on", THP_MEM_ALLOC_ENABLE="0")
    assert kept[0] == "0"
    if _thp_mode() == "madvise":  # not advised: not eligible (under "always" everything is)
        assert off[1] == kept[1] == "False"
