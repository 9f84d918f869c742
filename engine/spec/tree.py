"""Token trees and their lossless verification: several candidate continuations checked in one
forward pass (SpecInfer, Medusa, EAGLE-2).

A tree's nodes are draft tokens; node i hangs under `parents[i]`, an earlier node or -1, the
root: the sequence's last real token, whose target distribution chooses among the depth-1
nodes. The engine runs the root and every node as one query chunk, node i at position
context_len + depth(i) and attending to the context and its own ancestors only, so the target's
distribution at a node is the one it would have after that node's root path written as a chain.

Verification walks down from the root, choosing among a node's children:

- greedy: the child whose token is the target's argmax; where none is, the argmax itself ends
  the round;
- sampled, deterministic proposals (prompt lookup, a draft's top-k; siblings are distinct
  tokens): try child x1, accepted with probability p(x1); else remove x1 from p and renormalise,
  try x2 with that p, and so on; when every child is rejected the round ends with a token drawn
  from what is left of p. Exactly the target's distribution: each try either emits x_j with the
  probability p gives it or leaves p conditioned on "not x_j";
- sampled, stochastic proposals (siblings drawn independently from the draft's q at their
  parent): SpecInfer's rule: accept x with probability min(1, p(x) / q(x)), else
  p <- norm(max(p - q, 0)) and try the next child; when all are rejected, draw from p.

An accepted child becomes the node whose children are tried next; a leaf that is accepted ends
the round with a token drawn from the target's distribution after it (the bonus token). A chain
is a tree with one child per node, and then both rules are verify.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from engine.sampler import argmax_rows, draw, filtered_probs, generator_for
from engine.sequence import Sequence
from engine.spec.verify import joined, residual
from kernels.metadata import ancestor_mask, tree_depths

ROOT = -1  # the parent of depth-1 nodes: the sequence's last real token


@dataclass(frozen=True)
class TokenTree:
    """Draft tokens and the parent of each (an earlier node or ROOT), parents first."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a token tree needs one parent per token: {len(self.tokens)} "
                             f"tokens, {len(self.parents)} parents")
        tree_depths(list(self.parents))  # raises on a parent that is not an earlier node

    @classmethod
    def chain(cls, tokens: list[int]) -> TokenTree:
        """The tree of a plain draft: each token under the one before it."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> TokenTree:
        """The trie of several continuations: shared prefixes become one path, so siblings are
        always distinct tokens. Nodes are numbered in insertion order, so the first path comes
        first (and its children are tried first)."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for path in paths:
            node = ROOT
            for token in path:
                child = index.get((node, token))
                if child is None:
                    child = index[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = child
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth: 1 under the root."""
        return tuple(tree_depths(list(self.parents)))

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]  # slot 0: the root's
        for node, parent in enumerate(self.parents):
            kids[parent + 1].append(node)
        return tuple(tuple(k) for k in kids)

    def children(self, node: int) -> tuple[int, ...]:
        """The nodes under `node` (ROOT for the depth-1 nodes), in proposal order."""
        return self._children[node + 1]

    def child_with_token(self, node: int, token: int) -> int | None:
        for child in self.children(node):
            if self.tokens[child] == token:
                return child
        return None

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node` (empty for ROOT)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def leaves(self) -> list[int]:
        return [i for i in range(len(self)) if not self.children(i)]

    def ancestor_mask(self, device: torch.device | None = None) -> torch.Tensor:
        """[n, n] bool: each node with itself and its ancestors."""
        return ancestor_mask(list(self.parents), device)

    def positions(self, context_len: int) -> list[int]:
        """The nodes' positions when the root sits at position `context_len`."""
        return [context_len + d for d in self.depths]

    def subset(self, keep: list[int]) -> TokenTree:
        """The tree of the nodes `keep` (each kept node's parent kept too), renumbered in their
        order."""
        new = {old: i for i, old in enumerate(sorted(keep))}
        return TokenTree(tuple(self.tokens[i] for i in new),
                         tuple(ROOT if self.parents[i] == ROOT else new[self.parents[i]]
                               for i in new))

    def first_path_length(self) -> int:
        """How many nodes the first path holds: nodes 0, 1, ... each under the one before."""
        n = 0
        while n < len(self) and self.parents[n] == n - 1:
            n += 1
        return n

    def prefix(self, n: int) -> TokenTree:
        """The first n nodes: still a tree, since parents come before their children (the
        scheduler may cut a sequence's drafts short)."""
        return TokenTree(self.tokens[:n], self.parents[:n])


@dataclass
class TreeDrafted:
    """One sequence's draft tree to verify."""

    seq: Sequence
    logits: torch.Tensor  # [1 + len(tree), V]: the target at the root and after each node
    tree: TokenTree
    # [len(tree), V]: the distribution each node's token was drawn from (a stochastic
    # proposer's q at the node's parent); None: deterministic proposals.
    draft_probs: torch.Tensor | None = None


@dataclass(frozen=True)
class TreeVerdict:
    """The accepted root path (node indices) and the tokens to append: the path's tokens and
    one token from the target."""

    path: list[int]
    tokens: list[int]


def verify_tree_all(items: list[TreeDrafted]) -> list[TreeVerdict]:
    """Verify every tree of a step: one argmax over the greedy rows, one softmax over the
    sampled rows, then a walk per tree."""
    out: list[TreeVerdict | None] = [None] * len(items)
    greedy = [i for i, d in enumerate(items) if d.seq.params.greedy]
    sampled = [i for i, d in enumerate(items) if not d.seq.params.greedy]
    if greedy:
        best = argmax_rows(joined([items[i].logits for i in greedy]))
        start = 0
        for i in greedy:
            rows = len(items[i].tree) + 1
            out[i] = walk_greedy(best[start : start + rows], items[i].tree)
            start += rows
    if sampled:
        chosen = [items[i] for i in sampled]
        params = [d.seq.params for d in chosen for _ in range(len(d.tree) + 1)]
        probs = filtered_probs(joined([d.logits for d in chosen]), params)
        start = 0
        for i, d in zip(sampled, chosen, strict=True):
            rows = len(d.tree) + 1
            out[i] = verify_tree_sampled(probs[start : start + rows], d.tree, d.draft_probs,
                                         generator_for(d.seq))
            start += rows
    return out


def verify_tree_greedy(logits: torch.Tensor, tree: TokenTree) -> TreeVerdict:
    """The longest root path whose every token is the target's argmax at its parent, then the
    target's argmax after it."""
    return walk_greedy(argmax_rows(logits), tree)


def walk_greedy(best: list[int], tree: TokenTree) -> TreeVerdict:
    """The greedy walk over the target's argmax at the root (best[0]) and each node."""
    node, path = ROOT, []
    while True:
        token = best[node + 1]
        child = tree.child_with_token(node, token)
        if child is None:
            return TreeVerdict(path, tree.path_tokens(node) + [token])
        path.append(child)
        node = child


def verify_tree_sampled(probs: torch.Tensor, tree: TokenTree,
                        draft_probs: torch.Tensor | None, gen: torch.Generator) -> TreeVerdict:
    """Multi-candidate rejection sampling down the tree (see the module doc); `probs` holds the
    target's filtered distribution at the root and after each node ([1 + len(tree), V])."""
    node, path = ROOT, []
    while True:
        p = probs[node + 1]
        accepted = None
        for child in tree.children(node):
            q = None if draft_probs is None else draft_probs[child]
            if _accepts(p, tree.tokens[child], q, gen):
                accepted = child
                break
            p = _normalised(residual(p, tree.tokens[child], q))
        if accepted is None:
            return TreeVerdict(path, tree.path_tokens(node) + [draw(p, gen)])
        path.append(accepted)
        node = accepted


def _accepts(p: torch.Tensor, token: int, q: torch.Tensor | None, gen: torch.Generator) -> bool:
    """u <= p(x) / q(x) (q(x) = 1 for a deterministic proposal), without dividing by a tiny q;
    a token the target or the draft gives no probability is never accepted."""
    u = float(torch.rand(1, generator=gen))
    target = float(p[token])
    draft = 1.0 if q is None else float(q[token])
    return target > 0 and draft > 0 and u * draft <= target


def _normalised(p: torch.Tensor) -> torch.Tensor:
    # The next child's test compares against probabilities, so p must sum to 1 again.
    return p / p.sum()
