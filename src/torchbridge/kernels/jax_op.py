"""A JAX function registered as a torch op: schema, fake kernel, lowering, device and CPU kernels.

- fake (FakeTensor and meta): `jax.eval_shape` of the function, so output shapes and dtypes come
  from the function itself and an argument it rejects fails here, with the kernel's name;
- lowering: the function in the one lowering table (device/lowerings/registry.py), so eager
  dispatch runs it as a cached program and compiled graphs trace it into their one jax.jit;
- device kernel: `native.fast_call` bound to the op (device/custom_ops.py), the path ATen ops take;
- CPU kernel: the function jitted on JAX's CPU device, operands shared through dlpack.
On JAX's CPU platform Pallas kernels cannot compile, so they run with `interpret=True` there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import torch
import torch.utils._pytree as pytree
from jax._src import config as jax_config

from torchbridge.device import custom_ops, dtypes
from torchbridge.device.lowerings import registry
from torchbridge.device.runtime import STATE
from torchbridge.kernels import symbolic, tiling
from torchbridge.kernels.signature import Signature


class KernelError(ValueError):
    """A kernel rejected its arguments (raised with the kernel's name and its arguments' shapes)."""


@contextlib.contextmanager
def interpret_mode(on: Any) -> Iterator[None]:
    """Every pallas_call traced inside runs in interpret mode when `on` (True, or Pallas TPU
    InterpretParams). JAX's switch for this is the one behind pltpu.force_tpu_interpret_mode."""
    if not on:
        yield
        return
    prev = jax_config.pallas_tpu_interpret_mode_context_manager.swap_local(on)
    try:
        yield
    finally:
        jax_config.pallas_tpu_interpret_mode_context_manager.set_local(prev)


def _abstract(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return jax.ShapeDtypeStruct(tuple(v.shape), dtypes.to_jax(v.dtype))
    return v


_MISSING = object()
_SHAPE_CACHE_SIZE = 1024
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _shape_key(abstract: dict[str, Any], traced_scalars: tuple[str, ...]) -> Any:
    """What the fake kernel's result depends on: arrays' shapes and dtypes, static scalars' values, only
    the types of traced scalars. None when something in it is not hashable (a symbolic size)."""
    key = []
    for name, value in abstract.items():
        leaves, spec = pytree.tree_flatten(value)
        if name in traced_scalars:
            leaves = [x if isinstance(x, jax.ShapeDtypeStruct) else type(x) for x in leaves]
        if any(isinstance(x, _SYMBOLIC) or (isinstance(x, jax.ShapeDtypeStruct)
                                             and any(isinstance(d, _SYMBOLIC) for d in x.shape)) for x in leaves):
            return None  # a symbolic value compares by guard, not by equality
        key.append((name, spec, tuple(leaves)))
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)


