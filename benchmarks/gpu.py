"""On an NVIDIA GPU: the engine's decode against the memory-bandwidth bound and transformers.

Prints ONE JSON object:
- the device-to-device copy bandwidth of this GPU;
- batch-1 / 16 / 64 decode tokens/s of the demo model in float16 (and int8 / int4 weights when
  this engine's LLM takes `weights=`), each as a fraction of the bandwidth bound, with the
  Triton kernels, with them and CUDA graphs, with torch.compile inside the graphs, with an int8
  and an fp8 KV cache, and, as the same-run baseline, the torch reference kernels; and how many
  of 16 greedy outputs each variant shares with the reference;
- the same decode with transformers' `generate` on the same weights;
- Triton attention kernel timings against PyTorch's scaled_dot_product_attention on dense
  K/V (and against the reference's gather + SDPA), with the largest difference in their outputs.
On a machine without CUDA it prints one line saying so. Sized to finish in well under 8 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path, where the sibling engine.py would
# shadow the `engine` package; drop that entry before importing it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine, synthetic_prompts  # noqa: E402

BATCHES = (1, 16, 64)
CHECK_BATCH = 16  # prompts whose greedy outputs every variant is compared on
PROMPT_TOKENS = 64
DEVICE = "cuda"  # one place, so the non-GPU parts can be dry-run on the CPU


def log(message: str) -> None:
    print(f"[gpu] {message}", file=sys.stderr, flush=True)


def sizes(quick: bool) -> dict:
    if quick:
        return {"new_tokens": 32, "repeats": 1, "copy_mib": 512, "contexts": [1024]}
    return {"new_tokens": 128, "repeats": 3, "copy_mib": 4096, "contexts": [1024, 4096]}


def cuda_timed(fn: Callable[[], object]) -> float:
    """Wall seconds of fn with the GPU drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# ---- machine ----
def copy_bandwidth(mib: int, repeats: int = 10) -> dict:
    """Device memory bandwidth: a large device-to-device copy reads and writes every byte."""
    x = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)  # warm-up
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    seconds = statistics.median(times)
    del x, y
    torch.cuda.empty_cache()
    return {"bandwidth_gbs": 2 * mib * 2**20 / seconds / 1e9,
            "bandwidth_method": f"median of {repeats} device-to-device copies of {mib} MiB, "
                                "(bytes read + bytes written) / time by CUDA events"}


# ---- decode: engine and transformers ----
def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def decode_rate(generate: Callable[[int], object], batch: int, new: int, repeats: int) -> float:
    """Decode tokens/s: batch * (new - 1) / (t(generate new) - t(generate 1)), medians of
    alternating runs, so the prefill and the first token cancel out."""
    generate(4)  # warm-up at this batch shape (and Triton's compiles)
    long, short = [], []
    for _ in range(repeats):
        long.append(cuda_timed(lambda: generate(new)))
        short.append(cuda_timed(lambda: generate(1)))
    return batch * (new - 1) / (statistics.median(long) - statistics.median(short))


def bandwidth_bound(llm: LLM, batch: int, new: int, bandwidth_gbs: float) -> float:
    """Tokens/s if each decode step only read the weights once and every sequence's keys and
    values once (the mean context of the run), at the measured bandwidth."""
    mean_context = PROMPT_TOKENS + new / 2
    per_token = llm.kv_bytes_per_token  # int8/fp8: smaller
    kv_bytes = batch * mean_context * per_token
    return batch * bandwidth_gbs * 1e9 / (llm.weight_bytes + kv_bytes)


@dataclass(frozen=True)
class Variant:
    """One engine configuration to measure."""

    name: str
    precision: str  # float16, or int8 / int4 weights
    kernels: str
    cuda_graphs: bool
    torch_compile: bool = False
    kv_cache_dtype: str = "auto"


def engine_options() -> set[str]:
    """The options this engine's LLM takes: EngineConfig's fields, or on a revision from before
    EngineConfig (a before/after run) LLM's keyword arguments."""
    try:
        from engine.engine_config import EngineConfig
    except ImportError:
        return set(inspect.signature(LLM.__init__).parameters)
    return {f.name for f in dataclasses.fields(EngineConfig)}


