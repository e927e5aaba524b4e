"""Training on the device tracks training on the CPU step by step; modules and tensors move and persist.

Every comparison runs the same model (identical initial weights, identical batches) once on the CPU
and once on the device; the CPU run is the reference.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()
STEPS = 20
ATOL = 1e-4


def _cnn() -> nn.Module:
    return nn.Sequential(
        # No conv bias before batchnorm: its true gradient is zero, and Adam would amplify the
        # rounding noise in it into lr-sized steps that differ between any two implementations.
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 10),
    )


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10))


# (constructor, batch shape, Adam learning rate: the CNN's batchnorm wants a smaller one)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], float]] = {
    "cnn": (_cnn, (8, 3, 8, 8), 3e-3),
    "mlp": (_mlp, (8, 16), 1e-2),
}

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda p, lr, **kw: torch.optim.AdamW(p, lr=lr, weight_decay=0.1, **kw),
    "adam": lambda p, lr, **kw: torch.optim.Adam(p, lr=lr, **kw),
    "sgd_momentum": lambda p, lr, **kw: torch.optim.SGD(p, lr=5e-2, momentum=0.9, nesterov=True, **kw),
}


def _batches(shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Labels from a fixed linear teacher, so the task is learnable and the loss falls within 20 steps.
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(int(torch.tensor(shape[1:]).prod()), 10, generator=g)
    xs = [torch.randn(shape, generator=g) for _ in range(STEPS)]
    return [(x, (x.flatten(1) @ teacher).argmax(1)) for x in xs]


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, device: str) -> list[float]:
    losses = []
    model.train()
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compare_training(model_name: str, opt_name: str, **opt_kw: object) -> None:
    make, shape, lr = MODELS[model_name]
    torch.manual_seed(0)
    cpu = make()
    dev = copy.deepcopy(cpu).to(DEV)
    batches = _batches(shape)
    ref = _train(cpu, OPTIMIZERS[opt_name](cpu.parameters(), lr), batches, "cpu")
    got = _train(dev, OPTIMIZERS[opt_name](dev.parameters(), lr, **opt_kw), batches, DEV)
    assert ref[-1] < ref[0]  # the reference run actually learns, so matching it means something
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert abs(a - b) <= ATOL, f"step {step}: cpu loss {a} vs device loss {b}"
    for (name, p_cpu), p_dev in zip(cpu.state_dict().items(), dev.state_dict().values(), strict=True):
        assert p_dev.device.type == DEV, name
        torch.testing.assert_close(p_dev.cpu(), p_cpu, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_training_tracks_cpu(model_name: str, opt_name: str) -> None:
    _compare_training(model_name, opt_name)


@pytest.mark.parametrize("opt_name", ["adamw", "adam", "sgd_momentum"])
def test_fused_optimizer_tracks_cpu(opt_name: str) -> None:
    _compare_training("mlp", opt_name, fused=True)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum"])
def test_fused_optimizer_with_lr_scheduler_compiles_once(opt_name: str) -> None:
    """A new learning rate every step (a scheduler) is a new value, not a new program."""
    make, shape, lr = MODELS["mlp"]
    torch.manual_seed(0)
    cpu = make()
    dev = copy.deepcopy(cpu).to(DEV)
    batches = _batches(shape)[:8]
    results = []
    for model, device in ((cpu, "cpu"), (dev, DEV)):
        opt = OPTIMIZERS[opt_name](model.parameters(), lr, fused=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(batches))
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            if device == DEV and len(losses) == 2:
                compiles = dict(torchbridge.metrics()["compiles_by_op"])
        results.append(losses)
    for a, b in zip(*results, strict=True):
        assert abs(a - b) <= ATOL
    fused_op = "aten._fused_adamw_.default" if opt_name == "adamw" else "aten._fused_sgd_.default"
    assert torchbridge.metrics()["compiles_by_op"][fused_op] == compiles[fused_op]


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_kernel_with_grad_scale(found_inf: float, nesterov: bool) -> None:
    # The op the optimizer calls under AMP, against PyTorch's own fused CPU kernel.
    g = torch.Generator().manual_seed(5)
    state = [[torch.randn(3, 4, generator=g), torch.randn(5, generator=g)] for _ in range(3)]

    def run(device: str) -> list[list[torch.Tensor]]:
        params, grads, bufs = ([t.to(device) for t in ts] for ts in state)
        torch._fused_sgd_(params, grads, bufs, weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.1,
                          nesterov=nesterov, maximize=True, is_first_step=False,
                          grad_scale=torch.tensor(4.0, device=device),
                          found_inf=torch.tensor(found_inf, device=device))
        return [[t.cpu() for t in ts] for ts in (params, grads, bufs)]

    for got, ref in zip(run(DEV), run("cpu"), strict=True):
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_fused_adamw_kernel_with_grad_scale(found_inf: float) -> None:
    g = torch.Generator().manual_seed(6)
    state = [[torch.randn(3, 4, generator=g).abs() for _ in range(2)] for _ in range(4)]

    def run(device: str) -> list[list[torch.Tensor]]:
        params, grads, m, v = ([t.to(device) for t in ts] for ts in state)
        steps = [torch.tensor(3.0, device=device) for _ in params]
        torch._fused_adamw_(params, grads, m, v, [], steps, lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False, grad_scale=torch.tensor(8.0, device=device),
                            found_inf=torch.tensor(found_inf, device=device))
        return [[t.cpu() for t in ts] for ts in (params, grads, m, v)]

    for got, ref in zip(run(DEV), run("cpu"), strict=True):
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_foreach_false_tracks_cpu() -> None:
    _compare_training("mlp", "adamw", foreach=False)


# ---- moving and persisting --------------------------------------------------------------------


def test_module_to_device_keeps_parameters_and_ties() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    before = model.emb.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = emb.weight.detach().clone()
    model.to(DEV)
    # Same Parameter objects: the optimizer built before the move keeps working, tied weights stay tied.
    assert model.emb.weight is before and model.head.weight is model.emb.weight
    assert model.emb.weight.device.type == DEV
    torch.testing.assert_close(model.emb.weight.detach().cpu(), expected)
    ids = torch.tensor([1, 2, 3], device=DEV)
    model.head(model.emb(ids)).sum().backward()
    opt.step()
    assert model.emb.weight.device.type == DEV
    assert not torch.equal(model.emb.weight.detach().cpu(), expected)


def test_module_tpu_method_and_back() -> None:
    torch.manual_seed(0)
    cpu = _mlp()
    moved = getattr(copy.deepcopy(cpu), DEV)()
    assert all(p.device.type == DEV for p in moved.parameters())
    x = torch.randn(4, 16)
    torch.testing.assert_close(moved(x.to(DEV)).cpu(), cpu(x), atol=ATOL, rtol=0)
    back = moved.cpu()
    assert all(p.device.type == "cpu" for p in back.parameters())
    torch.testing.assert_close(back(x), cpu(x), atol=ATOL, rtol=0)


def test_deepcopy_of_device_model_is_independent() -> None:
    torch.manual_seed(0)
    cpu = _cnn()
    dev = copy.deepcopy(cpu).to(DEV)
    clone = copy.deepcopy(dev)
    assert all(p.device.type == DEV for p in clone.parameters())
    for p, q in zip(dev.parameters(), clone.parameters(), strict=True):
        assert p.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
        torch.testing.assert_close(q.detach().cpu(), p.detach().cpu())
    with torch.no_grad():
        clone[0].weight.add_(1.0)
    torch.testing.assert_close(dev[0].weight.detach().cpu(), cpu[0].weight.detach())
    torch.testing.assert_close(clone[0].weight.detach().cpu(), cpu[0].weight.detach() + 1.0)
    x = torch.randn(2, 3, 8, 8)
    cpu.eval()
    dev.eval()
    torch.testing.assert_close(dev(x.to(DEV)).detach().cpu(), cpu(x).detach(), atol=ATOL, rtol=0)


def test_state_dict_round_trip() -> None:
    torch.manual_seed(0)
    cpu = _cnn()
    dev = copy.deepcopy(cpu).to(DEV)
    sd = dev.state_dict()
    assert set(sd) == set(cpu.state_dict())
    assert all(v.device.type == DEV for v in sd.values())
    # Into a fresh CPU model and into a fresh device model.
    torch.manual_seed(1)
    fresh_cpu = _cnn()
    fresh_cpu.load_state_dict(sd)
    fresh_dev = _cnn().to(DEV)
    fresh_dev.load_state_dict(cpu.state_dict())
    for name, ref in cpu.state_dict().items():
        torch.testing.assert_close(fresh_cpu.state_dict()[name], ref)
        torch.testing.assert_close(fresh_dev.state_dict()[name].cpu(), ref)
        assert fresh_dev.state_dict()[name].device.type == DEV


def _save_load(obj: object, **kw: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, **kw)


def test_save_load_device_tensors() -> None:
    ref = torch.randn(3, 5)
    ints = torch.arange(-3, 9, dtype=torch.int64) * (2**40)
    t = ref.to(DEV)
    view = t[1:, ::2]  # a non-contiguous view keeps its storage relationship through save/load
    for kw, expected in (({}, DEV), ({"map_location": "cpu"}, "cpu"), ({"map_location": DEV}, DEV)):
        loaded = _save_load({"t": t, "view": view, "ints": ints.to(DEV)}, **kw)
        assert loaded["t"].device.type == expected
        assert loaded["view"].device.type == expected
        torch.testing.assert_close(loaded["t"].cpu(), ref)
        torch.testing.assert_close(loaded["view"].cpu(), ref[1:, ::2])
        assert torch.equal(loaded["ints"].cpu(), ints)
    # A CPU checkpoint mapped onto the device.
    loaded = _save_load(ref, map_location=DEV)
    assert loaded.device.type == DEV
    torch.testing.assert_close(loaded.cpu(), ref)


@pytest.mark.parametrize("map_location", ["cpu", DEV])
def test_save_load_device_model(map_location: str) -> None:
    torch.manual_seed(0)
    cpu = _cnn().eval()
    dev = copy.deepcopy(cpu).to(DEV)
    sd = _save_load(dev.state_dict(), map_location=map_location)
    assert all(v.device.type == map_location for v in sd.values())
    target = _cnn().eval()
    if map_location == DEV:
        target = target.to(DEV)
    target.load_state_dict(sd)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(target(x.to(map_location)).detach().cpu(), cpu(x).detach(), atol=ATOL, rtol=0)


def test_to_between_emulated_chips() -> None:
    if torch.device(DEV).type != DEV or getattr(torch, DEV).device_count() < 4:
        pytest.skip("needs 4 emulated chips (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    ref = torch.randn(4, 6)
    a = ref.to(DEV)
    b = a.to(f"{DEV}:3")
    assert b.device == torch.device(DEV, 3)
    assert a.device == torch.device(DEV, 0)
    torch.testing.assert_close(b.cpu(), ref)
    c = (b * 2 + 1).sum(0)
    assert c.device == torch.device(DEV, 3)
    torch.testing.assert_close(c.cpu(), (ref * 2 + 1).sum(0))
    # A module moves too, and its forward runs on that chip.
    torch.manual_seed(0)
    cpu = _mlp()
    moved = copy.deepcopy(cpu).to(f"{DEV}:3")
    assert all(p.device == torch.device(DEV, 3) for p in moved.parameters())
    x = torch.randn(2, 16)
    out = moved(x.to(f"{DEV}:3"))
    assert out.device == torch.device(DEV, 3)
    torch.testing.assert_close(out.detach().cpu(), cpu(x).detach(), atol=ATOL, rtol=0)
    # Back to chip 0, and a cross-chip op is refused as on CUDA.
    torch.testing.assert_close(b.to(f"{DEV}:0").cpu(), ref)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        _ = a + b
