"""The engine's speculative-decoding state: proposals per sequence, adaptive length, counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence
from engine.spec.config import SpecConfig
from engine.spec.ngram import propose_ngram

# Acceptance is tracked per sequence as an exponential moving average; below OFF_BELOW the
# sequence stops drafting for COOLDOWN steps (drafts that are rejected only cost verification).
EMA_DECAY = 0.7
FULL_AT = 0.5
OFF_BELOW = 0.15
COOLDOWN = 8
LOOKUP_TOKENS = 5  # prompt lookup's draft length in front of a draft model (lookup=1)


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted, per position)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return None if not self.draft_tokens else self.accepted_tokens / self.draft_tokens

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + accepted / drafts: tokens emitted per verification step (vLLM's definition)."""
        return None if not self.drafts else 1 + self.accepted_tokens / self.drafts

    def add(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


class SpecDecoder:
    """Proposes drafts for decoding sequences and learns how long they should be."""

    def __init__(self, config: SpecConfig, draft=None, max_model_len: int | None = None) -> None:
        self.config = config
        self.draft = draft  # a DraftModel for method "draft"
        self.counters = SpecCounters()
        self.max_model_len = max_model_len  # drafts never reach positions past the context
        self._model_drafted: set[str] = set()  # request ids the draft model drafted this step

    def propose_all(self, seqs: list[Sequence]) -> None:
        """Set `draft_token_ids` (possibly empty) of every sequence about to decode."""
        if self.draft is None:
            for seq in seqs:
                seq.draft_token_ids = self.propose(seq)
            return
        c, for_model = self.config, []
        for seq in seqs:
            k = self.draft_length(seq)
            # Lookup first when asked: free where the reply repeats itself or the prompt, and
            # its matches run long, so it may propose more than the draft model's k.
            lookup = propose_ngram(seq.all_token_ids, min(max(k, LOOKUP_TOKENS), self._room(seq)),
                                   c.ngram_max, c.ngram_min) if c.lookup and k else []
            if lookup:
                seq.draft_token_ids = lookup
            else:
                for_model.append((seq, k))
        self.draft.propose(for_model)
        self._model_drafted = {seq.request_id for seq, k in for_model if seq.draft_token_ids}

    def propose(self, seq: Sequence) -> list[int]:
        """Prompt-lookup draft tokens for one sequence (possibly none)."""
        k = self.draft_length(seq)
        if k == 0:
            return []
        c = self.config
        return propose_ngram(seq.all_token_ids, k, c.ngram_max, c.ngram_min)

    def draft_length(self, seq: Sequence) -> int:
        """The configured maximum, scaled down as the sequence's acceptance falls, and cut to
        the positions left in the context (the token to decode sits at cache index kv_len,
        position kv_len + position_offset; its drafts follow it)."""
        return min(self._adaptive_length(seq), self._room(seq))

    def _room(self, seq: Sequence) -> int:
        """Draft positions left before the end of the context."""
        if self.max_model_len is None:
            return 1 << 30
        return max(0, self.max_model_len - 1 - (seq.kv_len + seq.position_offset))

    def _adaptive_length(self, seq: Sequence) -> int:
        k_max = self.config.num_draft_tokens
        if not self.config.adaptive:
            return k_max
        if seq.spec_cooldown > 0:
            seq.spec_cooldown -= 1
            return 0
        if seq.spec_rate < OFF_BELOW:
            seq.spec_cooldown = COOLDOWN
            seq.spec_rate = FULL_AT / 2  # try again after the cooldown, with short drafts
            return 0
        return max(1, min(k_max, round(k_max * seq.spec_rate / FULL_AT)))

    def summary(self) -> dict:
        """The configuration and counters as plain values (for --json and the bench result)."""
        c = self.counters
        return {"method": self.config.method, "draft_model": self.config.draft_model,
                "lookup_first": self.config.lookup,
                "max_draft_tokens": self.config.num_draft_tokens,
                "adaptive": self.config.adaptive, "drafts": c.drafts,
                "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
                "accepted_per_position": list(c.accepted_per_pos),
                "acceptance_rate": c.acceptance_rate,
                "mean_accepted_length": c.mean_accepted_length}

    def after_step(self, sampling: list, new_tokens: list[list[int]], hidden) -> None:
        """Hand a hidden-state draft the target's hidden states of the step just run."""
        if hasattr(self.draft, "remember"):
            self.draft.remember(sampling, new_tokens, hidden)

    def after_verify(self, seq: Sequence, old_num_tokens: int, drafted: int,
                     accepted: int) -> None:
        """Let a draft model know which of its cached keys are still valid."""
        if self.draft is not None and seq.request_id in self._model_drafted:
            # A lookup draft leaves the draft model's cache where it was; it catches up later.
            self.draft.after_verify(seq, old_num_tokens, drafted, accepted)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Count a verification and update the sequence's acceptance estimate."""
        self.counters.add(proposed, accepted)
        rate = accepted / proposed
        seq.spec_rate = EMA_DECAY * seq.spec_rate + (1 - EMA_DECAY) * rate
