"""SwiGLU, the gated activation of Llama's MLP: silu(gate) * up in one pass.

silu is computed in float32 and rounded to the input dtype before the product, as PyTorch's
`F.silu(gate) * up` does. `impl` as in rms_norm.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from torchbridge.kernels import tiling
from torchbridge.kernels.kernel import kernel


def swiglu_reference(gate: jax.Array, up: jax.Array) -> jax.Array:
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g)).astype(gate.dtype) * up


def swiglu_pallas(gate: jax.Array, up: jax.Array) -> jax.Array:
    d = gate.shape[-1]
    n = gate.size // d if d else 0
    block = tiling.row_block(n, d, gate.dtype)
    spec = pl.BlockSpec((block, d), lambda i: (i, 0))

    def body(g_ref, u_ref, o_ref):
        o_ref[...] = swiglu_reference(g_ref[...], u_ref[...])

    out = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((n, d), gate.dtype), grid=(pl.cdiv(n, block),),
                         in_specs=[spec, spec], out_specs=spec)(gate.reshape(n, d), up.reshape(n, d))
    return out.reshape(gate.shape)


@kernel("torchbridge::swiglu", static_argnames=("impl",), reference=lambda g, u, impl: swiglu_reference(g, u))
def swiglu(gate: jax.Array, up: jax.Array, impl: str = "auto") -> jax.Array:
    """silu(gate) * up (same shapes)."""
    return tiling.choose(impl, swiglu_pallas, swiglu_reference, gate, up)
