"""A tiny random Qwen2 model carrying the real DeepSeek-R1-Distill-Qwen tokenizer and chat
template (whose template writes BOS while the tokenizer adds BOS too)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import TOKENIZERS


def shape_for_quick_eos(model, eos_id: int, eos_logit: float) -> None:
    """Make the random model's next-token distribution fixed and give EOS a known share, so a
    30000-token request ends after a few dozen sampled tokens (a random model never would).
    The residual stream's last dimension is a constant the layers cannot change, the final norm
    keeps only it, and so logits = lm_head[:, -1] * constant."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, -1] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[-1].zero_()
            layer.mlp.down_proj.weight[-1].zero_()
        model.model.norm.weight.zero_()
        model.model.norm.weight[-1] = 1.0
        head = torch.randn(model.lm_head.weight.shape[0]) * 0.05
        head[eos_id] = eos_logit
        model.lm_head.weight[:, -1] = head


def tiny_qwen2_dir(tmp_path_factory, tokenizer: str, seed: int, quick_eos: bool) -> str:
    """A tiny random Qwen2 model saved with a real tokenizer (and its chat template) from
    ../shared/tokenizers/<tokenizer>."""
    import transformers as tf

    src = TOKENIZERS / tokenizer
    if not src.is_dir():
        pytest.skip(f"../shared is absent ({src} not found)")
    tok = tf.AutoTokenizer.from_pretrained(src)
    torch.manual_seed(seed)
    cfg = tf.Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = tf.Qwen2ForCausalLM(cfg).eval()
    if quick_eos:
        shape_for_quick_eos(model, tok.eos_token_id, eos_logit=0.3)
    path = tmp_path_factory.mktemp(tokenizer)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / f, path / f)
    return str(path)


@pytest.fixture(scope="session")
def qwen_dsr1_dir(tmp_path_factory):
    return tiny_qwen2_dir(tmp_path_factory, "deepseek-r1-distill-qwen", 0, quick_eos=True)


@pytest.fixture(scope="session")
def qwen25_dir(tmp_path_factory):
    """Weights left as noise: structured output must hold even then."""
    return tiny_qwen2_dir(tmp_path_factory, "qwen2.5", 1, quick_eos=False)


@pytest.fixture(scope="module")
def server():
    """`steadylm serve` on stories260K in a subprocess, one per test module."""
    import signal

    from tests.entrypoints.test_server import start_server

    proc, base = start_server()
    yield base
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


TOOLS_MODEL = "m"  # the served name of the tiny Qwen servers below


@pytest.fixture(scope="module")
def qwen_tools(qwen25_dir):
    from tests.entrypoints.test_server import inproc_server

    with inproc_server(
        engine_kw={"num_gpu_blocks": 256},
        model_dir=qwen25_dir,
        name=TOOLS_MODEL,
        tool_call_parser="hermes",
    ) as (base, _):
        yield base


@pytest.fixture(scope="module")
def r1(qwen_dsr1_dir):
    from tests.entrypoints.test_server import inproc_server

    with inproc_server(
        engine_kw={"num_gpu_blocks": 128},
        model_dir=qwen_dsr1_dir,
        name=TOOLS_MODEL,
        reasoning_parser="deepseek-r1",
    ) as (base, state):
        yield base, state
