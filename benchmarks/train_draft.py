"""Train the demo model's hidden-state draft from its own greedy chat replies; prints one JSON.

The draft (engine/spec/hidden_draft.py, EAGLE-style without attention) predicts the target's
next final hidden state from its current one and the newest token with one small MLP, and reads
a token off it through the target's tied head restricted to the VOCAB tokens the demo model
writes most. Only the MLP and the id map are shipped (assets/drafts/, safetensors, float16).

Stages, each cached under --work-dir so a rerun picks up where it stopped:
1. generate: greedy replies of the demo model to every prompt of the first --topics topics of
   assets/drafts/prompts.json (templates x topics), batched through LLM.generate;
2. target states: the target's final hidden state at every reply position (this file's own
   forward pass, checked to reproduce the engine's reply);
3. train: two chained draft steps per position, on the target's greedy tokens and states;
   held-out prompts measure how often the draft's first and second tokens are the target's.
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
from engine.loader import load_checkpoint  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402
from engine.rope import cos_sin_tables, inv_frequencies  # noqa: E402
from engine.spec.config import DEMO_DRAFT_PATH  # noqa: E402
from engine.spec.hidden_draft import FORMAT, draft_step, vocab_fingerprint  # noqa: E402

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
EPOCHS = 4
LR = 1e-3
BATCH = 256
STATE_WEIGHT = 1.0


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


def generate(model: str, prompts: list[str], path: Path) -> list[dict]:
    """Greedy replies (prompt ids + reply ids) of the demo model, GEN_BATCH prompts at a time; each
    finished batch is appended to `path` (JSON lines), so a rerun resumes."""
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if len(done) >= len(prompts):
        return done[: len(prompts)]
    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=GEN_BATCH)
    ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    path.parent.mkdir(parents=True, exist_ok=True)
    for start in range(len(done), len(ids), GEN_BATCH):
        t0 = time.perf_counter()
        outs = llm.generate(ids[start : start + GEN_BATCH], params)
        batch = [{"prompt": p, "reply": o.token_ids}
                 for p, o in zip(ids[start : start + GEN_BATCH], outs, strict=True)]
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in batch)
        done += batch
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"generated {len(done)}/{len(ids)}: {tokens / (time.perf_counter() - t0):.0f}"
              " tok/s", file=sys.stderr)
    return done


# ---- the target's layers and the trainable draft head, in plain PyTorch ----
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def decoder_layer(h: torch.Tensor, w: dict, cfg, cos: torch.Tensor, sin: torch.Tensor,
                  ) -> torch.Tensor:
    """One Llama layer over right-padded sequences h ([B, T, hidden]), causal; the same math
    as the engine's forward (which fuses the residual adds into its norms)."""
    b, t, _ = h.shape
    x = rms_norm(h, w["input_layernorm.weight"], cfg.rms_norm_eps)

    def heads(name: str, n: int) -> torch.Tensor:
        return (x @ w[f"self_attn.{name}_proj.weight"].T).view(b, t, n, cfg.head_dim
                                                               ).transpose(1, 2)

    q, k, v = heads("q", cfg.num_heads), heads("k", cfg.num_kv_heads), heads("v", cfg.num_kv_heads)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    group = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = h + attn.transpose(1, 2).reshape(b, t, -1) @ w["self_attn.o_proj.weight"].T
    x = rms_norm(h, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    gate = torch.nn.functional.silu(x @ w["mlp.gate_proj.weight"].T)
    return h + (gate * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


def layer_weights(tensors: dict, i: int) -> dict:
    prefix = f"model.layers.{i}."
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def rope(cfg, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_tables(inv_frequencies(cfg), length)
    return cos[None, None], sin[None, None]  # broadcast over batch and heads


def batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def padded(seqs: list[list[int]]) -> torch.Tensor:
    longest = max(map(len, seqs))
    return torch.tensor([s + [0] * (longest - len(s)) for s in seqs])


def target_states(tensors: dict, cfg, records: list[dict], work: Path) -> list[torch.Tensor]:
    """The target's final (normed) hidden state at each reply position and the last prompt
    position, per record (float16); computed 100 records at a time, cached under `work`."""
    layers = [layer_weights(tensors, i) for i in range(cfg.num_layers)]
    out: list[torch.Tensor] = []
    for part in range(0, len(records), 100):
        path = work / f"final_{part}.pt"
        chunk = list(range(part, min(part + 100, len(records))))
        cached = torch.load(path) if path.exists() else {}
        if not all(i in cached for i in chunk):
            cached = _states(tensors, cfg, layers, records, chunk)
            torch.save(cached, path)
        out += [cached[i] for i in chunk]
        print(f"target states {part + len(chunk)}/{len(records)}", file=sys.stderr)
    return out


@torch.no_grad()
def _states(tensors: dict, cfg, layers: list, records: list[dict], chunk: list[int]) -> dict:
    out = {}
    for group in batches(sorted(chunk, key=lambda i: len(records[i]["ids"])), 16):
        ids = padded([records[i]["ids"] for i in group])
        cos, sin = rope(cfg, ids.shape[1])
        h = tensors["model.embed_tokens.weight"][ids]
        for w in layers:
            h = decoder_layer(h, w, cfg, cos, sin)
        h = rms_norm(h, tensors["model.norm.weight"], cfg.rms_norm_eps)
        for row, i in enumerate(group):
            out[i] = h[row, records[i]["prompt_len"] - 1 : len(records[i]["ids"])].half()
    return out


def reproduces_reply(tensors: dict, record: dict, states: torch.Tensor) -> bool:
    """This file's forward pass, through the target's tied head, gives the engine's reply."""
    best = (states[:-1].float() @ tensors["model.embed_tokens.weight"].T).argmax(-1)
    return best.tolist() == record["ids"][record["prompt_len"]:]


def draft_vocab(records: list[dict], train_idx: list[int], size: int, vocab_size: int,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's vocabulary: the `size` tokens the target wrote most in its training replies
    (sorted ids; a draft's head is the target's tied head restricted to them), and the map from
    a token id to its row there (-100, ignored by the loss, for a token left out)."""
    counts = Counter(t for i in train_idx for t in records[i]["ids"][records[i]["prompt_len"]:])
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
             token_to_row: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two chained draft steps per reply position q: from (h[q-1], x[q]) the draft predicts
    h[q] and the head row of x[q+1]; then from its own prediction and x[q+1], h[q+1] and x[q+2]
    (training the second step on the first's output, as serving chains them)."""
    cols: dict[str, list] = {k: [] for k in ("h0", "x1", "h1", "y1", "x2", "h2", "y2")}
    for i in which:
        ids, n, h = records[i]["ids"], records[i]["prompt_len"], states[i]
        for q in range(n, len(ids) - 2):
            r = q - n  # h[r] is the state at position q - 1
            for key, value in (("h0", h[r]), ("x1", ids[q]), ("h1", h[r + 1]),
                               ("y1", ids[q + 1]), ("x2", ids[q + 1]), ("h2", h[r + 2]),
                               ("y2", ids[q + 2])):
                cols[key].append(value)
    out = {k: torch.stack(v).float() if k.startswith("h") else torch.tensor(v)
           for k, v in cols.items()}
    out["y1"], out["y2"] = token_to_row[out["y1"]], token_to_row[out["y2"]]
    return out


def new_draft(cfg, width: int) -> dict[str, torch.nn.Parameter]:
    """f's weights; fc2 starts at zero, so the untrained draft predicts "the state stays"."""
    gen = torch.Generator().manual_seed(SEED)
    fan_in = 2 * cfg.hidden_size
    w = {"fc1.weight": (torch.rand(width, fan_in, generator=gen) * 2 - 1) / fan_in ** 0.5,
         "fc1.bias": torch.zeros(width), "fc2.weight": torch.zeros(cfg.hidden_size, width),
         "fc2.bias": torch.zeros(cfg.hidden_size), "embed_norm.weight": torch.ones(cfg.hidden_size)}
    return {k: torch.nn.Parameter(v) for k, v in w.items()}


def baseline_top1(path: str, records: list[dict], states: list[torch.Tensor], which: list[int],
                  embed: torch.Tensor, vocab_size: int, eps: float) -> dict:
    """Another draft file's held-out figures on `which`, through its own vocabulary (a token
    outside it counts as a miss), so an earlier draft is compared on the same prompts."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    vocab_ids = tensors.pop("draft.vocab_ids").long()
    w = {k: v.float() for k, v in tensors.items()}
    data = examples(records, states, which, rows_of(vocab_ids, vocab_size))
    return evaluate(w, data, embed, embed[vocab_ids], eps)


def two_steps(w: dict, data: dict, embed: torch.Tensor, head: torch.Tensor, eps: float):
    s1 = draft_step(data["h0"], embed[data["x1"]], w, eps)
    s2 = draft_step(s1, embed[data["x2"]], w, eps)
    return s1, s2, s1 @ head.T, s2 @ head.T


def evaluate(w: dict, data: dict, embed: torch.Tensor, head: torch.Tensor, eps: float) -> dict:
    """Held-out share of positions where the draft's first / second token is the target's."""
    with torch.no_grad():
        _, _, l1, l2 = two_steps(w, data, embed, head, eps)
    ok1, ok2 = l1.argmax(-1) == data["y1"], l2.argmax(-1) == data["y2"]
    return {"first_token": float(ok1.float().mean()), "second_token": float(ok2.float().mean()),
            "both": float((ok1 & ok2).float().mean())}


def train(w: dict, data: dict, held: dict, embed: torch.Tensor, head: torch.Tensor, eps: float,
          epochs: int, lr: float) -> list[dict]:
    """Cross-entropy on both steps' tokens plus a regression of the states (EAGLE's recipe)."""
    ce, l1_loss = torch.nn.functional.cross_entropy, torch.nn.functional.smooth_l1_loss

    def loss(batch: dict) -> torch.Tensor:
        s1, s2, l1, l2 = two_steps(w, batch, embed, head, eps)
        return (ce(l1, batch["y1"], ignore_index=-100) + ce(l2, batch["y2"], ignore_index=-100)
                + STATE_WEIGHT * (l1_loss(s1, batch["h1"]) + l1_loss(s2, batch["h2"])))

    return fit(w, data, loss, lambda: evaluate(w, held, embed, head, eps), epochs, lr)


def fit(w: dict, data: dict[str, torch.Tensor], loss, held_out, epochs: int, lr: float,
        ) -> list[dict]:
    """AdamW with a one-cycle rate over `epochs` shuffled passes of BATCH examples (rows of
    every tensor in `data`); `loss(batch)` per batch, `held_out()` after each epoch. One
    history entry per epoch (train loss, held-out figures, seconds), printed as it ends."""
    opt = torch.optim.AdamW(w.values(), lr=lr, weight_decay=0.0)
    n = len(next(iter(data.values())))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * (n // BATCH),
                                                pct_start=0.1)
    gen = torch.Generator().manual_seed(SEED)
    history = []
    for epoch in range(epochs):
        order, total, t0 = torch.randperm(n, generator=gen), 0.0, time.perf_counter()
        for b in range(n // BATCH):
            value = loss({k: v[order[b * BATCH : (b + 1) * BATCH]] for k, v in data.items()})
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

    @classmethod
    def build(cls, model: str, prompts: list[str], replies: list[dict], work: Path,
              vocab: int) -> Corpus:
        records = [{"ids": r["prompt"] + r["reply"], "prompt_len": len(r["prompt"])}
                   for r in replies]
        train_idx, held_idx = split(prompts)
        ckpt = load_checkpoint(model, dtype=torch.float32)
        states = target_states(ckpt.tensors, ckpt.config, records, work)
        vocab_ids, token_to_row = draft_vocab(records, train_idx, vocab, ckpt.config.vocab_size)
        return cls(records, train_idx, held_idx, ckpt, states, vocab_ids, token_to_row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work-dir", default=str(REPO / ".cache" / "draft-train"))
    parser.add_argument("--out", default=str(DEMO_DRAFT_PATH))
    parser.add_argument("--topics", type=int, default=TOPICS,
                        help="train on the first N topics of assets/drafts/prompts.json")
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--baseline", help="also score this draft file on the held-out prompts "
                        "of topics from --baseline-topics on (those it was not trained on)")
    parser.add_argument("--baseline-topics", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(SEED)
    work = Path(args.work_dir)
    model = str(fetch_demo_model(progress=lambda m, f: None))
    prompts = chat_prompts(args.topics)
    records = generate(model, prompts, work / "replies.jsonl")
    if args.generate_only:
        print(json.dumps({"replies": len(records), "machine": machine()}))
        return 0
    t0 = time.perf_counter()
    c = Corpus.build(model, prompts, records, work, args.vocab)
    state_s = time.perf_counter() - t0
    records, train_idx, held_idx, states = c.records, c.train_idx, c.held_idx, c.states
    ckpt, cfg, tensors = c.ckpt, c.ckpt.config, c.ckpt.tensors
    vocab_ids, token_to_row = c.vocab_ids, c.token_to_row
    embed = tensors["model.embed_tokens.weight"]
    head = embed[vocab_ids]
    data = examples(records, states, train_idx, token_to_row)
    held = examples(records, states, held_idx, token_to_row)
    w = new_draft(cfg, args.width)
    before = evaluate(w, held, embed, head, cfg.rms_norm_eps)
    t0 = time.perf_counter()
    history = train(w, data, held, embed, head, cfg.rms_norm_eps, args.epochs, args.lr)
    train_s = time.perf_counter() - t0
    compared = None
    if args.baseline:
        per_topic = len(json.loads(PROMPTS.read_text())["templates"])  # prompts run topic-major
        unseen = [i for i in held_idx if i // per_topic >= args.baseline_topics]
        unseen_data = examples(records, states, unseen, token_to_row)
        compared = {"baseline": {"file": Path(args.baseline).name,
                                 "sha256": hashlib.sha256(Path(args.baseline).read_bytes())
                                 .hexdigest()},
                    "held_out_prompts": len(unseen),
                    "this_draft": evaluate(w, unseen_data, embed, head, cfg.rms_norm_eps),
                    "baseline_draft": baseline_top1(args.baseline, records, states, unseen,
                                                    embed, cfg.vocab_size, cfg.rms_norm_eps)}
    save(w, vocab_ids, args.out, ckpt, {
        "format": FORMAT, "width": str(args.width), "trained_by": "benchmarks/train_draft.py",
        "epochs": str(args.epochs), "lr": str(args.lr)})
    result = {
        "benchmark": "train_draft", "target": ckpt.name, "out": args.out,
        "draft_vocab": len(vocab_ids), "width": args.width,
        "prompts": {"train": len(train_idx), "held_out": len(held_idx)},
        "reply_tokens": {"train": len(data["x1"]), "held_out": len(held["x1"])},
        "held_out_vocab_coverage": held_out_coverage(records, held_idx, vocab_ids),
        "target_forward_reproduces_engine": reproduces_reply(tensors, records[held_idx[0]],
                                                             states[held_idx[0]]),
        "held_out_top1_before_training": before,
        "held_out_top1": history[-1]["held_out"],
        "final_train_loss": history[-1]["train_loss"], "history": history,
        "against_baseline": compared,
        "file_bytes": Path(args.out).stat().st_size,
        "target_state_seconds": state_s, "train_seconds": train_s,
        "threads": torch.get_num_threads(), "machine": machine(),
    }
    # Provenance next to the weights: how they were made and how well they predict.
    provenance = {"file": Path(args.out).name, "command": "python benchmarks/train_draft.py " +
                  " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                           if k not in ("work_dir", "out", "generate_only", "baseline",
                                        "baseline_topics")),
                  "prompt_file": str(PROMPTS.relative_to(REPO)), "max_tokens": MAX_TOKENS,
                  "seed": SEED, **{k: v for k, v in result.items() if k != "out"}}
    (Path(args.out).parent / "README.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


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
