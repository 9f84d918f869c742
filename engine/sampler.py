"""Token sampling: logits processed per request (logit_bias, presence and frequency
penalties, a grammar's mask), then greedy, temperature, top-k and top-p, reproducible per
request seed."""

from __future__ import annotations

import random

import torch

from engine.sequence import Sequence


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's index of its largest value (the first where several tie; a NaN counts as the
    largest), as torch.argmax gives it: through NumPy for float32 on the CPU, where torch's CPU
    argmax took 86 us for one row of the demo model's 49,152 logits and NumPy's 4 us (a
    16-sequence step spent about 1.4 ms in it, a verification of 8 drafts 0.4 ms)."""
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
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    # A top_k beyond the vocabulary keeps every token (and must not overflow the tensor).
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k]).unsqueeze(1)
    remove = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass before
    # it already reaches top_p, so the most likely token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= torch.tensor(top_p).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
