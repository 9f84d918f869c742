"""Token sampling: logits processed per request (logit_bias, presence and frequency
penalties, a grammar's mask), then greedy, temperature, top-k and top-p, reproducible per
request seed."""

from __future__ import annotations

import random

import numpy as np
import torch

from engine.sequence import Sequence


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's index of its largest value (the first where several tie; a NaN counts as the
    largest), as torch.argmax gives it: through NumPy for float32 on the CPU, where torch's CPU
    argmax took 86 us for one row of the demo model's 49,152 logits and NumPy's 4 us (a
    16-sequence step spent about 0.8 ms in it, a verification of 8 drafts 0.4 ms)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Pick one token per row of `logits` ([S, V], float32) under each sequence's params."""
    logits = processed_logits(logits, seqs)
    tokens = argmax_rows(logits)
    rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if rows:
        probs = filtered_probs(logits[rows], [seqs[i].params for i in rows])
        # One uniform draw per request from its own generator: the token a seed picks does not
        # depend on which other requests share the batch.
        u = torch.cat([torch.rand(1, generator=generator_for(seqs[i])) for i in rows])
        for row, token in zip(rows, inverse_cdf(probs, u), strict=True):
            tokens[row] = token
    return tokens


def processed_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The logits each request's bias, penalties and grammar make of the model's; a copy
    when any row changes, so the raw logits stay for log-probabilities."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.processes_logits]
    if not rows:
        return logits
    logits = logits.float().clone()
    for i in rows:
        _process_row(logits[i], seqs[i])
    return logits


def _process_row(row: torch.Tensor, seq: Sequence) -> None:
    p = seq.params
    if p.logit_bias:
        ids, biases = zip(*p.logit_bias, strict=True)
        row.index_add_(0, torch.tensor(ids, device=row.device),
                       torch.tensor(biases, device=row.device, dtype=row.dtype))
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        # OpenAI's definition, over the tokens generated so far (not the prompt's).
        out = torch.tensor(seq.output_token_ids, device=row.device)
        counts = torch.bincount(out, minlength=row.numel())[: row.numel()].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if seq.grammar is not None:
        seq.grammar.mask(row)


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from an (unnormalised) distribution [V], with one uniform from `gen`."""
    return inverse_cdf(probs.unsqueeze(0), torch.rand(1, generator=gen))[0]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1).tolist()


def generator_for(seq: Sequence) -> torch.Generator:
    """The request's own random stream, seeded from its params (or at random) on first use."""
    if seq.generator is None:
        seed = seq.params.seed if seq.params.seed is not None else random.getrandbits(63)
        seq.generator = torch.Generator().manual_seed(seed)
    return seq.generator


# Tokens ranked first when cutting a top-p nucleus (four times as many until the nucleus ends
# among them): at top_p 0.9-0.95 the demo model's chat replies need a few to a few hundred.
NUCLEUS_FIRST_RANKS = 256
TOPK_UP_TO = 4096  # beyond, a whole-row sort is cheaper than torch.topk (_largest)


def filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Softmax at each row's temperature, with top-k and top-p mass removed (on the CPU)."""
    logits = logits.float().cpu()
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temps
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The logits with each row's tokens outside its top-k and its top-p nucleus set to -inf.

    Only the most likely tokens are ever ranked (torch.topk, widening until the nucleus ends
    among them): sorting every whole row, as this did before, took about 34 ms for a step of 16
    sampled sequences of the demo model's 49,152 logits on the 2-core CPU, more than the step's
    forward pass (benchmarks/sampling.py). The rows are cut together, widening only those whose
    nucleus runs on: one at a time, a step spent more in Python's loop and in each wide row's
    own widening than in the ranking."""
    vocab = logits.shape[-1]
    # A top_k beyond the vocabulary keeps every token.
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    rows = [i for i, (k, p) in enumerate(zip(ks, top_p, strict=True)) if k < vocab or p < 1.0]
    if not rows:
        return logits
    picked = logits[rows]
    log_totals = _log_totals(picked)
    keep = torch.zeros_like(picked, dtype=torch.bool)
    todo = list(range(len(rows)))
    width = NUCLEUS_FIRST_RANKS
    while todo:
        width = min(width, vocab)
        values, ids = _largest(picked[todo], width)
        sizes = _nucleus_sizes(values.double(), [ks[rows[j]] for j in todo],
                               [top_p[rows[j]] for j in todo], log_totals[todo], vocab)
        kept = torch.arange(width, device=picked.device) < torch.tensor(
            [size or 0 for size in sizes], device=picked.device).unsqueeze(1)
        # Each row is cut once, by the ranks that first hold its cut (the rows left keep none).
        keep[todo] = torch.zeros((len(todo), vocab), dtype=torch.bool,
                                 device=picked.device).scatter_(1, ids, kept)
        todo = [j for j, size in zip(todo, sizes, strict=True) if size is None]
        # Four times as many ranks, or the whole rows once a topk would cost more than a sort.
        width = 4 * width if 4 * width <= TOPK_UP_TO else vocab
    out = logits.clone()
    out[rows] = picked.masked_fill(~keep, float("-inf"))
    return out


def _largest(rows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest values of each CPU row and their ids, largest first: torch.topk for a few
    thousand, else NumPy's sort of the whole rows (torch's CPU sort of 49,152 values took 4.1 ms
    here, NumPy's 0.8 ms, topk of 16,384 1.7 ms). Float32 ranks as float64 would (the
    conversion is exact), without the copy."""
    if n <= TOPK_UP_TO:
        return rows.topk(n, dim=-1)
    ids = torch.from_numpy(np.argsort(-rows.numpy(), axis=-1)[:, :n])
    return rows.gather(1, ids), ids


def _log_totals(rows: torch.Tensor) -> torch.Tensor:
    """Each row's logsumexp (float64): the exponentials in float32, their sum in float64 (a
    nucleus of thousands of tokens sums thousands of small probabilities, and float32's
    rounding of the sum moved its edge by a token, against the exact sum, in some rows). Within
    2e-8 of a float64 logsumexp in half the time; a row with an infinite or NaN maximum goes
    through float64's, which defines those."""
    top = rows.amax(dim=-1, keepdim=True)
    if not bool(torch.isfinite(top).all()):
        return rows.double().logsumexp(dim=-1)
    return (rows - top).exp().sum(dim=-1, dtype=torch.float64).log() + top.squeeze(1).double()


def _nucleus_sizes(values: torch.Tensor, ks: list[int], ps: list[float],
                   log_totals: torch.Tensor, vocab: int) -> list[int | None]:
    """How many of each row's first ranks (values: its largest logits, float64, largest first)
    its top-k and top-p keep: its k most likely tokens cut to the smallest prefix whose
    probability (among those k) reaches p, a token dropped where the mass before it already
    reaches p, so the most likely token always stays. None where that needs more ranks (a
    nucleus or a top-k past them)."""
    width = values.shape[1]
    k = torch.tensor(ks, device=values.device).unsqueeze(1)
    in_k = torch.arange(width, device=values.device) < k
    ranked = values.masked_fill(~in_k, float("-inf"))
    # The top-k distribution's normaliser where k cuts the vocabulary, else the whole row's.
    norms = torch.where(k.squeeze(1) < vocab, ranked.logsumexp(dim=-1), log_totals)
    probs = (ranked - norms.unsqueeze(1)).exp()
    p = torch.tensor(ps, dtype=torch.float64, device=values.device).unsqueeze(1)
    past = ((probs.cumsum(-1) - probs) >= p) & in_k
    ends = torch.where(past.any(dim=-1), past.int().argmax(dim=-1), -1).tolist()
    sizes: list[int | None] = []
    for row_k, row_p, end in zip(ks, ps, ends, strict=True):
        if row_k < vocab and row_k > width:
            sizes.append(None)  # its normaliser needs all k
        elif row_p < 1.0 and end >= 0:
            sizes.append(max(1, end))
        else:
            sizes.append(row_k if row_k <= width else None)
    return sizes
