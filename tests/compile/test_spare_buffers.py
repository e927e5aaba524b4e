"""Freed large buffers written again by compiled and eager programs (storage.SPARES; compile.backend's
_call_recycling, device/recycling.py): on JAX's CPU platform a fresh output is new memory the kernel
page-faults in on every write, so a program whose large outputs have a spare of their shape in the pool
takes the spares as donated inputs and XLA writes the outputs into them. Checked against CPU PyTorch: values
stay right whether or not the previous results are alive, a live result is never written over, and
empty_cache() gives the memory back."""

from __future__ import annotations

import resource

import jax
import pytest
import torch

import torchbridge
from torchbridge.compile import metrics
from torchbridge.device import storage

DEV = torchbridge.device_name()
MOD = getattr(torch, DEV)  # torch.tpu under the default name
N = 3 << 20  # float32 elements: 12 MiB, above storage.SPARE_MIN_BYTES

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(autouse=True)
def _cpu_platform() -> None:
    if not storage.spares_enabled(jax.devices()[0]):
        pytest.skip("spare buffers serve JAX's CPU platform only (or TORCHBRIDGE_SPARE_BUFFERS=0)")
    MOD.empty_cache()


def _fn(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * k


def test_outputs_reuse_freed_buffers_and_match_cpu() -> None:
    step = torch.compile(_fn, backend="tpu")
    x = torch.randn(N)
    before = metrics()["recycled_outputs"]
    for i in range(5):
        k = torch.tensor(float(i + 1))
        out = step(x.to(DEV), k.to(DEV))  # the previous step's `out` is freed by this assignment
        torch.testing.assert_close(out.cpu(), _fn(x, k))
    # the first call has no spare yet, the second compiles the recycling program; then every call reuses
    assert metrics()["recycled_outputs"] - before >= 3


def test_live_results_are_never_written_over() -> None:
    step = torch.compile(_fn, backend="tpu")
    x = torch.randn(N)
    xd = x.to(DEV)
    before = metrics()["recycled_outputs"]
    kept = [step(xd, torch.tensor(float(i + 1), device=DEV)) for i in range(4)]
    for i, out in enumerate(kept):
        torch.testing.assert_close(out.cpu(), _fn(x, torch.tensor(float(i + 1))))
    assert metrics()["recycled_outputs"] == before  # every result alive: nothing to reuse
    # a view keeps its storage (and so its buffer) alive too
    view = kept[0][: N // 2]
    del kept
    again = step(xd, torch.tensor(9.0, device=DEV))
    torch.testing.assert_close(view.cpu(), _fn(x, torch.tensor(1.0))[: N // 2])
    torch.testing.assert_close(again.cpu(), _fn(x, torch.tensor(9.0)))


def test_empty_cache_returns_the_spares() -> None:
    step = torch.compile(_fn, backend="tpu")
    xd = torch.randn(N, device=DEV)
    out = step(xd, torch.tensor(2.0, device=DEV))
    del out
    second = step(xd, torch.tensor(3.0, device=DEV))  # drains the free: the first result's buffer is spare
    assert second.shape == (N,)
    assert storage.SPARES.nbytes >= N * 4
    assert MOD.memory_reserved() >= MOD.memory_allocated() + N * 4
    MOD.empty_cache()
    assert storage.SPARES.nbytes == 0
    assert MOD.memory_reserved() == MOD.memory_allocated()


def _two(x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.sin(x) * k, torch.cos(x[: N // 2]) * k  # two shapes: two kinds of spare


def test_outputs_with_a_spare_reuse_it_when_others_have_none() -> None:
    # The caller keeps every second result: one of the two large outputs finds a spare each call, the
    # other never does (a training step whose logits outlive it). The one that can is still recycled.
    step = torch.compile(_two, backend="tpu")
    x = torch.randn(N)
    xd = x.to(DEV)
    kept = []
    before = metrics()["recycled_outputs"]
    for i in range(5):
        k = torch.tensor(float(i + 1))
        a, b = step(xd, k.to(DEV))  # the previous `a` is freed by this assignment: a spare
        kept.append(b)
    assert metrics()["recycled_outputs"] - before >= 2  # was 0 when every output had to find a spare
    for i, b in enumerate(kept):
        torch.testing.assert_close(b.cpu(), torch.cos(x[: N // 2]) * (i + 1))
    a, _ = step(xd, torch.tensor(7.0, device=DEV))
    torch.testing.assert_close(a.cpu(), torch.sin(x) * 7)


def _transposed(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return (x * k).t().contiguous()


def test_a_program_that_copies_anyway_still_reuses_buffers() -> None:
    # XLA writes the transpose as a `copy` instruction whether or not the output goes into a spare: only
    # copies the donation adds count against it (its baseline is the same program without spares).
    step = torch.compile(_transposed, backend="tpu")
    x = torch.randn(2048, N // 2048)
    before = metrics()["recycled_outputs"]
    for i in range(4):
        out = step(x.to(DEV), torch.tensor(float(i + 1), device=DEV))
        torch.testing.assert_close(out.cpu(), (x * (i + 1)).t().contiguous())
    assert metrics()["recycled_outputs"] - before >= 2


def test_only_shapes_a_program_writes_are_kept() -> None:
    # Kept buffers of other shapes would only stop the C allocator from reusing their memory (eager and
    # fused training steps ran 1.3x and 1.9x slower with every freed buffer kept).
    x = torch.ones(N + 4096).to(DEV)  # copied from the host: no program writes this shape
    del x
    (torch.ones(4, device=DEV) + 1).cpu()  # the next ops drain the free
    assert storage.SPARES.nbytes == 0
    step = torch.compile(_fn, backend="tpu")
    out = step(torch.ones(N).to(DEV), torch.tensor(2.0, device=DEV))  # a compiled program writes (N,) float32
    y = torch.ones(N).to(DEV)
    del y, out
    (torch.ones(4, device=DEV) + 1).cpu()
    assert storage.SPARES.nbytes >= N * 4


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_eager_outputs_reuse_freed_buffers_and_match_cpu() -> None:
    # An eager op's large result is written into the buffer a freed result of its shape held: the
    # steady state maps no new pages (each fresh 12 MiB output was 3,072 page faults).
    x = torch.randn(N)
    xd = x.to(DEV)
    before = torchbridge.metrics()["recycled_outputs"]
    faults = []
    for i in range(6):
        k = float(i + 1)
        f0 = _minor_faults()
        out = torch.sin(xd) * k  # sin's result is freed after the product, the previous `out` by this assignment
        MOD.synchronize()
        faults.append(_minor_faults() - f0)
        torch.testing.assert_close(out.cpu(), torch.sin(x) * k)
    assert torchbridge.metrics()["recycled_outputs"] - before >= 6
    pages = N * 4 // 4096
    assert max(faults[3:]) < pages // 4, faults  # two fresh outputs a call without spares


def test_live_eager_results_are_never_written_over() -> None:
    x = torch.randn(N)
    xd = x.to(DEV)
    kept = [torch.cos(xd) * float(i + 1) for i in range(4)]  # each cos result freed, each product kept
    view = kept[1][: N // 2]
    del kept[1]
    kept.append(torch.cos(xd) * 9.0)
    for out, k in zip(kept, (1.0, 3.0, 4.0, 9.0), strict=True):
        torch.testing.assert_close(out.cpu(), torch.cos(x) * k)
    torch.testing.assert_close(view.cpu(), (torch.cos(x) * 2.0)[: N // 2])
