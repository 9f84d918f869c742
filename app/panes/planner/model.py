"""The Planner pane's state without Qt: search outcome, chosen plan, detail, calibration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.panes.planner.state import Failure, Outcome, Scenarios, WhatIf, plan_costs, plan_label
from planner.calibrate import Calibration
from planner.evaluate import Evaluation
from planner.measured import CalibrationReport
from planner.search import Plan

Observer = Callable[[str, Any], None]


class PlannerModel:
    """What the Planner pane shows, as napari keeps its ViewerModel apart from the widgets.

    Holds the last search's outcome (or the reason there is none), the chosen plan and its
    simulated detail, the calibration and the kept scenarios. Each change is one method, and
    observers hear it as (event, payload): "outcome", "cleared" (the reason), "chosen",
    "detail", "calibrated". The pane observes and draws; tests drive it without Qt."""

    def __init__(self) -> None:
        self.outcome: Outcome | None = None
        self.failure = ""  # why the last search found no plan
        self.chosen: Plan | None = None
        self.detail: Evaluation | None = None
        self.calibration = Calibration()
        self.calibration_report: CalibrationReport | None = None
        self.scenarios = Scenarios()
        self._observers: list[Observer] = []

    def observe(self, observer: Observer) -> None:
        """Call ``observer(event, payload)`` after every change."""
        self._observers.append(observer)

    def _emit(self, event: str, payload: Any) -> None:
        for observer in self._observers:
            observer(event, payload)

    # ---- changes
    def searched(self, result: Outcome | Failure | None) -> None:
        """A search ended: its outcome replaces the last; a failure clears every trace of the
        previous plan (it no longer matches the form); None (cancelled) changes nothing."""
        if result is None:
            return
        self.chosen = None
        if isinstance(result, Failure):
            self.outcome, self.detail, self.failure = None, None, result.message
            self._emit("cleared", result.message)
            return
        self.outcome, self.detail, self.failure = result, result.detail, ""
        self._emit("outcome", result)

    def choose(self, plan: Plan) -> None:
        """Make ``plan`` (one of the outcome's) the one the detail and deploy describe."""
        if self.outcome is None:
            raise ValueError("there is no search outcome to choose a plan from")
        self.chosen = plan
        self._emit("chosen", plan)

    def detailed(self, detail: Evaluation) -> None:
        """The chosen plan's simulation under the current what-ifs."""
        self.detail = detail
        self._emit("detail", detail)

    def calibrated(self, report: CalibrationReport) -> None:
        """Use ``report``'s calibration from the next search on."""
        self.calibration, self.calibration_report = report.calibration, report
        self._emit("calibrated", report)

    def keep_scenario(self) -> str:
        """Keep the outcome for the side-by-side comparison; returns its label."""
        if self.outcome is None:
            raise ValueError("There is no plan yet to keep as a scenario.")
        return self.scenarios.keep(self.outcome)

    # ---- what the views say
    def recommendation(self) -> str:
        """The recommendation line (rich text), or "" without a plan."""
        o = self.outcome
        if o is None or o.best is None:
            return ""
        best = o.best
        return (f"<b>Recommended:</b> {plan_label(best)} — {plan_costs(best, o.form).text()}, "
                f"${best.cost_per_1m_tokens:.3f} per 1M tokens, p99 TTFT "
                f"{best.ttft_p99_ms:.0f} ms (≤ {o.form.ttft_p99_ms:g}), p99 TPOT "
                f"{best.tpot_p99_ms:.1f} ms (≤ {o.form.tpot_p99_ms:g}). "
                f"{calibration_text(o.calibration)}")

    def verdict(self, detail: Evaluation, what_if: WhatIf) -> str:
        """The What-if panel's sentence for the chosen plan's ``detail``."""
        form = self.outcome.form
        s = detail.result.summary
        ttft, tpot = s("ttft")["p99"], s("tpot")["p99"]
        verdict = "meets" if ttft <= form.ttft_p99_ms and tpot <= form.tpot_p99_ms else "misses"
        # The simulated fleet is the peak hour's; the day average lets autoscaling trim it.
        average = plan_costs(self.chosen, form, what_if.spot_share, what_if.rate_scale,
                             what_if.replicas_delta).average_per_hour
        return (f"{detail.replicas} replica(s) at {form.rate * what_if.rate_scale:g} req/s: "
                f"p99 TTFT {ttft:.0f} ms, TPOT {tpot:.1f} ms, "
                f"${detail.cost_per_hour:.2f}/hour at peak, ${average:.2f}/hour averaged over "
                f"the day — {verdict} the SLOs.")


def calibration_text(calibration: Calibration) -> str:
    """The calibration a recommendation used, with its fit error when it was fitted."""
    if calibration.fit_error_pct is None:
        return f"Calibration: {calibration.name}."
    return (f"Calibration: {calibration.name}, fit error {calibration.fit_error_pct:.1f}% "
            f"over {calibration.points} point(s).")
