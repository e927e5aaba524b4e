"""Graph patterns the compile backend lowers as one function (compile/patterns.py), against CPU eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchbridge  # noqa: F401  (registers the device and the backend)
from torchbridge.compile import backend as compile_backend

DEV = torchbridge.device_name()


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _logits_grad(loss_fn, x: torch.Tensor, *args: torch.Tensor | None, device: str) -> torch.Tensor:
    xd = x.detach().to(device).requires_grad_()
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    fn = torch.compile(loss_fn, backend="tpu") if device != "cpu" else loss_fn
    (grad,) = torch.autograd.grad(fn(xd, *moved), xd)
    return grad.cpu()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_gradient_is_one_pattern_and_matches_cpu(reduction, weighted):
    torch.manual_seed(0)
    x = torch.randn(48, 37) * 3
    target = torch.randint(0, 37, (48,))
    target[::5] = -100  # ignored rows get no gradient
    weight = torch.rand(37) + 0.1 if weighted else None

    def loss_fn(x, target, weight):
        loss = F.cross_entropy(x, target, weight=weight, reduction=reduction)
        return loss.square().sum() if reduction == "none" else loss  # a non-uniform upstream gradient

    before = compile_backend.metrics()["patterns"]
    got = _logits_grad(loss_fn, x, target, weight, device=DEV)
    assert compile_backend.metrics()["patterns"] == before + 1
    torch.testing.assert_close(got, _logits_grad(loss_fn, x, target, weight, device="cpu"), atol=1e-6, rtol=1e-5)


def test_nll_gradients_summed_before_the_log_softmax_stay_separate_ops():
    """Two NLL gradients added together are not one NLL gradient: no pattern, still correct."""
    torch.manual_seed(0)
    x = torch.randn(16, 10)
    target = torch.randint(0, 10, (16,))

    def loss_fn(x, target):
        logp = F.log_softmax(x, dim=1)
        return F.nll_loss(logp, target) + F.nll_loss(logp, target.flip(0)) + logp.exp().square().sum()

    before = compile_backend.metrics()["patterns"]
    got = _logits_grad(loss_fn, x, target, device=DEV)
    torch.testing.assert_close(got, _logits_grad(loss_fn, x, target, device="cpu"), atol=1e-6, rtol=1e-5)
    assert compile_backend.metrics()["patterns"] == before  # two NLL gradients are summed first


def test_label_smoothing_cross_entropy_matches_cpu():
    torch.manual_seed(0)
    x = torch.randn(20, 9)
    target = torch.randint(0, 9, (20,))
    got = _logits_grad(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), x, target, device=DEV)
    ref = _logits_grad(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), x, target, device="cpu")
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
