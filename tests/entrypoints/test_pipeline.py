"""The LMDeploy pipeline API: the seed script, prompts of every shape, streaming, stop words,
duplicate BOS, progress, errors."""

from __future__ import annotations

import asyncio
import logging

import pytest

from steadylm import (
    ChatTemplateConfig,
    GenerationConfig,
    PytorchEngineConfig,
    TurbomindEngineConfig,
    pipeline,
)
from steadylm.errors import ConfigError
from tests.conftest import STORIES, hf_greedy, needs_shared

SEED_BACKEND = dict(
    enable_prefix_caching=True, cache_max_entry_count=0.30, session_len=32768, quant_policy=4
)
SEED_GEN = dict(top_p=0.8, top_k=40, temperature=0.8, do_sample=True, max_new_tokens=30000)


@pytest.fixture(scope="module")
def stories_pipe():
    if not STORIES.is_dir():
        pytest.skip(f"../shared is absent ({STORIES} not found)")
    with pipeline(
        str(STORIES), backend_config=PytorchEngineConfig(num_gpu_blocks=256, block_size=16)
    ) as pipe:
        yield pipe


@needs_shared
@pytest.mark.timeout(180)
def test_seed_script_on_stories260k():
    pipe = pipeline(str(STORIES), backend_config=PytorchEngineConfig(**SEED_BACKEND))
    gen_config = GenerationConfig(**SEED_GEN)
    response = pipe(["Once upon a time, there was a little dog"] * 2, gen_config=gen_config)
    pipe.close()
    assert len(response) == 2
    for r in response:
        assert r.finish_reason in ("stop", "length") and r.generate_token_len > 0
        assert r.text and r.error is None and r.ttft_s is not None
    assert pipe.engine.block_manager.num_used_blocks == 0


@pytest.mark.timeout(180)
def test_seed_script_on_random_qwen2_with_template_bos(qwen_dsr1_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="steadylm"):
        pipe = pipeline(qwen_dsr1_dir, backend_config=PytorchEngineConfig(**SEED_BACKEND))
        response = pipe(["What is 2+2?"] * 2, gen_config=GenerationConfig(**SEED_GEN))
        response += pipe(["And 3+3?"], gen_config=GenerationConfig(**SEED_GEN))
    pipe.close()
    assert all(r.finish_reason == "stop" for r in response)
    dup = [r for r in caplog.records if "BOS twice" in r.getMessage()]
    assert len(dup) == 1  # once per pipeline, not per request
    assert pipe.encoder.duplicate_bos_fixed == 3
    ids = pipe.encode("What is 2+2?")
    bos = pipe.tokenizer.bos_token_id
    assert ids[0] == bos and ids[1] != bos


@needs_shared
def test_greedy_pipeline_equals_transformers(stories_pipe):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(STORIES).eval()
    prompts = ["Once upon a time", "The little cat"]
    out = stories_pipe(prompts, gen_config=GenerationConfig(max_new_tokens=40, ignore_eos=True))
    for p, r in zip(prompts, out):
        ids = stories_pipe.encode(p)
        assert r.token_ids == hf_greedy(hf, ids, 40)
        assert r.input_token_len == len(ids) and r.generate_token_len == 40
        assert r.finish_reason == "length"


@needs_shared
def test_prompt_shapes(stories_pipe):
    gen = GenerationConfig(max_new_tokens=5, ignore_eos=True)
    single = stories_pipe("Once upon a time", gen_config=gen)
    assert single.index == 0 and single.generate_token_len == 5
    ids = stories_pipe.encode("Once upon a time")
    by_ids = stories_pipe(ids, gen_config=gen)
    assert by_ids.token_ids == single.token_ids
    batch = stories_pipe([ids, "The dog"], gen_config=gen)
    assert [r.index for r in batch] == [0, 1] and batch[0].token_ids == single.token_ids
    (bad,) = stories_pipe([3.5], gen_config=gen)  # LMDeploy: an error Response, no raise
    assert bad.finish_reason == "error" and bad.error_code == "invalid_request"
    assert "prompt" in bad.error_message


@needs_shared
def test_stream_equals_non_stream(stories_pipe):
    gen = GenerationConfig(max_new_tokens=60, do_sample=True, random_seed=11, top_k=40)
    prompts = ["Lily went to the park", "Tom had a red ball"]
    whole = stories_pipe(prompts, gen_config=gen)
    texts, tokens, reasons = ["", ""], [[], []], [None, None]
    for chunk in stories_pipe.stream_infer(prompts, gen_config=gen):
        texts[chunk.index] += chunk.text
        tokens[chunk.index] += chunk.token_ids
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
        assert "\ufffd" not in chunk.text
    assert texts == [r.text for r in whole]
    assert tokens == [r.token_ids for r in whole]
    assert reasons == [r.finish_reason for r in whole]


@needs_shared
def test_seeded_request_same_alone_and_in_a_batch(stories_pipe):
    gen = GenerationConfig(max_new_tokens=30, do_sample=True, random_seed=5, temperature=1.0)
    alone = stories_pipe("Once upon a time", gen_config=gen)
    other = GenerationConfig(max_new_tokens=30, do_sample=True, temperature=1.0)
    mixed = stories_pipe(["The sun", "Once upon a time", "A bird"], gen_config=[other, gen, other])
    assert mixed[1].token_ids == alone.token_ids


