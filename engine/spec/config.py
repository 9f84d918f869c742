"""Speculative decoding settings, parsed from `--spec` strings such as `ngram` or `ngram:k=6`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

METHODS = ("ngram", "draft")
# "demo-draft" names the demo model's own early-exit draft, shipped with the repository
# (trained by benchmarks/train_draft.py); it is method "draft" with this file.
DEMO_DRAFT = "demo-draft"
DEMO_DRAFT_PATH = (Path(__file__).resolve().parents[2] / "assets" / "drafts"
                   / "smollm2-135m-hidden.safetensors")
# "demo-medusa" names the demo model's Medusa heads (benchmarks/train_medusa.py), likewise.
DEMO_MEDUSA = "demo-medusa"
DEMO_MEDUSA_PATH = DEMO_DRAFT_PATH.with_name("smollm2-135m-medusa.safetensors")
MEDUSA_DRAFT_TOKENS = 3  # its heads' default depth (held-out chain acceptance: its .json)
MAX_BRANCHES = 8
# Prompt lookup's deepest draft (ngram's default k, and lookup's in front of a draft model):
# copied text is accepted 90-100% per position out to 10 tokens (benchmarks/speculative.py,
# copy-heavy), and break-even (break_even.py) picks the depth actually drafted, each step, from
# the sequence's acceptance and the measured step costs. Up to 15 (the most a verification
# takes as decode rows) was no faster on the 2-core EPYC: copy-heavy 0.985x and 1.04x of 10 in
# two runs (a 16-token verification cost about two plain steps there).
LOOKUP_DEPTH = 10


@dataclass(frozen=True)
class SpecConfig:
    """Which proposer, how many draft tokens at most, and whether the length adapts."""

    method: str = "ngram"
    num_draft_tokens: int = 5
    ngram_max: int = 4
    ngram_min: int = 2
    adaptive: bool = True
    draft_model: str | None = None
    # With a draft model: prompt lookup first, the draft model only where lookup finds nothing.
    lookup: bool = False
    # Draft trees (engine/spec/tree.py): up to this many candidate continuations verified in one
    # pass (prompt lookup: distinct earlier continuations; the hidden-state draft: its most
    # likely first tokens). 1: one chain, as before.
    num_branches: int = 1

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts a sequence may take in one step: k, or lookup's depth where prompt
        lookup drafts in front of a draft model (its matches run longer than the model's k)."""
        return max(self.num_draft_tokens, LOOKUP_DEPTH) if self.lookup else self.num_draft_tokens

    def __post_init__(self) -> None:
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("A draft model goes with method 'draft' only: use draft:PATH.")
        if self.method not in METHODS:
            raise ValueError(f"Unknown speculative method '{self.method}': use one of "
                             f"{', '.join(METHODS)}, {DEMO_DRAFT} or {DEMO_MEDUSA}.")
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be 1..16, got {self.num_draft_tokens}.")
        if self.lookup and self.method != "draft":
            raise ValueError("lookup=1 goes with a draft model (draft:PATH or demo-draft); "
                             "ngram always looks up.")
        if not 1 <= self.num_branches <= MAX_BRANCHES:
            raise ValueError(f"branches must be 1..{MAX_BRANCHES}, got {self.num_branches}.")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram sizes need 1 <= ngram_min <= ngram_max.")


def parse_spec(value: str | SpecConfig | None) -> SpecConfig | None:
    """`None`/"off" -> None; "ngram", "ngram:k=6,adaptive=0", "draft:PATH[,k=4]" or
    "demo-draft[:k=3,lookup=1]" / "demo-medusa[:k=3,lookup=1]" (the demo model's shipped draft
    and Medusa heads) -> SpecConfig; any of them
    with "branches=N" verifies draft trees of up to N candidate continuations.

    A draft model's PATH may itself hold ',' or ':', so only trailing ",key=value" options
    that name a known option are split off it.
    """
    if value is None or isinstance(value, SpecConfig):
        return value
    if value in ("", "off", "none"):
        return None
    method, _, options = value.partition(":")
    fields: dict = {"method": method}
    if method == "ngram":
        fields["num_draft_tokens"] = LOOKUP_DEPTH
    if method == DEMO_DRAFT:
        # Up to 3 draft tokens (break-even picks each sequence's depth below that: the draft
        # gets its first two right together 36% of the time on held-out prompts, and open
        # chat with trees read 1.35x at 3 against 1.25x at 2, benchmarks/speculative.py)
        # and prompt lookup first (copy-heavy replies).
        fields = {"method": "draft", "draft_model": str(DEMO_DRAFT_PATH),
                  "num_draft_tokens": 3, "lookup": True}
    elif method == DEMO_MEDUSA:
        fields = {"method": "draft", "draft_model": str(DEMO_MEDUSA_PATH),
                  "num_draft_tokens": MEDUSA_DRAFT_TOKENS, "lookup": True}
    elif method == "draft":
        path, options = _split_trailing_options(options)
        if not path:
            raise ValueError("--spec draft needs a model: draft:PATH (a GGUF file or HF folder).")
        fields["draft_model"] = path
    names = {"k": "num_draft_tokens", "n": "ngram_max", "min": "ngram_min",
             "adaptive": "adaptive", "lookup": "lookup", "branches": "num_branches"}
    for item in filter(None, options.split(",")):
        key, _, raw = item.partition("=")
        if key not in names:
            raise ValueError(f"Unknown option '{key}' in --spec {value}: use "
                             f"{', '.join(names)}.")
        fields[names[key]] = (raw not in ("0", "false", "off") if key in ("adaptive", "lookup")
                              else _integer(key, raw, value))
    return SpecConfig(**fields)


def _integer(key: str, raw: str, value: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"Option '{key}' in --spec {value} needs a whole number, got "
                         f"'{raw}'.") from None


def _split_trailing_options(text: str) -> tuple[str, str]:
    parts = text.split(",")
    cut = len(parts)
    while cut > 1 and re.fullmatch(r"(k|adaptive|lookup|branches)=\w+", parts[cut - 1]):
        cut -= 1
    return ",".join(parts[:cut]), ",".join(parts[cut:])
