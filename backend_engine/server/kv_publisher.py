"""A ZMQ KV event publisher that behaves as vLLM's `ZmqEventPublisher`, configured with vLLM's
`--kv-events-config` JSON, so routers that subscribe to vLLM (Dynamo, llm-d, vLLM's router, a
kvgate gateway with `--kv-events`) can follow a kvgate replica exactly.

- PUB socket: one message per batch, `(topic, seq as 8-byte big-endian, msgpack KVEventBatch)`,
  seq counting from 0 for this process. An endpoint with `*`, `::`, `ipc://` or `inproc://` is
  bound, any other is connected to.
- ROUTER replay socket: a request `(identity, b"", start seq)` gets every buffered batch with
  seq >= start as `(identity, b"", topic, seq, payload)`, then `(identity, b"", b"", -1, b"")`.
- A thread does the socket work, fed by a bounded queue, so the engine never waits on ZMQ.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from itertools import count

import msgspec
import zmq

from backend_engine.server.kv_events_config import KVEventsConfig
from protocol.kv_events import KVEventBatch, encode_batch, seq_bytes

logger = logging.getLogger(__name__)

END_SEQ = seq_bytes(-1)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule: rank r publishes on the endpoint's port + r (inproc gets a suffix)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if port == "0" else f"{base}:{int(port) + data_parallel_rank}"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 context: zmq.Context | None = None) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay: zmq.Socket | None = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s%s", self.endpoint,
                    f" (replay {self.replay_endpoint})" if self.replay_endpoint else "")

    def publish(self, batch: KVEventBatch) -> None:
        """Queue a batch; when the queue is full the batch is dropped (subscribers see a gap and
        replay, as with vLLM's high-water mark) rather than stalling the engine."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV event queue full: a batch was dropped")

    def shutdown(self, timeout_s: float = 1.0) -> None:
        self._running = False
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=timeout_s)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV event replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            seq = next(self._seq)
            payload = encode_batch(batch, encoder)
            try:
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
            except zmq.ZMQError:
                logger.exception("KV event publish failed")
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("invalid KV event replay request of %d frames", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", self._topic, seq_bytes(seq), payload))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