def variants() -> tuple[list[Variant], list[str]]:
    """The torch reference kernels (the same-run baseline), the Triton kernels, and with them
    CUDA graphs and quantized weights where this engine's LLM has those options."""
    params = engine_options()
    graphs = "cuda_graphs" in params
    suffix = "_graphs" if graphs else ""
    chosen = [Variant("float16_reference", "float16", "reference", False),
              Variant("float16_triton", "float16", "triton", False)]
    skipped = []
    if graphs:
        chosen.append(Variant("float16_triton_graphs", "float16", "triton", True))
    else:
        skipped.append("LLM(cuda_graphs=...) is not in this engine: CUDA graphs not measured")
    if "weights" in params:
        chosen += [Variant(f"{p}_triton{suffix}", p, "triton", graphs) for p in ("int8", "int4")]
    else:
        skipped.append("LLM(weights=...) is not in this engine: int8 / int4 weights skipped")
    if "torch_compile" in params:
        chosen.append(Variant(f"float16_triton_compile{suffix}", "float16", "triton", graphs,
                              torch_compile=True))
    if "kv_cache_dtype" in params:
        fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
        chosen += [Variant(f"float16_triton{suffix}_{kv}_kv", "float16", "triton", graphs,
                           kv_cache_dtype=kv) for kv in ("int8", "fp8") if kv == "int8" or fp8]
    return chosen, skipped


def open_engine(path: Path, variant: Variant, sz: dict) -> LLM:
    kwargs = {} if variant.precision == "float16" else {"weights": variant.precision}
    if variant.cuda_graphs:
        kwargs["cuda_graphs"] = True
    if variant.torch_compile:
        kwargs["torch_compile"] = True
    if variant.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = variant.kv_cache_dtype
    tokens = max(BATCHES) * (PROMPT_TOKENS + sz["new_tokens"] + 16)
    return LLM(str(path), device=DEVICE, dtype="float16", max_num_seqs=max(BATCHES),
               kv_cache_tokens=tokens, kernel_backend=variant.kernels, **kwargs)


def engine_decode(llm: LLM, prompts: dict[int, list[list[int]]], sz: dict,
                  bandwidth_gbs: float) -> dict:
    result = {"kernels": llm.model.ops.name, "weight_bytes": llm.weight_bytes,
              "kv_cache_dtype": getattr(llm, "kv_cache_dtype", "auto")}
    for batch in BATCHES:
        log(f"engine {result['kernels']} kernels: batch {batch}")
        rate = decode_rate(lambda n, p=prompts[batch]: llm.generate(p, greedy(n)), batch,
                           sz["new_tokens"], sz["repeats"])
        bound = bandwidth_bound(llm, batch, sz["new_tokens"], bandwidth_gbs)
        result[f"batch_{batch}"] = {"tokens_per_s": rate, "bound_tokens_per_s": bound,
                                    "fraction_of_bound": rate / bound}
    return result


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """32 greedy tokens per prompt, to compare every variant's outputs with the reference's."""
    return [o.token_ids for o in llm.generate(prompts, greedy(32))]


def same_outputs(tokens: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    return f"{same} of {len(reference)}"


def transformers_decode(path: Path, prompts: dict[int, list[list[int]]], sz: dict) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    folder = path.parent if path.is_file() else path
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float16, **kwargs).to(DEVICE).eval()
    result = {"version": transformers.__version__}
    for batch in BATCHES:
        log(f"transformers: batch {batch}")
        ids = torch.tensor(prompts[batch], device=DEVICE)  # same length each: no padding
        rate = decode_rate(lambda n, ids=ids: hf_generate(hf, ids, n), batch, sz["new_tokens"],
                           sz["repeats"])
        result[f"batch_{batch}"] = {"tokens_per_s": rate}
    return result


