"""Prometheus metrics for the server, in one registry per app: our `steadylm_*` series and the
same figures under vLLM's names and units (`vllm:*`, labelled `model_name` and `engine`), so
dashboards, autoscalers and gateways written for vLLM read them as they are
(`--metrics-names steadylm|vllm|both`, default both). Gauges and engine counters are read from
the engine at scrape time, so they are never stale.

The names, types and meanings of vLLM's series are tabled in README.md ("Metrics").
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# vLLM's buckets, so a dashboard's quantiles read the same
_VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
              7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0)  # fmt: skip
_VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
METRICS_NAMES = ("steadylm", "vllm", "both")


def _token_buckets(limit: int) -> list[int]:
    """vLLM's 1-2-5 buckets up to `limit` (the model's context)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > limit:
                return out
            out.append(v)
        exp += 1


class Metrics:
    def __init__(
        self, names: str = "both", model_name: str = "model", max_model_len: int = 1 << 17
    ) -> None:
        if names not in METRICS_NAMES:
            raise ValueError(f"metrics names {names!r}: choose one of {', '.join(METRICS_NAMES)}")
        r = self.registry = CollectorRegistry()
        self.ours = names in ("steadylm", "both")
        self.spec: object | None = None  # the engine's SpecStats at the last scrape
        self.stats: object | None = None  # the engine's stats at the last scrape
        self.healthy_now = True
        mine = r if self.ours else None  # prometheus objects without a registry stay unexported
        self.requests = Counter(
            "steadylm_requests", "Finished requests", ["finish_reason"], registry=mine
        )
        self.prompt_tokens = Counter("steadylm_prompt_tokens", "Prompt tokens", registry=mine)
        self.generation_tokens = Counter(
            "steadylm_generation_tokens", "Generated tokens", registry=mine
        )
        self.ttft = Histogram(
            "steadylm_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=mine,
        )
        self.tpot = Histogram(
            "steadylm_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=_LATENCY_BUCKETS,
            registry=mine,
        )
        self.rejected = Counter(
            "steadylm_rejected_requests", "Requests refused with 503", registry=mine
        )
        if self.ours:
            r.register(_EngineCollector(self))
            r.register(_SpecDecodeCollector(self, "steadylm_spec_decode_", {}))
        self.vllm = None
        if names in ("vllm", "both"):
            self.vllm = _VLLMSeries(r, model_name, max_model_len)
            labels = {"model_name": model_name, "engine": "0"}
            r.register(_VLLMEngineCollector(self, labels))
            r.register(_SpecDecodeCollector(self, "vllm:spec_decode_", labels))

    def observe_itl(self, gap_s: float) -> None:
        """A request's tokens of one step arrived `gap_s` after its previous ones (vLLM: one
        inter-token latency per request and step after the first token)."""
        if self.vllm is not None:
            self.vllm.itl.observe(gap_s)

    def observe_finished(
        self,
        finish_reason: str | None,
        num_prompt: int,
        num_output: int,
        ttft_s: float | None,
        tokens_per_s: float | None,
        times: dict | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """A finished request. `times`: its monotonic arrival, first scheduled, first token
        and finish times (None where it never got there)."""
        self.requests.labels(finish_reason or "unknown").inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tokens_per_s:
            self.tpot.observe(1.0 / tokens_per_s)
        if self.vllm is not None:
            self.vllm.finished(
                finish_reason, num_prompt, num_output, ttft_s, times or {}, max_tokens
            )

    def aborted(self) -> None:
        """A request the client abandoned (disconnected) before it finished."""
        self.requests.labels("abort").inc()
        if self.vllm is not None:
            self.vllm.success.labels(*self.vllm.labels, "abort").inc()

    def render(self, stats, healthy: bool) -> bytes:
        self.stats, self.healthy_now, self.spec = stats, healthy, stats.spec_decode
        return generate_latest(self.registry)


class _VLLMSeries:
    """The per-request series under vLLM's names (the engine's are read at scrape time)."""

    def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        names = ["model_name", "engine"]
        self.labels = (model_name, "0")
        lab = self.labels

        def hist(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*lab)

        def count(name, doc):
            return Counter(name, doc, names, registry=r).labels(*lab)

        self.prompt_tokens = count("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = count(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        tokens = _token_buckets(max_model_len)
        for attr, name, doc, buckets in (
            ("ttft", "time_to_first_token_seconds", "Time to first token.", _VLLM_TTFT),
            ("itl", "inter_token_latency_seconds", "Inter-token latency.", _VLLM_ITL),
            ("e2e", "e2e_request_latency_seconds", "End to end request latency.", _VLLM_REQUEST),
            ("queue", "request_queue_time_seconds", "Time spent in the WAITING phase.", None),
            ("prefill", "request_prefill_time_seconds", "Time spent in the PREFILL phase.", None),
            ("decode", "request_decode_time_seconds", "Time spent in the DECODE phase.", None),
            ("inference", "request_inference_time_seconds", "Time spent RUNNING.", None),
            ("req_prompt", "request_prompt_tokens", "Prefill tokens of a request.", tokens),
            ("req_generation", "request_generation_tokens", "Tokens a request generated.", tokens),
            ("max_tokens", "request_params_max_tokens", "The max_tokens parameter.", tokens),
        ):
            setattr(self, attr, hist(f"vllm:{name}", doc, buckets or _VLLM_REQUEST))

    def finished(self, reason, num_prompt, num_output, ttft_s, t: dict, max_tokens) -> None:
        # vLLM's reasons; our deadline cut a request short as an abort does
        reason = {"stop": "stop", "length": "length", "abort": "abort", "timeout": "abort"}.get(
            reason, "error"
        )
        self.success.labels(*self.labels, reason).inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        self.req_prompt.observe(num_prompt)
        self.req_generation.observe(num_output)
        if max_tokens is not None:
            self.max_tokens.observe(max_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        arrival, scheduled = t.get("arrival"), t.get("scheduled")
        first, end = t.get("first_token"), t.get("finish")
        if arrival is not None and end is not None:
            self.e2e.observe(end - arrival)
        if arrival is not None and scheduled is not None:
            self.queue.observe(scheduled - arrival)
        if scheduled is not None and first is not None:
            self.prefill.observe(first - scheduled)
        if first is not None and end is not None:
            self.decode.observe(end - first)
        if scheduled is not None and end is not None:
            self.inference.observe(end - scheduled)


class _EngineCollector:
    """Our engine gauges, read from the last scrape's stats."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        s = self.metrics.stats
        if s is None:
            return
        for name, doc, value in (
            ("num_requests_running", "Running requests", s.num_running),
            ("num_requests_waiting", "Waiting requests", s.num_waiting),
            ("kv_blocks_used", "KV blocks in use", s.kv_blocks_used),
            ("kv_blocks_total", "KV blocks in the pool", s.kv_blocks_total),
            (
                "kv_cache_usage_ratio",
                "Share of KV blocks in use",
                s.kv_blocks_used / max(1, s.kv_blocks_total),
            ),
            ("num_preemptions", "Preemptions since start", s.num_preemptions),
            (
                "prefix_cache_hit_rate",
                "Prefix cache tokens hit / tokens queried",
                s.prefix_cache_hit_rate,
            ),
            ("engine_healthy", "1 if the engine is healthy", 1 if self.metrics.healthy_now else 0),
            (
                "request_faults",
                "Requests that failed alone inside a step (their own fault) since start",
                s.num_request_faults,
            ),
        ):
            yield GaugeMetricFamily(f"steadylm_{name}", doc, value=value)
        faults = GaugeMetricFamily(
            "steadylm_engine_faults",
            "Engine faults since start (steps where nothing could run), by exception type",
            labels=["type"],
        )
        for kind, count in s.fault_counts.items():  # a handful of exception types at most
            faults.add_metric([kind], count)
        yield faults


class _VLLMEngineCollector:
    """The engine's figures under vLLM's names: gauges, and its own counters as counters."""

    def __init__(self, metrics: Metrics, labels: dict[str, str]) -> None:
        self.metrics, self.names, self.values = metrics, list(labels), list(labels.values())

    def _one(self, family, name, doc, value):
        m = family(name, doc, labels=self.names)
        m.add_metric(self.values, value)
        return m

    def collect(self):
        s = self.metrics.stats
        if s is None:
            return
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._one(
            g,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running,
        )  # noqa: E501
        yield self._one(
            g,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_waiting,
        )  # noqa: E501
        usage = s.kv_blocks_used / max(1, s.kv_blocks_total)
        yield self._one(
            g, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage
        )  # noqa: E501
        yield self._one(
            c,
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions,
        )  # noqa: E501
        yield self._one(
            c,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )  # noqa: E501
        yield self._one(
            c,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )  # noqa: E501


class _SpecDecodeCollector:
    """Speculative decoding's counters, vLLM's series (absent when it is off): drafts (verify
    steps of a request that proposed), draft tokens, accepted tokens, and accepted tokens by
    draft position; under our prefix, or vLLM's with its labels."""

    def __init__(self, metrics: Metrics, prefix: str, labels: dict[str, str]) -> None:
        self.metrics, self.prefix = metrics, prefix
        self.names, self.values = list(labels), list(labels.values())

    def collect(self):
        s = self.metrics.spec
        if s is None:
            return
        for name, doc, value in (
            ("num_drafts", "Verify steps of requests that proposed drafts", s.num_drafts),
            ("num_draft_tokens", "Draft tokens proposed", s.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted", s.num_accepted_tokens),
        ):
            m = CounterMetricFamily(self.prefix + name, doc, labels=self.names)
            m.add_metric(self.values, value)
            yield m
        per_pos = CounterMetricFamily(
            self.prefix + "num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft",
            labels=[*self.names, "position"],
        )
        for i, n in enumerate(s.accepted_per_pos):
            per_pos.add_metric([*self.values, str(i)], n)
        yield per_pos
