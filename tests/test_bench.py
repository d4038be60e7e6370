"""The benchmark scripts cannot rot: each runs on a tiny model and produces a result. Nothing
here asserts a speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-model")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from make_bench_model import build
    finally:
        sys.path.pop(0)
    return build(
        str(path),
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def run(*cmd: str) -> str:
    return subprocess.run(
        [sys.executable, *cmd], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout


def test_offline_bench_produces_json(tiny_model, tmp_path):
    out = tmp_path / "r.json"
    run(
        "-m",
        "steadylm.entrypoints.cli",
        "--log-level",
        "WARNING",
        "bench",
        "offline",
        "--model",
        tiny_model,
        "--num-prompts",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--runs",
        "2",
        "--max-total-tokens",
        "2048",
        "--block-size",
        "16",
        "--json",
        str(out),
    )
    res = json.loads(out.read_text())["results"]["3 x 16 -> 8"]
    assert res["output_tokens_per_s"]["median"] > 0
    assert 0 <= res["non_model_overhead"]["median"] < 1


def test_transformers_peer_and_membw_produce_results(tiny_model, tmp_path):
    text = run(
        "benchmarks/peer_transformers.py",
        "--model",
        tiny_model,
        "--workload",
        "W2",
        "--runs",
        "1",
        "--json",
        str(tmp_path / "hf.json"),
    )
    assert "1 x 256 -> 128" in text
    bw = json.loads(run("benchmarks/membw.py", "--model", tiny_model))
    assert bw["bandwidth_GBps"] > 0 and bw["step_weight_bytes"] > 0


def test_structured_overhead_produces_a_result(tmp_path):
    if not (ROOT.parent / "shared" / "tokenizers" / "qwen2.5").is_dir():
        pytest.skip("../shared is absent (the Qwen2.5 tokenizer)")
    out = tmp_path / "s.json"
    run(
        "benchmarks/structured_overhead.py",
        *("--model", str(tmp_path / "m"), "--tiny", "--runs", "1", "--steps", "4"),
        *("--out", str(out)),
    )
    result = json.loads(out.read_text())
    assert result["json_schema_step_ms"] > 0 and result["bitmask_fill_ms_per_step"] > 0
    assert result["bitmask_apply_ms_per_step"] > 0


def test_gemv_share_produces_a_result(tmp_path):
    """The GEMV-vs-oneDNN microbenchmark still runs (one layer, one round); no speed asserted."""
    from steadylm import kernels
    from steadylm.layers.linear import OneDNNDenseKernel

    probe = OneDNNDenseKernel(torch.randn(128, 64), None) if _onednn() else None
    if probe is None or probe.gemv_address is None:
        pytest.skip(f"no packed GEMV on this CPU / build ({kernels.status()})")
    # One tile; two tiles of a block (3 + 2 rows) where the GEMV takes 5 (AVX2's takes 1-4).
    for rows in (1, min(5, probe.gemv_max_rows)):
        out = tmp_path / f"gemv{rows}.json"
        args = ("--seconds", "0", "--layers", "1", "--rows", str(rows), "--json", str(out))
        run("benchmarks/gemv_share.py", *args)
        got = json.loads(out.read_text())
        assert got["rounds"] >= 1 and got["gemv"] > 0 and got["onednn"] > 0
        assert got["rows"] == rows and got["gemv_ms"] > 0 and got["onednn_ms"] > 0


@pytest.mark.parametrize("extra", [(), ("--quant-policy", "4", "--batch", "3")])
def test_decode_attention_share_produces_a_result(tmp_path, extra):
    """The decode-attention-vs-read microbenchmark still runs (one layer, one round each), on
    a plain cache and on a quantized one at batch 3."""
    from steadylm import kernels

    if kernels.native_decode_attention(torch.float32, torch.device("cpu")) is None:
        pytest.skip(f"no native decode attention here ({kernels.status()})")
    out = tmp_path / "attn.json"
    run(
        "benchmarks/decode_attention_share.py",
        *("--seconds", "0", "--layers", "1", "--contexts", "100,300", "--json", str(out)),
        *extra,
    )
    got = json.loads(out.read_text())
    assert set(got) == {"100", "300"}
    assert all(r["rounds"] >= 1 and r["attention_over_read"] > 0 for r in got.values())


def _onednn() -> bool:
    from steadylm.layers.linear import OneDNNDenseKernel

    return OneDNNDenseKernel.supports(torch.empty(1, 1))


def test_serving_bench_against_a_real_server(tiny_model, tmp_path):
    from tests.entrypoints.test_server import free_port, wait_healthy

    if not (Path(tiny_model) / "tokenizer.json").exists():
        pytest.skip("../shared is absent: no Llama-2 tokenizer for the bench model")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "steadylm.entrypoints.cli",
            "--log-level",
            "WARNING",
            "serve",
            tiny_model,
            "--server-port",
            str(port),
            "--max-total-tokens",
            "4096",
            "--block-size",
            "16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        out = tmp_path / "s.json"
        run(
            "-m",
            "steadylm.entrypoints.cli",
            "bench",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--concurrency",
            "2",
            "--runs",
            "1",
            "--json",
            str(out),
        )
        res = next(iter(json.loads(out.read_text())["results"].values()))
        assert res["completed"]["median"] == 4 and res["failed"]["median"] == 0
        assert res["tpot_ms_median"]["median"] > 0
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(
    "script", ["peer_llamacpp.py", "peer_ctranslate2.py", "peer_openvino.py", "peer_vllm.py"]
)
def test_peer_scripts_parse_without_their_peer(script):
    """The peers live in their own venvs (not CI's); their scripts import them only in main(),
    so the command line and workload table are still checked here."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "--workload" in r.stdout


def test_peer_step_loop_timing_counts_tokens_and_decode_steps():
    """time_steps (the OpenVINO and vLLM peers' step loops): a fake engine whose first step
    gives both requests their first token, then one token a step; a short count is an error."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from peer_common import time_steps
    finally:
        sys.path.pop(0)

    def engine(tokens: list[int]):
        state = {"step": 0}

        def step():
            state["step"] += 1
            k = state["step"]
            return [(i, int(k <= t), k == t) for i, t in enumerate(tokens)]

        return step, lambda: state["step"] < max(tokens)

    step, has_work = engine([4, 4])
    m = time_steps(step, has_work, 2, 10, 4, time.perf_counter())
    assert 0 < m["ttft_s"] <= m["elapsed_s"]
    assert m["decode_tokens_per_s_per_request"] > 0
    assert m["decode_step_ms"] > 0  # steps 2 and 3: both decoding, neither finished
    step, has_work = engine([4, 3])
    with pytest.raises(RuntimeError, match="expected 2 x 4"):
        time_steps(step, has_work, 2, 10, 4, time.perf_counter())


def test_peer_workloads_match_steadylms():
    from steadylm.bench import WORKLOADS

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from peer_common import WORKLOADS as PEER_WORKLOADS
    finally:
        sys.path.pop(0)
    assert PEER_WORKLOADS == {k: list(v) for k, v in WORKLOADS.items()}


def test_report_uses_each_runs_own_bandwidth_readings(tmp_path):
    """The W2 share of the bound divides by the mean of the readings around that run."""

    def put(name, obj):
        (tmp_path / name).write_text(json.dumps(obj))

    put(
        "steadylm-fp32-W2.json",
        {
            "results": {
                "1 x 256 -> 128": {
                    "decode_tokens_per_s_per_request": {"median": 80.0, "min": 79.0, "max": 81.0}
                }
            }
        },
    )
    before = {"bandwidth_GBps": 40.0, "bound_tokens_per_s": 90.0, "other_cpu_cores": 0.01}
    put("membw-steadylm-fp32-W2-before.json", before)
    put("membw-steadylm-fp32-W2-after.json", {"bandwidth_GBps": 50.0, "bound_tokens_per_s": 110.0})
    out = run(str(ROOT / "benchmarks" / "report.py"), str(tmp_path))
    row = next(line for line in out.splitlines() if line.startswith("| steadylm fp32 | 80.0"))
    assert "40.0 / 50.0" in row and "| 100.0 |" in row and "| 80% |" in row
    assert "CONTENDED" not in row
    # a reading that other processes shared is flagged: its bound reads low
    put("membw-steadylm-fp32-W2-after.json", {**before, "other_cpu_cores": 1.2})
    out = run(str(ROOT / "benchmarks" / "report.py"), str(tmp_path))
    row = next(line for line in out.splitlines() if line.startswith("| steadylm fp32 | 80.0"))
    assert "CONTENDED: other processes used 1.20 cores" in row


def test_membw_counts_other_processes_cpu():
    """membw.py's contention reading counts a busy process alongside (about one core)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from membw import measure
    finally:
        sys.path.pop(0)
    import time

    _, idle = measure(lambda: time.sleep(0.5))
    if idle is None:
        pytest.skip("no /proc/stat")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        _, loaded = measure(lambda: time.sleep(1.0))
    finally:
        busy.kill()
        busy.wait()
    assert loaded > 0.5


def test_soak_slope_is_least_squares_in_mb_per_min():
    """benchmarks/soak.py's verdict is this slope (the 30-minute run itself is not a test: it
    takes half an hour and a server; docs/benchmarks.md has its result)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from soak import slope_per_min
    finally:
        sys.path.pop(0)
    assert slope_per_min([(0.0, 100.0), (60.0, 102.0), (120.0, 104.0)]) == pytest.approx(2.0)
    assert slope_per_min([(0.0, 5.0), (30.0, 7.0), (60.0, 5.0), (90.0, 7.0)]) == pytest.approx(0.8)
    assert slope_per_min([(0.0, 1.0)]) is None


def test_gpu_check_smoke_writes_every_section(tmp_path):
    """benchmarks/gpu_check.py, the device check a lent GPU runs once, at tiny shapes on the
    CPU (Triton kernels in its interpreter; graphs, bf16 kernels and CUDA memory marked
    skipped): every section is written, none errored, every correctness check passed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check import SECTIONS, errors
    finally:
        sys.path.pop(0)
    r = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--smoke", "--device", "cpu"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert tuple(report["sections"]) == SECTIONS
    assert errors(report["sections"]) == []
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    assert report["sections"]["parity"]["tiny_fp32"]["quant_0"]["graphs"]["skipped"]
    text = (tmp_path / "gpu_check.md").read_text()
    assert text.startswith("## ") and "### Targets" in text and text in r.stdout


def test_side_by_side_alternates_and_reports_each_pairs_ratio(tiny_model, tmp_path):
    """side_by_side.py runs ours first in odd pairs and the peer first in even ones, and its
    summary holds each pair's own ratio of output tok/s (here transformers as the peer)."""
    out = tmp_path / "side"
    run(
        "benchmarks/side_by_side.py",
        *("--model", tiny_model, "--workload", "W2", "--pairs", "2", "--runs", "1"),
        *("--peer", "transformers", "--peer-python", sys.executable, "--peer-model", tiny_model),
        *("--ours-args", "--max-total-tokens 2048 --block-size 16"),
        *("--out", str(out), "--lock", str(tmp_path / "lock")),
    )
    summary = json.loads((out / "summary.json").read_text())
    shape = summary["shapes"]["1 x 256 -> 128"]

    def tok_s(name):
        r = json.loads((out / name).read_text())["results"]["1 x 256 -> 128"]
        return r["output_tokens_per_s"]["median"]

    assert shape["ratios"] == [tok_s(f"ours_{i}.json") / tok_s(f"peer_{i}.json") for i in (1, 2)]
    assert shape["min"] <= shape["median"] <= shape["max"]
    mtime = {f.name: f.stat().st_mtime_ns for f in out.glob("*.json")}
    assert mtime["ours_1.json"] < mtime["peer_1.json"] < mtime["peer_2.json"] < mtime["ours_2.json"]
    assert summary["bandwidth_before"]["GBps"] > 0 and summary["bandwidth_after"]["GBps"] > 0
