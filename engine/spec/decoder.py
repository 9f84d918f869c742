"""Speculative decoding as a step feature: proposals per sequence, batched verification,
adaptive draft length and vLLM's counters.

Proposers share one interface, `propose(requests)` filling each sequence's drafts: prompt lookup
(n-gram, below), a draft model (draft.py), a hidden-state draft (hidden_draft.py); "lookup
first" wraps a model proposer. The scheduler gives a decoding sequence's drafts their KV slots
as extra query tokens; verification runs over the whole step at once (verify.py).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.features import Step, StepFeature
from engine.runner import DECODE_ROW_CHUNK
from engine.sequence import Sequence
from engine.spec.break_even import (
    CALIBRATION_DECAY,
    CALIBRATION_MIN,
    PROBE_EVERY,
    MovingRatio,
    StepCosts,
    branch_threshold,
    draft_lengths,
)
from engine.spec.config import SpecConfig
from engine.spec.ngram import NgramIndex
from engine.spec.state import SpecState
from engine.spec.tree import ROOT, TokenTree, TreeDrafted, verify_tree_all
from engine.spec.verify import Drafted, verify_all

# Acceptance is tracked per sequence as an exponential moving average. Once the step costs are
# measured, draft lengths come from them (break_even.py); until then, below OFF_BELOW the
# sequence stops drafting for COOLDOWN steps (drafts that are rejected only cost verification).
EMA_DECAY = 0.7
FULL_AT = 0.5
OFF_BELOW = 0.15
COOLDOWN = 8
# The most draft tokens (a chain's, or a tree's nodes) one sequence puts into a verification.
# The runner attends a sequence's new tokens as decode rows, each as a plain decode step would,
# only up to DECODE_ROW_CHUNK of them; more go through a prefill chunk's attention, whose sums run
# in another order, so in bfloat16 a near tie could go the other way and the reply differ from
# plain decoding's (40-node prompt-lookup trees did, on open chat and shuffled words).
MAX_DRAFT_NODES = DECODE_ROW_CHUNK - 1
# A new request's acceptance per draft position before its own first verification: accepted
# over tried across recent verifications of every request (a moving ratio, PRIOR_DECAY), and
# PRIOR_RATE before any.
PRIOR_RATE = 0.8
PRIOR_DECAY = 0.95


def ema(old: float, new: float) -> float:
    """One step of a per-sequence moving average (EMA_DECAY: the weight of the old value)."""
    return EMA_DECAY * old + (1 - EMA_DECAY) * new


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted, per position)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Query tokens the drafts put into verification: a tree's nodes (a chain's equal its drafts).
    draft_nodes: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return None if not self.draft_tokens else self.accepted_tokens / self.draft_tokens

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + accepted / drafts: tokens emitted per verification step (vLLM's definition)."""
        return None if not self.drafts else 1 + self.accepted_tokens / self.drafts

    def add(self, proposed: int, accepted: int, nodes: int | None = None) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.draft_nodes += proposed if nodes is None else nodes
        self.accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


def observe_width(state: SpecState) -> None:
    """Fold the nodes per level of the drafts just proposed into the sequence's width (what
    break-even prices a level of its next draft at)."""
    if not state.tokens:
        return
    depth = len(state.tokens) if state.tree is None else state.tree.max_depth
    state.width = ema(state.width, len(state.tokens) / depth)


