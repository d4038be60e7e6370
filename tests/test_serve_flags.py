"""Every `lmdeploy serve api_server` flag (LMDeploy 0.18.0) on `steadylm serve`: it works, has no
effect (logged at INFO with the reason) or is refused with the reason, never "unrecognized
arguments". Most rows only parse and check; one test starts a real server."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

import httpx
import pytest

from steadylm.config import SpeculativeConfig
from steadylm.entrypoints import serve_cli
from steadylm.entrypoints.cli import build_parser, engine_config_from_args
from steadylm.errors import ConfigError
from tests.conftest import STORIES, needs_shared

# `lmdeploy serve api_server` in LMDeploy 0.18.0 (lmdeploy/cli/serve.py + cli/utils.py), all
# groups: server, PyTorch engine, TurboMind engine, vision, speculative decoding.
LMDEPLOY_API_SERVER_FLAGS = """
--server-name --server-port --allow-origins --allow-credentials --allow-methods --allow-headers
--proxy-url --max-concurrent-requests --allowed-media-domains --backend --log-level --api-keys
--ssl --model-name --max-log-len --disable-fastapi-docs --allow-terminate-by-client
--enable-abort-handling --trust-remote-code --chat-template --tool-call-parser
--reasoning-parser --revision --download-dir --generation-config --adapters --device
--eager-mode --empty-init --logprobs-mode --dllm-block-length --dllm-unmasking-strategy
--dllm-denoising-steps --dllm-confidence-threshold --enable-return-routed-experts
--distributed-executor-backend --kernel-block-size --prefix-cache-state-budget
--prefix-cache-decode-state-interval --language-model-only --dtype --tp --session-len
--max-batch-size --cache-max-entry-count --num-gpu-blocks --cache-block-seq-len
--enable-prefix-caching --max-prefill-token-num --quant-policy --model-format --hf-overrides
--disable-metrics --dp --ep --enable-microbatch --enable-eplb --role --migration-backend
--cudagraph-capture-batch-sizes --piecewise-cudagraph-max-tokens --node-rank --nnodes --cp
--rope-scaling-factor --num-tokens-per-iter --max-prefill-iters --async --communicator
--moe-a2a-backend --dist-init-addr --vision-max-batch-size --speculative-algorithm
--speculative-draft-model --speculative-num-draft-tokens --speculative-dflash-block-size
--kv-transfer-config
""".split()


def _ec(**want):
    return lambda a: all(getattr(engine_config_from_args(a), k) == v for k, v in want.items())


def _ns(**want):
    return lambda a: all(getattr(a, k) == v for k, v in want.items())


# flag: (argv, check on the parsed and checked args). Some are checked on the app below.
WORKS = {
    "--speculative-algorithm": (
        ["--speculative-algorithm", "ngram"],
        _ec(speculative_config=SpeculativeConfig(method="ngram")),
    ),
    "--speculative-num-draft-tokens": (
        ["--speculative-algorithm", "suffix", "--speculative-num-draft-tokens", "3"],
        _ec(speculative_config=SpeculativeConfig(method="suffix", num_speculative_tokens=3)),
    ),
    "--server-name": (["--server-name", "0.0.0.0"], _ns(server_name="0.0.0.0")),
    "--server-port": (["--server-port", "8000"], _ns(server_port=8000)),
    "--allow-origins": (
        ["--allow-origins", "http://a.example"],
        _ns(allow_origins=["http://a.example"]),
    ),
    "--allow-credentials": (["--allow-credentials"], _ns(allow_credentials=True)),
    "--allow-methods": (["--allow-methods", "GET", "POST"], _ns(allow_methods=["GET", "POST"])),
    "--allow-headers": (["--allow-headers", "x-a"], _ns(allow_headers=["x-a"])),
    "--max-concurrent-requests": (
        ["--max-concurrent-requests", "3"],
        _ns(max_concurrent_requests=3),
    ),
    "--log-level": (["--log-level", "DEBUG"], _ns(sub_log_level="DEBUG")),
    "--api-keys": (["--api-keys", "k1", "k2"], _ns(api_keys=["k1", "k2"])),
    "--ssl": (["--ssl"], _ns(ssl=True)),
    "--model-name": (["--model-name", "m"], _ns(model_name="m")),
    "--disable-fastapi-docs": (["--disable-fastapi-docs"], _ns(disable_fastapi_docs=True)),
    "--allow-terminate-by-client": (
        ["--allow-terminate-by-client"],
        _ns(allow_terminate_by_client=True),
    ),
    "--chat-template": (
        ["--chat-template", "TEMPLATE"],
        lambda a: a.chat_template.endswith(".jinja"),
    ),
    "--device": (["--device", "cuda"], _ec(device="cuda")),
    "--dtype": (["--dtype", "bfloat16"], _ec(dtype="bfloat16")),
    "--tp": (["--tp", "1"], _ec(tp=1)),
    "--tool-call-parser": (["--tool-call-parser", "qwen"], _ns(tool_call_parser="qwen")),
    "--reasoning-parser": (
        ["--reasoning-parser", "deepseek-r1"],
        _ns(reasoning_parser="deepseek-r1"),
    ),
    "--session-len": (["--session-len", "128"], _ec(session_len=128)),
    "--max-batch-size": (["--max-batch-size", "4"], _ec(max_batch_size=4)),
    "--cache-max-entry-count": (["--cache-max-entry-count", "0.5"], _ec(cache_max_entry_count=0.5)),
    "--num-gpu-blocks": (["--num-gpu-blocks", "64"], _ec(num_gpu_blocks=64)),
    "--cache-block-seq-len": (["--cache-block-seq-len", "16"], _ec(block_size=16)),
    "--enable-prefix-caching": (["--enable-prefix-caching"], _ec(enable_prefix_caching=True)),
    "--max-prefill-token-num": (["--max-prefill-token-num", "512"], _ec(max_prefill_token_num=512)),
    "--quant-policy": (["--quant-policy", "int4"], _ec(quant_policy=4)),
    "--disable-metrics": (["--disable-metrics"], _ns(disable_metrics=True)),
    "--eager-mode": (["--eager-mode"], _ec(eager_mode=True)),
}
# flag: argv. Each is logged once at INFO, naming the flag and "no effect".
NO_EFFECT = {
    "--backend": ["--backend", "turbomind"],
    "--max-log-len": ["--max-log-len", "100"],
    "--revision": ["--revision", "main"],
    "--download-dir": ["--download-dir", "/tmp/x"],
    "--vision-max-batch-size": ["--vision-max-batch-size", "4"],
    "--allowed-media-domains": ["--allowed-media-domains", "a.example"],
    "--trust-remote-code": ["--trust-remote-code"],
    "--generation-config": ["--generation-config", "auto"],
    "--distributed-executor-backend": ["--distributed-executor-backend", "mp"],
    "--kernel-block-size": ["--kernel-block-size", "32"],
    "--prefix-cache-state-budget": ["--prefix-cache-state-budget", "4"],
    "--prefix-cache-decode-state-interval": ["--prefix-cache-decode-state-interval", "64"],
    "--language-model-only": ["--language-model-only"],
    "--model-format": ["--model-format", "hf"],
    "--enable-microbatch": ["--enable-microbatch"],
    "--enable-eplb": ["--enable-eplb"],
    "--migration-backend": ["--migration-backend", "Mooncake"],
    "--cudagraph-capture-batch-sizes": ["--cudagraph-capture-batch-sizes", "1", "2"],
    "--piecewise-cudagraph-max-tokens": ["--piecewise-cudagraph-max-tokens", "256"],
    "--num-tokens-per-iter": ["--num-tokens-per-iter", "8192"],
    "--max-prefill-iters": ["--max-prefill-iters", "2"],
    "--async": ["--async", "0"],
    "--communicator": ["--communicator", "cuda-ipc"],
    "--moe-a2a-backend": ["--moe-a2a-backend", "deepep"],
    "--dist-init-addr": ["--dist-init-addr", "10.0.0.1:29500"],
}
# flag: (argv refused, words the error names, argv accepted: LMDeploy's default or a kept value)
REFUSED = {
    "--proxy-url": (["--proxy-url", "http://p:8000"], "proxy", None),
    "--enable-abort-handling": (["--enable-abort-handling"], "/abort_request", None),
    "--adapters": (["--adapters", "a=/lora"], "LoRA", None),
    "--empty-init": (["--empty-init"], "loads the weights", None),
    "--logprobs-mode": (["--logprobs-mode", "raw_logits"], "raw", None),
    "--dllm-block-length": (["--dllm-block-length", "4"], "diffusion", None),
    "--dllm-unmasking-strategy": (
        ["--dllm-unmasking-strategy", "sequential"],
        "diffusion",
        ["--dllm-unmasking-strategy", "low_confidence_dynamic"],
    ),
    "--dllm-denoising-steps": (["--dllm-denoising-steps", "8"], "diffusion", None),
    "--dllm-confidence-threshold": (
        ["--dllm-confidence-threshold", "0.5"],
        "diffusion",
        ["--dllm-confidence-threshold", "0.85"],
    ),
    "--enable-return-routed-experts": (["--enable-return-routed-experts"], "routed", None),
    "--hf-overrides": (["--hf-overrides", '{"a": 1}'], "config.json", None),
    "--dp": (["--dp", "2"], "data parallelism", ["--dp", "1"]),
    "--ep": (["--ep", "2"], "expert parallelism", ["--ep", "1"]),
    "--cp": (["--cp", "2"], "context parallelism", ["--cp", "1"]),
    "--role": (["--role", "Prefill"], "disaggregate", ["--role", "Hybrid"]),
    "--node-rank": (["--node-rank", "1"], "torchrun", ["--node-rank", "0"]),
    "--nnodes": (["--nnodes", "2"], "torchrun", ["--nnodes", "1"]),
    "--rope-scaling-factor": (
        ["--rope-scaling-factor", "2.0"],
        "rope",
        ["--rope-scaling-factor", "0"],
    ),
    "--speculative-draft-model": (["--speculative-draft-model", "/d"], "draft models", None),
    "--speculative-dflash-block-size": (
        ["--speculative-dflash-block-size", "4"],
        "DFlash",
        None,
    ),
    "--kv-transfer-config": (["--kv-transfer-config", "{}"], "connector", None),
}
# Values of working flags that steadylm cannot honour: (argv, words the error names).
REFUSED_VALUES = [
    (["--speculative-algorithm", "eagle3"], "ngram and suffix"),
    (["--device", "ascend"], "cuda or cpu"),
    (["--quant-policy", "fp8"], "fp8"),
    (["--model-format", "gptq"], "hf and awq"),
    (["--generation-config", "/some/dir"], "generation_config.json"),
    (["--chat-template", "internlm2"], "Jinja"),
    (["--ssl"], "SSL_KEYFILE"),
]
VLLM_ALIASES = {
    "--max-model-len": (["--max-model-len", "128"], _ec(session_len=128)),
    "--served-model-name": (["--served-model-name", "x"], _ns(model_name="x")),
    "--max-num-seqs": (["--max-num-seqs", "4"], _ec(max_batch_size=4)),
    "--enforce-eager": (["--enforce-eager"], _ec(eager_mode=True)),
    "--tensor-parallel-size": (["--tensor-parallel-size", "1"], _ec(tp=1)),
    "--host": (["--host", "0.0.0.0"], _ns(server_name="0.0.0.0")),
    "--port": (["--port", "8000"], _ns(server_port=8000)),
    "--model": (["--model", "MODEL"], lambda a: a.model.endswith("m")),
    "--gpu-memory-utilization": (
        ["--gpu-memory-utilization", "0.5"],
        _ec(gpu_memory_utilization=0.5),
    ),
    "--trust-remote-code": (["--trust-remote-code"], lambda a: True),
}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    return d


def checked(model_dir, argv: list[str], caplog=None):
    """Parse `steadylm serve` as the CLI does and run its checks (nothing is loaded)."""
    argv = [str(model_dir.parent / "t.jinja") if a == "TEMPLATE" else a for a in argv]
    if "--model" in argv:
        argv = [str(model_dir) if a == "MODEL" else a for a in argv]
        args = build_parser().parse_args(["serve", *argv])
    else:
        args = build_parser().parse_args(["serve", str(model_dir), *argv])
    serve_cli.check_args(args)
    return args


def test_the_table_covers_every_lmdeploy_api_server_flag():
    covered = set(WORKS) | set(NO_EFFECT) | set(REFUSED)
    assert len(LMDEPLOY_API_SERVER_FLAGS) == 77
    assert covered == set(LMDEPLOY_API_SERVER_FLAGS)
    assert not set(WORKS) & set(NO_EFFECT) and not set(REFUSED) & (set(WORKS) | set(NO_EFFECT))


@pytest.mark.parametrize("flag", sorted(WORKS))
def test_lmdeploy_flag_works(flag, model_dir):
    argv, ok = WORKS[flag]
    if flag == "--ssl":
        pytest.skip("needs SSL_KEYFILE/SSL_CERTFILE: test_ssl_reads_the_key_and_cert_from_env")
    assert ok(checked(model_dir, argv))


@pytest.mark.parametrize("flag", sorted(NO_EFFECT))
def test_lmdeploy_flag_has_no_effect_and_says_so(flag, model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="steadylm.server"):
        args = checked(model_dir, NO_EFFECT[flag])
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith(flag + " ")]
    assert len(notes) == 1 and "no effect" in notes[0], caplog.text
    # ... and the engine config is the one steadylm builds without the flag.
    assert engine_config_from_args(args) == engine_config_from_args(checked(model_dir, []))


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_lmdeploy_flag_is_refused_with_the_reason(flag, model_dir):
    argv, words, accepted = REFUSED[flag]
    with pytest.raises(ConfigError) as e:
        checked(model_dir, argv)
    assert str(e.value).startswith(f"{flag} ") and words.lower() in str(e.value).lower()
    if accepted:
        checked(model_dir, accepted)  # LMDeploy's default is fine


@pytest.mark.parametrize("argv,words", REFUSED_VALUES, ids=lambda x: " ".join(x))
def test_values_steadylm_cannot_honour_are_refused(argv, words, model_dir, monkeypatch):
    monkeypatch.delenv("SSL_KEYFILE", raising=False)
    with pytest.raises(ConfigError) as e:
        checked(model_dir, argv)
    assert str(e.value).startswith(argv[0]) and words in str(e.value)


@pytest.mark.parametrize("flag", sorted(VLLM_ALIASES))
def test_vllm_spellings_mean_the_same(flag, model_dir):
    argv, ok = VLLM_ALIASES[flag]
    assert ok(checked(model_dir, argv))


def test_tensor_parallel_size_is_tp(model_dir):
    assert engine_config_from_args(checked(model_dir, ["--tensor-parallel-size", "2"])).tp == 2
    with pytest.raises(ConfigError, match="tp"):
        engine_config_from_args(checked(model_dir, ["--tp", "0"]))


def test_log_level_before_or_after_the_subcommand(model_dir):
    parse = build_parser().parse_args
    assert parse(["--log-level", "debug", "serve", str(model_dir)]).log_level == "DEBUG"
    args = parse(["--log-level", "ERROR", "serve", str(model_dir), "--log-level", "info"])
    assert args.sub_log_level == "INFO"
    with pytest.raises(SystemExit):
        parse(["serve", str(model_dir), "--log-level", "loud"])


def test_ssl_reads_the_key_and_cert_from_env(model_dir, tmp_path, monkeypatch):
    for name in ("SSL_KEYFILE", "SSL_CERTFILE"):
        (tmp_path / name).write_text("x")
        monkeypatch.setenv(name, str(tmp_path / name))
    checked(model_dir, ["--ssl"])
    assert serve_cli.ssl_files() == {
        "ssl_keyfile": str(tmp_path / "SSL_KEYFILE"),
        "ssl_certfile": str(tmp_path / "SSL_CERTFILE"),
    }


def _app(model_dir, argv: list[str], monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.get("/metrics")(lambda: "m")
    app.post("/v1/completions")(lambda: {"ok": True})
    serve_cli.configure_app(app, checked(model_dir, argv))
    kills = []
    monkeypatch.setattr(serve_cli.os, "kill", lambda pid, sig: kills.append(sig))
    return TestClient(app), kills


def test_cors_docs_metrics_and_terminate_on_the_app(model_dir, monkeypatch):
    plain, _ = _app(model_dir, [], monkeypatch)
    assert plain.get("/docs").status_code == 200 and plain.get("/metrics").status_code == 200
    assert (
        "access-control-allow-origin"
        not in plain.get("/metrics", headers={"origin": "http://a.example"}).headers
    )
    assert plain.get("/terminate").status_code == 404

    argv = [
        "--allow-origins",
        "http://a.example",
        "--disable-fastapi-docs",
        "--disable-metrics",
        "--allow-terminate-by-client",
        "--api-keys",
        "k",
    ]
    client, kills = _app(model_dir, argv, monkeypatch)
    pre = client.options(
        "/v1/completions",
        headers={"origin": "http://a.example", "access-control-request-method": "POST"},
    )
    assert pre.headers["access-control-allow-origin"] == "http://a.example"
    for path in ("/docs", "/redoc", "/openapi.json", "/metrics"):
        assert client.get(path).status_code == 404, path
    assert client.get("/terminate").status_code == 401 and kills == []
    r = client.get("/terminate", headers={"authorization": "Bearer k"})
    assert r.status_code == 200 and kills == [signal.SIGTERM]


def _cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "steadylm.entrypoints.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_hub_id_fails_fast_and_downloads_nothing():
    for argv in (["serve", "some-org/some-model"], ["serve", "--model", "some-org/some-model"]):
        out = _cli(*argv)
        assert out.returncode == 2
        assert out.stderr == (
            "error: model path 'some-org/some-model' does not exist; steadylm never downloads: "
            "pass a local HF model directory or .gguf file (download it first, e.g. with "
            "`huggingface-cli download`)\n"
        )


def test_a_refused_flag_is_one_line_and_exit_2(tmp_path):
    out = _cli("--log-level", "WARNING", "serve", str(tmp_path), "--adapters", "a=/lora")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        "error: --adapters a=/lora: LoRA adapters are not supported yet; leave it out"
    ]


@needs_shared
def test_a_port_in_use_fails_before_the_model_loads():
    """The server takes its port before loading (as vLLM does): a busy port is one line and
    exit 2 at once, not a uvicorn error after the load."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _cli("--log-level", "INFO", "serve", str(STORIES), "--port", str(port))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
    assert "loaded" not in out.stderr.lower() and "KV cache" not in out.stderr


