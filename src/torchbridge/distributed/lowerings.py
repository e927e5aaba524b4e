"""Lowerings of PyTorch's functional collectives (`torch.ops._c10d_functional`), for compiled graphs.

A graph that calls them runs as one SPMD program over its groups' chips (compile/spmd.py); each
collective here becomes the XLA collective over its group's mesh axis, inside that program. The
bodies are the eager collectives' own (collectives.py), so both modes compute the same thing.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from torchbridge.device.lowerings.registry import ctx, lower
from torchbridge.distributed import collectives

NS = "_c10d_functional"


def group_name(group: Any) -> str:
    return group if isinstance(group, str) else group.group_name


def _axis(group: Any) -> tuple[Any, int]:
    name = group_name(group)
    axes = ctx().axes
    if name not in axes:
        raise NotImplementedError(f"torchbridge.compile: a collective over process group {name!r} outside a "
                                  "graph planned for it")
    return axes[name], axes["_sizes"][name]


@lower(f"{NS}::all_reduce")
def all_reduce(x: jax.Array, reduce_op: str, group: Any) -> jax.Array:
    axis, size = _axis(group)
    return collectives.reduce_body(x, reduce_op.lower(), None, axis, size)


@lower(f"{NS}::all_reduce_coalesced")
def all_reduce_coalesced(xs: list, reduce_op: str, group: Any) -> list:
    return [all_reduce(x, reduce_op, group) for x in xs]


@lower(f"{NS}::all_gather_into_tensor")
def all_gather_into_tensor(x: jax.Array, group_size: int, group: Any) -> jax.Array:
    axis, _ = _axis(group)
    return lax.all_gather(x.reshape(1) if x.ndim == 0 else x, axis, axis=0, tiled=True)


@lower(f"{NS}::all_gather_into_tensor_coalesced")
def all_gather_into_tensor_coalesced(xs: list, group_size: int, group: Any) -> list:
    return [all_gather_into_tensor(x, group_size, group) for x in xs]


@lower(f"{NS}::reduce_scatter_tensor")
def reduce_scatter_tensor(x: jax.Array, reduce_op: str, group_size: int, group: Any) -> jax.Array:
    axis, size = _axis(group)
    return collectives.reduce_scatter_body(x, reduce_op.lower(), None, axis, size)


@lower(f"{NS}::reduce_scatter_tensor_coalesced")
def reduce_scatter_tensor_coalesced(xs: list, reduce_op: str, group_size: int, group: Any) -> list:
    return [reduce_scatter_tensor(x, reduce_op, group_size, group) for x in xs]


@lower(f"{NS}::all_to_all_single")
def all_to_all_single(x: jax.Array, output_split_sizes: list, input_split_sizes: list, group: Any) -> jax.Array:
    axis, size = _axis(group)
    if len(set(output_split_sizes)) > 1 or len(set(input_split_sizes)) > 1 or x.shape[0] % size:
        raise NotImplementedError("torchbridge.compile: all_to_all_single with uneven splits inside a compiled "
                                  f"graph (splits {list(input_split_sizes)} -> {list(output_split_sizes)})")
    return collectives.all_to_all_body(x, axis, size)


@lower(f"{NS}::broadcast")
def broadcast(x: jax.Array, src: int, group: Any) -> jax.Array:
    axis, _ = _axis(group)
    return collectives.broadcast_body(x, src, axis)


@lower(f"{NS}::wait_tensor")
def wait_tensor(x: jax.Array) -> jax.Array:
    return x  # the collective's result is a value of the same program: nothing to wait for
