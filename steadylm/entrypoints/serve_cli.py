"""`steadylm serve MODEL_DIR`: the OpenAI-compatible server, flags named as in LMDeploy's
`api_server` (with vLLM's spellings accepted too: --host/--port, --max-model-len, ...).
LMDeploy flags steadylm has no knob for are in serve_compat.py."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

from steadylm.config import SPECULATIVE_METHODS, check_model_path
from steadylm.entrypoints import serve_compat
from steadylm.errors import ConfigError

logger = logging.getLogger("steadylm.server")

DEFAULT_MAX_CHOICES = 128  # prompts x n in one request (the server's default too)
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# vLLM's names for LMDeploy's engine flags: the same option, so the same meaning.
ENGINE_ALIASES = {
    "--session-len": ["--max-model-len"],
    "--max-batch-size": ["--max-num-seqs"],
    "--tp": ["--tensor-parallel-size"],
    "--block-size": ["--cache-block-seq-len"],
    "--eager-mode": ["--enforce-eager"],
}
DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")


def add_parser(sub, add_engine_flags) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI and Anthropic HTTP APIs",
        description="Routes: POST /v1/chat/completions, /v1/completions, /v1/responses "
        "(OpenAI), /v1/messages and /v1/messages/count_tokens (Anthropic), /tokenize and "
        "/detokenize (vLLM); GET /v1/models, /v1/models/{id}, /health, /metrics (ours and "
        "vLLM's series names). LMDeploy's `api_server` flags and vLLM's spellings of them "
        "are accepted; docs/lmdeploy_compat.md gives each one's outcome.",
    )
    p.add_argument(
        "model",
        nargs="?",
        help="a local HF model directory or .gguf file (nothing is downloaded)",
    )
    p.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same, vLLM's spelling")
    _add_server_flags(p)
    _add_lmdeploy_server_flags(p)
    add_engine_flags(p, ENGINE_ALIASES)
    serve_compat.add_compat_flags(p)


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server-name",
        "--host",
        dest="server_name",
        default="127.0.0.1",
        help="address to bind (LMDeploy binds 0.0.0.0; steadylm binds loopback unless told)",
    )
    p.add_argument(
        "--server-port",
        "--port",
        dest="server_port",
        type=int,
        default=23333,
        help="port (0: any free one, named in the INFO log); taken before the model loads",
    )
    p.add_argument(
        "--model-name",
        "--served-model-name",
        dest="model_name",
        default=None,
        help="the name clients pass as `model`; unset: the directory's name",
    )
    p.add_argument(
        "--api-keys",
        nargs="*",
        default=None,
        help="accepted Bearer keys for /v1 routes (an empty key is refused at startup)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="choices in flight (a request of 4 prompts x n=2 counts 8) before new requests get "
        "503 + Retry-After; unset: no limit",
    )
    p.add_argument(
        "--max-choices-per-request",
        type=int,
        default=DEFAULT_MAX_CHOICES,
        help="prompts x n in one request; more is a 400",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 before they are read",
    )
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    p.add_argument(
        "--reasoning-parser",
        choices=["deepseek-r1", "deepseek_r1", "qwen3"],
        default=None,
        help="split <think>...</think> into message.reasoning_content (and stream it as "
        "delta.reasoning_content); structured output then applies to the answer only",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=[
            "hermes",
            "qwen",
            "qwen2_5",
            "qwen3",
            "llama3",
            "llama3_json",
            "pythonic",
            "llama4_pythonic",
        ],  # fmt: skip
        default=None,
        help="read tool calls out of the answer for tool_choice 'auto' (hermes: Qwen2.5/3's "
        "<tool_call> blocks; llama3_json: Llama 3.x JSON calls; pythonic: Llama 3.2+/4's "
        "[f(a=1)] lists; qwen3_coder: Qwen3-Coder's XML calls); 'required' and named "
        "functions work without it (forced by structured output)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's switch for tool_choice 'auto'; here --tool-call-parser alone enables it",
    )
    p.add_argument(
        "--graceful-shutdown-s",
        type=float,
        default=30.0,
        help="on SIGTERM, time given to running requests before they are aborted",
    )
    p.add_argument(
        "--log-level",
        dest="sub_log_level",
        metavar="LEVEL",
        type=parse_log_level,
        default=None,
        help="as `steadylm --log-level X serve`; given here too, this one wins",
    )


def _add_lmdeploy_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LMDeploy api_server flags that work as in LMDeploy")
    g.add_argument(
        "--allow-origins",
        nargs="+",
        default=None,
        help="CORS: allowed origins; unset: no CORS headers (LMDeploy's default is '*')",
    )
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--allow-methods", nargs="+", default=["*"], help="CORS: allowed methods")
    g.add_argument("--allow-headers", nargs="+", default=["*"], help="CORS: allowed headers")
    g.add_argument(
        "--ssl",
        action="store_true",
        help="serve HTTPS with the files named by SSL_KEYFILE and SSL_CERTFILE",
    )
    g.add_argument(
        "--disable-fastapi-docs", action="store_true", help="no /docs, /redoc, /openapi.json"
    )
    g.add_argument("--disable-metrics", action="store_true", help="no /metrics route")
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help="a request's deadline when its body gives no `timeout`: past it the request ends "
        'with its output so far (finish_reason "timeout") and its KV is freed (default: none)',
    )
    g.add_argument(
        "--metrics-names",
        choices=("steadylm", "vllm", "both"),  # server.metrics.METRICS_NAMES
        default="both",
        help="/metrics series: ours (steadylm_*), vLLM's names and units (vllm:*, labelled "
        "model_name, for vLLM dashboards, autoscalers and gateways), or both",
    )
    g.add_argument(
        "--allow-terminate-by-client",
        action="store_true",
        help="GET /terminate stops the server gracefully (with --api-keys it needs a key)",
    )
    g.add_argument(
        "--model-format",
        choices=["hf", "awq", "gptq", "compressed-tensors", "fp8", "mxfp4"],
        default=None,
        help="hf and awq are read from config.json anyway; the others are not supported",
    )
    g.add_argument(
        "--generation-config",
        default=None,
        help="auto or lmdeploy: steadylm reads only eos_token_id from the model's "
        "generation_config.json; requests set their own sampling values",
    )


def parse_log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid log level {text!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    return level


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no model: a rejected flag or a missing directory fails here, in
    one line, before minutes of loading. Sets `args.model`; logs the no-effect flags."""
    for note in serve_compat.check_compat_flags(args):
        logger.info("%s", note)
    for note in _check_lmdeploy_values(args):
        logger.info("%s", note)
    if args.model and args.model_flag and args.model != args.model_flag:
        raise ConfigError(f"two models given ({args.model!r} and --model {args.model_flag!r})")
    args.model = args.model or args.model_flag
    if not args.model:
        raise ConfigError("a model is required: steadylm serve MODEL_DIR (or MODEL.gguf)")
    if not (os.path.isdir(args.model) or args.model.endswith(".gguf")):
        raise ConfigError(
            f"model path {args.model!r} does not exist; steadylm never downloads: pass a local "
            "HF model directory or .gguf file (download it first, e.g. with "
            "`huggingface-cli download`)",
            param="model",
        )
    check_model_path(args.model)
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise ConfigError(
            f"--chat-template {args.chat_template!r} is not a file: steadylm takes a Jinja "
            "template file (not LMDeploy's builtin template names)",
            param="chat_template",
        )
    if args.chat_template and args.chat_template.endswith(".json"):
        raise ConfigError(
            f"--chat-template {args.chat_template!r}: LMDeploy's JSON template config is not "
            "supported; pass a Jinja template file",
            param="chat_template",
        )
    if args.ssl:
        ssl_files()


