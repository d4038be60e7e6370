"""Prometheus metrics for the server, in one registry per app. Gauges are read from the engine
at scrape time, so they are never stale."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "steadylm_requests", "Finished requests", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("steadylm_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "steadylm_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "steadylm_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "steadylm_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "steadylm_rejected_requests", "Requests refused with 503", registry=r
        )
        self.running = Gauge("steadylm_num_requests_running", "Running requests", registry=r)
        self.waiting = Gauge("steadylm_num_requests_waiting", "Waiting requests", registry=r)
        self.kv_used = Gauge("steadylm_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge("steadylm_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.kv_usage = Gauge(
            "steadylm_kv_cache_usage_ratio", "Share of KV blocks in use", registry=r
        )
        self.preemptions = Gauge("steadylm_num_preemptions", "Preemptions since start", registry=r)
        self.hit_rate = Gauge(
            "steadylm_prefix_cache_hit_rate", "Prefix cache tokens hit / tokens queried", registry=r
        )
        self.healthy = Gauge("steadylm_engine_healthy", "1 if the engine is healthy", registry=r)
        self.engine_faults = Gauge(
            "steadylm_engine_faults",
            "Engine faults since start (steps where nothing could run), by exception type",
            ["type"],
            registry=r,
        )
        self.request_faults = Gauge(
            "steadylm_request_faults",
            "Requests that failed alone inside a step (their own fault) since start",
            registry=r,
        )

        self.spec: object | None = None  # the engine's SpecStats at the last scrape
        r.register(_SpecDecodeCollector(self))

    def observe_finished(
        self,
        finish_reason: str | None,
        num_prompt: int,
        num_output: int,
        ttft_s: float | None,
        tokens_per_s: float | None,
    ) -> None:
        self.requests.labels(finish_reason or "unknown").inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tokens_per_s:
            self.tpot.observe(1.0 / tokens_per_s)

    def render(self, stats, healthy: bool) -> bytes:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.kv_usage.set(stats.kv_blocks_used / max(1, stats.kv_blocks_total))
        self.preemptions.set(stats.num_preemptions)
        self.hit_rate.set(stats.prefix_cache_hit_rate)
        self.healthy.set(1 if healthy else 0)
        for kind, count in stats.fault_counts.items():  # a handful of exception types at most
            self.engine_faults.labels(kind).set(count)
        self.request_faults.set(stats.num_request_faults)
        self.spec = stats.spec_decode
        return generate_latest(self.registry)


class _SpecDecodeCollector:
    """Speculative decoding's counters, vLLM's series under our prefix (absent when it is
    off): drafts (verify steps of a request that proposed), draft tokens, accepted tokens,
    and accepted tokens by draft position."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        s = self.metrics.spec
        if s is None:
            return
        for name, doc, value in (
            ("num_drafts", "Verify steps of requests that proposed drafts", s.num_drafts),
            ("num_draft_tokens", "Draft tokens proposed", s.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted", s.num_accepted_tokens),
        ):
            yield CounterMetricFamily(f"steadylm_spec_decode_{name}", doc, value=value)
        per_pos = CounterMetricFamily(
            "steadylm_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft",
            labels=["position"],
        )
        for i, n in enumerate(s.accepted_per_pos):
            per_pos.add_metric([str(i)], n)
        yield per_pos
