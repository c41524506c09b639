"""The parts of prefix-stability advice on their own: token-run comparison against a naive
loop, realignment after a divergent span, and which texts count as volatile fields and how
they are masked."""

from __future__ import annotations

import random

import pytest

from gateway.prefix_divergence import find_divergence, pack, run_length
from gateway.volatile_fields import (ID, NUMBER, TIMESTAMP, UUID, WORD, field_kind, mask_context_word,
                                     mask_field, pair_kind)


def naive_run(a: list[int], pa: int, b: list[int], pb: int) -> int:
    n = 0
    while pa + n < len(a) and pb + n < len(b) and a[pa + n] == b[pb + n]:
        n += 1
    return n


def test_run_length_matches_a_naive_loop():
    rng = random.Random(0)
    for _ in range(300):
        shared = [rng.randrange(50) for _ in range(rng.randrange(0, 600))]
        a = shared + [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
        b = shared + [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
        pa, pb = rng.randrange(len(a) + 1), rng.randrange(len(b) + 1)
        assert run_length(pack(a, 10**6), 0, pack(b, 10**6), 0) == naive_run(a, 0, b, 0)
        assert run_length(pack(a, 10**6), pa, pack(b, 10**6), pb) == naive_run(a, pa, b, pb)


def test_divergence_realigns_after_the_shortest_spans():
    head, tail = list(range(100, 130)), list(range(200, 264))
    new = pack(head + [1, 2, 3] + tail, 4096)
    old = pack(head + [7, 8] + tail, 4096)
    div = find_divergence(new, old, 30, 48, block_size=16, min_blocks=2)
    assert (div.start, div.new_end, div.old_end, div.tail) == (30, 33, 32, 64)
    # One side may be empty (a field added); a tail that cannot fill two more blocks (the
    # cache reaches token 16 today and would need to reach 48) is no gain.
    div = find_divergence(pack(head + tail, 4096), old, 30, 48, 16, 2)
    assert (div.new_end, div.old_end) == (30, 32)
    assert find_divergence(pack(head + [1] + tail[:17], 4096), pack(head + [2] + tail[:17], 4096),
                           30, 48, 16, 2) is None
    assert find_divergence(pack(head + [1] + tail[:18], 4096), pack(head + [2] + tail[:18], 4096),
                           30, 48, 16, 2) is not None


def test_a_span_longer_than_the_limit_is_not_realigned():
    head, tail = list(range(100, 130)), list(range(200, 264))
    new = pack(head + list(range(1000, 1060)) + tail, 4096)
    old = pack(head + list(range(2000, 2060)) + tail, 4096)
    assert find_divergence(new, old, 30, 48, 16, 2) is None
    assert find_divergence(new, old, 30, 64, 16, 2) is not None


@pytest.mark.parametrize("text,kind", [
    ("2025-03-14 09:26:53", TIMESTAMP), ("2025-03-14T09:26:53Z", TIMESTAMP), ("14/03/2025", TIMESTAMP),
    ("09:26", TIMESTAMP), ("4711", NUMBER), ("1,234.50", NUMBER),
    ("3f2a9c1e-8b7d-4e2f-9a1b-0c3d5e7f9a2b", UUID), ("req_8f3k2j9d0a", ID), ("A1B2C3D4", ID),
    ("Alice", WORD), ("Chiara Rossi", WORD), ("O'Neil", WORD), ("user 42", NUMBER), ("", ""),
    ("a sentence of many more words than any name has", None),
    ("x" * 80, None), ("Summarize the following article in three bullet points please", None),
])
def test_field_kinds(text, kind):
    assert field_kind(text) == kind


def test_a_pair_needs_both_sides_to_be_fields():
    assert pair_kind("10:32:11", "11:47:02") == TIMESTAMP
    assert pair_kind("Alice", "") == WORD  # a name added to the template
    assert pair_kind("Alice", "the whole of a long and different paragraph here") is None
    assert pair_kind("", "") is None


def test_masks_keep_the_shape_and_drop_the_values():
    assert mask_field("2025-03-14 09:26:53") == "####-##-## ##:##:##"
    assert mask_field("3f2a9c1e-8b7d-4e2f-9a1b-0c3d5e7f9a2b") == "########-####-####-####-############"
    assert mask_field("Chiara Rossi") == "▇▇▇ ▇▇▇"
    assert mask_field("req_8f3k") == "▇▇▇_#▇#▇"
    assert mask_context_word("Today") == "Today"
    assert mask_context_word("order#4711") == "▇▇▇▇▇#####"
    assert mask_context_word("alice@example.com") == "▇▇▇"