class Proposer(ABC):
    """Drafts tokens for decoding sequences: fills `spec_state(seq).tokens` with up to k (and,
    where it branches, `spec_state(seq).tree`). The other hooks are optional; by default they do
    nothing."""

    # Candidate continuations a proposal may branch into (SpecDecoder sets it from its config;
    # a proposer that only drafts chains ignores it).
    num_branches: int = 1
    # The deepest draft it can make (Medusa: its heads); None: as deep as it is asked.
    max_depth: int | None = None
    # The target layers whose residual stream it reads (layer counts; the runner keeps them
    # each step: StepResult.streams): a draft with EAGLE-3's fused features.
    stream_layers: tuple[int, ...] = ()

    @abstractmethod
    def propose(self, requests: list[tuple[Sequence, int]]) -> None: ...

    def source(self, seq: Sequence) -> int:
        """Which of its sources would draft for the sequence now (LookupFirst: prompt lookup or
        its model): break-even prices the draft from that source's own acceptance. 0 where
        there is one source."""
        return 0

    def source_depth(self, source: int) -> int | None:
        """The deepest draft that source makes (None: as deep as it is asked)."""
        return self.max_depth

    def remember(self, sampling: list, new_tokens: list[list[int]],  # noqa: B027 (optional)
                 hidden: torch.Tensor, streams: torch.Tensor | None = None) -> None:
        """The target's hidden states of the step just run, and its middle layers' streams
        where stream_layers asked for them (a hidden-state draft keeps them)."""

    def after_verify(self, seq: Sequence, old_num_tokens: int,  # noqa: B027 (optional)
                     proposed: int, accepted: int) -> None:
        """Which drafts were accepted (a draft model's cache is valid up to there)."""


def _reproducible(seq: Sequence) -> bool:
    """Whether the request samples with a seed of its own (its output must not vary)."""
    return seq.params.seed is not None and seq.params.temperature > 0


def spec_state(seq: Sequence) -> SpecState:
    """The sequence's speculative state, made on first use."""
    if seq.spec is None:
        seq.spec = SpecState()
    return seq.spec


def branches_for(seq: Sequence, num_branches: int) -> int:
    """How many candidate continuations the sequence's drafts may branch into. A sequence under
    a KV-eviction policy drafts a chain: its attention statistics are kept by cache index, and a
    tree's rejected branches would be counted at the accepted path's indices."""
    return num_branches if seq.kv is None else 1


def set_draft_paths(seq: Sequence, paths: list[list[int]],
                    probs: list[list[float]] | None = None) -> None:
    """The sequence's drafts from candidate continuations: one chain, or their tree; `probs`
    (per path, the proposer's probability of each of its prefixes) become the tree's node
    probabilities, which decide the branches worth their cost (SpecDecoder._prune_branches)."""
    state = spec_state(seq)
    if len(paths) <= 1:
        state.tokens, state.tree = (paths[0] if paths else []), None
        if probs and paths:  # a confident draft's chain: its confidence is calibrated too
            state.node_probs = list(probs[0])
        return
    state.tree = TokenTree.from_paths(paths)
    state.tokens = list(state.tree.tokens)
    if probs is not None:
        state.node_probs = [0.0] * len(state.tree)
        for path, path_probs in zip(paths, probs, strict=True):
            node = ROOT
            for token, p in zip(path, path_probs, strict=True):
                node = state.tree.child_with_token(node, token)
                state.node_probs[node] = max(state.node_probs[node], p)


class LookupProposer(Proposer):
    """Prompt lookup: the continuation of the latest earlier occurrence of the last n-gram (with
    branches, the different continuations of its earlier occurrences, as a tree)."""

    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.num_branches = config.num_branches

    def propose(self, requests: list[tuple[Sequence, int]]) -> None:
        for seq, k in requests:
            branches = branches_for(seq, self.num_branches)
            if not k:
                spec_state(seq).tokens = []
            elif branches == 1:
                spec_state(seq).tokens = self._index(seq).propose(seq.all_token_ids, k)
            else:
                set_draft_paths(seq, self._index(seq).paths(seq.all_token_ids, k, branches))

    def finds(self, seq: Sequence) -> bool:
        """Whether the sequence's tail occurred earlier (a draft would be proposed)."""
        return bool(self._index(seq).propose(seq.all_token_ids, 1))

    def _index(self, seq: Sequence) -> NgramIndex:
        state = spec_state(seq)
        if state.ngrams is None:
            state.ngrams = NgramIndex(self.config.ngram_max, self.config.ngram_min)
        return state.ngrams


