"""Train the demo model's early-exit draft from its own greedy chat replies; prints one JSON.

The draft is self-speculative: the target's first EXIT_LAYERS layers (shared, not shipped),
then one trained decoder layer, a trained final norm and an LM head over a reduced vocabulary
(the tokens the demo model actually writes in chat, at most VOCAB of them). Only the trained
layer, norm, head and the id map are shipped (assets/drafts/, safetensors, float16).

Stages, each cached under --work-dir so a rerun picks up where it stopped:
1. generate: greedy replies of the demo model to every prompt in assets/drafts/prompts.json
   (templates x topics), batched through LLM.generate;
2. features: the target's residual stream after EXIT_LAYERS layers for every reply;
3. train: the trainable part on the replies' next tokens (the target's greedy choices),
   held-out prompts measure how often the draft's argmax equals the target's.
Fixed seeds and greedy generation make the result reproducible.
Run: python benchmarks/train_draft.py [--out assets/drafts/smollm2-135m-exit.safetensors]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from collections import Counter  # noqa: E402

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402
from engine.rope import cos_sin_tables, inv_frequencies  # noqa: E402
from engine.spec.config import DEMO_DRAFT_PATH  # noqa: E402
from engine.spec.exit_draft import FORMAT, vocab_fingerprint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "assets" / "drafts" / "prompts.json"
SEED = 0
HELD_OUT = 0.1
MAX_TOKENS = 160
GEN_BATCH = 60  # six topics' worth of prompts
TOPICS = 24
EXIT_LAYERS = 4
VOCAB = 8192
EPOCHS = 4
LR = 3e-4
BATCH = 8


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
    llm = LLM(model, device="cpu", max_num_seqs=GEN_BATCH)
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


class DraftHead(torch.nn.Module):
    """What the draft adds on top of the target's first layers: a layer, a norm, a small head."""

    def __init__(self, tensors: dict, cfg, exit_layers: int, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        # Start from the target's next layer and its final norm; the head from the tied
        # embedding's rows of the kept tokens.
        self.layer = torch.nn.ParameterDict({
            k.replace(".", "/"): torch.nn.Parameter(v.clone())  # module names hold no "."
            for k, v in layer_weights(tensors, exit_layers).items()})
        self.norm = torch.nn.Parameter(tensors["model.norm.weight"].clone())
        self.head = torch.nn.Parameter(tensors["model.embed_tokens.weight"][vocab_ids].clone())
        self.cfg = cfg

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        w = {k.replace("/", "."): v for k, v in self.layer.items()}
        h = decoder_layer(h, w, self.cfg, cos, sin)
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps) @ self.head.T

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors under the names the engine's loader reads (layer 0 of the draft's own)."""
        out = {f"model.layers.0.{k.replace('/', '.')}": v.detach()
               for k, v in self.layer.items()}
        out["model.norm.weight"] = self.norm.detach()
        out["lm_head.weight"] = self.head.detach()
        return out


def rope(cfg, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_tables(inv_frequencies(cfg), length)
    return cos[None, None], sin[None, None]  # broadcast over batch and heads


def batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def padded(seqs: list[list[int]]) -> torch.Tensor:
    longest = max(map(len, seqs))
    return torch.tensor([s + [0] * (longest - len(s)) for s in seqs])


@torch.no_grad()
def exit_features(tensors: dict, cfg, records: list[dict], exit_layers: int) -> list[torch.Tensor]:
    """The residual stream after the target's first `exit_layers` layers, per record (float16)."""
    layers = [layer_weights(tensors, i) for i in range(exit_layers)]
    out: list[torch.Tensor] = [None] * len(records)  # type: ignore[list-item]
    order = sorted(range(len(records)), key=lambda i: len(records[i]["ids"]))
    for group in batches(order, 16):
        ids = padded([records[i]["ids"] for i in group])
        cos, sin = rope(cfg, ids.shape[1])
        h = tensors["model.embed_tokens.weight"][ids]
        for w in layers:
            h = decoder_layer(h, w, cfg, cos, sin)
        for row, i in enumerate(group):
            out[i] = h[row, : len(records[i]["ids"])].half()
    return out


