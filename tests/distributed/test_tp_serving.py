"""Tensor parallelism through the user's entry points: `pipeline(..., PytorchEngineConfig(tp=2))`,
`steadylm serve --tp 2` with the openai client, a torchrun launch, and a worker killed under
load (every stream ends with an error within seconds, /health says 503, no process is left)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.conftest import STORIES, needs_shared
from tests.entrypoints.test_server import free_port, start_server

pytestmark = needs_shared
MODEL = "stories260K"
PROMPTS = ["Once upon a time", "Tom and Sue went to the park."]


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def completions(base: str) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    texts = []
    for p in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0)
        texts.append(r.choices[0].text)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Lily"}], max_tokens=20, temperature=0
    )
    return texts + [chat.choices[0].message.content]


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM; the exit code, or a failure with the output if it does not exit in 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{proc.args} did not exit after SIGTERM:\n" + proc.stdout.read())


def test_serve_tp2_answers_as_tp1():
    one, base1 = start_server()
    try:
        want = completions(base1)
    finally:
        stop(one)
    two, base2 = start_server("--tp", "2")
    try:
        workers = children(two.pid)
        assert len(workers) == 1
        assert completions(base2) == want
    finally:
        assert stop(two) == 0
    assert not any(alive(w) for w in workers)


def test_pipeline_tp2_equals_tp1():
    from steadylm import GenerationConfig, PytorchEngineConfig, pipeline

    gen = GenerationConfig(max_new_tokens=48, do_sample=False)
    texts = []
    for tp in (1, 2):
        cfg = PytorchEngineConfig(tp=tp, block_size=16, num_gpu_blocks=128)
        with pipeline(str(STORIES), backend_config=cfg) as pipe:
            texts.append([r.text for r in pipe(PROMPTS, gen_config=gen)])
            workers = children(os.getpid()) if tp == 2 else []
    assert texts[0] == texts[1]
    assert all(len(t) > 20 for t in texts[1])
    assert not any(alive(w) for w in workers)


def test_worker_killed_under_load_fails_every_stream_fast():
    """tp=4 (three workers). Eight streams are running when one worker gets SIGKILL: each
    stream ends with an error event naming the dead worker within 10 s, /health is 503, new
    requests get 503, the other workers are stopped, and the server exits cleanly."""
    proc, base = start_server("--tp", "4")
    try:
        workers = children(proc.pid)
        assert len(workers) == 3
        started = threading.Barrier(9)
        ended: dict[int, tuple[float, str]] = {}

        def stream(i: int) -> None:
            body = {
                "model": MODEL,
                "prompt": PROMPTS[i % 2],
                "max_tokens": 3000,
                "ignore_eos": True,
                "stream": True,
            }
            text, first = "", True
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    text += line + "\n"
                    if first and line.startswith("data: {"):
                        first = False
                        started.wait(30)
            ended[i] = (time.monotonic(), text)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(60)  # every stream has its first tokens
        victim = workers[1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(30)
        assert len(ended) == 8
        for when, text in ended.values():
            assert when - killed < 10, when - killed
            assert "tensor-parallel group failed" in text and f"pid {victim}" in text
            assert text.rstrip().endswith("data: [DONE]")
        assert httpx.get(f"{base}/health").status_code == 503
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 503
        deadline = time.monotonic() + 10
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)  # the executor kills the surviving workers
        assert not any(alive(w) for w in workers)
    finally:
        code = stop(proc)
    assert code == 0
    assert not children(proc.pid)


def test_torchrun_launch_serves():
    """`torchrun --nproc-per-node 2 -m steadylm.entrypoints.cli serve ... --tp 2`: rank 0 serves
    HTTP, rank 1 is its worker; the answers equal a single-process server's."""
    one, base1 = start_server()
    try:
        want = completions(base1)
    finally:
        stop(one)
    launcher = ("-m", "torch.distributed.run", "--nproc-per-node", "2")
    proc, base = start_server(
        "--tp", "2", launcher=(*launcher, "--master-port", str(free_port())), timeout=120
    )
    try:
        assert completions(base) == want
    finally:
        stop(proc)
