"""The shipped kernels against PyTorch on the CPU (the formulas the engine's model uses) and against
their jnp references: forward in fp32 and bf16 with shapes that are not multiples of the block
size, backward, eager, inside a larger compiled graph and in fused eager mode. `impl="pallas"`
runs the Pallas kernel (interpreted on this CPU); "auto" is what the engine gets (the reference
here, Pallas when compiled for TPU)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

from torchbridge.device import eager_mode  # noqa: E402
from torchbridge.kernels import paged_attention, rms_norm, rotary, swiglu  # noqa: E402

DEV = torchbridge.device_name()
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _paged_torch(q, k_cache, v_cache, tables, lens, scale):
    """Per sequence: gather its blocks, keep its first `len` keys, SDPA with GQA heads repeated."""
    h, kvh = q.shape[1], k_cache.shape[2]
    outs = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        if n == 0:
            outs.append(torch.zeros_like(q[i]))
            continue
        k = k_cache[tables[i]].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(h // kvh, 0)
        v = v_cache[tables[i]].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(h // kvh, 0)
        o = F.scaled_dot_product_attention(q[i][:, None].float(), k.float(), v.float(), scale=scale)
        outs.append(o[:, 0].to(q.dtype))
    return torch.stack(outs)


@dataclass
class Case:
    name: str
    make: Callable[[torch.dtype], tuple]  # CPU inputs
    run: Callable[..., object]  # (impl, *inputs) through the kernel
    torch_ref: Callable[..., object]  # the same with PyTorch ops
    grad_inputs: tuple[int, ...]  # which inputs get gradients checked


def _g(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def _paged_inputs(dtype: torch.dtype) -> tuple:
    # 3 sequences, 4 query heads over 2 KV heads, blocks of 8 (19 and 9 keys: partial blocks), one empty
    tables = torch.tensor([[1, 5, 2], [3, 0, 6], [6, 6, 6]], dtype=torch.int32)
    lens = torch.tensor([19, 9, 0], dtype=torch.int32)
    return (_g(3, 4, 32, dtype=dtype), _g(7, 8, 2, 32, dtype=dtype), _g(7, 8, 2, 32, dtype=dtype), tables, lens)


CASES = [
    Case("rms_norm", lambda dt: (_g(13, 40, dtype=dt), _g(40, dtype=dt)),
         lambda impl, x, w: rms_norm.rms_norm(x, w, eps=1e-5, impl=impl),
         lambda x, w: _rms(x, w, 1e-5), (0, 1)),
    Case("add_rms_norm", lambda dt: (_g(3, 7, 40, dtype=dt), _g(3, 7, 40, dtype=dt), _g(40, dtype=dt)),
         lambda impl, x, r, w: rms_norm.add_rms_norm(x, r, w, eps=1e-5, impl=impl),
         lambda x, r, w: (_rms(x + r, w, 1e-5), x + r), (0, 1, 2)),
    Case("rotary", lambda dt: (_g(11, 4, 16, dtype=dt), _g(11, 2, 16, dtype=dt), _g(11, 16, dtype=dt),
                               _g(11, 16, dtype=dt)),
         lambda impl, q, k, c, s: rotary.rotary(q, k, c, s, impl=impl),
         lambda q, k, c, s: (q * c[:, None] + _rotate_half(q) * s[:, None], k * c[:, None] + _rotate_half(k) * s[:, None]),
         (0, 1)),
    Case("swiglu", lambda dt: (_g(21, 24, dtype=dt), _g(21, 24, dtype=dt)),
         lambda impl, g, u: swiglu.swiglu(g, u, impl=impl),
         lambda g, u: F.silu(g) * u, (0, 1)),
    Case("paged_attention", _paged_inputs,
         lambda impl, q, kc, vc, t, n: paged_attention.paged_attention(q, kc, vc, t, n, 0.2, impl=impl),
         lambda q, kc, vc, t, n: _paged_torch(q, kc, vc, t, n, 0.2), (0, 1, 2)),
]
IDS = [c.name for c in CASES]


def _flat(x: object) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _close(got: object, want: object, dtype: torch.dtype) -> None:
    for g, w in zip(_flat(got), _flat(want), strict=True):
        torch.testing.assert_close(g.cpu().float(), w.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_torch_for_pallas_and_reference(case: Case, dtype: torch.dtype):
    torch.manual_seed(0)
    inputs = case.make(dtype)
    want = case.torch_ref(*inputs)
    dev = [t.to(DEV) for t in inputs]
    for impl in ("pallas", "reference", "auto"):
        _close(case.run(impl, *dev), want, dtype)
    _close(case.run("auto", *inputs), want, dtype)  # CPU tensors: the CPU kernel


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_matches_torch_autograd(case: Case):
    torch.manual_seed(1)
    inputs = case.make(torch.float64 if case.name != "paged_attention" else torch.float32)
    weights = [torch.randn_like(o) for o in _flat(case.torch_ref(*inputs))]

    def grads(fn: Callable, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() if i in case.grad_inputs else t for i, t in enumerate(tensors)]
        outs = _flat(fn(*leaves))
        sum(((o.float() * w.to(o.device).float()).sum() for o, w in zip(outs, weights, strict=True))).backward()
        return [leaves[i].grad.cpu() for i in case.grad_inputs]

    want = grads(case.torch_ref, list(inputs))
    got = grads(lambda *a: case.run("pallas", *a), [t.to(DEV) for t in inputs])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inside_a_larger_compiled_graph(case: Case):
    torch.manual_seed(2)
    inputs = case.make(torch.float32)
    scaled = [t * 0.5 if t.is_floating_point() else t for t in inputs]
    want = [o.tanh() + 1 for o in _flat(case.torch_ref(*scaled))]

    def graph(*a):
        a = [t * 0.5 if t.is_floating_point() else t for t in a]
        return [o.tanh() + 1 for o in _flat(case.run("pallas", *a))]

    got = torch.compile(graph, backend=DEV)(*[t.to(DEV) for t in inputs])
    _close(got, want, torch.float32)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_in_fused_eager_mode(case: Case):
    torch.manual_seed(3)
    inputs = case.make(torch.float32)
    previous = eager_mode.mode()
    torchbridge.set_eager_mode("fused")
    try:
        got = [o * 3 for o in _flat(case.run("auto", *[t.to(DEV) for t in inputs]))]
        _close(got, [o * 3 for o in _flat(case.torch_ref(*inputs))], torch.float32)
    finally:
        torchbridge.set_eager_mode(previous)


def test_paged_attention_on_the_cpu_platform_runs_the_engines_decode_kernel(monkeypatch: pytest.MonkeyPatch):
    """With the serving engine's CPU kernels loaded (the engine loads them on this device), "auto" paged
    attention on JAX's CPU platform is the engine's C++ decode kernel as a custom call (it reads blocks in
    place): same results as PyTorch in fp32 and bf16 (a bf16 cache reaches it as its bits), eager and
    compiled, and gradients (the reference's) as PyTorch autograd's."""
    from torchbridge.device import host_calls
    from torchbridge.device.runtime import STATE
    from torchbridge.serve import cpu_kernels

    if STATE.platform != "cpu":
        pytest.skip(f"the custom call exists on JAX's CPU platform only (this device runs on {STATE.platform})")
    if (why := cpu_kernels.available()) is not None:
        pytest.skip(f"the engine's CPU kernels do not build here: {why}")
    host_calls.use_paged_decode()  # what the engine does once it has loaded them
    calls = []
    real = host_calls.paged_decode
    monkeypatch.setattr(host_calls, "paged_decode", lambda *a, **k: calls.append(str(a[0].dtype)) or real(*a, **k))

    def inputs(dtype: torch.dtype) -> tuple:  # 5 rows (no other test's shapes: a new trace), partial blocks
        tables = torch.tensor([[1, 5, 2], [3, 0, 6], [6, 6, 6], [4, 2, 0], [5, 5, 1]], dtype=torch.int32)
        lens = torch.tensor([19, 9, 0, 24, 1], dtype=torch.int32)
        return (_g(5, 4, 32, dtype=dtype), _g(7, 8, 2, 32, dtype=dtype), _g(7, 8, 2, 32, dtype=dtype), tables, lens)

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(4)
        cpu = inputs(dtype)
        want = _paged_torch(*cpu, 0.2)
        dev = [t.to(DEV) for t in cpu]
        _close(paged_attention.paged_attention(*dev, 0.2), want, dtype)
        got = torch.compile(lambda *a: paged_attention.paged_attention(*a, 0.2) + 1, backend=DEV)(*dev)
        _close(got, want.float() + 1, dtype)
    assert set(calls) >= {"float32", "bfloat16"}, calls
    torch.manual_seed(5)
    cpu = inputs(torch.float32)
    weights = torch.randn(5, 4, 32)

    def grads(fn: Callable, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() if i < 3 else t for i, t in enumerate(tensors)]
        (fn(*leaves) * weights.to(leaves[0].device)).sum().backward()
        return [leaf.grad.cpu() for leaf in leaves[:3]]

    got = grads(lambda *a: paged_attention.paged_attention(*a, 0.2), [t.to(DEV) for t in cpu])
    for g, w in zip(got, grads(lambda *a: _paged_torch(*a, 0.2), list(cpu)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    # JAX differentiating the custom call itself (a JAX user of the kernel's function): the reference's gradients
    import jax
    import numpy as np

    arrays = [jax.device_put(t.numpy(), STATE.jax_device(0)) for t in cpu]
    w = jax.device_put(weights.numpy(), STATE.jax_device(0))
    for f in (paged_attention.paged_attention_host, paged_attention.paged_attention_reference):
        g = jax.grad(lambda q, k, v, f=f: (f(q, k, v, arrays[3], arrays[4], 0.2) * w).sum(), argnums=(0, 1, 2))(*arrays[:3])
        for a, b in zip(g, got, strict=True):
            np.testing.assert_allclose(np.asarray(a), b.numpy(), rtol=1e-4, atol=1e-5)


def _prefill_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: torch.Tensor, scale: float) -> torch.Tensor:
    """Per span: causal SDPA over its rows with GQA heads repeated (fp32); zeros outside every span."""
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for first, count in spans.tolist():
        if count:
            rows = slice(first, first + count)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].float().transpose(0, 1), k[rows].float().transpose(0, 1).repeat_interleave(g, 0),
                v[rows].float().transpose(0, 1).repeat_interleave(g, 0), is_causal=True, scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("host", [False, True], ids=["reference", "engine-kernel"])
def test_prefill_attention_matches_pytorch_per_span(host: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh prompts' packed causal attention on the device: the jnp reference, and on JAX's CPU platform with the
    engine's CPU kernels loaded the engine's C++ kernel as a custom call; fp32 and bf16, eager and inside a
    compiled graph, a padding span and rows of no span (zeros); gradients (the reference's) as PyTorch's."""
    from torchbridge.device import host_calls
    from torchbridge.device.runtime import STATE
    from torchbridge.kernels import prefill_attention

    calls: list[str] = []
    if host:
        from torchbridge.serve import cpu_kernels

        if STATE.platform != "cpu":
            pytest.skip(f"the custom call exists on JAX's CPU platform only (this device runs on {STATE.platform})")
        if (why := cpu_kernels.available()) is not None:
            pytest.skip(f"the engine's CPU kernels do not build here: {why}")
        host_calls.use_paged_decode()  # what the engine does once it has loaded them
    else:
        monkeypatch.setattr(host_calls, "prefill_attention_enabled", lambda: False)
    real = host_calls.prefill_attention
    monkeypatch.setattr(host_calls, "prefill_attention", lambda *a, **kw: calls.append(str(a[0].dtype)) or real(*a, **kw))
    spans = torch.tensor([[1, 6], [7, 0], [9, 13], [0, 0]])  # rows 0, 7, 8 and 22 on in no span
    n = 26 if host else 25  # (a kernel's program is kept per shape: each case its own trace)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(6)
        cpu = (_g(n, 4, 16, dtype=dtype), _g(n, 2, 16, dtype=dtype), _g(n, 2, 16, dtype=dtype))
        want = _prefill_torch(*cpu, spans, 0.3)
        dev = [t.to(DEV) for t in cpu] + [spans.to(DEV)]
        _close(prefill_attention.prefill_attention(*dev, 0.3), want, dtype)
        got = torch.compile(lambda *a: prefill_attention.prefill_attention(*a, 0.3) * 2, backend=DEV)(*dev)
        _close(got, want * 2, dtype)
    assert set(calls) >= {"float32", "bfloat16"} if host else not calls, calls
    torch.manual_seed(7)
    cpu = (_g(n, 4, 16, dtype=torch.float32), _g(n, 2, 16, dtype=torch.float32), _g(n, 2, 16, dtype=torch.float32))
    weights = torch.randn(n, 4, 16)

    def grads(fn: Callable, tensors: list[torch.Tensor], s: torch.Tensor) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in tensors]
        (fn(*leaves, s) * weights.to(leaves[0].device)).sum().backward()
        return [leaf.grad.cpu() for leaf in leaves]

    got = grads(lambda *a: prefill_attention.prefill_attention(*a, 0.3), [t.to(DEV) for t in cpu], spans.to(DEV))
    for g, w in zip(got, grads(lambda *a: _prefill_torch(*a, 0.3), list(cpu), spans), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
