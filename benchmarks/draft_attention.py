"""Would attention over the draft's own past (EAGLE's draft layer) raise its first-token agreement?

The demo draft (engine/spec/hidden_draft.py) is an MLP over the target's last final state and the
newest token, without attention or a KV cache of its own. EAGLE drafts with one decoder layer
that attends over the draft's earlier inputs. Before building that into serving (a draft cache
per sequence, tree attention inside the draft), this trains, on the same corpus, schedule and
seed, three drafts teacher-forced at the first draft step: the MLP as shipped (width 1024), the
MLP twice as wide (capacity alone) and the MLP whose input also holds one attention layer's output
over the reply's earlier (state, token) pairs (9 query heads of 64 over 3 key/value heads,
rotary positions, the target's shape). Prints one JSON object: held-out agreement of each with
the target's greedy choice (the draft's first token), their ratio to the shipped shape's, the
training seconds and the machine.

The corpus is train_draft.py's (its greedy replies, with the target's final state at every reply
position as the engine served them): run `python benchmarks/train_draft.py --generate-only`
first (about 20 minutes on the 2-core CPU), or point --work-dir at its folder. Only reply
positions are attended over: the corpus keeps no states for the prompt's.
Run: python benchmarks/draft_attention.py [--work-dir .cache/draft-train] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import train_draft as T  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402

SEQS_PER_BATCH = 4  # about 300 positions, as train_draft's BATCH of 256 rows
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
ROPE_BASE = 10_000.0


def sequences(c: T.Corpus, which: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Per reply: the target's states h[0..L-1], the tokens x they continue with, the states
    to predict (h[1..L]) and the draft-vocabulary rows of the target's greedy choices there."""
    out = []
    for i in which:
        r, h = c.records[i], c.states[i]
        n, length = r["prompt_len"], len(h) - 1
        if length > 0:
            out.append((h[:length], torch.tensor(r["ids"][n : n + length]), h[1:],
                        c.token_to_row[torch.tensor(r["best"][1 : 1 + length])]))
    return out


def batches(data: list, shuffle: bool, gen: torch.Generator):
    """SEQS_PER_BATCH replies at a time, padded at the end (zero states, ignored targets)."""
    order = torch.randperm(len(data), generator=gen).tolist() if shuffle else range(len(data))
    order = list(order)
    for b in range(0, len(order), SEQS_PER_BATCH):
        chunk = [data[i] for i in order[b : b + SEQS_PER_BATCH]]
        yield (_padded(chunk, 0, 0).float(), _padded(chunk, 1, 0), _padded(chunk, 2, 0).float(),
               _padded(chunk, 3, -100))


def _padded(chunk: list, col: int, value: float) -> torch.Tensor:
    """Column `col` of the chunk's replies, stacked, padded at the end to the longest."""
    longest = max(len(item[col]) for item in chunk)
    return torch.stack([F.pad(item[col], (0, 0, 0, longest - len(item[col]))
                              if item[col].dim() == 2 else (0, longest - len(item[col])),
                              value=value) for item in chunk])


def rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """x ([batch, heads, positions, dim]) rotated by its positions (0, 1, ...)."""
    d = x.shape[-1]
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(x.shape[2]).float()[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


class Draft:
    """The MLP draft step (draft_step's shape), optionally fed one attention layer's output."""

    def __init__(self, hidden: int, width: int, attention: bool, eps: float) -> None:
        gen = torch.Generator().manual_seed(T.SEED)

        def uniform(rows: int, cols: int) -> torch.nn.Parameter:
            return torch.nn.Parameter((torch.rand(rows, cols, generator=gen) * 2 - 1)
                                      / cols ** 0.5)
        context = HEADS * HEAD_DIM if attention else 0
        self.attention, self.eps = attention, eps
        self.w = {"embed_norm": torch.nn.Parameter(torch.ones(hidden)),
                  "fc1": uniform(width, 2 * hidden + context),
                  "fc1_bias": torch.nn.Parameter(torch.zeros(width)),
                  # Zero: the untrained draft predicts "the state stays", as train_draft's.
                  "fc2": torch.nn.Parameter(torch.zeros(hidden, width)),
                  "fc2_bias": torch.nn.Parameter(torch.zeros(hidden))}
        if attention:
            self.w.update({"in": uniform(hidden, 2 * hidden),
                           "in_norm": torch.nn.Parameter(torch.ones(hidden)),
                           "q": uniform(HEADS * HEAD_DIM, hidden),
                           "k": uniform(KV_HEADS * HEAD_DIM, hidden),
                           "v": uniform(KV_HEADS * HEAD_DIM, hidden)})

    def __call__(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Predicted next states ([batch, positions, hidden]) from states s and the tokens'
        embeddings e, each position attending (with attention) to itself and those before."""
        z = torch.cat([s, rms(e, self.eps) * self.w["embed_norm"]], -1)
        if self.attention:
            z = torch.cat([z, self._context(z)], -1)
        return s + F.linear(F.silu(F.linear(z, self.w["fc1"], self.w["fc1_bias"])),
                            self.w["fc2"], self.w["fc2_bias"])

    def _context(self, z: torch.Tensor) -> torch.Tensor:
        b, n, _ = z.shape
        a = rms(z @ self.w["in"].T, self.eps, self.w["in_norm"])

        def heads(name: str, count: int) -> torch.Tensor:
            return (a @ self.w[name].T).view(b, n, count, HEAD_DIM).transpose(1, 2)
        q, k, v = rotary(heads("q", HEADS)), rotary(heads("k", KV_HEADS)), heads("v", KV_HEADS)
        group = HEADS // KV_HEADS
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                             v.repeat_interleave(group, 1), is_causal=True)
        return out.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM)


def agreement(draft: Draft, data: list, embed: torch.Tensor, head: torch.Tensor) -> float:
    """Share of held-out reply positions where the draft's first token is the target's greedy
    choice (a token outside the draft vocabulary counts as a miss)."""
    right = total = 0
    for s, x, h, y in batches(data, False, torch.Generator()):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            picked = (draft(s, embed[x]) @ head.T).float().argmax(-1)
            real = h.abs().sum(-1) > 0
            right += int((picked == y)[real].sum())
            total += int(real.sum())
    return right / total


def train(draft: Draft, data: list, embed: torch.Tensor, head: torch.Tensor,
          epochs: int) -> float:
    """train_draft's loss (cross-entropy on the token, smooth L1 on the state) and schedule
    (AdamW, one cycle), matmuls under bfloat16 autocast; returns the seconds taken."""
    opt = torch.optim.AdamW(draft.w.values(), lr=T.LR, weight_decay=0.0)
    steps = math.ceil(len(data) / SEQS_PER_BATCH)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=T.LR, total_steps=epochs * steps,
                                                pct_start=0.1)
    gen, start = torch.Generator().manual_seed(T.SEED), time.perf_counter()
    for epoch in range(epochs):
        total = 0.0
        for s, x, h, y in batches(data, True, gen):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = draft(s, embed[x])
                logits = out @ head.T
            real = h.abs().sum(-1) > 0
            loss = (F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
                    + T.STATE_WEIGHT * F.smooth_l1_loss(out.float()[real], h[real]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
        print(f"epoch {epoch + 1}: loss {total / steps:.3f}", file=sys.stderr)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work-dir", default=str(T.REPO / ".cache" / "draft-train"))
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    if not (work / "replies.jsonl").exists():
        parser.error(f"No draft corpus in {work}: run python benchmarks/train_draft.py "
                     "--generate-only first, or pass its --work-dir.")
    torch.manual_seed(T.SEED)
    model = str(fetch_demo_model(progress=lambda m, f: None))
    prompts = T.chat_prompts(T.TOPICS)
    replies = [json.loads(line) for line in (work / "replies.jsonl").read_text().splitlines()]
    if len(replies) < len(prompts):
        parser.error(f"The corpus in {work} holds {len(replies)} of {len(prompts)} replies: "
                     "finish it with train_draft.py --generate-only.")
    c = T.Corpus.build(model, prompts, replies, work, T.VOCAB)
    cfg, embed = c.ckpt.config, c.ckpt.tensors["model.embed_tokens.weight"]
    head = embed[c.vocab_ids]
    train_data, held = sequences(c, c.train_idx), sequences(c, c.held_idx)
    shapes = {"mlp": (T.WIDTH, False), "mlp_twice_as_wide": (2 * T.WIDTH, False),
              "mlp_with_attention": (T.WIDTH, True)}
    drafts = {}
    for name, (width, attention) in shapes.items():
        print(f"{name}:", file=sys.stderr)
        draft = Draft(cfg.hidden_size, width, attention, cfg.rms_norm_eps)
        seconds = train(draft, train_data, embed, head, args.epochs)
        drafts[name] = {"held_out_first_token_agreement": round(agreement(draft, held, embed,
                                                                          head), 4),
                        "parameters": sum(p.numel() for p in draft.w.values()),
                        "train_seconds": round(seconds, 1)}
    base = drafts["mlp"]["held_out_first_token_agreement"]
    for d in drafts.values():
        d["ratio_to_mlp"] = round(d["held_out_first_token_agreement"] / base, 4)
    print(json.dumps({"benchmark": "draft_attention", "target": c.ckpt.name,
                      "target_dtype": c.dtype, "epochs": args.epochs,
                      "train_positions": sum(len(item[1]) for item in train_data),
                      "held_out_positions": sum(len(item[1]) for item in held),
                      "drafts": drafts, "machine": machine()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
