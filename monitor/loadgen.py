"""Load an OpenAI-compatible endpoint; measure TTFT, TPOT, ITL and E2E as vLLM's bench does."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import aiohttp
import aiohttp.http_exceptions
import httpx
import numpy as np

from monitor.remote import describe_error
from monitor.run_window import ServerWindow
from monitor.types import RequestRecord
from storage.queries import describe

# The precisions the planner knows (planner.catalog's PRECISIONS and KV_PRECISIONS), which a
# stored run may name; the monitor does not import the planner, and a test keeps them equal.
WEIGHT_PRECISIONS = ("bf16", "fp16", "fp8", "int8", "int4")
KV_PRECISIONS = ("bf16", "fp16", "fp8", "int8")

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum"  # noqa: SIM905
         .split())


@dataclass
class LoadSpec:
    """What to send, how often and when to stop; validated at construction."""

    url: str
    endpoint: str = "completions"  # or "chat"
    model: str | None = None
    rate: float | None = None  # requests/s; None with no concurrency = all at once
    arrival: str = "poisson"  # "poisson", "gamma" (burstiness = shape) or "constant"
    burstiness: float = 1.0
    # Requests in flight: alone, a closed loop; with a rate, a cap (arrivals wait for a slot,
    # as `vllm bench serve --max-concurrency`).
    concurrency: int | None = None
    requests: int = 100
    # Requests sent one at a time before the measured ones, not recorded: a server's first
    # request after start pays for its warm-up (TTFT 97-113 ms against 80-84 ms after it,
    # real vLLM 0.32 here), which in a 16-request run is its p99. `vllm bench serve` sends one
    # such test prompt first as well.
    warmups: int = 0
    duration_s: float | None = None
    input_len: int = 128
    # "words" of WORDS (about 1.1 tokens each), or "tokens" of the server's own tokenizer: token
    # ids from its /tokenize, sent as the prompt, so each prompt has exactly input_len tokens.
    input_unit: str = "words"
    output_len: int = 128
    length_spread: float = 0.0  # 0 = fixed lengths; 0.5 = uniform within +-50 %
    lengths: list[tuple[int, int]] | None = None  # (input, output) pairs read from a file
    token: str | None = field(default=None, repr=False)
    timeout_s: float = 300.0
    seed: int = 0
    slo_ms: dict[str, float] = field(default_factory=dict)  # keys ttft, tpot, e2e
    # Read the server's /metrics before and after the run, and store its own latency
    # estimates over exactly these requests beside the exact ones (monitor/run_window.py).
    server_estimates: bool = True

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"{self.url!r} is not an http(s) URL; use e.g. http://127.0.0.1:8000")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be 'completions' or 'chat'")
        if self.arrival not in ("poisson", "gamma", "constant"):
            raise ValueError("arrival must be poisson, gamma or constant")
        if self.input_unit not in ("words", "tokens"):
            raise ValueError("the input unit must be 'words' or 'tokens'")
        if self.input_unit == "tokens" and self.endpoint != "completions":
            raise ValueError("prompt lengths in tokens are sent as token ids, which only the "
                             "completions endpoint takes: use the completions endpoint")
        if (self.rate is not None and self.rate <= 0) or self.burstiness <= 0:
            raise ValueError("rate and burstiness must be positive")
        if self.warmups < 0:
            raise ValueError("warm-up requests must be 0 or more")
        if self.requests < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("requests, input and output lengths must be at least 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if not 0 <= self.length_spread < 1:
            raise ValueError("length spread must be within [0, 1)")
        unknown = set(self.slo_ms) - {"ttft", "tpot", "e2e"}
        if unknown:
            raise ValueError(f"unknown SLO names {sorted(unknown)}; use ttft, tpot, e2e")


def arrival_gaps(spec: LoadSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    """Seconds between request starts (zeros when there is no rate)."""
    if spec.rate is None:
        return np.zeros(n)
    if spec.arrival == "constant":
        return np.full(n, 1.0 / spec.rate)
    shape = 1.0 if spec.arrival == "poisson" else spec.burstiness
    # A gamma with shape k and scale 1/(k*rate) keeps the mean gap 1/rate; k=1 is Poisson.
    return rng.gamma(shape, 1.0 / (shape * spec.rate), n)


def request_lengths(spec: LoadSpec, rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    """(input, output) token counts of each request."""
    if spec.lengths:
        return [spec.lengths[i % len(spec.lengths)] for i in range(n)]
    s = spec.length_spread

    def draw(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - s))), max(1, int(mean * (1 + s)))
        return rng.integers(lo, hi + 1, n)

    return list(zip(draw(spec.input_len).tolist(), draw(spec.output_len).tolist(), strict=True))


def make_prompt(n_words: int, rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, n_words).tolist())


class LoadError(Exception):
    """A load test that cannot start (the server cannot size its prompts); one sentence."""


def token_pool(spec: LoadSpec) -> list[int]:
    """The server's token ids of WORDS, from its /tokenize (vLLM's and servescope's), which
    token prompts are drawn from. Raises LoadError saying what to do where it has none."""
    url = spec.url.rstrip("/") + "/tokenize"
    body = {"prompt": " " + " ".join(WORDS), "add_special_tokens": False}
    if spec.model:
        body["model"] = spec.model
    headers = {"Authorization": f"Bearer {spec.token}"} if spec.token else {}
    try:
        reply = httpx.post(url, json=body, headers=headers, timeout=spec.timeout_s)
    except httpx.HTTPError as exc:
        raise LoadError(describe_error(exc, url, spec.timeout_s)) from exc
    try:
        tokens = reply.json()["tokens"] if reply.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        tokens = None
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise LoadError(f"{url} answered HTTP {reply.status_code} without token ids: prompt "
                        "lengths in tokens need the server's /tokenize (vLLM's and servescope "
                        "serve's have one); give them in words instead")
    return tokens


def make_prompts(spec: LoadSpec, lengths: list[tuple[int, int]],
                 rng: np.random.Generator) -> list[str | list[int]]:
    """Each request's prompt: words, or exactly its length in the server's token ids."""
    if spec.input_unit == "words":
        return [make_prompt(n_in, rng) for n_in, _ in lengths]
    pool = np.asarray(token_pool(spec))
    return [rng.choice(pool, n_in).tolist() for n_in, _ in lengths]


def _payload(spec: LoadSpec, prompt: str | list[int], max_tokens: int) -> tuple[str, dict]:
    body: dict = {"max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                  "ignore_eos": True, "stream_options": {"include_usage": True}}
    if spec.model:
        body["model"] = spec.model
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _chunk_text(event: dict) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


class RequestFailed(Exception):
    """A request the server refused or answered wrongly; the message is one sentence."""


def request_error(exc: Exception, spec: LoadSpec) -> str:
    """The sentence stored with a failed request (the CLI and the History pane show it): what
    went wrong with which URL, never a Python type name."""
    if isinstance(exc, RequestFailed):
        return str(exc)
    if isinstance(exc, json.JSONDecodeError):
        return f"{spec.url} sent a stream line that is not JSON ({exc.msg})"
    if isinstance(exc, UnicodeDecodeError):
        return f"{spec.url} sent a stream line that is not UTF-8 text"
    if isinstance(exc, httpx.HTTPError | TimeoutError):
        return describe_error(exc, spec.url, spec.timeout_s)
    if isinstance(exc, aiohttp.ClientError | aiohttp.http_exceptions.HttpProcessingError):
        return _client_error(exc, spec.url)
    return f"the request to {spec.url} failed: {str(exc).strip() or 'no details were given'}"


def client_session(spec: LoadSpec, connections: int) -> aiohttp.ClientSession:
    """The streaming client: aiohttp, as `vllm bench serve`. On cores shared with the server
    under test, the client's CPU time per streamed token is taken from the server: 0.25-0.31 ms
    here against httpx's 0.51-0.75 (benchmarks/loadgen_client.py). A stalled connection or read
    fails after timeout_s, as httpx's timeout did."""
    headers = {"Authorization": f"Bearer {spec.token}"} if spec.token else {}
    timeout = aiohttp.ClientTimeout(total=None, connect=spec.timeout_s,
                                    sock_read=spec.timeout_s)
    # Lines up to 1 MiB: a chunk with many top log-probabilities is one long SSE line. The
    # environment's proxy settings apply, as they did with httpx.
    return aiohttp.ClientSession(headers=headers, timeout=timeout, read_bufsize=2**20,
                                 connector=aiohttp.TCPConnector(limit=connections),
                                 trust_env=True)


