"""The canonical block hash, frozen: an engine or gateway that computes other values breaks
prefix matching silently, so these literals must never change."""

import struct

import pytest
import xxhash

from routing.hashing import block_hashes, namespace_for, root_hash

MODEL = "SmolLM2-135M-Instruct"


def test_root_hash_vectors():
    assert root_hash(MODEL) == 5666169324055992704
    assert root_hash("") == 3244421341483603138


def test_block_hash_vectors_for_tokens_0_to_31():
    assert block_hashes(list(range(32)), MODEL) == [16789152398595001131, 12651469057204200445]


def test_block_hash_vectors_with_cache_salt():
    ns = namespace_for(MODEL, "tenant-a")
    assert ns == "SmolLM2-135M-Instruct|tenant-a"
    assert block_hashes(list(range(32)), ns) == [3989201205086783933, 1450078623460932550]


def test_block_hash_vectors_small_block_and_max_token():
    assert block_hashes([1, 2, 3, 4], "m", block_size=4) == [5272644799954975652]
    # The trailing 5 tokens do not make a full block and are not hashed.
    assert block_hashes([4294967295] * 16 + [0] * 5, "m") == [11158587189008745486]


def test_spec_rederived_from_xxh3_and_struct():
    tokens = list(range(100, 132))
    h = xxhash.xxh3_64_intdigest(MODEL.encode(), seed=0)
    expected = []
    for i in range(2):
        block = tokens[16 * i:16 * (i + 1)]
        h = xxhash.xxh3_64_intdigest(struct.pack("<Q", h) + struct.pack("<16I", *block))
        expected.append(h)
    assert block_hashes(tokens, MODEL) == expected


def test_namespace_and_cache_salt_separate_tenants():
    tokens = list(range(64))
    plain = block_hashes(tokens, namespace_for(MODEL))
    tenant_a = block_hashes(tokens, namespace_for(MODEL, "a"))
    tenant_b = block_hashes(tokens, namespace_for(MODEL, "b"))
    other_model = block_hashes(tokens, namespace_for("other-model"))
    chains = [plain, tenant_a, tenant_b, other_model]
    for i, x in enumerate(chains):
        for y in chains[i + 1:]:
            assert not set(x) & set(y)


def test_prefix_chain_is_shared_only_up_to_first_difference():
    a = block_hashes(list(range(64)), MODEL)
    b = block_hashes(list(range(32)) + [7] * 32, MODEL)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]


def test_out_of_range_token_is_rejected():
    with pytest.raises(ValueError):
        block_hashes([2**32] * 16, MODEL)