class LookupFirst(Proposer):
    """Prompt lookup in front of a model proposer: free where the reply repeats itself or the
    prompt, and its matches run long, so it may draft as deep as LOOKUP_DEPTH where break-even
    says so; the model drafts only where lookup found nothing, at most its own depth."""

    LOOKUP, MODEL = 0, 1  # its sources

    def __init__(self, lookup: LookupProposer, model: Proposer, model_depth: int) -> None:
        self.lookup, self.model = lookup, model
        self.model_depth = min(model_depth, model.max_depth or model_depth)
        self.stream_layers = model.stream_layers
        self._model_drafted: set[str] = set()  # request ids the model drafted this step

    def source(self, seq: Sequence) -> int:
        return self.LOOKUP if self.lookup.finds(seq) else self.MODEL

    def source_depth(self, source: int) -> int | None:
        return None if source == self.LOOKUP else self.model_depth

    def propose(self, requests: list[tuple[Sequence, int]]) -> None:
        for_model = []
        for seq, k in requests:
            self.lookup.propose([(seq, k)])
            state = spec_state(seq)
            state.source = self.LOOKUP if state.tokens else self.MODEL
            if k and not state.tokens:
                for_model.append((seq, min(k, self.model_depth)))
        self.model.propose(for_model)
        self._model_drafted = {seq.request_id for seq, _ in for_model if spec_state(seq).tokens}

    def remember(self, sampling, new_tokens, hidden, streams=None) -> None:
        self.model.remember(sampling, new_tokens, hidden, streams)

    def after_verify(self, seq: Sequence, old_num_tokens: int, proposed: int,
                     accepted: int) -> None:
        # A lookup draft leaves the model's cache where it was; it catches up later.
        if seq.request_id in self._model_drafted:
            self.model.after_verify(seq, old_num_tokens, proposed, accepted)


