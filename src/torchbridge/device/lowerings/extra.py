"""Ops that unmodified Hugging Face models reach outside the common op families.

Mixture-of-experts layers in transformers pick a device-specific path for `tpu`: `histc` on int32
expert ids and `torch._grouped_mm` (float32 included). PyTorch's meta kernel for `_grouped_mm` only
accepts bfloat16 (it mirrors the CUDA kernel's checks), so that op cannot go through the cached
dispatch, which asks the meta kernel for output shapes; it gets its own PrivateUse1 kernel that
works on the device values directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

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


@jax.jit
def _ragged_rows(a: jax.Array, b: jax.Array, offs: jax.Array) -> jax.Array:
    """(S, K) rows grouped by `offs` times (E, K, N) per-group matrices -> (S, N); rows past offs[-1] are 0."""
    sizes = jnp.diff(offs.astype(jnp.int32), prepend=jnp.zeros((1,), jnp.int32))
    return jax.lax.ragged_dot(a, b, sizes)


@jax.jit
def _ragged_contract(a: jax.Array, b: jax.Array, offs: jax.Array) -> jax.Array:
    """(K, S) times (S, N) contracted per group of S (the weight gradient) -> (E, K, N)."""
    rows = jnp.arange(a.shape[1])
    group = jnp.searchsorted(offs.astype(jnp.int64), rows, side="right")
    onehot = (group[:, None] == jnp.arange(offs.shape[0])[None, :]).astype(a.dtype)
    return jnp.einsum("ks,se,sn->ekn", a, onehot, b)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    # Imported here: this module is loaded while torchbridge.device.ops is still initialising.
    from torchbridge.device import dtypes, ops

    dtype = out_dtype or a.dtype
    if bias is not None or offs is None or a.dim() != 2:
        raise NotImplementedError(
            "torchbridge: _grouped_mm is supported for 2D inputs with offs and no bias; "
            f"got self {tuple(a.shape)}, mat2 {tuple(b.shape)}, offs {offs is not None}, bias {bias is not None}"
        )
    av, bv, ov = ops.value(a), ops.value(b), ops.value(offs)
    with jax.default_device(next(iter(av.devices()))):
        res = _ragged_rows(av, bv, ov) if b.dim() == 3 else _ragged_contract(av, bv, ov)
    return ops.from_array(res.astype(dtypes.to_jax(dtype)), dtype, a.device)


_library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kept alive for the process
_library.impl("_grouped_mm", _grouped_mm, "PrivateUse1")
