"""`torch.tpu` and `torch.accelerator` as parallel code uses `torch.cuda`: placement of factory tensors,
streams and events, memory accounting, device properties, autocast and `_assert_async`."""

from __future__ import annotations

import time

import pytest
import torch

import torchbridge

if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()
MOD = getattr(torch, DEV)


def _chip(t: torch.Tensor):
    from torchbridge.device.runtime import STATE

    MOD.synchronize()
    buf = STATE.table.get(t.untyped_storage().data_ptr())
    return None if buf is None else next(iter(buf.devices()))


@pytest.mark.parametrize("make", [
    lambda d: torch.randn(4, device=d), lambda d: torch.ones(4, device=d), lambda d: torch.arange(4, device=d),
    lambda d: torch.full((3,), 2.0, device=d), lambda d: torch.empty(4, device=d).fill_(1),
    lambda d: torch.tensor([1.0, 2.0], device=d), lambda d: torch.ones(4, device=d) + 1,
])
def test_factory_tensors_live_on_their_own_chip(make):
    from torchbridge.device.runtime import STATE

    index = min(3, MOD.device_count() - 1)
    t = make(f"{DEV}:{index}")
    assert t.device.index == index
    assert _chip(t) == STATE.devices[index]


def test_streams_are_one_queue_with_real_synchronisation():
    s = MOD.Stream()
    assert s.device.type == DEV and s != MOD.default_stream()
    with MOD.stream(s):
        assert MOD.current_stream() == s
    assert MOD.current_stream() == MOD.default_stream()
    x = torch.ones(256, 256, device=DEV)
    with MOD.stream(s):
        y = x @ x
    MOD.current_stream().wait_stream(s)
    ev = s.record_event()
    ev.synchronize()
    assert ev.query() and torch.equal(y.cpu(), torch.full((256, 256), 256.0))
    generic = torch.Stream(device=DEV)  # the device-generic API reaches the same guard
    assert generic.device == torch.device(DEV, MOD.current_device())


def test_timed_events_measure_device_work():
    x = torch.ones(512, 512, device=DEV)
    (x @ x).cpu()  # compile outside the timed span
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(5):
        x = x @ x * 1e-3
    end.record()
    end.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    assert 0 <= start.elapsed_time(end) <= wall_ms + 1


def test_accelerator_api_and_memory_accounting():
    assert torch.accelerator.current_accelerator().type == DEV
    assert torch.accelerator.device_count() == MOD.device_count()
    torch.accelerator.synchronize()
    MOD.reset_peak_memory_stats()
    before = torch.accelerator.memory_allocated()
    t = torch.empty(1024, 1024, device=DEV)
    assert torch.accelerator.memory_allocated() - before == t.nbytes == MOD.memory_allocated() - before
    assert torch.accelerator.max_memory_allocated() >= before + t.nbytes
    assert MOD.memory_stats()["allocated_bytes.all.current"] == torch.accelerator.memory_allocated()
    del t
    assert torch.accelerator.memory_allocated() == before
    free, total = torch.accelerator.get_memory_info()
    assert 0 < free <= total == MOD.get_device_properties(0).total_memory
    MOD.empty_cache()


def test_autocast_matches_cpu_autocast():
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(8, 16, generator=g), torch.randn(32, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(a, w)
    with torch.autocast(DEV):  # bfloat16 by default on this device
        out = torch.nn.functional.linear(a.to(DEV), w.to(DEV))
        soft = torch.softmax(out, -1)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), ref, rtol=2e-2, atol=2e-2)
    # CUDA's policy (which the device follows) runs softmax in float32; CPU's keeps bfloat16
    assert soft.dtype == torch.float32
    torch.testing.assert_close(soft.cpu(), torch.softmax(ref.float(), -1), rtol=1e-5, atol=1e-6)


def test_assert_async_raises_with_the_message():
    torch._assert_async(torch.tensor(True, device=DEV))
    with pytest.raises(RuntimeError, match="boom"):
        torch._assert_async(torch.tensor(False, device=DEV), "boom")
