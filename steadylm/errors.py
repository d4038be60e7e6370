"""Typed errors for everything a user can cause. Each message names the limit and the fix."""

from __future__ import annotations


class SteadyLMError(Exception):
    """Base class. `param` names the offending field when there is one (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(SteadyLMError, ValueError):
    """An invalid or conflicting engine setting."""


class ModelLoadError(SteadyLMError):
    """A model directory that cannot be loaded: missing files, unknown architecture, bad shapes."""


class RequestError(SteadyLMError, ValueError):
    """A request that can never run: invalid sampling values, a prompt longer than the limits."""


class OutOfMemoryPlanError(SteadyLMError):
    """The memory plan cannot fit the model, its activations and a minimal KV cache."""


class EngineDeadError(SteadyLMError):
    """The engine loop stopped after a fault; the cause is in the message."""
