"""embedding_bag: sums, means or maxima of embedding rows over bags of indices, and its backward.

Bag b holds indices[offsets[b]:offsets[b + 1]] (the last bag runs to the end of `indices`, or to the
last offset with include_last_offset). As in ATen's CPU kernel, an index equal to padding_idx (>= 0)
is left out of its bag and of its bag's size; an empty bag gives zeros; mean divides by the bag size
(at least 1); max takes the first index attaining each feature's maximum (strict comparison), and an
empty bag's max index is -1, which the backward skips.

The by-products (offset2bag: each index's bag; bag_size; max_indices) are laid out as PyTorch's meta
kernel sizes them for a non-CPU device (CUDA's layout), and the backward below reads them back.

scale_grad_by_freq divides each index's gradient by how often that index occurs in `indices`. The
CPU kernel (torch 2.13) looks the count up at the wrong position of its sorted indices (the k-th
distinct index gets the count of the k-th sorted entry), so its gradients differ from these wherever
that entry is another index; this lowering keeps the documented meaning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower

_SUM, _MEAN, _MAX = 0, 1, 2


def _bags(indices, offsets, include_last_offset: bool):
    """(number of bags, each index's bag); an index outside every bag gets the bag count."""
    n = indices.shape[0]
    b = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    starts = offsets[:b]
    seg = jnp.searchsorted(starts, jnp.arange(n, dtype=starts.dtype), side="right") - 1
    end = offsets[b] if include_last_offset else n
    outside = (seg < 0) | (jnp.arange(n) >= end)
    return b, jnp.where(outside, b, seg)


def _fit(x, i: int):
    """A by-product in the shape and dtype the meta kernel gave it (zeros where it is empty)."""
    shape, dt = ctx().out_shapes[i], ctx().out_dtypes[i]
    if x is None or 0 in shape:
        return jnp.zeros(shape, dt)
    if x.shape[0] < shape[0]:  # bag_size has one entry per offset, the bags' sizes come first
        x = jnp.concatenate([x, jnp.zeros((shape[0] - x.shape[0],) + x.shape[1:], x.dtype)])
    return x.reshape(shape).astype(dt)


def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    dt = ctx().out_dtypes[0]
    w = weight.astype(dt)
    b, seg = _bags(indices, offsets, include_last_offset)
    keep = seg < b
    if padding_idx is not None and padding_idx >= 0:
        keep = keep & (indices != padding_idx)
    seg = jnp.where(keep, seg, b)
    rows = w[indices]
    size = jax.ops.segment_sum(keep.astype(jnp.int64), seg, num_segments=b)
    max_idx = None
    n = indices.shape[0]
    if mode == _MAX and (n == 0 or b == 0):
        out = jnp.zeros((b, w.shape[1]), dt)
        max_idx = jnp.full(out.shape, -1, jnp.int64)
    elif mode == _MAX:
        out = jax.ops.segment_max(rows, seg, num_segments=b)
        out = jnp.where(size[:, None] > 0, out, jnp.zeros((), dt))
        # the first position (in index order) holding each bag's maximum, as the CPU's strict `>` keeps
        hit = keep[:, None] & (rows == out[jnp.minimum(seg, b - 1)])
        first = jax.ops.segment_min(jnp.where(hit, jnp.arange(n)[:, None], n), seg, num_segments=b)
        max_idx = jnp.where(first < n, indices[jnp.minimum(first, n - 1)], -1)
    else:
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.astype(dt)[:, None]
        out = jax.ops.segment_sum(rows, seg, num_segments=b)
        if mode == _MEAN:
            out = out / jnp.maximum(size, 1).astype(dt)[:, None]
    return out, _fit(seg, 1), _fit(size, 2), _fit(max_idx, 3)


lower("_embedding_bag", "_embedding_bag_forward_only")(_embedding_bag)


@lower("_embedding_bag_dense_backward")
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    dt = ctx().out_dtypes[0]
    g = grad.astype(dt)
    d = g.shape[1]
    if mode == _MAX:
        idx = maximum_indices.reshape(g.shape)
        cols = jnp.broadcast_to(jnp.arange(d), g.shape)
        out = jnp.zeros((num_weights, d), dt).at[jnp.where(idx >= 0, idx, num_weights), cols].add(g, mode="drop")
    else:
        b = g.shape[0]
        valid = offset2bag < b
        bag = jnp.minimum(offset2bag, b - 1)
        contrib = g[bag]
        if mode == _MEAN:
            contrib = contrib / jnp.maximum(bag_size[bag], 1).astype(dt)[:, None]
        if per_sample_weights is not None:
            contrib = contrib * per_sample_weights.astype(dt)[:, None]
        if scale_grad_by_freq:
            counts = jnp.zeros((num_weights,), dt).at[indices].add(1)
            contrib = contrib / counts[indices][:, None]
        target = jnp.where(valid, indices, num_weights)
        out = jnp.zeros((num_weights, d), dt).at[target].add(contrib, mode="drop")
    if padding_idx is not None and padding_idx >= 0:
        out = out.at[padding_idx].set(0)
    return out


@lower("_embedding_bag_per_sample_weights_backward")
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    dt = ctx().out_dtypes[0]
    b = grad.shape[0]
    bag = jnp.minimum(offset2bag, b - 1)
    res = jnp.sum(grad.astype(dt)[bag] * weight.astype(dt)[indices], axis=1)
    keep = offset2bag < b
    if padding_idx is not None and padding_idx >= 0:
        keep = keep & (indices != padding_idx)
    return jnp.where(keep, res, jnp.zeros((), dt))


@lower("_embedding_bag_backward")
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    if sparse:  # the device has no sparse tensors
        raise NotImplementedError("torchbridge: embedding_bag with sparse=True")
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                        scale_grad_by_freq, mode, per_sample_weights, padding_idx)
