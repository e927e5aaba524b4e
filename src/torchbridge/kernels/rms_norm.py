"""Fused RMSNorm, alone and after a residual add (one pass over the rows instead of two or three).

Numerics follow Llama's reference: normalise in float32, cast back to the input dtype, then scale
by the weight. `impl`: "auto" runs the Pallas kernel where the program is compiled for TPU and the
jnp reference elsewhere (on the CPU platform Pallas only runs in its interpreter, a simulator);
"pallas" forces the Pallas kernel (interpreted on the CPU), "reference" the jnp one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from torchbridge.kernels import tiling
from torchbridge.kernels.kernel import kernel


def rms_norm_reference(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w * y.astype(x.dtype)).astype(x.dtype)


def add_rms_norm_reference(x: jax.Array, residual: jax.Array, w: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    h = x + residual
    return rms_norm_reference(h, w, eps), h


def rms_norm_pallas(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    def body(x_ref, w_ref, o_ref):
        o_ref[...] = rms_norm_reference(x_ref[...], w_ref[...], eps)

    return _rows_call(body, [x], w, 1)(x, w.reshape(1, -1))[0].reshape(x.shape)


def add_rms_norm_pallas(x: jax.Array, residual: jax.Array, w: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    def body(x_ref, r_ref, w_ref, o_ref, h_ref):
        h = x_ref[...] + r_ref[...]
        h_ref[...] = h
        o_ref[...] = rms_norm_reference(h, w_ref[...], eps)

    out, h = _rows_call(body, [x, residual], w, 2)(x, residual, w.reshape(1, -1))
    return out.reshape(x.shape), h.reshape(x.shape)


def _rows_call(body, rows: list[jax.Array], w: jax.Array, n_out: int):
    """A pallas_call over blocks of rows (the last axis whole); operands are flattened to 2-D."""
    d = rows[0].shape[-1]
    n = rows[0].size // d if d else 0
    block = tiling.row_block(n, d, rows[0].dtype)
    row_spec = pl.BlockSpec((block, d), lambda i: (i, 0))
    call = pl.pallas_call(
        body,
        out_shape=[jax.ShapeDtypeStruct((n, d), rows[0].dtype)] * n_out,
        grid=(pl.cdiv(n, block),),
        in_specs=[row_spec] * len(rows) + [pl.BlockSpec((1, d), lambda i: (0, 0))],
        out_specs=[row_spec] * n_out,
    )
    return lambda *a: call(*(x.reshape(n, d) for x in a[:-1]), a[-1])


@kernel("torchbridge::rms_norm", static_argnames=("eps", "impl"), reference=lambda x, w, eps, impl: rms_norm_reference(x, w, eps))
def rms_norm(x: jax.Array, w: jax.Array, eps: float = 1e-6, impl: str = "auto") -> jax.Array:
    """RMSNorm over the last axis of x, scaled by w."""
    return tiling.choose(impl, rms_norm_pallas, rms_norm_reference, x, w, eps=eps)


@kernel("torchbridge::add_rms_norm", static_argnames=("eps", "impl"),
        reference=lambda x, r, w, eps, impl: add_rms_norm_reference(x, r, w, eps))
def add_rms_norm(x: jax.Array, residual: jax.Array, w: jax.Array, eps: float = 1e-6,
                 impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """(rms_norm(x + residual), x + residual): a transformer block's residual add fused with the next norm."""
    return tiling.choose(impl, add_rms_norm_pallas, add_rms_norm_reference, x, residual, w, eps=eps)
