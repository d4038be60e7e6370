"""LMDeploy `api_server` flags on `steadylm serve` that steadylm has no knob for.

Each flag below either has no effect here (it only tunes LMDeploy internals: logged once at
INFO with the reason) or is rejected with the reason when set to anything but LMDeploy's
default (honouring it would change results or the deployment). The flags that work are real
options of `steadylm serve` (serve_cli.py, and the engine flags in cli.py).
docs/lmdeploy_compat.md lists every flag with its outcome.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any

from steadylm.errors import ConfigError

logger = logging.getLogger("steadylm.server")


@dataclass(frozen=True)
class CompatFlag:
    flag: str
    why: str
    reject: bool = False  # False: no effect (INFO); True: an error unless at `default`
    default: Any = None  # LMDeploy's default: the one value a rejected flag accepts
    kw: dict = field(default_factory=dict)  # argparse: type, nargs, choices, action

    @property
    def dest(self) -> str:
        return "compat_" + self.flag[2:].replace("-", "_")


_FLAG = {"action": "store_true"}
_INT, _FLOAT, _STR = {"type": int}, {"type": float}, {"type": str}
_NO_GRAPHS = (
    "steadylm captures decode CUDA graphs for batch sizes 1, 2, 4, ... up to --max-batch-size "
    "(--eager-mode turns them off)"
)
_NO_DOWNLOAD = "steadylm never downloads: the model is the local directory given"
_ONE_PROCESS = (
    "--tp > 1 starts worker processes on this machine (or joins a torchrun launch): NCCL on "
    "CUDA, gloo on CPU"
)

NO_EFFECT: tuple[CompatFlag, ...] = (
    CompatFlag(
        "--backend",
        "steadylm is one engine; both backends' flags are accepted",
        kw={"choices": ["pytorch", "turbomind"]},
    ),
    CompatFlag("--max-log-len", "steadylm never logs prompts", kw=_INT),
    CompatFlag("--revision", _NO_DOWNLOAD, kw=_STR),
    CompatFlag("--download-dir", _NO_DOWNLOAD, kw=_STR),
    CompatFlag(
        "--vision-max-batch-size", "steadylm serves text models (no vision encoder)", kw=_INT
    ),
    CompatFlag(
        "--allowed-media-domains",
        "steadylm serves text models and fetches no media URLs",
        kw={"nargs": "+"},
    ),
    CompatFlag(
        "--trust-remote-code",
        "steadylm runs no remote code: architectures come from its own registry",
        kw=_FLAG,
    ),
    CompatFlag(
        "--language-model-only", "steadylm loads only language models (no vision encoder)", kw=_FLAG
    ),
    CompatFlag("--cudagraph-capture-batch-sizes", _NO_GRAPHS, kw={"type": int, "nargs": "+"}),
    CompatFlag("--piecewise-cudagraph-max-tokens", _NO_GRAPHS, kw=_INT),
    CompatFlag("--kernel-block-size", "kernels read the KV blocks at --block-size", kw=_INT),
    CompatFlag(
        "--distributed-executor-backend", _ONE_PROCESS, kw={"choices": ["uni", "mp", "ray"]}
    ),
    CompatFlag("--communicator", _ONE_PROCESS, kw={"choices": ["nccl", "native", "cuda-ipc"]}),
    CompatFlag("--dist-init-addr", _ONE_PROCESS, kw=_STR),
    CompatFlag(
        "--migration-backend",
        "KV migration only happens in PD disaggregation, which steadylm does not run",
        kw={"choices": ["DLSlime", "Mooncake"]},
    ),
    CompatFlag(
        "--enable-microbatch",
        "a TurboMind/PyTorch-engine scheduling detail; steadylm "
        "schedules one token budget per step",
        kw=_FLAG,
    ),
    CompatFlag(
        "--enable-eplb",
        "expert load balancing needs expert parallelism, which steadylm has not (the experts "
        "are split over the tp ranks)",
        kw=_FLAG,
    ),
    CompatFlag(
        "--moe-a2a-backend",
        "no expert parallelism, so no all-to-all between ranks",
        kw={"choices": ["auto", "default", "deepep"]},
    ),
    CompatFlag(
        "--prefix-cache-state-budget",
        "SSM state checkpoints: steadylm serves no SSM models",
        kw=_INT,
    ),
    CompatFlag(
        "--prefix-cache-decode-state-interval",
        "SSM state checkpoints: steadylm serves no SSM models",
        kw=_INT,
    ),
    CompatFlag(
        "--num-tokens-per-iter",
        "TurboMind's prefill chunking; steadylm's per-step budget is --max-prefill-token-num",
        kw=_INT,
    ),
    CompatFlag(
        "--max-prefill-iters",
        "TurboMind's prefill chunking; steadylm's per-step budget is --max-prefill-token-num",
        kw=_INT,
    ),
    CompatFlag(
        "--async",
        "TurboMind's execution mode; steadylm's step loop always runs in the background",
        kw={"type": int, "choices": [0, 1]},
    ),
)

_PARALLEL = "steadylm runs one model replica, sharded over --tp ranks"
_TORCHRUN_LAUNCH = " (more than one node: launch with torchrun)"
_DLLM = "steadylm does not run diffusion LLMs"
REJECTED: tuple[CompatFlag, ...] = (
    CompatFlag("--dp", _PARALLEL + " (no data parallelism)", True, 1, _INT),
    CompatFlag("--ep", _PARALLEL + " (no expert parallelism)", True, 1, _INT),
    CompatFlag("--cp", _PARALLEL + " (no context parallelism)", True, 1, _INT),
    CompatFlag("--nnodes", _PARALLEL + _TORCHRUN_LAUNCH, True, 1, _INT),
    CompatFlag("--node-rank", _PARALLEL + " (more than one node: torchrun sets it)", True, 0, _INT),
    CompatFlag(
        "--role",
        "steadylm does not disaggregate prefill and decode",
        True,
        "Hybrid",
        {"choices": ["Hybrid", "Prefill", "Decode"]},
    ),
    CompatFlag(
        "--kv-transfer-config", "steadylm has no external KV-cache connector", True, None, _STR
    ),
    CompatFlag(
        "--proxy-url",
        "steadylm does not register with LMDeploy's proxy; add this server to the proxy yourself",
        True,
        None,
        _STR,
    ),
    CompatFlag("--adapters", "LoRA adapters are not supported yet", True, None, {"nargs": "*"}),
    CompatFlag(
        "--empty-init",
        "steadylm always loads the weights and the KV cache at start",
        True,
        False,
        _FLAG,
    ),
    CompatFlag(
        "--hf-overrides",
        "it would change the model's config; edit config.json instead",
        True,
        None,
        _STR,
    ),
    CompatFlag(
        "--rope-scaling-factor",
        "it would change the model's RoPE; steadylm reads rope_scaling from config.json",
        True,
        0.0,
        _FLOAT,
    ),
    CompatFlag(
        "--logprobs-mode",
        "steadylm returns logprobs of the processed distribution, as "
        "OpenAI does; raw logits/logprobs are not supported",
        True,
        None,
        {"choices": ["raw_logits", "raw_logprobs"]},
    ),
    CompatFlag(
        "--enable-return-routed-experts",
        "the experts a token was routed to are not returned",
        True,
        False,
        _FLAG,
    ),
    CompatFlag(
        "--enable-abort-handling",
        "steadylm has no /abort_request route; a request is aborted when its client disconnects",
        True,
        False,
        _FLAG,
    ),
    CompatFlag("--dllm-block-length", _DLLM, True, None, _INT),
    CompatFlag(
        "--dllm-unmasking-strategy",
        _DLLM,
        True,
        "low_confidence_dynamic",
        {"choices": ["low_confidence_dynamic", "low_confidence_static", "sequential"]},
    ),
    CompatFlag("--dllm-denoising-steps", _DLLM, True, None, _INT),
    CompatFlag("--dllm-confidence-threshold", _DLLM, True, 0.85, _FLOAT),
    CompatFlag(
        "--speculative-dflash-block-size",
        "DFlash speculative decoding is not supported (ngram and suffix are)",
        True,
        None,
        _INT,
    ),
)

MODEL_FORMATS_READ = ("hf", "awq")  # others: LMDeploy's gptq, compressed-tensors, fp8, mxfp4
DEVICES_REJECTED = ("ascend", "maca", "camb")


def add_compat_flags(p: argparse.ArgumentParser) -> None:
    """Two groups, so `--help` says at a glance which LMDeploy flags do nothing here."""
    g = p.add_argument_group(
        "LMDeploy api_server flags with no effect",
        "accepted so LMDeploy command lines run; each only tunes LMDeploy internals, and "
        "steadylm logs once at INFO why it has no effect here",
    )
    for c in NO_EFFECT:
        g.add_argument(c.flag, help=c.why, **_argparse_kw(c))
    g = p.add_argument_group(
        "LMDeploy api_server flags refused unless at LMDeploy's default",
        "honouring any other value would change results, so it is an error naming the reason",
    )
    for c in REJECTED:
        shown = "" if c.default is None or c.default is False else f" (accepted: {c.default})"
        g.add_argument(c.flag, help=c.why + shown, **_argparse_kw(c))


def _argparse_kw(c: CompatFlag) -> dict:
    # SUPPRESS: the attribute exists only when the flag was given.
    kw = {"dest": c.dest, "default": argparse.SUPPRESS, **c.kw}
    if kw.get("action") != "store_true" and "choices" not in kw:
        kw["metavar"] = c.flag[2:].upper().replace("-", "_")
    return kw


def check_compat_flags(args: argparse.Namespace) -> list[str]:
    """Raise ConfigError for a rejected flag; return the INFO lines for no-effect flags given."""
    notes = []
    for c in REJECTED:
        if hasattr(args, c.dest) and getattr(args, c.dest) != c.default:
            keep = "" if c.default is None or c.default is False else f" or at {c.default}"
            raise ConfigError(
                f"{c.flag} {_show(getattr(args, c.dest))}: {c.why}; leave it out{keep}",
                param=c.flag,
            )
    for c in NO_EFFECT:
        if hasattr(args, c.dest):
            notes.append(f"{c.flag} {_show(getattr(args, c.dest))}: no effect, {c.why}")
    return notes


def _show(value: Any) -> str:
    if value is True:
        return "(set)"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)
