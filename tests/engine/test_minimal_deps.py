"""The engine core runs where only torch, triton, transformers, safetensors, tokenizers, jinja2,
tqdm and numpy are installed (the lent GPU machine): the server's and structured output's
libraries are imported only where used."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SERVER_ONLY = ("fastapi", "uvicorn", "pydantic", "starlette", "xgrammar", "prometheus_client")


def test_engine_and_pipeline_run_without_server_libraries(model_dirs):
    _, path = model_dirs("llama")
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {SERVER_ONLY!r}:
                    raise ImportError("not installed here: " + name)

        sys.meta_path.insert(0, Block())
        from steadylm.config import EngineConfig
        from steadylm.engine.llm_engine import LLMEngine
        from steadylm.engine.request import SamplingParams
        import steadylm.entrypoints.pipeline

        engine = LLMEngine.from_pretrained({path!r}, EngineConfig(num_gpu_blocks=32, block_size=4))
        out = engine.generate([[3, 17, 42]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(out[0].output_token_ids) == 4
        print("ran")
        """
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr[-2000:]
