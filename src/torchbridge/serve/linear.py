"""The engine's linear layer: `x @ W.T + b`, from weights pre-packed for oneDNN on the CPU.

`F.linear` on the CPU lays the weight out for its GEMM kernel again at every call; at a decode step's
few rows that re-layout is a large part of the call. `pack(model)` lays every linear's weight out once,
at load (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's freezing pass uses for the same
reason), and the layer then multiplies through `torch.ops.mkldnn._linear_pointwise`. Measured on the
bench model's five weight shapes (bench/bench_serve_kernels.py, docs/benchmarks/serve_kernels.md): bf16
1.2-1.6x F.linear from 1 to 512 rows; fp32 1.6x at 8 rows, level from 32 rows up (0.99-1.06x in that
run, 1.2-1.4x in an earlier one) on an Intel Xeon, where fp32 one-row calls with the weights in cache were
faster through F.linear (the packed call 0.8-0.95x). On an AMD EPYC (Zen 5) MKL, behind F.linear, is
2.0-3.4x slower than the packed call at every row count from 1 to 1024, in cache or not (the "cold"
cases read each weight from memory, as a decode step of a model larger than the cache does), and
single-user decode got 1.0-1.16x (bundled model, in cache) and 1.69-1.93x (bench model) faster when
its one-row calls moved to the packed weight (2026-12-04, docs/benchmarks/serve_kernels_zen5.md). So
every call uses the packed weight and the plain one is released (left on the meta device, for its
shape) unless another module shares it (tied embeddings): the linears hold their weights once, not twice.

On a CPU with Intel AMX the engine's CPU kernels (serve/cpu_kernels.py) add a third form for bf16:
`pack(model, tiles="amx")` also lays each weight out as AMX tiles (`amx_layout`), and calls of at most
`AMX_MAX_ROWS` rows (decode steps) run `amx_linear`: 1.2-1.6x oneDNN's packed call at 1-32 rows over the
bench and bundled models' five layer shapes summed, 2-5x for single shapes with the weight in cache (the
tile-linears part of bench/bench_serve_kernels.py). Longer calls (prefill) keep oneDNN, so such a layer
holds its weight twice. On a CPU with AVX512-BF16 and no AMX (AMD Zen 4/5) `tiles="avx512bf16"` keeps the
same layout for `avx512bf16_linear` (its tile rows are vdpbf16ps's operand), up to `AVX512BF16_MAX_ROWS`.

Where oneDNN has no 16-bit GEMM for this CPU (no AVX512-BF16/AMX: `packing_supported` is False), torch's
own bf16 GEMM ran ~10x slower than float32's from 16 rows up (AMD EPYC with AVX2: 2.6 vs 0.53 ms at 16 x 256
x 4096, 101 vs 11.5 ms at 2048 x 256 x 1536), so `pack` widens those layers instead (below): a bf16 decode
step of the bundled model at 32 sequences 54 -> 16 ms there.

On the bridge's device over JAX's CPU platform, XLA:CPU multiplies 16-bit floats in float32 and converts
the weight to float32 inside every call (a bf16 decode step of the bundled model at 32 sequences spent ~40%
of its XLA thread time in those conversions). `widen(model)` gives each 16-bit layer its weight as float32,
converted once, and the layer multiplies `x` converted to float32 by it, rounding the result to x's dtype:
the products XLA computed before, without converting the weight per call. The 16-bit weight is released
unless another module shares it (tied embeddings), so weights take twice their 16-bit memory there.

There, too, `x @ W.T` with W stored [out, in] (nn.Linear's layout) costs XLA:CPU's dot (YNNPACK, at a
decode step's rows) about twice `x @ Wt` with the same weight stored [in, out]: a jitted program of the
bundled model's 17 products at 2 rows took 0.72 ms against 0.35 ms, 1.3-2x from 2 to 32 rows, level from
128 rows up (one row, a matrix-vector product, 0.9x). So `transpose(model)` gives each layer its weight as
[in, out] (`Linear.wt`; after `widen`, the float32 copy), and a single-user decode step
of the bundled model spent 0.78 ms in its products instead of 1.56 (an XLA trace; 2026-12-04, AMD EPYC Zen 5).
A tied LM head keeps the embedding's [vocab, hidden] table as well as its own [hidden, vocab] copy.

oneDNN's fp32 kernels leave much of the core unused at a decode step's rows (one thread of an AMD EPYC Zen 3,
AVX2: 6-19 GFLOP/s at 1-4 rows, 28-57 at 8-32, 61-76 from 64 rows, of ~90; a Zen 4, AVX-512: 13-31 at one row,
60-90 at 8-32, of ~105), so where the kernel builds (AVX2 or AVX-512) `pack(model, panels=True)` lays
each float32 layer (and each 16-bit one it would widen) out as panels of 16 outputs (`panel_layout`) instead,
and every call runs the engine's own kernel over them (serve/csrc/panel_linear.cpp; `Linear.panels`): one
copy of the weight, no oneDNN packing.

XLA:CPU has no 16-bit GEMM, but oneDNN has one where the CPU has AVX512-BF16 or AMX (`packing_supported`),
and there it beat XLA's float32 dot from a few rows up: the bundled model's 17 products at 32 rows took
1.54 ms packed in bf16 against 2.38 ms in XLA (0.62 vs 0.96 at 8 rows, level at 2, XLA faster at 1 row:
0.33 vs 0.41; AMD EPYC Zen 4, 2026-12-06, /tmp scratch of the products alone). So `hold(model)` hands each
16-bit layer's weight, packed, to the engine's kernel library (serve/cpu_kernels.py `hold_packed_weight`),
and calls of `HELD_MIN_ROWS` rows or more go to it by its key (`torch.ops.torchbridge.held_linear`, a
custom call inside the compiled step); fewer rows keep the float32 [in, out] weight. Such a layer holds
its weight in 16 bits (packed) as well as in float32. Where the CPU has a bf16 tile kernel (AMX or
AVX512-BF16: `hold(model, tiles=...)`) a held layer also keeps `amx_layout`, and every call goes to the
library, which runs the tile kernel up to its row limit and oneDNN above: a single-user bf16 decode of the
bundled model on the device 1.41x the same engine without the tile kernel, level with the cpu engine
(AMD EPYC Zen 4, 2026-12-07, docs/benchmarks/serve.md). No product reads such a layer's own weight, so
`widen`/`transpose` give it no float32 copy and release the device's 16-bit one (unless tied).

XLA's float32 dot, like oneDNN's, leaves much of the core idle at a decode step's rows: `hold(model,
panels=True)` hands every float32 layer, and each 16-bit one oneDNN does not multiply here (AVX2 CPUs), to
the library as panels instead (`hold_panel_weight`), and calls of up to `HELD_PANEL_MAX_ROWS` rows run the
panel kernel inside the compiled step (16-bit x widened to float32, the result rounded once: XLA's products).
Larger calls keep XLA's dot by the [in, out] weight, so such a layer holds its weight twice in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchbridge.serve import cpu_kernels


class Linear(nn.Linear):
    """nn.Linear whose matmul uses `packed` (set by `pack`) when it has one."""

    packed: torch.Tensor | None = None
    tiles: torch.Tensor | None = None  # the weight in `amx_layout` (set by `pack`)
    tile_kernel: str | None = None  # which kernel multiplies by `tiles`: "amx" or "avx512bf16"
    wide: torch.Tensor | None = None  # a 16-bit weight as float32 (set by `widen`)
    wt: torch.Tensor | None = None  # the weight (or `wide`) as [in, out] (set by `transpose`)
    held: int | None = None  # the key of the weight the engine's kernel library holds (set by `hold`)
    held_rows: tuple[int, int] = (0, 0)  # calls of this many rows (at least, at most) go to the held weight
    panels: torch.Tensor | None = None  # the weight (float32) in `panel_layout` (set by `pack(panels=True)`)
    panel_bias: torch.Tensor | None = None  # the bias as float32, beside `panels`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return cpu_kernels.panel_linear(x, self.panels, self.panel_bias, self.out_features)
        if self.held is not None and self.held_rows[0] <= x.numel() // x.shape[-1] <= self.held_rows[1]:
            return torch.ops.torchbridge.held_linear(x, self.held, self.weight.shape[0])
        if self.wt is not None:
            y = x.to(self.wt.dtype) @ self.wt
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            return y.to(x.dtype)
        if self.wide is not None:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.wide, bias).to(x.dtype)
        if self.tiles is not None and x.numel() <= TILE_MAX_ROWS[self.tile_kernel] * x.shape[-1]:
            kernel = cpu_kernels.amx_linear if self.tile_kernel == "amx" else cpu_kernels.avx512bf16_linear
            return kernel(x, self.tiles, self.bias)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed, self.bias, "none", [], "")
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.weight, self.bias)


# From this many rows a held (oneDNN-packed 16-bit) weight is faster than XLA's float32 dot (the docstring).
HELD_MIN_ROWS = 4
# Calls of up to this many rows go to a weight held as panels: in a compiled program of a model's 17 linears
# it was 1.04-1.78x XLA's float32 dot by the [in, out] weight at 1-32 rows, and 0.86-1.24x at 128-512 (AMD EPYC
# Zen 3, bench/bench_serve_kernels.py --device-panels, docs/benchmarks/serve_kernels_device_panels_avx2.md);
# on a Zen 4 (AVX-512) float32 1.26-2.21x at 1-32 rows, 0.99-1.06x at 128-512 (serve_kernels_device_panels_zen4.md).
HELD_PANEL_MAX_ROWS = 32
# Above this many rows oneDNN's blocked GEMM catches up with the AMX kernel's one pass per 32 columns
# (alternated microbench: 1.2-4.7x at 1-32 rows, 0.9-1.2x at 48-64, 0.56-0.98x at 128-512).
AMX_MAX_ROWS = 32
# The AVX512-BF16 kernel re-reads a layer's weight for every 4 rows: on the bench model's layers it is level
# with oneDNN's blocked GEMM at 1-8 rows (0.95-1.26x, noisy) and behind from 16 (0.78-0.88x); on the bundled
# model's smaller ones it is 1.9-2.2x at 1-4 rows, 1.5x at 8, 1.3x at 16, 1.14x at 32 (AMD EPYC Zen 4,
# bench/bench_serve_kernels.py --tiles, docs/benchmarks/serve_kernels_zen4.md).
AVX512BF16_MAX_ROWS = 8
TILE_MAX_ROWS = {"amx": AMX_MAX_ROWS, "avx512bf16": AVX512BF16_MAX_ROWS}
# The top of a `held_rows` range that has none, and the range of a layer whose every call goes to the held weight
# (a bf16 layer held with tiles)
NO_ROW_LIMIT = 1 << 62
HELD_EVERY_CALL = (1, NO_ROW_LIMIT)


def always_held(m: Linear) -> bool:
    """Every call of `m` goes to the library's held weight: the layer's own weight is read by no product."""
    return m.held is not None and m.held_rows == HELD_EVERY_CALL


def panel_layout(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] as float32 [ceil(N/16), K, 16]: panel j holds outputs 16j..16j+15, one row of 16 per input
    (zeros past N), the operand serve/csrc/panel_linear.cpp streams."""
    n, k = w.shape
    w = F.pad(w.detach().float(), (0, 0, 0, -n % 16))
    return w.reshape(-1, 16, k).transpose(1, 2).contiguous()


