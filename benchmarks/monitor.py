"""Monitor benchmark: hub CPU (simulated GPUs, real HTTP servers), writer rate, chart redraw."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# Run as `python benchmarks/monitor.py`, sys.path[0] is benchmarks/, where this file would
# shadow the `monitor` package; drop it so the real package is imported.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
# Measure this checkout's code, not whichever copy of the packages is installed.
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402

from monitor.hub import Hub  # noqa: E402
from monitor.remote import PrometheusSource, ServerConfig  # noqa: E402
from monitor.types import Poll, Sample, SourceStatus  # noqa: E402
from storage.db import open_database  # noqa: E402
from storage.writer import Writer  # noqa: E402

ROOT = HERE.parent
METRICS_FILE = ROOT / "tests" / "monitor" / "vllm_metrics_a.txt"
N_GPUS, N_GPU_SERIES, GPU_HZ = 8, 20, 10.0
N_SERVERS, SERVER_HZ = 10, 1.0
HUB_SECONDS = float(os.environ.get("SERVESCOPE_BENCH_SECONDS", "20"))  # shorter for a smoke run
N_CHART_SERIES, WINDOW_POINTS, FRAMES, REDRAW_ROUNDS = 40, 600, 100, 3
TARGETS = {"hub_cpu_pct_of_one_core": 5.0, "writer_samples_per_s": 50_000,
           "redraw_ms_per_frame_p95": 16.0}


class SimulatedGpu:
    """A simulated GPU (no hardware): 20 random-walk series per poll, produced with numpy."""

    def __init__(self, index: int) -> None:
        self.name = f"simgpu{index}"
        self.interval_s = 1.0 / GPU_HZ
        self.status = SourceStatus(state="up", kind="simulated")
        self.keys = [f"{self.name}/0/metric{k}" for k in range(N_GPU_SERIES)]
        self.rng = np.random.default_rng(index)
        self.values = self.rng.uniform(0, 100, N_GPU_SERIES)

    def poll(self, now: float) -> Poll:
        self.values = np.clip(self.values + self.rng.normal(0, 1, N_GPU_SERIES), 0, 100)
        pairs = zip(self.keys, self.values.tolist(), strict=True)
        return Poll([Sample(k, now, float(v)) for k, v in pairs])

    def close(self) -> None:
        pass


def _serve_metrics(body: bytes, n: int, ports: Any, stop: Any) -> None:
    """Child process: n threaded HTTP servers on 127.0.0.1 answering /metrics with `body`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # keep stderr quiet
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(n)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    ports.put([s.server_address[1] for s in servers])
    stop.wait()


def start_servers() -> tuple[mp.Process, Any, list[int]]:
    """Start the servers in a separate process so their CPU is not charged to the hub."""
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve_metrics, args=(METRICS_FILE.read_bytes(), N_SERVERS, ports,
                                                    stop), daemon=True)
    proc.start()
    return proc, stop, ports.get(timeout=60)


def process_cpu_s() -> float:
    """User + system CPU seconds of this process (all its threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class TimedHub(Hub):
    """The Hub with its own thread's CPU time recorded (time.thread_time inside that thread)."""

    thread_cpu_s = 0.0

    def _run(self) -> None:
        t0 = time.thread_time()
        try:
            super()._run()
        finally:
            self.thread_cpu_s = time.thread_time() - t0


