"""`servescope record` against hostile sources, run as a user runs it: the healthy server beside
them keeps its scrapes, and each hostile one is reported down with its reason, live and at the
end."""

from __future__ import annotations

import json
import sqlite3

import pytest

from tests.monitor.hostile import HOSTILE_REASONS, HostileServer, start_record

DURATION_S, INTERVAL_S = 4.0, 0.2


@pytest.fixture
def hostile():
    server = HostileServer()
    yield server
    server.close()


def _closed_port_url(serve_text) -> str:
    gone = serve_text()
    url = gone.url
    gone.close()
    return url


def test_hostile_sources_never_delay_a_healthy_one_and_each_says_why(hostile, serve_text,
                                                                     tmp_path):
    path = tmp_path / "rec.db"
    refused = _closed_port_url(serve_text)
    servers = ["good", *HOSTILE_REASONS]
    args = ["--db", f"sqlite:///{path}", "--duration", str(DURATION_S), "--interval",
            str(INTERVAL_S), "--timeout", "1", "--json", "--server", f"refused={refused}"]
    for name in servers:
        args += ["--server", f"{name}={hostile.url_for(name)}"]
    proc = start_record(args)
    out, err = proc.communicate(timeout=60)
    summary = json.loads(out)

    with sqlite3.connect(path) as conn:
        stamps = [r[0] / 1000 for r in conn.execute(
            "SELECT DISTINCT s.ts_ms FROM samples s JOIN series x ON x.id = s.series_id "
            "WHERE x.key = 'good/requests_running' ORDER BY s.ts_ms")]
    # The slots of the run's first DURATION_S seconds, counted from the first scrape.
    due = round(DURATION_S / INTERVAL_S)
    stored = sum(1 for t in stamps if t < stamps[0] + DURATION_S - INTERVAL_S / 2)
    gap = max(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    print(f"healthy source: {stored} of {due} scrapes stored ({stored / due:.0%}), "
          f"longest gap {gap:.2f} s")
    assert stored / due >= 0.95, err
    assert gap < 0.9, err  # no scrape of it ever waited out a hostile source's 1 s timeout
    assert summary["scrapes"]["good"]["failed"] == 0 and summary["sources"]["good"] == "up"
    assert proc.returncode == 0 and "error" not in summary  # something was stored, none lost

    reasons = {**HOSTILE_REASONS, "refused": "Connection refused"}
    for name, why in reasons.items():
        live = [line for line in err.splitlines() if line.startswith(f"{name} is down: ")]
        assert live and why in live[0], f"{name}: {err}"             # live, on stderr
        assert summary["sources"][name] == "down"
        assert why in summary["reasons"][name]                        # and in the summary
    assert "good is up: " in err and "good" not in summary["reasons"]
    assert summary["scrapes"]["nan"]["non_finite"] >= 3
    assert hostile.hits["big"] >= 1 and hostile.hits["hang"] >= 1


def test_record_against_a_dead_server_exits_1_with_one_sentence(serve_text, tmp_path):
    url = _closed_port_url(serve_text)
    proc = start_record(["--db", f"sqlite:///{tmp_path / 'dead.db'}", "--server",
                         f"v={url}", "--duration", "0.5"])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("Nothing was recorded: every source was down (v: cannot connect to")
    assert "recorded 0 samples" in err  # the figures stay, but no longer pass for success
