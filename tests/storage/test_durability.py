"""A locked database, a full database and a SIGKILLed writer: one clear error, nothing lost."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
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
    w = Writer(db, interval_s=0.05, on_error=errors.append).start()
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
