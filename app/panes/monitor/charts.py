"""One live chart: a pyqtgraph plot with a curve per series, an SLO line, PNG and CSV export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QGraphicsItem,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.navigation import on_click
from app.panes.monitor.state import ChartSpec, decimate_peaks, series_csv, stable_y_range

# Distinct hues that read on both the dark and the light theme.
PALETTE = ("#4e9af1", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948", "#76b7b2",
           "#ff9da7")
SLO_COLOUR = "#e15759"


class TimeAxis(pg.DateAxisItem):
    """A date axis that remembers its last tick labels: a window sliding by a fraction of a
    tick per frame keeps the same ticks, and formatting each as a date is pure-Python work."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._labels: dict[tuple, list[str]] = {}

    def tickStrings(self, values, scale, spacing):  # noqa: N802 (pyqtgraph's naming)
        key = (tuple(values), scale, spacing, id(self.zoomLevel), self.utcOffset)
        labels = self._labels.get(key)
        if labels is None:
            if len(self._labels) > 64:  # ticks only move forward: old entries are dead
                self._labels.clear()
            labels = self._labels[key] = super().tickStrings(values, scale, spacing)
        return labels


class WindowCurve(pg.PlotCurveItem):
    """A curve whose bounding rectangle is its data's extent, found once per setData.

    pyqtgraph's own adds pen and pixel padding through several Python calls and recomputes it
    whenever the view moves, which a sliding window does every frame; the ViewBox clips its
    children, so the padding buys nothing here."""

    def setData(self, *args, **kwargs) -> None:  # noqa: N802 (pyqtgraph's naming)
        self._extent: QRectF | None = None
        super().setData(*args, **kwargs)

    def boundingRect(self) -> QRectF:  # noqa: N802 (Qt's naming)
        extent = getattr(self, "_extent", None)
        if extent is None:
            extent = self._extent = _extent(self.xData, self.yData)
        return extent


def _extent(x: np.ndarray | None, y: np.ndarray | None) -> QRectF:
    if x is None or y is None or not len(x):
        return QRectF()
    x0, x1 = float(np.fmin.reduce(x)), float(np.fmax.reduce(x))
    y0, y1 = float(np.fmin.reduce(y)), float(np.fmax.reduce(y))
    if not all(np.isfinite((x0, x1, y0, y1))):
        return QRectF()
    # A flat line still needs some height (an empty rectangle is never drawn).
    pad_y = max(y1 - y0, abs(y1), 1e-12) * 1e-3
    pad_x = max(x1 - x0, 1e-3) * 1e-3
    return QRectF(x0 - pad_x, y0 - pad_y, x1 - x0 + 2 * pad_x, y1 - y0 + 2 * pad_y)


