"""What the shipped kernels share: block sizes for row-wise kernels and the Pallas/jnp choice."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

IMPLS = ("auto", "pallas", "reference")
_BLOCK_BYTES = 256 * 1024  # per operand block: small next to a TPU core's VMEM, with double buffering
# The platform the program being traced is for, when the tracer knows it (the bridge's lowerings: the
# runtime's platform). None: not known (a jax.export for other platforms), so "auto" defers to lowering.
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("torchbridge_kernel_platform", default=None)


@contextlib.contextmanager
def tracing_for(platform: str | None) -> Iterator[None]:
    """Kernels traced inside are for `platform` ("tpu", "cpu", "gpu"): "auto" traces only that branch
    (jax.lax.platform_dependent traces both, and the Pallas one costs a kernel's whole trace). JAX's
    trace caches do not key on this, so it must not change for a function once traced: the bridge
    passes the runtime's platform, fixed for the process."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def platform() -> str | None:
    """The platform the program being traced is for (see tracing_for); None when not known."""
    return _PLATFORM.get()


def row_block(rows: int, width: int, dtype: Any) -> int:
    """Rows per block for a kernel that takes whole rows: a multiple of 8 (a TPU sublane tile) near
    _BLOCK_BYTES, or all rows when there are fewer than 8. A last partial block is allowed: Pallas
    pads its reads and drops its out-of-range writes."""
    if rows <= 8:
        return max(rows, 1)
    per_row = max(width, 1) * jnp.dtype(dtype).itemsize
    block = max(8, (_BLOCK_BYTES // per_row) // 8 * 8)
    return min(block, -(-rows // 8) * 8)


def choose(impl: str, pallas: Callable[..., Any], reference: Callable[..., Any], *arrays: Any, **static: Any) -> Any:
    """`impl`: "pallas", "reference", or "auto": the Pallas kernel when the program is compiled for
    TPU, the jnp reference on every other platform (decided now inside `tracing_for`, else at
    lowering, per platform)."""
    if impl == "pallas":
        return pallas(*arrays, **static)
    if impl == "reference":
        return reference(*arrays, **static)
    if impl != "auto":
        raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
    platform = _PLATFORM.get()
    if platform is not None:
        return (pallas if platform == "tpu" else reference)(*arrays, **static)
    return jax.lax.platform_dependent(*arrays, tpu=functools.partial(pallas, **static),
                                      default=functools.partial(reference, **static))
