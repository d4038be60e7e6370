"""Structured output through the OpenAI-compatible server, with the official `openai` client, on
a random-weight Qwen2 model with the real Qwen2.5 tokenizer: whatever the noise samples, the
grammar makes the output valid."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.test_server import inproc_server

NAME = "qwen-random"


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    vaccinated: bool


@pytest.fixture(scope="module")
def served(qwen25_dir):
    with inproc_server(
        engine_kw={"num_gpu_blocks": 256, "block_size": 16}, model_dir=qwen25_dir, name=NAME
    ) as (base, state):
        yield base, state


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


def chat(**kw) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "Describe a pet."}], **kw}


def test_parse_with_a_pydantic_model_validates_for_20_seeds(client):
    for seed in range(20):
        done = client.chat.completions.parse(
            model=NAME,
            messages=[{"role": "user", "content": "Describe a pet as JSON."}],
            response_format=Pet,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        pet = choice.message.parsed
        assert isinstance(pet, Pet)
        assert Pet.model_validate_json(choice.message.content) == pet


def test_unconstrained_noise_is_not_json(client):
    """The same model without a grammar: what makes the outputs above valid is the grammar."""
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        temperature=1.0,
        seed=0,
        max_tokens=30,
    )
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_json_object_regex_and_choice(served):
    base, _ = served
    url = f"{base}/v1/chat/completions"
    for seed in range(3):
        r = httpx.post(
            url,
            json=chat(response_format={"type": "json_object"}, seed=seed, max_tokens=300),
            timeout=60,
        )
        c = r.json()["choices"][0]
        if c["finish_reason"] == "stop":  # noise may write a long object; a whole one parses
            assert isinstance(json.loads(c["message"]["content"]), dict)
        else:
            assert c["message"]["content"].startswith("{")
    regex = r"(red|blue) [0-9]{2}"
    for field in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        r = httpx.post(url, json=chat(n=4, seed=1, **field), timeout=60)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert re.fullmatch(regex, c["message"]["content"]), c
    options = ["sunny", "rainy day", "snow ☃"]
    r = httpx.post(url, json=chat(n=6, seed=2, guided_choice=options), timeout=60)
    got = [c["message"]["content"] for c in r.json()["choices"]]
    assert all(g in options for g in got), got
    # a stop string inside a choice ends the text there, as it would unconstrained
    r = httpx.post(url, json=chat(seed=3, guided_choice=["alpha beta"], stop=[" beta"]), timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == "alpha"
    # completions take the same fields
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": NAME, "prompt": "Weather:", "guided_choice": options, "seed": 4},
        timeout=60,
    )
    assert r.json()["choices"][0]["text"] in options


def test_streamed_json_schema_deltas_join_to_valid_json(client):
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "A pet?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True},
        },
        temperature=1.0,
        seed=7,
        max_tokens=200,
        n=3,
        stream=True,
    )
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert len(texts) == 3
    for text in texts.values():
        Pet.model_validate_json(text)


@pytest.mark.parametrize(
    "field,needle",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "objectx",
        ),
        ({"guided_regex": "[a-"}, "regex"),
        ({"guided_grammar": 'root ::= "a" | b'}, "grammar"),
        ({"guided_choice": []}, "choice"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured output"),
        ({"structured_outputs": {"xml": "<a/>"}}, "xml"),
        ({"response_format": {"type": "structural_tag"}}, "structural_tag"),
    ],
)
def test_invalid_constraints_are_400s_and_the_server_goes_on(served, field, needle):
    base, _ = served
    r = httpx.post(f"{base}/v1/chat/completions", json=chat(**field), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    ok = httpx.post(f"{base}/v1/chat/completions", json=chat(max_tokens=2), timeout=60)
    assert ok.status_code == 200


def test_pipeline_response_format(qwen25_dir):
    from steadylm import GenerationConfig, PytorchEngineConfig, pipeline

    schema = Pet.model_json_schema()
    with pipeline(qwen25_dir, backend_config=PytorchEngineConfig(num_gpu_blocks=64)) as pipe:
        gen = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            random_seed=3,
            max_new_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )
        out = pipe(["A pet?", "Another pet?"], gen_config=gen)
        for o in out:
            Pet.model_validate_json(o.text)
        regex = GenerationConfig(response_format={"type": "regex_schema", "regex_schema": "ab+c"})
        assert re.fullmatch("ab+c", pipe("x", gen_config=regex).text)