class SpecDecoder(StepFeature):
    """Proposes drafts before each step, verifies them after it and learns how long they
    should be."""

    def __init__(self, config: SpecConfig, draft: Proposer | None = None,
                 max_model_len: int | None = None,
                 block_manager: BlockManager | None = None) -> None:
        self.config = config
        self.draft = draft  # a model proposer (DraftModel, HiddenDraft) for method "draft"
        if draft is not None:
            draft.num_branches = config.num_branches
        lookup = LookupProposer(config)
        if draft is None:
            self.proposer: Proposer = lookup
        elif config.lookup:
            self.proposer = LookupFirst(lookup, draft, config.num_draft_tokens)
        else:
            self.proposer = draft
        self.counters = SpecCounters()
        self.max_model_len = max_model_len  # drafts never reach positions past the context
        self.block_manager = block_manager  # rejected drafts' slots are trimmed off
        self.costs = StepCosts()  # this machine's decode-step and drafting costs, as measured
        # The proposer's confidence against what is accepted (accepted nodes / their
        # probabilities), and the acceptance per draft position over every request so far.
        self.calibration = MovingRatio(CALIBRATION_DECAY)
        # The prior starts as one verification at PRIOR_RATE, which fades as real ones come;
        # one per source of the proposer's drafts (Proposer.source), `acceptance` the first's.
        self.acceptance = MovingRatio(PRIOR_DECAY, num=PRIOR_RATE, den=1.0)
        self._priors = {0: self.acceptance}
        self._drafted_at: float | None = None  # when this step's proposals were done

    # ---- step hooks ----
    def before_schedule(self, running: list[Sequence]) -> None:
        decoding = []
        for seq in running:
            spec_state(seq).clear_drafts()
            if seq.num_uncomputed_tokens == 1:
                decoding.append(seq)
        self.propose_all(decoding)

    def choose(self, step: Step, logits: torch.Tensor, rows: list[int],
               chosen: list[list[int] | None]) -> None:
        """Verify every drafted sequence of the step in one batch."""
        drafted = [i for i, s in enumerate(step.sampling) if s.num_draft]
        chains = [i for i in drafted if spec_state(step.sampling[i].seq).tree is None]
        trees = [i for i in drafted if spec_state(step.sampling[i].seq).tree is not None]
        if chains:
            self._verify_chains(step, logits, rows, chains, chosen)
        if trees:
            self._verify_trees(step, logits, rows, trees, chosen)

    def _verify_chains(self, step: Step, logits: torch.Tensor, rows: list[int],
                       indices: list[int], chosen: list[list[int] | None]) -> None:
        items = []
        for i in indices:
            s = step.sampling[i]
            state = spec_state(s.seq)
            q = state.probs[: s.num_draft] if state.probs else None
            items.append(Drafted(s.seq, logits[rows[i] : rows[i] + 1 + s.num_draft],
                                 state.tokens[: s.num_draft],
                                 None if q is None else torch.stack(q)))
        for i, tokens in zip(indices, verify_all(items), strict=True):
            chosen[i] = tokens
            state = spec_state(step.sampling[i].seq)
            state.path = list(range(len(tokens) - 1))
            self.record(step.sampling[i].seq, step.sampling[i].num_draft, len(tokens) - 1)
            if state.node_probs is not None:
                self.calibration.observe(
                    len(tokens) - 1, sum(state.node_probs[: step.sampling[i].num_draft]))

    def _verify_trees(self, step: Step, logits: torch.Tensor, rows: list[int],
                      indices: list[int], chosen: list[list[int] | None]) -> None:
        """Tree drafts (deterministic proposals: prompt lookup, a draft's top tokens)."""
        items = []
        for i in indices:
            s = step.sampling[i]
            tree = spec_state(s.seq).tree.prefix(s.num_draft)
            items.append(TreeDrafted(s.seq, logits[rows[i] : rows[i] + 1 + s.num_draft], tree))
        for i, item, verdict in zip(indices, items, verify_tree_all(items), strict=True):
            chosen[i] = verdict.tokens
            spec_state(item.seq).path = verdict.path
            # A tree counts as a draft of its depth: acceptance is per draft position.
            self.record(item.seq, item.tree.max_depth, len(verdict.path), len(item.tree))
            probs = spec_state(item.seq).node_probs
            if probs is not None:
                self.calibration.observe(len(verdict.path), sum(probs[: len(item.tree)]))

    def after_forward(self, step: Step) -> None:
        """Count accepted drafts as computed, trim the rejected ones' slots, clear drafts;
        learn the step's cost if it only decoded."""
        self._observe_step_cost(step)
        for s, row in zip(step.sampling, step.rows, strict=False):
            if s.num_draft:
                self._keep_path(step, s.seq, row, spec_state(s.seq).path)
        self.proposer.remember(step.sampling, step.tokens, step.result.hidden,
                               step.result.streams)
        for s, tokens in zip(step.sampling, step.tokens, strict=True):
            seq, state = s.seq, spec_state(s.seq)
            if s.num_draft:
                seq.num_computed_tokens += len(tokens) - 1
                self.proposer.after_verify(seq, seq.num_tokens, len(state.tokens),
                                           len(tokens) - 1)
                self.block_manager.trim(seq, seq.kv_len + 1)  # cached, not computed: eviction
            state.clear_drafts()

    def _keep_path(self, step: Step, seq: Sequence, row: int, path: list[int]) -> None:
        """Lay the accepted drafts out as a chain's would be: their KV at the cache indices
        right after the last real token (draft node i was written at index kv_len + i), and,
        where the request asked for log-probabilities, their logits rows right after the root's
        row (`row`), where the output reads them. A chain's path is 0, 1, ..., so nothing moves;
        a tree's accepted branch may sit anywhere among its nodes. The KV destinations lie past
        the sequence's computed tokens, in blocks not yet full of them, so never in a block the
        prefix cache has indexed or another sequence shares. (A hidden-state draft reads its
        state at the path's last node where it lies: StateProposer.remember.)"""
        moves = [(node, depth) for depth, node in enumerate(path) if node != depth]
        if not moves:
            return
        base = seq.kv_len  # the last real token counts as computed already
        bm, result = self.block_manager, step.result
        result.runner.copy_slots([bm.slot(seq, base + node) for node, _ in moves],
                                 [bm.slot(seq, base + depth) for _, depth in moves])
        if seq.logprobs is None:
            return
        src = torch.tensor([row + 1 + node for node, _ in moves], device=result.logits.device)
        dst = torch.tensor([row + 1 + depth for _, depth in moves], device=result.logits.device)
        # The forward pass made these under inference mode: writing them outside it raises (and
        # the step would be recomputed request by request, engine/core.py's isolation).
        with torch.inference_mode():
            result.logits[dst] = result.logits[src]

    def on_preempt(self, seq: Sequence) -> None:
        state = spec_state(seq)
        state.clear_drafts()
        state.draft_computed = 0

    def _observe_step_cost(self, step: Step) -> None:
        """A step that only decoded (each sequence one token and its drafts) costs T(tokens):
        from the end of proposing to the tokens chosen (verification included)."""
        if self._drafted_at is None or not step.scheduled:
            return
        if any(s.num_new_tokens != 1 + s.num_draft for s in step.scheduled):
            return  # a prefill chunk rode along: not a decode step's cost
        tokens = sum(s.num_new_tokens for s in step.scheduled)
        self.costs.observe_step(tokens, step.now - self._drafted_at, len(step.scheduled))

    # ---- proposing ----
    def propose_all(self, seqs: list[Sequence]) -> None:
        """Set the drafts (possibly none) of every sequence about to decode."""
        # Only sequences given drafts reach the proposer (none drafts for k = 0; their drafts
        # were cleared before scheduling): at 16 sequences most steps draft for none, and the
        # loops over all of them were most of speculation's cost in such a step.
        requests = [(seq, k) for seq, k in zip(seqs, self.draft_lengths(seqs), strict=True) if k]
        if requests:
            drafting = [seq for seq, _ in requests]
            start = time.perf_counter()
            self.proposer.propose(requests)
            # The proposer's cost per token it drafted, before pruning drops some (counting
            # only the kept ones would make each drafted token look dearer the more are pruned).
            proposed = sum(len(spec_state(seq).tokens) for seq in drafting)
            self.costs.observe_drafting(proposed, time.perf_counter() - start)
            self._prune_branches(drafting, len(seqs))
            self._fit_trees(drafting)
            for seq in drafting:
                observe_width(spec_state(seq))
        self._drafted_at = time.perf_counter()

    def _prune_branches(self, seqs: list[Sequence], batch: int) -> None:
        """Keep a tree's nodes off its first path only where they pay (break_even.py's
        branch_threshold at the step's `batch` against the node's calibrated probability); the
        first path's depth break-even chose already. A tree left with its first path alone is
        drafted as a chain. Not for seeded sampled requests (their drafts may not depend on
        measured times)."""
        threshold = (branch_threshold(self.costs.at_batch(batch), batch)
                     if self.config.adaptive else None)
        if threshold is None:
            return
        scale = self.calibration.value(1.0, CALIBRATION_MIN)
        for seq in seqs:
            state = spec_state(seq)
            tree, probs = state.tree, state.node_probs
            if tree is None or probs is None or _reproducible(seq):
                continue
            first = tree.first_path_length()
            kept: set[int] = set()
            for node, parent in enumerate(tree.parents):
                if node < first or ((parent == -1 or parent in kept)
                                    and scale * probs[node] >= threshold):
                    kept.add(node)
            if len(kept) == len(tree):
                continue
            order = sorted(kept)
            state.node_probs = [probs[i] for i in order]
            if len(order) == first:
                state.tokens, state.tree = list(tree.tokens[:first]), None
            else:
                state.tree = tree.subset(order)
                state.tokens = list(state.tree.tokens)

    def _fit_trees(self, seqs: list[Sequence]) -> None:
        """A tree keeps its first MAX_DRAFT_NODES nodes (parents come first, so they are still
        a tree). Its nodes beyond its first path are drafts admission did not plan a request's
        blocks for: keep them only where the free blocks hold them now, else draft the first
        path alone (a sequence the pool cannot hold would be preempted by its own drafts)."""
        for seq in seqs:
            state = spec_state(seq)
            tree = state.tree
            if tree is not None and len(tree) > MAX_DRAFT_NODES:
                tree = state.tree = tree.prefix(MAX_DRAFT_NODES)
                state.tokens = list(tree.tokens)
                if state.node_probs is not None:
                    state.node_probs = state.node_probs[:MAX_DRAFT_NODES]
            if tree is not None and not self.block_manager.can_append(seq, 1 + len(tree)):
                # Nodes are numbered in proposal order: the first leaf ends the first path.
                state.tokens, state.tree = tree.path_tokens(tree.leaves()[0]), None

    def draft_lengths(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's draft length: at most the configured one and the positions left in
        the context; adaptive, where drafting pays by the measured costs (break_even.py), or,
        until they are known, scaled down as the sequence's acceptance falls."""
        caps = [min(self.max_draft_tokens, self._room(seq)) for seq in seqs]
        if not self.config.adaptive:
            return caps
        for i, seq in enumerate(seqs):
            state = spec_state(seq)
            state.source = self.proposer.source(seq)
            caps[i] = min(caps[i], self.proposer.source_depth(state.source) or caps[i])
        # A seeded sampled request must come out the same every time, and its random draws
        # depend on where drafts fall: its lengths may not depend on measured times.
        timed = [i for i, seq in enumerate(seqs) if not _reproducible(seq)]
        paying = draft_lengths([self._position_rate(seqs[i]) for i in timed],
                               [caps[i] for i in timed], self.costs.at_batch(len(timed)),
                               [spec_state(seqs[i]).width for i in timed])
        decided = {} if paying is None else dict(zip(timed, paying, strict=True))
        if decided and not any(decided.values()):
            self._cost_probe(seqs, timed, caps, decided)
        probe = bool(decided) and self._probe_pays(len(seqs))
        # The acceptance rule only where break-even did not decide: it counts down a cooldown
        # each time it is asked, which must not run on for sequences it does not rule.
        return [self._with_idle_rules(seq, decided[i], cap, probe) if i in decided
                else min(self._adaptive_length(seq), cap)
                for i, (seq, cap) in enumerate(zip(seqs, caps, strict=True))]

    def _cost_probe(self, seqs: list[Sequence], timed: list[int], caps: list[int],
                    decided: dict[int, int]) -> None:
        """Where break-even left every sequence without drafts and no step bigger than the
        batch's plain one was measured lately, the most promising sequence drafts its full
        depth this step: a size's cost is learnt only from steps of that size, so costs measured
        in a slow moment would keep drafting off for good (break_even.STALE_STEPS). At most
        once in STALE_STEPS steps: the probe's own step is fresh that long."""
        if self.costs.at_batch(len(timed)).fresh_above(len(timed)):
            return
        able = [i for i in timed if caps[i] > 0]
        if able:
            best = max(able, key=lambda i: self._position_rate(seqs[i]))
            decided[best] = caps[best]

    def _probe_pays(self, batch: int) -> bool:
        """Whether a probe (one draft token for a sequence break-even left without drafts) costs
        at most what one token costs decoding plainly at this batch: the step's extra query
        token and the drafting. At batch 1 a probe is nearly free; at 16 sequences on the EPYC
        the 17th query token once cost 3.6 ms of a 22 ms step, and probes alone, one every other
        step, made speculation 2-4% slower than none."""
        costs = self.costs.at_batch(batch)
        step, more = costs.step_s(batch), costs.step_s(batch + 1)
        if step is None or more is None:
            return True
        return more - step + (costs.draft_token_s or 0.0) <= step / batch

    def _with_idle_rules(self, seq: Sequence, k: int, cap: int, probe: bool = True) -> int:
        """The draft length break-even chose (k), with the rules for a sequence it left without
        drafts (cap > 0, k = 0): each such step its acceptance estimate moves one EMA weight
        back towards the prior (what drafts achieve for every request), since the few
        rejections that stopped it say little about the text to come; and it tries one draft
        now and then (where the prior is low too, its acceptance may still rise), where such a
        probe costs no more than a plain token (_probe_pays).

        Without the drift, two or three rejections in a row left a reply's estimate at 0.16-0.23
        with no verification to correct it, and the trained draft sat idle for 98 of 168 steps
        of open chat that it drafts at 50% acceptance (trees over open chat: 1.26x before the
        drift, 1.46x after, alternating in one run: README)."""
        state = spec_state(seq)
        if k or not cap:
            state.idle_steps = 0
            return k
        if state.verifications:
            state.position_rate = ema(state.position_rate, self.prior_of(state.source))
        state.idle_steps += 1
        if state.idle_steps < PROBE_EVERY or not probe:
            return 0
        state.idle_steps = 0
        return 1

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts a sequence may take in one step (admission sizes requests by it)."""
        deepest = min(self.config.max_draft_tokens, MAX_DRAFT_NODES)
        if self.proposer.max_depth is not None:  # not behind lookup (LookupFirst has none)
            return min(deepest, self.proposer.max_depth)
        return deepest

    def _room(self, seq: Sequence) -> int:
        """Draft positions left before the end of the context."""
        if self.max_model_len is None:
            return 1 << 30
        return max(0, self.max_model_len - 1 - (seq.kv_len + seq.position_offset))

    def _adaptive_length(self, seq: Sequence) -> int:
        k_max = self.config.num_draft_tokens
        if not self.config.adaptive:
            return k_max
        state = spec_state(seq)
        if state.cooldown > 0:
            state.cooldown -= 1
            return 0
        if state.rate < OFF_BELOW:
            state.cooldown = COOLDOWN
            state.rate = FULL_AT / 2  # try again after the cooldown, with short drafts
            return 0
        return max(1, min(k_max, round(k_max * state.rate / FULL_AT)))

    def summary(self) -> dict:
        """The configuration and counters as plain values (for --json and the bench result)."""
        c = self.counters
        return {"method": self.config.method, "draft_model": self.config.draft_model,
                "lookup_first": self.config.lookup,
                "max_draft_tokens": self.config.num_draft_tokens,
                "adaptive": self.config.adaptive,
                "step_ms_by_tokens": {n: t * 1e3 for n, t in sorted(
                    self.costs.by_tokens.items())},
                "draft_token_ms": (None if self.costs.draft_token_s is None
                                   else self.costs.draft_token_s * 1e3),
                "drafts": c.drafts, "draft_nodes": c.draft_nodes,
                "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
                "accepted_per_position": list(c.accepted_per_pos),
                "acceptance_rate": c.acceptance_rate,
                "mean_accepted_length": c.mean_accepted_length}

    def record(self, seq: Sequence, proposed: int, accepted: int,
               nodes: int | None = None) -> None:
        """Count a verification and update the sequence's acceptance estimate."""
        self.counters.add(proposed, accepted, nodes)
        state = spec_state(seq)
        state.rate = ema(state.rate, accepted / proposed)
        # Per position: the drafts tried until the first rejection (all, if none was).
        tried = min(accepted + 1, proposed)
        state.position_rate = ema(self._position_rate(seq), accepted / tried)
        state.verifications += 1
        self._prior(state.source).observe(accepted, tried)

    def _position_rate(self, seq: Sequence) -> float:
        """The sequence's acceptance per draft position: its own once a draft of it has been
        verified, before that the prior learnt from earlier requests (a new request is not
        assumed to be as predictable as a fixed guess: at a large batch, 16 new requests
        drafting on an optimistic guess cost more than their drafts bring)."""
        state = spec_state(seq)
        return state.position_rate if state.verifications else self.prior_of(state.source)

    @property
    def position_prior(self) -> float:
        """A new request's acceptance per draft position: what drafts achieved so far (the
        proposer's first source's)."""
        return self.prior_of(0)

    def prior_of(self, source: int) -> float:
        """position_prior for the drafts of one of the proposer's sources."""
        return self._prior(source).value(PRIOR_RATE)

    def _prior(self, source: int) -> MovingRatio:
        prior = self._priors.get(source)
        if prior is None:
            prior = self._priors[source] = MovingRatio(PRIOR_DECAY, num=PRIOR_RATE, den=1.0)
        return prior
