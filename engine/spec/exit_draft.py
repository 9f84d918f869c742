"""Early-exit drafts: the target's own first layers, plus one trained layer and a small head.

A draft file (safetensors, written by benchmarks/train_draft.py) holds only what the target
lacks: one decoder layer (`model.layers.0.*`), a final norm, an LM head over a reduced
vocabulary and `draft.vocab_ids`, the target token id of each head row. The draft model shares
the target's embedding and first `exit_layers` layers (no copy), so it costs a few layers and a
narrow head per token. Tokens outside the reduced vocabulary are never proposed; verification
stays lossless since every proposal is checked against the target.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from engine.config import ModelError
from engine.model import LlamaModel, _layer, _Taker

FORMAT = "servescope-early-exit-draft"


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id map: a draft trained for it must see the same ids."""
    vocab = sorted(tokenizer.backend.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()


def is_exit_draft(path: str) -> bool:
    """Whether `path` is an early-exit draft file (rather than a model of its own); a
    .safetensors file that is missing or not such a draft is a ModelError naming it."""
    p = Path(path)
    if p.suffix != ".safetensors":
        return False
    if not p.is_file():
        raise ModelError(f"The draft file {path} does not exist: check the path (the demo "
                         "draft is rebuilt by benchmarks/train_draft.py).")
    if read_metadata(p).get("format") != FORMAT:
        raise ModelError(f"{path} is not a servescope early-exit draft: give a draft written "
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


@dataclasses.dataclass
class ExitDraft:
    """A LlamaModel-shaped draft over the target's first layers, and its head's token ids."""

    model: LlamaModel
    vocab_ids: torch.Tensor  # [draft vocab] target token ids, on the device


def load_exit_draft(path: str, target: LlamaModel, target_tokenizer) -> ExitDraft:
    """Build the draft from `path` on top of the loaded target; a mismatch is a ModelError."""
    from safetensors.torch import load_file

    meta = read_metadata(Path(path))
    if meta.get("tokenizer_sha256") != vocab_fingerprint(target_tokenizer):
        raise ModelError(f"The draft {path} was trained for a different tokenizer than the "
                         "target's: use it with the model it was trained from "
                         f"({meta.get('target', 'unknown')}).")
    c = target.config
    exit_layers = int(meta["exit_layers"])
    if int(meta["hidden_size"]) != c.hidden_size or not 0 < exit_layers < c.num_layers:
        raise ModelError(f"The draft {path} does not fit this model (hidden size "
                         f"{meta['hidden_size']} vs {c.hidden_size}, exit after {exit_layers} of "
                         f"{c.num_layers} layers): use it with {meta.get('target', 'its target')}.")
    tensors = {k: v.float() for k, v in load_file(path).items()}
    vocab_ids = tensors.pop("draft.vocab_ids").long()
    if int(vocab_ids.max()) >= c.vocab_size:
        raise ModelError(f"The draft {path} proposes token ids outside the target's vocabulary: "
                         "use it with the model it was trained from.")
    take = _Taker(tensors, target.device, target.dtype)
    model = copy.copy(target)  # shares the embedding, rope tables, ops and first layers
    model.config = dataclasses.replace(c, num_layers=exit_layers + 1,
                                       vocab_size=len(vocab_ids))
    own = _layer(take, c, 0)
    prep = target.ops.prepare_linear
    own.qkv, own.o, own.gate_up, own.down = (prep(own.qkv), prep(own.o), prep(own.gate_up),
                                             prep(own.down))
    model.layers = target.layers[:exit_layers] + [own]
    model.norm = take("model.norm.weight")
    model.lm_head = prep(take("lm_head.weight"))
    model.weight_bytes = sum(t.numel() * t.element_size() for t in take.kept)
    return ExitDraft(model, vocab_ids.to(target.device))
