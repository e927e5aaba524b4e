"""`torch._grouped_mm` on the device: its eager kernel and its FakeTensor rule (the value is the
lowering in lowerings/moe.py).

PyTorch's meta kernel for `_grouped_mm` only accepts bfloat16 (it mirrors the CUDA kernel's checks), so
the op cannot go through the cached dispatch, which asks the meta kernel for output shapes: it gets
its own PrivateUse1 kernel that runs the lowering on the device values directly, and a FakeTensor rule
for torch.compile (below).
"""

from __future__ import annotations

from typing import Any

import jax
import torch
from torch._subclasses import fake_impls

from torchbridge.device.lowerings.moe import grouped_mm
from torchbridge.device.runtime import STATE


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, bias: torch.Tensor | None) -> list:
    """The output shape of _grouped_mm (as PyTorch's meta kernel computes it), with its checks."""
    torch._check(bias is None, lambda: "Bias tensor provided, but it is not supported yet.")
    torch._check(a.dim() in (2, 3) and b.dim() in (2, 3),
                 lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={a.dim()} and mat_b.dim()={b.dim()}")
    if a.dim() == 2 or b.dim() == 2:
        torch._check(offs is not None and offs.dim() == 1,
                     lambda: "a 1D offsets tensor is needed for 2D multiplicand layouts")
    if a.dim() == 2 and b.dim() == 2:
        torch._check(a.size(1) == b.size(0), lambda: "contraction dimension of mat_a and mat_b must match")
        return [offs.size(0), a.size(0), b.size(1)]
    torch._check(a.size(-1) == b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    if a.dim() == 2:
        torch._check(offs.size(0) == b.size(0), lambda: "matrix batch sizes have to match")
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        torch._check(offs.size(0) == a.size(0), lambda: "matrix batch sizes have to match")
        return [a.size(1), b.size(1)]
    torch._check(a.size(0) == b.size(0), lambda: "batched dimension has to match")
    return [a.size(0), a.size(1), b.size(-1)]


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The eager device kernel: the lowering above, run on the operands' values."""
    from torchbridge.device import buffers, dtypes

    dtype = out_dtype or a.dtype
    _grouped_mm_shape(a, b, offs, bias)  # the same checks as under torch.compile
    av, bv = buffers.value(a), buffers.value(b)
    ov = None if offs is None else buffers.value(offs)
    with jax.default_device(next(iter(av.devices()))):
        res = _grouped_mm_jit(av, bv, ov)
    return buffers.from_array(res.astype(dtypes.to_jax(dtype)), dtype, a.device)


_grouped_mm_jit = jax.jit(grouped_mm)
_library: torch.library.Library | None = None


def register() -> None:
    """The eager kernel (called by registration.register, once)."""
    global _library
    if _library is None:
        _library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kept alive for the process
        _library.impl("_grouped_mm", _grouped_mm, "PrivateUse1")


# Under torch.compile, Dynamo and AOTAutograd run every op on FakeTensors, and for `_grouped_mm`
# FakeTensorMode calls that same bfloat16-only meta kernel, so tracing a float32 MoE fails before our
# backend sees the graph. We give FakeTensorMode a rule for `_grouped_mm` on OUR device only (any other
# device returns NotImplemented and gets PyTorch's meta kernel, unchanged); the graph then holds a plain
# aten._grouped_mm node, which the backend runs through the lowering above.
# Why this and not the alternatives: an AOTAutograd decomposition comes too late (Dynamo's own fake
# propagation already fails, and FakeTensorMode prefers the Python meta kernel to decompositions);
# overriding the Meta kernel or registering a global fake impl (torch.library.register_fake) would change
# `_grouped_mm` for CUDA/CPU too; steering transformers to its non-grouped path needs a per-model
# `experts_implementation` setting (transformers itself picks grouped_mm for "tpu" in every dtype, while
# its CPU path under compile goes through a custom op with a host sync per call).
def _is_grouped_mm(func: Any) -> bool:
    return func is torch.ops.aten._grouped_mm.default


@fake_impls.register_op_impl(_is_grouped_mm)
def _grouped_mm_fake(fake_mode, func, a, b, offs=None, bias=None, out_dtype=None):
    if not (isinstance(a, torch.Tensor) and a.device.type == STATE.name):
        return NotImplemented
    shape = _grouped_mm_shape(a, b, offs, bias)
    with fake_mode:
        return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)
