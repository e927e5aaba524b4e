"""Mixture-of-experts ops: transformers' MoE layers pick a device-specific path for `tpu`, `histc` on
int32 expert ids and `torch._grouped_mm` (float32 included). Their eager kernel and compile-time
shape rule for `_grouped_mm` live with the dispatcher (device/grouped_mm.py); this is its value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower


@lower("histc")
def histc(a, bins=100, min=0, max=0):
    # Mirrors ATen's linear-interpolation histogram: bins of equal width over [min, max], the value
    # max itself in the last bin, values outside the range dropped; min == max means the data range.
    wide = jnp.float64 if not jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
    x = a.astype(wide).reshape(-1)
    lo = jnp.asarray(min, wide)
    hi = jnp.asarray(max, wide)
    use_data = lo == hi
    if x.size:
        lo = jnp.where(use_data, jnp.min(x), lo)
        hi = jnp.where(use_data, jnp.max(x), hi)
    same = lo == hi
    lo = jnp.where(same, lo - 1, lo)
    hi = jnp.where(same, hi + 1, hi)
    pos = ((x - lo) * bins / (hi - lo)).astype(jnp.int64)
    pos = jnp.where(pos == bins, bins - 1, pos)
    valid = (x >= lo) & (x <= hi)
    counts = jnp.zeros((bins,), jnp.int64).at[jnp.clip(pos, 0, bins - 1)].add(valid.astype(jnp.int64))
    return counts.astype(ctx().out_dtypes[0])


def _group_of(positions: jax.Array, offs: jax.Array) -> jax.Array:
    """One-hot (len(positions), G) membership of each position in the groups `offs` ends; positions at
    or past offs[-1] belong to no group (their row is all zeros)."""
    group = jnp.searchsorted(offs.astype(jnp.int64), positions, side="right")
    return group[:, None] == jnp.arange(offs.shape[0])[None, :]


@lower("_grouped_mm")
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm for every dtype and all four layouts; groups are delimited by `offs` (int32
    cumulative ends) along the jagged dim of each 2D operand, elements past offs[-1] give zeros.

    2D x 3D: (S, K) rows grouped by offs times (G, K, N) -> (S, N)    (the MoE forward)
    2D x 2D: (M, S) times (S, N), S grouped by offs  -> (G, M, N)     (the weight gradient)
    3D x 2D: (G, M, K) times (K, N), N grouped by offs -> (M, N)
    3D x 3D: a batched matmul, offs unused.
    """
    if bias is not None:  # PyTorch's kernels reject it too
        raise NotImplementedError("torchbridge: _grouped_mm with bias is not supported")
    if a.ndim == 3 and b.ndim == 3:
        res = jnp.matmul(a, b)
    elif a.ndim == 2 and b.ndim == 3:
        sizes = jnp.diff(offs.astype(jnp.int32), prepend=jnp.zeros((1,), jnp.int32))
        res = jax.lax.ragged_dot(a, b, sizes)
    elif a.ndim == 2:
        onehot = _group_of(jnp.arange(a.shape[1]), offs).astype(a.dtype)
        res = jnp.einsum("ms,sg,sn->gmn", a, onehot, b)
    else:
        onehot = _group_of(jnp.arange(b.shape[1]), offs).astype(a.dtype)
        res = jnp.einsum("gmk,kn,ng->mn", a, b, onehot)
    return res