@torch.no_grad()
def target_reproduces(tensors: dict, cfg, record: dict) -> bool:
    """This file's forward pass, run through all the target's layers, gives the engine's reply."""
    ids = torch.tensor([record["ids"]])
    cos, sin = rope(cfg, ids.shape[1])
    h = tensors["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_layers):
        h = decoder_layer(h, layer_weights(tensors, i), cfg, cos, sin)
    logits = rms_norm(h, tensors["model.norm.weight"], cfg.rms_norm_eps) @ \
        tensors["model.embed_tokens.weight"].T
    n = record["prompt_len"]
    return logits[0, n - 1 : -1].argmax(-1).tolist() == record["ids"][n:]


def labels(record: dict, token_to_row: torch.Tensor) -> torch.Tensor:
    """Per position: the draft-head row of the target's next (greedy) token; -100 where there
    is nothing to learn (prompt positions, whose next token the user chose) or it is not kept."""
    ids = torch.tensor(record["ids"])
    out = torch.full((len(ids),), -100)
    n = record["prompt_len"]
    out[n - 1 : -1] = token_to_row[ids[n:]]
    return out


def run_head(head: DraftHead, feats: list[torch.Tensor], targets: list[torch.Tensor],
             cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and the number of correct argmax predictions, over one batch of records."""
    longest = max(f.shape[0] for f in feats)
    h = torch.zeros(len(feats), longest, cfg.hidden_size)
    y = torch.full((len(feats), longest), -100)
    for i, (f, t) in enumerate(zip(feats, targets, strict=True)):
        h[i, : f.shape[0]], y[i, : f.shape[0]] = f.float(), t
    cos, sin = rope(cfg, longest)
    logits = head(h, cos, sin)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    correct = ((logits.argmax(-1) == y) & (y >= 0)).sum()
    return loss, correct


def evaluate(head: DraftHead, feats: list, targets: list, records: list, cfg) -> float:
    """Held-out share of reply tokens whose draft argmax is the target's (kept or not)."""
    correct, total = 0, 0
    with torch.no_grad():
        for group in batches(list(range(len(feats))), 16):
            _, c = run_head(head, [feats[i] for i in group], [targets[i] for i in group], cfg)
            correct += int(c)
            total += sum(len(records[i]["ids"]) - records[i]["prompt_len"] for i in group)
    return correct / total


def train(head: DraftHead, feats: list, targets: list, cfg, epochs: int, lr: float,
          held: tuple[list, list, list]) -> list[dict]:
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    order = list(range(len(feats)))
    rng = random.Random(SEED)
    steps = epochs * -(-len(order) // BATCH)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps,
                                                pct_start=0.1)
    history = []
    for epoch in range(epochs):
        rng.shuffle(order)
        total, t0 = 0.0, time.perf_counter()
        for group in batches(order, BATCH):
            loss, _ = run_head(head, [feats[i] for i in group], [targets[i] for i in group], cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss) * len(group)
        history.append({"epoch": epoch + 1, "train_loss": total / len(order),
                        "held_out_top1": evaluate(head, *held, cfg),
                        "seconds": time.perf_counter() - t0})
        print(json.dumps(history[-1]), file=sys.stderr)
    return history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work-dir", default=str(REPO / ".cache" / "draft-train"))
    parser.add_argument("--out", default=str(DEMO_DRAFT_PATH))
    parser.add_argument("--topics", type=int, default=TOPICS,
                        help="train on the first N topics of assets/drafts/prompts.json")
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument("--exit-layers", type=int, default=EXIT_LAYERS)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--lr", type=float, default=LR)
    args = parser.parse_args(argv)
    torch.manual_seed(SEED)
    work = Path(args.work_dir)
    model = str(fetch_demo_model(progress=lambda m, f: None))
    prompts = chat_prompts(args.topics)
    records = generate(model, prompts, work / "replies.jsonl")
    if args.generate_only:
        print(json.dumps({"replies": len(records), "machine": machine()}))
        return 0
    records = [{"ids": r["prompt"] + r["reply"], "prompt_len": len(r["prompt"])}
               for r in records]
    train_idx, held_idx = split(prompts)
    ckpt = load_checkpoint(model, dtype=torch.float32)
    cfg, tensors = ckpt.config, ckpt.tensors
    # The draft's vocabulary: the tokens the target wrote in its training replies, most
    # frequent first.
    counts = Counter(t for i in train_idx for t in records[i]["ids"][records[i]["prompt_len"]:])
    vocab_ids = torch.tensor(sorted(t for t, _ in counts.most_common(args.vocab)))
    token_to_row = torch.full((cfg.vocab_size,), -100)
    token_to_row[vocab_ids] = torch.arange(len(vocab_ids))
    t0 = time.perf_counter()
    feats = exit_features(tensors, cfg, records, args.exit_layers)
    feature_s = time.perf_counter() - t0
    targets = [labels(r, token_to_row) for r in records]
    held = ([feats[i] for i in held_idx], [targets[i] for i in held_idx],
            [records[i] for i in held_idx])
    head = DraftHead(tensors, cfg, args.exit_layers, vocab_ids)
    before = evaluate(head, *held, cfg)
    t0 = time.perf_counter()
    history = train(head, [feats[i] for i in train_idx], [targets[i] for i in train_idx], cfg,
                    args.epochs, args.lr, held)
    train_s = time.perf_counter() - t0
    save(head, vocab_ids, args, ckpt)
    held_tokens = [t for r in held[2] for t in r["ids"][r["prompt_len"]:]]
    kept = set(vocab_ids.tolist())
    result = {
        "benchmark": "train_draft", "target": ckpt.name, "out": args.out,
        "exit_layers": args.exit_layers, "draft_vocab": len(vocab_ids),
        "prompts": {"train": len(train_idx), "held_out": len(held_idx)},
        "reply_tokens": {"train": sum(len(records[i]["ids"]) - records[i]["prompt_len"]
                                      for i in train_idx), "held_out": len(held_tokens)},
        "held_out_vocab_coverage": sum(t in kept for t in held_tokens) / len(held_tokens),
        "target_forward_reproduces_engine": target_reproduces(tensors, cfg, records[held_idx[0]]),
        "held_out_top1_before_training": before,
        "held_out_top1": history[-1]["held_out_top1"],
        "final_train_loss": history[-1]["train_loss"], "history": history,
        "file_bytes": Path(args.out).stat().st_size,
        "feature_seconds": feature_s, "train_seconds": train_s,
        "threads": torch.get_num_threads(), "machine": machine(),
    }
    # Provenance next to the weights: how they were made and how well they predict.
    provenance = {"file": Path(args.out).name, "command": "python benchmarks/train_draft.py " +
                  " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                           if k not in ("work_dir", "out", "generate_only")),
                  "prompts": str(PROMPTS.relative_to(REPO)), "max_tokens": MAX_TOKENS,
                  "seed": SEED, **{k: v for k, v in result.items() if k != "out"}}
    (Path(args.out).parent / "README.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def save(head: DraftHead, vocab_ids: torch.Tensor, args, ckpt) -> None:
    """float16 tensors and the metadata the engine checks (format, tokenizer, shapes)."""
    from safetensors.torch import save_file

    tensors = {k: v.half().contiguous() for k, v in head.state().items()}
    tensors["draft.vocab_ids"] = vocab_ids.int()
    meta = {"format": FORMAT, "target": ckpt.name, "exit_layers": str(args.exit_layers),
            "hidden_size": str(ckpt.config.hidden_size),
            "tokenizer_sha256": vocab_fingerprint(ckpt.tokenizer),
            "trained_by": "benchmarks/train_draft.py", "seed": str(SEED),
            "epochs": str(args.epochs), "lr": str(args.lr)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out, metadata=meta)


if __name__ == "__main__":
    sys.exit(main())
