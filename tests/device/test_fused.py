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


def test_size_bound_starts_small_after_a_read_and_doubles(fused_mode, monkeypatch):
    """After a read the first few ops flush at once (the device starts while the host records the rest),
    then twice as many each time up to MAX_OPS; the next read starts over. Same cuts every iteration."""
    monkeypatch.setattr(fused, "FIRST_OPS", 4)
    monkeypatch.setattr(fused, "MAX_OPS", 16)
    x = torch.ones(3, device=DEV)
    ref = torch.ones(3)
    for _ in range(2):  # the second iteration cuts the same sequences: their programs are reused
        x.cpu()  # a read: the bound starts over
        cached = fused.stats()["fused_programs"]
        sizes = []
        for _ in range(4 + 8 + 16 + 16 + 3):
            before = fused.stats()
            x = x * 1.25
            ref = ref * 1.25
            after = fused.stats()
            if after["flushes"] > before["flushes"]:
                sizes.append(after["ops_fused"] - before["ops_fused"])
        assert sizes == [4, 8, 16, 16], sizes
        assert fused.stats()["pending_ops"] == 3
        torch.testing.assert_close(x.cpu(), ref)
        assert fused.stats()["size_bound"] == 4
    assert fused.stats()["fused_programs"] == cached  # nothing new traced in the second iteration
    for _ in range(4):  # exactly the bound: flushed, nothing left recorded, the bound grown to 8
        x = x * 1.25
    assert fused.stats()["pending_ops"] == 0 and fused.stats()["size_bound"] == 8
    x.cpu()  # a read with nothing recorded still starts the bound over
    assert fused.stats()["size_bound"] == 4


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


def test_host_writes_between_recorded_ops_keep_program_order(fused_mode):
    """A whole-storage write from the host lands directly in the buffer table while ops are recorded: ops
    recorded before it read the old values, ops recorded after it the new ones; a storage whose latest
    value is still a recorded write (its placeholder) gets the host's values, which come after it."""
    x = torch.zeros(3, device=DEV)
    x.cpu()
    before = x + 1  # recorded: reads the zeros
    x.copy_(torch.tensor([5.0, 6.0, 7.0]))  # direct
    after = x * 2  # recorded: reads 5, 6, 7
    assert fused.stats()["pending_ops"] > 0
    w = torch.ones(3, device=DEV)
    w.add_(1)  # recorded write: w's buffer is a placeholder now
    w.copy_(torch.tensor([9.0, 8.0, 7.0]))  # after it in program order
    w_after = w + 0.5
    torch.testing.assert_close(before.cpu(), torch.ones(3))
    torch.testing.assert_close(after.cpu(), torch.tensor([10.0, 12.0, 14.0]))
    torch.testing.assert_close(w.cpu(), torch.tensor([9.0, 8.0, 7.0]))
    torch.testing.assert_close(w_after.cpu(), torch.tensor([9.5, 8.5, 7.5]))


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_copies_of_no_elements(mode):
    """Hugging Face's DynamicCache starts every layer from torch.tensor([], device=...): nothing to copy, so
    nothing runs; shapes that do not broadcast still raise PyTorch's own error."""
    previous = eager_mode.mode()
    torchbridge.set_eager_mode(mode)
    try:
        empty = torch.tensor([], dtype=torch.float32, device=DEV)
        assert empty.shape == (0,) and empty.device.type == DEV
        k = torch.randn(1, 2, 3, 4)
        torch.testing.assert_close(torch.cat([empty, k.to(DEV)], dim=-2).cpu(), torch.cat([torch.tensor([]), k], -2))
        with pytest.raises(RuntimeError) as dev_err:
            torch.empty(0, 3, device=DEV).copy_(torch.empty(0, 2))
        with pytest.raises(RuntimeError) as cpu_err:
            torch.empty(0, 3).copy_(torch.empty(0, 2))
        assert str(dev_err.value) == str(cpu_err.value)
    finally:
        torchbridge.set_eager_mode(previous)
