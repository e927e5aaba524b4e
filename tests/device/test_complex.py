"""Complex tensors on the device, each checked against the same code on the CPU.

Lazy conjugate and negative views (`x.conj()`, `x.conj().imag`: the conj/neg bits) used to send
PyTorch's math-bit fallback into endless recursion through `_copy_from` (a segfault); view_as_real and
view_as_complex had no device kernel, which also broke complex(), polar() and several FFTs. Eager,
autograd and torch.compile are covered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()
TOL = dict(atol=1e-4, rtol=1e-4)


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "z": torch.randn(3, 4, dtype=torch.complex64, generator=g),
        "w": torch.randn(4, 5, dtype=torch.complex64, generator=g),
        "z64": torch.randn(6, dtype=torch.complex128, generator=g),
        "r": torch.randn(8, generator=g),
        "r2": torch.randn(3, 8, generator=g),
    }


def _resolved(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg()


def _check(fn: Callable[[dict[str, torch.Tensor]], Any]) -> None:
    """fn on CPU tensors and on device copies gives the same values (bits resolved before comparing)."""
    cpu = _data()
    ref = fn(cpu)
    out = fn({k: v.to(DEV) for k, v in cpu.items()})
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    for o, r in zip(outs, refs, strict=True):
        assert o.device.type == DEV, o.device
        assert o.dtype == r.dtype and o.shape == r.shape
        assert o.is_conj() == r.is_conj() and o.is_neg() == r.is_neg()
        torch.testing.assert_close(_resolved(o.cpu()), _resolved(r), **TOL)


# ---- the conj/neg bits ---------------------------------------------------------------------------

CONJ_CASES: dict[str, Callable[[dict[str, torch.Tensor]], Any]] = {
    "conj": lambda d: d["z"].conj(),
    "conj_conj": lambda d: d["z"].conj().conj(),
    "conj_times_self": lambda d: d["z"].conj() * d["z"],
    "conj_complex128": lambda d: d["z64"].conj() + 1,
    "resolve_conj": lambda d: d["z"].conj().resolve_conj(),
    "conj_physical": lambda d: d["z"].conj_physical(),
    "conj_physical_of_conj_view": lambda d: d["z"].conj().conj_physical(),
    "conj_physical_": lambda d: d["z"].clone().conj_physical_(),
    "conj_physical_real": lambda d: d["r"].conj_physical(),
    "clone_of_conj": lambda d: d["z"].conj().clone(),
    "contiguous_of_conj_t": lambda d: d["z"].conj().t().contiguous(),
    "cat_conj": lambda d: torch.cat([d["z"].conj(), d["z"]]),
    "sum_conj": lambda d: d["z"].conj().sum(0),
    "item_of_conj": lambda d: torch.tensor(d["z"].conj()[1, 2].item(), device=d["z"].device),
    # ops PyTorch lets through its conj fallback (BLAS reads the bit): resolved by the device
    "mm_conj": lambda d: d["z"].conj() @ d["w"],
    "mH": lambda d: d["z"].mH @ d["z"],
    "mv_conj": lambda d: d["z"].conj() @ d["w"][:, 0],
    "bmm_conj": lambda d: torch.bmm(d["z"].unsqueeze(0).conj(), d["w"].unsqueeze(0).conj()),
    "addmm_conj": lambda d: torch.addmm(d["z"][:, :3].conj(), d["z"], d["w"][:, :3].conj()),
    "addmm_into_conj_view": lambda d: (lambda out: (out.addmm_(d["z"], d["w"][:, :3]), out)[1])(d["z"][:, :3].clone().conj()),
    "dot_conj": lambda d: torch.dot(d["z"][0].conj(), d["z"][1]),
    "vdot": lambda d: torch.vdot(d["z"][0], d["z"][1]),
    "vdot_conj": lambda d: torch.vdot(d["z"][0].conj(), d["z"][1]),
    "einsum_conj": lambda d: torch.einsum("ij,jk->ik", d["z"].conj(), d["w"]),
    "repeat_interleave_conj": lambda d: d["z"].conj().repeat_interleave(2, dim=0),
    # the negative bit: the imaginary part of a conjugate view
    "imag_of_conj": lambda d: d["z"].conj().imag,
    "imag_of_conj_times_2": lambda d: d["z"].conj().imag * 2,
    "neg_view": lambda d: torch._neg_view(d["r2"]) + 1,
    "neg_view_mm": lambda d: torch._neg_view(d["r2"]) @ d["r2"].T,
}


@pytest.mark.parametrize("name", list(CONJ_CASES))
def test_conj_and_neg_views_match_cpu(name: str) -> None:
    _check(CONJ_CASES[name])


def test_conj_view_is_lazy_and_reads_back() -> None:
    # The reproduction from the bug report: this used to segfault.
    x = torch.randn(4, dtype=torch.complex64)
    d = x.to(DEV)
    c = d.conj()
    assert c.is_conj() and c.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    torch.testing.assert_close(c.cpu(), x.conj())
    torch.testing.assert_close((d.conj() * d).cpu(), x.conj() * x, **TOL)


WRITE_CASES: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "setitem_conj_view": lambda z, w: z.conj().__setitem__(0, torch.tensor(1 + 2j)),
    "copy_into_conj_view": lambda z, w: z.conj().copy_(w[:3, :4]),
    "copy_conj_into_plain": lambda z, w: z.copy_(w[:3, :4].conj()),
    "copy_conj_into_conj": lambda z, w: z.conj().copy_(w[:3, :4].conj()),
    "add_into_conj_view": lambda z, w: z.conj().add_(w[:3, :4]),
    "add_into_imag_of_conj": lambda z, w: z.conj().imag.add_(1),
    "mul_real_part": lambda z, w: z.real.mul_(3),
    "mul_imag_part": lambda z, w: z.imag.mul_(3),
    "mul_view_as_real": lambda z, w: torch.view_as_real(z).mul_(3),
    "zero_view_as_real_column": lambda z, w: torch.view_as_real(z)[..., 1].zero_(),
}


@pytest.mark.parametrize("name", list(WRITE_CASES))
def test_writes_through_complex_views_match_cpu(name: str) -> None:
    d = _data()
    z, w = d["z"].clone(), d["w"]
    zd, wd = z.to(DEV), w.to(DEV)
    WRITE_CASES[name](z, w)
    WRITE_CASES[name](zd, wd)
    torch.testing.assert_close(zd.cpu(), z, **TOL)


def test_conj_views_cross_devices_and_host() -> None:
    x = torch.randn(3, 4, dtype=torch.complex64)
    d = x.to(DEV)
    torch.testing.assert_close(x.conj().to(DEV).cpu(), x.conj())  # host conj view -> device
    host = torch.zeros(3, 4, dtype=torch.complex64)
    host.copy_(d.conj())  # device conj view -> host
    torch.testing.assert_close(host, x.conj())
    host.conj().copy_(d)  # device -> host conj view
    torch.testing.assert_close(host, x.conj())
    torch.testing.assert_close(torch._neg_view(d.real).cpu(), -x.real)
    if getattr(torch, DEV).device_count() > 1:
        other = d.conj().to(f"{DEV}:1")
        assert other.device.index == 1
        torch.testing.assert_close(other.cpu(), x.conj())


# ---- view_as_real / view_as_complex --------------------------------------------------------------

VIEW_CASES: dict[str, Callable[[dict[str, torch.Tensor]], Any]] = {
    "view_as_real": lambda d: torch.view_as_real(d["z"]),
    "view_as_real_transposed": lambda d: torch.view_as_real(d["z"].t()),
    "view_as_real_strided": lambda d: torch.view_as_real(d["z"][:, 1::2]),
    "view_as_real_0dim": lambda d: torch.view_as_real(d["z"][1, 2]),
    "view_as_real_complex128": lambda d: torch.view_as_real(d["z64"]),
    "view_as_complex": lambda d: torch.view_as_complex(d["r2"].reshape(3, 4, 2)),
    "view_as_complex_offset": lambda d: torch.view_as_complex(d["r2"][1:].reshape(2, 4, 2)),
    "view_as_complex_1d": lambda d: torch.view_as_complex(d["r"][2:4]),
    "round_trip": lambda d: torch.view_as_complex(torch.view_as_real(d["z"]) * 2),
    "real_imag": lambda d: (d["z"].real, d["z"].imag),
    "complex": lambda d: torch.complex(d["r2"], -d["r2"] * 2),
    "complex_broadcast": lambda d: torch.complex(d["r2"][:, :1], d["r"]),
    "polar": lambda d: torch.polar(d["r2"].abs(), d["r2"]),
    "abs_angle": lambda d: (d["z"].abs(), d["z"].angle()),
    "exp_log": lambda d: (d["z"].exp(), d["z"].log()),
    "vector_norm": lambda d: (torch.linalg.vector_norm(d["z"]), torch.linalg.vector_norm(d["z"], 1, dim=0)),
}


@pytest.mark.parametrize("name", list(VIEW_CASES))
def test_complex_real_views_match_cpu(name: str) -> None:
    _check(VIEW_CASES[name])


def test_view_as_real_aliases_storage() -> None:
    d = torch.randn(3, 4, dtype=torch.complex64).to(DEV)
    v = torch.view_as_real(d)
    assert v.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    assert (v.shape, v.stride(), v.storage_offset()) == ((3, 4, 2), (8, 2, 1), 0)
    c = torch.view_as_complex(v)
    assert c.untyped_storage().data_ptr() == d.untyped_storage().data_ptr() and c.stride() == (4, 1)


@pytest.mark.parametrize("bad", ["conj", "last_dim_3", "last_stride", "odd_offset"])
def test_view_errors_match_cpu(bad: str) -> None:
    def attempt(device: str) -> str:
        z = torch.randn(3, 4, dtype=torch.complex64).to(device)
        r = torch.randn(4, 6).to(device)
        try:
            if bad == "conj":
                torch.view_as_real(z.conj())
            elif bad == "last_dim_3":
                torch.view_as_complex(r.reshape(4, 2, 3))
            elif bad == "last_stride":
                torch.view_as_complex(r[:, :4].reshape(4, 2, 2).transpose(1, 2))
            else:
                torch.view_as_complex(r.reshape(-1)[1:23].reshape(11, 2))
        except RuntimeError as e:
            return str(e)
        raise AssertionError(f"{bad}: no error on {device}")

    assert attempt(DEV) == attempt("cpu")


# ---- FFT ------------------------------------------------------------------------------------------

FFT_CASES: dict[str, Callable[[dict[str, torch.Tensor]], Any]] = {
    "fft_real": lambda d: torch.fft.fft(d["r"]),
    "fft_complex": lambda d: torch.fft.fft(d["z"]),
    "ifft_real": lambda d: torch.fft.ifft(d["r"]),
    "ifft_complex": lambda d: torch.fft.ifft(d["z"], norm="ortho"),
    "fft_of_conj": lambda d: torch.fft.fft(d["z"].conj(), dim=0),
    "rfft": lambda d: torch.fft.rfft(d["r2"]),
    "irfft": lambda d: torch.fft.irfft(d["z"], n=6),
    "hfft": lambda d: torch.fft.hfft(d["z"]),
    "ihfft": lambda d: torch.fft.ihfft(d["r2"]),
    "fft2": lambda d: torch.fft.fft2(d["z"]),
    "ifft2_real": lambda d: torch.fft.ifft2(d["r2"]),
    "hfft2": lambda d: torch.fft.hfft2(d["z"]),
    "ihfft2": lambda d: torch.fft.ihfft2(d["r2"]),
    "ifftn": lambda d: torch.fft.ifftn(d["z"], norm="forward"),
    "stft": lambda d: torch.stft(d["r2"].reshape(-1), 8, return_complex=True, window=torch.hann_window(8).to(d["r"].device)),
}


@pytest.mark.parametrize("name", list(FFT_CASES))
def test_fft_matches_cpu(name: str) -> None:
    _check(FFT_CASES[name])


# ---- autograd and torch.compile -------------------------------------------------------------------

GRAD_CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "view_as_real": lambda z: torch.view_as_real(z).pow(2).sum(),
    "conj_times_self": lambda z: (z.conj() * z * 2).real.sum(),
    "abs": lambda z: z.abs().sum(),
    "fft": lambda z: torch.fft.fft(z).abs().sum(),
    "view_as_complex": lambda z: torch.view_as_complex(torch.view_as_real(z) * 2).angle().sum(),
    "mm_conj": lambda z: (z.conj() @ z.T).real.sum(),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_complex_gradients_match_cpu(name: str) -> None:
    x = _data()["z"]
    zc = x.clone().requires_grad_()
    GRAD_CASES[name](zc).backward()
    zd = x.to(DEV).requires_grad_()
    GRAD_CASES[name](zd).backward()
    torch.testing.assert_close(zd.grad.cpu(), zc.grad, **TOL)


def _f_conj(d: dict[str, torch.Tensor]) -> torch.Tensor:
    z = d["z"]
    return (z.conj() * z).real + torch.view_as_real(z).sum(-1) + z.conj().imag


def _f_fft(d: dict[str, torch.Tensor]) -> torch.Tensor:
    c = torch.view_as_complex(d["r2"].reshape(3, 4, 2))
    return torch.fft.ifft(d["r2"]).imag.sum() + torch.fft.fft(c.conj(), dim=-1).angle()


def _f_misc(d: dict[str, torch.Tensor]) -> torch.Tensor:
    z = d["z"]
    return torch.vdot(z[0], z[1]) + torch.linalg.vector_norm(z) + torch.complex(d["r"], -d["r"]).sum()


@pytest.mark.parametrize("fn", [_f_conj, _f_fft, _f_misc], ids=lambda f: f.__name__)
def test_compiled_complex_matches_cpu(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> None:
    torch._dynamo.reset()
    try:
        cpu = _data()
        ref = fn(cpu)
        out = torch.compile(fn, backend="tpu", fullgraph=True)({k: v.to(DEV) for k, v in cpu.items()})
        torch.testing.assert_close(out.cpu(), ref, **TOL)
    finally:
        torch._dynamo.reset()
