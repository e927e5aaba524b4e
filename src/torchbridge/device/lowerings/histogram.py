"""Counting ops: bincount, histogram (a bin count or explicit edges) and histogramdd's three helpers.

bincount's length depends on the largest value, so it runs op by op on concrete arrays. The histogram
ops have static shapes (the bin counts or the edge tensors fix them) but no Meta kernel in PyTorch,
which eager dispatch needs for output metadata; the ones below size outputs as the CPU kernels do.

Binning follows ATen's CPU kernel: with a bin count the outer edges are `range` or the input's
min/max per dimension (0 and 1 for an empty input), widened by 0.5 each way when equal, and the edges
are linspace over them in the input's dtype. An element lands in the bin whose edges enclose it (the
CPU's linear guess corrected by a local search gives the same bin as a search of the edges); the
last bin includes its right edge; elements outside the edges, and nans, are dropped. `density`
divides by the total and by each bin's width. Unlike the CPU, a non-finite range computed from the
data is not an error here (it cannot be checked without reading the values back); the edges are nan.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower


# ---- bincount ----
def _bincount(self, weights=None, minlength=0):
    if self.ndim != 1 or (self.size and int(jnp.min(self)) < 0):
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    length = max(int(minlength), int(jnp.max(self)) + 1 if self.size else 0)
    if weights is None:
        return jnp.zeros((length,), jnp.int64).at[self].add(1)
    if weights.shape != self.shape:
        raise RuntimeError("weights should be 1-d and have the same length as input")
    # As on the CPU: float32 weights sum in float32, any other dtype in float64.
    dt = jnp.float32 if weights.dtype == jnp.float32 else jnp.float64
    return jnp.zeros((length,), dt).at[self].add(weights.astype(dt))


_bincount.dynamic_shape = True
lower("bincount")(_bincount)


# ---- histogram ----
def _linspace(lo, hi, steps: int, dt):
    """torch.linspace's CPU values: the first half counts up from `lo`, the second down from `hi`,
    so both ends are exact."""
    lo, hi = jnp.asarray(lo, dt), jnp.asarray(hi, dt)
    if steps == 1:
        return lo.reshape(1)
    step = (hi - lo) / jnp.asarray(steps - 1, dt)
    i = jnp.arange(steps, dtype=dt)
    up = lo + step * i
    down = hi - step * jnp.asarray(steps - 1 - jnp.arange(steps), dt)
    return jnp.where(jnp.arange(steps) < steps // 2, up, down)


def _outer_edges(x, d: int, rng) -> list[tuple]:
    """(leftmost, rightmost) per dimension of `x` (M, D), as traced scalars of x's dtype."""
    dt = x.dtype
    out = []
    for k in range(d):
        if rng is not None:
            lo, hi = jnp.asarray(rng[2 * k], jnp.float64), jnp.asarray(rng[2 * k + 1], jnp.float64)
        elif x.shape[0] == 0:
            lo, hi = jnp.asarray(0.0, jnp.float64), jnp.asarray(1.0, jnp.float64)
        else:
            lo, hi = jnp.min(x[:, k]).astype(jnp.float64), jnp.max(x[:, k]).astype(jnp.float64)
        # The CPU widens in double precision and then rounds the ends to the input's dtype.
        same = lo == hi
        lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
        out.append((lo.astype(dt), hi.astype(dt)))
    return out


def _edges_from_counts(x, bins, rng) -> list:
    return [_linspace(lo, hi, int(n) + 1, x.dtype) for (lo, hi), n in zip(_outer_edges(x, len(bins), rng), bins,
                                                                          strict=True)]


def _hist(x, edges: list, weight, density: bool):
    """x (M, D), one edge vector per dimension -> the D-dimensional histogram."""
    dt = x.dtype
    sizes = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros((x.shape[0],), jnp.int64)
    keep = jnp.ones((x.shape[0],), bool)
    for k, e in enumerate(edges):
        v = x[:, k]
        keep = keep & (v >= e[0]) & (v <= e[-1])  # False for nan too
        pos = jnp.clip(jnp.searchsorted(e, v, side="right") - 1, 0, max(sizes[k] - 1, 0))
        flat = flat * sizes[k] + pos
    w = jnp.ones((x.shape[0],), dt) if weight is None else weight.reshape(-1).astype(dt)
    n = math.prod(sizes)
    hist = jnp.zeros((n,), dt).at[jnp.where(keep, flat, n)].add(w, mode="drop").reshape(sizes)
    if density:
        hist = hist / jnp.sum(hist)
        for k, e in enumerate(edges):
            shape = [1] * len(sizes)
            shape[k] = sizes[k]
            hist = hist / jnp.diff(e).reshape(shape)
    return hist


def _rows(x, d: int):
    return x.reshape(-1, d)


@lower("histogram.bin_ct")
def histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):  # noqa: A002 - ATen's name
    dt = ctx().out_dtypes[0]
    x = _rows(self.astype(dt), 1)
    edges = _edges_from_counts(x, [bins], range)
    return _hist(x, edges, weight, density), edges[0]


@lower("histogram.bins_tensor")
def histogram_bins_tensor(self, bins, *, weight=None, density=False):
    dt = ctx().out_dtypes[0]
    x = _rows(self.astype(dt), 1)
    edges = [bins.astype(dt)]
    return _hist(x, edges, weight, density), edges[0]


@lower("_histogramdd_bin_edges")
def histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):  # noqa: A002 - ATen's name
    d = self.shape[-1]
    return _edges_from_counts(_rows(self, d), bins, range)


@lower("_histogramdd_from_bin_cts")
def histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):  # noqa: A002 - ATen's name
    x = _rows(self, self.shape[-1])
    return _hist(x, _edges_from_counts(x, bins, range), weight, density)


@lower("_histogramdd_from_bin_tensors")
def histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    x = _rows(self, self.shape[-1])
    return _hist(x, [b.astype(x.dtype) for b in bins], weight, density)
