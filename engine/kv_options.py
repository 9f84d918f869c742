"""KV eviction options as users type them (CLI flags, HTTP fields, the app), without torch.

The budget is an int (tokens) or a float in (0, 1] (a fraction of each request's length), as
`LLM(kv_budget=...)` takes it; text is read so that "512" is tokens and "0.2" a fraction.
"""

from __future__ import annotations

from engine.sequence import RequestError


def parse_kv_budget(value: str | int | float | None) -> int | float | None:
    """An int of tokens or a float fraction from text or a JSON number; None stays None."""
    if value is None or isinstance(value, int | float) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            pass
    raise RequestError(f"kv_budget must be a number of tokens (e.g. 512) or a fraction of the "
                       f"request's length (e.g. 0.2), got {value!r}.")


KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # kernels.kv_quant.STORAGE's names, plus "auto"


def parse_kv_cache_dtype(value: str | None) -> str:
    """"auto" (the model's dtype), "int8" or "fp8" (e4m3), each quantized with a scale per token
    and KV head (kernels/kv_quant.py); anything else is a RequestError naming the choices."""
    text = (value or "auto").strip().lower()
    if text in ("float8", "fp8_e4m3", "float8_e4m3fn"):
        text = "fp8"
    if text not in KV_CACHE_DTYPES:
        raise RequestError(f"Unknown KV cache dtype '{value}': use auto (the model's dtype), "
                           "int8 or fp8.")
    return text


def kv_cache_bytes(kv_cache_dtype: str, model_element_bytes: int) -> tuple[int, int]:
    """(bytes per cached number, bytes of scale per token and KV head) of a KV cache dtype."""
    if kv_cache_dtype == "auto":
        return model_element_bytes, 0
    return 1, 4  # int8 / fp8 values with a float32 scale
