"""Mutating custom ops in compiled graphs: AOTAutograd's auto_functionalized(_v2) nodes, in JAX.

A custom op that writes an argument (a `torchbridge.kernel` with mutates_args) reaches the graph as
`auto_functionalized_v2(op, _all_bases=[...], <view of each written argument>, **other args)`,
which returns (op results..., new value of every base); the graph then copies the new bases into
the inputs. Here the written arguments are regenerated as views of the bases' values (the whole
base, a slice, or an as_strided window of a contiguous base), the op's lowering computes their new
values, and those are written back into the bases.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch._higher_order_ops import auto_functionalize as af

from torchbridge.device import views
from torchbridge.device.lowerings import registry

HOPS = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


def run(node: torch.fx.Node, op: torch._ops.OpOverload, kwargs: dict[str, Any]) -> tuple:
    """The value of one auto_functionalized(_v2) node; `kwargs` hold JAX values."""
    lowering = registry.find(op)
    if lowering is None:
        raise NotImplementedError(f"torchbridge.compile: operator '{op}' has no lowering (in {node.target})")
    names, types = af.get_mutable_args(op)
    kwargs = dict(kwargs)
    if node.target is torch.ops.higher_order.auto_functionalized:
        kwargs.pop("_only_clone_these_tensors", None)
        outs, new = _call(lowering, op, kwargs)
        return (*outs, *(new[n] for n in names))
    kwargs.pop("_only_clone_these_bases", None)
    bases = list(kwargs.pop("_all_bases"))
    base_vals = [b.meta.get("val") for b in node.kwargs["_all_bases"]]
    infos = af.read_view_information_from_args(names, types, kwargs, bases)
    for name in names:
        info = infos[name]
        kwargs[name] = None if info is None else (
            [_view(i, bases, base_vals) for i in info] if isinstance(info, list) else _view(info, bases, base_vals))
    outs, new = _call(lowering, op, kwargs)
    for name in names:
        info = infos[name]
        if info is None:
            continue
        pairs = zip(info, new[name], strict=True) if isinstance(info, list) else [(info, new[name])]
        for i, value in pairs:
            if i is not None:
                bases[i.base_index] = _write(i, bases[i.base_index], value)
    return (*outs, *bases)


def _call(lowering: registry.Lowering, op: torch._ops.OpOverload, kwargs: dict) -> tuple[tuple, dict]:
    res = lowering.fn(**kwargs)
    outs, new = res if lowering.mutates else (res, {})
    if not op._schema.returns:
        outs = (None,)
    elif len(op._schema.returns) == 1:
        outs = (outs,)
    return tuple(outs), new


def _view(info: Any, bases: list, base_vals: list) -> Any:
    base = bases[info.base_index]
    if isinstance(info, (af.NotView, af.AliasViewInfo)):
        return base
    if isinstance(info, af.SliceViewInfo):
        return jax.lax.slice_in_dim(base, *_slice_bounds(info, base.shape), axis=info.dim)
    return views.read(base.reshape(-1), _strided_spec(info, base_vals[info.base_index]))


def _write(info: Any, base: Any, value: Any) -> Any:
    value = views.cast(value, base.dtype)
    if isinstance(info, (af.NotView, af.AliasViewInfo)):
        return jnp.broadcast_to(value, base.shape)
    if isinstance(info, af.SliceViewInfo):
        start, _ = _slice_bounds(info, base.shape)
        return jax.lax.dynamic_update_slice_in_dim(base, value, start, axis=info.dim)
    spec = _strided_spec(info, None)
    return views.write(base.reshape(-1), spec, value).reshape(base.shape)


def _slice_bounds(info: Any, shape: tuple) -> tuple[int, int]:
    n = shape[info.dim]
    start = 0 if info.start is None else min(max(info.start + n if info.start < 0 else info.start, 0), n)
    end = n if info.end is None else min(max(info.end + n if info.end < 0 else info.end, start), n)
    return start, end


def _strided_spec(info: Any, base_val: Any) -> views.ViewSpec:
    if base_val is not None and not (base_val.is_contiguous() and base_val.storage_offset() == 0):
        raise NotImplementedError("torchbridge.compile: a kernel writes an as_strided view of a non-contiguous input")
    return views.ViewSpec(tuple(info.size), tuple(info.stride), int(info.storage_offset))


