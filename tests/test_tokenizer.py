"""Incremental detokenizing on real tokenizers: no broken UTF-8 in any delta, and the deltas
add up to the full decode."""

from __future__ import annotations

import pytest

from steadylm.tokenizer import IncrementalDetokenizer, PromptEncoder
from tests.conftest import STORIES, TOKENIZERS, needs_shared

TEXTS = [
    "café naïve — 日本語 😀 and more",
    "Numbers 12345 and symbols #@$% ~ [x] {y} <z>",
    " leading space and trailing space ",
    "Tom and  Sue went to the park.\nThey saw a dog.",
]


@needs_shared
@pytest.mark.parametrize(
    "tok_dir",
    [STORIES, TOKENIZERS / "qwen2.5", TOKENIZERS / "llama2"],
    ids=["stories-bytefallback", "qwen2.5-bytelevel", "llama2-spm"],
)
@pytest.mark.parametrize("text", TEXTS)
def test_stream_never_breaks_utf8_and_equals_decode(tok_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    prompt = tok.encode("Hello", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([t]) for t in ids] + [detok.add([], final=True)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]


@needs_shared
def test_duplicate_bos_dropped_and_logged_once(caplog):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZERS / "deepseek-r1-distill-qwen")
    enc = PromptEncoder(tok)
    msgs = [{"role": "user", "content": "hi"}]
    raw = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert raw[:2] == [tok.bos_token_id] * 2  # the bug: template BOS + tokenizer BOS
    with caplog.at_level("WARNING", logger="steadylm"):
        a = enc.encode_messages(msgs)
        b = enc.encode_messages(msgs)
    assert a == b == raw[1:]
    assert sum("BOS twice" in r.getMessage() for r in caplog.records) == 1
    qwen = PromptEncoder(AutoTokenizer.from_pretrained(TOKENIZERS / "qwen2.5"))
    ids = qwen.encode_messages(msgs)  # Qwen2.5 has no BOS: nothing to fix
    assert qwen.duplicate_bos_fixed == 0 and ids[0] != ids[1]


def test_stop_string_held_back_until_decided():
    class CharTok:  # one token per character
        def decode(self, ids, **_):
            return "".join(chr(i) for i in ids)

    detok = IncrementalDetokenizer(CharTok(), [], stop=["END"])
    out = [detok.add([ord(c)]) for c in "abcEN"]
    assert "".join(out) == "abc"  # "EN" is held back: it may start "END"
    assert detok.add([ord("D")]) == "" and detok.stopped
    assert detok.text == "abcEN"[:3]
