"""Model architectures, found through a registry keyed by the HF `architectures` name."""

from steadylm.models.registry import get_model_class, register, supported_architectures

__all__ = ["get_model_class", "register", "supported_architectures"]
