"""LLM: the engine's public facade over the scheduler, block manager, model runner and sampler."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from engine.admission import Admission
from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.core import EngineCore, StepStats
from engine.cuda_graphs import check_device
from engine.devices import (
    check_kv_cache_dtype,
    kv_budget_tokens,
    resolve_device,
    resolve_dtype,
)
from engine.engine_config import EngineConfig
from engine.kv_eviction import KVEvictor
from engine.model import LlamaModel
from engine.output_processor import delta
from engine.prefix_cache import PrefixCache
from engine.quantize import parse_weights
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sequence import (
    RequestError,
    RequestOutput,
    SamplingParams,
    Sequence,
    StreamDelta,
)
from engine.spec import SpecConfig, parse_spec
from engine.spec.decoder import SpecDecoder
from engine.teacher_forcing import ForcedTokens, TeacherForcing

Prompt = str | list[int]
__all__ = ["LLM", "EngineConfig", "Prompt", "StepStats"]


class LLM:
    """A loaded model with a paged KV cache, serving many requests by continuous batching: the
    facade that loads the model, checks requests and hands them to the engine core."""

    def __init__(self, model: str | EngineConfig, *,
                 progress: Callable[[float], None] | None = None, **options: Any) -> None:
        """Load the engine `model` describes: an EngineConfig, or a model path or name with the
        EngineConfig fields as keyword options (they override a given config's).
        `progress(fraction)` follows the weights and may raise LoadCancelled.

        A bad option raises before anything is read (engine/engine_config.py names them all:
        precision, batch and KV pool sizes, speculative decoding, prefix caching, KV eviction,
        CUDA graphs and torch.compile).
        """
        if isinstance(model, EngineConfig):
            config = replace(model, **options) if options else model
        else:
            config = EngineConfig(model, **options)
        self.engine_config = config
        from engine.loader import load_checkpoint

        weight_format = parse_weights(config.weights)
        self.kv_cache_dtype = config.kv_cache_dtype
        self.device, self.fallback_reason = resolve_device(config.device)
        if config.cuda_graphs:  # before the weights load
            check_device(self.device)
        if config.torch_compile:
            check_device(self.device, "Compiled decode steps", "torch_compile")
        check_kv_cache_dtype(self.kv_cache_dtype, self.device)
        self._dtype = resolve_dtype(None if config.dtype == "auto" else config.dtype, self.device)
        ckpt = load_checkpoint(config.model, dtype=torch.float32, progress=progress)
        self.config: ModelConfig = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.model_name = ckpt.name
        self.model_path = ckpt.source
        self.max_model_len = min(config.max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.model = LlamaModel(self.config, ckpt.tensors, self.device, self._dtype,
                                self.max_model_len, config.kernel_backend, weight_format,
                                ckpt.blocks)
        del ckpt
        tokens = config.kv_cache_tokens or kv_budget_tokens(
            self.config, self.device, self._dtype, config.max_num_seqs, self.max_model_len,
            self.kv_cache_dtype)
        self.num_kv_blocks = max(1, tokens // self.block_size)
        self.block_manager = BlockManager(self.num_kv_blocks, self.block_size)
        # What makes cached KV differ beyond the tokens: a block is shared only within it.
        identity = f"{self.model_path}|{self._dtype}|{weight_format}|{self.kv_cache_dtype}"
        self.prefix_cache = (PrefixCache(self.block_manager, identity) if config.prefix_caching
                             else None)
        self.runner = ModelRunner(self.model, self.block_manager, self.kv_cache_dtype)
        if config.cuda_graphs or config.torch_compile:
            self.runner.use_decode_graphs(
                config.max_num_seqs, self.max_model_len, capture=config.cuda_graphs,
                compile_backend="inductor" if config.torch_compile else None)
        self.spec = self._spec_decoder(parse_spec(config.speculative))
        if self.spec is not None:
            self.runner.stream_layers = self.spec.proposer.stream_layers
        self.evictor = KVEvictor(self.runner, self.block_manager)
        self.admission = self._admission()
        if config.evicts:
            self.admission.check_policy_allowed()
        # Hook order matters: prefix blocks are indexed before accepted drafts count as computed.
        features = [f for f in (self.prefix_cache, self.spec, self.evictor, TeacherForcing())
                    if f is not None]
        scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                              self.max_num_batched_tokens, self.prefix_cache)
        self.core = EngineCore(self.runner, self.block_manager, scheduler, features,
                               self.tokenizer, self.max_model_len)

    def _admission(self) -> Admission:
        from engine.spec.draft import DraftModel

        spec = self.spec
        return Admission(self.tokenizer, self.config.vocab_size, self.max_model_len,
                         self.block_size, self.max_num_batched_tokens, self.kv_cache_tokens,
                         self.kv_policy, self.kv_budget,
                         0 if spec is None else spec.max_draft_tokens,
                         spec is not None and isinstance(spec.draft, DraftModel))

    def _spec_decoder(self, config: SpecConfig | None) -> SpecDecoder | None:
        if config is None:
            return None
        draft = None
        if config.method == "draft":
            from engine.spec.draft import make_draft

            draft = make_draft(config.draft_model, self.tokenizer, self.config.vocab_size,
                               self.device, self._dtype, self.block_manager, self.max_model_len,
                               self.model)
        return SpecDecoder(config, draft, self.max_model_len, self.block_manager)

    # ---- properties the app and the benchmarks read ----
    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def last_stats(self) -> StepStats | None:
        return self.core.last_stats

    @property
    def step_observers(self) -> list[Callable[[StepStats], None]]:
        """Called with every step's StepStats on the stepping thread (the app's live chart)."""
        return self.core.step_observers

    # The options it was built with, read from its config (one copy of each).
    @property
    def block_size(self) -> int:
        return self.engine_config.block_size

    @property
    def max_num_batched_tokens(self) -> int:
        return self.engine_config.max_num_batched_tokens

    @property
    def kv_policy(self) -> str | None:
        """The engine's eviction policy by name; None for no eviction."""
        return None if self.engine_config.kv_policy == "none" else self.engine_config.kv_policy

    @property
    def kv_budget(self) -> int | float | None:
        return self.engine_config.kv_budget

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
                    request_id: str | None = None, arrival: float | None = None,
                    forced_tokens: list[int] | None = None,
                    share_prompt_with: str | None = None,
                    forced_top_k: int | None = None) -> str:
        """Queue a request; raises RequestError (naming the problem) if it can never run.

        `arrival` (time.perf_counter seconds) is when the request reached its server, so TTFT
        counts tokenizing and queueing as vLLM's does; default now. `forced_tokens` (evaluation)
        are appended instead of sampled ones; the output's `forced` has the model's
        log-probability and top-1 choice at each (with `forced_top_k`, also each position's
        TokenLogprob with that many alternatives). `share_prompt_with` names a request in flight
        with the same prompt (another choice, n > 1): this one shares its full prompt blocks
        once they are computed instead of computing them again."""
        params = params or SamplingParams()
        ids, kv = self.admission.check(prompt, params)
        rid = request_id if request_id is not None else self.core.new_request_id()
        seq = Sequence(rid, ids, params, arrival=time.perf_counter() if arrival is None
                       else arrival)
        seq.kv = kv
        if kv is not None:  # the chunk the admission checks sized the cache's peak by
            seq.max_chunk_tokens = self.admission.eviction_chunk(ids, kv)
        if forced_tokens is not None:
            seq.forced = ForcedTokens(list(forced_tokens), top_k=forced_top_k)
        source = self.core.seqs.get(share_prompt_with) if share_prompt_with else None
        if source is not None and source.prompt_token_ids == seq.prompt_token_ids:
            seq.prompt_source = source
        self.core.add(seq)
        return rid

    def sequence(self, request_id: str) -> Sequence | None:
        """The engine's live view of a request in flight (read it, do not change it): its KV
        length, blocks and eviction state for evaluations; None once it finished."""
        return self.core.seqs.get(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step and free its blocks; safe to call from any thread."""
        self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """Run one iteration: schedule, run the model, sample, and report what changed."""
        updated, stats = self.core.step()
        return [seq.to_output() for seq in updated], stats

    def step_deltas(self) -> tuple[list[StreamDelta], StepStats]:
        """Like step(), as new text per updated request (what a streaming server sends)."""
        updated, stats = self.core.step()
        return [delta(seq) for seq in updated], stats

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
                self.admission.check(p, sp)
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
        seq = self.core.seqs[rid]
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

        seq = Sequence("prompt-logits", self.admission.prompt_ids(token_ids), SamplingParams(),
                       0.0)
        self.admission.check_fits(seq.prompt_token_ids, SamplingParams(max_tokens=1))
        if not self.block_manager.can_append(seq, seq.num_tokens):
            raise RequestError("The KV pool is busy: wait for running requests to finish.")
        self.block_manager.append_slots(seq, seq.num_tokens)
        try:
            return self.runner.run([ScheduledSeq(seq, seq.num_tokens)],
                                   all_logits=True).logits.cpu()
        finally:
            self.block_manager.free(seq)

    def close(self) -> None:
        """Free the weights and the KV cache."""
        self.core.abort_all()
        self.model = None
        self.runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _is_token_list(p) -> bool:
    return isinstance(p, list) and bool(p) and isinstance(p[0], int)
