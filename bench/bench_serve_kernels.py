"""The engine's CPU kernels against what the engine ran before them, arms alternated, several rounds.

- decode attention: `torchbridge_serve::paged_decode_attention` (the pool read in place, each row to its
  own length) vs `scaled_dot_product_attention` over the decode workspace's contiguous rows (padded to
  the step's longest context), for MHA and GQA shapes, fp32 and bf16;
- linears: oneDNN pre-packed weights (serve/linear.py) vs `F.linear`, the bench model's five weight
  shapes summed, 1 to 1024 rows, with the weights in cache (the same layers every call) and "cold" at
  decode's 1-8 rows (each call a different copy of the layers, copies summing to > 64 MB: a model's
  weights as a decode step reads them, from memory, for the bench and the bundled model's shapes);
- tile linears (bf16, where the CPU has AMX or AVX512-BF16): `torchbridge_serve::amx_linear`, else
  `torchbridge_serve::avx512bf16_linear` (same weight layout) vs oneDNN's packed call at a decode step's
  1-32 rows, the bench model's and the bundled model's weight shapes summed per model;
- greedy sampling: `torchbridge_serve::row_argmax` vs `torch.max(dim=-1)` over float32 logits, 1 to 256
  rows of a 4K, 32K and 128K vocabulary;
- layer ops: `torchbridge_serve::swiglu` vs `F.silu(gate) * up` on the fused gate|up output's halves, and
  `torchbridge_serve::rotary_into_cache` vs `rotary` + the attention's two `index_copy_` calls into the
  paged cache, 1 to 512 rows of the bench and the bundled model's shapes;
- panel linears (`--panels`, AVX2 or AVX-512 CPUs): `torchbridge_serve::panel_linear` over weights in
  `panel_layout` vs what `pack` gives the same layers otherwise (oneDNN's packed call in fp32; bf16 widened to
  float32 where oneDNN has no bf16 GEMM), the bench and the bundled model's five shapes summed, 1 to 1024 rows
  in cache and 1-8 rows cold (copies summing to > 64 MB);
- attention loops (`--attention-loops`): the decode attention kernel's portable loops vs its vector ones
  (AVX-512, or AVX2 where the CPU has no AVX-512);
- device linears (the bridge's device over JAX's CPU platform, `--device-linears`): one compiled program of a
  model's 17 linears (4 layers and the LM head, bundled and bench model), the weights as nn.Linear holds them
  ([out, in], `F.linear`) vs as [in, out] (serve/linear.py `transpose`), 1 to 512 rows, float32;
- device panels (`--device-panels`, AVX2 or AVX-512 CPUs): the same programs, XLA's dot by the [in, out]
  weights vs the panel kernel by weights the kernel library holds (serve/linear.py `hold(panels=True)`), fp32
  and bf16 (widened).
One torch thread (the serving bench's setting). Ratios are old / new time (> 1: the new path is faster).

    python bench/bench_serve_kernels.py [--rounds 5] [--device-linears | --device-panels | --greedy | --tiles | --panels | --layer-ops | --attention-loops] [--write docs/benchmarks/serve_kernels.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ATTENTION = [  # rows, heads, kv heads, head size, longest context
    (32, 8, 8, 64, 256), (32, 8, 8, 64, 1024), (8, 32, 8, 128, 2048), (32, 32, 8, 128, 512)]
LINEAR_SHAPES = [(512, 1536), (512, 512), (512, 2816), (1408, 512), (512, 8000)]  # (in, out): the bench model
ROWS = [1, 8, 32, 45, 128, 512, 1024]
BUNDLED_SHAPES = [(256, 512), (256, 256), (256, 1536), (768, 256), (256, 4096)]  # fused qkv, o, gate/up, down, head
TILE_ROWS = [1, 2, 4, 8, 16, 32]


def timed(fn, n: int) -> float:  # noqa: ANN001
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def attention_cases(dtype: torch.dtype):  # noqa: ANN201
    from torchbridge.serve import cpu_kernels

    g = torch.Generator().manual_seed(0)
    for rows, heads, kv_heads, d, longest in ATTENTION:
        bs, blocks = 16, longest // 16
        pool = rows * blocks + 1
        k_cache = torch.randn(pool, bs, kv_heads, d, generator=g).to(dtype)
        v_cache = torch.randn(pool, bs, kv_heads, d, generator=g).to(dtype)
        tables = torch.randperm(pool - 1, generator=g)[: rows * blocks].view(rows, blocks)
        lens = torch.randint(longest // 8, longest, (rows,), generator=g)
        q = torch.randn(rows, heads, d, generator=g).to(dtype)
        n = int(lens.max())
        kw = torch.randn(rows, kv_heads, n, d, generator=g).to(dtype)
        vw = torch.randn(rows, kv_heads, n, d, generator=g).to(dtype)
        mask = (torch.arange(n)[None, :] < lens[:, None])[:, None, None, :]
        qg = q.view(rows, kv_heads, heads // kv_heads, d)
        name = f"{rows} rows, {heads}/{kv_heads} heads of {d}, contexts {longest // 8}-{longest}"
        yield (name,
               lambda qg=qg, kw=kw, vw=vw, mask=mask, d=d: F.scaled_dot_product_attention(qg, kw, vw, attn_mask=mask,
                                                                                          scale=d**-0.5),
               lambda q=q, k=k_cache, v=v_cache, t=tables, ln=lens, d=d: cpu_kernels.paged_decode_attention(
                   q, k, v, t, ln, d**-0.5))


def attention_loop_cases(dtype: torch.dtype):  # noqa: ANN201
    """The decode attention kernel's portable loops (what runs where the build has no vector form) vs its
    vector ones (AVX-512, else AVX2), same call, same data."""
    op = torch.ops.torchbridge_serve
    for name, _, kernel in attention_cases(dtype):
        def portable(kernel=kernel) -> None:  # noqa: ANN001
            op._force_portable(True)
            try:
                kernel()
            finally:
                op._force_portable(False)

        yield name, portable, kernel


def linear_cases(dtype: torch.dtype):  # noqa: ANN201
    from torchbridge.serve.linear import Linear, pack

    layers = torch.nn.ModuleList(Linear(i, o, bias=False) for i, o in LINEAR_SHAPES).to(dtype)
    plain = [layer.weight.detach().clone() for layer in layers]
    pack(layers)
    for rows in ROWS:
        xs = [torch.randn(rows, i).to(dtype) for i, _ in LINEAR_SHAPES]
        yield (f"{rows} rows",
               lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, plain, strict=True)],
               lambda xs=xs: [layer.matmul(x) for x, layer in zip(xs, layers, strict=True)])


COLD_ROWS = [1, 2, 4, 8]
COLD_BYTES = 64 << 20  # beyond any L3 this bench runs on: each copy is read from memory


def cold_linear_cases(dtype: torch.dtype):  # noqa: ANN201
    from torchbridge.serve.linear import Linear, pack

    for model, shapes in (("bench model", LINEAR_SHAPES), ("bundled model", BUNDLED_SHAPES)):
        size = sum(i * o for i, o in shapes) * dtype.itemsize
        copies = [torch.nn.ModuleList(Linear(i, o, bias=False) for i, o in shapes).to(dtype)
                  for _ in range(-(-COLD_BYTES // size))]
        plain = [[layer.weight.detach().clone() for layer in layers] for layers in copies]
        for layers in copies:
            pack(layers)
        for rows in COLD_ROWS:
            xs = [torch.randn(rows, i).to(dtype) for i, _ in shapes]
            turn = iter(range(1 << 62))

            def old(xs=xs, plain=plain, turn=turn) -> None:  # noqa: ANN001
                ws = plain[next(turn) % len(plain)]
                [F.linear(x, w) for x, w in zip(xs, ws, strict=True)]

            def new(xs=xs, copies=copies, turn=turn) -> None:  # noqa: ANN001
                layers = copies[next(turn) % len(copies)]
                [layer.matmul(x) for x, layer in zip(xs, layers, strict=True)]

            yield f"{model}, cold, {rows} rows ({len(copies)} copies)", old, new


def tile_cases(dtype: torch.dtype):  # noqa: ANN201
    """The kernel itself at every row count (serve/linear.py routes only up to its TILE_MAX_ROWS to it: this
    part is where that limit comes from) against the oneDNN packed call on the same layers."""
    from torchbridge.serve import cpu_kernels
    from torchbridge.serve.linear import Linear, pack

    kind = cpu_kernels.tile_kernel()
    kernel = cpu_kernels.amx_linear if kind == "amx" else cpu_kernels.avx512bf16_linear
    for model, shapes in (("bench model", LINEAR_SHAPES), ("bundled model", BUNDLED_SHAPES)):
        layers = torch.nn.ModuleList(Linear(i, o, bias=False) for i, o in shapes).to(dtype)
        pack(layers, tiles=kind)
        tiles = [layer.tiles for layer in layers]
        for layer in layers:
            layer.tiles = None  # matmul: the oneDNN packed call

        def onednn(xs: list[torch.Tensor], layers=layers) -> None:  # noqa: ANN001
            for layer, x in zip(layers, xs, strict=True):
                layer.matmul(x)

        def tiled(xs: list[torch.Tensor], tiles=tiles) -> None:  # noqa: ANN001
            for t, x in zip(tiles, xs, strict=True):
                kernel(x, t)

        for rows in TILE_ROWS:
            xs = [torch.randn(rows, i).to(dtype) for i, _ in shapes]
            yield f"{model}, {rows} rows", lambda xs=xs: onednn(xs), lambda xs=xs: tiled(xs)


PANEL_ROWS = [1, 2, 4, 8, 16, 32, 45, 128, 512, 1024]


def panel_cases(dtype: torch.dtype):  # noqa: ANN201
    """Both arms on copies of the same layers; cold cases cycle through copies summing to > COLD_BYTES."""
    from torchbridge.serve.linear import Linear, pack

    for model, shapes in (("bench model", LINEAR_SHAPES), ("bundled model", BUNDLED_SHAPES)):
        size = sum(i * o for i, o in shapes) * 4
        for cold, rows_list in ((False, PANEL_ROWS), (True, COLD_ROWS)):
            arms = {"old": [], "new": []}
            for _ in range(-(-COLD_BYTES // size) if cold else 1):
                layers = torch.nn.ModuleList(Linear(i, o, bias=False) for i, o in shapes).to(dtype)
                twin = torch.nn.ModuleList(Linear(i, o, bias=False) for i, o in shapes).to(dtype)
                twin.load_state_dict(layers.state_dict())
                pack(layers)
                assert pack(twin, panels=True) == len(shapes) and all(t.panels is not None for t in twin)
                arms["old"].append(layers)
                arms["new"].append(twin)
            for rows in rows_list:
                xs = [torch.randn(rows, i).to(dtype) for i, _ in shapes]
                turn = iter(range(1 << 62))

                def call(arm: str, xs=xs, turn=turn, arms=arms) -> None:  # noqa: ANN001
                    copies = arms[arm]
                    layers = copies[next(turn) % len(copies)]
                    [layer.matmul(x) for x, layer in zip(xs, layers, strict=True)]

                label = f", cold ({len(arms['old'])} copies)" if cold else ""
                yield f"{model}{label}, {rows} rows", lambda c=call: c("old"), lambda c=call: c("new")


# A model's 17 linears (4 decoder layers and the LM head) as one program on the bridge's device.
DEVICE_MODELS = (("bundled model", BUNDLED_SHAPES[:4] * 4 + BUNDLED_SHAPES[4:]),
                 ("bench model", LINEAR_SHAPES[:4] * 4 + LINEAR_SHAPES[4:]))


def _device_program_cases(model: str, shapes: list[tuple[int, int]], old, new, dtype: torch.dtype,  # noqa: ANN001
                          g: torch.Generator, rtol: float, atol: float):  # noqa: ANN202
    """Both compiled programs at 1-512 rows, checked against each other first; timed with the last output copied
    back (the whole program has run)."""
    import torchbridge

    dev = torchbridge.device_name()
    for rows in (1, 2, 4, 8, 32, 128, 512):
        xs = [torch.randn(rows, i, generator=g).to(dtype).to(dev) for i, _ in shapes]
        torch.testing.assert_close(old(xs)[-1].cpu().float(), new(xs)[-1].cpu().float(), rtol=rtol, atol=atol)

        def sync(fn, xs=xs) -> None:  # noqa: ANN001
            fn(xs)[-1].cpu()

        yield (f"{model}, {len(shapes)} linears, {rows} rows", lambda sync=sync, old=old: sync(old),
               lambda sync=sync, new=new: sync(new))


def device_linear_cases(dtype: torch.dtype):  # noqa: ANN201
    import torchbridge

    dev = torchbridge.device_name()
    g = torch.Generator().manual_seed(0)
    torch._dynamo.config.recompile_limit = 64  # one static program per model and row count, on purpose
    for model, shapes in DEVICE_MODELS:
        plain = [torch.randn(o, i, generator=g).to(dtype).to(dev) for i, o in shapes]
        wts = [w.t().contiguous() for w in plain]

        @torch.compile(backend="tpu", dynamic=False)
        def old(xs: list[torch.Tensor], ws: list[torch.Tensor] = plain) -> list[torch.Tensor]:
            return [F.linear(x, w) for x, w in zip(xs, ws, strict=True)]

        @torch.compile(backend="tpu", dynamic=False)
        def new(xs: list[torch.Tensor], ws: list[torch.Tensor] = wts) -> list[torch.Tensor]:
            return [x @ w for x, w in zip(xs, ws, strict=True)]

        yield from _device_program_cases(model, shapes, old, new, dtype, g, rtol=1e-4, atol=1e-3)


def device_panel_cases(dtype: torch.dtype):  # noqa: ANN201
    """The engine's layers on the bridge's device as its loader gives them (16-bit widened, [in, out]), a model's
    17 linears in one compiled program: XLA's dot vs the same products by weights held as panels."""
    import torchbridge
    from torchbridge.serve.linear import Linear, hold, transpose, widen

    dev = torchbridge.device_name()
    torch._dynamo.config.recompile_limit = 64  # one static program per model and row count, on purpose
    g = torch.Generator().manual_seed(0)
    for model, shapes in DEVICE_MODELS:
        layers = torch.nn.ModuleList(Linear(i, o, bias=False) for i, o in shapes).to(dtype)
        twin = torch.nn.ModuleList(Linear(i, o, bias=False) for i, o in shapes).to(dtype)
        twin.load_state_dict(layers.state_dict())
        layers, twin = layers.to(dev), twin.to(dev)
        assert hold(twin, panels=True) == len(shapes)
        for m in (layers, twin):
            widen(m)
            transpose(m)

        def program(mods: torch.nn.ModuleList):  # noqa: ANN202
            return torch.compile(lambda inputs: [m(x) for x, m in zip(inputs, mods, strict=True)], backend="tpu",
                                 dynamic=False)

        yield from _device_program_cases(model, shapes, program(layers), program(twin), dtype, g, rtol=1e-2, atol=1e-2)


