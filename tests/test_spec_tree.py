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


# ---- one forward pass over a tree, on the demo model ----
@pytest.fixture(scope="module")
def demo(demo_gguf):
    from engine import LLM

    return LLM(str(demo_gguf), device="cpu", dtype="float32", kv_cache_tokens=512)


def _sequence(llm, prompt: list[int], extra: int):
    from engine import SamplingParams
    from engine.sequence import Sequence

    seq = Sequence("tree", prompt, SamplingParams(), 0.0)
    llm.block_manager.append_slots(seq, len(prompt) + extra)
    return seq


def test_a_tree_pass_gives_each_node_the_logits_of_its_root_path(demo):
    from engine.runner import RunItem

    runner, bm = demo.runner, demo.block_manager
    prompt = demo.tokenizer.encode("The quick brown fox jumps over")
    a, b, c, d, e = demo.tokenizer.encode(" the lazy dog cat bird")[:5]
    tree = TokenTree.from_paths([[a, b, c], [a, d], [e, a]])  # nodes a b c d e a
    seq = _sequence(demo, prompt, len(tree) + 1)
    ctx = len(prompt) - 1
    try:
        runner.run_items([RunItem(prompt[:-1], 0, seq.block_table, 0)])
        got = runner.run_items([RunItem([prompt[-1], *tree.tokens], ctx, seq.block_table,
                                        1 + len(tree), draft_parents=list(tree.parents))]).logits
        # Keep the branch e, a (nodes 4, 5): its KV moves to the indices right after the root,
        # and the next token then sees the same context as after the chain e, a.
        runner.copy_slots([bm.slot(seq, ctx + 1 + node) for node in (4, 5)],
                          [bm.slot(seq, ctx + 1 + depth) for depth in (0, 1)])
        after_move = runner.run_items([RunItem([b], ctx + 3, seq.block_table, 1)]).logits[0]
        chain = runner.run_items([RunItem([prompt[-1], e, a, b], ctx, seq.block_table,
                                          4)]).logits
        torch.testing.assert_close(after_move, chain[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[0], chain[0], atol=1e-4, rtol=1e-4)
        for node in range(len(tree)):
            path = tree.path_tokens(node)
            chain = runner.run_items([RunItem([prompt[-1], *path], ctx, seq.block_table,
                                              1 + len(path))]).logits
            torch.testing.assert_close(got[1 + node], chain[-1], atol=1e-4, rtol=1e-4)
    finally:
        bm.free(seq)


@pytest.fixture(scope="module")
def demo_bf16(demo_gguf):
    from engine import LLM
    from kernels import cpu_linear

    if not cpu_linear.preferred():
        pytest.skip("bfloat16 linears here are oneDNN's, whose sums depend on the row count")
    return LLM(str(demo_gguf), device="cpu", dtype="bfloat16", kv_cache_tokens=512)


def test_a_verification_gives_each_token_the_logits_decoding_gives_it(demo_bf16):
    """A chain's and a tree's verification pass attend each token as a decode step would (the
    same kernel over the same keys in the same order), and the tile kernel's sums do not depend
    on the rows beside a row: so each token's logits are bit for bit those of decoding it
    alone, in bfloat16, where a gather-and-matmul over the chunk made them differ in the last
    bits and a greedy reply could change under speculation."""
    from engine.runner import RunItem

    llm = demo_bf16
    runner, bm = llm.runner, llm.block_manager
    prompt = llm.tokenizer.encode("The quick brown fox jumps over")
    x1, x2, x3, y = llm.tokenizer.encode(" the lazy dog cat")[:4]
    tree = TokenTree.from_paths([[x1, x2, x3], [y, x1]])  # nodes x1 x2 x3 y x1
    seq = _sequence(llm, prompt, len(tree) + 1)
    ctx = len(prompt) - 1
    try:
        runner.run_items([RunItem(prompt[:-1], 0, seq.block_table, 0)])
        decoded = [runner.run_items([RunItem([t], ctx + i, seq.block_table, 1)]).logits[0]
                   for i, t in enumerate([prompt[-1], x1, x2, x3])]
        chain = runner.run_items([RunItem([prompt[-1], x1, x2, x3], ctx, seq.block_table,
                                          4)]).logits
        for i in range(4):
            assert torch.equal(chain[i], decoded[i]), f"chain token {i}"
        got = runner.run_items([RunItem([prompt[-1], *tree.tokens], ctx, seq.block_table,
                                        1 + len(tree), draft_parents=list(tree.parents))]).logits
        for node, want in zip((0, 1, 2), decoded[1:], strict=True):  # the path x1 x2 x3
            assert torch.equal(got[1 + node], want), f"tree node {node}"
        assert torch.equal(got[0], decoded[0])
        # The branch y, x1, against decoding y then x1 (which overwrites the chain's slots).
        off = [runner.run_items([RunItem([t], ctx + 1 + i, seq.block_table, 1)]).logits[0]
               for i, t in enumerate([y, x1])]
        assert torch.equal(got[1 + 3], off[0]) and torch.equal(got[1 + 4], off[1])
    finally:
        bm.free(seq)


# Shuffled words (benchmarks/speculative.py's unpredictable workload) and open chat: prompt
# lookup finds many earlier continuations of the last words, so its trees grow wide.
WIDE_TREE_PROMPTS = [
    "Continue this list of words with more words, in no order: would for agreed that tuesday "
    "spaces their worried bike after children tuesday discuss their that children owners "
    "business new children agreed their after discuss debate children school fewer and worried "
    "after spaces residents to but keep bike for bike visitors made months residents debate and "
    "shops said agreed",
    "Write a short poem about the ocean.",
]


def test_wide_trees_keep_greedy_output_in_bfloat16(demo_gguf, demo_bf16):
    """Prompt lookup with 4 branches of up to 10 tokens drafts trees of up to 40 nodes; a
    verification of more than DECODE_ROW_CHUNK tokens would attend as a prefill chunk, in
    another summation order, and in bfloat16 both replies here changed (at tokens 40 and 47 on
    the EPYC). Trees are cut to what verifies as decode rows, so the replies are the plain
    engine's token for token."""
    from engine import LLM, SamplingParams
    from engine.runner import DECODE_ROW_CHUNK

    params = SamplingParams(temperature=0, max_tokens=56)
    ids = [demo_bf16.chat_prompt([{"role": "user", "content": p}]) for p in WIDE_TREE_PROMPTS]
    expected = [demo_bf16.generate([i], params)[0].token_ids for i in ids]
    llm = LLM(str(demo_gguf), device="cpu", dtype="bfloat16", kv_cache_tokens=512,
              speculative="ngram:branches=4,adaptive=0")
    try:
        assert [llm.generate([i], params)[0].token_ids for i in ids] == expected
        # One sequence at a time: every verification was a step of at most DECODE_ROW_CHUNK
        # tokens, and some were trees wider than a chain.
        assert max(llm.spec.costs.by_tokens) <= DECODE_ROW_CHUNK
        assert llm.spec.counters.draft_nodes > llm.spec.counters.draft_tokens
    finally:
        llm.close()


def test_copy_slots_moves_quantized_values_with_their_scales(demo):
    from engine.block_manager import BlockManager
    from engine.runner import ModelRunner

    runner = ModelRunner(demo.model, BlockManager(2, 16), "int8")
    gen = torch.Generator().manual_seed(0)
    runner.kv_scale.copy_(torch.rand(runner.kv_scale.shape, generator=gen))
    runner._kv_bytes.copy_(torch.randint(0, 256, runner._kv_bytes.shape, generator=gen,
                                         dtype=torch.uint8))
    before_bytes, before_scales = runner._kv_bytes.clone(), runner.kv_scale.clone()
    runner.copy_slots([7, 9, 3], [1, 2, 20])
    for src, dst in ((7, 1), (9, 2), (3, 20)):
        assert runner._kv_bytes[:, :, dst].equal(before_bytes[:, :, src])
        assert runner.kv_scale[:, :, dst].equal(before_scales[:, :, src])
    untouched = [s for s in range(32) if s not in (1, 2, 20)]
    assert runner._kv_bytes[:, :, untouched].equal(before_bytes[:, :, untouched])


def test_prompt_lookup_branches_over_the_different_continuations():
    from engine.spec import parse_spec
    from engine.spec.ngram import propose_ngram, propose_ngram_paths

    assert parse_spec("ngram:branches=3").num_branches == 3
    assert parse_spec("draft:/a,b/d.gguf,branches=2").draft_model == "/a,b/d.gguf"
    with pytest.raises(ValueError, match="branches must be"):
        parse_spec("ngram:branches=0")
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 3, 5, 6]
    paths = propose_ngram_paths(tokens, 3, 4, 2, branches=3)
    assert paths == [[7, 3, 5], [8, 2, 5], [7, 1, 5]]
    assert paths[0] == propose_ngram(tokens, 3, 4, 2)
    assert propose_ngram_paths(tokens, 3, 4, 2, branches=2) == paths[:2]
    tree = TokenTree.from_paths(paths)  # 7 -> {3 -> 5, 1 -> 5}, 8 -> 2 -> 5
    assert tree.children(ROOT) == (0, 3) and tree.children(0) == (1, 6)
    # A continuation already taken (or the start of one) adds no branch.
    assert propose_ngram_paths([1, 2, 3, 1, 2, 3, 1, 2], 2, 2, 2, branches=3) == [[3, 1]]


