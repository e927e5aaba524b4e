"""FlexAttention's higher-order ops (flex_attention, flex_attention_backward) in JAX.

PyTorch hands a compiled graph `flex_attention(q, k, v, score_mod, block_mask, scale, ...)` with the
score and mask functions as FX subgraphs over scalars; the compile backend turns those into JAX
functions of scalars (`score_fn(s, b, h, m, n, *buffers)`, `mask_fn(b, h, m, n, *buffers)`), and
this module vectorises them over the four index axes with jax.vmap, as PyTorch's reference
implementation does with torch.vmap (torch/_higher_order_ops/flex_attention.py, math_attention).

The computation is dense: the block mask's sparsity lists only tell a kernel which blocks to skip, and
`mask_fn` alone decides every element, so skipping nothing gives the same values. The backward is
jax.vjp of the same forward (recomputed): it differentiates the score function's JAX code directly,
so the joint graph PyTorch also passes is not needed, and gradients reach the score function's
captured buffers. Statistics follow the op's contract: logsumexp and max scores in base 2, fully
masked rows give out 0 and logsumexp -inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

LN2 = math.log(2.0)


def _over_indices(fn: Callable, with_score: bool, n_buffers: int) -> Callable:
    """fn of scalars -> fn of ([score [B, H, M, N]], b [B], h [H], m [M], n [N], *buffers)."""
    lead = (0,) if with_score else ()
    none = (None,) * n_buffers
    for axis in (4, 3, 2, 1):  # innermost first: n, m, h, b
        in_axes = lead + tuple(0 if i == axis else None for i in range(1, 5)) + none
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn


def _working(q: jax.Array) -> Any:
    return jnp.float64 if q.dtype == jnp.float64 else jnp.float32


def _expand_kv(q: jax.Array, kv: jax.Array) -> jax.Array:
    """Grouped-query heads repeated and a batch of 1 broadcast, as the reference does."""
    g = q.shape[1] // kv.shape[1]
    if g > 1:
        kv = jnp.repeat(kv, g, axis=1)
    return jnp.broadcast_to(kv, (q.shape[0], *kv.shape[1:]))


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, score_fn: Callable, mask_fn: Callable, scale: float,
            score_buffers: Sequence[jax.Array], mask_buffers: Sequence[jax.Array], index_dtype: Any
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    work = _working(q)
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    scores = jnp.einsum("bhmd,bhnd->bhmn", q.astype(work), k.astype(work)) * scale
    b, h, m, n = (jnp.arange(size, dtype=index_dtype) for size in scores.shape)
    modded = _over_indices(score_fn, True, len(score_buffers))(scores, b, h, m, n, *score_buffers).astype(work)
    keep = _over_indices(mask_fn, False, len(mask_buffers))(b, h, m, n, *mask_buffers).astype(bool)
    post = jnp.where(keep, modded, -jnp.inf)
    row_max = jnp.max(post, axis=-1)
    finite = jnp.isfinite(row_max)
    # the shift only keeps exp in range (fully masked rows: 0, not -inf - -inf); the values do not depend on
    # it, so it is held constant for differentiation
    safe_max = jax.lax.stop_gradient(jnp.where(finite, row_max, 0.0))
    e = jnp.where(keep, jnp.exp(post - safe_max[..., None]), 0.0)
    total = jnp.sum(e, axis=-1)
    lse = jnp.where(finite, jnp.log(jnp.where(finite, total, 1.0)) + safe_max, -jnp.inf)
    probs = e / jnp.where(finite, total, 1.0)[..., None]
    out = jnp.einsum("bhmn,bhnd->bhmd", probs.astype(q.dtype), v.astype(q.dtype))
    return out, lse / LN2, row_max / LN2


def forward(q: jax.Array, k: jax.Array, v: jax.Array, score_fn: Callable, mask_fn: Callable, scale: float,
            score_buffers: Sequence[jax.Array] = (), mask_buffers: Sequence[jax.Array] = (),
            index_dtype: Any = jnp.int32) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(out [B, Hq, M, Ev], logsumexp [B, Hq, M] base 2, max score [B, Hq, M] base 2)."""
    return _attend(q, k, v, score_fn, mask_fn, scale, score_buffers, mask_buffers, index_dtype)


def backward(q: jax.Array, k: jax.Array, v: jax.Array, grad_out: jax.Array | None, grad_lse: jax.Array | None,
             score_fn: Callable, mask_fn: Callable, scale: float, score_buffers: Sequence[jax.Array] = (),
             mask_buffers: Sequence[jax.Array] = (), index_dtype: Any = jnp.int32
             ) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array | None, ...]]:
    """Gradients of q, k, v and of the score function's floating-point buffers (None for the others)."""
    differentiable = [i for i, t in enumerate(score_buffers) if jnp.issubdtype(t.dtype, jnp.floating)]

    def f(q, k, v, *diff_buffers):
        buffers = list(score_buffers)
        for i, t in zip(differentiable, diff_buffers, strict=True):
            buffers[i] = t
        out, lse, _ = _attend(q, k, v, score_fn, mask_fn, scale, buffers, mask_buffers, index_dtype)
        return out, lse

    (out, lse), vjp = jax.vjp(f, q, k, v, *(score_buffers[i] for i in differentiable))
    g_out = jnp.zeros_like(out) if grad_out is None else grad_out.astype(out.dtype)
    # a fully masked row's logsumexp is a constant -inf: no gradient flows through it
    g_lse = jnp.zeros_like(lse) if grad_lse is None else jnp.where(jnp.isfinite(lse), grad_lse.astype(lse.dtype), 0)
    dq, dk, dv, *d_buffers = vjp((g_out, g_lse))
    grads: list[jax.Array | None] = [None] * len(score_buffers)
    for i, g in zip(differentiable, d_buffers, strict=True):
        grads[i] = g
    return dq, dk, dv, tuple(grads)
