"""`servescope diagnose`: the stored recording of real vLLM judged, verdicts stored and exported;
a database without samples, or no database at all, is one sentence."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from monitor.cli import main
from storage import queries
from storage.db import open_database
from storage.records import Sample
from storage.writer import Writer

RECORDING = Path(__file__).parent / "diagnosis_vllm_kv.json"
T0 = 1_700_000_000.0


@pytest.fixture
def recorded_db(tmp_path) -> str:
    """The real vLLM recording stored as `servescope record` stores it (wall-clock times)."""
    url = f"sqlite:///{tmp_path / 'rec.db'}"
    db = open_database(url)
    writer = Writer(db).start()
    series = json.loads(RECORDING.read_text())["series"]
    writer.submit([Sample(key, T0 + ts, value) for key, points in series.items()
                   for ts, value in points])
    assert writer.close()
    db.close()
    return url


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["diagnose", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_diagnose_names_kv_pressure_stores_it_and_exports_csv(recorded_db, capsys, tmp_path):
    target = tmp_path / "verdicts.csv"
    code, out, _ = run(capsys, "--db", recorded_db, "--json", "--csv", str(target))
    assert code == 0
    result = json.loads(out)
    rules = {v["rule"]: v for v in result["verdicts"]}
    assert rules["kv_pressure"]["title"].startswith("p99 TTFT spike with KV cache full and ")
    assert result["series"] > 10 and len(result["stored"]) == len(result["verdicts"])
    with target.open(encoding="utf-8") as f:
        assert "kv_pressure" in {row["rule"] for row in csv.DictReader(f)}

    # Judged again: the same episodes, not new rows; --history lists them.
    code, out, _ = run(capsys, "--db", recorded_db, "--json")
    assert json.loads(out)["stored"] == result["stored"]
    code, out, _ = run(capsys, "--db", recorded_db, "--history", "--json")
    assert code == 0 and len(json.loads(out)["verdicts"]) == len(result["verdicts"])

    # The text form: the verdict, its evidence and what to try.
    code, out, _ = run(capsys, "--db", recorded_db, "--no-store", "--source", "vllm")
    assert "vllm: p99 TTFT spike with KV cache full" in out
    assert "evidence: max of vllm/kv_cache_usage over" in out and "try: KV-cache pressure" in out


def test_a_window_without_trouble_says_what_it_could_not_judge(recorded_db, capsys):
    # From the start to the end of the light load that fits (the recording says when).
    light_end = json.loads(RECORDING.read_text())["meta"]["loads"]["light"]["ended_s"]
    window = f"{light_end:g}"
    code, out, _ = run(capsys, "--db", recorded_db, "--json", "--no-store",
                       "--end", str(T0 + light_end), "--window", window)
    result = json.loads(out)
    assert code == 0 and result["verdicts"] == [] and result["stored"] == []
    assert result["summary"].startswith(f"No rule's conditions held over {light_end:.0f} s")
    assert "memory_bound" in result["not_evaluated"]


def test_an_empty_database_and_a_missing_one_are_one_sentence(tmp_path, capsys):
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    open_database(empty).close()
    code, out, err = run(capsys, "--db", empty, "--json")
    assert code == 2
    assert err.strip() == (f"The database {empty} holds no samples to diagnose; record some "
                           "first (servescope record --db ... --server URL).")
    assert json.loads(out) == {"error": err.strip()}
    missing = tmp_path / "nope.db"
    code, _, err = run(capsys, "--db", f"sqlite:///{missing}")
    assert code == 2 and err.startswith(f"There is no database at {missing};")
    assert not missing.exists()


def test_servescope_diagnose_is_a_command(recorded_db):
    done = subprocess.run([sys.executable, "-m", "app.cli", "diagnose", "--db", recorded_db,
                           "--json", "--no-store"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kv_pressure" in {v["rule"] for v in json.loads(done.stdout)["verdicts"]}
    db = open_database(recorded_db)
    assert queries.list_verdicts(db) == []  # --no-store
    db.close()
