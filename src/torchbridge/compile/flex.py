"""FlexAttention's higher-order ops in compiled graphs.

AOTAutograd leaves `torch.ops.higher_order.flex_attention` (forward) and `flex_attention_backward`
in the graphs it hands the backend, with the user's score_mod and the block mask's mask_mod as FX
subgraphs over scalars (get_attr nodes). Each subgraph becomes a JAX function of scalars, interpreted
through the same lowering table as every other node; device/lowerings/flex_attention.py vectorises it
and computes the attention.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import torch
from torch.fx.node import map_arg

from torchbridge.device import dtypes
from torchbridge.device.lowerings import flex_attention, registry

HOPS = (torch.ops.higher_order.flex_attention, torch.ops.higher_order.flex_attention_backward)


def is_subgraph(value: Any) -> bool:
    return isinstance(value, torch.fx.GraphModule)


def scalar_function(gm: torch.fx.GraphModule, trace: Callable) -> Callable:
    """The subgraph as a JAX function of its placeholders (scalars and captured buffers).

    `trace(node, fn, args, kwargs)` runs one lowering with the node's output shapes in context (the
    backend's `_traced`); under vmap those are the scalar shapes the subgraph was traced with."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    constants = {n.target: _get(gm, n.target) for n in nodes if n.op == "get_attr"}

    def fn(*args: Any) -> Any:
        env: dict[torch.fx.Node, Any] = dict(zip(placeholders, args, strict=True))
        for node in nodes:
            if node.op == "get_attr":
                value = constants[node.target]
                env[node] = jnp.asarray(dtypes.host_to_numpy(value)) if isinstance(value, torch.Tensor) else value
            elif node.op == "call_function":
                a = map_arg(node.args, lambda n: env[n])
                kw = map_arg(node.kwargs, lambda n: env[n])
                if node.target is operator.getitem:
                    env[node] = a[0][a[1]]
                    continue
                lowering = registry.find(node.target) if isinstance(node.target, torch._ops.OpOverload) else None
                if lowering is None:
                    raise NotImplementedError(f"torchbridge.compile: '{node.target}' in a FlexAttention "
                                              f"score/mask function has no lowering")
                env[node] = _cast(trace(node, lowering.fn, a, kw), node.meta.get("val"))
            elif node.op == "output":
                out = node.args[0]
                out = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
                return map_arg(out, lambda n: env[n])
        raise AssertionError("subgraph without output")

    return fn


def _cast(res: Any, val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return jnp.asarray(res).astype(dtypes.to_jax(val.dtype))
    return res


def _get(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _index_dtype(gm: torch.fx.GraphModule) -> Any:
    """The dtype the subgraph was traced with for its b/h/m/n indices (int32 in PyTorch's tracing)."""
    for n in gm.graph.nodes:
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and not n.meta["val"].is_floating_point():
            return dtypes.to_jax(n.meta["val"].dtype)
    return jnp.int32


def run(node: torch.fx.Node, args: tuple, trace: Callable) -> Any:
    """One flex_attention / flex_attention_backward node, its arguments already JAX values."""
    if node.target is torch.ops.higher_order.flex_attention:
        q, k, v, score_gm, block_mask, scale, _kernel_options, *rest = args
        score_buffers, mask_buffers = (tuple(rest[0]) if rest else ()), (tuple(rest[1]) if len(rest) > 1 else ())
        mask_gm = block_mask[-1]
        return flex_attention.forward(q, k, v, scalar_function(score_gm, trace), scalar_function(mask_gm, trace),
                                      scale, score_buffers, mask_buffers, _index_dtype(mask_gm))
    q, k, v, _out, _lse, grad_out, grad_lse, fw_gm, _joint, block_mask, scale, _kernel_options, *rest = args
    score_buffers, mask_buffers = (tuple(rest[0]) if rest else ()), (tuple(rest[1]) if len(rest) > 1 else ())
    mask_gm = block_mask[-1]
    dq, dk, dv, grads = flex_attention.backward(q, k, v, grad_out, grad_lse, scalar_function(fw_gm, trace),
                                                scalar_function(mask_gm, trace), scale, score_buffers,
                                                mask_buffers, _index_dtype(mask_gm))
    wanted = node.meta.get("val")
    if isinstance(wanted, (tuple, list)) and len(wanted) == 4:  # buffers that need no gradient get None
        grads = tuple(g if w is not None else None for g, w in zip(grads, wanted[3], strict=False))
    return dq, dk, dv, grads
