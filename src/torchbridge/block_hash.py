"""The chained block hash shared by the engine's prefix cache and the router's prefix index.

A prompt's tokens are cut into full blocks of `block_size`; block i hashes to
h_i = xxh64(le_u64(h_{i-1}) || le_i32(tokens of block i)), seed 0, with h_{-1} = 0. Equal keys mean
equal whole prefixes up to and including the block (up to hash collisions). The engine publishes these
keys as KV events, and a router that tokenizes as the engine does computes the same ones, so this
module is the one place the formula lives. It imports neither torch nor jax (the router uses it).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    return xxhash.xxh64_intdigest(parent.to_bytes(8, "little") + array("i", tokens).tobytes())


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Chained hashes of the full blocks of `tokens` (a trailing partial block is ignored, as engines
    only cache full blocks). `parent` continues an existing chain."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out: list[int] = []
    for i in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out
