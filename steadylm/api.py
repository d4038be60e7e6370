"""LMDeploy-compatible types: `GenerationConfig`, `PytorchEngineConfig`,
`TurbomindEngineConfig`, `ChatTemplateConfig` and `Response`, with every field of LMDeploy
0.18's types, under LMDeploy's names and defaults. Both engine configs map onto steadylm's one
`EngineConfig`.

Each field has one of three outcomes (the `POLICY` tables below; docs/lmdeploy_compat.md lists
them): it works the same; it is accepted with no effect because it only tunes LMDeploy's
internals (said once at INFO, naming it); or, set to anything but its default, it is rejected
because honouring it would change results, with a message naming the field and the reason.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from steadylm.config import EngineConfig, SpeculativeConfig
from steadylm.engine.request import SamplingParams
from steadylm.engine.structured import from_response_format
from steadylm.entrypoints.server.reasoning import thinking_params
from steadylm.errors import ConfigError, RequestError

logger = logging.getLogger("steadylm")

WORKS, NO_EFFECT, REJECTED = "works", "accepted, no effect", "rejected"
_SAID: set[str] = set()  # no-effect fields already logged (once per process)


def apply_policy(cfg: Any, policy: dict[str, tuple[str, str]], error: type = ConfigError) -> None:
    """Log each no-effect field set away from its default (once), and raise `error` naming
    the first rejected one. Fields absent from `policy` work."""
    cls = type(cfg).__name__
    for f in dataclasses.fields(cfg):
        outcome, why = policy.get(f.name, (WORKS, ""))
        value = getattr(cfg, f.name)
        if outcome == WORKS or value == _default(f):
            continue
        if outcome == REJECTED:
            raise error(
                f"{cls}.{f.name}={value!r} is not supported: {why}. Leave it at {_default(f)!r}.",
                param=f.name,
            )
        key = f"{cls}.{f.name}"
        if key not in _SAID:
            _SAID.add(key)
            logger.info("%s=%r is accepted and has no effect in steadylm: %s", key, value, why)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


_DISAGG = "prefill/decode disaggregation is LMDeploy-internal; steadylm runs one engine"
_NO_VISION = "steadylm serves text-only models"
_NO_GRAPH = (
    "steadylm captures decode CUDA graphs for batch sizes 1, 2, 4, ... up to max_batch_size; "
    "eager_mode=True turns them off"
)
_NO_DOWNLOAD = "steadylm never downloads; pass a local model directory"
_EP = (
    "no expert parallelism: steadylm splits every expert's intermediate dim over the tp ranks "
    "(vLLM's default for MoE models); set tp"
)
_ROUTED = "the experts a token was routed to are not returned"


@dataclass
class GenerationConfig:
    """LMDeploy's generation parameters (every field of lmdeploy 0.18). `n > 1` falls back to
    1 with a warning, as LMDeploy's pipeline does; `max_new_tokens=None` fills the session."""

    n: int = 1
    max_new_tokens: int | None = 512
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
    logprob_start_len: int = -1
    response_format: dict | None = None
    logits_processors: list | None = None
    output_logits: str | None = None
    output_last_hidden_state: str | None = None
    include_stop_str_in_output: bool = False
    return_ppl: bool = False
    with_cache: bool = False
    preserve_cache: bool = False
    migration_request: Any = None
    return_routed_experts: bool = False
    repetition_ngram_size: int = 0
    repetition_ngram_threshold: int = 0
    # steadylm's (vLLM's server field): at most this many thought tokens between <think> and
    # </think>, then the engine closes the thought and the answer follows
    max_thinking_tokens: int | None = None
    # steadylm's (vLLM's `priority`): lower first under PytorchEngineConfig(scheduling_policy=
    # "priority"); and a deadline in seconds, then the answer ends there (finish_reason "timeout")
    priority: int = 0
    timeout: float | None = None

    POLICY: ClassVar[dict[str, tuple[str, str]]] = {
        "logprob_start_len": (REJECTED, "prompt-token logprobs are not returned yet"),
        "logits_processors": (REJECTED, "custom logits processors are not supported"),
        "output_logits": (REJECTED, "logits are not returned; use logprobs"),
        "output_last_hidden_state": (REJECTED, "hidden states are not returned"),
        "return_ppl": (REJECTED, "use Pipeline.get_ppl for perplexity"),
        "with_cache": (NO_EFFECT, _DISAGG),
        "preserve_cache": (NO_EFFECT, _DISAGG),
        "migration_request": (REJECTED, _DISAGG),
        "return_routed_experts": (REJECTED, _ROUTED),
        "repetition_ngram_size": (REJECTED, "n-gram repetition early stop is not supported"),
        "repetition_ngram_threshold": (
            REJECTED,
            "n-gram repetition early stop is not supported",
        ),
    }

    def __post_init__(self) -> None:
        if self.repetition_ngram_size <= 0 or self.repetition_ngram_threshold <= 0:
            self.repetition_ngram_size = self.repetition_ngram_threshold = 0  # as LMDeploy
        apply_policy(self, self.POLICY, RequestError)
        _need(
            isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1,
            "n",
            f"n={self.n!r} must be a positive int",
        )
        if self.n > 1:
            logger.warning(
                "n(%d) > 1 is not supported by the pipeline; falling back to 1, "
                "as LMDeploy does (the server supports n > 1)",
                self.n,
            )
            self.n = 1
        _need(
            _num(self.temperature) and 0 <= self.temperature <= 2,
            "temperature",
            f"temperature={self.temperature!r} must be in [0, 2]",
        )
        _need(
            _num(self.top_p) and 0 <= self.top_p <= 1,
            "top_p",
            f"top_p={self.top_p!r} must be in [0, 1]",
        )
        _need(
            _int(self.top_k) and self.top_k >= 0,
            "top_k",
            f"top_k={self.top_k!r} must be an int >= 0",
        )
        _need(
            _num(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            f"min_p={self.min_p!r} must be in [0, 1]",
        )
        _need(
            self.max_new_tokens is None or (_int(self.max_new_tokens) and self.max_new_tokens >= 1),
            "max_new_tokens",
            f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1 (or None: fill the "
            "session)",
        )
        _need(
            _num(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"repetition_penalty={self.repetition_penalty!r} must be > 0",
        )
        _need(
            self.min_new_tokens is None or (_int(self.min_new_tokens) and self.min_new_tokens >= 0),
            "min_new_tokens",
            f"min_new_tokens={self.min_new_tokens!r} must be an int >= 0",
        )
        _need(
            self.logprobs is None or (_int(self.logprobs) and self.logprobs >= 0),
            "logprobs",
            f"logprobs={self.logprobs!r} must be an int >= 0",
        )
        _need(
            self.random_seed is None or _int(self.random_seed),
            "random_seed",
            f"random_seed={self.random_seed!r} must be an int",
        )
        from_response_format(self.response_format)  # a malformed one names its field now
        _need(
            self.max_thinking_tokens is None
            or (_int(self.max_thinking_tokens) and self.max_thinking_tokens >= 0),
            "max_thinking_tokens",
            f"max_thinking_tokens={self.max_thinking_tokens!r} must be an int >= 0",
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
                ids is None or (isinstance(ids, list) and all(_int(t) and t >= 0 for t in ids)),
                name,
                f"{name} must be a list of token ids, got {ids!r}",
            )

    def convert_stop_bad_words_to_ids(self, tokenizer: Any) -> None:
        """LMDeploy's method: add the ids of the single-token stop and bad words to
        stop_token_ids / bad_token_ids (a word of several tokens is skipped with a warning, as
        LMDeploy does). steadylm also matches stop words on text, so they may span tokens."""

        def ids(words: list[str] | None) -> list[int]:
            out = []
            for w in words or []:
                enc = tokenizer.encode(w, add_special_tokens=False)
                if len(enc) == 1:
                    out += enc
                else:
                    logger.warning(
                        "the word %r is %d tokens; it has no single token id", w, len(enc)
                    )
            return out

        stop = ids(self.stop_words) + list(self.stop_token_ids or [])
        bad = ids(self.bad_words) + list(self.bad_token_ids or [])
        self.stop_token_ids = sorted(set(stop)) or None
        self.bad_token_ids = sorted(set(bad)) or None

    def update_from_hf_gen_cfg(self, generation_config: dict, tokenizer_eos_token_id) -> None:
        """LMDeploy's method: add the tokenizer's and generation_config.json's EOS ids to
        stop_token_ids."""
        stop = set(self.stop_token_ids or [])
        if tokenizer_eos_token_id is not None:
            stop.add(tokenizer_eos_token_id)
        eos = (generation_config or {}).get("eos_token_id")
        if eos is not None:
            stop.update([eos] if isinstance(eos, int) else eos)
        self.stop_token_ids = sorted(stop)

    def to_sampling_params(
        self, tokenizer: Any = None, max_new_tokens: int | None = None
    ) -> SamplingParams:
        """do_sample=False (or temperature 0) is greedy, as in LMDeploy. `max_new_tokens`
        stands in for a None field (the room left in the session)."""
        greedy = not self.do_sample or self.temperature == 0
        bad = list(self.bad_token_ids or [])
        if self.bad_words and tokenizer is not None:
            bad += words_to_single_ids(tokenizer, self.bad_words, "bad_words")
        top_p, top_k = float(self.top_p), self.top_k
        if top_p == 0:  # LMDeploy accepts 0: only the most likely token survives
            top_p, top_k = 1.0, 1
        return SamplingParams(
            max_new_tokens=self.max_new_tokens or max_new_tokens or 1,
            temperature=0.0 if greedy else float(self.temperature),
            top_k=top_k,
            top_p=top_p,
            min_p=float(self.min_p),
            repetition_penalty=float(self.repetition_penalty),
            seed=self.random_seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            bad_token_ids=tuple(bad),
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_new_tokens or 0,
            logprobs=self.logprobs,
            structured_outputs=from_response_format(self.response_format),
            thinking=thinking_params(tokenizer, None, self.max_thinking_tokens),
            priority=self.priority,
            timeout=self.timeout,
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


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _need(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise RequestError(message, param=name)


_LLAMA2_SYSTEM = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, "
    "while being safe. Your answers should not include any harmful, unethical, racist, sexist, "
    "toxic, dangerous, or illegal content. Please ensure that your responses are socially "
    "unbiased and positive in nature.\n\nIf a question does not make any sense, or is not "
    "factually coherent, explain why instead of answering something not correct. If you don't "
    "know the answer to a question, please don't share false information."
)
# LMDeploy 0.18's built-in templates for the families steadylm loads ('hf', the default, is
# the tokenizer's own template: what LMDeploy uses for Llama 3, Qwen2.5 and DeepSeek-R1).
BUILTIN_TEMPLATES: dict[str, dict[str, Any]] = {
    "base": {},
    "llama2": dict(
        system="[INST] <<SYS>>\n",
        meta_instruction=_LLAMA2_SYSTEM,
        eosys="\n<</SYS>>\n\n",
        assistant=" [/INST] ",
        eoa="</s>",
        separator="<s>[INST] ",
    ),
    "mistral": dict(user="[INST] ", eoh=" [/INST]", eoa="</s>"),
    "mixtral": dict(user="[INST] ", eoh=" [/INST]", eoa="</s>"),
    "vicuna": dict(
        meta_instruction="A chat between a curious user and an artificial intelligence "
        "assistant. The assistant gives helpful, detailed, and polite answers to the user's "
        "questions.",
        eosys=" ",
        user="USER: ",
        eoh=" ",
        assistant="ASSISTANT: ",
        eoa="</s>",
        stop_words=["</s>"],
    ),
}
_PIECES = (
    "system",
    "meta_instruction",
    "eosys",
    "user",
    "eoh",
    "assistant",
    "eoa",
    "tool",
    "eotool",
    "separator",
    "capability",
    "stop_words",
)


@dataclass
class ChatTemplateConfig:
    """LMDeploy's chat template config. `model_name` picks a template: 'hf' (or None) is the
    tokenizer's own; 'llama2', 'mistral', 'mixtral', 'vicuna' and 'base' are LMDeploy's
    built-ins; the other fields override pieces of it, as in LMDeploy (an unknown name builds
    LMDeploy's base template from the pieces, with a warning). With the tokenizer's template,
    `meta_instruction` becomes the system message when the conversation has none.
    `chat_template` (steadylm's extension) is a Jinja string or a path to one."""

    model_name: str | None = None
    model_path: str | None = None
    system: str | None = None
    meta_instruction: str | None = None
    eosys: str | None = None
    user: str | None = None
    eoh: str | None = None
    assistant: str | None = None
    eoa: str | None = None
    tool: str | None = None
    eotool: str | None = None
    separator: str | None = None
    capability: str | None = None
    stop_words: list[str] | None = None
    chat_template: str | None = None

    def template_text(self) -> str | None:
        """The Jinja template to use instead of the tokenizer's, if `chat_template` is set."""
        t = self.chat_template
        if t and not t.lstrip().startswith("{") and t.endswith((".jinja", ".j2", ".txt")):
            with open(t) as f:
                return f.read()
        return t

    def uses_tokenizer_template(self) -> bool:
        return self.chat_template is None and self.model_name in (None, "hf")

    def pieces(self) -> dict[str, Any]:
        """LMDeploy's BaseChatTemplate pieces: the built-in's, overridden by fields set here."""
        if self.model_name not in BUILTIN_TEMPLATES:
            logger.warning(
                "chat template %r is not built in (built in: hf, %s); building "
                "LMDeploy's base template from the fields given",
                self.model_name,
                ", ".join(BUILTIN_TEMPLATES),
            )
        base = {k: "" for k in _PIECES if k not in ("capability", "stop_words")}
        base.update(capability="chat", stop_words=None)
        base.update(BUILTIN_TEMPLATES.get(self.model_name, {}))
        base.update({k: getattr(self, k) for k in _PIECES if getattr(self, k) is not None})
        return base

    def formatter(self):
        """A function (messages, add_generation_prompt) -> prompt text for a built-in or
        piece-built template, or None when the tokenizer's (or a Jinja) template applies."""
        if self.uses_tokenizer_template() or self.chat_template is not None:
            return None
        p = self.pieces()
        return lambda messages, add_generation_prompt=True: base_template(
            p, messages, add_generation_prompt
        )

    def to_json(self, file_path: str | None = None) -> str:
        text = json.dumps(dataclasses.asdict(self), ensure_ascii=False, indent=4)
        if file_path:
            with open(file_path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, file_or_string: str) -> ChatTemplateConfig:
        try:
            with open(file_or_string, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            text = file_or_string
        return cls(**json.loads(text))


def base_template(p: dict[str, Any], messages: list[dict], add_generation_prompt: bool) -> str:
    """LMDeploy's `BaseChatTemplate.messages2prompt`, piece for piece."""
    if p["capability"] == "completion":
        return "".join(str(m["content"]) for m in messages)
    box = dict(user=p["user"], assistant=p["assistant"], system=p["system"], tool=p["tool"])
    eox = dict(
        user=p["eoh"],
        assistant=p["eoa"] + p["separator"],
        system=p["eosys"],
        tool=p["eotool"],
    )
    out = ""
    if p["meta_instruction"] is not None and messages and messages[0]["role"] != "system":
        out += f"{p['system']}{p['meta_instruction']}{p['eosys']}"
    for m in messages:
        out += f"{box.get(m['role'], '')}{m['content']}{eox.get(m['role'], '')}"
    if messages and messages[-1]["role"] == "assistant":
        end = eox["assistant"]
        return out[: -len(end)] if end else out  # the answer's prefix, to be continued
    return out + (p["assistant"] if add_generation_prompt else "")


_BUDGETS = ("gpu_memory_utilization", "kv_cache_bytes", "max_total_tokens")
_TP = "attention and MLP are split over the same tp ranks; set tp"
_TP_PROCS = "tp > 1 starts worker processes on this machine, or joins a torchrun launch"
_MULTI_NODE = "launch each node with torchrun; MASTER_ADDR / MASTER_PORT name rank 0 (README)"


@dataclass
class PytorchEngineConfig:
    """LMDeploy's PyTorch engine config (every field of lmdeploy 0.18), plus vLLM-style
    absolute budgets (`gpu_memory_utilization`, `kv_cache_bytes`, `max_total_tokens`).
    `max_prefill_token_num` defaults to 4096 where LMDeploy has 8192: the activation reserve
    it buys is half as large (1.17 vs 2.34 GiB for a 32B model), and that memory holds KV
    tokens instead; long prompts take more steps, with the same results."""

    dtype: str = "auto"
    tp: int = 1
    dp: int = 1
    dp_rank: int = 0
    ep: int = 1
    session_len: int | None = None
    max_batch_size: int | None = None
    attn_tp_size: int | None = None
    mlp_tp_size: int | None = None
    moe_tp_size: int | None = None
    cache_max_entry_count: float = 0.8
    prefill_interval: int = 16
    block_size: int = 64
    kernel_block_size: int = -1
    num_cpu_blocks: int = 0
    num_gpu_blocks: int = 0
    adapters: dict | None = None
    max_prefill_token_num: int = 4096
    cudagraph_capture_batch_sizes: list[int] | None = None
    thread_safe: bool = False
    enable_prefix_caching: bool = False
    prefix_cache_state_budget: int = 0
    prefix_cache_decode_state_interval: int = 0
    device_type: str = "cuda"
    eager_mode: bool = False
    custom_module_map: dict | None = None
    download_dir: str | None = None
    revision: str | None = None
    quant_policy: int = 0
    distributed_executor_backend: str | None = None
    empty_init: bool = False
    enable_microbatch: bool = False
    enable_eplb: bool = False
    enable_mp_engine: bool = False
    mp_engine_backend: str = "mp"
    model_format: str | None = None
    enable_metrics: bool = True
    hf_overrides: dict | None = None
    language_model_only: bool = False
    logprobs_mode: str | None = None
    enable_return_routed_experts: bool = False
    enable_transfer_obj_ref: bool = False
    dllm_block_length: int | None = None
    dllm_unmasking_strategy: str = "low_confidence_dynamic"
    dllm_denoising_steps: int | None = None
    dllm_confidence_threshold: float = 0.85
    role: Any = "Hybrid"
    migration_backend: Any = "DLSlime"
    kv_transfer_config: Any = None
    piecewise_cudagraph_max_tokens: int | None = None
    # steadylm extensions (vLLM's names): absolute or total-memory budgets.
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    max_total_tokens: int | None = None
    # steadylm extension: speculative decoding here as well as pipeline(speculative_config=)
    speculative_config: Any = None
    # steadylm extension (vLLM's name): "fcfs", or "priority" (GenerationConfig.priority)
    scheduling_policy: str = "fcfs"

    POLICY: ClassVar[dict[str, tuple[str, str]]] = {
        "dp": (REJECTED, "data parallelism is not supported; run one engine per replica"),
        "dp_rank": (REJECTED, "data parallelism is not supported"),
        "ep": (REJECTED, _EP),
        "attn_tp_size": (REJECTED, _TP),
        "mlp_tp_size": (REJECTED, _TP),
        "moe_tp_size": (REJECTED, "the experts are split over all tp ranks, like the dense layers"),
        "prefill_interval": (
            NO_EFFECT,
            "steadylm schedules prefill chunks in every step, within max_prefill_token_num",
        ),
        "kernel_block_size": (NO_EFFECT, "attention kernels read block_size blocks directly"),
        "num_cpu_blocks": (
            NO_EFFECT,
            "steadylm preempts by recompute, with no swap space in host memory",
        ),
        "adapters": (REJECTED, "LoRA adapters are not supported"),
        "cudagraph_capture_batch_sizes": (NO_EFFECT, _NO_GRAPH),
        "thread_safe": (NO_EFFECT, "the pipeline is always safe to call from threads"),
        "prefix_cache_state_budget": (NO_EFFECT, "for state-space models, which are not loaded"),
        "prefix_cache_decode_state_interval": (
            NO_EFFECT,
            "for state-space models, which are not loaded",
        ),
        "custom_module_map": (REJECTED, "custom model modules are not loaded"),
        "download_dir": (NO_EFFECT, _NO_DOWNLOAD),
        "revision": (NO_EFFECT, _NO_DOWNLOAD),
        "distributed_executor_backend": (NO_EFFECT, _TP_PROCS),
        "empty_init": (REJECTED, "skipping weight loading would change every result"),
        "enable_microbatch": (NO_EFFECT, "a scheduling detail of LMDeploy's engine"),
        "enable_eplb": (
            NO_EFFECT,
            "expert load balancing needs expert parallelism (ep), which steadylm has not",
        ),
        "enable_mp_engine": (NO_EFFECT, "steadylm's engine loop runs in a background thread"),
        "mp_engine_backend": (NO_EFFECT, "steadylm's engine loop runs in a background thread"),
        "enable_metrics": (NO_EFFECT, "the server always exports /metrics"),
        "hf_overrides": (REJECTED, "overriding the model config would change results"),
        "language_model_only": (NO_EFFECT, _NO_VISION),
        "logprobs_mode": (REJECTED, "logprobs are those of the processed distribution only"),
        "enable_return_routed_experts": (REJECTED, _ROUTED),
        "enable_transfer_obj_ref": (NO_EFFECT, "an LMDeploy-internal transfer option"),
        "dllm_block_length": (REJECTED, "diffusion language models are not supported"),
        "dllm_unmasking_strategy": (REJECTED, "diffusion language models are not supported"),
        "dllm_denoising_steps": (REJECTED, "diffusion language models are not supported"),
        "dllm_confidence_threshold": (REJECTED, "diffusion language models are not supported"),
        "role": (REJECTED, _DISAGG),
        "migration_backend": (NO_EFFECT, _DISAGG),
        "kv_transfer_config": (REJECTED, _DISAGG),
        "piecewise_cudagraph_max_tokens": (NO_EFFECT, _NO_GRAPH),
    }

    def to_engine_config(self) -> EngineConfig:
        apply_policy(self, self.POLICY)
        if self.device_type not in ("cuda", "cpu"):
            raise ConfigError(
                f"device_type={self.device_type!r}: steadylm runs on cuda or cpu",
                param="device_type",
            )
        _check_model_format(self.model_format)
        return _engine_config(
            self,
            block_size=self.block_size,
            max_prefill_token_num=self.max_prefill_token_num,
            device="cpu" if self.device_type == "cpu" else "auto",
            eager_mode=self.eager_mode,
            speculative_config=speculative_config(self.speculative_config),
            scheduling_policy=self.scheduling_policy,
        )


@dataclass
class TurbomindEngineConfig:
    """LMDeploy's TurboMind config (every field of lmdeploy 0.18), run by steadylm's one
    engine: the fields that mean the same as the PyTorch engine's map onto them."""

    dtype: str = "auto"
    gemm_input_dtype: str | None = None
    model_format: str | None = None
    tp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    device_num: int | None = None
    attn_tp_size: int | None = None
    attn_cp_size: int | None = None
    attn_dp_size: int | None = None
    mlp_tp_size: int | None = None
    mlp_dp_size: int | None = None
    outer_dp_size: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    devices: list[int] | None = None
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float = 0.8
    cache_chunk_size: int = -1
    cache_block_seq_len: int = 64
    enable_prefix_caching: bool = False
    cache_checkpoint_interval: int = 4096
    cache_prompt: str = "auto"
    cache_prompt_boundary_skip: int = 1
    cache_generation: str = "auto"
    quant_policy: int = 0
    rope_scaling_factor: float = 0.0
    use_logn_attn: bool = False
    download_dir: str | None = None
    revision: str | None = None
    max_prefill_token_num: int = 8192
    num_tokens_per_iter: int = 0
    max_prefill_iters: int = 1
    async_: int = 1
    empty_init: bool = False
    language_model_only: bool = False
    communicator: str = "nccl"
    moe_a2a_backend: str = "auto"
    hf_overrides: dict | None = None
    enable_metrics: bool = True
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    max_total_tokens: int | None = None

    POLICY: ClassVar[dict[str, tuple[str, str]]] = {
        "gemm_input_dtype": (REJECTED, "GEMM inputs run in the model dtype"),
        "dp": (REJECTED, "data parallelism is not supported; run one engine per replica"),
        "cp": (REJECTED, "context parallelism is not supported"),
        "ep": (REJECTED, _EP),
        "device_num": (NO_EFFECT, "tp is the number of devices"),
        "attn_tp_size": (REJECTED, _TP),
        "attn_cp_size": (REJECTED, "context parallelism is not supported"),
        "attn_dp_size": (REJECTED, "data parallelism is not supported"),
        "mlp_tp_size": (REJECTED, _TP),
        "mlp_dp_size": (REJECTED, "data parallelism is not supported"),
        "outer_dp_size": (REJECTED, "data parallelism is not supported"),
        "nnodes": (REJECTED, _MULTI_NODE),
        "node_rank": (REJECTED, _MULTI_NODE),
        "dist_init_addr": (NO_EFFECT, _MULTI_NODE),
        "devices": (NO_EFFECT, "pick the device with CUDA_VISIBLE_DEVICES"),
        "cache_chunk_size": (NO_EFFECT, "the KV pool is allocated once, at startup"),
        "cache_checkpoint_interval": (NO_EFFECT, "a TurboMind prefix-cache detail"),
        "cache_prompt": (NO_EFFECT, "a TurboMind prefix-cache detail"),
        "cache_prompt_boundary_skip": (NO_EFFECT, "a TurboMind prefix-cache detail"),
        "cache_generation": (NO_EFFECT, "a TurboMind prefix-cache detail"),
        "rope_scaling_factor": (REJECTED, "RoPE scaling is read from config.json"),
        "use_logn_attn": (REJECTED, "log-n attention scaling is not supported"),
        "download_dir": (NO_EFFECT, _NO_DOWNLOAD),
        "revision": (NO_EFFECT, _NO_DOWNLOAD),
        "num_tokens_per_iter": (
            NO_EFFECT,
            "max_prefill_token_num is the one token budget per step",
        ),
        "max_prefill_iters": (NO_EFFECT, "max_prefill_token_num is the one token budget per step"),
        "async_": (NO_EFFECT, "steadylm's engine loop runs in a background thread"),
        "empty_init": (REJECTED, "skipping weight loading would change every result"),
        "language_model_only": (NO_EFFECT, _NO_VISION),
        "communicator": (NO_EFFECT, "NCCL on CUDA and gloo on CPU, chosen by the device"),
        "moe_a2a_backend": (NO_EFFECT, "no expert parallelism, so no all-to-all between ranks"),
        "hf_overrides": (REJECTED, "overriding the model config would change results"),
        "enable_metrics": (NO_EFFECT, "the server always exports /metrics"),
    }

    def to_engine_config(self) -> EngineConfig:
        apply_policy(self, self.POLICY)
        _check_model_format(self.model_format)
        return _engine_config(
            self,
            block_size=self.cache_block_seq_len,
            max_prefill_token_num=self.max_prefill_token_num,
            device="auto",
        )


def _check_model_format(fmt: str | None) -> None:
    if fmt not in (None, "hf", "awq"):
        raise ConfigError(
            f"model_format={fmt!r}: steadylm reads hf and awq checkpoints (the format is read "
            "from config.json)",
            param="model_format",
        )


def speculative_config(value: Any) -> SpeculativeConfig | None:
    """LMDeploy's `SpeculativeConfig(method, model, num_speculative_tokens, dflash_block_size)`
    (or vLLM's dict, or steadylm's own) as the engine's. The draft-free methods `ngram` and
    `suffix` run; draft models, EAGLE, MTP and DFlash are refused with the reason."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, (dict, str)):
        return SpeculativeConfig.from_dict(value)
    method = getattr(value, "method", None)
    if method is None:
        raise ConfigError(
            f"speculative_config must be a SpeculativeConfig or a dict, not {type(value).__name__}",
            param="speculative_config",
        )
    if getattr(value, "model", ""):
        return SpeculativeConfig.from_dict({"method": method, "model": value.model})
    if getattr(value, "dflash_block_size", None) is not None:
        raise ConfigError(
            "speculative_config.dflash_block_size: DFlash is not supported",
            param="speculative_config.dflash_block_size",
        )
    return SpeculativeConfig(method=method, num_speculative_tokens=value.num_speculative_tokens)


def _engine_config(cfg: Any, **kw: Any) -> EngineConfig:
    if cfg.dtype not in ("auto", "float16", "bfloat16", "float32"):
        raise ConfigError(
            f"dtype={cfg.dtype!r} must be auto, float16, bfloat16 or float32", param="dtype"
        )
    blocks = getattr(cfg, "num_gpu_blocks", 0)
    notes: tuple[str, ...] = ()
    # LMDeploy's 0.8 is a default, not a choice: steadylm's own default applies (0.8 on CUDA,
    # 4 GiB on CPU), and another budget knob replaces it.
    ratio = None if cfg.cache_max_entry_count == 0.8 else cfg.cache_max_entry_count
    if blocks and ratio is not None:
        # LMDeploy lets both be set and num_gpu_blocks wins: the same here, said in the plan.
        notes = (
            f"num_gpu_blocks={blocks} and cache_max_entry_count={ratio} are both set: "
            "num_gpu_blocks sizes the KV cache, as in LMDeploy; cache_max_entry_count is unused",
        )
        ratio = None
    ec = EngineConfig(
        dtype=cfg.dtype,
        tp=cfg.tp,
        session_len=cfg.session_len,
        max_batch_size=cfg.max_batch_size or 128,
        enable_prefix_caching=cfg.enable_prefix_caching,
        quant_policy=cfg.quant_policy,
        num_gpu_blocks=blocks,
        cache_max_entry_count=ratio,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_bytes=cfg.kv_cache_bytes,
        max_total_tokens=cfg.max_total_tokens,
        plan_notes=notes,
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
    """LMDeploy's Response (every field of lmdeploy 0.18), plus steadylm's timing fields.
    `finish_reason='error'` comes with `error_code` (LMDeploy's codes: 'invalid_request',
    'context_length_exceeded', 'internal_error', ...) and `error_message`."""

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    logits: Any = None
    last_hidden_state: Any = None
    index: int = 0
    routed_experts: Any = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    error_code: str | None = None
    error_message: str | None = None
    ttft_s: float | None = None  # time to first token
    tokens_per_s: float | None = None  # output tokens / seconds after the first token
    num_preemptions: int = 0

    @property
    def error(self) -> str | None:
        """steadylm's earlier name for `error_message`."""
        return self.error_message

    def extend(self, other: Response) -> Response:
        """Append a streamed chunk, as LMDeploy's `Response.extend`: text, token ids and
        logprobs concatenate; the other fields take the chunk's values."""
        self.text += other.text
        self.generate_token_len = other.generate_token_len
        self.input_token_len = other.input_token_len
        self.finish_reason = other.finish_reason
        self.index = other.index
        if other.token_ids:
            self.token_ids = self.token_ids + other.token_ids
        if other.logprobs is not None:
            self.logprobs = (self.logprobs or []) + other.logprobs
        self.routed_experts = other.routed_experts
        self.cached_tokens = other.cached_tokens
        self.error_code, self.error_message = other.error_code, other.error_message
        self.ttft_s = self.ttft_s if self.ttft_s is not None else other.ttft_s
        self.tokens_per_s = other.tokens_per_s
        self.num_preemptions = other.num_preemptions
        return self

    def __repr__(self) -> str:  # LMDeploy's layout
        return f"text={self.text!r}\n{self._fields_text()}"

    def __str__(self) -> str:
        return f"text={self.text}\n{self._fields_text()}"

    def _fields_text(self) -> str:
        lines = [
            f"input_token_len={self.input_token_len}",
            f"generate_token_len={self.generate_token_len}",
            f'finish_reason="{self.finish_reason}"',
            f"token_ids={self.token_ids}",
            f"logprobs={self.logprobs}",
        ]
        if self.error_code:
            lines.append(f"error_code={self.error_code!r} error_message={self.error_message!r}")
        return "\n".join(lines)
