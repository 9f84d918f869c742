"""Start-up time: process launch to main window shown, against a bare PySide6 window, as JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = 5

APP = "import sys; from app.main_window import run_app; sys.exit(run_app(sys.argv))"

# The baseline does what the app's exit-after-show mode does, with an empty window.
BASELINE = """
import json, os, sys, time
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMainWindow
app = QApplication(sys.argv)
window = QMainWindow()
def report():
    t0 = float(os.environ["SERVESCOPE_STARTUP_T0"])
    print(json.dumps({"shown_s": time.time() - t0, "torch_imported": "torch" in sys.modules}))
    window.close()
    app.quit()
window.show()
QTimer.singleShot(0, report)
app.exec()
"""


def time_to_shown(code: str, env: dict[str, str]) -> dict:
    """Launch ``code`` in a fresh interpreter and return its report of the time to shown."""
    env = {**env, "SERVESCOPE_STARTUP_T0": repr(time.time())}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"start-up run failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine(env: dict[str, str]) -> dict:
    """The machine the measurement ran on, without importing torch."""
    return {"platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "qt_platform": env.get("QT_QPA_PLATFORM", "default")}


def main() -> None:
    env = {**os.environ, "SERVESCOPE_EXIT_AFTER_SHOW": "1"}
    env.setdefault("QT_QPA_PLATFORM", "offscreen")
    app_runs, base_runs, torch_seen = [], [], False
    time_to_shown(APP, env)  # warm the file cache so the first timed run is not an outlier
    for _ in range(RUNS):
        # Interleaved, so background load on the machine hits both sides alike.
        report = time_to_shown(APP, env)
        app_runs.append(report["shown_s"])
        torch_seen |= report["torch_imported"]
        base_runs.append(time_to_shown(BASELINE, env)["shown_s"])
    app_s, base_s = statistics.median(app_runs), statistics.median(base_runs)
    print(json.dumps({
        "benchmark": "startup_to_window_shown",
        "machine": {**machine(env), "torch_imported_at_show": torch_seen},
        "runs": RUNS,
        "servescope_s": round(app_s, 4),
        "baseline_empty_pyside6_window_s": round(base_s, 4),
        "ratio": round(app_s / base_s, 3),
        "target_s": 1.5,
        "within_target": app_s < 1.5,
        "servescope_runs_s": [round(x, 4) for x in app_runs],
        "baseline_runs_s": [round(x, 4) for x in base_runs],
    }))


if __name__ == "__main__":
    main()
