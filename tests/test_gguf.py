"""GGUF files: greedy tokens equal transformers reading the same file, every tensor type,
each rank's rows and columns, and the clear errors before anything is allocated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steadylm import gguf_file
from steadylm.errors import ModelLoadError
from tests.conftest import engine_for, hf_greedy, make_hf_model, run_to_end

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
from tests.gguf_util import hf_from_gguf, write_gguf  # noqa: E402

# Rows a multiple of the K-quants' 256-value blocks, so every type fits every linear.
SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
ALL_TYPES = list(gguf_file.SUPPORTED_TYPES)
PROMPTS = [[5, 9, 22, 41, 3, 7, 60], [11, 2, 90], list(range(1, 30))]


def _write(tmp_path, arch: str, types: list[str], **overrides) -> str:
    model = make_hf_model(arch, **{**SIZES, **overrides})
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(model, path, arch, types)
    return path


def _steadylm_greedy(path: str, prompts, n: int, **kw) -> list[list[int]]:
    from steadylm.engine.request import SamplingParams

    engine = engine_for(path, **kw)
    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts
    ]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.block_manager.check_integrity()
    return [got[i] for i in ids]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_on_every_tensor_type(tmp_path, arch):
    # Each 2-D tensor takes the next type in turn: all 13 appear in the file's 15 matrices.
    # transformers' GGUF config leaves Qwen3's head_dim at Qwen3Config's 128, so the reference
    # needs 128 there (steadylm reads the file's key_length: test_head_dim_from_key_length).
    shape = dict(hidden_size=512, head_dim=128) if arch == "qwen3" else {}
    path = _write(tmp_path, arch, ALL_TYPES, tie_word_embeddings=arch == "llama", **shape)
    r = gguf_file.reader(path)
    assert {t.tensor_type.name for t in r.tensors} >= set(ALL_TYPES)
    ref = hf_from_gguf(path)
    want = [hf_greedy(ref, p, 12) for p in PROMPTS]
    assert _steadylm_greedy(path, PROMPTS, 12) == want
    # Chunked prefill, a tiny pool that preempts, and the prefix cache give the same tokens.
    chunked = _steadylm_greedy(
        path, PROMPTS, 12, max_prefill_token_num=8, num_gpu_blocks=12, enable_prefix_caching=True
    )
    assert chunked == want


def test_dequantized_weights_equal_transformers(tmp_path, monkeypatch):
    """Every parameter (q / k un-permuted, merged layers in their parts) holds exactly what
    transformers reads from the same file."""
    from steadylm.config import ModelConfig
    from steadylm.layers.linear import Linear
    from steadylm.loader import load_model

    path = _write(tmp_path, "llama", ["Q4_K", "Q8_0", "Q6_K", "Q5_0"], tie_word_embeddings=False)
    ref = hf_from_gguf(path).state_dict()
    mc = ModelConfig.from_path(path)
    monkeypatch.setattr(Linear, "process_weights_after_loading", lambda self: None)  # unpacked
    model = load_model(path, mc, torch.float32, torch.device("cpu"))
    layer = model.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split([mc.q_size, mc.kv_size, mc.kv_size])
    at = "model.layers.1.self_attn."
    assert torch.equal(q, ref[at + "q_proj.weight"])
    assert torch.equal(k, ref[at + "k_proj.weight"])
    assert torch.equal(v, ref[at + "v_proj.weight"])
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])


def test_config_and_dtype_from_metadata(tmp_path):
    from steadylm.config import ModelConfig

    path = _write(tmp_path, "qwen3", ["Q8_0"], tie_word_embeddings=False)
    mc = ModelConfig.from_path(path)
    assert (mc.architecture, mc.num_layers, mc.num_heads, mc.num_kv_heads) == (
        "Qwen3ForCausalLM",
        2,
        4,
        2,
    )
    assert (mc.hidden_size, mc.head_dim, mc.tie_word_embeddings) == (256, 64, False)
    assert mc.torch_dtype == "bfloat16"  # a quantized file computes in bf16 under "auto"
    assert ModelConfig.from_path(str(tmp_path)).architecture == "Qwen3ForCausalLM"  # its dir
    f16 = _write(tmp_path / "..", "qwen2", ["F16"])
    assert ModelConfig.from_path(f16).torch_dtype == "float16"


def test_head_dim_from_key_length(tmp_path):
    """Qwen3's head_dim is not hidden / heads (0.6B: 1024 / 16 = 64, not its 128);
    transformers' GGUF config leaves it at a default, the file's key_length says it."""
    from steadylm.config import ModelConfig

    path = _write(tmp_path, "qwen3", ["F32"], head_dim=32)
    assert ModelConfig.from_path(path).head_dim == 32


def test_rank_reads_only_its_rows_and_aligned_columns(tmp_path):
    from steadylm.layers.shard import CheckpointTensor

    path = _write(tmp_path, "qwen2", ["Q4_K", "Q8_0"])
    r = gguf_file.reader(path)
    t = next(t for t in r.tensors if t.tensor_type.name == "Q4_K" and t.shape[0] == 512)
    whole = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    src = gguf_file.GGUFSlice(t)
    ct = CheckpointTensor(src, src.shape)
    part = ct.narrow(0, 3, 5).narrow(1, 256, 256).materialize()  # whole blocks of columns
    assert torch.equal(part, whole[3:8, 256:512])
    odd = ct.narrow(1, 40, 100).materialize()  # inside a block: dequantized, then cut
    assert torch.equal(odd, whole[:, 40:140])


def test_unpermute_inverts_llama_cpp_permute_for_any_rows():
    from tests.gguf_util import permute

    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)

    class Fake:
        tensor_type = gguf.GGMLQuantizationType.F32
        shape = (3, 64)
        data = permute(w, 4)

    src = gguf_file.GGUFSlice(Fake(), permute_heads=4)
    assert torch.equal(src[slice(None), slice(None)], torch.from_numpy(w))
    assert torch.equal(src[slice(5, 37), slice(1, 3)], torch.from_numpy(w[5:37, 1:3]))


def _one_tensor_gguf(path: str, arch: str, experts: int | None = None) -> str:
    """A GGUF file of one block and one F32 tensor: enough to be checked, never loaded."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    if experts is not None:
        w.add_expert_count(experts)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_architecture_is_a_clear_error_before_allocating(tmp_path):
    path = _one_tensor_gguf(str(tmp_path / "phi.gguf"), "phi2")
    with pytest.raises(ModelLoadError, match="architecture 'phi2' is not supported.*llama"):
        engine_for(path)


