"""Issue 20: usage patterns from LMDeploy's documentation (docs/en/llm/pipeline.md and the
chat/session examples), each run as written with only the import changed, against the real
stories260K model, asserting what LMDeploy documents for it."""

from __future__ import annotations

import math

import pytest

from steadylm import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, pipeline
from tests.conftest import STORIES, needs_shared

pytestmark = [needs_shared, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def pipe():
    if not STORIES.is_dir():
        pytest.skip(f"../shared is absent ({STORIES} not found)")
    backend = PytorchEngineConfig(
        session_len=256, block_size=16, num_gpu_blocks=96, enable_prefix_caching=True
    )
    with pipeline(str(STORIES), backend_config=backend) as p:
        yield p


def test_batch_of_prompts(pipe):
    """`response = pipe(['Hi, pls intro yourself', 'Shanghai is'])`: one Response each."""
    response = pipe(["Hi, pls intro yourself", "Shanghai is"])
    assert [r.index for r in response] == [0, 1]
    for r in response:
        assert r.finish_reason in ("stop", "length") and r.text
        assert r.generate_token_len == len(r.token_ids) and r.input_token_len > 0


def test_generation_config_sampling(pipe):
    gen_config = GenerationConfig(top_p=0.8, top_k=40, temperature=0.8, max_new_tokens=24)
    response = pipe(["Hi, pls intro yourself", "Shanghai is"], gen_config=gen_config)
    assert len(response) == 2 and all(r.generate_token_len <= 24 for r in response)


def test_openai_format_prompts(pipe):
    prompts = [
        [{"role": "user", "content": "Hi, pls intro yourself"}],
        [{"role": "user", "content": "Shanghai is"}],
    ]
    response = pipe(prompts, gen_config=GenerationConfig(max_new_tokens=8))
    assert len(response) == 2 and all(r.finish_reason for r in response)


def test_stream_infer_chunks_extend_to_the_whole(pipe):
    """`for item in pipe.stream_infer(prompts, gen_config=gen_config)`, accumulated with
    `Response.extend`, equals the non-streamed call."""
    gen_config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    prompts = ["Hi, pls intro yourself", "Shanghai is"]
    whole = pipe(prompts, gen_config=gen_config)
    acc: dict = {}
    for item in pipe.stream_infer(prompts, gen_config=gen_config):
        acc[item.index] = acc[item.index].extend(item) if item.index in acc else item
    assert [acc[i].text for i in range(2)] == [r.text for r in whole]
    assert [acc[i].token_ids for i in range(2)] == [r.token_ids for r in whole]
    assert all(acc[i].finish_reason == "length" for i in range(2))


def test_stream_infer_without_streaming_yields_finals(pipe):
    gen_config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    finals = list(pipe.stream_infer(["a", "b"], None, gen_config, stream_response=False))
    assert sorted(r.index for r in finals) == [0, 1]
    assert all(r.generate_token_len == 6 and r.finish_reason == "length" for r in finals)


def test_get_ppl(pipe):
    """`input_ids = tokenizer(prompts)['input_ids']; ppl = pipe.get_ppl(input_ids)`."""
    prompts = ["Once upon a time, there was a little girl.", "The dog ran to the park."]
    input_ids = pipe.tokenizer(prompts)["input_ids"]
    ppl = pipe.get_ppl(input_ids)
    assert isinstance(ppl, list) and len(ppl) == 2 and all(math.isfinite(p) for p in ppl)
    single = pipe.get_ppl(input_ids[0])
    assert isinstance(single, list) and single[0] == pytest.approx(ppl[0], rel=1e-5)


def test_logprobs(pipe):
    """`GenerationConfig(logprobs=10)`: per output token, a dict of token id -> logprob that
    holds the chosen token."""
    r = pipe("Once upon a time", gen_config=GenerationConfig(logprobs=10, max_new_tokens=8))
    assert len(r.logprobs) == r.generate_token_len
    for tok, lp in zip(r.token_ids, r.logprobs):
        assert tok in lp and 10 <= len(lp) <= 11 and all(v <= 0 for v in lp.values())


def test_chat_sessions(pipe):
    """`sess = pipe.chat('...')` then `pipe.chat('...', session=sess)`: the history holds
    (prompt, reply) pairs."""
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    sess = pipe.chat("Once upon a time", gen_config=gen)
    sess = pipe.chat("And then", session=sess, gen_config=gen)
    assert [p for p, _ in sess.history] == ["Once upon a time", "And then"]
    assert sess.history[-1][1] == sess.response.text
    assert sess.response.input_token_len > len(pipe.tokenizer.encode("And then"))


def test_chat_streaming_and_pipe_session(pipe):
    sess = pipe.session()
    text = ""
    for out in pipe.chat(
        "Once upon a time",
        session=sess,
        gen_config=GenerationConfig(max_new_tokens=5, ignore_eos=True),
        stream_response=True,
    ):
        text += out.text
    assert sess.history == [("Once upon a time", text)] and sess.response.text == text


def test_stop_words_and_include_stop_str(pipe):
    full = pipe("Once upon a time", gen_config=GenerationConfig(max_new_tokens=40)).text
    word = full.split()[3]
    cut = pipe(
        "Once upon a time", gen_config=GenerationConfig(max_new_tokens=40, stop_words=[word])
    )
    kept = pipe(
        "Once upon a time",
        gen_config=GenerationConfig(
            max_new_tokens=40, stop_words=[word], include_stop_str_in_output=True
        ),
    )
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + word and not cut.text.endswith(word)


def test_one_prompt_too_long_fails_alone(pipe):
    """LMDeploy: a prompt past session_len gets finish_reason='error'; the batch runs."""
    long_prompt = list(range(3, 300))
    out = pipe(["Once upon a time", long_prompt], gen_config=GenerationConfig(max_new_tokens=4))
    assert out[0].finish_reason in ("stop", "length") and out[0].text
    assert out[1].finish_reason == "error" and out[1].error_code == "context_length_exceeded"
    assert "session_len" in out[1].error_message


def test_max_new_tokens_none_fills_the_session(pipe):
    gen = GenerationConfig(max_new_tokens=None, ignore_eos=True)
    r = pipe("Once upon a time", gen_config=gen)
    assert r.finish_reason == "length" and r.input_token_len + r.generate_token_len == 256


def test_cached_tokens_from_the_prefix_cache(pipe):
    prompt = "Tom and Sue found a big red box in the garden. They opened it and saw a cat."
    gen = GenerationConfig(max_new_tokens=2)
    first = pipe(prompt, gen_config=gen)
    again = pipe(prompt, gen_config=gen)
    assert first.cached_tokens == 0  # nothing of it was cached before
    assert again.cached_tokens >= 16 and again.cached_tokens % 16 == 0


def test_builtin_chat_template_by_model_name():
    """`ChatTemplateConfig(model_name='llama2')` formats as LMDeploy's built-in template;
    `meta_instruction` overrides its system prompt."""
    from steadylm.tokenizer import PromptEncoder

    cfg = ChatTemplateConfig(model_name="llama2", meta_instruction="Be brief.")
    text = cfg.formatter()([{"role": "user", "content": "Hi"}], True)
    assert text == "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] "
    mistral = ChatTemplateConfig(model_name="mistral").formatter()
    two = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert mistral(two, True) == "[INST] a [/INST]b</s>[INST] c [/INST]"
    from transformers import AutoTokenizer

    enc = PromptEncoder(AutoTokenizer.from_pretrained(STORIES), formatter=mistral)
    assert enc.encode_messages(two[:1]) == enc.encode_text("[INST] a [/INST]")
