"""Pinned prefixes: an admin names a prompt prefix whose full KV blocks must never be evicted.

A pin is warmed by a prefill-only request (max_tokens=1) through the ordinary request path;
when it finishes, the block hashes that request computed (routing/hashing via the KV cache
manager) are pinned in the block pool, all or nothing, within the pool's pinned capacity.
`prepare` runs on any thread and only reads; `begin`, `complete`, `abort` and `unpin` run on
the engine thread, which owns the pool."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from backend_engine.block_pool import BlockNotCachedError, BlockPool, PinnedCapacityError
from backend_engine.errors import InvalidRequestError
from backend_engine.kv_block import KVBlock
from routing.hashing import block_hashes

WARMING, PINNED = "warming", "pinned"


class PinCapacityError(InvalidRequestError):
    def __init__(self, message: str):
        super().__init__(message, param="prompt", code="pinned_capacity_exceeded")


@dataclass(slots=True)
class Pin:
    pin_id: str
    namespace: str
    num_tokens: int  # the prefix's tokens (only its full blocks are pinned)
    block_hashes: list[int]
    cache_salt: str | None = None
    excerpt: str = ""
    state: str = WARMING
    created: float = field(default_factory=time.time)
    blocks: list[KVBlock] = field(default_factory=list)

    def view(self) -> dict:
        return {"id": self.pin_id, "state": self.state, "num_tokens": self.num_tokens,
                "num_blocks": len(self.block_hashes), "cache_salt": self.cache_salt,
                "excerpt": self.excerpt, "created": int(self.created)}


class PinTable:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.pins: dict[str, Pin] = {}  # pinned, by pin id
        self.warming: dict[str, Pin] = {}  # by the warming request's id
        self.failures: dict[str, Exception] = {}  # pin id → why warming did not pin

    def prepare(self, pin_id: str, token_ids: list[int], namespace: str,
                cache_salt: str | None = None, excerpt: str = "") -> Pin:
        """A new pin for these tokens, checked against the capacity (raises InvalidRequestError)."""
        if self.pool.max_pinned_blocks == 0:
            raise PinCapacityError("this replica has no pinned capacity (prefix caching off or "
                                   "max_pinned_fraction 0)")
        num_full = len(token_ids) // self.block_size
        if num_full == 0:
            raise InvalidRequestError(
                f"the prefix has {len(token_ids)} tokens; pinning needs at least one full block "
                f"of {self.block_size}", param="prompt", code="invalid_value")
        hashes = block_hashes(token_ids[:num_full * self.block_size], namespace, self.block_size)
        existing = self.pins.get(pin_id)
        if existing is not None and existing.block_hashes != hashes:
            raise InvalidRequestError(f"pin id {pin_id!r} already pins a different prefix",
                                      param="id", code="invalid_value")
        self._check_capacity(hashes)
        return Pin(pin_id, namespace, len(token_ids), hashes, cache_salt, excerpt)

    def _check_capacity(self, hashes: list[int]) -> None:
        new = 0
        for h in hashes:
            block = self.pool.lookup(h)
            new += block is None or block.pin_cnt == 0
        used, cap = self.pool.num_pinned_blocks, self.pool.max_pinned_blocks
        if used + new > cap:
            raise PinCapacityError(
                f"pinning this prefix needs {new} more KV blocks, but {used} of the {cap} "
                f"pinnable blocks ({cap * self.block_size} tokens) are pinned already; unpin "
                f"something or raise max_pinned_fraction")

    # -- engine thread -----------------------------------------------------------------------
    def begin(self, request_id: str, pin: Pin) -> None:
        self.failures.pop(pin.pin_id, None)
        self.warming[request_id] = pin

    def complete(self, request_id: str, computed_hashes: list[int], largest_need: int = 0) -> None:
        """The warming request computed its prompt: pin those blocks (once per pin id), unless
        a request in flight, `largest_need` blocks at most, would then no longer fit."""
        pin = self.warming.pop(request_id, None)
        if pin is None:
            return
        if pin.pin_id in self.pins:  # pushed twice: the first one holds the blocks
            return
        try:
            if computed_hashes[:len(pin.block_hashes)] != pin.block_hashes:
                raise BlockNotCachedError("the warmed prefix hashed differently")
            blocks = [self.pool.lookup(h) for h in pin.block_hashes]
            new = sum(1 for b in blocks if b is None or b.pin_cnt == 0)
            if largest_need > self.pool.num_blocks - self.pool.num_pinned_blocks - new:
                raise PinnedCapacityError(
                    f"a request in flight needs {largest_need} KV blocks, which would no longer "
                    f"fit beside this pin; retry when it has finished")
            pin.blocks = self.pool.pin(pin.block_hashes)
        except PinnedCapacityError as exc:
            self.failures[pin.pin_id] = PinCapacityError(str(exc))
            return
        except BlockNotCachedError as exc:
            self.failures[pin.pin_id] = RuntimeError(f"warming did not cache the prefix: {exc}")
            return
        pin.state = PINNED
        self.pins[pin.pin_id] = pin

    def abort(self, request_id: str) -> None:
        pin = self.warming.pop(request_id, None)
        if pin is not None:
            self.failures[pin.pin_id] = RuntimeError("the warming request was aborted")

    def unpin(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        self.pool.unpin(pin.blocks)
        pin.blocks = []
        return True

    # -- any thread --------------------------------------------------------------------------
    def num_pinned_prefix_blocks(self, token_ids: list[int], namespace: str) -> int:
        """How many of these tokens' leading full blocks are pinned (a request reuses them)."""
        num_full = min(len(token_ids) // self.block_size, self.pool.max_pinned_blocks)
        count = 0
        for h in block_hashes(token_ids[:num_full * self.block_size], namespace, self.block_size):
            block = self.pool.lookup(h)
            if block is None or block.pin_cnt == 0:
                break
            count += 1
        return count

    def capacity(self) -> dict:
        return {"pinned_blocks": self.pool.num_pinned_blocks,
                "max_pinned_blocks": self.pool.max_pinned_blocks,
                "num_pins": len(self.pins)}

    def views(self) -> list[dict]:
        return [pin.view() for pin in list(self.pins.values())]
