"""The overload queue's turns never stall: whatever sequence of refusals its requests meet,
the first request in line that is neither sent nor holding on to a replica is always trying,
so requests waiting their turn are served once a replica has room, not at the queue's maximum
wait. In process, on the queue alone, with attempts that refuse or take as scripted."""

from __future__ import annotations

import asyncio

import pytest

from gateway.overload_queue import Overloaded, OverloadQueue

pytestmark = pytest.mark.timeout(30)
MAX_WAIT_S = 10.0


async def test_a_held_request_refused_without_a_preferred_replica_keeps_holding():
    """A request holding on to its prefix's replica, refused on a later pass whose first pick was
    another replica, goes on holding; when its hold ends it is the head and keeps trying, and so
    do the requests behind it (it used to wait for a turn nobody gave it, and so did they)."""
    queue = OverloadQueue(capacity=8, max_wait_s=MAX_WAIT_S, affinity_s=0.3)
    room = asyncio.Event()
    passes = {"held": 0, "behind": 0}

    def attempt_of(request_id: str):
        async def attempt(hold, dispatched):
            passes[request_id] += 1
            await asyncio.sleep(0.01)
            if room.is_set():
                dispatched()
                return request_id
            if request_id == "held" and passes["held"] == 1:
                return Overloaded(0.2, preferred="a")  # its prefix's replica refused: hold
            return Overloaded(0.2)  # no replica has room (the first pick held no prefix)
        return attempt

    held = asyncio.create_task(queue.serve("held", attempt_of("held"), Overloaded(0.2)))
    await asyncio.sleep(0.05)
    behind = asyncio.create_task(queue.serve("behind", attempt_of("behind"), Overloaded(0.2)))
    await asyncio.sleep(0.05)
    # the held request meets a pass whose first pick held no prefix: then its hold runs out
    await asyncio.sleep(0.3 + 1.0)
    room.set()
    queue.notify_freed()
    done = await asyncio.wait_for(asyncio.gather(held, behind), 3.0)
    assert sorted(done) == ["behind", "held"]
    assert queue.summary()["total_timed_out"] == 0 and len(queue) == 0
