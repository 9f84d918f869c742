"""Live bar chart of speculative decoding's acceptance by draft position (vLLM's per-position
counter over its drafts: the share of verifications whose i-th draft token was accepted)."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QWidget

from app.panes.monitor.charts import PALETTE


def acceptance_by_position(summary: dict | None) -> list[float]:
    """Per draft position, accepted tokens there over verification steps with drafts (vLLM's
    spec_decode_num_accepted_tokens_per_pos / spec_decode_num_drafts); empty before any."""
    if not summary or not summary["drafts"]:
        return []
    return [n / summary["drafts"] for n in summary["accepted_per_position"]]


class SpecChart(pg.PlotWidget):
    """One bar per draft position, redrawn when the counters change."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setMinimumHeight(90)
        self.setMaximumHeight(130)
        plot = self.getPlotItem()
        plot.setTitle("Draft tokens accepted, by position", size="8pt")
        plot.setMenuEnabled(False)
        plot.setMouseEnabled(x=False, y=False)
        tick_font = QFont()
        tick_font.setPointSize(7)
        for side in ("left", "bottom"):
            plot.getAxis(side).setStyle(tickFont=tick_font)
        plot.getAxis("left").setWidth(40)
        plot.getAxis("left").setTicks([[(0.0, "0"), (0.5, "50%"), (1.0, "100%")]])
        plot.setYRange(0, 1, padding=0.05)
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.6, brush=PALETTE[3])
        plot.addItem(self.bars)
        self.shown: list[float] = []

    def update_rates(self, rates: list[float]) -> None:
        if rates == self.shown:
            return
        self.shown = list(rates)
        positions = np.arange(1, len(rates) + 1, dtype=float)
        self.bars.setOpts(x=positions, height=np.asarray(rates, dtype=float))
        if rates:
            self.getPlotItem().setXRange(0.4, len(rates) + 0.6, padding=0)
            self.getPlotItem().getAxis("bottom").setTicks(
                [[(float(i), str(i)) for i in range(1, len(rates) + 1)]])
