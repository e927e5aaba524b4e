"""torch.prims ops that PyTorch's reference decompositions emit inside compiled graphs.

Prims whose signature equals the aten op of the same name (erf, exp, ...) share that lowering;
the ones here differ and are keyed "prims::name".
"""

from __future__ import annotations

import jax.numpy as jnp

from torchbridge.device import dtypes
from torchbridge.device.lowerings.registry import ctx, lower


def _axes(dims):
    return None if dims is None else tuple(dims)


@lower("prims::convert_element_type")
def convert_element_type(a, dtype):
    return jnp.asarray(a).astype(dtypes.to_jax(dtype))


@lower("prims::var")
def var(a, dims, correction=1, *, output_dtype=None):
    a = a.astype(ctx().out_dtypes[0])
    return jnp.var(a, axis=_axes(dims), ddof=correction)


@lower("prims::sum")
def sum_(a, dims, *, output_dtype=None):
    return jnp.sum(a.astype(ctx().out_dtypes[0]), axis=_axes(dims))


@lower("prims::prod")
def prod(a, dims, *, output_dtype=None):
    return jnp.prod(a.astype(ctx().out_dtypes[0]), axis=_axes(dims))


@lower("prims::amax")
def amax(a, dims, *, output_dtype=None):
    return jnp.max(a, axis=_axes(dims))


@lower("prims::amin")
def amin(a, dims, *, output_dtype=None):
    return jnp.min(a, axis=_axes(dims))


@lower("prims::broadcast_in_dim")
def broadcast_in_dim(a, shape, broadcast_dimensions):
    expanded = [1] * len(shape)
    for src, dst in enumerate(broadcast_dimensions):
        expanded[dst] = a.shape[src]
    return jnp.broadcast_to(a.reshape(expanded), tuple(shape))


@lower("prims::squeeze")
def squeeze(a, dimensions):
    return jnp.squeeze(a, axis=tuple(dimensions)) if dimensions else a


@lower("prims::iota")
def iota(length, *, start, step, dtype, device, requires_grad):
    return (start + step * jnp.arange(length)).astype(dtypes.to_jax(dtype))


@lower("prims::collapse_view", "prims::collapse")
def collapse(a, start, end):
    return a.reshape(ctx().out_shapes[0])


@lower("prims::split_dim")
def split_dim(a, dim, outer_length):
    return a.reshape(ctx().out_shapes[0])
