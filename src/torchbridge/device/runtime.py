"""The device runtime, one per process (`STATE`): the device name, the JAX devices behind `tpu:N`,
the buffer table, and the RNG streams."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cached_property
from typing import Any

import jax
import numpy as np
from jaxlib.xla_client import execution_stream_id

from torchbridge.device import cpu_threads, native
from torchbridge.device.storage import BufferTable

# XLA's execution stream for programs that contain collectives (compute runs on stream 0): such a
# program waits for compute only through the buffers it reads, and compute does not queue behind a
# collective waiting for its peers. Collectives stay in dispatch order among themselves, on every rank.
COLLECTIVE_STREAM = 1


def run_collective(device_id: int, call: Callable[[], Any]) -> Any:
    """`call()` (it dispatches a program with collectives) on the collective stream; its result becomes
    the collective marker of JAX device `device_id`, which synchronize() waits on."""
    with execution_stream_id(COLLECTIVE_STREAM):
        out = call()
    STATE.last_collective[device_id] = out
    return out


class _State:
    def __init__(self) -> None:
        self.name = "tpu"
        self.registered = False
        self._seeds: dict[int, int] = {}
        self._counters: dict[int, int] = {}
        self.default_seed = 67280421310721  # torch's default CPU seed; any fixed value works
        # The newest results per device: a device runs programs in dispatch order, so waiting on
        # these waits for everything queued before them.
        self.last_results: dict[int, object] = {}
        # The newest collective's result per JAX device id: collectives run in order on a stream of
        # their own (distributed/collectives.py), so synchronize() waits on both.
        self.last_collective: dict[int, object] = {}

    # Run once, just before the JAX backend starts (the device registers without starting it): JAX's
    # distributed runtime must be initialized before the backend, so torchbridge.distributed adds its
    # start-up here (under torchrun every process joins it when it first touches the device).
    before_backend: list[Callable[[], None]] = []

    @cached_property
    def platform(self) -> str:
        with cpu_threads.sized_pools():  # (TORCHBRIDGE_XLA_CPU_THREADS: XLA's CPU pools sized as they start)
            for hook in self.before_backend:
                hook()
            return os.environ.get("TORCHBRIDGE_PLATFORM") or jax.default_backend()

    @cached_property
    def devices(self) -> list[jax.Device]:
        """This process's chips: `tpu:N` is the N-th of them (under jax.distributed, each process sees
        only its own chips, as torch.cuda does)."""
        devices = jax.local_devices(backend=self.platform)
        if self.registered:
            native.load().install(len(devices))  # the device guard's count, provisional until now
        return devices

    def jax_device(self, index: int) -> jax.Device:
        try:
            return self.devices[index]
        except IndexError:
            raise RuntimeError(
                f"torchbridge: {self.name}:{index} does not exist; {len(self.devices)} {self.platform} device(s) "
                "(set XLA_FLAGS=--xla_force_host_platform_device_count=N for N CPU devices)"
            ) from None

    @cached_property
    def table(self) -> BufferTable:
        return BufferTable()

    @property
    def current_device(self) -> int:
        return native.load().current_device()

    # RNG: a (seed, offset) pair per device, laid out as CUDA's Philox state is. Random values are
    # counter-based: element i of an op drawn at offset o is a function of (seed, o + i) alone
    # (lowerings/registry.TraceContext.bits), and the op advances the offset by its element count
    # rounded up to 4. So an op on a shard, started at the shard's offset, draws exactly the shard's
    # part of what the whole tensor would draw (what DTensor's random ops rely on).
    def manual_seed(self, seed: int, device: int | None = None) -> None:
        seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        if device is None:
            # Every chip, without counting them: counting starts JAX's backend, and `torch.manual_seed` (which
            # calls this) must not, or a process could not join JAX's distributed runtime afterwards.
            self.default_seed = seed
            self._seeds.clear()
            self._counters.clear()
            return
        self._seeds[device] = seed
        self._counters[device] = 0

    def initial_seed(self, device: int) -> int:
        return self._seeds.get(device, self.default_seed)

    def next_rng(self, device: int, count: int = 4) -> tuple[np.uint64, np.uint64]:
        """(seed, offset) for a random op drawing `count` values; advances the offset past them."""
        offset = self._counters.get(device, 0)
        self._counters[device] = offset + (count + 3) // 4 * 4
        return np.uint64(self._seeds.get(device, self.default_seed)), np.uint64(offset)

    def get_rng_state(self, device: int) -> tuple[int, int]:
        return self._seeds.get(device, self.default_seed), self._counters.get(device, 0)

    def set_rng_state(self, device: int, state: tuple[int, int]) -> None:
        self._seeds[device], self._counters[device] = int(state[0]), int(state[1])


STATE = _State()
