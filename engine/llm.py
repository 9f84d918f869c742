"""LLM: the engine's public facade over the scheduler, block manager, model runner and sampler."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.cuda_graphs import DecodeGraphs, check_device
from engine.detokenizer import append_token_text, final_text
from engine.devices import (
    check_kv_cache_dtype,
    kv_budget_tokens,
    resolve_device,
    resolve_dtype,
)
from engine.kv_eviction import KVEvictor, KVState, parse_policy, resolve_budget
from engine.kv_options import parse_kv_cache_dtype
from engine.model import LlamaModel
from engine.prefix_cache import PrefixCache
from engine.quantize import parse_weights
from engine.runner import ModelRunner
from engine.sampler import sample
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import (
    RequestError,
    RequestOutput,
    SamplingParams,
    Sequence,
    Status,
    StreamDelta,
)
from engine.spec import SpecConfig, parse_spec
from engine.spec.decoder import SpecDecoder
from engine.spec.verify import verify

Prompt = str | list[int]


@dataclass(frozen=True)
class StepStats:
    """What one engine step did, from the engine's own clock."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_finished: int
    kv_blocks_used: int
    kv_blocks_total: int
    wall_s: float
    timestamp: float
    num_evicted_tokens: int = 0  # KV entries dropped by eviction policies this step

