"""Graph patterns the compile backend lowers as one function instead of op by op.

A pattern is found in the FX graph once, when a `GraphProgram` is built: its root node is then
lowered by the pattern's function from the inputs of the whole pattern, and the nodes it absorbs
are never computed. Each pattern is exact (same values as the ops it replaces, up to floating-point
reassociation) and only matches when the absorbed nodes have no other users.
"""

from __future__ import annotations

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
