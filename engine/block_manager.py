"""Paged KV memory: fixed-size blocks handed out from a free list and held by reference count."""

from __future__ import annotations

from collections import OrderedDict, deque

from engine.sequence import Sequence


class BlockManager:
    """Owns the KV pool's block ids: which are free, and how many sequences hold each one.

    A sequence's `block_table` lists the blocks holding its tokens in order; token `p` lives in
    slot `block_table[p // block_size] * block_size + p % block_size`. A block may be held by
    several sequences (shared prefixes), so it is released only when its reference count drops
    to zero. A released block that the prefix cache knows (it has a hash) keeps its contents and
    waits in least-recently-used order, so a later request with the same prefix can take it
    back; new allocations use clean blocks first and evict the oldest cached one after that.

    Clean blocks are reused last-freed first. The pool is one tensor whose pages the operating
    system maps on first write; handing out the most recently freed (already resident) block
    keeps resident memory at the peak in use. Taking the oldest free block instead walked the
    whole pool, so resident memory grew by the pool's size over a long run (0.6 MB per short
    request with the demo model's 4 GB default pool) and looked like a leak.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(reversed(range(num_blocks)))  # taken from the right
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the sequence can hold its cached tokens plus `num_new_tokens`."""
        total = self.blocks_needed(seq.kv_len + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the sequence's block table to hold `num_new_tokens` more tokens."""
        needed = self.new_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise MemoryError(f"KV pool exhausted: need {needed} blocks, "
                              f"{self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the sequence's blocks beyond those `num_tokens` cached tokens need (rejected
        drafts, evicted tokens)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self.release(seq.block_table.pop())

    def share(self, seq: Sequence, block_ids: list[int]) -> None:
        """Let the sequence hold blocks already filled with its prefix (by it or another)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                if block_id not in self.evictable:
                    raise ValueError(f"block {block_id} is free and holds nothing to share")
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release every block the sequence holds (finish, abort or preemption)."""
        # Deepest blocks first, so they are also the first evicted (vLLM's order).
        for block_id in reversed(seq.block_table):
            self.release(block_id)
        seq.block_table = []

    def release(self, block_id: int) -> None:
        """Drop one reference to a block; it becomes free when nobody holds it."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} released more often than it was held")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hash[block_id] is None:
                self.free_ids.append(block_id)
            else:
                self.evictable[block_id] = None

    # ---- the prefix cache's index ----
    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the prefix with this hash, if it is still cached."""
        return self.hash_to_block.get(block_hash)

    def register(self, block_id: int, block_hash: bytes,
                 tokens: tuple[int, ...] | None = None) -> None:
        """Record that a full, computed block holds the prefix with this hash (and these
        tokens, which a hit is checked against)."""
        if block_hash in self.hash_to_block or self.block_hash[block_id] is not None:
            return  # an identical block is cached already, or this one is indexed
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tokens
        self.hash_to_block[block_hash] = block_id

    def slot(self, seq: Sequence, position: int) -> int:
        """The cache slot of the sequence's token at `position`."""
        block_id = seq.block_table[position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    def _take(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            del self.hash_to_block[self.block_hash[block_id]]
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id
