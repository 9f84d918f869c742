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
from engine.sequence import Sequence
from engine.spec.decoder import Proposer, branches_for, set_draft_paths, spec_state

FORMAT = "servescope-hidden-draft"
# A first token the draft finds at least this fraction as likely as its best one gets a branch
# of its own (with branches > 1). Not tuned yet: trees are built for correctness first.
BRANCH_RATIO = 0.1
TENSORS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "embed_norm.weight",
           "draft.vocab_ids")


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id map: a draft trained for it must see the same ids."""
    vocab = sorted(tokenizer.backend.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()


def is_hidden_draft(path: str) -> bool:
    """Whether `path` is a hidden-state draft file (rather than a model of its own); a
    .safetensors file that is missing or not such a draft is a ModelError naming it."""
    p = Path(path)
    if p.suffix != ".safetensors":
        return False
    if not p.is_file():
        raise ModelError(f"The draft file {path} does not exist: check the path (the demo "
                         "draft is rebuilt by benchmarks/train_draft.py).")
    if read_metadata(p).get("format") != FORMAT:
        raise ModelError(f"{path} is not a servescope hidden-state draft: give a draft written "
                         "by benchmarks/train_draft.py, a GGUF file or a Hugging Face folder.")
    return True


def read_metadata(path: Path) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except SafetensorError as exc:
        raise ModelError(f"The draft file {path} is not a readable safetensors file ({exc}): "
                         "it is truncated or corrupt; rebuild or copy it again.") from exc


def draft_step(s: torch.Tensor, token_embeddings: torch.Tensor, w: dict[str, torch.Tensor],
               eps: float) -> torch.Tensor:
    """f(s, x): the predicted next hidden state ([B, hidden]) from states and token embeddings.

    The training script runs this same function, so training and serving cannot drift apart.
    """
    e = token_embeddings * torch.rsqrt(token_embeddings.pow(2).mean(-1, keepdim=True) + eps)
    x = torch.cat([s, e * w["embed_norm.weight"]], dim=-1)
    return s + F.linear(F.silu(F.linear(x, w["fc1.weight"], w["fc1.bias"])), w["fc2.weight"],
                        w["fc2.bias"])


class HiddenDraft(Proposer):
    """Proposes tokens from each sequence's last target hidden state (see the module doc)."""

    def __init__(self, path: str, target: LlamaModel, target_tokenizer) -> None:
        from safetensors.torch import load_file

        meta = read_metadata(Path(path))
        if meta.get("tokenizer_sha256") != vocab_fingerprint(target_tokenizer):
            raise ModelError(f"The draft {path} was trained for a different tokenizer than the "
                             "target's: use it with the model it was trained from "
                             f"({meta.get('target', 'unknown')}).")
        c = target.config
        tensors = load_file(path)
        missing = [n for n in TENSORS if n not in tensors]
        if missing:
            raise ModelError(f"The draft {path} has no tensor '{missing[0]}': it is incomplete; "
                             "rebuild it with benchmarks/train_draft.py.")
        if tensors["fc2.weight"].shape[0] != c.hidden_size:
            raise ModelError(f"The draft {path} does not fit this model (hidden size "
                             f"{tensors['fc2.weight'].shape[0]} vs {c.hidden_size}): use it "
                             f"with {meta.get('target', 'its target')}.")
        ids = tensors.pop("draft.vocab_ids").long()
        if int(ids.max()) >= c.vocab_size:
            raise ModelError(f"The draft {path} proposes token ids outside the target's "
                             "vocabulary: use it with the model it was trained from.")
        self.name = Path(path).stem
        self.eps = c.rms_norm_eps
        self.embed = target.embed
        self.weights = {k: v.to(target.device, torch.float32) for k, v in tensors.items()}
        self.vocab_ids = ids.to(target.device)
        self.head = target.embed[self.vocab_ids].float()  # the tied LM head's kept rows

    def propose(self, requests: list[tuple[Sequence, int]]) -> None:
        """Fill each sequence's draft (up to k tokens) from its remembered hidden state; with
        branches, a tree whose first tokens are the draft's most likely ones (see
        _first_tokens), each continued as a chain."""
        active = [(seq, k) for seq, k in requests
                  if k > 0 and spec_state(seq).hidden is not None]
        if not active:
            return
        s = torch.stack([spec_state(seq).hidden for seq, _ in active])
        tokens = torch.tensor([seq.all_token_ids[-1] for seq, _ in active],
                              device=self.head.device)
        with torch.inference_mode():
            s = draft_step(s, self.embed[tokens].float(), self.weights, self.eps)
            firsts = self._first_tokens(s @ self.head.T, [seq for seq, _ in active])
            # One row per branch from here on: its sequence's state, its own first token.
            owner = [i for i, f in enumerate(firsts) for _ in f]
            s = s[owner]
            tokens = self.vocab_ids[torch.tensor([t for f in firsts for t in f],
                                                 device=self.head.device)]
            drafts = [tokens]
            for _ in range(max(k for _, k in active) - 1):
                s = draft_step(s, self.embed[tokens].float(), self.weights, self.eps)
                tokens = self.vocab_ids[(s @ self.head.T).argmax(-1)]
                drafts.append(tokens)
        table = torch.stack(drafts, dim=1).tolist()
        paths: list[list[list[int]]] = [[] for _ in active]
        for i, row in zip(owner, table, strict=True):
            paths[i].append(row[: active[i][1]])
        for (seq, _), seq_paths in zip(active, paths, strict=True):
            set_draft_paths(seq, seq_paths)

    def _first_tokens(self, scores: torch.Tensor, seqs: list[Sequence]) -> list[list[int]]:
        """Per sequence, the head indices of its draft's first tokens: the most likely one and,
        with branches (EAGLE-2's expansion by the draft's confidence), the next most likely
        ones the draft gives at least BRANCH_RATIO of the first's probability."""
        best = scores.argmax(-1).tolist()
        branches = [branches_for(seq, self.num_branches) for seq in seqs]
        if max(branches) == 1:
            return [[b] for b in best]
        probs, order = torch.softmax(scores, dim=-1).topk(max(branches), dim=-1)
        out = []
        for b, n, p, o in zip(best, branches, probs.tolist(), order.tolist(), strict=True):
            kept = [t for t, pt in zip(o[1:n], p[1:n], strict=True) if pt >= BRANCH_RATIO * p[0]]
            out.append([b] + kept)
        return out

    def remember(self, sampling: list, new_tokens: list[list[int]],
                 hidden: torch.Tensor) -> None:
        """Keep, per sampling sequence (ScheduledSeq), the target's hidden state at the row that
        chose its newest token: the step's rows are 1 + num_draft per sequence, in order."""
        start = 0
        for s, tokens in zip(sampling, new_tokens, strict=True):
            # A tree's accepted rows were laid out as a chain's already (SpecDecoder._keep_path).
            spec_state(s.seq).hidden = hidden[start + len(tokens) - 1].float()
            start += 1 + s.num_draft
