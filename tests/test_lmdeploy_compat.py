"""Issue 20: every public field and method of LMDeploy's current `lmdeploy.messages` types,
`ChatTemplateConfig` and `pipeline` exists in steadylm, with one of three outcomes per field.

The list of fields is read from the installed LMDeploy release's source (installed with
`--no-deps` by .ci/run; its modules are parsed, never imported), so it cannot drift: a field
LMDeploy adds fails this test until steadylm decides its outcome.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
from pathlib import Path

import pytest

from steadylm import api
from steadylm.api import NO_EFFECT, REJECTED, WORKS
from steadylm.entrypoints import pipeline as pipeline_mod
from steadylm.errors import SteadyLMError

DOC = Path(__file__).resolve().parents[1] / "docs" / "lmdeploy_compat.md"
CLASSES = ("GenerationConfig", "PytorchEngineConfig", "TurbomindEngineConfig", "Response")
# Where steadylm's default differs from LMDeploy's, and why (also stated in the docs).
DIFFERENT_DEFAULTS = {
    ("PytorchEngineConfig", "max_prefill_token_num"): "4096: half the activation reserve",
    ("ChatTemplateConfig", "model_name"): "optional: None is the tokenizer's template",
}
# A valid non-default value for every field that works the same (a new field fails here).
WORKING_SAMPLES = {
    "GenerationConfig": dict(
        n=1,
        max_new_tokens=7,
        do_sample=True,
        top_p=0.5,
        top_k=5,
        min_p=0.1,
        temperature=0.5,
        repetition_penalty=1.1,
        ignore_eos=True,
        random_seed=3,
        stop_words=["x"],
        bad_words=["y"],
        stop_token_ids=[2],
        bad_token_ids=[3],
        min_new_tokens=2,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        logprobs=2,
        response_format={"type": "json_object"},
        include_stop_str_in_output=True,
    ),
    "PytorchEngineConfig": dict(
        eager_mode=True,
        dtype="float32",
        tp=1,
        session_len=64,
        max_batch_size=4,
        cache_max_entry_count=0.5,
        block_size=16,
        num_gpu_blocks=8,
        max_prefill_token_num=32,
        enable_prefix_caching=True,
        device_type="cpu",
        quant_policy=4,
        model_format="hf",
    ),
    "TurbomindEngineConfig": dict(
        dtype="float16",
        model_format="awq",
        tp=1,
        session_len=64,
        max_batch_size=4,
        cache_max_entry_count=0.5,
        cache_block_seq_len=16,
        enable_prefix_caching=True,
        quant_policy=8,
        max_prefill_token_num=32,
    ),
}


def lmdeploy_source(module: str) -> ast.Module:
    from importlib import metadata

    try:
        dist = metadata.distribution("lmdeploy")
    except metadata.PackageNotFoundError:
        pytest.skip("lmdeploy is not installed (.ci/run installs it with --no-deps)")
    path = Path(dist.locate_file(f"lmdeploy/{module}.py"))
    return ast.parse(path.read_text())


def lmdeploy_fields(module: str, cls: str) -> dict[str, object]:
    """Field name -> default (a Python value where the default is a literal, else its text)."""
    node = next(n for n in lmdeploy_source(module).body if getattr(n, "name", "") == cls)
    out = {}
    for b in node.body:
        if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
            out[b.target.id] = _default(b.value)
    return out


def _default(node: ast.expr | None) -> object:
    if node is None:
        return dataclasses.MISSING
    text = ast.unparse(node)
    if text.startswith("field(default_factory=list"):
        return []
    try:
        return ast.literal_eval(node)
    except ValueError:
        return text


def steadylm_defaults(cls: type) -> dict[str, object]:
    return {f.name: api._default(f) for f in dataclasses.fields(cls)}


def _same_default(ours: object, theirs: object) -> bool:
    if ours == theirs:
        return True
    if isinstance(theirs, str) and "." in theirs:  # an enum member: QuantPolicy.NONE
        enum_cls, member = theirs.split(".", 1)
        if enum_cls == "QuantPolicy":
            from steadylm.messages import QuantPolicy

            return ours == QuantPolicy[member]
        return ours == member  # EngineRole.Hybrid -> "Hybrid"
    return False


@pytest.mark.parametrize("cls", CLASSES + ("ChatTemplateConfig",))
def test_every_lmdeploy_field_exists_with_lmdeploys_default(cls):
    module = "model" if cls == "ChatTemplateConfig" else "messages"
    theirs = lmdeploy_fields(module, cls)
    ours = steadylm_defaults(getattr(api, cls))
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"{cls} lacks LMDeploy's fields {missing}"
    for name, default in theirs.items():
        if (cls, name) in DIFFERENT_DEFAULTS or default is dataclasses.MISSING:
            continue
        assert _same_default(ours[name], default), (cls, name, ours[name], default)


@pytest.mark.parametrize("cls", CLASSES[:3])
def test_every_field_has_an_outcome_and_behaves_as_it_says(cls, caplog):
    """WORKS: a valid non-default value is taken. NO_EFFECT: INFO names the field. REJECTED:
    a SteadyLMError (ValueError) names the field. Never a TypeError."""
    klass = getattr(api, cls)
    theirs = lmdeploy_fields("messages", cls)
    for name in theirs:
        outcome = klass.POLICY.get(name, (WORKS, ""))[0]
        if outcome == WORKS:
            assert name in WORKING_SAMPLES[cls], f"{cls}.{name}: no sample value to check"
            cfg = klass(**{name: WORKING_SAMPLES[cls][name]})
            if hasattr(cfg, "to_engine_config"):
                cfg.to_engine_config()
            continue
        value = _odd_value(steadylm_defaults(klass)[name])
        kwargs = {name: value, **PAIRED.get(name, {})}
        api._SAID.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="steadylm"):
            try:
                cfg = klass(**kwargs)
                if hasattr(cfg, "to_engine_config"):
                    cfg.to_engine_config()
            except SteadyLMError as exc:
                assert outcome == REJECTED, f"{cls}.{name} rejected but listed as {outcome}"
                assert exc.param in kwargs and exc.param in exc.message
                continue
        assert outcome == NO_EFFECT, f"{cls}.{name}={value!r} was not rejected"
        assert any(f"{cls}.{name}" in r.getMessage() for r in caplog.records), name


# Fields that only act together (LMDeploy resets one without the other to 0).
PAIRED = {
    "repetition_ngram_size": {"repetition_ngram_threshold": 3},
    "repetition_ngram_threshold": {"repetition_ngram_size": 3},
}


def _odd_value(default: object) -> object:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2
    if isinstance(default, float):
        return default + 0.5
    if isinstance(default, str):
        return default + "-other"
    return {"set": 1} if default is None else None


@pytest.mark.parametrize("cls", CLASSES + ("ChatTemplateConfig",))
def test_every_public_lmdeploy_method_exists(cls):
    module = "model" if cls == "ChatTemplateConfig" else "messages"
    node = next(n for n in lmdeploy_source(module).body if getattr(n, "name", "") == cls)
    methods = [
        f.name for f in node.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
    ]
    if cls == "ChatTemplateConfig":
        methods.remove("chat_template")  # the name is steadylm's field (Jinja text)
    for name in methods:
        assert callable(getattr(getattr(api, cls), name, None)), f"{cls}.{name}"


def test_generation_config_methods_behave_as_lmdeploys():
    from transformers import AutoTokenizer

    from tests.conftest import STORIES

    if not STORIES.is_dir():
        pytest.skip("../shared is absent")
    tok = AutoTokenizer.from_pretrained(STORIES)
    word = tok.decode([300])
    g = api.GenerationConfig(stop_words=[word], stop_token_ids=[5])
    g.convert_stop_bad_words_to_ids(tok)
    assert set(g.stop_token_ids) == {5, *tok.encode(word, add_special_tokens=False)}
    g.update_from_hf_gen_cfg({"eos_token_id": [7, 8]}, 2)
    assert {2, 7, 8, 5} <= set(g.stop_token_ids)


def test_response_fields_and_extend():
    theirs = lmdeploy_fields("messages", "Response")
    r = api.Response(text="a", generate_token_len=1, input_token_len=3, token_ids=[5])
    r.extend(
        api.Response(
            text="b",
            generate_token_len=2,
            input_token_len=3,
            finish_reason="stop",
            token_ids=[6],
            logprobs=[{6: -0.1}],
            cached_tokens=2,
        )
    )
    assert (r.text, r.token_ids, r.generate_token_len, r.finish_reason) == ("ab", [5, 6], 2, "stop")
    assert r.logprobs == [{6: -0.1}] and r.cached_tokens == 2
    assert set(theirs) <= {f.name for f in dataclasses.fields(api.Response)}


def test_pipeline_signatures_match_lmdeploy():
    """pipeline() and every public Pipeline method take LMDeploy's parameters, in order."""
    tree = lmdeploy_source("api")
    their_fn = next(n for n in tree.body if getattr(n, "name", "") == "pipeline")
    ours = list(inspect.signature(pipeline_mod.pipeline).parameters)
    assert ours == [a.arg for a in their_fn.args.args] + ["kwargs"]
    cls = next(n for n in lmdeploy_source("pipeline").body if getattr(n, "name", "") == "Pipeline")
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        if fn.name == "get_reward_score":
            continue  # reward models are not loaded (docs/lmdeploy_compat.md)
        ours = getattr(pipeline_mod.Pipeline, fn.name, None)
        assert ours is not None, f"Pipeline.{fn.name} is missing"
        params = [p for p in inspect.signature(ours).parameters if p not in ("self", "_")]
        theirs = [a.arg for a in fn.args.args if a.arg != "self"]
        assert params[: len(theirs)] == theirs, (fn.name, params, theirs)


def test_messages_module_exports_lmdeploys_user_types():
    import steadylm.messages as ours

    their_names = {n.name for n in lmdeploy_source("messages").body if isinstance(n, ast.ClassDef)}
    internal = {
        "KVTransferConfig",
        "EventType",
        "EngineEvent",
        "ScheduleMetrics",
        "RequestMetrics",
        "EngineOutput",
    }
    for name in sorted(their_names - internal):
        assert hasattr(ours, name), name
    assert internal <= their_names  # the documented gaps are still LMDeploy's names


@pytest.mark.parametrize("cls", CLASSES[:3] + ("ChatTemplateConfig",))
def test_docs_list_every_field_with_its_outcome(cls):
    doc = DOC.read_text()
    klass = getattr(api, cls)
    policy = getattr(klass, "POLICY", {})
    for f in dataclasses.fields(klass):
        outcome = policy.get(f.name, (WORKS, ""))[0]
        assert f"| `{cls}.{f.name}` | {outcome} |" in doc, (cls, f.name, outcome)
