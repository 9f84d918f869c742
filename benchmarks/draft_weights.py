"""A speculative draft as it ships against another form of it, in one process, as JSON.

Three engines on the same model: plain decoding, speculation with the draft as it ships, and the
same speculation with the draft in another form (`--against`):
- `float`: the draft's matrices and head re-prepared as the target's own linears (bfloat16
  through its tile kernel) rather than compact (int4, `ops.prepare_compact_linear`): the draft
  before it became compact;
- `composed`: the hidden-state draft's levels composed from the kernel table's ops (draft_step,
  scores, top_tokens: about twenty torch ops and three matmul calls each) rather than one call
  of the table's fused level (kernels/cpu_draft.py): the draft before the fused level;
- `shared`: prompt lookup in front of the draft (`--spec demo-draft`) priced from one acceptance
  estimate for both sources rather than each source's own (`Proposer.source`): the pricing
  before the sources were kept apart;
- `spec`: another speculation setting altogether (`--against-spec`, e.g. another draft file:
  `draft:OLD.safetensors,k=3,lookup=0,branches=4`), for a draft retrained.
Each round runs the workload on all three in turn, each round starting one engine later, so the
machine's load falls on them alike (it moved single runs of this VM by 10-30% between
processes); the speed-ups over plain decoding and the shipped draft's over the other form are
per round, and their medians are reported. Outputs are checked equal to plain decoding: a draft
can only propose differently.
Run: python benchmarks/draft_weights.py [--spec demo-draft:lookup=0,branches=4]
     [--against float|composed|shared | --against-spec SPEC]
     [--workload open_chat|copy_heavy|concurrent_16]
     [--rounds 5]
     [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a script, this folder comes first on sys.path and this file's neighbours could shadow
# the project's packages.
sys.path = [p for p in sys.path if Path(p).resolve() != HERE]


from engine import LLM  # noqa: E402
from engine.bench import machine  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402


def _speculative():
    """benchmarks/speculative.py (its workloads and runners), loaded by path."""
    spec = importlib.util.spec_from_file_location("speculative_bench", HERE / "speculative.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_float_draft(llm: LLM, draft_file: str) -> None:
    """Re-prepare `llm`'s draft's head and matrices (StateProposer's own preparation) as the
    target's own linears (prepare_linear), as they were before they became compact."""
    from safetensors.torch import load_file

    draft = llm.spec.draft
    tensors = load_file(draft_file)
    tensors.pop("draft.vocab_ids")
    head = draft.ops.prepare_linear(draft.head_rows())
    weights = draft.prepare(tensors, draft.ops.prepare_linear)
    if hasattr(draft, "use_weights"):  # the hidden-state draft: its fused level goes with them
        draft.use_weights(weights, head)
    else:
        draft.head, draft.weights = head, weights


def as_composed_levels(llm: LLM, draft_file: str) -> None:
    """Let `llm`'s hidden-state draft compose its levels from the table's ops (no fused level)."""
    draft = llm.spec.draft
    if getattr(draft, "fused_level", None) is None:
        raise SystemExit(f"{llm.spec.config.draft_model} has no fused level here (not the "
                         "hidden-state draft, or the kernel table has none for it): nothing to "
                         "compare.")
    draft.fused_level = None


def as_shared_estimate(llm: LLM, draft_file: str) -> None:
    """Let `llm`'s prompt lookup and the draft behind it (LookupFirst) count as one source: one
    acceptance estimate, prior and depth cap for both, as before Proposer.source."""
    from engine.spec.decoder import LookupFirst, spec_state

    proposer = llm.spec.proposer
    if not isinstance(proposer, LookupFirst):
        raise SystemExit(f"{llm.spec.config.draft_model} drafts without prompt lookup in front "
                         "(use --spec demo-draft): one source already.")
    propose = proposer.propose

    def propose_as_one(requests):
        propose(requests)
        for seq, _ in requests:
            spec_state(seq).source = 0

    proposer.source, proposer.source_depth = (lambda seq: 0), (lambda source: None)
    proposer.propose = propose_as_one


AGAINST = {"float": as_float_draft, "composed": as_composed_levels, "shared": as_shared_estimate,
           "spec": None}


def _accepted_length(before: dict, after: dict) -> float | None:
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    return 1 + accepted / drafts if drafts else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spec", default="demo-draft:lookup=0,branches=4",
                   help="a speculation setting with the demo model's hidden-state draft")
    p.add_argument("--against", choices=tuple(AGAINST), default="float",
                   help="the other form: float (the draft's matrices as the target's) or "
                        "composed (the levels from the table's ops, not its fused level) or "
                        "shared (one acceptance estimate for lookup and the draft); spec "
                        "(set by --against-spec)")
    p.add_argument("--against-spec", help="the other engine's speculation setting (another "
                   "draft file, say), in place of a form of --spec's draft")
    p.add_argument("--workload", choices=("open_chat", "copy_heavy", "concurrent_16"),
                   default="open_chat")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    bench = _speculative()
    model = str(fetch_demo_model(progress=lambda m, f: None))
    plain = LLM(model, device="cpu", dtype="bfloat16")
    shipped = LLM(model, device="cpu", dtype="bfloat16", speculative=args.spec)
    if args.against_spec:
        args.against = "spec"
    elif args.against == "spec":
        raise SystemExit("--against spec needs --against-spec SPEC.")
    other = LLM(model, device="cpu", dtype="bfloat16",
                speculative=args.against_spec or args.spec)
    if AGAINST[args.against] is not None:
        AGAINST[args.against](other, other.spec.config.draft_model)
    if args.workload in ("open_chat", "copy_heavy"):
        prompts = bench.OPEN_CHAT if args.workload == "open_chat" else bench.COPY_HEAVY
        run = bench.run_workload
    else:
        prompts, run = (bench.OPEN_CHAT * bench.CONCURRENT)[:bench.CONCURRENT], bench.run_batch
    for llm in (plain, shipped, other):  # the step costs speculation prices drafts by
        for warm in (bench.COPY_HEAVY, bench.OPEN_CHAT, bench.UNPREDICTABLE):
            bench.run_workload(llm, warm, args.max_tokens)
    sides = {"shipped": shipped, args.against: other}
    counted = {name: bench._counters(llm) for name, llm in sides.items()}
    ratios = ("shipped_speedup", f"{args.against}_speedup", f"shipped_over_{args.against}")
    rounds = []
    engines = [plain, shipped, other]
    for i in range(args.rounds):
        # Each round starts one engine later, so none always runs first or after the same one.
        order = engines[i % 3:] + engines[: i % 3]
        ran = {id(llm): run(llm, prompts, args.max_tokens) for llm in order}
        base, fast, slow = (ran[id(llm)] for llm in engines)
        rounds.append({
            "plain_tokens_per_s": base["tokens_per_s"],
            ratios[0]: fast["tokens_per_s"] / base["tokens_per_s"],
            ratios[1]: slow["tokens_per_s"] / base["tokens_per_s"],
            ratios[2]: fast["tokens_per_s"] / slow["tokens_per_s"],
            "outputs_identical": fast["outputs"] == base["outputs"] == slow["outputs"]})
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in rounds[-1].items()}), file=sys.stderr)
    draft = shipped.spec.draft
    result = {
        "benchmark": "draft_weights", "spec": args.spec, "against": args.against,
        "against_spec": args.against_spec,
        "workload": args.workload, "machine": machine(),
        "shipped_form": {"head": type(draft.head).__name__,
                         "fused_level": getattr(draft, "fused_level", None) is not None},
        "head_bytes": {"shipped": getattr(draft.head, "nbytes", None),
                       args.against: getattr(other.spec.draft.head, "nbytes", None)},
        "rounds": rounds,
        # Accepted drafts per verification plus the bonus token, over all rounds: each form
        # proposes from its own arithmetic, so its acceptance is measured, not assumed.
        "mean_accepted_length": {name: _accepted_length(counted[name], bench._counters(llm))
                                 for name, llm in sides.items()},
        **{f"median_{k}": statistics.median(r[k] for r in rounds) for k in ratios},
        "outputs_identical": all(r["outputs_identical"] for r in rounds),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
