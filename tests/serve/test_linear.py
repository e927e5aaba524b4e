"""The engine's linear layer with oneDNN pre-packed weights (serve/linear.py) against F.linear in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchbridge.serve.linear import Linear, pack, packing_supported


class TwoLayers(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.up = Linear(32, 48, bias=True)
        self.head = Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as tie_word_embeddings does
        self.to(dtype)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_matches_float64_reference(dtype: torch.dtype, atol: float, rows: int) -> None:
    if not packing_supported(dtype):
        pytest.skip(f"oneDNN in this torch build does not run {dtype} linears on this CPU")
    torch.manual_seed(rows)
    model = TwoLayers(dtype)
    w, b = model.up.weight.detach().double().clone(), model.up.bias.detach().double().clone()
    tied = model.head.weight.detach().double().clone()
    assert pack(model) == 2
    x = torch.randn(rows, 32).to(dtype)
    torch.testing.assert_close(model.up(x).double(), x.double() @ w.T + b, atol=atol, rtol=atol)
    torch.testing.assert_close(model.head(x).double(), x.double() @ tied.T, atol=atol, rtol=atol)
    # [batch, seq, hidden] inputs too
    x3 = torch.randn(2, 3, 32).to(dtype)
    torch.testing.assert_close(model.up(x3).double(), x3.double() @ w.T + b, atol=atol, rtol=atol)
    # the tied weight is still the embedding's; bf16 drops the plain copy of the others, fp32 keeps it (one-row calls)
    assert model.head.weight.device.type == "cpu" and model.head.weight is model.embed.weight
    assert model.up.weight.device.type == ("cpu" if dtype == torch.float32 else "meta")