def measure_hub(tmp: str, ports: list[int]) -> dict[str, Any]:
    """Idle baseline, then the hub + writer for HUB_SECONDS; CPU as % of one core."""
    idle0, w0 = process_cpu_s(), time.monotonic()
    time.sleep(HUB_SECONDS)
    idle_cpu, idle_wall = process_cpu_s() - idle0, time.monotonic() - w0
    db = open_database(f"sqlite:///{os.path.join(tmp, 'hub.db')}")
    writer = Writer(db).start()
    sources: list[Any] = [SimulatedGpu(i) for i in range(N_GPUS)]
    sources += [PrometheusSource(ServerConfig(f"srv{i}", f"http://127.0.0.1:{p}",
                                              interval_s=1.0 / SERVER_HZ))
                for i, p in enumerate(ports)]
    hub = TimedHub(sources, writer)
    c0, w0 = process_cpu_s(), time.monotonic()
    hub.start()
    time.sleep(HUB_SECONDS)
    hub.stop()
    flushed = writer.close(timeout=60)
    busy_cpu, busy_wall = process_cpu_s() - c0, time.monotonic() - w0
    statuses = hub.statuses()
    up = sum(1 for name, s in statuses.items() if name.startswith("srv") and s.state == "up")
    keys = hub.series_keys()
    gpu_points = sum(len(hub.series(k)[0]) for k in keys if k.startswith("simgpu"))
    db.close()
    process_pct = 100 * (busy_cpu / busy_wall - idle_cpu / idle_wall)
    thread_pct = 100 * hub.thread_cpu_s / busy_wall
    return {
        "simulated_gpu_sources": N_GPUS, "series_per_gpu": N_GPU_SERIES, "gpu_poll_hz": GPU_HZ,
        "remote_servers": N_SERVERS, "servers_up_at_end": up, "server_poll_hz": SERVER_HZ,
        "seconds": round(busy_wall, 2), "series_live": len(keys),
        "gpu_points_held": gpu_points, "writer_flushed": flushed,
        "writer_error": writer.last_error,
        "hub_coordinator_thread_cpu_pct_of_one_core": round(thread_pct, 2),
        "process_cpu_pct_of_one_core_minus_idle": round(process_pct, 2),
        "idle_baseline_cpu_pct": round(100 * idle_cpu / idle_wall, 2),
    }


