"""The Planner pane driven end to end: form -> ranking -> report, cancel, bad input, what-ifs."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.panes.planner.pane import PlannerPane
from app.panes.planner.state import FormState, plan_label

SEARCH_MS = 60_000
BENCH_MS = 600_000  # loading and benchmarking the demo model on a busy CPU
SMALL = FormState(model="Llama-3.1-8B", rate=4.0, gpus=("L4", "L40S"), weights=("fp8", "int4"),
                  kv=("fp8",), speculative=False, num_requests=300)


def _pane(qtbot, tmp_path: Path) -> PlannerPane:
    pane = PlannerPane(form_folder=tmp_path)
    qtbot.addWidget(pane)
    return pane


def _search(qtbot, pane: PlannerPane, form: FormState) -> None:
    with qtbot.waitSignal(pane.outcome_ready, timeout=SEARCH_MS):
        pane.form.set_state(form)
        pane.recompute()


def test_form_to_ranking_to_report(qtbot, tmp_path: Path) -> None:
    pane = _pane(qtbot, tmp_path)
    _search(qtbot, pane, SMALL)
    best = pane.outcome.best
    assert pane.table.model().rowCount() == len(pane.outcome.result.candidates) > 0
    assert plan_label(best) in pane.recommendation.text()
    assert best.deployment.gpu.name in ("L4", "L40S")
    assert best.ttft_p99_ms <= SMALL.ttft_p99_ms and best.tpot_p99_ms <= SMALL.tpot_p99_ms
    # Sorting by $/hour descending puts the dearest plan on top.
    pane.table.sortByColumn(2, Qt.SortOrder.DescendingOrder)
    costs = [pane.table.plan_at(r).cost_per_hour for r in range(pane.table.model().rowCount())]
    assert costs == sorted(costs, reverse=True)
    assert "vllm serve" in pane.deploy.toPlainText()
    html_path, pdf_path = pane.export_report(tmp_path / "plan.html")
    text = html_path.read_text(encoding="utf-8")
    assert plan_label(best) in text and "vllm serve" in text and "data:image/png;base64," in text
    assert best.deployment.gpu.price_date in text and "Kind: Deployment".lower() in text.lower()
    pdf = pdf_path.read_bytes()
    assert pdf.startswith(b"%PDF") and pdf.rstrip().endswith(b"%%EOF")
    assert pdf.count(b"/Type /Page\n") + pdf.count(b"/Type /Page ") + pdf.count(
        b"/Type /Page>") >= 2 or len(pdf) > 50_000


def test_what_if_and_scenarios(qtbot, tmp_path: Path) -> None:
    pane = _pane(qtbot, tmp_path)
    _search(qtbot, pane, SMALL)
    assert not pane.charts["ttft"].spec.empty and not pane.charts["memory"].spec.empty
    before = pane.detail.result.summary("ttft")["p99"]
    with qtbot.waitSignal(pane.detail_ready, timeout=SEARCH_MS):
        pane.what_if.rate_scale.setValue(3.0)
    assert "12 req/s" in pane.what_if.verdict.text()
    assert pane.detail.result.summary("ttft")["p99"] > before
    pane.keep_scenario()
    _search(qtbot, pane, replace(SMALL, rate=8.0))
    pane.keep_scenario()
    assert pane.scenario_table.columnCount() == 2
    assert pane.scenario_table.item(0, 0).text() == "Llama-3.1-8B"
    pane.set_presentation(True)
    assert pane.font().pointSizeF() > pane._base_font.pointSizeF() * 1.5
    assert pane.form_scroll.isHidden()


def test_cancel_a_running_search(qtbot, tmp_path: Path) -> None:
    pane = _pane(qtbot, tmp_path)
    everything = replace(SMALL, gpus=tuple(pane.form.gpus.item(i).text()
                                           for i in range(pane.form.gpus.count())),
                         weights=("bf16", "fp8", "int8", "int4"), kv=("bf16", "fp8", "int8"),
                         speculative=True)
    pane.form.set_state(everything)
    with qtbot.waitSignal(pane.runner.cancelled, timeout=SEARCH_MS):
        pane.recompute()
        pane.cancel_button.click()
    qtbot.waitUntil(lambda: not pane.runner.is_running())
    assert pane.outcome is None
    assert "cancelled" in pane.status.text()


def _messages(window) -> list[tuple[str, str]]:
    return [(n.level, n.message) for n in window.notifications.notifications()]


def test_infeasible_and_unknown_model_say_why(make_window, qtbot, tmp_path: Path) -> None:
    window = make_window()
    pane = window.pane("planner")  # the window's own pane, as a user meets it
    huge = replace(SMALL, model="Llama-3.1-405B", gpus=("L4",), weights=("bf16",), kv=("bf16",))
    # The window starts its panes (a first search) meanwhile: wait for the message itself.
    pane.form.set_state(huge)
    pane.recompute()
    qtbot.waitUntil(lambda: "weights need" in pane.plan_banner.text(), timeout=SEARCH_MS)
    assert not pane.plan_banner.isHidden() and "Traceback" not in pane.plan_banner.text()
    pane.form.set_state(replace(SMALL, model="Llama-3.1-8C"))
    pane.recompute()
    qtbot.waitUntil(lambda: "unknown model" in pane.plan_banner.text(), timeout=SEARCH_MS)
    assert "Llama-3.1-8B" in pane.plan_banner.text()
    assert pane.outcome is None
    window.close()


def test_import_hugging_face_config(qtbot, tmp_path: Path) -> None:
    pane = _pane(qtbot, tmp_path)
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({
        "_name_or_path": "acme/tiny-3b", "model_type": "llama", "num_hidden_layers": 24,
        "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
        "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 8192}))
    assert pane.form.import_config(str(config))
    assert pane.form.state().model == "acme/tiny-3b"
    _search(qtbot, pane, replace(pane.form.state(), gpus=("L4",), kv=("fp8",),
                                 speculative=False, num_requests=300))
    assert pane.outcome.model.name == "acme/tiny-3b"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with qtbot.waitSignal(pane.notify) as blocker:
        assert not pane.form.import_config(str(bad))
    assert blocker.args[0] == "error" and "num_attention_heads" in blocker.args[1]


def _notices(pane: PlannerPane) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    pane.notify.connect(lambda level, text: seen.append((level, text)))
    return seen


def test_scenarios_saved_in_the_database_and_reloaded(qtbot, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plans.db'}"
    pane = PlannerPane(form_folder=tmp_path, db_url=url)
    qtbot.addWidget(pane)
    _search(qtbot, pane, SMALL)
    pane.keep_scenario()
    label = plan_label(pane.outcome.best)
    assert pane.save_scenarios() is not None
    again = PlannerPane(form_folder=tmp_path, db_url=url)
    qtbot.addWidget(again)
    assert again.restore_scenarios() == 1
    assert again.scenario_table.columnCount() == 1
    assert again.scenario_table.horizontalHeaderItem(0).text() == "Llama-3.1-8B @ 4 req/s"
    assert again.scenario_table.item(4, 0).text() == label
    assert again.scenarios.as_json()[0]["plan"]["gpu"] == pane.outcome.best.deployment.gpu.name


def test_a_broken_database_gives_one_notice_and_the_pane_works(qtbot, tmp_path: Path) -> None:
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"this is not an SQLite file " * 100)
    pane = PlannerPane(form_folder=tmp_path, db_url=f"sqlite:///{broken}")
    qtbot.addWidget(pane)
    seen = _notices(pane)
    assert pane.restore_scenarios() == 0
    _search(qtbot, pane, SMALL)
    pane.keep_scenario()
    assert pane.save_scenarios() is None
    errors = [text for level, text in seen if level == "error"]
    assert len(errors) == 1 and "broken.db" in errors[0]
    assert pane.scenario_table.columnCount() == 1  # the kept scenario is still on screen


def test_calibrate_from_engine_results_recomputes(qtbot, tmp_path: Path) -> None:
    from planner.calibrate import Measurement, deployment_for, predict
    from planner.catalog import load_catalog
    from planner.timing import Efficiency

    catalog, truth = load_catalog(), Efficiency(flops=0.45, memory=0.65)
    tok_s = {}
    for n in (1, 16, 64):
        m = Measurement("Llama-3.1-8B", "L4", "bf16", "bf16", 1, 1, n, 1000, 64, 1.0)
        tok_s[str(n)] = predict(deployment_for(m, catalog), m, truth)["throughput_tok_s"]
    records = [{"model": "meta-llama/Llama-3.1-8B-Instruct", "device": "cuda:0",
                "dtype": "bfloat16", "machine": {"gpus": ["NVIDIA L4"]},
                "config": {"prompt_tokens": 1000, "new_tokens": 64},
                "throughput_tokens_per_s": tok_s},
               {"model": "Qwen/Qwen3-0.6B", "device": "cpu", "dtype": "float32",
                "throughput_tokens_per_s": {"1": 20.0}}]
    data = Path(os.environ["SERVESCOPE_DATA_DIR"])
    data.mkdir(parents=True, exist_ok=True)
    (data / "bench_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pane = _pane(qtbot, tmp_path)
    seen = _notices(pane)
    _search(qtbot, pane, replace(SMALL, weights=("bf16",), kv=("bf16",), gpus=("L4",)))
    assert "Calibration: default (uncalibrated)" in pane.recommendation.text()
    with qtbot.waitSignal(pane.outcome_ready, timeout=SEARCH_MS):
        report = pane.calibrate()
    assert report is not None and report.calibration.points == 3
    eff = report.calibration.efficiency("L4", "bf16")
    assert abs(eff.flops - 0.45) < 0.051 and abs(eff.memory - 0.65) < 0.051
    text = pane.recommendation.text()
    assert report.calibration.name in text and "fit error" in text
    assert pane.outcome.best.calibration == report.calibration.name
    assert any("CPU run" in t for _, t in seen)


def test_calibrate_from_this_workstation(qtbot, tmp_path: Path, demo_gguf: Path) -> None:
    """The action benchmarks the real demo model off the GUI thread, keeps the result where
    calibration reads it, and calibrates from it: on a GPU it fits that GPU's factors; on the
    CPU it says why a CPU run cannot calibrate a catalog GPU."""
    pane = _pane(qtbot, tmp_path)
    seen = _notices(pane)
    steps = []
    pane.bench_runner.progressed.connect(lambda p: steps.append(p.message))
    with qtbot.waitSignal(pane.bench_runner.finished, timeout=BENCH_MS):
        assert pane.calibrate_workstation(quick=True)
        assert not pane.calibrate_workstation(quick=True)  # one at a time
    assert "loading the demo model" in steps and any("concurrent" in m for m in steps)
    lines = (Path(os.environ["SERVESCOPE_DATA_DIR"]) / "bench_results.jsonl").read_text()
    result = json.loads(lines.splitlines()[-1])
    assert result["model"] == "smollm2-135m-instruct"
    assert set(result["throughput_tokens_per_s"]) == {"1", "4"}
    assert all(v > 0 for v in result["throughput_tokens_per_s"].values())
    assert f"Benchmarked smollm2-135m-instruct on {result['device']}" in (
        pane.status.text() + "".join(t for _, t in seen if t.startswith("Calibrated")))
    if result["device"].startswith("cuda"):
        assert pane.calibration.points == 2 and "bf16" in pane.calibration.name
    else:
        assert any("a CPU run says nothing about a catalog GPU" in t for _, t in seen)
        assert pane.calibration.name == "default (uncalibrated)"
    assert pane.workstation_button.isEnabled()


def test_cancel_the_workstation_benchmark(qtbot, tmp_path: Path, demo_gguf: Path) -> None:
    pane = _pane(qtbot, tmp_path)
    with qtbot.waitSignal(pane.bench_runner.cancelled, timeout=BENCH_MS):
        pane.calibrate_workstation(quick=True)
        pane.cancel()
    assert "cancelled" in pane.status.text() and pane.workstation_button.isEnabled()
    assert not (Path(os.environ["SERVESCOPE_DATA_DIR"]) / "bench_results.jsonl").exists()


def test_a_long_prompt_plan_with_context_parallelism_says_why_and_spans_nodes(
        qtbot, tmp_path: Path) -> None:
    """124K-token documents for DeepSeek-V3 with a 10 s TTFT target: only context parallelism
    meets it. The pane ranks a CP plan, its deploy text gives vLLM's and SGLang's multi-node
    commands, the saved script says how each server spans the nodes, and the report says why
    the plan spans them."""
    pane = _pane(qtbot, tmp_path)
    form = FormState(model="DeepSeek-V3", rate=0.05, input_len=126976, input_dist="fixed",
                     output_len=1024, output_dist="fixed", ttft_p99_ms=10000.0,
                     tpot_p99_ms=100.0, gpus=("H200",), weights=("fp8",), kv=("fp8",),
                     speculative=False, autoscale=False, num_requests=100)
    _search(qtbot, pane, form)
    best = pane.outcome.best
    assert best.deployment.cp > 1 and f"CP{best.deployment.cp}" in plan_label(best)
    deploy = pane.deploy.toPlainText()
    assert "--prefill-context-parallel-size" in deploy and "--attn-cp-size" in deploy
    assert '--node-rank "$NODE_RANK"' in deploy
    script = pane.save_deploy(tmp_path / "deploy.sh")[0].read_text(encoding="utf-8")
    nodes = best.deployment.nodes
    assert f"# vLLM over {nodes} nodes: start a Ray cluster on them first" in script
    assert "\nvllm serve deepseek-ai/DeepSeek-V3" in script  # run; SGLang's commented out
    assert f"# SGLang over {nodes} nodes: run its command on each, with NODE_RANK=0" in script
    assert "\n# python -m sglang.launch_server" in script
    html_path, _pdf = pane.export_report(tmp_path / "plan.html")
    text = html_path.read_text(encoding="utf-8")
    assert "Why this layout" in text and "context parallelism: one TP8 group" in text


def test_draft_acceptance_measured_by_a_monitored_server_is_offered_and_planned(
        qtbot, tmp_path: Path) -> None:
    """A server the monitor recorded speculating (its acceptance at each draft position) is
    offered in the form's draft-acceptance choice; choosing it plans speculation with those
    rates, the report says so, and the form keeps the choice."""
    from storage.db import open_database
    from storage.records import Sample
    from storage.writer import Writer

    url = f"sqlite:///{tmp_path / 'monitor.db'}"
    db = open_database(url)
    writer = Writer(db).start()
    now = 1_800_000_000.0
    writer.submit([Sample(f"prod/spec_acceptance_rate_at[position={i}]", now + t, rate + t / 100)
                   for i, rate in enumerate((0.6, 0.4, 0.2)) for t in (0.0, 2.0)])
    assert writer.close()
    db.close()
    pane = PlannerPane(form_folder=tmp_path, db_url=url)
    qtbot.addWidget(pane)
    with qtbot.waitSignal(pane.acceptance_runner.succeeded, timeout=SEARCH_MS):
        pane.refresh_acceptance()
    labels = [pane.form.acceptance.itemText(i) for i in range(pane.form.acceptance.count())]
    assert labels[1] == "measured on prod: 2.23 tokens a step (3 draft tokens)"
    pane.form.acceptance.setCurrentIndex(1)  # as a user picks it
    form = replace(pane.form.state(), model="Llama-3.1-8B", rate=2.0, gpus=("H100 SXM",),
                   weights=("fp8",), kv=("fp8",), speculative=True, num_requests=200)
    assert form.spec_measured_on == "prod"
    assert form.spec_accepted_at == pytest.approx((0.61, 0.41, 0.21))
    _search(qtbot, pane, form)
    specs = [p.deployment.spec for p in pane.outcome.result.candidates if p.deployment.spec]
    assert specs and all(s.measured_on == "prod" for s in specs)
    assert specs[0].tokens_per_step == pytest.approx(2.23)
    html_path, _pdf = pane.export_report(tmp_path / "plan.html")
    assert "as measured on prod (acceptance by draft position 61%, 41%, 21%)" in \
        html_path.read_text(encoding="utf-8")
    pane.save()
    # Started again on a database without that source (retention, another machine): the
    # saved measurement stays chosen, as it was.
    again = PlannerPane(form_folder=tmp_path, db_url=f"sqlite:///{tmp_path / 'other.db'}")
    qtbot.addWidget(again)
    with qtbot.waitSignal(again.acceptance_runner.succeeded, timeout=SEARCH_MS) as read:
        again.refresh_acceptance()
    assert read.args == [[]]
    assert again.form.state().spec_measured_on == "prod"
    assert again.form.state().spec_accepted_at == pytest.approx((0.61, 0.41, 0.21))
    again.form.speculative.setChecked(False)
    assert not again.form.acceptance.isEnabled()
