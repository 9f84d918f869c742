"""A Prometheus server's HTTP API as a source: PromQL expressions mapped to the app's series."""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

import httpx

from monitor.remote import BackoffSource, FetchError, ServerConfig, classify_error
from monitor.types import Poll, Sample

# A Prometheus job name as the Servers pane accepts it (it goes into a label matcher).
JOB_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_:.\-]{0,23}")
# query_range returns at most 11,000 points per series; a backfill stays well under that.
MAX_BACKFILL_POINTS = 1000


def _quantile(q: float, histogram: str, sel: str, older: str | None = None) -> str:
    """PromQL for the q-quantile of a histogram over the last minute; `older` names the same
    figure's histogram on older servers, read where the newer one is absent."""
    rate = f"rate({histogram}_bucket{sel}[1m])"
    if older is not None:
        rate = f"({rate} or rate({older}_bucket{sel}[1m]))"
    return f"histogram_quantile({q}, sum by (le) ({rate}))"


def default_queries(job: str = "") -> dict[str, str]:
    """vLLM's metric names over the fleet the Prometheus server scrapes (only ``job`` when
    given); keys are the app's series."""
    if job and not JOB_PATTERN.fullmatch(job):
        raise ValueError(f"the job {job!r} is not a Prometheus job name; use letters, digits "
                         "and _ : . - (at most 24), starting with a letter or _")
    sel = f'{{job="{job}"}}' if job else ""
    return {
        **{f"ttft_s_p{round(q * 100)}": _quantile(q, "vllm:time_to_first_token_seconds", sel)
           for q in (0.5, 0.95, 0.99)},
        # TPOT per request (vLLM V1's histogram; V0's time_per_output_token was per token,
        # an inter-token latency, and V1 no longer exports it), and the inter-token latency.
        **{f"tpot_s_p{round(q * 100)}": _quantile(q, "vllm:request_time_per_output_token_seconds",
                                                  sel) for q in (0.5, 0.95, 0.99)},
        **{f"itl_s_p{round(q * 100)}": _quantile(q, "vllm:inter_token_latency_seconds", sel,
                                                 older="vllm:time_per_output_token_seconds")
           for q in (0.5, 0.95, 0.99)},
        "e2e_s_p99": _quantile(0.99, "vllm:e2e_request_latency_seconds", sel),
        "requests_running": f"sum(vllm:num_requests_running{sel})",
        "requests_waiting": f"sum(vllm:num_requests_waiting{sel})",
        # vLLM V1's name, or V0's on older servers.
        "kv_cache_usage": f"avg(vllm:kv_cache_usage_perc{sel} or vllm:gpu_cache_usage_perc{sel})",
        "generation_tokens_per_s": f"sum(rate(vllm:generation_tokens_total{sel}[1m]))",
        "prompt_tokens_per_s": f"sum(rate(vllm:prompt_tokens_total{sel}[1m]))",
    }


DEFAULT_QUERIES: dict[str, str] = default_queries()


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


def parse_matrix(data: Any) -> list[tuple[str, float, float]]:
    """(suffix, ts, value) of every point of a range query's `data`, NaN and infinities dropped."""
    if not isinstance(data, dict) or "resultType" not in data or "result" not in data:
        raise QueryError("an answer without data.resultType and data.result")
    if data["resultType"] != "matrix":
        raise QueryError(f"a {data['resultType']!r} result where a range query's matrix was "
                         "expected")
    try:
        out = [(_suffix(r.get("metric", {})), float(ts), float(value))
               for r in data["result"] for ts, value in r["values"]]
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise QueryError(f"a malformed matrix result ({type(exc).__name__}: {exc})") from exc
    return [row for row in out if math.isfinite(row[2])]


