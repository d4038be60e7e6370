"""KV quantization: round-trip bounds, 4-bit packing, and perplexity through the engine."""

from __future__ import annotations

import pytest
import torch

from steadylm.attention.torch_ref import dequantize_kv, quantize_kv
from tests.conftest import STORIES, engine_for, needs_shared


@pytest.mark.parametrize("bits,levels", [(8, 255), (4, 15)])
def test_round_trip_error_is_at_most_half_a_step(bits, levels):
    x = torch.randn(50, 4, 16) * 3
    codes, sz = quantize_kv(x, bits)
    assert codes.dtype == torch.uint8
    assert codes.shape == (50, 4, 16 if bits == 8 else 8)
    assert sz.shape == (50, 4, 2) and sz.dtype == x.dtype
    y = dequantize_kv(codes, sz, bits)
    step = (x.amax(-1) - x.amin(-1)) / levels  # (T, H): per token and head
    assert torch.all((y - x).abs() <= step[..., None] / 2 + 1e-5)
    # min and max of each (token, head) are represented exactly (asymmetric scheme)
    torch.testing.assert_close(y.amin(-1), x.amin(-1), rtol=0, atol=1e-5)


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    x = torch.tensor([[[0.0, 15.0, 3.0, 7.0]]])
    codes, _ = quantize_kv(x, 4)
    assert codes.tolist() == [[[0xF0, 0x73]]]


def test_constant_rows_do_not_divide_by_zero():
    x = torch.full((3, 2, 8), 0.25)
    for bits in (8, 4):
        codes, sz = quantize_kv(x, bits)
        torch.testing.assert_close(dequantize_kv(codes, sz, bits), x)


@needs_shared
def test_int8_perplexity_change_is_well_under_one_percent():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    text = (
        "Once upon a time, there was a little boy named Ben. Ben had a red kite. Every "
        "day after lunch, he ran to the hill behind his house to fly it."
    )
    ids = tok.encode(text)
    base = engine_for(str(STORIES), block_size=16, max_prefill_token_num=8).perplexity(ids)
    int8 = engine_for(
        str(STORIES), block_size=16, max_prefill_token_num=8, quant_policy=8
    ).perplexity(ids)
    assert abs(int8 / base - 1) < 0.01
    assert 1 < base < 20  # a trained model on its own domain


def test_score_matches_generation_logits(model_dirs):
    hf, path = model_dirs("qwen3")
    ids = [3, 9, 27, 81, 43, 2, 5, 6, 7, 8]
    logits = engine_for(path, max_prefill_token_num=3).score(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
