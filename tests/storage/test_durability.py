"""A locked database, a full database and a SIGKILLed writer: one clear error, nothing lost."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import sqlalchemy as sa

from storage import queries
from storage.db import open_database
from storage.records import Sample
from storage.writer import Writer

T0 = 1_699_999_200.0


def _count(path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT count(*) FROM samples").fetchone()[0]


def _integrity(path) -> str:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


def test_locked_database_reports_once_and_writes_after_release(tmp_path):
    path = tmp_path / "locked.db"
    db = open_database(f"sqlite:///{path}", busy_timeout_ms=100)
    errors: list[str] = []
    w = Writer(db, interval_s=0.05, on_error=errors.append, on_recover=errors.append).start()
    w.submit([Sample("g/v", T0, 1.0)])
    assert w.flush()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    w.submit([Sample("g/v", T0 + i, float(i)) for i in range(1, 500)])
    time.sleep(0.6)  # several ticks, each failing on the lock
    assert errors == [f"The database sqlite:///{path} is locked by another program; "
                      "close it or use another --db."]
    assert w.pending == 499
    other.execute("ROLLBACK")
    other.close()
    assert w.close()
    assert w.last_error is None
    assert errors[1:] == [f"The database sqlite:///{path} accepts writes again; the samples "
                          "held meanwhile are being stored."]
    assert _count(path) == 500 and _integrity(path) == "ok"
    db.close()


def test_full_database_keeps_what_is_stored_and_what_is_pending(tmp_path):
    path = tmp_path / "full.db"
    db = open_database(f"sqlite:///{path}")
    w = Writer(db, interval_s=0.05, on_error=lambda m: None).start()
    w.submit([Sample("g/v", T0 + i, float(i)) for i in range(1000)])
    assert w.flush()
    with db.engine.connect() as conn:
        pages = conn.exec_driver_sql("PRAGMA page_count").scalar()

    def cap(dbapi_conn, _record):  # SQLite's own size cap stands in for a full disk
        dbapi_conn.execute(f"PRAGMA max_page_count={pages}")

    sa.event.listen(db.engine, "connect", cap)
    db.engine.dispose()
    w.submit([Sample("g/v", T0 + 1000 + i, float(i)) for i in range(20_000)])
    assert not w.flush(timeout=0.5)
    assert w.last_error == (f"The database sqlite:///{path} is full (disk space or size limit); "
                            "free space or point --db at another location.")
    assert w.pending == 20_000
    assert _count(path) == 1000 and _integrity(path) == "ok"
    sa.event.remove(db.engine, "connect", cap)
    db.engine.dispose()  # space is back: the held samples go in on the next tick
    assert w.close()
    assert _count(path) == 21_000
    db.close()


RECORDER = textwrap.dedent("""
    import sys, time
    from storage.db import open_database
    from storage.records import Sample
    from storage.writer import Writer
    db = open_database(sys.argv[1])
    report = lambda ts: print(repr(ts), flush=True)
    w = Writer(db, interval_s=0.2, on_flush=report).start()
    t0, i = time.time(), 0
    while True:  # 200 samples/s over 4 series until killed
        w.submit([Sample(f"sim/s{k}", t0 + i * 0.02, float(i)) for k in range(4)])
        i += 1
        time.sleep(0.005)
""")


def test_sigkilled_writer_leaves_an_intact_database_with_every_flushed_sample(tmp_path):
    path = tmp_path / "killed.db"
    proc = subprocess.Popen([sys.executable, "-c", RECORDER, f"sqlite:///{path}"],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    flushed = [float(proc.stdout.readline()) for _ in range(5)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    assert _integrity(path) == "ok"
    db = open_database(f"sqlite:///{path}")
    for k in range(4):
        ts, values = queries.series_window(db, f"sim/s{k}", 0, flushed[-1], "raw")
        # Every sample up to the last reported flush is there, none missing in between.
        assert values.tolist() == [float(i) for i in range(len(values))]
        assert abs(ts[-1] - flushed[-1]) < 0.002
    db.close()


def test_a_database_locked_to_the_end_counts_every_unwritten_sample_as_dropped(tmp_path):
    path = tmp_path / "locked.db"
    db = open_database(f"sqlite:///{path}", busy_timeout_ms=100)
    w = Writer(db, interval_s=0.05, on_error=lambda m: None).start()
    w.submit([Sample("g/v", T0 + i, float(i)) for i in range(100)])
    assert w.flush()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another program holds the database to the end
    w.submit([Sample("g/v", T0 + 100 + i, float(i)) for i in range(400)])
    assert not w.close(timeout=0.5)
    w.submit([Sample("g/v", T0 + 500, 0.0)])  # after close: nothing will write it
    other.execute("ROLLBACK")
    other.close()
    assert (w.written_samples, w.dropped, w.submitted_samples) == (100, 401, 501)
    assert "locked" in w.last_error and w.pending == 0
    assert _count(path) == 100 and _integrity(path) == "ok"
    db.close()


FULL_DISK_RECORDER = textwrap.dedent("""
    import sys
    import sqlalchemy as sa
    from monitor.cli import main

    @sa.event.listens_for(sa.engine.Engine, "connect")
    def cap(dbapi_conn, _record):  # the disk fills up a few pages past the migrated schema
        dbapi_conn.execute("PRAGMA max_page_count=" + sys.argv[1])

    sys.exit(main(["record", *sys.argv[2:]]))
