"""Writer throughput: samples/s into SQLite through the batched writer vs one INSERT per sample."""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import sys
import tempfile
import time

from storage.db import open_database
from storage.records import Sample
from storage.writer import Writer

N_SERIES, N_PER_SERIES = 40, 5_000


def batched(path: str) -> float:
    db = open_database(f"sqlite:///{path}")
    writer = Writer(db).start()
    samples = [Sample(f"bench/s{k}", 1e9 + i * 0.1, float(i))
               for i in range(N_PER_SERIES) for k in range(N_SERIES)]
    t0 = time.perf_counter()
    for i in range(0, len(samples), 400):  # 40 series at 10 Hz arrive as 400-sample ticks
        writer.submit(samples[i:i + 400])
    assert writer.close(timeout=120), writer.last_error
    elapsed = time.perf_counter() - t0
    db.close()
    return len(samples) / elapsed


def naive(path: str, n: int = 20_000) -> float:
    # The baseline: a commit per sample, what a simple recorder without a writer thread does.
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE s (series_id INT, ts_ms INT, value REAL, "
                 "PRIMARY KEY (series_id, ts_ms)) WITHOUT ROWID")
    t0 = time.perf_counter()
    for i in range(n):
        conn.execute("INSERT INTO s VALUES (?, ?, ?)", (i % 40, i, float(i)))
        conn.commit()
    elapsed = time.perf_counter() - t0
    conn.close()
    return n / elapsed


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fast = batched(os.path.join(tmp, "a.db"))
        slow = naive(os.path.join(tmp, "b.db"))
    print(json.dumps({
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": os.cpu_count(), "sqlite": sqlite3.sqlite_version},
        "samples": N_SERIES * N_PER_SERIES,
        "writer_samples_per_s": round(fast),
        "commit_per_sample_samples_per_s": round(slow),
        "speedup": round(fast / slow, 1),
        "target_samples_per_s": 50_000,
    }))


if __name__ == "__main__":
    main()
