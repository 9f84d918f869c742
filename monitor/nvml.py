"""Local NVIDIA GPUs through nvidia-ml-py: every call guarded, GPM where the GPU supports it."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from monitor.types import Poll, Sample, SourceStatus

log = logging.getLogger(__name__)

# (series, GPM metric id) read from two GPM samples each tick; values are percentages.
GPM_METRICS = (("sm_util_pct", 2), ("sm_occupancy_pct", 3), ("tensor_util_pct", 5),
               ("dram_bw_util_pct", 10))


def _nvml() -> Any:
    import pynvml  # nvidia-ml-py's module; imported late so machines without it still start

    return pynvml


class Gpm:
    """Two GPM sample buffers per GPU, swapped each tick so each tick costs one SampleGet."""

    def __init__(self, N: Any, handle: Any) -> None:
        self.N, self.handle = N, handle
        support = N.nvmlGpmQueryDeviceSupport(handle)
        if not support.isSupportedDevice:
            raise RuntimeError("GPM is not supported on this GPU (Hopper or newer, datacenter)")
        self.prev, self.cur = N.nvmlGpmSampleAlloc(), N.nvmlGpmSampleAlloc()
        # nvtop's lesson: the real test of support is whether a sample can actually be taken.
        N.nvmlGpmSampleGet(handle, self.prev)

    def read(self) -> dict[str, float]:
        N = self.N
        N.nvmlGpmSampleGet(self.handle, self.cur)
        mg = N.c_nvmlGpmMetricsGet_t()
        mg.version = N.NVML_GPM_METRICS_GET_VERSION
        mg.sample1, mg.sample2, mg.numMetrics = self.prev, self.cur, len(GPM_METRICS)
        for i, (_, metric_id) in enumerate(GPM_METRICS):
            mg.metrics[i].metricId = metric_id
        N.nvmlGpmMetricsGet(mg)
        self.prev, self.cur = self.cur, self.prev
        return {name: float(mg.metrics[i].value) for i, (name, _) in enumerate(GPM_METRICS)
                if mg.metrics[i].nvmlReturn == N.NVML_SUCCESS}

    def close(self) -> None:
        for s in (self.prev, self.cur):
            with contextlib.suppress(Exception):  # freeing at shutdown: nothing else to do
                self.N.nvmlGpmSampleFree(s)


class NvmlSource:
    """Samples every local GPU; no driver means zero GPUs and a status line, never an error."""

    def __init__(self, name: str = "gpu", interval_s: float = 1.0, gpm: bool = True) -> None:
        self.name, self.interval_s = name, interval_s
        self.status = SourceStatus(kind="nvml")
        self.handles: list[Any] = []
        self.gpm: dict[int, Gpm] = {}
        self.gpm_reasons: dict[int, str] = {}
        self.N: Any = None
        try:
            self.N = _nvml()
            self.N.nvmlInit()
            self.handles = [self.N.nvmlDeviceGetHandleByIndex(i)
                            for i in range(self.N.nvmlDeviceGetCount())]
        except Exception as exc:  # ImportError, LibraryNotFound, DriverNotLoaded, ...
            self.N = None
            self.status.state = "unavailable"
            self.status.message = f"0 GPUs: NVML is not available ({exc})"
            return
        self.status.state = "up"
        self.status.message = f"{len(self.handles)} GPU(s)"
        if gpm:
            self._start_gpm()

    def _start_gpm(self) -> None:
        for i, h in enumerate(self.handles):
            try:
                self.gpm[i] = Gpm(self.N, h)
            except Exception as exc:
                self.gpm_reasons[i] = f"SM occupancy not available on this GPU: {exc}"

    def q(self, fn: str, *args: Any) -> Any:
        """One NVML call; None when the GPU or driver does not support it."""
        try:
            return getattr(self.N, fn)(*args)
        except Exception:  # NotSupported, FunctionNotFound on old drivers, GpuIsLost, ...
            return None

    def read_gpu(self, i: int, h: Any) -> dict[str, float]:
        N, q, out = self.N, self.q, {}
        util = q("nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            out["util_pct"], out["mem_util_pct"] = util.gpu, util.memory
        mem = q("nvmlDeviceGetMemoryInfo", h)
        if mem is not None:
            out["memory_used_bytes"], out["memory_total_bytes"] = mem.used, mem.total
        scalar = {"power_w": ("nvmlDeviceGetPowerUsage", 1e-3),
                  "power_limit_w": ("nvmlDeviceGetEnforcedPowerLimit", 1e-3),
                  "energy_j": ("nvmlDeviceGetTotalEnergyConsumption", 1e-3),
                  "throttle_reasons": ("nvmlDeviceGetCurrentClocksEventReasons", 1.0)}
        for name, (fn, scale) in scalar.items():
            value = q(fn, h)
            if value is not None:
                out[name] = value * scale
        extra = {"temperature_c": ("nvmlDeviceGetTemperature", N.NVML_TEMPERATURE_GPU),
                 "sm_clock_mhz": ("nvmlDeviceGetClockInfo", N.NVML_CLOCK_SM),
                 "mem_clock_mhz": ("nvmlDeviceGetClockInfo", N.NVML_CLOCK_MEM),
                 "pcie_tx_kib_s": ("nvmlDeviceGetPcieThroughput", N.NVML_PCIE_UTIL_TX_BYTES),
                 "pcie_rx_kib_s": ("nvmlDeviceGetPcieThroughput", N.NVML_PCIE_UTIL_RX_BYTES)}
        for name, (fn, arg) in extra.items():
            value = q(fn, h, arg)
            if value is not None:
                out[name] = value
        # Corrected ECC errors since the driver loaded (the diagnosis reads their increase).
        ecc = q("nvmlDeviceGetTotalEccErrors", h, N.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                N.NVML_VOLATILE_ECC)
        if ecc is not None:
            out["ecc_corrected_total"] = ecc
        procs = q("nvmlDeviceGetComputeRunningProcesses", h)
        if procs is not None:
            out["processes"] = len(procs)
        if i in self.gpm:
            try:
                out.update(self.gpm[i].read())
            except Exception as exc:
                self.gpm_reasons[i] = f"SM occupancy not available on this GPU: {exc}"
                self.gpm.pop(i).close()
        return out

    def poll(self, now: float) -> Poll:
        samples = []
        for i, h in enumerate(self.handles):
            values = self.read_gpu(i, h)
            samples += [Sample(f"{self.name}/{i}/{k}", now, float(v)) for k, v in values.items()]
        return Poll(samples)

    def describe(self) -> list[dict[str, Any]]:
        """Name, UUID and GPM availability of each GPU, for the status line and gpu_check."""
        rows = []
        for i, h in enumerate(self.handles):
            name = self.q("nvmlDeviceGetName", h)
            rows.append({"index": i, "name": name, "uuid": self.q("nvmlDeviceGetUUID", h),
                         "gpm": i in self.gpm, "gpm_reason": self.gpm_reasons.get(i)})
        return rows

    def close(self) -> None:
        for g in self.gpm.values():
            g.close()
        self.gpm.clear()
        if self.N is not None:
            self.q("nvmlShutdown")
            self.N = None
