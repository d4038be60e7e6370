"""`from steadylm.messages import ...` works as `from lmdeploy.messages import ...` does: the
public types of `lmdeploy.messages` (0.18) that a user script builds or reads.

LMDeploy's engine-internal types (`KVTransferConfig`, `EventType`, `EngineEvent`,
`ScheduleMetrics`, `RequestMetrics`, `EngineOutput`) are not provided: they describe LMDeploy's
own engine, which steadylm does not run (docs/lmdeploy_compat.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from steadylm.api import (
    ChatTemplateConfig,
    GenerationConfig,
    PytorchEngineConfig,
    Response,
    TurbomindEngineConfig,
)

__all__ = [
    "ChatTemplateConfig",
    "GenerationConfig",
    "PytorchEngineConfig",
    "QuantPolicy",
    "Response",
    "ResponseType",
    "SpeculativeConfig",
    "TurbomindEngineConfig",
    "VisionConfig",
]


class QuantPolicy(enum.IntEnum):
    """KV cache quantization, LMDeploy's values. steadylm runs NONE, INT4 and INT8; the others
    are refused by the engine configs with the reason."""

    NONE = 0
    INT4 = 4
    INT8 = 8
    FP8 = 16
    FP8_E5M2 = 17
    TURBO_QUANT = 42


class ResponseType(enum.Enum):
    """LMDeploy's engine response types (for code that compares against them)."""

    SUCCESS = enum.auto()
    FINISH = enum.auto()
    ENGINE_STOP_ERROR = enum.auto()
    SESSION_REPEAT = enum.auto()
    SESSION_NOT_EXIST = enum.auto()
    HANDLER_NOT_EXIST = enum.auto()
    INPUT_LENGTH_ERROR = enum.auto()
    INTERNAL_ENGINE_ERROR = enum.auto()
    CANCEL = enum.auto()
    PREFIX_CACHE_CONFLICT = enum.auto()
    NO_QUEUE = enum.auto()
    NOT_SUPPORTED = enum.auto()
    OUT_OF_MEMORY = enum.auto()


@dataclass
class VisionConfig:
    """Accepted for scripts that build it; steadylm serves text-only models, so passing it to
    `pipeline(vision_config=...)` has no effect (said at INFO)."""

    max_batch_size: int = 1
    thread_safe: bool = False


@dataclass
class SpeculativeConfig:
    """LMDeploy's fields. `method` "ngram" or "suffix" runs (draft-free speculative decoding,
    steadylm.config.SpeculativeConfig has their knobs); a draft model, EAGLE, MTP or DFlash is
    refused with the reason."""

    method: str
    model: str = ""
    num_speculative_tokens: int = 1
    dflash_block_size: int | None = None
