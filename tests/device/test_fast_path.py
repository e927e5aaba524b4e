"""The eager fast path (a repeat call runs its cached program straight from a C++-built key) keeps
PyTorch's semantics. Each scenario runs several times, so the first call takes the general path and
the later ones the fast path, and every result is compared with the same code on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()
_FUSED = pytest.mark.skipif(
    torchbridge.metrics()["eager_mode"] == "fused",
    reason="fused eager mode records ops instead of taking the fast path (its counters stay still)",
)


def _repeat_matches_cpu(fn: Callable[[str, int], torch.Tensor], times: int = 4) -> None:
    for i in range(times):
        got, ref = fn(DEV, i), fn("cpu", i)
        assert got.device.type == DEV
        torch.testing.assert_close(got.cpu(), ref, rtol=1e-6, atol=1e-6)


def _data(i: int, *shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) * (i + 1) / 7 - 3


@_FUSED
def test_repeat_calls_take_the_fast_path_without_new_programs():
    a, b = _data(0, 5, 6).to(DEV), _data(1, 5, 6).to(DEV)
    (a + b).cpu()
    before = torchbridge.metrics()
    for _ in range(5):
        out = a + b
    assert torchbridge.metrics()["compiles"] == before["compiles"]
    assert torchbridge.metrics()["fast_path_entries"] >= 1
    assert torchbridge.metrics()["fast_path_hits"] >= before["fast_path_hits"] + 5
    torch.testing.assert_close(out.cpu(), _data(0, 5, 6) + _data(1, 5, 6))


def test_tensor_lists_on_the_fast_path():
    """cat/stack and _foreach_ ops key each list item like a tensor argument; a list naming one
    storage twice, or a view of another item's storage, is a different key."""
    def fn(dev: str, i: int) -> torch.Tensor:
        a, b = _data(i, 4, 3).to(dev), _data(i + 1, 2, 3).to(dev)
        parts = [a, b * (i + 1)] if i % 2 == 0 else [a, a[:2]]
        out = torch.cat(parts, 0)
        stacked = torch.stack([out, out, out.flip(0)])
        params = [stacked[0].clone(), stacked[1].clone()]
        torch._foreach_add_(params, [stacked[2], params[0]], alpha=0.5)
        return torch.cat([stacked.sum(0), *params])

    _repeat_matches_cpu(fn, times=6)


@_FUSED
def test_lists_and_fresh_storages_are_served_in_cpp():
    a, b = _data(0, 4, 3).to(DEV), _data(1, 4, 3).to(DEV)
    for _ in range(2):
        torch.cat([a, b]).cpu()
        torch.zeros(3, 3, device=DEV).cpu()
    before = torchbridge.metrics()
    out = torch.cat([a, b])
    z = torch.zeros(3, 3, device=DEV)  # empty (a storage never written), then fill_
    after = torchbridge.metrics()
    assert after["fast_path_hits"] == before["fast_path_hits"] + 2  # cat, and fill_ into the fresh storage
    assert after["compiles"] == before["compiles"]
    torch.testing.assert_close(out.cpu(), torch.cat([_data(0, 4, 3), _data(1, 4, 3)]))
    torch.testing.assert_close(z.cpu(), torch.zeros(3, 3))


def test_zero_of_a_never_written_storage_is_free_and_of_a_written_one_zeroes_it():
    """zero_ on a storage nobody wrote is served as a no-op (it reads as zeros already: autograd's zero
    gradient for an unused output); the same remembered entry must still zero a written storage."""
    for i in range(4):
        fresh = torch.empty(6, 5, device=DEV).zero_()
        written = (_data(i, 6, 5) + 1.0).to(DEV).zero_()
        torch.testing.assert_close(fresh.cpu(), torch.zeros(6, 5))
        torch.testing.assert_close(written.cpu(), torch.zeros(6, 5))
        fresh.add_(i)  # and it is an ordinary storage afterwards
        torch.testing.assert_close(fresh.cpu(), torch.full((6, 5), float(i)))


