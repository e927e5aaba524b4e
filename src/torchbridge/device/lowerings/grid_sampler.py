"""Grid sampling: grid_sampler_3d, and the gradients of 2-D and 3-D grid sampling w.r.t. the input and
the grid.

grid_sampler_2d's forward reaches the device as PyTorch's decomposition (3-D has none); the backward
ops are `jax.vjp` of the sampler written here after ATen's CPU kernels (interpolation 0 bilinear or
trilinear, 1 nearest, 2 bicubic (2-D only); padding 0 zeros, 1 border, 2 reflection):

* grid values in [-1, 1] map to pixel coordinates ((g + 1) / 2 * (size - 1) with align_corners, else
  ((g + 1) * size - 1) / 2);
* border clips the coordinate into [0, size - 1]; reflection first reflects it about the image's edges
  (pixel centres with align_corners, pixel borders otherwise), then clips. A coordinate clipped to an
  edge, or lying exactly on one, gets no gradient, as ATen treats the edges as outside;
* bilinear and nearest read the (padded) coordinate's neighbours, taking 0 outside the image; nearest
  rounds half to even and passes no gradient to the grid;
* bicubic reads the 4 x 4 neighbours of the unpadded coordinate, applying the padding to each tap's
  integer position, with the cubic-convolution weights of upsampling (A = -0.75).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2
_A = -0.75


def _unnormalize(coord, size: int, align_corners: bool):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _clip(coord, size: int):
    # jnp.where rather than jnp.clip: the edges themselves must get gradient 0
    hi = size - 1
    return jnp.where(coord <= 0, jnp.zeros_like(coord), jnp.where(coord >= hi, jnp.full_like(coord, hi), coord))


def _reflect(coord, twice_low: int, twice_high: int):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    lo = twice_low / 2
    span = (twice_high - twice_low) / 2
    d = coord - lo
    sign = jnp.where(d < 0, -1.0, 1.0).astype(coord.dtype)
    d = d * sign
    extra = jnp.fmod(d, span)
    flips = jnp.floor(d / span)
    even = jnp.fmod(flips, 2) == 0
    return jnp.where(even, extra + lo, span - extra + lo)


def _pad(coord, size: int, padding: int, align_corners: bool):
    if padding == _BORDER:
        return _clip(coord, size)
    if padding == _REFLECTION:
        if align_corners:
            coord = _reflect(coord, 0, 2 * (size - 1))
        else:
            coord = _reflect(coord, -1, 2 * size - 1)
        return _clip(coord, size)
    return coord


def _gather(img, idx):
    """img (C, *spatial), integer positions (one per spatial dim, each of the output's shape) ->
    (C, *out), zero where outside the image."""
    sizes = img.shape[1:]
    inside = jnp.ones(idx[0].shape, bool)
    for i, n in zip(idx, sizes, strict=True):
        inside = inside & (i >= 0) & (i < n)
    v = img[(slice(None), *(jnp.clip(i, 0, n - 1) for i, n in zip(idx, sizes, strict=True)))]
    return jnp.where(inside[None], v, jnp.zeros((), img.dtype))


def _cubic(t):
    def near(x):
        return ((_A + 2) * x - (_A + 3)) * x * x + 1

    def far(x):
        return ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _sample_one(img, grid, mode: int, padding: int, align_corners: bool):
    sizes = img.shape[1:]
    # grid's last axis lists x, y(, z): the spatial dims from the last one back
    coords = [grid[..., len(sizes) - 1 - k] for k in range(len(sizes))]
    if mode == _BICUBIC:
        if len(sizes) != 2:
            raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
        h, w = sizes
        y, x = _unnormalize(coords[0], h, align_corners), _unnormalize(coords[1], w, align_corners)
        x0, y0 = jnp.floor(x), jnp.floor(y)
        wx, wy = _cubic(x - x0), _cubic(y - y0)

        def tap(i, j):
            tx = _pad(x0 - 1 + i, w, padding, align_corners).astype(jnp.int64)
            ty = _pad(y0 - 1 + j, h, padding, align_corners).astype(jnp.int64)
            return _gather(img, [jax.lax.stop_gradient(ty), jax.lax.stop_gradient(tx)])

        rows = [sum(tap(i, j) * wx[i][None] for i in range(4)) for j in range(4)]
        return sum(rows[j] * wy[j][None] for j in range(4))
    pos = [_pad(_unnormalize(c, n, align_corners), n, padding, align_corners) for c, n in zip(coords, sizes,
                                                                                             strict=True)]
    if mode == _NEAREST:
        return _gather(img, [jax.lax.stop_gradient(jnp.round(p)).astype(jnp.int64) for p in pos])
    lows = [jax.lax.stop_gradient(jnp.floor(p)) for p in pos]
    out = None
    for corner in itertools.product((0, 1), repeat=len(pos)):
        weight = None
        for bit, p, lo in zip(corner, pos, lows, strict=True):
            f = (p - lo) if bit else (lo + 1 - p)
            weight = f if weight is None else weight * f
        term = _gather(img, [lo.astype(jnp.int64) + bit for bit, lo in zip(corner, lows, strict=True)]) * weight[None]
        out = term if out is None else out + term
    return out


def _sample(inp, grid, mode: int, padding: int, align_corners: bool):
    return jax.vmap(lambda i, g: _sample_one(i, g, mode, padding, align_corners))(inp, grid)


def grid_sampler_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners,
                             output_mask):
    dt = ctx().out_dtypes[-1]
    acc = jnp.float32 if dt in (jnp.float16, jnp.bfloat16) else dt
    x, g = input.astype(acc), grid.astype(acc)
    _, vjp = jax.vjp(lambda a, b: _sample(a, b, interpolation_mode, padding_mode, align_corners), x, g)
    grad_input, grad_grid = vjp(grad_output.astype(acc))
    return (grad_input if output_mask[0] else None), grad_grid


lower("grid_sampler_2d_backward", "grid_sampler_3d_backward")(grid_sampler_backward)


@lower("grid_sampler_3d")
def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    dt = ctx().out_dtypes[0]
    acc = jnp.float32 if dt in (jnp.float16, jnp.bfloat16) else dt
    return _sample(input.astype(acc), grid.astype(acc), interpolation_mode, padding_mode, align_corners)
