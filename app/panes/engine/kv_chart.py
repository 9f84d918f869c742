"""Live chart of the KV cache over the engine's steps: blocks used, tokens evicted, prefix hits."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QWidget

from app.panes.engine.state import StepSeries
from app.panes.monitor.charts import PALETTE

# (attribute of StepSeries, plot title): one small plot each, since their units differ.
SERIES = (
    ("kv_blocks_used", "KV blocks used"),
    ("tokens_evicted", "Tokens evicted (total)"),
    ("prefix_hit_rate", "Prefix hit rate"),
)


class KVChart(pg.GraphicsLayoutWidget):
    """Three stacked plots sharing the step axis, redrawn with setData when steps arrive."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setMinimumHeight(200)
        self.plots: dict[str, pg.PlotItem] = {}
        self.curves: dict[str, pg.PlotDataItem] = {}
        first = None
        tick_font = QFont()
        tick_font.setPointSize(7)
        for row, (key, title) in enumerate(SERIES):
            plot = self.addPlot(row=row, col=0)
            plot.setTitle(title, size="8pt")
            plot.showGrid(x=True, y=True, alpha=0.2)
            plot.setMenuEnabled(False)
            for side in ("left", "bottom"):
                plot.getAxis(side).setStyle(tickFont=tick_font)
            plot.getAxis("left").setWidth(40)
            if first is None:
                first = plot
            else:
                plot.setXLink(first)
            if row < len(SERIES) - 1:
                plot.getAxis("bottom").setStyle(showValues=False)
            else:
                plot.setLabel("bottom", "engine step", **{"font-size": "8pt"})
            self.plots[key] = plot
            self.curves[key] = plot.plot(pen=pg.mkPen(PALETTE[row], width=1),
                                         connect="finite")
        rate = self.plots["prefix_hit_rate"]
        rate.setYRange(0, 1, padding=0.05)
        rate.enableAutoRange(y=False)
        rate.getAxis("left").setTicks([[(0.0, "0"), (0.5, "50%"), (1.0, "100%")]])

    def update_series(self, series: StepSeries) -> None:
        """Show the recorded steps."""
        steps = np.asarray(series.steps, dtype=float)
        for key, _ in SERIES:
            self.curves[key].setData(steps, np.asarray(getattr(series, key), dtype=float))

    def values(self, key: str) -> np.ndarray:
        """The y values a curve shows now (for tests and exports)."""
        y = self.curves[key].getData()[1]
        return np.asarray([] if y is None else y)
