"""Sampling against exact distributions on fixed logits, and seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from steadylm.engine.request import Request, SamplingParams
from steadylm.engine.sampler import Sampler, filter_probs

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N = 20_000


def exact(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The reference distribution, the slow obvious way, with HF's warper order: temperature,
    top-k, then top-p on what top-k kept (renormalised), then min-p."""
    p = torch.softmax(LOGITS / temperature, dim=-1).tolist()
    ranked = sorted(range(len(p)), key=lambda i: -p[i])
    kept = ranked[:top_k] if top_k else ranked
    total = sum(p[i] for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:
        if nucleus and mass >= top_p:
            break
        nucleus.append(i)
        mass += p[i] / total
    final = [i for i in nucleus if p[i] >= min_p * p[ranked[0]]]
    q = torch.zeros(len(p))
    for i in final:
        q[i] = p[i]
    return q / q.sum()


def draw(params: SamplingParams, n: int = N) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=0)
    reqs = [Request(f"r{i}", [1], params) for i in range(n)]
    out = sampler(LOGITS.repeat(n, 1), reqs)
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(LOGITS)).float() / n


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.5),
        dict(temperature=1.7),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=0.8, top_p=0.8, top_k=40),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=1.2, top_k=5, top_p=0.9, min_p=0.05),
    ],
)
def test_empirical_distribution_matches_exact(kw):
    want = exact(**kw)
    got = draw(SamplingParams(**kw))
    sigma = torch.sqrt(want * (1 - want) / N)
    assert torch.all((got - want).abs() <= 5 * sigma + 1e-9), (got, want)
    assert torch.all(got[want == 0] == 0)  # filtered tokens are never drawn


def test_filter_probs_matches_reference_exactly():
    for kw in [dict(top_k=2), dict(top_p=0.5), dict(min_p=0.3), dict(top_k=4, top_p=0.95)]:
        full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | kw
        got = filter_probs(
            LOGITS[None],
            torch.tensor([full["top_k"]]),
            torch.tensor([full["top_p"]]),
            torch.tensor([full["min_p"]]),
        )[0]
        torch.testing.assert_close(got, exact(**full))


def test_greedy_is_argmax():
    sampler = Sampler(torch.device("cpu"))
    out = sampler(LOGITS[None], [Request("g", [1], SamplingParams())])
    assert out.token_ids == [0]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(logprobs=2),
        dict(bad_token_ids=(0,)),
        dict(min_new_tokens=1, stop_token_ids=(0,)),
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(logit_bias=((0, -5.0),)),
    ],
)
def test_plain_greedy_only_where_the_token_is_the_raw_argmax(kw):
    """A step whose rows are all greedy with nothing that changes the argmax takes it straight
    from the logits in their dtype (bf16: no float32 copy); one row with anything else sends
    the whole batch the full way, where bf16 logits are widened first."""
    greedy = Request("g", [1], SamplingParams())
    other = Request("o", [1], SamplingParams(**kw))
    assert Sampler.plain_greedy([greedy, greedy])
    assert not Sampler.plain_greedy([greedy, other])
    bf16 = torch.stack([LOGITS, LOGITS.flip(0)]).to(torch.bfloat16)
    sampler = Sampler(torch.device("cpu"))
    assert sampler(bf16, [greedy, greedy]).token_ids == [0, len(LOGITS) - 1]
    want = sampler(bf16.float(), [greedy, other])
    assert sampler(bf16, [greedy, other]).token_ids[0] == want.token_ids[0] == 0
    if "logprobs" in kw:
        assert sampler(bf16, [greedy, other]).logprobs[1] == want.logprobs[1] is not None


def test_plain_greedy_respects_a_token_bitmask():
    row = Request("g", [1], SamplingParams())
    row.token_bitmask = torch.ones(1, dtype=torch.int32)
    assert not Sampler.plain_greedy([row])


def test_seeded_row_does_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [
        Sampler(torch.device("cpu"))(LOGITS[None], [Request("a", [1], params)]).token_ids[0]
        for _ in range(1)
    ]
    sampler = Sampler(torch.device("cpu"), seed=3)
    others = [Request(f"o{i}", [1], SamplingParams(temperature=1.0)) for i in range(5)]
    target, twin = Request("a", [1], params), Request("a", [1], params)
    seq_alone, seq_mixed = [], []
    s_alone = Sampler(torch.device("cpu"))
    for step in range(30):
        seq_alone.append(s_alone(LOGITS[None], [twin]).token_ids[0])
        batch = others[: step % 5] + [target] + others[step % 5 :]
        out = sampler(LOGITS.repeat(len(batch), 1), batch)
        seq_mixed.append(out.token_ids[batch.index(target)])
        twin.append_output(seq_alone[-1])  # the noise follows the output position
        target.append_output(seq_mixed[-1])
    assert seq_alone == seq_mixed
    assert seq_alone[0] == alone[0]
    assert len(set(seq_alone)) > 1  # it really samples


