"""Device kernels for ops defined outside ATen (`torchbridge.kernel`): the same C++ fast path.

A custom op's PrivateUse1 kernel is `native.fast_call` bound to the op, as for the ATen ops in
registry.KERNEL_OVERRIDES: a repeat call (same layouts, same constants) is served in C++, and the
first call reaches fallback.fallback, which finds the op's lowering in the one table by its qualified
name ("ns::name") and runs it through the cached eager dispatch. Ops defined before the device
registers are bound when it does (backend.register calls bind_pending).
"""

from __future__ import annotations

import functools

import torch

from torchbridge.device.runtime import STATE

_pending: list[tuple[torch.library.Library, torch._ops.OpOverload]] = []


def bind(lib: torch.library.Library, op: torch._ops.OpOverload) -> None:
    """Give `op` (defined in `lib`) its device kernel, now or when the device registers."""
    if STATE.registered:
        _bind(lib, op)
    else:
        _pending.append((lib, op))


def bind_pending() -> None:
    while _pending:
        _bind(*_pending.pop(0))


def _bind(lib: torch.library.Library, op: torch._ops.OpOverload) -> None:
    from torchbridge.device import native

    name = op._schema.name.split("::")[-1]
    if op._overloadname != "default":
        name = f"{name}.{op._overloadname}"
    lib.impl(name, functools.partial(native.load().fast_call, op), "PrivateUse1")
