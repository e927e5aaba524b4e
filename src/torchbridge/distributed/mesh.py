"""Which chip each rank of a process group computes on, and the JAX mesh of a group.

A rank's chip is the device of the tensors it hands to its first collective (`tpu:LOCAL_RANK` under
torchrun, whatever `set_device` chose). Ranks tell each other through the group's c10d store: each
publishes the JAX device id of its chip under its group rank and reads the others' when it needs
them (all of them for a collective, one peer for send/recv), so nothing assumes a device numbering.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

AXIS = "r"  # the mesh axis of a group: position = group rank


class GroupDevices:
    def __init__(self, store: Any, rank: int, size: int, world: GroupDevices | None = None,
                 global_rank: int | None = None) -> None:
        self.store, self.rank, self.size = store, rank, size
        # the world group's table: a rank's chip is also published there, under its global rank, so
        # that a mesh over several groups can name chips of ranks outside this rank's groups
        self.world, self.global_rank = world, global_rank
        self.mine: jax.Device | None = None
        self._ids: dict[int, int] = {}
        self._meshes: dict[tuple[int, ...], Mesh] = {}

    def claim(self, device: jax.Device) -> None:
        """This rank computes on `device` in this group (fixed by its first device collective)."""
        if self.mine is None:
            self.mine = device
            self._ids[self.rank] = device.id
            self.store.set(f"torchbridge/device/{self.rank}", str(device.id))
            if self.world is not None and self.world is not self:
                self.world.claim(device)
        elif device != self.mine:
            raise RuntimeError(
                f"torchbridge: rank {self.rank} of this process group computes on {_name(self.mine)} (the device of "
                f"its first collective), but this collective's tensors are on {_name(device)}; use one device per "
                "rank per group (torch.<device>.set_device(LOCAL_RANK) before creating tensors)")

    def device_id(self, rank: int) -> int:
        if rank not in self._ids:
            self._ids[rank] = int(self.store.get(f"torchbridge/device/{rank}"))
        return self._ids[rank]

    def mesh(self, ranks: tuple[int, ...] | None = None) -> Mesh:
        """The 1-d mesh of `ranks` (default: the whole group), in that order, on axis AXIS."""
        ranks = tuple(range(self.size)) if ranks is None else ranks
        mesh = self._meshes.get(ranks)
        if mesh is None:
            mesh = self._meshes[ranks] = Mesh(self.devices(np.array(ranks)), (AXIS,))
        return mesh

    def devices(self, ranks: np.ndarray) -> np.ndarray:
        """The chips of an array of this group's ranks."""
        by_id = {d.id: d for d in jax.devices(self.mine.platform)}
        return np.vectorize(lambda r: by_id[self.device_id(int(r))], otypes=[object])(ranks)


def _name(device: jax.Device) -> str:
    from torchbridge.device.runtime import STATE

    local = STATE.devices
    return f"{STATE.name}:{local.index(device)}" if device in local else str(device)
