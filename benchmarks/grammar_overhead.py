"""Constrained decoding: which grammar library costs the engine least, and what JSON replies
cost against free text.

One JSON object. Part 1, the libraries: llguidance, xgrammar and outlines-core, each where it
installs, on the demo model's tokenizer and the same JSON schemas: time to build the
tokenizer view and compile each schema, then the cost per token of one decode step's grammar
work (the next-token bitmask computed, the chosen token accepted) along the same token
sequences (valid replies, tokenized by the engine), against the engine's own decode step on
this machine. Applying a bitmask to the logits is the same work whichever library made it
(measured apart, as the engine does it). Part 2, the engine as shipped (llguidance,
engine/grammar.py): 100 chat requests with response_format json_schema over the schemas,
sampled (temperature 0.8, a seed each), every reply parsed and validated against its schema,
and the generated tokens/s with the grammar against the same requests without it (held to
the same lengths), alternated in chunks of 10 so both see the same machine load; and 20 of
them with xgrammar's matcher in the engine's place, alternated the same way.
Run: python benchmarks/grammar_overhead.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

import jsonschema  # noqa: E402
import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.grammar import GrammarSpec, Matcher  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402

# (schema, a valid reply): the replies give every library the same token sequence to follow.
CASES = [
    ({"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                       "population": {"type": "integer", "minimum": 0,
                                                      "maximum": 10**9}},
      "required": ["city", "population"], "additionalProperties": False},
     {"city": "Paris", "population": 2102650}),
    ({"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 3}},
      "required": ["answer", "confidence", "tags"], "additionalProperties": False},
     {"answer": "yes", "confidence": 87, "tags": ["capital", "france"]}),
    ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 40}, "admin": {"type": "boolean"}},
      "required": ["name", "age", "admin"], "additionalProperties": False},
     {"name": "Alice Martin", "age": 34, "email": "alice@example.org", "admin": False}),
    ({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "steps": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object", "properties": {
                      "n": {"type": "integer", "minimum": 1, "maximum": 9},
                      "text": {"type": "string", "maxLength": 20}},
                      "required": ["n", "text"], "additionalProperties": False}}},
      "required": ["title", "steps"], "additionalProperties": False},
     {"title": "Boil an egg", "steps": [{"n": 1, "text": "Boil water"},
                                        {"n": 2, "text": "Cook 8 minutes"}]}),
    ({"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5}},
      "required": ["sentiment", "score"], "additionalProperties": False},
     {"sentiment": "positive", "score": 4}),
]
QUESTIONS = ["Describe Paris as JSON.", "Answer as JSON: is Paris the capital of France?",
             "Give a user record as JSON.", "How do I boil an egg? Reply in JSON.",
             "Rate this review as JSON: 'Great food, slow service.'"]
REQUESTS = 100
COMPARED = 20  # requests run with each library end to end
# Room for the largest reply the schemas allow (every string and array at its bound), so a
# reply is never cut off unfinished.
MAX_TOKENS = 192


# ---- part 1: the libraries on the same token sequences ----
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (the demo tokenizer is byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _vocab_bytes(tokenizer) -> list[bytes]:
    decoder = _byte_decoder()
    pieces = [tokenizer.backend.id_to_token(i) for i in range(tokenizer.vocab_size)]
    return [bytes(decoder[c] for c in p) if all(c in decoder for c in p) else p.encode()
            for p in pieces]


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        self.version = version("llguidance")
        self.tokenizer = tokenizer
        Matcher(GrammarSpec("json_object"), tokenizer)  # builds the tokenizer view (cached)

    def compile(self, schema: dict):
        return GrammarSpec("json_schema", json.dumps(schema))

    def run(self, compiled, tokens: list[int], times: list) -> bool:
        m = Matcher(compiled, self.tokenizer)._ll
        for t in tokens:
            times.append(time.perf_counter())
            m.compute_bitmask()
            if not m.consume_token(t):
                return False
        return True


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar as xgr

        self.xgr, self.version = xgr, version("xgrammar")
        pieces = [tokenizer.backend.id_to_token(i) for i in range(tokenizer.vocab_size)]
        info = xgr.TokenizerInfo(pieces, xgr.VocabType.BYTE_LEVEL,
                                 vocab_size=tokenizer.vocab_size,
                                 stop_token_ids=list(tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab = tokenizer.vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(",", ":"))

    def run(self, compiled, tokens: list[int], times: list) -> bool:
        xgr = self.xgr
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, self.vocab)
        for t in tokens:
            times.append(time.perf_counter())
            m.fill_next_token_bitmask(mask)
            if not m.accept_token(t):
                return False
        return True


class _OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer) -> None:
        import outlines_core as oc

        self.oc = oc
        self.version = version("outlines-core")
        eos = tokenizer.eos_token_ids[0]
        vocab: dict[bytes, list[int]] = {}
        for i, b in enumerate(_vocab_bytes(tokenizer)):
            if i not in tokenizer.eos_token_ids:
                vocab.setdefault(b, []).append(i)
        self.vocabulary = oc.Vocabulary(eos, vocab)
        self.vocab = tokenizer.vocab_size

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), "")
        return self.oc.Index(regex, self.vocabulary)

    def run(self, compiled, tokens: list[int], times: list) -> bool:
        from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask

        guide = self.oc.Guide(compiled)
        mask = allocate_token_bitmask(self.vocab)
        for t in tokens:
            times.append(time.perf_counter())
            fill_next_token_bitmask(guide, mask)
            if not guide.accepts_tokens([t]):
                return False
            guide.advance(t)
        return True


def library_costs(tokenizer, step_ms: float) -> list[dict]:
    traces = [tokenizer.encode(json.dumps(reply, separators=(",", ":")))
              for _, reply in CASES]
    results = []
    for cls in (_Llguidance, _Xgrammar, _OutlinesCore):
        try:
            start = time.perf_counter()
            lib = cls(tokenizer)
            setup_s = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - a library that does not install or load
            results.append({"library": cls.name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        results.append(_measure(lib, setup_s, traces, step_ms))
    return results


def _measure(lib, setup_s: float, traces: list[list[int]], step_ms: float) -> dict:
    """Compile time per schema, the first token's grammar work (a lazy compiler pays its
    grammar there) and the mean of the others'."""
    compile_ms, first_ms, per_token, accepted = [], [], [], 0
    for (schema, _), tokens in zip(CASES, traces, strict=True):
        start = time.perf_counter()
        compiled = lib.compile(schema)
        compile_ms.append((time.perf_counter() - start) * 1000)
        times: list[float] = []
        ok = lib.run(compiled, tokens, times)
        times.append(time.perf_counter())
        steps = [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False)]
        first_ms.append(steps[0])
        per_token.extend(steps[1:])
        accepted += ok
    mean = statistics.fmean(per_token)
    return {"library": lib.name, "version": lib.version, "setup_s": round(setup_s, 3),
            "compile_ms_median": round(statistics.median(compile_ms), 2),
            "compile_ms_max": round(max(compile_ms), 2),
            "first_token_ms_median": round(statistics.median(first_ms), 3),
            "mask_ms_per_token": round(mean, 4),
            "mask_ms_per_token_p90": round(sorted(per_token)[int(0.9 * len(per_token))], 4),
            "traces_accepted": f"{accepted}/{len(traces)}",
            "overhead_vs_decode_step": round(mean / step_ms, 4)}


