"""No OpenAI field is silently ignored: `presence_penalty`, `frequency_penalty`, `logit_bias`,
`continue_final_message` and `chat_template_kwargs` work; `response_format`, `tools`,
`suffix`, `best_of` and function calls are a 400 naming the field until they are built."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import needs_shared
from tests.entrypoints.test_server import MODEL, inproc_server

pytestmark = [needs_shared, pytest.mark.timeout(180)]
TEMPLATE = "{{ greeting | default('') }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def base():
    with inproc_server(chat_template=TEMPLATE) as (url, _):
        yield url


def complete(base: str, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json={**body, **kw}, timeout=60)


def test_frequency_and_presence_penalties_change_greedy_output(base):
    plain = complete(base, max_tokens=80).json()["choices"][0]["text"]
    penalised = complete(base, max_tokens=80, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.status_code == 200
    text = penalised.json()["choices"][0]["text"]
    assert text != plain
    words = text.split()
    assert len(set(words)) >= len(set(plain.split()))  # fewer repeats, not more


def test_logit_bias_forces_and_bans_tokens(base):
    r = complete(base, logit_bias={"100": 100}, max_tokens=5, ignore_eos=True, logprobs=0)
    assert r.status_code == 200
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 5 and len(set(tokens)) == 1  # every step picks token 100
    bad = complete(base, logit_bias={"100000": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize(
    "field,value",
    [
        ("response_format", {"type": "structural_tag"}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "required"),
        ("functions", [{"name": "f"}]),
        ("best_of", 3),
        ("suffix", "The end."),
    ],
)
def test_unsupported_fields_are_a_400_naming_them(base, field, value):
    r = complete(base, **{field: value})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_harmless_defaults_of_those_fields_are_accepted(base):
    for field, value in (
        ("response_format", {"type": "text"}),
        ("tool_choice", "none"),
        ("best_of", 1),
    ):
        assert complete(base, **{field: value}).status_code == 200


def test_continue_final_message_and_chat_template_kwargs(base):
    def chat(**kw):
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0}
        return httpx.post(f"{base}/v1/chat/completions", json={**body, **kw}, timeout=60)

    msgs = [{"role": "user", "content": "Tell a story."}]
    plain = chat(messages=msgs).json()["usage"]["prompt_tokens"]
    greeted = chat(messages=msgs, chat_template_kwargs={"greeting": "Hello there, friend. "})
    assert greeted.status_code == 200 and greeted.json()["usage"]["prompt_tokens"] > plain
    opened = msgs + [{"role": "assistant", "content": "Once upon"}]
    r = chat(messages=opened, add_generation_prompt=False, continue_final_message=True)
    assert r.status_code == 200
    closed = chat(messages=opened, add_generation_prompt=False)
    # The open answer ends at "Once upon"; the closed one adds the template's newline after it.
    assert r.json()["usage"]["prompt_tokens"] < closed.json()["usage"]["prompt_tokens"]
    both = chat(messages=opened, continue_final_message=True)  # add_generation_prompt default
    assert both.status_code == 400 and "add_generation_prompt" in both.text
