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


def test_decimate_peaks_keeps_every_minimum_and_maximum():
    from app.panes.monitor.state import decimate_peaks

    ts = np.arange(10.0)
    values = np.array([1.0, 5, 2, 2, np.nan, np.nan, 7, 0, 3, 4])
    same_ts, same = decimate_peaks(ts, values, 10)
    assert same_ts is ts and same is values  # few enough: untouched
    out_ts, out_values = decimate_peaks(ts, values, 6)  # 3 runs of 4, 4 and 2 points
    assert out_values.tolist() == [1.0, 5.0, 0.0, 7.0, 3.0, 4.0]
    assert out_ts.tolist() == [0.0, 3.0, 4.0, 7.0, 8.0, 9.0]
    gap_ts, gap = decimate_peaks(np.arange(8.0), np.array([1.0, 2, np.nan, np.nan, 3, 4, 5, 6]), 8)
    assert len(gap) == 8  # at the limit: nothing merged, the gap stays a gap
    _, all_nan = decimate_peaks(np.arange(6.0), np.array([np.nan, np.nan, np.nan, 2, 3, 4]), 4)
    assert np.isnan(all_nan[:2]).all() and all_nan[2:].tolist() == [2.0, 4.0]  # gap kept


def test_time_axis_labels_match_pyqtgraphs_date_axis(qtbot):
    import pyqtgraph as pg

    from app.panes.monitor.charts import TimeAxis

    mine, theirs = TimeAxis(), pg.DateAxisItem()
    start = 1_700_000_000.0
    for level in theirs.zoomLevels.values():  # every zoom level, finest to coarsest
        spacing = level.tickSpecs[0].spacing
        mine.zoomLevel = theirs.zoomLevel = level
        ticks = [start + spacing * i for i in range(5)]
        for _ in range(2):  # the second call answers from the memory
            assert mine.tickStrings(ticks, 1.0, spacing) == theirs.tickStrings(ticks, 1.0,
                                                                               spacing)


def test_chart_curves_span_their_data_and_long_series_are_decimated(qtbot):
    from app.panes.monitor.charts import ChartView

    chart = ChartView(next(spec for spec in CHARTS if spec.chart_id == "queue"))
    qtbot.addWidget(chart)
    ts = 1_700_000_000.0 + np.arange(20_000) / 10
    flat = np.full(20_000, 3.0)
    chart.update_series({"a/requests_running": (ts, flat)}, (ts[0], ts[-1]))
    curve = chart.curves["a/requests_running"]
    rect = curve.boundingRect()
    assert rect.left() < ts[0] and rect.right() > ts[-1]
    assert rect.top() < 3.0 < rect.bottom()  # a flat line still has some height
    assert len(curve.xData) <= 2 * max(200, chart.plot.getPlotItem().getViewBox().width())
    assert chart.point_count() == 20_000  # CSV export keeps every point
