"""Architecture registry. Model modules register themselves when imported by `_load_all`."""

from __future__ import annotations

import importlib

from steadylm.errors import ModelLoadError

_REGISTRY: dict[str, type] = {}
_MODULES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral")


def register(*names: str):
    def wrap(cls: type) -> type:
        for name in names:
            _REGISTRY[name] = cls
        return cls

    return wrap


def _load_all() -> None:
    for mod in _MODULES:
        importlib.import_module(f"steadylm.models.{mod}")


def supported_architectures() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type:
    _load_all()
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(
            f"architecture {architecture!r} (config.json 'architectures') is not supported; "
            f"supported: {', '.join(sorted(_REGISTRY))}"
        ) from None
