"""What the quality canary can see: a KV-cache change scored by prefill and by decoding.

Two `servescope serve` of the demo model on 127.0.0.1 (the model's KV dtype, and an int8 KV
cache), scored by the canary's own client (monitor.canary.score) on the whole bundled held-out
text (465 tokens): as a prefill (what any server's prompt log-probabilities give) and by
decoding (`prompt_logprobs_decode_from`: the first DECODE_FROM tokens prefilled, the rest
decoded one at a time through the request's cache), with and without H2O eviction at a 10%
and a 20% budget. Each figure is a perplexity ratio against the full cache's score of the same
kind in the same run; the canary's alert fires above 1.05.

    python benchmarks/canary_sensitivity.py    # about four minutes on 2 cores
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from engine import LLM  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.models import demo_path  # noqa: E402
from engine.server import serve  # noqa: E402
from monitor.canary import DEFAULT_TOLERANCE, heldout_text, score  # noqa: E402

DECODE_FROM = 64


def _scores(url: str, text: str, extra: dict | None = None) -> dict:
    prefill = score(url, None, text, extra_body=extra)
    decoded = score(url, None, text, extra_body=extra, decode_from=DECODE_FROM)
    return {"prefill": prefill.perplexity, "decoded": decoded.perplexity,
            "decoded_tokens": decoded.tokens, "decode_s": round(decoded.elapsed_s, 1)}


def _ratios(case: dict, full: dict) -> dict:
    ratios = {kind: round(case[kind] / full[kind], 4) for kind in ("prefill", "decoded")}
    return case | {"ratio_" + k: v for k, v in ratios.items()} | {
        "alert_by_prefill": ratios["prefill"] > 1 + DEFAULT_TOLERANCE,
        "alert_by_decoding": ratios["decoded"] > 1 + DEFAULT_TOLERANCE}


def main() -> None:
    model, text = str(demo_path()), heldout_text()
    cases: dict[str, dict] = {}
    for kv_dtype in ("auto", "int8"):
        server = serve(LLM(model, device="cpu", kv_cache_tokens=2048, kv_cache_dtype=kv_dtype),
                       "127.0.0.1", 0)
        try:
            cases[f"kv {kv_dtype}"] = _scores(server.url, text)
            if kv_dtype == "auto":
                dtype = server.llm.dtype
                for budget in (0.1, 0.2):
                    cases[f"h2o {budget:.0%}"] = _scores(
                        server.url, text, {"kv_policy": "h2o", "kv_budget": budget})
        finally:
            server.close()
    full = cases["kv auto"]
    print(json.dumps({"benchmark": "canary_sensitivity", "machine": machine(),
                      "model_dtype": dtype, "decode_from": DECODE_FROM,
                      "baseline": "the full cache in the model's dtype, same kind of score",
                      "cases": {name: _ratios(case, full) for name, case in cases.items()}}))


if __name__ == "__main__":
    main()
