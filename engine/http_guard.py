"""What stands between the network and the API: body limits, deadlines and the API key.

`BodyGuard` is ASGI middleware. It reads the whole request body itself, capped in bytes
whatever the framing (Content-Length or chunked) and in time (a client that trickles its body
gets 408), and hands the application the buffered body, so nothing downstream ever reads an
unbounded or endless body. It checks the API key before the body is read.

`GuardedH11Protocol` is uvicorn's h11 protocol with a deadline on the request head: uvicorn
times out idle keep-alive connections but not one that sends its headers a byte at a time
(slowloris), which would hold a connection slot for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.api_reply import error_body


class BodyGuard:
    """ASGI middleware: the API key on /v1/ routes, then a bounded, buffered request body."""

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float,
                 api_key: str | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"].startswith("/v1/") and \
                not self._authorized(scope):
            await _answer(send, 401, "Missing or wrong API key: send 'Authorization: Bearer "
                          "<key>'.", "authentication_error")
            return
        declared = _content_length(scope)
        try:
            if declared is not None and declared > self.max_body_bytes:
                raise _BodyTooLarge
            body = await self._read_body(receive)
        except _BodyTooLarge:
            # Read on (and drop) what the client is still sending, within bounds, so that it
            # gets to read the 413 instead of a connection reset mid-upload.
            await self._discard(receive)
            await _answer(send, 413, f"The request body is over the {self.max_body_bytes}-byte "
                          "limit: send a smaller prompt.", "invalid_request_error")
            return
        except TimeoutError:
            await _answer(send, 408, f"The request body did not arrive within "
                          f"{self.body_timeout_s:g} s: send it at once.", "invalid_request_error")
            return
        except _Disconnected:
            return
        await self.app(_as_json(scope), _replay(body, receive), send)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1").strip()
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer":  # RFC 7235: the scheme is case-insensitive
            return False
        return hmac.compare_digest(given.strip().encode("latin-1"),
                                   self.api_key.encode("utf-8"))

    async def _read_body(self, receive) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks, size = [], 0
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), remaining)
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


    async def _discard(self, receive) -> None:
        """Drop the rest of an oversized body: at most 16 times the limit, within the body
        deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        budget = 16 * self.max_body_bytes
        with contextlib.suppress(TimeoutError):
            while budget > 0 and (remaining := deadline - loop.time()) > 0:
                message = await asyncio.wait_for(receive(), remaining)
                budget -= len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body"):
                    return


class _BodyTooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


def _as_json(scope):
    """Every body this API takes is JSON: read it as JSON whatever Content-Type says (clients
    such as curl -d send form encoding), so a bad body is judged by its content."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return dict(scope, headers=[*headers, (b"content-type", b"application/json")])


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP layer has already refused a malformed one
    return None


def _replay(body: bytes, receive):
    """The buffered body as one message, then the client's own messages (a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _answer(send, status: int, message: str, kind: str) -> None:
    data = json.dumps(error_body(status, message, kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within
    `header_timeout_s` of its first byte (or of the connection opening). An idle keep-alive
    connection is left to uvicorn's keep-alive timeout: closing it here too would race a client
    reusing it (a reset, a lost request)."""

    header_timeout_s = 10.0
    _head_deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self._head_deadline is None:
            self._arm_head_deadline()  # the first byte of a new request head
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:
            self._cancel_head_deadline()  # a new request's head has arrived

    def connection_lost(self, exc) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered: its own deadlines apply
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n"
                             b"connection: close\r\n\r\n")
        self.transport.close()
