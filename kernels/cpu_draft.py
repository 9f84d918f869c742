"""A hidden-state draft's level in one C call (cpu_kernels.c's draft_level): the draft's next
states from its states and their newest tokens, and each one's most probable next tokens.

Why: engine/spec/hidden_draft.py composes a level from about twenty torch ops and three matmul
calls (draft_step, scores, top_tokens), and on the 2-core EPYC half of a level's time went to the
calls, not the arithmetic: about 1.2 ms a draft tree of three levels, a tenth of a verify step.
The C function runs the same arithmetic with the same roundings (each matmul's input and output
bfloat16, the rest float32); sums may differ in their order (the norm's mean), so a state can
differ from the composition's in its last bits and, where two tokens' scores tie that closely, a
draft may name the other one. A draft only proposes: the target's verification decides every
output token either way.

Where the draft's matrices and head are int4 (prepare_compact_linear's form where the kernels
run), the embedding and biases bfloat16, and the C kernels run, `prepare` returns the fused
level; elsewhere None, and the draft composes its levels from the table's ops.
"""

from __future__ import annotations

import torch

from kernels import cpu_kernels, cpu_quant


class DraftLevel:
    """draft_level's weights, as one table of pointers (the tensors are kept alive here)."""

    def __init__(self, fc1, fc1_bias: torch.Tensor, fc2, fc2_bias: torch.Tensor, head,
                 embed: torch.Tensor, embed_norm: torch.Tensor, eps: float, vocab: int) -> None:
        self._held = (fc1, fc1_bias, fc2, fc2_bias, head, embed, embed_norm)
        self.hidden, self.width = embed.shape[1], fc1.out_features
        self.head_out, self.vocab, self.group, self.eps = head.out_features, vocab, \
            fc1.group_size, eps
        pointers = [t.data_ptr() for t in (fc1.codes, fc1.scales, fc1.mins, fc1_bias,
                                           fc2.codes, fc2.scales, fc2.mins, fc2_bias,
                                           head.codes, head.scales, head.mins, embed, embed_norm)]
        self._table = torch.tensor(pointers, dtype=torch.int64)

    def __call__(self, s: torch.Tensor, tokens: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(next states [rows, hidden] float32, probabilities [rows, k], head rows [rows, k])
        from states s [rows, hidden] float32 and tokens [rows]; None where the kernel refused
        (k outside 1..64, a NaN score, no memory) or the states are not float32 on the CPU."""
        if s.dtype != torch.float32 or tokens.device.type != "cpu":
            return None
        rows = s.shape[0]
        s = s.contiguous()
        tokens = cpu_kernels.int64_contiguous(tokens)
        s_out = torch.empty(rows, self.hidden, dtype=torch.float32)
        probs = torch.empty(rows, k, dtype=torch.float32)
        cols = torch.empty(rows, k, dtype=torch.int64)
        status = cpu_kernels._library().draft_level(
            self._table.data_ptr(), s.data_ptr(), tokens.data_ptr(), rows, self.hidden,
            self.width, self.head_out, self.vocab, self.group, self.eps, k, s_out.data_ptr(),
            probs.data_ptr(), cols.data_ptr(), torch.get_num_threads())
        return (s_out, probs, cols) if status == 0 else None


def prepare(fc1, fc1_bias, fc2, fc2_bias, head, embed: torch.Tensor, embed_norm: torch.Tensor,
            eps: float, vocab: int) -> DraftLevel | None:
    """The fused level for a hidden-state draft (hidden_draft.py's weights: fc1 takes the state
    and the normed embedding side by side, fc2 gives the state's update, the head the draft
    vocabulary's `vocab` scores), or None where it does not apply: a matrix that is not int4
    in the kernels' layout, unpadded and of one group size, a dtype other than bfloat16 for
    the embedding and biases, or the kernels not running here."""
    matrices = (fc1, fc2, head)
    if not all(isinstance(m, cpu_quant.Int4Linear) and m.padded_in == m.in_features
               for m in matrices):
        return None
    hidden = embed.shape[-1]
    if (len({m.group_size for m in matrices}) != 1 or fc1.in_features != 2 * hidden
            or fc2.in_features != fc1.out_features or fc2.out_features != hidden
            or head.in_features != hidden or not 0 < vocab <= head.out_features):
        return None
    vectors = (fc1_bias, fc2_bias, embed)
    if any(v is None or v.dtype != torch.bfloat16 or v.device.type != "cpu"
           or not v.is_contiguous() for v in vectors):
        return None
    if fc1_bias.numel() != fc1.out_features or fc2_bias.numel() != hidden:
        return None
    if not cpu_quant.available():
        return None
    norm = embed_norm.to(torch.float32).contiguous()
    return DraftLevel(fc1, fc1_bias, fc2, fc2_bias, head, embed, norm, eps, vocab)
