"""`servescope serve`: the embedded engine behind an OpenAI-compatible HTTP API with /metrics.

An ASGI application (FastAPI) under uvicorn. A request is checked at the door: the body by
engine/http_guard.py (size, time, API key), its fields by the pydantic models of
engine/api_schema.py, its prompt tokenized and measured against the context on a worker thread.
Only then does it reach the engine loop (engine/serve_loop.py), the one thread that steps the
engine. Errors follow vLLM's: 400 naming the field, 401, 404, 408, 413; 503 only while the
engine cannot serve (documented in the OpenAPI schema). A client that disconnects aborts its
request, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import ipaddress
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from engine.api_reply import Reply, error_body
from engine.api_request import (
    ApiError,
    chat_prompt_ids,
    check_decode_scoring,
    check_fields,
    check_model,
    grammar_spec,
    logprob_counts,
    reply_options,
    sampling_params,
    tool_plan,
)
from engine.api_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    field_path,
)
from engine.http_guard import BodyGuard, GuardedH11Protocol
from engine.kv_eviction import parse_policy
from engine.sequence import SEED_MAX, RequestError, SamplingParams, StreamDelta
from engine.serve_loop import Admitted, EngineLoop
from engine.serve_metrics import ServerMetrics
from engine.tool_calls import ToolServing

try:
    SERVESCOPE_VERSION = importlib.metadata.version("servescope")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was not installed
    SERVESCOPE_VERSION = "unknown"

log = logging.getLogger("servescope.serve")

MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServerLimits:
    """Connection limits and deadlines; each bounds what one client can hold."""

    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 30.0  # the whole request body
    header_timeout_s: float = 10.0  # the request head, from connect or the previous response
    # An idle keep-alive connection. Longer than clients keep idle ones (httpx and so the
    # openai client: 5 s), so the client, not the server, closes it: with equal timeouts a
    # request sent as the server closes is reset and lost (1 in 20,000 in the soak test).
    keep_alive_s: float = 30.0
    max_connections: int = 512  # beyond this, uvicorn answers 503 at once
    backlog: int = 2048  # connections the kernel queues before accept
    stall_timeout_s: float = 600.0  # no word from the engine on a request for this long


ERROR_RESPONSES = {
    400: {"description": "A field is invalid (the message names it)"},
    401: {"description": "Missing or wrong API key"},
    404: {"description": "The model named is not the one served"},
    408: {"description": "The request body did not arrive in time"},
    413: {"description": "The request body is over the limit"},
    503: {"description": "The engine cannot serve now (shutting down, or it failed): retry"},
}


# ---- the application ----
def create_app(llm, loop: EngineLoop, metrics: ServerMetrics,
               limits: ServerLimits = ServerLimits(), api_key: str | None = None,
               tools: ToolServing | None = None):
    """The ASGI application: routes, error handlers and the body guard around them."""
    app = FastAPI(title="servescope", version=SERVESCOPE_VERSION,
                  description="OpenAI-compatible API of the servescope engine.")
    tools = tools or ToolServing.for_template(llm.tokenizer.chat_template)
    # The routes find the engine through the app's state, never a closure: FastAPI keeps every
    # endpoint function it has seen in a process-wide cache (fastapi/dependencies/models.py), so
    # a closure over the engine would keep each served model in memory after its server stops
    # (the app starts and stops servers in one process).
    app.state.service = _Service(llm, loop, metrics, limits, tools)
    _add_error_handlers(app)

    @app.get("/health", responses={503: ERROR_RESPONSES[503]})
    async def health(request: Request) -> Response:
        reason = _service(request).loop.health()
        if reason is not None:
            return _error_response(ApiError(503, reason, "server_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        # As vLLM's /version: monitors store it with the source (monitor.remote.VERSION_PATHS).
        return {"version": f"servescope {SERVESCOPE_VERSION}"}

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        return Response(_service(request).metrics.exposition(),
                        media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
    async def models(request: Request) -> dict:
        llm = _service(request).llm
        return {"object": "list", "data": [
            {"id": llm.model_name, "object": "model", "created": 0, "owned_by": "servescope",
             "max_model_len": llm.max_model_len}]}

    @app.post("/tokenize", responses={k: ERROR_RESPONSES[k] for k in (400, 401, 404, 408, 413)})
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        llm = _service(request).llm
        check_model(body, llm.model_name)
        # A 4 MiB text takes seconds to encode: on a worker thread, as a prompt is.
        ids = await run_in_threadpool(llm.tokenizer.encode, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
                "token_strs": None}

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _service(request).generate(request, body, chat=False)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _service(request).generate(request, body, chat=True)

    return BodyGuard(app, limits.max_body_bytes, limits.body_timeout_s, api_key), app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (f"No route {request.method} {request.url.path}: see /v1/models, "
                       "/v1/completions, /v1/chat/completions, /health, /metrics.")
        elif exc.status_code == 400:
            message = "The request body is not valid JSON: send one JSON object."
        return _error_response(ApiError(exc.status_code, message, kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("Unexpected error on %s %s", request.method, request.url.path)
        return _error_response(ApiError(500, f"The server failed on this request "
                                             f"({type(exc).__name__}); it was logged.",
                                        "server_error"))


def _validation_error(exc: RequestValidationError) -> ApiError:
    """A 400 naming the first bad field, as vLLM answers (not FastAPI's 422 list)."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "The request body is invalid.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, "The request body is not valid JSON: send one JSON object.")
    field = field_path(tuple(first.get("loc", ())))
    same = [e for e in errors if field_path(tuple(e.get("loc", ()))) == field]
    reasons = list(dict.fromkeys(str(e.get("msg", "invalid")).removeprefix("Value error, ")
                                 for e in same))[:3]
    if field == "body":
        return ApiError(400, "The request body must be a JSON object: " + "; ".join(reasons))
    return ApiError(400, f"'{field}': " + "; or ".join(reasons), param=field)


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, str(exc), exc.kind, exc.param),
                        status_code=exc.status)


