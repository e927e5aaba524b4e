"""XLA custom calls for JAX's CPU platform: PyTorch's CPU kernels for matrix products and fused
attention inside XLA executables, and a fusion fence.

Which GEMM is faster depends on the CPU: on one 2-core machine XLA:CPU's own dot (YNNPACK/Eigen)
ran 1.2-1.4x slower than torch's GEMM on transformer-shaped products, on another (AMD EPYC, AVX-512)
it ran 7-10% faster, and inside a training step by 15% (a host GEMM's OpenMP threads also contend
with XLA's own), on a third (Xeon, AVX-512/AMX) torch's was 1.13-1.29x faster at every product measured.
So on JAX's CPU platform the first eligible product measures both once per process (`gemm_probe`), and
where torch's GEMM is the faster one mm/bmm/addmm lower to an XLA FFI custom
call (csrc/host_calls.cpp) that calls `at::mm_out`/`at::bmm_out` on the XLA buffers. XLA still
compiles, fuses and schedules everything else; only the inner product changes hands.
`TORCHBRIDGE_HOST_GEMM=1`/`0` forces the choice. On any other platform (TPU, GPU) XLA's dot is used.

`attention`/`attention_backward` run PyTorch's CPU flash attention (the kernel CPU PyTorch and
inductor use) for the fused SDPA op, in eager mode and in compiled graphs (lowerings/attention.py).

`TORCHBRIDGE_HOST_KERNELS=0` turns both off (XLA's dot and attention written in JAX), which is how the
benchmark compares; it is read when a program is traced (compiled graphs key their executables on it).

`fence(x)` is x, computed into its own buffer: XLA:CPU drops optimization barriers before fusing, so
a small costly value (a rotary cos/sin table) gets fused into every consumer and recomputed per
consumer element; the fence (a copy XLA cannot see through) keeps it computed once.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchbridge.device.runtime import STATE

_TARGET = "torchbridge_host_gemm"
_FENCE = "torchbridge_fence"
_ATTENTION = "torchbridge_attention"
_ATTENTION_BACKWARD = "torchbridge_attention_backward"
_ADAM = "torchbridge_adam_step"
_ADAGRAD = "torchbridge_adagrad_step"
_PAGED_DECODE = "torchbridge_paged_decode"
_HELD_LINEAR = "torchbridge_held_linear"
_PREFILL = "torchbridge_prefill_attention"
# every custom call we register
TARGETS = (_TARGET, _FENCE, _ATTENTION, _ATTENTION_BACKWARD, _ADAM, _ADAGRAD, _PAGED_DECODE, _HELD_LINEAR, _PREFILL)
# Parameters from this many elements get the one-pass Adam update; a bias or a norm's weight is
# cheaper as XLA's own loops than as one more custom call.
ADAM_MIN_ELEMENTS = 1 << 14
# Smaller products stay in XLA's dot: below MIN_MACS multiply-adds the custom call has nothing to
# win, and with fewer than MIN_ROWS output rows (batch included: a decode step's few sequences) the
# engine on this device ran 8-18% slower with the host GEMM, where XLA runs independent small dots
# side by side on its own threads.
MIN_MACS = 32 * 32 * 32
MIN_ROWS = 256
# The probe for the GEMM choice: a transformer-shaped product (tokens x hidden @ hidden x MLP); the faster
# one wins. A margin in XLA's favour (0.9, for the contention with XLA's threads inside a graph) made the
# choice flip between processes on a machine where torch's GEMM is 1.1-1.2x faster at the probe and
# 1.13-1.29x at the larger products of a sweep (Xeon with AVX-512/AMX), whose forward at hidden 768 x 8 x 512
# tokens then ran 0.88x Inductor with XLA's dot against 0.96-0.98x with torch's.
GEMM_PROBE = (1024, 384, 1024)
GEMM_MARGIN = 1.0
log = logging.getLogger(__name__)
_registered = False
# Positional operands of the ops whose lowering takes `Transposed` operands (schema name -> positions).
GEMM_OPERANDS = {"aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::addmm": (1, 2)}


class Transposed(NamedTuple):
    """An operand whose last two axes are swapped, handed over un-transposed (the GEMM transposes
    for free; XLA would otherwise copy it into the row-major layout a custom call reads)."""

    base: Any

    def value(self) -> Any:
        return jnp.swapaxes(self.base, -1, -2)


def register(native_module: Any) -> None:
    """Give XLA the handler; once per process, after the extension is loaded."""
    global _registered
    if not _registered:
        jax.ffi.register_ffi_target(_TARGET, native_module.host_gemm_capsule(), platform="cpu")
        jax.ffi.register_ffi_target(_FENCE, native_module.fence_capsule(), platform="cpu")
        jax.ffi.register_ffi_target(_ATTENTION, native_module.attention_capsule(), platform="cpu")
        jax.ffi.register_ffi_target(_ATTENTION_BACKWARD, native_module.attention_backward_capsule(), platform="cpu")
        jax.ffi.register_ffi_target(_ADAM, native_module.adam_step_capsule(), platform="cpu")
        jax.ffi.register_ffi_target(_ADAGRAD, native_module.adagrad_step_capsule(), platform="cpu")
        jax.ffi.register_ffi_target(_PAGED_DECODE, native_module.paged_decode_capsule(), platform="cpu")
        jax.ffi.register_ffi_target(_HELD_LINEAR, native_module.held_linear_capsule(), platform="cpu")
        jax.ffi.register_ffi_target(_PREFILL, native_module.prefill_attention_capsule(), platform="cpu")
        _registered = True


def _on_cpu() -> bool:
    """The custom calls exist: handlers registered and the bridge on JAX's CPU platform."""
    return _registered and STATE.platform == "cpu"


