"""`torch.tpu`: the device module PyTorch and users expect (like `torch.cuda`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import torch

from torchbridge.device import native
from torchbridge.device.runtime import STATE


def _index(device: int | str | torch.device | None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index if d.index is not None else current_device()


def is_available() -> bool:
    return STATE.registered and len(STATE.devices) > 0


def is_initialized() -> bool:
    return STATE.registered


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return len(STATE.devices)


def current_device() -> int:
    return native.load().current_device()


def set_device(device: int | str | torch.device) -> None:
    native.load().set_device(_index(device))


@contextlib.contextmanager
def device(dev: int | str | torch.device) -> Iterator[None]:
    prev = current_device()
    set_device(dev)
    try:
        yield
    finally:
        set_device(prev)


def get_device_name(device: int | str | torch.device | None = None) -> str:
    d = STATE.jax_device(_index(device))
    return f"{d.platform}:{d.id} ({getattr(d, 'device_kind', d.platform)})"


def get_platform() -> str:
    """The PJRT platform behind the device: 'cpu', 'tpu', 'gpu', 'neuron', ..."""
    return STATE.platform


def synchronize(device: int | str | torch.device | None = None) -> None:
    """Wait for all queued work (JAX dispatch is asynchronous)."""
    from torchbridge.device import fused

    STATE.table.flush()
    jax.block_until_ready(fused.RECORDER.last_outputs)
    pending = STATE.last_results.get(_index(device))
    if pending is not None:
        jax.block_until_ready(pending)
    if STATE.last_collective:
        pending = STATE.last_collective.get(STATE.jax_device(_index(device)).id)
        if pending is not None:
            jax.block_until_ready(pending)


def manual_seed(seed: int) -> None:
    STATE.manual_seed(seed, current_device())


def manual_seed_all(seed: int) -> None:
    STATE.manual_seed(seed)


def seed() -> None:
    import random

    manual_seed(random.getrandbits(63))


def seed_all() -> None:
    import random

    manual_seed_all(random.getrandbits(63))


def initial_seed() -> int:
    return STATE.initial_seed(current_device())


def get_rng_state(device: int | str | torch.device | None = None) -> torch.Tensor:
    """16 bytes: seed and offset, little-endian uint64 each (CUDA's Philox layout, which DTensor reads)."""
    s, o = STATE.get_rng_state(_index(device))
    return torch.tensor([s, o], dtype=torch.uint64).view(torch.uint8)


def set_rng_state(state: torch.Tensor, device: int | str | torch.device | None = None) -> None:
    state = state.detach().cpu().contiguous()
    if state.dtype != torch.uint8 or state.numel() != 16:
        raise ValueError(f"torchbridge: an RNG state is 16 bytes (seed, offset), got {state.numel()} {state.dtype}")
    s, o = (int(v) for v in state.view(torch.uint64).tolist())
    STATE.set_rng_state(_index(device), (s, o))


# ---- streams and events: one queue per device (see csrc/native.cpp); synchronisation is real ----
class Stream(torch.Stream):
    """A stream of the device (all streams of a device are its one queue)."""

    def __new__(cls, device: int | str | torch.device | None = None, priority: int = 0, **kwargs: object) -> Stream:
        return super().__new__(cls, device=torch.device(STATE.name, _index(device)), priority=priority, **kwargs)


Event = torch.Event


def current_stream(device: int | str | torch.device | None = None) -> torch.Stream:
    return torch._C._accelerator_getStream(_index(device))


_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1


def default_stream(device: int | str | torch.device | None = None) -> torch.Stream:
    return torch.Stream(stream_id=0, device_index=_index(device), device_type=_PRIVATEUSE1)


def set_stream(stream: torch.Stream) -> None:
    torch._C._accelerator_setStream(stream)


@contextlib.contextmanager
def stream(s: torch.Stream | None) -> Iterator[None]:
    if s is None:
        yield
        return
    prev = current_stream(s.device_index)
    set_stream(s)
    try:
        yield
    finally:
        set_stream(prev)


# ---- memory --------------------------------------------------------------------------------------
# Counted by the allocator in C++ (a c10::DeviceAllocator, so torch.accelerator's memory functions
# agree): bytes of live storages, PyTorch's meaning of "allocated".
def memory_stats(device: int | str | torch.device | None = None) -> dict[str, int]:
    stats = torch._C._accelerator_getDeviceStats(_index(device))
    out = {}
    for name, value in stats.items():  # {stat: {pool: {kind: n}}} -> "stat.pool.kind", as torch.cuda's keys
        if isinstance(value, dict):
            for pool, v in value.items():
                if isinstance(v, dict):
                    for kind, n in v.items():
                        out[f"{name}.{pool}.{kind}"] = n
                else:
                    out[f"{name}.{pool}"] = v
        else:
            out[name] = value
    return out


def memory_allocated(device: int | str | torch.device | None = None) -> int:
    return int(native.load().live_bytes(_index(device)))


def max_memory_allocated(device: int | str | torch.device | None = None) -> int:
    return int(native.load().peak_bytes(_index(device)))


def memory_reserved(device: int | str | torch.device | None = None) -> int:
    """Allocated bytes plus the freed buffers kept for reuse (storage.SPARES; empty_cache drops them)."""
    from torchbridge.device import storage

    return memory_allocated(device) + storage.SPARES.bytes_on(STATE.jax_device(_index(device)))


def max_memory_reserved(device: int | str | torch.device | None = None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device: int | str | torch.device | None = None) -> None:
    native.load().reset_peak_bytes(_index(device))


def reset_accumulated_memory_stats(device: int | str | torch.device | None = None) -> None:
    torch._C._accelerator_resetAccumulatedStats(_index(device))


def empty_cache() -> None:
    """Drop buffers the backend keeps for reuse (shared zero buffers, freed buffers kept for programs'
    outputs); live tensors are untouched."""
    from torchbridge.device import storage

    storage.clear_zero_cache()
    storage.SPARES.clear()


def mem_get_info(device: int | str | torch.device | None = None) -> tuple[int, int]:
    """(free, total) bytes of the chip: the platform's numbers where it reports them (TPU, GPU), the
    host's available and total memory on JAX's CPU platform."""
    stats = STATE.jax_device(_index(device)).memory_stats()
    if stats and "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return total - int(stats.get("bytes_in_use", 0)), total
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    platform: str
    total_memory: int
    index: int


def get_device_properties(device: int | str | torch.device | None = None) -> DeviceProperties:
    index = _index(device)
    d = STATE.jax_device(index)
    return DeviceProperties(getattr(d, "device_kind", d.platform), d.platform, mem_get_info(index)[1], index)


# ---- autocast --------------------------------------------------------------------------------------
def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


class DeviceModule:
    """Exposes the functions above as attributes of `torch.<name>`."""

    def __init__(self) -> None:
        for fname in (
            "is_available is_initialized _is_in_bad_fork device_count current_device set_device device "
            "get_device_name get_platform synchronize manual_seed manual_seed_all seed seed_all initial_seed "
            "get_rng_state set_rng_state memory_allocated max_memory_allocated reset_peak_memory_stats "
            "Stream Event current_stream default_stream set_stream stream memory_stats memory_reserved "
            "max_memory_reserved reset_accumulated_memory_stats empty_cache mem_get_info get_device_properties "
            "get_amp_supported_dtype is_bf16_supported"
        ).split():
            setattr(self, fname, globals()[fname])
