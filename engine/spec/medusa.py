"""Medusa heads: several next-next tokens read off the target's last hidden state at once.

Head i (0-based) predicts the token i + 1 places after the one the target's own head just chose,
from the same state h, with one residual block (Medusa's recipe):

    z_i = h + SiLU(W_i h + b_i),  d_i = argmax(z_i . E[vocab])

through the target's tied LM head restricted to the draft's vocabulary. Unlike the hidden-state
draft (hidden_draft.py), no head sees the tokens drafted before it, so all of them cost one
batched matrix product each and nothing chains; with branches, the draft is a tree of the most
probable paths through the heads' top tokens (Medusa's tree, chosen per step by confidence as
EAGLE-2 does). A file (safetensors, written by
benchmarks/train_medusa.py) holds the heads and `draft.vocab_ids`; the head rows are the
target's embedding, so they are not shipped. Drafts are argmax choices: verification treats
them as deterministic proposals and stays lossless for sampled requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model import LlamaModel
from engine.sampler import argmax_rows
from engine.sequence import Sequence
from engine.spec.decoder import branches_for, set_draft_paths, spec_state
from engine.spec.hidden_draft import StateProposer, keep_best, load_draft_file, remembered_states

FORMAT = "servescope-medusa"


def head_names(i: int) -> tuple[str, str]:
    return f"heads.{i}.weight", f"heads.{i}.bias"


def medusa_states(h: torch.Tensor, weights: dict[str, torch.Tensor], heads: int,
                  linear=F.linear) -> torch.Tensor:
    """z_i for i < heads ([heads, B, hidden]) from the target's states h ([B, hidden]).

    The training script runs this same function, so training and serving cannot drift apart;
    serving passes the target's own matmul (`linear`, float32 out) and weights prepared for it.
    """
    return torch.stack([h + F.silu(linear(h, weights[w], weights[b]))
                        for w, b in map(head_names, range(heads))])


class MedusaHeads(StateProposer):
    """Proposes up to `num_heads` tokens per sequence from its remembered hidden state."""

    def __init__(self, path: str, target: LlamaModel, target_tokenizer) -> None:
        heads = 0
        tensors, ids = load_draft_file(path, target, target_tokenizer, head_names(0),
                                       head_names(0)[0])
        while all(n in tensors for n in head_names(heads)):
            heads += 1
        super().__init__(path, target, ids)
        self.num_heads = self.max_depth = heads
        self.weights = self.prepare(tensors)

    def propose(self, requests: list[tuple[Sequence, int]]) -> None:
        """Fill each sequence's draft (up to min(k, heads) tokens): the heads' best tokens as a
        chain, or with branches a tree of the most probable paths through the heads' top
        tokens (see best_paths)."""
        active = [(seq, min(k, self.num_heads)) for seq, k in requests
                  if k > 0 and spec_state(seq).hidden_at is not None]
        if not active:
            return
        depth = max(k for _, k in active)
        branches = [branches_for(seq, self.num_branches) for seq, _ in active]
        with torch.inference_mode():
            h = remembered_states([seq for seq, _ in active])
            scores = self.scores(medusa_states(h, self.weights, depth, self.linear))
            # [depth, B, vocab]
            if max(branches) == 1:
                chains = self.vocab_ids[torch.tensor(argmax_rows(scores))].T.tolist()  # [B, depth]
                for (seq, k), chain in zip(active, chains, strict=True):
                    set_draft_paths(seq, [chain[:k]])
                return
            probs, tokens = self.top_tokens(scores, max(branches))
        probs, tokens = probs.transpose(0, 1).tolist(), tokens.transpose(0, 1).tolist()
        for i, (seq, k) in enumerate(active):
            set_draft_paths(seq, *best_paths(probs[i][:k], tokens[i][:k], branches[i]))


def best_paths(probs: list[list[float]], tokens: list[list[int]], n: int
               ) -> tuple[list[list[int]], list[list[float]]]:
    """The n most probable paths through the heads' top tokens (`probs[level][j]` is the
    probability of `tokens[level][j]`; the heads are taken as independent, as Medusa's trees
    do), found level by level as a beam of n; a path below BRANCH_RATIO of the best one's
    probability is dropped, so confident heads draft a chain. Each path comes with its
    probability at every depth."""
    beam = [(1.0, [], [])]
    for level_probs, level_tokens in zip(probs, tokens, strict=True):
        beam = keep_best([(p * q, path + [t], cum + [p * q]) for p, path, cum in beam
                          for q, t in zip(level_probs[:n], level_tokens[:n], strict=True)], n)
    return [path for _, path, _ in beam], [cum for _, _, cum in beam]
