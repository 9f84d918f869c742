"""PromApiSource against a small Prometheus HTTP API served on 127.0.0.1 by the test itself."""

from __future__ import annotations

import json
import socket

import pytest

from monitor.hub import Hub
from monitor.promapi import DEFAULT_QUERIES, PromApiSource, parse_result
from monitor.remote import ServerConfig
from tests.monitor.conftest import vector_answer as _vector

TTFT_P99 = DEFAULT_QUERIES["ttft_s_p99"]


def test_expressions_become_the_apps_series(prom):
    server = prom({
        TTFT_P99: _vector(({}, "0.245")),
        "sum(vllm:num_requests_running)": json.dumps(
            {"status": "success", "data": {"resultType": "scalar", "result": [1.7e9, "3"]}}),
        "vllm:gpu_cache_usage_perc": _vector(({"__name__": "vllm:gpu_cache_usage_perc",
                                               "instance": "a:8000"}, "0.5"),
                                             ({"instance": "b:8000"}, "0.25")),
        "tpot_nan": _vector(({}, "NaN")),  # histogram_quantile of an idle fleet
    })
    source = PromApiSource(ServerConfig("fleet", server.url),
                           {"ttft_s_p99": TTFT_P99,
                            "requests_running": "sum(vllm:num_requests_running)",
                            "kv_cache_usage": "vllm:gpu_cache_usage_perc",
                            "tpot_s_p99": "tpot_nan"})
    hub = Hub([source])
    assert hub.tick(100.0) == 4
    assert hub.series("fleet/ttft_s_p99")[1].tolist() == [0.245]
    assert hub.latest("fleet/requests_running") == 3.0
    assert hub.latest("fleet/kv_cache_usage[instance=a:8000]") == 0.5
    assert hub.latest("fleet/kv_cache_usage[instance=b:8000]") == 0.25
    assert "fleet/tpot_s_p99" not in hub.series_keys()
    assert source.status.state == "up" and source.status.last_error is None
    assert source.status.last_ok == 100.0
    assert server.seen[0]["query"] == [TTFT_P99] and server.seen[0]["time"] == ["100.000"]
    hub.stop()


def test_a_refused_expression_is_reported_while_the_others_keep_coming(prom):
    server = prom({"up": _vector(({}, "1"))})
    source = PromApiSource(ServerConfig("fleet", server.url), {"up": "up", "bad": "rate(("})
    poll = source.poll(10.0)
    assert [(s.series, s.value) for s in poll.samples] == [("fleet/up", 1.0)]
    assert source.status.state == "up"
    assert "parse error in 'rate(('" in source.status.last_error
    assert source.status.message == "1 series from 2 expressions, 1 failed"


@pytest.mark.parametrize("body, expected", [
    ("<html>proxy error</html>", "not JSON"),
    (json.dumps({"status": "success"}), "without data.resultType"),
    (json.dumps({"status": "success", "data": {"resultType": "vector",
                                               "result": [{"value": ["x"]}]}}), "malformed vector"),
    (json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}}),
     "'matrix' result"),
    (json.dumps([1, 2]), "no status: success"),
])
def test_a_malformed_answer_marks_the_source_down_without_raising(prom, body, expected):
    server = prom({"up": body})
    source = PromApiSource(ServerConfig("fleet", server.url, interval_s=2.0), {"up": "up"})
    assert source.poll(50.0).samples == []
    assert source.status.state == "down" and expected in source.status.last_error
    assert source.status.message == "retrying in 2 s"
    source.close()


def test_an_unreachable_url_backs_off_and_recovers(prom):
    with socket.socket() as s:  # a port nothing listens on once this socket closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = PromApiSource(ServerConfig("gone", f"http://127.0.0.1:{port}", timeout_s=2.0),
                           {"up": "up"})
    assert source.poll(0.0).samples == []
    assert source.status.state == "down"
    assert source.status.last_error.startswith(f"cannot connect to http://127.0.0.1:{port}")
    source.poll(1.5)
    assert source.failures == 2 and source.status.message == "retrying in 2 s"
    assert source.poll(2.0).samples == [] and source.failures == 2  # still backing off
    server = prom({"up": _vector(({}, "1"))})
    source.url = server.url + "/api/v1/query"  # the server came back, at a new port
    assert [s.value for s in source.poll(4.0).samples] == [1.0]
    assert source.status.state == "up" and source.failures == 0
    source.close()


def test_parse_result_drops_infinite_values():
    assert parse_result({"resultType": "vector", "result": [
        {"metric": {}, "value": [1.0, "+Inf"]}, {"metric": {"gpu": "0"}, "value": [1.0, "2"]}]}) \
        == [("[gpu=0]", 1.0, 2.0)]


def test_the_first_poll_backfills_the_window_with_query_range(prom):
    from tests.monitor.conftest import matrix_answer

    server = prom({"up": _vector(({}, "1")), "bad": _vector(({}, "1"))},
                  ranges={"up": matrix_answer(({"instance": "a"}, [(940.0, "1"), (970.0, "0")]),
                                              ({"instance": "b"}, [(970.0, "NaN")])),
                          "bad": "<html>"})
    source = PromApiSource(ServerConfig("fleet", server.url, interval_s=1.0),
                           {"up": "up", "bad": "bad"}, backfill_s=60.0)
    hub = Hub([source])
    hub.tick(1000.0)
    ts, values = hub.series("fleet/up[instance=a]")
    assert ts.tolist() == [940.0, 970.0] and values.tolist() == [1.0, 0.0]
    assert hub.series("fleet/up")[1].tolist() == [1.0]  # the instant query at 1000
    assert "fleet/up[instance=b]" not in hub.series_keys()  # NaN points dropped
    ranged = next(p for p in server.seen if "step" in p)
    assert (ranged["start"], ranged["end"], ranged["step"]) == (["940.000"], ["1000.000"], ["1"])
    assert source.status.message.endswith(
        "backfilled 2 points of the last 60 s (1 expressions failed)")
    hub.tick(1001.0)  # once only
    assert sum("step" in p for p in server.seen) == 2
    hub.stop()


def test_a_job_narrows_the_default_queries_and_a_bad_job_is_refused():
    from monitor.promapi import default_queries

    queries = default_queries("vllm-8b")
    assert queries["requests_running"] == 'sum(vllm:num_requests_running{job="vllm-8b"})'
    assert 'vllm:time_to_first_token_seconds_bucket{job="vllm-8b"}[1m]' in queries["ttft_s_p99"]
    with pytest.raises(ValueError, match="not a Prometheus job name"):
        default_queries('x"} or vector(1) #')


def test_a_server_failing_during_the_backfill_stops_it_at_once(prom):
    server = prom({"a": _vector(({}, "1")), "b": _vector(({}, "2"))})
    source = PromApiSource(ServerConfig("fleet", server.url), {"a": "a", "b": "b"},
                           backfill_s=60.0)
    poll = source.poll(1000.0)  # the instant queries answer; query_range is "400" for both
    assert sorted(s.value for s in poll.samples) == [1.0, 2.0]
    assert source.status.message.endswith("(2 expressions failed)")
    # A server error (here a 404 on the whole API) ends the backfill at its first query.
    broken = PromApiSource(ServerConfig("fleet2", server.url + "/not-prometheus"),
                           {"a": "a", "b": "b"}, backfill_s=60.0)
    seen = len(server.seen)
    assert broken.backfill(1000.0) == [] and len(server.seen) == seen + 1
    assert broken.status.message.endswith("(2 expressions failed)")
    broken.close()
    source.close()
