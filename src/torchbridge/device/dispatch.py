"""Eager execution: every ATen op that reaches the device runs here.

For each call we build a key from the op, the tensor views (shape, strides, offset, dtype, which
arguments share a storage), the static arguments and the *types* of scalar arguments. The first
call with a key asks PyTorch's meta kernel for the output shapes/dtypes (so promotion, broadcasting
and error checks are PyTorch's own), then traces one JAX program that reads the input views from
their flat storage buffers, runs the lowering, writes in-place/out= results back into new storage
buffers and lays out the new outputs. Later calls with the same key only run that compiled program.
Scalar values are program inputs, so a new scalar value never recompiles.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.array import ArrayImpl

from torchbridge.device import (
    donation,
    dtypes,
    eager_mode,
    fused,
    host_calls,
    native,
    recycling,
    storage,
    views,
)
from torchbridge.device.lowerings import registry
from torchbridge.device.runtime import STATE

_T, _S, _L, _C = 0, 1, 2, 3  # argument encodings: tensor, dynamic scalar, list, constant
_NUMBER = torch._C.NumberType.get()
_TENSOR = torch._C.TensorType.get()
# Scalar[] (a _foreach_ op's per-tensor scalars, e.g. Adam's bias corrections, new every step): traced
_NUMBER_LIST = torch._C.ListType(_NUMBER)


class UnsupportedOp(RuntimeError):
    pass


@dataclass(frozen=True)
class OpInfo_:
    """What we know about an op from its schema alone (cached per OpOverload)."""

    lowering: registry.Lowering | None
    arg_names: tuple[str, ...]
    dynamic: frozenset[str]  # Scalar-typed args passed as traced values
    mutated: tuple[str, ...]  # args written by the op (in-place self, out=, running stats)
    out_args: tuple[str, ...]  # kwarg-only out= args, stripped before calling the lowering
    inplace: bool
    dynamic_pos: tuple[bool, ...] = ()  # per position: is `dynamic` (for the C++ fast-path key)


_op_infos: dict[Any, OpInfo_] = {}


def op_info(op: torch._ops.OpOverload) -> OpInfo_:
    # Keyed by id: OpOverloads live for the whole process and their __hash__ is a Python method.
    info = _op_infos.get(id(op))
    if info is None:
        schema = op._schema
        lowering = registry.find(op)
        static = set(lowering.static) if lowering else set()
        dynamic = set()
        mutated, out_args = [], []
        for a in schema.arguments:
            t = a.type
            inner = t.getElementType() if isinstance(t, torch._C.OptionalType) else t
            # Numbers given for a Tensor argument (wrapped numbers, e.g. from _foreach slow paths) are
            # traced too: a new value must not recompile.
            if (inner == _NUMBER or inner == _TENSOR or inner == _NUMBER_LIST) and a.name not in static:
                dynamic.add(a.name)
            elif lowering is not None and a.name in lowering.dynamic:
                dynamic.add(a.name)
            if a.alias_info is not None and a.alias_info.is_write:
                mutated.append(a.name)
                if a.kwarg_only and a.is_out:
                    out_args.append(a.name)
        # native_batch_norm updates its running stats in training although its schema has no (a!).
        mutated += [m for m in (lowering.mutates if lowering else ()) if m not in mutated]
        inplace = bool(mutated) and not out_args and mutated[0] == schema.arguments[0].name and (
            registry.functional_name(op) != schema.name.split("::")[-1]
        )
        names = tuple(a.name for a in schema.arguments)
        info = OpInfo_(lowering, names, frozenset(dynamic), tuple(mutated), tuple(out_args), inplace,
                       tuple(n in dynamic for n in names))
        _op_infos[id(op)] = info
    return info


# ---- argument encoding --------------------------------------------------------------------------

class _Call:
    """One call's arguments split into device tensors, host scalars and static structure."""

    __slots__ = ("tensors", "scalars", "hosts", "struct", "kw_struct")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.scalars: list[Any] = []
        self.hosts: list[torch.Tensor] = []

    def encode(self, value: Any, dynamic: bool) -> Any:
        if isinstance(value, torch.Tensor):
            self.tensors.append(value)
            return (_T, len(self.tensors) - 1)
        if dynamic and type(value) in (int, float, bool):
            self.scalars.append(value)
            return (_S, len(self.scalars) - 1, type(value))
        if isinstance(value, (list, tuple)):
            if any(isinstance(v, torch.Tensor) for v in value):
                return (_L, tuple(self.encode(v, False) for v in value))
            if dynamic and value and all(type(v) in (int, float, bool) for v in value):
                return (_L, tuple(self.encode(v, True) for v in value))  # (fast_path.cpp's 'l')
            return (_C, tuple(value))
        return (_C, value)


