"""QPainter charts drawn from a ChartSpec: one widget for the pane, one function for report PNGs."""

from __future__ import annotations

import math

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QImage, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from app.panes.planner.figures import COLOURS, SLO_COLOUR, ChartSpec

MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 4.8, 1.0, 2.6, 2.6  # in line heights


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high] (1, 2, 5 x 10^k steps)."""
    if not math.isfinite(low) or not math.isfinite(high) or high <= low:
        return [low]
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    start = math.floor(low / step) * step
    return [start + i * step for i in range(int((high - start) / step) + 2)
            if start + i * step <= high + step * 1e-9]


def _fmt(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def paint_chart(painter: QPainter, rect: QRectF, spec: ChartSpec, text: QColor,
                font: QFont) -> None:
    """Draw ``spec`` inside ``rect`` with axis text in ``text`` colour at ``font``'s size."""
    painter.save()
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setFont(font)
    line = painter.fontMetrics().height()
    title = QFont(font)
    title.setBold(True)
    painter.setFont(title)
    painter.setPen(text)
    painter.drawText(QRectF(rect.left(), rect.top(), rect.width(), line * 1.4),
                     Qt.AlignmentFlag.AlignCenter, spec.title)
    painter.setFont(font)
    if spec.note:
        painter.drawText(QRectF(rect.left(), rect.top() + line * 1.2, rect.width(), line * 1.2),
                         Qt.AlignmentFlag.AlignCenter, spec.note)
    if spec.empty:
        painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, "no data yet")
    elif spec.stacked is not None:
        _paint_stacked(painter, rect, spec, text, line)
    else:
        _paint_xy(painter, rect, spec, text, line)
    painter.restore()


def _plot_area(rect: QRectF, line: float, left: float = MARGIN_LEFT) -> QRectF:
    return rect.adjusted(line * left, line * MARGIN_TOP, -line * MARGIN_RIGHT,
                         -line * MARGIN_BOTTOM)


def _ranges(spec: ChartSpec) -> tuple[float, float, float, float]:
    xs = [x for s in spec.series for x in s.xs] + [v for v, _ in spec.vlines]
    ys = [y for s in spec.series for y in s.ys] + [v for v, _ in spec.hlines]
    bar_width = _bar_width(spec)
    x0, x1 = min(xs), max(xs) + bar_width
    y0 = 0.0 if any(s.style == "bars" for s in spec.series) else min(ys)
    y1 = max(ys)
    if x1 <= x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 <= y0:
        y0, y1 = y0 - 1, y1 + 1
    pad = (y1 - y0) * 0.08
    return x0, x1, (y0 - pad if y0 != 0.0 else 0.0), y1 + pad


def _bar_width(spec: ChartSpec) -> float:
    for s in spec.series:
        if s.style == "bars" and len(s.xs) > 1:
            return s.xs[1] - s.xs[0]
        if s.style == "bars":
            return 1.0
    return 0.0


def _axes(painter: QPainter, area: QRectF, text: QColor, line: float,
          x_ticks: list[float], y_ticks: list[float], sx, sy, spec: ChartSpec) -> None:
    grid = QColor(text)
    grid.setAlpha(40)
    for y in y_ticks:
        painter.setPen(QPen(grid, 1))
        painter.drawLine(QPointF(area.left(), sy(y)), QPointF(area.right(), sy(y)))
        painter.setPen(text)
        painter.drawText(QRectF(area.left() - line * 3.4, sy(y) - line / 2, line * 3.2, line),
                         Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, _fmt(y))
    for x in x_ticks:
        painter.setPen(text)
        painter.drawText(QRectF(sx(x) - line * 2, area.bottom() + line * 0.2, line * 4, line),
                         Qt.AlignmentFlag.AlignCenter, _fmt(x))
    painter.setPen(QPen(text, 1))
    painter.drawLine(area.bottomLeft(), area.bottomRight())
    painter.drawLine(area.bottomLeft(), area.topLeft())
    painter.drawText(QRectF(area.left(), area.bottom() + line * 1.2, area.width(), line * 1.2),
                     Qt.AlignmentFlag.AlignCenter, spec.x_label)
    painter.save()
    painter.translate(area.left() - line * (MARGIN_LEFT - 0.1), area.center().y())
    painter.rotate(-90)
    painter.drawText(QRectF(-area.height() / 2, 0, area.height(), line),
                     Qt.AlignmentFlag.AlignCenter, spec.y_label)
    painter.restore()


def _paint_xy(painter: QPainter, rect: QRectF, spec: ChartSpec, text: QColor,
              line: float) -> None:
    area = _plot_area(rect, line)
    x0, x1, y0, y1 = _ranges(spec)

    def sx(x: float) -> float:
        return area.left() + (x - x0) / (x1 - x0) * area.width()

    def sy(y: float) -> float:
        return area.bottom() - (y - y0) / (y1 - y0) * area.height()

    x_ticks = [t for t in nice_ticks(x0, x1) if x0 <= t <= x1]
    y_ticks = [t for t in nice_ticks(y0, y1) if y0 <= t <= y1]
    _axes(painter, area, text, line, x_ticks, y_ticks, sx, sy, spec)
    width = _bar_width(spec)
    radius = max(2.5, line * 0.22)
    for s in spec.series:
        colour = QColor(s.colour)
        if s.style == "bars":
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(colour)
            for x, y in zip(s.xs, s.ys, strict=True):
                painter.drawRect(QRectF(QPointF(sx(x) + 0.5, sy(y)),
                                        QPointF(sx(x + width) - 0.5, sy(y0))))
        elif s.style == "line":
            painter.setPen(QPen(colour, max(1.0, line * 0.1)))
            points = [QPointF(sx(x), sy(y)) for x, y in zip(s.xs, s.ys, strict=True)]
            for a, b in zip(points, points[1:], strict=False):
                painter.drawLine(a, b)
        else:
            painter.setPen(QPen(text if s.style == "marker" else colour, 1))
            painter.setBrush(colour)
            r = radius * (2.0 if s.style == "marker" else 1.0)
            for x, y in zip(s.xs, s.ys, strict=True):
                painter.drawEllipse(QPointF(sx(x), sy(y)), r, r)
    _reference_lines(painter, area, spec, sx, line)
    _legend(painter, area, [(s.name, s.colour) for s in spec.series if s.style != "bars"], line)


