"""LMDeploy-compatible types: `GenerationConfig`, `PytorchEngineConfig`,
`TurbomindEngineConfig`, `ChatTemplateConfig` and `Response`, with LMDeploy's field names and
defaults. Both engine configs map onto steadylm's one `EngineConfig`. A field steadylm does not
support is rejected when set to anything but its default, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from steadylm.config import EngineConfig
from steadylm.engine.request import SamplingParams
from steadylm.errors import ConfigError, RequestError

logger = logging.getLogger("steadylm")


@dataclass
class GenerationConfig:
    n: int = 1
    max_new_tokens: int = 512
    do_sample: bool = False
    top_p: float = 1.0
    top_k: int = 50
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] | None = None
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    response_format: dict | None = None
    logits_processors: list | None = None
    output_logits: str | None = None
    output_last_hidden_state: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "response_format",
            "logits_processors",
            "output_logits",
            "output_last_hidden_state",
        ):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"GenerationConfig.{name} is not supported by steadylm yet; leave it unset"
                )
        _need(
            isinstance(self.n, int) and self.n == 1,
            "n",
            f"n={self.n!r}: the pipeline returns one Response per prompt; use n=1 "
            "(the server supports n > 1)",
        )
        _need(
            _num(self.temperature) and 0 <= self.temperature <= 2,
            "temperature",
            f"temperature={self.temperature!r} must be in [0, 2]",
        )
        _need(
            _num(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"top_p={self.top_p!r} must be in (0, 1]",
        )
        _need(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            f"top_k={self.top_k!r} must be an int >= 0",
        )
        _need(
            _num(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            f"min_p={self.min_p!r} must be in [0, 1]",
        )
        _need(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            "max_new_tokens",
            f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1",
        )
        _need(
            _num(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"repetition_penalty={self.repetition_penalty!r} must be > 0",
        )
        _need(
            self.min_new_tokens is None
            or (isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0),
            "min_new_tokens",
            f"min_new_tokens={self.min_new_tokens!r} must be an int >= 0",
        )
        _need(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            "logprobs",
            f"logprobs={self.logprobs!r} must be an int >= 0",
        )
        _need(
            self.random_seed is None or isinstance(self.random_seed, int),
            "random_seed",
            f"random_seed={self.random_seed!r} must be an int",
        )
        for name in ("stop_words", "bad_words"):
            words = getattr(self, name)
            _need(
                words is None
                or (isinstance(words, list) and all(isinstance(w, str) and w for w in words)),
                name,
                f"{name} must be a list of non-empty strings, got {words!r}",
            )
        for name in ("stop_token_ids", "bad_token_ids"):
            ids = getattr(self, name)
            _need(
                ids is None
                or (isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)),
                name,
                f"{name} must be a list of token ids, got {ids!r}",
            )

    def to_sampling_params(self, tokenizer: Any = None) -> SamplingParams:
        """do_sample=False (or temperature 0) is greedy, as in LMDeploy."""
        greedy = not self.do_sample or self.temperature == 0
        bad = list(self.bad_token_ids or [])
        if self.bad_words and tokenizer is not None:
            bad += words_to_single_ids(tokenizer, self.bad_words, "bad_words")
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=0.0 if greedy else float(self.temperature),
            top_k=self.top_k,
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            repetition_penalty=float(self.repetition_penalty),
            seed=self.random_seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            bad_token_ids=tuple(bad),
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_new_tokens or 0,
            logprobs=self.logprobs,
        )


def words_to_single_ids(tokenizer: Any, words: list[str], param: str) -> list[int]:
    ids = []
    for w in words:
        enc = tokenizer.encode(w, add_special_tokens=False)
        if len(enc) != 1:
            raise RequestError(
                f"{param}: {w!r} is {len(enc)} tokens; only single-token words can be banned",
                param=param,
            )
        ids += enc
    return ids


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _need(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise RequestError(message, param=name)


@dataclass
class ChatTemplateConfig:
    """Override the model's chat template: `chat_template` is a Jinja string or a path."""

    model_name: str | None = None
    chat_template: str | None = None

    def template_text(self) -> str | None:
        t = self.chat_template
        if t and not t.lstrip().startswith("{") and t.endswith((".jinja", ".j2", ".txt")):
            with open(t) as f:
                return f.read()
        return t


@dataclass
class PytorchEngineConfig:
    dtype: str = "auto"
    tp: int = 1
    dp: int = 1
    ep: int = 1
    dp_rank: int = 0
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float = 0.8
    prefill_interval: int = 16
    block_size: int = 64
    num_cpu_blocks: int = 0
    num_gpu_blocks: int = 0
    adapters: dict | None = None
    max_prefill_token_num: int = 4096
    thread_safe: bool = False
    enable_prefix_caching: bool = False
    device_type: str = "cuda"
    eager_mode: bool = False
    custom_module_map: dict | None = None
    download_dir: str | None = None
    revision: str | None = None
    quant_policy: int = 0
    distributed_executor_backend: str | None = None
    # steadylm extensions (vLLM's names): absolute or total-memory budgets.
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    max_total_tokens: int | None = None

    def to_engine_config(self) -> EngineConfig:
        _reject_unsupported(self, _PYTORCH_UNSUPPORTED)
        if self.device_type not in ("cuda", "cpu"):
            raise ConfigError(
                f"device_type={self.device_type!r}: steadylm runs on cuda or cpu",
                param="device_type",
            )
        return _engine_config(
            self,
            block_size=self.block_size,
            max_prefill_token_num=self.max_prefill_token_num,
            device="cpu" if self.device_type == "cpu" else "auto",
        )


