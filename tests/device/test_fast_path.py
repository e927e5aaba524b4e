"""The eager fast path (a repeat call runs its cached program straight from a C++-built key) keeps
PyTorch's semantics. Each scenario runs several times, so the first call takes the general path and
the later ones the fast path, and every result is compared with the same code on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()


def _repeat_matches_cpu(fn: Callable[[str, int], torch.Tensor], times: int = 4) -> None:
    for i in range(times):
        got, ref = fn(DEV, i), fn("cpu", i)
        assert got.device.type == DEV
        torch.testing.assert_close(got.cpu(), ref, rtol=1e-6, atol=1e-6)


def _data(i: int, *shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) * (i + 1) / 7 - 3


def test_repeat_calls_take_the_fast_path_without_new_programs():
    a, b = _data(0, 5, 6).to(DEV), _data(1, 5, 6).to(DEV)
    (a + b).cpu()
    before = torchbridge.metrics()
    for _ in range(5):
        out = a + b
    assert torchbridge.metrics()["compiles"] == before["compiles"]
    assert torchbridge.metrics()["fast_path_entries"] >= 1
    torch.testing.assert_close(out.cpu(), _data(0, 5, 6) + _data(1, 5, 6))


def test_new_scalar_values_on_the_fast_path():
    def fn(dev: str, i: int) -> torch.Tensor:
        x = _data(0, 4, 4).to(dev)
        return x.mul(0.5 + i).add(i, alpha=2.0 - i).clamp(min=-i)

    _repeat_matches_cpu(fn)


def test_aliasing_changes_the_key():
    def fn(dev: str, i: int) -> torch.Tensor:
        a, b = _data(i, 3, 3).to(dev), _data(i + 1, 3, 3).to(dev)
        # same layouts, but the second call reads one storage twice
        return a.add_(b) if i % 2 == 0 else a.add_(a)

    _repeat_matches_cpu(fn)


def test_in_place_through_views_on_the_fast_path():
    def fn(dev: str, i: int) -> torch.Tensor:
        base = _data(i, 4, 6).to(dev)
        for _ in range(3):
            base[:, 1::2].mul_(2).add_(1)
            base.t()[2].sub_(0.25)
        return base

    _repeat_matches_cpu(fn)


def test_out_argument_into_a_fresh_tensor():
    def fn(dev: str, i: int) -> torch.Tensor:
        out = torch.empty(3, 5, device=dev)
        torch.mul(_data(i, 3, 5).to(dev), 3, out=out)
        return out

    _repeat_matches_cpu(fn)


def test_dtype_punned_storage_takes_the_general_path():
    def fn(dev: str, i: int) -> torch.Tensor:
        x = torch.full((8,), 1.5 + i, device=dev)
        bits = x.view(torch.int32)
        bits.add_(1)  # one ulp up, through the int32 view of a float32 storage
        return x

    _repeat_matches_cpu(fn)


def test_random_ops_draw_fresh_values_and_reproduce_with_a_seed():
    x = torch.ones(64, 64, device=DEV)
    torch.manual_seed(3)
    first = [torch.nn.functional.dropout(x, 0.5).cpu() for _ in range(3)]
    assert not torch.equal(first[1], first[2])  # the fast path must not replay the same key
    torch.manual_seed(3)
    again = [torch.nn.functional.dropout(x, 0.5).cpu() for _ in range(3)]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_device_mismatch_still_raises_after_a_fast_entry_exists():
    a, b = torch.ones(2, 2, device=DEV), torch.ones(2, 2, device=DEV)
    for _ in range(2):
        a + b
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(2, 2)
