"""Registers the device with PyTorch: name, C++ pieces, device module, and the op fallback."""

from __future__ import annotations

import os
from typing import Any

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
    _enable_persistent_cache()
    from torchbridge.device import custom_ops, device_module, dispatch, host_calls, native, ops

    mod = native.load()
    host_calls.register(mod)
    STATE.name = name
    torch.utils.rename_privateuse1_backend(name)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    torch._register_device_module(name, device_module.DeviceModule())
    # The JAX backend starts on first use (STATE.devices), not here: under torchrun JAX's distributed
    # runtime has to start first. Until then the guard accepts any index up to its maximum.
    mod.install(_PROVISIONAL_DEVICE_COUNT)
    mod.set_python_hooks(device_module.synchronize, device_module.mem_get_info, device_module.empty_cache)
    _library = torch.library.Library("_", "IMPL")  # noqa: TOR901 - a fallback needs the wildcard library
    _library.fallback(mod.fast_call, dispatch_key="PrivateUse1")  # repeat calls in C++, the rest: ops.fallback
    _aten_library.impl("_has_compatible_shallow_copy_type", _shallow_copy_compatible, "PrivateUse1")
    ops.register_kernels()
    skip_dynamo(ops.fallback)
    # autocast on the device defaults to bfloat16, the dtype TPUs compute in (CUDA's default is float16)
    torch.set_autocast_dtype(name, torch.bfloat16)
    dispatch.install_fast_path(ops.fallback)
    custom_ops.bind_pending()  # torchbridge.kernel ops defined before the device registered
    STATE.registered = True
    # torch.compile(backend="tpu") is found through the `torch_dynamo_backends` entry points in
    # pyproject.toml, so importing torchbridge does not import Dynamo.


# Module.to() keeps its Parameter objects (so tied weights stay tied and optimizers keep their
# references) only when `param.data = moved` is allowed, i.e. when PyTorch may shallow-copy a device
# tensor into a CPU one. Built-in backends get that from TensorImpl; PrivateUse1 has to opt in.
_aten_library = torch.library.Library("aten", "IMPL")  # noqa: TOR901


def _shallow_copy_compatible(self: torch.Tensor, other: torch.Tensor) -> bool:
    def dense(t: torch.Tensor) -> bool:
        return t.layout == torch.strided and t.device.type in ("cpu", STATE.name)

    return dense(self) and dense(other)


def skip_dynamo(*fns: Any) -> None:
    """Dynamo must never trace the device's own Python: it runs when PyTorch calls a device kernel,
    also from C++ in the middle of a compiled region's eager part (DDP's reducer copying buckets),
    where Dynamo's frame hook is live and would trace `fn` with fake tensors. Mark each function's
    code (and every frame it calls) to run as plain Python."""
    eval_frame = torch._C._dynamo.eval_frame
    skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
    for fn in fns:
        eval_frame.set_code_exec_strategy(fn.__code__, skip)


def _enable_persistent_cache() -> None:
    """XLA executables persist on disk, so a second process skips recompiling what the first compiled.

    TORCHBRIDGE_COMPILE_CACHE=0 turns it off; TORCHBRIDGE_COMPILE_CACHE_DIR moves it. Only programs
    that took at least TORCHBRIDGE_COMPILE_CACHE_MIN_SECS (default 0.1 s) to compile are written, so
    the thousands of tiny eager programs do not flood the disk.
    """
    if os.environ.get("TORCHBRIDGE_COMPILE_CACHE", "1") == "0" or jax.config.jax_compilation_cache_dir:
        return
    from pathlib import Path

    path = os.environ.get("TORCHBRIDGE_COMPILE_CACHE_DIR", str(Path.home() / ".cache" / "torchbridge" / "xla"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("TORCHBRIDGE_COMPILE_CACHE_MIN_SECS", "0.1")))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_PROVISIONAL_DEVICE_COUNT = 64  # kMaxDevices in csrc/native.cpp