def _check_lmdeploy_values(args: argparse.Namespace) -> list[str]:
    """LMDeploy flags that steadylm honours for some values and rejects for others."""
    notes = []
    if args.device in serve_compat.DEVICES_REJECTED:
        raise ConfigError(f"--device {args.device}: steadylm runs on cuda or cpu", param="device")
    if args.quant_policy not in (0, 4, 8):
        raise ConfigError(
            f"--quant-policy {args.quant_policy}: steadylm's KV cache is the model dtype (0), "
            "int8 (8) or int4 (4); fp8 and turbo_quant are not supported",
            param="quant_policy",
        )
    if args.speculative_draft_model:
        raise ConfigError(
            f"--speculative-draft-model {args.speculative_draft_model}: draft models are not "
            "supported yet; --speculative-algorithm ngram or suffix needs none",
            param="speculative_draft_model",
        )
    alg = args.speculative_algorithm
    if alg is not None and alg not in SPECULATIVE_METHODS:
        raise ConfigError(
            f"--speculative-algorithm {alg}: steadylm runs ngram and suffix (no draft model, "
            "EAGLE, MTP or DFlash yet)",
            param="speculative_algorithm",
        )
    fmt = args.model_format
    if fmt is not None and fmt not in serve_compat.MODEL_FORMATS_READ:
        raise ConfigError(
            f"--model-format {fmt}: steadylm reads hf and awq checkpoints only", param="model"
        )
    if fmt is not None:
        notes.append(f"--model-format {fmt}: no effect, the format is read from config.json")
    gen = args.generation_config
    if gen is not None and gen not in ("auto", "lmdeploy"):
        raise ConfigError(
            f"--generation-config {gen!r}: steadylm reads generation_config.json from the model "
            "directory only (auto or lmdeploy)",
            param="generation_config",
        )
    if gen is not None:
        notes.append(
            f"--generation-config {gen}: no effect, steadylm reads only eos_token_id from "
            "generation_config.json and takes sampling values from each request"
        )
    return notes


