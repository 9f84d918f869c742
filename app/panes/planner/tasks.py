"""Background tasks for the Planner pane: the search, one plan's detailed simulation, the
workstation benchmark and running a plan here."""

from __future__ import annotations

import threading
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

from app.panes.planner.state import Failure, FormState, Outcome, WhatIf
from app.workers import Progress, TaskFunction, relay
from planner.calibrate import Calibration
from planner.catalog import Catalog, CatalogError, Model, load_catalog
from planner.evaluate import Evaluation, InfeasibleError, evaluate
from planner.hf_import import model_from_architecture, model_from_hf_config
from planner.search import Cancelled, Plan, search
from planner.workload import Workload

# The planner's own user errors: their message is the one sentence the user sees.
USER_ERRORS = (CatalogError, InfeasibleError, KeyError, ValueError)
RUN_HERE_REQUESTS = 12  # a run here: enough for p50s, short on a CPU


def user_message(exc: BaseException) -> str:
    """The sentence to show: KeyError's repr quotes would otherwise wrap the message."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


def resolve_model(catalog: Catalog, name: str, imported: dict[str, Model]) -> Model:
    """A catalog model, one imported from a config.json this session, or a path to one."""
    if name in imported:
        return imported[name]
    path = Path(name)
    if path.suffix == ".json" or path.is_dir():
        return model_from_hf_config(path / "config.json" if path.is_dir() else path)
    return catalog.model(name)


def search_task(form: FormState, imported: dict[str, Model],
                calibration: Calibration | None = None) -> TaskFunction:
    """A task running the planner's search, then simulating the best plan for the charts."""
    calibration = calibration or Calibration()

    def task(cancel: threading.Event) -> Generator[Progress, None, Outcome | Failure | None]:
        yield Progress(0.0, "reading catalogs")
        try:
            catalog = load_catalog()
            model = resolve_model(catalog, form.model, imported)
            workload, space = form.workload(), form.space()
        except USER_ERRORS as exc:
            return Failure(user_message(exc))
        def run(report) -> object:
            return search(model, workload, catalog, space, form.budget,
                          calibration=calibration, cost_opts=form.cost_options(),
                          progress=lambda f, m: report(Progress(f * 0.9, m)),
                          cancel=cancel.is_set)

        # On cancel the search stops within 256 candidates or one simulation.
        try:
            result = yield from relay(run, "planner-search")
        except Cancelled:
            return None
        except USER_ERRORS as exc:
            return Failure(user_message(exc))
        if not result.candidates:
            return Failure(f"No plan for {model.name}: {result.infeasible}.")
        yield Progress(0.95, "simulating the recommended plan")
        detail = evaluate(result.candidates[0].deployment, workload,
                          result.candidates[0].replicas, calibration, form.cost_options())
        return Outcome(form, model, catalog, result, detail, calibration)

    return task


def detail_task(outcome: Outcome, plan: Plan, what_if: WhatIf) -> TaskFunction:
    """A task simulating ``plan`` under changed assumptions (traffic, spot share, replicas)."""

    def task(_cancel: threading.Event) -> Generator[Progress, None, Evaluation | Failure]:
        yield Progress(None, "simulating the chosen plan")
        form = outcome.form
        workload = form.workload(what_if.rate_scale)
        replicas = max(1, plan.replicas + what_if.replicas_delta)
        try:
            return evaluate(plan.deployment, workload, replicas, outcome.calibration,
                            form.cost_options(what_if.spot_share))
        except USER_ERRORS as exc:
            return Failure(user_message(exc))

    return task


@dataclass(frozen=True)
class WorkstationBench:
    """The engine benchmark of the demo model on this machine, and that model for the planner."""

    result: dict
    model: Model


def planner_model(llm) -> Model:
    """The loaded engine model as a planner Model, named as its benchmark result names it."""
    c = llm.config
    return model_from_architecture(
        llm.model_name, f"loaded from {llm.model_path}", c.num_layers, c.hidden_size,
        c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size,
        c.max_position_embeddings, c.attention_bias)


def workstation_task(quick: bool | None = None) -> TaskFunction:
    """Load the demo model, run the engine benchmark on it and save the result where the
    calibration reads engine results. `quick` None: the full benchmark on a GPU, the quick one
    on the CPU (whose result cannot calibrate a catalog GPU, but is kept in the history)."""

    def task(cancel: threading.Event) -> Generator[Progress, None, WorkstationBench | Failure]:
        from engine.bench import iter_benchmark, save_result
        from engine.llm import LLM
        from engine.models import fetch_demo_model

        # A ModelError (no network for the first fetch, a damaged file) reaches the runner,
        # which reports its one sentence.
        yield Progress(0.0, "finding the demo model")
        path = fetch_demo_model(progress=lambda message, fraction: None, cancel=cancel.is_set)
        yield Progress(0.05, "loading the demo model")
        llm = LLM(str(path))
        events = iter_benchmark(llm, quick=llm.device.type != "cuda" if quick is None
                                else quick)
        result = None
        try:
            # Each benchmark step is a yield, so a cancel lands between steps.
            for event in events:
                yield Progress(0.1 + 0.85 * event.fraction, f"benchmark: {event.message}")
                result = event.result if event.result is not None else result
        finally:
            events.close()
        if result is None:
            return Failure("The engine benchmark ended without a result.")
        save_result(result)
        return WorkstationBench(result, planner_model(llm))

    return task


def run_here_task(plan: Plan, workload: Workload, db_url: str | None,
                  calibration: Calibration, requests: int = RUN_HERE_REQUESTS,
                  engine: str = "auto") -> TaskFunction:
    """Run the chosen plan on this machine (app.plan_run): predict it, serve it, load it while
    the monitor records, store the run; the result is run_here's figures."""

    def task(_cancel: threading.Event) -> Generator[Progress, None, dict | Failure]:
        from app.plan_run import (
            PlanRun,
            PlanRunError,
            demo_model_path,
            for_engine,
            predicted_figures,
            run_here,
            run_workload,
        )
        from storage.db import StorageError, open_database

        yield Progress(None, "predicting the plan")
        try:
            sent = run_workload(workload, requests)
            ev = evaluate(for_engine(plan.deployment, engine), sent, 1, calibration)
            run = PlanRun(plan, sent, demo_model_path(plan.deployment.model), requests,
                          predicted_figures(ev), engine)
            db = open_database(db_url)
        except (PlanRunError, StorageError, *USER_ERRORS) as exc:
            return Failure(user_message(exc))
        try:
            # A started server always runs its load to the end: the run is bounded by
            # `requests`, and a half-run would store nothing worth calibrating from.
            return (yield from relay(
                lambda report: run_here(run, db, lambda m: report(Progress(None, m))),
                "plan-run"))
        except (PlanRunError, StorageError, RuntimeError) as exc:
            return Failure(user_message(exc))
        finally:
            db.close()

    return task
