"""Speculative decoding planned with the acceptance a real server measured: `servescope serve`
speculating with the demo model's draft, recorded by `servescope record` into a database, then
`servescope plan search --spec-acceptance-from` and the Planner pane's choice read it back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import pytest

from planner.catalog import load_catalog
from planner.search import SearchSpace, search
from planner.timing import SpecDecode
from planner.workload import Slo, Workload
from tests.test_cli import serving

PLAN = ["--model", "Llama-3.1-8B", "--input-len", "512", "--output-len", "128", "--rate", "2",
        "--ttft-p99-ms", "2000", "--tpot-p99-ms", "60", "--gpus", "H100 SXM", "--json"]


def test_measured_rates_set_the_tokens_a_step_and_a_matching_per_token_rate():
    spec = SpecDecode.from_measured([0.62, 0.41, 0.27], measured_on="prod")
    assert spec.draft_len == 3 and spec.tokens_per_step == pytest.approx(2.30)
    a = spec.acceptance  # the one rate a token giving the same expectation (Leviathan's form)
    assert (1 - a ** 4) / (1 - a) == pytest.approx(2.30, abs=1e-3)
    assert SpecDecode.from_measured([0.0, 0.0], "idle").acceptance == 0.0
    with pytest.raises(ValueError, match="drafted nothing"):
        SpecDecode.from_measured([], "idle")
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        SpecDecode(draft_len=2, accepted_at=(0.5, 1.5))


def test_a_plan_with_poor_measured_acceptance_gains_less_from_speculation():
    """The same search with speculation accepted 70% a token (assumed) and as a server measured
    it (2% past the first position): the measured one predicts fewer tokens a step, and the
    plans carry where their figure came from."""
    catalog, model = load_catalog(), load_catalog().model("Llama-3.1-8B")
    w = Workload(512, 128, rate=2, slo=Slo(2000, 60), num_requests=200)
    space = SearchSpace(gpus=("H100 SXM",), weights=("fp8",), kv=("fp8",), tp=(1,), pp=(1,),
                        max_seqs=(64,))
    poor = SpecDecode.from_measured([0.2, 0.02, 0.0], "prod")
    assumed = search(model, w, catalog, replace(space, spec=(SpecDecode(),)))
    measured = search(model, w, catalog, replace(space, spec=(poor,)))
    a, m = (r.candidates[0].as_dict()["spec_decode"] for r in (assumed, measured))
    assert m["tokens_per_step"] == pytest.approx(1.22) and m["measured_on"] == "prod"
    assert a["measured_on"] is None and a["tokens_per_step"] > 2.5
    assert measured.candidates[0].tpot_p99_ms > assumed.candidates[0].tpot_p99_ms


def _spec_counters(metrics: str) -> tuple[float, list[float]]:
    """The drafts and accepted tokens by position in a /metrics text (vLLM's names)."""
    from prometheus_client.parser import text_string_to_metric_families

    drafts, accepted = 0.0, {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "vllm:spec_decode_num_drafts_total":
                drafts += sample.value
            elif sample.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                position = int(sample.labels["position"])
                accepted[position] = accepted.get(position, 0.0) + sample.value
    return drafts, [accepted[i] for i in sorted(accepted)]


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", "plan", "search", *args],
                          capture_output=True, text=True, timeout=300)


def test_acceptance_recorded_from_a_speculating_server_plans_the_search(demo_gguf, tmp_path):
    """servescope serve with the demo draft, recorded while it answers; the planner reads the
    recorded acceptance by position back from the database. A source that did not speculate
    and a broken database are one sentence each."""
    from openai import OpenAI

    db = f"sqlite:///{tmp_path / 'monitor.db'}"
    passage = ("The city council met on Tuesday to discuss the new bike lanes on Main Street. "
               "Residents said the lanes made the street safer for children walking to school.")
    with serving(demo_gguf, "--spec", "demo-draft", "--kv-cache-tokens", "4096") as url:
        record = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "record", "--server", f"spec={url}",
             "--duration", "25", "--interval", "1", "--db", db],
            stderr=subprocess.PIPE, text=True)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            client.chat.completions.create(
                model=client.models.list().data[0].id, max_tokens=64, temperature=0,
                messages=[{"role": "user", "content": "Repeat the following paragraph "
                                                      f"exactly, then stop:\n\n{passage}"}])
        served = _spec_counters(httpx.get(f"{url}/metrics").text)
        record.wait(timeout=120)
    from storage.db import open_database
    from storage.queries import acceptance_by_position

    stored = open_database(db)
    rates = acceptance_by_position(stored, "spec")
    stored.close()
    # What the server's own counters say, by vLLM's definition (accepted at i / drafts): the
    # recorder scraped them after the last request, so the stored figures are these.
    drafts, accepted = served
    assert drafts > 0 and rates == pytest.approx([a / drafts for a in accepted])
    assert all(0.0 <= r <= 1.0 for r in rates) and rates[0] > 0
    done = _plan(*PLAN, "--spec-acceptance-from", "spec", "--db", db)
    assert done.returncode == 0, done.stderr[-2000:]
    plans = json.loads(done.stdout)["candidates"] + json.loads(done.stdout)["pareto"]
    specs = [p["spec_decode"] for p in plans if p["spec_decode"]]
    assert specs, "no plan speculated"
    assert all(s["measured_on"] == "spec" and s["draft_len"] == len(rates) for s in specs)
    assert specs[0]["tokens_per_step"] == pytest.approx(1 + sum(rates), abs=1e-3)

    missing = _plan(*PLAN, "--spec-acceptance-from", "idle", "--db", db)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "'idle' stored no speculative acceptance" in missing.stderr
    assert "sources that did: spec" in missing.stderr
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"not a database at all" * 100)
    bad = _plan(*PLAN, "--spec-acceptance-from", "spec", "--db", f"sqlite:///{broken}")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "broken.db" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
