"""The `_foreach_*` ops: one lowering per list op, applying the per-tensor lowering to each element.

A compiled optimizer step keeps `_foreach_add`, `_foreach_addcdiv`, `_foreach_lerp`, ... in its graph
(torch ships no decomposition for them). In eager mode PyTorch's CompositeExplicitAutograd "slow"
kernels would loop over per-tensor ops, one dispatch each; every overload here is also claimed as a
device kernel (KERNEL_OVERRIDES), so an eager foreach call is one program over the whole list (eager
foreach AdamW over 57 parameter shards: one dispatch per op instead of 57). Inside one jax.jit the
per-element loop costs nothing at run time: XLA sees one fused program.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import torch

from torchbridge.device.lowerings.registry import (
    KERNEL_OVERRIDES,
    LOWERINGS,
    TraceContext,
    ctx,
    lower,
    tracing,
)

# list op -> the per-tensor op it applies (same name without the prefix unless listed here)
_ELEMENT_OP = {"norm": "linalg_vector_norm"}

# arguments the per-tensor lowering needs as Python values (eager calls would otherwise trace them)
_STATIC = {"norm": ("ord",)}

# list ops whose last positional argument holds one scalar per element (ScalarList or a 1-D Tensor)
_PER_ELEMENT_SCALARS = {"addcdiv", "addcmul"}

_NAMES = (
    "abs acos add addcdiv addcmul asin atan ceil clamp_max clamp_min copy cos cosh div erf erfc exp expm1 "
    "floor frac lerp lgamma log log10 log1p log2 max maximum minimum mul neg norm pow reciprocal round "
    "rsqrt sigmoid sign sin sinh sqrt sub tan tanh trunc zero"
).split()


def _element_lowering(name: str) -> Any:
    target = _ELEMENT_OP.get(name, name)
    found = LOWERINGS.get(target) or LOWERINGS.get(f"{target}.Tensor") or LOWERINGS.get(f"{target}.default")
    if found is None:
        raise NotImplementedError(f"torchbridge: _foreach_{name} needs a lowering for '{target}'")
    return found


def _pick(v: Any, i: int) -> Any:
    return v[i] if isinstance(v, (list, tuple)) else v


def _flat_shape(shape: tuple, args: list, kwargs: dict) -> tuple[int] | None:
    """(size,) where every array operand of the element has the result's multi-dimensional shape (or is
    a scalar): the element then runs on flat arrays. Its storages are flat buffers, and XLA:CPU does
    not update a donated buffer in place through the reshape to [rows, cols] when the fusion ends in a
    select (lerp's two-sided formula): it copied 44 of an eager AdamW lerp_'s 57 results (45 vs 7 ms)."""
    if len(shape) < 2:
        return None
    arrays = [x for x in (*args, *kwargs.values()) if hasattr(x, "ndim")]
    if not arrays or any(x.ndim and tuple(x.shape) != tuple(shape) for x in arrays):
        return None
    return (math.prod(shape),)


def _flatten(x: Any) -> Any:
    """An operand of an element _flat_shape accepted: its arrays flat, scalars as they are."""
    return x.reshape(-1) if getattr(x, "ndim", 0) else x


def _make(name: str) -> None:
    def foreach(*args: Any, **kwargs: Any) -> list:
        outer = ctx()
        lowering = _element_lowering(name)
        n = len(next(a for a in args if isinstance(a, (list, tuple))))
        results = []
        for i in range(n):
            el_args = [_pick(a, i) for a in args]
            if name in _PER_ELEMENT_SCALARS and len(el_args) == 4:
                scal = el_args.pop()
                if getattr(scal, "ndim", 0) == 1:  # the `.Tensor` overload: a 1-D tensor of scalars
                    scal = scal[i]
                kwargs = {**kwargs, "value": scal}
            el_kwargs = {k: _pick(v, i) for k, v in kwargs.items()}
            # an in-place overload (eager) returns nothing: its results take its first list's shapes
            if i < len(outer.out_shapes):
                shape, dtype = outer.out_shapes[i], outer.out_dtypes[i]
            else:
                shape, dtype = jnp.shape(args[0][i]), args[0][i].dtype
            flat = _flat_shape(shape, el_args, el_kwargs)
            if flat is not None:
                el_args = [_flatten(x) for x in el_args]
                el_kwargs = {k: _flatten(v) for k, v in el_kwargs.items()}
            sub = TraceContext(out_shapes=[flat or shape], out_dtypes=[dtype], rng=outer.rng)
            with tracing(sub):
                res = lowering.fn(*el_args, **el_kwargs)
            res = jnp.broadcast_to(jnp.asarray(res).astype(dtype), flat or shape)
            results.append(res.reshape(shape) if flat is not None else res)
        return results

    lower(f"_foreach_{name}", static=_STATIC.get(name, ()))(foreach)


def _overloads(name: str) -> list[str]:
    """Every overload of `_foreach_{name}` and `_foreach_{name}_` ("packet.overload", as KERNEL_OVERRIDES names them)."""
    found = []
    for packet in (f"_foreach_{name}", f"_foreach_{name}_"):
        ops = getattr(torch.ops.aten, packet, None)
        if ops is not None:
            found += [packet if o == "default" else f"{packet}.{o}" for o in ops.overloads()]
    return found


for _name in _NAMES:
    _make(_name)
    KERNEL_OVERRIDES.update(_overloads(_name))
