"""`steadylm serve MODEL_DIR`: the OpenAI-compatible server, flags named as in LMDeploy's
`api_server` (with vLLM's --host/--port accepted too)."""

from __future__ import annotations

import argparse
import logging
import os
import signal

logger = logging.getLogger("steadylm.server")

DEFAULT_MAX_CHOICES = 128  # prompts x n in one request (the server's default too)
DEFAULT_MAX_BODY_BYTES = 16 * 2**20


def add_parser(sub, add_engine_flags) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", help="a local HF model directory")
    p.add_argument(
        "--server-name",
        "--host",
        dest="server_name",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: loopback only)",
    )
    p.add_argument("--server-port", "--port", dest="server_port", type=int, default=23333)
    p.add_argument(
        "--model-name",
        default=None,
        help="the name clients pass as `model` (default: the directory's name)",
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
        "503 + Retry-After (default: no limit)",
    )
    p.add_argument(
        "--max-choices-per-request",
        type=int,
        default=DEFAULT_MAX_CHOICES,
        help="prompts x n in one request; more is a 400 (default %(default)s)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 before they are read (default %(default)s)",
    )
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    p.add_argument(
        "--graceful-shutdown-s",
        type=float,
        default=30.0,
        help="on SIGTERM, time given to running requests before they are aborted",
    )
    add_engine_flags(p)


def run(args: argparse.Namespace, engine_config) -> int:
    import uvicorn

    from steadylm.api import ChatTemplateConfig
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.entrypoints.server.app import ServerState, build_app, check_api_keys
    from steadylm.tokenizer import load_tokenizer

    check_api_keys(args.api_keys)  # before minutes of loading, not after
    tokenizer = load_tokenizer(args.model)
    engine = LLMEngine.from_pretrained(args.model, engine_config)
    template = None
    if args.chat_template:
        template = ChatTemplateConfig(chat_template=args.chat_template).template_text()
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
    )
    app = build_app(state)

    @app.on_event("shutdown")
    def _shutdown() -> None:
        state.async_engine.shutdown()

    # uvicorn finishes in-flight requests on SIGTERM, then re-raises the signal under the
    # handler that was installed before it: make that a no-op so a graceful stop exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    logger.info("serving %s on http://%s:%d", name, args.server_name, args.server_port)
    uvicorn.run(
        app,
        host=args.server_name,
        port=args.server_port,
        log_level="warning",
        timeout_graceful_shutdown=args.graceful_shutdown_s,
    )
    return 0
