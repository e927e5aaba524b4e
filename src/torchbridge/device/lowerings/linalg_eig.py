"""General (non-symmetric) eigendecomposition: linalg_eig and _linalg_eigvals.

jnp.linalg.eig runs LAPACK's geev on the host (XLA:CPU), the routine PyTorch's CPU kernel calls, so
eigenvalues come in the same order and each eigenvector is normalized the same way (unit 2-norm,
largest component real). Real inputs give complex outputs, as in PyTorch.
"""

from __future__ import annotations

import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower


@lower("linalg_eig")
def linalg_eig(a):
    w_dt, v_dt = ctx().out_dtypes[0], ctx().out_dtypes[1]
    if a.shape[-1] == 0:
        return jnp.zeros(ctx().out_shapes[0], w_dt), jnp.zeros(ctx().out_shapes[1], v_dt)
    w, v = jnp.linalg.eig(a)
    return w.astype(w_dt), v.astype(v_dt)


@lower("_linalg_eigvals")
def linalg_eigvals(a):
    dt = ctx().out_dtypes[0]
    if a.shape[-1] == 0:
        return jnp.zeros(ctx().out_shapes[0], dt)
    return jnp.linalg.eigvals(a).astype(dt)
