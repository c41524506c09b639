"""LLMEngine: requests in, one step at a time, incremental outputs out.

add_request → scheduler.schedule() → model_runner.execute() → append tokens, detokenise,
check stops → free finished blocks → flush KV events → RequestOutputs. Not thread-safe: the
async engine drives it from one thread."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from backend_engine.block_pool import BlockPool
from backend_engine.config import EngineConfig
from backend_engine.detokenizer import IncrementalDetokenizer, TokenTexts
from backend_engine.errors import ContextLengthExceededError, InvalidRequestError
from backend_engine.kv_cache_manager import KVCacheManager
from backend_engine.metrics import EngineStats
from backend_engine.model_loader import check_architecture, resolve_model
from backend_engine.model_runner import ModelRunner
from backend_engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from backend_engine.sampler import SamplerOutput, SamplingRow
from backend_engine.sampling_params import SamplingParams
from backend_engine.scheduler import Scheduler
from backend_engine.sequence import Sequence
from routing.hashing import NAMESPACE_RULE, namespace_for


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    outputs: list[CompletionOutput]
    arrival_time: float
    prompt: str | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        files = resolve_model(config.model)
        self.model_id = config.served_model_name or files.model_id
        self.hf_config = AutoConfig.from_pretrained(files.folder)
        check_architecture(self.hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(files.folder)
        self.max_model_len = self._max_model_len(config)
        self.runner = ModelRunner(config, files.folder, self.hf_config, self.max_model_len)
        self.block_size = config.block_size
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching,
                              config.kv_event_buffer)
        self.kv = KVCacheManager(self.pool, config.block_size)
        self.scheduler = Scheduler(config, self.kv)
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self.token_texts = TokenTexts(self.tokenizer)
        self.eos_token_ids = self._eos_ids(files.folder)

    def _max_model_len(self, config: EngineConfig) -> int:
        limit = self.hf_config.max_position_embeddings
        window = getattr(self.hf_config, "sliding_window", None)
        if window:  # full attention is exact only inside the window
            limit = min(limit, window)
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
    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate a request without touching engine state (safe from any thread); returns
        the effective max_tokens."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt", code="invalid_value")
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})",
                                      param="prompt", code="invalid_value")
        room = self.max_model_len - n
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            asked = n + (params.max_tokens or 1)
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {asked} tokens ({n} in the prompt, {asked - n} for the "
                f"completion). Please reduce the length of the prompt or the completion.")
        pool_room = self.kv_capacity_tokens - n
        if pool_room < 1:
            raise ContextLengthExceededError(
                f"the prompt ({n} tokens) does not fit in this replica's KV cache "
                f"({self.kv_capacity_tokens} tokens)")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        return min(max_tokens, pool_room)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, prompt: str | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        max_tokens = self.check_request(prompt_token_ids, params)
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
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                         params.include_stop_str_in_output,
                                         params.skip_special_tokens) for _ in seqs]
        outputs = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                   for i in range(params.n)]
        self.requests[request_id] = RequestState(request_id, list(prompt_token_ids), params,
                                                 seqs, detoks, outputs, arrival, prompt)
        for seq in seqs:
            self.scheduler.add(seq)
        self.stats.prompt_tokens += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq, out in zip(state.seqs, state.outputs):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                out.finish_reason = "abort"
                self.stats.finished_by_reason["abort"] += 1
        self.scheduler.sweep_finished()
        self.pool.flush_events()
        return self._make_output(state, finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        if not sched:
            self.pool.flush_events()
            return []
        rows = {seq: self._sampling_row(seq) for seq, _ in sched.scheduled}
        sampled, result = self.runner.execute(sched.scheduled, rows)
        now = time.monotonic()
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.kv.cache_computed_blocks(seq)  # before a finish frees the blocks
        touched: dict[str, RequestState] = {}
        for i, seq in enumerate(sampled):
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            self._accept_token(state, seq, result, i, now)
            touched[state.request_id] = state
        self.scheduler.sweep_finished()
        self.pool.flush_events()
        self.stats.prefix_cache_queries = self.kv.prefix_cache_queries
        self.stats.prefix_cache_hits = self.kv.prefix_cache_hits
        outputs = []
        for state in touched.values():
            finished = all(s.is_finished for s in state.seqs)
            outputs.append(self._make_output(state, finished))
            if finished:
                del self.requests[state.request_id]
                self.stats.observe("e2e", now - state.arrival_time)
        return outputs

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        blocked = []
        if seq.num_output_tokens < p.min_tokens:
            blocked = list(self.eos_token_ids | set(p.stop_token_ids))
        return SamplingRow(p, seq.prompt_token_ids, seq.output_token_ids, seq.generator, blocked)

    def _accept_token(self, state: RequestState, seq: Sequence, result: SamplerOutput, i: int,
                      now: float) -> None:
        token = result.token_ids[i]
        seq.append_token(token)
        self.stats.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.stats.observe("ttft", now - seq.arrival_time)
        out = state.outputs[seq.index]
        if out.logprobs is not None and result.logprobs is not None:
            top = []
            if result.top_ids is not None and seq.params.logprobs:
                k = seq.params.logprobs
                top = [(t, self.token_texts(t), lp) for t, lp in
                       zip(result.top_ids[i][:k], result.top_logprobs[i][:k])]
            out.logprobs.append(TokenLogprob(token, self.token_texts(token),
                                             result.logprobs[i], top))
        self._check_stop(state, seq, token, now)

    def _check_stop(self, state: RequestState, seq: Sequence, token: int, now: float) -> None:
        p = seq.params
        past_min = seq.num_output_tokens >= p.min_tokens
        detok = state.detoks[seq.index]
        is_eos = token in self.eos_token_ids and not p.ignore_eos
        is_stop_id = token in p.stop_token_ids
        stop_str = None
        if not (is_eos or is_stop_id):
            stop_str = detok.add_token(token, check_stop=past_min)
        reason: tuple[str, str | int | None] | None = None
        if past_min and is_stop_id:
            reason = ("stop", token)
        elif past_min and is_eos:
            reason = ("stop", None)
        elif stop_str is not None:
            reason = ("stop", stop_str)
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = ("length", None)
        if reason is None:
            return
        self.scheduler.finish(seq, *reason)
        seq.finish_time = now
        self.stats.finished_by_reason[reason[0]] += 1
        if seq.first_token_time is not None and seq.num_output_tokens > 1:
            self.stats.observe("tpot", (now - seq.first_token_time) / (seq.num_output_tokens - 1))

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        for seq, detok, out in zip(state.seqs, state.detoks, state.outputs):
            done = seq.is_finished
            out.delta_text = detok.take_delta(done)
            out.text = detok.text[:detok.emitted]
            new_ids = seq.output_token_ids[len(out.token_ids):]
            out.delta_token_ids = new_ids
            out.token_ids = out.token_ids + new_ids
            if out.logprobs is not None:
                start = len(out.logprobs) - len(new_ids)
                out.delta_logprobs = out.logprobs[start:]
            out.finish_reason = seq.finish_reason if done else None
            out.stop_reason = seq.stop_reason if done else None
        cached = max(0, state.seqs[0].num_cached_tokens)
        metrics = {"arrival_time": state.arrival_time}
        if state.seqs[0].first_token_time is not None:
            metrics["first_token_time"] = state.seqs[0].first_token_time
        return RequestOutput(state.request_id, state.prompt_token_ids,
                             [CompletionOutput(o.index, o.text, list(o.token_ids),
                                               None if o.logprobs is None else list(o.logprobs),
                                               o.finish_reason, o.stop_reason, o.delta_text,
                                               o.delta_token_ids, o.delta_logprobs)
                              for o in state.outputs],
                             num_cached_tokens=cached, finished=finished, prompt=state.prompt,
                             metrics=metrics)

    # -- cache state for the replica server ------------------------------------------------
    def load(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_usage": round(self.pool.usage(), 4),
                "pending_prefill_tokens": self.scheduler.pending_prefill_tokens(),
                "num_free_blocks": self.pool.num_free_blocks,
                "num_total_blocks": self.pool.num_blocks}

    def kv_snapshot(self) -> dict:
        seq = self.pool.event_seq  # read before the blocks: replaying later events is idempotent
        return {"seq": seq, "block_size": self.block_size, "namespace_rule": NAMESPACE_RULE,
                "model": self.model_id, "blocks": self.pool.cached_hashes(), "load": self.load()}