def measure_writer() -> dict[str, Any]:
    """The existing storage_writer benchmark's functions, imported from its file."""
    spec = importlib.util.spec_from_file_location("storage_writer_bench",
                                                  HERE / "storage_writer.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with tempfile.TemporaryDirectory() as tmp:
        fast = mod.batched(os.path.join(tmp, "a.db"))
        slow = mod.naive(os.path.join(tmp, "b.db"))
    return {"samples": mod.N_SERIES * mod.N_PER_SERIES, "writer_samples_per_s": round(fast),
            "commit_per_sample_samples_per_s": round(slow), "speedup": round(fast / slow, 1)}


def _as_before(chart: Any) -> None:
    """Undo the ChartView's redraw savings: the same-run baseline (the pane before them)."""
    import pyqtgraph as pg
    from PySide6.QtWidgets import QGraphicsItem

    item = chart.plot.getPlotItem()
    item.showGrid(x=True, y=True, alpha=0.2)
    item.getAxis("left").setCacheMode(QGraphicsItem.CacheMode.NoCache)
    item.enableAutoRange(y=True)
    chart._fit_y = lambda x_range: None  # pyqtgraph's per-frame auto-range instead
    # PlotDataItems clipping to the view and downsampling themselves, as the pane had.
    item.setClipToView(True)
    item.setDownsampling(auto=True, mode="peak")
    chart._new_curve = lambda key, colour: chart.plot.plot(
        pen=pg.mkPen(colour, width=1), name=key, connect="finite")


def _build_charts(before: bool) -> tuple[Any, list[Any]]:
    """The pane's nine ChartViews in its 3-column grid, shown at 1600x1000."""
    from PySide6.QtWidgets import QApplication, QGridLayout, QWidget

    from app.panes.monitor.charts import ChartView
    from app.panes.monitor.state import CHARTS

    QApplication.instance() or QApplication([])
    host = QWidget()
    grid = QGridLayout(host)
    charts = [ChartView(spec) for spec in CHARTS]
    for i, chart in enumerate(charts):
        if before:
            _as_before(chart)
        grid.addWidget(chart, i // 3, i % 3)
    host.resize(1600, 1000)
    host.show()
    QApplication.processEvents()
    return host, charts


def _one_frame(charts: list[Any], ts: np.ndarray, values: np.ndarray) -> tuple[float, ...]:
    """(wall ms, CPU ms, setData-only wall ms) for one update + synchronous repaint."""
    n_series = len(values)
    t0, c0 = time.perf_counter(), time.thread_time()
    for c, chart in enumerate(charts):
        mine = {f"s{k}": (ts, values[k]) for k in range(c, n_series, len(charts))}
        if mine:
            chart.update_series(mine, (ts[0], ts[-1]))
    t1 = time.perf_counter()
    # host.repaint() does not paint the graphics views' scenes; repainting each view's
    # viewport forces the real, synchronous draw of every curve.
    for chart in charts:
        chart.plot.viewport().repaint()
    t2, c2 = time.perf_counter(), time.thread_time()
    return (t2 - t0) * 1e3, (c2 - c0) * 1e3, (t1 - t0) * 1e3


class _Series:
    """n live series of WINDOW_POINTS points: "walk" (random walks, like SimulatedGpu's) or
    "noise" (uniform white noise: every segment spans a third of the plot, the worst case
    for line rasterisation)."""

    def __init__(self, n: int, kind: str, rng: np.random.Generator) -> None:
        self.kind, self.rng = kind, rng
        self.ts = time.time() - np.arange(WINDOW_POINTS)[::-1] / GPU_HZ
        if kind == "walk":
            start = rng.uniform(20, 80, (n, 1))
            self.values = np.clip(start + np.cumsum(rng.normal(0, 1, (n, WINDOW_POINTS)),
                                                    axis=1), 0, 100)
        else:
            self.values = rng.uniform(0, 100, (n, WINDOW_POINTS))

    def advance(self) -> None:
        """One 10 Hz frame: the window slides by one point."""
        self.ts = self.ts + 1 / GPU_HZ
        last = self.values[:, -1]
        self.values = np.roll(self.values, -1, axis=1)
        n = len(last)
        self.values[:, -1] = (np.clip(last + self.rng.normal(0, 1, n), 0, 100)
                              if self.kind == "walk" else self.rng.uniform(0, 100, n))


def _chart_frames(n_series: int, frames: int, kind: str,
                  rounds: int = REDRAW_ROUNDS) -> dict[str, np.ndarray]:
    """Per-frame times of the current ChartViews and of the baseline, in alternating rounds so
    both see the same machine load (one window at a time: two shown at once slow each other);
    columns (wall ms, CPU ms, setData-only ms)."""
    from PySide6.QtWidgets import QApplication

    data = _Series(n_series, kind, np.random.default_rng(0))
    out: dict[str, list[tuple[float, ...]]] = {"now": [], "before": []}
    for _ in range(rounds):
        for name in out:
            host, charts = _build_charts(before=name == "before")
            for frame in range(frames // rounds + 5):
                data.advance()
                row = _one_frame(charts, data.ts, data.values)
                if frame >= 5:  # the first frames create curves and legends
                    out[name].append(row)
            host.close()
            QApplication.processEvents()
    return {name: np.array(rows) for name, rows in out.items()}


def _summary(rows: np.ndarray) -> dict[str, float]:
    return {"ms_per_frame_median": round(float(np.median(rows[:, 0])), 2),
            "ms_per_frame_p95": round(float(np.percentile(rows[:, 0], 95)), 2),
            "cpu_ms_per_frame_median": round(float(np.median(rows[:, 1])), 2),
            "set_data_only_ms_median": round(float(np.median(rows[:, 2])), 2)}


def _compare(frames: dict[str, np.ndarray]) -> dict[str, Any]:
    now, before = _summary(frames["now"]), _summary(frames["before"])
    return {**now, "before": before,
            "speedup_vs_before_median": round(before["ms_per_frame_median"]
                                              / now["ms_per_frame_median"], 2),
            "cpu_speedup_vs_before_median": round(before["cpu_ms_per_frame_median"]
                                                  / now["cpu_ms_per_frame_median"], 2)}


def measure_redraw() -> dict[str, Any]:
    """40 live series (random walks and white noise; now and the same-run baseline) and one
    series, ms per frame."""
    walk = _compare(_chart_frames(N_CHART_SERIES, FRAMES, "walk"))
    noise = _compare(_chart_frames(N_CHART_SERIES, FRAMES, "noise"))
    one = _summary(_chart_frames(1, FRAMES, "walk")["now"])
    return {
        "series": N_CHART_SERIES, "points_per_series": WINDOW_POINTS,
        "frames_per_variant": REDRAW_ROUNDS * (FRAMES // REDRAW_ROUNDS),
        "widgets": "the app's ChartView (pyqtgraph PlotWidget, pen width 1, no symbols, no "
                   "OpenGL) x9 in a 3-column grid, 1600x1000, QT_QPA_PLATFORM=offscreen",
        "random_walk_series": walk,
        "white_noise_series": noise,
        "before_is": "the same ChartViews with the redraw savings undone (x and y grid, left "
                     "axis not cached, pyqtgraph auto-range on y every frame, PlotDataItems "
                     "clipping and downsampling), measured in alternating rounds with the "
                     "current ones in this run",
        "method": "per frame: ChartView.update_series (setData) on every chart, then "
                  "viewport().repaint() of each chart's PlotWidget; perf_counter (wall) and "
                  "thread_time (CPU) around both",
        "single_series_ms_median": one["ms_per_frame_median"],
        "ratio_40_vs_1_series": round(walk["ms_per_frame_median"]
                                      / one["ms_per_frame_median"], 2),
    }


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "load_avg_at_start": os.getloadavg()}


def main() -> None:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    info = machine()
    if "--redraw-only" in sys.argv:  # the chart part alone, for working on the pane
        print(json.dumps({"machine": info, "redraw": measure_redraw(),
                          "targets": {"redraw_ms_per_frame_p95": 16.0}}))
        return
    proc, stop, ports = start_servers()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hub = measure_hub(tmp, ports)
    finally:
        stop.set()
        proc.join(10)
    writer = measure_writer()
    redraw = measure_redraw()
    # The target applies to the whole process: each source is scraped on its own thread, so the
    # hub's coordinating thread alone no longer holds the scraping and parsing.
    cpu = hub["process_cpu_pct_of_one_core_minus_idle"]
    print(json.dumps({
        "machine": info,
        "gpus": "simulated (no GPU used): numpy random-walk sources",
        "hub": hub,
        "hub_cpu_method": "process_cpu_pct_of_one_core_minus_idle (the target's figure) = "
                          "getrusage delta of the whole process (one scrape thread per source: "
                          "polling simulated GPUs, scraping and parsing the 10 servers' "
                          "/metrics; the hub thread: ring buffers, submitting; the SQLite "
                          "writer thread) minus an idle baseline of the same length; "
                          "hub_coordinator_thread_cpu_pct_of_one_core = time.thread_time() "
                          "inside the hub's own thread; the HTTP servers run in a separate "
                          "process, not counted",
        "writer": writer,
        "redraw": redraw,
        "targets": TARGETS,
        "met": {
            "hub_plus_writer_process_cpu_under_5pct": cpu < TARGETS["hub_cpu_pct_of_one_core"],
            "writer_at_least_50k_per_s":
                writer["writer_samples_per_s"] >= TARGETS["writer_samples_per_s"],
            "redraw_p95_under_16ms_random_walks":
                redraw["random_walk_series"]["ms_per_frame_p95"]
                < TARGETS["redraw_ms_per_frame_p95"],
            "redraw_p95_under_16ms_white_noise":
                redraw["white_noise_series"]["ms_per_frame_p95"]
                < TARGETS["redraw_ms_per_frame_p95"],
        },
    }))


if __name__ == "__main__":
    main()