def enabled() -> bool:
    """Whether fused attention goes to PyTorch's kernels, and products may (CPU platform, not turned off)."""
    return _on_cpu() and os.environ.get("TORCHBRIDGE_HOST_KERNELS", "1") != "0"


def gemm_enabled() -> bool:
    """Whether eligible products go to PyTorch's CPU GEMM: host kernels on, and TORCHBRIDGE_HOST_GEMM
    says so or, unset, torch's GEMM measured faster than XLA's dot on this machine."""
    if not enabled():
        return False
    forced = os.environ.get("TORCHBRIDGE_HOST_GEMM")
    if forced is not None:
        return forced != "0"
    return gemm_probe()["host_gemm"]


def switches() -> tuple[bool, bool, bool]:
    """What a traced program's choice of kernels depends on (compiled graphs key executables on it)."""
    return enabled(), gemm_enabled(), paged_decode_enabled()


_SERVE_OPS = ("torchbridge_serve::paged_decode_attention", "torchbridge_serve::prefill_attention")
_paged_decode_loaded = False


def use_paged_decode() -> None:
    """Say that the serving engine's CPU kernel library is loaded (the engine does, when it runs on this
    device over the CPU platform; the device never imports the engine): decode attention over a paged
    cache then goes to its kernel (`paged_decode`), and fresh prompts' attention to its prefill kernel
    (`prefill_attention`). Asked of the dispatcher here, once, not at every compiled call (`switches()` is
    part of every call's key: a failed lookup there cost ~38 us a call)."""
    global _paged_decode_loaded
    for op in _SERVE_OPS:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"):
            raise RuntimeError(f"{op} has no CPU kernel: load the engine's CPU kernels first")
    _paged_decode_loaded = True


def paged_decode_enabled() -> bool:
    """Whether decode attention over a paged cache goes to the serving engine's CPU kernel: host kernels on
    and `use_paged_decode()` called."""
    return _paged_decode_loaded and enabled()


def paged_decode(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, context_lens: Any, scale: float) -> Any:
    """The engine's paged decode attention (serve/csrc/paged_attention.cpp) as a custom call: q [R,H,D];
    caches [num_blocks, block_size, KVH, D] in q's dtype or as its 16-bit bits; block tables [R, max_blocks]
    and context lengths [R] (int32/int64). Each row reads its blocks in place, up to its own length."""
    return jax.ffi.ffi_call(_PAGED_DECODE, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k_cache, v_cache, block_tables, context_lens, scale=float(scale))


