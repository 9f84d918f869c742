"""The Triton prefill kernel on draft-tree chunks (the runner's tree masks) against the
reference, in Triton's interpreter: the kernel reads a chunk's mask as given, so a tree needs no
kernel of its own, only this check that masks of that shape come out right."""

from __future__ import annotations

import math

import pytest
import torch

from engine.runner import _slot_table, _tree_chunk_mask
from kernels import AttentionMetadata, PrefillChunk, reference
from tests.kernels.test_triton import _tolerance, tops


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _wide_tree(n: int) -> list[int]:
    """n nodes, a few branches of different depths: node i under i - 1 or i - 3."""
    return [-1 if i < 3 else (i - 3 if i % 2 else i - 1) for i in range(n)]


# (cached context, draft parents): a tree under the root only, a deep and branching tree, a
# tree after a one-token prompt (no cached context), and one wider than a query tile.
TREES = [(9, [-1, -1, -1]), (37, [-1, 0, 1, 0, 3, -1, 5]), (0, [-1, 0, -1, 2]),
         (70, _wide_tree(40))]


def _tree_batch(gen, heads, kv_heads, dim, block_size, dtype):
    """Decode rows beside draft-tree chunks (the last real token, then the nodes), laid out as
    the runner lays them out, in a cache of scattered blocks."""
    seqs = [(16, 1, None)] + [(ctx, 1 + len(p), p) for ctx, p in TREES] + [(5, 1, None)]
    total = [ctx + n for ctx, n, _ in seqs]
    num_blocks = sum(-(-t // block_size) for t in total) + 2
    null_slot = num_blocks * block_size
    k_cache = torch.randn(null_slot + 1, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(null_slot + 1, kv_heads, dim, generator=gen).to(dtype)
    k_cache[null_slot] = v_cache[null_slot] = 0
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-t // block_size))] for t in total]
    slots = torch.from_numpy(_slot_table(tables, total, block_size, null_slot))
    q = torch.randn(sum(n for _, n, _ in seqs), heads, dim, generator=gen).to(dtype)
    decode_rows, decode_idx, prefills, row = [], [], [], 0
    for i, (_, n, parents) in enumerate(seqs):
        if parents is None:
            decode_rows.append(i)
            decode_idx.append(row)
        else:
            mask = _tree_chunk_mask(n, total[i], parents, torch.device("cpu"))
            prefills.append(PrefillChunk(row, row + n, slots[i, : total[i]], mask))
        row += n
    lengths = torch.tensor([total[i] for i in decode_rows])
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), prefills=prefills,
                             decode_token_index=torch.tensor(decode_idx),
                             decode_slots=slots[decode_rows, : int(lengths.max())])
    meta.decode_mask = (torch.arange(int(lengths.max())) < lengths[:, None])[:, None, None, :]
    return q, k_cache, v_cache, meta


def test_tree_masks_are_what_tree_verification_needs():
    mask = _tree_chunk_mask(4, 6, [-1, 0, -1], torch.device("cpu"))
    # Context of 2, the root at index 2, nodes at 3 (root's), 4 (under 3) and 5 (root's).
    assert mask.int().tolist() == [[1, 1, 1, 0, 0, 0],
                                   [1, 1, 1, 1, 0, 0],
                                   [1, 1, 1, 1, 1, 0],
                                   [1, 1, 1, 0, 0, 1]]


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,dtype", [
    (2, 2, 16, 16, torch.float32), (6, 2, 64, 32, torch.float32), (9, 3, 64, 16, torch.float16),
])
def test_tree_chunks_match_the_reference(heads, kv_heads, dim, block_size, dtype):
    gen = torch.Generator().manual_seed(heads * 10 + dim)
    q, k_cache, v_cache, meta = _tree_batch(gen, heads, kv_heads, dim, block_size, dtype)
    scale = 1 / math.sqrt(dim)
    got = tops.paged_attention(q, k_cache, v_cache, meta, scale)
    want = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, want, **_tolerance(dtype))
