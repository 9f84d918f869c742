"""Parse Prometheus exposition text with prometheus_client's parser, failing soft on garbage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
# DCGM writes blanks as values just under 2**63; they mean "no reading", not a number.
DCGM_BLANK_FLOOR = 9.2e18


class MetricsError(ValueError):
    """Metrics text that could not be parsed; the message is one sentence."""


@dataclass
class Scrape:
    """Every sample of one scrape by sample name (counters keep `_total`, buckets keep `le`);
    `non_finite` counts the NaN/±Inf samples left out (with `non_finite_names`, the first few)."""

    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)
    non_finite: int = 0
    non_finite_names: list[str] = field(default_factory=list)

    def names(self) -> set[str]:
        return set(self.samples)

    def values(self, name: str) -> list[tuple[Labels, float]]:
        return self.samples.get(name, [])


def _is_dcgm_blank(value: float) -> bool:
    return abs(value) >= DCGM_BLANK_FLOOR


def parse_metrics(text: str) -> Scrape:
    """Parse exposition text; raise MetricsError naming the problem when it is malformed."""
    if text.lstrip().startswith(('"', "{", "<")):
        # llama.cpp once served the text as a JSON string; HTML means a wrong URL or a proxy page.
        raise MetricsError("the response is not Prometheus text (it looks like JSON or HTML)")
    scrape = Scrape()
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                value = float(s.value)
                if not math.isfinite(value):
                    # Counted, not silently lost: a source sending only these is reported down.
                    scrape.non_finite += 1
                    if len(scrape.non_finite_names) < 3:
                        scrape.non_finite_names.append(s.name)
                    continue
                if _is_dcgm_blank(value):
                    continue
                labels = tuple(sorted(s.labels.items()))
                scrape.samples.setdefault(s.name, []).append((labels, value))
    except Exception as exc:  # the parser raises ValueError, IndexError, TypeError... on garbage
        raise MetricsError(f"malformed metrics text ({type(exc).__name__}: {exc})"[:300]) from exc
    return scrape
