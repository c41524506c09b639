"""A vLLM-style KV event publisher for the gateway tests: kvgate's ZmqEventPublisher (vLLM's wire
and replay protocol, the structs of protocol/kv_events.py written field for field after vLLM's),
with a socket wrapper that can drop a live batch (a gap the replay must fill) or corrupt one."""

from __future__ import annotations

import hashlib
import socket

from backend_engine.server.kv_publisher import KVEventsConfig, ZmqEventPublisher
from protocol.kv_events import BlockStored, KVEventBatch


def free_ports(n: int) -> list[int]:
    """n consecutive free ports (DP ranks publish on port + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return list(range(base, base + n))
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


class FaultyPub:
    """Wraps the publisher's PUB socket (used only on its thread): drops or corrupts batches."""

    def __init__(self, sock) -> None:  # noqa: ANN001
        self.sock = sock
        self.drop = 0  # drop the next N batches on the live stream (they stay in the replay buffer)
        self.corrupt = 0  # replace the next N payloads with bytes that are not a batch
        self.extra: list[list[bytes]] = []  # raw messages to send before the next batch

    def send_multipart(self, frames) -> None:  # noqa: ANN001
        while self.extra:
            self.sock.send_multipart(self.extra.pop(0))
        if self.drop:
            self.drop -= 1
            return
        if self.corrupt:
            self.corrupt -= 1
            frames = (frames[0], frames[1], b"\x93not a batch")
        self.sock.send_multipart(frames)

    def close(self, linger: int = 0) -> None:
        self.sock.close(linger)


def publisher(port: int, replay_port: int | None, rank: int = 0) -> tuple[ZmqEventPublisher, FaultyPub]:
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{replay_port}" if replay_port else None)
    pub = ZmqEventPublisher(config, data_parallel_rank=rank)
    faulty = FaultyPub(pub._pub)
    pub._pub = faulty
    return pub, faulty


def engine_hash(parent: int | None, tokens: list[int]) -> int:
    """A 64-bit engine hash unlike ours (vLLM's sha256, truncated as with int hashes)."""
    data = (parent or 0).to_bytes(8, "big") + repr(tokens).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")


def chain(tokens: list[int], bs: int = 16, parent: int | None = None) -> list[int]:
    out = []
    for i in range(len(tokens) // bs):
        parent = engine_hash(parent, tokens[i * bs:(i + 1) * bs])
        out.append(parent)
    return out


def stored_batch(tokens: list[int], parent: int | None = None, bs: int = 16,
                 first: int = 0) -> tuple[KVEventBatch, list[int]]:
    """One BlockStored for the full blocks of tokens[first*bs:], as vLLM's cache_full_blocks."""
    hashes = chain(tokens, bs)
    new = hashes[first:]
    event = BlockStored(new, hashes[first - 1] if first else parent, tokens[first * bs:len(hashes) * bs],
                        bs, None, "GPU", None)
    return KVEventBatch(0.0, [event]), hashes
