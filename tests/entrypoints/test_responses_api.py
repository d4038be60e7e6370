"""OpenAI's Responses API (`/v1/responses`) with the `openai` SDK's `responses.create` and
`responses.stream`: the chat route's answer as output items, streamed events the SDK
accumulates, instructions, previous_response_id (and store=false), function tools and their
outputs, text.format json_schema, and reasoning items."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import needs_shared
from tests.entrypoints.test_server import MODEL
from tests.entrypoints.test_tools_and_reasoning import NAME, WEATHER, _check_weather_args

openai = pytest.importorskip("openai")
FN = {"type": "function", **WEATHER["function"]}


def _client(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def _chat(base: str, **kw) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", json=kw, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@needs_shared
def test_a_response_is_the_chat_answer_streamed_or_not(server):
    client = _client(server)
    r = client.responses.create(
        model=MODEL, input="Once upon a time", max_output_tokens=12, temperature=0
    )
    chat = _chat(
        server,
        model=MODEL,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=12,
        temperature=0,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat["choices"][0]["message"]["content"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    with client.responses.stream(
        model=MODEL, input="Once upon a time", max_output_tokens=12, temperature=0
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert final.output_text == r.output_text and final.status == "incomplete"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",  # (its status says incomplete), as vLLM: the SDK ends on it
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}


@needs_shared
def test_instructions_and_previous_response_id(server):
    client = _client(server)
    first = client.responses.create(
        model=MODEL, input="Once upon a time", instructions="Be brief.", max_output_tokens=5
    )
    chat = _chat(
        server,
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Once upon a time"},
        ],
        max_tokens=5,
    )
    assert first.usage.input_tokens == chat["usage"]["prompt_tokens"]
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=5
    )
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    ids = httpx.post(f"{server}/tokenize", json={"messages": history}, timeout=30).json()
    assert second.usage.input_tokens == len(ids["tokens"])  # the first turn was in the prompt
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError, match="previous_response_id"):
            client.responses.create(model=MODEL, input="y", previous_response_id=missing)


@needs_shared
@pytest.mark.parametrize(
    "body,needle",
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": [{"type": "message", "content": "x"}]}, "role"),
        ({"model": MODEL, "input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}}, "schema"),
        (
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input_image",
        ),
    ],
)
def test_bad_requests_are_400s_in_openais_shape(server, body, needle):
    r = httpx.post(f"{server}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_function_tools_and_their_outputs(qwen_tools):
    client = _client(qwen_tools)
    kw = dict(
        model=NAME,
        input="Weather in Paris?",
        tools=[FN],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
    )
    r = client.responses.create(**kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    _check_weather_args(call.arguments)
    with client.responses.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    (streamed,) = [o for o in final.output if o.type == "function_call"]
    assert streamed.name == "get_weather" and "response.function_call_arguments.delta" in kinds
    _check_weather_args(streamed.arguments)
    after = client.responses.create(
        model=NAME,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}],
        tools=[FN],
        max_output_tokens=5,
    )
    assert after.status in ("completed", "incomplete")
    assert after.usage.input_tokens > r.usage.input_tokens  # the call and its output came back


def test_text_format_json_schema_constrains_the_answer(qwen_tools):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = _client(qwen_tools).responses.create(
        model=NAME,
        input="A city?",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        max_output_tokens=60,
    )
    value = json.loads(r.output_text)
    assert set(value) == {"city"} and len(value["city"]) <= 8


def test_reasoning_comes_as_a_reasoning_item(r1):
    base, _ = r1
    ask = "Weather in Paris?"
    r = _client(base).responses.create(
        model=NAME,
        input=ask,
        max_output_tokens=10,
        temperature=1.0,
        extra_body={"seed": 2, "max_thinking_tokens": 3, "ignore_eos": True},
    )
    chat = _chat(
        base,
        model=NAME,
        messages=[{"role": "user", "content": ask}],
        max_tokens=10,
        temperature=1.0,
        seed=2,
        max_thinking_tokens=3,
        ignore_eos=True,
    )["choices"][0]["message"]
    assert r.output[0].type == "reasoning"
    assert r.output[0].content[0].text == chat["reasoning_content"]
    assert r.output_text == (chat["content"] or "")
