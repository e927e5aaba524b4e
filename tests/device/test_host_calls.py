"""The CPU platform's custom calls (device/host_calls.py): products through PyTorch's CPU BLAS, and the
fusion fence. Every result is compared with the same computation in CPU PyTorch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import torchbridge
from torchbridge.compile import backend
from torchbridge.device import host_calls

DEV = torchbridge.device_name()
pytestmark = pytest.mark.skipif(not host_calls.enabled(), reason="the host GEMM only exists on JAX's CPU platform")


@pytest.fixture(autouse=True)
def _host_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the host GEMM itself: on whether this machine's measurement picks it."""
    monkeypatch.setenv("TORCHBRIDGE_HOST_GEMM", "1")


def test_gemm_choice_follows_the_switch_else_this_machines_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_calls.gemm_enabled()
    monkeypatch.setenv("TORCHBRIDGE_HOST_GEMM", "0")
    assert not host_calls.gemm_enabled()
    monkeypatch.delenv("TORCHBRIDGE_HOST_GEMM")
    probe = host_calls.gemm_probe()
    assert probe["torch_ms"] > 0 and probe["xla_ms"] > 0
    assert host_calls.gemm_enabled() == (probe["torch_ms"] < host_calls.GEMM_MARGIN * probe["xla_ms"])
    monkeypatch.setenv("TORCHBRIDGE_HOST_KERNELS", "0")  # attention and GEMM both off
    assert not host_calls.gemm_enabled()


