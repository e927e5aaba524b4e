"""The mesh of a compiled graph's process groups (the planner compile/spmd.py asks for).

One group: its ranks' chips on one axis. Several (FSDP's data-parallel group and TP's group of a 2-d
DeviceMesh): a mesh with one axis per group, laid out the way DeviceMesh lays out ranks. Each group's
global ranks must be an arithmetic progression (start + i * stride), as every DeviceMesh dimension
is; then rank(i_1, ..., i_m) = base + sum_k i_k * stride_k, axes ordered from the largest stride.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import Mesh

from torchbridge.compile.spmd import Plan
from torchbridge.distributed import process_group
from torchbridge.distributed.mesh import AXIS


def _group(name: str) -> process_group.DeviceProcessGroup:
    pg = torch._C._distributed_c10d._resolve_process_group(name)
    if not isinstance(pg, process_group.DeviceProcessGroup):
        raise NotImplementedError(f"torchbridge.compile: collectives over process group {name!r} "
                                  f"({type(pg).__name__}) inside a graph on the device; use the device's backend")
    return pg


def plan(names: tuple[str, ...], device: jax.Device) -> Plan:
    pgs = {name: _group(name) for name in names}
    tables = {name: pg.claim(device) for name, pg in pgs.items()}
    # groups over the same ranks share an axis
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, pg in pgs.items():
        by_ranks.setdefault(tuple(pg.global_ranks), []).append(name)
    sizes = {name: pg.size() for name, pg in pgs.items()}
    if len(by_ranks) == 1:
        name = names[0]
        return Plan(tables[name].mesh(), dict.fromkeys(names, AXIS), sizes, device)
    me = torch.distributed.get_rank()
    dims = []
    for ranks, members in by_ranks.items():
        stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
        if stride <= 0 or any(r != ranks[0] + i * stride for i, r in enumerate(ranks)):
            raise NotImplementedError(f"torchbridge.compile: process group ranks {list(ranks)} are not a DeviceMesh "
                                      "dimension (start + i * stride); a graph over several groups needs that layout")
        dims.append((stride, len(ranks), ranks.index(me), members))
    dims.sort(key=lambda d: -d[0])
    base = me - sum(stride * index for stride, _, index, _ in dims)
    shape = tuple(n for _, n, _, _ in dims)
    ranks = np.zeros(shape, dtype=np.int64)
    for idx in itertools.product(*(range(n) for n in shape)):
        ranks[idx] = base + sum(i * d[0] for i, d in zip(idx, dims, strict=True))
    if len(set(ranks.flat)) != ranks.size or ranks.min() < 0:
        raise NotImplementedError(f"torchbridge.compile: process groups {list(names)} do not form a device mesh")
    world = process_group._world_devices
    axis_names = tuple(f"{AXIS}{k}" for k in range(len(dims)))
    axes: dict[str, Any] = {}
    for axis, (_, _, _, members) in zip(axis_names, dims, strict=True):
        axes.update(dict.fromkeys(members, axis))
    return Plan(Mesh(world.devices(ranks), axis_names), axes, sizes, device)
