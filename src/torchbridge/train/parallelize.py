"""Parallelisms, activation checkpointing and compilation, applied to an unmodified Hugging Face Llama.

In TorchTitan's order: tensor parallelism first (DTensor's column/row-parallel plan on the projections),
then activation checkpointing (each decoder layer recomputed in the backward), then torch.compile, then
FSDP2 (each decoder layer and the root sharded over the data-parallel mesh dimension). The device mesh
is ("dp_shard", "tp"); a degree of 1 leaves that parallelism out.

Tensor parallelism is Megatron's: q/k/v and gate/up are column-parallel (each rank computes its heads
and its slice of the MLP, as local tensors, so Hugging Face's `view(..., -1, head_dim)` sees the local
head count), o_proj and down_proj row-parallel (their partial sums all-reduced), the embedding
row-parallel over the vocabulary and the output projection column-parallel with replicated logits.
A tied output projection is the embedding's own (vocabulary-sharded) weight, so it is tied again after
both are distributed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchbridge.train.config import TrainConfig


def device_mesh(cfg: TrainConfig, device_type: str) -> Any:  # DeviceMesh
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (cfg.parallel.dp_shard, cfg.parallel.tp), mesh_dim_names=("dp_shard", "tp"))


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tied = model.config.tie_word_embeddings
    parallelize_module(model, tp_mesh, {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if tied:  # the same placement (vocabulary rows sharded): hand the distributed weight to the output
        model.lm_head.weight = model.model.embed_tokens.weight
    parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    if tied:  # ColwiseParallel wrapped it in a new Parameter: share one again
        model.lm_head.weight = model.model.embed_tokens.weight
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })


def apply_activation_checkpointing(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers
    for i, layer in enumerate(layers):
        # non-reentrant: works with compiled blocks and FSDP2; its state-dict hooks keep the names unchanged
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def compile_backend(device_type: str) -> str:
    """The bridge's backend on its device (registered under the device's name), inductor on the CPU."""
    return "inductor" if device_type == "cpu" else device_type


def apply_compile(model: nn.Module, device_type: str, per_block: bool) -> nn.Module:
    """Each decoder layer compiled (FSDP2's and TP's hooks between them, as TorchTitan does), or the whole
    model as one graph on one rank. Returns the module to call."""
    backend = compile_backend(device_type)
    if per_block:
        for layer in model.model.layers:
            layer.compile(backend=backend)
        return model
    return torch.compile(model, backend=backend)


def apply_fsdp(model: nn.Module, dp_mesh: Any, bf16: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    layers = model.model.layers
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by the backward: keep them gathered
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)


def parallelize(model: nn.Module, cfg: TrainConfig, device_type: str) -> tuple[nn.Module, Any]:
    """Apply [parallel] and [training] switches; returns (the module to call, the device mesh)."""
    mesh = device_mesh(cfg, device_type)
    if cfg.parallel.tp > 1:
        apply_tp(model, mesh["tp"])
    if cfg.training.activation_checkpointing:
        apply_activation_checkpointing(model)
    step_model = model
    if cfg.training.compile:
        step_model = apply_compile(model, device_type, per_block=cfg.parallel.dp_shard > 1 or cfg.parallel.tp > 1)
    if cfg.parallel.dp_shard > 1:
        apply_fsdp(model, mesh["dp_shard"], cfg.training.mixed_precision == "bfloat16")
    return step_model, mesh
