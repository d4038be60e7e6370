"""Structured output and thinking budgets: which tokens a request may sample next.

A request whose `SamplingParams.structured_outputs` is set gets a grammar compiled by xgrammar
(the library vLLM, SGLang and LMDeploy use; compiled grammars are cached per spec) and its own
matcher. A request whose `SamplingParams.thinking` is set (by a reasoning parser) has its thought
tracked token by token: the grammar applies to the answer after `</think>`, never to the
thought, and a thinking budget forces `</think>` once it is spent.

Each step the engine fills one bitmask row (ceil(V / 32) int32 words; bit t set: token t
allowed) for every sampling request that is constrained right now, in one batched xgrammar
call. The rows travel in the step contract to rank 0's sampler, which applies them to the
logits before sampling. The matcher advances when the engine appends the sampled token, so
recompute preemption (which keeps the output tokens) can never desynchronise it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from steadylm.errors import RequestError

# vLLM's structured_outputs kinds (guided_json, guided_regex, ... in its older API)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 4096
GRAMMAR_CACHE_BYTES = 256 << 20  # compiled grammars kept by xgrammar's compiler
COMPILED_KEPT = 64  # ... and the most recent ones held by the manager itself
# JSON nesting of a schema (objects and arrays); xgrammar's compile time grows steeply with it
# (a 500-level schema ran for minutes and took gigabytes), real schemas stay far below.
MAX_SCHEMA_DEPTH = 256
ANY_OBJECT = '{"type": "object", "additionalProperties": true}'  # json_object, as LMDeploy


@dataclass(frozen=True)
class StructuredOutputs:
    """What the answer must match. `spec`: a JSON schema (JSON text) for "json", a regular
    expression, a JSON list of strings for "choice", an EBNF grammar (xgrammar's / GBNF
    dialect), or xgrammar's structural-tag JSON; empty for "json_object" (any JSON object)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError(
                f"structured output kind {self.kind!r} is not one of {list(STRUCTURED_KINDS)}",
                param="response_format",
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise RequestError(
                f"a structured output spec is a string of at most {MAX_SPEC_CHARS} characters",
                param="response_format",
            )

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutputs:
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def json_schema(cls, schema: str | dict) -> StructuredOutputs:
        """A JSON schema given as text, or as a value (serialised here)."""
        if isinstance(schema, str):
            return cls("json", schema)
        try:
            return cls("json", json.dumps(schema, ensure_ascii=False))
        except (TypeError, ValueError) as exc:
            raise RequestError(
                f"the JSON schema is not JSON: {exc}", param="response_format.json_schema"
            ) from None


@dataclass(frozen=True)
class ThinkingParams:
    """A reasoning model's thought markers, set by the reasoning parser. The request is in a
    thought when the last marker in its prompt is `start_token_id` (a template that opens the
    thought, as DeepSeek-R1's does), or when neither marker is in the prompt and
    `think_by_default`, or once it samples the start marker as its first token. The thought
    ends with `end_token_id`; `max_thinking_tokens` (the tokens between the markers) forces
    it to end."""

    start_token_id: int
    end_token_id: int
    think_by_default: bool = False
    max_thinking_tokens: int | None = None

    def __post_init__(self) -> None:
        n = self.max_thinking_tokens
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise RequestError(
                f"max_thinking_tokens={n!r} must be an int >= 0", param="max_thinking_tokens"
            )

    def open_after(self, prompt_ids: list[int]) -> bool:
        for t in reversed(prompt_ids):
            if t == self.end_token_id:
                return False
            if t == self.start_token_id:
                return True
        return self.think_by_default


