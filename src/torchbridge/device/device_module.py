"""`torch.tpu`: the device module PyTorch and users expect (like `torch.cuda`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import torch

from torchbridge.device import native
from torchbridge.device.state import STATE


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
    s, c = STATE.get_rng_state(_index(device))
    return torch.tensor([s & 0x7FFF_FFFF_FFFF_FFFF, c], dtype=torch.int64)


def set_rng_state(state: torch.Tensor, device: int | str | torch.device | None = None) -> None:
    s, c = (int(v) for v in state.tolist())
    STATE.set_rng_state(_index(device), (s, c))


def memory_allocated(device: int | str | torch.device | None = None) -> int:
    return int(native.load().live_bytes(_index(device)))


def max_memory_allocated(device: int | str | torch.device | None = None) -> int:
    return int(native.load().peak_bytes(_index(device)))


def reset_peak_memory_stats(device: int | str | torch.device | None = None) -> None:
    native.load().reset_peak_bytes(_index(device))


class DeviceModule:
    """Exposes the functions above as attributes of `torch.<name>`."""

    def __init__(self) -> None:
        for fname in (
            "is_available is_initialized _is_in_bad_fork device_count current_device set_device device "
            "get_device_name get_platform synchronize manual_seed manual_seed_all seed seed_all initial_seed "
            "get_rng_state set_rng_state memory_allocated max_memory_allocated reset_peak_memory_stats"
        ).split():
            setattr(self, fname, globals()[fname])
