"""Tool calls and reasoning through the server with the official `openai` client: tool_choice
auto / required / named, streamed and not, tool history through the real Qwen2.5 template; the
thought split on the real DeepSeek-R1 tokenizer and template, and max_thinking_tokens exactly."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.test_server import inproc_server

NAME = "m"  # the served name of conftest's qwen_tools and r1 servers (TOOLS_MODEL)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def _check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    assert isinstance(args["city"], str) and len(args["city"]) <= 12


def _stream(client, **kw) -> tuple[str, dict[int, dict], str | None, str]:
    """(content, {index: {id, name, arguments}}, finish_reason, reasoning) of a stream."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function and tc.function.name:
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            reason = c.finish_reason or reason
    return content, calls, reason, reasoning


def test_named_function_is_forced_from_noise(qwen_tools):
    client = _client(qwen_tools)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(5):
        r = client.chat.completions.create(
            model=NAME,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=named,
            temperature=1.0,
            seed=seed,
            max_tokens=100,
        )
        c = r.choices[0]
        # a named function was the caller's choice: "stop", as OpenAI and vLLM report it
        assert c.finish_reason == "stop" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        _check_weather_args(call.function.arguments)
    kw = dict(
        model=NAME,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        temperature=1.0,
        seed=9,
        max_tokens=100,
        logprobs=True,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, reason, _ = _stream(client, **kw)
    assert reason == "stop" and content == "" and len(calls) == 1
    # the call's tokens were held back until it was whole; their logprobs were not dropped
    streamed = [
        lp.token
        for chunk in client.chat.completions.create(stream=True, **kw)
        for c in chunk.choices
        if c.logprobs
        for lp in c.logprobs.content
    ]
    assert streamed == [lp.token for lp in whole.logprobs.content]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    _check_weather_args(calls[0]["arguments"])


def test_required_gives_one_or_more_valid_calls(qwen_tools):
    client = _client(qwen_tools)
    finished = 0
    for seed in range(6):
        r = client.chat.completions.create(
            model=NAME,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        c = r.choices[0]
        if c.finish_reason == "length":  # noise may keep adding calls; cut, it is content
            continue
        finished += 1
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                _check_weather_args(call.function.arguments)
            else:
                assert args["zone"] in ("utc", "cet")
    assert finished >= 3


CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>"
)


def test_auto_reads_hermes_calls_streamed_and_not(qwen_tools):
    """The model writes a call (forced here by a regex of its exact text) and the parser turns
    it into tool_calls; the same text without tools stays content."""
    client = _client(qwen_tools)
    regex = "Let me check\\.\n" + json.dumps(CALL_TEXT)[1:-1].replace("\\n", "\n")
    regex = regex.replace("{", "\\{").replace("}", "\\}")
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=80)
    r = client.chat.completions.create(**kw, extra_body={"guided_regex": regex})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content == "Let me check."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    content, calls, reason, _ = _stream(client, **kw, extra_body={"guided_regex": regex})
    assert (content, reason) == ("Let me check.", "tool_calls")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}
    plain = client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=80, extra_body={"guided_regex": regex}
    )
    assert "<tool_call>" in plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls


def test_llama3_json_calls_through_the_llama_31_template(qwen25_dir):
    from tests.conftest import SHARED

    template = (SHARED / "chat_templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    call = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}'
    regex = call.replace("{", "\\{").replace("}", "\\}")
    with inproc_server(
        engine_kw={"num_gpu_blocks": 128},
        model_dir=qwen25_dir,
        name=NAME,
        tool_call_parser="llama3_json",
        chat_template=template,
    ) as (base, _):
        ids = httpx.post(
            f"{base}/tokenize", json={"messages": ASK, "tools": [WEATHER]}, timeout=60
        ).json()["tokens"]
        prompt = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=60).json()
        assert "get_weather" in prompt["prompt"] and "<|start_header_id|>" in prompt["prompt"]
        client = _client(base)
        kw = dict(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=60)
        r = client.chat.completions.create(**kw, extra_body={"guided_regex": regex})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and not c.message.content
        assert c.message.tool_calls[0].function.name == "get_weather"
        assert json.loads(c.message.tool_calls[0].function.arguments) == {
            "city": "Oslo",
            "unit": "f",
        }
        content, calls, reason, _ = _stream(client, **kw, extra_body={"guided_regex": regex})
        assert reason == "tool_calls" and not content
        assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "unit": "f"}
        # required, streamed: the forced call list arrives whole at the end
        content, calls, reason, _ = _stream(
            client, **{**kw, "max_tokens": 200}, tool_choice="required", seed=2, temperature=1.0
        )
        if reason != "length":
            assert reason == "tool_calls" and calls and calls[0]["name"] == "get_weather"
            _check_weather_args(calls[0]["arguments"])


