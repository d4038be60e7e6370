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

def work(faults):
    for _ in range(6):  # a 96 MiB activation, written and freed, as a prefill's gate/up output
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        x = torch.ones(24 << 20)
        del x
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

faults = []
engine = threading.Thread(target=work, args=(faults,), name="steadylm-engine")
engine.start()
engine.join()
print(*faults)
"""


def _faults_on_a_thread(tune: bool) -> tuple[str, list[int]]:
    """In a fresh process (torch's buffers in huge pages, as `import steadylm` sets): the
    setting's result, and the page faults of each of six 96 MiB allocations on a new thread."""
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("STEADYLM_CPU_MALLOC",)}
    env.update(THP_MEM_ALLOC_ENABLE="1", STEADYLM_CPU_HUGEPAGES="on")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(root=root, tune=tune)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    tuned, faults = out.stdout.splitlines()
    return tuned, [int(f) for f in faults.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
@needs_thp
def test_large_blocks_on_the_engine_thread_stay_in_the_process():
    """The engine runs on its own thread under the server and the pipeline; glibc would map
    and unmap each block over 64 MiB that such a thread allocates, so every prefill
    page-faulted its activations in again. Tuned, only the first allocation faults."""
    tuned, faults = _faults_on_a_thread(tune=True)
    assert tuned == "True"
    assert sum(faults[2:]) <= 4, faults
    untuned, faults = _faults_on_a_thread(tune=False)  # mapped afresh: 25 faults each here
    assert min(faults[2:]) >= 10, faults  # (24,576 where the kernel gives no huge pages)
