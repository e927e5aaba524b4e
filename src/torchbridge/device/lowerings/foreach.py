"""The `_foreach_*` ops: one lowering per list op, applying the per-tensor lowering to each element.

Eager mode never reaches these (PyTorch's CompositeExplicitAutograd "slow" kernels loop over
per-tensor ops first); a compiled optimizer step does: AOTAutograd keeps `_foreach_add`,
`_foreach_addcdiv`, `_foreach_lerp`, ... in the graph and torch ships no decomposition for them.
Inside one jax.jit the per-element loop costs nothing at run time: XLA sees one fused program.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from torchbridge.device.lowerings.registry import LOWERINGS, TraceContext, ctx, lower, tracing

# list op -> the per-tensor op it applies (same name without the prefix unless listed here)
_ELEMENT_OP = {"norm": "linalg_vector_norm"}

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
            sub = TraceContext(out_shapes=[outer.out_shapes[i]], out_dtypes=[outer.out_dtypes[i]], rng=outer.rng)
            with tracing(sub):
                res = lowering.fn(*el_args, **el_kwargs)
            res = jnp.asarray(res).astype(outer.out_dtypes[i])
            results.append(jnp.broadcast_to(res, outer.out_shapes[i]))
        return results

    lower(f"_foreach_{name}")(foreach)


for _name in _NAMES:
    _make(_name)
