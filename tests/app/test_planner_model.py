"""The Planner's Qt-free model: search outcome → failure → selection, driven without widgets."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from app.panes.planner.model import PlannerModel
from app.panes.planner.state import Failure, FormState, WhatIf

SMALL = FormState(model="Llama-3.1-8B", rate=4.0, gpus=("L4",), weights=("int4",), kv=("fp8",),
                  speculative=False, num_requests=200)


def _outcome(form: FormState):
    from app.panes.planner.tasks import search_task

    generator = search_task(form, {})(threading.Event())
    try:
        while True:
            next(generator)
    except StopIteration as stop:
        return stop.value


def test_the_model_imports_no_qt():
    code = ("import sys, app.panes.planner.model, app.panes.planner.state, "
            "app.panes.planner.report; "
            "sys.exit(any(m.startswith('PySide6') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_outcome_failure_and_choice_without_widgets():
    model, events = PlannerModel(), []
    model.observe(lambda event, payload: events.append(event))
    with pytest.raises(ValueError, match="no plan yet"):
        model.keep_scenario()
    outcome = _outcome(SMALL)
    model.searched(outcome)
    assert events == ["outcome"] and model.outcome is outcome
    assert "$" in model.recommendation() and "at peak" in model.recommendation()
    model.choose(outcome.best)
    model.detailed(outcome.detail)
    assert "at peak" in model.verdict(outcome.detail, WhatIf())
    assert model.keep_scenario() == "Llama-3.1-8B @ 4 req/s"

    model.searched(Failure("no option meets the SLOs (SLO 1 ms)"))
    assert events[-1] == "cleared" and model.failure.endswith("(SLO 1 ms)")
    assert model.outcome is None and model.chosen is None and model.detail is None
    assert model.recommendation() == ""
    model.searched(None)  # a cancelled search changes nothing
    assert events[-1] == "cleared"
    model.searched(_outcome(replace(SMALL, rate=2.0)))
    assert events[-1] == "outcome" and model.failure == ""
    assert len(model.scenarios.items) == 1  # kept scenarios outlive a failed search
