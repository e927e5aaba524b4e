"""Bounded symbolic sizes: one program per size bucket for sizes that change from call to call.

XLA programs have static shapes. When an input's size changes between calls, Dynamo (automatic
dynamic shapes, on by default for every backend) hands the backend a graph whose sizes are symbols
(`s0`). Compiling one program per concrete size would compile at every step of a jagged workload (a
DLRM's index lists, a different length every batch). Instead, where every op that sees a symbolic
size can run on a padded array (the rules below), the graph runs as bounded programs:

- each symbol s gets a static padded value P(s): when a value of s exceeds it (the first one
  included), the power of two at or above twice that value (per Dynamo shape environment), so P
  only grows and a whole run compiles a few programs (one per growth), forward and backward alike;
- inputs are padded to P (read in place when their storage already holds the padded view, e.g. a
  tensor an earlier bounded program returned; otherwise copied into a zero-padded host array), and
  the true sizes enter the program as values (`lengths`);
- elementwise ops and gathers leave garbage in the padding, which nothing reads; ops whose result
  would read it (reductions over a padded axis, scatters, bags of indices) first mask it with the
  true sizes (`MASKED`);
- outputs with a symbolic size come back as views of their true size into the padded buffer.

A graph with any other op on a symbolic size (`unsupported()` names it) is specialised instead: one
static program per size, Dynamo guarding `s0 == n` (backend.tpu_backend retries it static).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import sympy
import torch
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

aten = torch.ops.aten


def size_expr(x: torch.SymInt) -> sympy.Expr:
    """A size's expression after the shape environment's replacements (a size Dynamo guarded to
    one value, `s0 == 5`, is the constant 5)."""
    env = x.node.shape_env
    return env.replace(x.node.expr) if env is not None else x.node.expr


def free_symbols(val: Any) -> set[sympy.Symbol]:
    """The symbols a node's value (a tensor's sizes, strides and offset, or a SymInt) depends on."""
    if isinstance(val, torch.SymInt):
        return set(size_expr(val).free_symbols)
    if isinstance(val, torch.Tensor):
        out: set[sympy.Symbol] = set()
        for s in (*val.shape, *val.stride(), val.storage_offset()):
            if isinstance(s, torch.SymInt):
                out |= size_expr(s).free_symbols
        return out
    if isinstance(val, (list, tuple)):
        return set().union(*(free_symbols(v) for v in val)) if val else set()
    return set()


def concrete(x: Any, bindings: dict[sympy.Symbol, int] | None) -> int:
    """An int size: a SymInt evaluated with `bindings` (None: the value Dynamo traced with, for
    graphs specialised by guards)."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    if bindings is None:
        return int(guarding_hint_or_throw(x))
    return int(size_expr(x).xreplace(bindings))


def ints(seq: Any, bindings: dict[sympy.Symbol, int] | None) -> tuple[int, ...]:
    return tuple(concrete(s, bindings) for s in seq)


def plain_symbol(x: Any) -> sympy.Symbol | None:
    """The symbol a size is, when it is exactly one symbol (s0, not 2*s0)."""
    if isinstance(x, torch.SymInt):
        e = size_expr(x)
        return e if isinstance(e, sympy.Symbol) else None
    return None


def padded_size(n: int) -> int:
    """The bucket a size grows to: the power of two at or above twice the size (at least 16). The
    headroom is what keeps compiles few: sizes that wander around a power of two (a jagged batch's
    index count) would otherwise cross it, and compile again, once per symbol."""
    return max(16, 1 << max(0, 2 * n - 1).bit_length())


# Padded value of each symbol so far, per shape environment (forward and backward graphs of one
# Dynamo compile share it, so the backward reads the forward's padded outputs in place).
_PADDED: weakref.WeakKeyDictionary[Any, dict[sympy.Symbol, int]] = weakref.WeakKeyDictionary()