@needs_shared
def test_stop_words_span_token_boundaries(stories_pipe):
    gen = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    full = stories_pipe("Once upon a time", gen_config=gen).text
    word = full[10:17]  # a piece that spans several tokens
    assert len(stories_pipe.tokenizer.encode(word, add_special_tokens=False)) > 1
    stopped = stories_pipe(
        "Once upon a time", gen_config=GenerationConfig(max_new_tokens=60, stop_words=[word])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(word)]
    streamed = "".join(
        c.text
        for c in stories_pipe.stream_infer(
            "Once upon a time", gen_config=GenerationConfig(max_new_tokens=60, stop_words=[word])
        )
    )
    assert streamed == stopped.text


@needs_shared
def test_min_new_tokens_and_ignore_eos(stories_pipe):
    # Greedy from "Once upon a time" ends its story with BOS (an eos id) well before 400 (at 341).
    base = stories_pipe("Once upon a time", gen_config=GenerationConfig(max_new_tokens=480))
    assert base.finish_reason == "stop" and base.generate_token_len < 400
    n = base.generate_token_len + 20
    more = stories_pipe(
        "Once upon a time", gen_config=GenerationConfig(max_new_tokens=480, min_new_tokens=n)
    )
    assert more.generate_token_len >= n
    ign = stories_pipe(
        "Once upon a time", gen_config=GenerationConfig(max_new_tokens=300, ignore_eos=True)
    )
    assert ign.finish_reason == "length" and ign.generate_token_len == 300


@needs_shared
def test_async_generate_and_chat(stories_pipe):
    async def run():
        chunks = []
        async for r in stories_pipe.generate(
            "Once upon a time", 7, GenerationConfig(max_new_tokens=8, ignore_eos=True)
        ):
            chunks.append(r)
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1].finish_reason == "length" and all(c.index == 7 for c in chunks)
    assert sum(len(c.token_ids) for c in chunks) == 8
    sess = stories_pipe.chat(
        "Once upon a time", gen_config=GenerationConfig(max_new_tokens=5, ignore_eos=True)
    )
    assert sess.response.generate_token_len == 5
    assert sess.history == [("Once upon a time", sess.response.text)]  # LMDeploy's pairs


@needs_shared
def test_tqdm_progress(stories_pipe, capsys):
    stories_pipe(["a", "b", "c"], gen_config=GenerationConfig(max_new_tokens=2), use_tqdm=True)
    assert "3/3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_p", -0.1),
        ("top_p", 1.5),
        ("temperature", -0.1),
        ("top_k", -1),
        ("min_p", 2.0),
        ("max_new_tokens", 0),
        ("repetition_penalty", 0.0),
        ("n", 0),
        ("min_new_tokens", -3),
        ("logprobs", -1),
        ("stop_words", "stop"),
        ("stop_token_ids", [-1]),
        ("random_seed", "x"),
        ("response_format", {"type": "xml"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    ],
)
def test_invalid_generation_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize(
    "cls,field,value",
    [
        (PytorchEngineConfig, "empty_init", True),
        (PytorchEngineConfig, "adapters", {"a": "b"}),
        (PytorchEngineConfig, "dp", 2),
        (PytorchEngineConfig, "device_type", "ascend"),
        (PytorchEngineConfig, "attn_tp_size", 2),
        (TurbomindEngineConfig, "rope_scaling_factor", 2.0),
        (TurbomindEngineConfig, "model_format", "gptq"),
        (PytorchEngineConfig, "quant_policy", 3),
    ],
)
def test_unsupported_engine_fields_are_rejected(cls, field, value):
    with pytest.raises(ConfigError, match=field):
        cls(**{field: value}).to_engine_config()


def test_engine_configs_map_lmdeploy_names():
    ec = TurbomindEngineConfig(
        cache_block_seq_len=32, session_len=4096, cache_max_entry_count=0.5
    ).to_engine_config()
    assert (ec.block_size, ec.session_len, ec.cache_max_entry_count) == (32, 4096, 0.5)
    ec = PytorchEngineConfig(gpu_memory_utilization=0.9).to_engine_config()
    assert ec.cache_max_entry_count is None and ec.gpu_memory_utilization == 0.9


@needs_shared
def test_chat_template_override(stories_pipe):
    from steadylm.tokenizer import PromptEncoder

    enc = PromptEncoder(
        stories_pipe.tokenizer,
        ChatTemplateConfig(
            chat_template="{% for m in messages %}{{ m['content'] }}!{% endfor %}"
        ).template_text(),
    )
    ids = enc.encode_messages([{"role": "user", "content": "Hi"}])
    assert stories_pipe.tokenizer.decode(ids, skip_special_tokens=True) == "Hi!"


@needs_shared
def test_num_gpu_blocks_wins_over_cache_max_entry_count_and_the_plan_says_so():
    """LMDeploy lets both be set and num_gpu_blocks decides; steadylm does the same and says
    so in the startup plan (it used to refuse the pair)."""
    from steadylm.engine.llm_engine import LLMEngine

    ec = PytorchEngineConfig(
        num_gpu_blocks=40, cache_max_entry_count=0.3, device_type="cpu", block_size=16
    ).to_engine_config()
    engine = LLMEngine.from_pretrained(str(STORIES), ec)
    assert engine.plan.num_blocks == 40
    assert any("num_gpu_blocks sizes the KV cache" in n for n in engine.plan.notes)
    assert "num_gpu_blocks=40" in engine.plan.table()
