"""A kernel's signature: what each JAX parameter becomes in the torch op's schema, and back.

The schema comes from the function's annotations: `jax.Array` -> Tensor, `jax.Array | None` ->
Tensor?, `list[jax.Array]` / `Sequence[jax.Array]` -> Tensor[], float/int/bool/str (optional or as
lists) -> the same scalar types. Any other annotated parameter is a pytree of arrays: the op takes
its leaves as a Tensor[] and its structure in one trailing `str` argument (`_trees`), so the schema
stays one a torch op can have. The return annotation works the same way (a pytree result is
returned as a Tensor[] and rebuilt by the caller).
"""

from __future__ import annotations

import collections.abc
import inspect
import json
import types
import typing
from dataclasses import dataclass
from typing import Any

import jax
import torch
import torch.utils._pytree as pytree

TREES = "_trees"  # the hidden argument holding the pytree parameters' structures

_SCALARS = {float: float, int: int, bool: bool, str: str}


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "array" | "optional" | "list" | "tree" | "scalar"
    annotation: Any  # the torch-side annotation (for torch.library.infer_schema)
    default: Any = inspect.Parameter.empty
    static: bool = True  # scalars only: False when a new value must not recompile (traced)


def _is_array(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, jax.Array)


def _optional_inner(t: Any) -> Any:
    """X for `X | None` / Optional[X], else None."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(t)) == 2:
            return args[0]
    return None


def _sequence_item(t: Any) -> Any:
    """X for list[X], Sequence[X] and tuple[X, ...], else None."""
    origin = typing.get_origin(t)
    args = typing.get_args(t)
    if origin in (list, collections.abc.Sequence) and len(args) == 1:
        return args[0]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _param(name: str, t: Any, default: Any, static: bool, kernel: str) -> Param:
    if _is_array(t):
        return Param(name, "array", torch.Tensor, default)
    inner = _optional_inner(t)
    if inner is not None and _is_array(inner):
        return Param(name, "optional", torch.Tensor | None, default)
    item = _sequence_item(t)
    if item is not None and _is_array(item):
        return Param(name, "list", list[torch.Tensor], default)
    scalar = inner if inner is not None else t
    if scalar in _SCALARS:
        traced = scalar in (float, int) and not static
        return Param(name, "scalar", t, default, static=not traced)
    seq = _sequence_item(scalar)
    if seq in (int, float, bool):
        return Param(name, "scalar", list[seq] if inner is None else list[seq] | None, default)
    if default is not inspect.Parameter.empty:
        raise TypeError(f"torchbridge.kernel {kernel}: pytree parameter '{name}' cannot have a default")
    return Param(name, "tree", list[torch.Tensor], default)


@dataclass(frozen=True)
class Signature:
    kernel: str  # "ns::name", for error messages
    params: tuple[Param, ...]
    result: str  # "array" | "tuple" | "list" | "tree" | "none"
    n_results: int  # for "tuple"
    mutates: tuple[str, ...]
    schema: str

    @staticmethod
    def of(fn: Any, kernel: str, mutates_args: tuple[str, ...], static_argnames: tuple[str, ...]) -> Signature:
        sig = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception as e:  # noqa: BLE001 - an unresolvable annotation: say which kernel
            raise TypeError(f"torchbridge.kernel {kernel}: cannot resolve the annotations of {fn.__name__}: {e}") from e
        params = []
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"torchbridge.kernel {kernel}: *args/**kwargs are not supported ('{p.name}')")
            if p.name not in hints:
                raise TypeError(f"torchbridge.kernel {kernel}: parameter '{p.name}' needs an annotation "
                                "(jax.Array, a scalar type, or a pytree of arrays)")
            params.append(_param(p.name, hints[p.name], p.default, p.name in static_argnames, kernel))
        unknown = set(static_argnames) - {p.name for p in params}
        if unknown:
            raise TypeError(f"torchbridge.kernel {kernel}: static_argnames {sorted(unknown)} are not parameters")
        for name in mutates_args:
            match = [p for p in params if p.name == name]
            if not match or match[0].kind not in ("array", "list"):
                raise TypeError(f"torchbridge.kernel {kernel}: mutates_args '{name}' must name a jax.Array "
                                "or list-of-arrays parameter")
        result, n, _ = _result(hints.get("return", inspect.Parameter.empty), kernel)
        return Signature.build(kernel, tuple(params), result, tuple(mutates_args), n)

    @staticmethod
    def build(kernel: str, params: tuple[Param, ...], result: str, mutates: tuple[str, ...], n: int = 0) -> Signature:
        ret_ann = {"none": None, "array": torch.Tensor, "list": list[torch.Tensor], "tree": list[torch.Tensor],
                   "tuple": tuple[tuple(torch.Tensor for _ in range(n))]}[result]
        torch_params = [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=p.annotation,
                                          default=p.default) for p in params]
        if any(p.kind == "tree" for p in params):
            torch_params.append(inspect.Parameter(TREES, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                                                  default=""))
        proto = types.FunctionType((lambda: None).__code__, {})
        proto.__signature__ = inspect.Signature(torch_params, return_annotation=ret_ann)
        schema = torch.library.infer_schema(proto, mutates_args=mutates)
        return Signature(kernel, params, result, n, mutates, schema)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params) + ((TREES,) if self.has_trees else ())

    @property
    def has_trees(self) -> bool:
        return any(p.kind == "tree" for p in self.params)

    @property
    def traced_scalars(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.kind == "scalar" and not p.static)

    @property
    def static_scalars(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.kind == "scalar" and p.static)

    # -- torch call <-> JAX call ------------------------------------------------------------------
    def flatten_call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A Python call of the kernel -> the op's arguments (pytree parameters flattened)."""
        bound = self._bind_python(args, kwargs)
        out, trees = [], {}
        for p in self.params:
            v = bound[p.name]
            if p.kind == "tree":
                leaves, spec = pytree.tree_flatten(v)
                trees[p.name] = pytree.treespec_dumps(spec)
                v = leaves
            out.append(v)
        if trees:
            out.append(json.dumps(trees))
        return tuple(out), {}

    def _bind_python(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = [p.name for p in self.params]
        if len(args) > len(names):
            raise TypeError(f"{self.kernel}: takes {len(names)} arguments, got {len(args)}")
        bound = dict(zip(names, args, strict=False))
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"{self.kernel}: unexpected argument '{k}'")
            if k in bound:
                raise TypeError(f"{self.kernel}: got two values for argument '{k}'")
            bound[k] = v
        for p in self.params:
            if p.name not in bound:
                if p.default is inspect.Parameter.empty:
                    raise TypeError(f"{self.kernel}: missing argument '{p.name}'")
                bound[p.name] = p.default
        return bound

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The op's arguments (as the dispatcher or a graph passes them, defaults possibly left
        out) -> {parameter: value}, pytree parameters rebuilt from their leaves."""
        names = self.names
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        trees = json.loads(bound.get(TREES) or "{}")
        out = {}
        for p in self.params:
            v = bound.get(p.name, p.default)
            if p.kind == "tree":
                v = pytree.tree_unflatten(list(v), pytree.treespec_loads(trees[p.name]))
            elif p.kind == "list" and v is not None:
                v = list(v)
            out[p.name] = v
        return out

    def call(self, fn: Any, values: dict[str, Any]) -> Any:
        return fn(*(values[p.name] for p in self.params))

    def arrays(self, values: dict[str, Any]) -> tuple:
        """The values of the array parameters (the differentiable ones), in signature order."""
        return tuple(values[p.name] for p in self.params if p.kind != "scalar")

    def with_arrays(self, values: dict[str, Any], arrays: tuple) -> dict[str, Any]:
        it = iter(arrays)
        return {p.name: (next(it) if p.kind != "scalar" else values[p.name]) for p in self.params}

    def describe(self, values: dict[str, Any]) -> str:
        """`x: float32[4, 16], w: float32[8], eps=1e-05`, for error messages."""
        def one(v: Any) -> str:
            if hasattr(v, "shape") and hasattr(v, "dtype"):
                return f"{v.dtype}{list(v.shape)}"
            if isinstance(v, (list, tuple, dict)):
                return str(jax.tree.map(one, v))
            return repr(v)

        return ", ".join(f"{p.name}: {one(values[p.name])}" if p.kind != "scalar" else f"{p.name}={values[p.name]!r}"
                         for p in self.params)

    # -- results ----------------------------------------------------------------------------------
    def split_result(self, res: Any) -> tuple[Any, dict[str, Any]]:
        """The JAX function's return -> (outputs, {mutated parameter: new value})."""
        if not self.mutates:
            return res, {}
        if self.result == "none":
            outs, new = None, res
        else:
            if not (isinstance(res, tuple) and len(res) == 2):
                raise TypeError(f"{self.kernel}: a kernel with mutates_args returns (result, {{name: new value}})")
            outs, new = res
        if not isinstance(new, dict) or set(new) != set(self.mutates):
            got = sorted(new) if isinstance(new, dict) else type(new).__name__
            raise TypeError(f"{self.kernel}: expected the new values of {list(self.mutates)} as a dict, got {got}")
        return outs, new

    def flatten_result(self, outs: Any) -> Any:
        """Outputs in the op's return form (a pytree result becomes its list of leaves)."""
        if self.result == "tree":  # JAX's flattening (dict keys sorted), as the caller's unflattening
            return jax.tree.leaves(outs)
        if self.result == "tuple":
            if not (isinstance(outs, (tuple, list)) and len(outs) == self.n_results):
                raise TypeError(f"{self.kernel}: expected a tuple of {self.n_results} arrays, got {type(outs).__name__}")
            return tuple(outs)
        if self.result == "list":
            return list(outs)
        return outs


def _result(t: Any, kernel: str) -> tuple[str, int, None]:
    if t is None or t is type(None):
        return "none", 0, None
    if t is inspect.Parameter.empty:
        raise TypeError(f"torchbridge.kernel {kernel}: annotate the return type (jax.Array, a tuple of them, "
                        "None, or a pytree)")
    if _is_array(t):
        return "array", 1, None
    args = typing.get_args(t)
    if typing.get_origin(t) is tuple and args and Ellipsis not in args and all(_is_array(a) for a in args):
        return "tuple", len(args), None
    item = _sequence_item(t)
    if item is not None and _is_array(item):
        return "list", 0, None
    return "tree", 0, None