def prefill_attention_enabled() -> bool:
    """Whether fresh prompts' packed causal attention goes to the serving engine's CPU kernel (as
    `paged_decode_enabled`: the same library)."""
    return paged_decode_enabled()


def prefill_attention(q: Any, k: Any, v: Any, spans: Any, scale: float) -> Any:
    """The engine's packed causal attention of fresh prompts (serve/csrc/prefill_attention.cpp) as a custom
    call: q [N,H,D], k and v [N,KVH,D] of one float dtype, spans [S,2] int64 (first row, row count; 0: padding).
    Each span attends over its own rows, causally; rows outside every span are zeros."""
    return jax.ffi.ffi_call(_PREFILL, jax.ShapeDtypeStruct(q.shape, q.dtype))(q, k, v, spans, scale=float(scale))


def held_linear(x: Any, key: int, out_features: int) -> Any:
    """x [rows, in] @ W.T + b, W and b held by the serving engine's kernel library under `key`
    (serve/cpu_kernels.py `hold_packed_weight`: oneDNN's packed 16-bit GEMM, which XLA:CPU lacks: it
    multiplies 16-bit floats in float32; or `hold_panel_weight`: the library's AVX2 float32 kernel, x of any
    float dtype). CPU platform only; the engine loads the library before it asks."""
    if not _on_cpu():
        raise RuntimeError("torchbridge held_linear: only on JAX's CPU platform (the engine's oneDNN weights)")
    return jax.ffi.ffi_call(_HELD_LINEAR, jax.ShapeDtypeStruct((x.shape[0], out_features), x.dtype))(
        x, key=np.int64(key))


@functools.cache
def gemm_probe() -> dict[str, Any]:
    """Torch's GEMM vs XLA's dot on `GEMM_PROBE`, measured once per process. It runs on a thread of its
    own: the first product is usually met while a program is being traced, and JAX's trace state
    (which would capture the probe's own calls) is per thread."""
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(_measure_gemm()), name="torchbridge-gemm-probe")
    thread.start()
    thread.join()
    log.info("torchbridge: host GEMM %s (torch %.2f ms, XLA dot %.2f ms for %s)", "on" if out["host_gemm"] else "off",
             out["torch_ms"], out["xla_ms"], "x".join(map(str, GEMM_PROBE)))
    return out


def _measure_gemm() -> dict[str, Any]:
    m, k, n = GEMM_PROBE
    rng = np.random.default_rng(0)
    device = STATE.jax_device(0)
    a = jax.device_put(rng.standard_normal((m, k), dtype=np.float32), device)
    b = jax.device_put(rng.standard_normal((k, n), dtype=np.float32), device)
    out = jax.ShapeDtypeStruct((m, n), jnp.float32)
    arms = {"xla_ms": jax.jit(lambda x, y: jnp.matmul(x, y)),
            "torch_ms": jax.jit(lambda x, y: jax.ffi.ffi_call(_TARGET, out)(x, y, trans_a=False, trans_b=False))}
    times: dict[str, list[float]] = {name: [] for name in arms}
    # each arm in blocks of its own, a pause between them, and the best time of three blocks: right
    # after a torch GEMM (or any OpenMP work of the process, a model's initialisation) libgomp's worker
    # threads spin for a while, and an XLA dot measured then took up to twice its time; with one
    # median per arm the choice flipped between processes of the same training script, whose step
    # was 0.90-0.96x Inductor's with torch's GEMM forced and 1.00-1.10x with XLA's on this machine
    for block in range(3):
        for name, fn in arms.items():
            for i in range(6):
                t = time.perf_counter()
                fn(a, b).block_until_ready()
                if block or i >= 2:  # the first calls compile and warm up
                    times[name].append(time.perf_counter() - t)
            time.sleep(0.01)
    res = {name: min(v) * 1e3 for name, v in times.items()}
    return {**res, "host_gemm": res["torch_ms"] < GEMM_MARGIN * res["xla_ms"]}


