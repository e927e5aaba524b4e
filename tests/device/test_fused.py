"""Fused eager mode against CPU PyTorch: same values, flushed on reads, cached across iterations."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torchbridge
from torchbridge.device import eager_mode, fused

DEV = torchbridge.device_name()


@pytest.fixture
def fused_mode():
    previous = eager_mode.mode()
    torchbridge.set_eager_mode("fused")
    yield
    torchbridge.set_eager_mode(previous)


def test_views_and_inplace_writes_are_visible_after_flush(fused_mode):
    base = torch.zeros(4, 4, device=DEV)
    base[1:3, 1:3] = 5.0
    base.t()[0].add_(1)
    col = base[:, 2]
    col.mul_(2)
    ref = torch.zeros(4, 4)
    ref[1:3, 1:3] = 5.0
    ref.t()[0].add_(1)
    ref[:, 2].mul_(2)
    assert fused.stats()["pending_ops"] > 0  # nothing has run yet
    torch.testing.assert_close(base.cpu(), ref)
    assert fused.stats()["pending_ops"] == 0


def test_item_flushes_for_python_control_flow(fused_mode):
    x = torch.arange(6.0, device=DEV)
    y = (x * 3).sum()
    if y.item() > 40:  # data-dependent branch: must see the real value
        z = x + 1
    else:
        z = x - 1
    torch.testing.assert_close(z.cpu(), torch.arange(6.0) + 1)


def test_size_bound_flushes(fused_mode, monkeypatch):
    monkeypatch.setattr(fused, "MAX_OPS", 8)
    x = torch.ones(3, device=DEV)
    before = fused.stats()["flushes"]
    for _ in range(20):
        x = x * 1.5
    assert fused.stats()["flushes"] - before >= 2
    torch.testing.assert_close(x.cpu(), torch.ones(3) * 1.5**20)


def test_training_20_steps_matches_cpu_and_reuses_fused_programs(fused_mode):
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))
    dev = copy.deepcopy(cpu).to(DEV)
    opt_cpu = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    opt_dev = torch.optim.AdamW(dev.parameters(), lr=1e-2)
    data = [(torch.randn(8, 12), torch.randint(0, 3, (8,))) for _ in range(20)]
    programs_after_warmup = None
    for step, (x, y) in enumerate(data):
        for model, opt, xx, yy in ((cpu, opt_cpu, x, y), (dev, opt_dev, x.to(DEV), y.to(DEV))):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xx), yy)
            loss.backward()
            opt.step()
            if model is cpu:
                ref = loss.item()
            else:
                assert abs(loss.item() - ref) < 1e-4
        if step == 3:
            programs_after_warmup = fused.stats()["fused_programs"]
    # Steady state: the same op sequences hit the fused-program cache instead of compiling.
    assert fused.stats()["fused_programs"] - programs_after_warmup <= 2
    for p_cpu, p_dev in zip(cpu.parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(p_dev.cpu(), p_cpu, atol=1e-5, rtol=1e-4)


def test_host_tensor_mutated_after_transfer_does_not_leak_into_device_copy(fused_mode):
    host = torch.arange(6.0)
    dev = host.to(DEV)  # recorded, not yet run
    host.mul_(100)
    torch.testing.assert_close(dev.cpu(), torch.arange(6.0))
