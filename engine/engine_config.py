"""EngineConfig: every option an engine is built with, as frozen data validated when made.

One definition serves everyone who builds or sizes an engine: `LLM` takes it, the command line's
engine flags are derived from its fields (`add_cli_arguments` / `from_cli`, as vLLM derives its
CLI from `EngineArgs`), the Engine pane sizes its load request with `sized_for`, the memory
estimate and the benchmarks read it. The derived figures (a request's peak KV slots, the pool for
a concurrency, the memory estimate) are its methods, so nobody re-implements the engine's rules.

No torch here: the app and the CLI check options (and the planner reads precisions) before the
engine is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.cpu_features import cpu_default_dtype
from engine.kv_options import (
    TRAITS,
    eviction_chunk,
    parse_kv_budget,
    parse_kv_cache_dtype,
    peak_kv_tokens,
    policy_name,
    resolve_budget,
)
from engine.quantize import parse_weights
from engine.spec.config import parse_spec

if TYPE_CHECKING:
    from engine.memory import MemoryEstimate

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The planner's precision names (planner.catalog.PRECISIONS / KV_PRECISIONS) are accepted for
# dtype too, and `precisions()` says a config's in them: one vocabulary across the two.
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32"}
PLANNER_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}  # the planner models no float32
# Under an eviction budget a request peaks at budget + a block + one prefill chunk, so a sized
# load (the Engine pane's) prefills in smaller chunks to keep that peak near the budget.
EVICTION_PREFILL_CHUNK = 256


class ConfigError(ValueError):
    """An engine option out of range; the message names the option and what to give."""


def _option(default: Any, help: str, flag: str | None = None) -> Any:
    """A field that is also a command-line flag (`--name-with-dashes` unless `flag` says)."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class EngineConfig:
    """What to load and how: precision, sizes of the batch and the KV pool, and the features."""

    model: str = field(metadata={
        "help": "a GGUF file, a Hugging Face folder, or a name from `models list`",
        "flag": "--model", "default": "smollm2-135m-instruct"})
    device: str = _option("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = _option("auto", "float32, bfloat16 or float16 (auto: bfloat16 on CUDA and on "
                                 "CPUs with bfloat16 instructions, else float32)")
    weights: str = _option("float", "weight-only quantization: float, int8 (per channel) or "
                                    "int4[:g32|g64|g128] (default float)")
    kv_cache_dtype: str = _option("auto", "KV cache storage: auto (the model's dtype), int8 or "
                                          "fp8 (e4m3), with a scale per token and KV head")
    max_model_len: int | None = _option(None, "context length (default: the model's)")
    max_num_seqs: int = _option(64, "requests batched together at most")
    max_num_batched_tokens: int = _option(2048, "tokens one step computes at most (prefill "
                                                "chunks and decode tokens together)")
    kv_cache_tokens: int | None = _option(None, "KV pool size in tokens (default: what the "
                                                "device's memory allows)")
    block_size: int = _option(16, "tokens per KV block")
    speculative: str | None = _option(
        None, "speculative decoding: ngram[:k=10] (prompt lookup), draft:PATH[,k=4] (a smaller "
              "model with the same tokenizer, or a draft file from benchmarks/train_draft.py or "
              "train_medusa.py), demo-draft[:k=3] (the demo model's own draft) or "
              "demo-medusa[:k=3] (its Medusa heads); lookup=1 tries prompt lookup before a "
              "draft; branches=N verifies draft trees; default off", flag="--spec")
    prefix_caching: bool = _option(False, "share the KV blocks of common prompt prefixes "
                                          "between requests")
    kv_policy: str = _option("none", "KV-cache eviction: none, streaming, h2o, scissorhands or "
                                     "snapkv (default none)")
    kv_budget: int | float | None = _option(
        None, "KV entries each request keeps under --kv-policy: tokens (512) or a fraction of "
              "the request's length (0.2)")
    cuda_graphs: bool = _option(False, "replay decode steps from CUDA graphs (CUDA only)")
    torch_compile: bool = _option(False, "run decode steps through torch.compile (CUDA only)",
                                  flag="--compile")
    kernel_backend: str | None = _option(None, "kernels: reference (torch), onednn (CPU) or "
                                               "triton (CUDA); default the best for the device")

    def __post_init__(self) -> None:
        # Normalised spellings, so two configs that load the same engine compare equal.
        self._set("dtype", _dtype(self.dtype))
        self._set("weights", parse_weights(self.weights).name)
        self._set("kv_cache_dtype", parse_kv_cache_dtype(self.kv_cache_dtype))
        self._set("kv_policy", policy_name(self.kv_policy))
        self._set("kv_budget", parse_kv_budget(self.kv_budget))
        self._set("speculative", None if self.speculative in (None, "", "off")
                  else self.speculative)
        if not self.model:
            raise ConfigError("No model given: name a GGUF file, a Hugging Face folder or a "
                              "model from `servescope models list`.")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _positive(name, getattr(self, name))
        for name in ("max_model_len", "kv_cache_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}.")
        # A step computes at least a block, so a prefill chunk always fills one.
        self._set("max_num_batched_tokens", max(self.max_num_batched_tokens, self.block_size))
        parse_spec(self.speculative)  # a bad --spec fails before anything loads
        if self.evicts:
            resolve_budget(self.kv_budget, 1 << 30, self.block_size)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    # ---- derived figures ----
    @property
    def evicts(self) -> bool:
        return self.kv_policy != "none"

    @property
    def num_draft_tokens(self) -> int:
        """Speculative drafts a decode step may add (0 without speculation)."""
        spec = parse_spec(self.speculative)
        return 0 if spec is None else spec.max_draft_tokens

    def bounded_by_budget(self) -> bool:
        """Whether the eviction budget bounds a request's KV slots (SnapKV holds the whole
        prompt until it ends, so its peak is the request's length)."""
        return self.evicts and not TRAITS[self.kv_policy].holds_prompt

    def peak_kv_tokens(self, request_tokens: int) -> int:
        """KV slots a request of `request_tokens` (prompt + new tokens) holds at its peak: all of
        them, or under an eviction budget the budget plus a block and one step's chunk."""
        if not self.evicts:
            return request_tokens
        budget = resolve_budget(self.kv_budget, request_tokens, self.block_size)
        chunk = eviction_chunk(request_tokens, TRAITS[self.kv_policy].holds_prompt,
                               self.max_num_batched_tokens, self.num_draft_tokens)
        return min(request_tokens, peak_kv_tokens(budget, self.block_size, chunk))

    @classmethod
    def sized_for(cls, model: str, context_tokens: int, concurrency: int,
                  **options: Any) -> EngineConfig:
        """A config whose context is `context_tokens` and whose KV pool holds `concurrency`
        requests of that length at their peak (the Engine pane's load)."""
        if context_tokens < 16 or concurrency < 1:
            raise ConfigError("Context must be at least 16 tokens and concurrency at least 1.")
        config = cls(model, max_model_len=context_tokens, **options)
        if config.bounded_by_budget():
            config = replace(config, max_num_batched_tokens=EVICTION_PREFILL_CHUNK)
        # The pool is whole blocks and each request holds whole blocks at its peak.
        blocks = -(-config.peak_kv_tokens(context_tokens) // config.block_size)
        return replace(config, kv_cache_tokens=blocks * config.block_size * concurrency)

    def memory_estimate(self, context_tokens: int, concurrency: int,
                        device_kind: str = "cpu") -> MemoryEstimate:
        """Memory this engine needs for `concurrency` requests of `context_tokens` on a device
        kind ("cpu" / "cuda"), from the model's header only."""
        from engine.memory import estimate_memory

        return estimate_memory(self.model, self.concrete_dtype(device_kind),
                               self.peak_kv_tokens(context_tokens), concurrency,
                               self.max_num_batched_tokens, device_kind, self.weights,
                               self.kv_cache_dtype)

    def concrete_dtype(self, device_kind: str) -> str:
        """What "auto" becomes on a device: engine.devices.resolve_dtype's rule, read without
        torch (where the GPU supports bfloat16; on the CPU, from its instructions alone)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device_kind == "cuda" else cpu_default_dtype()

    def precisions(self, device_kind: str = "cpu") -> tuple[str | None, str | None]:
        """(weights, KV cache) in the planner's precision names, None where the planner models
        no such precision (float32): what a benchmark of this engine calibrates."""
        dtype = PLANNER_DTYPES.get(self.concrete_dtype(device_kind))
        bits = parse_weights(self.weights).bits
        weights = dtype if bits is None else f"int{bits}"
        kv = dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        return weights, kv

    def options(self) -> dict[str, Any]:
        """Every option but the model, as plain values (stored beside a measurement)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "model"}

    # ---- the command line ----
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, with the field's default and help."""
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            default = f.metadata.get("default", f.default)
            if f.type == "bool":
                parser.add_argument(flag, dest=f.name, action="store_true", help=f.metadata["help"])
            else:
                kind = int if f.type in ("int", "int | None") else str
                parser.add_argument(flag, dest=f.name, type=kind, default=default,
                                    help=f.metadata["help"])

    @classmethod
    def from_cli(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """The config the parsed flags describe (a bad value raises, naming the option)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        return cls(**(values | overrides))


def _dtype(value: str | None) -> str:
    text = "auto" if value is None else str(value).removeprefix("torch.").strip().lower()
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPES:
        raise ConfigError(f"Unknown dtype '{value}': use float32, bfloat16 or float16.")
    return text


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number of at least 1, got {value!r}.")
