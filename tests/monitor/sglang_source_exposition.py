"""SGLang's /metrics text, made the way SGLang makes it: a script to run in a subprocess.

SGLang is not installed here (it needs CUDA-built torch and much else), so this script defines
the metrics that servescope reads exactly as SGLang's own source does
(python/sglang/srt/observability/metrics_collector.py, sgl-project/sglang at 44cedc2b: the names,
types, label names, default buckets and multiprocess modes), records requests the way SGLang's
TokenizerMetricsCollector and SchedulerMetricsCollector do (including its inter-token histogram's
batched observation), and renders the text as SGLang's server does: prometheus_client's
MultiProcessCollector over PROMETHEUS_MULTIPROC_DIR (add_prometheus_middleware in sglang's
utils). The values are the caller's: a JSON scenario on stdin, one exposition text per phase
out, as a JSON list.

Scenario: {"dp": 2, "tp": 2, "phases": [{"requests": [{"ttft": s, "e2e": s, "queue": s,
"prompt": n, "generated": n, "cached": n, "itl": [[interval_s, new_tokens], ...]}],
"scheduler": [{"running": n, "queue": n, "token_usage": f, "retracted": n}, ... one per dp rank],
"aborted": n}]}. Every tp rank of a dp rank reports the same scheduler state, as SGLang's
schedulers do under --enable-metrics-for-all-schedulers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400]
ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
               8.000]
QUEUE_BUCKETS = [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100,
                 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000,
                 2500, 3000]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def main() -> None:
    scenario = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as directory:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # before prometheus_client's import
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
        from prometheus_client.exposition import generate_latest

        tok_labels = {"model_name": MODEL, "engine_type": "unified"}
        tk = list(tok_labels)
        prompt_tokens = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                                labelnames=tk)
        generation_tokens = Counter("sglang:generation_tokens_total",
                                    "Number of generation tokens processed.", labelnames=tk)
        cached_tokens = Counter("sglang:cached_tokens_total",
                                "Number of cached prompt tokens by source (device/host/storage).",
                                labelnames=tk + ["cache_source"])
        num_requests = Counter("sglang:num_requests_total", "Number of requests processed.",
                               labelnames=tk)
        aborted = Counter("sglang:num_aborted_requests_total", "Number of requests aborted.",
                          labelnames=tk)
        ttft = Histogram("sglang:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", labelnames=tk,
                         buckets=TTFT_BUCKETS)
        itl = Histogram("sglang:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", labelnames=tk,
                        buckets=ITL_BUCKETS)
        e2e = Histogram("sglang:e2e_request_latency_seconds",
                        "Histogram of End-to-end request latency in seconds", labelnames=tk,
                        buckets=E2E_BUCKETS)

        def sched_labels(dp: int, tp: int) -> dict:
            return {"model_name": MODEL, "engine_type": "unified", "tp_rank": tp, "pp_rank": 0,
                    "dp_rank": dp}

        sk = list(sched_labels(0, 0))

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=sk, multiprocess_mode="mostrecent")

        running = gauge("sglang:num_running_reqs", "The number of running requests.")
        usage = gauge("sglang:token_usage", "The token usage.")
        throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        queued = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        accept_len = gauge("sglang:spec_accept_length",
                           "The average acceptance length of speculative decoding.")
        accept_rate = gauge("sglang:spec_accept_rate",
                            "The average acceptance rate of speculative decoding (`accepted "
                            "tokens / total draft tokens` in batch).")
        retracted = Counter("sglang:num_retracted_requests_total",
                            "Total number of retracted requests.", labelnames=sk)
        queue_time = Histogram("sglang:queue_time_seconds",
                               "Histogram of queueing time in seconds.", labelnames=sk,
                               buckets=QUEUE_BUCKETS)

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        texts = []
        for phase in scenario["phases"]:
            for r in phase["requests"]:
                ttft.labels(**tok_labels).observe(r["ttft"])
                for interval, n in r["itl"]:
                    # TokenizerMetricsCollector.observe_inter_token_latency: the whole interval
                    # into _sum, new_tokens observations into the bucket of interval / new_tokens.
                    his = itl.labels(**tok_labels)
                    his._sum.inc(interval)
                    for i, bound in enumerate(his._upper_bounds):
                        if interval / n <= bound:
                            his._buckets[i].inc(n)
                            break
                # observe_one_finished_request
                prompt_tokens.labels(**tok_labels).inc(r["prompt"])
                generation_tokens.labels(**tok_labels).inc(r["generated"])
                if r["cached"] > 0:
                    cached_tokens.labels(**tok_labels, cache_source="device").inc(r["cached"])
                num_requests.labels(**tok_labels).inc(1)
                e2e.labels(**tok_labels).observe(r["e2e"])
                # the scheduler of dp rank 0 took it off its queue (tp rank 0 observes; with
                # metrics on for all schedulers every tp rank does)
                for tp in range(scenario["tp"]):
                    queue_time.labels(**sched_labels(0, tp)).observe(r["queue"])
            for _ in range(phase.get("aborted", 0)):
                aborted.labels(**tok_labels).inc(1)
            for dp, state in enumerate(phase["scheduler"]):
                for tp in range(scenario["tp"]):
                    labels = sched_labels(dp, tp)
                    running.labels(**labels).set(state["running"])
                    usage.labels(**labels).set(state["token_usage"])
                    throughput.labels(**labels).set(state.get("gen_throughput", 0.0))
                    queued.labels(**labels).set(state["queue"])
                    hit_rate.labels(**labels).set(0.0)  # log_decode_stats sets it to 0
                    accept_len.labels(**labels).set(state.get("accept_length", 0.0))
                    accept_rate.labels(**labels).set(state.get("accept_rate", 0.0))
                    retracted.labels(**labels).inc(state.get("retracted", 0))
            texts.append(generate_latest(registry).decode())
        json.dump(texts, sys.stdout)


if __name__ == "__main__":
    main()