class JaxOp:
    """`apply(values)` (values: {parameter: value} as Signature.bind gives them) as the op `qualname`."""

    def __init__(self, qualname: str, sig: Signature, apply: Callable[[dict[str, Any]], Any],
                 interpret: Any = None) -> None:
        self.qualname = qualname
        self.sig = sig
        self._apply = apply
        self._interpret = interpret
        self.op_def = torch.library.custom_op(qualname, self._cpu_kernel, mutates_args=sig.mutates, schema=sig.schema)
        self.op: torch._ops.OpOverload = self.op_def._opoverload
        self.op_def.register_fake(self._fake)
        registry.lower(qualname, dynamic=sig.traced_scalars, mutates=sig.mutates)(self.lowering)
        custom_ops.bind(self.op_def._lib, self.op)
        self._cpu_jit = jax.jit(self._cpu_program, static_argnums=(2,))
        # Output shapes per argument signature: Dynamo and AOTAutograd ask the fake kernel several times
        # per op and graph, and eval_shape retraces the whole kernel (both platform branches) each time.
        self._shapes: dict[Any, Any] = {}
        self._symbolic_shapes: dict[Any, Any] = {}  # likewise, for symbolic sizes (kernels/symbolic.py)

    # -- the JAX side -----------------------------------------------------------------------------
    def run(self, values: dict[str, Any], interpret: Any, platform: str | None) -> Any:
        """The op's results in its return form, plus {name: new value} for a mutating op, traced for
        `platform` (tiling.tracing_for)."""
        with interpret_mode(interpret), tiling.tracing_for(platform):
            res = self._apply(values)
        outs, new = self.sig.split_result(res)
        outs = self.sig.flatten_result(outs)
        return (outs, new) if self.sig.mutates else outs

    def lowering(self, *args: Any, **kwargs: Any) -> Any:
        """The registry's lowering: eager dispatch and compiled graphs call this inside their trace."""
        interpret = self._interpret if self._interpret is not None else STATE.platform == "cpu"
        return self.run(self.sig.bind(args, kwargs), interpret, STATE.platform)

    def _fake(self, *args: Any, **kwargs: Any) -> Any:
        values = self.sig.bind(args, kwargs)
        device = next(t.device for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor))
        res = symbolic.eval_shape(self._eval_shape, values, self._symbolic_shapes)
        if res is None:  # no symbolic sizes, or the kernel needs them as numbers (then Dynamo guards them)
            abstract = pytree.tree_map(_abstract, values)
            key = _shape_key(abstract, self.sig.traced_scalars)
            res = self._shapes.get(key, _MISSING) if key is not None else _MISSING
            if res is _MISSING:
                res = self._eval_shape(abstract)
                if key is not None:
                    if len(self._shapes) >= _SHAPE_CACHE_SIZE:
                        self._shapes.pop(next(iter(self._shapes)))
                    self._shapes[key] = res

        def empty(s: Any) -> torch.Tensor:
            return torch.empty(tuple(s.shape), dtype=dtypes.to_torch(s.dtype), device=device)

        if self.sig.mutates:
            res = res[0]
        return None if res is None else jax.tree.map(empty, res)

    def _eval_shape(self, abstract: dict[str, Any]) -> Any:
        traced = {k: v for k, v in abstract.items() if k in self.sig.traced_scalars or any(
            p.name == k and p.kind != "scalar" for p in self.sig.params)}
        fixed = {k: v for k, v in abstract.items() if k not in traced}
        try:
            # Any platform's branch has the same result shapes (platform_dependent requires it).
            res = jax.eval_shape(lambda t: self.run({**fixed, **t}, interpret=True, platform="cpu"), traced)
        except KernelError:
            raise
        except Exception as e:  # noqa: BLE001 - JAX's error, said again with the kernel and its arguments
            raise KernelError(f"{self.qualname}: the kernel rejected its arguments ({self.sig.describe(abstract)}): "
                              f"{type(e).__name__}: {e}") from e
        if self.sig.mutates:
            for name, val in res[1].items():
                want = abstract[name]
                got = jax.tree.leaves(val)
                wants = jax.tree.leaves(want)
                if [tuple(g.shape) for g in got] != [tuple(w.shape) for w in wants]:
                    raise KernelError(f"{self.qualname}: the new value of mutated argument '{name}' has shape "
                                      f"{[tuple(g.shape) for g in got]}, the argument {[tuple(w.shape) for w in wants]}")
        return res

    # -- the CPU kernel ---------------------------------------------------------------------------
    def _cpu_program(self, arrays: dict[str, Any], traced: dict[str, Any], fixed: tuple) -> Any:
        return self.run({**arrays, **traced, **{k: list(v) if isinstance(v, tuple) else v for k, v in fixed}},
                        interpret=True, platform="cpu")

    def _cpu_kernel(self, *args: Any, **kwargs: Any) -> Any:
        values = self.sig.bind(args, kwargs)
        inputs = pytree.tree_leaves(values)

        def to_jax(v: Any) -> Any:
            return jax.dlpack.from_dlpack(v.detach().contiguous()) if isinstance(v, torch.Tensor) else v

        arrays = {p.name: pytree.tree_map(to_jax, values[p.name]) for p in self.sig.params if p.kind != "scalar"}
        traced = {k: values[k] for k in self.sig.traced_scalars}
        fixed = tuple((k, tuple(values[k]) if isinstance(values[k], list) else values[k])
                      for k in self.sig.static_scalars)
        with jax.default_device(jax.devices("cpu")[0]):
            res = self._cpu_jit(arrays, traced, fixed)
        if self.sig.mutates:
            res, new = res
            with torch.no_grad():
                for name, val in new.items():
                    targets = values[name] if isinstance(values[name], list) else [values[name]]
                    for t, v in zip(targets, jax.tree.leaves(val), strict=True):
                        t.copy_(torch.from_dlpack(v))
        ptrs = {t.data_ptr() for t in inputs if isinstance(t, torch.Tensor)}

        def to_torch(a: Any) -> torch.Tensor:
            t = torch.from_dlpack(a)
            return t.clone() if t.data_ptr() in ptrs else t  # an op's output must not alias its inputs

        return None if res is None else jax.tree.map(to_torch, res)