def fence(x: Any) -> Any:
    """`x` as its own buffer (on the CPU platform); elsewhere an optimization barrier."""
    if _on_cpu() and getattr(x, "size", 0):
        return jax.ffi.ffi_call(_FENCE, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    return jax.lax.optimization_barrier(x)


def _unwrap(x: Any) -> tuple[Any, bool]:
    return (x.base, True) if isinstance(x, Transposed) else (x, False)


def value(x: Any) -> Any:
    """The operand as a plain array."""
    return x.value() if isinstance(x, Transposed) else x


def _shapes(a: Any, ta: bool, b: Any, tb: bool) -> tuple[tuple, tuple]:
    sa = tuple(a.shape[:-2]) + ((a.shape[-1], a.shape[-2]) if ta else tuple(a.shape[-2:]))
    sb = tuple(b.shape[:-2]) + ((b.shape[-1], b.shape[-2]) if tb else tuple(b.shape[-2:]))
    return sa, sb


def _eligible(a: Any, b: Any, sa: tuple, sb: tuple) -> bool:
    if a.ndim not in (2, 3) or b.ndim != a.ndim or a.dtype != b.dtype:
        return False
    if a.dtype not in (jnp.float32, jnp.float64):
        return False
    if sa[:-2] != sb[:-2] or sa[-1] != sb[-2]:
        return False  # batch broadcasting and shape errors are XLA's (PyTorch's meta kernel already checked)
    rows = sa[-2]
    for d in sa[:-2]:
        rows *= d
    return rows >= MIN_ROWS and rows * sa[-1] * sb[-1] >= MIN_MACS


def matmul(a: Any, b: Any) -> Any:
    """a @ b for mm/bmm/matmul lowerings; either operand may be a `Transposed`."""
    a_arr, ta = _unwrap(a)
    b_arr, tb = _unwrap(b)
    if enabled() and hasattr(a_arr, "ndim") and hasattr(b_arr, "ndim"):
        sa, sb = _shapes(a_arr, ta, b_arr, tb)
        if _eligible(a_arr, b_arr, sa, sb) and gemm_enabled():
            out = jax.ShapeDtypeStruct(sa[:-1] + (sb[-1],), a_arr.dtype)
            return jax.ffi.ffi_call(_TARGET, out)(a_arr, b_arr, trans_a=ta, trans_b=tb)
    return jnp.matmul(value(a), value(b), preferred_element_type=None)


def attention(q: Any, k: Any, v: Any, bias: Any, is_causal: bool, scale: float) -> tuple[Any, Any]:
    """PyTorch's CPU flash attention: (out, logsumexp). q [B,H,L,E], k/v [B,H,S,E] with equal heads,
    bias None or an additive float [B,H,L,S]."""
    b, h, length, _ = q.shape
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, length), q.dtype))
    return jax.ffi.ffi_call(_ATTENTION, outs)(q, k, v, _mask(bias, q.dtype), is_causal=is_causal,
                                               has_mask=bias is not None, scale=float(scale))


def attention_backward(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, bias: Any, is_causal: bool,
                       scale: float) -> tuple[Any, Any, Any]:
    """Gradients (dq, dk, dv) of `attention`, from its saved output and logsumexp."""
    outs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return jax.ffi.ffi_call(_ATTENTION_BACKWARD, outs)(grad_out, q, k, v, out, lse, _mask(bias, q.dtype),
                                                        is_causal=is_causal, has_mask=bias is not None,
                                                        scale=float(scale))


