"""Registers the device with PyTorch: name, C++ pieces, device module, the op fallback, and the
device kernels some aten ops need beside it."""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import torch

from torchbridge.device import native
from torchbridge.device.lowerings import registry
from torchbridge.device.runtime import STATE

aten = torch.ops.aten
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
    from torchbridge.device import custom_ops, device_module, dispatch, fallback, host_calls

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
    _library.fallback(mod.fast_call, dispatch_key="PrivateUse1")  # repeat calls in C++, the rest: fallback.fallback
    _aten_library.impl("_has_compatible_shallow_copy_type", _shallow_copy_compatible, "PrivateUse1")
    _register_kernels()
    skip_dynamo(fallback.fallback)
    # autocast on the device defaults to bfloat16, the dtype TPUs compute in (CUDA's default is float16)
    torch.set_autocast_dtype(name, torch.bfloat16)
    dispatch.install_fast_path(fallback.fallback)
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


def _register_kernels() -> None:
    """Import the lowering modules (they fill the table) and claim the ops they list in KERNEL_OVERRIDES."""
    global _override_lib
    from torchbridge.device import aten_kernels, grouped_mm, lowerings  # noqa: F401
    from torchbridge.device.fallback import COPY_FROM, MATH_BIT_KEYS

    aten_kernels.register()
    grouped_mm.register()

    if _override_lib is None:
        # Each kernel is native.fast_call(op, ...): repeat calls are served in C++, the rest reach `fallback`.
        fast = native.load().fast_call
        _override_lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kernels for existing aten ops
        for name in sorted(registry.KERNEL_OVERRIDES):
            packet, _, overload = name.partition(".")
            op = getattr(getattr(aten, packet), overload or "default")
            _override_lib.impl(op, functools.partial(fast, op), "PrivateUse1")
        for op in _structured_functional_ops():
            _override_lib.impl(op, functools.partial(fast, op), "PrivateUse1")
        for key in MATH_BIT_KEYS:
            for name in COPY_FROM:
                _override_lib.impl(name, torch.library.fallthrough_kernel, key)


def _structured_functional_ops() -> list[torch._ops.OpOverload]:
    """Functional ops whose generic kernel allocates an output and calls the `.out` variant
    (CompositeExplicitAutogradNonFunctional: add, mul, where, ...). A device kernel of our own runs
    the functional lowering directly: one dispatch instead of two, and no empty output to fill."""
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not torch._C._dispatch_has_kernel_for_dispatch_key(
            name, "CompositeExplicitAutogradNonFunctional"
        ) or torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1"):
            continue
        packet, _, overload = name[len("aten::"):].partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is None or registry.find(op) is None:
            continue
        schema = op._schema
        if any(a.alias_info is not None for a in schema.arguments) or not schema.returns:
            continue  # in-place and out= variants already reach the fallback with their own outputs
        found.append(op)
    return found


_override_lib: torch.library.Library | None = None

