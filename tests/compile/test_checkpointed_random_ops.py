"""Activation checkpointing of random ops under torch.compile on the device: AOTAutograd wraps them in
run_and_save_rng_state / run_with_rng_state (compile/rng_state.py), and the backward's recomputation
must draw the same mask as the forward did. The check does not need the RNG to match CPU's: the
forward's output shows which elements dropout kept, and the gradient of sum(out * c) with respect to
x is c * 2 where kept and 0 elsewhere (p = 0.5) only if the recomputed mask is the forward's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torchbridge
from torchbridge.compile import metrics

DEV = torchbridge.device_name()

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(self.lin(x)), p=0.5, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def test_recomputed_dropout_draws_the_forwards_mask() -> None:
    torch.manual_seed(0)
    block = _Block().to(DEV)
    compiled = torch.compile(block, backend="tpu")
    for _ in range(2):  # the second call runs the compiled programs again, with new masks
        x = torch.randn(32, 64, device=DEV, requires_grad=True)
        c = torch.randn(32, 64)
        out = compiled(x)
        (out * c.to(DEV)).sum().backward()
        h = torch.tanh(block.lin(x.detach())).cpu()
        kept = out.detach().cpu() != 0
        assert 0.35 < kept.float().mean() < 0.65  # a real p = 0.5 mask, not all-kept
        torch.testing.assert_close(out.detach().cpu(), torch.where(kept, h * 2, 0.0), rtol=1e-5, atol=1e-6)
        # d out / d x through the kept elements only (the recomputed mask must be the forward's)
        want = (torch.where(kept, c * 2, 0.0) * (1 - h * h)) @ block.lin.weight.detach().cpu()
        torch.testing.assert_close(x.grad.cpu(), want, rtol=1e-4, atol=1e-5)
    assert metrics()["graphs_compiled"] >= 2


def test_checkpointed_attention_without_dropout_matches_cpu() -> None:
    """The fused SDPA op carries the seeded tag even with dropout_p = 0 (what a Llama's checkpointed
    layers compile to): its values and gradients equal CPU eager's."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def run(device: str, compile_it: bool) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(1)
        q, k, v = (torch.randn(2, 4, 16, 8).to(device).requires_grad_() for _ in range(3))
        def fn(*a: torch.Tensor) -> torch.Tensor:
            return checkpoint(attend, *a, use_reentrant=False)

        out = (torch.compile(fn, backend="tpu") if compile_it else fn)(q, k, v)
        out.square().sum().backward()
        return tuple(t.detach().cpu() for t in (out, q.grad, k.grad, v.grad))

    for got, want in zip(run(DEV, True), run("cpu", False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
