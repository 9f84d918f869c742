"""Device and dtype choice, with the reason for any fallback, and the default KV budget."""

from __future__ import annotations

import os

import torch

from engine.config import ModelConfig
from engine.cpu_features import cpu_default_dtype
from engine.kv_options import kv_cache_bytes
from kernels import ONEDNN_DTYPES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str) -> tuple[torch.device, str | None]:
    """The device to run on and, when it is not the one asked for, why."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), None
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return torch.device("cpu"), ("CUDA is not available in this PyTorch build or "
                                         "machine: running on the CPU.")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            return torch.device("cuda:0"), (f"There is no GPU {index} ({torch.cuda.device_count()} "
                                            "found): running on cuda:0.")
        return torch.device(device), None
    if device == "cpu":
        return torch.device("cpu"), None
    raise ValueError(f"Unknown device '{device}': use auto, cpu, cuda or cuda:N.")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA (float16 where the GPU lacks it), and on CPUs where cpu_default_dtype
    says so and the CPU table serves bfloat16 (oneDNN's bfloat16 linear or the C tile kernel
    passed its self-check), else float32, unless asked otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        served = cpu_default_dtype() == "bfloat16" and torch.bfloat16 in ONEDNN_DTYPES
        return torch.bfloat16 if served else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype '{dtype}': use float32, bfloat16 or float16.")
    return _DTYPES[dtype]


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> None:
    """An fp8 KV cache on CUDA needs fp8 conversions in hardware (the Triton kernels use them)."""
    if kv_cache_dtype == "fp8" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"An fp8 KV cache needs a GPU with fp8 support (compute capability 8.9 or newer; "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}): use int8.")


def kv_budget_tokens(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                     max_num_seqs: int, max_model_len: int, kv_cache_dtype: str = "auto") -> int:
    """Default KV pool size: room for every sequence at full context, within a memory budget.

    On the CPU the budget is a quarter of physical memory (at most 4 GiB); on CUDA 85% of the
    memory free after the weights were loaded. A quantized cache (int8/fp8) fits more tokens.
    """
    per_token = config.kv_bytes_per_token(*kv_cache_bytes(kv_cache_dtype, dtype.itemsize))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * 0.85)
    else:
        budget = min(physical_memory_bytes() // 4, 4 << 30)
    return max(1, min(budget // per_token, max_num_seqs * max_model_len))


def physical_memory_bytes() -> int:
    """Total RAM of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
