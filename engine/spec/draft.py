"""A draft model: a smaller model sharing the target's tokenizer, drafting into its own KV cache.

The draft's paged cache mirrors the target's: same slots, same block tables, so a sequence's
blocks hold both models' keys and values and preemption or trimming frees both at once. Each
sequence's SpecState remembers how far the draft has computed (`draft_computed`); the next
proposal first catches up on the tokens accepted since, then drafts one token per forward pass.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.config import ModelError
from engine.model import LlamaModel
from engine.runner import ModelRunner, RunItem
from engine.sampler import argmax_rows, draw, filtered_probs, generator_for
from engine.sequence import Sequence
from engine.spec.decoder import Proposer, spec_state


class DraftModel(Proposer):
    """Proposes tokens with a second, cheaper model; its probabilities go to verification."""

    def __init__(self, path: str, target_tokenizer, target_vocab: int, device: torch.device,
                 dtype: torch.dtype, block_manager: BlockManager, max_positions: int) -> None:
        from engine.loader import load_checkpoint

        ckpt = load_checkpoint(path, dtype=torch.float32)
        check_same_tokenizer(ckpt.tokenizer, target_tokenizer, ckpt.config.vocab_size,
                             target_vocab, path)
        self.name = ckpt.name
        self.model = LlamaModel(ckpt.config, ckpt.tensors, device, dtype, max_positions)
        self.runner = ModelRunner(self.model, block_manager)
        self.block_manager = block_manager

    def propose(self, requests: list[tuple[Sequence, int]]) -> None:
        """Fill each sequence's draft (up to k tokens) and, for sampled requests, draft_probs."""
        active = [(seq, k) for seq, k in requests if k > 0 and self._reserve(seq, k)]
        for seq, _ in active:
            spec_state(seq).tokens, spec_state(seq).probs = [], []
        items = [RunItem(seq.all_token_ids[spec_state(seq).draft_computed :],
                         spec_state(seq).draft_computed, seq.block_table, 1) for seq, _ in active]
        while active:
            logits = self.runner.run_items(items).logits
            for (seq, _), row in zip(active, logits, strict=True):
                self._pick(seq, row)
            active = [(seq, k) for seq, k in active if len(spec_state(seq).tokens) < k]
            items = [RunItem([spec_state(seq).tokens[-1]], seq.num_tokens - 1 +
                             len(spec_state(seq).tokens), seq.block_table, 1)
                     for seq, _ in active]

    def after_verify(self, seq: Sequence, old_num_tokens: int, proposed: int,
                     accepted: int) -> None:
        """The draft's keys are valid up to the last accepted draft it took as input."""
        spec_state(seq).draft_computed = old_num_tokens + min(accepted, proposed - 1)

    def _reserve(self, seq: Sequence, k: int) -> bool:
        # The same blocks the scheduler will ask for (computed + 1 + k), so it allocates none.
        if not self.block_manager.can_append(seq, 1 + k):
            return False
        self.block_manager.append_slots(seq, 1 + k)
        return True

    def _pick(self, seq: Sequence, logits: torch.Tensor) -> None:
        state = spec_state(seq)
        if seq.params.greedy:
            state.tokens.append(argmax_rows(logits.unsqueeze(0))[0])
            return
        q = filtered_probs(logits.unsqueeze(0), [seq.params])[0]
        state.tokens.append(draw(q, generator_for(seq)))
        state.probs.append(q)


def make_draft(path: str, target_tokenizer, target_vocab: int, device: torch.device,
               dtype: torch.dtype, block_manager: BlockManager, max_positions: int,
               target_model: LlamaModel):
    """A hidden-state draft or Medusa heads for a draft file (.safetensors from
    train_draft.py or train_medusa.py), else a draft model."""
    from engine.spec import medusa
    from engine.spec.hidden_draft import FORMAT, HiddenDraft

    kind = draft_format(path)
    if kind == FORMAT:
        return HiddenDraft(path, target_model, target_tokenizer)
    if kind == medusa.FORMAT:
        return medusa.MedusaHeads(path, target_model, target_tokenizer)
    return DraftModel(path, target_tokenizer, target_vocab, device, dtype, block_manager,
                      max_positions)


def draft_format(path: str) -> str | None:
    """The servescope draft format of `path` (hidden_draft.FORMAT, or medusa.FORMAT for Medusa
    heads), or None where it is not a .safetensors file (a draft model of its own); a
    .safetensors file that is missing or not such a draft is a ModelError naming it."""
    from engine.spec.hidden_draft import FORMAT, read_metadata
    from engine.spec.medusa import FORMAT as MEDUSA_FORMAT

    p = Path(path)
    if p.suffix != ".safetensors":
        return None
    if not p.is_file():
        raise ModelError(f"The draft file {path} does not exist: check the path (the demo "
                         "drafts are rebuilt by benchmarks/train_draft.py and "
                         "benchmarks/train_medusa.py).")
    found = read_metadata(p).get("format")
    if found not in (FORMAT, MEDUSA_FORMAT):
        raise ModelError(f"{path} is not a servescope draft (a hidden-state draft or Medusa "
                         "heads): give a draft written by benchmarks/train_draft.py or "
                         "benchmarks/train_medusa.py, a GGUF file or a Hugging Face folder.")
    return found


def check_same_tokenizer(draft, target, draft_vocab: int, target_vocab: int, path: str) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    if draft_vocab != target_vocab or draft.backend.get_vocab() != target.backend.get_vocab():
        raise ModelError(
            f"The draft model {path} uses a different tokenizer than the target "
            f"({draft_vocab} vs {target_vocab} embeddings): pick a draft model trained with the "
            "target's tokenizer.")
