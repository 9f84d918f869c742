"""Result views: the sortable ranked table, the what-if controls and the scenario comparison."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QSortFilterProxyModel, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHeaderView,
    QLabel,
    QSpinBox,
    QTableView,
    QTableWidget,
    QTableWidgetItem,
    QWidget,
)

from app.panes.planner.state import TABLE_COLUMNS, Scenarios, WhatIf, table_row
from planner.search import Plan

PLAN_ROLE = Qt.ItemDataRole.UserRole + 1


class PlanTableModel(QAbstractTableModel):
    """The ranked plans; the sort role carries raw numbers so columns sort numerically."""

    def __init__(self) -> None:
        super().__init__()
        self._plans: list[Plan] = []
        self._rows: list[tuple[Any, ...]] = []

    def set_plans(self, plans: list[Plan]) -> None:
        self.beginResetModel()
        self._plans = list(plans)
        self._rows = [table_row(p) for p in plans]
        self.endResetModel()

    def rowCount(self, parent: QModelIndex = QModelIndex()) -> int:  # noqa: N802, B008
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: QModelIndex = QModelIndex()) -> int:  # noqa: N802, B008
        return 0 if parent.isValid() else len(TABLE_COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,  # noqa: N802
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        return TABLE_COLUMNS[section] if orientation == Qt.Orientation.Horizontal else section + 1

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        value = self._rows[index.row()][index.column()]
        if role == PLAN_ROLE:
            return self._plans[index.row()]
        if role == Qt.ItemDataRole.UserRole:
            return value
        if role == Qt.ItemDataRole.DisplayRole:
            if isinstance(value, float):
                return f"{value:,.3f}" if index.column() in (2, 3) else f"{value:,.1f}"
            return str(value)
        if role == Qt.ItemDataRole.TextAlignmentRole and index.column() > 0:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None


class PlanTable(QTableView):
    """A sortable view of the ranking; emits the plan the user selects."""

    plan_selected = Signal(object)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.source = PlanTableModel()
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.source)
        self.proxy.setSortRole(Qt.ItemDataRole.UserRole)
        self.setModel(self.proxy)
        self.setSortingEnabled(True)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.selectionModel().currentRowChanged.connect(self._on_row)

    def set_plans(self, plans: list[Plan]) -> None:
        self.source.set_plans(plans)
        self.sortByColumn(-1, Qt.SortOrder.AscendingOrder)  # back to the planner's ranking
        for column in range(1, len(TABLE_COLUMNS)):
            self.resizeColumnToContents(column)

    def plan_at(self, row: int) -> Plan:
        return self.proxy.index(row, 0).data(PLAN_ROLE)

    def _on_row(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if current.isValid():
            self.plan_selected.emit(current.data(PLAN_ROLE))


class WhatIfPanel(QGroupBox):
    """Traffic, spot share and replica changes applied to the chosen plan without a new search."""

    changed = Signal(object)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("What if…", parent)
        self.rate_scale = QDoubleSpinBox(suffix=" × traffic", decimals=2, minimum=0.1,
                                         maximum=20.0, singleStep=0.25, value=1.0)
        self.spot = QDoubleSpinBox(decimals=2, minimum=-0.01, maximum=1.0, singleStep=0.1,
                                   value=-0.01)
        self.spot.setSpecialValueText("as planned")
        self.replicas = QSpinBox(minimum=-16, maximum=64, prefix="+", value=0)
        self.verdict = QLabel("Choose a plan to try changes on it.")
        self.verdict.setWordWrap(True)
        layout = QFormLayout(self)
        layout.addRow("Traffic", self.rate_scale)
        layout.addRow("Spot share", self.spot)
        layout.addRow("Replicas", self.replicas)
        layout.addRow(self.verdict)
        for box in (self.rate_scale, self.spot, self.replicas):
            box.setKeyboardTracking(False)
            box.valueChanged.connect(lambda _v: self.changed.emit(self.what_if()))

    def what_if(self) -> WhatIf:
        spot = None if self.spot.value() < 0 else self.spot.value()
        return WhatIf(self.rate_scale.value(), spot, self.replicas.value())

    def reset(self) -> None:
        for box, value in ((self.rate_scale, 1.0), (self.spot, -0.01), (self.replicas, 0)):
            box.blockSignals(True)
            box.setValue(value)
            box.blockSignals(False)


class ScenarioTable(QTableWidget):
    """Up to three kept scenarios side by side, one column each."""

    def show_scenarios(self, scenarios: Scenarios) -> None:
        names, rows = scenarios.comparison()
        self.clear()
        self.setColumnCount(len(names))
        self.setRowCount(len(rows))
        self.setHorizontalHeaderLabels(names)
        self.setVerticalHeaderLabels([label for label, _ in rows])
        for r, (_label, values) in enumerate(rows):
            for c, value in enumerate(values):
                self.setItem(r, c, QTableWidgetItem(value))
        self.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)


class ValidationTable(QTableWidget):
    """The plans run on this machine, each figure as "predicted / measured (error)", and the
    median error over them (app.plan_run.ValidationRow)."""

    def show_runs(self, rows: list) -> None:
        from app.plan_run import validation_table

        header, body = validation_table(rows)
        self.clear()
        self.setColumnCount(len(header))
        self.setHorizontalHeaderLabels(header)
        self.setRowCount(len(body))
        for r, cells in enumerate(body):
            for c, text in enumerate(cells):
                self.setItem(r, c, QTableWidgetItem(text))
        self.resizeColumnsToContents()
