"""The embedded server's /metrics, in vLLM's metric names so dashboards and collectors just work."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from engine.sequence import RequestOutput

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so histograms from servescope and vLLM
# can be compared bucket by bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


PHASES = {"queue": "Time waiting before first scheduled",
          "prefill": "Time from first scheduled to the first token",
          "decode": "Time from the first token to the last",
          "inference": "Time from first scheduled to the last token"}


def phase_seconds(m) -> dict[str, float]:
    """A finished request's phases as vLLM defines them (queued -> scheduled -> first token ->
    last token), for the phases its timestamps cover."""
    last = m.token_times[-1] if m.token_times else None
    spans = {"queue": (m.arrival, m.first_scheduled),
             "prefill": (m.first_scheduled, m.first_token),
             "decode": (m.first_token, last),
             "inference": (m.first_scheduled, last)}
    return {phase: max(0.0, end - start) for phase, (start, end) in spans.items()
            if start is not None and end is not None}


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


class ServerMetrics:
    """Prometheus series for one served model, updated from the engine's own records."""

    def __init__(self, model_name: str, spec_counters=None, max_model_len: int = 2048) -> None:
        self.registry = CollectorRegistry()
        if spec_counters is not None:
            self.registry.register(_SpecCollector(model_name, spec_counters))
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch",
                             labels, registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                             labels, registry=r).labels(model_name)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", labels,
                              registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens computed (including "
                                     "recomputation after preemption)", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels,
                                         registry=r).labels(model_name)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix-cache look-ups, in "
                                      "tokens", labels, registry=r).labels(model_name)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens",
                                   labels, registry=r).labels(model_name)
        # vLLM has no eviction counter, so this one lives in servescope's own namespace.
        self.kv_evicted = Counter("servescope:kv_evicted_tokens", "KV-cache entries dropped by "
                                  "eviction policies, in tokens", labels,
                                  registry=r).labels(model_name)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", labels,
                                   registry=r).labels(model_name)
        # servescope's own: requests recomputed alone after a batch step failed.
        self.isolated = Counter("servescope:engine_isolated_requests", "Requests recomputed "
                                "one by one because the batch step they were in failed",
                                labels, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests", labels +
                                ["finished_reason"], registry=r)
        self.model_name = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", labels,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        # vLLM's TPOT and request phases (its names and buckets), so the monitor charts the
        # same figures for servescope serve as for vLLM.
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Time per output "
                              "token after the first, per request", labels, buckets=ITL_BUCKETS,
                              registry=r).labels(model_name)
        self.phases = {phase: Histogram(f"vllm:request_{phase}_time_seconds", doc, labels,
                                        buckets=E2E_BUCKETS, registry=r).labels(model_name)
                       for phase, doc in PHASES.items()}
        # Tokens per request, as vLLM's: the monitor's response-length drift reads the second.
        tokens = build_1_2_5_buckets(max_model_len)
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per "
                                        "request", labels, buckets=tokens,
                                        registry=r).labels(model_name)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Generated tokens "
                                            "per request", labels, buckets=tokens,
                                            registry=r).labels(model_name)

    def observe_step(self, stats) -> None:
        """Gauges and token counters from one engine step (engine.llm.StepStats)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_blocks_used / max(1, stats.kv_blocks_total))
        self.prompt_tokens.inc(stats.num_prefill_tokens)
        self.generation_tokens.inc(stats.num_generated_tokens)
        self.preemptions.inc(stats.num_preempted)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.kv_evicted.inc(stats.num_evicted_tokens)
        self.isolated.inc(stats.num_isolated)

    def observe_finished(self, output: RequestOutput) -> None:
        """Latency histograms and the success counter from a finished request."""
        m = output.metrics
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        for gap in m.itl_s:
            self.itl.observe(gap)
        if m.finished is not None:
            self.e2e.observe(m.finished - m.arrival)
        if m.tpot_s is not None:
            self.tpot.observe(m.tpot_s)
        for phase, seconds in phase_seconds(m).items():
            self.phases[phase].observe(seconds)
        self.request_prompt.observe(len(output.prompt_token_ids))
        self.request_generation.observe(len(output.token_ids))
        self._success.labels(self.model_name, output.finish_reason or "unknown").inc()

    def exposition(self) -> bytes:
        """The text exposition format (version 0.0.4)."""
        return generate_latest(self.registry)


class _SpecCollector:
    """vLLM's speculative-decoding counters, read from the engine's SpecCounters at scrape time."""

    def __init__(self, model_name: str, counters) -> None:
        self.model_name, self.counters = model_name, counters

    def collect(self):
        c, name = self.counters, self.model_name
        for metric, value, doc in (
            ("vllm:spec_decode_num_drafts", c.drafts, "Verification steps with drafts"),
            ("vllm:spec_decode_num_draft_tokens", c.draft_tokens, "Draft tokens proposed"),
            ("vllm:spec_decode_num_accepted_tokens", c.accepted_tokens, "Draft tokens accepted"),
        ):
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by position",
                                      labels=["model_name", "position"])
        for position, value in enumerate(list(c.accepted_per_pos)):
            per_pos.add_metric([name, str(position)], value)
        yield per_pos
