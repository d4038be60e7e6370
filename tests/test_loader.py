"""Model loading: sharded checkpoints load; each broken directory gets a clear error naming the
file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from steadylm.config import ModelConfig
from steadylm.engine.request import SamplingParams
from steadylm.errors import ModelLoadError
from tests.conftest import engine_for, hf_greedy, make_hf_model


@pytest.fixture
def saved(tmp_path):
    model = make_hf_model("llama", tie_word_embeddings=False)
    model.save_pretrained(tmp_path)
    return model, tmp_path


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    model = make_hf_model("qwen3")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    prompt = [3, 4, 5, 6]
    req = engine_for(str(tmp_path)).generate(
        [prompt], SamplingParams(max_new_tokens=16, ignore_eos=True)
    )[0]
    assert req.output_token_ids == hf_greedy(model, prompt, 16)


def test_unknown_architecture(saved):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM.*supported: LlamaForCausalLM"):
        engine_for(str(path))


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json not found"):
        ModelConfig.from_path(str(tmp_path))


def test_missing_weights_file(saved):
    _, path = saved
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights in"):
        engine_for(str(path))


def test_missing_shard(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"shard '{shard.name}'"):
        engine_for(str(tmp_path))


def test_missing_tensor_is_named(saved):
    _, path = saved
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight \(shard 1\)"
    ):
        engine_for(str(path))


def test_shape_mismatch_names_file_and_tensor(saved):
    _, path = saved
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 48)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor "
        r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*\(5, 48\)",
    ):
        engine_for(str(path))


def test_bfloat16_checkpoint_loads_in_requested_dtype(tmp_path):
    model = make_hf_model("mistral").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    engine = engine_for(str(tmp_path), dtype="float32")
    assert engine.dtype == torch.float32
    engine16 = engine_for(str(tmp_path), dtype="bfloat16")
    assert next(engine16.runner.model.parameters()).dtype == torch.bfloat16
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu_follows_checkpoint_and_cpu(native, monkeypatch):
    from types import SimpleNamespace

    from steadylm import platform

    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    bf16 = SimpleNamespace(torch_dtype="bfloat16")  # resolve_dtype reads only this field
    assert platform.resolve_dtype("auto", bf16, cpu) == (
        torch.bfloat16 if native else torch.float32
    )
    for ckpt in ("float32", "float16"):  # fp16 math is slow on CPUs: fp32
        assert (
            platform.resolve_dtype("auto", SimpleNamespace(torch_dtype=ckpt), cpu) == torch.float32
        )
    assert platform.resolve_dtype("float32", bf16, cpu) == torch.float32  # explicit wins


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/etc/passwd", "sub/../../x"])
def test_shard_paths_outside_the_model_dir_are_refused(tmp_path, escape):
    """Issue 19.7: an index entry may not load a file outside the model directory, even one
    that exists and holds valid tensors."""
    model_dir = tmp_path / "model"
    make_hf_model("llama").save_pretrained(model_dir, max_shard_size="20KB")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(sorted(model_dir.glob("model-*.safetensors"))[0], outside)
    (model_dir / "sub").mkdir()
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = escape
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="outside"):
        engine_for(str(model_dir))