def apply_ms(tokenizer) -> float:
    """The engine's share: one bitmask unpacked and applied to a row of logits."""
    m = Matcher(GrammarSpec("json_object"), tokenizer)
    row = torch.zeros(tokenizer.vocab_size)
    m.mask(row)
    start = time.perf_counter()
    for _ in range(100):
        m.mask(row)
    return (time.perf_counter() - start) * 10


# ---- part 2: the engine with and without the grammar ----
class _XgrammarMatcher:
    """engine.grammar.Matcher's two calls over xgrammar, to run the engine end to end with
    the other candidate (the engine ships llguidance's)."""

    compiler = None

    def __init__(self, spec: GrammarSpec, tokenizer) -> None:
        import xgrammar as xgr

        if _XgrammarMatcher.compiler is None:
            _XgrammarMatcher.compiler = _Xgrammar(tokenizer).compiler
        schema = spec.schema if spec.kind == "json_schema" else '{"type": "object"}'
        compiled = self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                     separators=(",", ":"))
        self.xgr, self.m = xgr, xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)

    def mask(self, row: torch.Tensor) -> None:
        self.m.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(row.unsqueeze(0), self.bitmask)

    def accept(self, token: int) -> None:
        self.m.accept_token(token)


CHUNK = 10  # requests per alternation: the machine's load drifts; each chunk sees both runs


