"""Long contexts: decode context parallelism (KV striped over TP ranks) under vLLM 0.32's rules,
in the memory and step-time models, the search and the commands."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from planner.calibrate import Calibration
from planner.catalog import load_catalog
from planner.export import NotServable, sglang_command, vllm_command
from planner.memory import kv_bytes_per_token_per_gpu, plan_memory
from planner.search import SearchSpace, cp_reason, search
from planner.timing import Deployment, StepCost, dcp_problem
from planner.workload import Slo, Workload


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_dcp_follows_vllms_rules(catalog):
    """vLLM refuses DCP for GQA unless TP exceeds the KV heads (it stripes copies only), caps it
    at TP / KV heads, and needs it to divide TP; MLA copies its latent on every rank."""
    llama, ds = catalog.model("Llama-3.1-70B"), catalog.model("DeepSeek-V3")
    assert "above its 8 KV heads" in dcp_problem(llama, 8, 2)
    assert dcp_problem(ds, 8, 8) == "" and dcp_problem(ds, 4, 2) == ""
    assert "must divide" in dcp_problem(ds, 8, 3)
    with pytest.raises(ValueError, match="KV heads"):
        Deployment(llama, catalog.gpu("H100 SXM"), tp=8, dcp=2)


def test_dcp_stripes_the_per_gpu_kv_cache(catalog):
    """DeepSeek-V3's MLA latent, 61 layers x (512 + 64) x 2 bytes a token, is whole on every TP
    rank; DCP 8 leaves an eighth of it on each."""
    ds = catalog.model("DeepSeek-V3")
    assert kv_bytes_per_token_per_gpu(ds, "bf16", 8, 1) == 61 * 576 * 2
    assert kv_bytes_per_token_per_gpu(ds, "bf16", 8, 1, dcp=8) == 61 * 576 * 2 / 8
    h200 = catalog.gpu("H200")
    one = plan_memory(ds, h200, "fp8", "bf16", tp=8, context=131072)
    eight = plan_memory(ds, h200, "fp8", "bf16", tp=8, context=131072, dcp=8)
    assert eight.kv_gb == one.kv_gb  # the same memory ...
    assert eight.kv_tokens == pytest.approx(8 * one.kv_tokens, rel=1e-6)  # ... 8x the tokens
    assert eight.max_sequences >= 8 * one.max_sequences


def test_dcp_speeds_long_decode_and_costs_a_little_on_short(catalog):
    """Each rank reads its stripe of the cache: at a 128K context the decode step is faster;
    at 100 tokens the query/output exchange (an all-gather and a reduce-scatter a layer) makes
    it slower, by no more than that exchange costs."""
    ds, h200 = catalog.model("DeepSeek-V3"), catalog.gpu("H200")
    plain = StepCost(Deployment(ds, h200, "fp8", "bf16", tp=8))
    striped = StepCost(Deployment(ds, h200, "fp8", "bf16", tp=8, dcp=8))
    assert striped.decode_seconds(16, 131072) < 0.8 * plain.decode_seconds(16, 131072)
    short_plain, short_striped = plain.decode_seconds(16, 100), striped.decode_seconds(16, 100)
    exchange = striped.dcp_fixed + 16 * striped.dcp_per_token
    assert short_plain < short_striped <= short_plain + exchange


def test_long_context_search_finds_a_cheaper_plan_with_dcp(catalog):
    """128K-token documents asked about again and again (95% of each prompt cached): the KV
    cache, not compute, bounds a replica, and striping it over the TP ranks halves the GPUs."""
    w = Workload(131072, 1024, rate=0.5, slo=Slo(ttft_p99_ms=20000, tpot_p99_ms=100),
                 num_requests=200)
    space = SearchSpace(gpus=("H200",), weights=("fp8",), kv=("fp8",), tp=(8,), pp=(1,),
                        spec=(None,), max_seqs=(16, 64), prefix_hit=0.95)
    model = catalog.model("DeepSeek-V3")
    with_dcp = search(model, w, catalog, space)
    without = search(model, w, catalog, replace(space, dcp=(1,)))
    best, base = with_dcp.candidates[0], without.candidates[0]
    assert best.deployment.dcp > 1 and base.deployment.dcp == 1
    assert best.cost_per_hour < base.cost_per_hour
    assert best.ttft_p99_ms <= 20000 and best.tpot_p99_ms <= 100
    assert best.as_dict()["dcp"] == best.deployment.dcp
    argv = shlex.split(vllm_command(best))
    assert argv[argv.index("--decode-context-parallel-size") + 1] == str(best.deployment.dcp)
    assert "--dcp-size" in sglang_command(best)
    # Started at the workload's context, not the model's 163,840 tokens, which its KV cache
    # (sized for the workload) could not hold: vLLM would refuse to start.
    assert argv[argv.index("--max-model-len") + 1] == str(131072 + 1024)


def test_sglang_refuses_dcp_for_a_gqa_model_by_name(catalog):
    """SGLang stripes MLA caches only; a GQA plan with DCP names the model and where it runs."""
    llama = catalog.model("Llama-3.1-70B")
    wide = replace(llama, name="wide-gqa", kv_heads=4)  # TP 8 > 4 KV heads: DCP 2 is valid
    d = Deployment(wide, catalog.gpu("H100 SXM"), tp=8, dcp=2)

    class _Plan:
        deployment = d

    with pytest.raises(NotServable, match="covers MLA models only; wide-gqa"):
        sglang_command(_Plan())


def test_a_workload_longer_than_the_models_context_is_refused(catalog):
    w = Workload(131072, 1024, rate=0.1, slo=Slo(60000, 100), num_requests=50)
    with pytest.raises(ValueError, match="131072-token context"):
        search(catalog.model("Llama-3.1-70B"), w, catalog, SearchSpace(gpus=("H100 SXM",)))


# Prefill context parallelism: copies of a TP group on other nodes, each taking a share of
# every prompt (SGLang's --attn-cp-size with --enable-prefill-cp, vLLM's -pcp for MLA).

LONG_PROMPT = 126976  # a 124K-token document, leaving room for 1024 generated tokens at 128K


def test_cp_splits_a_long_prompt_and_leaves_decode_alone(catalog):
    """Two CP ranks each compute half of a 124K prompt: its prefill on TP8·CP2 takes more than
    half of TP8's (the keys and values go round the network, and each step keeps its fixed
    cost) and well under it; a decode step is the same, as each rank keeps the whole cache; the
    replica has twice the GPUs, each holding what a TP8 GPU holds."""
    llama, h100 = catalog.model("Llama-3.1-70B"), catalog.gpu("H100 SXM")
    one = Deployment(llama, h100, "fp8", "fp8", tp=8)
    two = replace(one, cp=2)
    a, b = StepCost(one), StepCost(two)
    pa, pb = a.prefill_seconds(LONG_PROMPT), b.prefill_seconds(LONG_PROMPT)
    assert pa / 2 + LONG_PROMPT * b.cp_per_token < pb < 0.6 * pa
    assert b.decode_seconds(16, LONG_PROMPT) == a.decode_seconds(16, LONG_PROMPT)
    assert (two.gpus, two.group_gpus, two.layout) == (16, 8, "TP8·CP2")
    assert b.dense_bytes == a.dense_bytes
    # A slower network between the nodes costs more, and only the prompt's share of it.
    slow = replace(two, gpu=replace(h100, network_gbs=5.0))
    assert StepCost(slow).prefill_seconds(LONG_PROMPT) > pb
    assert StepCost(slow).decode_seconds(16, LONG_PROMPT) == a.decode_seconds(16, LONG_PROMPT)


def test_cp_needs_a_network_between_nodes_and_is_planned_apart_from_dcp(catalog):
    """Ranks that fit in one node exchange over its GPU link; beyond it, over the network the
    catalog gives the GPU, and a card with none cannot span nodes."""
    llama, ds = catalog.model("Llama-3.1-70B"), catalog.model("DeepSeek-V3")
    with pytest.raises(ValueError, match="16 GPUs spans nodes, and the catalog has no network "
                                         "between L40S nodes"):
        Deployment(llama, catalog.gpu("L40S"), "fp8", "fp8", tp=8, cp=2)
    inside = Deployment(llama, catalog.gpu("L40S"), "fp8", "fp8", tp=4, cp=2)
    assert inside.nodes == 1 and StepCost(inside).cp_per_token > 0
    h100 = catalog.gpu("H100 SXM")
    in_node = StepCost(Deployment(llama, h100, "fp8", "fp8", tp=4, cp=2))
    over_nodes = StepCost(Deployment(llama, h100, "fp8", "fp8", tp=4, cp=4))
    # NVLink (450 GB/s) against a 50 GB/s NIC, for (N-1)/N of the same bytes a token.
    assert over_nodes.cp_per_token > 5 * in_node.cp_per_token
    with pytest.raises(ValueError, match="not both"):
        Deployment(ds, catalog.gpu("H200"), "fp8", "fp8", tp=8, dcp=2, cp=2)
    with pytest.raises(ValueError, match="cp must be at least 1"):
        Deployment(llama, catalog.gpu("H100 SXM"), tp=8, cp=0)


def test_a_ttft_only_cp_can_meet_gets_a_cp_plan_both_servers_run(catalog):
    """DeepSeek-V3 answering over 124K-token documents with TTFT p99 <= 10 s: one H200 node
    prefills such a prompt in about 12 s, so the search without CP finds nothing and says how
    close it came; with CP it plans TP8·CP2 or wider across nodes, says why, and both servers
    get its command (each node's rank left to its shell)."""
    w = Workload(LONG_PROMPT, 1024, rate=0.05, slo=Slo(ttft_p99_ms=10000, tpot_p99_ms=100),
                 num_requests=100)
    space = SearchSpace(gpus=("H200",), weights=("fp8",), kv=("fp8",), tp=(8,), pp=(1,),
                        spec=(None,), max_seqs=(16,))
    ds = catalog.model("DeepSeek-V3")
    without = search(ds, w, catalog, replace(space, cp=(1,)))
    assert not without.candidates
    assert "lowest TTFT any option reaches is 11" in without.infeasible
    result = search(ds, w, catalog, space)
    best = result.candidates[0]
    d = best.deployment
    assert d.cp > 1 and best.ttft_p99_ms <= 10000 and best.tpot_p99_ms <= 100
    assert best.as_dict()["layout"] == f"TP8·CP{d.cp}" and best.as_dict()["cp"] == d.cp
    assert result.why_layout.startswith("context parallelism: one TP8 group prefills a "
                                        "126976-token prompt in 11.")
    # With half of each prompt in the prefix cache, the reason names what is prefilled.
    cached = replace(best, deployment=replace(d, prefix_hit=0.5))
    assert ("prefills the 63488 uncached tokens of a 126976-token prompt in "
            in cp_reason(cached, w, Calibration()))
    argv = shlex.split(sglang_command(best))
    assert argv[argv.index("--tp-size") + 1] == str(8 * d.cp)
    assert argv[argv.index("--attn-cp-size") + 1] == str(d.cp)
    assert argv[argv.index("--cp-strategy") + 1] == "zigzag" and "--enable-prefill-cp" in argv
    assert argv[argv.index("--nnodes") + 1] == str(d.cp)
    assert argv[argv.index("--node-rank") + 1] == "$NODE_RANK"
    argv = shlex.split(vllm_command(best))
    assert argv[argv.index("--prefill-context-parallel-size") + 1] == str(d.cp)


def test_cp_is_not_offered_where_no_server_runs_it(catalog):
    """Llama-3.1-70B's GQA attention: vLLM 0.32 runs PCP on MLA only, and SGLang 0.5.23 splits
    Llama's heads over its whole TP world, so neither runs the layout the model would time.
    The search offers no CP plan, says which candidates it left out and why, and the exports
    refuse one built by hand."""
    w = Workload(LONG_PROMPT, 1024, rate=0.05, slo=Slo(ttft_p99_ms=8000, tpot_p99_ms=100),
                 num_requests=100)
    space = SearchSpace(gpus=("H100 SXM",), weights=("fp8",), kv=("fp8",), tp=(8,), pp=(1,),
                        spec=(None,), max_seqs=(16,))
    llama = catalog.model("Llama-3.1-70B")
    result = search(llama, w, catalog, space)
    assert not result.candidates and "lowest TTFT any option reaches is 10" in result.infeasible
    assert any("prefill context parallelism for Llama-3.1-70B runs in neither vLLM 0.32" in note
               for note in result.notes)

    class _Plan:
        deployment = Deployment(llama, catalog.gpu("H100 SXM"), "fp8", "fp8", tp=8, cp=2)

    with pytest.raises(NotServable, match="MLA attention only, not Llama-3.1-70B's"):
        vllm_command(_Plan())
    with pytest.raises(NotServable, match="nor SGLang 0.5.23"):
        sglang_command(_Plan())


def test_vllm_runs_cp_for_an_mla_model(catalog):
    d = Deployment(catalog.model("DeepSeek-V3"), catalog.gpu("H200"), "fp8", "fp8", tp=8, cp=2)

    class _Plan:
        deployment = d

    argv = shlex.split(vllm_command(_Plan()))
    assert argv[argv.index("--prefill-context-parallel-size") + 1] == "2"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"


def test_short_prompts_are_never_planned_with_cp(catalog):
    """Below CP_MIN_PROMPT tokens the search does not try CP: the same candidates as with
    CP switched off."""
    w = Workload(2048, 256, rate=2, slo=Slo(ttft_p99_ms=2000, tpot_p99_ms=50), num_requests=100)
    space = SearchSpace(gpus=("H100 SXM",), weights=("fp8",), kv=("fp8",), spec=(None,),
                        max_seqs=(64,))
    llama = catalog.model("Llama-3.1-70B")
    with_cp, without = search(llama, w, catalog, space), search(llama, w, catalog,
                                                                 replace(space, cp=(1,)))
    assert with_cp.evaluated == without.evaluated
    assert all(p.deployment.cp == 1 for p in with_cp.candidates)
