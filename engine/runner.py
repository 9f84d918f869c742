"""The model runner: owns the KV cache, turns a scheduled step into tensors and runs the model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.block_manager import BlockManager
from engine.cuda_graphs import DecodeGraphs
from engine.model import LlamaModel
from engine.scheduler import ScheduledSeq
from kernels import AttentionMetadata, PrefillChunk, kv_quant
from kernels.kv_quant import QuantizedCache
from kernels.metadata import ancestor_mask, tree_depths
from kernels.reference import rotate_half

# A sequence's chunk of at most this many new tokens (a speculative verification, a prompt's
# short tail) attends as decode rows, one per token, each over exactly the keys it sees: the
# verify step then computes each token's attention as a plain decode step would (the same
# kernel, keys and order), so speculation gives the logits decoding gives, in bfloat16 too,
# and skips the gather a prefill chunk makes. Longer chunks stay prefills (one matmul per
# chunk beats a pass over the keys per token).
DECODE_ROW_CHUNK = 16


@dataclass
class RunItem:
    """One sequence's share of a forward pass: its new tokens from position `start` on."""

    tokens: list[int]
    start: int  # cache index of the first new token (its position unless tokens were evicted)
    block_table: list[int]
    logit_rows: int  # how many of the last new tokens need logits (0 = none)
    position_offset: int = 0  # position = cache index + offset (KV eviction shifts them apart)
    mass_rows: int | None = None  # with attention statistics: sum only the last rows (SnapKV)
    # Draft trees: the parent of each of the last len(draft_parents) tokens among them (-1: the
    # token before them). Each sits at its parent's position + 1 and attends to the tokens
    # before the drafts and its own ancestors only. None: the tokens are one causal chain.
    draft_parents: list[int] | None = None

    @classmethod
    def from_scheduled(cls, s: ScheduledSeq) -> RunItem:
        seq, computed = s.seq, s.seq.num_computed_tokens
        real = s.num_new_tokens - s.num_draft
        tokens = seq.all_token_ids[computed : computed + real] + seq.draft_tokens[: s.num_draft]
        mass_rows = None if seq.kv is None else seq.kv.policy.mass_rows(seq, len(tokens))
        # The last real token and every draft: the model's distribution at each.
        return cls(tokens, seq.kv_len, seq.block_table, 1 + s.num_draft if s.samples else 0,
                   seq.position_offset, mass_rows, _draft_parents(seq, s.num_draft))

    def offsets(self) -> list[int]:
        """Each token's position relative to the first: consecutive, except that a draft tree's
        nodes sit at their depth below the last token before the drafts."""
        if self.draft_parents is None:
            return list(range(len(self.tokens)))
        before = len(self.tokens) - len(self.draft_parents)
        return list(range(before)) + [before - 1 + d for d in tree_depths(self.draft_parents)]


def _draft_parents(seq, num_draft: int) -> list[int] | None:
    """The scheduled drafts' tree, read off the sequence's speculative state as
    Sequence.draft_tokens reads its drafts (the runner does not import the spec feature). The
    scheduler may cut the drafts short; the first nodes of a tree are still a tree."""
    parents = getattr(seq.spec, "draft_parents", None)
    return None if parents is None or not num_draft else parents[:num_draft]


@dataclass
class StepResult:
    """What one forward pass produced, for the rows that need logits (every row with
    all_logits), in item order."""

    logits: torch.Tensor  # [rows, vocab] float32
    hidden: torch.Tensor  # [rows, hidden]: the states behind the logits (a hidden-state draft)
    # With want_mass: each item's attention statistics over its context (KV eviction), on the CPU.
    mass: list[torch.Tensor] | None = None
    # The runner that ran the step: features that keep only part of the step's KV (tree
    # speculation keeps the accepted path) rearrange its cache through it.
    runner: ModelRunner | None = None
    # With the runner's stream_layers: the residual stream after each of those layers, side by
    # side ([rows, len(stream_layers) * hidden], the model's dtype), for a draft that reads them.
    streams: torch.Tensor | None = None


