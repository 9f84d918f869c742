"""A source's detected kind and version reach its stored row, created or already there."""

from __future__ import annotations

from storage import queries
from storage.records import Sample
from storage.writer import Writer

T0 = 1_699_999_200.0


def test_a_described_source_keeps_its_kind_version_and_url(any_db):
    w = Writer(any_db).start()
    w.submit([Sample("vllm-a/requests_running", T0, 1.0)])
    assert w.flush()
    assert queries.list_sources(any_db)[0]["kind"] == "unknown"  # what a first sample knows
    w.describe_source("vllm-a", "vllm", "0.32.0", "http://127.0.0.1:8000")
    w.describe_source("later", "sglang")  # no samples yet: the row is created
    assert w.close()
    rows = {r["name"]: r for r in queries.list_sources(any_db)}
    assert (rows["vllm-a"]["kind"], rows["vllm-a"]["version"], rows["vllm-a"]["url"]) == (
        "vllm", "0.32.0", "http://127.0.0.1:8000")
    assert (rows["later"]["kind"], rows["later"]["version"]) == ("sglang", None)


def test_a_none_field_leaves_what_is_stored(sqlite_db):
    w = Writer(sqlite_db).start()
    w.describe_source("s", "vllm", "0.32.0", "http://h:1")
    assert w.flush()
    w.describe_source("s", "vllm", None, None)
    assert w.close()
    row = queries.list_sources(sqlite_db)[0]
    assert (row["version"], row["url"]) == ("0.32.0", "http://h:1")


def test_acceptance_by_position_counts_every_draft_across_a_restart(sqlite_db):
    """From a server's counters: its first reading (drafts before recording began) plus every
    rise, a fall being a restart whose new count adds whole; vLLM's definition, accepted at
    position i over drafts."""
    w = Writer(sqlite_db).start()
    drafts = (5.0, 9.0, 2.0, 4.0)  # restarted after the second reading
    at0, at1 = (3.0, 6.0, 1.0, 3.0), (1.0, 2.0, 0.0, 1.0)
    w.submit([Sample("srv/spec_drafts_total", T0 + i, v) for i, v in enumerate(drafts)]
             + [Sample("srv/spec_accepted_tokens_at_total[position=0]", T0 + i, v)
                for i, v in enumerate(at0)]
             + [Sample("srv/spec_accepted_tokens_at_total[position=1]", T0 + i, v)
                for i, v in enumerate(at1)])
    assert w.close()
    assert queries.acceptance_by_position(sqlite_db, "srv") == [9 / 13, 3 / 13]
    assert queries.sources_with_acceptance(sqlite_db) == ["srv"]
    assert queries.acceptance_by_position(sqlite_db, "nobody") == []
