"""Sampling controls of the chat playground: temperature, top-p, top-k, max tokens, seed."""

from __future__ import annotations

from PySide6.QtWidgets import QDoubleSpinBox, QFormLayout, QGroupBox, QSpinBox, QWidget

from app.panes.engine.state import SamplingSettings
from app.settings import Settings


class SamplingControls(QGroupBox):
    """Spin boxes for the sampling parameters, persisted as the user changes them."""

    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__("Sampling", parent)
        self._settings = settings
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.05, decimals=2)
        self.temperature.setToolTip("0 is greedy: the same prompt always gives the same reply")
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1.0, singleStep=0.05, decimals=2)
        self.top_k = QSpinBox(minimum=0, maximum=100000)
        self.top_k.setSpecialValueText("off")
        self.max_tokens = QSpinBox(minimum=1, maximum=32768, singleStep=64)
        self.seed = QSpinBox(minimum=-1, maximum=2**31 - 1)
        self.seed.setSpecialValueText("random")
        form = QFormLayout(self)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        self._restore()
        for box in self._boxes():
            box.valueChanged.connect(self.save)

    def values(self) -> SamplingSettings:
        """The sampling settings the controls show."""
        return SamplingSettings(self.temperature.value(), self.top_p.value(), self.top_k.value(),
                                self.max_tokens.value(), self.seed.value())

    def save(self, *_: object) -> None:
        """Persist the controls."""
        v = self.values()
        for key, value in (("chat/temperature", v.temperature), ("chat/top_p", v.top_p),
                           ("chat/top_k", v.top_k), ("chat/max_tokens", v.max_tokens),
                           ("chat/seed", v.seed)):
            self._settings.set(key, value)

    def _restore(self) -> None:
        s = self._settings
        self.temperature.setValue(s.get("chat/temperature"))
        self.top_p.setValue(s.get("chat/top_p"))
        self.top_k.setValue(s.get("chat/top_k"))
        self.max_tokens.setValue(s.get("chat/max_tokens"))
        self.seed.setValue(s.get("chat/seed"))

    def _boxes(self) -> tuple:
        return (self.temperature, self.top_p, self.top_k, self.max_tokens, self.seed)
