"""Tree speculation: the token tree, the losslessness of tree verification (chi-square against
the target, as tests/test_spec.py does for the chain; wrong rules must fail the same test)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from engine.spec.tree import ROOT, TokenTree, TreeVerdict, verify_tree_greedy, verify_tree_sampled
from engine.spec.verify import residual, verify_sampled

V = 4  # vocabulary of the synthetic target
LENGTH = 2  # tokens generated per trial: their joint distribution is tested
TRIALS = 12000


# ---- the tree ----
def test_tree_structure_helpers():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 8], [9]])
    assert tree.tokens == (5, 6, 7, 8, 9) and tree.parents == (ROOT, 0, 1, 0, ROOT)
    assert tree.depths == (1, 2, 3, 2, 1) and tree.max_depth == 3
    assert tree.children(ROOT) == (0, 4) and tree.children(0) == (1, 3)
    assert tree.path(2) == [0, 1, 2] and tree.path_tokens(3) == [5, 8]
    assert tree.leaves() == [2, 3, 4]
    assert tree.positions(10) == [11, 12, 13, 12, 11]
    mask = tree.ancestor_mask()
    assert mask.tolist() == [[True, False, False, False, False],
                             [True, True, False, False, False],
                             [True, True, True, False, False],
                             [True, False, False, True, False],
                             [False, False, False, False, True]]
    assert tree.prefix(2) == TokenTree((5, 6), (ROOT, 0))
    assert TokenTree.chain([1, 2, 3]).parents == (ROOT, 0, 1)
    assert TokenTree.chain([1, 2, 3]).ancestor_mask().equal(torch.ones(3, 3).tril().bool())
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree((1, 2), (1, ROOT))


def test_greedy_takes_the_longest_path_the_target_agrees_with():
    tree = TokenTree.from_paths([[1, 2], [3, 0, 1]])  # nodes: 1, 2, 3, 0, 1
    logits = torch.full((6, V), -1.0)
    for row, best in enumerate([3, 0, 0, 0, 1, 2]):  # root, then after each node
        logits[row, best] = 5.0
    # Root argmax 3 -> node 2; after it 0 -> node 3; after that 1 -> node 4; then 2 (bonus).
    assert verify_tree_greedy(logits, tree) == TreeVerdict([2, 3, 4], [3, 0, 1, 2])
    logits[0] = 0.0
    logits[0, 2] = 5.0  # a root argmax no child has: only the target's token
    assert verify_tree_greedy(logits, tree) == TreeVerdict([], [2])


# ---- losslessness under sampling ----
@functools.cache
def _dist(prefix: tuple[int, ...], salt: int) -> torch.Tensor:
    """A fixed distribution over V tokens for each prefix (a synthetic model; never modified)."""
    seed = salt * 1_000_003 + sum((t + 1) * 7**i for i, t in enumerate(prefix)) + len(prefix)
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g) * 1.2, dim=0)


def target(prefix: tuple[int, ...]) -> torch.Tensor:
    return _dist(prefix, 1)


def draft(prefix: tuple[int, ...]) -> torch.Tensor:
    """Another model: the proposer, which disagrees with the target."""
    return _dist(prefix, 2)


@functools.cache
def top_k_tree(prefix: tuple[int, ...], widths: tuple[int, ...],
               salt: int = 2) -> tuple[TokenTree, None]:
    """Deterministic proposals: at depth d, each node's `widths[d]` most likely tokens of the
    draft (or, with salt 1, of the target itself: a proposer that is often right)."""
    paths: list[list[int]] = [[]]
    for width in widths:
        paths = [p + [t] for p in paths
                 for t in _dist(prefix + tuple(p), salt).argsort(descending=True)[:width].tolist()]
    return TokenTree.from_paths(paths), None


def sampled_tree(prefix: tuple[int, ...], widths: tuple[int, ...],
                 gen: torch.Generator) -> tuple[TokenTree, torch.Tensor]:
    """Stochastic proposals (SpecInfer): each node's children drawn independently from the
    draft at it, so siblings may repeat a token; each node keeps the q it was drawn from."""
    tokens, parents, qs = [], [], []
    frontier = [(ROOT, ())]
    for width in widths:
        nxt = []
        for node, path in frontier:
            q = draft(prefix + path)
            for t in torch.multinomial(q, width, replacement=True, generator=gen).tolist():
                tokens.append(t)
                parents.append(node)
                qs.append(q)
                nxt.append((len(tokens) - 1, path + (t,)))
        frontier = nxt
    return TokenTree(tuple(tokens), tuple(parents)), torch.stack(qs)


def _target_rows(prefix: tuple[int, ...], tree: TokenTree) -> torch.Tensor:
    return torch.stack([target(prefix)] + [target(prefix + tuple(tree.path_tokens(i)))
                                           for i in range(len(tree))])


def _generate(rule, propose, gen: torch.Generator) -> tuple[int, ...]:
    """LENGTH tokens, verifying a freshly proposed tree each round as the engine does."""
    out: tuple[int, ...] = ()
    while len(out) < LENGTH:
        tree, q = propose(out, gen)
        out += tuple(rule(_target_rows(out, tree), tree, q, gen).tokens)
    return out[:LENGTH]


def _p_value(rule, propose, seed: int = 0, trials: int = TRIALS) -> float:
    """Chi-square test of the generated LENGTH-token sequences against the target's joint
    distribution (V**LENGTH cells); the probability of a worse fit under the target."""
    gen = torch.Generator().manual_seed(seed)
    cells = list(itertools.product(range(V), repeat=LENGTH))
    counts = dict.fromkeys(cells, 0)
    for _ in range(trials):
        counts[_generate(rule, propose, gen)] += 1
    expected = torch.tensor([float(torch.prod(torch.stack(
        [target(c[:i])[c[i]] for i in range(LENGTH)]))) for c in cells]) * trials
    observed = torch.tensor([float(counts[c]) for c in cells])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))


def deterministic(widths, salt: int = 2):
    return lambda prefix, gen: top_k_tree(prefix, widths, salt)


def stochastic(widths):
    return lambda prefix, gen: sampled_tree(prefix, widths, gen)


@pytest.mark.parametrize("propose", [
    deterministic((2,)), deterministic((3, 2)), deterministic((1, 1, 1)),
    deterministic((V,)),  # every token a child: one is always accepted
    deterministic((2, 2), salt=1),  # the target's own top tokens: long paths accepted
    stochastic((2,)), stochastic((2, 2)), stochastic((3, 1)),
], ids=["top2", "top3x2", "chain3", "all-tokens", "target-top2x2", "sampled2", "sampled2x2",
        "sampled3x1"])
def test_tree_verification_keeps_the_target_distribution(propose):
    # Fails by chance once in a thousand runs; the seed is fixed, so it does not flake.
    assert _p_value(verify_tree_sampled, propose) > 1e-3


def _forget_to_update_p(probs, tree, draft_probs, gen):
    """A wrong rule: each child tried against the untouched target distribution."""
    node, path = ROOT, []
    while True:
        p = probs[node + 1]
        accepted, left = None, p.clone()
        for child in tree.children(node):
            token = tree.tokens[child]
            q = 1.0 if draft_probs is None else float(draft_probs[child][token])
            if float(torch.rand(1, generator=gen)) * q <= float(p[token]):
                accepted = child
                break
            left = residual(left, token, None if draft_probs is None else draft_probs[child])
        if accepted is None:
            tail = int(torch.multinomial(left, 1, generator=gen))
            return TreeVerdict(path, tree.path_tokens(node) + [tail])
        path.append(accepted)
        node = accepted


@pytest.mark.parametrize("propose", [deterministic((2,), salt=1), stochastic((2, 2))],
                         ids=["target-top2", "sampled2x2"])
def test_a_rule_that_does_not_update_p_after_a_rejection_is_caught(propose):
    assert _p_value(_forget_to_update_p, propose) < 1e-6


# ---- a chain is a tree ----
CHAIN_ROWS = torch.stack([torch.tensor([0.5, 0.3, 0.15, 0.05]), torch.tensor([0.1, 0.6, 0.2, 0.1]),
                          torch.tensor([0.25, 0.25, 0.25, 0.25])])


def _accepted_lengths(verify, trials: int = 20000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(3)
    for _ in range(trials):
        counts[len(verify(gen)) - 1] += 1
    return counts


def test_a_chain_verified_as_a_tree_accepts_as_verify_does():
    chain = [0, 1]
    tree = TokenTree.chain(chain)
    by_tree = _accepted_lengths(lambda g: verify_tree_sampled(CHAIN_ROWS, tree, None, g).tokens)
    by_chain = _accepted_lengths(lambda g: verify_sampled(CHAIN_ROWS, chain, None, g))
    # Exactly: none accepted 0.5, one 0.5 * 0.4, both 0.5 * 0.6.
    expected = torch.tensor([0.5, 0.2, 0.3]) * 20000
    for counts in (by_tree, by_chain):
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 13.8  # 2 degrees of freedom: p = 0.001
    # And the two samples against each other (a two-sample chi-square, 2 degrees of freedom).
    pooled = (by_tree + by_chain) / 2
    assert float(((by_tree - pooled) ** 2 / pooled).sum() * 2) < 13.8

