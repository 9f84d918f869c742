"""Hidden-state drafts (EAGLE-style, without attention): draft from the target's own last state.

The target's verification pass already computes its final hidden state h at the position that
produced the newest token x. The draft predicts the target's next hidden state from (h, x) with
one small MLP, reads a token off it through the target's own tied LM head restricted to the
tokens the demo model writes most, and repeats from its own prediction for the next draft token:

    s_1 = f(h, x_n),  d_1 = argmax(s_1 . E[vocab]);  s_j = f(s_{j-1}, d_{j-1}),  d_j = ...

No KV cache and no extra layers: each draft token costs one MLP and a narrow head. A draft file
(safetensors, written by benchmarks/train_draft.py) holds f and `draft.vocab_ids`; the head rows
are the target's embedding, so they are not shipped. Drafts are argmax choices, so verification
treats them as deterministic proposals (p_draft = 1) and stays lossless for sampled requests.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import ModelError
from engine.model import LlamaModel
from engine.sampler import argmax_rows
from engine.sequence import Sequence
from engine.spec.decoder import Proposer, branches_for, set_draft_paths, spec_state

FORMAT = "servescope-hidden-draft"
# With branches > 1, a path the draft finds at least this fraction as likely as its best one at
# the same depth stays in the tree (up to the branch count).
BRANCH_RATIO = 0.1
TENSORS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "embed_norm.weight",
           "draft.vocab_ids")
# A draft trained on the target's middle layers too (train_draft.py --fuse-layers) names them
# in this metadata key (layer counts, comma-separated) and holds "fuse.weight".
FUSE_LAYERS = "fuse_layers"


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id map: a draft trained for it must see the same ids."""
    vocab = sorted(tokenizer.backend.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()


def read_metadata(path: Path) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except SafetensorError as exc:
        raise ModelError(f"The draft file {path} is not a readable safetensors file ({exc}): "
                         "it is truncated or corrupt; rebuild or copy it again.") from exc


def draft_step(s: torch.Tensor, token_embeddings: torch.Tensor, w: dict[str, torch.Tensor],
               eps: float, linear=F.linear) -> torch.Tensor:
    """f(s, x): the predicted next hidden state ([B, hidden]) from states and token embeddings.

    The training script runs this same function, so training and serving cannot drift apart;
    serving passes the target's own matmul (`linear`, float32 out) and weights prepared for it.
    """
    e = token_embeddings * torch.rsqrt(token_embeddings.pow(2).mean(-1, keepdim=True) + eps)
    x = torch.cat([s, e * w["embed_norm.weight"]], dim=-1)
    return s + linear(F.silu(linear(x, w["fc1.weight"], w["fc1.bias"])), w["fc2.weight"],
                      w["fc2.bias"])


def fused_root(h: torch.Tensor, streams: torch.Tensor, w: dict[str, torch.Tensor], eps: float,
               linear=F.linear) -> torch.Tensor:
    """The draft's first state from the target's final state h ([B, hidden]) and its residual
    streams after the draft's fuse layers ([B, layers * hidden], side by side): h plus a
    projection of each stream over its root mean square (EAGLE-3's fused features: the final
    state is shaped to predict the token just chosen, the middle layers still hold more of the
    context that the token after it depends on). Shared by training and serving, as
    draft_step."""
    x = streams.float().unflatten(-1, (-1, h.shape[-1]))
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return h + linear(x, w["fuse.weight"])


def load_draft_file(path: str, target: LlamaModel, target_tokenizer, required: tuple[str, ...],
                    out_tensor: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A draft file's tensors (without its id map) and its vocabulary ids, checked against the
    target: the same tokenizer, every `required` tensor present, `out_tensor` the target's
    hidden size wide, ids inside the target's vocabulary; else a ModelError naming the file."""
    from safetensors.torch import load_file

    meta = read_metadata(Path(path))
    if meta.get("tokenizer_sha256") != vocab_fingerprint(target_tokenizer):
        raise ModelError(f"The draft {path} was trained for a different tokenizer than the "
                         "target's: use it with the model it was trained from "
                         f"({meta.get('target', 'unknown')}).")
    c = target.config
    tensors = load_file(path)
    missing = [n for n in required if n not in tensors]
    if missing:
        raise ModelError(f"The draft {path} has no tensor '{missing[0]}': it is incomplete; "
                         f"rebuild it with {meta.get('trained_by', 'its training script')}.")
    if tensors[out_tensor].shape[0] != c.hidden_size:
        raise ModelError(f"The draft {path} does not fit this model (hidden size "
                         f"{tensors[out_tensor].shape[0]} vs {c.hidden_size}): use it "
                         f"with {meta.get('target', 'its target')}.")
    ids = tensors.pop("draft.vocab_ids").long()
    if int(ids.max()) >= c.vocab_size:
        raise ModelError(f"The draft {path} proposes token ids outside the target's "
                         "vocabulary: use it with the model it was trained from.")
    return tensors, ids


class StateProposer(Proposer):
    """A proposer that drafts from the target's own final hidden states (kept per sequence
    from each step), reading tokens off them through the target's tied LM head restricted to
    the draft's vocabulary."""

    def __init__(self, path: str, target: LlamaModel, vocab_ids: torch.Tensor) -> None:
        self.name = Path(path).stem
        self.embed = target.embed
        self.ops, self.dtype = target.ops, target.dtype
        self.vocab_ids = vocab_ids.to(target.device)
        # The tied LM head's kept rows, through the target's matmul in its compact form (int4
        # where the kernels have it): a draft token's cost is mostly reading this head and the
        # draft's matrices, every step. In float32 the head took 1.3-1.7 ms of a 10.5 ms
        # bfloat16 step on the 2-core EPYC; in int4 rather than bfloat16, open chat's
        # speculation ran 1.01-1.05x faster there with the same acceptance, and 0.99x at 16
        # concurrent requests (benchmarks/draft_weights.py, README). The Medusa heads share this
        # preparation. Padded to whole tiles of 16 rows, the padding's scores cut off again
        # (scores()).
        self.head = self.ops.prepare_compact_linear(self.head_rows())

    def head_rows(self) -> torch.Tensor:
        """The draft vocabulary's rows of the tied head in the target's dtype, padded with zero
        rows to whole tiles of 16 (before the matmul's preparation)."""
        rows = self.vocab_ids.numel()
        head = F.pad(self.embed[self.vocab_ids], (0, 0, 0, -rows % 16))
        return head.to(self.dtype).contiguous()

    def prepare(self, weights: dict[str, torch.Tensor], matrix=None) -> dict:
        """The draft's matrices prepared for the target's matmul (by `matrix`; default the
        compact form, as the head's), and its biases in the target's dtype (once, not per draft
        step); other vectors (a norm's weight) in float32."""
        device = self.embed.device
        matrix = matrix or self.ops.prepare_compact_linear

        def one(name: str, v: torch.Tensor):
            if v.dim() == 2:
                return matrix(v.to(device, self.dtype).contiguous())
            return v.to(device, self.dtype if name.endswith(".bias") else torch.float32)

        return {k: one(k, v) for k, v in weights.items()}

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + b through the target's matmul (weight and bias from prepare), in float32."""
        return self.ops.linear(x.to(self.dtype), weight, bias).float()

    def scores(self, s: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's logits ([..., vocab]) from states s ([..., hidden])."""
        return self.linear(s, self.head)[..., : self.vocab_ids.numel()]

    def top_tokens(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most probable draft tokens of each row of `scores` ([..., vocab]): their
        probabilities and token ids ([..., k] each), most probable first."""
        probs, cols = self.ops.softmax_topk(scores.reshape(-1, scores.shape[-1]), k)
        shape = (*scores.shape[:-1], k)
        return probs.view(shape), self.vocab_ids[cols].view(shape)

    def remember(self, sampling: list, new_tokens: list[list[int]],
                 hidden: torch.Tensor, streams: torch.Tensor | None = None) -> None:
        """Note, per sampling sequence (ScheduledSeq), where the target's hidden state at the row
        that chose its newest token lies: the step's rows are 1 + num_draft per sequence, in
        order, and a verified draft's newest token was chosen at its last accepted node's row
        (the root's where none was accepted).

        Only the step's tensor and the row are kept: the step's rows are a tensor of their own,
        never written after this step, and most steps draft for nobody (at 16 sequences
        break-even leaves nearly all without drafts), so gathering and converting every
        sequence's state each step, as this did, was wasted; a draft gathers what it reads
        (remembered_states)."""
        start = 0
        for s, tokens in zip(sampling, new_tokens, strict=True):
            state = spec_state(s.seq)
            state.hidden_at = (hidden, start + (1 + state.path[-1] if state.path
                                                else len(tokens) - 1))
            state.streams = streams
            start += 1 + s.num_draft


def remembered_states(seqs: list[Sequence], streams: bool = False) -> torch.Tensor:
    """The sequences' remembered target states as one float32 tensor ([len(seqs), hidden]), or
    with `streams` their middle layers' streams ([len(seqs), layers * hidden]): one gather
    where they were kept from one step, as they are while the same requests decode."""
    states = [spec_state(seq) for seq in seqs]
    kept = [(s.streams if streams else s.hidden_at[0], s.hidden_at[1]) for s in states]
    step = kept[0][0]
    if all(rows is step for rows, _ in kept):
        return step[torch.tensor([row for _, row in kept], device=step.device)].float()
    return torch.stack([rows[row] for rows, row in kept]).float()


class HiddenDraft(StateProposer):
    """Proposes tokens from each sequence's last target hidden state (see the module doc)."""

    def __init__(self, path: str, target: LlamaModel, target_tokenizer) -> None:
        tensors, ids = load_draft_file(path, target, target_tokenizer, TENSORS, "fc2.weight")
        super().__init__(path, target, ids)
        self.eps = target.config.rms_norm_eps
        self.stream_layers = fuse_layers(path, tensors, target.config)
        self.use_weights(self.prepare(tensors), self.head)

    def use_weights(self, weights: dict, head) -> None:
        """Draft with these prepared weights (prepare's) and head; a level (draft_step, scores,
        top_tokens) runs in one kernel call where the table has one for them
        (kernels/cpu_draft.py), else it is composed from the table's ops."""
        self.weights, self.head = weights, head
        self.fused_level = self.ops.prepare_draft_level(
            weights["fc1.weight"], weights["fc1.bias"], weights["fc2.weight"],
            weights["fc2.bias"], head, self.embed, weights["embed_norm.weight"], self.eps,
            self.vocab_ids.numel())

    def propose(self, requests: list[tuple[Sequence, int]]) -> None:
        """Fill each sequence's draft (up to k tokens) from its remembered hidden state: a
        chain of the draft's best tokens, or with branches a tree grown level by level from the
        most probable paths so far (EAGLE-2's expansion by the draft's confidence)."""
        active = [(seq, k) for seq, k in requests
                  if k > 0 and spec_state(seq).hidden_at is not None]
        if not active:
            return
        branches = [branches_for(seq, self.num_branches) for seq, _ in active]
        s = self.root_states([seq for seq, _ in active])
        tokens = torch.tensor([seq.all_token_ids[-1] for seq, _ in active],
                              device=self.embed.device)
        with torch.inference_mode():
            if max(branches) == 1:
                for (seq, k), chain in zip(active, self._chains(s, tokens,
                                                                max(k for _, k in active)),
                                           strict=True):
                    set_draft_paths(seq, [chain[:k]])
                return
            trees = self._tree_paths(s, tokens, [k for _, k in active], branches)
        for (seq, _), (paths, probs) in zip(active, trees, strict=True):
            set_draft_paths(seq, paths, probs)

    def root_states(self, seqs: list[Sequence]) -> torch.Tensor:
        """The draft's first states for the sequences: their remembered final states, fused
        with their middle layers' streams where the draft reads them (fused_root)."""
        s = remembered_states(seqs)
        if not self.stream_layers:
            return s
        with torch.inference_mode():
            return fused_root(s, remembered_states(seqs, streams=True), self.weights, self.eps,
                              self.linear)

    def level(self, s: torch.Tensor, tokens: torch.Tensor, k: int
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One draft step from states s ([rows, hidden]) and the tokens they continue ([rows]):
        the next states, and each one's k most probable next tokens (probabilities, token ids;
        [rows, k], most probable first). k = 1: the best token alone, argmax's choice (the first
        of tied scores), and the probabilities None where the level is composed from ops."""
        if self.fused_level is not None:
            got = self.fused_level(s, tokens, k)
            if got is not None:
                s, probs, cols = got
                return s, probs, self.vocab_ids[cols]
        s = draft_step(s, self.embed[tokens].float(), self.weights, self.eps, self.linear)
        scores = self.scores(s)
        if k == 1:
            return s, None, self.vocab_ids[argmax_rows(scores)].unsqueeze(1)
        probs, ids = self.top_tokens(scores, k)
        return s, probs, ids

    def _chains(self, s: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[list[int]]:
        """Each row's chain of the draft's best tokens, `depth` long, from the target's states
        s and the tokens they chose."""
        drafts = []
        for _ in range(depth):
            s, _, best = self.level(s, tokens, 1)
            tokens = best[:, 0]
            drafts.append(tokens)
        return torch.stack(drafts, dim=1).tolist()

    def _tree_paths(self, s: torch.Tensor, tokens: torch.Tensor, depths: list[int],
                    branches: list[int]) -> list[tuple[list[list[int]], list[list[float]]]]:
        """Per row of `s` (the target's state of a sequence, `tokens` its newest token), the
        `branches` most probable paths of its depth and each path's probability at every depth:
        each level scores every kept path's next tokens by the draft's probability times the
        path's, keeps the best (keep_best) and steps the draft once for each kept path."""
        # (probability, path, its probability at each depth, row of s)
        beams = [[(1.0, [], [], row)] for row in range(len(depths))]
        s, probs_t, tokens_t = self.level(s, tokens, max(branches))
        for level in range(max(depths)):
            probs, ids = probs_t.tolist(), tokens_t.tolist()
            next_rows: list[int] = []
            for i, beam in enumerate(beams):
                if level >= depths[i]:
                    continue
                n = branches[i]
                kept = keep_best([(p * q, path + [t], cum + [p * q], r) for p, path, cum, r in beam
                                  for q, t in zip(probs[r][:n], ids[r][:n], strict=True)], n)
                beams[i] = [(p, path, cum, len(next_rows) + j)
                            for j, (p, path, cum, _) in enumerate(kept)]
                next_rows += [r for *_, r in kept]
            if level + 1 < max(depths):
                last = torch.tensor([path[-1] for beam in beams for _, path, _, _ in beam
                                     if len(path) == level + 1], device=self.embed.device)
                s, probs_t, tokens_t = self.level(s[next_rows], last, max(branches))
        return [([path for _, path, _, _ in beam], [cum for _, _, cum, _ in beam])
                for beam in beams]


def fuse_layers(path: str, tensors: dict[str, torch.Tensor], config) -> tuple[int, ...]:
    """The target layers a draft file fuses (FUSE_LAYERS), checked against its fuse.weight and
    the target's depth; () for a draft of the final state alone."""
    named = read_metadata(Path(path)).get(FUSE_LAYERS, "")
    fuse = tensors.get("fuse.weight")
    if not named and fuse is None:
        return ()
    try:
        layers = tuple(int(x) for x in named.split(","))
    except ValueError:
        layers = ()
    if (fuse is None or not layers or any(not 0 < n <= config.num_layers for n in layers)
            or tuple(fuse.shape) != (config.hidden_size, len(layers) * config.hidden_size)):
        raise ModelError(f"The draft {path} fuses target layers '{named}' that do not fit this "
                         f"model ({config.num_layers} layers of {config.hidden_size}): use it "
                         "with the model it was trained from, or rebuild it.")
    return layers


def keep_best(candidates: list[tuple], n: int) -> list[tuple]:
    """One level of a draft tree: the n most probable candidates (probability first), less any
    below BRANCH_RATIO of the best one's, so a confident draft stays a chain."""
    ranked = sorted(candidates, key=lambda c: -c[0])[:n]
    return [c for c in ranked if c[0] >= BRANCH_RATIO * ranked[0][0]]
