"""PyTorch semantics on the device, each checked against the same code on the CPU.

Views and in-place writes, type promotion, out= arguments, 0-dim/empty/non-contiguous tensors, every
dtype, printing, device-mismatch and unsupported-op errors, CPU fallback, scalar recompilation, the
`torch.<device>` module and renaming the device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

from torchbridge.device import fallback, metrics  # noqa: E402

DEV = torchbridge.device_name()


def _to(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


def _assert_same(got: Any, ref: Any) -> None:
    if isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.device.type == DEV, got.device
        assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
        assert got.shape == ref.shape, (got.shape, ref.shape)
        got = got.cpu()
        if ref.dtype.is_floating_point:
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6, equal_nan=True)
        else:
            assert torch.equal(got, ref), (got, ref)
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref)
        for g, r in zip(got, ref, strict=True):
            _assert_same(g, r)
    else:
        assert got == ref


def check(fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn` on CPU arguments and on device copies of them; results and mutated inputs must match."""
    dev_args = [_to(a, DEV) for a in args]
    ref = fn(*args)
    got = fn(*dev_args)
    _assert_same(got, ref)
    for d, c in zip(dev_args, args, strict=True):
        if isinstance(c, torch.Tensor):
            _assert_same(d, c)


# ---- views alias storage ---------------------------------------------------------------------


def _base() -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(4, 6)


VIEW_WRITES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}