@needs_shared
@pytest.mark.timeout(300)
def test_vllm_and_lmdeploy_flags_on_a_real_server():
    from tests.entrypoints.test_server import free_port, wait_healthy

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "steadylm.entrypoints.cli",
        "serve",
        str(STORIES),
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "64",
        "--port",
        str(port),
        "--max-model-len",
        "128",
        "--served-model-name",
        "x",
        "--max-num-seqs",
        "4",
        "--trust-remote-code",
        "--backend",
        "pytorch",
        "--disable-fastapi-docs",
        "--allow-terminate-by-client",
        "--log-level",
        "INFO",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout=180)  # a loaded 2-core machine is slow
        models = httpx.get(f"{base}/v1/models", timeout=60).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("x", 128)]
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": "x", "prompt": "Once upon a time", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{base}/docs", timeout=60).status_code == 404
        assert httpx.get(f"{base}/terminate", timeout=60).status_code == 200
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read()
    assert "--trust-remote-code (set): no effect, steadylm runs no remote code" in log
    assert "--backend pytorch: no effect" in log


def test_the_docs_table_lists_every_flag():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "lmdeploy_compat.md").read_text()
    section = doc[doc.index("## steadylm serve flags") :]
    for flag in [*LMDEPLOY_API_SERVER_FLAGS, *VLLM_ALIASES]:
        assert f"| `{flag}` |" in section, flag
