"""Shared checks for engine tests."""


def assert_no_leaks(engine) -> None:
    """Every block is free (possibly still cached) once no request is in flight."""
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
