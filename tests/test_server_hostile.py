"""`servescope serve` under hostile and careless clients, on 127.0.0.1 with the demo model.

Raw sockets send what no well-behaved client would (bad framing, trickled heads and bodies,
invalid JSON and Unicode, out-of-range fields); every case must get an HTTP answer in 4xx (or the
documented 503), and after each one a canary request must still succeed. A long stream runs
alongside the whole corpus and must finish whole: one request can only fail itself.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from engine import LLM
from engine.server import ServerLimits, serve

LIMITS = ServerLimits(body_timeout_s=1.0, header_timeout_s=1.0, keep_alive_s=1.0)


@pytest.fixture(scope="module")
def llm(demo_gguf):
    return LLM(str(demo_gguf), device="cpu", kv_cache_tokens=4096, max_num_seqs=8,
               max_model_len=1024)


@pytest.fixture(scope="module")
def server(llm):
    srv = serve(llm, "127.0.0.1", 0, limits=LIMITS)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _raw(server, data: bytes, read_timeout: float = 30.0) -> tuple[int | None, bytes]:
    """Send bytes as they are; the status line's code (None: closed with no answer) and body."""
    host, port = server.server_address
    with socket.create_connection((host, port), timeout=read_timeout) as s:
        s.sendall(data)
        return _read_answer(s)


def _read_answer(s: socket.socket) -> tuple[int | None, bytes]:
    chunks = []
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            if _complete(b"".join(chunks)):
                break
    except (ConnectionResetError, TimeoutError):
        pass
    raw = b"".join(chunks)
    if not raw.startswith(b"HTTP/1.1 "):
        return None, raw
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _complete(raw: bytes) -> bool:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def _post(path: str, body: bytes, headers: dict | None = None) -> bytes:
    head = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(body)),
            "Connection": "close", **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


