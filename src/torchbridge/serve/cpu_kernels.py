"""The engine's C++ kernels for the CPU (serve/csrc), built once per machine and loaded on demand.

`paged_decode_attention` reads each decoding sequence's keys and values from the paged cache in place
(serve/csrc/paged_attention.cpp): a decode step neither gathers the context nor pads it to the step's
longest one. `rms_norm`, `add_rms_norm`, `rotary` and `swiglu` (serve/csrc/pointwise.cpp) are the decoder
layer's small ops as one pass each (`rotary_into_cache` also writes the step's keys and values into the
paged cache), with the signatures of the bridge's shipped kernels (torchbridge.kernels),
so the model calls either through the same lines. `amx_linear` (serve/csrc/amx_linear.cpp) runs a bf16
linear layer's few decode rows on Intel AMX where the CPU has it, `avx512bf16_linear`
(serve/csrc/avx512bf16_linear.cpp) the same product from the same weight layout with AVX512-BF16 where it
has that and no AMX (serve/linear.py). `panel_linear` (serve/csrc/panel_linear.cpp) runs float32 linear layers
(and 16-bit ones widened to float32) at every row count on AVX2 and AVX-512 CPUs, from weights in
`panel_layout`, where oneDNN's fp32 kernels reached 28-76% of the core's FMA rate at a decode step's rows
(Zen 3; 12-90% on a Zen 4). `hold_packed_weight` /
`held_linear` (serve/csrc/held_linear.cpp) keep a layer's oneDNN-packed weight (or, `hold_panel_weight`, its
panels) in the library under a key, for the engine on the bridge's device, whose compiled step calls it by that key. `row_argmax`
(serve/csrc/argmax.cpp) is greedy sampling's maximum and its index per row. `prefill_attention`
(serve/csrc/prefill_attention.cpp) is the causal attention of a step's fresh prompts, packed, one span each. They are compiled for
this CPU (-march=native; the CPU's flags are part of the build's key), on first use (~20 s on 2 cores).
Where no C++ compiler works, `available()` says why and the engine runs the plain torch ops and decodes
through its workspace.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_attention.cpp", "pointwise.cpp", "amx_linear.cpp",
                                      "avx512bf16_linear.cpp", "panel_linear.cpp", "held_linear.cpp", "argmax.cpp",
                                      "prefill_attention.cpp")]
_HEADERS = [_CSRC / "widen.h", _CSRC / "exp16.h"]
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]
_state: dict[str, object] = {}


def _load() -> None:
    from torchbridge import cpp_build

    key = cpp_build.torch_signature() + " ".join(_CFLAGS).encode() + cpp_build.cpu_signature()
    build = cpp_build.build_dir("serve-cpu", _SOURCES + _HEADERS, key)
    cpp_build.load("torchbridge_serve_cpu", build, [p.name for p in _SOURCES], extra_cflags=_CFLAGS,
                   is_python_module=False)


def available() -> str | None:
    """None once the kernels are loaded (building them first if needed); else why they cannot be."""
    if "error" not in _state:
        try:
            _load()
            _state["error"] = None
        except Exception as e:  # no compiler, headers missing, ...: the engine has a plain-torch path
            lines = str(e).strip().splitlines() or [""]
            _state["error"] = f"{type(e).__name__}: {next((ln for ln in lines if 'error' in ln), lines[-1])}"
            log.warning("the engine's CPU kernels could not be built (%s); running the plain torch ops, "
                        "decoding through the workspace", _state["error"])
    return _state["error"]  # type: ignore[return-value]


def loaded() -> bool:
    """Whether the kernels are loaded already (never builds them: for callers that only use them if so)."""
    return _state.get("error", "") is None


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of each span of rows over its own keys and values (prompts from their first token).

    q: [N, H, D], k, v: [N, KVH, D] (rows at any stride); spans: [S, 2] int64 (first row, row count), in order and
    disjoint, count 0 for padding. Returns [N, H, D] in q's dtype; rows outside every span are zeros."""
    out = torch.empty(q.shape, dtype=q.dtype)
    torch.ops.torchbridge_serve.prefill_attention.default(out, q, k, v, spans, scale)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of one query per row over positions [0, len) (the last `window` of them if given).

    q: [R, H, D] (each row's heads contiguous, rows at any stride); caches [num_blocks, block_size, KVH, D];
    block_tables [R, max_blocks] and context_lens [R] (int64). Returns [R, H, D] (contiguous) in q's dtype;
    a row of length 0 gives zeros."""
    out = torch.empty(q.shape, dtype=q.dtype)
    if q.stride(-1) != 1 or (q.shape[1] > 1 and q.stride(1) != q.shape[2]):
        q = q.contiguous()  # (rows may stay strided: a slice of the step's q|k|v product)
    torch.ops.torchbridge_serve.paged_decode_attention.default(out, q, k_cache, v_cache, block_tables, context_lens,
                                                               scale, window or 0)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dimension (normalised in fp32, as Hugging Face's RMSNorm)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    torch.ops.torchbridge_serve.rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). The sum is written into `residual`'s memory (the layer's
    fresh attention output), which the caller must not read as before."""
    x, residual = x.contiguous(), residual.contiguous()
    out = torch.empty_like(x)
    torch.ops.torchbridge_serve.add_rms_norm(out, residual, x, weight, eps)
    return out, residual


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, D] and k [N, KVH, D] rotated in place by cos/sin [N, D] (Llama's rotate-half form); returns them."""
    torch.ops.torchbridge_serve.rotary(q, k, cos.contiguous(), sin.contiguous())
    return q, k


def rotary_into_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary`, then token t's k and v rows written to cache slot slots[t] (caches [num_blocks, block_size,
    KVH, D]): what the attention's two index_copy_ calls did, in the same pass. Returns q, k."""
    torch.ops.torchbridge_serve.rotary_into_cache.default(q, k, v, cos.contiguous(), sin.contiguous(), k_cache,
                                                          v_cache, slots)
    return q, k


# Below this many rows the two eager ops are faster than the kernel's call (its op call costs more than theirs):
# 0.64-0.73x at 1 row, 0.93-1.15x at 8, 1.02-1.32x at 16, 1.14-1.45x at 32 (medians over the bench and bundled
# models' widths, fp32 and bf16: bench/bench_serve_kernels.py --layer-ops, AMD EPYC Zen 4,
# docs/benchmarks/serve_kernels_layer_ops_zen4.md).
SWIGLU_MIN_ROWS = 16


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass, rounded as the two eager ops round; gate and up may be the halves of
    the fused gate|up projection's output (rows strided). Fewer than SWIGLU_MIN_ROWS rows: the eager ops."""
    if gate.dim() != 2:
        return swiglu(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])).view(gate.shape)
    if gate.shape[0] < SWIGLU_MIN_ROWS:
        return torch.nn.functional.silu(gate) * up
    out = torch.empty(gate.shape, dtype=gate.dtype)
    torch.ops.torchbridge_serve.swiglu.default(out, gate, up)
    return out


def amx_available() -> bool:
    """Whether `amx_linear` runs here: the kernels are loaded, this CPU has AMX-BF16 and Linux granted it."""
    return available() is None and bool(torch.ops.torchbridge_serve.amx_available())


def tile_kernel() -> str | None:
    """The kernel that runs bf16 decode rows from a weight in `amx_layout` on this CPU: "amx", else
    "avx512bf16" (vdpbf16ps, serve/csrc/avx512bf16_linear.cpp), else None (or the kernels did not load)."""
    if available() is not None:
        return None
    if torch.ops.torchbridge_serve.amx_available():
        return "amx"
    return "avx512bf16" if torch.ops.torchbridge_serve.avx512bf16_available() else None


def _tiled(op, x: torch.Tensor, w_tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], w_tiles.shape[0] * 32, dtype=x.dtype, device=x.device)
    op(out, x2, w_tiles, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def amx_linear(x: torch.Tensor, w_tiles: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in bf16 with fp32 accumulation; `w_tiles` is W [N, K] laid out by
    serve/linear.py `amx_layout`. Returns [..., N]."""
    return _tiled(torch.ops.torchbridge_serve.amx_linear, x, w_tiles, bias)


def avx512bf16_linear(x: torch.Tensor, w_tiles: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`amx_linear`'s product from the same layout, with AVX512-BF16's vdpbf16ps instead of AMX tiles."""
    return _tiled(torch.ops.torchbridge_serve.avx512bf16_linear, x, w_tiles, bias)


def panel_linear_available() -> bool:
    """Whether `panel_linear` runs here: the kernels are loaded and were built for a CPU with AVX2/FMA or AVX-512."""
    return available() is None and bool(torch.ops.torchbridge_serve.panel_linear_available())


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) with float32 products and accumulation, rounded once to x's dtype; `panels` is
    W [out_features, K] in serve/linear.py `panel_layout`, `bias` float32. Returns [..., out_features]."""
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = torch.empty(x2.shape[0], out_features, dtype=torch.float32, device=x.device)
    torch.ops.torchbridge_serve.panel_linear.default(out, x2, panels, bias)
    out = out.view(*x.shape[:-1], out_features)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def weight_key(w: torch.Tensor, bias: torch.Tensor | None = None, form: str = "") -> int:
    """A 63-bit key from a weight's (and bias's) dtype, shape and bytes, and the `form` it is held in: equal for
    the same layer in every process (a program in the persistent compile cache names its weights by it),
    different for another model's layer of the same shape or the same layer held another way."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    h.update(form.encode())
    for t in (w, bias):
        if t is not None:
            t = t.detach().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def hold_packed_weight(w: torch.Tensor, bias: torch.Tensor | None = None, tiles: str | None = None,
                       tile_max_rows: int = 0) -> int:
    """Give the library W [out, in] (a CPU tensor of a dtype oneDNN packs here) pre-packed, with its bias;
    returns the key `held_linear` takes. `tiles` ("amx" or "avx512bf16", `tile_kernel()`; a bf16 W whose
    sides are multiples of 32): also in serve/linear.py `amx_layout`, and calls of up to `tile_max_rows` rows
    run that kernel over it instead of oneDNN."""
    key = weight_key(w, bias, form="" if tiles is None else f"tiles:{tiles}:{tile_max_rows}")
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
    b = None if bias is None else bias.detach().to(w.dtype).contiguous()
    torch.ops.torchbridge_serve.hold_packed_weight(key, packed, b, w.shape[1], w.shape[0])
    if tiles is not None:
        from torchbridge.serve.linear import amx_layout

        torch.ops.torchbridge_serve.hold_tiles(key, amx_layout(w.detach()), tiles, tile_max_rows)
    return key


def hold_panel_weight(w: torch.Tensor, bias: torch.Tensor | None = None) -> int:
    """Give the library W [out, in] (a CPU tensor of a float dtype) as float32 panels (serve/linear.py
    `panel_layout`, for `panel_linear`), with its bias as float32; returns the key `held_linear` takes. Only
    where `panel_linear_available()`."""
    from torchbridge.serve.linear import panel_layout

    key = weight_key(w, bias, form="panels")
    b = None if bias is None else bias.detach().float().contiguous()
    torch.ops.torchbridge_serve.hold_panel_weight(key, panel_layout(w), b, w.shape[1], w.shape[0])
    return key


def held_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """x [..., in] @ W.T + b for the weight held under `key` (CPU tensors; the device calls the same
    kernel from inside its programs, device/host_calls.py `held_linear`)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype)
    torch.ops.torchbridge_serve.held_linear(out, x2, key)
    return out.view(*x.shape[:-1], out_features)


def row_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum and the first index holding it, as `logits.max(dim=-1)` gives them (NaN
    propagated), for float32 logits [rows, vocab]; torch's indexed reduction is a scalar loop on the CPU."""
    x = logits.contiguous()
    best = torch.empty(x.shape[0], dtype=torch.float32)
    index = torch.empty(x.shape[0], dtype=torch.int64)
    torch.ops.torchbridge_serve.row_argmax(best, index, x)
    return best, index