class Dims:
    """A graph's symbolic sizes: where each symbol's value comes from at call time, and (bounded
    graphs) the padded value each symbol takes in the program."""

    def __init__(self, placeholders: list[torch.fx.Node], bounded: bool) -> None:
        self.bounded = bounded
        self.sources: dict[sympy.Symbol, tuple[int, int | None]] = {}  # symbol -> (input, dim or None)
        self.shape_env = None
        for i, node in enumerate(placeholders):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt):
                sym = plain_symbol(val)
                if sym is not None:
                    self.sources.setdefault(sym, (i, None))
                    self.shape_env = val.node.shape_env
            elif isinstance(val, torch.Tensor):
                for d, size in enumerate(val.shape):
                    sym = plain_symbol(size)
                    if sym is not None:
                        self.sources.setdefault(sym, (i, d))
                        self.shape_env = size.node.shape_env
        self.symbols = tuple(sorted(self.sources, key=str))
        self.index = {s: k for k, s in enumerate(self.symbols)}
        self.symbolic_inputs = frozenset(i for i, n in enumerate(placeholders) if free_symbols(n.meta.get("val")))

    @staticmethod
    def of(placeholders: list[torch.fx.Node], bounded: bool) -> Dims | None:
        if not any(free_symbols(n.meta.get("val")) for n in placeholders):
            return None
        return Dims(placeholders, bounded)

    def bind(self, args: tuple) -> tuple[dict, dict]:
        """(true, padded) values of the symbols for a call with `args`."""
        true = {}
        for sym, (i, d) in self.sources.items():
            a = args[i]
            true[sym] = int(a) if d is None else int(a.shape[d])
        if not self.bounded:
            return true, true
        store = _PADDED.setdefault(self.shape_env, {}) if self.shape_env is not None else {}
        padded = {}
        for sym, n in true.items():
            p = store.get(sym, 0)
            if n > p:
                p = store[sym] = padded_size(n)
            padded[sym] = p
        return true, padded

    def lengths(self, true: dict) -> np.ndarray:
        return np.array([true[s] for s in self.symbols], dtype=np.int64)


