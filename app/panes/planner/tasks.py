"""Background tasks for the Planner pane: the search and one plan's detailed simulation."""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

from app.panes.planner.state import FormState, Outcome, WhatIf
from app.workers import Progress, TaskFunction
from planner.calibrate import Calibration
from planner.catalog import Catalog, CatalogError, Model, load_catalog
from planner.evaluate import Evaluation, InfeasibleError, evaluate
from planner.hf_import import model_from_hf_config
from planner.search import Cancelled, Plan, search

# The planner's own user errors: their message is the one sentence the user sees.
USER_ERRORS = (CatalogError, InfeasibleError, KeyError, ValueError)


@dataclass(frozen=True)
class Failure:
    """A planner failure a user can fix, carrying the planner's one-sentence explanation.

    Returned rather than raised: the runner would prefix a raised error with its type name."""

    message: str


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
        events: queue.Queue = queue.Queue()
        box: dict = {}

        def run() -> None:
            try:
                box["result"] = search(model, workload, catalog, space, form.budget,
                                       calibration=calibration,
                                       cost_opts=form.cost_options(),
                                       progress=lambda f, m: events.put(Progress(f * 0.9, m)),
                                       cancel=cancel.is_set)
            except BaseException as exc:  # handed to the task's thread, which reports it
                box["error"] = exc
            events.put(None)

        # The search reports through a callback; a helper thread turns it into yields, so each
        # progress event is also a point where the runner can cancel (Orange's TaskState).
        helper = threading.Thread(target=run, name="planner-search", daemon=True)
        helper.start()
        try:
            while (event := events.get()) is not None:
                yield event
        finally:
            helper.join()  # on cancel the search stops within 256 candidates or one simulation
        if "error" in box:
            error = box["error"]
            if isinstance(error, Cancelled):
                return None
            if isinstance(error, USER_ERRORS):
                return Failure(user_message(error))
            raise error
        result = box["result"]
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