class PromApiSource(BackoffSource):
    """Runs each PromQL expression with /api/v1/query every poll; the first successful poll
    also fetches the last ``backfill_s`` seconds with /api/v1/query_range, so charts start full.
    Never raises from poll()."""

    def __init__(self, config: ServerConfig, queries: dict[str, str] | None = None,
                 backfill_s: float = 0.0) -> None:
        super().__init__(config, "prometheus-api")
        self.queries = dict(DEFAULT_QUERIES if queries is None else queries)
        self.url = config.url.rstrip("/") + "/api/v1/query"
        self.backfill_s = backfill_s
        self.backfilled = backfill_s <= 0

    def poll(self, now: float) -> Poll:
        if now < self._next_try:
            return Poll()
        self._begin_scrape()
        try:
            poll = self._poll_now(now)
        finally:
            self._deadline = 0.0
        if not self.backfilled and self.status.state == "up":
            self.backfilled = True  # once: a failed backfill is reported, not retried
            poll.samples[:0] = self.backfill(now)
        return poll

    def backfill(self, now: float) -> list[Sample]:
        """The window before ``now`` of every expression (older points first); an expression
        that fails is named in the status' message and skipped."""
        step = max(self.interval_s, self.backfill_s / MAX_BACKFILL_POINTS)
        params = {"start": f"{now - self.backfill_s:.3f}", "end": f"{now:.3f}",
                  "step": f"{step:g}"}
        samples, failed = [], []
        items = list(self.queries.items())
        self._deadline = time.monotonic() + self.config.timeout_s  # the backfill's own
        for i, (series, expr) in enumerate(items):
            try:
                rows = self._answer(self._fetch({"query": expr, **params}, self.range_url),
                                    expr, parse_matrix)
            except QueryError:
                failed.append(series)
                continue
            except (FetchError, httpx.HTTPError, OSError):
                # The server failed: the rest would each wait out the timeout on the hub's
                # thread, stalling every other source, for a nicety.
                failed += [name for name, _ in items[i:]]
                break
            samples += [Sample(f"{self.name}/{series}{suffix}", ts, value)
                        for suffix, ts, value in sorted(rows, key=lambda r: r[1]) if ts < now]
        self._deadline = 0.0
        self.status.message += f"; backfilled {len(samples)} points of the last " \
            f"{self.backfill_s:g} s" + (f" ({len(failed)} expressions failed)" if failed else "")
        return samples

    @property
    def range_url(self) -> str:
        return self.url.removesuffix("/api/v1/query") + "/api/v1/query_range"

    def _poll_now(self, now: float) -> Poll:
        samples, errors = [], []
        for series, expr in self.queries.items():
            try:
                rows = self.query(expr, now)
            except QueryError as exc:
                errors.append(f"{series}: {self.url} sent {exc}")
                continue
            except (FetchError, httpx.HTTPError, OSError) as exc:
                # The server itself failed: the other expressions would only wait for it too.
                reason, message = classify_error(exc, self.url, self.config.timeout_s)
                self._fail(now, message, reason)
                return Poll()
            samples += [Sample(f"{self.name}/{series}{suffix}", now, value)
                        for suffix, _ts, value in rows]
        if errors and len(errors) == len(self.queries):
            self._fail(now, errors[0], "error")
            return Poll()
        self._ok(now, f"{len(samples)} series from {len(self.queries)} expressions"
                 + (f", {len(errors)} failed" if errors else ""), errors[0] if errors else None)
        return Poll(samples)

    def query(self, expr: str, now: float) -> list[tuple[str, float, float]]:
        """One instant query; a refused expression or a malformed answer raises QueryError."""
        body = self._fetch({"query": expr, "time": f"{now:.3f}"}, self.url)
        return self._answer(body, expr, parse_result)

    @staticmethod
    def _answer(body: bytes, expr: str, parse: Any) -> list[tuple[str, float, float]]:
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise QueryError(f"an answer that is not JSON ({exc})") from exc
        if not isinstance(answer, dict) or answer.get("status") != "success":
            error = answer.get("error") if isinstance(answer, dict) else None
            raise QueryError(f"an error for {expr!r}: {error or 'no status: success'}")
        return parse(answer.get("data"))

    def _fetch(self, params: dict[str, str], url: str) -> bytes:
        with self._stream(url, params=params) as response:
            # Prometheus answers a bad expression with 400 / 422 and a JSON error body.
            if response.status_code not in (200, 400, 422):
                raise FetchError(f"{url} answered HTTP {response.status_code}",
                                 response.status_code)
            return self._read(response, url)
