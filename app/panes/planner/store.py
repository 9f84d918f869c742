"""The Planner pane's database and measured-run reads: saved scenarios and calibration inputs."""

from __future__ import annotations

from typing import Any

SCENARIOS_KIND = "planner-scenarios"


class PlannerStore:
    """Opens the database on first use; a broken one is reported once and then left alone."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url
        self.error: str | None = None
        self._db: Any = None

    def database(self) -> Any:
        """The open database; raises StorageError (its one-sentence message) when it is broken."""
        from storage.db import StorageError, open_database

        if self.error is not None:
            raise StorageError(self.error)
        if self._db is None:
            try:
                self._db = open_database(self.url)
            except StorageError as exc:
                self.error = str(exc)
                raise
        return self._db

    def save_scenarios(self, rows: list[dict[str, Any]]) -> int:
        """Store the scenarios as one saved plan; returns its id."""
        from storage.queries import save_plan

        names = ", ".join(r["name"] for r in rows)
        return save_plan(self.database(), f"Scenarios: {names}"[:200],
                         {"kind": SCENARIOS_KIND, "scenarios": rows})

    def load_scenarios(self) -> list[dict[str, Any]]:
        """The most recently saved scenarios, or none."""
        from storage.queries import list_plans

        for row in list_plans(self.database()):
            plan = row.get("plan") or {}
            if isinstance(plan, dict) and plan.get("kind") == SCENARIOS_KIND:
                return list(plan.get("scenarios") or [])
        return []

    def load_tests(self) -> list[dict[str, Any]]:
        """Stored load-test runs, the remote servers' calibration points."""
        from storage.queries import list_runs

        return list_runs(self.database(), "loadtest")

    def acceptance_sources(self) -> list[tuple[str, list[float]]]:
        """Each monitored server that measured speculative acceptance by draft position, with
        its rates (the mean of what was stored)."""
        from storage.queries import acceptance_by_position, sources_with_acceptance

        db = self.database()
        found = [(name, acceptance_by_position(db, name)) for name in sources_with_acceptance(db)]
        return [(name, rates) for name, rates in found if rates]

    def load_plan_runs(self) -> list[Any]:
        """The runs "Run a plan here" stored, each beside its prediction (app.plan_run)."""
        from app.plan_run import validation_rows

        return validation_rows(self.load_tests())

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
