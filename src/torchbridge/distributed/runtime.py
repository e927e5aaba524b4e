"""JAX's distributed runtime, started for a torch.distributed job: one process per chip.

JAX must join its distributed runtime before its backend starts, and the backend starts when the
device is first used (device/runtime.py runs `before_backend` hooks). Two ways in, whichever comes first:
- under torchrun (its agent's TCPStore at MASTER_ADDR:MASTER_PORT exists before the workers start),
  the first use of the device starts the runtime;
- otherwise the creation of the device's process group does (`init_process_group`), with its store.
Both find the coordinator the same way: global rank 0 picks a free port on the address it reaches the
store from and publishes it in the store; every rank then calls `jax.distributed.initialize` with
RANK and WORLD_SIZE. On JAX's CPU platform its cross-process collectives are gloo's TCP transport,
bound to the same address (so nothing assumes one host or loopback).

TORCHBRIDGE_DISTRIBUTED=0 keeps every process standalone. TORCHBRIDGE_HEARTBEAT_TIMEOUT (seconds,
default 100: JAX's) bounds how long the others wait before a dead rank takes the job down.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import jax

_KEY = "torchbridge/jax_coordinator"
_started = False


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store the workers connect to


def launch() -> Launch | None:
    """This process's place in a multi-process launch (torchrun's or any launcher's env vars), or None."""
    env = os.environ
    if env.get("TORCHBRIDGE_DISTRIBUTED", "1") == "0":
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if world <= 1:
        return None
    return Launch(rank, world, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")),
                  env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def started() -> bool:
    return _started


def backend_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def on_backend_start() -> None:
    """The device's `before_backend` hook: under torchrun, join the runtime through the agent's store."""
    info = launch()
    if info is not None and info.agent_store and not _started:
        start(None, info.rank, info.world_size)


def start(store: Any, rank: int, world_size: int, timeout: timedelta | None = None) -> None:
    """Join JAX's distributed runtime as process `rank` of `world_size` (idempotent). `store`: a c10d
    store every rank shares (the world group's); under torchrun its agent's store is used instead, so
    ranks that start from the device hook and ranks that start from init_process_group meet."""
    global _started
    if _started or world_size <= 1 or os.environ.get("TORCHBRIDGE_DISTRIBUTED", "1") == "0":
        return
    if backend_started():
        raise RuntimeError(
            f"torchbridge: rank {rank}: the device was used before the process group existed, so JAX started "
            "without its distributed runtime. Call torch.distributed.init_process_group() before using the device, "
            "or launch with torchrun (then the order does not matter).")
    info = launch()
    peer = _store_host(store) or (info.master_addr if info else "127.0.0.1")
    if info is not None and info.agent_store:
        store, peer = _agent_store(info), info.master_addr
    seconds = int(timeout.total_seconds()) if timeout is not None else 300
    if rank == 0:
        host = _outward_address(peer)
        store.set(_KEY, f"{host}:{_free_port(host)}")
    coordinator = store.get(_KEY).decode()
    _use_gloo_on(_outward_address(coordinator.rsplit(":", 1)[0]))
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=world_size, process_id=rank,
        initialization_timeout=seconds,
        heartbeat_timeout_seconds=int(os.environ.get("TORCHBRIDGE_HEARTBEAT_TIMEOUT", "100")))
    _started = True


def stop() -> None:
    """Leave JAX's distributed runtime before the process ends: a barrier that every process of the job
    must reach (JAX's own exit hook does the same at interpreter exit, which is too late for a job
    whose processes end at different times). The runtime cannot be joined again in this process."""
    if _started:
        jax.distributed.shutdown()


def local_address(store: Any) -> str:
    """This host's address toward the store's host (where the other ranks meet)."""
    info = launch()
    return _outward_address(_store_host(store) or (info.master_addr if info else "127.0.0.1"))


def _store_host(store: Any) -> str | None:
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return getattr(store, "host", None)


def _agent_store(info: Launch) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(info.master_addr, info.master_port, info.world_size, False, timedelta(seconds=300),
                         use_libuv=True)


def _outward_address(peer: str) -> str:
    """This host's address on the interface that reaches `peer` (loopback reaches loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer), 9))  # UDP connect: picks the route, sends nothing
        return s.getsockname()[0]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _use_gloo_on(host: str) -> None:
    """JAX's CPU client builds gloo's TCP collectives on the host name's address by default; bind them to
    the address that reaches the other ranks instead (a host name may resolve to loopback or to an
    interface the peers cannot reach)."""
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    def make_cpu_client() -> Any:
        from jax._src import distributed

        collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                     hostname=host)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)