def pad_host(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`arr` in the top corner of a zero array of `shape` (each axis at least as long)."""
    if arr.shape == shape:
        return arr
    out = np.zeros(shape, arr.dtype)
    out[tuple(slice(0, n) for n in arr.shape)] = arr
    return out


def strided_numpy(flat: np.ndarray, shape: tuple, strides: tuple, offset: int) -> np.ndarray:
    """A strided view of a flat host array (no copy)."""
    item = flat.dtype.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], shape=shape, strides=tuple(s * item for s in strides))


# ---- which ops may see a padded size ---------------------------------------------------------------

def _mask(x: Any, val: torch.Tensor, lens: dict, fill: Any) -> Any:
    """`x` (a padded array for the meta value `val`) with `fill` wherever an index along a
    symbolic axis is past that axis's true size."""
    keep = None
    for d, size in enumerate(val.shape):
        sym = plain_symbol(size)
        if sym is None:
            continue
        shape = [1] * x.ndim
        shape[d] = x.shape[d]
        k = (jnp.arange(x.shape[d]) < lens[sym]).reshape(shape)
        keep = k if keep is None else keep & k
    if keep is None:
        return x
    return jnp.where(keep, x, jnp.asarray(fill, x.dtype))


def _arg(node: torch.fx.Node, i: int, name: str) -> Any:
    """Argument `i` (schema name `name`) of a node, positional or keyword, or the schema default."""
    if i < len(node.args):
        return node.args[i]
    if name in node.kwargs:
        return node.kwargs[name]
    for a in node.target._schema.arguments:
        if a.name == name:
            return a.default_value
    return None


def _full(node: torch.fx.Node, args: tuple, kwargs: dict) -> list:
    """The call's arguments, positional, with schema defaults filled in."""
    out = list(args)
    for a in node.target._schema.arguments[len(args):]:
        out.append(kwargs[a.name] if a.name in kwargs else a.default_value)
    return out


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else None


def _bag_forward(node: torch.fx.Node, args: tuple, kwargs: dict, lens: dict) -> tuple[tuple, dict]:
    # Bags end at the next offset; the last one at the end of `indices`, which is now the padded
    # end: give it its true end as one more offset (include_last_offset), so padding is in no bag.
    a = _full(node, args, kwargs)
    if not a[7]:  # include_last_offset
        n = lens[plain_symbol(_val(node.args[1]).shape[0])]
        a[2] = jnp.concatenate([a[2], n.astype(a[2].dtype).reshape(1)])
        a[7] = True
    return tuple(a), {}


def _bag_mask(o2b: int) -> Callable:
    """Backward ops reading offset2bag (argument `o2b`): padded positions go to no bag (the bag count)."""
    def rule(node: torch.fx.Node, args: tuple, kwargs: dict, lens: dict) -> tuple[tuple, dict]:
        a = _full(node, args, kwargs)
        bags = a[0].shape[0]
        a[o2b] = _mask(a[o2b], _val(node.args[o2b]), lens, bags)
        return tuple(a), {}
    return rule


def _zero_arg0(node: torch.fx.Node, args: tuple, kwargs: dict, lens: dict) -> tuple[tuple, dict]:
    """Padding contributes nothing: argument 0 (what a sum or scatter-add reads) is zero there."""
    return (_mask(args[0], _val(node.args[0]), lens, 0), *args[1:]), kwargs


def _bag_checks(node: torch.fx.Node) -> str | None:
    idx = _val(node.args[1])
    if not (isinstance(idx, torch.Tensor) and idx.ndim == 1 and plain_symbol(idx.shape[0]) is not None):
        return "embedding_bag over 2-d or derived-size indices"
    if free_symbols(_val(node.args[2])):
        return "embedding_bag with a symbolic number of bags"
    return None


def _no_freq(i: int, name: str) -> Callable[[torch.fx.Node], str | None]:
    def check(node: torch.fx.Node) -> str | None:
        return "scale_grad_by_freq with padded indices" if _arg(node, i, name) else None
    return check


# op -> (rule run before the op's lowering, a check that may reject the node)
MASKED: dict[Any, tuple[Callable, Callable[[torch.fx.Node], str | None] | None]] = {
    aten._embedding_bag.default: (_bag_forward, _bag_checks),
    aten._embedding_bag_forward_only.default: (_bag_forward, _bag_checks),
    aten._embedding_bag_dense_backward.default: (_bag_mask(2), _no_freq(6, "scale_grad_by_freq")),
    aten._embedding_bag_backward.default: (_bag_mask(3), _no_freq(7, "scale_grad_by_freq")),
    aten._embedding_bag_per_sample_weights_backward.default: (_bag_mask(4), None),
    aten.embedding_dense_backward.default: (_zero_arg0, _no_freq(4, "scale_grad_by_freq")),
    aten.sum.dim_IntList: (_zero_arg0, None),
    aten.sum.default: (_zero_arg0, None),
}

# Ops whose padded result is the true result in its valid part, whatever the padding holds:
# elementwise (no size or scalar argument derived from a symbol) and gathers.
ELEMENTWISE = frozenset({
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default, aten.relu.default,
    aten.sigmoid.default, aten.tanh.default, aten.exp.default, aten.where.self, aten.threshold_backward.default,
    aten.gelu.default, aten.gelu_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default,
    aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten.embedding.default, aten.unsqueeze.default, aten.squeeze.dim,
})
# Ops taking sizes: a symbolic size is the padded one (the padding is garbage or zeros, never read).
SIZED = frozenset({aten.expand.default, aten.zeros.default, aten.full.default, aten.new_zeros.default,
                   aten.empty.memory_format})
# Integer arithmetic on sizes, in the trace on padded values (only for other sizes, checked by the users).
SIZE_ARITHMETIC = frozenset({aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, operator.add,
                             operator.sub, operator.mul, operator.floordiv, operator.mod, torch.sym_max})
# Comparisons of sizes and checks on them (torch._check): in a program for exact sizes, evaluated on this
# call's sizes while tracing (bounded programs reject them: padded sizes would answer wrongly).
SIZE_COMPARISONS = frozenset({operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
                              torch.sym_not})
SIZE_CHECKS = frozenset({aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
                         aten.sym_constrain_range.default})
_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def _leading_only(val: Any) -> bool:
    """A tensor whose only symbolic size is its first, and whose strides do not depend on it: its
    padded layout is the true layout plus rows at the end."""
    if not isinstance(val, torch.Tensor) or val.ndim == 0 or plain_symbol(val.shape[0]) is None:
        return False
    return not (free_symbols(list(val.shape[1:])) or free_symbols(list(val.stride())) or
                free_symbols([val.storage_offset()]))


def _reject(node: torch.fx.Node) -> str | None:
    """Why `node`, which sees a symbolic size, cannot run padded (None: it can)."""
    target = node.target
    if target is operator.getitem or target in SIZE_ARITHMETIC:
        return None
    if target in MASKED:
        check = MASKED[target][1]
        return check(node) if check else None
    size_args = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)
                 and isinstance(_val(a), torch.SymInt)]
    if target in ELEMENTWISE:
        return f"{target} with a size as a value" if size_args else None
    if target in SIZED:
        return None
    if target in _VIEWS:
        src, out = _val(node.args[0]), _val(node)
        if _leading_only(src) and _leading_only(out) and plain_symbol(src.shape[0]) == plain_symbol(out.shape[0]):
            return None
        return f"{target} moving a symbolic size"
    return f"{target} on a symbolic size"


def unsupported(graph: torch.fx.Graph) -> str | None:
    """Why the graph cannot run as bounded programs (None: it can): a size no input gives directly
    (not_exact), or an op on a symbolic size without a rule above."""
    why = not_exact(graph)
    if why:
        return why
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        inputs = [_val(a) for a in node.all_input_nodes]
        if not (free_symbols(_val(node)) or any(free_symbols(v) for v in inputs)):
            continue
        why = _reject(node)
        if why:
            return why
    return None


def not_exact(graph: torch.fx.Graph) -> str | None:
    """Why the graph cannot compile one program per exact size (None: it can): every size must follow
    from the sizes its inputs have at the call (no data-dependent size, no size of its own)."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    known = set(Dims(placeholders, bounded=False).sources)
    for node in graph.nodes:
        if node.op in ("output", "get_attr"):
            continue
        missing = free_symbols(node.meta.get("val")) - known
        if missing:
            return f"{node.target} has size {sorted(map(str, missing))}, which no input's size gives"
    return None