class ModelRunner:
    """Runs one engine step: input ids, positions and attention metadata, then the forward pass."""

    def __init__(self, model: LlamaModel, block_manager: BlockManager,
                 kv_cache_dtype: str = "auto") -> None:
        self.model = model
        self.block_manager = block_manager
        self.device = model.device
        c = model.config
        slots = block_manager.num_blocks * block_manager.block_size
        # One extra slot, kept at zero, that padded attention rows point at: masked keys get
        # weight 0, but 0 * NaN from a never-written slot would still poison the output.
        self.null_slot = slots
        shape = (c.num_layers, 2, slots + 1, c.num_kv_heads, c.head_dim)
        quantized = kv_quant.storage_dtype(kv_cache_dtype)
        # torch.empty: on the CPU the OS commits pages only as the cache fills.
        self.kv = torch.empty(shape, dtype=quantized or model.dtype, device=self.device)
        self._kv_bytes = kv_quant.as_bytes(self.kv) if quantized else self.kv
        self._kv_bytes[:, :, self.null_slot].zero_()
        # Quantized: a float32 scale per slot and KV head beside the values (kernels/kv_quant.py).
        self.kv_scale = (torch.zeros(shape[:-1], dtype=torch.float32, device=self.device)
                         if quantized else None)
        self.kv_caches = [self._layer_caches(i) for i in range(c.num_layers)]
        self.decode_graphs: DecodeGraphs | None = None  # see use_decode_graphs
        # Layer counts whose residual stream each step keeps (StepResult.streams): a draft
        # that reads middle layers sets them. Such steps run eagerly, not through graphs.
        self.stream_layers: tuple[int, ...] = ()

    def use_decode_graphs(self, max_batch: int, max_width: int, capture: bool = True,
                          compile_backend: str | None = None) -> None:
        """Run decode-only steps through CUDA graphs (capture) and/or torch.compile from now on;
        with neither, through the same padded static tensors eagerly (the CPU tests' check)."""
        self.decode_graphs = DecodeGraphs(self, max_batch, max_width, capture, compile_backend)

    def _layer_caches(self, layer: int) -> tuple:
        if self.kv_scale is None:
            return self.kv[layer, 0], self.kv[layer, 1]
        return (QuantizedCache(self.kv[layer, 0], self.kv_scale[layer, 0]),
                QuantizedCache(self.kv[layer, 1], self.kv_scale[layer, 1]))

    def zero_null_slot(self) -> None:
        """Clear what padded rows wrote into the null slot (values; a zero value needs no scale)."""
        self._kv_bytes[:, :, self.null_slot].zero_()

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pool, scales included (the one zeroed padding slot, a few KiB, is not
        counted)."""
        values = self.kv[:, :, : self.null_slot].numel() * self.kv.element_size()
        if self.kv_scale is None:
            return values
        scales = self.kv_scale[:, :, : self.null_slot]
        return values + scales.numel() * scales.element_size()

    def run(self, scheduled: list[ScheduledSeq], all_logits: bool = False,
            want_mass: bool = False, logits: bool = True) -> StepResult:
        """Run the step: logits for the sequences that sample, in order (with `all_logits`,
        every token's: prompt_logits); with `want_mass`, each sequence's attention statistics;
        without `logits`, the states alone (StepResult.logits empty: a draft's corpus)."""
        return self.run_items([RunItem.from_scheduled(s) for s in scheduled], all_logits,
                              want_mass, logits)

    @torch.inference_mode()
    def run_items(self, items: list[RunItem], all_logits: bool = False,
                  want_mass: bool = False, logits: bool = True) -> StepResult:
        """The forward pass over any batch of run items (the target's step or a draft's)."""
        input_ids, positions, rows = self._inputs(items)
        meta = self._metadata(items, want_mass)
        meta.want_mass = want_mass
        masses: list = []
        streams = dict.fromkeys(self.stream_layers) if self.stream_layers else None
        graphs = self.decode_graphs
        if graphs is not None and streams is None and graphs.handles(len(items), meta,
                                                                     all_logits):
            hidden = graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, masses,
                                        streams=streams)
        parts = [] if streams is None else [streams[n] for n in self.stream_layers]
        if not all_logits:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            hidden = hidden[index]
            parts = [part[index] for part in parts]  # before joining them: a prefill's rows
        kept = torch.cat(parts, dim=-1) if parts else None
        return StepResult(self.model.logits(hidden) if logits else hidden[:, :0], hidden,
                          _per_item_mass(items, masses) if want_mass else None, self, kept)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy every layer's cached K/V from slots `src` to slots `dst` (quantized values as
        bytes with their scales): a tree's accepted nodes moved to consecutive positions."""
        if not src:
            return
        c = self.model.config
        index = torch.tensor(src, dtype=torch.long)
        self.move_kv(index.expand(c.num_layers, c.num_kv_heads, len(src)),
                     torch.tensor(dst, dtype=torch.long), None)

    @torch.inference_mode()
    def move_kv(self, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor | None) -> None:
        """Copy cached K/V from `src` slots ([layers, kv_heads, n], one source per layer and head)
        to `dst` slots ([n]); with `delta` ([n]), re-rotate each moved key by that many positions.
        """
        layers = torch.arange(src.shape[0]).view(-1, 1, 1)
        heads = torch.arange(src.shape[1]).view(1, -1, 1)
        src, dst = src.to(self.device), dst.to(self.device)
        index_src, index_dst = (layers, slice(None), src, heads), (layers, slice(None),
                                                                     dst.view(1, 1, -1), heads)
        # Quantized values move as bytes (float8 has no CPU indexing kernel) with their scales.
        moved = self._kv_bytes[index_src]  # [layers, kv_heads, n, 2, D] (a copy)
        scales = None if self.kv_scale is None else self.kv_scale[index_src]  # [.., n, 2]
        if delta is not None:
            moved, scales = self._rotate_keys(moved, scales, delta.to(self.device))
        self._kv_bytes[index_dst] = moved
        if scales is not None:
            self.kv_scale[index_dst] = scales

    def _rotate_keys(self, moved: torch.Tensor, scales: torch.Tensor | None,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Moved keys re-rotated by `delta`; quantized keys are dequantized, rotated and stored
        again with fresh scales (a rotation keeps a row's norm, not its largest element)."""
        if scales is None:
            moved[..., 0, :] = self._rotate(moved[..., 0, :], delta)
            return moved, None
        keys = kv_quant.dequantize(moved[..., 0, :].view(self.kv.dtype), scales[..., 0],
                                   torch.float32)
        data, scales[..., 0] = kv_quant.quantize(self._rotate(keys, delta), self.kv.dtype)
        moved[..., 0, :] = kv_quant.as_bytes(data)
        return moved, scales

    def _rotate(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Keys rotated by `delta` more positions (rotary angles add). In float32 with angles
        computed afresh: a kept key is re-rotated at every compaction while it stays in the
        window, and half-precision cos/sin tables would compound their rounding each time."""
        angles = delta.float().unsqueeze(-1) * self.model.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        kf = k.float()
        return (kf * angles.cos() + rotate_half(kf) * angles.sin()).to(k.dtype)

    def _inputs(self, items: list[RunItem]) -> tuple[torch.Tensor, torch.Tensor, list]:
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        for item in items:
            ids.extend(item.tokens)
            first = item.start + item.position_offset
            pos.extend(first + offset for offset in item.offsets())
            rows.extend(range(len(ids) - item.logit_rows, len(ids)))
        as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(pos), rows

    def _metadata(self, items: list[RunItem], want_mass: bool = False) -> AttentionMetadata:
        # Built in NumPy, then handed to torch once per tensor: as torch ops (about 30 small
        # ones a step) it took 182 us of a 4.4 ms int4 decode step at batch 1 on the 2-core
        # EPYC, 416 us of 19.8 ms at 16 sequences; now 116 and 232 (benchmarks/step_metadata.py).
        bs = self.block_manager.block_size
        context = [item.start + len(item.tokens) for item in items]
        slots = _slot_table([item.block_table for item in items], context, bs, self.null_slot)
        slot_mapping, decode_rows, prefills = [], [], []
        row = 0
        for i, item in enumerate(items):
            n, ctx = len(item.tokens), context[i]
            slot_mapping.append(slots[i, ctx - n : ctx])
            if n == 1 or (n <= DECODE_ROW_CHUNK and not want_mass):
                decode_rows += [DecodeRow(i, row + j, length, path)
                                for j, (length, path) in enumerate(_row_keys(item, ctx))]
            else:
                mask = (_chunk_mask(n, ctx, self.device) if item.draft_parents is None
                        else _tree_chunk_mask(n, ctx, item.draft_parents, self.device))
                prefills.append(PrefillChunk(row, row + n, self._tensor(slots[i, :ctx]), mask,
                                             item.mass_rows, item.draft_parents is None))
            row += n
        meta = AttentionMetadata(slot_mapping=self._tensor(np.concatenate(slot_mapping)),
                                 prefills=prefills)
        if decode_rows:
            self._decode_metadata(meta, slots, decode_rows)
        return meta

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A NumPy array of the step's metadata as a tensor on the device (shared on the CPU)."""
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _decode_metadata(self, meta: AttentionMetadata, slots: np.ndarray,
                         rows: list[DecodeRow]) -> None:
        lengths = np.array([r.keys for r in rows], dtype=np.int64)
        longest = int(lengths.max())
        meta.decode_token_index = self._tensor(np.array([r.token for r in rows], dtype=np.int64))
        table = slots[[r.item for r in rows], :longest]  # a copy (fancy indexing)
        for k, r in enumerate(rows):
            if r.path is not None:  # a tree node: its ancestors' keys follow the context's
                start = r.keys - len(r.path)
                table[k, start : r.keys] = slots[r.item, r.path]
        meta.decode_slots = self._tensor(table)
        meta.decode_lengths = self._tensor(lengths)
        if lengths.min() != longest:
            valid = np.arange(longest)[None, :] < lengths[:, None]
            meta.decode_mask = self._tensor(valid[:, None, None, :])


def _per_item_mass(items: list[RunItem], masses: list) -> list[torch.Tensor]:
    """Each item's attention mass over its context, [layers, kv_heads, context], on the CPU."""
    decode = None
    if masses and masses[0].decode is not None:
        decode = torch.stack([m.decode for m in masses]).cpu()  # [layers, B, kv_heads, T]
    out, d, c = [], 0, 0
    for item in items:
        ctx = item.start + len(item.tokens)
        if len(item.tokens) == 1:
            # A one-token prompt chunk outside SnapKV's observation window counts for nothing.
            out.append(decode[:, d, :, :ctx] * (item.mass_rows != 0))
            d += 1
        else:
            out.append(torch.stack([m.prefill[c] for m in masses]).cpu())
            c += 1
    return out


def _slot_table(block_tables: list[list[int]], lengths: list[int], block_size: int,
                null_slot: int) -> np.ndarray:
    """Cache slot of each sequence's positions ([S, max(lengths)], int64); past a sequence's
    length, the zeroed null slot (its own block's tail may hold another request's stale
    values)."""
    max_len = max(lengths)
    width = -(-max_len // block_size)
    table = np.zeros((len(block_tables), width), dtype=np.int64)
    for i, blocks in enumerate(block_tables):
        used = min(width, len(blocks))
        table[i, :used] = blocks[:used]
    t = np.arange(max_len)
    slots = table[:, t // block_size] * block_size + t % block_size
    valid = t[None, :] < np.array(lengths)[:, None]
    return np.where(valid, slots, null_slot)


def _chunk_mask(n: int, ctx: int, device: torch.device) -> torch.Tensor | None:
    """Causal mask of a chunk whose first query sits at position ctx - n; None when ctx == n."""
    if n == ctx:
        return None
    q_pos = torch.arange(ctx - n, ctx, device=device).unsqueeze(1)
    return torch.arange(ctx, device=device).unsqueeze(0) <= q_pos


def _tree_chunk_mask(n: int, ctx: int, parents: list[int], device: torch.device) -> torch.Tensor:
    """A chunk ending in a draft tree: causal up to the drafts; each draft sees everything before
    the drafts and, among them, itself and its ancestors only (never its siblings' branches)."""
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
    d = len(parents)
    mask[n - d :, ctx - d :] = ancestor_mask(parents)
    return mask.to(device)


@dataclass
class DecodeRow:
    """One query token attended as a decode row: `keys` keys, the first of the item's slot
    table; for a draft tree's node, the last len(path) of them are its ancestors' and its own
    (`path`: their columns in the item's slot table) instead of the columns there."""

    item: int
    token: int  # its row in the step's flat batch
    keys: int
    path: list[int] | None = None


def _row_keys(item: RunItem, ctx: int) -> list[tuple[int, list[int] | None]]:
    """Each new token's key count and, for a draft tree's node, its path (see DecodeRow): a
    chain's token j of n sees the first ctx - n + j + 1 keys; a node at depth d sees the keys
    before the drafts and its d ancestors-or-self."""
    n = len(item.tokens)
    if item.draft_parents is None:
        return [(ctx - n + j + 1, None) for j in range(n)]
    d = len(item.draft_parents)
    first = ctx - d  # the first draft's column
    rows: list[tuple[int, list[int] | None]] = [(first - (n - d) + j + 1, None)
                                                for j in range(n - d)]
    paths: list[list[int]] = []
    for k, parent in enumerate(item.draft_parents):
        paths.append((paths[parent] if parent >= 0 else []) + [first + k])
        rows.append((first + len(paths[k]), paths[k]))
    return rows