def test_a_tree_the_free_blocks_cannot_hold_becomes_its_first_path():
    from engine import SamplingParams
    from engine.block_manager import BlockManager
    from engine.sequence import Sequence
    from engine.spec import SpecConfig
    from engine.spec.decoder import SpecDecoder, set_draft_paths, spec_state

    bm = BlockManager(2, 4)
    seq = Sequence("s", [1, 2, 3, 4, 5], SamplingParams(), 0.0)
    bm.append_slots(seq, 5)
    seq.num_computed_tokens = 4
    decoder = SpecDecoder(SpecConfig(num_branches=2), block_manager=bm)
    set_draft_paths(seq, [[7, 8], [9]])  # 1 + 3 more tokens: 8 in all, the 2 blocks hold them
    decoder._fit_trees([seq])
    assert spec_state(seq).tree is not None
    set_draft_paths(seq, [[7, 8, 6], [9, 6]])  # 1 + 5 more: 10 tokens, a third block
    decoder._fit_trees([seq])
    assert spec_state(seq).tree is None and spec_state(seq).tokens == [7, 8, 6]


def test_an_accepted_branch_is_laid_out_as_a_chain():
    """After verification the accepted nodes' KV moves to the indices right after the root, and,
    where the request asked for log-probabilities, their logits rows to the rows right after
    the root's, where a chain's would be; the hidden rows stay (a hidden-state draft reads the
    last accepted node's row where it is)."""
    from engine import SamplingParams
    from engine.block_manager import BlockManager
    from engine.features import Step
    from engine.runner import StepResult
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence
    from engine.spec import SpecConfig
    from engine.spec.decoder import SpecDecoder

    class Runner:
        def __init__(self):
            self.copies = []

        def copy_slots(self, src, dst):
            self.copies.append((src, dst))

    def keep(params: SamplingParams, path: list[int]) -> list[float]:
        bm = BlockManager(6, 4)
        seq = Sequence("s", [1, 2, 3, 4, 5], params, 0.0)
        bm.append_slots(seq, 5 + 6)
        seq.num_computed_tokens = 5  # the root, the last real token, is computed: kv_len 5
        runner = Runner()
        logits = torch.arange(9.0).unsqueeze(1).repeat(1, 3)  # another sequence's 2 rows, then 7
        hidden = logits.clone() * 10
        step = Step(SchedulerOutput())
        step.result = StepResult(logits, hidden, None, runner)
        SpecDecoder(SpecConfig(num_branches=3), block_manager=bm)._keep_path(step, seq, 2, path)
        copies = [([bm.slot(seq, 8), bm.slot(seq, 9)], [bm.slot(seq, 5), bm.slot(seq, 6)])]
        assert runner.copies == (copies if path == [3, 4] else [])
        assert hidden[:, 0].tolist() == [0, 10, 20, 30, 40, 50, 60, 70, 80]
        return logits[:, 0].tolist()

    assert keep(SamplingParams(logprobs=1), [3, 4]) == [0, 1, 2, 6, 7, 5, 6, 7, 8]
    assert keep(SamplingParams(), [3, 4]) == list(range(9))  # nobody reads them
    # A chain's path, or a tree's first branch, moves nothing.
    assert keep(SamplingParams(logprobs=1), [0, 1]) == list(range(9))