class RequestConstraint:
    """One request's position in its thought and its grammar. `accept` advances it by one
    sampled token; `mode` says what the next token's bitmask row must be."""

    def __init__(self, matcher: Any, thinking: ThinkingParams | None, prompt_ids: list[int]):
        self.matcher = matcher
        self.thinking = thinking
        self.in_thought = thinking is not None and thinking.open_after(prompt_ids)
        self.num_accepted = 0
        self.thought_tokens = 0
        self.error: str | None = None

    def mode(self) -> str | None:
        """ "end": only the end-of-thought token; "grammar" (the matcher's row), "grammar+start"
        (also the start marker, which may open a thought as the first token), or None."""
        t = self.thinking
        if self.in_thought:
            if t.max_thinking_tokens is not None and self.thought_tokens >= t.max_thinking_tokens:
                return "end"
            return None
        if self.matcher is None or self.matcher.is_terminated():
            return None
        return "grammar+start" if t is not None and self.num_accepted == 0 else "grammar"

    @property
    def completed(self) -> bool:
        """The grammar has accepted its stop token: the answer is whole."""
        return self.matcher is not None and not self.in_thought and self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and `error` set) if the grammar refuses it.
        The start marker counts as a marker only as the first output token."""
        t = self.thinking
        first = self.num_accepted == 0
        self.num_accepted += 1
        if self.in_thought:
            if token_id == t.end_token_id:
                self.in_thought = False
            elif not (first and token_id == t.start_token_id):
                self.thought_tokens += 1
            return True
        if first and t is not None and token_id == t.start_token_id:
            self.in_thought = True
            return True
        if self.matcher is None or self.matcher.is_terminated():
            return True
        if not self.matcher.accept_token(token_id):
            self.error = f"the sampled token {token_id} does not fit the structured output"
            return False
        return True


class StructuredOutputManager:
    """Compiles grammars (cached by spec) and fills the step's bitmask rows. xgrammar is
    imported on first use: an engine that never sees a structured request never loads it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._compiler = None
        self._batch = None
        self._compiled: OrderedDict[StructuredOutputs, Any] = OrderedDict()  # recent grammars

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def _xgr(self):
        import xgrammar

        return xgrammar

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise RequestError(
                        "structured output needs the model's tokenizer; this engine has none",
                        param="response_format",
                    )
                xgr = self._xgr()
                hf = getattr(self.tokenizer, "tokenizer", self.tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids)
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=2, cache_limit_bytes=GRAMMAR_CACHE_BYTES
                )
                self._batch = xgr.BatchGrammarMatcher(max_threads=2)
            return self._compiler

    def compile(self, so: StructuredOutputs) -> Any:
        """The compiled grammar (the last COMPILED_KEPT are kept here, so the engine's
        add_request finds what the caller compiled before taking the engine lock); an invalid
        spec is a RequestError naming why."""
        with self._lock:
            if so in self._compiled:
                self._compiled.move_to_end(so)
                return self._compiled[so]
        grammar = self._compile(so)
        with self._lock:
            self._compiled[so] = grammar
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return grammar

    def _compile(self, so: StructuredOutputs) -> Any:
        compiler = self.compiler()
        try:
            if so.kind in ("json", "json_object"):
                schema = so.spec if so.kind == "json" else ANY_OBJECT
                _check_depth(json.loads(schema))  # not JSON, or too deep: a clear message
                # Compact JSON: a grammar that allows any whitespace lets a model loop on it.
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if so.kind == "regex":
                return compiler.compile_regex(so.spec)
            if so.kind == "choice":
                return compiler.compile_grammar(_choice_grammar(so.spec))
            if so.kind == "grammar":
                return compiler.compile_grammar(so.spec)
            return compiler.compile_structural_tag(so.spec)
        except RequestError:
            raise
        except (ValueError, RuntimeError, TypeError) as exc:
            raise RequestError(
                f"invalid {so.kind} for structured output: {_reason(exc)}",
                param="response_format",
            ) from None

    def constraint(
        self, params: Any, prompt_ids: list[int], stop_token_ids: tuple[int, ...]
    ) -> RequestConstraint | None:
        """A new request's constraint, or None when it has neither grammar nor thought."""
        so, thinking = params.structured_outputs, params.thinking
        if so is None and thinking is None:
            return None
        matcher = None
        if so is not None:
            stops = sorted(
                t for t in set(stop_token_ids) | set(self.eos_token_ids) if t < self.vocab_size
            )
            matcher = self._xgr().GrammarMatcher(self.compile(so), override_stop_tokens=stops)
        return RequestConstraint(matcher, thinking, prompt_ids)

    def fill(self, constraints: list[RequestConstraint]) -> torch.Tensor | None:
        """The bitmask rows (len(constraints), W) int32 of this step's constrained requests
        (each `mode()` must be non-None), or None if there are none."""
        if not constraints:
            return None
        rows = torch.zeros(len(constraints), self.bitmask_width, dtype=torch.int32)
        modes = [c.mode() for c in constraints]
        grammar = [i for i, mode in enumerate(modes) if mode != "end"]
        if grammar:
            self.compiler()  # the batch matcher is made with it
            matchers = [constraints[i].matcher for i in grammar]
            self._batch.batch_fill_next_token_bitmask(matchers, rows, indices=grammar)
        for i, (c, mode) in enumerate(zip(constraints, modes)):
            if mode == "end":
                _allow(rows[i], c.thinking.end_token_id)
            elif mode == "grammar+start":
                _allow(rows[i], c.thinking.start_token_id)
        return rows