def _client_error(exc: Exception, url: str) -> str:
    """aiohttp's failures as sentences: its messages carry reprs and the raw bytes read."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"the TLS certificate of {url} could not be verified ({exc.certificate_error})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {url} ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"{url} failed: it closed the connection before answering"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"{url} failed: its answer was cut short (the connection ended inside the body)"
    if isinstance(exc, aiohttp.ClientOSError):
        return f"{url} failed: {exc.strerror or 'the connection broke'}"
    message = getattr(exc, "message", None)
    what = (message if isinstance(message, str) else str(exc)).strip().splitlines()
    reason = what[0].split(": b'")[0].rstrip(":").strip() if what else "no details were given"
    return f"{url} failed: its answer is not readable HTTP ({reason[:120]})"


async def send_one(client: aiohttp.ClientSession, spec: LoadSpec, prompt: str | list[int],
                   prompt_len: int, max_tokens: int) -> RequestRecord:
    """One streamed request, timed from send to each content chunk."""
    path, body = _payload(spec, prompt, max_tokens)
    start = time.perf_counter()
    times: list[float] = []
    usage_tokens = usage_prompt = None
    try:
        async with client.post(spec.url.rstrip("/") + path, json=body) as resp:
            if resp.status != 200:
                detail = (await resp.content.read(4096)).decode("utf-8", "replace")[:200]
                raise RequestFailed(f"{spec.url} answered HTTP {resp.status}: "
                                    f"{detail.strip() or 'no details'}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data.decode("utf-8"))
                if _chunk_text(event):
                    times.append(time.perf_counter())
                usage = event.get("usage") or {}
                usage_tokens = usage.get("completion_tokens", usage_tokens)
                # The server's own count of prompt tokens beats the words the prompt was made of.
                usage_prompt = usage.get("prompt_tokens", usage_prompt)
    except Exception as exc:  # any failure is this request's result, not the run's
        return RequestRecord("loadgen", time.time(), prompt_tokens=prompt_len, ok=False,
                             error=request_error(exc, spec)[:300])
    end = time.perf_counter()
    if not times:
        return RequestRecord("loadgen", time.time(), prompt_tokens=prompt_len, ok=False,
                             error="the stream ended without any output")
    n_out = usage_tokens or len(times)
    ttft, e2e = times[0] - start, end - start
    # vLLM's TPOT: (latency - TTFT) / (output tokens - 1), i.e. the first token excluded.
    tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 else None
    return RequestRecord("loadgen", time.time(), ttft_s=ttft, tpot_s=tpot, e2e_s=e2e,
                         itl_s=[b - a for a, b in zip(times, times[1:], strict=False)],
                         prompt_tokens=usage_prompt or prompt_len, output_tokens=n_out)


@dataclass(frozen=True)
class ServerInfo:
    """The deployment a load test measured: GPU, parallelism, precisions and engine. Stored with
    the run so the planner can calibrate its efficiency factors from it (planner.measured)."""

    gpu: str | None = None  # catalog or CUDA device name, e.g. "H100 SXM", "NVIDIA L4"
    tp: int = 1
    pp: int = 1
    weights: str | None = None
    kv: str | None = None
    engine: str | None = None  # e.g. "vLLM 0.8.5"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tensor and pipeline parallel sizes must be at least 1, got "
                             f"--tp {self.tp} --pp {self.pp}")
        if self.weights is not None and self.weights not in WEIGHT_PRECISIONS:
            raise ValueError(f"--weights {self.weights!r} is not a precision the planner "
                             f"knows; use one of {', '.join(WEIGHT_PRECISIONS)}")
        if self.kv is not None and self.kv not in KV_PRECISIONS:
            raise ValueError(f"--kv {self.kv!r} is not a KV-cache precision the planner "
                             f"knows; use one of {', '.join(KV_PRECISIONS)}")

    def as_config(self) -> dict:
        """The keys a run's config carries (planner.measured reads them); unset ones left out."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class LoadResult:
    """The records of a finished run and its summary (the --json output)."""

    spec: LoadSpec
    records: list[RequestRecord]
    started: float
    duration_s: float
    summary: dict