# ---- the engine: tree speculation leaves greedy output unchanged ----
COPY_PROMPT = ("Copy this text exactly.\n\nThe cat sat on the mat. The cat ate the fish. The dog "
               "sat on the cat. The bird sang on the fence while the dog ate the bone.\n\nCopy:\n"
               "The cat")
PROMPTS = [COPY_PROMPT, "List the colors of the rainbow: red, orange, yellow, green, blue, red,",
           "def fibonacci(n):\n    if n < 2:", "The capital of France is"]


@pytest.fixture(scope="module")
def greedy_expected(demo):
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outputs = demo.generate(PROMPTS, params)
    return params, [o.token_ids for o in outputs], [o.logprobs for o in outputs]


@pytest.mark.parametrize("spec,options", [
    ("ngram:k=4,min=1,branches=3,adaptive=0", {}),
    ("ngram:k=4,min=1,branches=3,adaptive=0", {"prefix_caching": True}),
    ("demo-draft:branches=2,adaptive=0,lookup=0", {}),
    ("demo-medusa:branches=3,adaptive=0,lookup=0", {}),
], ids=["lookup-branches", "lookup-branches-prefix-cache", "demo-draft-top2", "medusa-top3"])
def test_tree_speculation_keeps_greedy_output(demo_gguf, greedy_expected, spec, options,
                                              caplog):
    from engine import LLM, SamplingParams

    caplog.set_level("WARNING", logger="servescope.engine")

    params, expected, expected_logprobs = greedy_expected
    llm = LLM(str(demo_gguf), device="cpu", dtype="float32",
              kv_cache_tokens=2048, speculative=spec, **options)
    moved = []
    copy_slots = llm.runner.copy_slots

    def spy(src, dst):
        moved.append(len(src))
        copy_slots(src, dst)

    llm.runner.copy_slots = spy
    outputs = llm.generate(PROMPTS, params)
    together = [o.token_ids for o in outputs]
    # Alone, the copy prompt (whose branches differ most) and one other: what a batch of one
    # changes is the same for all four, and CI time is counted.
    alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS[:2]]
    assert together == expected and alone == expected[:2]
    # Log-probabilities are read from the rows that chose the tokens (laid out as a chain's:
    # test_an_accepted_branch_is_laid_out_as_a_chain), so they are the plain engine's.
    for out, want in zip(outputs, expected_logprobs, strict=True):
        assert all(lp.rank == 1 for lp in out.logprobs)
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(
            [lp.logprob for lp in want], abs=1e-3)
    c = llm.spec.counters
    assert c.accepted_tokens > 0
    assert moved, "no accepted branch other than the first: the KV move went untested"
    # Every step ran as one batch: a failed one is recomputed request by request, which would
    # leave the output right (the checks above) and the engine several times slower.
    assert not [r for r in caplog.records if r.name == "servescope.engine"], caplog.text
    # Sampled trees: a seed still gives one reply.
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=5, ignore_eos=True)
    first, again = (llm.generate([COPY_PROMPT], sampled)[0].token_ids for _ in range(2))
    assert first == again and len(first) == 16
    assert llm.block_manager.num_used_blocks == 0
