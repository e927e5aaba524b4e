"""Lowerings for eval batch norm's saved stats, bincount, histograms, embedding_bag, margin-loss,
bicubic-upsampling and grid-sampler backward: each result and gradient against CPU PyTorch."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()


def _to(x: Any, device: str, grad: bool = False) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone().to(device)
        return y.requires_grad_() if grad and y.is_floating_point() else y
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device, grad) for v in x)
    return x


def _leaves(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _leaves(v)]
    return []


def _same(fn: Callable[..., Any], *args: Any, grad: bool = False, atol: float = 1e-5, rtol: float = 1.3e-5,
          **kwargs: Any) -> None:
    """fn on the CPU and on the device: equal outputs (shape and dtype included) and, with grad,
    equal gradients of the outputs' sum w.r.t. every float argument."""
    results, grads = [], []
    for device in ("cpu", DEV):
        a = _to(args, device, grad)
        out = fn(*a, **kwargs)
        results.append([t.detach().cpu() for t in _leaves(out)])
        if grad:
            leaves = [t for t in _leaves(a) if t.requires_grad]
            total = sum(t.sum() for t in _leaves(out) if t.is_floating_point())
            grads.append([g.cpu() for g in torch.autograd.grad(total, leaves)])
    for c, d in zip(*results, strict=True):
        torch.testing.assert_close(d, c, atol=atol, rtol=rtol)
    if grad:
        for c, d in zip(*grads, strict=True):
            torch.testing.assert_close(d, c, atol=1e-4, rtol=1e-4)


# ---- batch norm ----
@pytest.mark.parametrize("training", [False, True])
def test_native_batch_norm_saved_stats(training: bool) -> None:
    x, w, b = torch.randn(4, 3, 5), torch.randn(3), torch.randn(3)
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    aten = torch.ops.aten
    _same(lambda *a: aten.native_batch_norm(*a, training, 0.1, 1e-5), x, w, b, rm, rv)
    _same(lambda *a: aten._native_batch_norm_legit(*a, training, 0.1, 1e-5), x, w, b, rm, rv)
    if not training:
        _same(lambda *a: aten._native_batch_norm_legit_no_training(*a, 0.1, 1e-5), x, w, b, rm, rv)


def test_native_batch_norm_eval_backward() -> None:
    x, w, b = torch.randn(2, 4, 3, 3), torch.randn(4), torch.randn(4)
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    _same(lambda x, w, b: torch.native_batch_norm(x, w, b, rm.to(x.device), rv.to(x.device), False, 0.1, 1e-5),
          x, w, b, grad=True)
    _same(lambda x, w, b: F.batch_norm(x, rm.to(x.device), rv.to(x.device), w, b, training=False), x, w, b, grad=True)


# ---- counting ----
@pytest.mark.parametrize("minlength", [0, 3, 20])
def test_bincount(minlength: int) -> None:
    x = torch.tensor([0, 4, 4, 1, 9, 4])
    _same(torch.bincount, x, minlength=minlength)
    _same(torch.bincount, x, torch.randn(6), minlength=minlength)  # float32 weights stay float32
    _same(torch.bincount, x, torch.arange(6), minlength=minlength)  # others are summed in float64
    _same(torch.bincount, torch.zeros(0, dtype=torch.long), minlength=minlength)


@pytest.mark.parametrize(("rng", "density", "weighted"), list(itertools.product([None, (-1.0, 0.5)], [False, True],
                                                                                [False, True])))
def test_histogram_bin_count(rng: tuple[float, float] | None, density: bool, weighted: bool) -> None:
    x = torch.randn(4, 7)
    w = torch.rand(4, 7) if weighted else None
    _same(lambda x, w: torch.histogram(x, 6, range=rng, weight=w, density=density), x, w)


def test_histogram_edge_cases() -> None:
    _same(lambda x: torch.histogram(x, 4), torch.full((5,), 2.0))  # equal min and max widen by 0.5
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, float("nan"), 5.0])
    _same(lambda x, e: torch.histogram(x, e), x, torch.tensor([0.0, 1.0, 2.5, 3.0]))  # right edge included
    _same(lambda x, e: torch.histogram(x, e, density=True), x, torch.tensor([-1.0, 1.5, 2.0, 6.0]))


def test_histogramdd() -> None:
    x = torch.randn(20, 3)
    w = torch.rand(20)
    _same(lambda x, w: torch.histogramdd(x, [3, 4, 2], weight=w, density=True), x, w)
    _same(lambda x: torch.histogramdd(x, [2, 2, 2], range=[-1.0, 1.0, 0.0, 2.0, -2.0, 0.0]), x)
    edges = [torch.tensor([-2.0, 0.0, 2.0]), torch.tensor([-1.0, 1.0]), torch.tensor([-3.0, -1.0, 0.0, 3.0])]
    _same(lambda x, *e: torch.histogramdd(x, list(e)), x, *edges)