class ChartView(QWidget):
    """A titled plot whose curves are created once per series and updated with setData."""

    export_requested = Signal(str, str)  # (chart_id, "png" or "csv")

    def __init__(self, spec: ChartSpec, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.spec = spec
        self.setObjectName(f"chart-{spec.chart_id}")
        self.plot = pg.PlotWidget(axisItems={"bottom": TimeAxis()})
        self.plot.setMinimumHeight(150)
        self.plot.setLabel("left", units=None, text=spec.unit)
        item = self.plot.getPlotItem()
        item.addLegend(offset=(4, 4), labelTextSize="7pt")
        self._configure_for_speed(item)
        self.curves: dict[str, pg.PlotCurveItem] = {}
        self.data: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # key -> (ts, lo, hi) in the chart's unit: the histogram bucket each p99 lies in.
        self.bands: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._band_items: dict[str, tuple[pg.PlotCurveItem, pg.PlotCurveItem,
                                          pg.FillBetweenItem]] = {}
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
        """Keep what is redrawn per frame small (benchmarks/monitor.py measures the frame with
        and without these): most of a frame went to repainting axes and grid."""
        # Horizontal grid lines only: vertical ones belong to the time axis, which slides every
        # frame, so they would force the grid to be re-rendered on each one.
        item.showGrid(x=False, y=True, alpha=0.2)
        # The left axis (and its grid) becomes a cached pixmap, redrawn only when y changes...
        item.getAxis("left").setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        # ...which is rare because y is set by hand to a stable "nice" range (see
        # stable_y_range) instead of pyqtgraph's per-frame auto-range over every curve's bounds.
        # x follows the window by hand too (clipping to the view needs a fixed x range).
        item.enableAutoRange(x=False, y=False)
        # The unit is in the label already; left on, automatic SI prefixes re-render each
        # axis label (the hidden top and right ones too) as HTML on every range change, i.e.
        # every frame.
        for side in ("left", "bottom", "top", "right"):
            item.getAxis(side).enableAutoSIPrefix(False)
        self._y_range: tuple[float, float] | None = None

    def _build(self) -> None:
        header = QHBoxLayout()
        header.setContentsMargins(0, 0, 0, 0)
        header.addWidget(self.title, 1)
        for fmt in ("png", "csv"):
            button = QToolButton(text=fmt.upper(), autoRaise=True,
                                 toolTip=f"Export this chart as {fmt.upper()}")
            on_click(button.clicked, lambda f=fmt: self.export_requested.emit(
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
                      x_range: tuple[float, float] | None,
                      bands: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
                      ) -> None:
        """Show ``data`` (series key -> raw timestamps and values) and ``bands`` (a drawn
        series' key -> timestamps, lower and upper ends); scales to the chart's unit."""
        self.data = {k: (ts, values * self.spec.scale) for k, (ts, values) in data.items()}
        for key in [k for k in self.curves if k not in self.data]:
            self.plot.removeItem(self.curves.pop(key))
        for key, (ts, values) in self.data.items():
            curve = self.curves.get(key)
            if curve is None:
                curve = self._new_curve(key, PALETTE[len(self.curves) % len(PALETTE)])
                self.curves[key] = curve
            curve.setData(*decimate_peaks(ts, values, self._max_points()))
        self._update_bands(bands or {})
        if x_range is not None:
            self.plot.setXRange(*x_range, padding=0)
            self._fit_y(x_range)

    def _update_bands(self, bands: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """A translucent band (the line's colour) between each series' lower and upper ends;
        y is fitted to the lines only, so a wide last bucket cannot flatten them."""
        self.bands = {k: (ts, lo * self.spec.scale, hi * self.spec.scale)
                      for k, (ts, lo, hi) in bands.items() if k in self.curves and len(ts)}
        for key in [k for k in self._band_items if k not in self.bands]:
            for item in self._band_items.pop(key):
                self.plot.removeItem(item)
        for key, (ts, lo, hi) in self.bands.items():
            if key not in self._band_items:
                colour = QColor(self.curves[key].opts["pen"].color())
                colour.setAlpha(60)
                edges = (pg.PlotCurveItem(pen=pg.mkPen(None)), pg.PlotCurveItem(pen=pg.mkPen(None)))
                fill = pg.FillBetweenItem(*edges, brush=pg.mkBrush(colour))
                fill.setZValue(-1)  # behind the lines
                for item in (*edges, fill):
                    self.plot.addItem(item)
                self._band_items[key] = (*edges, fill)
            lower, upper, _ = self._band_items[key]
            lower.setData(ts, lo)
            upper.setData(ts, hi)

    def _fit_y(self, x_range: tuple[float, float]) -> None:
        """Set y to a stable range holding the points inside ``x_range``; unchanged if it is."""
        visible = [values[(ts >= x_range[0]) & (ts <= x_range[1])]
                   for ts, values in self.data.values()]
        y_range = stable_y_range(visible, self._y_range)
        if y_range != self._y_range:
            self._y_range = y_range
            self.plot.setYRange(*y_range, padding=0)

    def _new_curve(self, key: str, colour: str) -> pg.PlotCurveItem:
        # A bare curve item: PlotDataItem's clipping and downsampling cost more per setData
        # than they save here, where the data is already the window (decimate_peaks covers
        # long windows with more points than pixels).
        curve = WindowCurve(pen=pg.mkPen(colour, width=1), name=key, connect="finite")
        self.plot.addItem(curve)
        return curve

    def _max_points(self) -> int:
        """Two points (a bin's min and max) per horizontal pixel of the plot."""
        return 2 * max(200, int(self.plot.getPlotItem().getViewBox().width()))

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
