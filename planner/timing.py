"""Per-iteration time model: a roofline over compute and memory, plus TP and PP communication."""

from __future__ import annotations

from dataclasses import dataclass

from planner.catalog import Gpu, Model
from planner.memory import BYTES_PER_PARAM, kv_bytes_per_token_per_gpu

MAX_TP = 8  # one NVLink / PCIe node; TP across nodes is not worth modelling for inference
DEFAULT_OVERHEAD_MS = 0.3  # a GPU engine's per-step host cost where none was measured


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak; calibration replaces them with fitted values.

    memory 0.8 is aiconfigurator's mem_bw_empirical_scaling_factor. flops 0.5 is the low end of
    the 0.5-0.7 range the research note (planner.md section 6) starts from: the FLOP count covers
    the GEMMs and attention only, not the norms, RoPE, activation and quantize kernels between
    them, and FP8 GEMMs reach a smaller share of their doubled peak than 16-bit ones do."""

    flops: float = 0.5
    memory: float = 0.8
    link: float = 0.7
    # A step's fixed cost; None: the device's own, measured (Gpu.step_overhead_ms, this machine
    # after `servescope plan machine`), else DEFAULT_OVERHEAD_MS plus kernel_floor_us a layer.
    # Calibration may fit it.
    overhead_ms: float | None = None
    # Two costs of GPU kernels that a roofline of peaks leaves out, used for devices whose step
    # costs were not measured (a measured step holds them already):
    # - kernel_floor_us: a layer's kernels (norms, QKV, RoPE, attention, output, MLP, and the
    #   all-reduces) each take a few microseconds however little work they get, about 50 us a
    #   layer in all: what decode at small batch spends beyond reading the weights.
    # - ridge_blend: near the ridge point a GEMM reaches neither peak, so its time is the longer
    #   of its compute and memory times plus this share of the shorter (0: the plain roofline).
    # Both defaults are the best grid point over the published latency points; planner_validation
    # reports them held out by source (each source predicted with the values fitted on the
    # others).
    kernel_floor_us: float = 50.0
    ridge_blend: float = 0.5
    # What serving adds per sequence per step beyond an engine's timed step (streaming each
    # token, detokenizing, the API process sharing the cores): 0 until a calibration run at
    # more than one sequence measures it; a batch-1 run cannot tell it from the step's own cost.
    serving_ms_per_seq: float = 0.0

    def __post_init__(self) -> None:
        for name in ("flops", "memory", "link"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value}")
        if self.overhead_ms is not None and self.overhead_ms < 0:
            raise ValueError("overhead_ms must be non-negative")
        if self.kernel_floor_us < 0 or not 0.0 <= self.ridge_blend <= 1.0:
            raise ValueError("kernel_floor_us must be non-negative and ridge_blend in [0, 1]")
        if self.serving_ms_per_seq < 0:
            raise ValueError("serving_ms_per_seq must be non-negative")


@dataclass(frozen=True)
class SpecDecode:
    """Speculative decoding: a draft proposes `draft_len` tokens, each accepted with `acceptance`;
    `draft_cost` is one draft step's time as a fraction of reading the target's weights.

    `accepted_at`, where set, is measured acceptance by draft position (vLLM's definition: how
    often position i was accepted, per draft; the monitor stores it from a server's counters),
    and then the expected tokens a step are 1 plus their sum; `acceptance` is the per-token
    rate that gives the same (from_measured); `measured_on` says where it was measured."""

    draft_len: int = 4
    acceptance: float = 0.7
    draft_cost: float = 0.05
    method: str = "eagle"
    draft: str = ""  # the draft model's id where the method needs one (planner.checkpoints)
    accepted_at: tuple[float, ...] = ()
    measured_on: str = ""

    def __post_init__(self) -> None:
        if self.draft_len < 1:
            raise ValueError("draft_len must be at least 1")
        if not 0.0 <= self.acceptance < 1.0:
            raise ValueError("acceptance must be in [0, 1)")
        if self.draft_cost < 0:
            raise ValueError("draft_cost must be non-negative")
        if self.accepted_at:
            if len(self.accepted_at) != self.draft_len:
                raise ValueError("accepted_at needs one rate per draft position")
            if not all(0.0 <= a <= 1.0 for a in self.accepted_at):
                raise ValueError("each measured acceptance must be in [0, 1]")

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens per verify step: 1 plus the measured acceptance at each position, or
        with one rate a token (Leviathan et al.) (1 - a^(g+1)) / (1 - a)."""
        if self.accepted_at:
            return 1.0 + sum(self.accepted_at)
        a, g = self.acceptance, self.draft_len
        return (1.0 - a ** (g + 1)) / (1.0 - a)

    @classmethod
    def from_measured(cls, accepted_at: list[float] | tuple[float, ...], measured_on: str,
                      **fields) -> SpecDecode:
        """Speculation as measured: a draft as long as the positions measured, the per-token
        rate that gives the same expected tokens a step (found by bisection: the Leviathan
        form rises with it), and those rates kept for the step model."""
        rates = tuple(float(a) for a in accepted_at)
        if not rates:
            raise ValueError("no measured acceptance: the source drafted nothing")
        target, g = 1.0 + sum(rates), len(rates)
        lo, hi = 0.0, 0.999
        for _ in range(60):
            mid = (lo + hi) / 2.0
            if (1.0 - mid ** (g + 1)) / (1.0 - mid) < target:
                lo = mid
            else:
                hi = mid
        return cls(draft_len=g, acceptance=round(lo, 4), accepted_at=rates,
                   measured_on=measured_on, **fields)


def dcp_problem(model: Model, tp: int, dcp: int) -> str:
    """Why vLLM would refuse decode context parallelism of `dcp` at TP `tp`, or "" (its rules,
    vllm/config/parallel.py and ModelConfig.verify_with_parallel_config, 0.32): DCP reuses
    the TP ranks, so TP must divide by it; for GQA/MQA it only stripes copies of KV heads, so TP
    must exceed the KV heads, DCP be at most TP / KV heads and divide the query heads per KV
    head. MLA's latent is copied on every rank, so any divisor of TP will do."""
    if dcp < 1:
        return f"dcp must be at least 1, got {dcp}"
    if dcp == 1:
        return ""
    if tp % dcp:
        return f"decode context parallel size {dcp} must divide the tensor parallel size {tp}"
    if model.is_mla:
        return ""
    if tp <= model.kv_heads:
        return (f"decode context parallelism for {model.name} needs a tensor parallel size above "
                f"its {model.kv_heads} KV heads (TP {tp}); raise TP or set dcp to 1")
    if dcp > tp // model.kv_heads:
        return (f"decode context parallel size {dcp} exceeds TP {tp} / {model.kv_heads} KV "
                f"heads for {model.name}; use at most {tp // model.kv_heads}")
    if (model.heads // model.kv_heads) % dcp:
        return (f"decode context parallel size {dcp} must divide {model.name}'s "
                f"{model.heads // model.kv_heads} query heads per KV head")
    return ""


def cp_problem(gpu: Gpu, group_gpus: int, cp: int, dcp: int) -> str:
    """Why the planner cannot plan prefill context parallelism of `cp` ranks, each a TP x PP
    group of `group_gpus`, or "". Ranks share a node while they fit in one (MAX_TP GPUs);
    beyond it they need the GPU's scale-out network. Combined with DCP the engines' rules
    differ (vLLM lets DCP span the PCP axis, SGLang keeps them apart), so the planner plans one
    or the other."""
    if cp < 1:
        return f"cp must be at least 1, got {cp}"
    if cp == 1:
        return ""
    if gpu.interconnect == "none":
        return f"{gpu.name} has no peers to split a prompt with; set cp to 1"
    if group_gpus * cp > MAX_TP and gpu.network_gbs <= 0:
        return (f"prefill context parallelism over {group_gpus * cp} GPUs spans nodes, and the "
                f"catalog has no network between {gpu.name} nodes (network_gbs); use fewer "
                f"ranks or set cp to 1")
    if dcp > 1:
        return f"plan prefill context parallelism (cp {cp}) or decode's (dcp {dcp}), not both"
    return ""


@dataclass(frozen=True)
class Deployment:
    """One replica's layout: model on GPUs at a precision, parallelism and batch limits."""

    model: Model
    gpu: Gpu
    weights: str = "bf16"
    kv: str = "bf16"
    tp: int = 1
    pp: int = 1
    max_seqs: int = 256
    max_batched_tokens: int = 2048
    spec: SpecDecode | None = None
    prefix_hit: float = 0.0
    dcp: int = 1  # decode context parallel: ranks of the TP group striping each KV cache
    # Prefill context parallel: copies of the TP x PP group that split every prompt's tokens
    # between them, on one node while they fit (each keeps the whole KV cache; decode is not
    # split).
    cp: int = 1
    # The engine that serves it, where the device has that engine's own step costs measured
    # (Gpu.engines: this machine after `servescope plan machine`); "" or an engine the device
    # has none for: the device's figures.
    engine: str = ""

    @property
    def engine_costs(self) -> dict[str, float] | None:
        """The serving engine's own step costs measured on this device, or None."""
        return self.gpu.engines.get(self.engine) if self.engine else None

    @property
    def measured_overhead_ms(self) -> float:
        """The fixed cost per step measured on this device: the engine's own where it has
        one, else the device's (0: none measured)."""
        engine = self.engine_costs
        return engine["overhead_ms"] if engine else self.gpu.step_overhead_ms

    def __post_init__(self) -> None:
        if self.tp < 1 or self.tp > MAX_TP:
            raise ValueError(f"tp must be between 1 and {MAX_TP}, got {self.tp}")
        if self.pp < 1 or self.pp > self.model.layers:
            raise ValueError(f"pp must be between 1 and the model's {self.model.layers} layers")
        if self.max_seqs < 1 or self.max_batched_tokens < 1:
            raise ValueError("max_seqs and max_batched_tokens must be at least 1")
        if not 0.0 <= self.prefix_hit < 1.0:
            raise ValueError("prefix_hit must be in [0, 1)")
        BYTES_PER_PARAM[self.weights]  # noqa: B018 - raises KeyError on an unknown precision
        why = (dcp_problem(self.model, self.tp, self.dcp)
               or cp_problem(self.gpu, self.group_gpus, self.cp, self.dcp))
        if why:
            raise ValueError(why)

    @property
    def gpus(self) -> int:
        """All the replica's GPUs."""
        return self.tp * self.pp * self.cp

    @property
    def group_gpus(self) -> int:
        """One context-parallel rank's GPUs: what holds one copy of the weights."""
        return self.tp * self.pp

    @property
    def nodes(self) -> int:
        """Nodes of MAX_TP GPUs the replica spans."""
        return -(-self.gpus // MAX_TP)

    @property
    def layout(self) -> str:
        """'TP8', 'TP4·PP2', 'TP8·CP2', 'TP8·DCP2': the parallelism as tables name it."""
        parts = [f"TP{self.tp}"] + [f"{name}{n}" for name, n in
                                    (("PP", self.pp), ("CP", self.cp), ("DCP", self.dcp)) if n > 1]
        return "·".join(parts)


# NCCL's own cost model (src/graph/tuning.cc, baseLat for the ring algorithm, LL/LL128
# protocols): a collective pays a fixed 3.6 us launch/sync latency, then one link latency per ring
# step. The per-step latency is the catalog's link_latency_us (NCCL's hwLat for that link).
COLLECTIVE_BASE_US = 3.6


def ring_steps(tp: int) -> int:
    """A ring all-reduce is a reduce-scatter then an all-gather: 2(N-1) dependent steps."""
    return 2 * (tp - 1)


def allreduce_seconds(gpu: Gpu, tp: int, message_bytes: float, link_eff: float) -> float:
    """Ring all-reduce: base latency plus 2(N-1) step latencies, plus 2(N-1)/N of the message
    over the link (GenZ collective_times.py and NCCL's tuning model share this form)."""
    if tp == 1:
        return 0.0
    latency = (COLLECTIVE_BASE_US + ring_steps(tp) * gpu.link_latency_us) * 1e-6
    return latency + ring_steps(tp) / tp * message_bytes / (gpu.link_gbs * 1e9 * link_eff)


def allgather_seconds(gbs: float, latency_us: float, ranks: int, message_bytes: float,
                      link_eff: float) -> float:
    """Ring all-gather of a `message_bytes` total over links of `gbs` GB/s and `latency_us` a
    step: half a ring all-reduce (each rank receives (N-1)/N of the message)."""
    if ranks == 1:
        return 0.0
    latency = (COLLECTIVE_BASE_US + (ranks - 1) * latency_us) * 1e-6
    return latency + (ranks - 1) / ranks * message_bytes / (gbs * 1e9 * link_eff)


def send_seconds(gpu: Gpu, message_bytes: float, link_eff: float) -> float:
    """A pipeline hand-off: one point-to-point send, base latency plus one step (GenZ's PP)."""
    latency = (COLLECTIVE_BASE_US + gpu.link_latency_us) * 1e-6
    return latency + message_bytes / (gpu.link_gbs * 1e9 * link_eff)


class StepCost:
    """Time of one engine iteration for a deployment, with its constants computed once."""

    __slots__ = ("d", "eff", "flops_per_token", "lm_head_flops", "attn_flops", "dense_bytes",
                 "expert_bytes", "kv_read", "flops_rate", "attn_rate", "bw", "comm_per_token",
                 "comm_fixed", "stage_layers", "spec_tokens", "draft_fraction", "pp",
                 "handoff_fixed", "handoff_per_token", "overhead", "draft_seconds", "moe",
                 "dcp_fixed", "dcp_per_token", "per_seq", "blend", "cp", "cp_fixed",
                 "cp_per_token")

    def __init__(self, d: Deployment, eff: Efficiency | None = None) -> None:
        m, g, self.d = d.model, d.gpu, d
        self.eff = eff or Efficiency()
        bpp = BYTES_PER_PARAM[d.weights]
        active = m.active_params_b * 1e9 - m.embedding_params
        self.flops_per_token = 2.0 * active
        self.lm_head_flops = 2.0 * m.vocab * m.hidden
        self.attn_flops = 4.0 * m.layers * m.heads * m.head_dim
        routed = m.moe_layers * m.experts * m.expert_params if m.is_moe else 0.0
        # Per GPU of one context-parallel rank: each rank holds the whole model.
        self.dense_bytes = (m.params_b * 1e9 - routed) * bpp / d.group_gpus
        self.expert_bytes = m.moe_layers * m.expert_params * bpp / d.group_gpus
        self.kv_read = kv_bytes_per_token_per_gpu(m, d.kv, d.tp, d.pp, d.dcp)
        engine = d.engine_costs
        # An engine measured on this device brings its own 16-bit matmul rate (the precisions
        # the device has no figure of run as bf16 math there too).
        tflops = (engine["tflops_bf16"] if engine and d.weights in ("bf16", "fp16", "int4")
                  else g.compute_tflops(d.weights))
        attn_tflops = engine["tflops_bf16"] if engine else g.compute_tflops("bf16")
        self.flops_rate = tflops * 1e12 * self.eff.flops * d.group_gpus
        # Attention (QK^T and PV over the cache) runs in 16-bit FMHA kernels whatever the weight
        # precision: FP8/INT8 weights speed up the linear layers only.
        self.attn_rate = attn_tflops * 1e12 * self.eff.flops * d.group_gpus
        self.bw = g.bandwidth_gbs * 1e9 * self.eff.memory
        self.stage_layers = m.layers / d.pp
        # Two all-reduces per layer (after attention and after the MLP) of bf16 activations,
        # each costing allreduce_seconds: its latency part is fixed, its size part per token.
        reduces = 2 * self.stage_layers if d.tp > 1 else 0.0
        self.comm_fixed = reduces * allreduce_seconds(g, d.tp, 0.0, self.eff.link)
        self.comm_per_token = reduces * (allreduce_seconds(g, d.tp, 2.0 * m.hidden, self.eff.link)
                                         - allreduce_seconds(g, d.tp, 0.0, self.eff.link))
        # Decode context parallelism, vLLM's default "ag_rs" exchange: per layer an all-gather
        # of the queries over the DCP group and a reduce-scatter of the partial outputs (their
        # log-sum-exp alongside), each half a ring all-reduce (GenZ collective_times.py).
        # Queries and outputs are bf16, DCP x the rank's query heads wide.
        self.dcp_fixed = self.dcp_per_token = 0.0
        if d.dcp > 1:
            width = 2.0 * d.dcp * m.heads / d.tp * (m.kv_lora_rank or m.head_dim)
            self.dcp_fixed = self.stage_layers * allreduce_seconds(g, d.dcp, 0.0, self.eff.link)
            self.dcp_per_token = self.stage_layers * (
                allreduce_seconds(g, d.dcp, width, self.eff.link)
                - allreduce_seconds(g, d.dcp, 0.0, self.eff.link))
        # Prefill context parallelism (SGLang's --attn-cp-size with --enable-prefill-cp, vLLM's
        # -pcp): each CP rank takes 1/cp of a prompt's tokens through every layer, then the
        # ranks all-gather the chunk's keys and values over the network, so that every rank's
        # queries see the whole prefix and every rank keeps the whole cache for decode. Counted
        # after the compute, not hidden under it: an all-gather is not a ring-attention overlap.
        self.cp, self.cp_fixed, self.cp_per_token = d.cp, 0.0, 0.0
        if d.cp > 1:  # kv_read: a token's keys and values on this GPU, all the stage's layers
            # A ring over nodes runs at the network's pace; within one node, at the GPU link's.
            gbs, lat = ((g.network_gbs, g.network_latency_us) if d.nodes > 1
                        else (g.link_gbs, g.link_latency_us))
            empty = allgather_seconds(gbs, lat, d.cp, 0.0, self.eff.link)
            self.cp_fixed = self.stage_layers * empty
            self.cp_per_token = allgather_seconds(gbs, lat, d.cp, self.kv_read,
                                                  self.eff.link) - empty
        self.spec_tokens = d.spec.draft_len + 1 if d.spec else 1
        self.draft_fraction = d.spec.draft_len * d.spec.draft_cost if d.spec else 0.0
        # Constants of time(), which the search calls hundreds of thousands of times.
        self.pp, self.moe = d.pp, m.is_moe
        self.handoff_fixed = (d.pp - 1) * send_seconds(g, 0.0, self.eff.link)
        self.handoff_per_token = (d.pp - 1) * (send_seconds(g, 2.0 * m.hidden, self.eff.link)
                                               - send_seconds(g, 0.0, self.eff.link))
        # The fixed cost per step: a fitted one, else the engine's, the device's, the default;
        # a fit scales the engine's per-sequence cost by the same factor as its fixed one.
        measured_ms = d.measured_overhead_ms
        # A device profiled here (it has engines' fitted costs) measured its fixed costs even
        # where they came out 0 (a step that is all weight reading: servescope's on the 2-core
        # Xeon with AMX once its layers ran in one call); taking 0 for "not measured" gave it
        # the default overhead and the ridge blend, and its 52-token prefill 22% over the fit.
        measured = bool(d.gpu.engines) or measured_ms > 0
        overhead_ms = self.eff.overhead_ms
        if overhead_ms is None:
            overhead_ms = measured_ms if measured else (
                DEFAULT_OVERHEAD_MS + self.eff.kernel_floor_us * 1e-3 * m.layers)
        # A measured device's costs were fitted to the plain roofline (engine.device_profile).
        self.blend = 0.0 if measured else self.eff.ridge_blend
        scale = overhead_ms / measured_ms if measured_ms else 1.0
        self.overhead = overhead_ms * 1e-3
        self.per_seq = ((engine["per_seq_ms"] * 1e-3 * scale) if engine else 0.0) \
            + self.eff.serving_ms_per_seq * 1e-3
        self.draft_seconds = self.draft_fraction * self.dense_bytes / self.bw * d.pp

    def _experts_touched(self, tokens: float) -> float:
        """Distinct routed experts a layer reads for `tokens` tokens routed uniformly at random."""
        m = self.d.model
        if not m.is_moe:
            return 0.0
        return m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** tokens)

    def time(self, prefill_tokens: float, prefill_attn: float, decode_seqs: int,
             decode_ctx: float, sampled: int) -> float:
        """Seconds for one iteration: `prefill_tokens` prompt tokens whose attention covers
        `prefill_attn` (query, key) pairs, plus `decode_seqs` decodes over `decode_ctx` cached
        tokens in all; `sampled` sequences produce logits."""
        pp = self.pp
        if prefill_tokens + decode_seqs <= 0:
            return 0.0
        cp_comm = 0.0
        if self.cp > 1 and prefill_tokens:  # each CP rank computes its share of the prompts
            cp_comm = self.cp_fixed + self.cp_per_token * prefill_tokens
            prefill_tokens, prefill_attn = prefill_tokens / self.cp, prefill_attn / self.cp
        tokens = prefill_tokens + decode_seqs * self.spec_tokens
        micro = min(pp, max(decode_seqs + (1 if prefill_tokens else 0), 1))
        gemm_flops = tokens * self.flops_per_token + sampled * self.spec_tokens * self.lm_head_flops
        attn_flops = self.attn_flops * (prefill_attn + decode_ctx * self.spec_tokens)
        weights = self.dense_bytes
        if self.moe:
            weights += self.expert_bytes * self._experts_touched(tokens / micro)
        kv = (decode_ctx + tokens) * self.kv_read
        # A roofline per operator, as LLM-Viewer does: the linear layers (bound by FLOPs or by
        # reading the weights) and attention (bound by its FLOPs or by reading the KV cache) are
        # separate kernels that run one after the other, so their times add. One max() over the
        # summed work would let a KV-bound attention hide behind compute-bound GEMMs.
        compute, read = gemm_flops / self.flops_rate, weights / self.bw * micro
        linear = (max(compute, read) + self.blend * min(compute, read)) / micro
        attention = max(attn_flops / self.attn_rate, kv / self.bw) / micro
        comm = self.comm_fixed + self.comm_per_token * tokens / micro
        if self.dcp_fixed:  # every token's attention reads a striped cache, prompts' too
            comm += self.dcp_fixed + self.dcp_per_token * tokens / micro
        stage = linear + attention + comm + cp_comm / micro
        handoff = self.handoff_fixed + self.handoff_per_token * tokens / micro
        draft = self.draft_seconds if decode_seqs else 0.0
        return self.overhead + self.per_seq * sampled + pp * stage + handoff + draft

    def prefill_seconds(self, input_len: int) -> float:
        """One prompt alone, in chunks of max_batched_tokens: its TTFT on an idle replica."""
        budget = self.d.max_batched_tokens
        start = int(input_len * self.d.prefix_hit)
        total, done = 0.0, start
        while done < input_len:
            chunk = min(budget, input_len - done)
            total += self.time(chunk, chunk * (done + chunk / 2.0), 0, 0.0, 1)
            done += chunk
        return total

    def decode_seconds(self, batch: int, mean_ctx: float) -> float:
        """One decode iteration for `batch` sequences of `mean_ctx` cached tokens on average."""
        return self.time(0, 0.0, batch, batch * mean_ctx, batch)

