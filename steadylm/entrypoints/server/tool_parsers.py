"""Tool calls in model output text: the text side of OpenAI `tools`, as vLLM's
`--tool-call-parser hermes`, `llama3_json`, `pythonic` and `qwen3_coder` read it.

A parser turns a model's output into content plus `ToolCall`s, whole (`parse`) or piece by piece
(`feed`, then `finish`) as OpenAI chat-completion-chunk deltas. Invariants the tests hold:
- streaming rebuilds exactly what `parse` returns: the content deltas join to `parse`'s content
  (so leading and trailing whitespace is held back, as `parse` strips it), and the argument
  pieces of call i join to `parse`'s arguments of call i;
- text that may still become a call marker is held back, so no marker reaches a content delta;
- nothing here raises on model output: what does not parse as a call stays content.

With tool_choice "required" or a named function the server constrains the output with
`tool_call_schema` instead (plain JSON, no markers) and reads it back with `parse_forced`.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_DEFS_KEYS = ("$defs", "definitions")  # where a parameters schema keeps what its $refs name


@dataclass
class ToolCall:
    id: str  # "call_" + 24 hex digits
    name: str
    arguments: str  # JSON text of the arguments object


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # NaN / Infinity are not JSON


def _loads(text: str) -> Any:
    """The JSON value of `text` (surrounding whitespace allowed), or None when it is not JSON."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to read
        return None


def _decode_at(text: str, i: int) -> tuple[Any, int] | None:
    """(value, end) of the JSON value starting exactly at text[i], or None."""
    try:
        return _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        return None