def _view_write(name: str) -> Callable[[Callable[[torch.Tensor], torch.Tensor]], Callable[[torch.Tensor], torch.Tensor]]:
    def deco(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        VIEW_WRITES[name] = fn
        return fn

    return deco


@_view_write("slice_assign")
def _slice_assign(b: torch.Tensor) -> tuple:
    v = b[1:3, ::2]
    v[:, 1] = -1.0
    b[0, 2:4] = torch.tensor([7.0, 8.0], device=b.device)
    return v, b[:, 2]


@_view_write("index_put_")
def _index_put(b: torch.Tensor) -> tuple:
    v = b[1:]
    idx = torch.tensor([0, 2], device=b.device)
    v.index_put_((idx, torch.tensor([5, 1], device=b.device)), torch.tensor([-3.0, -4.0], device=b.device))
    return v, b.view(-1)


@_view_write("index_copy_")
def _index_copy(b: torch.Tensor) -> tuple:
    v = b.t()
    v.index_copy_(0, torch.tensor([4, 1], device=b.device), torch.full((2, 4), 9.0, device=b.device))
    return v, b[2]


@_view_write("masked_fill_")
def _masked_fill(b: torch.Tensor) -> tuple:
    v = b[:, 1:5]
    v.masked_fill_(v > 10, 0.5)
    return v, b.reshape(2, 12)


@_view_write("through_t")
def _through_t(b: torch.Tensor) -> tuple:
    v = b.t()
    v[2].mul_(10)
    v.add_(1)
    return v, b


@_view_write("through_view")
def _through_view(b: torch.Tensor) -> tuple:
    v = b.view(2, 12)
    v[1, 3:7] = 100.0
    w = v.view(-1)
    w[0] = -5.0
    return v, w, b


@_view_write("through_unsqueeze")
def _through_unsqueeze(b: torch.Tensor) -> tuple:
    v = b.unsqueeze(0).unsqueeze(-1)
    v[0, 3, :, 0].sub_(50)
    return v, b


@_view_write("narrow")
def _narrow(b: torch.Tensor) -> tuple:
    v = b.narrow(1, 2, 3)
    v.zero_()
    w = b.narrow(0, 1, 2)
    w.fill_(2.5)
    return v, w, b


@_view_write("as_strided")
def _as_strided(b: torch.Tensor) -> tuple:
    diag = b.as_strided((4,), (7,), 0)  # the main diagonal of the 4x6 matrix
    diag.copy_(torch.tensor([-1.0, -2.0, -3.0, -4.0], device=b.device))
    overlapping = b.as_strided((3, 3), (1, 1), 10)  # overlapping windows read through one storage
    return diag, overlapping.clone(), b


@pytest.mark.parametrize("name", list(VIEW_WRITES))
def test_inplace_writes_visible_through_views_and_base(name: str) -> None:
    check(VIEW_WRITES[name], _base())


def test_views_share_storage_and_see_later_writes() -> None:
    b = _base().to(DEV)
    views = [b.t(), b.view(24), b[1:, 2:], b.unsqueeze(1), b.narrow(1, 1, 2), b.as_strided((2, 2), (6, 1), 7)]
    for v in views:
        assert v.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    b.mul_(-1)  # a write to the base after the views were taken
    ref = _base().mul(-1)
    ref_views = [ref.t(), ref.view(24), ref[1:, 2:], ref.unsqueeze(1), ref.narrow(1, 1, 2),
                 ref.as_strided((2, 2), (6, 1), 7)]
    for v, r in zip(views, ref_views, strict=True):
        _assert_same(v, r)


def test_inplace_on_view_updates_autograd_base() -> None:
    def fn(x: torch.Tensor) -> tuple:
        w = x.clone().requires_grad_()
        y = w * 2
        y[1:3].mul_(3)  # in-place on a view of a non-leaf: autograd rebases the view
        y.sum().backward()
        return y.detach(), w.grad

    check(fn, torch.randn(5))


# ---- type promotion --------------------------------------------------------------------------

PROMOTIONS: dict[str, Callable[..., Any]] = {
    "int_plus_float": lambda: (torch.arange(5), torch.linspace(0, 1, 5)),
    "int32_plus_int64": lambda: (torch.arange(5, dtype=torch.int32), torch.arange(5, dtype=torch.int64) * 2**33),
    "bool_plus_bool": lambda: (torch.tensor([True, False, True]), torch.tensor([True, True, False])),
    "bool_plus_int": lambda: (torch.tensor([True, False, True]), torch.tensor([3, 4, 5], dtype=torch.int8)),
    "half_plus_float_scalar": lambda: (torch.tensor([1.5, 2.25, -3.0], dtype=torch.float16), 2.1),
    "bf16_times_float_scalar": lambda: (torch.tensor([1.5, 2.25, -3.0], dtype=torch.bfloat16), 1.3),
    "half_plus_float32_0dim": lambda: (torch.tensor([1.5, 2.25, -3.0], dtype=torch.float16), torch.tensor(0.1)),
    "int_plus_float_0dim": lambda: (torch.arange(4, dtype=torch.int32), torch.tensor(2.5, dtype=torch.float64)),
    "float32_plus_float64_0dim": lambda: (torch.linspace(0, 1, 4), torch.tensor(1 / 3, dtype=torch.float64)),
    "float32_0dim_plus_int_dim": lambda: (torch.tensor(0.5), torch.arange(3, dtype=torch.int16)),
    "uint8_plus_int8": lambda: (torch.tensor([250, 3], dtype=torch.uint8), torch.tensor([-1, 7], dtype=torch.int8)),
    "int_plus_int_scalar": lambda: (torch.arange(4, dtype=torch.int16), 3),
    "int_plus_float_scalar": lambda: (torch.arange(4, dtype=torch.int64), 0.5),
    "bool_plus_float_scalar": lambda: (torch.tensor([True, False]), 1.5),
}


@pytest.mark.parametrize("name", list(PROMOTIONS))
@pytest.mark.parametrize("op", ["add", "mul", "sub"])
def test_type_promotion(name: str, op: str) -> None:
    a, b = PROMOTIONS[name]()
    if op == "sub" and (a.dtype == torch.bool or (isinstance(b, torch.Tensor) and b.dtype == torch.bool)):
        pytest.skip("PyTorch rejects subtraction of bool tensors (checked separately)")
    check(getattr(torch, op), a, b)


def test_bool_subtraction_error_matches_cpu() -> None:
    a = torch.tensor([True, False])
    with pytest.raises(RuntimeError, match="Subtraction, the `-` operator, with two bool tensors"):
        a - a
    with pytest.raises(RuntimeError, match="Subtraction, the `-` operator, with two bool tensors"):
        a.to(DEV) - a.to(DEV)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8])
