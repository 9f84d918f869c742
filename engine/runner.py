"""The model runner: owns the KV cache, turns a scheduled step into tensors and runs the model."""

from __future__ import annotations

import torch

from engine.block_manager import BlockManager
from engine.model import LlamaModel
from engine.scheduler import ScheduledSeq
from kernels import AttentionMetadata, PrefillChunk


class ModelRunner:
    """Runs one engine step: input ids, positions and attention metadata, then the forward pass."""

    def __init__(self, model: LlamaModel, block_manager: BlockManager) -> None:
        self.model = model
        self.block_manager = block_manager
        self.device = model.device
        c = model.config
        slots = block_manager.num_blocks * block_manager.block_size
        shape = (c.num_layers, 2, slots, c.num_kv_heads, c.head_dim)
        # torch.empty: on the CPU the OS commits pages only as the cache fills.
        self.kv = torch.empty(shape, dtype=model.dtype, device=self.device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(c.num_layers)]

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], all_logits: bool = False) -> torch.Tensor:
        """Run the step; logits ([S, V] float32) for the sequences that sample, in order.

        With `all_logits` every token's logits are returned instead (used by prompt_logits).
        """
        input_ids, positions, rows = self._inputs(scheduled)
        meta = self._metadata(scheduled)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        if not all_logits:
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        return self.model.logits(hidden)

    def _inputs(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, list]:
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            real = s.num_new_tokens - s.num_draft
            ids.extend(s.seq.all_token_ids[start : start + real])
            ids.extend(s.seq.draft_token_ids[: s.num_draft])
            pos.extend(range(start, start + s.num_new_tokens))
            if s.samples:
                # The last real token and every draft: the target's distribution at each.
                rows.extend(range(len(ids) - 1 - s.num_draft, len(ids)))
        as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(pos), rows

    def _metadata(self, scheduled: list[ScheduledSeq]) -> AttentionMetadata:
        bs = self.block_manager.block_size
        context = [s.seq.num_computed_tokens + s.num_new_tokens for s in scheduled]
        slots = _slot_table([s.seq.block_table for s in scheduled], max(context), bs, self.device)
        slot_mapping, decode_rows, decode_idx, prefills = [], [], [], []
        row = 0
        for i, s in enumerate(scheduled):
            n, ctx = s.num_new_tokens, context[i]
            slot_mapping.append(slots[i, ctx - n : ctx])
            if n == 1:
                decode_rows.append(i)
                decode_idx.append(row)
            else:
                prefills.append(PrefillChunk(row, row + n, slots[i, :ctx], _chunk_mask(n, ctx,
                                                                                       self.device)))
            row += n
        meta = AttentionMetadata(slot_mapping=torch.cat(slot_mapping), prefills=prefills)
        if decode_rows:
            self._decode_metadata(meta, slots, decode_rows, decode_idx, context)
        return meta

    def _decode_metadata(self, meta: AttentionMetadata, slots: torch.Tensor, rows: list[int],
                         token_rows: list[int], context: list[int]) -> None:
        lengths = [context[i] for i in rows]
        longest = max(lengths)
        meta.decode_token_index = torch.tensor(token_rows, device=self.device)
        meta.decode_slots = slots[rows, :longest]
        if min(lengths) != longest:
            t = torch.arange(longest, device=self.device)
            valid = t.unsqueeze(0) < torch.tensor(lengths, device=self.device).unsqueeze(1)
            meta.decode_mask = valid[:, None, None, :]


def _slot_table(block_tables: list[list[int]], max_len: int, block_size: int,
                device: torch.device) -> torch.Tensor:
    """Cache slot of every position < max_len for each sequence ([S, max_len]; padding -> 0)."""
    width = -(-max_len // block_size)
    table = torch.zeros((len(block_tables), width), dtype=torch.long)
    for i, blocks in enumerate(block_tables):
        table[i, : min(width, len(blocks))] = torch.tensor(blocks[:width], dtype=torch.long)
    t = torch.arange(max_len)
    slots = table[:, t // block_size] * block_size + t % block_size
    return slots.to(device)


def _chunk_mask(n: int, ctx: int, device: torch.device) -> torch.Tensor | None:
    """Causal mask of a chunk whose first query sits at position ctx - n; None when ctx == n."""
    if n == ctx:
        return None
    q_pos = torch.arange(ctx - n, ctx, device=device).unsqueeze(1)
    return torch.arange(ctx, device=device).unsqueeze(0) <= q_pos
