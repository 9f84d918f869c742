"""The records sources produce and the writer stores: samples and per-request figures."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of a series at a wall-clock time; series is "source/metric" ("gpu0/power_w")."""

    series: str
    ts: float
    value: float

    @property
    def source(self) -> str:
        return self.series.split("/", 1)[0]


@dataclass(slots=True)
class RequestRecord:
    """One request's latency figures in seconds (None when not measured) and token counts."""

    source: str
    ts: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    ok: bool = True
    error: str | None = None
    run_id: int | None = None
