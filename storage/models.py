"""SQLAlchemy 2 models: sources, series, samples and rollups, requests, alerts, runs, plans."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    """Declarative base of every servescope table."""


class Source(Base):
    """Where samples come from: a GPU collector, the engine, a remote server, a load test."""

    __tablename__ = "sources"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(40), default="unknown")
    # The server's own version string where it names one (vLLM's GET /version), else None.
    version: Mapped[str | None] = mapped_column(String(80), nullable=True)
    url: Mapped[str | None] = mapped_column(Text, nullable=True)
    # A reference (e.g. "env:VLLM_TOKEN" or a keyring entry), never the token itself.
    token_ref: Mapped[str | None] = mapped_column(String(200), nullable=True)
    dollars_per_hour: Mapped[float | None] = mapped_column(Float, nullable=True)
    # A user-added server's quality canary (monitor/canary.py): seconds between scorings of the
    # held-out text; None where it has none.
    canary_every_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # ...scored by decoding from this token on (`servescope serve` only); None: by prefill.
    canary_decode_from: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_ms: Mapped[int] = mapped_column(BigInteger, default=0)


class Series(Base):
    """One named time series of one source."""

    __tablename__ = "series"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id"), index=True)
    key: Mapped[str] = mapped_column(String(400), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    unit: Mapped[str | None] = mapped_column(String(40), nullable=True)


class Sample(Base):
    """One raw value; narrow rows keyed (series_id, ts_ms) so a window read is one range scan."""

    __tablename__ = "samples"
    __table_args__ = {"sqlite_with_rowid": False}
    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts_ms: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    value: Mapped[float] = mapped_column(Float)


class _RollupColumns:
    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts_ms: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    count: Mapped[int] = mapped_column(Integer)
    total: Mapped[float] = mapped_column(Float)
    min: Mapped[float] = mapped_column(Float)
    max: Mapped[float] = mapped_column(Float)


class Rollup1m(_RollupColumns, Base):
    """Per-minute count, sum, min and max of a series (mean = total / count)."""

    __tablename__ = "samples_1m"
    __table_args__ = {"sqlite_with_rowid": False}


class Rollup1h(_RollupColumns, Base):
    """Per-hour count, sum, min and max of a series."""

    __tablename__ = "samples_1h"
    __table_args__ = {"sqlite_with_rowid": False}


class RequestRow(Base):
    """One finished (or failed) request with its latency figures in milliseconds."""

    __tablename__ = "requests"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id"), index=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"), nullable=True, index=True)
    ts_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    tpot_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    e2e_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    itl_ms: Mapped[list[float] | None] = mapped_column(JSON, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    ok: Mapped[bool] = mapped_column(Boolean, default=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class Alert(Base):
    """An SLO rule firing or clearing."""

    __tablename__ = "alerts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rule: Mapped[str] = mapped_column(String(200))
    series: Mapped[str] = mapped_column(String(400))
    state: Mapped[str] = mapped_column(String(10))
    ts_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    threshold: Mapped[float] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text, default="")


class Run(Base):
    """A benchmark or load test: its configuration and summary figures."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(40))
    name: Mapped[str] = mapped_column(String(200), default="")
    started_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    finished_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class SavedPlan(Base):
    """A planner result the user kept."""

    __tablename__ = "saved_plans"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    created_ms: Mapped[int] = mapped_column(BigInteger)
    plan: Mapped[dict[str, Any]] = mapped_column(JSON)


class VerdictRow(Base):
    """A diagnosis verdict (monitor.diagnosis): a named cause on a server or GPU over a span,
    its evidence (series, window, values) and what to try; one row per episode."""

    __tablename__ = "verdicts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rule: Mapped[str] = mapped_column(String(80))
    kind: Mapped[str] = mapped_column(String(40))
    source: Mapped[str] = mapped_column(String(200), index=True)
    gpu: Mapped[str] = mapped_column(String(80), default="")
    title: Mapped[str] = mapped_column(Text)
    advice: Mapped[str] = mapped_column(Text, default="")
    start_ms: Mapped[int] = mapped_column(BigInteger)
    end_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    evaluated_ms: Mapped[int] = mapped_column(BigInteger)
    evidence: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
