"""Registers the device with PyTorch: name, C++ pieces, device module, and the op fallback."""

from __future__ import annotations

import os

import jax
import torch

from torchbridge.device.state import STATE

_library: torch.library.Library | None = None


def register(name: str = "tpu") -> None:
    """Make `name` a PyTorch device backed by JAX. Idempotent; the name is fixed once per process."""
    global _library
    if STATE.registered:
        if name != STATE.name:
            raise RuntimeError(f"torchbridge: device already registered as '{STATE.name}'")
        return
    # int64/float64 must stay 64-bit, as on CPU.
    jax.config.update("jax_enable_x64", True)
    from torchbridge.device import device_module, native, ops

    mod = native.load()
    STATE.name = name
    torch.utils.rename_privateuse1_backend(name)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    torch._register_device_module(name, device_module.DeviceModule())
    mod.install(_device_count())
    _library = torch.library.Library("_", "IMPL")  # noqa: TOR901 - a fallback needs the wildcard library
    _library.fallback(ops.fallback, dispatch_key="PrivateUse1")
    ops.register_kernels()
    STATE.registered = True
    # torch.compile(backend="tpu") is found through the `torch_dynamo_backends` entry points in
    # pyproject.toml, so importing torchbridge does not import Dynamo.


def _device_count() -> int:
    # Counting devices initialises the JAX backend; do it once here so `tpu:N` checks are cheap later.
    return len(STATE.devices) if os.environ.get("TORCHBRIDGE_LAZY_INIT") != "1" else 1
