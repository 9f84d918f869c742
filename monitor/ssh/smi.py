"""A remote box's GPUs through nvidia-smi's CSV query loop, as the series NvmlSource produces.

nvidia-smi(1): ``--query-gpu=FIELDS --format=csv,noheader,nounits -lms N`` prints one line per
GPU every N ms, the fields in the order asked, comma-and-space separated, without units;
a value the GPU or driver does not report reads ``[N/A]`` or ``[Not Supported]``. The clock
event ("throttle") reasons are a hex bitmask (0x0000000000000004 = SW power cap), the field
named ``clocks_event_reasons.active`` since driver R535 and ``clocks_throttle_reasons.active``
before; the remote script tries the new name, then the old one.
"""

from __future__ import annotations

import math

# (nvidia-smi field, NvmlSource series, scale to the series' unit); "index" keys the GPU.
FIELDS: tuple[tuple[str, str, float], ...] = (
    ("utilization.gpu", "util_pct", 1.0),
    ("utilization.memory", "mem_util_pct", 1.0),
    ("memory.used", "memory_used_bytes", 2.0**20),  # MiB
    ("memory.total", "memory_total_bytes", 2.0**20),
    ("power.draw", "power_w", 1.0),
    ("enforced.power.limit", "power_limit_w", 1.0),
    ("temperature.gpu", "temperature_c", 1.0),
    ("clocks.sm", "sm_clock_mhz", 1.0),
    ("clocks.mem", "mem_clock_mhz", 1.0),
    # Corrected (single-bit) ECC errors since the driver loaded; [N/A] where ECC is off.
    ("ecc.errors.corrected.volatile.total", "ecc_corrected_total", 1.0),
)
THROTTLE_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
SERIES = {field: (series, scale) for field, series, scale in FIELDS}
SERIES.update({name: ("throttle_reasons", 1.0) for name in THROTTLE_FIELDS})
# The remote script's own lines, told apart from nvidia-smi's by this prefix.
MARK = "#servescope "
NOT_FOUND = 127  # the shell's status for a command it cannot find


def query(throttle_field: str) -> str:
    """The --query-gpu list, with one of the throttle-reason names."""
    return ",".join(("index", *(f for f, _, _ in FIELDS), throttle_field))


def remote_script(interval_ms: int) -> str:
    """A POSIX sh script (no single quotes: it is passed as sh -c '...') that announces each
    field list it runs nvidia-smi with, and its exit status, then waits on stdin so the SSH
    session (and with it the tunnel) lives until servescope closes it."""
    tries = " ".join(query(f) for f in THROTTLE_FIELDS)
    return (f"for q in {tries}; do echo \"{MARK}fields $q\"; "
            f"nvidia-smi --query-gpu=\"$q\" --format=csv,noheader,nounits -lms {interval_ms} "
            f"2>&1; s=$?; echo \"{MARK}exit $s\"; [ $s -eq {NOT_FOUND} ] && break; done; "
            "while read -r _; do :; done")


def parse_row(line: str, fields: list[str]) -> tuple[int, dict[str, float]] | None:
    """(GPU index, {series: value}) of one CSV row; None when the line is not a row (an
    nvidia-smi message). Values it does not report ([N/A], [Not Supported]) are left out."""
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != len(fields) or fields[0] != "index" or not cells[0].isdigit():
        return None
    values: dict[str, float] = {}
    for field, cell in zip(fields[1:], cells[1:], strict=True):
        value = _number(cell)
        if value is not None and field in SERIES:
            series, scale = SERIES[field]
            values[series] = value * scale
    return int(cells[0]), values


def _number(cell: str) -> float | None:
    try:
        value = float(int(cell, 16)) if cell.lower().startswith("0x") else float(cell)
    except ValueError:  # [N/A], [Not Supported], [Unknown Error], ERR!
        return None
    return value if math.isfinite(value) else None
