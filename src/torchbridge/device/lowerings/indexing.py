"""Indexing, scatter/gather, masking, concatenation, padding and reordering ops.

Indices arrive as JAX arrays. Boolean masks never reach `index`/`index_put` here: eager mode turns
them into integer indices first (fallback._index_masks, like CPU's expandTensors), so programs keep static
shapes. Ops whose output shape depends on values (nonzero, masked_select, unique) are marked
`dynamic_shape` and run on concrete arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchbridge.device.lowerings.moves import as_bits, from_bits
from torchbridge.device.lowerings.registry import ctx, lower


def _out_dtype(i: int = 0):
    return ctx().out_dtypes[i]


def _out_shape(i: int = 0):
    return ctx().out_shapes[i]


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _index_tuple(indices) -> tuple:
    return tuple(slice(None) if i is None else jnp.asarray(i) for i in indices)


def _scalar(v, dtype):
    return jnp.asarray(v).astype(dtype)


# ---- advanced indexing ----
@lower("index")
def index(self, indices):
    if self.ndim == 0:  # x[None]-style indexing of a 0-dim tensor only broadcasts
        return jnp.broadcast_to(self, _out_shape())
    return from_bits(as_bits(self)[_index_tuple(indices)], self.dtype).reshape(_out_shape())


def _mask_put(self, indices, values, accumulate):
    """x[mask] = v with one boolean mask and one value (a vocab-parallel embedding zeroing the ids another
    rank owns): a select, which a compiled graph can trace (the mask's True count is not static)."""
    lead = 0
    while lead < len(indices) and indices[lead] is None:
        lead += 1
    mask = jnp.asarray(indices[lead])
    mask = mask.reshape((1,) * lead + mask.shape + (1,) * (self.ndim - lead - mask.ndim))
    v = values.reshape(())
    return self + jnp.where(mask, v, jnp.zeros((), self.dtype)) if accumulate else jnp.where(mask, v, self)


@lower("index_put", "_index_put_impl")
def index_put(self, indices, values, accumulate=False, unsafe=False):
    values = jnp.asarray(values).astype(self.dtype)
    masks = [i for i in indices if i is not None and jnp.asarray(i).dtype == jnp.bool_]
    if len(masks) == 1 and sum(i is not None for i in indices) == 1 and values.size == 1 and self.dtype != jnp.bool_:
        return _mask_put(self, indices, values, accumulate)
    idx = _index_tuple(indices)
    if accumulate:
        if self.dtype == jnp.bool_:
            return self.at[idx].max(values)
        return self.at[idx].add(values)
    return from_bits(as_bits(self).at[idx].set(as_bits(values)), self.dtype)


def _along(dim: int, ndim: int, index) -> tuple:
    return (slice(None),) * dim + (index,)


@lower("index_select")
def index_select(self, dim, index):
    if self.ndim == 0:
        return jnp.broadcast_to(self, _out_shape())
    taken = jnp.take(as_bits(self), jnp.asarray(index).reshape(-1), axis=_dim(dim, self.ndim))
    return from_bits(taken, self.dtype).reshape(_out_shape())


@lower("index_add")
def index_add(self, dim, index, source, alpha=1):
    if self.ndim == 0:
        return self + jnp.sum(jnp.asarray(source).astype(self.dtype)) * alpha
    d = _dim(dim, self.ndim)
    source = jnp.asarray(source).astype(self.dtype)
    if source.ndim == 0:
        source = source.reshape((1,) * self.ndim)
    if not (isinstance(alpha, (int, bool)) and alpha == 1):
        source = source * jnp.asarray(alpha).astype(self.dtype)
    return self.at[_along(d, self.ndim, jnp.asarray(index).reshape(-1))].add(source)


@lower("index_copy")
def index_copy(self, dim, index, source):
    if self.ndim == 0:
        return jnp.asarray(source).astype(self.dtype).reshape(())
    d = _dim(dim, self.ndim)
    source = jnp.asarray(source).astype(self.dtype)
    if source.ndim == 0:
        source = source.reshape((1,) * self.ndim)
    written = as_bits(self).at[_along(d, self.ndim, jnp.asarray(index).reshape(-1))].set(as_bits(source))
    return from_bits(written, self.dtype)


@lower("index_fill")
def index_fill(self, dim, index, value):
    value = _scalar(value, self.dtype)
    if self.ndim == 0:
        return jnp.where(jnp.asarray(index).size > 0, value, self)
    d = _dim(dim, self.ndim)
    return self.at[_along(d, self.ndim, jnp.asarray(index).reshape(-1))].set(value)


@lower("take")
def take(self, index):
    flat = as_bits(self).reshape(-1)
    index = jnp.asarray(index)
    return from_bits(flat[jnp.where(index < 0, index + flat.shape[0], index)], self.dtype)


# ---- gather / scatter ----
def _scatter_index(dim: int, index) -> tuple:
    """Full index tuple addressing self at index[i][j]... along `dim` (the scatter/gather pattern)."""
    grids = jnp.meshgrid(*[jnp.arange(n) for n in index.shape], indexing="ij")
    return tuple(index if d == dim else grids[d] for d in range(index.ndim))


@lower("gather")
def gather(self, dim, index, sparse_grad=False):
    index = jnp.asarray(index)
    if self.ndim == 0:
        return jnp.broadcast_to(self, _out_shape())
    if index.ndim == 0:
        return self.reshape(-1)[index].reshape(_out_shape())
    d = _dim(dim, self.ndim)
    if 0 in index.shape:
        return jnp.zeros(_out_shape(), self.dtype)
    return from_bits(as_bits(self)[_scatter_index(d, index)], self.dtype)


def _scatter_src(src, index, dtype):
    src = jnp.asarray(src).astype(dtype)
    if src.ndim == 0:
        return jnp.broadcast_to(src, index.shape)
    return src[tuple(slice(0, n) for n in index.shape)]


def _apply(ref, vals, how: str):
    if how == "set":
        return ref.set(vals)
    if how in ("add", "sum"):
        return ref.add(vals)
    if how in ("multiply", "prod"):
        return ref.multiply(vals)
    if how == "amax":
        return ref.max(vals)
    if how == "amin":
        return ref.min(vals)
    raise ValueError(f"torchbridge: unsupported scatter reduction {how!r}")


def _scatter(self, dim, index, src, how: str):
    index = jnp.asarray(index)
    if 0 in index.shape:
        return self
    if self.ndim == 0:
        vals = jnp.asarray(src).astype(self.dtype).reshape(-1)[:1]
        return _apply(self.reshape(1).at[jnp.zeros(1, jnp.int32)], vals, how).reshape(())
    d = _dim(dim, self.ndim)
    if how == "set":  # an overwrite moves bits (moves.py)
        vals = as_bits(_scatter_src(src, index, self.dtype))
        return from_bits(as_bits(self).at[_scatter_index(d, index)].set(vals), self.dtype)
    return _apply(self.at[_scatter_index(d, index)], _scatter_src(src, index, self.dtype), how)


@lower("scatter")
def scatter(self, dim, index, src=None, value=None, *, reduce=None):
    vals = src if src is not None else value
    return _scatter(self, dim, index, vals, "set" if reduce is None else reduce)


@lower("scatter_add")
def scatter_add(self, dim, index, src):
    return _scatter(self, dim, index, src, "add")


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _highest(dtype):
    return jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max


def _reduce_into(self, idx, vals, reduce: str, include_self: bool):
    """self with vals reduced into the positions idx (repeats reduce together), as scatter_reduce."""
    if reduce == "mean":
        base = self if include_self else self.at[idx].set(0)
        total = base.at[idx].add(vals)
        count = jnp.ones(self.shape, self.dtype) if include_self else jnp.ones(self.shape, self.dtype).at[idx].set(0)
        count = count.at[idx].add(1)
        count = jnp.where(count == 0, 1, count)
        return total / count if jnp.issubdtype(self.dtype, jnp.inexact) else jnp.floor_divide(total, count)
    neutral = {"sum": 0, "prod": 1, "amax": _lowest(self.dtype), "amin": _highest(self.dtype)}[reduce]
    base = self if include_self else self.at[idx].set(jnp.asarray(neutral, self.dtype))
    return _apply(base.at[idx], vals, reduce)


@lower("scatter_reduce")
def scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    index = jnp.asarray(index)
    if 0 in index.shape:
        return self
    squeeze = self.ndim == 0
    if squeeze:
        self, index, src = self.reshape(1), index.reshape(1), jnp.asarray(src).reshape(1)
    d = _dim(dim, self.ndim)
    out = _reduce_into(self, _scatter_index(d, index), _scatter_src(src, index, self.dtype), reduce, include_self)
    return out.reshape(()) if squeeze else out


@lower("index_reduce")
def index_reduce(self, dim, index, source, reduce, *, include_self=True):
    squeeze = self.ndim == 0
    if squeeze:
        self, source = self.reshape(1), jnp.asarray(source).reshape(1)
    d = _dim(dim, self.ndim)
    idx = _along(d, self.ndim, jnp.asarray(index).reshape(-1))
    out = _reduce_into(self, idx, jnp.asarray(source).astype(self.dtype), reduce, include_self)
    return out.reshape(()) if squeeze else out


@lower("put")
def put(self, index, source, accumulate=False):
    flat = self.reshape(-1)
    index = jnp.asarray(index).reshape(-1)
    index = jnp.where(index < 0, index + flat.shape[0], index)
    src = jnp.asarray(source).astype(self.dtype).reshape(-1)
    return (flat.at[index].add(src) if accumulate else flat.at[index].set(src)).reshape(self.shape)


# ---- masks ----
@lower("masked_fill")
def masked_fill(self, mask, value):
    return jnp.where(mask, _scalar(value, self.dtype), self)


@lower("masked_scatter")
def masked_scatter(self, mask, source):
    mask = jnp.broadcast_to(mask, self.shape).reshape(-1)
    src = jnp.asarray(source).astype(self.dtype).reshape(-1)
    if src.shape[0] == 0:
        return self
    # The k-th True position takes source[k]: positions are a running count of the mask.
    pos = jnp.clip(jnp.cumsum(mask.astype(jnp.int64)) - 1, 0, src.shape[0] - 1)
    return jnp.where(mask, src[pos], self.reshape(-1)).reshape(self.shape)


def _masked_select(self, mask):
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    return jnp.broadcast_to(self, shape)[jnp.broadcast_to(mask, shape)]


_masked_select.dynamic_shape = True
lower("masked_select")(_masked_select)


def _nonzero(self):
    if self.ndim == 0:
        return jnp.zeros((int(self != 0), 0), jnp.int64)
    return jnp.stack(jnp.nonzero(self), axis=1).astype(jnp.int64).reshape(-1, self.ndim)


_nonzero.dynamic_shape = True
lower("nonzero")(_nonzero)


def _unique2(self, sorted=True, return_inverse=False, return_counts=False):  # noqa: A002 - ATen's name
    flat = self.reshape(-1)
    values, inverse, counts = jnp.unique(flat, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(self.shape).astype(jnp.int64) if return_inverse else jnp.zeros((0,), jnp.int64)
    counts = counts.astype(jnp.int64) if return_counts else jnp.zeros((0,), jnp.int64)
    return values, inverse, counts


_unique2.dynamic_shape = True
lower("_unique2")(_unique2)


def _unique(self, sorted=True, return_inverse=False):  # noqa: A002 - ATen's name
    values, inverse, _ = _unique2(self, sorted, return_inverse)
    return values, inverse


_unique.dynamic_shape = True
lower("_unique")(_unique)


def _unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):  # noqa: A002 - ATen's name
    values, inverse, counts = jnp.unique(self, axis=dim, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1).astype(jnp.int64) if return_inverse else jnp.zeros((0,), jnp.int64)
    counts = counts.astype(jnp.int64) if return_counts else jnp.zeros((0,), jnp.int64)
    return values, inverse, counts


_unique_dim.dynamic_shape = True
lower("unique_dim")(_unique_dim)


def _unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    if dim is not None:
        raise NotImplementedError("torchbridge: unique_consecutive with dim")
    flat = self.reshape(-1)
    if flat.shape[0] == 0:
        e = jnp.zeros((0,), jnp.int64)
        return flat, (e.reshape(self.shape) if return_inverse else e), e
    starts = jnp.concatenate([jnp.ones(1, bool), flat[1:] != flat[:-1]])
    group = jnp.cumsum(starts.astype(jnp.int64)) - 1
    values = flat[starts]
    counts = jnp.bincount(group, length=values.shape[0]).astype(jnp.int64)
    inverse = group.reshape(self.shape) if return_inverse else jnp.zeros((0,), jnp.int64)
    return values, inverse, counts if return_counts else jnp.zeros((0,), jnp.int64)


_unique_consecutive.dynamic_shape = True
lower("unique_consecutive")(_unique_consecutive)


# ---- sorted search ----
def _search(seq, values, side: str, sorter):
    if sorter is not None:
        seq = jnp.take_along_axis(seq, jnp.asarray(sorter), axis=-1)
    if seq.ndim <= 1:
        return jnp.searchsorted(seq, values, side=side, method="compare_all")
    lead = seq.shape[:-1]
    fn = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side, method="compare_all"))
    return fn(seq.reshape(-1, seq.shape[-1]), values.reshape(-1, values.shape[-1])).reshape(lead + values.shape[-1:])


