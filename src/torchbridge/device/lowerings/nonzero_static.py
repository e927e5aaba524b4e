"""nonzero_static: the indices of the first `size` nonzero elements, padded with `fill_value`.

Unlike nonzero its output shape (size, ndim) is known before the data, so it compiles like any
other op.
"""

from __future__ import annotations

import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower


@lower("nonzero_static")
def nonzero_static(a, *, size, fill_value=-1):
    if a.ndim == 0 or size == 0:  # (size, 0) or (0, ndim): nothing to compute
        return jnp.zeros(ctx().out_shapes[0], jnp.int64)
    if a.size == 0:  # every row is padding (jnp.nonzero would pad with 0 here)
        return jnp.full(ctx().out_shapes[0], fill_value, jnp.int64)
    idx = jnp.nonzero(a, size=size, fill_value=fill_value)
    return jnp.stack(idx, axis=1).astype(jnp.int64)
