"""Anthropic's Messages API (`/v1/messages`) with the official `anthropic` client: the same
answer as the chat route, streamed and not, stop sequences, usage, count_tokens, errors in
Anthropic's shape, x-api-key; tools (tool_use / tool_result) on the Qwen2.5 template and
thinking blocks with `budget_tokens` on the DeepSeek-R1 template."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import needs_shared
from tests.entrypoints.test_server import MODEL, inproc_server
from tests.entrypoints.test_tools_and_reasoning import NAME, WEATHER, _check_weather_args

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
ASK = [{"role": "user", "content": "Once upon a time"}]


def _client(base: str, key: str = "none"):
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def _chat(base: str, **kw) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", json=kw, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _sse(base: str, body: dict) -> list[tuple[str, dict]]:
    """(event, data) pairs of a raw /v1/messages stream."""
    out, event = [], None
    with httpx.stream("POST", f"{base}/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                out.append((event, json.loads(line[6:])))
    return out


@needs_shared
def test_a_message_is_the_chat_answer_streamed_or_not(server):
    client = _client(server)
    m = client.messages.create(
        model=MODEL, max_tokens=12, messages=ASK, extra_body={"temperature": 0}
    )
    chat = _chat(server, model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat["message"]["content"]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=ASK, extra_body={"temperature": 0}
    ) as s:
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12
    events = [
        e
        for e, _ in _sse(server, {"model": MODEL, "max_tokens": 5, "messages": ASK, "stream": True})
    ]
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


@needs_shared
def test_stop_sequences_system_and_count_tokens(server):
    client = _client(server)
    first = client.messages.create(
        model=MODEL, max_tokens=20, messages=ASK, extra_body={"temperature": 0}
    )
    text = first.content[0].text
    stop = text.split()[3]  # a word the greedy answer writes
    m = client.messages.create(
        model=MODEL,
        max_tokens=20,
        messages=ASK,
        stop_sequences=[stop],
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]
    n = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    ids = httpx.post(
        f"{server}/tokenize",
        json={"messages": [{"role": "system", "content": "Be brief."}, *ASK]},
        timeout=30,
    ).json()["tokens"]
    assert n.input_tokens == len(ids)
    m = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, system="Be brief.")
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(ids)


@needs_shared
@pytest.mark.parametrize(
    "body,status,kind,needle",
    [
        ({"model": MODEL, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        (
            {"model": "claude-x", "max_tokens": 4, "messages": ASK},
            404,
            "not_found_error",
            "claude-x",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": ""},
                            }
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "image",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": []},
            400,
            "invalid_request_error",
            "messages",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": ASK, "temperature": 3},
            400,
            "invalid_request_error",
            "temperature",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled"}},
            400,
            "invalid_request_error",
            "budget_tokens",
        ),
    ],
)
def test_bad_requests_get_anthropics_error_shape(server, body, status, kind, needle):
    r = httpx.post(f"{server}/v1/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind
    assert needle in err["error"]["message"]
    ok = httpx.post(
        f"{server}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK}
    )
    assert ok.status_code == 200  # and the server goes on


@needs_shared
def test_x_api_key_authenticates():
    with inproc_server(api_keys=["sk-1"]) as (base, _):
        with pytest.raises(anthropic.AuthenticationError):
            _client(base, "wrong").messages.create(model=MODEL, max_tokens=2, messages=ASK)
        m = _client(base, "sk-1").messages.create(model=MODEL, max_tokens=2, messages=ASK)
        assert m.usage.output_tokens == 2
        r = httpx.post(
            f"{base}/v1/messages",
            json={"model": MODEL, "max_tokens": 2, "messages": ASK},
            headers={"authorization": "Bearer sk-1"},
        )
        assert r.status_code == 200  # Bearer works here too


TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}


def test_a_forced_tool_is_a_tool_use_block_streamed_or_not(qwen_tools):
    client = _client(qwen_tools)
    kw = dict(
        model=NAME,
        max_tokens=100,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    m = client.messages.create(**kw)
    (block,) = [b for b in m.content if b.type == "tool_use"]
    assert block.name == "get_weather" and m.stop_reason == "tool_use"
    _check_weather_args(json.dumps(block.input))
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "get_weather" and final.stop_reason == "tool_use"
    _check_weather_args(json.dumps(streamed.input))
    # the call and its result go back in the history, as Anthropic's clients send them
    history = [
        kw["messages"][0],
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "12 C, rain"}],
        },
    ]
    ids = client.messages.count_tokens(model=NAME, messages=history, tools=[TOOL]).input_tokens
    m = client.messages.create(model=NAME, max_tokens=8, messages=history, tools=[TOOL])
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == ids
    text = httpx.post(
        f"{qwen_tools}/tokenize",
        json={
            "messages": [
                kw["messages"][0],
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": block.id,
                            "type": "function",
                            "function": {"name": block.name, "arguments": json.dumps(block.input)},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": block.id, "content": "12 C, rain"},
            ],
            "tools": [WEATHER],
            "return_token_strs": True,
        },
        timeout=30,
    ).json()
    assert len(text["tokens"]) == ids and "<tool_response>" in "".join(text["token_strs"])


@pytest.mark.parametrize("budget", [0, 4])
def test_thinking_budget_tokens_is_the_thinking_budget(r1, budget):
    """`thinking.budget_tokens` is our thinking budget: the thinking block is the chat route's
    reasoning under max_thinking_tokens, and the text block its answer (same seed)."""
    base, _ = r1
    client = _client(base)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = client.messages.create(
        model=NAME,
        max_tokens=budget + 6,
        messages=ask,
        thinking={"type": "enabled", "budget_tokens": budget},
        extra_body={"seed": 3, "ignore_eos": True},
    )
    chat = _chat(
        base,
        model=NAME,
        messages=ask,
        max_tokens=budget + 6,
        temperature=1.0,
        seed=3,
        max_thinking_tokens=budget,
        ignore_eos=True,
    )["message"]
    thought = [b.thinking for b in m.content if b.type == "thinking"]
    text = [b.text for b in m.content if b.type == "text"]
    assert (thought[0] if thought else None) == chat["reasoning_content"]
    assert (text[0] if text else None) == chat["content"]
    if thought:
        assert m.content[0].type == "thinking"  # the thought comes first