def _reference_lines(painter: QPainter, area: QRectF, spec: ChartSpec, sx, line: float) -> None:
    for i, (x, label) in enumerate(spec.vlines):
        colour = QColor(SLO_COLOUR if label.startswith("SLO") else COLOURS[1])
        painter.setPen(QPen(colour, max(1.0, line * 0.1), Qt.PenStyle.DashLine))
        painter.drawLine(QPointF(sx(x), area.top()), QPointF(sx(x), area.bottom()))
        width = painter.fontMetrics().horizontalAdvance(label)
        # Near the right edge the label goes on the line's left so it is not clipped.
        left = sx(x) + 4 if sx(x) + width + 4 < area.right() else sx(x) - width - 4
        painter.drawText(QPointF(left, area.top() + line * (1 + i)), label)


def _legend(painter: QPainter, area: QRectF, items: list[tuple[str, str]], line: float) -> None:
    y = area.top() + line * 0.2
    for name, colour in items:
        width = painter.fontMetrics().horizontalAdvance(name)
        x = area.right() - width - line * 1.2
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(QColor(colour))
        painter.drawRect(QRectF(x - line * 0.9, y + line * 0.25, line * 0.6, line * 0.5))
        painter.setPen(QColor(colour))
        painter.drawText(QPointF(x, y + line * 0.8), name)
        y += line


def _paint_stacked(painter: QPainter, rect: QRectF, spec: ChartSpec, text: QColor,
                   line: float) -> None:
    stacked = spec.stacked
    label_width = max(painter.fontMetrics().horizontalAdvance(r) for r in stacked.rows) / line
    area = _plot_area(rect, line, left=label_width + 0.8)
    area.setBottom(area.bottom() - line * 1.2)  # room for the parts legend
    top = max(sum(v) for v in stacked.values) * 1.05
    ticks = [t for t in nice_ticks(0.0, top) if t <= top]

    def sx(x: float) -> float:
        return area.left() + x / top * area.width()

    row_h = area.height() / len(stacked.rows)
    for i, (label, values) in enumerate(zip(stacked.rows, stacked.values, strict=True)):
        y = area.top() + i * row_h
        painter.setPen(text)
        painter.drawText(QRectF(rect.left(), y, area.left() - rect.left() - line * 0.4, row_h),
                         Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, label)
        left = 0.0
        for j, value in enumerate(values):
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(QColor(COLOURS[j % len(COLOURS)]))
            painter.drawRect(QRectF(QPointF(sx(left), y + row_h * 0.18),
                                    QPointF(sx(left + value), y + row_h * 0.82)))
            left += value
    painter.setPen(text)
    for t in ticks:
        painter.drawText(QRectF(sx(t) - line * 2, area.bottom() + line * 0.2, line * 4, line),
                         Qt.AlignmentFlag.AlignCenter, _fmt(t))
    painter.drawLine(area.bottomLeft(), area.bottomRight())
    x = rect.left() + line * 0.5  # the row labels leave the plot narrow; use the full width
    for j, part in enumerate(stacked.parts):
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(QColor(COLOURS[j % len(COLOURS)]))
        painter.drawRect(QRectF(x, area.bottom() + line * 1.55, line * 0.6, line * 0.5))
        painter.setPen(text)
        painter.drawText(QPointF(x + line * 0.8, area.bottom() + line * 2.05), part)
        x += painter.fontMetrics().horizontalAdvance(part) + line * 1.6


def render_png(spec: ChartSpec, size: QSize | None = None, point_size: float = 10.0) -> QImage:
    """The chart on a white background, for the report (printed pages are light)."""
    size = size or QSize(900, 480)
    image = QImage(size, QImage.Format.Format_ARGB32)
    image.fill(QColor("white"))
    painter = QPainter(image)
    font = QFont()
    font.setPointSizeF(point_size)
    paint_chart(painter, QRectF(0, 0, size.width(), size.height()), spec, QColor("#1d1f23"), font)
    painter.end()
    return image


class ChartView(QWidget):
    """A widget painting one ChartSpec with the palette's text colour and the widget's font."""

    def __init__(self, spec: ChartSpec, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.spec = spec
        self.setMinimumSize(280, 200)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def set_spec(self, spec: ChartSpec) -> None:
        self.spec = spec
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 (Qt override)
        painter = QPainter(self)
        paint_chart(painter, QRectF(self.rect()).adjusted(4, 4, -4, -4), self.spec,
                    self.palette().windowText().color(), self.font())
        painter.end()
