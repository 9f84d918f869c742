"""Speculative decoding settings, parsed from `--spec` strings such as `ngram` or `ngram:k=6`."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpecConfig:
    """Which proposer, how many draft tokens at most, and whether the length adapts."""

    method: str = "ngram"
    num_draft_tokens: int = 5
    ngram_max: int = 4
    ngram_min: int = 2
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"Unknown speculative method '{self.method}': use one of "
                             f"{', '.join(METHODS)}.")
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be 1..16, got {self.num_draft_tokens}.")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram sizes need 1 <= ngram_min <= ngram_max.")


def parse_spec(value: str | SpecConfig | None) -> SpecConfig | None:
    """`None`/"off" -> None; "ngram" or "ngram:k=6,adaptive=0" -> SpecConfig."""
    if value is None or isinstance(value, SpecConfig):
        return value
    if value in ("", "off", "none"):
        return None
    method, _, options = value.partition(":")
    fields: dict = {"method": method}
    names = {"k": "num_draft_tokens", "n": "ngram_max", "min": "ngram_min",
             "adaptive": "adaptive"}
    for item in filter(None, options.split(",")):
        key, _, raw = item.partition("=")
        if key not in names:
            raise ValueError(f"Unknown option '{key}' in --spec {value}: use "
                             f"{', '.join(names)}.")
        fields[names[key]] = raw not in ("0", "false", "off") if key == "adaptive" else int(raw)
    return SpecConfig(**fields)
