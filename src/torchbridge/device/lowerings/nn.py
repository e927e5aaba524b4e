"""Neural-network ops: convolution, pooling, normalization, upsampling, losses (forward and backward).

Backward ops take the saved values PyTorch hands them (save_mean/invstd, pooling indices...) so the
gradients follow the same formulas as the CPU kernels; where a backward is the exact transpose of a
linear forward (convolution, average pooling, bilinear upsampling) it is derived with `jax.vjp`.
Index and weight tables that depend only on shapes are built with NumPy at trace time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchbridge.device import host_calls
from torchbridge.device.lowerings.registry import KERNEL_OVERRIDES, ctx, lower

# PyTorch's CompositeExplicitAutograd kernels for these would shadow the lowerings below in eager mode.
# (convolution's would call convolution_overrideable, which only throws and has no meta kernel.)
# (_native_batch_norm_legit_no_training is one too; it gets its kernel below, with eval batch norm's.)
KERNEL_OVERRIDES.update({"convolution", "convolution_backward", "native_layer_norm", "native_group_norm"})

_MEAN, _SUM = 1, 2  # ATen's Reduction enum (0 is none)


def _out_shape(i: int = 0):
    return ctx().out_shapes[i]


def _acc(x):
    """Half-precision inputs are normalized/reduced in float32, as PyTorch's CPU kernels do."""
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


def _fit(x, i: int):
    """Outputs the CPU kernel leaves empty (e.g. save_mean in eval mode) keep the meta shape."""
    shape = _out_shape(i)
    if math.prod(shape) == 0:
        return jnp.zeros(shape, x.dtype)
    return jnp.reshape(x, shape)


def _per_dim(v, n: int) -> tuple[int, ...]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return tuple(v * n if len(v) == 1 else v)


def _masked(values, mask):
    return tuple(v if m else None for v, m in zip(values, mask, strict=True))


# ---- convolution ----
def _dimension_numbers(nsp: int):
    sp = "DHW"[3 - nsp:] if nsp <= 3 else "".join(chr(ord("a") + i) for i in range(nsp))
    return ("NC" + sp, "OI" + sp, "NC" + sp)


def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    nsp = w.ndim - 2
    stride, padding, dilation = _per_dim(stride, nsp), _per_dim(padding, nsp), _per_dim(dilation, nsp)
    dn = lax.conv_dimension_numbers(x.shape, w.shape, _dimension_numbers(nsp))
    if not transposed:
        return lax.conv_general_dilated(x, w, stride, [(p, p) for p in padding], rhs_dilation=dilation,
                                        dimension_numbers=dn, feature_group_count=groups)
    # A transposed convolution is the input-gradient of a convolution: dilate the input by the stride
    # and convolve with the spatially flipped kernel, in/out channels swapped within each group.
    output_padding = _per_dim(output_padding, nsp)
    cin, cout_g, *k = w.shape
    wt = w.reshape(groups, cin // groups, cout_g, *k).swapaxes(1, 2).reshape(groups * cout_g, cin // groups, *k)
    wt = jnp.flip(wt, axis=tuple(range(2, 2 + nsp)))
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op)
            for kk, p, d, op in zip(k, padding, dilation, output_padding, strict=True)]
    dn = lax.conv_dimension_numbers(x.shape, wt.shape, _dimension_numbers(nsp))
    return lax.conv_general_dilated(x, wt, (1,) * nsp, pads, lhs_dilation=stride, rhs_dilation=dilation,
                                    dimension_numbers=dn, feature_group_count=groups)


