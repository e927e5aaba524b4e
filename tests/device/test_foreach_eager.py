"""Eager `_foreach_*` calls on the device: one program over the whole list (not PyTorch's per-tensor
loop), equal to the same calls on CPU tensors, per-tensor scalars (Scalar[]) traced so new values
compile nothing, writes into several views of one storage applied in order, and lists that span
devices handed to PyTorch's own per-tensor loop."""

from __future__ import annotations

import pytest
import torch

import torchbridge
from torchbridge.device import dispatch

DEV = torchbridge.device_name()

SHAPES = [(5, 7), (3,), (2, 4, 3), (11,)]


def _lists(seed: int, n: int = 3) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.rand(s, generator=g) + 0.5 for s in SHAPES] for _ in range(n)]


CALLS = {
    "add_.Scalar": lambda a, b, c: torch._foreach_add_(a, 0.25),
    "add_.List alpha": lambda a, b, c: torch._foreach_add_(a, b, alpha=-0.5),
    "add_.ScalarList": lambda a, b, c: torch._foreach_add_(a, [0.1, 0.2, 0.3, 0.4]),
    "mul_.Scalar": lambda a, b, c: torch._foreach_mul_(a, 0.9),
    "mul_.Tensor": lambda a, b, c: torch._foreach_mul_(a, torch.tensor(1.5, device=a[0].device)),
    "div_.ScalarList": lambda a, b, c: torch._foreach_div_(a, [2.0, 3.0, 4.0, 5.0]),
    "lerp_.Scalar": lambda a, b, c: torch._foreach_lerp_(a, b, 0.1),
    "addcmul_.Scalar": lambda a, b, c: torch._foreach_addcmul_(a, b, c, 0.001),
    "addcdiv_.ScalarList": lambda a, b, c: torch._foreach_addcdiv_(a, b, c, [-0.1, -0.2, -0.3, -0.4]),
    "addcdiv_.Tensor": lambda a, b, c: torch._foreach_addcdiv_(a, b, c, torch.tensor([1.0, 2.0, 3.0, 4.0])),
    "sqrt_": lambda a, b, c: torch._foreach_sqrt_(a),
    "zero_": lambda a, b, c: torch._foreach_zero_(a),
    "copy_": lambda a, b, c: torch._foreach_copy_(a, b),
    "sqrt (functional)": lambda a, b, c: torch._foreach_sqrt(a),
    "mul.List (functional)": lambda a, b, c: torch._foreach_mul(a, b),
    "norm (functional)": lambda a, b, c: torch._foreach_norm(a),
    "norm ord 3 (clip_grad_norm_ passes it)": lambda a, b, c: torch._foreach_norm(a, 3.0),
    "norm ord inf": lambda a, b, c: torch._foreach_norm(a, float("inf")),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_foreach_call_matches_cpu_in_one_program(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _lists(1)
    dev = [[t.to(DEV) for t in ts] for ts in ref]
    runs = []
    real_run = dispatch.run

    def counting_run(op, *args, **kwargs):
        runs.append(op)
        return real_run(op, *args, **kwargs)

    monkeypatch.setattr(dispatch, "run", counting_run)
    hits = torchbridge.metrics()["fast_path_hits"]
    out_dev = CALLS[name](*dev)
    programs = len(runs) + torchbridge.metrics()["fast_path_hits"] - hits
    monkeypatch.undo()
    out_cpu = CALLS[name](*ref)
    assert programs == 1, f"{name}: {programs} dispatches for a list of {len(SHAPES)}"
    for got, want in zip(dev[0], ref[0], strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    if out_cpu is not None:
        for got, want in zip(out_dev, out_cpu, strict=True):
            assert got.device.type == DEV
            torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


def test_new_scalar_lists_compile_nothing() -> None:
    """Adam's bias corrections reach `_foreach_div_` as a new Scalar[] every step: traced values."""
    a = [t.to(DEV) for t in _lists(2)[0]]
    ref = [t.clone() for t in _lists(2)[0]]
    torch._foreach_div_(a, [1.5, 2.5, 3.5, 4.5])
    compiles = torchbridge.metrics()["compiles"]
    for step in range(2, 6):
        scalars = [step + 0.5 * i for i in range(len(SHAPES))]
        torch._foreach_div_(a, scalars)
        torch._foreach_div_(ref, scalars) if step > 2 else None
    assert torchbridge.metrics()["compiles"] == compiles
    torch._foreach_div_(ref, [1.5, 2.5, 3.5, 4.5])
    torch._foreach_div_(ref, [2 + 0.5 * i for i in range(len(SHAPES))])
    for got, want in zip(a, ref, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-7)


def test_copy_into_views_of_one_storage() -> None:
    """FSDP2's all-gather copy-in: each parameter shard copied into its split of one flat buffer."""
    sizes = [35, 3, 24, 11]
    srcs = [torch.randn(n) for n in sizes]
    flat_cpu = torch.zeros(sum(sizes) * 2)
    flat_dev = flat_cpu.to(DEV)
    torch._foreach_copy_(torch.split(flat_dev[3:3 + sum(sizes)], sizes), [s.to(DEV) for s in srcs])
    torch._foreach_copy_(torch.split(flat_cpu[3:3 + sum(sizes)], sizes), srcs)
    torch.testing.assert_close(flat_dev.cpu(), flat_cpu, rtol=0, atol=0)


def test_eager_foreach_adamw_matches_cpu() -> None:
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    runs = {}
    for device in (DEV, "cpu"):
        params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
        g = torch.Generator().manual_seed(3)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device)
            opt.step()
        runs[device] = [p.detach().cpu() for p in params]
    for got, want in zip(runs[DEV], runs["cpu"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_list_spanning_devices_runs_per_tensor() -> None:
    a, b = torch.ones(3, device=DEV), torch.ones(3)
    torch._foreach_add_([a, b], 1.0)
    assert torch.equal(a.cpu(), torch.full((3,), 2.0)) and torch.equal(b, torch.full((3,), 2.0))
    r = torch._foreach_sqrt([a, b])
    assert r[0].device.type == DEV and r[1].device.type == "cpu"


def test_clip_grad_norm_matches_cpu() -> None:
    grads = _lists(4)[0]
    got = {}
    for device in (DEV, "cpu"):
        params = [torch.nn.Parameter(torch.zeros(g.shape, device=device)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(device) * 10
        total = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=2.0)
        got[device] = [total.cpu()] + [p.grad.cpu() for p in params]
    for a, b in zip(got[DEV], got["cpu"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
