"""Constrained decoding: replies that must be JSON (OpenAI's response_format json_object and
json_schema), through llguidance, a grammar library made for token masks.

llguidance was picked by measured overhead on this machine (benchmarks/grammar_overhead.py):
its mask costs 0.2 ms a token against a decode step of 15 ms or more (xgrammar's 0.02 ms,
outlines-core's 0.8 ms), it compiles a schema lazily (xgrammar 20 ms, outlines-core 0.8 s),
and it reads the tokenizer from its own `tokenizers` JSON: xgrammar imports transformers
(8 s here) and outlines-core needs the vocabulary decoded by hand. A request's
grammar is checked at the door (`check`), its matcher made when the engine takes it
(OutputProcessor.add), advanced by each token appended, and its mask applied by the sampler.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import numpy as np
import torch

# Compact JSON: with free whitespace a small model can emit blank lines until max_tokens and
# leave the object unfinished.
_JSON_OPTIONS = {"whitespace_flexible": False}
# id(tokenizer) -> (LLTokenizer, the tokenizer itself, kept so that its id stays unique)
_tokenizers: dict[int, tuple] = {}
_lock = threading.Lock()


class GrammarError(ValueError):
    """A schema the grammar compiler refuses, in one sentence."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a reply must be: "json_object" (any JSON object) or "json_schema" (`schema`)."""

    kind: str
    schema: str = ""  # the JSON schema as JSON text (frozen, hashable)

    def grammar(self) -> str:
        """llguidance's grammar for this spec."""
        from llguidance import LLMatcher

        schema = (closed_objects(json.loads(self.schema)) if self.kind == "json_schema"
                  else {"type": "object"})
        return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)


# Keywords whose values are subschemas: one, a map of them, or a list of them. allOf is left
# out on purpose: closing each of its branches would forbid the other branches' properties.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_OPENS_OBJECTS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def closed_objects(schema):
    """The schema with every object that lists its properties closed to any others unless it
    says otherwise (additionalProperties false where none of _OPENS_OBJECTS is given), as vLLM's
    default grammar backend (xgrammar's strict mode) and llama.cpp's schema converter read a
    schema. JSON Schema itself leaves such objects open, and the demo model asked for
    {"name": string} went on adding nested properties until max_tokens cut the JSON short."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if "properties" in out and not any(key in out for key in _OPENS_OBJECTS):
        out["additionalProperties"] = False
    return out


def _ll_tokenizer(tokenizer):
    """llguidance's view of the engine's tokenizer, built once per tokenizer (about 1 s)."""
    from llguidance import LLTokenizer

    with _lock:
        if id(tokenizer) not in _tokenizers:
            ll = LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                             eos_token=list(tokenizer.eos_token_ids))
            _tokenizers[id(tokenizer)] = (ll, tokenizer)
        return _tokenizers[id(tokenizer)][0]


def check(spec: GrammarSpec, tokenizer) -> None:
    """Raise GrammarError (naming the problem) if the spec cannot be compiled."""
    from llguidance import LLMatcher

    try:
        grammar = spec.grammar()
    except ValueError as exc:
        raise GrammarError(f"the schema is not valid JSON schema: {exc}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar,
                                                                  _ll_tokenizer(tokenizer))
    if is_error:
        raise GrammarError(f"the schema cannot be compiled: {messages[0].splitlines()[0]}")


class Matcher:
    """One sequence's place in its grammar: which tokens may come next."""

    def __init__(self, spec: GrammarSpec, tokenizer) -> None:
        from llguidance import LLMatcher

        self._ll = LLMatcher(_ll_tokenizer(tokenizer), spec.grammar(), log_level=0)

    def mask(self, row: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar forbids next to -inf in `row` ([V]); once
        the reply is complete only the end-of-sequence tokens remain. Does nothing once the
        matcher has failed (it never leaves a row with no token to pick)."""
        if self._ll.is_error():
            return
        # Bit j of the little-endian mask words is token j; logits wider than the tokenizer
        # (padding rows) are forbidden too.
        packed = np.frombuffer(self._ll.compute_bitmask(), dtype=np.uint8)
        forbidden = np.ones(row.numel(), dtype=bool)
        bits = np.unpackbits(packed, bitorder="little")[: row.numel()]
        forbidden[: bits.size] = bits == 0
        if row.device.type == "cpu":
            # numpy's putmask: torch's masked_fill_ on [V] went through its thread pool and
            # took 10+ ms a row here when the cores were busy.
            np.putmask(row.numpy(), forbidden, -np.inf)
        else:
            row.masked_fill_(torch.from_numpy(forbidden).to(row.device), float("-inf"))

    def accept(self, token: int) -> None:
        # A token outside the grammar only happens if the mask was bypassed (ignore_eos past
        # the end): the matcher then stops constraining rather than failing the engine step.
        self._ll.consume_token(token)


def new_matcher(spec: GrammarSpec, tokenizer) -> Matcher:
    return Matcher(spec, tokenizer)
