"""FlexAttention on the device, and torch.compile's default backend routed to the bridge's.

Reference: attention written out in plain PyTorch on CPU tensors (scores, the same mask and score
modification as tensors, softmax, autograd), independent of FlexAttention's own implementations.
Tolerances: float32, 2e-5 absolute/relative (XLA and PyTorch's CPU kernels sum in different orders).
Cases: a causal document mask (what TorchTitan builds from positions), grouped-query heads, and a
score_mod adding a per-head bias from a captured tensor that requires grad (its gradient checked too).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import torchbridge
from torchbridge.compile import backend as compile_backend
from torchbridge.compile import default_backend

DEV = torchbridge.device_name()
pytestmark = [pytest.mark.skipif(torchbridge.registration_error() is not None,
                                 reason=f"device backend unavailable: {torchbridge.registration_error()}"),
              pytest.mark.usefixtures("fresh_dynamo")]
B, HQ, HKV, L, E = 2, 4, 2, 40, 8
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _documents(device: str) -> torch.Tensor:
    """Document ids per position: batch 0 holds three documents, batch 1 two."""
    ids = torch.zeros(B, L, dtype=torch.int64)
    ids[0, 13:] = 1
    ids[0, 29:] = 2
    ids[1, 21:] = 1
    return ids.to(device)


def _mask_mod(docs: torch.Tensor):
    def causal_document(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    return causal_document


def _score_mod(bias: torch.Tensor):
    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    return head_bias


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, L, E, generator=g)
    k = torch.randn(B, HKV, L, E, generator=g)
    v = torch.randn(B, HKV, L, E, generator=g)
    bias = torch.randn(HQ, generator=g) * 0.1
    grad = torch.randn(B, HQ, L, E, generator=g)
    return q, k, v, bias, grad


def _reference(q, k, v, bias, docs):
    """Plain PyTorch: the dense scores, the mask and score_mod as tensors, softmax."""
    k, v = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
    scores = q @ k.transpose(-2, -1) / E**0.5
    pos = torch.arange(L)
    scores = scores + bias[None, :, None, None] * (pos[:, None] - pos[None, :])
    keep = (docs[:, None, :, None] == docs[:, None, None, :]) & (pos[:, None] >= pos[None, :])
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def _leaves(device: str, q, k, v, bias):
    return [t.detach().to(device).requires_grad_() for t in (q, k, v, bias)]


def _check(run, compiled: bool) -> None:
    q, k, v, bias, grad = _inputs()
    docs_cpu = _documents("cpu")
    cq, ck, cv, cb = _leaves("cpu", q, k, v, bias)
    ref = _reference(cq, ck, cv, cb, docs_cpu)
    ref.backward(grad)
    dq, dk, dv, db = _leaves(DEV, q, k, v, bias)
    docs = _documents(DEV)
    make_mask = torch.compile(create_block_mask) if compiled else create_block_mask
    block_mask = make_mask(_mask_mod(docs), B, None, L, L, device=DEV)
    out = run(dq, dk, dv, score_mod=_score_mod(db), block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(out.cpu(), ref.detach(), **TOL)
    out.backward(grad.to(DEV))
    for got, want in ((dq, cq), (dk, ck), (dv, cv), (db, cb)):
        torch.testing.assert_close(got.grad.cpu(), want.grad, **TOL)


def test_eager_forward_and_backward_match_plain_pytorch():
    _check(flex_attention, compiled=False)


@pytest.mark.usefixtures("no_program_cache")  # it counts lowerings: a program kept by an earlier run arrives lowered
def test_compiled_with_the_default_backend_is_routed_and_matches_plain_pytorch():
    before = compile_backend.metrics()
    _check(torch.compile(flex_attention), compiled=True)
    after = compile_backend.metrics()
    # create_block_mask's graph, flex_attention's forward graph: both went to the bridge's backend, and
    # the forward and backward higher-order ops were lowered (not run eagerly)
    assert after["routed_from_inductor"] >= before["routed_from_inductor"] + 2
    assert after["flex_attention_lowered"] >= before["flex_attention_lowered"] + 2


def test_compiled_block_mask_equals_cpu_block_mask():
    docs = _documents("cpu")
    ref = create_block_mask(_mask_mod(docs), B, None, L, L, device="cpu", BLOCK_SIZE=16)
    got = torch.compile(create_block_mask)(_mask_mod(docs.to(DEV)), B, None, L, L, device=DEV, BLOCK_SIZE=16)
    torch.testing.assert_close(got.to_dense().cpu(), ref.to_dense())
    torch.testing.assert_close(got.kv_num_blocks.cpu(), ref.kv_num_blocks)


def test_compiled_inside_a_compiled_model_with_backend_inductor():
    """TorchTitan's --compile: a block compiled with backend="inductor" calling compiled flex_attention."""
    q, k, v, bias, grad = _inputs(1)
    docs_cpu = _documents("cpu")
    cq, ck, cv, cb = _leaves("cpu", q, k, v, bias)
    ref = _reference(cq, ck, cv, cb, docs_cpu) * 2
    ref.backward(grad)
    dq, dk, dv, db = _leaves(DEV, q, k, v, bias)
    block_mask = create_block_mask(_mask_mod(_documents(DEV)), B, None, L, L, device=DEV)
    inner = torch.compile(flex_attention)

    def block(q, k, v, bias):
        return inner(q, k, v, score_mod=_score_mod(bias), block_mask=block_mask, enable_gqa=True) * 2

    out = torch.compile(block, backend="inductor", fullgraph=True)(dq, dk, dv, db)
    torch.testing.assert_close(out.cpu(), ref.detach(), **TOL)
    out.backward(grad.to(DEV))
    for got, want in ((dq, cq), (dk, ck), (dv, cv), (db, cb)):
        torch.testing.assert_close(got.grad.cpu(), want.grad, **TOL)


def test_graphs_on_other_devices_are_left_to_inductor():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    assert not default_backend.touches(gm, [torch.ones(2)], DEV)
    assert default_backend.touches(gm, [torch.ones(2, device=DEV)], DEV)
