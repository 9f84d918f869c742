"""`servescope serve`: the embedded engine behind an OpenAI-compatible HTTP API with /metrics."""

from __future__ import annotations

import hmac
import json
import queue
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from engine.kv_options import parse_kv_budget
from engine.sequence import RequestError, SamplingParams, StreamDelta
from engine.serve_loop import EngineLoop
from engine.serve_metrics import ServerMetrics

MAX_BODY_BYTES = 4 << 20
REPLY_TIMEOUT_S = 600


class ApiError(Exception):
    """An error the client caused, sent back as OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class Server(ThreadingHTTPServer):
    """The HTTP server: one handler thread per connection, one engine loop for all of them."""

    daemon_threads = True

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None) -> None:
        super().__init__((host, port), Handler)
        self.llm = llm
        self.api_key = api_key
        spec = getattr(llm, "spec", None)
        self.metrics = ServerMetrics(llm.model_name, None if spec is None else spec.counters)
        self.loop = EngineLoop(llm, self.metrics).start()

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up mid-stream is normal for a server; anything else is logged."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        """Stop accepting requests, end the engine loop and release the socket."""
        self.shutdown()
        self.loop.stop()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    """Routes /v1/models, /v1/completions, /v1/chat/completions, /health and /metrics."""

    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base signature
        pass  # access logs would drown the progress on stderr

    def do_GET(self) -> None:
        self._dispatch({"/health": self._health, "/metrics": self._metrics,
                        "/v1/models": self._models})

    def do_POST(self) -> None:
        self._dispatch({"/v1/completions": self._completions,
                        "/v1/chat/completions": self._chat})

    def _dispatch(self, routes: dict) -> None:
        route = routes.get(self.path.split("?", 1)[0])
        try:
            if route is None:
                raise ApiError(404, f"No route {self.command} {self.path}: see /v1/models, "
                                    "/v1/completions, /v1/chat/completions, /health, /metrics.",
                               "not_found_error")
            if route not in (self._health, self._metrics):
                self._authorize()
            route()
        except ApiError as exc:
            self._send_json(exc.status, {"error": {"message": str(exc), "type": exc.kind,
                                                   "code": exc.status}})

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                           "authentication_error")

    # ---- simple routes ----
    def _health(self) -> None:
        self._send(200, b"", "text/plain")

    def _metrics(self) -> None:
        self._send(200, self.server.metrics.exposition(), "text/plain; version=0.0.4")

    def _models(self) -> None:
        name = self.server.llm.model_name
        self._send_json(200, {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "servescope",
             "max_model_len": self.server.llm.max_model_len}]})

    # ---- generation ----
    def _completions(self) -> None:
        body = self._body()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or _is_token_list(prompt)):
            raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list "
                                "holding one string.")
        self._generate(body, prompt, chat=False)

    def _chat(self) -> None:
        body = self._body()
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects.")
        messages = [{"role": m["role"], "content": _content_text(m.get("content"))}
                    for m in messages]
        try:
            prompt = self.server.llm.chat_prompt(messages)
        except Exception as exc:  # a template error names the problem, not a traceback
            raise ApiError(400, f"The chat template failed on these messages: {exc}") from exc
        llm = self.server.llm
        # As vLLM: without max_tokens a chat reply may use the rest of the context.
        room = min(llm.max_model_len, llm.kv_cache_tokens) - len(prompt)
        self._generate(body, prompt, chat=True, default_max_tokens=max(1, room))

    def _generate(self, body: dict, prompt, chat: bool, default_max_tokens: int = 16) -> None:
        params = _sampling(body, default_max_tokens)
        sub = self.server.loop.submit(prompt, params)
        reply = _Reply(body.get("model") or self.server.llm.model_name, chat)
        first = self._next(sub)
        if isinstance(first, RequestError):
            raise ApiError(400, str(first))
        if body.get("stream"):
            self._stream(sub, first, reply, bool((body.get("stream_options") or {})
                                                 .get("include_usage")))
        else:
            self._send_json(200, reply.whole(self._collect(sub, first)))

    def _next(self, sub) -> StreamDelta | RequestError:
        try:
            return sub.replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            self.server.loop.abort(sub.request_id)
            return RequestError("The engine did not answer in time: retry later.")

    def _collect(self, sub, first) -> list[StreamDelta]:
        deltas = [first]
        while deltas[-1].output is None:
            item = self._next(sub)
            if isinstance(item, RequestError):
                raise ApiError(503, str(item), "server_error")
            deltas.append(item)
        return deltas

    def _stream(self, sub, delta, reply: _Reply, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for chunk in reply.opening():
                self._event(chunk)
            while True:
                if isinstance(delta, RequestError):
                    self._event({"error": {"message": str(delta), "type": "server_error"}})
                    break
                self._event(reply.chunk(delta))
                if delta.output is not None:
                    if include_usage:
                        self._event(reply.usage_chunk(delta.output))
                    break
                delta = self._next(sub)
            self._write_chunk(b"data: [DONE]\n\n")
            self._write_chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.server.loop.abort(sub.request_id)  # the client left: free its KV blocks

    # ---- wire helpers ----
    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ApiError(413, f"The request body is over {MAX_BODY_BYTES} bytes.")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"The request body is not valid JSON ({exc}).") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        return body

    def _event(self, payload: dict) -> None:
        self._write_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send_json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Reply:
    """OpenAI response objects for one request (completion or chat, whole or chunked)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def opening(self) -> list[dict]:
        if not self.chat:
            return []
        return [self._envelope("chat.completion.chunk", [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]

    def chunk(self, delta: StreamDelta) -> dict:
        if self.chat:
            return self._envelope("chat.completion.chunk", [
                {"index": 0, "delta": {"content": delta.text}, "finish_reason":
                 delta.finish_reason}])
        return self._envelope("text_completion", [
            {"index": 0, "text": delta.text, "logprobs": None,
             "finish_reason": delta.finish_reason}])

    def usage_chunk(self, output) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, []) | {"usage": _usage(output)}

    def whole(self, deltas: list[StreamDelta]) -> dict:
        output = deltas[-1].output
        text = "".join(d.text for d in deltas)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": output.finish_reason}
            return self._envelope("chat.completion", [choice]) | {"usage": _usage(output)}
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": output.finish_reason}
        return self._envelope("text_completion", [choice]) | {"usage": _usage(output)}


def _usage(output) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def _content_text(content) -> str:
    """Message content as text: a string, or OpenAI's list of {type: text, text} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if content is None:
        return ""
    raise ApiError(400, "Message 'content' must be a string or a list of text parts.")


def _sampling(body: dict, default_max_tokens: int) -> SamplingParams:
    """SamplingParams from OpenAI's fields (plus vLLM's top_k and ignore_eos)."""
    if body.get("n", 1) != 1:
        raise ApiError(400, "Only n=1 is supported: send one request per completion.")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    stop = body.get("stop") or ()
    try:
        return SamplingParams(
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            top_k=max(0, int(body.get("top_k", 0) or 0)),
            max_tokens=int(max_tokens),
            seed=None if body.get("seed") is None else int(body["seed"]),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            ignore_eos=bool(body.get("ignore_eos", False)),
            **_kv_fields(body),
        )
    except (RequestError, TypeError, ValueError) as exc:
        raise ApiError(400, f"Bad sampling parameters: {exc}") from exc


def _kv_fields(body: dict) -> dict:
    """servescope's extra fields (as vLLM takes extra sampling params in the body): the KV
    eviction policy and budget of this request; the engine checks the values on admission."""
    policy = body.get("kv_policy")
    if policy is not None and not isinstance(policy, str):
        raise ApiError(400, "'kv_policy' must be a string: none, streaming, h2o, scissorhands "
                            "or snapkv.")
    try:
        budget = parse_kv_budget(body.get("kv_budget"))
    except RequestError as exc:
        raise ApiError(400, str(exc)) from exc
    return {"kv_policy": policy, "kv_budget": budget}


def serve(llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> Server:
    """Start serving in background threads; call `.close()` on the result to stop."""
    import threading

    server = Server(llm, host, port, api_key)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
