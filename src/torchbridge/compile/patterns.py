"""Graph patterns the compile backend lowers as one function instead of op by op.

A pattern is found in the FX graph once, when a `GraphProgram` is built: its root node is then
lowered by the pattern's function from the inputs of the whole pattern, and the nodes it absorbs
are never computed. Each pattern is exact (same values as the ops it replaces, up to floating-point
reassociation) and only matches when the absorbed nodes have no other users.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from torchbridge.device.lowerings import nn

aten = torch.ops.aten


@dataclass(frozen=True)
class Match:
    inputs: tuple[Any, ...]   # FX nodes or constants: the arguments of `fn`
    absorbed: tuple[torch.fx.Node, ...]
    fn: Any


def _cross_entropy_backward(node: torch.fx.Node) -> Match | None:
    """log_softmax backward of an NLL gradient: cross-entropy's logits gradient (nn.nll_log_softmax_backward)."""
    if node.target is not aten._log_softmax_backward_data.default:
        return None
    grad, output, dim = node.args[0], node.args[1], node.args[2]
    if not (isinstance(grad, torch.fx.Node) and grad.op == "call_function"
            and grad.target is aten.nll_loss_backward.default and len(grad.users) == 1):
        return None
    val = output.meta.get("val") if isinstance(output, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.ndim != 2 or dim not in (1, -1):
        return None
    g, _, target, weight, reduction, ignore_index, total_weight = grad.args
    return Match((g, output, target, weight, reduction, ignore_index, total_weight), (grad,),
                 nn.nll_log_softmax_backward)


_PATTERNS = (_cross_entropy_backward,)


def find(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, Match]:
    """Pattern root -> match, for every pattern in the graph."""
    found = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        for pattern in _PATTERNS:
            m = pattern(n)
            if m is not None:
                found[n] = m
                break
    return found


# ---- an optimizer step's writes, lowered together --------------------------------------------------

@dataclass(frozen=True)
class AdamWrite:
    """One parameter's Adam/AdamW update in a compiled foreach optimizer step (torch.optim.Adam/AdamW,
    foreach, no amsgrad), found from the three values the graph writes back:

        p1 = p * decay                       (_foreach_mul: AdamW's weight decay; absent when 0)
        m' = lerp(m, g, w1)                  (_foreach_lerp, or its decomposition m + full_like(g - m, w1) * (g - m))
        v' = v * beta2 + w2 * g * g          (_foreach_mul, _foreach_addcmul)
        d  = sqrt(v') / bc2_sqrt + eps       (_foreach_sqrt, _foreach_div, _foreach_add)
        (g = -g for maximize, then g + wd p for Adam's weight decay: _foreach_neg, _foreach_add)
        p' = p1 + value * m' / d             (_foreach_addcdiv, value = -lr / bc1), or, as the
             p1 + m' / (d / value)            capturable step Dynamo compiles writes it

    The backend computes (p', m', v') with host_calls.adam_update (one pass over the arrays) instead of
    the element values of those foreach ops (which XLA then drops as unused)."""

    param: int      # input positions written: the parameter, exp_avg, exp_avg_sq
    exp_avg: int
    exp_avg_sq: int
    nodes: dict[str, Any]   # p, g, m, v: FX nodes (the inputs' values)
    scalars: dict[str, Any]  # decay, w1, beta2, w2, eps, l2, gscale: numbers; bc2_sqrt, step_value: (node or
    #                          number, element)


def _element(x: Any) -> tuple[Any, int] | None:
    """(foreach node, i) when `x` is getitem(foreach node, i)."""
    if isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target is operator.getitem:
        src, i = x.args
        if isinstance(src, torch.fx.Node) and src.op == "call_function" and isinstance(i, int):
            return src, i
    return None


def _of(x: Any, *targets: Any) -> tuple[list, tuple, int] | None:
    """(the foreach node's list arguments' element i, its other arguments, i) when `x` is element i of
    a call to one of `targets`."""
    e = _element(x)
    if e is None or e[0].target not in targets:
        return None
    node, i = e
    elems = [a[i] if isinstance(a, (list, tuple)) else None for a in node.args]
    return elems, tuple(node.args) + tuple(node.kwargs.values()), i


def _value(args: tuple, k: int, default: Any) -> Any:
    return args[k] if len(args) > k else default


def _per_element(x: Any, i: int) -> tuple[Any, int | None] | None:
    """A per-parameter scalar argument: a number, element i of a list (a number or a one-element
    tensor node), or element i of a 1-d tensor node: (value or node, index into it or None)."""
    if isinstance(x, (int, float)):
        return x, None
    if isinstance(x, (list, tuple)):
        v = x[i]
        if isinstance(v, (int, float)):
            return v, None
        if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor) and v.meta["val"].numel() == 1:
            return v, None
        return None
    if isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) and x.meta["val"].ndim == 1:
        return x, i
    return None