def _met_slo(r: RequestRecord, slo_ms: dict[str, float]) -> bool:
    got = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    return r.ok and all(got[k] is not None and got[k] * 1000 <= v for k, v in slo_ms.items())


def summarize(records: list[RequestRecord], duration_s: float,
              slo_ms: dict[str, float]) -> dict:
    """vLLM bench serve's figures: percentiles in ms, throughput, goodput, completed, failed."""
    ok = [r for r in records if r.ok]
    ms = lambda xs: [x * 1000.0 for x in xs if x is not None]  # noqa: E731
    out: dict = {}
    for name, values in (("ttft_ms", ms(r.ttft_s for r in ok)),
                         ("tpot_ms", ms(r.tpot_s for r in ok)),
                         ("itl_ms", ms(x for r in ok for x in r.itl_s)),
                         ("e2e_ms", ms(r.e2e_s for r in ok))):
        d = describe(values)
        out[name] = {k: d[k] for k in ("p50", "p95", "p99", "mean")}
    dur = max(duration_s, 1e-9)
    out["request_throughput"] = len(ok) / dur
    out["output_tokens_per_s"] = sum(r.output_tokens for r in ok) / dur
    out["goodput"] = sum(_met_slo(r, slo_ms) for r in ok) / dur if slo_ms else None
    out["completed"], out["failed"] = len(ok), len(records) - len(ok)
    out["duration_s"] = duration_s
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


