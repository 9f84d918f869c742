"""Train the demo model's hidden-state draft from its own greedy chat replies; prints one JSON.

The draft (engine/spec/hidden_draft.py, EAGLE-style without attention) predicts the target's
next final hidden state from its current one and the newest token with one small MLP, and reads
a token off it through the target's tied head restricted to the VOCAB tokens the demo model
writes most. Only the MLP and the id map are shipped (assets/drafts/, safetensors, float16).

Stages, each cached under --work-dir so a rerun picks up where it stopped:
1. generate: greedy replies of the demo model to every prompt of the first --topics topics of
   assets/drafts/prompts.json (templates x topics), batched through LLM.generate in --dtype
   (default: what the engine serves on this machine, bfloat16 where the CPU has it), with the
   target's final hidden state at every position that chose a reply token, as the engine
   computed it (a step feature records it), so the draft learns the target as it is served;
   with --sampled (the default) also a reply sampled at temperature 0.7 to every training
   prompt: more of the target's own contexts, labelled with its greedy choice at each;
   with --fuse-layers (EAGLE-3's fused features), also the target's residual streams after
   those layers at the same positions, by prefilling each reply again (record_streams);
2. train: --steps chained draft steps per position (serving chains up to 3), each from the
   draft's own previous prediction, on the target's greedy tokens and states;
   held-out prompts measure how often the draft's tokens at each step are the target's.
Fixed seeds and greedy generation make the result reproducible.
Run: python benchmarks/train_draft.py [--out assets/drafts/smollm2-135m-hidden.safetensors]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from collections import Counter  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.features import Step, StepFeature  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402
from engine.spec.config import DEMO_DRAFT_PATH  # noqa: E402
from engine.spec.hidden_draft import (  # noqa: E402
    FORMAT,
    FUSE_LAYERS,
    draft_step,
    fused_root,
    vocab_fingerprint,
)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "assets" / "drafts" / "prompts.json"
SEED = 0
HELD_OUT = 0.1
MAX_TOKENS = 160
GEN_BATCH = 60  # six topics' worth of prompts
# All of prompts.json: 5920 prompts. Held-out first-token agreement grew with the replies: 60
# topics (600 prompts) 51%, 296 topics (2960) 58%.
TOPICS = 592
VOCAB = 8192
WIDTH = 1024
EPOCHS = 2  # over greedy and sampled replies: as many updates as 4 over greedy alone
LR = 1e-3
BATCH = 256
STATE_WEIGHT = 1.0
# Chained steps trained per position: serving drafts up to 3 (demo-draft's k), each step from
# the draft's own previous state, so each of them is trained on what it will be given.
STEPS = 3
SOFT = 0.0
# Middle layers whose residual streams the draft's first step reads beside the final state
# (EAGLE-3's fused features), none by default: with 3,10,20 (low, middle and high of the demo
# model's 30) the draft's held-out chains of 2 were right 1.08x as often, but served it was no
# faster (docs/ARCHITECTURE.md).
FUSE = ""
# Sampled replies (--sampled): more contexts of the target's own writing; the draft still learns
# the target's greedy choice at each of them (generate()'s `best`). No top_p: at 60 sequences
# the nucleus's per-row ranking made generation several times slower.
SAMPLED_TEMPERATURE = 0.7


def chat_prompts(topics: int) -> list[str]:
    """Every template on each of the first `topics` topics, topic by topic."""
    spec = json.loads(PROMPTS.read_text())
    return [t.format(topic=topic) for topic in spec["topics"][:topics] for t in spec["templates"]]


def split(prompts: list[str]) -> tuple[list[int], list[int]]:
    """Indices of training and held-out prompts (a fixed shuffle)."""
    order = list(range(len(prompts)))
    random.Random(SEED).shuffle(order)
    cut = int(len(order) * HELD_OUT)
    return sorted(order[cut:]), sorted(order[:cut])


class StateRecorder(StepFeature):
    """Keeps, per request, the target's final hidden state (float16) and its own greedy choice
    at every position that chose a token, keyed by position (a preempted request's
    recomputation overwrites)."""

    def __init__(self) -> None:
        self.states: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def after_forward(self, step: Step) -> None:
        # One conversion and one argmax over the step's rows, not one per sequence.
        hidden = step.result.hidden.to(torch.float16)
        best = step.result.logits.argmax(-1)
        for s, row in zip(step.sampling, step.rows, strict=False):
            self.states.setdefault(s.seq.request_id, {})[s.seq.num_tokens - 1] = (hidden[row],
                                                                                 best[row])

    def take(self, request_id: str, prompt_len: int, length: int
             ) -> tuple[torch.Tensor, list[int]]:
        """A finished request's states and greedy choices at its last prompt position and the
        next `length` - 1 ([length, hidden] and `length` token ids)."""
        kept = self.states.pop(request_id)
        at = [kept[p] for p in range(prompt_len - 1, prompt_len - 1 + length)]
        return torch.stack([h for h, _ in at]), [int(t) for _, t in at]


def generate(model: str, prompts: list[str], path: Path, dtype: str = "auto",
             temperature: float = 0.0) -> list[dict]:
    """Replies (prompt ids + reply ids) of the demo model in `dtype`, greedy or sampled at
    `temperature` (seeded per prompt), GEN_BATCH prompts at a time, with the target's states
    and greedy choices behind them (`best`: the reply itself where greedy): each finished
    batch is appended to `path` (JSON lines) and its states saved beside it, so a rerun
    resumes."""
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if len(done) >= len(prompts):
        return done[: len(prompts)]
    llm = LLM(model, device="cpu", dtype=dtype, max_num_seqs=GEN_BATCH)
    recorder = StateRecorder()
    llm.core.features.append(recorder)
    ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    path.parent.mkdir(parents=True, exist_ok=True)
    for start in range(len(done), len(ids), GEN_BATCH):
        t0 = time.perf_counter()
        chunk = ids[start : start + GEN_BATCH]
        params = [SamplingParams(temperature=temperature, seed=SEED + start + i,
                                 max_tokens=MAX_TOKENS)
                  for i in range(len(chunk))]
        outs = llm.generate(chunk, params)
        batch, states = [], []
        for p, o in zip(chunk, outs, strict=True):
            h, best = recorder.take(o.request_id, len(p), len(o.token_ids))
            batch.append({"prompt": p, "reply": o.token_ids, "best": best,
                          "dtype": str(llm.model.dtype), "temperature": temperature})
            states.append(h)
        torch.save(states, states_file(path, start))
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in batch)
        done += batch
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"generated {len(done)}/{len(ids)}: {tokens / (time.perf_counter() - t0):.0f}"
              " tok/s", file=sys.stderr)
    return done


EVAL_ROWS = 8192  # positions scored at a time (evaluate)
STREAM_BATCH = 8  # replies prefilled per forward pass while recording middle layers


def record_streams(model: str, records: list[dict], path: Path, layers: tuple[int, ...],
                   dtype: str = "auto") -> None:
    """The target's residual stream after each of `layers` (EAGLE-3's fused features) at the
    positions whose final states generate() kept (the last prompt position and every reply
    position but the last), by prefilling each prompt + reply in the served dtype: saved as
    generate()'s states are, float16 [reply, len(layers) * hidden] per record, each batch of
    GEN_BATCH records beside `path` (a rerun resumes). Prefill rather than decoding computes the
    same layers in batched matmuls: about 1.8% apart from the decode path's final states here,
    and ten times faster than generating again."""
    from engine.scheduler import ScheduledSeq
    from engine.sequence import Sequence

    llm = None
    for start in range(0, len(records), GEN_BATCH):
        if streams_file(path, layers, start).exists():
            continue
        if llm is None:
            llm = LLM(model, device="cpu", dtype=dtype)
            llm.runner.stream_layers = layers
        t0, kept = time.perf_counter(), []
        chunk = records[start : start + GEN_BATCH]
        for b in range(0, len(chunk), STREAM_BATCH):
            seqs = [Sequence(f"streams-{start + b + i}", r["ids"][:-1], SamplingParams(), 0.0)
                    for i, r in enumerate(chunk[b : b + STREAM_BATCH])]
            for seq in seqs:
                llm.block_manager.append_slots(seq, seq.num_tokens)
            try:
                streams = llm.runner.run([ScheduledSeq(q, q.num_tokens) for q in seqs],
                                         all_logits=True, logits=False).streams
            finally:
                for seq in seqs:
                    llm.block_manager.free(seq)
            at = 0
            for seq, r in zip(seqs, chunk[b : b + STREAM_BATCH], strict=True):
                n = r["prompt_len"]
                kept.append(streams[at + n - 1 : at + seq.num_tokens].half().clone())
                at += seq.num_tokens
        torch.save(kept, streams_file(path, layers, start))
        tokens = sum(len(r["ids"]) for r in chunk)
        print(f"streams {start + len(chunk)}/{len(records)}: "
              f"{tokens / (time.perf_counter() - t0):.0f} tok/s", file=sys.stderr)


def streams_file(path: Path, layers: tuple[int, ...], start: int) -> Path:
    """Where record_streams() keeps the streams of the records from `start` on."""
    return path.with_suffix(f".streams_{'-'.join(map(str, layers))}_{start}.pt")


def states_file(path: Path, start: int) -> Path:
    """Where generate() keeps the states of the replies from `start` on, beside `path`."""
    return path.with_suffix(f".states_{start}.pt")


def target_states(records: list[dict], path: Path) -> list[torch.Tensor]:
    """Per record of `path` (generate()'s), the target's states it saved: at the last prompt
    position and at every reply position but the last ([reply, hidden], float16)."""
    out: list[torch.Tensor] = []
    while len(out) < len(records):
        out += torch.load(states_file(path, len(out)))
    return out[: len(records)]


def target_streams(records: list[dict], path: Path, layers: tuple[int, ...]
                   ) -> list[torch.Tensor]:
    """Per record of `path`, the middle layers' streams record_streams() saved."""
    out: list[torch.Tensor] = []
    while len(out) < len(records):
        out += torch.load(streams_file(path, layers, len(out)))
    return out[: len(records)]


def reply_agreement(tensors: dict, records: list[dict], states: list[torch.Tensor]) -> float:
    """Share of the target's greedy choices (the replies, where greedy) that are the argmax of
    their state through the target's tied head in float32 (below 1 only by the served dtype's
    rounding near ties): the states are the ones behind the choices."""
    head = tensors["model.embed_tokens.weight"]
    same = total = 0
    for record, h in zip(records, states, strict=True):
        best = torch.tensor(record["best"])
        same += int(((h.float() @ head.T).argmax(-1) == best).sum())
        total += len(best)
    return same / total


def draft_vocab(records: list[dict], train_idx: list[int], size: int, vocab_size: int,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's vocabulary: the `size` tokens the target chose most in its training replies
    (sorted ids; a draft's head is the target's tied head restricted to them), and the map from
    a token id to its row there (-100, ignored by the loss, for a token left out)."""
    counts = Counter(t for i in train_idx for t in records[i]["best"])
    vocab_ids = torch.tensor(sorted(t for t, _ in counts.most_common(size)))
    return vocab_ids, rows_of(vocab_ids, vocab_size)


def rows_of(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The map from a token id to its row in a draft vocabulary (-100 for a token left out)."""
    token_to_row = torch.full((vocab_size,), -100)
    token_to_row[vocab_ids] = torch.arange(len(vocab_ids))
    return token_to_row


def held_out_coverage(records: list[dict], held_idx: list[int], vocab_ids: torch.Tensor
                      ) -> float:
    """Share of the held-out replies' tokens inside the draft's vocabulary."""
    kept = set(vocab_ids.tolist())
    held = [t for i in held_idx for t in records[i]["ids"][records[i]["prompt_len"]:]]
    return sum(t in kept for t in held) / len(held)


def examples(records: list[dict], states: list[torch.Tensor], which: list[int],
             token_to_row: torch.Tensor, steps: int,
             streams: list[torch.Tensor] | None = None, release: bool = False
             ) -> dict[str, torch.Tensor]:
    """`steps` chained draft steps per reply position q: from (h[q-1], x[q]) the draft predicts
    h[q] and the head row of x[q+1]; then from its own prediction and x[q+1], h[q+1] and x[q+2];
    and so on (training each step on the previous one's output, as serving chains them). The
    token a step should draft is the target's greedy choice there (the next token, where the
    reply is greedy). Keys h0, and per step j: xj (its input token), hj (the target's state),
    yj (the row of the token it should draft); states in float16. With `streams`
    (record_streams'), also a0: the middle layers' streams beside h0; with `release`, the
    list of them is emptied once they are gathered (all 1.4M positions' streams are 5 GB
    twice over, and the states' four shifted copies follow)."""
    # positions q = n .. n + m - 1 of a reply; h[r] is the state at n - 1 + r
    counts = {i: len(records[i]["ids"]) - records[i]["prompt_len"] - steps for i in which}
    kept = [i for i in which if counts[i] > 0]
    out = {} if streams is None else {"a0": torch.cat([streams[i][: counts[i]] for i in kept])}
    if release and streams is not None:
        streams.clear()
    cols: dict[str, list] = {"h0": []}
    for j in range(1, steps + 1):
        cols.update({f"x{j}": [], f"h{j}": [], f"y{j}": []})
    for i in kept:
        ids, n, h, best, m = (records[i]["ids"], records[i]["prompt_len"], states[i],
                              records[i]["best"], counts[i])
        cols["h0"].append(h[:m])
        for j in range(1, steps + 1):
            cols[f"x{j}"].append(torch.tensor(ids[n + j - 1 : n + j - 1 + m]))
            cols[f"h{j}"].append(h[j : j + m])
            cols[f"y{j}"].append(token_to_row[torch.tensor(best[j : j + m])])
    return out | {k: torch.cat(v) for k, v in cols.items()}


def chain_steps(w: dict, data: dict, embed: torch.Tensor, head: torch.Tensor, eps: float,
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each chained step's predicted state and its draft-vocabulary logits."""
    s, out = data["h0"].float(), []
    if "fuse.weight" in w:
        s = fused_root(s, data["a0"], w, eps)
    for j in range(1, sum(k.startswith("y") for k in data) + 1):
        s = draft_step(s, embed[data[f"x{j}"]], w, eps)
        out.append((s, s @ head.T))
    return out


def new_draft(cfg, width: int, fuse: int = 0) -> dict[str, torch.nn.Parameter]:
    """f's weights; fc2 starts at zero, so the untrained draft predicts "the state stays"; with
    `fuse` middle layers, their projection (fused_root), at zero too: it adds only what helps."""
    gen = torch.Generator().manual_seed(SEED)
    fan_in = 2 * cfg.hidden_size
    w = {"fc1.weight": (torch.rand(width, fan_in, generator=gen) * 2 - 1) / fan_in ** 0.5,
         "fc1.bias": torch.zeros(width), "fc2.weight": torch.zeros(cfg.hidden_size, width),
         "fc2.bias": torch.zeros(cfg.hidden_size), "embed_norm.weight": torch.ones(cfg.hidden_size)}
    if fuse:
        w["fuse.weight"] = torch.zeros(cfg.hidden_size, fuse * cfg.hidden_size)
    return {k: torch.nn.Parameter(v) for k, v in w.items()}


def baseline_top1(path: str, records: list[dict], states: list[torch.Tensor], which: list[int],
                  embed: torch.Tensor, vocab_size: int, eps: float, steps: int,
                  streams: list[torch.Tensor] | None = None) -> dict:
    """Another draft file's held-out figures on `which`, through its own vocabulary (a token
    outside it counts as a miss), so an earlier draft is compared on the same prompts."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    vocab_ids = tensors.pop("draft.vocab_ids").long()
    w = {k: v.float() for k, v in tensors.items()}
    data = examples(records, states, which, rows_of(vocab_ids, vocab_size), steps, streams)
    return evaluate(w, data, embed, embed[vocab_ids], eps)


def evaluate(w: dict, data: dict, embed: torch.Tensor, head: torch.Tensor, eps: float) -> dict:
    """Held-out share of positions where the draft's token at each chained step is the target's
    (`per_step`), and where its tokens up to that step all are (`chain`: a greedy chain of that
    many drafts accepted whole). EVAL_ROWS positions at a time: all 80k held-out positions'
    logits over the draft vocabulary at once were 2.6 GB a step."""
    rows, parts = len(data["x1"]), []
    with torch.no_grad():
        for start in range(0, rows, EVAL_ROWS):
            part = {k: v[start : start + EVAL_ROWS] for k, v in data.items()}
            parts.append(torch.stack([logits.argmax(-1) == part[f"y{j}"] for j, (_, logits)
                                      in enumerate(chain_steps(w, part, embed, head, eps),
                                                   start=1)]))
    ok = torch.cat(parts, dim=1)
    chain = ok.cumprod(0)
    return {"per_step": [round(float(x), 4) for x in ok.float().mean(1)],
            "chain": [round(float(x), 4) for x in chain.float().mean(1)]}


def train(w: dict, data: dict, held: dict, embed: torch.Tensor, head: torch.Tensor, eps: float,
          epochs: int, lr: float, soft: float = 0.0, bf16: bool = False) -> list[dict]:
    """Cross-entropy on every step's token plus a regression of the states (EAGLE's recipe);
    with `soft` > 0, plus that weight times the cross-entropy against the target's own
    distribution over the draft vocabulary (its state through the same head: distillation)."""
    ce, l1_loss = torch.nn.functional.cross_entropy, torch.nn.functional.smooth_l1_loss

    def step_loss(s: torch.Tensor, logits: torch.Tensor, batch: dict, j: int) -> torch.Tensor:
        h, s, logits = batch[f"h{j}"].float(), s.float(), logits.float()  # bf16 under autocast
        value = ce(logits, batch[f"y{j}"], ignore_index=-100) + STATE_WEIGHT * l1_loss(s, h)
        if soft:
            value = value + soft * ce(logits, torch.softmax(h @ head.T, dim=-1))
        return value

    def loss(batch: dict) -> torch.Tensor:
        return sum(step_loss(s, logits, batch, j) for j, (s, logits)
                   in enumerate(chain_steps(w, batch, embed, head, eps), start=1))

    return fit(w, data, loss, lambda: evaluate(w, held, embed, head, eps), epochs, lr, bf16)


def fit(w: dict, data: dict[str, torch.Tensor], loss, held_out, epochs: int, lr: float,
        bf16: bool = False) -> list[dict]:
    """AdamW with a one-cycle rate over `epochs` shuffled passes of BATCH examples (rows of
    every tensor in `data`); `loss(batch)` per batch (its matmuls in bfloat16 with `bf16`: the
    weights and their updates stay float32), `held_out()` after each epoch. One history entry
    per epoch (train loss, held-out figures, seconds), printed as it ends."""
    opt = torch.optim.AdamW(w.values(), lr=lr, weight_decay=0.0)
    n = len(next(iter(data.values())))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * (n // BATCH),
                                                pct_start=0.1)
    gen = torch.Generator().manual_seed(SEED)
    history = []
    for epoch in range(epochs):
        order, total, t0 = torch.randperm(n, generator=gen), 0.0, time.perf_counter()
        for b in range(n // BATCH):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                value = loss({k: v[order[b * BATCH : (b + 1) * BATCH]]
                              for k, v in data.items()})
            opt.zero_grad()
            value.backward()
            opt.step()
            sched.step()
            total += float(value.detach())
        history.append({"epoch": epoch + 1, "train_loss": total / (n // BATCH),
                        "held_out": held_out(), "seconds": time.perf_counter() - t0})
        print(json.dumps(history[-1]), file=sys.stderr)
    return history


@dataclass
class Corpus:
    """What every draft of the demo model is trained on: the replies (prompt + reply ids), the
    held-out split, the target's checkpoint and final states, the draft vocabulary."""

    records: list[dict]
    train_idx: list[int]
    held_idx: list[int]
    ckpt: object
    states: list[torch.Tensor]
    vocab_ids: torch.Tensor
    token_to_row: torch.Tensor
    dtype: str  # the target's while it wrote the replies and computed the states
    # With fuse layers: the target's middle-layer streams beside the states (record_streams).
    streams: list[torch.Tensor] | None = None

    @classmethod
    def build(cls, model: str, prompts: list[str], replies: list[dict], work: Path,
              vocab: int, sampled: list[dict] | None = None,
              layers: tuple[int, ...] = ()) -> Corpus:
        """From generate()'s greedy `replies` under `work`, and its `sampled` ones (training
        prompts' only: a held-out prompt stays unseen); with `layers`, record_streams' streams
        of those layers too (recorded first where missing)."""
        records = [record(r, i) for i, r in enumerate(replies)]
        train_idx, held_idx = split(prompts)
        ckpt = load_checkpoint(model, dtype=torch.float32)
        states = target_states(records, work / "replies.jsonl")
        streams = corpus_streams(model, records, work / "replies.jsonl", layers)
        if sampled:
            extra, trained = target_states(sampled, work / "sampled.jsonl"), list(train_idx)
            train_idx += range(len(records), len(records) + len(trained))
            more = [record(sampled[i], i) for i in trained]
            if streams is not None:
                kept = corpus_streams(model, [record(r, i) for i, r in enumerate(sampled)],
                                      work / "sampled.jsonl", layers)
                streams += [kept[i] for i in trained]
            records += more
            states += [extra[i] for i in trained]
        vocab_ids, token_to_row = draft_vocab(records, train_idx, vocab, ckpt.config.vocab_size)
        return cls(records, train_idx, held_idx, ckpt, states, vocab_ids, token_to_row,
                   replies[0]["dtype"], streams)


def corpus_streams(model: str, records: list[dict], path: Path, layers: tuple[int, ...]
                   ) -> list[torch.Tensor] | None:
    """The records' middle-layer streams (recorded where missing), or None without layers."""
    if not layers:
        return None
    record_streams(model, records, path, layers)
    return target_streams(records, path, layers)


def record(reply: dict, prompt: int) -> dict:
    """A reply as the corpus keeps it: all ids, the prompt's length, the greedy choices, the
    prompt's index."""
    return {"ids": reply["prompt"] + reply["reply"], "prompt_len": len(reply["prompt"]),
            "best": reply.get("best", reply["reply"]), "prompt": prompt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work-dir", default=str(REPO / ".cache" / "draft-train"))
    parser.add_argument("--out", default=str(DEMO_DRAFT_PATH))
    parser.add_argument("--topics", type=int, default=TOPICS,
                        help="train on the first N topics of assets/drafts/prompts.json")
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument("--dtype", default="auto", help="the target's dtype while generating "
                        "(auto: what the engine serves on this machine)")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help="chained draft steps trained per position")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--fuse-layers", default=FUSE,
                        help="target layer counts whose residual streams the draft's first "
                        "step also reads (EAGLE-3's fused features; comma-separated, '' for "
                        "none): recorded by prefilling the corpus's replies again")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--soft", type=float, default=SOFT,
                        help="weight of the distillation term (0: greedy tokens only)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="train's matmuls in bfloat16 (autocast; faster where the CPU "
                        "has bfloat16 instructions)")
    parser.add_argument("--sampled", action=argparse.BooleanOptionalAction, default=True,
                        help="also train on a sampled reply to every training prompt")
    parser.add_argument("--subset", type=float, default=1.0,
                        help="train on this share of the training prompts (quick comparisons)")
    parser.add_argument("--baseline", help="also score this draft file on the held-out prompts "
                        "of topics from --baseline-topics on (those it was not trained on)")
    parser.add_argument("--baseline-topics", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(SEED)
    work = Path(args.work_dir)
    model = str(fetch_demo_model(progress=lambda m, f: None))
    prompts = chat_prompts(args.topics)
    records = generate(model, prompts, work / "replies.jsonl", args.dtype)
    sampled = (generate(model, prompts, work / "sampled.jsonl", args.dtype, SAMPLED_TEMPERATURE)
               if args.sampled else None)
    if args.generate_only:
        print(json.dumps({"replies": len(records), "machine": machine()}))
        return 0
    t0 = time.perf_counter()
    layers = tuple(int(x) for x in args.fuse_layers.split(",") if x)
    c = Corpus.build(model, prompts, records, work, args.vocab, sampled, layers)
    load_s = time.perf_counter() - t0
    records, train_idx, held_idx, states = c.records, c.train_idx, c.held_idx, c.states
    ckpt, cfg, tensors = c.ckpt, c.ckpt.config, c.ckpt.tensors
    vocab_ids, token_to_row = c.vocab_ids, c.token_to_row
    embed = tensors["model.embed_tokens.weight"]
    head = embed[vocab_ids]
    held = examples(records, states, held_idx, token_to_row, args.steps, c.streams)
    compared = None
    if args.baseline:  # scored first: the training examples take the corpus's streams
        per_topic = len(json.loads(PROMPTS.read_text())["templates"])  # prompts run topic-major
        unseen = [i for i in held_idx if i // per_topic >= args.baseline_topics]
        unseen_data = examples(records, states, unseen, token_to_row, args.steps, c.streams)
        compared = {"baseline": {"file": Path(args.baseline).name,
                                 "sha256": hashlib.sha256(Path(args.baseline).read_bytes())
                                 .hexdigest()},
                    "held_out_prompts": len(unseen),
                    "baseline_draft": baseline_top1(args.baseline, records, states, unseen,
                                                    embed, cfg.vocab_size, cfg.rms_norm_eps,
                                                    args.steps, c.streams)}
    data = examples(records, states, [i for i in train_idx if records[i]["prompt"]
                                      < args.subset * len(prompts)], token_to_row, args.steps,
                    c.streams, release=True)
    w = new_draft(cfg, args.width, len(layers))
    before = evaluate(w, held, embed, head, cfg.rms_norm_eps)
    t0 = time.perf_counter()
    history = train(w, data, held, embed, head, cfg.rms_norm_eps, args.epochs, args.lr,
                    args.soft, args.bf16)
    train_s = time.perf_counter() - t0
    if compared is not None:
        compared["this_draft"] = evaluate(w, unseen_data, embed, head, cfg.rms_norm_eps)
    save(w, vocab_ids, args.out, ckpt, {
        "format": FORMAT, "width": str(args.width), "trained_by": "benchmarks/train_draft.py",
        "epochs": str(args.epochs), "lr": str(args.lr), "steps": str(args.steps),
        "target_dtype": c.dtype, **({FUSE_LAYERS: args.fuse_layers} if layers else {})})
    result = {
        "benchmark": "train_draft", "target": ckpt.name, "out": args.out,
        "draft_vocab": len(vocab_ids), "width": args.width,
        "prompts": {"train": len(train_idx), "held_out": len(held_idx)},
        "reply_tokens": {"train": len(data["x1"]), "held_out": len(held["x1"])},
        "held_out_vocab_coverage": held_out_coverage(records, held_idx, vocab_ids),
        "target_dtype": c.dtype,
        "reply_agreement_float32_head": reply_agreement(tensors, [records[i] for i in held_idx],
                                                        [states[i] for i in held_idx]),
        "held_out_top1_before_training": before,
        "held_out_top1": history[-1]["held_out"],
        "final_train_loss": history[-1]["train_loss"], "history": history,
        "against_baseline": compared,
        "file_bytes": Path(args.out).stat().st_size,
        "corpus_load_seconds": load_s, "train_seconds": train_s,
        "threads": torch.get_num_threads(), "machine": machine(),
    }
    # Provenance next to the weights: how they were made and how well they predict.
    provenance = {"file": Path(args.out).name, "command": "python benchmarks/train_draft.py " +
                  " ".join(option(k, v) for k, v in vars(args).items()
                           if k not in ("work_dir", "out", "generate_only", "baseline",
                                        "baseline_topics")),
                  "prompt_file": str(PROMPTS.relative_to(REPO)), "max_tokens": MAX_TOKENS,
                  "seed": SEED, **{k: v for k, v in result.items() if k != "out"}}
    (Path(args.out).parent / "README.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def option(name: str, value) -> str:
    """A command-line option as it would be typed (a flag for a boolean)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


def save(w: dict, vocab_ids: torch.Tensor, out: str, ckpt, meta: dict[str, str]) -> None:
    """float16 tensors, the id map and the metadata the engine checks (`meta`: the format and
    the training settings; the target, its tokenizer's fingerprint and the seed added here)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().half().contiguous() for k, v in w.items()}
    tensors["draft.vocab_ids"] = vocab_ids.int()
    meta = {"target": ckpt.name, "tokenizer_sha256": vocab_fingerprint(ckpt.tokenizer),
            "seed": str(SEED), **meta}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out, metadata=meta)


if __name__ == "__main__":
    sys.exit(main())
