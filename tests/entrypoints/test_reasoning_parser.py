"""The reasoning parsers' text side: the thought split off the answer, the same whole or fed in
pieces of any size, with no marker text leaking while it is still undecided."""

from __future__ import annotations

import random

import pytest

from steadylm.entrypoints.server.reasoning import (
    REASONING_PARSERS,
    ReasoningSplitter,
    marker_ids,
    split_reasoning,
    thinking_params,
)
from steadylm.errors import ConfigError, RequestError
from tests.conftest import TOKENIZERS

R1 = REASONING_PARSERS["deepseek-r1"]
QWEN3 = REASONING_PARSERS["qwen3"]

CASES = [
    # (parser, in a thought at the start (from the prompt), output, (reasoning, content))
    (R1, True, "Let me think.\n</think>\n\nIt is 4.", ("Let me think.\n", "\n\nIt is 4.")),
    (R1, True, "<think>\nhmm</think>ok", ("\nhmm", "ok")),  # R1 wrote <think> anyway
    (R1, True, "still thinking </thi", ("still thinking </thi", "")),  # cut short
    (R1, False, "The answer.", ("", "The answer.")),  # the prompt closed the thought
    (QWEN3, False, "<think>a</think>b", ("a", "b")),
    (QWEN3, False, "  <think>\nx\n</think>\n\ny", ("\nx\n", "\n\ny")),
    (QWEN3, False, "plain <think> text", ("", "plain <think> text")),  # not at the start
    (QWEN3, False, "</think> x", ("", "</think> x")),
    (QWEN3, False, " <thin", ("", " <thin")),  # never became a marker
    (QWEN3, False, "<think>one</think>two<think>three</think>", ("one", "two<think>three</think>")),
]


@pytest.mark.parametrize("parser,in_thought,text,want", CASES)
def test_whole_split(parser, in_thought, text, want):
    assert split_reasoning(parser, in_thought, text) == want


@pytest.mark.parametrize("parser,in_thought,text,want", CASES)
def test_streamed_split_equals_whole_at_every_piece_size(parser, in_thought, text, want):
    for size in range(1, 9):
        s = ReasoningSplitter(parser, in_thought)
        reasoning = content = ""
        for i in range(0, len(text), size):
            r, c = s.feed(text[i : i + size])
            reasoning, content = reasoning + r, content + c
            if in_thought:  # an end marker still arriving is held back, never shown
                assert "</th" not in r + c or "</think>" in text[: i + size]
        r, c = s.finish()
        assert (reasoning + r, content + c) == want


def test_random_texts_stream_like_whole():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<", "</", "think", ">", "a", " ", "\n", "é"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        parser, start = rng.choice([(R1, True), (R1, False), (QWEN3, False)])
        want = split_reasoning(parser, start, text)
        s = ReasoningSplitter(parser, start)
        got_r = got_c = ""
        i = 0
        while i < len(text):
            n = rng.randint(1, 4)
            r, c = s.feed(text[i : i + n])
            got_r, got_c = got_r + r, got_c + c
            i += n
        r, c = s.finish()
        assert (got_r + r, got_c + c) == want, text


def test_markers_and_thinking_params_from_the_real_tokenizer():
    src = TOKENIZERS / "deepseek-r1-distill-qwen"
    if not src.is_dir():
        pytest.skip(f"../shared is absent ({src} not found)")
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(src)
    start, end = marker_ids(tok, R1)
    assert tok.decode([start]) == "<think>" and tok.decode([end]) == "</think>"
    p = thinking_params(tok, R1, 7)
    assert (p.start_token_id, p.end_token_id, p.max_thinking_tokens) == (start, end, 7)
    assert p.think_by_default and not thinking_params(tok, QWEN3, None).think_by_default
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    ids = tok.encode(prompt + "<｜Assistant｜><think>\n", add_special_tokens=False)
    assert p.open_after(ids) and not p.open_after(ids + [end])
    auto = thinking_params(tok, None, 3)  # no parser: the tokenizer's own markers
    assert (auto.start_token_id, auto.end_token_id) == (start, end)
    assert thinking_params(tok, None, None) is None

    qwen = tf.AutoTokenizer.from_pretrained(TOKENIZERS / "qwen2.5")
    with pytest.raises(ConfigError, match="<think>"):
        marker_ids(qwen, R1)
    with pytest.raises(RequestError, match="max_thinking_tokens"):
        thinking_params(qwen, None, 5)
