"""One live chart: a pyqtgraph plot with a curve per series, an SLO line, PNG and CSV export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QGraphicsItem,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.panes.monitor.state import ChartSpec, series_csv, stable_y_range

# Distinct hues that read on both the dark and the light theme.
PALETTE = ("#4e9af1", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948", "#76b7b2",
           "#ff9da7")
SLO_COLOUR = "#e15759"


class ChartView(QWidget):
    """A titled plot whose curves are created once per series and updated with setData."""

    export_requested = Signal(str, str)  # (chart_id, "png" or "csv")

    def __init__(self, spec: ChartSpec, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.spec = spec
        self.setObjectName(f"chart-{spec.chart_id}")
        self.plot = pg.PlotWidget(axisItems={"bottom": pg.DateAxisItem()})
        self.plot.setMinimumHeight(150)
        self.plot.setLabel("left", units=None, text=spec.unit)
        item = self.plot.getPlotItem()
        item.addLegend(offset=(4, 4), labelTextSize="7pt")
        item.setClipToView(True)
        item.setDownsampling(auto=True, mode="peak")
        self._configure_for_speed(item)
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.data: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.slo_line: pg.InfiniteLine | None = None
        if spec.slo is not None:
            pen = pg.mkPen(SLO_COLOUR, width=1, style=Qt.PenStyle.DashLine)
            self.slo_line = pg.InfiniteLine(angle=0, pen=pen, label="SLO",
                                            labelOpts={"color": SLO_COLOUR, "position": 0.02})
            item.addItem(self.slo_line)
        self.title = QLabel(f"<b>{spec.title}</b> <span>({spec.unit})</span>")
        self.title.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self._build()

    def _configure_for_speed(self, item: pg.PlotItem) -> None:
        """Keep what is redrawn per frame small: measured, these three took a frame of 40 series
        from ~60 ms to ~25 ms (benchmarks/monitor.py), most of it axis and grid repainting."""
        # Horizontal grid lines only: vertical ones belong to the time axis, which slides every
        # frame, so they would force the grid to be re-rendered on each one.
        item.showGrid(x=False, y=True, alpha=0.2)
        # The left axis (and its grid) becomes a cached pixmap, redrawn only when y changes...
        item.getAxis("left").setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        # ...which is rare because y is set by hand to a stable "nice" range (see
        # stable_y_range) instead of pyqtgraph's per-frame auto-range over every curve's bounds.
        # x follows the window by hand too (clipping to the view needs a fixed x range).
        item.enableAutoRange(x=False, y=False)
        self._y_range: tuple[float, float] | None = None

    def _build(self) -> None:
        header = QHBoxLayout()
        header.setContentsMargins(0, 0, 0, 0)
        header.addWidget(self.title, 1)
        for fmt in ("png", "csv"):
            button = QToolButton(text=fmt.upper(), autoRaise=True,
                                 toolTip=f"Export this chart as {fmt.upper()}")
            button.clicked.connect(lambda _=False, f=fmt: self.export_requested.emit(
                self.spec.chart_id, f))
            header.addWidget(button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(0)
        layout.addLayout(header)
        layout.addWidget(self.plot, 1)

    def set_slo(self, value: float | None) -> None:
        """Move the SLO line (in the chart's unit); None hides it."""
        if self.slo_line is not None:
            self.slo_line.setVisible(value is not None)
            if value is not None:
                self.slo_line.setValue(value)

    def update_series(self, data: dict[str, tuple[np.ndarray, np.ndarray]],
                      x_range: tuple[float, float] | None) -> None:
        """Show ``data`` (series key -> raw timestamps and values); scales to the chart's unit."""
        self.data = {k: (ts, values * self.spec.scale) for k, (ts, values) in data.items()}
        for key in [k for k in self.curves if k not in self.data]:
            self.plot.removeItem(self.curves.pop(key))
        for key, (ts, values) in self.data.items():
            curve = self.curves.get(key)
            if curve is None:
                colour = PALETTE[len(self.curves) % len(PALETTE)]
                curve = self.plot.plot(pen=pg.mkPen(colour, width=1), name=key, connect="finite")
                self.curves[key] = curve
            curve.setData(ts, values)
        if x_range is not None:
            self.plot.setXRange(*x_range, padding=0)
            self._fit_y(x_range)

    def _fit_y(self, x_range: tuple[float, float]) -> None:
        """Set y to a stable range holding the points inside ``x_range``; unchanged if it is."""
        visible = [values[(ts >= x_range[0]) & (ts <= x_range[1])]
                   for ts, values in self.data.values()]
        y_range = stable_y_range(visible, self._y_range)
        if y_range != self._y_range:
            self._y_range = y_range
            self.plot.setYRange(*y_range, padding=0)

    def forget_y_range(self) -> None:
        """Refit y on the next update (after the user zoomed while paused)."""
        self._y_range = None

    def point_count(self) -> int:
        """How many points the chart holds now."""
        return sum(len(ts) for ts, _ in self.data.values())

    def export_png(self, path: str | Path) -> None:
        """Write the plot as a PNG image."""
        from pyqtgraph.exporters import ImageExporter

        exporter = ImageExporter(self.plot.getPlotItem())
        exporter.parameters()["width"] = max(800, self.plot.width())
        exporter.export(str(path))

    def export_csv(self, path: str | Path) -> None:
        """Write the chart's data (in the chart's unit) as CSV."""
        Path(path).write_text(series_csv(self.data), encoding="utf-8")