@lower("convolution", "convolution_overrideable", "_convolution")
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *flags):
    unbatched = input.ndim == weight.ndim - 1
    x = input[None] if unbatched else input
    out = _conv(x, weight.astype(x.dtype), stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out[0] if unbatched else out


def _conv_backward(grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups,
                   output_mask):
    def f(x, w):
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(f, input, weight.astype(input.dtype))
    grad_input, grad_weight = vjp(grad_output.astype(input.dtype))
    grad_bias = jnp.sum(grad_output, axis=(0,) + tuple(range(2, grad_output.ndim)))
    return _masked((grad_input, grad_weight, grad_bias), output_mask)


@lower("convolution_backward")
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    return _conv_backward(grad_output, input, weight, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask)


@lower("convolution_backward_overrideable")
def convolution_backward_overrideable(grad_output, input, weight, stride, padding, dilation, transposed,
                                      output_padding, groups, output_mask):
    return _conv_backward(grad_output, input, weight, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask)


# ---- pooling ----
def _pool_args(nsp, kernel_size, stride, padding, dilation=1):
    k = _per_dim(kernel_size, nsp)
    s = _per_dim(stride, nsp) if stride else k
    return k, s, _per_dim(padding, nsp), _per_dim(dilation, nsp)


def _window_positions(out_n: int, k: int, s: int, p: int, d: int) -> np.ndarray:
    """(out, k) input coordinates covered by each pooling window (may fall outside the input)."""
    return np.arange(out_n)[:, None] * s + np.arange(k)[None, :] * d - p


def _max_windows(x, windows):
    """Max and flat argmax over windows given per spatial dim as (positions (out, k), inside (out, k))."""
    nsp = len(windows)
    sizes = x.shape[-nsp:]
    outs = tuple(pos.shape[0] for pos, _ in windows)
    ks = tuple(pos.shape[1] for pos, _ in windows)
    idx, valid, flat = [], np.ones((1,) * (2 * nsp), bool), np.zeros((1,) * (2 * nsp), np.int64)
    for i, (pos, ok) in enumerate(windows):
        shape = [1] * (2 * nsp)
        shape[i], shape[nsp + i] = outs[i], ks[i]
        pos = np.clip(pos, 0, sizes[i] - 1).reshape(shape)
        idx.append(pos)
        valid = valid & ok.reshape(shape)
        flat = flat * sizes[i] + pos
    patches = x[(Ellipsis, *idx)]  # (..., out..., k...)
    low = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    patches = jnp.where(valid, patches, jnp.asarray(low, x.dtype))
    patches = patches.reshape(patches.shape[: x.ndim - nsp] + outs + (-1,))
    arg = jnp.argmax(patches, axis=-1)  # first maximum (NaN counts as maximum), like the CPU kernel
    values = jnp.take_along_axis(patches, arg[..., None], axis=-1)[..., 0]
    flat = jnp.asarray(np.broadcast_to(flat, outs + ks).reshape(outs + (-1,)))
    indices = jnp.take_along_axis(jnp.broadcast_to(flat, patches.shape), arg[..., None], axis=-1)[..., 0]
    return values, indices


def _max_pool_with_indices(nsp, x, kernel_size, stride, padding, dilation, ceil_mode):
    k, s, p, d = _pool_args(nsp, kernel_size, stride, padding, dilation)
    sizes = x.shape[-nsp:]
    windows = []
    for i, o in enumerate(_out_shape(0)[-nsp:]):
        pos = _window_positions(o, k[i], s[i], p[i], d[i])
        windows.append((pos, (pos >= 0) & (pos < sizes[i])))
    return _max_windows(x, windows)


def _adaptive_windows(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Adaptive pooling window i covers [floor(i*n/o), ceil((i+1)*n/o)); padded to the longest window."""
    start = (np.arange(n_out) * n_in) // n_out
    end = -((-(np.arange(n_out) + 1) * n_in) // n_out)
    pos = start[:, None] + np.arange(int((end - start).max()))[None, :]
    return pos, pos < end[:, None]


@lower("adaptive_max_pool2d")
def adaptive_max_pool2d(self, output_size):
    return _max_windows(self, [_adaptive_windows(n, o) for n, o in zip(self.shape[-2:], _out_shape()[-2:],
                                                                          strict=True)])


@lower("adaptive_max_pool3d")
def adaptive_max_pool3d(self, output_size):
    return _max_windows(self, [_adaptive_windows(n, o) for n, o in zip(self.shape[-3:], _out_shape()[-3:],
                                                                          strict=True)])


def _max_pool_backward(nsp, grad_output, x, indices):
    lead = x.shape[: x.ndim - nsp]
    n = math.prod(lead)
    g = grad_output.reshape(n, -1)
    idx = indices.reshape(n, -1)
    out = jnp.zeros((n, math.prod(x.shape[-nsp:])), grad_output.dtype)
    return out.at[jnp.arange(n)[:, None], idx].add(g).reshape(x.shape)


@lower("max_pool2d_with_indices")
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool_with_indices(2, self, kernel_size, stride, padding, dilation, ceil_mode)


@lower("max_pool3d_with_indices")
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool_with_indices(3, self, kernel_size, stride, padding, dilation, ceil_mode)


@lower("max_pool2d_with_indices_backward")
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _max_pool_backward(2, grad_output, self, indices)


@lower("adaptive_max_pool2d_backward")
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _max_pool_backward(2, grad_output, self, indices)


@lower("adaptive_max_pool3d_backward")
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _max_pool_backward(3, grad_output, self, indices)


@lower("max_pool3d_with_indices_backward")
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _max_pool_backward(3, grad_output, self, indices)


def _avg_divisors(outs, sizes, k, s, p, count_include_pad) -> np.ndarray:
    div = np.ones((), np.float64)
    for o, n, kk, ss, pp in zip(outs, sizes, k, s, p, strict=True):
        start = np.arange(o) * ss - pp
        end = np.minimum(start + kk, n + pp)
        if count_include_pad:
            size = end - start
        else:
            size = np.minimum(end, n) - np.maximum(start, 0)
        div = div[..., None] * size
    return div


def _avg_pool(nsp, x, outs, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    k, s, p, _ = _pool_args(nsp, kernel_size, stride, padding)
    sizes = x.shape[-nsp:]
    lead = x.ndim - nsp
    xf = _acc(x)
    hi = [max(0, (o - 1) * ss + kk - pp - n) for o, ss, kk, pp, n in zip(outs, s, k, p, sizes, strict=True)]
    # A concrete zero init makes this JAX's differentiable window-sum (the backward is its vjp).
    sums = lax.reduce_window(xf, np.zeros((), xf.dtype), lax.add, (1,) * lead + k, (1,) * lead + s,
                             [(0, 0)] * lead + [(pp, h) for pp, h in zip(p, hi, strict=True)])
    sums = sums[(Ellipsis, *[slice(0, o) for o in outs])]
    if divisor_override:
        return sums / divisor_override
    return sums / jnp.asarray(_avg_divisors(outs, sizes, k, s, p, count_include_pad), xf.dtype)


@lower("avg_pool2d")
def avg_pool2d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(2, self, _out_shape()[-2:], kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


@lower("avg_pool3d")
def avg_pool3d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(3, self, _out_shape()[-3:], kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


def _avg_pool_backward(nsp, grad_output, x, *args):
    outs = grad_output.shape[-nsp:]
    _, vjp = jax.vjp(lambda v: _avg_pool(nsp, v, outs, *args), jnp.zeros(x.shape, _acc(x).dtype))
    return vjp(_acc(grad_output))[0]


@lower("avg_pool2d_backward")
def avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override=None):
    return _avg_pool_backward(2, grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)


@lower("avg_pool3d_backward")
def avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override=None):
    return _avg_pool_backward(3, grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)


def _adaptive_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(out, in) averaging weights of adaptive pooling: window i covers [floor(i*n/o), ceil((i+1)*n/o))."""
    m = np.zeros((n_out, n_in))
    for i in range(n_out):
        start = (i * n_in) // n_out
        end = -((-(i + 1) * n_in) // n_out)
        m[i, start:end] = 1.0 / (end - start)
    return m


def _adaptive_avg(x, outs):
    nsp = len(outs)
    xf = _acc(x)
    for i, o in enumerate(outs):
        axis = x.ndim - nsp + i
        m = jnp.asarray(_adaptive_matrix(x.shape[axis], o), xf.dtype)
        xf = jnp.moveaxis(jnp.tensordot(xf, m, axes=([axis], [1])), -1, axis)
    return xf


@lower("_adaptive_avg_pool2d", "adaptive_avg_pool2d")
def adaptive_avg_pool2d(self, output_size):
    return _adaptive_avg(self, _out_shape()[-2:])


@lower("_adaptive_avg_pool3d", "adaptive_avg_pool3d")
def adaptive_avg_pool3d(self, output_size):
    return _adaptive_avg(self, _out_shape()[-3:])


def _adaptive_avg_backward(nsp, grad_output, x):
    outs = grad_output.shape[-nsp:]
    _, vjp = jax.vjp(lambda v: _adaptive_avg(v, outs), jnp.zeros(x.shape, _acc(x).dtype))
    return vjp(_acc(grad_output))[0]


@lower("_adaptive_avg_pool2d_backward")
def adaptive_avg_pool2d_backward(grad_output, self):
    return _adaptive_avg_backward(2, grad_output, self)


@lower("_adaptive_avg_pool3d_backward")
def adaptive_avg_pool3d_backward(grad_output, self):
    return _adaptive_avg_backward(3, grad_output, self)


def _im2col(x, kernel_size, dilation, padding, stride):
    """(N, C, H, W) -> (N, C*kh*kw, L) sliding blocks, channel-major like F.unfold (an exact gather)."""
    k, s, p, d = _pool_args(2, kernel_size, stride, padding, dilation)
    unbatched = x.ndim == 3
    x = x[None] if unbatched else x
    xp = jnp.pad(x, [(0, 0), (0, 0)] + [(pp, pp) for pp in p])
    outs = [(xp.shape[2 + i] - (d[i] * (k[i] - 1) + 1)) // s[i] + 1 for i in range(2)]
    hpos = _window_positions(outs[0], k[0], s[0], 0, d[0])  # (oh, kh) in padded coordinates
    wpos = _window_positions(outs[1], k[1], s[1], 0, d[1])
    patches = xp[:, :, hpos[:, None, :, None], wpos[None, :, None, :]]  # (N, C, oh, ow, kh, kw)
    n, c = x.shape[:2]
    cols = patches.transpose(0, 1, 4, 5, 2, 3).reshape(n, c * k[0] * k[1], outs[0] * outs[1])
    return cols[0] if unbatched else cols


@lower("im2col")
def im2col(self, kernel_size, dilation, padding, stride):
    return _im2col(self, kernel_size, dilation, padding, stride)


@lower("col2im")
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    # fold is the transpose of unfold: overlapping blocks add up.
    k = _per_dim(kernel_size, 2)
    lead = self.shape[:-2]
    channels = self.shape[-2] // (k[0] * k[1])
    zeros = jnp.zeros(lead + (channels,) + tuple(_per_dim(output_size, 2)), self.dtype)
    _, vjp = jax.vjp(lambda v: _im2col(v, kernel_size, dilation, padding, stride), zeros)
    return vjp(self)[0]


# ---- normalization ----
def _bshape(v, ndim: int, axis: int = 1):
    """A per-channel vector shaped to broadcast against an `ndim` tensor along `axis`."""
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


@lower("native_layer_norm")
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    x = _acc(input)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight.astype(x.dtype)
    if bias is not None:
        out = out + bias.astype(x.dtype)
    return out, _fit(mean, 1), _fit(rstd, 2)


@lower("native_layer_norm_backward")
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    k = len(normalized_shape)
    axes = tuple(range(input.ndim - k, input.ndim))
    lead = tuple(range(input.ndim - k))
    x, g = _acc(input), _acc(grad_out)
    shape = input.shape[: input.ndim - k] + (1,) * k
    mean, rstd = mean.astype(x.dtype).reshape(shape), rstd.astype(x.dtype).reshape(shape)
    xhat = (x - mean) * rstd
    gw = g * weight.astype(x.dtype) if weight is not None else g
    dx = rstd * (gw - jnp.mean(gw, axis=axes, keepdims=True) - xhat * jnp.mean(gw * xhat, axis=axes, keepdims=True))
    dw = jnp.sum(g * xhat, axis=lead) if weight is not None else None
    db = jnp.sum(g, axis=lead) if bias is not None else None
    return _masked((dx, dw, db), output_mask)


@lower("native_group_norm")
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = _acc(input).reshape(N, group, -1)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    rstd = lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True) + eps)
    out = ((x - mean) * rstd).reshape(input.shape)
    if weight is not None:
        out = out * _bshape(weight.astype(out.dtype), input.ndim)
    if bias is not None:
        out = out + _bshape(bias.astype(out.dtype), input.ndim)
    return out, mean.reshape(N, group), rstd.reshape(N, group)


@lower("native_group_norm_backward")
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    x = _acc(input).reshape(N, group, C // group, HxW)
    g = _acc(grad_out).reshape(N, group, C // group, HxW)
    mean = mean.astype(x.dtype).reshape(N, group, 1, 1)
    rstd = rstd.astype(x.dtype).reshape(N, group, 1, 1)
    xhat = (x - mean) * rstd
    gw = g * weight.astype(x.dtype).reshape(1, group, C // group, 1) if weight is not None else g
    axes = (2, 3)
    dx = rstd * (gw - jnp.mean(gw, axis=axes, keepdims=True) - xhat * jnp.mean(gw * xhat, axis=axes, keepdims=True))
    dw = jnp.sum(g * xhat, axis=(0, 3)).reshape(C)
    db = jnp.sum(g, axis=(0, 3)).reshape(C)
    return _masked((dx.reshape(input.shape), dw, db), output_mask)


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_invstd, new_running_mean, new_running_var)."""
    x = _acc(input)
    axes = (0,) + tuple(range(2, x.ndim))
    new_rm, new_rv = running_mean, running_var
    if training:
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - _bshape(mean, x.ndim)), axis=axes)
        invstd = lax.rsqrt(var + eps)
        n = x.size // x.shape[1]
        if running_mean is not None:
            new_rm = (1 - momentum) * running_mean + momentum * mean.astype(running_mean.dtype)
        if running_var is not None:
            unbiased = var * (n / (n - 1)) if n > 1 else var
            new_rv = (1 - momentum) * running_var + momentum * unbiased.astype(running_var.dtype)
    else:
        mean = running_mean.astype(x.dtype)
        invstd = lax.rsqrt(running_var.astype(x.dtype) + eps)
    out = (x - _bshape(mean, x.ndim)) * _bshape(invstd, x.ndim)
    if weight is not None:
        out = out * _bshape(weight.astype(x.dtype), x.ndim)
    if bias is not None:
        out = out + _bshape(bias.astype(x.dtype), x.ndim)
    return out, mean, invstd, new_rm, new_rv


def _stats(new_rm, new_rv) -> dict:
    return {k: v for k, v in (("running_mean", new_rm), ("running_var", new_rv)) if v is not None}


@lower("native_batch_norm", mutates=("running_mean", "running_var"))
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    out, mean, invstd, rm, rv = _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return (out, _fit(mean, 1), _fit(invstd, 2)), _stats(rm, rv)


@lower("_native_batch_norm_legit", mutates=("running_mean", "running_var"))
def native_batch_norm_legit(input, weight, bias, *rest):
    if isinstance(rest[0], bool):  # the .no_stats overload: (training, momentum, eps)
        running_mean = running_var = None
        training, momentum, eps = rest
    else:
        running_mean, running_var, training, momentum, eps = rest
    out, mean, invstd, rm, rv = _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return (out, _fit(mean, 1), _fit(invstd, 2)), _stats(rm, rv)


@lower("_native_batch_norm_legit_no_training")
def native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, invstd, _, _ = _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)
    return out, _fit(mean, 1), _fit(invstd, 2)


@lower("_native_batch_norm_legit_functional")
def native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    out, mean, invstd, rm, rv = _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return out, _fit(mean, 1), _fit(invstd, 2), rm, rv


@lower("_batch_norm_with_update", mutates=("running_mean", "running_var"))
def batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, invstd, rm, rv = _batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return (out, _fit(mean, 1), _fit(invstd, 2), jnp.zeros(_out_shape(3), jnp.uint8)), _stats(rm, rv)




def _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                         output_mask):
    x, g = _acc(input), _acc(grad_out)
    axes = (0,) + tuple(range(2, x.ndim))
    if train:
        mean, invstd = save_mean.astype(x.dtype), save_invstd.astype(x.dtype)
    else:
        mean, invstd = running_mean.astype(x.dtype), lax.rsqrt(running_var.astype(x.dtype) + eps)
    xhat = (x - _bshape(mean, x.ndim)) * _bshape(invstd, x.ndim)
    gsum = jnp.sum(g, axis=axes)
    dot = jnp.sum(g * xhat, axis=axes)
    scale = invstd * weight.astype(x.dtype) if weight is not None else invstd
    if train:
        n = x.size // x.shape[1]
        dx = (g - _bshape(gsum / n, x.ndim) - xhat * _bshape(dot / n, x.ndim)) * _bshape(scale, x.ndim)
    else:
        dx = g * _bshape(scale, x.ndim)
    return _masked((dx, dot, gsum), output_mask)


@lower("native_batch_norm_backward")
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
                               eps, output_mask):
    return _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
                                eps, output_mask)


@lower("batch_norm_backward")
def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps,
                        output_mask, reserve):
    return _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps,
                                output_mask)


# ---- upsampling ----
def _scales(rest, nsp: int) -> list:
    """Per-dim scale factors from either (scales_h, scales_w) or the .vec overload's scale_factors list."""
    if len(rest) == 1 and (rest[0] is None or isinstance(rest[0], (list, tuple))):
        return list(rest[0]) if rest[0] is not None else [None] * nsp
    return list(rest) + [None] * (nsp - len(rest))


def _source_scale(n_in: int, n_out: int, scale, dtype) -> np.floating:
    # compute_scales_value in ATen's UpSample.h: 1/scale when given, else in/out.
    if scale is not None and scale > 0:
        return dtype(1.0 / scale)
    return dtype(n_in) / dtype(n_out)


def _nearest_index(n_in: int, n_out: int, scale, exact: bool) -> np.ndarray:
    s = _source_scale(n_in, n_out, scale, np.float32)
    if exact:  # "nearest-exact": sample at pixel centres
        return np.minimum(np.floor((np.arange(n_out) + 0.5) * s).astype(np.int64), n_in - 1)
    if n_out == n_in:
        return np.arange(n_out)
    if n_out == 2 * n_in:
        return np.arange(n_out) >> 1
    return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * s).astype(np.int64), n_in - 1)


def _nearest_indices(in_sizes, out_sizes, scales, exact: bool) -> tuple:
    nsp = len(in_sizes)
    idx = []
    for i, (n_in, n_out, sc) in enumerate(zip(in_sizes, out_sizes, scales, strict=True)):
        shape = [1] * nsp
        shape[i] = n_out
        idx.append(_nearest_index(n_in, n_out, sc, exact).reshape(shape))
    return tuple(idx)


def _upsample_nearest(nsp, exact=False):
    def fn(input, output_size, *rest):
        outs = _out_shape()[-nsp:]
        return input[(Ellipsis, *_nearest_indices(input.shape[-nsp:], outs, _scales(rest, nsp), exact))]

    return fn


def _upsample_nearest_backward(nsp, exact=False):
    def fn(grad_output, output_size, input_size, *rest):
        idx = _nearest_indices(tuple(input_size)[-nsp:], grad_output.shape[-nsp:], _scales(rest, nsp), exact)
        return jnp.zeros(tuple(input_size), grad_output.dtype).at[(Ellipsis, *idx)].add(grad_output)

    return fn


for _n in (1, 2, 3):
    lower(f"upsample_nearest{_n}d")(_upsample_nearest(_n))
    lower(f"upsample_nearest{_n}d_backward")(_upsample_nearest_backward(_n))
    lower(f"_upsample_nearest_exact{_n}d")(_upsample_nearest(_n, exact=True))
    lower(f"_upsample_nearest_exact{_n}d_backward")(_upsample_nearest_backward(_n, exact=True))


def _linear_weights(n_in: int, n_out: int, align_corners: bool, scale, dtype):
    """Source indices (i0, i1) and weights (w0, w1) of linear interpolation along one dim (ATen's formula)."""
    dst = np.arange(n_out, dtype=dtype)
    if align_corners:
        s = dtype((n_in - 1) / (n_out - 1)) if n_out > 1 else dtype(0)
        src = dst * s
    else:
        s = _source_scale(n_in, n_out, scale, dtype)
        src = np.maximum(s * (dst + dtype(0.5)) - dtype(0.5), dtype(0))
    i0 = src.astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    w1 = (src - i0).astype(dtype)
    return i0, i1, (dtype(1) - w1), w1


def _upsample_linear(x, outs, align_corners, scales):
    nsp = len(outs)
    np_dtype = np.float64 if x.dtype == jnp.float64 else np.float32
    xf = _acc(x)
    for i, o in enumerate(outs):
        axis = x.ndim - nsp + i
        i0, i1, w0, w1 = _linear_weights(x.shape[axis], o, align_corners, scales[i], np_dtype)
        shape = [1] * (x.ndim - axis)
        shape[0] = o
        w0 = jnp.asarray(w0, xf.dtype).reshape(shape)
        w1 = jnp.asarray(w1, xf.dtype).reshape(shape)
        xf = jnp.take(xf, i0, axis=axis) * w0 + jnp.take(xf, i1, axis=axis) * w1
    return xf


def _upsample_linear_fwd(nsp):
    def fn(input, output_size, align_corners, *rest):
        return _upsample_linear(input, _out_shape()[-nsp:], align_corners, _scales(rest, nsp))

    return fn


def _upsample_linear_bwd(nsp):
    def fn(grad_output, output_size, input_size, align_corners, *rest):
        outs = grad_output.shape[-nsp:]
        scales = _scales(rest, nsp)
        zeros = jnp.zeros(tuple(input_size), _acc(grad_output).dtype)
        _, vjp = jax.vjp(lambda v: _upsample_linear(v, outs, align_corners, scales), zeros)
        return vjp(_acc(grad_output))[0]

    return fn


lower("upsample_linear1d")(_upsample_linear_fwd(1))
lower("upsample_bilinear2d")(_upsample_linear_fwd(2))
lower("upsample_trilinear3d")(_upsample_linear_fwd(3))
lower("upsample_linear1d_backward")(_upsample_linear_bwd(1))
lower("upsample_bilinear2d_backward")(_upsample_linear_bwd(2))
lower("upsample_trilinear3d_backward")(_upsample_linear_bwd(3))


# ---- losses ----
def _reduce(loss, reduction: int):
    if reduction == _MEAN:
        return jnp.mean(loss)
    if reduction == _SUM:
        return jnp.sum(loss)
    return loss


def _nll_parts(self, target, weight, ignore_index):
    """Flattened (N, C) scores, targets clipped into range, per-sample weights (0 where ignored)."""
    c = self.shape[-1]
    x = self.reshape(-1, c)
    t = target.reshape(-1)
    valid = t != ignore_index
    tc = jnp.where(valid, t, 0)
    w = weight.astype(x.dtype)[tc] if weight is not None else jnp.ones(t.shape, x.dtype)
    return x, tc, jnp.where(valid, w, 0)


def _nll_forward(self, target, weight, reduction, ignore_index):
    x, t, w = _nll_parts(self, target, weight, ignore_index)
    loss = -jnp.take_along_axis(x, t[:, None], axis=1)[:, 0] * w
    total = jnp.sum(w)
    if reduction == _MEAN:
        return jnp.sum(loss) / total, total
    if reduction == _SUM:
        return jnp.sum(loss), total
    return loss.reshape(target.shape), total


def _nll_row_grads(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """(N, C) scores, the one-hot of the targets, and s_i: the NLL gradient is -s_i at row i's target."""
    x, t, w = _nll_parts(self, target, weight, ignore_index)
    g = grad_output.reshape(-1) if reduction not in (_MEAN, _SUM) else grad_output
    if reduction == _MEAN:
        g = g / total_weight
    hit = lax.broadcasted_iota(t.dtype, x.shape, 1) == t[:, None]
    return x, hit, (w * g).astype(x.dtype)[:, None]


def _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    # a select against the class index: one elementwise pass over (N, C) instead of broadcasting
    # zeros and scattering into them (two passes; 8 x 128 x 8192 logits: ~15 ms instead of ~25 ms)
    _, hit, s = _nll_row_grads(grad_output, self, target, weight, reduction, ignore_index, total_weight)
    return jnp.where(hit, (-s).astype(self.dtype), jnp.zeros((), self.dtype))


def nll_log_softmax_backward(grad_output, log_probs, target, weight, reduction, ignore_index, total_weight):
    """`_log_softmax_backward_data(nll_loss_backward(...), log_probs, dim=1)`, cross-entropy's gradient
    with respect to the logits, as one elementwise pass: the NLL gradient has one nonzero per row,
    -s_i at the target, so its row sum is -s_i and the log-softmax backward g - exp(y) * sum(g)
    becomes s_i * (exp(y) - onehot). Computed as two ops, XLA materialises the one-hot gradient and
    then reduces it over the classes (8 x 128 x 8192 logits on 2 cores: ~49 ms against ~10 here)."""
    x, hit, s = _nll_row_grads(grad_output, log_probs, target, weight, reduction, ignore_index, total_weight)
    return (s * (jnp.exp(x) - hit.astype(x.dtype))).reshape(log_probs.shape)


def _channels_last(x):
    return jnp.moveaxis(x, 1, -1) if x.ndim > 1 else x


@lower("nll_loss_forward")
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll_forward(self, target, weight, reduction, ignore_index)


@lower("nll_loss_backward")
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    return _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight).reshape(self.shape)


@lower("nll_loss2d_forward")
def nll_loss2d_forward(self, target, weight, reduction, ignore_index):
    return _nll_forward(_channels_last(self), target, weight, reduction, ignore_index)


@lower("nll_loss2d_backward")
def nll_loss2d_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    grad = _nll_backward(grad_output, _channels_last(self), target, weight, reduction, ignore_index, total_weight)
    return jnp.moveaxis(grad.reshape(_channels_last(self).shape), -1, 1)


@lower("mse_loss")
def mse_loss(self, target, reduction=_MEAN):
    return _reduce(jnp.square(self - target), reduction)


@lower("mse_loss_backward")
def mse_loss_backward(grad_output, self, target, reduction):
    g = 2 * (self - target) * grad_output
    return g / self.size if reduction == _MEAN else g


_BCE_EPS = 1e-12  # the CPU kernel's clamp of x*(1-x) in the gradient


@lower("binary_cross_entropy")
def binary_cross_entropy(self, target, weight=None, reduction=_MEAN):
    # log is clamped at -100 so that x = 0 or 1 gives a finite loss, as in PyTorch.
    log_x = jnp.maximum(jnp.log(self), -100)
    log_1mx = jnp.maximum(jnp.log1p(-self), -100)
    loss = -(target * log_x + (1 - target) * log_1mx)
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@lower("binary_cross_entropy_backward")
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=_MEAN):
    g = grad_output * (self - target) / jnp.maximum((1 - self) * self, _BCE_EPS)
    if weight is not None:
        g = g * weight
    return g / self.size if reduction == _MEAN else g


@lower("smooth_l1_loss")
def smooth_l1_loss(self, target, reduction=_MEAN, beta=1.0):
    d = jnp.abs(self - target)
    loss = d if beta == 0 else jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)
    return _reduce(loss, reduction)