def engine_runs(llm: LLM) -> dict:
    """The json_schema requests through the engine, in chunks; each chunk run constrained,
    then without the grammar held to the same lengths (ignore_eos, max_tokens = each
    constrained reply's), so both runs batch the same work under the same load. The first
    COMPARED requests also run with xgrammar's matcher in the engine's place."""
    totals = {b: {"tokens": 0, "s": 0.0, "free_s": 0.0, "valid": 0, "count": 0, "bad": []}
              for b in ("llguidance", "xgrammar")}
    for start in range(0, REQUESTS, CHUNK):
        ids = range(start, min(start + CHUNK, REQUESTS))
        for backend in ("llguidance", "xgrammar"):
            if backend == "xgrammar" and start >= COMPARED:
                continue
            _chunk(llm, backend, list(ids), totals[backend])
    return {b: _summary(t) for b, t in totals.items()}


def _chunk(llm: LLM, backend: str, ids: list[int], total: dict) -> None:
    prompts, params, schemas = [], [], []
    for i in ids:
        case = i % len(CASES)
        prompts.append(llm.chat_prompt([{"role": "user", "content": QUESTIONS[case]}]))
        params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS,
                                     grammar=GrammarSpec("json_schema",
                                                         json.dumps(CASES[case][0]))))
        schemas.append(CASES[case][0])
    constrained = _with_backend(backend, lambda: _timed(llm, prompts, params))
    free = [SamplingParams(temperature=0.8, seed=i, max_tokens=len(o.token_ids),
                           ignore_eos=True) for i, o in zip(ids, constrained["outputs"],
                                                            strict=True)]
    free_run = _timed(llm, prompts, free)
    total["tokens"] += constrained["tokens"]
    total["s"] += constrained["s"]
    total["free_s"] += free_run["s"]
    total["count"] += len(ids)
    for o, schema in zip(constrained["outputs"], schemas, strict=True):
        ok = _validates(o.text, schema)
        total["valid"] += ok
        if not ok:
            total["bad"].append(o.text)


def _summary(t: dict) -> dict:
    return {"requests": t["count"], "valid_json_schema_replies": t["valid"],
            "constrained_tokens_per_s": round(t["tokens"] / t["s"], 2),
            "unconstrained_tokens_per_s": round(t["tokens"] / t["free_s"], 2),
            "ratio_constrained_vs_unconstrained": round(t["free_s"] / t["s"], 3),
            "mean_tokens": round(t["tokens"] / t["count"], 1), "invalid_examples": t["bad"][:3]}


def _with_backend(backend: str, run):
    """Run with the engine's matcher (llguidance) or xgrammar's in its place."""
    import engine.output_processor as op

    shipped = op.new_matcher
    if backend == "xgrammar":
        op.new_matcher = _XgrammarMatcher
    try:
        return run()
    finally:
        op.new_matcher = shipped


def _timed(llm: LLM, prompts, params) -> dict:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return {"outputs": outputs, "s": wall, "tokens": sum(len(o.token_ids) for o in outputs)}


def _validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def decode_step_ms(llm: LLM) -> float:
    """The engine's own batch-1 decode step on this machine (the yardstick for part 1)."""
    ids = llm.chat_prompt([{"role": "user", "content": QUESTIONS[0]}])
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    return out.metrics.tpot_s * 1000


def main() -> None:
    llm = LLM(str(fetch_demo_model(progress=lambda m, f: None)), device="cpu",
              kv_cache_tokens=32768, max_num_seqs=16)
    step_ms = decode_step_ms(llm)
    libraries = library_costs(llm.tokenizer, step_ms)
    engine = engine_runs(llm)
    print(json.dumps({"benchmark": "grammar_overhead", "machine": machine(),
                      "model": llm.model_name, "decode_step_ms_batch1": round(step_ms, 3),
                      "libraries": libraries,
                      "apply_bitmask_ms_per_row": round(apply_ms(llm.tokenizer), 4),
                      "engine": engine}, indent=2))


if __name__ == "__main__":
    main()
