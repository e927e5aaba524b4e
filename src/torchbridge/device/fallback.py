"""The PrivateUse1 fallback: route every device op to a lowering, a decomposition, or the CPU.

Order: a few ops need direct handling (cross-device copies, `.item()`, data-dependent shapes); then
the lowering table (compiled, cached programs, see dispatch.py); then PyTorch's own decompositions;
then, only if the user opted in, the op runs on the CPU. Otherwise the error names the op and the
switch that enables CPU fallback.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch
from torch._decomp import decomposition_table

from torchbridge.device import dispatch, dtypes
from torchbridge.device.buffers import from_array, to_host, value, write_from_host
from torchbridge.device.lowerings import registry
from torchbridge.device.runtime import STATE

aten = torch.ops.aten

_cpu_fallback = os.environ.get("TORCHBRIDGE_CPU_FALLBACK", "0") == "1"
_local = threading.local()


def set_cpu_fallback(enabled: bool) -> None:
    """Run ops without a lowering on the CPU (copying operands), warning once per op."""
    global _cpu_fallback
    _cpu_fallback = bool(enabled)


def cpu_fallback_enabled() -> bool:
    return _cpu_fallback


# ---- direct handlers -----------------------------------------------------------------------------

DIRECT: dict[Any, Callable[..., Any]] = {}


def direct(*ops: Any):
    def deco(fn):
        for op in ops:
            DIRECT[id(op)] = fn  # by id: OpOverload.__hash__ is slow and ops are process-lifetime singletons
        return fn

    return deco


def _is_dev(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == STATE.name


def _has_bits(t: torch.Tensor) -> bool:
    """Whether `t` is a lazy conjugate or negative view (its storage holds conj(value) / -value)."""
    return t.is_conj() or t.is_neg()


def _host_with_bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s storage values on the CPU, carrying `t`'s conj/neg bits, so CPU kernels apply them."""
    host = to_host(t)
    if t.is_neg():
        host = torch._neg_view(host)
    if t.is_conj():
        host = host.conj()
    return host


@direct(aten.copy_.default)
def _copy_(op, args, kwargs):
    self, src = args[0], args[1]
    if _is_dev(self):
        if self.numel() == 0 and isinstance(src, torch.Tensor) and (src.shape == self.shape or _broadcasts_to(src, self)):
            return self  # no elements to copy (Hugging Face's DynamicCache starts each layer from torch.tensor([]))
        if not _is_dev(src) and isinstance(src, torch.Tensor) and write_from_host(self, src):
            return self  # a host tensor into a whole device storage: one transfer, no program
        if _is_dev(src) and src.device != self.device:
            src = _host_with_bits(src)  # device -> device through host keeps it simple and correct
        if not _is_dev(src) and _has_bits(src):
            src = src.resolve_conj().resolve_neg()  # on the CPU
        res = dispatch.run(aten.copy_.default, (self, src) + tuple(args[2:]), kwargs)
        # The program copied storage values. Where self and src differ in a conj/neg bit, self's
        # storage must hold the conjugate/negation of them: what CPU's copy_ does after copying.
        if self.is_conj() != src.is_conj():
            dispatch.run(aten.conj_physical_.default, (self,), {})
        if self.is_neg() != src.is_neg():
            dispatch.run(aten.neg_.default, (self,), {})
        return res
    # self on CPU, src on the device
    self.copy_(_host_with_bits(src))
    return self


def _broadcasts_to(src: torch.Tensor, dst: torch.Tensor) -> bool:
    try:
        return torch.broadcast_shapes(src.shape, dst.shape) == dst.shape
    except RuntimeError:  # copy_ itself raises PyTorch's error for these
        return False


# PyTorch's own copy_ reaches these from C++ (e.g. _to_copy under FakeTensorMode when the device is
# available); a boxed Python *fallback* cannot serve that path (it trips an internal assert in
# torch's Python-kernel trampoline), so they also get explicit device kernels.
registry.KERNEL_OVERRIDES.update({"_copy_from", "_copy_from_and_resize"})
# They also must pass PyTorch's conjugate/negative fallbacks untouched (registration._register_kernels makes them
# fallthroughs there, as copy_ and clone already are): those fallbacks resolve a lazy conj/neg input with
# clone(), whose copy_ calls _copy_from for an out-of-tree device again, recursing until the C++ stack
# overflows (the segfault of `x.conj().cpu()`). CPU and CUDA copies never call _copy_from, so only
# out-of-tree devices see the change; ours applies the bits itself (_copy_ above).
MATH_BIT_KEYS = ("Conjugate", "Negative")
COPY_FROM = ("_copy_from", "_copy_from_and_resize")