def _as_call(obj: Any, names: set[str] | None) -> ToolCall | None:
    """`{"name": .., "arguments" | "parameters": {..}}` as a ToolCall, or None when it is not one
    (or names a function outside `names`). Arguments written as a JSON string are accepted."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        args = {}
    elif isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    call_id = "call_" + uuid.uuid4().hex[:24]
    return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))


def _functions(tools: list[dict]) -> dict[str, dict]:
    """name -> function definition, for an OpenAI `tools` list."""
    out = {}
    for tool in tools:
        ok = isinstance(tool, dict) and tool.get("type", "function") == "function"
        fn = tool.get("function") if ok else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(
                "tools: each tool must be {'type': 'function', 'function': {'name': ..., "
                f"'parameters': {{...}}}}; got {str(tool)[:200]}"
            )
        out[name] = fn
    return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _skip_ws(text: str, i: int) -> int:
    return len(text) - len(text[i:].lstrip())


class ToolParser:
    """Reads one choice's output. One instance per choice: `feed` and `finish` keep state."""

    ARGS_KEY = "arguments"  # what the model's own format calls the arguments object

    def __init__(self, tools: list[dict] | None) -> None:
        # Without `tools`, any name counts; with them, only theirs.
        self._names = None if tools is None else set(_functions(tools))
        self._buf = ""  # output text not yet sent
        self._ws = ""  # trailing whitespace of the content sent, held until content follows
        self._content_started = False
        self._n_calls = 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output -> (content outside the calls, stripped, None when empty; calls)."""
        raise NotImplementedError

    def feed(self, delta_text: str) -> list[dict]:
        """The next piece of output -> the chunk deltas to send now."""
        raise NotImplementedError

    def finish(self) -> list[dict]:
        """End of output: the deltas for what was held back."""
        raise NotImplementedError

    @property
    def called(self) -> bool:
        """Whether a tool call was sent (the choice's finish_reason is then "tool_calls")."""
        return self._n_calls > 0

    def _call(self, obj: Any) -> ToolCall | None:
        return _as_call(obj, self._names)

    def _content(self, text: str) -> list[dict]:
        if not self._content_started:
            text = text.lstrip()
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if not body:
            return []
        self._content_started = True
        return [{"content": body}]

    def _emit(self, call: ToolCall) -> list[dict]:
        self._n_calls += 1
        return call_deltas(self._n_calls - 1, call)


def call_deltas(index: int, call: ToolCall) -> list[dict]:
    """Call `index` as OpenAI streams it: its id and name (empty arguments), then the
    arguments."""
    head = {"index": index, "id": call.id, "type": "function"}
    head["function"] = {"name": call.name, "arguments": ""}
    args = {"index": index, "function": {"arguments": call.arguments}}
    return [{"tool_calls": [head]}, {"tool_calls": [args]}]


class HermesToolParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`,
    any number, anywhere in the output. A last call left unclosed (the model stopped after its
    JSON) still counts. A block whose body is not a call stays content, markers included."""

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self._in_call = False

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls, pos = [], [], 0
        while (start := text.find(HERMES_START, pos)) >= 0:
            end = text.find(HERMES_END, start)
            stop = len(text) if end < 0 else end + len(HERMES_END)
            call = self._body_call(text[start + len(HERMES_START) : end if end >= 0 else stop])
            content.append(text[pos:start] if call else text[pos:stop])
            if call:
                calls.append(call)
            pos = stop
        content.append(text[pos:])
        return "".join(content).strip() or None, calls

    def feed(self, delta_text: str) -> list[dict]:
        self._buf += delta_text
        out: list[dict] = []
        while True:
            if not self._in_call:
                i = self._buf.find(HERMES_START)
                if i < 0:  # send all but what may be the start of a marker
                    i = len(self._buf) - _partial_suffix(self._buf, HERMES_START)
                    out += self._content(self._buf[:i])
                    self._buf = self._buf[i:]
                    return out
                out += self._content(self._buf[:i])
                self._buf = self._buf[i + len(HERMES_START) :]
                self._in_call = True
            else:
                j = self._buf.find(HERMES_END)
                if j < 0:
                    return out
                out += self._close(self._buf[:j], HERMES_END)
                self._buf = self._buf[j + len(HERMES_END) :]
                self._in_call = False

    def finish(self) -> list[dict]:
        out = self._close(self._buf, "") if self._in_call else self._content(self._buf)
        self._buf, self._ws, self._in_call = "", "", False
        return out

    def _close(self, body: str, end: str) -> list[dict]:
        call = self._body_call(body)
        return self._emit(call) if call else self._content(HERMES_START + body + end)

    def _body_call(self, body: str) -> ToolCall | None:
        """The call a <tool_call> block's body holds, or None (then it stays content)."""
        return self._call(_loads(body))


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


class Qwen3CoderToolParser(HermesToolParser):
    """Qwen3-Coder's XML calls (vLLM's `qwen3_coder`): `<tool_call>\n<function=NAME>\n
    <parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>`. Values are text;
    each is read as its parameter's schema type says (integer, number, boolean, object, array:
    as JSON; string as written, one newline trimmed at each end). A block that is not a call to
    a known function stays content, as with hermes."""

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self._schemas = {
            name: (fn.get("parameters") or {}).get("properties") or {}
            for name, fn in _functions(tools or []).items()
        }

    def _body_call(self, body: str) -> ToolCall | None:
        m = _FUNCTION.match(body)
        if m is None:
            return None
        name = m.group(1).strip()
        if not name or (self._names is not None and name not in self._names):
            return None
        props = self._schemas.get(name, {})
        args = {}
        for key, raw in _PARAMETER.findall(m.group(2)):
            key = key.strip()
            spec = props.get(key) if isinstance(props, dict) else None
            args[key] = _xml_value(raw, spec if isinstance(spec, dict) else {})
        call_id = "call_" + uuid.uuid4().hex[:24]
        return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))


def _xml_value(raw: str, spec: dict) -> Any:
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kind = spec.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or kind is None and "enum" in spec:
        return text
    value = _loads(text)
    if value is None and text.strip() not in ("null", "None"):
        return text  # not the type the schema says: kept as written, as vLLM does
    return value


def _llama_start(text: str, final: bool) -> int | None:
    """Where the first call's `{` is, -1 when the output is plain content, None when it is too
    early to tell. Calls start the output, after whitespace and an optional <|python_tag|>."""
    i = _skip_ws(text, 0)
    rest = text[i:]
    if not final and PYTHON_TAG.startswith(rest):  # nothing yet, or part of the tag
        return None
    if rest.startswith(PYTHON_TAG):
        i = _skip_ws(text, i + len(PYTHON_TAG))
        if i == len(text) and not final:
            return None
    return i if text.startswith("{", i) else -1


def _after_separator(text: str, i: int, final: bool) -> int | None:
    """Skip whitespace, one `;` and whitespace after a call; None when more text may follow."""
    j = _skip_ws(text, i)
    if text.startswith(";", j):
        j = _skip_ws(text, j + 1)
    return None if j == len(text) and not final else j


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calling: the output is `{"name": .., "parameters": {..}}`
    ("arguments" accepted too), optionally after <|python_tag|>, calls separated by `;`. If the
    first object is not a call, the whole output is content; text after the last call that
    does not start another call is content."""

    ARGS_KEY = "parameters"

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self._mode: str | None = None  # "json" or "text" once the output's start is known
        self._pos = 0  # json mode: where the next call (or separator) starts in _buf
        self._after_call = False  # json mode: a separator may come next

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = _llama_start(text, final=True)
        calls = []
        while i >= 0:
            decoded = _decode_at(text, i)
            call = self._call(decoded[0]) if decoded else None
            if call is None:
                break
            calls.append(call)
            i = _after_separator(text, decoded[1], final=True)
            if not text.startswith("{", i):
                break
        rest = text[i:] if calls else text
        return rest.strip() or None, calls

    def feed(self, delta_text: str) -> list[dict]:
        self._buf += delta_text
        if self._mode == "json" and not self._after_call and "}" not in delta_text:
            return []  # an unfinished object can only be finished by a "}"
        return self._advance(final=False)

    def finish(self) -> list[dict]:
        out = self._advance(final=True)
        self._buf, self._ws, self._mode = "", "", "text"
        return out

    def _advance(self, final: bool) -> list[dict]:
        if self._mode is None:
            start = _llama_start(self._buf, final)
            if start is None:
                return []
            self._mode, self._pos = ("json", start) if start >= 0 else ("text", 0)
        if self._mode == "json":
            return self._calls(final)
        out = self._content(self._buf)
        self._buf = ""
        return out

    def _calls(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while True:
            if self._after_call:
                j = _after_separator(self._buf, self._pos, final)
                if j is None:
                    return out
                self._pos, self._after_call = j, False
                if not self._buf.startswith("{", j):
                    return out + self._to_text(j)
            decoded = _decode_at(self._buf, self._pos)
            call = self._call(decoded[0]) if decoded else None
            if call is None:
                if decoded is None and not final:
                    return out  # the object may be unfinished
                return out + self._to_text(self._pos)
            out += self._emit(call)
            self._pos, self._after_call = decoded[1], True

    def _to_text(self, i: int) -> list[dict]:
        """The rest is content: from `i` after a call, else the whole output."""
        text = self._buf[i:] if self.called else self._buf
        self._mode, self._buf = "text", ""
        return self._content(text)


PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's wrapping


def _pythonic_calls(text: str, names: set[str] | None) -> list[ToolCall] | None:
    """`[f(a=1, b="x"), g()]` (optionally inside Llama 4's <|python_start|> / <|python_end|>)
    as calls, or None when it is not exactly a list of calls with literal keyword arguments
    to known functions. Read with Python's own parser: nothing is evaluated but literals."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START) :]
        body = body[: -len(PYTHON_END)] if body.endswith(PYTHON_END) else body
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        name = node.func.id
        if names is not None and name not in names:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None  # not literals, a **kwargs, or a value JSON cannot hold
        if None in args:
            return None
        calls.append(ToolCall("call_" + uuid.uuid4().hex[:24], name, arguments))
    return calls


class PythonicToolParser(ToolParser):
    """Llama 3.2 / 3.3 / 4's pythonic tool calling (vLLM's `pythonic`): the whole output is a
    Python list of calls with keyword arguments, `[get_weather(city="Paris"), get_time()]`,
    optionally between <|python_start|> and <|python_end|>. Anything else is content. Output
    that starts like a list (or the tag) is held until it ends, then sent as its calls, or as
    content if it is not one; other output streams as content at once."""

    ARGS_KEY = "arguments"

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self._mode: str | None = None  # "calls" (held) or "text", once the start is known

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = _pythonic_calls(text, self._names)
        return (None, calls) if calls else (text.strip() or None, [])

    def feed(self, delta_text: str) -> list[dict]:
        self._buf += delta_text
        if self._mode is None:
            head = self._buf.lstrip()
            if not head or (PYTHON_START.startswith(head) and head != PYTHON_START):
                return []  # too early to tell
            looks = head.startswith("[") or head.startswith(PYTHON_START)
            self._mode = "calls" if looks else "text"
        if self._mode == "calls":
            return []
        out = self._content(self._buf)
        self._buf = ""
        return out

    def finish(self) -> list[dict]:
        text, self._buf = self._buf, ""
        calls = _pythonic_calls(text, self._names) if self._mode != "text" else None
        out = [d for call in calls for d in self._emit(call)] if calls else self._content(text)
        self._ws, self._mode = "", "text"
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "qwen2_5": HermesToolParser,
    "qwen3": HermesToolParser,
    "llama3": Llama3JsonToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "llama4_pythonic": PythonicToolParser,
}


def _parser_class(parser_name: str) -> type[ToolParser]:
    if parser_name not in TOOL_PARSERS:
        raise ValueError(f"tool call parser {parser_name!r} is not one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[parser_name]


def _named_choice(tool_choice: Any) -> str:
    ok = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    fn = tool_choice.get("function") if ok else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}; got {str(tool_choice)[:200]}"
        )
    return name


def _call_schema(name: str, fn: dict, key: str, defs: dict[str, dict]) -> dict:
    """The schema of one call object of `fn`; its $defs / definitions move into `defs`, since
    their $refs ("#/$defs/X") point at the root of the whole schema."""
    params = copy.deepcopy(fn.get("parameters") or _EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise ValueError(f"tools: the parameters of function {name!r} must be a JSON schema")
    for defs_key in _DEFS_KEYS:
        found = params.pop(defs_key, None) or {}
        if not isinstance(found, dict):
            raise ValueError(f"tools: {defs_key} of function {name!r} must be an object")
        for def_name, schema in found.items():
            if defs.setdefault(defs_key, {}).setdefault(def_name, schema) != schema:
                raise ValueError(
                    f"tools: {defs_key}/{def_name} has different schemas in different "
                    "functions, which tool_choice 'required' cannot combine; rename one"
                )
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: params},
        "required": ["name", key],
        "additionalProperties": False,
    }


def tool_call_schema(tools: list[dict] | None, tool_choice: Any, parser_name: str) -> dict | None:
    """The JSON schema that forces the output for tool_choice "required" (an array of one or more
    calls to any of `tools`, as vLLM does it) or a named function `{"type": "function",
    "function": {"name": ..}}` (one call object of it); None for None, "none" and "auto".
    A call object is `{"name": .., K: <the function's parameters schema>}`, K being the
    arguments key of the parser's format. Raises ValueError for a choice `tools` cannot meet."""
    if tool_choice in (None, "none", "auto"):
        return None
    key = _parser_class(parser_name).ARGS_KEY
    functions = _functions(tools or [])
    defs: dict[str, dict] = {}
    if tool_choice == "required":
        if not functions:
            raise ValueError("tool_choice 'required' needs at least one function in tools")
        calls = [_call_schema(name, fn, key, defs) for name, fn in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    else:
        name = _named_choice(tool_choice)
        if name not in functions:
            raise ValueError(
                f"tool_choice names function {name!r}, which is not one of the tools "
                f"{sorted(functions)}"
            )
        schema = _call_schema(name, functions[name], key, defs)
    return {**schema, **defs}


def parse_forced(text: str, tool_choice: Any) -> list[ToolCall]:
    """The calls in output constrained by `tool_call_schema`: a JSON array of call objects for
    "required", one call object for a named function. [] when the output is not that (e.g. it
    was cut short by max_tokens)."""
    names = None if tool_choice == "required" else {_named_choice(tool_choice)}
    value = _loads(text)
    calls = [_as_call(item, names) for item in (value if isinstance(value, list) else [value])]
    return calls if calls and all(calls) else []