@dataclass
class TurbomindEngineConfig:
    dtype: str = "auto"
    model_format: str | None = None
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float = 0.8
    cache_chunk_size: int = -1
    cache_block_seq_len: int = 64
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    rope_scaling_factor: float = 0.0
    use_logn_attn: bool = False
    download_dir: str | None = None
    revision: str | None = None
    max_prefill_token_num: int = 8192
    num_tokens_per_iter: int = 0
    max_prefill_iters: int = 1
    communicator: str = "nccl"
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    max_total_tokens: int | None = None

    def to_engine_config(self) -> EngineConfig:
        _reject_unsupported(self, _TURBOMIND_UNSUPPORTED)
        if self.model_format not in (None, "hf", "awq"):
            raise ConfigError(
                f"model_format={self.model_format!r}: steadylm reads hf and awq "
                "checkpoints (the format is read from config.json)",
                param="model_format",
            )
        return _engine_config(
            self,
            block_size=self.cache_block_seq_len,
            max_prefill_token_num=self.max_prefill_token_num,
            device="auto",
        )


_PYTORCH_UNSUPPORTED = (
    "dp",
    "ep",
    "dp_rank",
    "prefill_interval",
    "num_cpu_blocks",
    "adapters",
    "custom_module_map",
    "download_dir",
    "revision",
    "distributed_executor_backend",
)
_TURBOMIND_UNSUPPORTED = (
    "cache_chunk_size",
    "rope_scaling_factor",
    "use_logn_attn",
    "download_dir",
    "revision",
    "num_tokens_per_iter",
    "max_prefill_iters",
    "communicator",
)
_WHY = {
    "prefill_interval": "steadylm schedules prefill chunks in every step within "
    "max_prefill_token_num",
    "num_cpu_blocks": "only eviction by recompute is supported (no swap to host memory)",
    "download_dir": "steadylm never downloads; pass a local model directory",
    "revision": "steadylm never downloads; pass a local model directory",
}


def _reject_unsupported(cfg: Any, names: tuple[str, ...]) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name in names:
        if getattr(cfg, name) != defaults[name]:
            why = _WHY.get(name, "it is not supported by steadylm yet")
            raise ConfigError(
                f"{type(cfg).__name__}.{name}={getattr(cfg, name)!r}: {why}; "
                f"leave it at {defaults[name]!r}",
                param=name,
            )


def _engine_config(cfg: Any, **kw: Any) -> EngineConfig:
    if cfg.dtype not in ("auto", "float16", "bfloat16", "float32"):
        raise ConfigError(
            f"dtype={cfg.dtype!r} must be auto, float16, bfloat16 or float32", param="dtype"
        )
    absolute = (
        cfg.gpu_memory_utilization
        or cfg.kv_cache_bytes
        or cfg.max_total_tokens
        or getattr(cfg, "num_gpu_blocks", 0)
    )
    # LMDeploy's 0.8 is a default, not a choice: another budget knob replaces it.
    ratio = None if absolute and cfg.cache_max_entry_count == 0.8 else cfg.cache_max_entry_count
    if ratio == 0.8:
        ratio = None  # steadylm's own default applies (0.8 on CUDA, 4 GiB on CPU)
    ec = EngineConfig(
        dtype=cfg.dtype,
        tp=cfg.tp,
        session_len=cfg.session_len,
        max_batch_size=cfg.max_batch_size or 128,
        enable_prefix_caching=cfg.enable_prefix_caching,
        quant_policy=cfg.quant_policy,
        num_gpu_blocks=getattr(cfg, "num_gpu_blocks", 0),
        cache_max_entry_count=ratio,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_bytes=cfg.kv_cache_bytes,
        max_total_tokens=cfg.max_total_tokens,
        **kw,
    )
    if ratio is not None:
        logger.info(
            "cache_max_entry_count=%s: LMDeploy's meaning, the share of memory free "
            "after the weights and the activation reserve (see the memory plan)",
            ratio,
        )
    return ec


@dataclass
class Response:
    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    error: str | None = None
    ttft_s: float | None = None  # time to first token
    tokens_per_s: float | None = None  # output tokens / seconds after the first token
    num_preemptions: int = 0

    def __repr__(self) -> str:  # LMDeploy-like, short
        return (
            f"Response(text={self.text!r}, generate_token_len={self.generate_token_len}, "
            f"input_token_len={self.input_token_len}, finish_reason={self.finish_reason!r}"
            + (f", error={self.error!r}" if self.error else "")
            + ")"
        )