def _first_moment(m1: Any) -> tuple[Any, Any, Any] | None:
    """(m, g, w1) when m1 = lerp(m, g, w1), as the op or as its decomposition."""
    lerp = _of(m1, aten._foreach_lerp.Scalar)
    if lerp:
        return lerp[0][0], lerp[0][1], lerp[1][2]
    acm = _of(m1, aten._foreach_addcmul.Scalar)
    if not acm or _value(acm[1], 3, 1) != 1:
        return None
    full, diff = acm[0][1], acm[0][2]
    sub = _of(diff, aten._foreach_sub.List)
    if not (sub and isinstance(full, torch.fx.Node) and full.target is aten.full_like.default
            and full.args[0] is diff and sub[0][1] is acm[0][0]):
        return None
    return sub[0][1], sub[0][0], full.args[1]


def find_adam_writes(placeholders: list[torch.fx.Node], written: dict[int, torch.fx.Node]) -> list[AdamWrite]:
    """The Adam/AdamW parameter updates among a graph's writes (see AdamWrite); others are left alone."""
    index = {n: k for k, n in enumerate(placeholders)}
    out = []
    for k, value in written.items():
        addcdiv = _of(value, aten._foreach_addcdiv.Tensor, aten._foreach_addcdiv.ScalarList,
                      aten._foreach_addcdiv.Scalar)
        if addcdiv is None:
            continue
        (p1, m1, den, *_), args, i = addcdiv
        if isinstance(args[3] if len(args) > 3 else 1, (int, float)) and _value(args, 3, 1) == 1:
            by = _of(den, aten._foreach_div.List)  # the capturable form: d / value
            step_value = _per_element(by[1][1], by[2]) if by else None
            den = by[0][0] if by else None
        else:
            step_value = _per_element(args[3], i)
        eps_add = _of(den, aten._foreach_add.Scalar)
        div = _of(eps_add[0][0], aten._foreach_div.List, aten._foreach_div.ScalarList,
                  aten._foreach_div.Tensor) if eps_add else None
        sqrt = _of(div[0][0], aten._foreach_sqrt.default) if div else None
        v2 = sqrt[0][0] if sqrt else None
        addcmul = _of(v2, aten._foreach_addcmul.Scalar)
        mulv = _of(addcmul[0][0], aten._foreach_mul.Scalar) if addcmul else None
        first = _first_moment(m1)
        if not (step_value and eps_add and div and addcmul and mulv and first):
            continue
        bc2 = _per_element(div[1][1], div[2])
        m, g, w1 = first
        if bc2 is None or addcmul[0][1] is not g or addcmul[0][2] is not g:
            continue
        mulp = _of(p1, aten._foreach_mul.Scalar)
        p, decay = (mulp[0][0], mulp[1][1]) if mulp else (p1, 1.0)
        l2, gscale = 0.0, 1.0
        wd = _of(g, aten._foreach_add.List)  # Adam's L2 decay: g + wd p, read in the same pass
        if wd and wd[0][1] is p and isinstance(wd[1][2] if len(wd[1]) > 2 else 1, (int, float)):
            g, l2 = wd[0][0], _value(wd[1], 2, 1)
        neg = _of(g, aten._foreach_neg.default)  # maximize
        if neg:
            g, gscale = neg[0][0], -1.0
        v = mulv[0][0]
        slots = (index.get(p), index.get(m), index.get(v))
        if k != slots[0] or None in slots or written.get(slots[1]) is not m1 or written.get(slots[2]) is not v2:
            continue
        scalars = {"decay": decay, "w1": w1, "beta2": mulv[1][1], "w2": _value(addcmul[1], 3, 1),
                   "eps": eps_add[1][1], "bc2_sqrt": bc2, "step_value": step_value, "l2": l2, "gscale": gscale}
        if not all(isinstance(scalars[s], (int, float)) for s in ("decay", "w1", "beta2", "w2", "eps", "l2")):
            continue
        out.append(AdamWrite(k, slots[1], slots[2], {"p": p, "g": g, "m": m, "v": v}, scalars))
    return out