def test_mixture_of_experts_gguf_is_refused_with_the_reason(tmp_path):
    """llama.cpp writes Mixtral as 'llama' with an expert count: not a dense Llama to load."""
    path = _one_tensor_gguf(str(tmp_path / "mixtral.gguf"), "llama", experts=8)
    with pytest.raises(ModelLoadError, match="mixture of experts in GGUF .8 experts"):
        engine_for(path)
    # an architecture of its own: named as unsupported
    path = _one_tensor_gguf(str(tmp_path / "qwen3moe.gguf"), "qwen3moe")
    with pytest.raises(ModelLoadError, match="architecture 'qwen3moe' is not supported"):
        engine_for(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = str(tmp_path / "iq.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    raw = np.zeros((4, 66), np.uint8)  # one IQ2_XXS block a row
    w.add_tensor("token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="IQ2_XXS.*token_embd.weight.*supported: F32"):
        engine_for(path)


def test_not_a_gguf_file_and_several_in_a_directory(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read .*broken.gguf as GGUF"):
        engine_for(str(bad))
    (tmp_path / "other.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files"):
        engine_for(str(tmp_path))


def test_plan_counts_dequantized_bytes(tmp_path):
    from steadylm.loader import checkpoint_weight_bytes

    path = _write(tmp_path, "llama", ["Q4_0"], tie_word_embeddings=True)
    model = make_hf_model("llama", **SIZES, tie_word_embeddings=True)
    n = sum(p.numel() for p in model.parameters())  # the tied head counted once
    assert checkpoint_weight_bytes(path, torch.bfloat16) == 2 * n
    engine = engine_for(path)
    assert engine.plan.weight_bytes == 4 * n
    run_to_end(engine)


def test_config_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from steadylm.config import ModelConfig

    monkeypatch.setenv("STEADYLM_CACHE_DIR", str(tmp_path / "cache"))
    path = _write(tmp_path, "qwen3", ["Q8_0"], head_dim=32)
    first = ModelConfig.from_path(path)

    def no_conversion(path):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_file, "_convert_config", no_conversion)
    again = ModelConfig.from_path(path)
    assert again == first and again.head_dim == 32 and again.torch_dtype == "bfloat16"
    # A rewritten file (another size / modification time) is converted anew.
    write_gguf(make_hf_model("qwen3", **{**SIZES, "num_hidden_layers": 3}), path, "qwen3", ["F16"])
    with pytest.raises(AssertionError, match="converted again"):
        ModelConfig.from_path(path)


def test_steadylm_plan_on_a_gguf_file(tmp_path, capsys):
    import json

    from steadylm.entrypoints.cli import main
    from steadylm.loader import checkpoint_weight_bytes

    path = _write(tmp_path, "qwen2", ["Q4_K", "Q8_0"])
    assert main(["plan", path, "--gpu", "rtx4090", "--dtype", "bf16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weight_bytes"] == checkpoint_weight_bytes(path, torch.bfloat16)
    assert main(["plan", path, "--gpu", "rtx4090"]) == 0
    out = capsys.readouterr().out
    assert "GGUF file:" in out and "Q4_K" in out and "Q8_0" in out and "dequantized" in out