# ---- one request, from fields to engine and back ----
def _service(request: Request) -> _Service:
    return request.app.state.service


class _Service:
    """What the routes share: the engine, its loop, the metrics and the limits."""

    def __init__(self, llm, loop: EngineLoop, metrics: ServerMetrics,
                 limits: ServerLimits, tools: ToolServing) -> None:
        self.llm, self.loop, self.metrics, self.limits = llm, loop, metrics, limits
        self.tools = tools  # the chat template in use and its tool-call parser

    async def generate(self, request: Request, body, chat: bool) -> Response:
        arrival = time.perf_counter()  # TTFT counts tokenizing and queueing, as vLLM's does
        reason = self.loop.health()
        if reason is not None:
            raise ApiError(503, reason, "server_error")
        check_model(body, self.llm.model_name)
        check_fields(body, chat, self.llm)
        tools = tool_plan(body, self.tools) if chat else None
        # Tokenizing a 4 MiB prompt takes seconds, and compiling a large schema a while: on a
        # worker thread, not the event loop and not the engine thread.
        prompt_ids = await run_in_threadpool(self._prompt_ids, body, chat, tools)
        grammar = await run_in_threadpool(grammar_spec, body, chat, self.llm.tokenizer, tools)
        params = self._sampling(body, len(prompt_ids), chat, grammar)
        decode_from = check_decode_scoring(body, chat, len(prompt_ids))
        streams = await self._submit(prompt_ids, params, arrival, body.n,
                                     logprob_counts(body, chat)[1], decode_from)
        options = reply_options(body, chat, prompt_ids, self.llm.tokenizer)
        options.prompt_scores = streams[0].admitted.prompt_logprobs
        options.decoded_from = decode_from
        options.tools = tools
        reply = Reply(self.llm.model_name, chat, self.llm.tokenizer, options, body.n)
        if body.stream:
            return _SseResponse(streams, reply, body.include_usage)
        choices = await _collect_unless_disconnected(streams, request)
        if choices is None:
            return Response(status_code=499)  # nobody is there to read it
        return JSONResponse(reply.whole(choices))

    async def _submit(self, prompt_ids: list[int], params: SamplingParams, arrival: float,
                      n: int, prompt_logprobs: int | None,
                      decode_from: int | None = None) -> list[_EngineStream]:
        """One engine request per choice, each admitted before the reply starts; a seed gives
        choice i the seed + i. Choices after the first share the first one's full prompt
        blocks (the scheduler's fork) instead of computing the prompt's KV again."""
        streams = [_EngineStream(self.loop, self.limits.stall_timeout_s) for _ in range(n)]
        for i, stream in enumerate(streams):
            stream.submit(prompt_ids, _choice_params(params, i), arrival,
                          prompt_logprobs if i == 0 else None,  # the prompt is scored once
                          share_prompt_with=streams[0].request_id if i else None,
                          decode_from=decode_from if i == 0 else None)
        for stream in streams:
            first = await stream.next()
            if isinstance(first, RequestError):
                for other in streams:
                    other.abort()
                raise ApiError(*_request_error(stream, first))
            stream.admitted = first
        return streams

    def _prompt_ids(self, body, chat: bool, tools=None) -> list[int]:
        self._check_text_length(body, chat)
        if chat:
            try:
                ids = chat_prompt_ids(body, self.llm.tokenizer, tools, self.tools)
            except Exception as exc:  # a template error names the problem, not a traceback
                raise ApiError(400, f"The chat template failed on these messages: {exc}",
                               param="messages") from exc
        else:
            prompt = body.prompt_value()
            ids = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise ApiError(400, "The prompt is empty: give at least one token.", param="prompt")
        vocab = self.llm.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} is outside the vocabulary (0..{vocab - 1}).",
                           param="prompt")
        return list(ids)

    def _check_text_length(self, body, chat: bool) -> None:
        """A text longer than the context could hold even at the longest token is refused
        without tokenizing it (seconds of CPU for a 4 MiB body)."""
        if self._repositions(body):
            return  # StreamingLLM takes prompts longer than the context
        if chat:
            chars = sum(len(m.text()) for m in body.messages)
        else:
            prompt = body.prompt_value()
            chars = len(prompt) if isinstance(prompt, str) else 0
        limit = self.llm.max_model_len * self.llm.tokenizer.max_token_chars
        if chars > limit:
            raise ApiError(400, f"The prompt has {chars} characters, more than this model's "
                                f"maximum context length of {self.llm.max_model_len} tokens can "
                                "hold: shorten the prompt.", param="messages" if chat else
                           "prompt")

    def _sampling(self, body, prompt_len: int, chat: bool, grammar) -> SamplingParams:
        room = self.llm.max_model_len - prompt_len
        asked = body.requested_max_tokens() if chat else body.max_tokens
        bounded = not self._repositions(body)  # StreamingLLM may run past the context
        if bounded and room < 1:
            raise ApiError(400, f"This model's maximum context length is "
                                f"{self.llm.max_model_len} tokens and the prompt has "
                                f"{prompt_len}: shorten the prompt.", param="prompt")
        if asked is not None and bounded and asked > room:
            raise ApiError(400, f"'max_tokens' is too large: {asked}. This model's maximum "
                                f"context length is {self.llm.max_model_len} tokens and the "
                                f"prompt has {prompt_len} ({asked} > {room}).",
                           param="max_tokens")
        if asked is None:
            # As vLLM: a chat reply may use the rest of the context, a completion 16 tokens.
            pool = min(self.llm.max_model_len, self.llm.kv_cache_tokens) - prompt_len
            asked = max(1, pool) if chat else max(1, min(16, room))
        # Echo with max_tokens 0 still runs one token (vLLM's way); the reply leaves it out.
        return sampling_params(body, max(1, asked), grammar, chat)

    def _repositions(self, body) -> bool:
        name = body.kv_policy if body.kv_policy is not None else self.llm.kv_policy
        try:
            policy = parse_policy(name)
        except Exception:  # noqa: BLE001 - the engine names a bad policy on admission
            return False
        return policy is not None and policy.repositions


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    if index == 0 or params.seed is None:
        return params
    seed = params.seed + index if params.seed + index <= SEED_MAX else params.seed - index
    return dataclasses.replace(params, seed=seed)


