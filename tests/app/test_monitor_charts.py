"""The Monitor pane's chart: a stable y range (so its cached axis is rarely redrawn)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from app.panes.monitor.state import CHARTS, nice_ceiling, stable_y_range


@pytest.mark.parametrize(("x", "top"), [(0.7, 1.0), (1.0, 1.0), (1.5, 2.0), (3.0, 5.0),
                                        (60.0, 100.0), (0.003, 0.005), (2e9, 2e9)])
def test_nice_ceiling(x, top):
    assert nice_ceiling(x) == pytest.approx(top)


def test_stable_y_range_keeps_a_range_that_still_fits_and_refits_otherwise():
    assert stable_y_range([np.array([1.0, 60.0, np.nan])], None) == (0.0, 100.0)
    assert stable_y_range([np.array([1.0, 99.0])], (0.0, 100.0)) == (0.0, 100.0)
    assert stable_y_range([np.array([1.0, 101.0])], (0.0, 100.0)) == (0.0, 200.0)
    # Data that shrank to under 30% of the range gets a tighter one.
    assert stable_y_range([np.array([1.0, 20.0])], (0.0, 100.0)) == (0.0, 50.0)
    assert stable_y_range([np.array([-3.0, 20.0])], (0.0, 100.0)) == (-5.0, 50.0)
    assert stable_y_range([np.array([np.nan])], (0.0, 5.0)) == (0.0, 5.0)
    assert stable_y_range([], None) == (0.0, 1.0)
    assert stable_y_range([np.zeros(3)], None) == (0.0, 1.0)


def test_chart_sets_x_to_the_window_and_y_to_a_stable_range(qtbot):
    from PySide6.QtWidgets import QGraphicsItem

    from app.panes.monitor.charts import ChartView

    chart = ChartView(CHARTS[0])
    qtbot.addWidget(chart)
    now = time.time()
    ts = now - np.arange(600)[::-1] / 10
    chart.update_series({"a/util_pct": (ts, np.linspace(0, 60, 600))}, (ts[0], ts[-1]))
    (x0, x1), (y0, y1) = chart.plot.getPlotItem().getViewBox().viewRange()
    assert (x0, x1) == pytest.approx((ts[0], ts[-1])) and (y0, y1) == pytest.approx((0, 100))
    # Points outside the window do not count; a new maximum inside it refits.
    chart.update_series({"a/util_pct": (ts, np.r_[np.full(599, 50.0), 150.0])},
                        (ts[0], ts[-1] - 1))
    assert chart.plot.getPlotItem().getViewBox().viewRange()[1] == pytest.approx((0, 100))
    chart.update_series({"a/util_pct": (ts, np.r_[np.full(599, 50.0), 150.0])},
                        (ts[0], ts[-1]))
    assert chart.plot.getPlotItem().getViewBox().viewRange()[1] == pytest.approx((0, 200))
    left = chart.plot.getPlotItem().getAxis("left")
    assert left.cacheMode() == QGraphicsItem.CacheMode.DeviceCoordinateCache
    assert chart.point_count() == 600