def adam_update(p: Any, g: Any, m: Any, v: Any, *, decay: Any, l2: Any, w1: float, beta2: float, w2: float,
                step_size: Any, bc2_sqrt: Any, eps: float, gscale: float = 1.0,
                in_place: bool = False) -> tuple[Any, Any, Any]:
    """One Adam/AdamW step of one parameter: (p', m', v') with torch's foreach AdamW's operations,
    m' = lerp(m, g, w1), v' = beta2 v + w2 g g, p' = decay p - step_size m' / (sqrt(v') / bc2_sqrt + eps),
    after g = gscale g + l2 p (maximize's -1; Adam's weight decay, where AdamW's is `decay` = 1 - lr wd).
    (w1 = 1 - beta1, w2 = 1 - beta2.)

    On the CPU platform a large parameter's step is one custom call reading p, g, m, v once and
    writing the three results once: XLA:CPU, which has no multi-output loop fusion, would run each
    moment's update as its own loop and recompute both in the parameter's (8 reads, 3 writes).
    `in_place`: the call's results alias p, m and v (ask it only where the program donates all three:
    XLA copies an operand it may not overwrite before the call)."""
    arrays = (p, g, m, v)
    if _one_pass_fits(arrays):
        return _one_pass(_ADAM, arrays, (decay, l2, w1, beta2, w2, step_size, bc2_sqrt, eps, gscale),
                         {0: 0, 2: 1, 3: 2} if in_place else None)
    dt = p.dtype
    if gscale != 1:
        g = g * gscale
    if not (isinstance(l2, (int, float)) and l2 == 0):
        g = g + jnp.asarray(l2, dt) * p
    m = m + w1 * (g - m) if w1 < 0.5 else g - (g - m) * (1 - w1)
    v = v * beta2 + w2 * g * g
    d = jnp.sqrt(v) / jnp.asarray(bc2_sqrt, dt) + eps
    return p * jnp.asarray(decay, dt) - jnp.asarray(step_size, dt) * (m / d), m, v


def adagrad_update(p: Any, g: Any, s: Any, *, clr: Any, eps: float, l2: float = 0.0, gscale: float = 1.0,
                   in_place: bool = False) -> tuple[Any, Any]:
    """One Adagrad step of one parameter, (p', s'), with torch's foreach Adagrad's operations: g = gscale g
    + l2 p, s' = s + g g, p' = p + (g clr) / (sqrt(s') + eps), clr = -lr / (1 + (step - 1) lr_decay).

    On the CPU platform a large parameter's step is one custom call reading p, g, s once and writing both
    results once (XLA:CPU runs the state's update and the parameter's as two loops, the second
    recomputing or re-reading s'). `in_place`: the results alias p and s (only where the program
    donates both)."""
    arrays = (p, g, s)
    if _one_pass_fits(arrays):
        return _one_pass(_ADAGRAD, arrays, (clr, eps, l2, gscale), {0: 0, 2: 1} if in_place else None)
    if gscale != 1:
        g = g * gscale
    if l2 != 0:
        g = g + jnp.asarray(l2, p.dtype) * p
    s = s + g * g
    return p + (g * jnp.asarray(clr, p.dtype)) / (jnp.sqrt(s) + eps), s


def _one_pass_fits(arrays: tuple) -> bool:
    """Whether an optimizer's one-pass custom call serves these arrays (a parameter first, its gradient
    and state after): CPU platform, float32/float64, large enough, all of one shape and dtype."""
    p = arrays[0]
    return (enabled() and p.dtype in (jnp.float32, jnp.float64) and p.size >= ADAM_MIN_ELEMENTS
            and all(x.dtype == p.dtype and x.shape == p.shape for x in arrays))


def _one_pass(target: str, arrays: tuple, coefs: tuple, aliases: dict[int, int] | None) -> tuple:
    """The custom call `target` over `arrays` and its float64 coefficients: one result per aliasable
    array (the parameter and its state, not the gradient), each of the parameter's shape. It runs on the
    flat arrays (the update is elementwise): a program's flat input buffers then reach the call without
    a relayout copy, which in place (`aliases`: operand -> result) would also copy the results back."""
    p = arrays[0]
    coef = jnp.stack([jnp.asarray(x, jnp.float64).reshape(()) for x in coefs])
    outs = tuple(jax.ShapeDtypeStruct((p.size,), p.dtype) for _ in range(len(arrays) - 1))
    flat = jax.ffi.ffi_call(target, outs, input_output_aliases=aliases)(*(x.reshape(-1) for x in arrays), coef)
    return tuple(x.reshape(p.shape) for x in flat)


def _mask(bias: Any, dtype: Any) -> Any:
    """The mask operand: the bias, or a 1-element placeholder the handler ignores (has_mask=False)."""
    return bias if bias is not None else jnp.zeros((1,), dtype)
