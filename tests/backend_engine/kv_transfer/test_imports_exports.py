"""The block bookkeeping on both sides of a transfer: what is held, reserved, registered and
freed, without any transport."""

from backend_engine.block_pool import BlockPool
from backend_engine.kv_transfer.base import KVSender
from backend_engine.kv_transfer.exports import KVExports
from backend_engine.kv_transfer.imports import KVImports
from backend_engine.kv_transfer.params import RemoteDecode
from backend_engine.kv_transfer.wire import KVLayout
from backend_engine.sampling_params import SamplingParams
from backend_engine.sequence import Sequence
from routing.hashing import block_hashes

HASHES = block_hashes(list(range(64)), "m", 16)  # four blocks


def _all_free(pool: BlockPool) -> bool:
    return pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def _cache(pool: BlockPool, hashes: list[int]) -> None:
    """Blocks computed earlier by an ordinary request, now free but cached."""
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.release(blocks)


def test_reserve_holds_cached_blocks_and_reserves_the_rest():
    pool = BlockPool(32)
    _cache(pool, HASHES[:2])
    imports = KVImports(pool)
    reservation = imports.reserve("t", HASHES)
    assert reservation.need == [2, 3] and len(reservation.block_ids) == 2
    assert pool.num_free_blocks == 32 - 4  # two held, two reserved
    assert pool.lookup(HASHES[0]).hits == 0  # a hold is not a prefix-cache hit


def test_completed_blocks_enter_the_cache_and_stay_held_until_claimed():
    pool = BlockPool(32)
    imports = KVImports(pool)
    reservation = imports.reserve("t", HASHES)
    pool.flush_events()
    assert imports.complete("t", reservation.need) == 4
    event = pool.flush_events()
    assert event.stored == HASHES  # they appear in the replica's KV events
    assert pool.num_free_blocks == 28  # held for the request that follows
    blocks = imports.claim("t")
    assert [b.block_hash for b in blocks] == HASHES
    imports.release(blocks)
    assert _all_free(pool) and all(pool.lookup(h) for h in HASHES)  # free, and still cached


def test_a_failed_transfer_registers_nothing_and_frees_everything():
    pool = BlockPool(32)
    _cache(pool, HASHES[:1])
    imports = KVImports(pool)
    imports.reserve("t", HASHES)
    imports.fail("t")
    assert _all_free(pool)
    assert [pool.lookup(h) is not None for h in HASHES] == [True, False, False, False]
    assert imports.claim("t") is None and imports.held_blocks == 0


def test_unreceived_blocks_go_back_and_only_received_ones_are_cached():
    pool = BlockPool(32)
    imports = KVImports(pool)
    imports.reserve("t", HASHES)
    assert imports.complete("t", [0, 1]) == 2
    imports.release(imports.claim("t"))
    assert _all_free(pool)
    assert [pool.lookup(h) is not None for h in HASHES] == [True, True, False, False]


def test_reservation_is_a_prefix_that_leaves_headroom():
    pool = BlockPool(20)  # headroom: 1 block
    busy = pool.allocate(16)
    imports = KVImports(pool)
    reservation = imports.reserve("t", HASHES)  # 4 free, 3 may be taken
    assert reservation.need == [0, 1, 2]
    imports.fail("t")
    pool.release(busy)
    assert _all_free(pool)


def test_unclaimed_holds_expire():
    now = [0.0]
    pool = BlockPool(32)
    imports = KVImports(pool, claim_ttl_s=5.0, clock=lambda: now[0])
    imports.complete("t", imports.reserve("t", HASHES).need)
    now[0] = 4.0
    assert imports.expire() == 0 and not _all_free(pool)
    now[0] = 6.0
    assert imports.expire() == 1 and _all_free(pool)


def test_two_transfers_of_the_same_blocks_keep_one_copy():
    pool = BlockPool(32)
    imports = KVImports(pool)
    first, second = imports.reserve("a", HASHES), imports.reserve("b", HASHES)
    imports.complete("a", first.need)
    assert imports.complete("b", second.need) == 0
    a, b = imports.claim("a"), imports.claim("b")
    assert [x.block_id for x in a] == [x.block_id for x in b]
    imports.release(a)
    imports.release(b)
    assert _all_free(pool)


def test_duplicate_transfer_id_is_refused():
    imports = KVImports(BlockPool(32))
    imports.reserve("t", HASHES)
    assert imports.reserve("t", HASHES).error


class RecordingSender(KVSender):
    def __init__(self):
        self.calls = []

    def start(self, spec):
        self.calls.append(("start", spec.hashes))

    def offer(self, transfer_id, blocks):
        self.calls.append(("offer", [i for i, _ in blocks]))

    def close(self, transfer_id):
        self.calls.append(("close",))

    def abort(self, transfer_id, reason):
        self.calls.append(("abort",))

    def shutdown(self):
        pass

    in_flight = 0


def _prefill_seq(pool: BlockPool, num_tokens: int) -> Sequence:
    seq = Sequence("r-0", "r", 0, list(range(num_tokens)), SamplingParams(), "m", 1)
    seq.block_table = pool.allocate(-(-num_tokens // 16))
    return seq


def test_exports_offer_computed_prompt_blocks_as_they_complete_and_hold_them():
    pool = BlockPool(32)
    sender = RecordingSender()
    exports = KVExports(pool, 16, sender, KVLayout("m", 16, 1, 1, 1, "float32"))
    seq = _prefill_seq(pool, 70)  # four full blocks and a partial one
    exports.begin(seq, RemoteDecode("t", "tcp://x:1"))
    seq.num_computed_tokens = 40  # a first chunk
    exports.on_computed(seq)
    assert sender.calls[0] == ("start", block_hashes(seq.prompt_token_ids, "m", 16))
    seq.num_computed_tokens = 70
    exports.on_computed(seq)
    assert sender.calls[1:] == [("offer", [0, 1]), ("offer", [2, 3])]
    pool.release(seq.block_table)  # the request ends: the holds keep the offered blocks
    assert exports.held_blocks == 4 and pool.num_free_blocks == 28
    exports.on_finish(seq, "length")
    assert sender.calls[-1] == ("close",)
    exports.released("t", [seq.block_table[0].block_id])
    exports.finished("t")
    assert _all_free(pool) and exports.held_blocks == 0


def test_an_aborted_prefill_aborts_its_transfer():
    pool = BlockPool(32)
    sender = RecordingSender()
    exports = KVExports(pool, 16, sender, KVLayout("m", 16, 1, 1, 1, "float32"))
    seq = _prefill_seq(pool, 40)
    exports.begin(seq, RemoteDecode("t", "tcp://x:1"))
    seq.num_computed_tokens = 32
    exports.on_computed(seq)
    exports.on_finish(seq, "abort")
    assert sender.calls[-1] == ("abort",)
    pool.release(seq.block_table)
    exports.finished("t")
    assert _all_free(pool)


def test_a_transfer_opens_when_its_prefill_starts_computing_not_while_it_queues():
    pool = BlockPool(32)
    sender = RecordingSender()
    exports = KVExports(pool, 16, sender, KVLayout("m", 16, 1, 1, 1, "float32"))
    seq = _prefill_seq(pool, 40)
    exports.begin(seq, RemoteDecode("t", "tcp://x:1"))
    assert sender.calls == []  # queued: the decode replica reserves nothing yet
    assert exports.on_finish(seq, "abort") == "t"  # aborted while queued: nothing to tell anyone
    assert sender.calls == []
    pool.release(seq.block_table)
    assert _all_free(pool)