@direct(aten._copy_from.default)
def _copy_from(op, args, kwargs):
    src, dst = args[0], args[1]
    return _copy_(aten.copy_.default, (dst, src), {})


@direct(aten._copy_from_and_resize.default)
def _copy_from_and_resize(op, args, kwargs):
    src, dst = args[0], args[1]
    if dst.shape != src.shape:
        dst.resize_(src.shape)
    return _copy_(aten.copy_.default, (dst, src), {})


@direct(aten._local_scalar_dense.default)
def _item(op, args, kwargs):
    t = args[0]
    return np.asarray(value(t)).item()


@direct(aten._assert_async.default, aten._assert_async.msg)
def _assert_async(op, args, kwargs):
    # CUDA checks on the device and reports later; here the check reads the value at once (the result
    # of everything queued before it), which is the same answer, sooner.
    t = args[0]
    if t.numel() != 1:
        raise RuntimeError(f"{op}: expected a tensor with one element, got shape {tuple(t.shape)}")
    if not np.asarray(value(t)).item():
        msg = args[1] if len(args) > 1 else kwargs.get("assert_msg")
        raise RuntimeError(msg or "Expected Tensor with single nonzero value, but got zero")
    return None


@direct(aten.equal.default)
def _equal(op, args, kwargs):
    a, b = args
    if a.shape != b.shape:
        return False
    return bool(np.array_equal(np.asarray(value(a)), np.asarray(value(b))))


@direct(aten.is_pinned.default)
def _is_pinned(op, args, kwargs):
    return False


@direct(aten.record_stream.default)
def _record_stream(op, args, kwargs):
    return None


# Keyed by id, like DIRECT (see direct()).
dispatch._HOST_OK.update(id(op) for op in (aten.copy_.default, aten.index.Tensor, aten.index.Tensor_out,
                                           aten.index_put.default, aten.index_put_.default,
                                           aten._index_put_impl_.default))


@direct(aten.index.Tensor, aten.index.Tensor_out, aten.index_put.default, aten.index_put_.default,
        aten._index_put_impl_.default)
def _index_masks(op, args, kwargs):
    # A boolean mask selects a data-dependent number of elements: turn it into integer indices first
    # (as CPU's expandTensors does), so the compiled program sees static shapes.
    indices = args[1]
    if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        expanded: list[Any] = []
        for i in indices:
            if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                expanded.extend(i.nonzero().unbind(1))
            else:
                expanded.append(i)
        args = (args[0], expanded) + tuple(args[2:])
    return dispatch.run(op, args, kwargs)


@direct(aten.repeat_interleave.Tensor)
def _repeat_interleave_counts(op, args, kwargs):
    # repeat_interleave(repeats) -> [0]*r0 + [1]*r1 + ...: the output length is data-dependent, so (as on
    # CUDA) it is read back unless output_size is given; then it is one searchsorted over the running sum.
    repeats = args[0]
    output_size = kwargs.get("output_size", args[1] if len(args) > 1 else None)
    if repeats.dim() != 1:
        raise RuntimeError(f"repeat_interleave: repeats must be 0-dim or 1-dim tensor, got shape {tuple(repeats.shape)}")
    if repeats.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"repeat_interleave: repeats has to be Long or Int tensor, got {repeats.dtype}")
    if repeats.numel() and bool((repeats < 0).any()):
        raise RuntimeError("repeat_interleave: repeats can not be negative")
    total = int(repeats.sum()) if output_size is None else int(output_size)
    ends = repeats.cumsum(0)
    return torch.searchsorted(ends, torch.arange(total, device=repeats.device, dtype=ends.dtype), right=True).to(
        repeats.dtype)


# ---- lazy conj/neg views -------------------------------------------------------------------------

# `x.conj()` and `x.conj().imag` are views with a conj/neg bit: the storage is shared and readers apply
# the operation. PyTorch's Conjugate/Negative fallbacks resolve such inputs for most ops before they get
# here; the ops below are let through those fallbacks (CPU/CUDA BLAS read the bits as transpose flags,
# and the repeat_interleave/conj_physical kernels handle them), but our lowerings read storage values,
# so the bits are resolved here first: inputs become resolved copies, and a mutated argument with a bit
# set is computed into a resolved copy and copied back (copy_ re-applies its bits), as the fallbacks do.
_MATH_BIT_OPS = [
    getattr(getattr(aten, packet), overload)
    for packet, overloads in (
        ("mm", ("default", "out")), ("addmm", ("default", "out")), ("addmm_", ("default",)),
        ("bmm", ("default", "out")), ("baddbmm", ("default", "out")), ("baddbmm_", ("default",)),
        ("dot", ("default", "out")), ("vdot", ("default", "out")),
        ("linalg_solve_triangular", ("default", "out")), ("linalg_svd", ("default", "U")),
        ("repeat_interleave", ("self_Tensor", "self_int")),
        ("conj_physical", ("default", "out")), ("_conj_physical", ("default",)),
    )
    for overload in overloads
]


