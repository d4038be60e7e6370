"""steadylm: an LLM engine that never stalls, says exactly what fits, and is measured.

`from steadylm import pipeline, GenerationConfig, PytorchEngineConfig` works as it does in
LMDeploy. Names are imported lazily, so `import steadylm` itself does no work.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# Before torch's first CPU allocation: its allocator then backs large buffers with transparent
# huge pages (platform.torch_huge_pages says why; STEADYLM_CPU_HUGEPAGES=off leaves it alone).
if os.environ.get("STEADYLM_CPU_HUGEPAGES", "on") != "off":
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

_EXPORTS = {
    "pipeline": "steadylm.entrypoints.pipeline",
    "Pipeline": "steadylm.entrypoints.pipeline",
    "GenerationConfig": "steadylm.api",
    "PytorchEngineConfig": "steadylm.api",
    "TurbomindEngineConfig": "steadylm.api",
    "ChatTemplateConfig": "steadylm.api",
    "Response": "steadylm.api",
    "EngineConfig": "steadylm.config",
    "LLMEngine": "steadylm.engine.llm_engine",
    "AsyncEngine": "steadylm.engine.async_engine",
    "SamplingParams": "steadylm.engine.request",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'steadylm' has no attribute {name!r}")
