"""Linears of the engine on the bridge's device whose products run a weight the engine's kernel library holds,
by a key (serve/linear.py `hold`, serve/csrc/held_linear.cpp, the device's custom call): 16-bit ones through
oneDNN's packed GEMM, and with the panel kernel (AVX2/FMA or AVX-512) every float32 one, and each 16-bit one
oneDNN does not multiply on the CPU, through the library's panel kernel.
Equal to the float64 product, eager and compiled; few rows stay in XLA where the rule says so; a key nobody
holds is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchbridge  # noqa: F401 - the device
from torchbridge.serve import cpu_kernels
from torchbridge.serve.linear import (
    HELD_MIN_ROWS,
    HELD_PANEL_MAX_ROWS,
    TILE_MAX_ROWS,
    Linear,
    hold,
    packing_supported,
    transpose,
    widen,
)

pytestmark = pytest.mark.skipif(cpu_kernels.available() is not None, reason="the engine's CPU kernels do not build here")
packed_only = pytest.mark.skipif(not packing_supported(torch.bfloat16),
                                 reason="oneDNN has no bf16 GEMM on this CPU (no AVX512-BF16/AMX)")
panels_only = pytest.mark.skipif(cpu_kernels.available() is not None or not cpu_kernels.panel_linear_available(),
                                 reason="the panel kernel is built only for CPUs with AVX2/FMA or AVX-512")


def _layers(dtype: torch.dtype = torch.bfloat16, k: int = 64) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(k, 96, bias=True), Linear(96, 40)).to(dtype)
    w, b = model[0].weight.detach().double().clone(), model[0].bias.detach().double().clone()
    return model.to("tpu"), w, b


@packed_only
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


@panels_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_panel_held_linear_is_the_float64_product(compiled: bool, dtype: torch.dtype) -> None:
    """Every float32 layer, and each 16-bit one oneDNN does not multiply here, held as panels; 70 inputs and 96
    outputs (a partial last panel needs none: 96 = 6 x 16, the second layer's 40 does) through the float32
    kernel, rounded once to x's dtype."""
    if dtype != torch.float32 and packing_supported(dtype):
        pytest.skip(f"oneDNN multiplies {dtype} here: hold(panels=True) holds such layers packed (the test above)")
    model, w, b = _layers(dtype, k=70)
    assert hold(model, panels=True) == 2 and model[0].held != model[1].held
    assert model[0].held_rows == (1, HELD_PANEL_MAX_ROWS)
    widen(model)
    transpose(model)
    first = torch.compile(model[0], backend="tpu") if compiled else model[0]
    w1 = model[1].wt.detach().cpu().double()  # [in, out], the widened copy of a 16-bit weight is exact
    b1 = model[1].bias.detach().cpu().double()
    rounding = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    for shape in ((1, 70), (HELD_PANEL_MAX_ROWS, 70), (2, 3, 70)):
        x = torch.randn(*shape).to(dtype)
        y = first(x.to("tpu"))
        z = model[1](y).cpu().double()
        y = y.cpu()
        for out, inp, wd, bd in ((y.double(), x.double(), w.T, b), (z, y.double(), w1, b1)):
            ref, scale = inp @ wd + bd, inp.abs() @ wd.abs() + bd.abs()
            assert out.shape == ref.shape
            # float32 accumulation (error within ~1e-6 of sum |x||w|), then one rounding to x's dtype
            assert ((out - ref).abs() <= ref.abs() * rounding + scale * 1e-5).all()
        assert y.dtype == dtype


@panels_only
def test_panel_held_weights_serve_decode_rows_xla_more(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, _ = _layers(torch.float32)
    hold(model, panels=True)
    transpose(model)
    calls = []
    real = torch.ops.torchbridge.held_linear
    monkeypatch.setattr(torch.ops.torchbridge, "held_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    for rows in (1, 3, HELD_PANEL_MAX_ROWS, HELD_PANEL_MAX_ROWS + 1, 100):
        model[0](torch.randn(rows, 64).to("tpu")).cpu()
    assert calls == [1, 3, HELD_PANEL_MAX_ROWS]


@packed_only
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


tiled_only = pytest.mark.skipif(cpu_kernels.tile_kernel() is None,  # (None too where the kernels do not build)
                                reason="no bf16 tile kernel here (it needs AMX or AVX512-BF16 and the CPU kernels built)")


@tiled_only
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tiled_held_linear_is_the_float64_product_at_every_row_count(compiled: bool) -> None:
    """With the tile kernel, a held bf16 layer whose sides are multiples of 32 (64 -> 96) serves every call: up to
    the kernel's row limit through the tile layout, above it through oneDNN; one that is not (96 -> 40) keeps XLA
    below HELD_MIN_ROWS."""
    kernel = cpu_kernels.tile_kernel()
    model, w, b = _layers()
    assert hold(model, tiles=kernel) == 2
    assert model[0].held_rows == (1, 1 << 62) and model[1].held_rows == (HELD_MIN_ROWS, 1 << 62)
    widen(model)
    transpose(model)
    fn = torch.compile(model[0], backend="tpu") if compiled else model[0]
    for rows in (1, 2, TILE_MAX_ROWS[kernel], TILE_MAX_ROWS[kernel] + 1, 37):
        x = torch.randn(rows, 64).bfloat16()
        y = fn(x.to("tpu")).cpu()
        xd = x.double()
        ref, scale = xd @ w.T + b, xd.abs() @ w.abs().T + b.abs()
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + scale * 1e-5).all(), rows


@tiled_only
def test_tiled_held_weights_run_the_tile_kernel_up_to_its_limit() -> None:
    """Routing, seen through the results: a key holding W packed and another weight W2 as tiles gives x @ W2.T up
    to the tile kernel's row limit and x @ W.T above it (a library that never took the tiles, or took them at
    every row count, fails)."""
    from torchbridge.serve.linear import amx_layout

    kernel = cpu_kernels.tile_kernel()
    limit = TILE_MAX_ROWS[kernel]
    torch.manual_seed(1)
    w, w2 = torch.randn(96, 64).bfloat16(), torch.randn(96, 64).bfloat16()
    key = 4242
    torch.ops.torchbridge_serve.hold_packed_weight(key, torch.ops.mkldnn._reorder_linear_weight(w, None), None, 64, 96)
    torch.ops.torchbridge_serve.hold_tiles(key, amx_layout(w2), kernel, limit)
    for rows in (1, limit, limit + 1, 40):
        x = torch.randn(rows, 64).bfloat16()
        y = cpu_kernels.held_linear(x, key, 96).double()
        expect = x.double() @ (w2 if rows <= limit else w).double().T
        assert ((y - expect).abs() <= expect.abs() * 2**-8 + 1e-3).all(), rows


def test_hold_tiles_refuses_a_weight_it_does_not_fit_by_name() -> None:
    if cpu_kernels.available() is not None:
        pytest.skip("the engine's CPU kernels do not build here")
    if not packing_supported(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 GEMM on this CPU (no AVX512-BF16/AMX)")
    key = cpu_kernels.hold_packed_weight(torch.randn(96, 64).bfloat16())
    with pytest.raises(Exception, match=r"hold_tiles: tiles must be contiguous bfloat16 \[3, 2, 2, 16, 32\]"):
        torch.ops.torchbridge_serve.hold_tiles(key, torch.zeros(2, 2, 2, 16, 32, dtype=torch.bfloat16), "amx", 8)
    with pytest.raises(Exception, match="hold_tiles: no packed weight is held under key 777"):
        torch.ops.torchbridge_serve.hold_tiles(777, torch.zeros(3, 2, 2, 16, 32, dtype=torch.bfloat16), "amx", 8)
    with pytest.raises(Exception, match="hold_tiles: kernel must be"):
        torch.ops.torchbridge_serve.hold_tiles(key, torch.zeros(3, 2, 2, 16, 32, dtype=torch.bfloat16), "vnni", 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_key_nobody_holds_is_refused_by_name(dtype: torch.dtype) -> None:
    from torchbridge.kernels.held_linear import held_linear

    with pytest.raises(Exception, match="no weight is held under key 12345"):
        held_linear(torch.randn(8, 64).to(dtype).to("tpu"), 12345, 96).cpu()


@panels_only
def test_panel_held_linear_refuses_the_wrong_width_by_name() -> None:
    from torchbridge.kernels.held_linear import held_linear

    key = cpu_kernels.hold_panel_weight(torch.randn(96, 64))
    with pytest.raises(Exception, match=r"held_linear: x must be \[rows, 64\]"):
        held_linear(torch.randn(8, 65).to("tpu"), key, 96).cpu()


def test_the_same_weight_gets_the_same_key_another_gets_another() -> None:
    w = torch.randn(96, 64).bfloat16()
    assert cpu_kernels.weight_key(w) == cpu_kernels.weight_key(w.clone())
    assert cpu_kernels.weight_key(w) != cpu_kernels.weight_key(w + 1)
    assert cpu_kernels.weight_key(w) != cpu_kernels.weight_key(w.reshape(64, 96))
    assert cpu_kernels.weight_key(w) != cpu_kernels.weight_key(w, form="panels")
