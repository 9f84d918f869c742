"""Schema, migrations, the batched writer, rollups, retention and queries on real databases."""

from __future__ import annotations

import time

import numpy as np
import pytest
import sqlalchemy as sa

from storage import queries
from storage.db import StorageError, default_url, open_database
from storage.records import RequestRecord, Sample
from storage.rollup import RetentionPolicy, apply_retention, roll_up
from storage.writer import Writer

T0 = 1_699_999_200.0  # a fixed minute boundary (divisible by 3600) keeps rollup buckets known


def test_default_database_lives_in_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVESCOPE_DATA_DIR", str(tmp_path / "data"))
    assert default_url() == f"sqlite:///{tmp_path / 'data' / 'servescope.db'}"
    db = open_database()
    assert (tmp_path / "data" / "servescope.db").exists()
    db.close()


def test_sqlite_is_wal_with_busy_timeout_and_samples_without_rowid(sqlite_db):
    with sqlite_db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
        ddl = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE name='samples'").scalar()
        version = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    assert "WITHOUT ROWID" in ddl and "PRIMARY KEY (series_id, ts_ms)" in ddl
    assert version == "0005"  # the newest migration (0005_source_canary_decode)


def test_migrations_run_once_and_reopen_keeps_data(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    db = open_database(url)
    Writer(db).start().close()
    w = Writer(db).start()
    w.submit([Sample("gpu0/power_w", T0, 250.0)])
    assert w.close()
    db.close()
    again = open_database(url)
    assert queries.series_window(again, "gpu0/power_w", T0 - 1, T0 + 1)[1].tolist() == [250.0]
    again.close()


def test_bad_url_is_one_clear_error():
    with pytest.raises(StorageError, match="not a database URL"):
        open_database("no-such-scheme-at-all")


def test_writer_stores_samples_and_requests(any_db):
    w = Writer(any_db).start()
    w.submit([Sample("gpu0/power_w", T0 + i, 100.0 + i) for i in range(10)]
             + [Sample("vllm-a/ttft_p99_s", T0, 0.25)],
             [RequestRecord("vllm-a", T0 + 1, ttft_s=0.1, tpot_s=0.02, e2e_s=1.1,
                            itl_s=[0.02, 0.03], prompt_tokens=12, output_tokens=3)])
    assert w.close()
    ts, values = queries.series_window(any_db, "gpu0/power_w", T0 + 2, T0 + 5)
    assert ts.tolist() == [T0 + 2, T0 + 3, T0 + 4, T0 + 5]
    assert values.tolist() == [102.0, 103.0, 104.0, 105.0]
    assert queries.list_series(any_db) == ["gpu0/power_w", "vllm-a/ttft_p99_s"]
    assert queries.list_series(any_db, source="vllm-a") == ["vllm-a/ttft_p99_s"]
    summary = queries.request_percentiles(any_db, T0, T0 + 2, source="vllm-a")
    assert summary["ttft_ms"]["p99"] == pytest.approx(100.0)
    assert summary["itl_ms"]["count"] == 2 and summary["itl_ms"]["mean"] == pytest.approx(25.0)


def test_writer_batches_each_tick_into_one_executemany(sqlite_db):
    statements: list[tuple[str, int]] = []

    def spy(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("INSERT INTO samples"):
            statements.append((statement, len(parameters) if executemany else 1))

    sa.event.listen(sqlite_db.engine, "before_cursor_execute", spy)
    w = Writer(sqlite_db, interval_s=0.5).start()
    time.sleep(0.05)
    for chunk in range(10):  # ten submissions well inside one 0.5 s tick
        w.submit([Sample("gpu0/util", T0 + chunk * 100 + i, float(i)) for i in range(100)])
    assert w.close()
    assert [n for _, n in statements] == [1000]
    assert w.written_samples == 1000


def test_duplicate_timestamps_keep_the_first_value(any_db):
    w = Writer(any_db).start()
    w.submit([Sample("a/x", T0, 1.0), Sample("a/x", T0, 2.0)])
    assert w.close()
    assert queries.series_window(any_db, "a/x", T0, T0)[1].tolist() == [1.0]


def test_minute_and_hour_rollups_hold_count_mean_min_max(any_db):
    w = Writer(any_db).start()
    # Two minutes of 1 Hz samples: values 0..59 in the first minute, 100..159 in the second.
    w.submit([Sample("g/v", T0 + i, float(i)) for i in range(60)]
             + [Sample("g/v", T0 + 60 + i, 100.0 + i) for i in range(60)])
    assert w.close()
    roll_up(any_db, int(T0 * 1000), int((T0 + 120) * 1000))
    ts, means = queries.series_window(any_db, "g/v", T0, T0 + 119, resolution="1m")
    assert ts.tolist() == [T0, T0 + 60]
    assert means.tolist() == [29.5, 129.5]
    ts, means = queries.series_window(any_db, "g/v", T0, T0 + 119, resolution="1h")
    assert ts.tolist() == [T0] and means.tolist() == [79.5]
    with any_db.engine.connect() as conn:
        row = conn.exec_driver_sql("SELECT count, total, min, max FROM samples_1h").one()
    assert tuple(row) == (120, 9540.0, 0.0, 159.0)
    # A late sample in the first minute is counted when its bucket is rolled up again.
    w = Writer(any_db).start()
    w.submit([Sample("g/v", T0 + 0.5, 59.5)])
    assert w.close()
    roll_up(any_db, int(T0 * 1000), int(T0 * 1000) + 1)
    assert queries.series_window(any_db, "g/v", T0, T0, resolution="1m")[1].tolist() == [
        pytest.approx((sum(range(60)) + 59.5) / 61)]


def test_auto_resolution_follows_the_window_length():
    assert queries.pick_resolution(60) == "raw"
    assert queries.pick_resolution(86_400) == "1m"
    assert queries.pick_resolution(7 * 86_400) == "1h"


def test_retention_drops_only_what_is_older_than_the_policy(any_db):
    w = Writer(any_db).start()
    w.submit([Sample("g/v", T0, 1.0), Sample("g/v", T0 + 2 * 86_400, 2.0)],
             [RequestRecord("g", T0, ttft_s=0.1), RequestRecord("g", T0 + 2 * 86_400, ttft_s=0.2)])
    assert w.close()
    apply_retention(any_db, RetentionPolicy(raw_days=1, request_days=1),
                    now_ms=int((T0 + 2 * 86_400 + 60) * 1000))
    assert queries.series_window(any_db, "g/v", T0 - 1, T0 + 3 * 86_400, "raw")[1].tolist() == [2.0]
    assert queries.request_percentiles(any_db, T0 - 1, T0 + 3 * 86_400)["completed"] == 1
    with pytest.raises(ValueError):
        RetentionPolicy(raw_days=0)


def test_run_summary_recomputes_percentiles_from_its_requests(any_db):
    run_id = queries.save_run(any_db, "loadtest", "smoke", {"rate": 2.0}, {}, T0)
    records = [RequestRecord("load", T0 + i, ttft_s=0.01 * (i + 1), tpot_s=0.002, e2e_s=0.5,
                             output_tokens=8, run_id=run_id) for i in range(100)]
    records.append(RequestRecord("load", T0 + 100, ok=False, error="HTTP 500", run_id=run_id))
    w = Writer(any_db).start()
    w.submit(requests=records)
    assert w.close()
    queries.finish_run(any_db, run_id, {"completed": 100}, T0 + 101)
    out = queries.run_summary(any_db, run_id)
    expected = np.percentile([10.0 * (i + 1) for i in range(100)], [50, 95, 99])
    got = [out["requests"]["ttft_ms"][k] for k in ("p50", "p95", "p99")]
    assert got == pytest.approx(expected.tolist())
    assert (out["completed"], out["failed"]) == (100, 1)
    assert out["config"] == {"rate": 2.0} and out["finished_ms"] == int((T0 + 101) * 1000)
    assert [r["id"] for r in queries.list_runs(any_db, kind="loadtest")] == [run_id]
    with pytest.raises(KeyError):
        queries.run_summary(any_db, run_id + 1)


def test_saved_plans_round_trip(any_db):
    plan_id = queries.save_plan(any_db, "h100 tp2", {"gpu": "H100", "tp": 2})
    with any_db.engine.connect() as conn:
        stored = conn.exec_driver_sql(f"SELECT name FROM saved_plans WHERE id={plan_id}").scalar()
    assert stored == "h100 tp2"
