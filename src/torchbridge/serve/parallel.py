"""Tensor parallelism for the engine's models: Megatron's split, as vLLM shards the Llama family.

A model is split over the `size` ranks of a process group by attention heads and MLP width:
- column-parallel linears (q/k/v, gate/up): a rank holds the output rows of its heads / its slice of
  the MLP and computes them from the full input; no communication;
- row-parallel linears (o, down): a rank holds the input columns matching its slice and computes a
  partial sum of the full output; one all-reduce adds the ranks' partial sums;
- vocab-parallel embedding: a rank holds one contiguous block of the vocabulary (padded to a multiple
  of `size`); ids outside its block give zero rows, and an all-reduce adds the one rank's row;
- vocab-parallel LM head: a rank computes the logits of its block; an all-gather joins them.
Norms, rotary tables and routers are replicated. A decoder layer costs two all-reduces of
[tokens, hidden]; the KV cache of a rank holds only its key/value heads.

Collectives are PyTorch's functional collectives (the `_c10d_functional` ops): eager on any c10d
backend (gloo for `cpu`, torchbridge's for the bridge's device) and traced by Dynamo into compiled
graphs, where the bridge lowers them to XLA collectives inside the step's one program.

Each parallel module says how its checkpoint tensors split (`tp_dim`: the dimension cut into `size`
blocks, block `rank` kept); the loader (models/loader.py) asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchbridge.serve.config import ModelConfig
from torchbridge.serve.linear import Linear

FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group; `name` is the c10d group's name (None: 1 rank)."""

    rank: int = 0
    size: int = 1
    name: str | None = None


SINGLE = TPGroup()


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse a rank count the model cannot be split over (at start-up, before anything is spawned)."""
    if size < 1:
        raise ValueError(f"{FLAG} must be at least 1, got {size}")
    parts = {"attention heads": cfg.num_heads, "key/value heads": cfg.num_kv_heads}
    if cfg.intermediate_size and any(i not in cfg.moe_layers for i in range(cfg.num_layers)):
        parts["MLP intermediate size"] = cfg.intermediate_size
    if cfg.moe_layers:
        parts["expert intermediate size"] = cfg.moe_intermediate_size
    bad = [f"{n} {what}" for what, n in parts.items() if n % size]
    if bad:
        fits = [str(k) for k in range(1, cfg.num_heads + 1) if not any(n % k for n in parts.values())]
        raise ValueError(f"{FLAG} {size} must divide the model's {', '.join(bad)} (every rank holds an equal "
                         f"share); sizes that fit this model: {', '.join(fits)}")


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The sum of every rank's `x`."""
    if tp.size == 1:
        return x
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", tp.name))


def all_gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[n, m] per rank -> [n, size * m]: the ranks' blocks side by side, in rank order."""
    if tp.size == 1:
        return x
    c10d = torch.ops._c10d_functional
    stacked = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), tp.size, tp.name))  # [size * n, m]
    n, m = x.shape
    return stacked.view(tp.size, n, m).transpose(0, 1).reshape(n, tp.size * m)


def shard(tensor: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    """Block `rank` of `tensor` cut into `size` equal blocks along `dim`; a dimension that does not divide
    (a vocabulary) is padded with zeros at the end first."""
    if tp.size == 1:
        return tensor
    n = tensor.shape[dim]
    block = -(-n // tp.size)
    if block * tp.size != n:
        pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, block * tp.size - n]
        tensor = F.pad(tensor, pad)
    return tensor.narrow(dim, tp.rank * block, block)


class ColumnParallelLinear(Linear):
    """y[:, block rank] = x @ W[block rank].T: output features split, no communication."""

    tp_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features // tp.size, bias=bias)


class RowParallelLinear(Linear):
    """y = sum over ranks of x[:, block rank] @ W[:, block rank].T: input features split, one all-reduce.
    `reduce=False` leaves the partial sum (a caller that adds several, the experts of a layer, reduces once)."""

    tp_dim = 1

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, reduce: bool = True) -> None:
        super().__init__(in_features // tp.size, out_features, bias=False)
        self.tp, self.reduce = tp, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return all_reduce(y, self.tp) if self.reduce else y


class VocabParallelEmbedding(nn.Embedding):
    """Rows [rank * block, (rank + 1) * block) of the (padded) vocabulary; ids elsewhere add nothing."""

    tp_dim = 0

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup) -> None:
        super().__init__(-(-vocab_size // tp.size), dim)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        block = self.num_embeddings
        local = ids - self.tp.rank * block
        mine = (local >= 0) & (local < block)
        rows = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        # Ids of other blocks looked up row 0 of this one: zero them, so the sum holds the owner's row only.
        return all_reduce(rows.masked_fill(~mine[:, None], 0), self.tp)


class ParallelLMHead(Linear):
    """The logits of the rank's vocabulary block; `logits` joins every rank's and drops the padding."""

    tp_dim = 0

    def __init__(self, dim: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__(dim, -(-vocab_size // tp.size), bias=False)
        self.tp, self.vocab_size = tp, vocab_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last(self.matmul(hidden), self.tp)[:, : self.vocab_size]