@lower("smooth_l1_loss_backward")
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    d = self - target
    g = jnp.sign(d) if beta == 0 else jnp.where(jnp.abs(d) < beta, d / beta, jnp.sign(d))
    g = g * grad_output
    return g / self.size if reduction == _MEAN else g


@lower("huber_loss")
def huber_loss(self, target, reduction=_MEAN, delta=1.0):
    d = jnp.abs(self - target)
    return _reduce(jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta)), reduction)


@lower("huber_loss_backward")
def huber_loss_backward(grad_output, self, target, reduction, delta):
    d = self - target
    g = jnp.clip(d, -delta, delta) * grad_output
    return g / self.size if reduction == _MEAN else g


# ---- fused optimizer steps (torch.optim.*(fused=True)) ----
# One lowering serves the in-place op (`_fused_adam_`, which returns nothing and mutates its lists)
# and its functional twin (`_fused_adam`, which returns the new lists): for the functional one the
# meta kernel reports outputs, and the "mutations" are the unchanged inputs.
def _optimizer_result(new: dict, old: dict, order: tuple[str, ...]):
    if ctx().out_shapes:  # functional variant
        return tuple(new[k] for k in order), old
    return new[order[0]], {k: new[k] for k in order[1:]}


def _unscale(grads, grad_scale, maximize):
    if grad_scale is not None:
        grads = [g / grad_scale.astype(g.dtype) for g in grads]
    return grads, [-g if maximize else g for g in grads]


