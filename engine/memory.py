"""Memory a model needs before it is loaded (weights + KV cache), and what the devices have."""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig
from engine.kv_options import kv_cache_bytes, parse_kv_cache_dtype
from engine.models import resolve_model
from engine.quantize import parse_weights, quantized_weight_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BLOCK_SIZE = 16


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a model needs at a context length and concurrency, by component."""

    weight_bytes: int
    kv_bytes: int
    activation_bytes: int
    parameters: int
    kv_bytes_per_token: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes


@dataclass(frozen=True)
class DeviceMemory:
    """A device the engine can run on and its memory."""

    name: str
    kind: str  # "cpu" | "cuda"
    index: int
    total_bytes: int
    free_bytes: int


def estimate_memory(model: str | Path, dtype: str = "float32", context_tokens: int = 2048,
                    concurrency: int = 1, max_num_batched_tokens: int = 2048,
                    device: str = "cpu", weights: str = "float",
                    kv_cache_dtype: str = "auto") -> MemoryEstimate:
    """Estimate from the model's header only: weights are dequantized to `dtype` at load, or
    held in the `weights` format (engine/quantize.py); the KV cache in `dtype` or quantized
    (`kv_cache_dtype` int8 / fp8, kernels/kv_quant.py)."""
    path = resolve_model(model)
    config, parameters = read_header(path, path.stat().st_mtime_ns)
    return estimate_for(config, parameters, dtype, context_tokens, concurrency,
                        max_num_batched_tokens, device, weights, kv_cache_dtype)


def estimate_for(config: ModelConfig, parameters: int, dtype: str, context_tokens: int,
                 concurrency: int, max_num_batched_tokens: int = 2048,
                 device: str = "cpu", weights: str = "float",
                 kv_cache_dtype: str = "auto") -> MemoryEstimate:
    """The estimate for a known config and parameter count."""
    size = DTYPE_BYTES[dtype]
    weight_format = parse_weights(weights)
    if weight_format.quantized:
        # The CPU engine runs quantized matmuls through PyTorch's packed ops (kernels/quant.py).
        weight_bytes = quantized_weight_bytes(config, parameters, size, weight_format,
                                              packed=device == "cpu")
    else:
        weight_bytes = parameters * size
        if device == "cpu" and config.tie_word_embeddings and _packs_linear_weights(dtype):
            # The CPU engine keeps a re-laid-out copy of a tied LM head (oneDNN's packed layout,
            # or the bfloat16 tile kernel's: kernels/cpu_linear.py).
            weight_bytes += config.vocab_size * config.hidden_size * size
    per_token = config.kv_bytes_per_token(*kv_cache_bytes(parse_kv_cache_dtype(kv_cache_dtype),
                                                          size))
    blocks = concurrency * -(-context_tokens // BLOCK_SIZE)
    # The widest activations of one step: the MLP's fused gate/up output plus float32 logits
    # for every sequence sampled.
    activations = (max_num_batched_tokens * 2 * config.intermediate_size * size
                   + concurrency * config.vocab_size * 4)
    return MemoryEstimate(weight_bytes, blocks * BLOCK_SIZE * per_token, activations, parameters,
                          per_token)


def _packs_linear_weights(dtype: str) -> bool:
    """Whether the CPU kernels the engine would pick for `dtype` pack weights into new matrices
    (oneDNN: float32, and bfloat16 where the CPU runs it natively). Imported here, not at the
    top: the estimate needs torch only for this question, and only for a tied float model."""
    import torch

    import kernels

    return kernels.packs_linear_weights("cpu", getattr(torch, dtype))


@functools.lru_cache(maxsize=16)
def read_header(path: Path, mtime_ns: int = 0) -> tuple[ModelConfig, int]:
    """The config and parameter count of a GGUF file or Hugging Face folder, without weights.

    Cached per path and modification time: the app re-estimates on every setting change.
    """
    if path.is_dir():
        from engine.loader import hf

        raw = hf.read_json(path / "config.json", path, required=True)
        return hf.read_config(raw, path), _safetensors_parameters(path)
    from engine.loader import gguf as gguf_loader

    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.read_config(reader, path)
    return config, sum(int(t.n_elements) for t in reader.tensors)


def _safetensors_parameters(folder: Path) -> int:
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for d in entry["shape"]:
                    count *= d
                total += count
    return total


def device_memory() -> list[DeviceMemory]:
    """The CPU (physical memory, available memory) and each CUDA GPU torch can see."""
    from engine.devices import physical_memory_bytes

    devices = [DeviceMemory("CPU", "cpu", 0, physical_memory_bytes(), _available_ram())]
    import torch

    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            devices.append(DeviceMemory(torch.cuda.get_device_name(i), "cuda", i, total, free))
    return devices


def _available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    from engine.devices import physical_memory_bytes

    return physical_memory_bytes()
