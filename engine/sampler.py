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
    forward pass (benchmarks/sampling.py)."""
    vocab = logits.shape[-1]
    # A top_k beyond the vocabulary keeps every token.
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    rows = [i for i, (k, p) in enumerate(zip(ks, top_p, strict=True)) if k < vocab or p < 1.0]
    if not rows:
        return logits
    # In float64: a nucleus of thousands of tokens sums thousands of small probabilities, and
    # float32's rounding moved its edge by a token (against the exact sum) in some rows.
    doubled = logits[rows].double()
    # The filtered rows' first candidates ranked in one call (one per row cost more than the
    # ranking), and each row's log-normaliser over the whole vocabulary.
    first = doubled.topk(min(vocab, NUCLEUS_FIRST_RANKS), dim=-1)
    log_totals = doubled.logsumexp(dim=-1)
    out = logits.clone()
    for j, i in enumerate(rows):
        kept = _kept_tokens(doubled[j], ks[i], top_p[i], (first.values[j], first.indices[j]),
                            log_totals[j])
        row = torch.full_like(logits[i], float("-inf"))
        row[kept] = logits[i, kept]
        out[i] = row
    return out


def _kept_tokens(row: torch.Tensor, k: int, p: float, first: tuple[torch.Tensor, torch.Tensor],
                 log_total: torch.Tensor) -> torch.Tensor:
    """Ids of the k most likely tokens of `row` (float64), cut to the smallest prefix whose
    probability (among those k) reaches p: a token is dropped when the mass before it already
    reaches p, so the most likely token always stays. `first`: the row's largest values and
    their ids, largest first; `log_total`: the logsumexp of the whole row."""
    values, ids = first[0][:k], first[1][:k]
    ranked_all_k = k <= first[1].numel()
    if p >= 1.0:
        return ids if ranked_all_k else row.topk(k).indices
    if k < row.numel():  # the top-k distribution's normaliser, over all k however few ranked
        log_total = (values if ranked_all_k else row.topk(k).values).logsumexp(-1)
    while True:
        probs = (values - log_total).exp()
        past = ((probs.cumsum(-1) - probs) >= p).nonzero()
        if past.numel():
            return ids[: max(1, int(past[0]))]
        width = ids.numel()
        if width == k:
            return ids
        values, ids = _largest(row, k if 4 * width > TOPK_UP_TO else min(4 * width, k))


def _largest(row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest values of a CPU row and their ids, largest first: torch.topk for a few
    thousand, else NumPy's sort of the whole row (torch's CPU sort of 49,152 values took 4.1 ms
    here, NumPy's 0.8 ms, topk of 16,384 1.7 ms)."""
    if n <= TOPK_UP_TO:
        return row.topk(n)
    ids = torch.from_numpy(np.argsort(-row.numpy())[:n])
    return row[ids], ids
