"""The README's commands, run as written where they are cheap: the planner's worked example
(its table is the planner's own output) and the serving recipe (serve stories260K, then
`bench serve --concurrency 16`, every request answered)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_shared

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _command_after(marker: str) -> list[str]:
    """The first command of the first ```bash block after `marker`, as its arguments."""
    block = README[README.index(marker) :].split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " ").splitlines()[0])


def _steadylm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "steadylm.entrypoints.cli", "--log-level", "WARNING", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _plan_json(args: list[str], **changes: str) -> dict:
    for flag, value in changes.items():
        args = [*args, f"--{flag.replace('_', '-')}", value]
    out = _steadylm(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _check_plan_table(cmd: list[str], table: str) -> None:
    assert cmd[:2] == ["steadylm", "plan"]
    rows = re.findall(r"^\| (\d) \((?:fp16|int8|int4)\) \|(.*)\|$", table, re.M)
    assert [q for q, _ in rows] == ["0", "8", "4"]
    for q, cells in rows:
        plan = _plan_json(cmd[1:], quant_policy=q)
        _, kv, tokens, one, two = (c.strip() for c in cells.split("|"))
        assert int(tokens.replace(",", "")) == plan["total_tokens"], (q, tokens)
        assert int(one.replace(",", "")) == plan["max_session_len"]
        assert int(two.split()[0].replace(",", "")) == plan["max_session_len_for_concurrency"]
        assert kv == f"{plan['kv_cache_bytes'] / 2**30:.2f} GiB"


def test_planner_table_is_the_planners_output():
    cmd = _command_after("**It tells you exactly what fits,**")
    start = README.index("**It tells you exactly what fits,**")
    _check_plan_table(cmd, README[start : README.index("## LMDeploy users")])
    seed = re.search(r"cache_max_entry_count=0\.3` the same card holds ([\d,]+) int4", README)
    args = [a for a in cmd[1:] if not a.startswith("--gpu-memory-utilization")]
    i = args.index("0.9")
    args = args[:i] + args[i + 1 :]
    plan = _plan_json(args, quant_policy="4", cache_max_entry_count="0.3")
    assert int(seed.group(1).replace(",", "")) == plan["total_tokens"]


def test_moe_planner_table_is_the_planners_output():
    cmd = _command_after("**Mixtures of experts.**")
    start = README.index("**Mixtures of experts.**")
    _check_plan_table(cmd, README[start : README.index("## Layout")])


@needs_shared
def test_serving_recipe_as_written():
    from tests.entrypoints.test_server import free_port, wait_healthy

    serve = _command_after("## Serving")
    assert serve[:2] == ["steadylm", "serve"]
    port = str(free_port())
    serve = [port if a == "23333" else a for a in serve]
    proc = subprocess.Popen(
        [sys.executable, "-m", "steadylm.entrypoints.cli", "--log-level", "WARNING", *serve[1:]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        bench = next(
            line for line in README.splitlines() if line.startswith("steadylm bench serve")
        )
        args = shlex.split(bench.replace("23333", port))[1:]
        out = _steadylm(*args, "--runs", "1", timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        row = next(line for line in out.stdout.splitlines() if "concurrency 16" in line)
        assert "| 16 (16-16) | 0 (0-0) |" in row, row
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("extra", [["--input-len", "600"]])
@needs_shared
def test_bench_serve_reports_failures_instead_of_crashing(extra):
    """Prompts longer than the model's 512 positions: every request gets a 400, and the bench
    says so (exit 1) rather than dying on a median of nothing."""
    from tests.entrypoints.test_server import start_server

    proc, base = start_server()
    try:
        out = _steadylm(
            "bench", "serve", "--base-url", base, "--num-prompts", "3", "--runs", "1", *extra
        )
        assert out.returncode == 1, out.stdout + out.stderr
        assert "3 of 3 requests failed; the first: HTTP 400" in out.stderr
        assert "Traceback" not in out.stderr
    finally:
        proc.terminate()
        proc.wait(30)


def test_bench_workload_and_explicit_lengths_conflict(tmp_path):
    out = _steadylm(
        "bench", "offline", "--model", str(tmp_path), "--workload", "W2", "--output-len", "5"
    )
    assert out.returncode == 2
    assert "--workload W2 fixes the prompt count and lengths (1 x 256 -> 128)" in out.stderr
    assert "drop --output-len or --workload" in out.stderr