def test_int_true_division_gives_float(dtype: torch.dtype) -> None:
    a = torch.tensor([7, 9, 100, 3], dtype=dtype)
    b = torch.tensor([2, 4, 7, 3], dtype=dtype)
    check(torch.div, a, b)
    check(lambda x: x / 4, a)
    check(lambda x, y: torch.div(x, y, rounding_mode="floor"), a, b)
    check(lambda x, y: torch.div(x, y, rounding_mode="trunc"), a, b)


def test_inplace_promotion_rules() -> None:
    check(lambda x: x.add_(2.5), torch.arange(4, dtype=torch.float16))
    # Writing a float result into an int tensor in place is refused, as on CPU.
    for device in ("cpu", DEV):
        x = torch.arange(4, device=device)
        with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
            x.add_(torch.tensor([0.5, 1, 2, 3], device=device))


# ---- out= --------------------------------------------------------------------------------------


def test_out_into_preallocated_tensor() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple:
        r = torch.add(a, b, out=out)
        assert r is out
        return r

    check(fn, torch.randn(3, 4), torch.randn(4), torch.empty(3, 4))


def test_out_resizes_empty_tensor() -> None:
    def fn(a: torch.Tensor, out: torch.Tensor) -> tuple:
        torch.mul(a, 3, out=out)
        torch.exp(a, out=out)
        return out

    check(fn, torch.randn(2, 5), torch.empty(0))


def test_storage_resize_keeps_the_bytes_that_survive() -> None:
    """untyped_storage().resize_ as FSDP2 uses it (free with resize_(0), regrow, fill through a view) and
    as growing, shrinking and same-size resizes keep the written prefix, against the CPU. Bytes a grown
    storage adds are uninitialised in PyTorch, so only the written ones are compared."""
    def fn(a: torch.Tensor, src: torch.Tensor) -> tuple:
        freed = a.clone()
        st = freed.untyped_storage()
        st.resize_(0)
        st.resize_(src.numel() * src.element_size())
        freed.copy_(src)
        grown = a.clone()
        grown.untyped_storage().resize_(grown.numel() * grown.element_size() * 2)
        shrunk = a.clone()
        shrunk.untyped_storage().resize_(shrunk.element_size() * 3)
        same = a.clone()
        same.untyped_storage().resize_(same.numel() * same.element_size())
        same.add_(1)
        return freed, grown, torch.empty(0, device=a.device).set_(shrunk.untyped_storage(), 0, (3,)), same

    check(fn, torch.randn(8), torch.randn(8))


def test_out_into_non_contiguous_view_writes_base() -> None:
    def fn(a: torch.Tensor, base: torch.Tensor) -> tuple:
        out = base[:, ::2]
        torch.sub(a, 1, out=out)
        return out, base

    check(fn, torch.randn(3, 2), torch.zeros(3, 4))


def test_out_dtype_errors_match_cpu() -> None:
    # Same refusal as on CPU; the device's wording comes from PyTorch's meta kernel, not the CPU kernel.
    for device in ("cpu", DEV):
        out = torch.full((3,), 5, dtype=torch.int64, device=device)
        with pytest.raises(RuntimeError, match="can't be cast"):
            torch.add(torch.randn(3, device=device), 1, out=out)
        assert out.cpu().tolist() == [5, 5, 5]


def test_out_with_sum_and_matmul() -> None:
    check(lambda a, o: torch.sum(a, 1, out=o), torch.randn(3, 4), torch.empty(0))
    check(lambda a, b, o: torch.mm(a, b, out=o), torch.randn(3, 4), torch.randn(4, 2), torch.empty(3, 2))