def _any_bits(values: Any, T=torch.Tensor, conj=torch.Tensor.is_conj, neg=torch.Tensor.is_neg) -> bool:
    # Hot for mm/addmm/bmm (well under a microsecond): these ops take no tensor lists.
    for v in values:
        if isinstance(v, T) and (conj(v) or neg(v)):
            return True
    return False


@direct(*_MATH_BIT_OPS)
def _resolve_math_bits(op, args, kwargs):
    if not (_any_bits(args) or (kwargs and _any_bits(kwargs.values()))):
        return _run_op(op, args, kwargs)
    written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    names = [a.name for a in op._schema.arguments]
    stand_ins: list[tuple[torch.Tensor, torch.Tensor]] = []

    def resolve(name: str | None, v: Any) -> Any:
        if not (isinstance(v, torch.Tensor) and _has_bits(v)):
            return v
        r = v.resolve_conj().resolve_neg()
        if name in written:
            stand_ins.append((v, r))
        return r

    args = tuple(resolve(names[i] if i < len(names) else None, a) for i, a in enumerate(args))
    kwargs = {k: resolve(k, v) for k, v in kwargs.items()}
    res = _run_op(op, args, kwargs)
    originals = {id(r): v for v, r in stand_ins}
    for v, r in stand_ins:
        v.copy_(r)
    return _map_results(lambda r: originals.get(id(r), r), res) if isinstance(res, (torch.Tensor, list, tuple)) else res


# ---- data-dependent shapes -------------------------------------------------------------------------

