"""`run_and_save_rng_state` / `run_with_rng_state` in compiled graphs: random ops recomputed by activation
checkpointing.

Under torch.compile, AOTAutograd's partitioner wraps each op tagged `nondeterministic_seeded` inside a
checkpointed region (dropout; the fused SDPA ops, whose dropout_p may be 0) in these two higher-order
ops: the forward runs the op and returns the RNG state it started from, the backward's recomputation
runs it again from that state, so both draw the same mask. The partitioner records the state as a CPU
generator's (uint8[5056]); the backend lowers both ops itself (backend.GraphProgram._run_node): the
forward packs the random node's (seed, offset) into the state's first 16 bytes (the device's own state
layout, torch.tpu.get_rng_state), the recomputation unpacks them. PyTorch's eager implementations of
the two ops know cpu, cuda, hpu and xpu only, so a graph run op by op (backend="aot_eager") with
them on the device still fails in torch ("Backend not supported for tpu").
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import torch

RUN_AND_SAVE = torch.ops.higher_order.run_and_save_rng_state
RUN_WITH = torch.ops.higher_order.run_with_rng_state
STATE_BYTES = 16


def pack(key: Any, node: torch.fx.Node) -> Any:
    """A random node's (seed, offset) as the state its recomputation gets back: the first 16 bytes of a
    uint8 array of the state's recorded size (the partitioner records a CPU generator's state)."""
    size = next((int(u.meta["val"].numel()) for u in node.users
                 if u.target is operator.getitem and u.args[1] == 0 and "val" in u.meta), STATE_BYTES)
    if key is None:  # the wrapped op draws nothing (SDPA without dropout)
        return jnp.zeros((size,), jnp.uint8)
    words = jnp.stack([jnp.asarray(key[0], jnp.uint64), jnp.asarray(key[1], jnp.uint64)])
    packed = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(STATE_BYTES)
    return jnp.concatenate([packed, jnp.zeros((size - STATE_BYTES,), jnp.uint8)])


def unpack(state: Any) -> tuple[Any, Any]:
    words = jax.lax.bitcast_convert_type(state[:STATE_BYTES].reshape(2, 8), jnp.uint64)
    return words[0], words[1]


def result_meta(node: torch.fx.Node, first_arg: int) -> Any:
    """The wrapped op's result as meta tensors (the partitioner leaves these nodes without a "val"):
    its meta kernel run on the arguments' recorded shapes."""
    from torch.fx.node import map_aggregate

    def meta(v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            v = v.meta.get("val")
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return v

    op = node.args[first_arg - 1]
    with torch.no_grad():
        return op(*map_aggregate(node.args[first_arg:], meta), **map_aggregate(node.kwargs, meta))
