"""Rotary position embedding of queries and keys in one kernel (Llama's rotate-half form).

q: [N, H, D] and k: [N, KVH, D] rotated by cos/sin: [N, D] (one row per token's position):
x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2]).
`impl` as in rms_norm.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from torchbridge.kernels import tiling
from torchbridge.kernels.kernel import kernel


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def rotary_reference(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    cos, sin = cos.astype(q.dtype), sin.astype(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary_pallas(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    n, h, d = q.shape
    kvh = k.shape[1]
    block = tiling.row_block(n, (h + kvh) * d, q.dtype)

    def body(q_ref, k_ref, c_ref, s_ref, qo_ref, ko_ref):
        qo_ref[...], ko_ref[...] = rotary_reference(q_ref[...], k_ref[...], c_ref[...], s_ref[...])

    return pl.pallas_call(
        body,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)],
        grid=(pl.cdiv(n, block),),
        in_specs=[pl.BlockSpec((block, h, d), lambda i: (i, 0, 0)), pl.BlockSpec((block, kvh, d), lambda i: (i, 0, 0)),
                  pl.BlockSpec((block, d), lambda i: (i, 0)), pl.BlockSpec((block, d), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((block, h, d), lambda i: (i, 0, 0)), pl.BlockSpec((block, kvh, d), lambda i: (i, 0, 0))],
    )(q, k, cos, sin)


@kernel("torchbridge::rotary", static_argnames=("impl",),
        reference=lambda q, k, c, s, impl: rotary_reference(q, k, c, s))
def rotary(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """(rotated q, rotated k); cos and sin: [N, D] for the N tokens' positions."""
    return tiling.choose(impl, rotary_pallas, rotary_reference, q, k, cos, sin)
