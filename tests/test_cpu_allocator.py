"""glibc's allocator settings for large CPU activations (platform.tune_cpu_allocator)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_hugepages import needs_thp

_CHILD = """
import resource, sys, threading
sys.path[:0] = [{root!r}]
import steadylm, torch
from steadylm import platform

print(platform.tune_cpu_allocator() if {tune} else "untuned")

def in_heap(address):
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.rstrip().endswith("[heap]")
    raise AssertionError(hex(address))

def work(out):
    for _ in range(6):  # a 96 MiB activation, written and freed, as a prefill's gate/up output
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        x = torch.ones(24 << 20)
        heap = in_heap(x.data_ptr())
        del x
        out.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before, heap))

out = []
engine = threading.Thread(target=work, args=(out,), name="steadylm-engine")
engine.start()
engine.join()
print(*(f"{{faults}}:{{int(heap)}}" for faults, heap in out))
"""


def _on_a_thread(tune: bool) -> tuple[str, list[int], list[bool]]:
    """In a fresh process (torch's buffers in huge pages, as `import steadylm` sets): the
    setting's result, and for each of six 96 MiB allocations on a new thread its page faults
    and whether it came from the process's heap (glibc's main arena) or a mapping of its own."""
    root = str(Path(__file__).resolve().parents[1])
    env = {  # glibc's own settings from the environment would decide the untuned case
        k: v
        for k, v in os.environ.items()
        if k != "STEADYLM_CPU_MALLOC" and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
    }
    env.update(THP_MEM_ALLOC_ENABLE="1", STEADYLM_CPU_HUGEPAGES="on")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(root=root, tune=tune)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    tuned, rows = out.stdout.splitlines()
    pairs = [r.split(":") for r in rows.split()]
    return tuned, [int(f) for f, _ in pairs], [h == "1" for _, h in pairs]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
@needs_thp
def test_large_blocks_on_the_engine_thread_stay_in_the_process():
    """The engine runs on its own thread under the server and the pipeline; glibc would map
    and unmap each block over 64 MiB that such a thread allocates, so every prefill
    page-faulted its activations in again. Tuned, the blocks come from the process's heap,
    where a freed one is kept."""
    tuned, faults, heap = _on_a_thread(tune=True)
    assert tuned == "True" and all(heap), (faults, heap)
    untuned, faults, heap = _on_a_thread(tune=False)
    assert not any(heap), (faults, heap)
    assert min(faults) >= 10, faults  # mapped afresh each time: 25 faults here (2 MiB pages)