def test_bans_penalties_and_min_new_tokens():
    sampler = Sampler(torch.device("cpu"))
    r = Request("b", [1], SamplingParams(bad_token_ids=(0,)))
    assert sampler(LOGITS[None], [r]).token_ids == [1]
    r = Request("m", [1], SamplingParams(min_new_tokens=2), eos_token_ids=(0,))
    assert sampler(LOGITS[None], [r]).token_ids == [1]
    r = Request("p", [0], SamplingParams(repetition_penalty=10.0))  # token 0 seen: 2.0 / 10
    assert sampler(LOGITS[None], [r]).token_ids == [1]


def test_logprobs_are_log_softmax_of_raw_logits():
    sampler = Sampler(torch.device("cpu"))
    out = sampler(LOGITS[None], [Request("l", [1], SamplingParams(logprobs=2))])
    lp = torch.log_softmax(LOGITS, -1)
    assert set(out.logprobs[0]) == {0, 1}
    assert math.isclose(out.logprobs[0][1], float(lp[1]), rel_tol=1e-6)


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_k", 2**70),
        ("top_k", 2**63),
        ("top_k", True),
        ("top_k", 1.0),
        ("max_new_tokens", 2**63),
        ("max_new_tokens", True),
        ("min_new_tokens", 2**64),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("logprobs", 10**6),
        ("logprobs", -1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("min_p", float("nan")),
        ("stop_token_ids", (2**63,)),
        ("bad_token_ids", (-1,)),
        ("bad_token_ids", (True,)),
    ],
)
def test_values_the_engine_cannot_represent_are_refused(field, value):
    """Issue 19.2: every value is checked before it can reach a tensor constructor."""
    from steadylm.errors import RequestError

    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_extreme_but_valid_values_sample_without_error():
    """The largest representable values run: top_k past the vocabulary means no top-k, a
    temperature below 1e-5 is greedy (vLLM's rule), ids past the vocabulary ban nothing."""
    n = len(LOGITS)
    reqs = [
        Request("k", [1], SamplingParams(top_k=2**63 - 1, temperature=0.5, seed=2**64 - 1)),
        Request("t", [1], SamplingParams(temperature=1e-9, bad_token_ids=(n, 2**63 - 1))),
        Request("lp", [1], SamplingParams(logprobs=1024)),
    ]
    out = Sampler(torch.device("cpu"), seed=0)(LOGITS.repeat(3, 1), reqs)
    assert out.token_ids[1] == out.token_ids[2] == 0  # greedy, and token n-1 not banned
    assert len(out.logprobs[2]) == n  # every token's logprob (capped at the vocabulary)


def test_a_failed_sampling_call_leaves_seeded_generators_unchanged():
    """A step that raises is retried; a seeded request must then draw what it would have."""
    params = SamplingParams(temperature=1.0, seed=5)
    reference = Sampler(torch.device("cpu"))
    want = [reference(LOGITS[None], [Request("a", [1], params)]).token_ids[0] for _ in range(6)]
    sampler = Sampler(torch.device("cpu"))
    draw_noise = sampler._sample

    def draw_then_fail(logits, requests):
        draw_noise(logits, requests)  # the seeded generator has advanced
        raise RuntimeError("fault after sampling")

    got = []
    for i in range(6):
        req = Request("a", [1], params)
        if i in (0, 3):
            sampler._sample = draw_then_fail
            with pytest.raises(RuntimeError):
                sampler(LOGITS[None], [req])
            sampler._sample = draw_noise
        got.append(sampler(LOGITS[None], [req]).token_ids[0])
    assert got == want


def test_presence_frequency_penalties_and_logit_bias_follow_openai():
    """logit -= frequency * count + presence * (count > 0), over generated tokens only (vLLM's
    rule); logit_bias adds to the named tokens. Checked through greedy picks on fixed logits."""
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.2)
    r = Request("p", [0, 0, 0], params)  # the prompt's tokens are not counted
    for t in (0, 0, 1):
        r.append_output(t)
    got = Sampler(torch.device("cpu"))._apply_penalties(LOGITS[None].clone(), [r])[0]
    want = LOGITS.clone()
    want[0] -= 0.2 * 2 + 0.3
    want[1] -= 0.2 * 1 + 0.3
    torch.testing.assert_close(got, want)
    bias = SamplingParams(logit_bias=((7, 100.0), (2, -5.0)))
    out = Sampler(torch.device("cpu"))(LOGITS[None], [Request("b", [1], bias)])
    assert out.token_ids == [7]  # the least likely token, pushed to the top
    with pytest.raises(ValueError):
        SamplingParams(logit_bias=((1, 101.0),))
    with pytest.raises(ValueError):
        SamplingParams(presence_penalty=2.5)