def _request_error(stream: _EngineStream, error: RequestError) -> tuple:
    if stream.unavailable:
        return 503, str(error), "server_error"
    return 400, str(error), "invalid_request_error"


class _EngineStream:
    """One request's replies from the engine thread, as an asyncio queue on the server's loop."""

    def __init__(self, loop: EngineLoop, stall_timeout_s: float) -> None:
        self.loop = loop
        self.stall_timeout_s = stall_timeout_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_id: str | None = None
        self.finished = False
        self.unavailable = False  # the error came from the engine not serving, not the request
        self.admitted: Admitted | None = None
        self._mailbox = _Mailbox.of_running_loop()

    def submit(self, prompt_ids: list[int], params: SamplingParams, arrival: float,
               prompt_logprobs: int | None = None, share_prompt_with: str | None = None,
               decode_from: int | None = None) -> None:
        sub = self.loop.submit(prompt_ids, params, self._deliver_threadsafe, arrival,
                               prompt_logprobs, share_prompt_with, decode_from)
        self.request_id = sub.request_id

    def _deliver_threadsafe(self, item) -> None:
        self._mailbox.post(self.queue, item)

    async def next(self) -> Admitted | StreamDelta | RequestError:
        """The next reply; a RequestError if the engine stalls or stops."""
        # A reply already here is taken without a timer (the common case under load).
        item = self.queue.get_nowait() if not self.queue.empty() else await self._wait()
        if item is None:
            reason = self.loop.health()
            self.abort()
            self.unavailable = True
            return RequestError(reason or "The engine did not answer in time: retry later.")
        if isinstance(item, RequestError) or (isinstance(item, StreamDelta) and
                                              item.output is not None):
            self.finished = True
            self.unavailable = self.loop.health() is not None
        return item

    async def _wait(self) -> Admitted | StreamDelta | RequestError | None:
        """The next reply, or None once the engine has stopped or stalled too long (checked
        every second)."""
        waited = 0.0
        while True:
            try:
                async with asyncio.timeout(1.0):
                    return await self.queue.get()
            except TimeoutError:
                waited += 1.0
                if self.loop.health() is not None or waited >= self.stall_timeout_s:
                    return None

    def abort(self) -> None:
        if self.request_id is not None and not self.finished:
            self.loop.abort(self.request_id)


