"""Shared fixtures: tiny random HF models of each architecture, saved as real model dirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run in Triton's interpreter on CPU tensors when no GPU is present. Triton
# reads the variable when a kernel is defined, so it is set before any steadylm kernel module
# imports; on a CUDA machine the kernels compile for the device (the `gpu` tests).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_device(what: str) -> torch.device:
    """At a kernel test module's top: skip it unless Triton runs here (compiled on a GPU, or
    interpreted on CPU tensors); the device its kernels take."""
    pytest.importorskip("triton", reason=f"triton is not installed: {what} cannot run")
    from steadylm import platform

    if not torch.cuda.is_available() and not platform.triton_interpreted():
        pytest.skip(
            "no CUDA device and TRITON_INTERPRET is unset: Triton kernels cannot run here",
            allow_module_level=True,
        )
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES = SHARED / "models" / "stories260K"
TOKENIZERS = SHARED / "tokenizers"
MODEL_CONFIGS = SHARED / "model_configs"

needs_shared = pytest.mark.skipif(
    not STORIES.is_dir(), reason=f"../shared is absent ({STORIES} not found)"
)

TINY = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
)
ARCHS = ("llama", "llama3", "qwen2", "qwen3", "mistral")
# Mixture-of-experts architectures (tests/models/test_moe.py): 8 experts, top 2.
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# Layer sizes the packed CPU GEMV and the AWQ layout take (every linear's output a multiple of
# 64, its input of 16 and of the AWQ group).
GEMV_SIZES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


def make_hf_model(arch: str, seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    if arch == "llama":
        cfg = tf.LlamaConfig(**{"tie_word_embeddings": True, **kw})
        cls = tf.LlamaForCausalLM
    elif arch == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        cfg = tf.LlamaConfig(rope_scaling=rope, **kw)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**kw)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**kw)
        cls = tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(sliding_window=24, **kw)
        cls = tf.MistralForCausalLM
    elif arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers)
        moe = {**MOE, "num_experts": 8, "norm_topk_prob": True, "mlp_only_layers": [1]}
        cfg = tf.Qwen3MoeConfig(**{**moe, **kw})
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "qwen2_moe":  # with the gated shared expert
        moe = {**MOE, "num_experts": 8, "shared_expert_intermediate_size": 40}
        cfg = tf.Qwen2MoeConfig(**{**moe, **kw})
        cls = tf.Qwen2MoeForCausalLM
    elif arch == "mixtral":  # experts of intermediate_size
        moe = {"num_local_experts": 8, "num_experts_per_tok": 2}
        cfg = tf.MixtralConfig(**{**moe, **kw})
        cls = tf.MixtralForCausalLM
    else:
        raise ValueError(arch)
    model = cls(cfg).eval()
    if arch in MOE_ARCHS:  # a router that routes: each token's experts differ
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                    p.normal_(0, 1.0)
    if arch == "qwen2":  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    return model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> (hf_model, saved directory); built once per test session."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            model = make_hf_model(arch)
            path = tmp_path_factory.mktemp(arch)
            model.save_pretrained(path)
            cache[arch] = (model, str(path))
        return cache[arch]

    return get


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=n,
        )
    return out[0, len(prompt) :].tolist()


def engine_for(path: str, **kw):
    from steadylm.config import EngineConfig
    from steadylm.engine.llm_engine import LLMEngine

    knobs = (
        "max_total_tokens",
        "kv_cache_bytes",
        "gpu_memory_utilization",
        "cache_max_entry_count",
    )
    if not any(kw.get(k) for k in knobs):
        kw.setdefault("num_gpu_blocks", 128)
    kw.setdefault("block_size", 4)
    # The checkpoints are fp32 and compared with fp32 transformers; "auto" would be bf16 on CUDA.
    kw.setdefault("dtype", "float32")
    return LLMEngine.from_pretrained(path, EngineConfig(**kw))


def run_to_end(engine, check=True, max_steps=100_000):
    steps = 0
    while engine.has_unfinished():
        engine.step()
        if check:
            engine.block_manager.check_integrity()
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return steps


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