""")


def test_record_on_a_full_disk_reports_every_dropped_sample_and_keeps_the_stored(tmp_path):
    from tests.monitor.hostile import HostileServer

    path = tmp_path / "full.db"
    open_database(f"sqlite:///{path}").close()  # migrated, so only samples fill what is left
    with sqlite3.connect(path) as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    server = HostileServer()
    try:
        # The same `record` a user runs, its database capped (SQLite's max_page_count stands in
        # for a full disk: no root mount of a tiny filesystem needed, and the error is the same
        # SQLITE_FULL).
        servers = [f"--server=g{i}={server.url_for('good')}" for i in range(6)]
        proc = subprocess.run(
            [sys.executable, "-c", FULL_DISK_RECORDER, str(pages + 2), "--db",
             f"sqlite:///{path}", *servers, "--interval", "0.05", "--duration", "2", "--json"],
            capture_output=True, text=True, timeout=60, env=os.environ.copy())
    finally:
        server.close()
    summary = json.loads(proc.stdout)
    assert proc.returncode == 1
    assert "is full (disk space or size limit)" in proc.stderr  # said live, once
    assert summary["dropped"] > 0 and "could not be stored" in summary["error"]
    assert summary["samples"] + summary["dropped"] == summary["submitted"]
    assert _count(path) == summary["samples"] > 0 and _integrity(path) == "ok"


def test_sigkilled_record_under_load_loses_at_most_1_5_s_and_stays_intact(tmp_path):
    from tests.monitor.hostile import HostileServer, start_record

    path = tmp_path / "killed.db"
    server = HostileServer()
    args = ["--db", f"sqlite:///{path}", "--interval", "0.05", "--timeout", "1",
            "--report-flushes"]
    for i in range(6):  # six vLLM servers scraped 20 times a second, and two hostile ones
        args += ["--server", f"g{i}={server.url_for('good')}"]
    args += ["--server", f"slow={server.url_for('slow')}", "--server",
             f"hang={server.url_for('hang')}"]
    proc = start_record(args)
    flushes = threading.Semaphore(0)

    def drain() -> None:  # keep the pipe empty; count the writer's flushes
        for line in proc.stderr:
            if line.startswith("flushed "):
                flushes.release()

    threading.Thread(target=drain, daemon=True).start()
    try:
        for _ in range(4):
            assert flushes.acquire(timeout=30), "the recorder never flushed"
        time.sleep(0.95)  # just before the flush after next: the most a kill can cost
        killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
    finally:
        server.close()
    assert _integrity(path) == "ok"
    with sqlite3.connect(path) as conn:
        last = conn.execute("SELECT max(ts_ms) FROM samples").fetchone()[0] / 1000
        stamps = [r[0] for r in conn.execute(
            "SELECT DISTINCT s.ts_ms FROM samples s JOIN series x ON x.id = s.series_id "
            "WHERE x.key = 'g0/requests_running' ORDER BY s.ts_ms")]
    lost_s = killed_at - last
    print(f"SIGKILL lost the last {lost_s:.2f} s of samples")
    assert lost_s <= 1.5
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert max(gaps) < 500  # no hole in what was stored


def test_programs_opening_one_new_database_at_once_all_open_it(tmp_path):
    """The app and `servescope record` started together on a fresh file: each process opens
    (creating the schema once), none fails on "table already exists" or "locked", and the
    schema ends at the newest revision. Three programs, warmed up on a file of their own,
    open 30 fresh files together, each at one instant, so that their first statements meet:
    two connections turning a new file to WAL at once make SQLite answer "locked" at once,
    without waiting out the busy timeout, in about one round in seven."""
    rounds = 30
    script = textwrap.dedent("""
        import sys, time
        from storage.db import open_database
        folder, start, rounds, own = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        open_database(f"sqlite:///{folder}/{own}.db").close()
        for round_ in range(rounds):
            at = start + 0.25 * round_
            # Sleep, then spin the last 20 ms: a sleep alone wakes the programs too far apart
            # for their first statements to meet.
            time.sleep(max(0.0, at - 0.02 - time.time()))
            while time.time() < at:
                pass
            open_database(f"sqlite:///{folder}/fresh{round_}.db").close()
    """)
    start = str(time.time() + 4.0)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), start, str(rounds),
                               f"own{i}"], stderr=subprocess.PIPE, text=True) for i in range(3)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    for round_ in range(rounds):
        with sqlite3.connect(tmp_path / f"fresh{round_}.db") as conn:
            assert conn.execute("select version_num from alembic_version").fetchall() == [
                (_head(),)]


def _head() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from storage.db import MIGRATIONS_DIR

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return ScriptDirectory.from_config(cfg).get_current_head()