def test_tools_and_tool_history_reach_the_template(qwen_tools):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = httpx.post(
        f"{qwen_tools}/tokenize",
        json={"messages": history, "tools": [WEATHER]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    text = httpx.post(
        f"{qwen_tools}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60
    ).json()["prompt"]
    assert '"name": "get_weather"' in text and "The weather in a city" in text  # the tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    done = _client(qwen_tools).chat.completions.create(
        model=NAME, messages=history, tools=[WEATHER], max_tokens=3
    )
    assert done.usage.prompt_tokens == r.json()["count"]


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "guided_choice": ["a"]}, "cannot be combined"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "name"),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}
                ],
            },
            "$defs",
        ),
    ],
)
def test_bad_tool_requests_are_400s(qwen_tools, body, needle):
    r = httpx.post(
        f"{qwen_tools}/v1/chat/completions",
        json={"model": NAME, "messages": ASK, "tools": [WEATHER], **body},
        timeout=60,
    )
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_deeply_nested_model_output_or_history_is_not_a_500(qwen_tools):
    client = _client(qwen_tools)
    deep = "<tool_call>" + "[" * 1500  # deeper than Python's JSON decoder can recurse
    r = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=1600,
        extra_body={"guided_choice": [deep]},
    )
    assert r.choices[0].message.content == deep and not r.choices[0].message.tool_calls
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    r = httpx.post(
        f"{qwen_tools}/v1/chat/completions",
        json={"model": NAME, "messages": history, "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_auto_without_a_parser_is_a_400_but_required_works(qwen25_dir):
    with inproc_server(engine_kw={"num_gpu_blocks": 64}, model_dir=qwen25_dir, name=NAME) as (
        base,
        _,
    ):
        url = f"{base}/v1/chat/completions"
        body = {"model": NAME, "messages": ASK, "tools": [WEATHER], "max_tokens": 60}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = httpx.post(url, json={**body, "tool_choice": named, "seed": 1}, timeout=60)
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == (
            "get_weather"
        )
        none = httpx.post(url, json={**body, "tool_choice": "none"}, timeout=60)
        assert none.status_code == 200 and "tool_calls" not in none.json()["choices"][0]["message"]


# ---- reasoning -------------------------------------------------------------------------------


def test_r1_template_opens_the_thought_in_the_prompt(r1):
    base, state = r1
    ids = httpx.post(f"{base}/tokenize", json={"messages": ASK}, timeout=60).json()["tokens"]
    end = state.tokenizer.encode("</think>", add_special_tokens=False)
    assert state.tokenizer.decode(ids).endswith("<think>\n") and len(end) == 1
    r = _client(base).chat.completions.create(
        model=NAME, messages=ASK, temperature=1.0, seed=0, max_tokens=40
    )
    m = r.choices[0].message
    # the random model never closes its thought: everything it wrote is reasoning
    assert m.reasoning_content and not m.content


@pytest.mark.parametrize("budget", [0, 1, 5, 13])
def test_max_thinking_tokens_is_honoured_exactly(r1, budget):
    base, state = r1
    tok = state.tokenizer
    end = tok.encode("</think>", add_special_tokens=False)[0]
    kw = dict(
        model=NAME,
        messages=ASK,
        temperature=1.0,
        seed=budget,
        max_tokens=budget + 6,
        logprobs=True,
        extra_body={"max_thinking_tokens": budget, "ignore_eos": True},
    )
    client = _client(base)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    tokens = [t.token for t in c.logprobs.content]
    ids = tok.encode("".join(tokens), add_special_tokens=False)
    assert end in ids
    assert tokens.index("</think>") == budget  # exactly `budget` thought tokens, then the end
    assert c.message.reasoning_content == ("".join(tokens[:budget]) or None)
    assert c.message.content == "".join(tokens[budget + 1 :])
    content, _, _, reasoning = _stream(client, **kw)
    assert (reasoning or None, content) == (c.message.reasoning_content, c.message.content)


def test_structured_output_applies_to_the_answer_not_the_thought(r1):
    base, _ = r1
    r = _client(base).chat.completions.create(
        model=NAME,
        messages=ASK,
        temperature=1.0,
        seed=3,
        max_tokens=40,
        extra_body={"max_thinking_tokens": 8, "guided_choice": ["yes", "no"]},
    )
    m = r.choices[0].message
    assert m.content in ("yes", "no") and m.reasoning_content
    assert m.reasoning_content not in ("yes", "no")


def test_a_reasoning_parser_needs_the_markers(qwen25_dir):
    from steadylm.errors import ConfigError

    with pytest.raises(ConfigError, match="<think>"):
        with inproc_server(model_dir=qwen25_dir, name=NAME, reasoning_parser="deepseek-r1"):
            pass


def test_pipeline_max_thinking_tokens(qwen_dsr1_dir):
    from steadylm import GenerationConfig, PytorchEngineConfig, pipeline

    with pipeline(qwen_dsr1_dir, backend_config=PytorchEngineConfig(num_gpu_blocks=64)) as pipe:
        end = pipe.tokenizer.encode("</think>", add_special_tokens=False)[0]
        for budget in (0, 6):
            gen = GenerationConfig(
                do_sample=True,
                random_seed=budget,
                max_new_tokens=budget + 4,
                ignore_eos=True,
                max_thinking_tokens=budget,
            )
            out = pipe("Why is the sky blue?", gen_config=gen)
            assert out.token_ids.index(end) == budget
    with pytest.raises(ValueError, match="max_thinking_tokens"):
        GenerationConfig(max_thinking_tokens=-1)
