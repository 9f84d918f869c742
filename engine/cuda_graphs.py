"""CUDA graphs and torch.compile for the decode step: each (batch, key width) bucket captured
once, then replayed.

A decode step launches several kernels per layer, each reading little memory for a small
model, so issuing them from Python can take longer than running them; a graph replays the whole
forward pass as one launch (benchmarks/gpu.py measures both against the bandwidth bound).

Shapes are baked into a graph, so a step is padded up to its bucket: batch to the next size in
BATCH_BUCKETS, the keys' width to the next power of two. Padded rows read and write only the
runner's null slot, which is zeroed again after every replay.

With a compile backend the bucket's forward pass is torch.compile'd first (one graph with
dynamic batch and width, the KV cache's ops as opaque custom ops: kernels/compiled.py), so the
graph replays fused kernels. Both are for CUDA; the CPU tests run the same padded steps eagerly
or compiled with the "aot_eager" backend, which traces without generating code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.model import LlamaModel
from kernels import AttentionMetadata

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 256  # narrower key widths share one graph: the padding costs less than a capture


def check_device(device: torch.device, what: str = "CUDA graphs",
                 option: str = "cuda_graphs") -> None:
    """CUDA graphs and the compiled decode step are for CUDA only; anywhere else, say so."""
    if device.type != "cuda":
        raise ValueError(f"{what} need a CUDA device, not '{device}': leave {option} off there.")


@dataclass
class _Step:
    """The static tensors a graph reads and writes; each step's inputs are copied into them."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    null_slot: int
    hidden: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None

    @classmethod
    def empty(cls, batch: int, width: int, null_slot: int, device: torch.device) -> _Step:
        def full(shape, value, dtype=torch.long):
            return torch.full(shape, value, dtype=dtype, device=device)

        meta = AttentionMetadata(slot_mapping=full((batch,), null_slot),
                                 decode_token_index=torch.arange(batch, device=device),
                                 decode_slots=full((batch, width), null_slot),
                                 decode_mask=full((batch, 1, 1, width), False, torch.bool))
        return cls(full((batch,), 0), full((batch,), 0), meta, null_slot)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> None:
        """This step's inputs in the first rows; padded rows attend to the null slot only."""
        batch, width = meta.decode_slots.shape
        static = self.meta
        self.ids.zero_()
        self.ids[:batch].copy_(input_ids)
        self.positions.zero_()
        self.positions[:batch].copy_(positions)
        static.slot_mapping.fill_(self.null_slot)
        static.slot_mapping[:batch].copy_(meta.slot_mapping)
        static.decode_slots.fill_(self.null_slot)
        static.decode_slots[:batch, :width].copy_(meta.decode_slots)
        static.decode_mask.zero_()
        # One key each for padded rows: an SDPA backend may give NaN for a row with no key.
        static.decode_mask[:, 0, 0, 0] = True
        if meta.decode_mask is None:
            static.decode_mask[:batch, :, :, :width] = True
        else:
            static.decode_mask[:batch, :, :, :width].copy_(meta.decode_mask)


class _Runner(Protocol):
    """What the graphs need of the runner that owns them (engine/runner.py)."""

    model: LlamaModel
    kv_caches: list
    null_slot: int
    device: torch.device

    def zero_null_slot(self) -> None: ...


class DecodeGraphs:
    """Decode-only steps of a runner through captured graphs (or, with capture=False, through the
    same padded static tensors run eagerly: the CPU tests' way to check the padding), compiled
    first when `compile_backend` names a torch.compile backend ("inductor" on CUDA)."""

    def __init__(self, runner: _Runner, max_batch: int, max_width: int,
                 capture: bool = True, compile_backend: str | None = None) -> None:
        if capture:
            check_device(runner.device)
        self.runner = runner
        self._compiled = None
        if compile_backend is not None:
            from kernels.compiled import compilable

            ops = compilable(runner.model.ops)

            def forward(ids, positions, meta):
                return runner.model.forward(ids, positions, meta, runner.kv_caches, ops=ops)

            self._compiled = torch.compile(forward, backend=compile_backend, fullgraph=True,
                                           dynamic=True)
        self.batches = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_width = max_width
        self.capture = capture
        self._steps: dict[tuple[int, int], _Step] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def handles(self, batch: int, meta: AttentionMetadata, all_logits: bool) -> bool:
        """Whether a step of `batch` sequences is one the graphs serve: one single-token query
        per sequence (a verification's decode rows run eagerly), no statistics."""
        return (not all_logits and not meta.want_mass and not meta.prefills
                and meta.decode_slots is not None and meta.decode_slots.shape[0] == batch
                and batch <= self.batches[-1]
                and meta.decode_slots.shape[1] <= self.max_width)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step's rows ([B, hidden]; valid until the next run)."""
        batch, width = meta.decode_slots.shape
        bucket = (next(b for b in self.batches if b >= batch), self._width(width))
        step = self._steps.get(bucket) or self._build(*bucket)
        step.fill(input_ids, positions, meta)
        if step.graph is not None:
            step.graph.replay()
        else:
            step.hidden = self._forward(step)
        self.runner.zero_null_slot()  # padded rows wrote their K/V there
        return step.hidden[:batch]

    def _width(self, width: int) -> int:
        return min(max(MIN_WIDTH, 1 << (width - 1).bit_length()), self.max_width)

    def _forward(self, step: _Step) -> torch.Tensor:
        if self._compiled is not None:
            return self._compiled(step.ids, step.positions, step.meta)
        return self.runner.model.forward(step.ids, step.positions, step.meta,
                                         self.runner.kv_caches)

    def _build(self, batch: int, width: int) -> _Step:
        step = _Step.empty(batch, width, self.runner.null_slot, self.runner.device)
        if self.capture:
            # One eager pass on a side stream first: Triton compiles and cuBLAS picks its
            # kernels and workspace outside the capture, as torch.cuda.graphs asks.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(step)
            torch.cuda.current_stream().wait_stream(side)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=self._pool):
                step.hidden = self._forward(step)
        self._steps[(batch, width)] = step
        return step
