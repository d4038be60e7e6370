"""Frozen configuration objects, validated once.

`ModelConfig` is the HF config normalised into the few numbers the engine needs. `EngineConfig`
holds every knob a user sets (named as LMDeploy and vLLM users know them). Derived values are
properties; nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from steadylm.errors import ConfigError, ModelLoadError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
QUANT_POLICIES = (0, 4, 8)


def parse_dtype(name: str | torch.dtype, field_name: str = "dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        choices = ", ".join(sorted({"auto", "float32", "float16", "bfloat16"}))
        raise ConfigError(
            f"{field_name}={name!r} is not supported; choose one of {choices}"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers of one model, normalised from its HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: dict[str, Any] | None = None
    # Mixture of experts (0 experts: a dense model). `moe_layers` are the layers whose MLP is
    # the sparse block (the rest are dense MLPs of `intermediate_size`); each expert is an MLP
    # of `moe_intermediate_size`; Qwen2-MoE adds a gated shared expert.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    hf_config: Any = field(default=None, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: dict | None = None) -> ModelConfig:
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ModelLoadError(
                "config.json has no 'architectures' entry; cannot pick a model class"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        sliding = None
        if getattr(hf_config, "use_sliding_window", True):
            sliding = getattr(hf_config, "sliding_window", None)
        eos = (generation_config or {}).get("eos_token_id", hf_config.eos_token_id)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        dtype = getattr(hf_config, "dtype", None)
        if dtype is None and not isinstance(
            getattr(type(hf_config), "torch_dtype", None), property
        ):
            dtype = getattr(hf_config, "torch_dtype", None)  # transformers < 4.56
        quant = getattr(hf_config, "quantization_config", None)
        if quant is not None and not isinstance(quant, dict):
            quant = quant.to_dict()
        return cls(
            **_moe_fields(archs[0], hf_config),
            architecture=archs[0],
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=archs[0].startswith("Qwen3"),
            sliding_window=sliding,
            torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else "float32",
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            quantization=quant,
            hf_config=hf_config,
        )

    @classmethod
    def from_path(cls, path: str) -> ModelConfig:
        """Read a model directory or a bare config.json without loading any weight."""
        from transformers import AutoConfig

        from steadylm import gguf_file

        check_model_path(path)
        gguf_path = gguf_file.find_gguf(path)
        if gguf_path is not None:
            hf_config, dtype = gguf_file.load_hf_config(gguf_path)
            return dataclasses.replace(cls.from_hf(hf_config), torch_dtype=dtype)
        cfg_file = path if path.endswith(".json") else os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ModelLoadError(f"{cfg_file} not found: a model directory needs a config.json")
        try:
            hf_config = AutoConfig.from_pretrained(cfg_file if path.endswith(".json") else path)
        except (ValueError, KeyError, OSError) as exc:
            raise ModelLoadError(f"cannot read {cfg_file}: {exc}") from exc
        gen_file = os.path.join(os.path.dirname(cfg_file), "generation_config.json")
        gen = None
        if not path.endswith(".json") and os.path.isfile(gen_file):
            with open(gen_file) as f:
                gen = json.load(f)
        return cls.from_hf(hf_config, gen)


def _moe_fields(arch: str, hf: Any) -> dict[str, Any]:
    """The mixture-of-experts numbers, read as transformers' modeling files read them: Mixtral
    (every layer sparse, experts of `intermediate_size`, top-k always renormalised), Qwen2-MoE
    and Qwen3-MoE (`decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`; Qwen2-MoE's
    shared expert)."""
    if arch == "MixtralForCausalLM":
        n = hf.num_local_experts
        return dict(
            num_experts=n,
            num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=hf.intermediate_size,
            norm_topk_prob=True,
            moe_layers=tuple(range(hf.num_hidden_layers)) if n > 0 else (),
        )
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    n, step = hf.num_experts, getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    layers = tuple(
        i for i in range(hf.num_hidden_layers) if i not in dense and n > 0 and (i + 1) % step == 0
    )
    return dict(
        num_experts=n,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        shared_expert_intermediate_size=(
            getattr(hf, "shared_expert_intermediate_size", 0) or 0
            if arch == "Qwen2MoeForCausalLM"
            else 0
        ),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        moe_layers=layers,
    )


def check_model_path(path: str) -> None:
    """A model path that does not exist is the user's error, said the same way everywhere."""
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model path {path!r} does not exist; steadylm never downloads (a hub id is not "
            "a path): download the model first and pass its local directory or .gguf file"
        )


