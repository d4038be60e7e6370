"""Tool call parsers: whole-output parsing, streaming that rebuilds exactly what parse() returns
(in pieces of every size, and as a real tokenizer's incremental decode), and the schemas that
force tool_choice "required" / a named function."""

from __future__ import annotations

import copy
import json
import re

import pytest

from steadylm.entrypoints.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolCall,
    parse_forced,
    tool_call_schema,
)
from tests.conftest import TOKENIZERS

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, TIME]
ID = re.compile(r"call_[0-9a-f]{24}")


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


PARIS = hermes("get_weather", '{"city": "Paris", "unit": "celsius"}')
UTC = hermes("get_time", '{"tz": "UTC"}')
# (text, expected content, expected [(name, arguments)])
HERMES_CASES = {
    "one": (PARIS, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "two": (
        PARIS + "\n" + UTC,
        None,
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"tz": "UTC"}')],
    ),
    "content_before": (
        "Let me check that.\n\n" + UTC,
        "Let me check that.",
        [("get_time", '{"tz": "UTC"}')],
    ),
    "compact_json": (
        '<tool_call>{"name":"get_time","arguments":{"tz":"CET"}}</tool_call>',
        None,
        [("get_time", '{"tz": "CET"}')],
    ),
    "unclosed_last": (
        'Ok. <tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n',
        "Ok.",
        [("get_time", '{"tz": "UTC"}')],
    ),
    "string_arguments": (
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
        None,
        [("get_time", '{"tz": "UTC"}')],
    ),
    "unicode": (
        hermes("get_weather", '{"city": "東京 🌧", "unit": "celsius"}'),
        None,
        [("get_weather", '{"city": "東京 🌧", "unit": "celsius"}')],
    ),
    "escaped_unicode": (
        hermes("get_weather", '{"city": "\\u6771\\u4eac"}'),
        None,
        [("get_weather", '{"city": "東京"}')],
    ),
    "malformed": (
        'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> ok',
        'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> ok',
        [],
    ),
    "malformed_then_good": (
        "<tool_call>not json</tool_call>\n" + UTC,
        "<tool_call>not json</tool_call>",
        [("get_time", '{"tz": "UTC"}')],
    ),
    "unknown_tool": (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    "no_name": (
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    "nan_is_not_json": (
        '<tool_call>{"name": "get_time", "arguments": {"tz": NaN}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {"tz": NaN}}</tool_call>',
        [],
    ),
    "plain": (
        "  Just an answer, 2 < 3 and <tool is no marker.\n",
        "Just an answer, 2 < 3 and <tool is no marker.",
        [],
    ),
    "stray_close_and_partial_open": (
        "a </tool_call> b <tool_cal",
        "a </tool_call> b <tool_cal",
        [],
    ),
}

W = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
T = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
BAD = '{"name": "get_weather", "parameters": {"city": }'
LLAMA_CASES = {
    "one": (W, None, [("get_weather", '{"city": "Paris"}')]),
    "python_tag_two": (
        "<|python_tag|>" + W + "; " + T,
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')],
    ),
    "whitespace_arguments_key": (
        '\n {"name": "get_time", "arguments": {"tz": "東京"}} \n',
        None,
        [("get_time", '{"tz": "東京"}')],
    ),
    "text_after_calls": (
        W + ";" + T + " I called both.",
        "I called both.",
        [
            ("get_weather", '{"city": "Paris"}'),
            ("get_time", '{"tz": "UTC"}'),
        ],
    ),
    "bad_second_call": (
        W + "; " + '{"name": "get_time", "parameters": ',
        '{"name": "get_time", "parameters":',
        [("get_weather", '{"city": "Paris"}')],
    ),
    "content": ("The weather tool wants " + W, "The weather tool wants " + W, []),
    "malformed": (BAD, BAD, []),
    "unknown_tool": (
        '{"name": "rm_rf", "parameters": {}}',
        '{"name": "rm_rf", "parameters": {}}',
        [],
    ),
    "not_a_call": ('{"answer": 42}', '{"answer": 42}', []),
    "tag_then_code": ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
}
PY = 'get_weather(city="Paris", unit="celsius")'
PYTHONIC_CASES = {
    "one": ("[" + PY + "]", None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "two": (
        "[" + PY + ", get_time(tz='UTC')]",
        None,
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"tz": "UTC"}')],
    ),
    "no_arguments_spaces": ("  [get_time()]\n", None, [("get_time", "{}")]),
    "llama4_tags": (
        "<|python_start|>[get_time(tz='CET')]<|python_end|>",
        None,
        [("get_time", '{"tz": "CET"}')],
    ),
    "literals": (
        "[get_weather(city='東京', unit=None, n=[1, 2.5, True], m={'a': -1})]",
        None,
        [("get_weather", '{"city": "東京", "unit": null, "n": [1, 2.5, true], "m": {"a": -1}}')],
    ),
    "content": ("The answer is [1, 2].", "The answer is [1, 2].", []),
    "a_list_not_calls": ("[1, 2]", "[1, 2]", []),
    "unknown_tool": ("[rm_rf(path='/')]", "[rm_rf(path='/')]", []),
    "positional_argument": ("[get_time('UTC')]", "[get_time('UTC')]", []),
    "not_a_literal": ("[get_time(tz=open('x'))]", "[get_time(tz=open('x'))]", []),
    "unclosed": ("[get_time(tz='UTC'", "[get_time(tz='UTC'", []),
    "text_after": ("[get_time()] done", "[get_time()] done", []),
}


def xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CODER_CASES = {
    "one": (xml("get_weather", city="Paris", unit="celsius"), None,
            [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "two_after_content": (
        "Checking.\n" + xml("get_weather", city="New York") + "\n" + xml("get_time", tz="UTC"),
        "Checking.",
        [("get_weather", '{"city": "New York"}'), ("get_time", '{"tz": "UTC"}')],
    ),
    "typed_values": (
        xml("get_weather", city="42", days="3", opts='{"a": [1, true]}'),
        None,
        [("get_weather", '{"city": "42", "days": 3, "opts": {"a": [1, true]}}')],
    ),
    "multiline_string": (xml("get_time", tz="line one\nline two"), None,
                         [("get_time", '{"tz": "line one\\nline two"}')]),
    "unknown_function": (xml("rm_rf", path="/"), xml("rm_rf", path="/"), []),
    "not_xml": ("<tool_call>\nhello\n</tool_call>", "<tool_call>\nhello\n</tool_call>", []),
    "unclosed_last": (
        "Ok. <tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n",
        "Ok.",
        [("get_time", '{"tz": "UTC"}')],
    ),
}  # fmt: skip
CASES = (
    [(HermesToolParser, k, *v) for k, v in HERMES_CASES.items()]
    + [(Qwen3CoderToolParser, k, *v) for k, v in CODER_CASES.items()]
    + [(Llama3JsonToolParser, k, *v) for k, v in LLAMA_CASES.items()]
    + [(PythonicToolParser, k, *v) for k, v in PYTHONIC_CASES.items()]
)
CASE_IDS = [f"{cls.__name__[:8]}-{key}" for cls, key, *_ in CASES]


def stream(parser, pieces) -> list[dict]:
    deltas = [d for piece in pieces for d in parser.feed(piece)]
    return deltas + parser.finish()


def rebuild(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """What an OpenAI client accumulates from the deltas; checks their shape on the way."""
    content, calls = [], []
    for delta in deltas:
        assert len(delta) == 1 and set(delta) <= {"content", "tool_calls"}, delta
        if "content" in delta:
            assert delta["content"], "empty content delta"
            content.append(delta["content"])
        for tc in delta.get("tool_calls", []):
            if "id" in tc:  # a new call opens with its id, type and name
                assert tc["index"] == len(calls) and ID.fullmatch(tc["id"]), tc
                assert tc["type"] == "function" and tc["function"]["arguments"] == "", tc
                calls.append([tc["function"]["name"], ""])
            else:
                assert tc["index"] == len(calls) - 1 and set(tc["function"]) == {"arguments"}
                calls[-1][1] += tc["function"]["arguments"]
    return "".join(content) or None, [tuple(c) for c in calls]


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("cls,key,text,content,calls", CASES, ids=CASE_IDS)
def test_parse(cls, key, text, content, calls):
    got_content, got_calls = cls(TOOLS).parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(isinstance(c, ToolCall) and ID.fullmatch(c.id) for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("cls,key,text,content,calls", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("size", range(1, 8))
def test_stream_rebuilds_parse(cls, key, text, content, calls, size):
    parser = cls(TOOLS)
    deltas = stream(parser, pieces_of(text, size))
    assert rebuild(deltas) == (content, calls)
    assert parser.called == bool(calls)
    if content is None or "<" not in content:
        # no marker, nor any start of one, in a content delta
        assert not [d for d in deltas if "<" in d.get("content", "")]


def test_unicode_arguments_are_not_escaped():
    _, [call] = HermesToolParser(TOOLS).parse(HERMES_CASES["unicode"][0])
    assert "東京 🌧" in call.arguments and "\\u" not in call.arguments
    assert json.loads(call.arguments) == {"city": "東京 🌧", "unit": "celsius"}


def test_without_tools_any_name_counts():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert HermesToolParser(None).parse(text)[1][0].name == "rm_rf"
    assert HermesToolParser(TOOLS).parse(text)[1] == []
    assert HermesToolParser([]).parse(text)[1] == []


def test_hermes_delta_shape_and_timing():
    parser = HermesToolParser(TOOLS)
    assert parser.feed("Let me check.") == [{"content": "Let me check."}]
    assert parser.feed("\n<tool_") == []  # whitespace and a marker's start are held back
    assert parser.feed("call>\n") == []
    deltas = parser.feed('{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    call_id = deltas[0]["tool_calls"][0]["id"]
    assert deltas == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_time", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"tz": "UTC"}'}}]},
    ]
    assert parser.finish() == [] and parser.called


def test_hermes_held_partial_marker_is_flushed_as_content():
    parser = HermesToolParser(TOOLS)
    assert parser.feed("x <tool") == [{"content": "x"}]
    assert parser.feed("box") == [{"content": " <toolbox"}]
    assert parser.feed(" <tool_c") == []
    assert parser.finish() == [{"content": " <tool_c"}] and not parser.called


def test_llama3_emits_a_call_as_soon_as_it_is_complete():
    parser = Llama3JsonToolParser(TOOLS)
    assert parser.feed("<|python_") == [] and parser.feed('tag|>{"name": "get_time", ') == []
    deltas = parser.feed('"parameters": {"tz": "UTC"}}')
    assert rebuild(deltas) == (None, [("get_time", '{"tz": "UTC"}')])
    assert parser.finish() == []


def test_llama3_plain_text_streams_at_once():
    parser = Llama3JsonToolParser(TOOLS)
    assert parser.feed("  ") == []
    assert parser.feed("Hello {") == [{"content": "Hello {"}]
    assert parser.finish() == []


def test_registry():
    for name in ("hermes", "qwen", "qwen2_5", "qwen3"):
        assert TOOL_PARSERS[name] is HermesToolParser
    assert TOOL_PARSERS["llama3"] is TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser
    assert TOOL_PARSERS["pythonic"] is TOOL_PARSERS["llama4_pythonic"] is PythonicToolParser
    assert TOOL_PARSERS["qwen3_coder"] is Qwen3CoderToolParser


def test_pythonic_holds_a_list_and_streams_prose_at_once():
    parser = PythonicToolParser(TOOLS)
    assert parser.feed(" <|python_") == [] and parser.feed("start|>[get_") == []
    assert parser.feed("time(tz='UTC')]") == []  # held until the output ends
    assert rebuild(parser.finish()) == (None, [("get_time", '{"tz": "UTC"}')])
    parser = PythonicToolParser(TOOLS)
    assert parser.feed("Hello [") == [{"content": "Hello ["}]
    assert parser.finish() == [] and not parser.called


def test_pythonic_survives_hostile_output():
    """Nothing the model writes makes the parser raise: deep nesting, huge literals, code."""
    parser = PythonicToolParser(TOOLS)
    for text in (
        "[" * 5000,
        "[get_time(tz=" + "(" * 300 + "1" + ")" * 300 + ")]",
        "[get_time(tz=__import__('os').system('x'))]",
        "[get_time(**{'tz': 1})]",
        "[get_time(tz=1e999999)]",
        "[get_time(tz=" + "9" * 5000 + ")]",
    ):
        content, calls = parser.parse(text)
        strict = json.JSONDecoder(parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
        assert all(isinstance(strict.decode(c.arguments), dict) for c in calls), text[:80]
        assert calls or content == text.strip()


def test_bad_tools_are_a_value_error():
    with pytest.raises(ValueError, match="tools"):
        HermesToolParser([{"type": "function", "function": {}}])


QWEN = TOKENIZERS / "qwen2.5"


@pytest.mark.skipif(not QWEN.is_dir(), reason=f"../shared is absent ({QWEN} not found)")
@pytest.mark.parametrize("key", ["two", "content_before", "unicode", "malformed_then_good"])
def test_qwen_tokenizer_incremental_decode(key):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN)
    text, content, calls = HERMES_CASES[key]
    ids = tok.encode(text)
    assert tok.convert_tokens_to_ids("<tool_call>") in ids  # the marker is one token
    pieces, prev = [], ""
    for k in range(1, len(ids) + 1):
        now = tok.decode(ids[:k])
        if now.endswith("\ufffd"):  # an unfinished UTF-8 character: wait for its next token
            continue
        assert now.startswith(prev)
        pieces.append(now[len(prev) :])
        prev = now
    assert prev == text
    parser = HermesToolParser(TOOLS)
    deltas = stream(parser, pieces)
    assert rebuild(deltas) == (content, calls) == rebuild_parse(text)


def rebuild_parse(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = HermesToolParser(TOOLS).parse(text)
    return content, [(c.name, c.arguments) for c in calls]


# ---- tool_choice "required" / named: the schema that forces the output ----

DEFS_TOOL = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}},
            "required": ["unit"],
            "$defs": {"Unit": {"type": "string", "enum": ["C", "F"]}},
        },
    },
}
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def accepts(schema: dict, text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), text)


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_schema_none_when_not_forced(choice):
    assert tool_call_schema(TOOLS, choice, "hermes") is None


def test_required_schema_follows_vllm():
    schema = tool_call_schema(TOOLS, "required", "llama3_json")
    assert schema["type"] == "array" and schema["minItems"] == 1
    weather = schema["items"]["anyOf"][0]
    assert weather["properties"] == {
        "name": {"const": "get_weather"},
        "parameters": WEATHER["function"]["parameters"],
    }
    assert weather["required"] == ["name", "parameters"]


@pytest.mark.parametrize("parser,key", [("hermes", "arguments"), ("llama3", "parameters")])
def test_required_schema_compiles_and_constrains(parser, key):
    schema = tool_call_schema(TOOLS, "required", parser)
    good = json.dumps(
        [{"name": "get_weather", key: {"city": "Paris"}}, {"name": "get_time", key: {}}]
    )
    assert accepts(schema, good)
    assert not accepts(schema, "[]")
    assert not accepts(schema, f'[{{"name": "rm_rf", "{key}": {{}}}}]')
    assert not accepts(schema, f'[{{"name": "get_weather", "{key}": {{"unit": "celsius"}}}}]')
    assert not accepts(schema, '[{"name": "get_time", "argz": {}}]')
    calls = parse_forced(good, "required")
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]


def test_named_schema_compiles_and_constrains():
    schema = tool_call_schema(TOOLS, NAMED_TIME, "qwen")
    assert accepts(schema, '{"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert not accepts(schema, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert not accepts(schema, '[{"name": "get_time", "arguments": {}}]')
    [call] = parse_forced('{"name": "get_time", "arguments": {"tz": "東京"}}', NAMED_TIME)
    assert (call.name, call.arguments) == ("get_time", '{"tz": "東京"}') and ID.fullmatch(call.id)


def test_schema_validates_with_jsonschema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = tool_call_schema(TOOLS + [DEFS_TOOL], "required", "hermes")
    good = [{"name": "set_unit", "arguments": {"unit": "C"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "set_unit", "arguments": {"unit": "K"}}], schema)


def test_defs_move_to_the_root_without_touching_tools():
    tools = [copy.deepcopy(DEFS_TOOL), copy.deepcopy(WEATHER)]
    schema = tool_call_schema(tools, "required", "hermes")
    assert tools == [DEFS_TOOL, WEATHER]
    assert schema["$defs"] == {"Unit": {"type": "string", "enum": ["C", "F"]}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["arguments"]
    assert accepts(schema, '[{"name": "set_unit", "arguments": {"unit": "F"}}]')
    assert not accepts(schema, '[{"name": "set_unit", "arguments": {"unit": "K"}}]')
    named = tool_call_schema(
        tools, {"type": "function", "function": {"name": "set_unit"}}, "hermes"
    )
    assert accepts(named, '{"name": "set_unit", "arguments": {"unit": "C"}}')


def test_schema_errors():
    with pytest.raises(ValueError, match="not one of the tools"):
        tool_call_schema(TOOLS, {"type": "function", "function": {"name": "rm_rf"}}, "hermes")
    with pytest.raises(ValueError, match="at least one"):
        tool_call_schema([], "required", "hermes")
    with pytest.raises(ValueError, match="tool_choice must be"):
        tool_call_schema(TOOLS, "always", "hermes")
    with pytest.raises(ValueError, match="parser"):
        tool_call_schema(TOOLS, "required", "mistral")
    clash = copy.deepcopy(DEFS_TOOL)
    clash["function"]["name"] = "other"
    clash["function"]["parameters"]["$defs"]["Unit"] = {"type": "integer"}
    with pytest.raises(ValueError, match="Unit"):
        tool_call_schema([DEFS_TOOL, clash], "required", "hermes")


@pytest.mark.parametrize(
    "text",
    ['[{"name": "get_time", "arguments": {"tz": "UT', "[]", "null", '[{"name": "get_time"}, 3]'],
)
def test_parse_forced_rejects_what_is_not_calls(text):
    assert parse_forced(text, "required") == []


def test_parse_forced_named_checks_the_name():
    assert parse_forced('{"name": "get_weather", "arguments": {}}', NAMED_TIME) == []


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "<|python_tag|>",
    "<|py",
    PARIS,
    UTC,
    W,
    T,
    '{"name": "get_time", "arguments": {"tz": "é"}}',
    '{"name": "rm_rf", "arguments": {}}',
    '{"name": ',
    "}",
    ";",
    " ",
    "\n",
    "Hi",
    "ok 🌧",
    "[get_time(",
    "tz='UTC'",
    ")]",
    "<|python_start|>",
    "<function=get_time>\n",
    "<parameter=tz>\nUTC\n</parameter>\n",
    "</function>\n",
]


@pytest.mark.parametrize(
    "cls", [HermesToolParser, Llama3JsonToolParser, PythonicToolParser, Qwen3CoderToolParser]
)
def test_random_outputs_stream_like_parse(cls):
    """Outputs glued from markers, calls, their pieces and prose, fed in random pieces."""
    import random

    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 8)))
        content, calls = cls(TOOLS).parse(text)
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            pieces.append(text[i : i + n])
            i += n
        parser = cls(TOOLS)
        got = rebuild(stream(parser, pieces))
        assert got == (content, [(c.name, c.arguments) for c in calls]), text
        assert parser.called == bool(calls)