# ---- 0-dim, empty, non-contiguous ----------------------------------------------------------------


def test_zero_dim_tensors() -> None:
    check(lambda a, b: (a + b, a * 2, (a > b), a.neg(), a.exp()), torch.tensor(1.5), torch.tensor(-2.0))
    check(lambda a, b: a + b, torch.tensor(3), torch.randn(2, 3))
    x = torch.tensor(2.75, device=DEV)
    assert x.dim() == 0 and x.item() == 2.75 and float(x) == 2.75
    assert int(torch.tensor(7, device=DEV)) == 7
    assert bool(torch.tensor(True, device=DEV)) is True


def test_cpu_zero_dim_tensor_is_accepted_as_scalar() -> None:
    check(lambda a: a * torch.tensor(3.0), torch.randn(2, 2))
    d = torch.randn(2, 2)
    _assert_same(d.to(DEV) + torch.tensor(1.5), d + torch.tensor(1.5))


def test_empty_tensors() -> None:
    check(lambda a: (a + 1, a.sum(), a.sum(0), a * a, a.t().contiguous()), torch.empty(0, 3))
    check(lambda a, b: torch.cat([a, b]), torch.empty(0, 3), torch.randn(2, 3))
    check(lambda a: a.mean(), torch.empty(0))
    e = torch.empty(0, 4, device=DEV)
    assert e.cpu().shape == (0, 4) and e.numel() == 0


def test_non_contiguous_inputs() -> None:
    a = torch.randn(4, 6)
    b = torch.randn(6, 4)
    check(lambda x, y: x.t() + y, a, b)
    check(lambda x: x[:, ::2] * 2, a)
    check(lambda x: x[1:, 1::3].exp(), a)
    check(lambda x: x.unsqueeze(1).expand(4, 3, 6) - 1, a)
    check(lambda x: x.reshape(2, 2, 6).permute(2, 0, 1).sum(0), a)
    check(lambda x, y: x.t() @ y.t(), b, a)
    check(lambda x: x.t().contiguous(), a)
    check(lambda x: torch.flip(x, [0])[::2].clone(), a)


# ---- dtypes ------------------------------------------------------------------------------------