def greedy_cases(dtype: torch.dtype):  # noqa: ANN201
    """Greedy sampling's row maximum and index over float32 logits: torch.max(dim=-1) vs row_argmax, for
    the bundled model's, a 32K and Llama 3's 128K vocabulary."""
    from torchbridge.serve import cpu_kernels

    g = torch.Generator().manual_seed(0)
    for rows in (1, 8, 32, 256):
        for vocab in (4096, 32000, 128256):
            x = torch.randn(rows, vocab, generator=g).to(dtype)
            assert torch.equal(cpu_kernels.row_argmax(x)[1], x.max(dim=-1)[1])
            yield (f"{rows} rows, vocabulary {vocab}", lambda x=x: x.max(dim=-1),
                   lambda x=x: cpu_kernels.row_argmax(x))


LAYER_MODELS = [("bench", 8, 8, 64, 1408), ("bundled", 4, 2, 64, 768)]  # heads, kv heads, head size, intermediate


def layer_op_cases(dtype: torch.dtype):  # noqa: ANN201
    """A decoder layer's small ops, eager vs the CPU kernels, on the bench and the bundled model's shapes:
    silu(gate) * up over the fused gate|up output's halves vs `swiglu`; `rotary` and the attention's two
    index_copy_ calls into the paged cache vs `rotary_into_cache`."""
    from torchbridge.serve import cpu_kernels

    def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # the kernel itself, at every row count
        out = torch.empty(gate.shape, dtype=gate.dtype)
        torch.ops.torchbridge_serve.swiglu.default(out, gate, up)
        return out

    g = torch.Generator().manual_seed(0)
    for model, heads, kv_heads, d, inter in LAYER_MODELS:
        for rows in (1, 8, 16, 32, 512):
            gate, up = torch.randn(rows, 2 * inter, generator=g).to(dtype).chunk(2, dim=-1)
            yield (f"{model} swiglu, {rows} rows x {inter}", lambda gate=gate, up=up: F.silu(gate) * up,
                   lambda gate=gate, up=up: swiglu_op(gate, up))
        for rows in (1, 8, 32, 512):
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
            q, k, v = (t.reshape(rows, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
            cos, sin = torch.randn(rows, d, generator=g).to(dtype), torch.randn(rows, d, generator=g).to(dtype)
            k_cache = torch.zeros(2048, 16, kv_heads, d, dtype=dtype)
            v_cache = torch.zeros_like(k_cache)
            slots = torch.randperm(2048 * 16, generator=g)[:rows]

            def old(q=q, k=k, v=v, cos=cos, sin=sin, kc=k_cache, vc=v_cache, slots=slots) -> None:  # noqa: ANN001
                cpu_kernels.rotary(q, k, cos, sin)
                kc.view(-1, k.shape[1], k.shape[2]).index_copy_(0, slots, k)
                vc.view(-1, v.shape[1], v.shape[2]).index_copy_(0, slots, v)

            def new(q=q, k=k, v=v, cos=cos, sin=sin, kc=k_cache, vc=v_cache, slots=slots) -> None:  # noqa: ANN001
                cpu_kernels.rotary_into_cache(q, k, v, cos, sin, kc, vc, slots)

            yield f"{model} rotary + cache write, {rows} rows", old, new


def run(rounds: int, device_linears: bool = False, greedy: bool = False, tiles: bool = False,
        layer_ops: bool = False, attention_loops: bool = False, panels: bool = False,
        device_panels: bool = False) -> list[tuple[str, str, str, float, float, list[float]]]:
    from torchbridge.serve import cpu_kernels

    assert cpu_kernels.available() is None, cpu_kernels.available()
    out = []
    parts = [("decode attention", attention_cases, (torch.float32, torch.bfloat16)),
             ("linears", linear_cases, (torch.float32, torch.bfloat16)),
             ("linears", cold_linear_cases, (torch.float32, torch.bfloat16)),
             ("greedy sampling", greedy_cases, (torch.float32,)),
             ("layer ops", layer_op_cases, (torch.float32, torch.bfloat16))]
    kind = cpu_kernels.tile_kernel()
    tile_part = [(f"{kind} linears", tile_cases, (torch.bfloat16,))] if kind else []
    if not kind:
        print("neither AMX-BF16 nor AVX512-BF16 on this CPU: the tile-linears part is not run")
    parts += tile_part
    from torchbridge.serve.linear import packing_supported

    # bf16 layers take panels only where oneDNN has no bf16 GEMM here (serve/linear.py `pack`).
    panel_dtypes = (torch.float32,) + (() if packing_supported(torch.bfloat16) else (torch.bfloat16,))
    panel_part = [("panel linears", panel_cases, panel_dtypes)]
    if cpu_kernels.panel_linear_available():
        parts += panel_part
    else:
        print("neither AVX2/FMA nor AVX-512 on this CPU: the panel-linears part is not run")
    if panels:
        parts = panel_part
    if tiles:
        parts = tile_part
    if device_linears:
        parts = [("device linears", device_linear_cases, (torch.float32,))]
    if device_panels:
        assert cpu_kernels.panel_linear_available(), "the panel kernel is built only for AVX2/FMA or AVX-512 CPUs"
        parts = [("device panels", device_panel_cases, panel_dtypes)]
    if greedy:
        parts = [("greedy sampling", greedy_cases, (torch.float32,))]
    if layer_ops:
        parts = [("layer ops", layer_op_cases, (torch.float32, torch.bfloat16))]
    if attention_loops:
        parts = [("attention loops", attention_loop_cases, (torch.float32, torch.bfloat16))]
    for part, cases, dtypes in parts:
        for dtype in dtypes:
            for name, old, new in cases(dtype):
                n = max(3, int(0.05 / max(timed(new, 1), 1e-6)))
                olds, news = [], []
                for r in range(rounds):  # alternated, the order flipped every round
                    for arm in ((old, new) if r % 2 == 0 else (new, old)):
                        (olds if arm is old else news).append(timed(arm, n))
                ratios = [a / b for a, b in zip(olds, news, strict=True)]
                out.append((part, str(dtype).removeprefix("torch."), name, statistics.median(olds) * 1e3,
                            statistics.median(news) * 1e3, ratios))
                print(f"{part:16s} {out[-1][1]:8s} {name:45s} old {out[-1][3]:8.3f} ms  new {out[-1][4]:8.3f} ms  "
                      f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    return out


def cpu_name() -> str:
    """The CPU's model name, family and the vector extensions the kernels care about (the same model name
    covers AVX2-only and AVX-512 parts)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "cpu"
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info[:40]) if v}
    flags = set(field.get("flags", "").split())
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{field.get('model name', 'cpu')} (family {field.get('cpu family', '?')}; {', '.join(have) or 'no AVX2'})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", type=Path, default=None)
    only = ap.add_mutually_exclusive_group()  # each replaces the default set of parts with one
    only.add_argument("--device-linears", action="store_true",
                      help="only the device-linears part: [out, in] vs [in, out] weights in a compiled program")
    only.add_argument("--greedy", action="store_true", help="only the greedy-sampling part")
    only.add_argument("--tiles", action="store_true", help="only the tile-linears part (AMX or AVX512-BF16)")
    only.add_argument("--panels", action="store_true", help="only the panel-linears part (AVX2 or AVX-512)")
    only.add_argument("--device-panels", action="store_true",
                      help="only the device-panels part: XLA's dot vs weights held as panels (AVX2 or AVX-512)")
    only.add_argument("--layer-ops", action="store_true", help="only the layer-ops part (swiglu, rotary + cache write)")
    only.add_argument("--attention-loops", action="store_true",
                      help="only decode attention's portable loops vs its vector ones (AVX-512 or AVX2)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = run(args.rounds, args.device_linears, args.greedy, args.tiles, args.layer_ops, args.attention_loops,
               args.panels, args.device_panels)
    if args.write:
        lines = ["# The engine's CPU kernels vs the ops they replaced", "",
                 f"Command: `python bench/bench_serve_kernels.py --rounds {args.rounds}"
                 f"{' --device-linears' if args.device_linears else ''}{' --greedy' if args.greedy else ''}"
                 f"{' --tiles' if args.tiles else ''}{' --panels' if args.panels else ''}"
                 f"{' --device-panels' if args.device_panels else ''}"
                 f"{' --layer-ops' if args.layer_ops else ''}"
                 f"{' --attention-loops' if args.attention_loops else ''} "
                 f"--write {args.write}`", "",
                 f"Machine: {platform.machine()}, {cpu_name()}, torch {torch.__version__}, "
                 "1 thread; arms alternated, medians over rounds; ratio = old / new time (> 1: new faster).", "",
                 "| part | dtype | case | old ms | new ms | old / new (range) |", "|---|---|---|---:|---:|---:|"]
        for part, dt, name, o, n, r in rows:
            lines.append(f"| {part} | {dt} | {name} | {o:.3f} | {n:.3f} | {statistics.median(r):.2f}x "
                         f"({min(r):.2f}-{max(r):.2f}) |")
        lines += ["", "Old: decode attention is `scaled_dot_product_attention` over the decode workspace (contiguous "
                  "rows padded to the step's longest context); linears are `F.linear`. New: "
                  "`torchbridge_serve::paged_decode_attention` on the paged pool; oneDNN pre-packed weights "
                  "(every call, one-row fp32 ones included since 2026-12-04: see the cold cases). amx / avx512bf16 linears: old is the oneDNN packed call, new "
                  "`torchbridge_serve::amx_linear` (serve/csrc/amx_linear.cpp) or `avx512bf16_linear` "
                  "(serve/csrc/avx512bf16_linear.cpp); both on the same layers, weights packed once. Greedy sampling: old `torch.max(dim=-1)`, new `torchbridge_serve::row_argmax` "
                  "(serve/csrc/argmax.cpp). Panel linears: old what `pack` gives the layers without panels (oneDNN's "
                  "packed call; bf16 widened to float32 where oneDNN has no bf16 GEMM), new "
                  "`torchbridge_serve::panel_linear` (serve/csrc/panel_linear.cpp). Layer ops: old `F.silu(gate) * up`, or `rotary` then two `index_copy_` into the "
                  "paged cache; new `torchbridge_serve::swiglu` / `rotary_into_cache` (serve/csrc/pointwise.cpp). Attention loops: old the decode kernel's portable loops, new its AVX-512 or AVX2 ones. Device linears: old multiplies by the weight as nn.Linear holds it ([out, in], F.linear), new by "
                  "the same weight stored [in, out] (serve/linear.py `transpose`); one compiled program each, the "
                  "time includes its call and the last output's copy back. Device panels: old the layers as the "
                  "engine's loader gives them on the device (16-bit widened to float32, [in, out]: XLA's dot), new "
                  "the same layers held as panels (serve/linear.py `hold(panels=True)`: the panel kernel as a "
                  "custom call inside the program); one compiled program each, timed like device linears."]
        args.write.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
