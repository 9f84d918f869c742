"""Stored diagnosis verdicts: the migration matches the model, one row per episode, newest first."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from storage import queries
from storage.models import Base
from storage.records import Sample
from storage.writer import Writer

T0 = 1_700_000_000.0


def verdict(rule: str, start: float, end: float, title: str = "t", source: str = "vllm",
            gpu: str = "") -> dict:
    return {"rule": rule, "kind": "p99 spike", "source": source, "gpu": gpu, "title": title,
            "advice": "try this", "start": start, "end": end,
            "evidence": [{"series": f"{source}/kv_cache_usage", "stat": "max", "value": 1.0,
                          "start": start, "end": end, "threshold": "KV_FULL", "limit": 0.9,
                          "over": None, "summary": {"n": 3, "max": 1.0}}]}


def test_the_migrated_verdicts_table_is_the_models(any_db):
    with any_db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        version = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
    assert [d for d in diff if "verdicts" in repr(d)] == []
    assert version == "0005"


def test_a_continuing_verdict_extends_its_episode_and_a_later_one_starts_another(any_db):
    first = queries.save_verdicts(any_db, [verdict("kv_pressure", T0, T0 + 60, "17 preemptions")],
                                  evaluated_s=T0 + 60)
    # Evaluated again 30 s later over an overlapping window: the same episode, updated.
    again = queries.save_verdicts(any_db, [verdict("kv_pressure", T0 + 30, T0 + 90,
                                                   "19 preemptions")], evaluated_s=T0 + 90)
    assert again == first
    # Another rule, and another GPU, are rows of their own; so is a later, separate episode.
    queries.save_verdicts(any_db, [verdict("queue_growth", T0, T0 + 60),
                                   verdict("memory_bound", T0, T0 + 60, source="gpu", gpu="1")])
    later = queries.save_verdicts(any_db, [verdict("kv_pressure", T0 + 600, T0 + 660)])
    assert later != first
    rows = queries.list_verdicts(any_db)
    assert [r["rule"] for r in rows][0] == "kv_pressure" and rows[0]["start"] == T0 + 600
    kv = [r for r in rows if r["rule"] == "kv_pressure"]
    assert [(r["start"], r["end"]) for r in kv] == [(T0 + 600, T0 + 660), (T0, T0 + 90)]
    assert kv[1]["title"] == "19 preemptions" and kv[1]["evaluated"] == T0 + 90
    assert kv[1]["evidence"][0]["threshold"] == "KV_FULL"
    assert [r["gpu"] for r in queries.list_verdicts(any_db, source="gpu")] == ["1"]


def test_samples_span_covers_every_series_or_one_source(any_db):
    assert queries.samples_span(any_db) is None
    w = Writer(any_db).start()
    w.submit([Sample("a/x", T0, 1.0), Sample("a/x", T0 + 5, 2.0), Sample("b/y", T0 + 9, 3.0)])
    assert w.close()
    assert queries.samples_span(any_db) == (T0, T0 + 9)
    assert queries.samples_span(any_db, "a") == (T0, T0 + 5)
    assert queries.samples_span(any_db, "nobody") is None
