"""LLMEngine: requests in, one step at a time, incremental outputs out.

add_request → scheduler.schedule() → model_runner.execute() → append tokens, detokenise,
check stops → free finished blocks → flush KV events → RequestOutputs. Not thread-safe: the
async engine drives it from one thread."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from transformers import AutoConfig, AutoTokenizer

from backend_engine.block_pool import BlockPool
from backend_engine.config import EngineConfig
from backend_engine.dtype import resolve_dtype
from backend_engine.errors import ContextLengthExceededError, InvalidRequestError
from backend_engine.hybrid_kv_cache_manager import kv_cache_manager
from backend_engine.kv_sizing import step_limits
from backend_engine.kv_transfer.params import RemoteDecode, RemotePrefill, check_kv_transfer
from backend_engine.metrics import EngineStats
from backend_engine.model_families import check_config, context_limit
from backend_engine.model_loader import resolve_model
from backend_engine.model_runner import ModelRunner, SeqResult
from backend_engine.output_processor import OutputProcessor, RequestState
from backend_engine.outputs import RequestOutput
from backend_engine.pins import Pin, PinTable
from backend_engine.quant.loader import served_quantization
from backend_engine.replica_load import engine_load, kv_snapshot
from backend_engine.priority import check_priority
from backend_engine.sampler import SamplingRow
from backend_engine.sampling_params import SamplingParams
from backend_engine.scheduler import Scheduler
from backend_engine.sequence import Sequence
from backend_engine.spec_decode.controller import SpecController
from backend_engine.spec_decode.proposers import build_proposer
from backend_engine.step_budget import QueueDrain, StepBudget, default_target_itl_ms, prompt_work
from backend_engine.step_cost import StepCostModel, StepShape
from backend_engine.structured_output_manager import StructuredOutputManager
from routing.hashing import namespace_for

log = logging.getLogger("kvgate.engine")


def for_device(config: EngineConfig) -> EngineConfig:
    """The config with its device-dependent defaults decided for `config.device`: dtype "auto",
    target_itl_ms None (the device's ITL target) and the step limits (the device class's)."""
    itl = config.target_itl_ms
    seqs, tokens = step_limits(config.device)
    return dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device),
                               target_itl_ms=default_target_itl_ms(config.device)
                               if itl is None else itl,
                               max_num_seqs=config.max_num_seqs or seqs,
                               max_num_batched_tokens=config.max_num_batched_tokens or tokens)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        quantization, served = served_quantization(config.model, config.quantization)
        log.info("%s", served)
        config = dataclasses.replace(for_device(config), quantization=quantization)
        self.config = config
        files = resolve_model(config.model, config.quantization)
        self.model_id = config.served_model_name or files.model_id
        self.hf_config = AutoConfig.from_pretrained(files.folder)
        check_config(self.hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(files.folder)
        self.max_model_len = self._max_model_len(config)
        self.runner = self._build_runner(config, files)
        try:
            self._build_engine(config, files)
        except BaseException:
            self.runner.shutdown()  # tensor-parallel workers must not outlive a failed start
            raise

    def _build_runner(self, config: EngineConfig, files):  # -> ModelRunner-like
        if config.tensor_parallel_size == 1:
            return ModelRunner(config, files.folder, self.hf_config, self.max_model_len)
        from backend_engine.executor.tensor_parallel import TensorParallelExecutor

        return TensorParallelExecutor(config, files.folder, self.hf_config, self.max_model_len,
                                      files.model_id)

    def _build_engine(self, config: EngineConfig, files) -> None:
        self.block_size = config.block_size
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching,
                              config.kv_event_buffer, config.eviction_policy,
                              config.max_pinned_fraction)
        if config.kv_offload_enabled:
            self.pool.tier = self._kv_tier(config)
        self.kv = kv_cache_manager(self.pool, self.runner.kv_cache_groups, config)
        self.kv.enable_partial_reuse(self.runner.copy_blocks)  # on while prefix caching is
        self.pins = PinTable(self.pool, config.block_size)
        self.budget = self._step_budget(config)
        self.drain = QueueDrain()
        self.scheduler = Scheduler(config, self.kv, self.budget)
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self.eos_token_ids = self._eos_ids(files.folder)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.proposer = build_proposer(config, self.hf_config.vocab_size, self.max_model_len)
        self.spec = SpecController(config.speculative_max_batch) if self.proposer else None
        self.kv_connector = None
        if config.kv_role != "both":  # prefill/decode disaggregation
            from backend_engine.kv_transfer.connector import KVConnector

            self.kv_connector = KVConnector(config, self.pool, self.runner.kv_caches,
                                            self.model_id)
        self._resumed: list[RequestState] = []  # decode side: first tokens came with the request
        self.structured = StructuredOutputManager(self.tokenizer, self.hf_config.vocab_size,
                                                  self.eos_token_ids, self.stats)

    def _kv_tier(self, config: EngineConfig):  # -> KVTier
        tier = self.runner.open_kv_tier(self.model_id, config)  # one per tensor-parallel rank
        tier.observe = lambda seconds: self.stats.observe("kv_tier_restore", seconds)
        return tier

    def _step_budget(self, config: EngineConfig) -> StepBudget | None:
        if not config.target_itl_ms:  # 0: a fixed token budget, no latency target
            return None
        from backend_engine.step_calibration import calibrated_model

        # a tensor-parallel executor is fitted from its first steps alone
        local = isinstance(self.runner, ModelRunner)
        model = calibrated_model(self.runner, self.max_model_len) if local else StepCostModel()
        return StepBudget(model, config.target_itl_ms / 1000, config.min_prefill_tokens,
                          config.max_num_batched_tokens,
                          self.runner.forward_pass.prompt_row_granule if local else 1)

    def _max_model_len(self, config: EngineConfig) -> int:
        limit = context_limit(self.hf_config)
        if config.max_model_len is not None:
            if config.max_model_len > limit:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                                 f"limit {limit}")
            return config.max_model_len
        return limit

    def _eos_ids(self, folder) -> set[int]:
        ids = set()
        value = getattr(self.hf_config, "eos_token_id", None)
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
        try:
            from transformers import GenerationConfig

            value = GenerationConfig.from_pretrained(folder).eos_token_id
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
        except OSError:
            pass
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- requests --------------------------------------------------------------------------
    def kv_room_tokens(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """KV tokens one request can hold: the pool less the pinned blocks it does not reuse."""
        pinned = self.pool.num_pinned_blocks
        if pinned:
            namespace = namespace_for(self.model_id, cache_salt)
            pinned -= self.pins.num_pinned_prefix_blocks(prompt_token_ids, namespace)
        return self.kv.tokens_in(self.pool.num_blocks - pinned)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      cache_salt: str | None = None, priority: int = 0) -> int:
        """Validate a request without changing engine state (safe from any thread); returns
        the effective max_tokens."""
        check_priority(priority)
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt", code="invalid_value")
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})",
                                      param="prompt", code="invalid_value")
        bad_bias = [t for t in (params.logit_bias or {}) if not 0 <= int(t) < vocab]
        if bad_bias:
            raise InvalidRequestError(f"logit_bias has token ids outside [0, {vocab}): "
                                      f"{bad_bias[:5]}", param="logit_bias", code="invalid_value")
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)
        resumed = params.resume_token_ids
        if resumed and (params.n != 1 or any(not 0 <= t < vocab for t in resumed)):
            raise InvalidRequestError(f"resume_token_ids continue one sample (n=1) with token ids "
                                      f"in [0, {vocab})", param="resume_token_ids",
                                      code="invalid_value")
        if resumed and n + len(resumed) >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt ({n} tokens) and resume_token_ids ({len(resumed)}) leave no room in "
                f"this model's context of {self.max_model_len} tokens")
        room = self.max_model_len - n
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            asked = n + (params.max_tokens or 1)
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {asked} tokens ({n} in the prompt, {asked - n} for the "
                f"completion). Please reduce the length of the prompt or the completion.")
        capacity = self.kv_room_tokens(prompt_token_ids, cache_salt)
        pool_room = capacity - n
        if pool_room < 1:
            raise ContextLengthExceededError(
                f"the prompt ({n} tokens) does not fit in this replica's KV cache "
                f"({capacity} tokens not held by pinned prefixes)")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        return min(max_tokens, pool_room)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, prompt: str | None = None,
                    arrival_time: float | None = None, pin: Pin | None = None,
                    priority: int = 0,
                    kv_transfer: RemoteDecode | RemotePrefill | None = None) -> None:
        """Queue a request; with `pin`, it is the prefill that warms that pin's blocks;
        `priority` follows vLLM: lower values are served first. `kv_transfer`: the request is
        the prefill half (RemoteDecode) or the decode half (RemotePrefill) of a P/D pair."""
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        max_tokens = self.check_request(prompt_token_ids, params, cache_salt, priority)
        check_kv_transfer(kv_transfer, params, self.hf_config.vocab_size, self.kv_connector)
        if isinstance(kv_transfer, RemoteDecode):
            max_tokens = 1  # the prefill half stops at the first token
        namespace = namespace_for(self.model_id, cache_salt)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(f"{request_id}-{i}", request_id, i, list(prompt_token_ids), params,
                           namespace, max_tokens, arrival_time=arrival,
                           parent=seqs[0] if seqs else None, priority=priority)
            if params.seed is not None:
                seq.generator = torch.Generator().manual_seed(params.seed + i)
            seqs.append(seq)
        state = self.outputs.new_state(request_id, prompt_token_ids, params, seqs, arrival,
                                       prompt)
        self.requests[request_id] = state
        if self.kv_connector is not None:
            self.kv_connector.on_add(seqs, kv_transfer)
        if isinstance(kv_transfer, RemotePrefill):  # its first tokens came with it
            self.stats.generation_tokens += len(kv_transfer.first_tokens)
            for seq, reason in self.outputs.resume(state, kv_transfer):
                self._finish(seq, reason, seq.first_token_time)
            self._resumed.append(state)
        elif params.resume_token_ids:  # a migrated stream: what the client already has
            for seq, reason in self.outputs.replay(state, params.resume_token_ids):
                self._finish(seq, reason, time.monotonic())
                self._resumed.append(state)  # its end (and any held-back text) goes out now
        live = [seq for seq in seqs if not seq.is_finished]
        if live and params.structured_outputs is not None:  # scheduled once its grammar compiles
            self.structured.add_request(request_id, params.structured_outputs, live)
        else:
            for seq in live:
                self.scheduler.add(seq)
        if pin is not None:
            self.pins.begin(request_id, pin)
        self.stats.prompt_tokens += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.pins.abort(request_id)
        self.structured.forget(request_id)
        for seq, out in zip(state.seqs, state.outputs):
            if not seq.is_finished:
                self._finish(seq, ("abort", None), time.monotonic())
                out.finish_reason = "abort"
        self.scheduler.sweep_finished()
        self.pool.flush_events()
        return self.outputs.make_output(state, finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def housekeeping(self) -> None:
        """KV-transfer work posted by its threads, and expiry of its holds; also while idle."""
        if self.kv_connector is not None:
            self.kv_connector.housekeeping()

    def close(self) -> None:
        """Stop the KV-transfer threads and any tensor-parallel workers; the engine is
        unusable afterwards."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.pool.tier is not None:
            self.pool.tier.close()
        self.runner.shutdown()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.housekeeping()
        outputs = []
        for state in self._resumed:  # their first tokens go out before any computing
            if self.requests.get(state.request_id) is not state:
                continue  # aborted meanwhile
            outputs.append(self.outputs.make_output(state, state.finished))
            if state.finished and self.requests.pop(state.request_id, None) is not None:
                self.stats.observe("e2e", time.monotonic() - state.arrival_time)
        self._resumed.clear()
        return outputs + self._step()

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        failed = self._admit_compiled()
        self._propose_drafts()
        hits = self.kv.prefix_cache_hits
        sched = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        if not sched:
            self.pool.flush_events()
            self.structured.wait_for_pending(0.01)  # nothing to run until a grammar is ready
            if self.pool.tier is not None:  # ... or a prefix is read from disk
                self.pool.tier.wait_for_reads(0.01)
            return failed
        shape = StepShape.of(sched.scheduled)
        retired = prompt_work(sched.scheduled) + self.kv.prefix_cache_hits - hits
        rows = {seq: self._sampling_rows(seq) for seq, _ in sched.scheduled}
        self.structured.start_step(sched.scheduled, rows)
        try:
            results = self.runner.execute(sched.scheduled, rows)
        finally:
            self.structured.finish_step()
        self._observe_step(shape, retired, time.perf_counter() - started)
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for seq, n in sched.scheduled:
            result = results.get(seq)
            drafted = len(seq.spec_token_ids)
            if result is not None and drafted:
                accepted = len(result.token_ids) - 1
                seq.num_computed_tokens += n - (drafted - accepted)  # rejected slots roll back
                if self.spec is not None:
                    self.spec.record(seq.seq_id, drafted, accepted)
            else:
                seq.num_computed_tokens += n
            seq.spec_token_ids = []
            seq.spec_draft_probs = None
            seq.progress_time = now
            state = self.requests.get(seq.request_id)
            reason = None
            if result is not None and state is not None:
                reason = self._append_tokens(state, seq, result, now)
                touched[state.request_id] = state
            self.kv.cache_computed_blocks(seq)  # before a finish frees the blocks
            if self.kv_connector is not None:
                self.kv_connector.on_computed(seq)  # prefill side: stream what is computed
            if reason is not None and seq.request_id in self.pins.warming:
                self.pins.complete(seq.request_id, seq.block_hashes, self._largest_need(seq))
            if reason is not None:
                self._finish(seq, reason, now)
            elif drafted:
                self.kv.trim_to(seq, seq.num_computed_tokens)
        self.scheduler.sweep_finished()
        self.pool.flush_events()
        self.stats.prefix_cache_queries = self.kv.prefix_cache_queries
        self.stats.prefix_cache_hits = self.kv.prefix_cache_hits
        outputs = failed
        for state in touched.values():
            finished = state.finished
            outputs.append(self.outputs.make_output(state, finished))
            if finished:
                del self.requests[state.request_id]
                self.stats.observe("e2e", now - state.arrival_time)
        return outputs

    def _observe_step(self, shape: StepShape, retired: int, seconds: float) -> None:
        self.stats.observe("step", seconds)
        if self.budget is not None:
            self.budget.model.observe(shape, seconds)
        self.drain.observe(retired, seconds, bool(self.scheduler.waiting), self._estimated_drain)

    def drain_rate(self) -> float:
        """Prompt tokens per second the queue is retired at: measured while requests wait,
        else the step budget's estimate under the current decodes (inf without a budget)."""
        return self.drain.rate if self.drain.rate is not None else self._estimated_drain()

    def _estimated_drain(self) -> float:
        if self.budget is not None:
            return self.budget.prefill_rate(self.scheduler.decode_load())
        return float("inf")

    def _largest_need(self, finishing: Sequence) -> int:
        """KV blocks the largest other unfinished sequence may need (a pin must leave room)."""
        seqs = [s for s in (*self.scheduler.running, *self.scheduler.waiting)
                if s is not finishing and not s.is_finished]
        return max((self.kv.blocks_for(s.num_prompt_tokens + s.max_tokens) for s in seqs),
                   default=0)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is now compiled; end those whose failed."""
        ready, failed = self.structured.take_ready()
        for seq in ready:
            if not seq.is_finished:
                self.scheduler.add(seq)
        return [out for out in map(self.abort_request, failed) if out is not None]

    def _propose_drafts(self) -> None:
        if self.proposer is None or not self.scheduler.running:
            return
        if not self.spec.should_speculate(len(self.scheduler.running)):
            return
        work = []
        for seq in self.scheduler.running:
            if seq.is_finished or seq.num_computed_tokens != seq.num_tokens - 1:
                continue  # still prefilling
            room = min(seq.max_tokens - seq.num_output_tokens,
                       self.max_model_len - seq.num_tokens) - 1
            budget = self.spec.draft_budget(seq.seq_id, self.config.num_speculative_tokens)
            if room > 0 and budget > 0:
                work.append((seq, min(room, budget)))
        if work:
            self.proposer.propose_batch(work, self._draft_row)
            self.structured.trim_drafts([seq for seq, _ in work])

    def _draft_row(self, seq: Sequence, drafted: list[int]) -> SamplingRow:
        """How a proposer samples the next draft, given the drafts it made so far."""
        return SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids + drafted,
                           seq.generator, self.outputs.blocked_tokens(seq, len(drafted)))

    def _sampling_rows(self, seq: Sequence) -> list[SamplingRow]:
        """One row per logits row: the last real token, then each draft (whose penalties
        see the drafts before it, as if they had been sampled)."""
        p, outputs = seq.params, seq.output_token_ids
        rows = [SamplingRow(p, seq.prompt_token_ids, outputs, seq.generator,
                            self.outputs.blocked_tokens(seq))]
        for i in range(1, len(seq.spec_token_ids) + 1):
            rows.append(SamplingRow(p, seq.prompt_token_ids, outputs + seq.spec_token_ids[:i],
                                    seq.generator, self.outputs.blocked_tokens(seq, i)))
        return rows

    def _append_tokens(self, state: RequestState, seq: Sequence, result: SeqResult,
                       now: float):
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.stats.observe("ttft", now - seq.arrival_time)
            self.stats.observe_ttft_by_priority(seq.priority, now - seq.arrival_time)
        for j, token in enumerate(result.token_ids):
            logprob = None
            if result.logprobs is not None:
                logprob = (result.logprobs[j],
                           result.top_ids[j] if result.top_ids is not None else [],
                           result.top_logprobs[j] if result.top_logprobs is not None else [])
            self.stats.generation_tokens += 1
            reason = self.outputs.append_token(state, seq, token, logprob)
            if reason is None and self.structured.accept(seq, token):
                reason = ("stop", None)  # the grammar is complete: nothing may follow
            if reason is not None:
                return reason
        return None

    def _finish(self, seq: Sequence, reason, now: float) -> None:
        self.scheduler.finish(seq, *reason)
        if self.kv_connector is not None:
            self.kv_connector.on_finish(seq, reason[0])
        if self.spec is not None:
            self.spec.forget(seq.seq_id)
            self.proposer.release(seq.seq_id)
        self.stats.finished_by_reason[reason[0]] += 1
        if seq.first_token_time is not None and seq.num_output_tokens > 1:
            self.stats.observe("tpot", (now - seq.first_token_time) / (seq.num_output_tokens - 1))

    # -- the runner's processes --------------------------------------------------------------
    def check_health(self) -> None:
        """Raise if the engine can no longer compute (a tensor-parallel rank died)."""
        self.runner.check_health()

    # -- cache state for the replica server (replica_load.py) -------------------------------
    def load(self) -> dict:
        return engine_load(self)

    def kv_snapshot(self) -> dict:
        return kv_snapshot(self)
