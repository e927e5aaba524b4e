"""View ops as value computations, for compiled graphs.

In eager mode these never reach the lowering table: PyTorch's own view kernels (as_strided, view)
run on device tensors and alias storage; view_as_real/view_as_complex, which PyTorch only implements
for CPU/CUDA/MPS/Meta, get device kernels at the end of this file that build them from those views. Inside a compiled graph AOTAutograd has functionalized
aliasing away, so a view is just a new value computed from its base.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from torchbridge.device import views
from torchbridge.device.lowerings.registry import ctx, lower


def _shape():
    return ctx().out_shapes[0]


@lower("view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy", "_reshape_copy")
def view(a, *args, **kwargs):
    return jnp.reshape(a, _shape())


@lower("permute", "permute_copy")
def permute(a, dims):
    return jnp.transpose(a, [d % max(a.ndim, 1) for d in dims])


@lower("transpose.int", "transpose_copy.int")
def transpose(a, dim0, dim1):
    if a.ndim == 0:
        return a
    return jnp.swapaxes(a, dim0, dim1)


@lower("t", "t_copy", "numpy_T")
def t(a):
    return a.T


@lower("expand", "expand_copy")
def expand(a, size, implicit=False):
    return jnp.broadcast_to(a, _shape())


@lower("slice.Tensor", "slice_copy.Tensor")
def slice_(a, dim=0, start=None, end=None, step=1):
    dim = dim % a.ndim
    n = a.shape[dim]
    start, end, step = slice(start, end, step).indices(n)
    length = _shape()[dim]
    if length == 0:
        return jnp.zeros(_shape(), a.dtype)
    return lax.slice_in_dim(a, start, start + (length - 1) * step + 1, step, axis=dim)


@lower("select.int", "select_copy.int")
def select(a, dim, index):
    dim = dim % a.ndim
    return lax.index_in_dim(a, index % a.shape[dim], axis=dim, keepdims=False)


@lower("squeeze", "squeeze_copy")
def squeeze(a, dim=None):
    return jnp.reshape(a, _shape())


@lower("unsqueeze", "unsqueeze_copy")
def unsqueeze(a, dim):
    return jnp.reshape(a, _shape())


@lower("alias", "detach", "lift_fresh", "detach_copy", "resolve_conj", "resolve_neg")
def alias(a):
    return a


# A graph value is what the tensor means, so the lazy conj/neg views are the operations themselves
# (and resolving them is the identity, above).
@lower("_conj", "_conj_copy")
def conj_view(a):
    return jnp.conj(a) if jnp.issubdtype(a.dtype, jnp.complexfloating) else a


@lower("_neg_view", "_neg_view_copy")
def neg_view(a):
    return -a


@lower("view_as_real", "view_as_real_copy")
def view_as_real(a):
    return jnp.stack([jnp.real(a), jnp.imag(a)], axis=-1)


@lower("view_as_complex", "view_as_complex_copy")
def view_as_complex(a):
    return lax.complex(a[..., 0], a[..., 1])


@lower("as_strided", "as_strided_copy")
def as_strided(a, size, stride, storage_offset=None):
    flat = a.reshape(-1)
    offset = 0 if storage_offset is None else storage_offset
    need = 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + offset if all(size) else 0
    if need > flat.shape[0]:
        flat = jnp.concatenate([flat, jnp.zeros((need - flat.shape[0],), flat.dtype)])
    return views.read(flat, views.ViewSpec(tuple(size), tuple(stride), offset))


@lower("diagonal", "diagonal_copy")
def diagonal(a, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(a, offset=offset, axis1=dim1, axis2=dim2)


@lower("unfold", "unfold_copy")
def unfold(a, dimension, size, step):
    if a.ndim == 0:
        return a.reshape(1)
    dim = dimension % a.ndim
    n = (a.shape[dim] - size) // step + 1
    idx = jnp.arange(n)[:, None] * step + jnp.arange(size)[None, :]
    taken = jnp.take(a, idx, axis=dim)  # (..., n, size, ...)
    return jnp.moveaxis(taken, dim + 1, -1)


@lower("split_with_sizes", "split_with_sizes_copy")
def split_with_sizes(a, split_sizes, dim=0):
    dim = dim % a.ndim
    out, start = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(a, start, start + s, axis=dim))
        start += s
    return out


@lower("split.Tensor", "split_copy.Tensor")
def split(a, split_size, dim=0):
    dim = dim % a.ndim
    n = a.shape[dim]
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] if split_size else [0]
    return split_with_sizes(a, sizes, dim)


@lower("unbind.int", "unbind_copy.int")
def unbind(a, dim=0):
    dim = dim % a.ndim
    return [lax.index_in_dim(a, i, axis=dim, keepdims=False) for i in range(a.shape[dim])]


@lower("narrow", "narrow_copy")
def narrow(a, dim, start, length):
    dim = dim % a.ndim
    return lax.slice_in_dim(a, start % a.shape[dim] if start < 0 else start, (start % a.shape[dim] if start < 0 else start) + length, axis=dim)


@lower("view_as", "expand_as")
def view_as(a, other):
    return jnp.broadcast_to(a, other.shape) if a.size != other.size else a.reshape(other.shape)