@lower("searchsorted")
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    side = side or ("right" if right else "left")
    return _search(sorted_sequence, jnp.asarray(self), side, sorter).reshape(_out_shape())


@lower("bucketize")
def bucketize(self, boundaries, *, out_int32=False, right=False):
    return jnp.searchsorted(boundaries, jnp.asarray(self), side="right" if right else "left",
                            method="compare_all").reshape(_out_shape())


# ---- embedding ----
@lower("embedding")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@lower("embedding_renorm")
def embedding_renorm(self, indices, max_norm, norm_type):
    # Rows looked up by `indices` whose norm exceeds max_norm are scaled down (the 1e-7 is PyTorch's).
    used = jnp.zeros(self.shape[0], jnp.bool_).at[jnp.asarray(indices).reshape(-1)].set(True)
    norms = jnp.linalg.norm(self.astype(jnp.promote_types(self.dtype, jnp.float32)), ord=norm_type, axis=1)
    scale = jnp.where(used & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return self * scale[:, None].astype(self.dtype)


@lower("embedding_dense_backward")
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = jnp.asarray(indices).reshape(-1)
    g = grad_output.reshape(idx.shape[0], -1)
    keep = idx != padding_idx
    if scale_grad_by_freq:
        counts = jnp.zeros(num_weights, g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
    g = jnp.where(keep[:, None], g, 0)
    return jnp.zeros((num_weights, g.shape[1]), g.dtype).at[idx].add(g)


# ---- scatter into views (functional forms of writes through views) ----
@lower("slice_scatter")
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    d = _dim(dim, self.ndim)
    return self.at[_along(d, self.ndim, slice(start, end, step))].set(jnp.asarray(src).astype(self.dtype))


@lower("select_scatter")
def select_scatter(self, src, dim, index):
    d = _dim(dim, self.ndim)
    return self.at[_along(d, self.ndim, index)].set(jnp.asarray(src).astype(self.dtype))


@lower("diagonal_scatter")
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    d1, d2 = _dim(dim1, self.ndim), _dim(dim2, self.ndim)
    moved = jnp.moveaxis(self, (d1, d2), (-2, -1))
    n = jnp.asarray(src).shape[-1]
    rows = jnp.arange(n) + max(-offset, 0)
    cols = jnp.arange(n) + max(offset, 0)
    moved = moved.at[..., rows, cols].set(jnp.asarray(src).astype(self.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


@lower("as_strided_scatter")
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    flat_idx = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[d] = n
        flat_idx = flat_idx + np.arange(n).reshape(shape) * s
    flat = self.reshape(-1).at[flat_idx.reshape(-1)].set(jnp.asarray(src).astype(self.dtype).reshape(-1))
    return flat.reshape(self.shape)


# ---- triangles, reordering, repetition ----
@lower("tril")
def tril(self, diagonal=0):
    return jnp.tril(self, k=diagonal)


@lower("triu")
def triu(self, diagonal=0):
    return jnp.triu(self, k=diagonal)


@lower("flip")
def flip(self, dims):
    if self.ndim == 0 or not dims:
        return self
    return jnp.flip(self, axis=tuple(_dim(d, self.ndim) for d in dims))


@lower("roll")
def roll(self, shifts, dims=()):
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), axis=tuple(_dim(d, self.ndim) for d in dims))


@lower("repeat")
def repeat(self, repeats):
    return jnp.tile(self, tuple(repeats)).reshape(_out_shape())


# ---- concatenation and padding ----
@lower("cat")
def cat(tensors, dim=0):
    dt = _out_dtype()
    out_ndim = len(_out_shape())
    # Legacy rule: 1-d empty tensors are skipped whatever the other shapes are.
    parts = [jnp.asarray(t).astype(dt) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0 and out_ndim != 1)]
    if not parts:
        return jnp.zeros(_out_shape(), dt)
    return jnp.concatenate(parts, axis=_dim(dim, out_ndim))


@lower("stack")
def stack(tensors, dim=0):
    dt = _out_dtype()
    return jnp.stack([jnp.asarray(t).astype(dt) for t in tensors], axis=_dim(dim, len(_out_shape())))


def _pad_config(ndim: int, pad) -> list[tuple[int, int]]:
    """ATen pads list (last dim first, (before, after) pairs) -> one pair per dim."""
    cfg = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        cfg[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return cfg


@lower("constant_pad_nd")
def constant_pad_nd(self, pad, value=0):
    cfg = [(lo, hi, 0) for lo, hi in _pad_config(self.ndim, pad)]
    return lax.pad(self, _scalar(value, self.dtype), cfg)


def _replicate(x, cfg):
    """Edge padding that also takes negative pads (they crop), which jnp.pad rejects: output
    position i reads input clip(i - before)."""
    for d, (lo, hi) in enumerate(cfg):
        if lo or hi:
            n = x.shape[d]
            x = jnp.take(x, jnp.clip(jnp.arange(n + lo + hi) - lo, 0, n - 1), axis=d)
    return x


def _padded(mode: str):
    if mode == "edge":
        return _replicate
    return lambda x, cfg: jnp.pad(x, cfg, mode=mode)


def _mode_pad(mode: str):
    def fn(self, padding):
        return _padded(mode)(self, _pad_config(self.ndim, padding))

    return fn


def _mode_pad_backward(mode: str):
    def fn(grad_output, self, padding):
        cfg = _pad_config(self.ndim, padding)
        _, vjp = jax.vjp(lambda v: _padded(mode)(v, cfg), jnp.zeros(self.shape, grad_output.dtype))
        return vjp(grad_output)[0]

    return fn


for _n in (1, 2, 3):
    lower(f"reflection_pad{_n}d")(_mode_pad("reflect"))
    lower(f"replication_pad{_n}d")(_mode_pad("edge"))
    lower(f"reflection_pad{_n}d_backward")(_mode_pad_backward("reflect"))
    lower(f"replication_pad{_n}d_backward")(_mode_pad_backward("edge"))
