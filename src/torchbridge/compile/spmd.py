"""Graphs with collectives: one SPMD program over the ranks' chips, collectives inside it.

A graph that calls PyTorch's functional collectives (`_c10d_functional.*`: what DTensor, tensor
parallelism and compiled FSDP emit) must run as one XLA program on every rank of its groups, the
collectives as XLA collectives between them. The program is the graph's usual program inside a
`shard_map` over a mesh whose axes are the graph's process groups: every rank's local buffers become
its shard of global arrays (dim 0), the lowerings of the collectives name the mesh axis of their group
(`registry.ctx().axes`), and every rank takes its own shard of the results. Which mesh that is comes
from torchbridge.distributed (the c10d layer knows the groups); it registers itself as the planner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

COLLECTIVE_NAMESPACE = "_c10d_functional"


@dataclass(frozen=True)
class Plan:
    mesh: Mesh
    axes: dict[str, Any]  # process group name -> the mesh axis (or axes) its collectives run over
    sizes: dict[str, int]  # process group name -> its size
    device: jax.Device  # this rank's chip

    @property
    def spec(self) -> P:
        return P(tuple(self.mesh.axis_names))

    def key(self) -> tuple:
        return tuple(d.id for d in self.mesh.devices.flat), tuple(self.mesh.axis_names), tuple(sorted(self.axes.items()))

    def to_global(self, local: Any) -> jax.Array:
        """This rank's array as its shard (along dim 0) of the mesh-wide array."""
        if isinstance(local, np.ndarray) or np.isscalar(local):
            local = jax.device_put(np.asarray(local), self.device)
        if local.ndim == 0:
            local = local.reshape(1)
        n = self.mesh.devices.size
        return jax.make_array_from_single_device_arrays((n * local.shape[0], *local.shape[1:]),
                                                        NamedSharding(self.mesh, self.spec), [local])

    def wrap(self, program: Callable[..., Any]) -> Callable[..., Any]:
        """`program` (this rank's arrays in and out, each at least 1-d) as a shard_map over the mesh."""
        return jax.shard_map(program, mesh=self.mesh, in_specs=self.spec, out_specs=self.spec, check_vma=False)


def local(x: jax.Array) -> jax.Array:
    """This rank's shard of a result."""
    return x.addressable_data(0)


_planner: Callable[[tuple[str, ...], jax.Device], Plan] | None = None


def set_planner(fn: Callable[[tuple[str, ...], jax.Device], Plan]) -> None:
    global _planner
    _planner = fn


def plan(groups: tuple[str, ...], device: jax.Device) -> Plan:
    if _planner is None:
        raise NotImplementedError(
            "torchbridge.compile: this graph calls torch.distributed collectives, but no process group of the "
            "device exists (call torch.distributed.init_process_group() first)")
    return _planner(groups, device)