def ssl_files() -> dict[str, str]:
    """LMDeploy's --ssl: key and certificate paths from SSL_KEYFILE / SSL_CERTFILE."""
    names = ("SSL_KEYFILE", "SSL_CERTFILE")
    paths = {n: os.environ.get(n, "") for n in names}  # read at startup, as LMDeploy does
    missing = [n for n in names if not os.path.isfile(paths[n])]
    if missing:
        raise ConfigError(
            f"--ssl needs {' and '.join(missing)} set to existing files (the TLS key and "
            "certificate)",
            param="ssl",
        )
    return {"ssl_keyfile": paths["SSL_KEYFILE"], "ssl_certfile": paths["SSL_CERTFILE"]}


def configure_app(app, args: argparse.Namespace) -> None:
    """The LMDeploy server flags that shape the app: CORS, docs, /metrics, /terminate."""
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse

    from steadylm.entrypoints.server.protocol import error_body

    drop = set()
    if args.disable_fastapi_docs:
        drop.update(DOC_PATHS)
        app.openapi_url = app.docs_url = app.redoc_url = None
    if args.disable_metrics:
        drop.add("/metrics")
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", "") not in drop]
    if args.allow_terminate_by_client:
        keys = set(args.api_keys or [])

        async def terminate(request) -> JSONResponse:  # a Starlette route: no body to parse
            header = request.headers.get("authorization", "")
            key = header[7:] if header.lower().startswith("bearer ") else ""
            if keys and key not in keys:
                msg = "invalid or missing API key (Authorization: Bearer <key>)"
                body = error_body(msg, "authentication_error", None, 401)
                return JSONResponse(body, status_code=401)
            os.kill(os.getpid(), signal.SIGTERM)  # the same graceful stop as `kill -TERM`
            return JSONResponse({"status": "terminating"})

        app.add_route("/terminate", terminate, methods=["GET"])

    if args.allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allow_origins,
            allow_credentials=args.allow_credentials,
            allow_methods=args.allow_methods,
            allow_headers=args.allow_headers,
        )


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (IPv4 or IPv6 as `host` resolves; port 0: any
    free one), with SO_REUSEADDR as uvicorn sets it."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ConfigError(f"--server-name {host!r}: {e.strerror}") from e
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


def run(args: argparse.Namespace, engine_config) -> int:
    """Serve until SIGTERM. `check_args(args)` has run (cli.py calls it before the engine
    config is built, so a rejected flag is reported before anything else)."""
    import uvicorn

    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.entrypoints.server.app import ServerState, build_app, check_api_keys
    from steadylm.tokenizer import load_tokenizer

    check_api_keys(args.api_keys)  # before minutes of loading, not after
    tls = ssl_files() if args.ssl else {}
    # The port is taken before the engine loads, as vLLM does: a port in use fails now rather
    # than after minutes of loading, and tensor-parallel workers' sockets cannot take it meanwhile.
    sock = listen_socket(args.server_name, args.server_port)
    tokenizer = load_tokenizer(args.model)
    if args.reasoning_parser:  # a model without the thought markers fails before loading
        from steadylm.entrypoints.server.reasoning import REASONING_PARSERS, marker_ids

        marker_ids(tokenizer, REASONING_PARSERS[args.reasoning_parser])
    engine = LLMEngine.from_pretrained(args.model, engine_config, tokenizer)
    template = None
    if args.chat_template:
        with open(args.chat_template) as f:
            template = f.read()
    name = args.model_name or os.path.basename(os.path.normpath(args.model))
    state = ServerState(
        engine,
        tokenizer,
        name,
        args.api_keys,
        args.max_concurrent_requests,
        template,
        args.max_choices_per_request,
        args.max_request_body_bytes,
        args.reasoning_parser,
        args.tool_call_parser,
        args.metrics_names,
        args.request_timeout_s,
    )
    app = build_app(state)
    configure_app(app, args)

    @app.on_event("shutdown")
    def _shutdown() -> None:
        state.async_engine.shutdown()

    # uvicorn finishes in-flight requests on SIGTERM, then re-raises the signal under the
    # handler that was installed before it: make that a no-op so a graceful stop exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    scheme = "https" if tls else "http"
    port = sock.getsockname()[1]  # the bound one when --server-port 0
    logger.info("serving %s on %s://%s:%d", name, scheme, args.server_name, port)
    config = uvicorn.Config(
        app,
        host=args.server_name,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=args.graceful_shutdown_s,
        **tls,
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    if not server.started:
        return 1
    return 0
