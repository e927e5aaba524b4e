"""Gathers and scatters of 16-bit floats moved as 16-bit integers on JAX's CPU platform.

XLA's CPU backend has few bfloat16/float16 kernels: its float normalization runs a gather or scatter of
them in float32, converting the WHOLE operand there and back, not just the rows moved. The engine's
bf16 KV cache (8 MB per layer for the bundled model) was converted four times per layer per decode step:
~150 ms of a step whose model math takes a few. Moving the same bits as uint16 is exact (a gather or
an overwriting scatter never looks at the values) and XLA moves integers as they are. Other platforms
have native 16-bit moves and keep the float types.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from torchbridge.device.runtime import STATE

_NARROW_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def moved_as_bits(dtype: Any) -> bool:
    """Whether values of `dtype` are gathered and scattered as uint16 bits here (16-bit floats on the
    CPU platform)."""
    return jnp.dtype(dtype) in _NARROW_FLOATS and STATE.platform == "cpu"


def as_bits(x: Any) -> Any:
    """`x` as uint16 bits when it is moved as bits (moved_as_bits), else `x` unchanged."""
    x = jnp.asarray(x)
    return lax.bitcast_convert_type(x, jnp.uint16) if moved_as_bits(x.dtype) else x


def from_bits(x: Any, dtype: Any) -> Any:
    """The inverse of as_bits for a result that should have `dtype`."""
    return lax.bitcast_convert_type(x, dtype) if x.dtype != jnp.dtype(dtype) else x
