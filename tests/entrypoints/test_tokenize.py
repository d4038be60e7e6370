"""vLLM's /tokenize and /detokenize, and OpenAI's usage.prompt_tokens_details.cached_tokens."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import STORIES, needs_shared
from tests.entrypoints.test_server import MODEL, inproc_server

pytestmark = needs_shared


@pytest.fixture(scope="module")
def base():
    with inproc_server(engine_kw={"enable_prefix_caching": True}) as (url, _):
        yield url


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(STORIES)


def test_tokenize_text_and_back(base, tok):
    text = "Once upon a time, Lily saw a cat."
    r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    plain = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert plain.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    strs = httpx.post(f"{base}/tokenize", json={"prompt": text, "return_token_strs": True})
    assert strs.json()["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    back = httpx.post(f"{base}/detokenize", json={"tokens": plain.json()["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == text


def test_tokenize_messages_is_what_chat_feeds_the_model(base):
    """The count equals the prompt_tokens a chat request with the same messages reports."""
    msgs = [{"role": "user", "content": "Lily and the cat"}]
    ids = httpx.post(f"{base}/tokenize", json={"messages": msgs}).json()["tokens"]
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "max_tokens": 2},
        timeout=60,
    ).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {"prompt": 5}, None),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": ["1"]}, None),
    ],
)
def test_bad_tokenize_bodies_are_4xx(base, path, body, param):
    r = httpx.post(f"{base}{path}", json=body)
    assert r.status_code in (400, 404), r.text
    if param:
        assert r.json()["error"]["param"] == param
    assert httpx.get(f"{base}/health").status_code == 200


def test_usage_reports_prefix_cache_hits(base):
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["usage"]
    second = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    # whole 16-token blocks of the prompt, never the last prompt token (it must be computed)
    assert cached == (second["prompt_tokens"] - 1) // 16 * 16 and cached > 0


def test_completion_text_offset_and_chat_bytes(base):
    """Completion logprobs carry each token's character offset in the text, the same whether
    streamed or not; chat logprobs carry each token's UTF-8 bytes."""
    import json

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    whole = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 1}, timeout=60).json()
    lp = whole["choices"][0]["logprobs"]
    lengths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:k]) for k in range(len(lengths))]
    assert "".join(lp["tokens"]) == whole["choices"][0]["text"]
    streamed = []
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "logprobs": 1, "stream": True}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])["choices"][0]["logprobs"]
                streamed += chunk["text_offset"] if chunk else []
    assert streamed == lp["text_offset"]
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Lily"}],
            "max_tokens": 8,
            "logprobs": True,
            "top_logprobs": 2,
        },
        timeout=60,
    ).json()
    for c in chat["choices"][0]["logprobs"]["content"]:
        assert bytes(c["bytes"]).decode("utf-8") == c["token"]
        assert all(bytes(t["bytes"]).decode("utf-8") == t["token"] for t in c["top_logprobs"])
