"""When drafting pays: the engine's own measured step costs against each sequence's acceptance.

A decode step over B sequences costs T(B); verifying D draft tokens with them costs T(B + D)
plus the proposer's time. On a CPU a verify step of 1 + k tokens costs 1.5-1.9 plain steps, so a
draft that is mostly rejected makes a request slower; on a GPU at batch 1 it is nearly free, and
at a large batch it is not. So nothing here is assumed: T is learnt from the steps the engine
runs (decode-only steps, by query tokens), the proposer's cost per draft token likewise, and a
sequence whose drafts are accepted with probability p per position is expected to gain
E_k = p + p^2 + ... + p^k tokens from k drafts (the accepted prefix; vLLM's and EAGLE's
analysis). Each step, drafts are handed out where they raise the batch's tokens per second, the
most promising sequences first, and nowhere else: below break-even a request decodes plainly.

A tree of depth k is priced by its nodes, not its depth: a sequence whose trees have held w
nodes per level (its measured width) puts about w * k query tokens into the step, and the
proposer drafts each of them. Its p is then the tree's acceptance per level, which the tree's
extra branches raise: that is what they are paid for. Which branches a tree keeps is priced
node by node: a node off the first path stays only where its probability of being accepted (the
proposer's own, scaled by how often its nodes have been accepted against it: a MovingRatio)
buys more tokens than its query token's time would decoding plainly (branch_threshold).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cache

COST_DECAY = 0.8  # weight of the old estimate in each moving average
# A sequence left without drafts tries one draft token every PROBE_EVERY steps, so a reply that
# becomes predictable (a quote, a list) is noticed; a probe costs at most one verify step in 32.
PROBE_EVERY = 32
# The draft's calibration (accepted nodes against its own probabilities) is a moving ratio over
# about 1 / (1 - CALIBRATION_DECAY) drafts; below CALIBRATION_MIN expected nodes it is 1.
CALIBRATION_DECAY = 0.95
CALIBRATION_MIN = 2.0
# A sequence drafts only where its drafts raise the batch's tokens per second by this fraction
# at least: the costs are moving averages of noisy steps, and speculation switched on costs a
# little each step that no draft's price includes (0.3-0.6 ms of a 24 ms step of 16 sequences
# on the EPYC). Drafts that paid by less on paper left 16 concurrent requests 6-9% slower than
# without speculation there; at batch 1 the drafts that pay bring 30% and more.
DRAFT_MARGIN = 0.05
# A step size not stepped in the last STALE_STEPS decode steps (2-5 s on the 2-core CPU) is
# priced from fresher ones where two or more sizes are fresh, and a new measurement replaces it
# rather than moving it by one average's weight. Where nothing bigger than the plain step is
# fresh, one sequence drafts its full depth once (a cost probe, SpecDecoder._cost_probe), so
# the sizes drafting would use are measured again: their costs are learnt only from steps that
# use them, and costs measured high once (another process took the cores for 6 s) stopped
# drafting for good in 1 of 4 trials: the engine ran plain, open chat 100 tok/s against 139
# before, for the rest of its life (benchmarks/spec_recovery.py).
STALE_STEPS = 200


def expected_accepted(p: float, k: int) -> float:
    """Tokens expected from k drafts accepted with probability p each, in order."""
    return expected_accepted_by_depth(p, k)[-1] if k else 0.0


def expected_accepted_by_depth(p: float, k: int) -> list[float]:
    """expected_accepted(p, d) for d = 1..k, built up one depth at a time (draft_lengths tries
    every depth of every sequence each step)."""
    out, term, total = [], 1.0, 0.0
    for _ in range(k):
        term *= p
        total += term
        out.append(total)
    return out


@dataclass
class StepCosts:
    """Seconds per decode step by its query tokens, and per draft token proposed."""

    by_tokens: dict[int, float] = field(default_factory=dict)
    draft_token_s: float | None = None
    # Decode steps observed (all batches', counted by all steps' costs), and the count at which
    # each size was last stepped: how fresh its cost is.
    steps: int = 0
    seen_at: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    stale_after: int = STALE_STEPS  # in steps; a batch's own costs follow all steps'
    # The same per batch size (sequences decoding): a step's time depends on its shape, not only
    # its query tokens (on the EPYC a plain step of 16 sequences took 23 ms, one sequence's
    # 16-token verification 28-31), and priced from all steps alike, drafts at 16 sequences
    # looked nearly free and made speculation 13% slower than none. See at_batch.
    by_batch: dict[int, StepCosts] = field(default_factory=dict, repr=False, compare=False)
    # Where a batch's own costs come from (set by at_batch): all steps', whose slope is the
    # batch's until it has stepped two sizes. Read only then: refitting all steps' curve every
    # step for a batch that has its own (batch 1, after a few verifications) was a third of
    # the pricing's time, about 30 us a step on the 2-core EPYC.
    _all_steps: StepCosts | None = field(default=None, repr=False, compare=False)
    # The priced sizes in order, their times and the fitted slope, rebuilt after a step is
    # observed or a priced size goes stale (the step count in _curve_until): draft_lengths
    # prices every depth of every sequence each step (at 16 sequences and depths up to 10,
    # rebuilding them per price cost 0.9 ms of a 26.5 ms step: benchmarks/spec_pricing.py).
    _curve: tuple[list[int], list[float], float | None] | None = \
        field(default=None, repr=False, compare=False)
    _curve_until: float = field(default=0.0, repr=False, compare=False)

    def observe_step(self, tokens: int, seconds: float, batch: int | None = None) -> None:
        if self._root is self:
            self.steps += 1
        old = self.by_tokens.get(tokens)
        self.by_tokens[tokens] = seconds if old is None or not self._fresh(tokens) else \
            COST_DECAY * old + (1 - COST_DECAY) * seconds
        self.seen_at[tokens] = self._now()
        self._curve = None
        if batch is not None:
            own = self.by_batch.setdefault(batch, StepCosts())
            own._all_steps = self
            own.observe_step(tokens, seconds)

    @property
    def _root(self) -> StepCosts:
        """All steps' costs: they count the steps and hold the staleness window."""
        return self._all_steps or self

    def _now(self) -> int:
        return self._root.steps

    def _fresh(self, tokens: int) -> bool:
        return tokens in self.seen_at and self._now() - self.seen_at[tokens] < \
            self._root.stale_after

    def fresh_above(self, tokens: int) -> bool:
        """Whether a step bigger than `tokens` was measured within the last stale_after."""
        return any(n > tokens and self._fresh(n) for n in self.by_tokens)

    def at_batch(self, batch: int) -> StepCosts:
        """The costs of steps decoding `batch` sequences, from their own steps: a size they have
        not stepped is priced from their nearest one along the slope of all steps until they
        have stepped two; the proposer's cost is all steps'. Where no step was recorded with
        its batch (a table set by hand), all steps'."""
        if not self.by_batch:
            return self
        own = self.by_batch.setdefault(batch, StepCosts())
        own._all_steps, own.draft_token_s = self, self.draft_token_s
        return own

    def observe_drafting(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        per = seconds / tokens
        old = self.draft_token_s
        self.draft_token_s = per if old is None else COST_DECAY * old + (1 - COST_DECAY) * per

    def _fitted(self) -> tuple[list[int], list[float], float | None]:
        """The sizes priced from (the fresh ones where two or more are, else all measured),
        their times made non-decreasing, and the least-squares slope through them."""
        if self._curve is None or self._now() >= self._curve_until:
            fresh = [n for n in sorted(self.by_tokens) if self._fresh(n)]
            sizes = fresh if len(fresh) >= 2 else sorted(self.by_tokens)
            # Valid until a fresh size in use goes stale (all sizes in use: until a step).
            self._curve_until = (min(self.seen_at[n] for n in fresh) + self._root.stale_after
                                 if len(fresh) >= 2 else float("inf"))
            times = [self.by_tokens[n] for n in sizes]
            self._curve = (sizes, _non_decreasing(times), _least_squares_slope(sizes, times))
        return self._curve

    def step_s(self, tokens: int) -> float | None:
        """T(tokens): measured if seen; between two measured sizes, the straight line between
        them; beyond the measured sizes, the nearest one's plus the fitted slope (never
        negative) per token; None while fewer than two sizes have been seen.

        Anchored at measured sizes, not read off the fitted line: a line through small batches
        (where a CPU step is memory-bound, 0.5 ms a token) and one measured large one put
        T(17) below the measured T(16) and drafting at 16 looked free."""
        sizes, times, _ = self._fitted()
        i = bisect_left(sizes, tokens)
        if i < len(sizes) and sizes[i] == tokens:
            return times[i]
        slope = self.slope()
        if slope is None or not sizes:
            return None
        if 0 < i < len(sizes):
            below, above = sizes[i - 1], sizes[i]
            return times[i - 1] + (times[i] - times[i - 1]) * (tokens - below) / (above - below)
        if i == len(sizes):
            return times[-1] + slope * (tokens - sizes[-1])
        return max(1e-9, times[0] - slope * (sizes[0] - tokens))

    def slope(self) -> float | None:
        """Seconds one more query token adds to a step: the least-squares line through the
        measured sizes (never negative); with fewer than two, all steps' (for a batch's own
        costs) or None."""
        own = self._fitted()[2]
        if own is None and self._all_steps is not None:
            return self._all_steps.slope()
        return own

    @property
    def known(self) -> bool:
        """Whether sizes can be priced: two measured, or a slope to price from (a batch's own
        costs, which may not have measured even their plain step yet)."""
        return len(self.by_tokens) >= 2 or self.slope() is not None


def _non_decreasing(times: list[float]) -> list[float]:
    """The closest non-decreasing sequence to `times` (least squares: pool adjacent violators).
    A step of more query tokens never costs less, but the measured times say so where a size
    is seldom stepped: once a sequence drafts nearly every step, T(1) is the rare plain step's,
    one noisy sample (16.0 ms against T(2) 12.1 in one run), and a draft's verification looked
    cheaper than none, so drafts were made at 5% acceptance."""
    blocks: list[list[float]] = []  # [mean, count] of pooled runs
    for t in times:
        blocks.append([t, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _least_squares_slope(xs: list[int], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / spread)


@dataclass
class MovingRatio:
    """The ratio of two moving sums, each decayed by `decay` per observation (about the last
    1 / (1 - decay) observations count): the calibration of a draft's confidence (accepted
    nodes over the sum of their probabilities) and the acceptance per draft position over
    every request (accepted over tried)."""

    decay: float
    num: float = 0.0
    den: float = 0.0

    def observe(self, num: float, den: float) -> None:
        self.num = self.decay * self.num + num
        self.den = self.decay * self.den + den

    def value(self, default: float, min_den: float = 1e-9) -> float:
        """num / den, or `default` while den is below `min_den` (too little seen)."""
        return self.num / self.den if self.den >= min_den else default


def branch_threshold(costs: StepCosts, batch: int) -> float | None:
    """The acceptance probability a drafted tree node off its first path must have to be worth
    verifying: it adds a query token to the step (the measured slope) and must bring at least
    the tokens that time buys decoding plainly at this batch (its proposing is spent already).
    None while the costs are unknown."""
    step, slope = costs.step_s(batch), costs.slope()
    if step is None or slope is None:
        return None
    return batch / step * slope


def tree_nodes(width: float, depth: int) -> int:
    """Query tokens a draft of `depth` levels adds, `width` nodes per level (at least one)."""
    return max(depth, round(width * depth))


def draft_lengths(rates: list[float], caps: list[int], costs: StepCosts,
                  widths: list[float] | None = None) -> list[int] | None:
    """Draft depth per decoding sequence that maximises the step's tokens per second (0 where
    drafting does not pay), or None while the costs are not yet known.

    `rates[i]` is sequence i's acceptance probability per draft position (per tree level),
    `caps[i]` the deepest draft it may take, `widths[i]` its drafts' nodes per level (1, a
    chain, by default). Greedy, most promising sequence first: each takes the depth that
    raises the batch's rate most, against the rate the batch makes already.
    """
    widths = widths or [1.0] * len(rates)
    batch = len(rates)
    if not costs.known:
        return None
    if batch not in costs.by_tokens:
        # A batch size never stepped: one plain step measures it before any draft is priced
        # against a guess (16 new requests once drafted on costs extrapolated from batch 1's).
        return [0] * batch
    time_s = costs.step_s(batch)
    per_draft = costs.draft_token_s or 0.0
    step_s = cache(costs.step_s)  # each size priced once per call, not once per depth tried
    tokens, n = float(batch), batch
    lengths = [0] * batch
    # The last sequence left without drafts (its rate, width and cap): one after it in the
    # order, no likelier, no narrower and no deeper, gains less at every depth for no less
    # time, against the same batch, so it is left without drafts unpriced (at 16 sequences the
    # pricing took 0.36 ms of a 25 ms step, most of it for sequences that drafted nothing).
    idle: tuple[float, float, int] | None = None
    for i in sorted(range(batch), key=lambda j: -rates[j]):
        if (idle is not None and rates[i] <= idle[0] and widths[i] >= idle[1]
                and caps[i] <= idle[2]):
            continue
        best = (tokens / time_s * (1 + DRAFT_MARGIN), 0, tokens, time_s)
        for k, gain in enumerate(expected_accepted_by_depth(rates[i], caps[i]), start=1):
            nodes = tree_nodes(widths[i], k)
            step_k = step_s(n + nodes)
            if step_k is None:
                return None
            gained = tokens + gain
            spent = step_k + (time_s - step_s(n)) + per_draft * nodes
            if gained / spent > best[0]:
                best = (gained / spent, k, gained, spent)
        _, k, tokens, time_s = best
        lengths[i] = k
        n += tree_nodes(widths[i], k)
        if not k:
            idle = (rates[i], widths[i], caps[i])
    return lengths
