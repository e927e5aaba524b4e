"""A device tensor's values as a JAX array, and back: for code that works on values outside the op
dispatcher (.item(), .cpu(), collectives, custom kernels, ops with data-dependent shapes).

A tensor that covers its whole storage contiguously (a DDP bucket, a freshly allocated gradient,
most FSDP shards) is its storage's buffer: reading it and writing it are table lookups, with no
program run. Any other view is gathered out of / scattered into its storage by a small cached program.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from torchbridge.device import dtypes, views
from torchbridge.device.runtime import STATE

_readers: dict[Any, Any] = {}
_writers: dict[Any, Any] = {}


def _parts(t: torch.Tensor) -> tuple[int, jax.Array, Any, views.ViewSpec, int]:
    STATE.table.drain()
    storage = t.untyped_storage()
    key = storage.data_ptr()
    jdt = dtypes.to_jax(t.dtype)
    buf = STATE.table.get_or_zeros(key, storage.nbytes(), jdt, jax_device(t))
    spec = views.ViewSpec(tuple(t.shape), tuple(t.stride()), t.storage_offset())
    return key, buf, jdt, spec, storage.nbytes() // jdt.itemsize


def jax_device(t: torch.Tensor) -> jax.Device:
    return STATE.jax_device(t.device.index or 0)


def _whole(t: torch.Tensor, buf: jax.Array, jdt: Any, count: int) -> bool:
    return buf.dtype == jdt and t.numel() == count and t.storage_offset() == 0 and t.is_contiguous()


def _read(buf: jax.Array, jdt: Any, spec: views.ViewSpec, count: int, flat: bool) -> jax.Array:
    rk = (spec, buf.shape, buf.dtype, jdt, count, flat)
    reader = _readers.get(rk)
    if reader is None:
        def read(b: jax.Array) -> jax.Array:
            v = views.read(views.bitcast_flat(b, jdt, count), spec)
            return v.reshape(-1) if flat else v

        reader = _readers[rk] = jax.jit(read)
    return reader(buf)


def value(t: torch.Tensor) -> jax.Array:
    """The values of a device tensor as a contiguous JAX array of its shape, on its device."""
    _, buf, jdt, spec, count = _parts(t)
    return _read(buf, jdt, spec, count, flat=False)


def flat_value(t: torch.Tensor) -> jax.Array:
    """`t`'s values, row-major, as a 1-d array on its device (t's dtype)."""
    _, buf, jdt, spec, count = _parts(t)
    if _whole(t, buf, jdt, count):
        return buf
    return _read(buf, jdt, spec, count, flat=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a device tensor (contiguous, same shape and dtype)."""
    _, buf, jdt, spec, count = _parts(t)
    if STATE.platform == "cpu" and buf.dtype == jdt and jdt != np.bool_:
        # JAX's CPU buffers are host memory: gather the view with numpy, no program per view shape
        # (a compiled graph's output of a changing size is a view into a padded buffer, compile/bounded.py)
        flat = np.asarray(buf)
        item = flat.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(flat[spec.offset:], shape=spec.shape,
                                               strides=tuple(s * item for s in spec.strides))
        return dtypes.numpy_to_host(np.ascontiguousarray(view), t.dtype).reshape(t.shape)
    return dtypes.numpy_to_host(np.asarray(value(t)), t.dtype).reshape(t.shape)


def from_array(arr: jax.Array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new contiguous device tensor holding `arr` (already of the right JAX dtype)."""
    out = torch.empty(tuple(arr.shape), dtype=dtype, device=device)
    jdev = STATE.jax_device(device.index or 0)
    STATE.table.set(out.untyped_storage().data_ptr(), jax.device_put(arr.reshape(-1), jdev))
    return out


def write_from_host(t: torch.Tensor, host: torch.Tensor) -> bool:
    """`t.copy_(host)` as one transfer when `t` covers its whole storage contiguously and `host` is a
    CPU tensor of its shape and dtype (what `.to(device)` does): the storage gets the host values as
    its buffer, with no program, so a new shape (a jagged batch's index list) compiles nothing.
    False (nothing done) otherwise.

    In fused eager mode this is also safe while ops are recorded: a recorded op that reads the storage
    holds its old buffer already, one recorded later reads the new one, and a recorded write still
    pending for the storage is dropped at the flush (its placeholder is no longer in the table), as the
    host's values come after it."""
    if (host.device.type != "cpu" or host.dtype != t.dtype or tuple(host.shape) != tuple(t.shape)
            or host.is_conj() or host.is_neg() or t.is_conj() or t.is_neg()):
        return False
    STATE.table.drain()
    storage = t.untyped_storage()
    if t.storage_offset() != 0 or not t.is_contiguous() or storage.nbytes() != t.numel() * t.element_size():
        return False
    arr = dtypes.host_to_numpy(host).reshape(-1)
    STATE.table.set(storage.data_ptr(), jax.device_put(arr, jax_device(t)))
    return True


def write_flat(t: torch.Tensor, values: jax.Array) -> None:
    """Write `values` (1-d, t's numel and dtype, on t's device) into `t`, visible through every view."""
    key, buf, jdt, spec, count = _parts(t)
    if values.dtype != jdt or values.shape != (t.numel(),):
        raise ValueError(f"torchbridge: writing {values.shape} {values.dtype} into a {tuple(t.shape)} {t.dtype} tensor")
    STATE.last_results[t.device.index or 0] = values  # what synchronize() waits on
    if _whole(t, buf, jdt, count):
        del buf  # the table's reference is then the old buffer's last: `replace` can keep it as a spare
        STATE.table.replace(key, values)
        return
    wk = (spec, buf.shape, buf.dtype, jdt, count)
    writer = _writers.get(wk)
    if writer is None:
        def write(b: jax.Array, v: jax.Array) -> jax.Array:
            flat = views.bitcast_flat(b, jdt, count)
            return views.bitcast_flat(views.write(flat, spec, v.reshape(spec.shape)), b.dtype, b.shape[0])

        writer = _writers[wk] = jax.jit(write)
    STATE.table.set(key, writer(buf, values))