ALL_DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
              torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _sample(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.tensor([True, False, True, True, False, False])
    if dtype.is_floating_point:
        return torch.tensor([-2.5, 0.0, 1.25, 3.0, -0.5, 7.75], dtype=dtype)
    info = torch.iinfo(dtype)
    vals = [info.min, info.max, 0, 1, -1 if info.min < 0 else 2, 5]
    return torch.tensor(vals, dtype=dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_round_trip_and_ops(dtype: torch.dtype) -> None:
    x = _sample(dtype)
    d = x.to(DEV)
    assert d.dtype == dtype and d.device.type == DEV
    assert torch.equal(d.cpu(), x)
    y = torch.flip(x, [0])
    if dtype == torch.bool:
        check(lambda a, b: (a & b, a | b, a ^ b, ~a, a == b, a.sum()), x, y)
    else:
        check(lambda a, b: (a + b, a * b, a - b, a == b, a < b, torch.maximum(a, b), a.sum(), a.abs()), x, y)
    check(lambda a: (a.to(torch.float32), a.to(torch.int64), a.to(torch.bool)), x)


def test_int64_stays_64_bit() -> None:
    big = torch.tensor([2**53 + 1, -(2**62) + 7, 2**31 + 5, 2**63 - 1], dtype=torch.int64)
    d = big.to(DEV)
    assert torch.equal(d.cpu(), big)
    check(lambda a: (a + 1, a - 3, a // 2, a * 1, a.max(), a[:3] * 2), big)
    assert d[0].item() == 2**53 + 1
    assert torch.arange(2**40, 2**40 + 3, device=DEV).cpu().tolist() == [2**40, 2**40 + 1, 2**40 + 2]
    full = torch.full((2,), 2**53 + 3, dtype=torch.int64, device=DEV)
    assert full.cpu().tolist() == [2**53 + 3] * 2


def test_float64_stays_64_bit() -> None:
    x = torch.tensor([1 + 2**-40, 1e300, 1 / 3, 2**53 + 2.0], dtype=torch.float64)
    d = x.to(DEV)
    assert torch.equal(d.cpu(), x)
    check(lambda a: (a * 3, a - 1, a.sum(), a / 7), x)
    assert (d[0] - 1).item() == 2**-40
    assert torch.tensor(1e-310, dtype=torch.float64, device=DEV).item() == 1e-310


def test_reinterpreting_views_across_dtypes() -> None:
    check(lambda a: a.view(torch.int32), torch.randn(4))
    check(lambda a: a.view(torch.uint8), torch.tensor([1, 256, -1], dtype=torch.int32))


# ---- printing -----------------------------------------------------------------------------------


def test_repr_and_print_show_device() -> None:
    t = torch.tensor([[1.5, -2.0], [0.25, 4.0]], device=DEV)
    text = repr(t)
    assert f"device='{DEV}:0'" in text
    assert "1.5000" in text and "-2.0000" in text
    assert str(torch.tensor(3, device=DEV)) == f"tensor(3, device='{DEV}:0')"
    assert "dtype=torch.int8" in repr(torch.tensor([1, 2], dtype=torch.int8, device=DEV))
    assert repr(torch.empty(0, device=DEV)) == f"tensor([], device='{DEV}:0')"
    big = torch.arange(2000, dtype=torch.float32, device=DEV)
    assert "..." in repr(big)  # summarised printing reads only parts of the tensor
    print(t, t.t(), t[0])


# ---- errors -------------------------------------------------------------------------------------


def test_mixing_cpu_tensor_raises_like_cuda() -> None:
    d = torch.randn(3, device=DEV)
    c = torch.randn(3)
    for fn in (lambda: d + c, lambda: c * d, lambda: torch.mm(d.view(3, 1), c.view(1, 3)),
               lambda: torch.where(d > 0, d, c)):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            fn()


_lib = torch.library.Library("tbsemantics", "DEF")  # noqa: TOR901
_lib.define("unlowered(Tensor x) -> Tensor")
_lib.impl("unlowered", lambda x: x * 2 + 1, "CPU")


def test_unsupported_op_error_names_op_and_switch() -> None:
    # A custom op with only a CPU kernel: it has no lowering and no decomposition on any backend.
    x = torch.randn(4, device=DEV)
    assert not fallback.cpu_fallback_enabled()
    with pytest.raises(NotImplementedError) as err:
        torch.ops.tbsemantics.unlowered(x)
    msg = str(err.value)
    assert "tbsemantics.unlowered" in msg
    assert "set_cpu_fallback" in msg and "TORCHBRIDGE_CPU_FALLBACK" in msg


def test_cpu_fallback_runs_warns_once_and_counts() -> None:
    x = torch.randn(4)
    d = x.to(DEV)
    before = metrics.metrics()["cpu_fallbacks"].get("tbsemantics.unlowered.default", 0)
    fallback.set_cpu_fallback(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = torch.ops.tbsemantics.unlowered(d)
            second = torch.ops.tbsemantics.unlowered(d + 1)
    finally:
        fallback.set_cpu_fallback(False)
    mine = [w for w in caught if "tbsemantics.unlowered" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "CPU" in str(mine[0].message)
    _assert_same(first, x * 2 + 1)
    _assert_same(second, (x + 1) * 2 + 1)
    after = metrics.metrics()["cpu_fallbacks"].get("tbsemantics.unlowered.default", 0)
    assert after - before == 2


# ---- compilation cache ----------------------------------------------------------------------------


def test_new_python_scalar_does_not_recompile() -> None:
    x = torch.randn(5, 3, device=DEV)
    r1 = x + 1.0
    before = metrics.metrics()["compiles"]
    r2 = x + 2.0
    r3 = x * 0.5
    r4 = x * 7.25
    assert metrics.metrics()["compiles"] == before + 1  # only the first mul compiles
    xc = x.cpu()
    for got, ref in ((r1, xc + 1.0), (r2, xc + 2.0), (r3, xc * 0.5), (r4, xc * 7.25)):
        _assert_same(got, ref)


# ---- torch.<device> module -----------------------------------------------------------------------


def test_device_module_functions() -> None:
    mod = getattr(torch, DEV)
    assert mod.is_available()
    assert mod.device_count() == 8  # tests/conftest.py emulates 8 chips
    assert mod.current_device() == 0
    assert isinstance(mod.get_device_name(), str) and mod.get_device_name()
    mod.set_device(2)
    try:
        assert mod.current_device() == 2
        assert torch.empty(3, device=DEV).device == torch.device(DEV, 2)
    finally:
        mod.set_device(0)
    assert mod.current_device() == 0
    y = torch.randn(100, device=DEV) * 3
    mod.synchronize()
    assert y.device.type == DEV


def test_device_module_manual_seed_reproduces() -> None:
    mod = getattr(torch, DEV)
    mod.manual_seed(123)
    a = torch.rand(8, device=DEV).cpu()
    b = torch.rand(8, device=DEV).cpu()
    mod.manual_seed(123)
    assert torch.equal(torch.rand(8, device=DEV).cpu(), a)
    assert not torch.equal(a, b)
    assert ((a >= 0) & (a < 1)).all()


def test_memory_allocated_tracks_tensors() -> None:
    mod = getattr(torch, DEV)
    dev_index = 5  # a chip no other test allocates on
    base = mod.memory_allocated(dev_index)
    t = torch.empty(1024, 256, dtype=torch.float32, device=f"{DEV}:{dev_index}")
    assert mod.memory_allocated(dev_index) >= base + 1024 * 256 * 4
    assert mod.max_memory_allocated(dev_index) >= base + 1024 * 256 * 4
    del t
    assert mod.memory_allocated(dev_index) == base
    assert mod.max_memory_allocated(dev_index) >= base + 1024 * 256 * 4


def test_device_name_from_environment() -> None:
    code = (
        "import torch, torchbridge\n"
        "x = torch.ones(2, device='neuron')\n"
        "y = (x * 3).cpu()\n"
        "assert y.tolist() == [3.0, 3.0], y\n"
        "assert x.device.type == 'neuron'\n"
        "assert hasattr(torch, 'neuron') and torch.neuron.is_available()\n"
        "assert torchbridge.device_name() == 'neuron'\n"
        "print('ok', repr(x))\n"
    )
    env = dict(os.environ, TORCHBRIDGE_DEVICE_NAME="neuron")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "device='neuron:0'" in res.stdout


def test_pinned_memory_and_non_blocking_copies() -> None:
    """`pin_memory()`, `.to(..., non_blocking=True)` both ways, and DataLoader(pin_memory=True), as a
    CUDA training loop uses them."""
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(4, 5)
    pinned = x.pin_memory()
    assert pinned.is_pinned() and not x.is_pinned()
    torch.testing.assert_close(pinned, x)
    on_dev = pinned.to(DEV, non_blocking=True)
    back = on_dev.mul(2).to("cpu", non_blocking=True)
    getattr(torch, DEV).synchronize()
    torch.testing.assert_close(back, x * 2)
    data = torch.arange(12.0).reshape(6, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # older spellings of the pin-memory device are deprecated
        batches = [b.to(DEV, non_blocking=True).sum().item()
                   for (b,) in DataLoader(TensorDataset(data), batch_size=3, pin_memory=True)]
    assert batches == [data[:3].sum().item(), data[3:].sum().item()]