def _canary(client) -> None:
    r = client.post("/v1/completions", json={"prompt": "The capital of France is",
                                             "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


BAD_FIELDS = [
    # (body text, field the 400 must name)
    ('{"prompt": "hi \\ud800"}', "prompt"),
    ('{"messages": [{"role": "user", "content": "hi \\udfff there"}]}', "messages"),
    ('{"prompt": "hi", "seed": ' + str(2**70) + '}', "seed"),
    ('{"prompt": "hi", "top_k": 1e30}', "top_k"),
    ('{"prompt": "hi", "stop": [1]}', "stop"),
    ('{"prompt": "hi", "stop": [""]}', "stop"),
    ('{"prompt": "hi", "max_tokens": ' + str(10**12) + '}', "max_tokens"),
    ('{"prompt": "hi", "max_tokens": -5}', "max_tokens"),
    ('{"prompt": "hi", "max_tokens": "lots"}', "max_tokens"),
    ('{"prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ('{"prompt": "hi", "top_p": 0}', "top_p"),
    ('{"prompt": "hi", "n": 17}', "n"),
    ('{"prompt": "hi", "n": 2, "best_of": 3}', "best_of"),
    ('{"prompt": "hi", "logprobs": 21}', "logprobs"),
    ('{"prompt": "hi", "logit_bias": {"42": 101}}', "logit_bias"),
    ('{"prompt": "hi", "logit_bias": {"4200000": 1}}', "logit_bias"),
    ('{"prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias"),
    ('{"prompt": "hi", "presence_penalty": 2.5}', "presence_penalty"),
    ('{"prompt": "hi", "echo": 3}', "echo"),
    ('{"prompt": "hi", "suffix": "tail"}', "suffix"),
    ('{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
     "tools"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}', "tool_choice"),
    ('{"messages": [{"role": "user", "content": "hi"}], "response_format": '
     '{"type": "json_schema"}}', "response_format"),
    ('{"messages": [{"role": "user", "content": "hi"}], "response_format": '
     '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}',
     "response_format"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', "top_logprobs"),
    ('{"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy"}}', "audio"),
    ('{"messages": [{"role": "user", "content": "hi"}], "store": true}', "store"),
    ('{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}',
     "reasoning_effort"),
    ('{"prompt": [999999999]}', "prompt"),
    ('{"prompt": [-1, 2]}', "prompt"),
    ('{"prompt": []}', "prompt"),
    ('{"prompt": ""}', "prompt"),
    ('{"prompt": {"a": 1}}', "prompt"),
    ('{"prompt": ["a", "b"]}', "prompt"),
    ('{"prompt": "hi", "kv_policy": "lru", "kv_budget": 8}', "kv_policy"),
    ('{"prompt": "hi", "kv_budget": true, "kv_policy": "h2o"}', "kv_budget"),
    ('{"messages": []}', "messages"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}', "messages"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     "messages"),
    ('{"messages": [{"content": "hi"}]}', "messages"),
]


@pytest.mark.parametrize("text,field", BAD_FIELDS, ids=[t[:40] for t, _ in BAD_FIELDS])
def test_bad_fields_get_a_400_naming_them(server, client, text, field):
    path = "/v1/chat/completions" if '"messages"' in text else "/v1/completions"
    status, body = _raw(server, _post(path, text.encode()))
    assert status == 400, body
    error = json.loads(body)["error"]
    assert field in error["message"] or error["param"] == field, error
    assert error["code"] == 400
    _canary(client)


MALFORMED = [
    b"[]", b"null", b"123", b'"text"', b"{", b"{not json", b"\xff\xfe\x00garbage",
    b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"1" * 5000 + b"}",
    b'{"prompt": "a", "prompt": 5}', b"",
]


@pytest.mark.parametrize("body", MALFORMED, ids=[repr(b[:20]) for b in MALFORMED])
def test_malformed_bodies_get_an_http_answer(server, client, body):
    status, answer = _raw(server, _post("/v1/completions", body))
    assert status is not None and 400 <= status < 500, answer
    assert "error" in json.loads(answer)
    _canary(client)


def test_framing_attacks(server, client):
    # A negative length, a length over the limit (refused before reading), chunked past it.
    status, _ = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: -1\r\n\r\n{}")
    assert status == 400
    status, body = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                b"Content-Length: 10000000\r\n\r\n{")
    assert status == 413, body
    chunk = b"x" * 65536
    chunked = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(70))
    status, body = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n")
    assert status == 413, body
    status, _ = _raw(server, b"GARBAGE\r\n\r\n")
    assert status == 400
    status, _ = _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000
                     + b"\r\n\r\n")
    assert status in (400, 431)
    _canary(client)


def test_trickled_heads_and_bodies_are_cut_off(server, client):
    host, port = server.server_address
    # Slowloris: a head that never ends is closed after the head deadline (408).
    idle = [socket.create_connection((host, port)) for _ in range(20)]
    for s in idle:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    _canary(client)  # 20 stuck connections hold no one else up
    start = time.monotonic()
    statuses = []
    for s in idle:
        s.settimeout(10)
        statuses.append(_read_answer(s)[0])
        s.close()
    assert statuses == [408] * 20
    assert time.monotonic() - start < 5
    # A body that stops halfway gets 408 after the body deadline.
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        status, body = _read_answer(s)
    assert status == 408 and b"did not arrive" in body
    _canary(client)


def test_unknown_routes_and_methods(server, client):
    assert client.get("/v2/nothing").status_code == 404
    assert client.delete("/v1/completions").status_code == 405
    assert client.get("/v1/completions").status_code == 405
    assert client.get("/openapi.json").json()["paths"]["/v1/completions"]["post"]


def test_one_bad_request_never_touches_a_stream_in_flight(server, client):
    """A 300-token stream runs while the whole hostile corpus is sent: it ends whole."""
    result = {}

    def stream() -> None:
        body = {"prompt": "Tell me a long story.", "max_tokens": 300, "temperature": 0,
                "ignore_eos": True, "stream": True}
        chunks = []
        with httpx.Client(base_url=server.url, timeout=300) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        result["chunks"] = chunks

    t = threading.Thread(target=stream)
    t.start()
    for text, _ in BAD_FIELDS:
        path = "/v1/chat/completions" if '"messages"' in text else "/v1/completions"
        status, _ = _raw(server, _post(path, text.encode()))
        assert status == 400
    t.join(300)
    chunks = result["chunks"]
    assert all("error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_client_that_leaves_a_whole_reply_aborts_its_work(server, llm):
    host, port = server.server_address
    body = json.dumps({"prompt": "Count slowly:", "max_tokens": 900, "temperature": 0,
                       "ignore_eos": True}).encode()
    s = socket.create_connection((host, port))
    s.sendall(_post("/v1/completions", body, {"Connection": "keep-alive"}))
    deadline = time.time() + 30
    while not llm.has_unfinished() and time.time() < deadline:
        time.sleep(0.02)
    assert llm.has_unfinished()
    s.close()
    deadline = time.time() + 20
    while llm.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert not llm.has_unfinished()
    assert llm.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("header,status", [
    ("Bearer k3y", 200), ("bearer k3y", 200), ("BEARER  k3y", 200), ("Basic k3y", 401),
    ("Bearer wrong", 401), ("", 401), ("Bearer", 401),
])
def test_api_key_scheme_is_case_insensitive(llm, header, status):
    srv = serve(llm, "127.0.0.1", 0, api_key="k3y")
    try:
        headers = {"Authorization": header} if header else {}
        r = httpx.get(f"{srv.url}/v1/models", headers=headers, timeout=30)
        assert r.status_code == status
        # Refused before the body is read: a bad key with a bad body is still a 401.
        bad = httpx.post(f"{srv.url}/v1/completions", content=b"{", headers=headers,
                         timeout=30)
        assert bad.status_code == (400 if status == 200 else 401)
    finally:
        srv.close()


def test_the_official_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    name = client.models.list().data[0].id
    out = client.completions.create(model=name, prompt="The capital of France is",
                                    max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5 and out.choices[0].text
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
        temperature=0, stream=True) if c.choices]
    assert "".join(pieces)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt="hi", max_tokens=10**9)
    assert "max_tokens" in str(info.value)
    with pytest.raises(openai.NotFoundError) as info:  # as vLLM: another model's name is a 404
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert name in str(info.value)


def test_a_prompt_beyond_any_context_is_refused_untokenized(server, client, llm):
    text = "hello world, this is a long prompt. " * 110_000  # 3.96 MB, under the body limit
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 4})
    assert r.status_code == 400
    assert "characters" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    _canary(client)


def test_every_connection_sends_without_waiting_for_acks(server):
    """The server's connections have Nagle's algorithm off (TCP_NODELAY). With it on (the
    listening socket made with protocol 0, which asyncio does not take for TCP), a kept-alive
    stream's first token waited for the client's delayed ACK of the response headers, about
    40 ms on Linux, and the tokens after it came bunched."""
    host, port = server.server_address
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive after
        status, _ = _read_answer(s)
        assert status == 200
        sockets = [c.transport.get_extra_info("socket")
                   for c in server.uvicorn.server_state.connections]
        assert sockets
        assert all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for sock in sockets)
