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