class _Mailbox:
    """Replies from the engine thread to one event loop, handed over in one wake-up per batch.

    The engine thread delivers every request's tokens of a step back to back; the event loop is
    woken once for all of them (rather than a call_soon_threadsafe per token: a self-pipe write
    and an event-loop pass each), so the API's work per step does not grow with the number of
    wake-ups. (Measured by benchmarks/peer_vllm.py: no gain beyond the noise on two cores.)
    """

    _by_loop: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
    _create_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []

    @classmethod
    def of_running_loop(cls) -> _Mailbox:
        loop = asyncio.get_running_loop()
        with cls._create_lock:
            box = cls._by_loop.get(loop)
            if box is None:
                # Closed loops' mailboxes go (tests and the app start servers many times).
                for old in [lp for lp in cls._by_loop if lp.is_closed()]:
                    del cls._by_loop[old]
                box = cls._by_loop[loop] = cls(loop)
            return box

    def post(self, queue: asyncio.Queue, item: object) -> None:
        """Called on the engine thread; raises RuntimeError once the event loop has closed."""
        with self._lock:
            wake = not self._items
            self._items.append((queue, item))
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._hand_over)
            except RuntimeError:
                with self._lock:
                    self._items.clear()
                raise

    def _hand_over(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


async def _collect(stream: _EngineStream) -> list[StreamDelta]:
    deltas: list[StreamDelta] = []
    while not deltas or deltas[-1].output is None:
        item = await stream.next()
        if isinstance(item, RequestError):  # 500: the engine failed on this request alone
            raise ApiError(503 if stream.unavailable else 500, str(item), "server_error")
        deltas.append(item)
    return deltas


async def _until_disconnect(receive) -> None:
    """Wait on an ASGI receive channel (its body already read) until the client leaves."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_disconnected(streams: list[_EngineStream],
                                       request: Request) -> list[list[StreamDelta]] | None:
    """Every choice's deltas, or None (and the requests aborted) if the client leaves."""
    collect = asyncio.ensure_future(asyncio.gather(*(_collect(s) for s in streams)))
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if collect in done:
        if collect.exception() is not None:  # one choice failed: the others stop too
            for stream in streams:
                stream.abort()
        return collect.result()
    for stream in streams:
        stream.abort()
    collect.cancel()
    with contextlib.suppress(asyncio.CancelledError, ApiError):
        await collect
    return None


class _SseResponse(StreamingResponse):
    """Server-sent events of one request; a client that leaves aborts the request at once."""

    def __init__(self, streams: list[_EngineStream], reply: Reply, include_usage: bool) -> None:
        self.streams = streams
        super().__init__(_events(streams, reply, include_usage),
                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(self._abort_on_disconnect(receive))
        try:
            await super().__call__(scope, watcher_receive(watcher, receive), send)
        finally:
            watcher.cancel()
            self._abort()  # no-op once finished; frees the KV blocks otherwise

    def _abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def _abort_on_disconnect(self, receive) -> None:
        await _until_disconnect(receive)
        self._abort()


def watcher_receive(watcher: asyncio.Future, receive):
    """Starlette may listen for the disconnect too; it then waits on the same watcher."""

    async def wait_for_disconnect():
        await asyncio.shield(watcher)
        return {"type": "http.disconnect"}

    return wait_for_disconnect


async def _events(streams: list[_EngineStream], reply: Reply, include_usage: bool):
    """The choices' chunks as they come (each names its index), then the usage block."""
    for chunk in reply.opening():
        yield _sse(chunk)
    outputs: list = [None] * len(streams)  # each choice's output, set when it finishes
    chunks = _one_choice(streams[0], reply, outputs) if len(streams) == 1 else \
        _choices(streams, reply, outputs)
    async for chunk in chunks:
        yield chunk
    if any(out is None for out in outputs):
        return  # an error event ended the stream
    if include_usage:
        yield _sse(reply.usage_chunk(outputs))
    yield b"data: [DONE]\n\n"


async def _one_choice(stream: _EngineStream, reply: Reply, outputs: list):
    """One choice's chunks, awaited in turn (no task per token), until its output or an error
    event."""
    while True:
        item = await stream.next()
        if isinstance(item, RequestError):
            yield _error_event(stream, item)
            return
        yield _sse(reply.chunk(item, 0))
        if item.output is not None:
            outputs[0] = item.output
            return


async def _choices(streams: list[_EngineStream], reply: Reply, outputs: list):
    """Several choices' chunks as they come (each names its index), until every output or an
    error event."""
    pending = {asyncio.ensure_future(s.next()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                item = task.result()
                if isinstance(item, RequestError):
                    yield _error_event(streams[i], item)
                    return
                yield _sse(reply.chunk(item, i))
                if item.output is None:
                    pending[asyncio.ensure_future(streams[i].next())] = i
                else:
                    outputs[i] = item.output
    finally:
        for task in pending:
            task.cancel()


def _error_event(stream: _EngineStream, error: RequestError) -> bytes:
    return _sse(error_body(503 if stream.unavailable else 500, str(error), "server_error")) + \
        b"data: [DONE]\n\n"


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


# ---- running it ----
class Server:
    """uvicorn serving the application, the engine loop beside it; `.close()` stops both."""

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, limits: ServerLimits = ServerLimits(),
                 tools: ToolServing | None = None) -> None:
        import socket

        import uvicorn

        self.llm = llm
        self.api_key = api_key
        self.limits = limits
        spec = getattr(llm, "spec", None)
        self.metrics = ServerMetrics(llm.model_name, None if spec is None else spec.counters,
                                     llm.max_model_len)
        self.loop = EngineLoop(llm, self.metrics)
        asgi, self.app = create_app(llm, self.loop, self.metrics, limits, api_key, tools)
        protocol = type("Protocol", (GuardedH11Protocol,),
                        {"header_timeout_s": limits.header_timeout_s})
        self.config = uvicorn.Config(
            asgi, host=host, port=port, http=protocol, lifespan="off", log_level="warning",
            access_log=False, backlog=limits.backlog, limit_concurrency=limits.max_connections,
            timeout_keep_alive=int(max(1, limits.keep_alive_s)), timeout_graceful_shutdown=5)
        self.uvicorn = uvicorn.Server(self.config)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
        # on connections whose socket says TCP. With proto 0 it stayed on, and on a kept-alive
        # connection a stream's first token waited for the client's delayed ACK of the
        # headers: 42-44 ms to the first token where the server had it at 29-34, the next
        # tokens bunched behind it (a raw-socket client, `servescope serve --weights int4`).
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.socket.bind((host, port))
        except OSError:
            self.socket.close()
            raise
        self.socket.listen(limits.backlog)

    @property
    def server_address(self) -> tuple:
        return self.socket.getsockname()[:2]

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Serve until Ctrl+C, SIGTERM or close(): the engine steps on this thread and HTTP runs
        on a background one. The thread that loaded the model should be the one stepping it:
        decode steps taken on another thread than the one whose torch work came first ran
        slower. Measured by benchmarks/before_after.py over peer_vllm.py (README): served /
        in-process at batch 1 went from 0.79x (int4) and 0.96x (float32) to 1.09x and 1.05x."""
        on_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _interrupt) if on_main else None
        try:
            self.loop.run_here(when_ready=self._start_http)
        except KeyboardInterrupt:
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self._stop_http()
            self.socket.close()

    def start(self) -> Server:
        """Serve on background threads (the engine loop's and HTTP's); returns once the
        socket accepts."""
        self.loop.start()
        self._start_http()
        for _ in range(500):
            if self.uvicorn.started or not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
        return self

    def _start_http(self) -> None:
        self._thread = threading.Thread(target=self._serve_http, name="http", daemon=True)
        self._thread.start()

    def _serve_http(self) -> None:
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self.loop.stop_soon()  # HTTP has ended (close(), or it cannot serve): so does the loop

    def _stop_http(self) -> None:
        self.uvicorn.should_exit = True
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def close(self) -> None:
        """Stop accepting requests, end the engine loop and release the socket."""
        self._stop_http()
        self.loop.stop()
        self.socket.close()


def _interrupt(signum, frame) -> None:
    """SIGTERM stops `servescope serve` as Ctrl+C does (uvicorn, off the main thread, no
    longer catches it)."""
    raise KeyboardInterrupt


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          limits: ServerLimits = ServerLimits(), tools: ToolServing | None = None) -> Server:
    """Start serving in background threads; call `.close()` on the result to stop. `tools`:
    another chat template or tool-call parser (ToolServing.for_template); default: the
    model's template and the parser its tool format needs."""
    return Server(llm, host, port, api_key, limits, tools).start()