SPECULATIVE_METHODS = ("ngram", "suffix")
# vLLM's and LMDeploy's model-based methods: named, so the refusal can say why.
_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mtp", "deepseek_mtp", "dflash")
_SPEC_INTS = (
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "suffix_decoding_max_tree_depth",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's `--speculative-config` names and defaults.

    `ngram` (prompt lookup): the last `prompt_lookup_max` down to `prompt_lookup_min` tokens
    matched in the request's own prompt and output; what followed the latest match is proposed.
    `suffix`: the longest match (up to `suffix_decoding_max_tree_depth` tokens) of the output's
    end in the request's tokens and in recent requests' outputs
    (`suffix_decoding_max_cached_requests` of them), proposing the most frequent continuation
    while its probability stays at least `suffix_decoding_min_token_prob`, and at most
    `suffix_decoding_max_spec_factor` times the match length. Either way at most
    `num_speculative_tokens` a step; with `adaptive`, a request whose drafts stop paying
    proposes fewer, then none for a while."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None  # ngram: 5; suffix: the tree depth (as vLLM)
    prompt_lookup_max: int | None = None  # vLLM: both 5 by default; one given sets the other
    prompt_lookup_min: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method in _MODEL_METHODS:
            raise ConfigError(
                f"speculative method {self.method!r} is not supported: steadylm proposes "
                f"drafts with {' or '.join(SPECULATIVE_METHODS)} (no draft or EAGLE model yet)",
                param="speculative_config.method",
            )
        _check(
            self.method in SPECULATIVE_METHODS,
            "speculative_config.method",
            f"speculative method {self.method!r} is not one of {SPECULATIVE_METHODS}",
        )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.num_speculative_tokens is None:
            k = 5 if self.method == "ngram" else self.suffix_decoding_max_tree_depth
            object.__setattr__(self, "num_speculative_tokens", k)
        for name in _SPEC_INTS:
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 64,
                f"speculative_config.{name}",
                f"speculative_config {name}={value!r} must be an int in [1, 64]",
            )
        n = self.suffix_decoding_max_cached_requests
        _check(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0,
            "speculative_config.suffix_decoding_max_cached_requests",
            f"suffix_decoding_max_cached_requests={n!r} must be an int >= 0",
        )
        _check(
            lo <= hi,
            "speculative_config.prompt_lookup_min",
            f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}",
        )
        f = self.suffix_decoding_max_spec_factor
        _check(
            _is_number(f) and f > 0,
            "speculative_config.suffix_decoding_max_spec_factor",
            f"suffix_decoding_max_spec_factor={f!r} must be > 0",
        )
        p = self.suffix_decoding_min_token_prob
        _check(
            _is_number(p) and 0 <= p <= 1,
            "speculative_config.suffix_decoding_min_token_prob",
            f"suffix_decoding_min_token_prob={p!r} must be in [0, 1]",
        )

    @classmethod
    def from_dict(cls, value: dict | str) -> SpeculativeConfig:
        """vLLM's `--speculative-config` (a JSON object, or its text)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"speculative_config is not JSON: {exc}", param="speculative_config"
                ) from None
        if not isinstance(value, dict):
            raise ConfigError(
                "speculative_config must be a JSON object", param="speculative_config"
            )
        value = dict(value)
        model = value.pop("model", None)
        if model:  # a draft model: vLLM infers the method from it
            method = value.setdefault("method", "draft_model")
            if method in SPECULATIVE_METHODS:
                raise ConfigError(
                    f"speculative method {method!r} takes no draft model (model={model!r})",
                    param="speculative_config.model",
                )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(
                f"speculative_config does not take {', '.join(unknown)}; it takes "
                f"{', '.join(sorted(known | {'model'}))}",
                param="speculative_config",
            )
        return cls(**value)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine knob, with LMDeploy's names and defaults where LMDeploy has the knob.

    Memory budget precedence (see `steadylm.memory`): exactly one of `num_gpu_blocks`,
    `max_total_tokens`, `kv_cache_bytes`, `gpu_memory_utilization` and `cache_max_entry_count`
    decides the KV pool. Setting two of them is an error; with none set, `cache_max_entry_count`
    applies at its LMDeploy default of 0.8.
    """

    dtype: str = "auto"
    device: str = "auto"
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int = 128
    max_prefill_token_num: int = 4096
    block_size: int = 64
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    num_gpu_blocks: int = 0
    max_total_tokens: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    cache_max_entry_count: float | None = None
    watermark_blocks: int | None = None
    eviction_type: str = "recompute"
    seed: int = 0
    eager_mode: bool = False  # CUDA: no decode CUDA graphs (LMDeploy's name; vLLM's enforce_eager)
    dist_timeout_s: float = 60.0  # tp > 1: a collective waiting longer than this fails
    log_stats_interval_s: float = 10.0
    plan_notes: tuple[str, ...] = ()  # said with the memory plan (e.g. a knob that lost)
    speculative_config: SpeculativeConfig | None = None  # speculative decoding (None: off)
    # vLLM's: "fcfs" (arrival order), or "priority" (SamplingParams.priority, lower first; a
    # waiting request may preempt running ones of a larger value)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _check_positive(self, "tp", "max_batch_size", "max_prefill_token_num", "block_size")
        _check(
            self.scheduling_policy in ("fcfs", "priority"),
            "scheduling_policy",
            f"scheduling_policy={self.scheduling_policy!r} is not 'fcfs' or 'priority'",
        )
        if self.session_len is not None:
            _check_positive(self, "session_len")
        _check(
            self.quant_policy in QUANT_POLICIES,
            "quant_policy",
            f"quant_policy={self.quant_policy} is not one of {QUANT_POLICIES}",
        )
        _check(self.num_gpu_blocks >= 0, "num_gpu_blocks", "num_gpu_blocks must be >= 0")
        _check(
            self.eviction_type == "recompute",
            "eviction_type",
            f"eviction_type={self.eviction_type!r}: only 'recompute' is supported",
        )
        for name in ("gpu_memory_utilization", "cache_max_entry_count"):
            value = getattr(self, name)
            _check(
                value is None or 0.0 < value <= 1.0,
                name,
                f"{name}={value} must be in (0, 1]",
            )
        for name in ("max_total_tokens", "kv_cache_bytes"):
            value = getattr(self, name)
            _check(value is None or value > 0, name, f"{name}={value} must be positive")
        _check(
            self.dist_timeout_s > 0, "dist_timeout_s", f"dist_timeout_s={self.dist_timeout_s} > 0"
        )
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        spec = self.speculative_config
        if isinstance(spec, (dict, str)):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(spec))
        _check(
            self.speculative_config is None
            or isinstance(self.speculative_config, SpeculativeConfig),
            "speculative_config",
            "speculative_config must be a SpeculativeConfig, a dict or None",
        )

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(message, param=name)


def _check_positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        _check(
            isinstance(value, int) and value > 0, name, f"{name}={value!r} must be a positive int"
        )
