"""steadylm: an LLM engine that never stalls, says exactly what fits, and is measured.

`from steadylm import pipeline, GenerationConfig, PytorchEngineConfig` works as it does in
LMDeploy. Names are imported lazily, so `import steadylm` itself does no work.
"""

from __future__ import annotations

import importlib
from typing import Any

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
