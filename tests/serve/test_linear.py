"""The engine's linear layer with oneDNN pre-packed weights (serve/linear.py) against F.linear in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchbridge.serve.linear import Linear, pack, packing_supported, transpose, widen


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
    # the tied weight is still the embedding's; the plain copy of the others is dropped (every call is packed)
    assert model.head.weight.device.type == "cpu" and model.head.weight is model.embed.weight
    assert model.up.weight.device.type == "meta"
    # zero rows (a step with nothing for this layer): an empty result of the right shape
    assert model.up(torch.randn(0, 32).to(dtype)).shape == (0, 48)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7])
def test_widened_linear_is_the_16bit_product_rounded_once(dtype: torch.dtype, rows: int) -> None:
    """`widen` (the bridge's device over JAX's CPU platform): the weight kept as float32, the product computed
    in float32 and rounded once to the input's dtype: within half a unit in the last place of the float64
    product (plus float32 accumulation error), in the input's dtype; the 16-bit weight released unless tied."""
    torch.manual_seed(rows)
    model = TwoLayers(dtype)
    w, b = model.up.weight.detach().double().clone(), model.up.bias.detach().double().clone()
    tied = model.head.weight.detach().double().clone()
    assert widen(model) == 2
    x = torch.randn(2, rows, 32).to(dtype)
    eps = torch.finfo(dtype).eps
    for y, ref in ((model.up(x), x.double() @ w.T + b), (model.head(x), x.double() @ tied.T)):
        assert y.dtype == dtype and y.shape == ref.shape
        assert ((y.double() - ref).abs() <= ref.abs() * eps / 2 + 1e-5).all()
    assert model.up.wide.dtype == torch.float32 and model.up.weight.device.type == "meta"
    assert model.head.weight is model.embed.weight and model.head.weight.device.type == "cpu"
    # float32 layers are left alone
    assert widen(TwoLayers(torch.float32)) == 0


@pytest.mark.parametrize("dtype,wide", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("rows", [1, 6])
def test_transposed_linear_matches_float64_reference(dtype: torch.dtype, wide: bool, rows: int) -> None:
    """`transpose` (the bridge's device over JAX's CPU platform): the weight held as [in, out] gives x @ W.T + b
    (float64 reference), for 2-d and 3-d inputs and zero rows; 16-bit layers widened to float32 when asked
    (the product then rounded once, as `widen`), kept 16-bit otherwise; the tied head keeps the embedding's
    table as well."""
    torch.manual_seed(rows)
    model = TwoLayers(dtype)
    w, b = model.up.weight.detach().double().clone(), model.up.bias.detach().double().clone()
    tied = model.head.weight.detach().double().clone()
    if wide:
        assert widen(model) == (0 if dtype == torch.float32 else 2)  # float32 layers are left alone
    assert transpose(model) == 2
    assert model.up.wide is None  # the widened copy is the transposed one now, not kept twice
    wdt = torch.float32 if wide else dtype
    assert model.up.wt.shape == (32, 48) and model.up.wt.dtype == wdt and model.up.wt.is_contiguous()
    assert model.head.wt.shape == (32, 50) and model.up.weight.device.type == "meta"
    assert model.head.weight is model.embed.weight and model.head.weight.device.type == "cpu"
    # Error bounds relative to sum |x| |w| (cancellation makes |ref| alone too tight for 16-bit sums):
    # one rounding of the result when widened, a 16-bit dot's own accumulation otherwise.
    tol = 1e-6 if dtype == torch.float32 else (torch.finfo(dtype).eps if wide else 32 * torch.finfo(dtype).eps)
    for x in (torch.randn(rows, 32).to(dtype), torch.randn(2, rows, 32).to(dtype)):
        xd = x.double()
        for y, ref, scale in ((model.up(x), xd @ w.T + b, xd.abs() @ w.abs().T + b.abs()),
                              (model.head(x), xd @ tied.T, xd.abs() @ tied.abs().T)):
            assert y.dtype == dtype and y.shape == ref.shape
            assert ((y.double() - ref).abs() <= scale * tol).all(), ((y.double() - ref).abs() / scale).max()
    assert model.up(torch.randn(0, 32).to(dtype)).shape == (0, 48)


def test_pack_widens_16bit_layers_where_onednn_has_no_16bit_gemm() -> None:
    if packing_supported(torch.bfloat16):
        pytest.skip("oneDNN runs bf16 linears on this CPU: pack packs them (test_packed_matches_float64_reference)")
    model = TwoLayers(torch.bfloat16)
    assert pack(model) == 2
    assert model.up.wide is not None and model.up.packed is None and model.up.weight.device.type == "meta"


# ---- bf16 decode rows from the tile layout: Intel AMX (serve/csrc/amx_linear.cpp) and AVX512-BF16 -------
# (serve/csrc/avx512bf16_linear.cpp). On an AMX host both kernels run and both are tested.

TILE_KERNELS = ["amx", "avx512bf16"]


def _kernel_or_skip(kind: str):  # noqa: ANN202
    from torchbridge.serve import cpu_kernels

    if cpu_kernels.available() is not None:
        pytest.skip(f"the engine's CPU kernels do not build here: {cpu_kernels.available()}")
    if kind == "amx" and not cpu_kernels.amx_available():
        pytest.skip("this CPU has no AMX-BF16 (or Linux did not grant the tile state): the kernel cannot run")
    if kind == "avx512bf16" and not torch.ops.torchbridge_serve.avx512bf16_available():
        pytest.skip("this CPU has no AVX512-BF16: the kernel cannot run")
    return cpu_kernels.amx_linear if kind == "amx" else cpu_kernels.avx512bf16_linear


def _tile_kernel_or_skip() -> str:
    from torchbridge.serve import cpu_kernels

    if cpu_kernels.available() is not None:
        pytest.skip(f"the engine's CPU kernels do not build here: {cpu_kernels.available()}")
    kind = cpu_kernels.tile_kernel()
    if kind is None:
        pytest.skip("this CPU has neither AMX-BF16 nor AVX512-BF16: no tile kernel runs")
    return kind


@pytest.mark.parametrize("kind", TILE_KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 32])
@pytest.mark.parametrize("n,k,bias", [(96, 64, True), (64, 160, False), (160, 64, True), (512, 1408, True)])
def test_tile_kernel_is_the_float64_product_rounded_once(kind: str, rows: int, n: int, k: int, bias: bool) -> None:
    """fp32 accumulation then one rounding to bf16: within bf16's unit roundoff (2^-8 relative) of the exact
    product, plus fp32 accumulation error; a wrong tile layout or row mapping is off by O(1). Output counts
    cover one, two (96: three panels of 32), four and five panels (the AVX512-BF16 kernel's 4-panel groups
    and its single-panel tail)."""
    kernel = _kernel_or_skip(kind)
    from torchbridge.serve.linear import amx_layout

    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    got = kernel(x, amx_layout(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), exact, rtol=2**-8 + 1e-5, atol=1e-5)