def _skip_if_inf(found_inf, new: list, old: list) -> list:
    if found_inf is None:
        return new
    return [jnp.where(found_inf != 0, o, n) for n, o in zip(new, old, strict=True)]


def _adam(decoupled: bool):
    def fn(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2, weight_decay, eps,
           amsgrad, maximize, grad_scale=None, found_inf=None):
        raw_grads = list(grads)  # a skipped (found_inf) step leaves the grads as they came, like PyTorch
        stored_grads, grads = _unscale(grads, grad_scale, maximize)
        params, m1, m2, vmax = [], [], [], []
        for i, (p, g, m, v, step) in enumerate(zip(self, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True)):
            lr_ = jnp.asarray(lr, p.dtype)
            step = jnp.asarray(step).astype(p.dtype)
            bc1 = 1 - jnp.power(beta1, step)
            bc2_sqrt = jnp.sqrt(1 - jnp.power(beta2, step))
            if not amsgrad:  # one pass over the parameter's arrays (host_calls.adam_update)
                p, m, v = host_calls.adam_update(
                    p, g, m, v, decay=1 - lr_ * weight_decay if decoupled else 1.0,
                    l2=0.0 if decoupled else weight_decay, w1=1 - beta1, beta2=beta2, w2=1 - beta2, step_size=lr_ / bc1,
                    bc2_sqrt=bc2_sqrt, eps=eps)
                params.append(p)
                m1.append(m)
                m2.append(v)
                continue
            if weight_decay != 0:
                if decoupled:
                    p = p * (1 - lr_ * weight_decay)
                else:
                    g = g + weight_decay * p
            m = m + (1 - beta1) * (g - m)
            v = beta2 * v + (1 - beta2) * g * g
            if amsgrad:
                vm = jnp.maximum(max_exp_avg_sqs[i], v)
                vmax.append(vm)
                denom = jnp.sqrt(vm) / bc2_sqrt + eps
            else:
                denom = jnp.sqrt(v) / bc2_sqrt + eps
            params.append(p - (lr_ / bc1) * m / denom)
            m1.append(m)
            m2.append(v)
        old = {"self": list(self), "grads": raw_grads, "exp_avgs": list(exp_avgs), "exp_avg_sqs": list(exp_avg_sqs),
               "max_exp_avg_sqs": list(max_exp_avg_sqs)}
        new = {"self": _skip_if_inf(found_inf, params, old["self"]),
               "grads": _skip_if_inf(found_inf, stored_grads, raw_grads),
               "exp_avgs": _skip_if_inf(found_inf, m1, old["exp_avgs"]),
               "exp_avg_sqs": _skip_if_inf(found_inf, m2, old["exp_avg_sqs"]),
               "max_exp_avg_sqs": _skip_if_inf(found_inf, vmax, old["max_exp_avg_sqs"]) if amsgrad else []}
        return _optimizer_result(new, {k: v for k, v in old.items() if k != "self"},
                                 ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"))

    return fn


_OPT_MUTATES = ("grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")
# The learning rate is traced: with an LR scheduler it changes every step, and each new value would
# otherwise compile a new program.
lower("_fused_adam", mutates=_OPT_MUTATES, dynamic=("lr",))(_adam(decoupled=False))
lower("_fused_adamw", mutates=_OPT_MUTATES, dynamic=("lr",))(_adam(decoupled=True))


@lower("_fused_sgd", mutates=("grads", "momentum_buffer_list"), dynamic=("lr",))
def fused_sgd(self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize,
              is_first_step, grad_scale=None, found_inf=None):
    raw_grads = list(grads)  # a skipped (found_inf) step leaves the grads as they came, like PyTorch
    stored_grads, grads = _unscale(grads, grad_scale, maximize)
    params, bufs = [], []
    for i, (p, g) in enumerate(zip(self, grads, strict=True)):
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            buf = g if is_first_step else momentum * momentum_buffer_list[i] + (1 - dampening) * g
            bufs.append(buf)
            g = g + momentum * buf if nesterov else buf
        params.append(p - jnp.asarray(lr, p.dtype) * g)
    old = {"self": list(self), "grads": raw_grads, "momentum_buffer_list": list(momentum_buffer_list)}
    new = {"self": _skip_if_inf(found_inf, params, old["self"]), "grads": _skip_if_inf(found_inf, stored_grads, raw_grads),
           "momentum_buffer_list": _skip_if_inf(found_inf, bufs, old["momentum_buffer_list"]) if momentum != 0 else []}
    return _optimizer_result(new, {k: v for k, v in old.items() if k != "self"},
                             ("self", "grads", "momentum_buffer_list"))