class _TwoOutputs(torch.autograd.Function):
    """Like a compiled model returning (loss, logits): autograd hands its backward zeros for the
    output nobody used."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0, x * 3.0

    @staticmethod
    def backward(ctx, g_used, g_unused):
        return g_used * 2.0 + g_unused * 3.0


def test_zero_gradient_of_an_unused_output_matches_cpu():
    for dev in (DEV, "cpu"):
        x = _data(0, 4, 3).to(dev).requires_grad_()
        for _ in range(3):
            used, _unused = _TwoOutputs.apply(x)
            used.sum().backward()
        if dev == DEV:
            got = x.grad.cpu()
    torch.testing.assert_close(got, x.grad)


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


# In-place writes into storages of 1 MiB and more donate the old buffer, so XLA updates it in place.
# These check that a donated buffer is never one that something else still reads.

def test_kv_cache_style_writes_into_a_large_storage():
    before = torchbridge.metrics()["donated_writes"]

    def fn(dev: str, i: int) -> torch.Tensor:
        cache = torch.zeros(2048, 4, 64, device=dev)  # 2 MiB
        view = cache[:, 1]  # a view of the same storage, alive across the writes
        for step in range(3):
            idx = torch.tensor([step, 100 + step, 2000 - step], device=dev)
            cache.index_copy_(0, idx, torch.full((3, 4, 64), float(step + i), device=dev))
            view.mul_(1.5)
        return cache

    _repeat_matches_cpu(fn)
    if torchbridge.metrics()["eager_mode"] != "fused":  # fused mode composes programs instead
        assert torchbridge.metrics()["donated_writes"] > before  # the in-place path was really taken


def test_large_storage_sharing_a_buffer_is_not_donated():
    a = torch.arange(2048 * 256, dtype=torch.float32).reshape(2048, 256).to(DEV)
    b = torch.empty_like(a)
    b.copy_(a)  # may share a's immutable buffer
    snapshot = a.cpu()
    for step in range(3):
        a.index_fill_(0, torch.tensor([step], device=DEV), -1.0)
    torch.testing.assert_close(b.cpu(), snapshot)
    ref = snapshot.clone()
    ref[:3] = -1.0
    torch.testing.assert_close(a.cpu(), ref)


def test_write_into_a_byte_storage_of_another_dtype_is_correct_and_not_donated():
    """FSDP2 all-gathers into a uint8 storage viewed as float32: the written buffer comes out as float32
    and cannot take the old byte buffer's place, so the program must not ask JAX to donate it (JAX
    warned "Some donated buffers were not usable" at every such write)."""
    import warnings

    src = torch.randn(512, 1024)
    raw = torch.zeros(512 * 1024 * 4, dtype=torch.uint8, device=DEV)  # 2 MiB
    view = raw.view(torch.float32).view(512, 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            view.add_(src.to(DEV))
    torch.testing.assert_close(view.cpu(), src * 3)
    torch.testing.assert_close(raw.cpu(), (src * 3).view(torch.uint8).flatten())


def test_result_still_pending_when_its_input_is_overwritten():
    x = torch.randn(1024, 512).to(DEV)
    ref_x = x.cpu()
    total = x.sum(0)  # reads x's buffer; x is then written in place several times
    for _ in range(3):
        x.add_(1.0)
    getattr(torch, DEV).synchronize()
    torch.testing.assert_close(total.cpu(), ref_x.sum(0), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(x.cpu(), ref_x + 3.0)


@_FUSED
def test_fused_mode_records_the_fast_paths_repeat_calls():
    """In fused mode native.fast_call must record a remembered call, not run it: the recorder has to
    see every op, or a later read would miss its write. The remembered entry is shared by both modes."""
    a, b = _data(0, 4, 4).to(DEV), _data(1, 4, 4).to(DEV)
    for _ in range(2):
        (a * b).cpu()
    torchbridge.set_eager_mode("fused")
    try:
        before = torchbridge.metrics()
        out = a * b
        after = torchbridge.metrics()
        assert after["fast_path_hits"] == before["fast_path_hits"] + 1  # served in C++ ...
        assert after["fused"]["pending_ops"] == before["fused"]["pending_ops"] + 1  # ... and recorded
        assert after["compiles"] == before["compiles"]
        out.add_(1.0)
        torch.testing.assert_close(out.cpu(), _data(0, 4, 4) * _data(1, 4, 4) + 1.0)
        for _ in range(3):  # entries remembered in fused mode serve later repeats, still recorded
            out.mul_(2.0)
        torch.testing.assert_close(out.cpu(), (_data(0, 4, 4) * _data(1, 4, 4) + 1.0) * 8.0)
    finally:
        torchbridge.set_eager_mode("eager")
    before = torchbridge.metrics()["fast_path_hits"]
    torch.testing.assert_close((a * b).cpu(), _data(0, 4, 4) * _data(1, 4, 4))
    assert torchbridge.metrics()["fast_path_hits"] > before


def test_conjugate_view_after_a_plain_entry_with_the_same_layout():
    """mm sees conj views unresolved; the key carries the conj/neg bits so a plain call's program is
    not reused for them."""
    def fn(dev: str, i: int) -> torch.Tensor:
        a = torch.complex(_data(i, 3, 3), _data(i + 2, 3, 3)).to(dev)
        b = torch.complex(_data(i + 1, 3, 3), -_data(i, 3, 3)).to(dev)
        return torch.mm(a.conj() if i % 2 else a, b) + torch.mm(a, torch._neg_view(b) if i % 3 == 2 else b)

    _repeat_matches_cpu(fn, times=6)


def test_zero_buffers_are_shared_up_to_a_size_and_the_cache_is_bounded():
    from torchbridge.device import storage
    from torchbridge.device.runtime import STATE

    dev = STATE.jax_device(0)
    small = storage.zeros(1000, "float32", dev)
    assert storage.zeros(1000, "float32", dev) is small  # fresh storages of one size share it
    big = storage.ZERO_CACHE_MAX // 4 + 1
    assert storage.zeros(big, "float32", dev) is not storage.zeros(big, "float32", dev)  # not kept
    assert sum(b.nbytes for b in storage._zero_cache.values()) <= storage.ZERO_CACHE_BYTES
    assert not bool(storage.zeros(1000, "float32", dev).any())


# ---- one key builder, named structures ----------------------------------------------------------

def _general_path_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    from torchbridge.device import dispatch

    seen = []
    run = dispatch.run

    def spy(op, args, kwargs, *rest, **kw):
        seen.append((op, args, kwargs))
        return run(op, args, kwargs, *rest, **kw)

    monkeypatch.setattr(dispatch, "run", spy)
    return seen


def test_the_general_path_keys_programs_by_the_cpp_key(monkeypatch: pytest.MonkeyPatch):
    """One builder: the key fast_call builds in C++ is the key the general path finds its program by
    (with the buffers' dtypes and the device), and the fast entry it remembers is under the same key."""
    from torchbridge.device import dispatch, native

    seen = _general_path_calls(monkeypatch)
    a, b = _data(0, 7, 11).to(DEV), _data(1, 7, 11).to(DEV)  # a shape no other test uses: a miss
    torch.testing.assert_close((a * b).cpu(), _data(0, 7, 11) * _data(1, 7, 11))
    op, args, kwargs = next(c for c in seen if c[0] is torch.ops.aten.mul.Tensor)
    info = dispatch.op_info(op)
    key = native.load().signature(id(op), args, kwargs, info.dynamic_pos, info.dynamic)[0]
    assert (key, (np.dtype("float32"),) * 2, 0) in dispatch._programs  # two storages, device 0
    if torchbridge.metrics()["eager_mode"] == "eager":
        assert key in dispatch._fast


def test_a_walk_that_disagrees_with_the_key_is_an_error(monkeypatch: pytest.MonkeyPatch):
    """The fast path hands a program its scalars in the key's order: if the encoding a program is
    traced from ever walked the arguments in another order, the first call says so."""
    from torchbridge.device import dispatch

    encode = dispatch._encode_call

    def reversed_scalars(info, args, kwargs):
        call, pos, kw = encode(info, args, kwargs)
        call.scalars.reverse()
        return call, pos, kw

    monkeypatch.setattr(dispatch, "_encode_call", reversed_scalars)
    x = _data(0, 3, 13).to(DEV)
    with pytest.raises(RuntimeError, match=r"aten\.add\.\w+: .*walked the arguments in different orders"):
        torch.add(x, 2.5, alpha=3)


def test_fast_entries_and_hooks_take_names_not_positions():
    """What C++ reads from Python is passed by name, so a reordering cannot silently swap two fields."""
    from torchbridge.device import native

    mod = native.load()
    with pytest.raises(TypeError):
        mod.FastEntry(object(), [], 0, None, False, [], [], True, False)
    with pytest.raises(TypeError):
        mod.fast_setup({}, {}, object, object, {}, print, print, print, print, print, print, print)
