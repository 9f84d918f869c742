"""The load generator and the record / loadtest commands against real servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from monitor.cli import main
from monitor.loadgen import LoadSpec, arrival_gaps, run_load
from storage import queries
from storage.db import open_database

TTFT_S, GAP_S = 0.03, 0.01


class OpenAIServer(ThreadingHTTPServer):
    """A tiny OpenAI-compatible streaming server: TTFT_S before the first chunk, GAP_S after."""

    daemon_threads = True

    def __init__(self, fail_every: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fail_every, self.seen, self.bodies = fail_every, 0, []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class _Handler(BaseHTTPRequestHandler):
    server: OpenAIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.seen += 1
            self.server.bodies.append(body)
            fail = self.server.fail_every and self.server.seen % self.server.fail_every == 0
        if fail:
            self.send_response(500)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"boom")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        time.sleep(TTFT_S)
        chat = self.path.endswith("/chat/completions")
        for i in range(body["max_tokens"]):
            if i:
                time.sleep(GAP_S)
            choice = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
            self._event({"choices": [choice]})
        self._event({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def _event(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def openai_server():
    server = OpenAIServer()
    yield server
    server.shutdown()
    server.server_close()


def test_closed_loop_figures_follow_the_servers_timing(openai_server):
    spec = LoadSpec(openai_server.url, concurrency=4, requests=12, input_len=8, output_len=5,
                    slo_ms={"ttft": 10_000})
    s = run_load(spec).summary
    assert (s["completed"], s["failed"]) == (12, 0)
    assert s["ttft_ms"]["p50"] >= TTFT_S * 1000
    assert GAP_S * 1000 <= s["tpot_ms"]["mean"] < GAP_S * 1000 * 3
    assert s["e2e_ms"]["p50"] >= (TTFT_S + 4 * GAP_S) * 1000
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    assert s["output_tokens_per_s"] == pytest.approx(5 * s["request_throughput"])
    body = openai_server.bodies[0]
    assert body["stream"] is True and body["max_tokens"] == 5 and len(body["prompt"].split()) == 8


def test_warm_up_requests_reach_the_server_but_not_the_figures(openai_server):
    spec = LoadSpec(openai_server.url, concurrency=2, requests=3, input_len=8, output_len=2,
                    warmups=2)
    result = run_load(spec)
    assert openai_server.seen == 5  # two warm-ups, then the three measured
    assert result.summary["completed"] == 3 and len(result.records) == 3
    with pytest.raises(ValueError, match="warm-up"):
        LoadSpec(openai_server.url, warmups=-1)


def test_open_loop_rate_chat_endpoint_failures_and_strict_slo():
    server = OpenAIServer(fail_every=3)
    try:
        spec = LoadSpec(server.url, endpoint="chat", rate=40.0, arrival="constant", requests=9,
                        output_len=3, slo_ms={"ttft": 1.0})
        result = run_load(spec)
    finally:
        server.shutdown()
        server.server_close()
    s = result.summary
    assert (s["completed"], s["failed"]) == (6, 3)
    assert s["errors"] == [f"{server.url} answered HTTP 500: boom"]  # a sentence, no type name
    assert s["goodput"] == 0.0                   # no TTFT can beat 1 ms here
    assert result.duration_s >= 8 / 40.0         # nine starts 25 ms apart
    assert len([x for r in result.records if r.ok for x in r.itl_s]) == 6 * 2


def test_unreachable_and_broken_servers_give_sentences_not_exception_names():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends
    errors = run_load(LoadSpec(url, requests=2, output_len=1)).summary["errors"]
    assert len(errors) == 1 and errors[0].startswith(f"cannot connect to {url}"), errors
    assert not re.search(r"[A-Z][a-z]+(Error|Exception)\b", errors[0])


def test_the_precision_names_are_the_planners():
    from monitor.loadgen import KV_PRECISIONS, WEIGHT_PRECISIONS
    from planner import catalog

    assert (WEIGHT_PRECISIONS, KV_PRECISIONS) == (catalog.PRECISIONS, catalog.KV_PRECISIONS)


def test_arrival_processes_keep_the_mean_rate():
    rng = np.random.default_rng(1)
    poisson = arrival_gaps(LoadSpec("http://h", rate=10.0), rng, 20_000)
    bursty = arrival_gaps(LoadSpec("http://h", rate=10.0, arrival="gamma", burstiness=0.25),
                          rng, 20_000)
    assert poisson.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)
    assert arrival_gaps(LoadSpec("http://h", rate=4.0, arrival="constant"), rng, 3).tolist() == [
        0.25, 0.25, 0.25]


def test_loadtest_command_prints_one_json_object_and_stores_the_run(openai_server, tmp_path,
                                                                    capsys):
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    code = main(["loadtest", "--url", openai_server.url, "--concurrency", "2", "--requests",
                 "4", "--output-len", "3", "--json", "--db", url])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "request_throughput",
            "output_tokens_per_s", "goodput", "completed", "failed"} <= set(out)
    assert set(out["ttft_ms"]) == {"p50", "p95", "p99", "mean"}
    db = open_database(url)
    stored = queries.run_summary(db, out["run_id"])
    db.close()
    assert stored["completed"] == 4 and stored["config"]["concurrency"] == 2
    assert stored["requests"]["ttft_ms"]["p99"] == pytest.approx(out["ttft_ms"]["p99"])


def test_without_db_the_run_goes_to_the_default_database_unless_no_db(openai_server, tmp_path,
                                                                     monkeypatch, capsys):
    monkeypatch.setenv("SERVESCOPE_DATA_DIR", str(tmp_path))  # the app's default database
    args = ["loadtest", "--url", openai_server.url, "--requests", "2", "--output-len", "2"]
    assert main(args + ["--no-db", "--json"]) == 0
    assert "run_id" not in json.loads(capsys.readouterr().out)
    assert not (tmp_path / "servescope.db").exists()
    assert main(args) == 0
    assert f"stored as run 1 in sqlite:///{tmp_path / 'servescope.db'}" in capsys.readouterr().out
    db = open_database(None)
    assert [r["name"] for r in queries.list_runs(db)] == [openai_server.url]
    db.close()


def test_a_stored_run_names_its_server_and_calibrates_the_planner(openai_server, tmp_path,
                                                                  capsys):
    """--gpu/--tp/--weights/--kv/--engine go into the run's config; the planner reads the
    stored run back as a calibration point for that GPU and precision."""
    from planner.catalog import load_catalog
    from planner.measured import calibrate_measured, from_runs

    url = f"sqlite:///{tmp_path / 'runs.db'}"
    code = main(["loadtest", "--url", openai_server.url, "--concurrency", "2", "--requests",
                 "4", "--input-len", "16", "--output-len", "4", "--model",
                 "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA L4", "--tp", "1",
                 "--weights", "bf16", "--kv", "fp8", "--engine", "test server", "--json",
                 "--db", url])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    db = open_database(url)
    runs = queries.list_runs(db, "loadtest")
    db.close()
    config = runs[0]["config"]
    assert (config["gpu"], config["tp"], config["pp"], config["weights"], config["kv"],
            config["engine"]) == ("NVIDIA L4", 1, 1, "bf16", "fp8", "test server")
    catalog = load_catalog()
    points, skipped = from_runs(runs, catalog)
    assert skipped == [] and len(points) == 1
    p = points[0]
    assert (p.model, p.gpu, p.weights, p.kv, p.tp, p.batch, p.input_len, p.output_len) == (
        "Llama-3.1-8B", "L4", "bf16", "fp8", 1, 2, 16, 4)
    assert p.throughput_tok_s == pytest.approx(out["output_tokens_per_s"])
    report = calibrate_measured([], runs, catalog)
    assert report.calibration.name == "measured (L4 bf16)" and report.calibration.points == 1


def test_server_flags_are_checked(capsys):
    code = main(["loadtest", "--url", "http://127.0.0.1:9", "--weights", "fp4"])
    err = capsys.readouterr().err
    assert code == 2 and "--weights 'fp4' is not a precision the planner knows" in err
    code = main(["loadtest", "--url", "http://127.0.0.1:9", "--tp", "0"])
    assert code == 2 and "at least 1" in capsys.readouterr().err


def test_user_errors_are_one_sentence_and_exit_2(capsys):
    assert main(["loadtest", "--url", "ftp://nowhere", "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"error": captured.err.strip()}
    assert "not an http(s) URL" in captured.err and captured.err.count("\n") == 1
    assert main(["record", "--duration", "1"]) == 2
    assert "nothing to record" in capsys.readouterr().err
    assert main(["loadtest", "--url", "http://127.0.0.1:9", "--requests", "1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"].startswith("no request to")


def test_record_command_samples_a_server_into_the_database(serve_text, tmp_path, capsys):
    text = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 7\n")
    server = serve_text(text)
    url = f"sqlite:///{tmp_path / 'rec.db'}"
    code = main(["record", "--db", url, "--server", f"vllm-a={server.url}", "--duration", "1.2",
                 "--interval", "0.2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["sources"] == {"vllm-a": "up"} and out["samples"] >= 4
    db = open_database(url)
    _, values = queries.series_window(db, "vllm-a/requests_running", 0, 2e10, "raw")
    db.close()
    assert len(values) == out["samples"] and set(values.tolist()) == {7.0}


def test_sigkilled_recorder_leaves_every_flushed_sample(serve_text, tmp_path):
    server = serve_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n")
    path = tmp_path / "killed.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "monitor.cli", "record", "--db", f"sqlite:///{path}", "--server",
         f"v={server.url}", "--interval", "0.05", "--report-flushes"],
        stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    flushed = []
    while len(flushed) < 3:
        line = proc.stderr.readline()
        assert line, "the recorder exited early"
        if line.startswith("flushed "):
            flushed.append(float(line.split()[1]))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        stamps = [r[0] for r in conn.execute("SELECT ts_ms FROM samples ORDER BY ts_ms")]
    assert stamps[-1] >= int(flushed[-1] * 1000)
    # Polls are 50 ms apart: no gap in what was stored up to the last flush.
    assert max(np.diff(stamps)) < 500


def test_record_stores_slo_alerts_from_a_prometheus_api_source(prom, tmp_path, capsys):
    from tests.monitor.conftest import vector_answer

    server = prom({"histogram_quantile(0.99, sum by (le) (rate("
                   "vllm:time_to_first_token_seconds_bucket[1m])))": vector_answer(({}, "0.25"))})
    expr = next(iter(server.answers))
    # The fleet recovers 1 s in: p99 TTFT 250 ms -> 20 ms against a 100 ms SLO.
    timer = threading.Timer(1.0, server.answers.__setitem__, (expr, vector_answer(({}, "0.02"))))
    timer.start()
    url = f"sqlite:///{tmp_path / 'alerts.db'}"
    code = main(["record", "--db", url, "--prom-url", server.url, "--slo-ttft-ms", "100",
                 "--slo-window", "0.4", "--duration", "2.5", "--interval", "0.1", "--json"])
    timer.join()
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["sources"] == {"prometheus": "up"}
    rule = "prometheus p99 TTFT (ttft)"
    assert out["alerts"] == [[rule, "firing"], [rule, "cleared"]]
    db = open_database(url)
    stored = queries.list_alerts(db)
    _, ttft = queries.series_window(db, "prometheus/ttft_s_p99", 0, 2e10, "raw")
    db.close()
    assert [(a["rule"], a["state"]) for a in stored] == [(rule, "firing"), (rule, "cleared")]
    assert stored[0]["value"] == 0.25 and stored[0]["threshold"] == 0.1
    assert stored[1]["value"] < 0.1 and stored[0]["ts_ms"] < stored[1]["ts_ms"]
    assert set(ttft.tolist()) == {0.25, 0.02}


def test_record_attaches_slo_rules_to_every_server(serve_text, tmp_path, capsys):
    server = serve_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n")
    code = main(["record", "--db", f"sqlite:///{tmp_path / 'r.db'}", "--server",
                 f"a={server.url}", "--slo-tpot-ms", "50", "--duration", "0.5", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["alerts"] == []  # no TPOT data yet
    assert main(["record", "--server", server.url, "--slo-window", "0", "--json"]) == 2


class _LyingServer:
    """Answers every request with `reply` (raw bytes after the request is read; a list of them:
    sent apart, 50 ms between, so the client reads them separately), then holds the connection
    open for `hold_s` or closes it: a stalled, truncated or garbled stream."""

    def __init__(self, reply: bytes | list[bytes], hold_s: float = 0.0) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.reply, self.hold_s = reply, hold_s
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            announced = re.search(rb"(?i)content-length: *(\d+)", head)
            length = int(announced.group(1)) if announced else 0
            while len(body) < length:
                body += conn.recv(65536)
            for i, piece in enumerate([self.reply] if isinstance(self.reply, bytes)
                                      else self.reply):
                time.sleep(0.05 if i else 0.0)
                conn.sendall(piece)
            time.sleep(self.hold_s)

    def close(self) -> None:
        self.sock.close()


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


TOKEN_EVENT = b'data: {"choices": [{"text": " tok"}]}\n\n'


def test_stream_lines_cut_between_reads_and_crlf_line_ends_are_read_whole():
    events = [b'data: {"choices": [{"text": " a"}]}\r\n\r\n',
              b'data: {"choices": [{"text": " b"}]}\r\n\r\n',
              b'data: {"choices": [{"text": " c"}], "usage": {"completion_tokens": 3, '
              b'"prompt_tokens": 5}}\r\n\r\n', b"data: [DONE]\r\n\r\n"]
    body = b"".join(events)
    cut_json, cut_line_end = 20, len(events[0]) + len(events[1]) - 1  # in a JSON, in a CRLF
    server = _LyingServer([STREAM_HEAD + _chunk(body[:cut_json]),
                           _chunk(body[cut_json:cut_line_end]),
                           _chunk(body[cut_line_end:]) + b"0\r\n\r\n"])
    try:
        run = run_load(LoadSpec(server.url, requests=1, concurrency=1, output_len=3,
                                timeout_s=5.0, server_estimates=False))
    finally:
        server.close()
    (record,) = run.records
    assert record.ok, record.error
    assert (record.output_tokens, record.prompt_tokens, len(record.itl_s)) == (3, 5, 2)


@pytest.mark.parametrize(("reply", "hold_s", "expected"), [
    # one token, then nothing: the read timeout ends it
    (STREAM_HEAD + _chunk(TOKEN_EVENT), 8.0, "did not answer within 0.5 s"),
    # the connection closes in the middle of a chunk
    (STREAM_HEAD + _chunk(TOKEN_EVENT) + b"40\r\ndata: {", 0.0, "failed: "),
    # a data line that is not JSON
    (STREAM_HEAD + _chunk(b"data: {not json\n\n"), 0.0, "sent a stream line that is not JSON"),
    # a data line that is not UTF-8
    (STREAM_HEAD + _chunk(b"data: \xff\xfe\n\n"), 0.0, "not UTF-8 text"),
    # a line of 2 MiB without an end
    (STREAM_HEAD + _chunk(b"data: " + b"x" * 2**21), 0.0, "Got more than 2097152 bytes"),
    # a body that says it is a stream and is not HTTP at all
    (b"SSH-2.0-OpenSSH_9.2\r\n", 0.0, "failed: "),
], ids=["stalls", "truncated", "not-json", "not-utf8", "endless-line", "not-http"])
def test_a_lying_server_gives_each_request_a_sentence_and_the_run_ends(reply, hold_s, expected):
    server = _LyingServer(reply, hold_s)
    try:
        started = time.monotonic()
        s = run_load(LoadSpec(server.url, requests=2, concurrency=2, output_len=4,
                              timeout_s=0.5, server_estimates=False)).summary
    finally:
        server.close()
    assert (s["completed"], s["failed"]) == (0, 2), s
    assert len(s["errors"]) == 1 and expected in s["errors"][0], s["errors"]
    assert s["errors"][0].startswith(server.url) or "cannot connect" in s["errors"][0]
    assert not re.search(r"[A-Z][a-z]+(Error|Exception)\b", s["errors"][0]), s["errors"]
    assert time.monotonic() - started < max(hold_s, 5.0)  # a stall is cut at the timeout
