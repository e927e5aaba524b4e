"""16-bit linears of the engine on the bridge's device whose products run oneDNN's packed GEMM by a key
(serve/linear.py `hold`, serve/csrc/held_linear.cpp, the device's custom call): equal to the float64
product, eager and compiled; few rows stay in XLA; a key nobody holds is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchbridge  # noqa: F401 - the device
from torchbridge.serve import cpu_kernels
from torchbridge.serve.linear import HELD_MIN_ROWS, Linear, hold, packing_supported, transpose, widen

pytestmark = [
    pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="oneDNN has no bf16 GEMM on this CPU (no AVX512-BF16/AMX)"),
    pytest.mark.skipif(cpu_kernels.available() is not None, reason="the engine's CPU kernels do not build here"),
]


def _layers() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(64, 96, bias=True), Linear(96, 40)).to(torch.bfloat16)
    w, b = model[0].weight.detach().double().clone(), model[0].bias.detach().double().clone()
    return model.to("tpu"), w, b


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_held_linear_is_the_float64_product(compiled: bool) -> None:
    model, w, b = _layers()
    assert hold(model) == 2 and model[0].held is not None and model[0].held != model[1].held
    widen(model)
    transpose(model)
    fn = torch.compile(model[0], backend="tpu") if compiled else model[0]
    for shape in ((HELD_MIN_ROWS, 64), (2, 37, 64), (1, 64)):
        x = torch.randn(*shape).bfloat16()
        y = fn(x.to("tpu")).cpu()
        xd = x.double()
        ref, scale = xd @ w.T + b, xd.abs() @ w.abs().T + b.abs()
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        # float32 accumulation, then one rounding to bf16 (2^-8 relative), plus the accumulation's error
        # relative to sum |x||w| (a zero-bias or wrong-weight mutant is off by far more)
        assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + scale * 1e-5).all()


def test_held_weights_serve_many_rows_xla_few(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, _ = _layers()
    hold(model)
    widen(model)
    transpose(model)
    calls = []
    real = torch.ops.torchbridge.held_linear
    monkeypatch.setattr(torch.ops.torchbridge, "held_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    for rows in (1, HELD_MIN_ROWS - 1, HELD_MIN_ROWS, 100):
        model[0](torch.randn(rows, 64).bfloat16().to("tpu")).cpu()
    assert calls == [HELD_MIN_ROWS, 100]


def test_a_key_nobody_holds_is_refused_by_name() -> None:
    from torchbridge.kernels.held_linear import held_linear

    with pytest.raises(Exception, match="no weight is held under key 12345"):
        held_linear(torch.randn(8, 64).bfloat16().to("tpu"), 12345, 96).cpu()


def test_the_same_weight_gets_the_same_key_another_gets_another() -> None:
    w = torch.randn(96, 64).bfloat16()
    assert cpu_kernels.weight_key(w) == cpu_kernels.weight_key(w.clone())
    assert cpu_kernels.weight_key(w) != cpu_kernels.weight_key(w + 1)
    assert cpu_kernels.weight_key(w) != cpu_kernels.weight_key(w.reshape(64, 96))
