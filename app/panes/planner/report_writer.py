"""Writes the report: HTML with embedded PNG charts, and PDF by printing the same HTML with Qt."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QMarginsF, QSizeF, QUrl
from PySide6.QtGui import QImage, QPageLayout, QPageSize, QPdfWriter, QTextDocument

from app.panes.planner.charts import render_png
from app.panes.planner.figures import ChartSpec
from app.panes.planner.report import report_html
from app.panes.planner.state import Outcome


def _png_bytes(image: QImage) -> bytes:
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    buffer.close()
    return bytes(data.data())


def write_html(outcome: Outcome, charts: dict[str, ChartSpec], path: Path,
               runs: Sequence = ()) -> Path:
    """A self-contained HTML file: the charts are embedded as base64 PNG data URIs."""
    images = {key: "data:image/png;base64," + base64.b64encode(
        _png_bytes(render_png(spec))).decode("ascii") for key, spec in charts.items()}
    path = Path(path)
    path.write_text(report_html(outcome, images, runs=list(runs)), encoding="utf-8")
    return path


PDF_IMAGE_FRACTION = 0.8  # of the printable width


def pdf_layout() -> QPageLayout:
    """A4 portrait with 15 mm margins, the PDF's pages."""
    return QPageLayout(QPageSize(QPageSize.PageSizeId.A4), QPageLayout.Orientation.Portrait,
                       QMarginsF(15, 15, 15, 15), QPageLayout.Unit.Millimeter)


def pdf_document(outcome: Outcome, charts: dict[str, ChartSpec],
                 layout: QPageLayout | None = None, runs: Sequence = ()) -> QTextDocument:
    """The report laid out page by page at the printable width of ``layout``."""
    document = QTextDocument()
    # QTextDocument does not decode data URIs, so the PDF names each chart as a resource.
    names = {}
    for key, spec in charts.items():
        name = f"chart-{key}.png"
        document.addResource(QTextDocument.ResourceType.ImageResource, QUrl(name),
                             render_png(spec))
        names[key] = name
    # Laid out at the paper's printable width in the document's own unit (96 dpi pixels), so
    # printing scales whole pages onto the paper; left to print_, charts ran past the margin.
    page = QSizeF((layout or pdf_layout()).paintRectPixels(96).size())
    # The body's margins take the rest of the width (the report test checks the fit).
    document.setHtml(report_html(outcome, names, int(page.width() * PDF_IMAGE_FRACTION),
                                 list(runs)))
    document.setPageSize(page)
    return document


def write_pdf(outcome: Outcome, charts: dict[str, ChartSpec], path: Path,
              runs: Sequence = ()) -> Path:
    """An A4 PDF of the same report through QTextDocument and QPdfWriter."""
    layout = pdf_layout()
    document = pdf_document(outcome, charts, layout, runs)
    writer = QPdfWriter(str(path))
    writer.setPageLayout(layout)
    writer.setTitle(f"Serving plan: {outcome.model.name}")
    writer.setCreator("servescope")
    document.print_(writer)
    return Path(path)


def write_report(outcome: Outcome, charts: dict[str, ChartSpec], path: Path,
                 runs: Sequence = ()) -> list[Path]:
    """The HTML report at ``path`` (.html) and, beside it, its PDF twin; returns both paths.
    ``runs``: the plan runs made on this machine (app.plan_run.ValidationRow), tabled beside
    their predictions."""
    path = Path(path)
    html_path = path if path.suffix.lower() in (".html", ".htm") else path.with_suffix(".html")
    return [write_html(outcome, charts, html_path, runs),
            write_pdf(outcome, charts, html_path.with_suffix(".pdf"), runs)]
