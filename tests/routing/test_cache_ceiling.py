from benchmarks.cache_ceiling import cache_ceilings


def test_ceilings_by_whole_block_and_by_token():
    a = list(range(40))
    b = list(range(37)) + [99, 98, 97]  # shares 37 tokens with a: 2 whole blocks
    got = cache_ceilings([a, b], block_size=16)
    assert got == {"whole_blocks": round(32 / 80, 4), "by_token": round(37 / 80, 4)}
    assert cache_ceilings([a, a], block_size=16) == {"whole_blocks": round(32 / 80, 4),
                                                     "by_token": round(39 / 80, 4)}
    assert cache_ceilings([], 16) == {"whole_blocks": 0.0, "by_token": 0.0}