@dataclass(frozen=True)
class AdagradWrite:
    """One parameter's Adagrad update in a compiled foreach optimizer step (torch.optim.Adagrad, foreach),
    found from the two values the graph writes back:

        (g = -g for maximize, then g + wd p for weight decay: _foreach_neg, _foreach_add)
        s' = s + g * g                       (_foreach_addcmul)
        d  = sqrt(s') + eps                  (_foreach_sqrt, _foreach_add)
        p' = p + (g * clr) / d               (_foreach_mul, _foreach_addcdiv; clr = -lr / (1 + (step - 1) lr_decay))

    The backend computes (p', s') with host_calls.adagrad_update (one pass) instead of the foreach ops'
    element values."""

    param: int      # input positions written: the parameter, its state sum
    state_sum: int
    nodes: dict[str, Any]   # p, g, s: FX nodes
    scalars: dict[str, Any]  # eps, l2, gscale: numbers; clr: (node or number, element)


def _scalar_factor(x: Any, i: int) -> tuple[Any, int | None] | None:
    """Element i's factor of a _foreach_mul: as _per_element, plus one 0-d/1-element tensor for all."""
    if isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) and x.meta["val"].numel() == 1:
        return x, None
    return _per_element(x, i)


def find_adagrad_writes(placeholders: list[torch.fx.Node], written: dict[int, torch.fx.Node]) -> list[AdagradWrite]:
    """The Adagrad parameter updates among a graph's writes (see AdagradWrite); others are left alone."""
    index = {n: k for k, n in enumerate(placeholders)}
    out = []
    for k, value in written.items():
        addcdiv = _of(value, aten._foreach_addcdiv.Scalar)
        if addcdiv is None or _value(addcdiv[1], 3, 1) != 1:
            continue
        (p, num, den, *_), _, _ = addcdiv
        mul = _of(num, aten._foreach_mul.List, aten._foreach_mul.Scalar, aten._foreach_mul.ScalarList,
                  aten._foreach_mul.Tensor)
        eps_add = _of(den, aten._foreach_add.Scalar)
        sqrt = _of(eps_add[0][0], aten._foreach_sqrt.default) if eps_add else None
        addcmul = _of(sqrt[0][0], aten._foreach_addcmul.Scalar) if sqrt else None
        if not (mul and eps_add and sqrt and addcmul) or _value(addcmul[1], 3, 1) != 1:
            continue
        g = mul[0][0]
        clr = _scalar_factor(mul[1][1], mul[2])
        s_old, g1, g2 = addcmul[0][:3]
        if clr is None or g1 is not g or g2 is not g:
            continue
        l2, gscale = 0.0, 1.0
        wd = _of(g, aten._foreach_add.List)  # weight decay: g + wd p
        if wd and wd[0][1] is p and isinstance(_value(wd[1], 2, 1), (int, float)):
            g, l2 = wd[0][0], _value(wd[1], 2, 1)
        neg = _of(g, aten._foreach_neg.default)  # maximize
        if neg:
            g, gscale = neg[0][0], -1.0
        slots = (index.get(p), index.get(s_old))
        if k != slots[0] or slots[1] is None or written.get(slots[1]) is not sqrt[0][0]:
            continue
        if not isinstance(eps_add[1][1], (int, float)):
            continue
        out.append(AdagradWrite(k, slots[1], {"p": p, "g": g, "s": s_old},
                                {"eps": eps_add[1][1], "l2": l2, "gscale": gscale, "clr": clr}))
    return out
