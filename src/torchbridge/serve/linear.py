"""The engine's linear layer: `x @ W.T + b`, from weights pre-packed for oneDNN on the CPU.

`F.linear` on the CPU lays the weight out for its GEMM kernel again at every call; at a decode step's
few rows that re-layout is a large part of the call. `pack(model)` lays every linear's weight out once,
at load (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's freezing pass uses for the same
reason), and the layer then multiplies through `torch.ops.mkldnn._linear_pointwise`. Measured on
the bench model's shapes (hidden 512, 1-1024 rows; docs/benchmarks/serve.md): bf16 1.4-1.8x faster up
to 128 rows and level above; fp32 1.2-2.0x from 8 to 128 rows, level above, but 0.8x for a single
row, where MKL's matrix-vector path wins, so fp32 keeps the plain weight for one-row calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose matmul uses `packed` (set by `pack`) when it has one."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (x.shape[0] > 1 or x.dtype != torch.float32) and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def packing_supported(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


@torch.no_grad()
def pack(model: nn.Module) -> int:
    """Pack the weights of every `Linear` in `model` (on the CPU, for dtypes oneDNN runs); returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.weight.device.type == "cpu" and packing_supported(m.weight.dtype):
            m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
            n += 1
    return n
