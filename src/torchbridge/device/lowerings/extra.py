"""Ops that unmodified Hugging Face models reach outside the common op families.

Mixture-of-experts layers in transformers pick a device-specific path for `tpu`: `histc` on int32
expert ids and `torch._grouped_mm` (float32 included). PyTorch's meta kernel for `_grouped_mm` only
accepts bfloat16 (it mirrors the CUDA kernel's checks), so that op cannot go through the cached
dispatch, which asks the meta kernel for output shapes; it gets its own PrivateUse1 kernel that
runs its lowering on the device values directly, and a FakeTensor rule for torch.compile (below).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch._subclasses import fake_impls

from torchbridge.device.lowerings.registry import ctx, lower
from torchbridge.device.state import STATE


@lower("histc")
def histc(a, bins=100, min=0, max=0):
    # Mirrors ATen's linear-interpolation histogram: bins of equal width over [min, max], the value
    # max itself in the last bin, values outside the range dropped; min == max means the data range.
    wide = jnp.float64 if not jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
    x = a.astype(wide).reshape(-1)
    lo = jnp.asarray(min, wide)
    hi = jnp.asarray(max, wide)
    use_data = lo == hi
    if x.size:
        lo = jnp.where(use_data, jnp.min(x), lo)
        hi = jnp.where(use_data, jnp.max(x), hi)
    same = lo == hi
    lo = jnp.where(same, lo - 1, lo)
    hi = jnp.where(same, hi + 1, hi)
    pos = ((x - lo) * bins / (hi - lo)).astype(jnp.int64)
    pos = jnp.where(pos == bins, bins - 1, pos)
    valid = (x >= lo) & (x <= hi)
    counts = jnp.zeros((bins,), jnp.int64).at[jnp.clip(pos, 0, bins - 1)].add(valid.astype(jnp.int64))
    return counts.astype(ctx().out_dtypes[0])


def _group_of(positions: jax.Array, offs: jax.Array) -> jax.Array:
    """One-hot (len(positions), G) membership of each position in the groups `offs` ends; positions at
    or past offs[-1] belong to no group (their row is all zeros)."""
    group = jnp.searchsorted(offs.astype(jnp.int64), positions, side="right")
    return group[:, None] == jnp.arange(offs.shape[0])[None, :]


@lower("_grouped_mm")
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm for every dtype and all four layouts; groups are delimited by `offs` (int32
    cumulative ends) along the jagged dim of each 2D operand, elements past offs[-1] give zeros.

    2D x 3D: (S, K) rows grouped by offs times (G, K, N) -> (S, N)    (the MoE forward)
    2D x 2D: (M, S) times (S, N), S grouped by offs  -> (G, M, N)     (the weight gradient)
    3D x 2D: (G, M, K) times (K, N), N grouped by offs -> (M, N)
    3D x 3D: a batched matmul, offs unused.
    """
    if bias is not None:  # PyTorch's kernels reject it too
        raise NotImplementedError("torchbridge: _grouped_mm with bias is not supported")
    if a.ndim == 3 and b.ndim == 3:
        res = jnp.matmul(a, b)
    elif a.ndim == 2 and b.ndim == 3:
        sizes = jnp.diff(offs.astype(jnp.int32), prepend=jnp.zeros((1,), jnp.int32))
        res = jax.lax.ragged_dot(a, b, sizes)
    elif a.ndim == 2:
        onehot = _group_of(jnp.arange(a.shape[1]), offs).astype(a.dtype)
        res = jnp.einsum("ms,sg,sn->gmn", a, onehot, b)
    else:
        onehot = _group_of(jnp.arange(b.shape[1]), offs).astype(a.dtype)
        res = jnp.einsum("gmk,kn,ng->mn", a, b, onehot)
    return res


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
    # Imported here: this module is loaded while torchbridge.device.ops is still initialising.
    from torchbridge.device import dtypes, ops

    dtype = out_dtype or a.dtype
    _grouped_mm_shape(a, b, offs, bias)  # the same checks as under torch.compile
    av, bv = ops.value(a), ops.value(b)
    ov = None if offs is None else ops.value(offs)
    with jax.default_device(next(iter(av.devices()))):
        res = _grouped_mm_jit(av, bv, ov)
    return ops.from_array(res.astype(dtypes.to_jax(dtype)), dtype, a.device)


_grouped_mm_jit = jax.jit(grouped_mm)


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
