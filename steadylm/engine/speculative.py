"""Speculative decoding's scheduler side: proposers that guess a request's next tokens from
tokens already seen, and the adaptive rule that decides how many of them a request may try.

A proposer is pure Python over token ids (no model, no tensors): `ngram` (prompt lookup) and
`suffix` (the most frequent continuation of the longest match, in the request's own tokens
and in recent requests' outputs). The engine asks for drafts while it schedules; the runner
scores the last token and the drafts in one forward; a draft is kept while the token sampled
at its position equals it (for a fixed draft that *is* the rejection-sampling rule: accepted
with probability p(draft), else the sampled token is drawn from p without the draft), then the
token sampled after the last kept draft is appended too. So the output is the model's own.

Both indexes hold, per sequence, the positions where each `gram`-token window ends: a match
is found from the last `gram` tokens and extended backwards, so a lookup reads a few
candidate positions instead of the whole sequence (30,000-token answers stay cheap).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from steadylm.config import SpeculativeConfig

MAX_CANDIDATES = 64  # most recent occurrences of the last window looked at per lookup
SEPARATOR = -1  # between requests in the shared store: never matches a token
# The shared store's size in tokens at most (about 100 bytes of index each): 10,000 cached
# answers of 500 tokens would otherwise hold ~500 MB in a long-running server.
MAX_STORE_TOKENS = 1 << 20


class TokenIndex:
    """A growing token sequence and, for each `gram`-token window, the positions just after
    its occurrences (oldest first)."""

    def __init__(self, gram: int) -> None:
        self.gram = gram
        self.tokens = array("q")
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids) -> None:
        g, tokens, ends = self.gram, self.tokens, self.ends
        for t in token_ids:
            tokens.append(t)
            if len(tokens) >= g:
                key = tuple(tokens[-g:])
                if SEPARATOR not in key:
                    ends.setdefault(key, []).append(len(tokens))

    def matches(self, suffix: list[int], max_len: int, limit: int) -> list[tuple[int, int]]:
        """(position after the match, match length) of the latest `limit` occurrences of the
        last `gram` tokens of `suffix` that have a continuation, each extended backwards to at
        most `max_len` matching tokens; latest first."""
        g = self.gram
        if len(suffix) < g:
            return []
        found = self.ends.get(tuple(suffix[-g:]))
        if not found:
            return []
        out = []
        tokens, n = self.tokens, len(self.tokens)
        for end in reversed(found):
            if end >= n:  # the window at the very end has no continuation yet
                continue
            m = g
            while m < max_len and m < len(suffix) and end - m - 1 >= 0:
                if tokens[end - m - 1] != suffix[-m - 1]:
                    break
                m += 1
            out.append((end, m))
            if len(out) >= limit:
                break
        return out


class NgramProposer:
    """Prompt lookup (vLLM's `ngram`): the longest match of the last `prompt_lookup_max` ..
    `prompt_lookup_min` tokens in the request's own tokens; the latest such match's
    continuation, up to k tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.indexes: dict[str, TokenIndex] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        index = self._index(request_id, token_ids)
        best_end, best_len = -1, 0
        for end, m in index.matches(token_ids, self.hi, MAX_CANDIDATES):
            if m > best_len:
                best_end, best_len = end, m
                if m == self.hi:
                    break
        if best_end < 0:
            return []
        return list(index.tokens[best_end : best_end + k])

    def _index(self, request_id: str, token_ids: list[int]) -> TokenIndex:
        index = self.indexes.get(request_id)
        if index is None or len(index) > len(token_ids):  # new, or resumed shorter: rebuild
            index = self.indexes[request_id] = TokenIndex(self.lo)
        index.extend(token_ids[len(index) :])
        return index

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        self.indexes.pop(request_id, None)


class SuffixProposer:
    """Suffix decoding: the longest match (up to `suffix_decoding_max_tree_depth` tokens) of the
    sequence's end, in the request's own tokens and in the outputs of recent finished requests
    (a shared store of `suffix_decoding_max_cached_requests` outputs, `MAX_STORE_TOKENS` at
    most). Among the matches of that length the most frequent next token is proposed, then
    the most frequent after it among the matches that agree, while the path's probability
    (the product of those frequencies) stays at least `suffix_decoding_min_token_prob`; at
    most `suffix_decoding_max_spec_factor` times the match length, and at most k tokens."""

    GRAM = 2  # the shortest match that proposes anything

    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.indexes: dict[str, TokenIndex] = {}
        self.store = TokenIndex(self.GRAM)  # finished outputs, SEPARATOR between them
        self.stored: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self._next_id = 0

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        index = self.indexes.get(request_id)
        if index is None or len(index) > len(token_ids):
            index = self.indexes[request_id] = TokenIndex(self.GRAM)
        index.extend(token_ids[len(index) :])
        suffix = token_ids[-self.depth :]
        cands = [(index.tokens, e, m) for e, m in index.matches(suffix, self.depth, 256)]
        cands += [(self.store.tokens, e, m) for e, m in self.store.matches(suffix, self.depth, 256)]
        if not cands:
            return []
        longest = max(m for _, _, m in cands)
        cands = [(seq, e) for seq, e, m in cands if m == longest]
        limit = min(k, int(self.factor * longest), self.depth)
        out: list[int] = []
        prob = 1.0
        while len(out) < limit and cands:
            counts: dict[int, int] = {}
            for seq, e in cands:
                if e < len(seq) and seq[e] != SEPARATOR:
                    counts[seq[e]] = counts.get(seq[e], 0) + 1
            if not counts:
                break
            token, n = max(counts.items(), key=lambda kv: kv[1])
            prob *= n / sum(counts.values())
            if prob < self.min_prob:
                break
            out.append(token)
            cands = [(seq, e + 1) for seq, e in cands if e < len(seq) and seq[e] == token]
        return out

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        """A request ended: its output joins the shared store (the oldest leave it)."""
        self.indexes.pop(request_id, None)
        if not self.max_cached or not output_token_ids:
            return
        self.stored[self._next_id] = list(output_token_ids)
        self._next_id += 1
        self.store.extend([*output_token_ids, SEPARATOR])
        if len(self.stored) > self.max_cached or len(self.store) > MAX_STORE_TOKENS:
            # rebuild with the newer half (of the requests, and of the tokens)
            total = sum(map(len, self.stored.values()))
            while self.stored and (
                len(self.stored) > self.max_cached // 2 or total > MAX_STORE_TOKENS // 2
            ):
                total -= len(self.stored.popitem(last=False)[1])
            self.store = TokenIndex(self.GRAM)
            for out in self.stored.values():
                self.store.extend([*out, SEPARATOR])


PROPOSERS = {"ngram": NgramProposer, "suffix": SuffixProposer}


@dataclass
class _Pace:
    """One request's recent acceptance (an exponential average of accepted / proposed) and,
    while its drafts do not pay, how many steps it waits before proposing again."""

    rate: float = 1.0
    wait: int = 0
    backoff: int = 0


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: drafts (requests that proposed), draft tokens, accepted
    tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step of a drafting request, the bonus token included (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """The engine's speculative decoding: one proposer, each request's pace, the counters.

    The adaptive rule has two parts.
    - Per request: its draft length follows its acceptance rate r (drafts past the point where
      r**i, the chance that draft i is reached and kept, falls below `MIN_GAIN` are not
      proposed). When even the first draft is unlikely to be kept the request stops proposing
      for `backoff` steps, doubling (up to `MAX_BACKOFF`) while it keeps failing.
    - Per engine, measured: the tokens each running request gains per second in decode steps
      with drafts and in those without (exponential averages). Where scoring drafts costs
      more than they bring (a CPU whose multi-row step is much slower than a decode step, a
      batch that already fills the device), speculation pauses for `gate_wait` steps,
      doubling while it keeps losing, then tries again. So a workload nobody can predict
      runs as without speculation, but for a short probe now and then."""

    MIN_GAIN = 0.35
    ALPHA = 0.3
    MAX_BACKOFF = 64
    RATE_ALPHA = 0.1  # the per-engine rates' averaging weight
    MIN_SAMPLES = 4  # steps of each kind before the gate judges
    MAX_GATE_WAIT = 512

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = PROPOSERS[config.method](config)
        self.pace: dict[str, _Pace] = {}
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self.rates = [0.0, 0.0]  # tokens / second / request: [without drafts, with drafts]
        self.samples = [0, 0]
        self.gate_wait = 0  # steps left with speculation paused
        self.gate_backoff = 0

    def propose(self, request_id: str, token_ids: list[int], limit: int) -> list[int]:
        """Draft tokens to follow `token_ids` (prompt + output so far), at most `limit`."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        pace = self.pace.setdefault(request_id, _Pace())
        if self.config.adaptive:
            if self.gate_wait > 0:
                return []
            if pace.wait > 0:
                pace.wait -= 1
                return []
            k = min(k, self._length(pace.rate))
        return self.proposer.propose(request_id, token_ids, k)[:k]

    def _length(self, rate: float) -> int:
        n, reach = 1, rate
        while n < self.k and reach * rate >= self.MIN_GAIN:
            reach *= rate
            n += 1
        return n

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verify step's outcome for a request that proposed `num_drafts` tokens."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        pace = self.pace.setdefault(request_id, _Pace())
        pace.rate += self.ALPHA * (num_accepted / num_drafts - pace.rate)
        if pace.rate < self.MIN_GAIN:  # even the first draft rarely pays: pause, then probe
            pace.backoff = min(max(1, 2 * pace.backoff), self.MAX_BACKOFF)
            pace.wait = pace.backoff
            pace.rate = self.MIN_GAIN  # the probe after the pause proposes one token
        elif num_accepted:
            pace.backoff = 0

    def observe(self, seconds: float, num_seqs: int, num_tokens: int, drafted: bool) -> None:
        """One decode step's outcome (steps with prefill chunks are not passed): its wall
        time, requests, tokens generated, and whether any request scored drafts."""
        if self.gate_wait > 0:
            self.gate_wait -= 1
        if seconds <= 0 or num_seqs <= 0:
            return
        rate = num_tokens / seconds / num_seqs
        i = int(drafted)
        self.samples[i] += 1
        if self.samples[i] == 1:
            self.rates[i] = rate
        else:
            self.rates[i] += self.RATE_ALPHA * (rate - self.rates[i])
        if not self.config.adaptive or min(self.samples) < self.MIN_SAMPLES or not drafted:
            return
        if self.rates[1] < self.rates[0]:  # drafts cost more than they bring: pause
            self.gate_backoff = min(max(8, 2 * self.gate_backoff), self.MAX_GATE_WAIT)
            self.gate_wait = self.gate_backoff
            self.samples[1] = 0  # judged afresh after the pause
        else:
            self.gate_backoff = 0

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        self.pace.pop(request_id, None)
        self.proposer.finish(request_id, output_token_ids)

    def snapshot(self) -> SpecStats:
        s = self.stats
        return SpecStats(
            s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos)
        )
