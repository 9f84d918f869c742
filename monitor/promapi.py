"""A Prometheus server's HTTP API as a source: PromQL expressions mapped to the app's series."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx

from monitor.remote import BackoffSource, FetchError, ServerConfig, describe_error
from monitor.types import Poll, Sample


def _quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket[1m])))"


# vLLM's metric names over the whole fleet the Prometheus server scrapes; keys are app series.
DEFAULT_QUERIES: dict[str, str] = {
    **{f"ttft_s_p{round(q * 100)}": _quantile(q, "vllm:time_to_first_token_seconds")
       for q in (0.5, 0.95, 0.99)},
    **{f"tpot_s_p{round(q * 100)}": _quantile(q, "vllm:time_per_output_token_seconds")
       for q in (0.5, 0.95, 0.99)},
    "e2e_s_p99": _quantile(0.99, "vllm:e2e_request_latency_seconds"),
    "requests_running": "sum(vllm:num_requests_running)",
    "requests_waiting": "sum(vllm:num_requests_waiting)",
    "kv_cache_usage": "avg(vllm:gpu_cache_usage_perc)",
    "generation_tokens_per_s": "sum(rate(vllm:generation_tokens_total[1m]))",
    "prompt_tokens_per_s": "sum(rate(vllm:prompt_tokens_total[1m]))",
}


class QueryError(Exception):
    """One expression the server refused or answered in a shape this source cannot read."""


def _suffix(metric: dict) -> str:
    # Several series from one expression stay apart, named like the normaliser's per-GPU series.
    labels = ",".join(f"{k}={v}" for k, v in sorted(metric.items()) if k != "__name__")
    return f"[{labels}]" if labels else ""


def parse_result(data: Any) -> list[tuple[str, float, float]]:
    """(suffix, ts, value) of an instant query's `data`; NaN and infinities are dropped."""
    if not isinstance(data, dict) or "resultType" not in data or "result" not in data:
        raise QueryError("an answer without data.resultType and data.result")
    kind, result = data["resultType"], data["result"]
    try:
        if kind == "scalar":
            rows = [("", result[0], result[1])]
        elif kind == "vector":
            rows = [(_suffix(r.get("metric", {})), *r["value"]) for r in result]
        else:
            raise QueryError(f"a {kind!r} result where an instant vector or scalar was expected")
        out = [(suffix, float(ts), float(value)) for suffix, ts, value in rows]
    except (TypeError, KeyError, IndexError, ValueError, AttributeError) as exc:
        raise QueryError(f"a malformed {kind} result ({type(exc).__name__}: {exc})") from exc
    return [row for row in out if math.isfinite(row[2])]


class PromApiSource(BackoffSource):
    """Runs each PromQL expression with /api/v1/query every poll; never raises from poll()."""

    def __init__(self, config: ServerConfig, queries: dict[str, str] | None = None) -> None:
        super().__init__(config, "prometheus-api")
        self.queries = dict(DEFAULT_QUERIES if queries is None else queries)
        self.url = config.url.rstrip("/") + "/api/v1/query"

    def poll(self, now: float) -> Poll:
        if now < self._next_try:
            return Poll()
        samples, errors = [], []
        for series, expr in self.queries.items():
            try:
                rows = self.query(expr, now)
            except QueryError as exc:
                errors.append(f"{series}: {self.url} sent {exc}")
                continue
            except (FetchError, httpx.HTTPError, OSError) as exc:
                # The server itself failed: the other expressions would only wait for it too.
                self._fail(now, str(exc) if isinstance(exc, FetchError) else describe_error(
                    exc, self.url, self.config.timeout_s))
                return Poll()
            samples += [Sample(f"{self.name}/{series}{suffix}", now, value)
                        for suffix, _ts, value in rows]
        if errors and len(errors) == len(self.queries):
            self._fail(now, errors[0])
            return Poll()
        self._ok(now, samples, errors)
        return Poll(samples)

    def query(self, expr: str, now: float) -> list[tuple[str, float, float]]:
        """One instant query; a refused expression or a malformed answer raises QueryError."""
        body = self._fetch({"query": expr, "time": f"{now:.3f}"})
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise QueryError(f"an answer that is not JSON ({exc})") from exc
        if not isinstance(answer, dict) or answer.get("status") != "success":
            error = answer.get("error") if isinstance(answer, dict) else None
            raise QueryError(f"an error for {expr!r}: {error or 'no status: success'}")
        return parse_result(answer.get("data"))

    def _fetch(self, params: dict[str, str]) -> bytes:
        limit = self.config.max_bytes
        with self.client.stream("GET", self.url, params=params) as response:
            # Prometheus answers a bad expression with 400 / 422 and a JSON error body.
            if response.status_code not in (200, 400, 422):
                raise FetchError(f"{self.url} answered HTTP {response.status_code}")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limit:
                    raise FetchError(f"{self.url} sent more than {limit / 2**20:g} MiB")
                chunks.append(chunk)
        return b"".join(chunks)

    def _ok(self, now: float, samples: list[Sample], errors: list[str]) -> None:
        self.failures, self._next_try = 0, 0.0
        self.status.state, self.status.last_ok = "up", now
        self.status.last_error = errors[0] if errors else None
        self.status.message = (f"{len(samples)} series from {len(self.queries)} expressions"
                               + (f", {len(errors)} failed" if errors else ""))

