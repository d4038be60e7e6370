"""Speculative decoding: the proposers, and output that does not change with it.

Greedy output equals output without speculation token for token (every proposer, every
architecture, batching, chunked prefill, preemption on a tight pool, prefix caching, int8 /
int4 KV, penalties, stop ids, logprobs); seeded sampling does too (a seeded request's noise is
keyed by position); unseeded sampling keeps the model's distribution (a chi-square test); the
block manager's integrity holds after every step and no request keeps a rejected draft's
block.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from steadylm.config import EngineConfig, SpeculativeConfig
from steadylm.engine.request import SamplingParams
from steadylm.engine.speculative import NgramProposer, Speculator, SuffixProposer
from steadylm.errors import ConfigError
from tests.conftest import ARCHS, STORIES, engine_for, needs_shared, run_to_end

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats in them (random weights loop too, so drafts get accepted)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 97) for _ in range(rng.randrange(2, 6))]
        out.append(motif * rng.randrange(2, 5) + [rng.randrange(3, 97) for _ in range(3)])
    return out


def generate(engine, ps, params, check=True) -> list:
    """Run to the end, checking the block manager after every step and that no running
    request holds a block past its tokens' (a rejected draft's block is given back)."""
    ids = [engine.add_request(p, params) for p in ps]
    reqs = [engine.requests[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
        bm = engine.block_manager
        bm.check_integrity()
        for r in engine.scheduler.running:
            held = len(bm.block_table(r.request_id))
            assert held <= bm.blocks_needed(r.num_tokens), (r.request_id, held, r.num_tokens)
    return reqs


def outputs(reqs) -> list[list[int]]:
    return [r.output_token_ids for r in reqs]


def accepted(engine) -> int:
    return engine.stats().spec_decode.num_accepted_tokens


# ---- proposers ------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    #        a  b  c  X   a  b  c  Y   b  c  -> the suffix [b, c] matches twice, [a? b c] no;
    tokens = [1, 2, 3, 10, 1, 2, 3, 11, 2, 3]
    assert p.propose("r", tokens, 2) == [11, 2]  # the latest match of the longest suffix
    # a 3-token match beats a later 2-token one
    tokens = [5, 2, 3, 10, 9, 2, 3, 11, 5, 2, 3]
    assert p.propose("s", tokens, 1) == [10]
    assert p.propose("t", [1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.propose("u", [7, 8, 7], 3) == []  # a 1-token match is below prompt_lookup_min


def test_ngram_index_grows_with_the_request():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=2))
    seq = [1, 2, 3]
    assert p.propose("r", seq, 2) == []
    seq += [4, 1, 2]
    assert p.propose("r", seq, 2) == [3, 4]
    p.finish("r", seq)
    assert p.indexes == {}


def test_suffix_proposes_the_most_frequent_continuation():
    cfg = SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=0.5)
    p = SuffixProposer(cfg)
    # after [7, 8]: 9 three times, 5 once -> 9 (p 0.75); after [7, 8, 9]: 1 twice, 2 once
    # -> 1 (0.75 * 2/3 = 0.5, kept); then 0.5 * 1/2 < 0.5 stops.
    seq = [7, 8, 9, 1, 0, 7, 8, 9, 1, 3, 7, 8, 9, 2, 4, 7, 8, 5, 6, 7, 8]
    assert p.propose("r", seq, 8) == [9, 1]
    # the match length caps the draft (max_spec_factor 1.0): a 2-token match proposes 2 at most
    p2 = SuffixProposer(dataclasses.replace(cfg, suffix_decoding_min_token_prob=0.0))
    assert len(p2.propose("r", [1, 2, 3, 4, 5, 6, 1, 2], 8)) == 2


def test_suffix_learns_from_finished_requests():
    p = SuffixProposer(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=2))
    assert p.propose("a", [40, 41, 42], 4) == []
    p.finish("a", [50, 51, 52, 53, 54, 55])
    assert p.propose("b", [1, 2, 50, 51], 4) == [52, 53]  # another request's answer
    p.finish("b", [60, 61, 62])
    p.finish("c", [70, 71, 72])  # the store keeps 2 requests: the oldest leave
    assert p.propose("d", [50, 51], 4) == []
    assert p.propose("e", [70, 71], 4) == [72]


def test_the_adaptive_rule_backs_off_and_comes_back():
    spec = Speculator(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=1))
    seq = [1, 2, 1]
    assert spec.propose("r", seq, 8) == [2, 1]  # everything it can, at first
    for _ in range(4):  # every draft rejected
        spec.record("r", 2, 0)
        while not spec.propose("r", seq, 8):  # paused for a while, then a probe
            pass
    assert len(spec.propose("r", seq, 8)) == 1  # probes propose one token
    pauses = []
    for _ in range(2):
        spec.record("r", 1, 0)
        waits = 0
        while not spec.propose("r", seq, 8):
            waits += 1
        pauses.append(waits)
    assert pauses[1] == 2 * pauses[0] > 0  # the pause doubles while drafts keep failing
    for _ in range(10):
        spec.record("r", 1, 1)
    assert len(spec.propose("r", seq, 8)) == 2  # accepted again: longer drafts


def test_the_engine_gate_pauses_speculation_that_costs_more_than_it_brings():
    spec = Speculator(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=1))
    for _ in range(Speculator.MIN_SAMPLES):
        spec.observe(0.010, 1, 1, drafted=False)  # 100 tokens/s per request without drafts
        spec.observe(0.030, 1, 2, drafted=True)  # 67 with
    assert spec.propose("r", [1, 2, 1], 4) == []  # paused
    for _ in range(spec.gate_wait):
        spec.observe(0.010, 1, 1, drafted=False)
    assert spec.propose("r", [1, 2, 1], 4) != []  # tried again after the pause


# ---- configuration ---------------------------------------------------------------------------
def test_vllm_and_lmdeploy_spellings():
    from steadylm.api import PytorchEngineConfig, speculative_config
    from steadylm.messages import SpeculativeConfig as LMDeploySpec

    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    assert cfg.speculative_config.num_speculative_tokens == 4
    assert cfg.speculative_config.prompt_lookup_max == 5  # vLLM's default
    ours = speculative_config(LMDeploySpec(method="suffix", num_speculative_tokens=3))
    assert (ours.method, ours.num_speculative_tokens) == ("suffix", 3)
    ec = PytorchEngineConfig(speculative_config=LMDeploySpec(method="ngram")).to_engine_config()
    assert ec.speculative_config.method == "ngram"
    for bad in (
        LMDeploySpec(method="eagle3", model="/draft"),
        LMDeploySpec(method="ngram", model="/draft"),
        {"method": "ngram", "num_speculative_tokens": 0},
        {"model": "/draft"},
        {"method": "ngram", "typo": 1},
    ):
        with pytest.raises(ConfigError):
            speculative_config(bad)


def test_cli_flags_map_onto_one_config():
    from steadylm.entrypoints.cli import build_parser, engine_config_from_args

    parser = build_parser()

    def spec(*flags):
        args = parser.parse_args(["generate", "--model", "m", "hi", *flags])
        return engine_config_from_args(args).speculative_config

    assert spec() is None
    s = spec("--speculative-config", '{"method": "suffix", "num_speculative_tokens": 5}')
    assert (s.method, s.num_speculative_tokens) == ("suffix", 5)
    s = spec("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "3")
    assert (s.method, s.num_speculative_tokens) == ("ngram", 3)
    with pytest.raises(ConfigError, match="draft_model"):
        spec("--speculative-draft-model", "/d")
    with pytest.raises(ConfigError, match="not both"):
        spec("--speculative-config", '{"method": "ngram"}', "--speculative-algorithm", "ngram")
    with pytest.raises(ConfigError, match="needs --speculative-algorithm"):
        spec("--speculative-num-draft-tokens", "3")


# ---- exactness -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_unchanged(arch, method, model_dirs):
    _, path = model_dirs(arch)
    ps = prompts(4)
    ref = outputs(engine_for(path).generate(ps, GREEDY))
    engine = engine_for(path, speculative_config=METHODS[method])
    assert outputs(generate(engine, ps, GREEDY)) == ref
    assert accepted(engine) > 0, "no draft was ever accepted: the test would prove nothing"


CONFIGS = {
    "chunked prefill": dict(max_prefill_token_num=8),
    "tight pool (preemption)": dict(num_gpu_blocks=14, max_batch_size=8),
    "prefix caching": dict(enable_prefix_caching=True),
    "int8 KV": dict(quant_policy=8),
    "int4 KV": dict(quant_policy=4),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_greedy_output_is_unchanged_under(config, model_dirs):
    _, path = model_dirs("llama")
    ps = prompts(6, seed=3)
    kw = CONFIGS[config]
    base = engine_for(path, **kw)
    ref = outputs(base.generate(ps, GREEDY))
    engine = engine_for(path, speculative_config=NGRAM, **kw)
    assert outputs(generate(engine, ps, GREEDY)) == ref
    if config == "prefix caching":
        # a second turn: each prompt with its answer (written by speculative steps) and more
        turn2 = [p + out + [5, 6] for p, out in zip(ps, ref)]
        assert outputs(generate(engine, turn2, GREEDY)) == outputs(base.generate(turn2, GREEDY))
    assert accepted(engine) > 0
    if "preemption" in config:
        assert engine.stats().num_preemptions > 0, "the pool was not tight enough to preempt"
    if config == "prefix caching":
        assert engine.stats().prefix_cache_hit_rate > 0


def test_penalties_bans_stop_ids_and_logprobs_are_unchanged(model_dirs):
    _, path = model_dirs("qwen2")
    ps = prompts(4, seed=5)
    ref_greedy = outputs(engine_for(path).generate(ps, GREEDY))
    stop = ref_greedy[0][12]  # a token inside the first answer: a stop inside an accepted run
    cases = [
        SamplingParams(max_new_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(
            max_new_tokens=30, ignore_eos=True, frequency_penalty=0.5, presence_penalty=0.3
        ),
        SamplingParams(max_new_tokens=30, min_new_tokens=20, stop_token_ids=(stop,)),
        SamplingParams(max_new_tokens=30, stop_token_ids=(stop,)),
        SamplingParams(max_new_tokens=7, ignore_eos=True),
        SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=2),
    ]
    for params in cases:
        ref = engine_for(path).generate(ps, params)
        engine = engine_for(path, speculative_config=NGRAM)
        got = generate(engine, ps, params)
        assert outputs(got) == outputs(ref), params
        for a, b in zip(got, ref):
            assert a.finish_reason == b.finish_reason
            if params.logprobs is not None:
                assert len(a.output_logprobs) == len(b.output_logprobs) == a.num_output_tokens
                for x, y in zip(a.output_logprobs, b.output_logprobs):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_seeded_sampling_is_unchanged(model_dirs):
    """A seeded request's noise is keyed by (seed, position): the same tokens with and
    without speculation, alone or batched."""
    _, path = model_dirs("llama")
    ps = prompts(5, seed=7)
    params = [
        SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.7, top_p=0.9, seed=s)
        for s in range(len(ps))
    ]
    ref = [engine_for(path).generate([p], sp)[0].output_token_ids for p, sp in zip(ps, params)]
    engine = engine_for(path, speculative_config=NGRAM)
    ids = [engine.add_request(p, sp) for p, sp in zip(ps, params)]
    reqs = [engine.requests[i] for i in ids]
    run_to_end(engine)
    assert outputs(reqs) == ref
    assert engine.stats().spec_decode.num_drafts > 0


def _exact_pair_distribution(hf, prefix: list[int], temperature: float) -> torch.Tensor:
    """P(x0, x1, x2) of three tokens sampled after `prefix`, summed over x0: (V, V)."""

    def probs(seq):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1].double()
        return torch.softmax(logits / temperature, -1)

    p0 = probs(prefix)
    vocab = p0.shape[0]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for x0 in range(vocab):
        p1 = probs(prefix + [x0])
        for x1 in range(vocab):
            joint[x1] += p0[x0] * p1[x1] * probs(prefix + [x0, x1])
    return joint


def test_rejection_sampling_keeps_the_models_distribution(tmp_path):
    """Unseeded sampling at temperature 1 with drafts on every decode step: the empirical
    distribution of the 2nd and 3rd tokens (a draft's position and the one after it) against
    the model's exact one, by a chi-square test at significance 0.001 (so a correct sampler
    fails it with a fixed engine seed for 1 seed in 1,000). A sampler that kept every draft,
    or resampled a rejected one from p instead of p without the draft, fails it."""
    from tests.conftest import make_hf_model

    vocab = 6
    hf = make_hf_model("llama", seed=3, vocab_size=vocab, initializer_range=0.08)
    hf.save_pretrained(tmp_path)
    prefix = [0, 1, 2, 3, 4, 5, 0, 2, 4]  # every token has a continuation: drafts always
    exact = _exact_pair_distribution(hf, prefix, 1.0).flatten()
    n = 3000
    engine = engine_for(
        str(tmp_path),
        speculative_config=dict(NGRAM, adaptive=False),
        max_batch_size=128,
        num_gpu_blocks=512,
        seed=11,
    )
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)
    reqs = generate(engine, [prefix] * n, params)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for r in reqs:
        counts[r.output_token_ids[1] * vocab + r.output_token_ids[2]] += 1
    spec = engine.stats().spec_decode
    assert spec.num_drafts >= n  # every request drafted in its decode step
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # both outcomes happened
    expected = exact * n
    keep = expected >= 5  # the cells a chi-square test can judge; the rest pooled
    obs, exp = counts[keep], expected[keep]
    if not keep.all():
        obs = torch.cat([obs, counts[~keep].sum()[None]])
        exp = torch.cat([exp, expected[~keep].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, (chi2, df, p_value)


@needs_shared
def test_stories260k_greedy_is_unchanged():
    from steadylm.tokenizer import load_tokenizer

    tok = load_tokenizer(str(STORIES))
    texts = ["Once upon a time, there was a little girl", "The cat sat on the mat and"]
    ps = [tok.encode(t) for t in texts]
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    ref = outputs(engine_for(str(STORIES), block_size=16).generate(ps, params))
    for spec in METHODS.values():
        engine = engine_for(str(STORIES), block_size=16, speculative_config=spec)
        assert outputs(generate(engine, ps, params)) == ref
        assert accepted(engine) > 0


def test_stats_and_the_plan_say_what_speculation_did(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path, speculative_config=NGRAM)
    generate(engine, prompts(3), GREEDY)
    s = engine.stats().spec_decode
    assert s.num_draft_tokens >= s.num_accepted_tokens == sum(s.accepted_per_pos) > 0
    assert 1 < s.mean_acceptance_length <= 1 + NGRAM["num_speculative_tokens"]
    assert "ngram, up to 4 drafts a step" in engine.plan.table()
    off = engine_for(path)
    assert off.stats().spec_decode is None and "speculative" not in off.plan.table()
    # logits for 1 + k rows per request are in the activation reserve
    assert engine.plan.activation_bytes > off.plan.activation_bytes


def test_drafts_never_cause_a_preemption(model_dirs):
    """On a pool where every block is needed, drafts are dropped rather than preempting."""
    _, path = model_dirs("llama")
    ps = prompts(6, seed=9)
    kw = dict(num_gpu_blocks=40, max_batch_size=6)
    base = engine_for(path, **kw)
    ref = outputs(base.generate(ps, GREEDY))
    engine = engine_for(path, speculative_config=NGRAM, **kw)
    assert outputs(generate(engine, ps, GREEDY)) == ref
    assert engine.stats().num_preemptions <= base.stats().num_preemptions


def test_the_suffix_store_is_bounded_in_tokens(monkeypatch):
    from steadylm.engine import speculative

    monkeypatch.setattr(speculative, "MAX_STORE_TOKENS", 100)
    p = SuffixProposer(SpeculativeConfig(method="suffix"))
    for i in range(30):
        p.finish(f"r{i}", [1000 + i] * 10)
    assert len(p.store) <= 100 + 11  # the bound, plus the answer that crossed it
    assert p.propose("x", [1029, 1029], 4) != []  # the newest stay
    assert p.propose("y", [1000, 1000], 4) == []  # the oldest left
