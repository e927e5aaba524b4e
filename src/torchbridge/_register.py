"""How the device reaches PyTorch.

PyTorch imports every package on the `torch.backends` entry point while `import torch` runs
(torch/__init__.py, `_import_device_backends`); ours (pyproject.toml) is `autoload` below. So `import
torch` alone makes the device usable and its c10d backend known: scripts written for CUDA only change
the device string, and nothing depends on import order. With `TORCH_DEVICE_BACKEND_AUTOLOAD=0`,
`torchbridge.register()` does the same explicitly. `TORCHBRIDGE_NO_DEVICE=1` skips autoloading.

Importing `torchbridge` or any of its layers never registers anything by itself (the router imports
no torch at all). Registration never raises: if the bridge cannot load (no compiler, no jax) the
engine on `cpu` still works and the error is kept for the first use of the device
(`registration_error()`).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from torchbridge import host_allocator

_error: BaseException | None = None
_attempted = False


def device_name() -> str:
    return os.environ.get("TORCHBRIDGE_DEVICE_NAME", "tpu")


def registration_error() -> BaseException | None:
    """The exception that kept the device backend from registering, or None."""
    if not _attempted:
        register()
    return _error


def register() -> None:
    """Register the device and its c10d backend with PyTorch (idempotent, never raises)."""
    global _error, _attempted
    if _attempted:
        return
    _attempted = True
    host_allocator.configure()
    try:
        from torchbridge.device import registration

        registration.register(device_name())
        from torchbridge import distributed

        distributed.register()
        # torch.compile's default backend (Inductor) on the device's graphs -> the bridge's backend
        from torchbridge.compile import default_backend

        default_backend.install(device_name())
    except Exception as e:  # noqa: BLE001 - keep the engine and router usable without the bridge
        _error = e
        warnings.warn(f"torchbridge: device backend '{device_name()}' did not register: {e}", stacklevel=2)


def autoload() -> None:
    """The `torch.backends` entry point: called by `import torch`. The host allocator policy, when asked
    for, applies with or without the device (PyTorch's own CPU training steps page-fault the same way)."""
    if _is_torchrun_launcher():
        return
    host_allocator.configure()
    if os.environ.get("TORCHBRIDGE_NO_DEVICE") != "1":
        register()


def _is_torchrun_launcher() -> bool:
    """torchrun's own process (`torchrun ...` or `python -m torch.distributed.run ...`) only starts the
    workers, each a fresh interpreter that registers the device itself. Registering there imports JAX and
    the lowerings (~2.4 s of the launcher's 4.4 s `import torch` here), on every job's critical path.
    `register()` still works in it when called."""
    argv = sys.orig_argv
    if any(Path(a).name == "torchrun" for a in argv[:2]):
        return True
    return any(argv[i] == "-m" and argv[i + 1] in ("torch.distributed.run", "torch.distributed.launch")
               for i in range(len(argv) - 1))