def _decode(enc: Any, tensors: list, scalars: list) -> Any:
    kind = enc[0]
    if kind == _T:
        return tensors[enc[1]]
    if kind == _S:
        return scalars[enc[1]]
    if kind == _L:
        return [_decode(e, tensors, scalars) for e in enc[1]]
    value = enc[1]
    return list(value) if isinstance(value, tuple) else value


def _encode_call(info: OpInfo_, args: tuple, kwargs: dict) -> tuple[_Call, tuple, tuple]:
    call = _Call()
    names = info.arg_names
    pos = tuple(call.encode(a, names[i] in info.dynamic if i < len(names) else False) for i, a in enumerate(args))
    kw = tuple((k, call.encode(v, k in info.dynamic)) for k, v in kwargs.items())
    return call, pos, kw


# ---- tensor classification ---------------------------------------------------------------------

class _DeviceArg(NamedTuple):
    # A NamedTuple, not a dataclass: one is made per device tensor of every general-path call.
    slot: int
    spec: views.ViewSpec
    dtype: Any


def _device_mismatch(a: torch.device, b: torch.device) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!"
    )


_CODES: dict[int, tuple[torch.dtype, Any]] = {}  # c10 ScalarType code -> (torch dtype, jax dtype)
_devices: dict[int, torch.device] = {}


_CODE_OF: dict[torch.dtype, int] = {}  # torch dtype -> c10 ScalarType code


def _dtype_codes() -> dict[int, tuple[torch.dtype, Any]]:
    if not _CODES:
        probes = [torch.empty(0, dtype=dt) for dt in dtypes.TORCH_TO_JAX]
        for t, d in zip(probes, native.load().describe(probes), strict=True):
            _CODES[d[2]] = (t.dtype, dtypes.TORCH_TO_JAX[t.dtype])
            _CODE_OF[t.dtype] = d[2]
    return _CODES


def _classify(op: Any, call: _Call, device_type: str, allow_host: bool) -> tuple[list, list, list, torch.device | None]:
    """Per tensor: a _DeviceArg or a host descriptor. Returns (descs, storage keys, storage infos, device)."""
    codes = _CODES or _dtype_codes()
    descs: list[Any] = []
    slots: dict[int, int] = {}
    keys: list[int] = []
    storages: list[tuple[int, int]] = []  # (nbytes, device index)
    dev_index = -1
    for i, d in enumerate(native.load().describe(call.tensors)):
        if d[0]:
            _, key, nbytes, shape, strides, offset, code, index = d
            if dev_index < 0:
                dev_index = index
            elif index != dev_index:
                raise _device_mismatch(torch.device(device_type, dev_index), torch.device(device_type, index))
            slot = slots.get(key)
            if slot is None:
                slot = len(keys)
                slots[key] = slot
                keys.append(key)
                storages.append((nbytes, index))
            dt = codes.get(code)
            if dt is None:
                raise TypeError(f"torchbridge: {op}: dtype {call.tensors[i].dtype} is not supported on the device")
            descs.append(_DeviceArg(slot, views.ViewSpec(shape, strides, offset), dt[1]))
        else:
            t = call.tensors[i]
            dev = t.device
            if dev.type == "cpu" and (d[1] == 0 or allow_host):
                # CUDA accepts 0-dim CPU tensors as scalars; we pass them as (weakly typed) values.
                if d[1] == 0 and not allow_host:
                    descs.append(("scalar", t.dtype))
                else:
                    descs.append(("host", tuple(t.shape), dtypes.to_jax(t.dtype)))
            else:
                other = torch.device(device_type, max(dev_index, 0))
                raise _device_mismatch(other, dev)
    device = None
    if dev_index >= 0:
        device = _devices.get(dev_index)
        if device is None:
            device = _devices[dev_index] = torch.device(device_type, dev_index)
    return descs, keys, storages, device


