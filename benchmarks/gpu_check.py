"""GPU check: what monitor.nvml.NvmlSource reads next to nvidia-smi's figures, as one JSON."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Run as `python benchmarks/gpu_check.py`, sys.path[0] is benchmarks/, whose monitor.py would
# shadow the `monitor` package; drop it so the real package is imported.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from monitor.nvml import NvmlSource  # noqa: E402

# NvmlSource series -> (nvidia-smi query field, factor turning smi's unit into ours).
SMI_FIELDS = {
    "util_pct": ("utilization.gpu", 1.0),
    "mem_util_pct": ("utilization.memory", 1.0),
    "memory_used_bytes": ("memory.used", 2**20),  # smi reports MiB
    "memory_total_bytes": ("memory.total", 2**20),
    "power_w": ("power.draw", 1.0),
    "power_limit_w": ("enforced.power.limit", 1.0),
    "temperature_c": ("temperature.gpu", 1.0),
    "sm_clock_mhz": ("clocks.sm", 1.0),
    "mem_clock_mhz": ("clocks.mem", 1.0),
}


def smi_query() -> tuple[list[dict[str, float | None]], str | None]:
    """nvidia-smi's figures per GPU in NvmlSource's units, or an error message."""
    if shutil.which("nvidia-smi") is None:
        return [], "nvidia-smi is not on PATH"
    fields = ",".join(f for f, _ in SMI_FIELDS.values())
    cmd = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        return [], f"nvidia-smi failed: {exc}"
    rows = []
    for line in out.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        rows.append({name: _number(cell, factor)
                     for (name, (_, factor)), cell in zip(SMI_FIELDS.items(), cells, strict=False)})
    return rows, None


def _number(cell: str, factor: float) -> float | None:
    # smi writes "[N/A]" or "[Not Supported]" for fields a GPU lacks.
    try:
        return float(cell) * factor
    except ValueError:
        return None


def compare(ours: dict[str, float], smi: dict[str, float | None]) -> dict[str, Any]:
    """Side by side per field, with the difference where both have a figure."""
    rows: dict[str, Any] = {}
    for name in SMI_FIELDS:
        a, b = ours.get(name), smi.get(name)
        rows[name] = {"nvml": a, "nvidia_smi": b,
                      "diff": None if a is None or b is None else round(a - b, 3)}
    return rows


def main() -> None:
    source = NvmlSource(gpm=True)
    result: dict[str, Any] = {"machine": {"platform": platform.platform(),
                                          "python": sys.version.split()[0]},
                              "gpus": len(source.handles), "nvml_status": source.status.message,
                              "nvml_state": source.status.state}
    if source.handles:
        # GPM needs two samples some time apart; the first read primes, the second measures.
        for i, h in enumerate(source.handles):
            source.read_gpu(i, h)
        time.sleep(1.0)
        ours = [source.read_gpu(i, h) for i, h in enumerate(source.handles)]
        smi, smi_error = smi_query()
        result["nvidia_smi_error"] = smi_error
        result["devices"] = [
            {**info, "nvml_all": ours[i],
             "sm_occupancy_pct_gpm": ours[i].get("sm_occupancy_pct"),
             "compared": compare(ours[i], smi[i] if i < len(smi) else {})}
            for i, info in enumerate(source.describe())]
    source.close()
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