def hf_generate(hf, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy generate of exactly n tokens (EOS cannot end it early)."""
    with torch.inference_mode():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False,
                           pad_token_id=hf.generation_config.eos_token_id)


# ---- attention kernels ----
def paged_case(batch: int, context: int, heads: int, kv_heads: int, dim: int,
               block_size: int = 16, prefill: bool = False):
    """q, a paged cache with each sequence's blocks scattered, and its metadata: `batch` decode
    queries over `context` keys each, or one fresh causal prefill of `context` tokens."""
    from kernels.metadata import AttentionMetadata, PrefillChunk

    device = DEVICE
    gen = torch.Generator(device="cpu").manual_seed(batch * context + heads)
    per_seq = -(-context // block_size)
    num_blocks = per_seq * batch
    blocks = torch.randperm(num_blocks, generator=gen).view(batch, per_seq)
    t = torch.arange(context)
    slots = (blocks[:, t // block_size] * block_size + t % block_size).to(device)
    shape = (num_blocks * block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(device, torch.float16)
    v_cache = torch.randn(shape, generator=gen).to(device, torch.float16)
    rows = context if prefill else batch
    q = torch.randn(rows, heads, dim, generator=gen).to(device, torch.float16)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long, device=device))
    if prefill:
        meta.prefills = [PrefillChunk(0, context, slots[0], None)]
    else:
        meta.decode_token_index = torch.arange(batch, device=device)
        meta.decode_slots = slots
    return q, k_cache, v_cache, meta, slots


def dense_sdpa(q, k_cache, v_cache, slots, prefill: bool, scale: float) -> Callable[[], object]:
    """PyTorch's SDPA over K/V already laid out densely ([B, Hkv, T, D]): attention without
    paging, the bar a paged kernel is held to."""
    import torch.nn.functional as F

    k = k_cache[slots].permute(0, 2, 1, 3).contiguous()
    v = v_cache[slots].permute(0, 2, 1, 3).contiguous()
    qh = q.transpose(0, 1)[None] if prefill else q[:, :, None, :]
    return lambda: F.scaled_dot_product_attention(qh, k, v, is_causal=prefill, scale=scale,
                                                  enable_gqa=True)


def attention_kernels(contexts: list[int]) -> list[dict]:
    shapes = {"demo (9 heads, 3 KV, dim 64)": (9, 3, 64),
              "Llama-3-8B-like (32 heads, 8 KV, dim 128)": (32, 8, 128)}
    cases = [(name, shape, batch, context, False) for name, shape in shapes.items()
             for batch in BATCHES for context in contexts]
    cases += [(name, shape, 1, context, True) for name, shape in shapes.items()
              for context in contexts]
    return [{"kind": "prefill" if case[4] else "decode", "shape": case[0], "batch": case[2],
             "context": case[3], **attempt(lambda case=case: attention_case(*case))}
            for case in cases]


def attention_case(name: str, shape: tuple[int, int, int], batch: int, context: int,
                   prefill: bool) -> dict:
    """One shape timed three ways, after checking the Triton output against the reference."""
    from triton.testing import do_bench

    from kernels import reference, triton_ops

    log(f"attention {'prefill' if prefill else 'decode'} {name} batch {batch} ctx {context}")
    heads, kv_heads, dim = shape
    q, k_cache, v_cache, meta, slots = paged_case(batch, context, heads, kv_heads, dim,
                                                  prefill=prefill)
    scale = 1 / math.sqrt(dim)
    runs = {"triton": lambda: triton_ops.paged_attention(q, k_cache, v_cache, meta, scale),
            "sdpa_dense": dense_sdpa(q, k_cache, v_cache, slots, prefill, scale),
            "reference": lambda: reference.paged_attention(q, k_cache, v_cache, meta, scale)}
    error = (runs["triton"]().float() - runs["reference"]().float()).abs().max().item()
    ms = {k: do_bench(fn, return_mode="median") for k, fn in runs.items()}
    kv_bytes = 2 * slots.numel() * kv_heads * dim * k_cache.element_size()
    return {"triton_ms": ms["triton"], "sdpa_dense_ms": ms["sdpa_dense"],
            "reference_gather_sdpa_ms": ms["reference"],
            "sdpa_over_triton": ms["sdpa_dense"] / ms["triton"],
            "reference_over_triton": ms["reference"] / ms["triton"],
            "triton_kv_read_gbs": kv_bytes / (ms["triton"] / 1000) / 1e9,
            "max_abs_diff_vs_reference": error}


# ---- report ----
def attempt(measure: Callable[[], dict]) -> dict:
    """measure(), or the error it raised: one failing part (a kernel that does not compile on
    this GPU, a capture that fails) is reported without losing the rest of the run."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, the run goes on
        log(f"failed: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {exc}"}


def run(model: str | None, quick: bool) -> dict:
    import triton

    from engine.models import fetch_demo_model, resolve_model

    started = time.perf_counter()
    sz = sizes(quick)
    path = resolve_model(model) if model else fetch_demo_model(lambda message, fraction: None)
    log("copy bandwidth")
    bw = copy_bandwidth(sz["copy_mib"])
    chosen, skipped = variants()
    decode, outputs, prompts = {}, {}, {}
    for variant in chosen:
        def measure(variant=variant) -> dict:
            nonlocal prompts
            llm = open_engine(path, variant, sz)
            try:
                prompts = prompts or {b: synthetic_prompts(llm.tokenizer, b, PROMPT_TOKENS)
                                      for b in {*BATCHES, CHECK_BATCH}}
                result = engine_decode(llm, prompts, sz, bw["bandwidth_gbs"])
                outputs[variant.name] = greedy_tokens(llm, prompts[CHECK_BATCH])
                return result
            finally:
                llm.close()
                torch.cuda.empty_cache()

        decode[variant.name] = attempt(measure)
    reference = outputs.get("float16_reference")
    for name, tokens in outputs.items():
        if reference is not None:
            decode[name]["same_greedy_outputs_as_reference"] = same_outputs(tokens, reference)
    working = [n for n in ("float16_triton_graphs", "float16_triton") if n in outputs]
    best = working[0] if working else None
    hf = attempt(lambda: transformers_decode(path, prompts, sz)) if prompts else {
        "error": "no engine run finished, so there were no prompts to give transformers"}

    def ratio(a: str | None, b: str) -> dict | None:
        runs = {**decode, "transformers": hf}
        if a is None or "error" in runs.get(a, {}) or "error" in runs.get(b, {"error": ""}):
            return None  # the failure is reported where it happened
        return {f"batch_{n}": runs[a][f"batch_{n}"]["tokens_per_s"]
                / runs[b][f"batch_{n}"]["tokens_per_s"] for n in BATCHES}

    return {
        "benchmark": "gpu", "quick": quick, "model_path": str(path), "machine": machine(),
        "gpu": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "cuda": torch.version.cuda},
        "sizes": {**sz, "prompt_tokens": PROMPT_TOKENS, "batches": list(BATCHES)}, **bw,
        "decode_method": "tokens/s = batch * (n - 1) / (t(generate n) - t(generate 1)), medians "
                         "of alternating wall-clock runs after a warm-up; greedy, EOS ignored",
        "bound_method": "batch * bandwidth / (weight bytes + batch * mean context * KV bytes "
                        "per token): one read of the weights and of each sequence's KV per step",
        "decode": decode, "decode_skipped": skipped, "transformers": hf,
        "best_variant": best,
        "best_over_transformers": ratio(best, "transformers"),
        "best_over_reference_kernels": ratio(best, "float16_reference"),
        "triton_over_reference_kernels": ratio("float16_triton", "float16_reference"),
        "attention": attention_kernels(sz["contexts"]),
        "attention_method": "triton.testing.do_bench medians (ms), float16; sdpa_dense: "
                            "F.scaled_dot_product_attention on K/V already dense [B, Hkv, T, "
                            "D]; reference: the engine's gather + SDPA",
        "wall_s": time.perf_counter() - started,
        "finished_at": time.time(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--model", help="a GGUF path, an HF folder or a listed model name "
                                        "(default: the demo model)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu", "skipped": "no CUDA GPU: torch.cuda.is_available()"
                          " is False here, so there is nothing to measure",
                          "machine": machine()}))
        return 0
    print(json.dumps(run(args.model, args.quick), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