# ---- the compiled program ----------------------------------------------------------------------

@dataclass
class _Program:
    fn: Any  # jitted
    writes: tuple[int, ...]  # storage slots returned updated, in order
    outputs: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]  # new tensors: shape, strides, dtype
    out_struct: Any  # how to rebuild the return value
    random: int  # values a random op draws (the RNG offset advances by them); 0: not random
    resize: dict[str, Any] | None = None  # out= args that must be resized first (then the call is redone)
    raw: Any = None  # the traceable function behind `fn`, composed by fused eager mode
    _avals: Any = None
    _donating: Any = None

    def call(self, bufs: list, scalars: tuple, hosts: tuple, host_scalars: tuple, rng: Any, dev_index: int) -> Any:
        """Run the program. A large storage it writes whose buffer nothing else holds is donated, so
        XLA updates it in place: a KV-cache write into a 32 MB pool then costs the rows written, not a
        copy of the pool (the table keeps the only reference, and the old buffer is replaced anyway)."""
        donate = (self.writes and self._donating is not False
                  and any(bufs[s].nbytes >= donation.DONATE_BYTES for s in self.writes)
                  and len(donation.sole_holders(bufs, self.writes, dev_index)) == len(self.writes))
        if donate and self._donating is None:
            # a write whose new buffer has another dtype or length than the old one (a float32 copy into
            # FSDP2's byte buffer) cannot reuse it: JAX would warn and copy, so this program never donates
            updated, _ = self.out_avals(tuple(bufs), scalars, hosts, host_scalars, rng)
            fits = all(u.shape == bufs[s].shape and u.dtype == bufs[s].dtype
                       for u, s in zip(updated, self.writes, strict=True))
            self._donating = donation.donating_jit(self.raw, tuple(self.writes)) if fits else False
        if donate and self._donating:
            global donated_writes
            donated_writes += 1
            return self._donating(tuple(bufs[s] for s in self.writes),
                                  tuple(b for i, b in enumerate(bufs) if i not in self.writes),
                                  scalars, hosts, host_scalars, rng)
        return self.fn(tuple(bufs), scalars, hosts, host_scalars, rng)

    def out_avals(self, *args: Any) -> Any:
        """Output shapes/dtypes (for fused mode's placeholders); traced once per program."""
        if self._avals is None:
            self._avals = jax.eval_shape(self.raw, *args)
        return self._avals


_programs: dict[Any, _Program] = {}
_lock = threading.RLock()
compile_counter: Counter[str] = Counter()
donated_writes = 0  # calls that updated a large storage in place (see _Program.call)
cpu_fallback_counter: Counter[str] = Counter()


def _meta_tensor(t: torch.Tensor, desc: Any) -> torch.Tensor:
    if isinstance(desc, _DeviceArg):
        return torch.empty_strided(desc.spec.shape, desc.spec.strides, dtype=t.dtype, device="meta")
    # Host tensors too: meta kernels (masked_fill, index_copy...) require every tensor on self's device.
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")


def _flatten_result(res: Any, leaves: list) -> Any:
    if isinstance(res, torch.Tensor):
        leaves.append(res)
        return ("t", len(leaves) - 1)
    if isinstance(res, (list, tuple)):
        return ("l" if isinstance(res, list) else "u", tuple(_flatten_result(r, leaves) for r in res))
    return ("c", res)


def _rebuild(struct: Any, leaves: list) -> Any:
    kind, v = struct
    if kind == "t":
        return leaves[v]
    if kind == "l":
        return [_rebuild(s, leaves) for s in v]
    if kind == "u":
        return tuple(_rebuild(s, leaves) for s in v)
    return v


def _result_leaves(struct: Any, res: Any) -> list:
    """A lowering's result values where the meta result (`struct`, from _flatten_result) has tensors,
    skipping what it holds as constants (None, sizes)."""
    kind, v = struct
    if kind == "t":
        return [res]
    if kind in ("l", "u"):
        return [leaf for s, r in zip(v, res, strict=True) for leaf in _result_leaves(s, r)]
    return []


