"""`torch.compile(..., backend="tpu", options={"symbolic_sizes": "exact"})`: one Dynamo trace for every
size, one static XLA program per size (no padding), against CPU eager PyTorch.

For callers that already choose their sizes (the engine's shape buckets): tracing again per size cost
the engine ~5 s per bucket at start-up."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import torchbridge  # noqa: F401  (registers the device and the backend)
from torchbridge.compile import metrics

DEV = torchbridge.device_name()
EXACT = {"symbolic_sizes": "exact"}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _frames() -> int:
    return counters["stats"]["unique_graphs"]


def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # softmax and cumsum over the symbolic axis: ops that cannot run on padded sizes (bounded mode)
    y = x @ w
    return torch.softmax(y, dim=0).cumsum(0) + y.mean(0)


def test_one_trace_serves_every_size_with_a_program_per_size() -> None:
    step = torch.compile(f, backend=DEV, dynamic=True, options=EXACT)
    frames, graphs = _frames(), metrics()["graphs_compiled"]
    w = torch.randn(8, 4)
    for n in (3, 5, 9, 5, 3):
        x = torch.randn(n, 8)
        torch.testing.assert_close(step(x.to(DEV), w.to(DEV)).cpu(), f(x, w), rtol=1e-5, atol=1e-5)
    assert _frames() - frames == 1
    assert metrics()["graphs_compiled"] - graphs == 3  # one per distinct size; repeats reuse theirs


def test_the_default_traces_again_for_each_size_of_such_a_graph() -> None:
    """What "exact" saves: by default a graph that cannot run padded is specialised, Dynamo guarding
    each size (one trace per size)."""
    step = torch.compile(f, backend=DEV, dynamic=True)
    frames = _frames()
    w = torch.randn(8, 4)
    for n in (3, 5, 9):
        x = torch.randn(n, 8)
        torch.testing.assert_close(step(x.to(DEV), w.to(DEV)).cpu(), f(x, w), rtol=1e-5, atol=1e-5)
    assert _frames() - frames == 3


def test_gradients_for_each_size_match_cpu() -> None:
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    dev = copy.deepcopy(cpu).to(DEV)

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(model(x), dim=0).square().sum()

    step = torch.compile(loss, backend=DEV, dynamic=True, options=EXACT)
    frames = _frames()
    for n in (3, 6, 11):
        x = torch.randn(n, 8)
        cpu.zero_grad()
        dev.zero_grad()
        ref = loss(cpu, x)
        ref.backward()
        got = step(dev, x.to(DEV))
        got.backward()
        torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)
        for p, q in zip(dev.parameters(), cpu.parameters(), strict=True):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-4)
    assert _frames() - frames == 1


def test_an_unknown_option_is_refused_with_its_name() -> None:
    step = torch.compile(f, backend=DEV, options={"symbolic_sizes": "padded"})
    with pytest.raises(Exception, match="symbolic_sizes.*'bounded', 'exact'"):
        step(torch.randn(3, 8, device=DEV), torch.randn(8, 4, device=DEV))