def amx_layout(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] (N, K multiples of 32) as [N/32, K/32, 2, 16, 32]: for each 32 outputs and 32 inputs, two
    16 x 32 tiles holding W[n][k] at [k // 2][2 n + k % 2] (AMX's pair-interleaved B operand)."""
    n, k = w.shape
    tiles = w.reshape(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return tiles.reshape(n // 32, k // 32, 2, 16, 32).contiguous()


def _amx_fits(w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0
            and (bias is None or bias.dtype == torch.bfloat16))


def packing_supported(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


@torch.no_grad()
def pack(model: nn.Module, tiles: str | None = None, panels: bool = False) -> int:
    """Pack the weights of every `Linear` in `model` (on the CPU, for dtypes oneDNN runs; 16-bit layers it does
    not run on this CPU are widened instead); returns how many.
    `tiles`: also give bf16 layers their weight in `amx_layout`, for that kernel's decode rows ("amx" or
    "avx512bf16": what the engine's CPU kernels' `tile_kernel()` names here).
    `panels`: float32 layers, and those 16-bit ones, get `panel_layout` instead of oneDNN's packing (the CPU
    kernels' `panel_linear_available()`)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    shared = _shared(model)
    n = 0
    for m in linears:
        w = m.weight
        widened = w.device.type == "cpu" and w.dtype in _HALF and not packing_supported(w.dtype)
        if panels and w.device.type == "cpu" and (w.dtype == torch.float32 or widened):
            m.panels = panel_layout(w)
            m.panel_bias = None if m.bias is None else m.bias.detach().float()
            _release(m, shared)
            n += 1
            continue
        if widened:
            _widen(m, shared)  # no oneDNN 16-bit GEMM on this CPU: torch's own runs ~10x slower than float32's
            n += 1
            continue
        if w.device.type != "cpu" or not packing_supported(w.dtype):
            continue
        m.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        if tiles is not None and _amx_fits(w, m.bias):
            m.tiles, m.tile_kernel = amx_layout(w.detach()), tiles
        _release(m, shared)
        n += 1
    return n


@torch.no_grad()
def widen(model: nn.Module) -> int:
    """Give every 16-bit float `Linear` of `model` its weight as float32 (`Linear.wide`), releasing the
    16-bit one where no other module shares it; returns how many (an `always_held` layer is only released).
    For devices whose compiler upcasts
    16-bit products to float32 anyway (the bridge's device over JAX's CPU platform): same products, no
    conversion of the weight per call."""
    shared = _shared(model)
    n = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.weight.dtype in _HALF:
            if always_held(m):
                _release(m, shared)  # every call goes to the library: no product reads a float32 copy
                continue
            _widen(m, shared)
            n += 1
    return n


@torch.no_grad()
def hold(model: nn.Module, panels: bool = False, tiles: str | None = None) -> int:
    """Hand every 16-bit `Linear` of `model` (on a device other than the CPU, a dtype oneDNN packs here) to the
    engine's kernel library, packed (`Linear.held`; its kernels loaded); returns how many. For the bridge's
    device over JAX's CPU platform, whose compiler has no 16-bit GEMM. The layer keeps its weight too.
    `panels` (where the CPU kernels' `panel_linear_available()`): every float32 `Linear`, and each 16-bit one
    oneDNN does not multiply here, is held in
    `panel_layout` instead, for the library's float32 kernel, up to `HELD_PANEL_MAX_ROWS` rows.
    `tiles` ("amx" or "avx512bf16": the CPU kernels' `tile_kernel()`): a packed bf16 layer of fitting shape also
    holds `amx_layout`, and every call goes to the library: up to that kernel's row limit (`TILE_MAX_ROWS`) the
    tile kernel runs, above it oneDNN."""
    from torchbridge.kernels import held_linear  # noqa: F401 - registers torch.ops.torchbridge.held_linear
    from torchbridge.serve import cpu_kernels

    n = 0
    for m in model.modules():
        if not isinstance(m, Linear) or m.weight.device.type == "cpu":
            continue
        # 16-bit layers go to panels only where oneDNN has no 16-bit GEMM here (AVX2 CPUs): elsewhere its
        # packed call is the faster one from a few rows up.
        as_panels = panels and (m.weight.dtype == torch.float32
                                or (m.weight.dtype in _HALF and not packing_supported(m.weight.dtype)))
        if not as_panels and not (m.weight.dtype in _HALF and packing_supported(m.weight.dtype)):
            continue
        w, bias = m.weight.detach().cpu(), None if m.bias is None else m.bias.detach().cpu()
        if as_panels:
            m.held, m.held_rows = cpu_kernels.hold_panel_weight(w, bias), (1, HELD_PANEL_MAX_ROWS)
        elif tiles is not None and _amx_fits(w, bias):
            # the tile kernel at a decode step's few rows (where XLA's dot beat oneDNN's packed call), oneDNN above
            m.held = cpu_kernels.hold_packed_weight(w, bias, tiles, TILE_MAX_ROWS[tiles])
            m.held_rows = HELD_EVERY_CALL
        else:
            m.held, m.held_rows = cpu_kernels.hold_packed_weight(w, bias), (HELD_MIN_ROWS, NO_ROW_LIMIT)
        n += 1
    return n


@torch.no_grad()
def transpose(model: nn.Module) -> int:
    """Give every `Linear` of `model` the weight it multiplies by (its widened one after `widen`) as [in, out]
    (`Linear.wt`), releasing the plain weight where no other module shares it; returns how many (layers whose
    every call goes to a held weight, `always_held`, get none: only released). For the
    bridge's device over JAX's CPU platform, whose dot multiplies a decode step's few rows by a weight stored
    [in, out] about twice as fast as by one stored [out, in] (the module's docstring)."""
    shared = _shared(model)
    n = 0
    for m in model.modules():
        if isinstance(m, Linear):
            if not always_held(m):
                m.wt, m.wide = (m.weight.detach() if m.wide is None else m.wide).t().contiguous(), None
                n += 1
            _release(m, shared)
    return n


_HALF = (torch.bfloat16, torch.float16)


def _shared(model: nn.Module) -> set[int]:
    """Storages of the parameters of modules other than `Linear`s (a tied embedding's weight)."""
    return {p.data_ptr() for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}


def _release(m: Linear, shared: set[int]) -> None:
    """Drop a layer's plain weight (left on the meta device, for its shape) unless another module shares it."""
    if m.weight.data_ptr() not in shared:
        m.weight = nn.Parameter(torch.empty_like(m.weight, device="meta"), requires_grad=False)


def _widen(m: Linear, shared: set[int]) -> None:
    m.wide = m.weight.detach().float()
    _release(m, shared)