def _as_list(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        out = []
        for v in x:
            out.extend(_as_list(v))
        return out
    # None stands for an output the op leaves undefined (output_mask=False in backward ops); the
    # meta result has no tensor leaf there either.
    return [] if x is None else [x]


def _wrap_numbers(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A number given for a Tensor argument is traced as a scalar, but the meta kernel's schema
    check wants a tensor there: give it a 0-dim CPU tensor (what a wrapped number is)."""
    tensor_args = [a.name for a in op._schema.arguments if a.type == _TENSOR]
    if not tensor_args:
        return args, kwargs
    names = [a.name for a in op._schema.arguments]

    def wrap(v: Any) -> Any:
        return torch.tensor(v, device="meta") if type(v) in (int, float, bool) else v

    args = tuple(wrap(v) if i < len(names) and names[i] in tensor_args else v for i, v in enumerate(args))
    return args, {k: wrap(v) if k in tensor_args else v for k, v in kwargs.items()}


def _build(op: Any, info: OpInfo_, call: _Call, pos: tuple, kw: tuple, descs: list, storages: list) -> _Program:
    """One key's program: output metadata from PyTorch's meta kernel, then the traced JAX function."""
    meta_res, resize = _meta_result(op, info, call, pos, kw, descs)
    if resize:
        return _Program(None, (), [], None, False, resize)
    leaves: list[torch.Tensor] = []
    out_struct = _flatten_result(meta_res, leaves)
    written = _written_args(info, pos, kw)
    body = _Body(op, info, pos, kw, descs, storages, written, leaves, out_struct)
    compile_counter[str(op)] += 1
    draws = random_draws(leaves, [call.tensors[i] for idx, _ in written for i in idx]) if info.lowering.random else 0
    # keep_unused: a program that overwrites a storage without reading it (fill_, normal_) must still run on
    # that storage's device; JAX places a jitted call by its (kept) committed arguments.
    fn = jax.jit(body, keep_unused=True)
    if not body.write_slots and recycling.wanted(
            [((views.storage_numel(shape, strides),), dtypes.to_jax(dt)) for shape, strides, dt in body.new_outputs],
            STATE.jax_device(storages[0][1] if storages else 0)):
        fn = recycling.Recycling(body, fn)  # large fresh outputs into spare buffers
    return _Program(fn, body.write_slots, body.new_outputs, out_struct, draws, raw=body)


def _meta_result(op: Any, info: OpInfo_, call: _Call, pos: tuple, kw: tuple, descs: list) -> tuple[Any, dict]:
    """The op run on meta tensors (so shapes, dtypes, promotion and errors are PyTorch's own), and the
    out= arguments the meta kernel resized (then the call is redone after resizing them)."""
    meta_tensors = [_meta_tensor(t, d) for t, d in zip(call.tensors, descs, strict=True)]
    meta_args = tuple(_decode(e, meta_tensors, call.scalars) for e in pos)
    meta_kwargs = {k: _decode(e, meta_tensors, call.scalars) for k, e in kw}
    meta_args, meta_kwargs = _wrap_numbers(op, meta_args, meta_kwargs)
    if meta_kwargs.get("device") is not None:  # factory ops: asking the device would recurse here
        meta_kwargs["device"] = torch.device("meta")
    before = {n: _shapes(meta_kwargs[n]) for n in info.out_args if n in meta_kwargs}
    try:
        meta_res = op(*meta_args, **meta_kwargs)
    except NotImplementedError:
        # In-place ops that return nothing (_fused_sgd_, the tensor_lr optimizer steps) may lack a
        # meta kernel; there is no output to describe, and the lowering still checks its inputs.
        if op._schema.returns:
            raise
        meta_res = None
    return meta_res, {n: _shapes(meta_kwargs[n]) for n in before if _shapes(meta_kwargs[n]) != before[n]}


def _written_args(info: OpInfo_, pos: tuple, kw: tuple) -> list[tuple[list[int], str]]:
    """Which tensors the op writes, each group with its source: "result[:i]" (out=, in-place) or
    "mutates:<name>" (the lowering's second result, e.g. batch norm's running stats)."""
    arg_values = dict(zip(info.arg_names, pos, strict=False))
    arg_values.update(dict(kw))
    written: list[tuple[list[int], str]] = []
    if info.out_args:
        first = 0  # several out= args (max.dim_max, aminmax.out, sort.values) take consecutive result leaves
        for name in info.out_args:
            idx = _tensor_indices(arg_values[name])
            written.append((idx, f"result:{first}"))
            first += len(idx)
    elif info.inplace:
        written.append((_tensor_indices(arg_values[info.mutated[0]]), "result"))
    extra = [m for m in info.mutated if m not in info.out_args and not (info.inplace and m == info.mutated[0])]
    for name in extra:
        if name in arg_values and arg_values[name][0] != _C:
            written.append((_tensor_indices(arg_values[name]), f"mutates:{name}"))
    return written


class _Storages:
    """A program's storage buffers while it is traced, read as any dtype (bitcast views, made once
    per slot and dtype until a write replaces the buffer)."""

    def __init__(self, bufs: tuple, nbytes: list[int]) -> None:
        self.bufs = list(bufs)
        self.nbytes = nbytes
        self._typed: dict[tuple[int, Any], Any] = {}

    def read(self, slot: int, dtype: Any) -> Any:
        k = (slot, dtype)
        if k not in self._typed:
            self._typed[k] = views.bitcast_flat(self.bufs[slot], dtype, self.nbytes[slot] // jnp.dtype(dtype).itemsize)
        return self._typed[k]

    def write(self, d: _DeviceArg, value: Any) -> None:
        cur = self.read(d.slot, d.dtype)
        self._typed.clear()
        self.bufs[d.slot] = views.write(cur, d.spec, views.cast(value, d.dtype))


class _Body:
    """The JAX function one eager program traces: read the input views out of their storages' flat
    buffers, run the lowering, write in-place/out= results back, lay out the new outputs. Called with
    (storage buffers, dynamic scalars, host arrays, host scalars, rng); returns (written buffers in
    `write_slots` order, new output buffers)."""

    def __init__(self, op: Any, info: OpInfo_, pos: tuple, kw: tuple, descs: list, storages: list,
                 written: list[tuple[list[int], str]], leaves: list[torch.Tensor], out_struct: Any) -> None:
        self.lowering = info.lowering
        self.out_args = info.out_args
        self.pos, self.kw, self.descs, self.written, self.out_struct = pos, kw, descs, written, out_struct
        self.new_outputs = [] if (info.out_args or info.inplace) else [
            (tuple(m.shape), tuple(m.stride()), m.dtype) for m in leaves]
        self.out_shapes = [tuple(m.shape) for m in leaves]
        self.out_dtypes = [dtypes.to_jax(m.dtype) for m in leaves]
        self.storage_nbytes = [nbytes for nbytes, _ in storages]
        self.write_slots = tuple(sorted({descs[i].slot for idx, _ in written for i in idx}))
        self.gemm_operands = host_calls.GEMM_OPERANDS.get(op._schema.name, ()) if host_calls.gemm_enabled() else ()

    def __call__(self, bufs: tuple, scalars: tuple, hosts: tuple, host_scalars: tuple, rng: Any) -> tuple:
        storages = _Storages(bufs, self.storage_nbytes)
        args, kwargs = self._arguments(storages, scalars, hosts, host_scalars)
        c = registry.TraceContext(out_shapes=self.out_shapes, out_dtypes=self.out_dtypes, rng=rng)
        with registry.tracing(c):
            res = self.lowering.fn(*args, **kwargs)
        mutations = {}
        if self.lowering.mutates:
            res, mutations = res
        res_leaves = _as_list(res)
        if any(isinstance(r, (int, float)) for r in res_leaves):  # constants among the results (the fused
            res_leaves = _result_leaves(self.out_struct, res)      # SDPA's sizes): where meta has tensors
        self._write_back(storages, res_leaves, mutations)
        return tuple(storages.bufs[s] for s in self.write_slots), self._new_outputs(res_leaves)

    def _arguments(self, storages: _Storages, scalars: tuple, hosts: tuple, host_scalars: tuple) -> tuple[tuple, dict]:
        values, host_i, scalar_i = [], 0, 0
        for d in self.descs:
            if isinstance(d, _DeviceArg):
                values.append(views.read(storages.read(d.slot, d.dtype), d.spec))
            elif d[0] == "scalar":
                values.append(host_scalars[scalar_i])
                scalar_i += 1
            else:
                values.append(hosts[host_i])
                host_i += 1
        args = tuple(_decode(e, values, list(scalars)) for e in self.pos)
        for i in self.gemm_operands:  # a transposed view goes to the GEMM un-transposed, with a flag
            d = self.descs[self.pos[i][1]] if i < len(self.pos) and self.pos[i][0] == _T else None
            base = views.swapped_last_two(d.spec) if isinstance(d, _DeviceArg) else None
            if base is not None:
                args = (*args[:i], host_calls.Transposed(views.read(storages.read(d.slot, d.dtype), base)), *args[i + 1:])
        kwargs = {k: _decode(e, values, list(scalars)) for k, e in self.kw if k not in self.out_args}
        return args, kwargs

    def _write_back(self, storages: _Storages, res_leaves: list, mutations: dict) -> None:
        """Writes into existing storages (in-place, out=, running stats)."""
        for idx, source in self.written:
            kind, _, name = source.partition(":")
            src = res_leaves[int(name or 0):] if kind == "result" else _as_list(mutations[name])
            for j, ti in enumerate(idx):
                storages.write(self.descs[ti], src[j])

    def _new_outputs(self, res_leaves: list) -> tuple:
        new = []
        for (shape, strides, dt), r in zip(self.new_outputs, res_leaves if self.new_outputs else [], strict=True):
            r = jnp.broadcast_to(views.cast(r, dtypes.to_jax(dt)), shape)
            new.append(views.layout(r, views.ViewSpec(shape, strides, 0), views.storage_numel(shape, strides)))
        return tuple(new)


def random_draws(outputs: list, written: list) -> int:
    """How many values a random op draws: one per element of its largest result (at least one)."""
    return max([1] + [t.numel() for t in outputs] + [t.numel() for t in written])


def _shapes(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return tuple(v.shape)
    return tuple(_shapes(x) for x in v)


def _resize_outs(value: Any, shapes: Any) -> None:
    if isinstance(value, torch.Tensor):
        value.resize_(shapes)
    else:
        for v, s in zip(value, shapes, strict=True):
            _resize_outs(v, s)


def _tensor_indices(enc: Any) -> list[int]:
    if enc[0] == _T:
        return [enc[1]]
    if enc[0] == _L:
        return [i for e in enc[1] for i in _tensor_indices(e)]
    return []


# ---- the fast path -----------------------------------------------------------------------------
#
# A repeat call (same op, same tensor layouts and aliasing, same constants, same scalar types) skips
# encoding, classification and the program lookup: native.fast_call builds the call's key in one C++
# pass over the arguments, and a hit runs the remembered program on the storages' current buffers (or
# records it, in fused mode). Anything unusual (CPU tensors, factory calls, a dtype-punned storage)
# takes the general path, which remembers the call as a native.FastEntry once it has run it.

_fast: dict[Any, Any] = {}  # call key (csrc/fast_path.cpp) -> native.FastEntry
_ARRAY = ArrayImpl  # the concrete class of every jax.Array (the C++ fast path checks buffers by type)


def _returned_positions(info: OpInfo_, kwargs: dict) -> tuple | None:
    """Where an in-place or out= op's return value comes from: the positions (or kwarg names) of
    the arguments it wrote; None for ops that return new tensors."""
    if not (info.out_args or info.inplace):
        return None
    return tuple(n if n in kwargs else info.arg_names.index(n) for n in info.out_args or (info.mutated[0],))


def _returned_args(returns: tuple, args: tuple, kwargs: dict) -> Any:
    vals = [args[r] if isinstance(r, int) else kwargs[r] for r in returns]
    return vals[0] if len(vals) == 1 else tuple(vals)


def _remember_fast(key: Any, op: Any, info: OpInfo_, program: _Program, storages: list, buffer_dtypes: list,
                   device: torch.device, kwargs: dict) -> None:
    jdev = STATE.jax_device(device.index or 0)
    zeros = [(nbytes // jnp.dtype(dt).itemsize, dt, jdev) for (nbytes, _), dt in zip(storages, buffer_dtypes, strict=True)]
    _dtype_codes()  # fills _CODE_OF on first use
    _fast[key] = native.load().FastEntry(
        program=program, buffer_dtypes=list(buffer_dtypes), dev_index=device.index or 0,
        returns=_returned_positions(info, kwargs), returns_none=not op._schema.returns, zeros=zeros,
        outputs=[(list(shape), list(strides), _CODE_OF[dt]) for shape, strides, dt in program.outputs],
        single=program.out_struct == ("t", 0), zeroes=op is torch.ops.aten.zero_.default and len(storages) == 1)
    native.load().fast_register_op(op, info.dynamic_pos, info.dynamic)


def install_fast_path(fallback: Any) -> None:
    """Hand native.fast_call (every op's device kernel) what it needs to serve remembered calls
    without entering Python; `fallback` is the general path it calls for everything else."""
    mod = native.load()
    mod.fast_setup(entries=_fast, table=STATE.table._buffers, array_type=_ARRAY, pending_type=fused.Pending,
                   last=STATE.last_results, fallback=fallback, drain=STATE.table.drain, next_rng=STATE.next_rng,
                   rebuild=_rebuild, record=fused.record_fast, flush=STATE.table.flush, zeros=storage.zeros)
    mod.fast_fused(eager_mode.is_fused())


def _call_key(op: torch._ops.OpOverload, info: OpInfo_, args: tuple, kwargs: dict) -> tuple[Any, tuple, tuple, bool]:
    """The call's key from the one builder (csrc/fast_path.cpp), with the storage addresses and dynamic
    scalars in the order it walked them, and whether the fast path could serve the call."""
    sig = native.load().signature(id(op), args, kwargs, info.dynamic_pos, info.dynamic)
    if sig is None:
        raise RuntimeError(f"torchbridge: {op}: an argument is an undefined tensor")
    return sig


def _check_same_walk(op: Any, storage_keys: list, scalars: list, key_storages: tuple, key_scalars: tuple) -> None:
    """The key (C++) and the argument encoding a program is traced from (_Call) must walk the arguments
    in the same order: the fast path hands a program storages and scalars in the key's order."""
    if list(key_storages) != storage_keys or [type(s) for s in key_scalars] != [type(s) for s in scalars] or any(
            a is not b for a, b in zip(key_scalars, scalars, strict=True)):
        raise RuntimeError(f"torchbridge: {op}: the eager cache key (csrc/fast_path.cpp) and dispatch._Call walked "
                           "the arguments in different orders")


# ---- the entry point ---------------------------------------------------------------------------

def run(op: torch._ops.OpOverload, args: tuple, kwargs: dict, remember: bool = False, generator: Any = None) -> Any:
    """Run one op through the general path. `remember`: let the fast path serve its repeats (callers
    that do more than run the op, e.g. copy_'s conj/neg handling, must not). `generator`: the
    torch.Generator a random op draws from (default: the device's own stream)."""
    info = op_info(op)
    if info.lowering is None:
        raise UnsupportedOp(str(op))
    call_key, key_storages, key_scalars, servable = _call_key(op, info, args, kwargs)
    call, pos, kw = _encode_call(info, args, kwargs)
    device_type = STATE.name
    descs, keys, storages, device = _classify(op, call, device_type, allow_host=id(op) in _HOST_OK)
    if device is None:
        device = _factory_device(kwargs, device_type)
    dev_index = device.index or 0
    jdev = STATE.jax_device(dev_index)
    # Host tensors: 0-dim ones become (weakly typed) scalar values, others arrays on the device.
    hosts, host_scalars = [], []
    for i, d in enumerate(descs):
        if not isinstance(d, _DeviceArg):
            if d[0] == "scalar":
                host_scalars.append(call.tensors[i].item())
            else:
                hosts.append(jax.device_put(dtypes.host_to_numpy(call.tensors[i]), jdev))
    lazy = eager_mode.is_fused()
    get_buffer = STATE.table.get_or_zeros_lazy if lazy else STATE.table.get_or_zeros
    bufs = []
    buffer_dtypes = []
    first_dtype: dict[int, Any] = {}
    for d in descs:
        if isinstance(d, _DeviceArg) and d.slot not in first_dtype:
            first_dtype[d.slot] = d.dtype
    for slot, key in enumerate(keys):
        bufs.append(get_buffer(key, storages[slot][0], first_dtype[slot], jdev))
        buffer_dtypes.append(bufs[-1].dtype)
    # The key describes the arguments; what it cannot see is the buffers' current dtypes and, for a
    # factory call, the device the current-device default picked.
    cache_key = (call_key, tuple(buffer_dtypes), dev_index)
    program = _programs.get(cache_key)
    if program is None:
        _check_same_walk(op, keys, call.scalars, key_storages, key_scalars)
        with _lock:
            program = _build(op, info, call, pos, kw, descs, storages)
            _programs[cache_key] = program
    if program.resize:
        for name, shapes in program.resize.items():
            _resize_outs(kwargs[name], shapes)
        # Apply the resize events now: a late drain would overwrite the result with the old contents.
        STATE.table.drain()
        return run(op, args, kwargs, remember, generator)
    rng = None
    if program.random and generator is not None:
        offset = generator.get_offset()
        generator.set_offset(offset + (program.random + 3) // 4 * 4)
        rng = (np.uint64(generator.initial_seed()), np.uint64(offset))
    elif program.random:
        rng = STATE.next_rng(dev_index, program.random)
    if lazy:
        updated, new = fused.RECORDER.record(program, tuple(bufs), tuple(call.scalars), tuple(hosts),
                                             tuple(host_scalars), rng)
    elif bufs or hosts:  # committed inputs already pin the program to their device
        updated, new = program.call(bufs, tuple(call.scalars), tuple(hosts), tuple(host_scalars), rng, dev_index)
    else:
        with jax.default_device(jdev):
            updated, new = program.fn(tuple(bufs), tuple(call.scalars), tuple(hosts), tuple(host_scalars), rng)
    if not lazy:
        STATE.last_results[dev_index] = (updated, new)  # what synchronize() waits on
    if remember and servable and generator is None:
        _remember_fast(call_key, op, info, program, storages, buffer_dtypes, device, kwargs)
    for slot, buf in zip(program.writes, updated, strict=True):
        STATE.table.set(keys[slot], buf)
    returns = _returned_positions(info, kwargs)
    if returns is not None:
        # e.g. _fused_adam_ mutates its lists and returns nothing
        result = _returned_args(returns, args, kwargs) if op._schema.returns else None
    else:
        outs = []
        new_tensor = native.load().new_tensor
        for (shape, strides, dt), buf in zip(program.outputs, new, strict=True):
            code = _CODE_OF.get(dt)
            if code is None:  # a dtype the device cannot hold: let torch raise its own error
                t = torch.empty_strided(shape, strides, dtype=dt, device=device)
                key = t.untyped_storage().data_ptr()
            else:
                t, key = new_tensor(list(shape), list(strides), code, dev_index)
            STATE.table.set(key, buf)
            outs.append(t)
        result = _rebuild(program.out_struct, outs)
    if lazy and fused.RECORDER.full():
        STATE.table.flush()  # after the table holds this op's placeholders, so they resolve too
    return result


def _factory_device(kwargs: dict, device_type: str) -> torch.device:
    dev = kwargs.get("device")
    if dev is None:
        return torch.device(device_type, STATE.current_device)
    dev = torch.device(dev)
    return dev if dev.index is not None else torch.device(device_type, STATE.current_device)


_HOST_OK: set[Any] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


_warned: set[str] = set()


def cache_info() -> dict[str, Any]:
    return {"programs": len(_programs), "compiles": sum(compile_counter.values()), "fast_entries": len(_fast),
            "donated_writes": donated_writes}


def clear_cache() -> None:
    """Drop every compiled eager program (and the fused sequences built from them)."""
    STATE.table.flush()
    _programs.clear()
    _fast.clear()
    # Fused programs are keyed by id() of per-op programs; ids of dropped programs may be reused.
    fused.RECORDER.cache.clear()
