"""Kernel result shapes for symbolic sizes, through JAX's shape polymorphism.

When Dynamo traces with symbolic sizes (`dynamic=True`, or a size that changed between calls), a
kernel op's fake implementation gets tensors whose sizes are SymInts. Evaluating the kernel with them
as numbers would make Dynamo guard each one (`s0 == 16`), and trace again for every new size. Instead,
each symbol becomes a JAX symbolic dimension of the same name, the kernel is evaluated abstractly
once, and each result size, an expression over those dimensions, is rebuilt from the SymInts. A kernel
that needs a size as a number (a Pallas grid, a Python branch on it) raises inside JAX; the caller then
falls back to numbers, and the guards, for that argument layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import sympy
import torch
import torch.utils._pytree as pytree
from jax import export

from torchbridge.compile.bounded import size_expr
from torchbridge.device import dtypes

_NUMBERS = "numbers"  # a cache entry: this layout's kernel needs its sizes as numbers


def _to_jax(e: sympy.Expr, dims: dict[str, Any]) -> Any:
    """A torch size expression over symbols (s0, 16*s1, s0//2) as JAX dimensions over `dims`."""
    from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

    if e.is_Integer:
        return int(e)
    if e.is_Symbol:
        return dims[str(e)]
    args = [_to_jax(a, dims) for a in e.args]
    if e.is_Add:
        return sum(args[1:], args[0])
    if e.is_Mul:
        out = args[0]
        for a in args[1:]:
            out = out * a
        return out
    if e.is_Pow and e.args[1].is_Integer and int(e.args[1]) > 0:
        out = args[0]
        for _ in range(int(e.args[1]) - 1):
            out = out * args[0]
        return out
    if isinstance(e, FloorDiv):
        return args[0] // args[1]
    if isinstance(e, (Mod, PythonMod)):
        return args[0] % args[1]
    raise NotImplementedError(f"size expression {e}")


def _layout(values: dict[str, Any]) -> Any:
    """What the abstract result depends on: shapes (a symbolic size by its expression, so that two sizes
    known equal key alike and unrelated ones do not), dtypes and the other arguments."""
    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (tuple(str(size_expr(d)) if isinstance(d, torch.SymInt) else d for d in v.shape), v.dtype)
        return v
    leaves, spec = pytree.tree_flatten(values)
    try:
        key = (spec, tuple(one(v) for v in leaves))
        hash(key)
    except TypeError:
        return None
    return key


def eval_shape(evaluate: Callable[[dict[str, Any]], Any], values: dict[str, Any], cache: dict[Any, Any]) -> Any:
    """`evaluate(abstract values)` with symbolic JAX dimensions, its results' sizes as SymInts; None when
    no tensor has a symbolic size, or the kernel needs its sizes as numbers. `cache`: the kernel's own,
    by argument layout (Dynamo and AOTAutograd ask for every call of the op, layer after layer)."""
    leaves = pytree.tree_leaves(values)
    sizes = [d for t in leaves if isinstance(t, torch.Tensor) for d in t.shape if isinstance(d, torch.SymInt)]
    if not sizes or any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) for v in leaves):
        return None  # (a symbolic scalar argument: numbers)
    layout = _layout(values)
    res = cache.get(layout) if layout is not None else None
    if res is None:
        res = _evaluate(evaluate, values, sizes)
        if layout is not None:
            if len(cache) >= _CACHE_SIZE:
                cache.pop(next(iter(cache)))
            cache[layout] = res
    if res is _NUMBERS:
        return None
    torch_sizes = {str(e): d for d in sizes if (e := size_expr(d)).is_Symbol}
    try:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(_size(d, torch_sizes) for d in s.shape), s.dtype), res)
    except Exception:  # noqa: BLE001 - a result size over a symbol no argument has on its own: numbers
        return None


_CACHE_SIZE = 256


def _evaluate(evaluate: Callable[[dict[str, Any]], Any], values: dict[str, Any], sizes: list) -> Any:
    """The abstract result with JAX dimensions (one per torch symbol, of its name), or _NUMBERS."""
    names = sorted({str(s) for d in sizes for s in size_expr(d).free_symbols})
    dims = dict(zip(names, export.symbolic_shape(", ".join(names)), strict=True))

    def abstract(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        shape = tuple(_to_jax(size_expr(d), dims) if isinstance(d, torch.SymInt) else d for d in v.shape)
        return jax.ShapeDtypeStruct(shape, dtypes.to_jax(v.dtype))

    try:
        return evaluate(pytree.tree_map(abstract, values))
    except Exception:  # noqa: BLE001 - any failure means: evaluate with numbers (and guards) instead
        return _NUMBERS


def _size(d: Any, sizes: dict[str, torch.SymInt]) -> Any:
    """A result dimension: an int, or the SymInt its JAX expression stands for."""
    if not export.is_symbolic_dim(d):
        return int(d)
    text = str(d)
    if text in sizes:
        return sizes[text]
    # a polynomial with JAX's integer operators, over the symbols (JAX prints its own expressions)
    namespace = {"floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b, "max": torch.sym_max,
                 "min": torch.sym_min, **sizes}
    return eval(text, {"__builtins__": {}}, namespace)  # noqa: S307 - JAX's own expression text
