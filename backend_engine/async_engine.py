"""The async engine: an engine thread runs the step loop; callers on the event loop add
requests and read their incremental outputs from per-request queues. Torch releases the GIL
during the forward pass, so the event loop stays responsive while the engine computes.

The engine thread also builds the engine (loads, quantises, calibrates, compiles), so every
parallel torch op of the replica runs on that one thread. OpenMP (libgomp) gives each thread
that enters a parallel region its own team of workers, and with more workers than CPUs it
throttles their spinning, so every small op pays a wake-up: a model loaded on one thread and run
on another decodes far slower than on the loading thread."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable

from backend_engine.chat import render_chat
from backend_engine.config import EngineConfig
from backend_engine.engine import LLMEngine
from backend_engine.errors import EngineDeadError, EngineOverloadedError
from backend_engine.kv_transfer.params import RemoteDecode, RemotePrefill, check_kv_transfer
from backend_engine.outputs import RequestOutput
from backend_engine.pins import Pin
from backend_engine.request_progress import FINISHED, WAITING, RequestProgress, progress_of
from backend_engine.sampling_params import SamplingParams
from routing.hashing import NAMESPACE_RULE, namespace_for

log = logging.getLogger("kvgate.engine")
_IDLE_WAIT_S = 0.05


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig):
        """Builds the engine on its own thread and waits for it; the step loop starts with
        `start()`. Raises what building raised (e.g. ModelLoadError)."""
        self.config = config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._go = threading.Event()  # set by start() (or shutdown()): run the step loop
        built: list = []  # the engine, or what building it raised
        ready = threading.Event()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._main, args=(built, ready), name="kvgate-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if isinstance(built[0], BaseException):
            self._thread.join()
            self._thread = None
            raise built[0]
        self.engine: LLMEngine = built[0]
        self.dead: BaseException | None = None
        self._event_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._waiters_lock = threading.Lock()
        # accepted by generate() but not yet picked up by the engine thread; each counter has
        # one writer thread, so no lock is needed
        self._num_submitted = 0
        self._num_picked = 0
        self._tokens_submitted = 0  # prompt tokens of those requests, likewise
        self._tokens_picked = 0
        self._load = self.engine.load()  # refreshed by the engine thread after every step
        if self.engine.kv_connector is not None:  # its threads post work to the engine thread
            self.engine.kv_connector.wake = self._wake.set

    # -- facts about the model --------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def stats(self):
        return self.engine.stats

    @property
    def spec_stats(self):
        """Speculative decoding counters, or None when speculation is off."""
        return self.engine.spec.stats if self.engine.spec is not None else None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                    continue_final_message: bool = False) -> list[int]:
        return render_chat(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs,
                           tools, continue_final_message)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._go.set()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._go.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None
        await asyncio.to_thread(self.engine.close)  # KV-transfer threads, tensor-parallel workers

    @property
    def is_running(self) -> bool:
        return (self._go.is_set() and self._thread is not None and self._thread.is_alive()
                and self.dead is None)

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, cache_salt: str | None = None,
                       prompt: str | None = None, pin: Pin | None = None,
                       priority: int = 0,
                       kv_transfer: RemoteDecode | RemotePrefill | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; `priority`: lower is served earlier (vLLM's);
        `kv_transfer`: this is one half of a prefill/decode pair (see LLMEngine.add_request)."""
        if self.dead is not None:
            raise EngineDeadError("the engine stopped after an internal error")
        self.engine.check_request(prompt_token_ids, params, cache_salt, priority)
        check_kv_transfer(kv_transfer, params, self.engine.hf_config.vocab_size,
                          self.engine.kv_connector)
        limit = self.config.max_waiting
        if limit is not None and self.num_waiting() >= limit:
            raise EngineOverloadedError("the waiting queue is full")
        self._admit(len(prompt_token_ids) * params.n)
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        self._num_submitted += 1
        self._tokens_submitted += len(prompt_token_ids) * params.n
        self._commands.put(("add", request_id, list(prompt_token_ids), params, cache_salt,
                            prompt, pin, priority, kv_transfer))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (disconnect, cancel): free at once
                self._commands.put(("abort", request_id))
                self._wake.set()

    def progress(self, request_ids: list[str]) -> RequestProgress | None:
        """Where these engine requests stand (request_progress.py); None: none is known here.
        Read without the engine thread, so a long or hung step cannot delay the answer."""
        seqs, unread = [], False
        for request_id in request_ids:
            state = self.engine.requests.get(request_id)
            if state is not None:
                seqs += state.seqs
            elif request_id in self._streams:  # ended, its outputs not yet read; or not yet added
                unread = True
        found = progress_of(seqs)
        if found is None and unread:
            return RequestProgress(WAITING if self._queued() else FINISHED, 0, 0, 0, 0, 0.0)
        return found

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def abort_kv_transfer(self, transfer_id: str) -> None:
        """Stop sending a prefill's blocks (its client left); a no-op once it has ended."""
        connector = self.engine.kv_connector
        if connector is not None and connector.sender is not None:
            connector.sender.abort(transfer_id, "the prefill's client left")

    # -- pinned prefixes -----------------------------------------------------------------------
    async def pin(self, pin_id: str, token_ids: list[int], cache_salt: str | None = None,
                  excerpt: str = "") -> dict:
        """Warm the prefix (a prefill-only request) and pin its full blocks; idempotent per id."""
        pins = self.engine.pins
        params = SamplingParams(max_tokens=1, temperature=0.0)
        self.engine.check_request(token_ids, params, cache_salt)
        pin = pins.prepare(pin_id, token_ids, namespace_for(self.model_id, cache_salt),
                           cache_salt, excerpt)
        if pin_id in pins.pins:
            return pins.pins[pin_id].view()
        async for _ in self.generate(token_ids, params, f"pin-{pin_id}-{uuid.uuid4().hex[:8]}",
                                     cache_salt, pin=pin):
            pass
        done = pins.pins.get(pin_id)
        if done is None:
            raise pins.failures.pop(pin_id, RuntimeError("the pin did not complete"))
        return done.view()

    async def unpin(self, pin_id: str) -> bool:
        return await self.call_in_engine(lambda: self.engine.pins.unpin(pin_id))

    def pins(self) -> list[dict]:
        return self.engine.pins.views()

    def pin_capacity(self) -> dict:
        return self.engine.pins.capacity()

    async def call_in_engine(self, fn: Callable[[], object]) -> object:
        """Run fn on the engine thread, which owns the block pool, and return its result."""
        if not self.is_running:
            return fn()  # no engine thread (not started, or stopped): nothing races with us
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, future))
        self._wake.set()
        return await future

    def _queued(self) -> int:
        return max(0, self._num_submitted - self._num_picked)

    def queue_delay_s(self, prompt_tokens: int = 0) -> float:
        """Expected wait before a request of prompt_tokens joining now gets its first token."""
        load = self._load
        pending = (load["pending_prefill_tokens"] + prompt_tokens
                   + max(0, self._tokens_submitted - self._tokens_picked))
        rate = load.get("drain_rate_tok_s") or 0.0
        if pending <= 0 or load["running"] + load["waiting"] + self._queued() == 0:
            return 0.0  # an idle replica takes the request at once
        return pending / rate if rate > 0 else float("inf")

    def _admit(self, prompt_tokens: int) -> None:
        """Refuse (503 + Retry-After) a request that would wait past max_queue_delay_s."""
        bound = self.config.max_queue_delay_s
        if not bound:  # None or 0: never refuse
            return
        delay = self.queue_delay_s(prompt_tokens)
        if delay <= bound:
            return
        self.engine.stats.admission_refused += 1
        retry = int(min(30.0, max(1.0, delay - bound)))
        raise EngineOverloadedError(
            f"a new request would wait ~{min(delay, 9999):.0f} s for its first token here, over "
            f"this replica's bound of {bound:g} s", retry)

    def num_waiting(self) -> int:
        return self._load["waiting"] + self._queued()

    # -- engine thread -------------------------------------------------------------------------
    def _main(self, built: list, ready: threading.Event) -> None:
        try:
            built.append(LLMEngine(self.config))
        except BaseException as exc:  # raised again by __init__, on the caller's thread
            built.append(exc)
            return
        finally:
            ready.set()
        self._go.wait()
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self.engine.check_health()  # a dead tensor-parallel rank ends the loop
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.engine.housekeeping()  # KV-transfer work also arrives while idle
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                seq_before = self.engine.pool.event_seq
                outputs = self.engine.step()
                # load first: a caller woken by an output must not read an older load
                self._load = self.engine.load()
                for out in outputs:
                    self._deliver(out.request_id, out)
                if self.engine.pool.event_seq != seq_before:
                    self._notify_event_waiters()
        except BaseException as exc:  # report to every caller instead of hanging them
            log.exception("engine loop failed")
            self.dead = exc
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"engine failed: {exc}"))

    def _apply_commands(self) -> None:
        changed = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                _, request_id, tokens, params, salt, prompt, pin, priority, kv_transfer = cmd
                self._num_picked += 1
                self._tokens_picked += len(tokens) * params.n
                if request_id not in self._streams:
                    continue  # aborted before it reached the engine
                try:
                    self.engine.add_request(request_id, tokens, params, salt, prompt, pin=pin,
                                            priority=priority, kv_transfer=kv_transfer)
                except Exception as exc:
                    self._deliver(request_id, exc)
            elif cmd[0] == "call":
                self._resolve(cmd[2], cmd[1])
            else:
                out = self.engine.abort_request(cmd[1])
                if out is not None:  # ends the caller's stream with finish_reason "abort"
                    self._deliver(cmd[1], out)
                    changed = True
        self._load = self.engine.load()
        if changed:
            self._notify_event_waiters()

    @staticmethod
    def _resolve(future: asyncio.Future, fn: Callable[[], object]) -> None:
        try:
            result, error = fn(), None
        except Exception as exc:
            result, error = None, exc

        def settle() -> None:
            if not future.done():
                future.set_result(result) if error is None else future.set_exception(error)
        try:
            future.get_loop().call_soon_threadsafe(settle)
        except RuntimeError:  # the loop closed
            pass

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the loop closed
            pass

    # -- cache state -------------------------------------------------------------------------
    def load(self) -> dict:
        load = dict(self._load)
        load["waiting"] += self._queued()
        load["queue_delay_s"] = round(min(self.queue_delay_s(), 1e6), 3)
        # the admission bound: a router holds back what this replica would refuse (0: none)
        load["max_queue_delay_s"] = self.config.max_queue_delay_s or 0.0
        return load

    def num_free_blocks(self) -> int:
        return self.engine.pool.num_free_blocks

    def kv_snapshot(self) -> dict:
        seq = self.engine.pool.event_seq  # before the blocks: replaying later events is idempotent
        return {"seq": seq, "block_size": self.block_size,
                "namespace_rule": NAMESPACE_RULE, "model": self.model_id,
                "blocks": self.engine.pool.cached_hashes(), "load": self.load(),
                **({"tier_blocks": self.engine.pool.tier_hashes()}
                   if self.engine.pool.tier is not None else {}),
                **self.kv_transfer_info()}

    def kv_transfer_info(self) -> dict:
        """The replica's P/D role and, for a decode replica, where prefill replicas send to."""
        connector = self.engine.kv_connector
        info = {"role": self.config.kv_role}
        if connector is not None and connector.receiver is not None:
            info["kv_transfer_address"] = connector.receiver.address
        return info

    def kv_events_since(self, seq: int) -> list[dict] | None:
        events = self.engine.pool.events_since(seq)
        return None if events is None else [e.to_dict() for e in events]

    async def wait_kv_events(self, after_seq: int, timeout: float) -> None:
        if self.engine.pool.event_seq > after_seq:
            return
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self._waiters_lock:
            self._event_waiters.append(entry)
        try:
            if self.engine.pool.event_seq <= after_seq:
                await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._waiters_lock:
                if entry in self._event_waiters:
                    self._event_waiters.remove(entry)

    def _notify_event_waiters(self) -> None:
        with self._waiters_lock:
            waiters, self._event_waiters = self._event_waiters, []
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass

    def drain_observations(self) -> dict[str, list[float]]:
        return self.engine.stats.drain_observations()

    def drain_ttft_by_priority(self) -> list[tuple[int, float]]:
        return self.engine.stats.drain_ttft_by_priority()

    def drain_kv_transfer_seconds(self) -> list[float]:
        connector = self.engine.kv_connector
        return connector.drain_seconds() if connector is not None else []