class LLM:
    """A loaded model with a paged KV cache, serving many requests by continuous batching."""

    def __init__(self, model: str, *, device: str = "auto", dtype: str | torch.dtype | None = None,
                 max_num_seqs: int = 64, kv_cache_tokens: int | None = None,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 2048,
                 block_size: int = 16, kernel_backend: str | None = None,
                 progress: Callable[[float], None] | None = None,
                 speculative: str | SpecConfig | None = None,
                 prefix_caching: bool = False, kv_policy: str | None = None,
                 kv_budget: int | float | None = None, cuda_graphs: bool = False,
                 weights: str = "float", kv_cache_dtype: str = "auto",
                 torch_compile: bool = False) -> None:
        """Load `model`; `progress(fraction)` follows the weights and may raise LoadCancelled.

        `kv_policy` (none, streaming, h2o, scissorhands, snapkv) with `kv_budget` (tokens, or a
        fraction of each request's length) evicts KV entries; requests may override both.
        `cuda_graphs` replays decode-only steps from CUDA graphs and `torch_compile` runs them
        through torch.compile (inductor), alone or inside the graphs (CUDA only).
        `weights`: "float", "int8" or "int4[:g32|g64|g128]" weight-only quantization
        (engine/quantize.py); a bad value raises WeightsError before anything is read.
        `kv_cache_dtype`: "auto" (the model's dtype), "int8" or "fp8" KV cache, quantized with a
        scale per token and KV head (kernels/kv_quant.py).
        """
        engine_policy = parse_policy(kv_policy)
        if engine_policy is not None:
            resolve_budget(kv_budget, 1 << 30, block_size)  # a bad budget fails before loading
        from engine.loader import load_checkpoint

        weight_format = parse_weights(weights)
        self.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
        self.device, self.fallback_reason = resolve_device(device)
        if cuda_graphs:  # before the weights load
            check_device(self.device)
        if torch_compile:
            check_device(self.device, "Compiled decode steps", "torch_compile")
        check_kv_cache_dtype(self.kv_cache_dtype, self.device)
        self._dtype = resolve_dtype(dtype, self.device)
        ckpt = load_checkpoint(model, dtype=torch.float32, progress=progress)
        self.config: ModelConfig = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.model_name = ckpt.name
        self.model_path = ckpt.source
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.model = LlamaModel(self.config, ckpt.tensors, self.device, self._dtype,
                                self.max_model_len, kernel_backend, weight_format, ckpt.blocks)
        del ckpt
        self.block_size = block_size
        tokens = kv_cache_tokens or kv_budget_tokens(self.config, self.device, self._dtype,
                                                     max_num_seqs, self.max_model_len,
                                                     self.kv_cache_dtype)
        self.num_kv_blocks = max(1, tokens // block_size)
        self.block_manager = BlockManager(self.num_kv_blocks, block_size)
        # What makes cached KV differ beyond the tokens: a block is shared only within it.
        identity = f"{self.model_path}|{self._dtype}|{weight_format}|{self.kv_cache_dtype}"
        self.prefix_cache = PrefixCache(self.block_manager, identity) if prefix_caching else None
        self.scheduler = Scheduler(self.block_manager, max_num_seqs,
                                   max(max_num_batched_tokens, block_size), self.prefix_cache)
        self.runner = ModelRunner(self.model, self.block_manager, self.kv_cache_dtype)
        if cuda_graphs or torch_compile:
            self.runner.decode_graphs = DecodeGraphs(
                self.runner, max_num_seqs, self.max_model_len, capture=cuda_graphs,
                compile_backend="inductor" if torch_compile else None)
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids)
        self.spec = self._spec_decoder(parse_spec(speculative))
        self.kv_policy, self.kv_budget = kv_policy, kv_budget
        self.evictor = KVEvictor(self.runner, self.block_manager)
        self.max_num_batched_tokens = max(max_num_batched_tokens, block_size)
        if engine_policy is not None:
            self._check_policy_allowed()
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._abort_lock = threading.Lock()
        self._to_abort: set[str] = set()
        self.last_stats: StepStats | None = None
        # Called with every step's StepStats on the stepping thread (the app's live chart).
        self.step_observers: list[Callable[[StepStats], None]] = []

    def _spec_decoder(self, config: SpecConfig | None) -> SpecDecoder | None:
        if config is None:
            return None
        draft = None
        if config.method == "draft":
            from engine.spec.draft import make_draft

            draft = make_draft(config.draft_model, self.tokenizer, self.config.vocab_size,
                               self.device, self._dtype, self.block_manager, self.max_model_len,
                               self.model)
        return SpecDecoder(config, draft, self.max_model_len)

    # ---- properties the app and the benchmarks read ----
    @property
    def dtype(self) -> str:
        return str(self._dtype).removeprefix("torch.")

    @property
    def weights(self) -> str:
        """The weight format: "float", "int8", "int4:g32", ..."""
        return self.model.weight_format.name

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached token takes in the pool (values and, quantized, their scales)."""
        return self.kv_cache_bytes // self.kv_cache_tokens

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    # ---- requests ----
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        """Queue a request; raises RequestError (naming the problem) if it can never run.

        `arrival` (time.perf_counter seconds) is when the request reached its server, so TTFT
        counts tokenizing and queueing as vLLM's does; default now."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        kv = self._kv_state(ids, params)
        self._check_fits(ids, params, kv)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._seqs:
            raise RequestError(f"Request id '{rid}' is already in use: pick another id.")
        seq = Sequence(rid, ids, params, arrival=time.perf_counter() if arrival is None
                       else arrival)
        seq.kv = kv
        if kv is not None:  # the chunk _check_fits and _kv_state sized the cache's peak by
            seq.max_chunk_tokens = self._eviction_chunk(ids, kv)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step and free its blocks; safe to call from any thread."""
        with self._abort_lock:
            self._to_abort.add(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """Run one iteration: schedule, run the model, sample, and report what changed."""
        updated, stats = self._step()
        return [seq.to_output() for seq in updated], stats

    def step_deltas(self) -> tuple[list[StreamDelta], StepStats]:
        """Like step(), as new text per updated request (what a streaming server sends)."""
        updated, stats = self._step()
        return [_delta(seq) for seq in updated], stats

    def _step(self) -> tuple[list[Sequence], StepStats]:
        try:
            return self._run_step()
        except Exception as exc:  # one request's failure must not end the others
            return self._isolate(exc)

    def _run_step(self, apply_aborts: bool = True) -> tuple[list[Sequence], StepStats]:
        start = time.perf_counter()
        # A step run alone (see _isolate) leaves aborts for later: the queues are set aside.
        updated = self._apply_aborts() if apply_aborts else []
        self._propose_drafts()
        plan = self.scheduler.schedule()
        sampling = [s for s in plan.scheduled if s.samples]
        generated = accepted = 0
        if plan.scheduled:
            for s in plan.scheduled:
                if s.seq.metrics.first_scheduled is None:
                    s.seq.metrics.first_scheduled = start
            want_mass = any(s.seq.kv is not None and s.seq.kv.policy.wants_mass(s.seq.kv)
                            for s in plan.scheduled)
            logits = self.runner.run(plan.scheduled, want_mass=want_mass)
            new_tokens = self._choose_tokens(sampling, logits)
            if self.spec is not None:
                self.spec.after_step(sampling, new_tokens, self.runner.last_hidden)
            now = time.perf_counter()
            for s in plan.scheduled:
                # Drafts count as computed only once accepted (see _accept).
                s.seq.num_computed_tokens += s.num_new_tokens - s.num_draft
                # A sequence under an eviction policy keeps its blocks private (it may move them).
                if self.prefix_cache is not None and s.seq.kv is None:
                    self.prefix_cache.register(s.seq)
            for s, tokens in zip(sampling, new_tokens, strict=True):
                generated += self._accept(s, tokens, now)
                accepted += len(tokens) - 1
                updated.append(s.seq)
            evicted = self._evict(plan.scheduled, self.runner.last_mass if want_mass else None)
        else:
            evicted = 0
        for seq in updated:
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
        self.last_stats = self._stats(plan, updated, start, generated, accepted, evicted)
        for observe in self.step_observers:
            observe(self.last_stats)
        return updated, self.last_stats

    # ---- isolation: a failed step fails only the requests that fail alone ----
    def _isolate(self, exc: Exception) -> tuple[list[Sequence], StepStats]:
        """After a failed step, recompute each sequence of the batch alone: those that fail
        alone end with finish_reason "error"; the others go on. Costs a recompute of the batch,
        only when a step fails."""
        start = time.perf_counter()
        suspects = list(self.scheduler.running)
        # Sequences the failed step finished before it broke still owe their last delta.
        updated = [seq for seq in self._seqs.values() if seq.is_finished]
        if not suspects and not updated:
            raise exc
        for seq in suspects:
            self.scheduler.preempt(seq)  # frees its blocks and resets it to be recomputed
            self.scheduler.waiting.remove(seq)
        stats = None
        for seq in suspects:
            alone, stats = self._run_alone(seq)
            updated.extend(alone)
        updated = list(dict.fromkeys(updated))
        for seq in updated:
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
        if stats is None:
            stats = self._stats(SchedulerOutput(), updated, start, 0, 0)
        return updated, stats

    def _run_alone(self, seq: Sequence) -> tuple[list[Sequence], StepStats | None]:
        """Step one sequence with the others set aside until it samples a token, finishes or
        fails; then put the queues back together."""
        sched = self.scheduler
        saved_running, saved_waiting = sched.running, sched.waiting
        sched.running, sched.waiting = [], deque([seq])
        updated, stats, before = [], None, len(seq.output_token_ids)
        chunk = seq.max_chunk_tokens or self.max_num_batched_tokens
        try:
            for _ in range(-(-seq.num_tokens // chunk) + 1):
                alone, stats = self._run_step(apply_aborts=False)
                updated.extend(alone)
                if seq.is_finished or len(seq.output_token_ids) > before:
                    break
        except Exception as exc:
            self._fail(seq, exc)
            updated.append(seq)
        finally:
            saved_running.extend(sched.running)
            saved_waiting.extendleft(reversed(sched.waiting))
            sched.running, sched.waiting = saved_running, saved_waiting
        return updated, stats

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        seq.error = (f"The engine failed on this request ({type(exc).__name__}: {exc}); other "
                     "requests were not affected.")
        self._finish(seq, "error", time.perf_counter())

    def _evict(self, scheduled: list, masses: list | None) -> int:
        """After acceptance: fold in attention statistics, compact sequences over budget."""
        evicted = 0
        for i, s in enumerate(scheduled):
            seq = s.seq
            if seq.kv is None or seq.is_finished or seq.status is not Status.RUNNING:
                continue
            self.evictor.observe(seq, None if masses is None else masses[i])
            evicted += self.evictor.maybe_compact(seq)
        return evicted

    # ---- convenience loops ----
    def generate(
        self, prompts: Prompt | Iterable[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching); outputs in prompt order."""
        single = isinstance(prompts, str) or _is_token_list(prompts)
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            try:
                ids = self._prompt_ids(p)
                self._check_fits(ids, sp, self._kv_state(ids, sp))
            except RequestError as e:
                raise RequestError(f"Prompt {i}: {e}") from None
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(rids):
            outputs, _ = self.step()
            done.update((o.request_id, o) for o in outputs if o.finished)
        return [done[r] for r in rids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """Generate the assistant's reply to a conversation through the model's chat template."""
        return self.generate([self.chat_prompt(messages)], params)[0]

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def stream(self, prompt: Prompt | list[dict],
               params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield new text as it is generated; closing the iterator aborts the request."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = self.chat_prompt(prompt)
        rid = self.add_request(prompt, params)
        seq = self._seqs[rid]
        try:
            while not seq.is_finished:
                deltas, _ = self.step_deltas()
                yield from (d for d in deltas if d.request_id == rid)
        finally:
            if not seq.is_finished:
                self.abort(rid)
                self.step()

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits ([len, vocab], float32) of every prompt position, computed in one prefill."""
        from engine.scheduler import ScheduledSeq

        seq = Sequence("prompt-logits", self._prompt_ids(token_ids), SamplingParams(), 0.0)
        self._check_fits(seq.prompt_token_ids, SamplingParams(max_tokens=1))
        if not self.block_manager.can_append(seq, seq.num_tokens):
            raise RequestError("The KV pool is busy: wait for running requests to finish.")
        self.block_manager.append_slots(seq, seq.num_tokens)
        try:
            return self.runner.run([ScheduledSeq(seq, seq.num_tokens)], all_logits=True).cpu()
        finally:
            self.block_manager.free(seq)

    def close(self) -> None:
        """Free the weights and the KV cache."""
        for rid in list(self._seqs):
            self.abort(rid)
        self._apply_aborts()
        self.model = None
        self.runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- internals ----
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("The prompt is empty: give at least one token.")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"Token id {bad[0]} is outside the vocabulary (0.."
                               f"{self.config.vocab_size - 1}): check the token ids.")
        return ids

    def _kv_state(self, ids: list[int], params: SamplingParams) -> KVState | None:
        """The request's eviction policy and budget in tokens (its own, else the engine's)."""
        name = params.kv_policy if params.kv_policy is not None else self.kv_policy
        policy = parse_policy(name)
        if policy is None:
            return None
        self._check_policy_allowed()
        budget = params.kv_budget if params.kv_budget is not None else self.kv_budget
        tokens = resolve_budget(budget, len(ids) + params.max_tokens, self.block_size)
        state = KVState(policy, tokens)
        if policy.repositions:
            chunk = self._eviction_chunk(ids, state)
            peak = tokens + self.block_size + chunk
            if peak >= self.max_model_len:
                raise RequestError(
                    f"With {policy.name} the cache holds up to {peak} tokens (kv_budget {tokens}, "
                    f"one block, a step's chunk of up to {chunk}: prompt or speculative drafts) "
                    f"but the context holds {self.max_model_len}: lower kv_budget or "
                    "max_num_batched_tokens.")
        return state

    def _eviction_chunk(self, ids: list[int], kv: KVState) -> int:
        """The most tokens a sequence under eviction computes in one step beyond its budget and
        a block, before compacting: a prefill chunk, or a decode token and its speculative
        drafts; SnapKV holds the whole prompt until it ends."""
        chunk = len(ids) if kv.policy.name == "snapkv" else min(len(ids),
                                                               self.max_num_batched_tokens)
        drafts = 0 if self.spec is None else self.spec.config.num_draft_tokens
        return max(chunk, 1 + drafts)

    def _check_policy_allowed(self) -> None:
        from engine.spec.draft import DraftModel

        if self.spec is not None and isinstance(self.spec.draft, DraftModel):
            raise RequestError("KV eviction does not work with a draft model (its cache mirrors "
                               "the target's block for block): use --spec ngram or no eviction.")

    def _check_fits(self, ids: list[int], params: SamplingParams,
                    kv: KVState | None = None) -> None:
        unbounded = kv is not None and kv.policy.repositions  # positions stay within the cache
        if len(ids) >= self.max_model_len and not unbounded:
            raise RequestError(
                f"The prompt has {len(ids)} tokens but the context holds {self.max_model_len}: "
                "shorten the prompt or load the model with a longer max_model_len.")
        need = len(ids) + params.max_tokens
        if not unbounded:
            need = min(need, self.max_model_len)
        if kv is not None:
            # The cache peaks at the budget plus a block plus a prefill chunk, except that
            # SnapKV holds the whole prompt until it ends.
            need = min(need, kv.budget + self.block_size + self._eviction_chunk(ids, kv))
        if need > self.kv_cache_tokens:
            raise RequestError(
                f"The request needs up to {need} KV slots ({len(ids)} prompt + {params.max_tokens} "
                f"new tokens) but the KV pool holds {self.kv_cache_tokens}: lower max_tokens or "
                "raise kv_cache_tokens.")

    def _propose_drafts(self) -> None:
        if self.spec is None:
            return
        decoding = []
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            if seq.num_uncomputed_tokens == 1:
                decoding.append(seq)
        self.spec.propose_all(decoding)

    def _choose_tokens(self, sampling: list, logits: torch.Tensor) -> list[list[int]]:
        """New tokens per sampling sequence: one sampled, or the verified drafts plus one."""
        plain = [i for i, s in enumerate(sampling) if not s.num_draft]
        starts = list(itertools.accumulate((1 + s.num_draft for s in sampling), initial=0))
        chosen: list[list[int]] = [[] for _ in sampling]
        if plain:
            rows = [starts[i] for i in plain]
            for i, token in zip(plain, sample(logits[rows], [sampling[i].seq for i in plain]),
                                strict=True):
                seq = sampling[i].seq
                if seq.forced_token_ids is not None:
                    token = _force(seq, logits[starts[i]])
                chosen[i] = [token]
        for i, s in enumerate(sampling):
            if s.num_draft:
                rows = logits[starts[i] : starts[i + 1]]
                q = s.seq.draft_probs[: s.num_draft] if s.seq.draft_probs else None
                chosen[i] = verify(s.seq, rows, s.seq.draft_token_ids[: s.num_draft],
                                   None if q is None else torch.stack(q))
                self.spec.record(s.seq, s.num_draft, len(chosen[i]) - 1)
        return chosen

    def _accept(self, s, tokens: list[int], now: float) -> int:
        """Append verified tokens (how many); rejected drafts' KV goes with the trimmed blocks."""
        seq = s.seq
        seq.num_computed_tokens += len(tokens) - 1
        if s.num_draft:
            self.spec.after_verify(seq, seq.num_tokens, len(seq.draft_token_ids), len(tokens) - 1)
            self.block_manager.trim(seq, seq.kv_len + 1)  # cached, not computed: eviction
        seq.draft_token_ids, seq.draft_probs = [], None
        for count, token in enumerate(tokens, start=1):
            self._append_token(seq, token, now)
            if seq.is_finished:
                return count
        return len(tokens)

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.output_token_ids.append(token)
        m = seq.metrics
        m.token_times.append(now)
        if m.first_token is None:
            m.first_token = now
        reason = self._finish_reason(seq, token)
        if reason is not None:
            seq.text = final_text(self.tokenizer, seq)
            seq.text, stopped = _truncate_at_stop(seq.text, seq.params.stop)
            self._finish(seq, "stop" if stopped else reason, now)
            return
        append_token_text(self.tokenizer, seq)
        seq.text, stopped = _truncate_at_stop(seq.text, seq.params.stop)
        if stopped:
            self._finish(seq, "stop", now)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_ids and not seq.params.ignore_eos:
            return "stop"
        if seq.kv is not None and seq.kv.policy.repositions:
            too_long = seq.kv_len >= self.max_model_len  # positions are cache indices
        else:
            too_long = seq.num_tokens >= self.max_model_len
        if len(seq.output_token_ids) >= seq.params.max_tokens or too_long:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq, reason)
        seq.metrics.finished = now

    def _apply_aborts(self) -> list[Sequence]:
        with self._abort_lock:
            rids, self._to_abort = self._to_abort, set()
        aborted = []
        for rid in rids:
            seq = self._seqs.get(rid)
            if seq is not None and seq.status is not Status.FINISHED:
                self._finish(seq, "abort", time.perf_counter())
                aborted.append(seq)
        return aborted

    def _stats(self, plan, updated: list[Sequence], start: float, generated: int,
               accepted: int, evicted: int = 0) -> StepStats:
        bm = self.block_manager
        return StepStats(
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            num_generated_tokens=generated,
            num_draft_tokens=sum(s.num_draft for s in plan.scheduled),
            num_accepted_tokens=accepted,
            prefix_cache_queries=plan.prefix_queries,
            prefix_cache_hits=plan.prefix_hits,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted=len(plan.preempted),
            num_finished=sum(1 for s in updated if s.is_finished),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            wall_s=time.perf_counter() - start,
            timestamp=start,
            num_evicted_tokens=evicted,
        )


def _force(seq: Sequence, logits: torch.Tensor) -> int:
    """Teacher forcing: the given next token, recording the model's log-probability of it and
    its own top-1 choice."""
    token = seq.forced_token_ids[len(seq.output_token_ids)]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    seq.forced_logprobs.append(float(logprobs[token]))
    seq.forced_top1.append(int(logprobs.argmax()))
    return token


def _is_token_list(p) -> bool:
    return isinstance(p, list) and bool(p) and isinstance(p[0], int)


def _truncate_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _delta(seq: Sequence) -> StreamDelta:
    """Text and tokens not yet streamed; text that may start a stop string is held back."""
    hold = 0 if seq.is_finished else max((len(s) - 1 for s in seq.params.stop), default=0)
    visible = max(seq.emitted_text_len, len(seq.text) - hold)
    delta = StreamDelta(seq.request_id, seq.text[seq.emitted_text_len : visible],
                        seq.output_token_ids[seq.emitted_token_len :])
    seq.emitted_text_len = visible
    seq.emitted_token_len = len(seq.output_token_ids)
    if seq.is_finished:
        delta.finish_reason = seq.finish_reason
        delta.output = seq.to_output()
    return delta