def _check_depth(value: Any) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH (counted without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestError(
                f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep",
                param="response_format",
            )
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack += [(c, depth + 1) for c in children if isinstance(c, (dict, list))]


def from_response_format(rf: dict | None) -> StructuredOutputs | None:
    """OpenAI's `response_format` (text, json_object, json_schema) and LMDeploy's
    (regex_schema too) as a StructuredOutputs; None for text."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise RequestError("response_format must be an object", param="response_format")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json_object")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if isinstance(spec, dict) and "schema" in spec:
            spec = spec["schema"]
        elif isinstance(spec, dict) and "json_schema" in spec:  # LMDeploy's nesting
            spec = spec["json_schema"]
        else:
            raise RequestError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                param="response_format.json_schema",
            )
        return StructuredOutputs.json_schema(spec)
    if kind == "regex_schema":  # LMDeploy
        regex = rf.get("regex_schema")
        if not isinstance(regex, str) or not regex:
            raise RequestError(
                "response_format regex_schema needs a regular expression string",
                param="response_format.regex_schema",
            )
        return StructuredOutputs("regex", regex)
    raise RequestError(
        f"response_format type {kind!r} is not supported; use text, json_object, json_schema "
        "or regex_schema",
        param="response_format.type",
    )


def _allow(row: torch.Tensor, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    if word < row.shape[0]:
        value = int(row[word]) | (1 << bit)
        row[word] = value - (1 << 32) if value >= 1 << 31 else value  # as int32


def _choice_grammar(spec: str) -> str:
    try:
        options = json.loads(spec)
    except ValueError:
        options = None
    if (
        not isinstance(options, list)
        or not options
        or len(options) > MAX_CHOICES
        or not all(isinstance(o, str) and o for o in options)
    ):
        raise RequestError(
            f"a choice is a list of 1 to {MAX_CHOICES} non-empty strings",
            param="response_format",
        )
    # JSON string literals are valid EBNF string literals (the same escapes).
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    head, sep, rest = text.partition(": ")
    if sep and (head.endswith((".cc", ".h")) or ".cc:" in head or ".h:" in head):
        text = rest  # "/project/cpp/regex_converter.cc:94: Regex parsing error ..."
    return text.splitlines()[0] if text else type(exc).__name__


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (in place). xgrammar's
    kernel (CPU or CUDA) when it is importable, else the torch reference."""
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - xgrammar is a dependency
        apply_token_bitmask_reference(logits, bitmask, rows)
        return
    full = torch.full(
        (logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device
    )
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(
        logits, full.to(logits.device, non_blocking=True), indices=rows
    )


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
) -> None:
    """The pure-torch oracle of `apply_token_bitmask`."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # (n, W, 32)
    allowed = bits.flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # ids past the bitmask (padded vocab) are never allowed
        pad = torch.zeros(len(rows), vocab - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad.to(allowed.device)], dim=1)
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
