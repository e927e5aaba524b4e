"""torch <-> JAX dtype mapping. 64-bit types stay 64-bit (jax_enable_x64 is on for the backend)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

TORCH_TO_JAX: dict[torch.dtype, jnp.dtype] = {
    torch.bool: jnp.dtype(jnp.bool_),
    torch.uint8: jnp.dtype(jnp.uint8),
    torch.int8: jnp.dtype(jnp.int8),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int32: jnp.dtype(jnp.int32),
    torch.int64: jnp.dtype(jnp.int64),
    torch.float16: jnp.dtype(jnp.float16),
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.float32: jnp.dtype(jnp.float32),
    torch.float64: jnp.dtype(jnp.float64),
    torch.complex64: jnp.dtype(jnp.complex64),
    torch.complex128: jnp.dtype(jnp.complex128),
    torch.uint16: jnp.dtype(jnp.uint16),
    torch.uint32: jnp.dtype(jnp.uint32),
    torch.uint64: jnp.dtype(jnp.uint64),
}
JAX_TO_TORCH: dict[jnp.dtype, torch.dtype] = {v: k for k, v in TORCH_TO_JAX.items()}


def to_jax(dtype: torch.dtype) -> jnp.dtype:
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"torchbridge: dtype {dtype} is not supported on the device") from None


def to_torch(dtype: np.dtype) -> torch.dtype:
    return JAX_TO_TORCH[jnp.dtype(dtype)]


def host_to_numpy(t: torch.Tensor, copy: bool = True) -> np.ndarray:
    """A CPU tensor as a numpy array of the matching JAX dtype (bfloat16 via ml_dtypes). `copy=False`: the
    array shares the tensor's memory (a caller that owns the tensor and keeps it alive and unchanged while a
    program may read it)."""
    # Through DLPack, not Tensor.numpy(): .numpy() marks the CPU storage non-resizable for good, so a
    # later `out=` resize of the user's tensor would fail after `t.to(device)`.
    # The result is a copy: JAX's CPU client may alias host memory instead of copying it, and the
    # user may mutate `t` before the device program (deferred in fused mode) reads it.
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        a = np.from_dlpack(t.view(torch.int16)).view(jnp.bfloat16)
    elif t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        signed = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}[t.dtype]
        a = np.from_dlpack(t.view(signed)).view(TORCH_TO_JAX[t.dtype])
    else:
        a = np.from_dlpack(t)
    return a.copy() if copy else a


def numpy_to_host(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of host_to_numpy: a numpy array as a CPU tensor of `dtype`."""
    a = np.ascontiguousarray(a)
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        signed = {torch.uint16: np.int16, torch.uint32: np.int32, torch.uint64: np.int64}[dtype]
        return torch.from_numpy(a.view(signed).copy()).view(dtype)
    return torch.from_numpy(a.copy())