async def _run(spec: LoadSpec, progress: Callable[[int, int], None] | None) -> LoadResult:
    rng = np.random.default_rng(spec.seed)
    gaps = arrival_gaps(spec, rng, spec.requests)
    lengths = request_lengths(spec, rng, spec.requests)
    prompts = await asyncio.to_thread(make_prompts, spec, lengths, rng)
    connections = spec.concurrency or spec.requests
    gate = asyncio.Semaphore(connections)
    records: list[RequestRecord] = []

    async def one(i: int, client: aiohttp.ClientSession) -> None:
        async with gate:
            records.append(await send_one(client, spec, prompts[i], lengths[i][0],
                                          lengths[i][1]))
        if progress is not None:
            progress(len(records), spec.requests)

    if spec.warmups:
        async with client_session(spec, 1) as c:
            for _ in range(spec.warmups):  # the first request's shape; the record is dropped
                await send_one(c, spec, prompts[0], lengths[0][0], lengths[0][1])
    window = (await asyncio.to_thread(ServerWindow, spec.url, spec.token)
              if spec.server_estimates else None)
    started, t0 = time.time(), time.perf_counter()
    async with client_session(spec, connections) as c:
        tasks = []
        for i in range(spec.requests):
            if spec.duration_s is not None and time.perf_counter() - t0 >= spec.duration_s:
                break
            if spec.concurrency is not None and spec.rate is None:
                await gate.acquire()  # closed loop: the next request starts when one ends
                gate.release()
            tasks.append(asyncio.create_task(one(i, c)))
            if gaps[i] > 0:
                await asyncio.sleep(gaps[i])
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    summary = summarize(records, duration, spec.slo_ms)
    if window is not None:
        summary["server"] = await asyncio.to_thread(window.close, summary["completed"])
    return LoadResult(spec, records, started, duration, summary)


def run_load(spec: LoadSpec, progress: Callable[[int, int], None] | None = None) -> LoadResult:
    """Run a load test to completion (blocking) and return its records and summary. Raises
    LoadError when prompts in tokens cannot be made (the server has no /tokenize)."""
    return asyncio.run(_run(spec, progress))


def store_run(db, result: LoadResult, name: str = "", server: ServerInfo | None = None,
              extra: dict | None = None) -> int:
    """Save a load test as a run with its request records; returns the run id. `server` adds
    the measured deployment (GPU, TP/PP, precisions, engine) to the run's config, `extra` more
    keys (a plan run's predictions)."""
    from storage.queries import finish_run, save_run
    from storage.writer import Writer

    config = {k: v for k, v in asdict(result.spec).items() if k != "token"}
    config.update(server.as_config() if server is not None else {})
    config.update(extra or {})
    run_id = save_run(db, "loadtest", name or result.spec.url, config, result.summary,
                      result.started)
    for r in result.records:
        r.run_id = run_id
    writer = Writer(db).start()
    writer.submit(requests=result.records)
    if not writer.close():
        raise RuntimeError(writer.last_error or "the request records could not be stored")
    finish_run(db, run_id, result.summary, result.started + result.duration_s)
    return run_id