def _close(dev: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(dev.cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_products_with_transposed_operands_match_cpu(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(288, 80, generator=g, dtype=dtype)
    w = torch.randn(112, 80, generator=g, dtype=dtype)
    bias = torch.randn(112, generator=g, dtype=dtype)
    da, dw, dbias = a.to(DEV), w.to(DEV), bias.to(DEV)
    _close(da @ dw.t(), a @ w.t())
    _close(dw @ da.t(), w @ a.t())  # 112 rows: XLA's dot
    _close(da.t().contiguous().t() @ dw.t(), a @ w.t())
    _close(dw.t().t() @ da.t(), w @ a.t())
    _close(F.linear(da, dw, dbias), F.linear(a, w, bias))
    _close(torch.addmm(dbias, da, dw.t(), beta=0.5, alpha=2.0), torch.addmm(bias, a, w.t(), beta=0.5, alpha=2.0))
    out = torch.empty(288, 112, dtype=dtype, device=DEV)
    torch.mm(da, dw.t(), out=out)
    _close(out, a @ w.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_products_match_cpu(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 64, 32, generator=g, dtype=dtype)
    k = torch.randn(6, 64, 32, generator=g, dtype=dtype)
    dq, dk = q.to(DEV), k.to(DEV)
    _close(torch.bmm(dq, dk.transpose(1, 2)), torch.bmm(q, k.transpose(1, 2)))
    _close(torch.bmm(dq.transpose(1, 2), dk), torch.bmm(q.transpose(1, 2), k))
    _close(dq.permute(0, 2, 1) @ dk, q.permute(0, 2, 1) @ k)
    # batch broadcasting, tiny products, integers and complex stay on XLA's dot
    _close(dq.view(2, 3, 64, 32) @ dk[0].t(), q.view(2, 3, 64, 32) @ k[0].t())
    _close(dq[:, :3, :4] @ dk[:, :4, :2], q[:, :3, :4] @ k[:, :4, :2])
    ai = torch.randint(-5, 5, (70, 70))
    assert torch.equal((ai.to(DEV) @ ai.to(DEV).t()).cpu(), ai @ ai.t())
    c = torch.randn(70, 70, dtype=torch.complex64, generator=g)
    _close(c.to(DEV) @ c.to(DEV).t(), c @ c.t())


def test_products_lower_to_the_custom_call_and_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((320, 96), dtype=np.float32))
    b = jnp.asarray(np.random.default_rng(1).standard_normal((80, 96), dtype=np.float32))

    def product(x, y):
        return host_calls.matmul(x, host_calls.Transposed(y))

    text = jax.jit(product).lower(a, b).as_text()
    assert "torchbridge_host_gemm" in text
    # few rows (a decode step): XLA's dot
    assert "torchbridge_host_gemm" not in jax.jit(product).lower(a[:64], b).as_text()
    np.testing.assert_allclose(np.asarray(jax.jit(product)(a, b)), np.asarray(a) @ np.asarray(b).T, rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("TORCHBRIDGE_HOST_KERNELS", "0")
    # read when a program is traced: a fresh trace (jit caches per function) uses XLA's dot
    assert "torchbridge_host_gemm" not in jax.jit(lambda x, y: product(x, y)).lower(a, b).as_text()


class _Block(torch.nn.Module):
    """Linear layers, attention-style batched products with transposes, and a rotary-style cos/sin
    table broadcast over batch and heads (the fence's case)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Linear(64, 128)
        self.out = torch.nn.Linear(64, 64, bias=False)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.qk(x).view(b, s, 2, 4, 16).permute(2, 0, 3, 1, 4)
        angles = torch.arange(s, device=x.device, dtype=x.dtype)[:, None] * self.freq
        cos, sin = angles.cos(), angles.sin()
        q = q * cos + q.flip(-1) * sin
        k = k * cos - k.flip(-1) * sin
        scores = (q.reshape(b * 4, s, 16) @ k.reshape(b * 4, s, 16).transpose(1, 2)).softmax(-1)
        mixed = (scores @ k.reshape(b * 4, s, 16)).view(b, 4, s, 16).transpose(1, 2).reshape(b, s, 64)
        return self.out(mixed)


def test_compiled_graph_with_gemm_operands_and_fences_matches_cpu() -> None:
    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(4, 96, 64)  # 384 rows: the linear layers take the host GEMM too
    ref = model(x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    dev_model = _Block()
    dev_model.load_state_dict(model.state_dict())
    dev_model.to(DEV)
    compiled = torch.compile(dev_model, backend=DEV)
    out = compiled(x.to(DEV))
    _close(out, ref)
    out.sum().backward()
    for p, g in zip(dev_model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-4, atol=1e-5)


def test_fence_picks_small_transcendental_tables_broadcast_to_large_consumers() -> None:
    gm = make_fx(_Block())(torch.randn(3, 24, 64))
    picked = {str(n.target) for n in backend._broadcast_transcendentals(list(gm.graph.nodes))}
    assert picked == {"aten.cos.default", "aten.sin.default"}
    # a transcendental whose consumers are no larger is left to XLA's fusion
    gm2 = make_fx(lambda x: torch.exp(x) * x + 1)(torch.randn(8, 8))
    assert not backend._broadcast_transcendentals(list(gm2.graph.nodes))


def _attention(q, k, v, mask, causal, gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


_CASES = ["plain", "causal", "bool-mask", "float-mask", "learned-bias", "gqa", "fully-masked-row"]


def _attention_case(case: str) -> tuple:
    """(q, k, v, mask, causal, gqa) on the CPU, all requiring gradients as the case says."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 40, 16, generator=g, requires_grad=True)
    kv_heads = 2 if case == "gqa" else 6
    k = torch.randn(2, kv_heads, 40, 16, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, 40, 16, generator=g, requires_grad=True)
    mask = None
    if case == "bool-mask":
        mask = torch.rand(2, 1, 40, 40, generator=g) > 0.3
        mask[..., 0] = True  # no fully masked row
    elif case == "float-mask":
        mask = torch.randn(1, 6, 40, 40, generator=g)
    elif case == "learned-bias":  # the mask needs a gradient too (the flash kernel has none for it)
        mask = torch.randn(1, 6, 40, 40, generator=g, requires_grad=True)
    elif case == "fully-masked-row":  # PyTorch gives such a row 0 and no gradient, not NaN
        mask = torch.ones(2, 1, 40, 40, dtype=torch.bool)
        mask[:, :, 7] = False
    return q, k, v, mask, case == "causal", case == "gqa"


def _check_attention(fn, case: str) -> None:
    """`fn` (the attention, eager or compiled) on the device against `_attention` on the CPU."""
    q, k, v, mask, causal, gqa = _attention_case(case)
    ref = _attention(q, k, v, mask, causal, gqa)
    ref.square().sum().backward()
    dq, dk, dv = (t.detach().to(DEV).requires_grad_() for t in (q, k, v))
    dmask = None if mask is None else mask.detach().to(DEV).requires_grad_(mask.requires_grad)
    out = fn(dq, dk, dv, dmask, causal, gqa)
    out.square().sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    for dev_t, cpu_t in zip((dq, dk, dv), (q, k, v), strict=True):
        torch.testing.assert_close(dev_t.grad.cpu(), cpu_t.grad, rtol=1e-4, atol=1e-5)
    if case == "learned-bias":
        torch.testing.assert_close(dmask.grad.cpu(), mask.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("host_kernels", ["1", "0"])
@pytest.mark.parametrize("case", _CASES)
def test_compiled_attention_is_one_fused_op_and_matches_cpu(case: str, host_kernels: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA in a compiled graph is the fused overrideable op (forward and backward), run by PyTorch's
    CPU flash attention (host kernels) or by the JAX lowering; values and gradients match CPU."""
    monkeypatch.setenv("TORCHBRIDGE_HOST_KERNELS", host_kernels)
    torch._dynamo.reset()
    seen = []
    compile_graph = backend.compile_graph

    def spy(gm, example_inputs, forward=False, **kw):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_graph(gm, example_inputs, forward, **kw)

    monkeypatch.setattr(backend, "compile_graph", spy)
    _check_attention(torch.compile(_attention, backend=DEV), case)
    torch._dynamo.reset()
    assert "aten._scaled_dot_product_fused_attention_overrideable.default" in seen
    assert "aten._scaled_dot_product_fused_attention_overrideable_backward.default" in seen
    assert "aten.bmm.default" not in seen


class _OpLog(TorchDispatchMode):
    """The ATen ops called on device tensors while it is active (forward and, through autograd's
    thread-local state, backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(a, torch.Tensor) and a.device.type == DEV for a in flat):
            self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


_FUSED = "aten._scaled_dot_product_fused_attention_overrideable.default"


@pytest.mark.parametrize("case", _CASES)
def test_eager_attention_is_one_fused_op_and_matches_cpu(case: str) -> None:
    """Eager SDPA on the device is the same fused op (no [L, S] scores op by op): forward and backward."""
    with _OpLog() as log:
        _check_attention(_attention, case)
    assert _FUSED in log.ops
    assert "aten._scaled_dot_product_fused_attention_overrideable_backward.default" in log.ops
    assert "aten.bmm.default" not in log.ops


def test_dropout_attention_keeps_the_math_path() -> None:
    """Dropout has no fused kernel here: the device answers "math" and PyTorch decomposes it."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    torch.manual_seed(0)
    with _OpLog() as log:
        out = F.scaled_dot_product_attention(q.to(DEV), k.to(DEV), v.to(DEV), dropout_p=0.5)
    assert out.shape == (1, 2, 8, 4) and torch.isfinite(out.cpu()).all()
    assert _FUSED not in log.ops and "aten.bmm.default" in log.ops