def test_tiled_layer_routes_decode_rows_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """pack(tiles=this CPU's kernel): layers whose sizes are multiples of 32 get tiles and send up to that
    kernel's TILE_MAX_ROWS rows to it, longer calls to oneDNN; both equal the float64 product; other layers
    get no tiles."""
    kind = _tile_kernel_or_skip()
    from torchbridge.serve import cpu_kernels
    from torchbridge.serve.linear import TILE_MAX_ROWS

    torch.manual_seed(0)
    model = nn.Sequential(Linear(64, 96, bias=True), Linear(96, 50)).to(torch.bfloat16)
    w, b = model[0].weight.detach().double().clone(), model[0].bias.detach().double().clone()
    assert pack(model, tiles=kind) == 2
    assert model[0].tiles is not None and model[1].tiles is None  # 50 outputs: not a multiple of 32
    calls = []
    name = f"{kind}_linear"
    real = getattr(cpu_kernels, name)
    monkeypatch.setattr(cpu_kernels, name, lambda *a: calls.append(a[0].shape) or real(*a))
    most = TILE_MAX_ROWS[kind]
    for rows in (1, most, most + 1, 200):
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(model[0](x).double(), x.double() @ w.T + b, atol=3e-2, rtol=2e-2)
    assert calls == [(1, 64), (most, 64)]
    x3 = torch.randn(2, 3, 64).bfloat16()  # [batch, seq, hidden]
    torch.testing.assert_close(model[0](x3).double(), x3.double() @ w.T + b, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", TILE_KERNELS)
def test_tile_kernel_refuses_bad_input_by_name(kind: str) -> None:
    kernel = _kernel_or_skip(kind)
    from torchbridge.serve.linear import amx_layout

    op = f"{kind}_linear"
    tiles = amx_layout(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=f"{op}: x has 96 features, the weight tiles 64"):
        kernel(torch.zeros(2, 96, dtype=torch.bfloat16), tiles)
    with pytest.raises(RuntimeError, match=f"{op}: x must be a contiguous 2-D bfloat16"):
        kernel(torch.zeros(2, 64), tiles)
    with pytest.raises(RuntimeError, match=rf"{op}: bias must be contiguous bfloat16 \[64\]"):
        kernel(torch.zeros(2, 64, dtype=torch.bfloat16), tiles, torch.zeros(32, dtype=torch.bfloat16))


@pytest.mark.parametrize("switch", ["TORCHBRIDGE_SERVE_TILES", "TORCHBRIDGE_SERVE_AMX"])
def test_tiles_are_the_engines_bf16_default_and_can_be_switched_off(llama_dir, monkeypatch: pytest.MonkeyPatch,
                                                                    switch: str) -> None:
    kind = _tile_kernel_or_skip()
    from torchbridge.serve import LLM

    def tiled(llm: LLM) -> list[str | None]:
        return [m.tile_kernel if m.tiles is not None else None
                for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]

    kw = dict(dtype="bfloat16", block_size=4, num_blocks=32, max_model_len=64)
    assert set(tiled(LLM(str(llama_dir), **kw))) == {kind}
    assert not any(tiled(LLM(str(llama_dir), **{**kw, "dtype": "float32"})))
    monkeypatch.setenv(switch, "0")
    assert not any(tiled(LLM(str(llama_dir), **kw)))


# ---- float32 products from the panel layout on AVX2/FMA and AVX-512 CPUs (serve/csrc/panel_linear.cpp) -----


def _panels_or_skip():  # noqa: ANN202
    from torchbridge.serve import cpu_kernels

    if cpu_kernels.available() is not None:
        pytest.skip(f"the engine's CPU kernels do not build here: {cpu_kernels.available()}")
    if not cpu_kernels.panel_linear_available():
        pytest.skip("the panel kernel is built only for CPUs with AVX2/FMA or AVX-512 (this one has neither)")
    return cpu_kernels.panel_linear


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 25, 32, 45])
@pytest.mark.parametrize("n,k,bias", [(16, 32, False), (48, 32, True), (50, 32, False), (1536, 512, False),
                                      (33, 4100, True)])
