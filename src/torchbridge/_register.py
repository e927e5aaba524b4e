"""Import-time registration of the device backend, kept failure-tolerant (see package docstring)."""

from __future__ import annotations

import os
import warnings

_error: BaseException | None = None


def device_name() -> str:
    return os.environ.get("TORCHBRIDGE_DEVICE_NAME", "tpu")


def registration_error() -> BaseException | None:
    """The exception that kept the device backend from registering, or None."""
    return _error


def _register() -> None:
    global _error
    if os.environ.get("TORCHBRIDGE_NO_DEVICE") == "1":
        return
    try:
        from torchbridge.device import backend

        backend.register(device_name())
    except Exception as e:  # noqa: BLE001 - keep the engine and router usable without the bridge
        _error = e
        warnings.warn(f"torchbridge: device backend '{device_name()}' did not register: {e}", stacklevel=2)


_register()
