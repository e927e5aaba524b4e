"""upsample_bicubic2d_backward: the gradient of bicubic upsampling.

The forward reaches the device as PyTorch's decomposition. Bicubic upsampling is linear and separable:
out = W_h x W_w^T per image, where row o of W holds the four cubic-convolution weights (A = -0.75)
of output pixel o at the source pixels floor(src) - 1 .. floor(src) + 2, clamped into the image (so
border pixels collect the weights of taps past the edge). The source coordinate follows ATen's CPU
kernel (align_corners: o * (in - 1) / (out - 1); else (o + 0.5) / scale - 0.5, not clamped at 0 for
cubic), computed in the input's dtype. The backward is the transpose, W_h^T g W_w. An unchanged size
is a copy on the CPU whatever the scale, and so here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from torchbridge.device.lowerings.nn import _scales, _source_scale
from torchbridge.device.lowerings.registry import ctx, lower

_A = -0.75


def _cubic_weights(t: np.ndarray) -> list[np.ndarray]:
    """The four tap weights for fractional offsets t."""

    def near(x):  # |x| <= 1
        return ((_A + 2) * x - (_A + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _matrix(n_in: int, n_out: int, align_corners: bool, scale, dtype) -> np.ndarray:
    """(n_out, n_in) interpolation matrix along one dimension."""
    if n_in == n_out:
        return np.eye(n_out, dtype=np.float64)
    dst = np.arange(n_out, dtype=dtype)
    if align_corners:
        s = dtype((n_in - 1) / (n_out - 1)) if n_out > 1 else dtype(0)
        src = s * dst
    else:
        src = _source_scale(n_in, n_out, scale, dtype) * (dst + dtype(0.5)) - dtype(0.5)
    base = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    t = np.clip(src - base, 0, 1).astype(np.float64)
    m = np.zeros((n_out, n_in), np.float64)
    rows = np.arange(n_out)
    for k, w in enumerate(_cubic_weights(t)):
        np.add.at(m, (rows, np.clip(base - 1 + k, 0, n_in - 1)), w)
    return m


@lower("upsample_bicubic2d_backward")
def upsample_bicubic2d_backward(grad_output, output_size, input_size, align_corners, *rest):
    dt = ctx().out_dtypes[0]
    acc = jnp.float32 if dt in (jnp.float16, jnp.bfloat16) else dt
    np_dt = np.float64 if acc == jnp.float64 else np.float32
    (in_h, in_w), (out_h, out_w) = tuple(input_size)[-2:], grad_output.shape[-2:]
    sh, sw = _scales(rest, 2)
    wh = jnp.asarray(_matrix(in_h, out_h, align_corners, sh, np_dt), acc)
    ww = jnp.asarray(_matrix(in_w, out_w, align_corners, sw, np_dt), acc)
    g = grad_output.astype(acc)
    return jnp.einsum("oh,...ow,wp->...hp", wh, g, ww).reshape(tuple(input_size))