def test_panel_kernel_matches_float64_reference(rows: int, n: int, k: int, bias: bool) -> None:
    """float32 accumulation: within float32's error for k terms of the float64 product. Rows cover every block
    size of both forms (1-6 rows for AVX2, 1-12 for AVX-512) and the even splits of 7, 13, 25, 32 and 45 rows;
    outputs one panel, an odd count of whole panels (48: a pair and one alone on AVX-512), a partial last panel
    in a pair (50) and alone (33), many panels; 4100 inputs, more than one pass over a panel (2048 per pass).
    A wrong layout, row split, pairing or tail is off by O(1)."""
    kernel = _panels_or_skip()
    from torchbridge.serve.linear import panel_layout

    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    got = kernel(x, panel_layout(w), b, n)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_panel_kernel_refuses_bad_input_by_name() -> None:
    _panels_or_skip()
    from torchbridge.serve.linear import panel_layout

    op = torch.ops.torchbridge_serve.panel_linear.default
    panels = panel_layout(torch.zeros(40, 64))  # 3 panels
    with pytest.raises(RuntimeError, match="panel_linear: x has 96 features, the weight panels 64"):
        op(torch.empty(2, 40), torch.zeros(2, 96), panels, None)
    with pytest.raises(RuntimeError, match="panel_linear: x must be a contiguous 2-D float32"):
        op(torch.empty(2, 40), torch.zeros(2, 64, dtype=torch.bfloat16), panels, None)
    with pytest.raises(RuntimeError, match=r"panel_linear: out must be contiguous float32 \[2, N\] with ceil\(N/16\) = 3"):
        op(torch.empty(2, 64), torch.zeros(2, 64), panels, None)
    with pytest.raises(RuntimeError, match=r"panel_linear: bias must be contiguous float32 \[40\]"):
        op(torch.empty(2, 40), torch.zeros(2, 64), panels, torch.zeros(32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_pack_with_panels_is_the_float32_product_rounded_once(dtype: torch.dtype, rows: int) -> None:
    """pack(panels=True): float32 layers, and 16-bit ones oneDNN does not run here, multiply through the panel
    kernel: the float32 product rounded once to the input's dtype (within half a unit in its last place of the
    float64 product, plus float32 accumulation error); the plain weight released unless tied."""
    _panels_or_skip()
    if dtype != torch.float32 and packing_supported(dtype):
        pytest.skip(f"oneDNN runs {dtype} linears on this CPU: pack packs them, no panels")
    torch.manual_seed(rows)
    model = TwoLayers(dtype)
    w, b = model.up.weight.detach().double().clone(), model.up.bias.detach().double().clone()
    tied = model.head.weight.detach().double().clone()
    assert pack(model, panels=True) == 2
    assert model.up.panels is not None and model.up.packed is None and model.up.wide is None
    assert model.up.weight.device.type == "meta" and model.head.weight is model.embed.weight
    x = torch.randn(2, rows, 32).to(dtype)
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    for y, ref in ((model.up(x), x.double() @ w.T + b), (model.head(x), x.double() @ tied.T)):
        assert y.dtype == dtype and y.shape == ref.shape
        assert ((y.double() - ref).abs() <= ref.abs() * eps / 2 + 1e-5).all()


def test_panels_are_the_engines_default_here_and_can_be_switched_off(llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel runs, the engine's float32 linears use it (greedy tokens against HF: tests/serve/test_engine.py
    runs through it on such a CPU); TORCHBRIDGE_SERVE_PANELS=0 keeps oneDNN; cpu_kernels=False plain torch."""
    _panels_or_skip()
    from torchbridge.serve import LLM

    def layouts(llm: LLM) -> set[str]:
        return {"panels" if m.panels is not None else "packed" if m.packed is not None else "plain"
                for m in llm.engine.runner.model.modules() if isinstance(m, Linear)}

    kw = dict(block_size=4, num_blocks=32, max_model_len=64)
    assert layouts(LLM(str(llama_dir), **kw)) == {"panels"}
    assert layouts(LLM(str(llama_dir), cpu_kernels=False, **kw)) == {"packed"}
    monkeypatch.setenv("TORCHBRIDGE_SERVE_PANELS", "0")
    assert layouts(LLM(str(llama_dir), **kw)) == {"packed"}
