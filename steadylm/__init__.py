"""steadylm: an LLM engine that never stalls, says exactly what fits, and is measured."""

__version__ = "0.1.0"
