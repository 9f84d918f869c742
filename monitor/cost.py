"""Cost per 1M tokens from a server's $/hour and its measured tokens/s."""

from __future__ import annotations

from monitor.types import Poll, Sample, SourceStatus


def cost_per_million_tokens(dollars_per_hour: float, tokens_per_s: float) -> float | None:
    """$ per 1M tokens = ($/h) / (tokens/s * 3600) * 1e6; None while nothing is generated."""
    if dollars_per_hour < 0:
        raise ValueError("the hourly price cannot be negative")
    if tokens_per_s <= 0:
        return None
    return dollars_per_hour / (tokens_per_s * 3600.0) * 1e6


class CostSource:
    """Derives "<server>-cost/usd_per_1m_tokens" from a hub's tokens/s series of that server."""

    def __init__(self, hub, server: str, dollars_per_hour: float, window_s: float = 60.0,
                 tokens_series: str = "generation_tokens_per_s", interval_s: float = 1.0) -> None:
        cost_per_million_tokens(dollars_per_hour, 1.0)  # validates the price
        self.hub = hub
        self.name = f"{server}-cost"
        self.key = f"{server}/{tokens_series}"
        self.dollars_per_hour = dollars_per_hour
        self.window_s = window_s
        self.interval_s = interval_s
        self.status = SourceStatus(state="up", kind="cost")

    def poll(self, now: float) -> Poll:
        _, values = self.hub.series(self.key, since=now - self.window_s)
        if not len(values):
            return Poll()
        cost = cost_per_million_tokens(self.dollars_per_hour, float(values.mean()))
        if cost is None:
            return Poll()
        return Poll([Sample(f"{self.name}/usd_per_1m_tokens", now, cost)])

    def close(self) -> None:
        pass
