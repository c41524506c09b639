"""The canonical prefix block hash: the one function the engine's prefix cache and every
gateway's index share, so a gateway's prediction and an engine's event name the same block.

    h0 = xxh3_64(namespace as UTF-8, seed 0)
    h_i = xxh3_64(le_u64(h_{i-1}) || le_u32(token) for each token of block i)   (full blocks only)

The namespace is the model id, extended with the request's cache_salt or tenant when given,
so different tenants never share (or probe) each other's cached blocks.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import xxhash

DEFAULT_BLOCK_SIZE = 16
NAMESPACE_RULE = "model[|salt]"

_U64 = struct.Struct("<Q")
_MAX_TOKEN = 0xFFFFFFFF
_LITTLE_ENDIAN = array("I").itemsize == 4 and struct.pack("=I", 1) == struct.pack("<I", 1)


def namespace_for(model: str, cache_salt: str | None = None) -> str:
    """The namespace string for a model and an optional per-request salt or tenant."""
    return model if not cache_salt else f"{model}|{cache_salt}"


def root_hash(namespace: str) -> int:
    return xxhash.xxh3_64_intdigest(namespace.encode("utf-8"), seed=0)


def _tokens_le_u32(tokens: Sequence[int]) -> bytes:
    try:
        packed = array("I", tokens)
    except OverflowError as exc:
        raise ValueError("token ids must be in [0, 2**32)") from exc
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def block_hash(parent: int, block_tokens: Sequence[int]) -> int:
    """Hash of one full block chained on its parent's hash."""
    return xxhash.xxh3_64_intdigest(_U64.pack(parent) + _tokens_le_u32(block_tokens))


def block_hashes(
    token_ids: Sequence[int],
    namespace: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped).

    `parent` continues a chain (the hash of the block before `token_ids[0]`); by default the
    chain starts at the namespace's root.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    h = root_hash(namespace) if parent is None else parent
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    data = _tokens_le_u32(token_ids[: num_full * block_size])
    stride = 4 * block_size
    out: list[int] = []
    digest = xxhash.xxh3_64_intdigest
    for i in range(num_full):
        h = digest(_U64.pack(h) + data[i * stride : (i + 1) * stride])
        out.append(h)
    return out