def run_dynamic(op: Any, lowering: registry.Lowering, args: tuple, kwargs: dict) -> Any:
    """Ops whose output shape depends on values (nonzero, unique, masked_select): run op by op."""
    device = next(a.device for a in _tensors(args, kwargs) if _is_dev(a))
    conv = _map_tensors(lambda t: value(t) if _is_dev(t) else jax.numpy.asarray(dtypes.host_to_numpy(t)), args, kwargs)
    with jax.default_device(STATE.jax_device(device.index or 0)):
        res = lowering.fn(*conv[0], **conv[1])
    return _map_results(lambda a: from_array(a, dtypes.to_torch(a.dtype), device), res)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _map_tensors(fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def m(v):
        if isinstance(v, torch.Tensor):
            return fn(v)
        if isinstance(v, (list, tuple)):
            return type(v)(m(x) for x in v)
        return v

    return tuple(m(a) for a in args), {k: m(v) for k, v in kwargs.items()}


def _map_results(fn, res):
    if isinstance(res, (list, tuple)):
        return type(res)(_map_results(fn, r) for r in res)
    return fn(res)


# ---- CPU fallback ---------------------------------------------------------------------------------

def run_on_cpu(op: Any, args: tuple, kwargs: dict) -> Any:
    dispatch.cpu_fallback_counter[str(op)] += 1
    dispatch.warn_once(str(op), f"torchbridge: {op} has no '{STATE.name}' lowering; running it on the CPU "
                                "(copying operands each call)")
    device = next((a.device for a in _tensors(args, kwargs) if _is_dev(a)), None)
    originals: dict[int, torch.Tensor] = {}

    def to_cpu(t: torch.Tensor) -> torch.Tensor:
        if not _is_dev(t):
            return t
        c = to_host(t)
        originals[id(c)] = t
        return c

    cargs, ckwargs = _map_tensors(to_cpu, args, kwargs)
    res = op(*cargs, **ckwargs)
    # Write back every argument the op mutates.
    schema = op._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            cval = ckwargs.get(a.name) if a.name in ckwargs else (cargs[i] if i < len(cargs) else None)
            for c in (cval if isinstance(cval, (list, tuple)) else [cval]):
                if isinstance(c, torch.Tensor) and id(c) in originals:
                    orig = originals[id(c)]
                    if orig.shape != c.shape:
                        orig.resize_(c.shape)
                    orig.copy_(c)

    def back(r):
        if isinstance(r, torch.Tensor):
            if id(r) in originals:
                return originals[id(r)]
            return r.to(device) if device is not None else r
        return r

    return _map_results(back, res) if isinstance(res, (torch.Tensor, list, tuple)) else res


# ---- the fallback --------------------------------------------------------------------------------

def _unsupported(op: Any) -> NotImplementedError:
    return NotImplementedError(
        f"torchbridge: operator '{op}' is not implemented for the '{STATE.name}' device. "
        f"Enable CPU fallback with torchbridge.set_cpu_fallback(True) or TORCHBRIDGE_CPU_FALLBACK=1 "
        f"(it copies operands to the CPU), or add a lowering in torchbridge/device/lowerings/."
    )


def fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    STATE.table.drain()
    handler = DIRECT.get(id(op))
    if handler is not None:
        return handler(op, args, kwargs)
    if op._schema.name.startswith("aten::_foreach_") and (_across_devices(args)
                                                           or _reads_earlier_write(op, args)):
        if _scalar_list_overload(op, args):
            return op.overloadpacket.ScalarList(*args[:-1], args[-1].tolist())
        # PyTorch's own per-tensor loop, each element on its device: what CUDA's foreach kernels fall
        # back to for such a list (ours run the whole list as one program on the device)
        return op.redispatch(_PER_TENSOR_LOOP, *args, **kwargs)
    return _run_op(op, args, kwargs)


# ---- _foreach_ calls one program cannot serve ---------------------------------------------------

_PER_TENSOR_LOOP = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _tensor_lists(args: tuple) -> list[list[torch.Tensor]]:
    return [list(a) for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]


def _across_devices(args: tuple) -> bool:
    """A tensor elsewhere than on this device: in a list, or a CPU tensor of per-tensor scalars
    (`_foreach_addcdiv_.Tensor`; a 0-dim CPU tensor is a scalar, served here)."""
    return (any(t.device.type != STATE.name for ts in _tensor_lists(args) for t in ts)
            or any(isinstance(a, torch.Tensor) and a.device.type != STATE.name and a.dim() for a in args))


def _scalar_list_overload(op: torch._ops.OpOverload, args: tuple) -> bool:
    """`_foreach_addcdiv_.Tensor(self, t1, t2, scalars)` with device lists and a 1-D CPU tensor of
    scalars: run as its `.ScalarList` overload, as PyTorch's own kernel converts it."""
    last = args[-1] if args else None
    return (op._overloadname == "Tensor" and hasattr(op.overloadpacket, "ScalarList")
            and isinstance(last, torch.Tensor) and last.dim() == 1 and last.device.type == "cpu"
            and all(t.device.type == STATE.name for ts in _tensor_lists(args) for t in ts))


def _reads_earlier_write(op: torch._ops.OpOverload, args: tuple) -> bool:
    """An in-place `_foreach_*_` call where element i's write overlaps memory that element j != i reads
    or writes (`_foreach_add_(ps, [g, ps[0]])`): PyTorch's loop runs the elements in order, so a later
    one sees an earlier one's result, which one program over the whole list would not. Splits of one
    buffer (FSDP2's all-gather copy-in) do not overlap and stay one program."""
    lists = _tensor_lists(args)
    if not op._schema.name.endswith("_") or not lists:
        return False
    spans = [[_span(t) for t in ts] for ts in lists]
    return any(j != i and w[0] == r[0] and w[1] < r[2] and r[1] < w[2]
               for i, w in enumerate(spans[0]) for span in spans for j, r in enumerate(span))


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) a tensor's elements lie in."""
    size = t.element_size()
    first = t.storage_offset()
    last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0 and st > 0)
    return t.untyped_storage().data_ptr(), first * size, (last + 1) * size if t.numel() else first * size


def _run_op(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """The fallback past the direct handlers: lowering, then decomposition, then CPU (if enabled)."""
    info = dispatch.op_info(op)
    if info.lowering is not None:
        if kwargs and kwargs.get("generator") is not None:
            return _run_with_generator(op, args, kwargs)
        if getattr(info.lowering.fn, "dynamic_shape", False):
            return run_dynamic(op, info.lowering, args, kwargs)
        # native.fast_call serves the repeat calls it can: run() remembers this one for it.
        return dispatch.run(op, args, kwargs, remember=True)
    decomp = decomposition_table.get(op)
    active = getattr(_local, "decomposing", None)
    if active is None:
        active = _local.decomposing = set()
    if decomp is not None and op not in active:
        active.add(op)
        try:
            return decomp(*args, **kwargs)
        finally:
            active.discard(op)
    if _cpu_fallback:
        return run_on_cpu(op, args, kwargs)
    raise _unsupported(op)


def _run_with_generator(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """A random op given a torch.Generator: the op draws at the generator's (seed, offset), and the offset
    advances past the values drawn. The generator is not part of the program: all share the op's program."""
    gen = kwargs["generator"]
    if gen.device.type != STATE.name:
        raise RuntimeError(f"{op}: expected a '{STATE.name}' device type for generator but found '{gen.device.type}'")
    return dispatch.run(op, args, {k: v for k, v in kwargs.items() if k != "generator"}, generator=gen)


warnings.filterwarnings("default", message="torchbridge:")