# ---- embedding_bag ----
@pytest.mark.parametrize(("mode", "padding_idx", "last"), list(itertools.product(["sum", "mean", "max"], [None, 2],
                                                                                 [False, True])))
def test_embedding_bag(mode: str, padding_idx: int | None, last: bool) -> None:
    weight = torch.randn(10, 3)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 2])
    offsets = torch.tensor([0, 3, 3, 7] + ([9] if last else []))  # bag 1 is empty
    _same(lambda w, i, o: F.embedding_bag(i, w, o, mode=mode, padding_idx=padding_idx, include_last_offset=last),
          weight, idx, offsets, grad=True)


def test_embedding_bag_per_sample_weights_and_2d_input() -> None:
    weight, psw = torch.randn(8, 4), torch.rand(6)
    idx, offsets = torch.tensor([0, 7, 3, 3, 1, 6]), torch.tensor([0, 2, 5])
    _same(lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p), weight, idx, offsets, psw,
          grad=True)
    _same(lambda w, i: F.embedding_bag(i, w, mode="mean"), weight, torch.tensor([[0, 2, 2], [5, 2, 7]]), grad=True)
    # scale_grad_by_freq: only the largest index repeats, where the CPU kernel scales right (see lowerings/embedding_bag.py)
    _same(lambda w, i: F.embedding_bag(i, w, mode="mean", scale_grad_by_freq=True), weight,
          torch.tensor([[0, 1, 4], [4, 4, 2]]), grad=True)


# ---- backward ops ----
@pytest.mark.parametrize(("p", "reduction"), list(itertools.product([1, 2], ["none", "mean", "sum"])))
def test_multi_margin_loss_backward(p: int, reduction: str) -> None:
    x, y, w = torch.randn(6, 5), torch.tensor([0, 4, 2, 2, 1, 3]), torch.rand(5)
    for weight in (None, w):  # weight takes no gradient, so it is moved here rather than passed in
        _same(lambda x, wt=weight: F.multi_margin_loss(x, y.to(x.device), p=p, margin=0.7, reduction=reduction,
                                                       weight=None if wt is None else wt.to(x.device)),
              x, grad=True)
    _same(lambda x: F.multi_margin_loss(x, y[:1].to(x.device), p=p, reduction=reduction), x[0], grad=True)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss_backward(reduction: str) -> None:
    x = torch.randn(4, 5)
    y = torch.tensor([[3, 0, -1, 1, 1], [0, 1, 2, 3, 4], [-1, 2, 2, 2, 2], [4, 4, 1, -1, 0]])
    _same(lambda x: F.multilabel_margin_loss(x, y.to(x.device), reduction=reduction), x, grad=True)
    _same(lambda x: F.multilabel_margin_loss(x, y[0].to(x.device), reduction=reduction), x[0], grad=True)


@pytest.mark.parametrize(("align_corners", "size", "scale"), [(False, (7, 5), None), (True, (7, 5), None),
                                                               (False, None, 1.7), (True, None, 0.6),
                                                               (False, (3, 9), None)])
def test_upsample_bicubic2d_backward(align_corners: bool, size: tuple[int, int] | None, scale: float | None) -> None:
    _same(lambda x: F.interpolate(x, size=size, scale_factor=scale, mode="bicubic", align_corners=align_corners),
          torch.randn(2, 3, 4, 6), grad=True, atol=1e-4)


@pytest.mark.parametrize(("mode", "padding", "align_corners"),
                         list(itertools.product(["bilinear", "nearest", "bicubic"],
                                                ["zeros", "border", "reflection"], [False, True])))
def test_grid_sampler_2d_backward(mode: str, padding: str, align_corners: bool) -> None:
    torch.manual_seed(0)
    x, grid = torch.randn(2, 3, 5, 6), torch.rand(2, 4, 7, 2) * 2.6 - 1.3  # some points outside the image
    _same(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align_corners),
          x, grid, grad=True, atol=1e-4)


@pytest.mark.parametrize(("mode", "padding"), list(itertools.product(["bilinear", "nearest"],
                                                                     ["zeros", "border", "reflection"])))
def test_grid_sampler_3d(mode: str, padding: str) -> None:
    torch.manual_seed(0)
    x, grid = torch.randn(2, 2, 3, 4, 5), torch.rand(2, 2, 3, 4, 3) * 2.6 - 1.3
    for align_corners in (False, True):
        _same(lambda x, g, ac=align_corners: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=ac),
              x, grid, grad=True, atol=1e-4)
