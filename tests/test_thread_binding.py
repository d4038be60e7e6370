"""OpenMP threads pinned one CPU each (platform.cpu_threads_bind, kernels.bind_threads)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from steadylm import kernels, platform
from steadylm.errors import ConfigError


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7}, raising=False)


def test_auto_binds_only_when_the_ranks_threads_fill_the_cpus(monkeypatch, four_cpus):
    monkeypatch.delenv("STEADYLM_CPU_OMP_THREADS_BIND", raising=False)
    assert platform.cpu_threads_bind(4) is None  # nobind unless asked
    monkeypatch.setenv("STEADYLM_CPU_OMP_THREADS_BIND", "auto")
    assert platform.cpu_threads_bind(4) == [4, 5, 6, 7]
    assert platform.cpu_threads_bind(2, rank=1, ranks=2) == [6, 7]
    assert platform.cpu_threads_bind(2) is None  # CPUs to share: left to the OS
    assert platform.cpu_threads_bind(8) is None  # more threads than CPUs
    monkeypatch.setenv("STEADYLM_CPU_OMP_THREADS_BIND", "nobind")
    assert platform.cpu_threads_bind(4) is None


def test_a_cpu_list_per_rank(monkeypatch, four_cpus):
    monkeypatch.setenv("STEADYLM_CPU_OMP_THREADS_BIND", "0-1|8,10")
    assert platform.cpu_threads_bind(2, rank=0, ranks=2) == [0, 1]
    assert platform.cpu_threads_bind(2, rank=1, ranks=2) == [8, 10]
    monkeypatch.setenv("STEADYLM_CPU_OMP_THREADS_BIND", "2-5")
    assert platform.cpu_threads_bind(3) == [2, 3, 4]  # the first of a longer list


@pytest.mark.parametrize("value", ["x", "1-", "3-1", "0,,1", "0,0", "0", "0-1|2-3"])
def test_a_bad_cpu_list_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv("STEADYLM_CPU_OMP_THREADS_BIND", value)
    with pytest.raises(ConfigError, match="STEADYLM_CPU_OMP_THREADS_BIND"):
        platform.cpu_threads_bind(2)


_CHILD = """
import glob, os, sys
sys.path[:0] = [{root!r}]
import torch
from steadylm import kernels
torch.set_num_threads(2)
torch.ones(1 << 20).sum()  # the team exists
me = open("/proc/thread-self/status").read().split("Cpus_allowed_list:")[1].split()[0]
cpus = kernels.bind_threads()
lists = [
    open(d + "/status").read().split("Cpus_allowed_list:")[1].split()[0]
    for d in glob.glob("/proc/self/task/*")
]
after = open("/proc/thread-self/status").read().split("Cpus_allowed_list:")[1].split()[0]
print(cpus, me == after, lists.count(str(cpus[1])), float(torch.ones(1 << 20).sum()))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two CPUs",
)
def test_the_teams_other_threads_are_pinned_the_caller_is_not():
    """In a fresh process (pinning is for the life of a thread): thread 1 of the team gets
    the list's second CPU alone; the calling thread keeps its CPUs, so the processes it starts
    later are not confined to one."""
    if kernels.native_ops() is None:
        pytest.skip("the native CPU kernels are not built here")
    a, b = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "STEADYLM_CPU_OMP_THREADS_BIND": f"{a},{b}"}
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(root=root)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{a},", f"{b}]", "True", "1", f"{float(1 << 20)}"]


def test_the_runner_pins_the_team_of_each_thread_that_runs_steps(monkeypatch, model_dirs):
    """The engine's steps may run on another thread than the one that built it (the server's
    engine thread): each stepping thread's team is pinned, once."""
    from steadylm.engine.request import SamplingParams
    from tests.conftest import engine_for, run_to_end

    calls = []
    monkeypatch.setattr(
        kernels, "bind_threads", lambda *a: calls.append((threading.get_ident(), a))
    )
    engine = engine_for(model_dirs("llama")[1])
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True))
    run_to_end(engine)
    assert calls == [(threading.get_ident(), (0, 1))]
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    other = threading.Thread(target=run_to_end, args=(engine,))
    other.start()
    other.join()
    assert len(calls) == 2 and calls[1][0] == other.ident and calls[1][1] == (0, 1)


def test_a_bad_cpu_list_fails_the_engine_at_start(monkeypatch, model_dirs):
    from tests.conftest import engine_for

    monkeypatch.setenv("STEADYLM_CPU_OMP_THREADS_BIND", "0-x")
    with pytest.raises(ConfigError, match="STEADYLM_CPU_OMP_THREADS_BIND"):
        engine_for(model_dirs("llama")[1])
