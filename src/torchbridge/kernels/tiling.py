"""What the shipped kernels share: block sizes for row-wise kernels and the Pallas/jnp choice."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

IMPLS = ("auto", "pallas", "reference")
_BLOCK_BYTES = 256 * 1024  # per operand block: small next to a TPU core's VMEM, with double buffering


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
    TPU, the jnp reference on every other platform (decided at lowering, per platform)."""
    if impl == "pallas":
        return pallas(*arrays, **static)
    if impl == "reference":
        return reference(*arrays, **static)
    if impl != "auto":
        raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
    return jax.lax.platform_dependent(*arrays, tpu=functools.partial(pallas, **static),
                                      default=functools.partial(reference, **static))
