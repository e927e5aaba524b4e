"""`torchbridge.kernel` with kernels defined here, as a user would: each result is compared with the
same computation written in PyTorch on the CPU (an independent reference), never with the kernel's
own output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from jax.experimental import pallas as pl

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

from torchbridge.device import dispatch, eager_mode, fused  # noqa: E402
from torchbridge.kernels import KernelError  # noqa: E402

DEV = torchbridge.device_name()


@torchbridge.kernel("kapi::rmsnorm", mutates_args=(), static_argnames=("eps",))
def rmsnorm(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _double_block(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0


def _affine_reference(x: jax.Array) -> jax.Array:
    return x * 2.0 + 1.0


@torchbridge.kernel("kapi::affine", reference=_affine_reference)
def affine(x: jax.Array) -> jax.Array:
    """2x + 1 as a Pallas kernel over blocks of 8 rows (the last one partial for odd row counts)."""
    spec = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(_double_block, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(x.shape[0], 8),), in_specs=[spec], out_specs=spec)(x)


@torchbridge.kernel("kapi::affine_no_ref")
def affine_no_ref(x: jax.Array) -> jax.Array:
    spec = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(_double_block, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(x.shape[0], 8),), in_specs=[spec], out_specs=spec)(x)


@torchbridge.kernel("kapi::accumulate", mutates_args=("acc",))
def accumulate(acc: jax.Array, x: jax.Array, scale: float) -> None:
    """acc += scale * x, in place; `scale` is traced (a new value does not recompile)."""
    return {"acc": acc + scale * x}


@torchbridge.kernel("kapi::stats")
def stats(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.mean(x, axis=-1), jnp.max(x, axis=-1)


@torchbridge.kernel("kapi::linear_tree")
def linear_tree(params: dict, x: jax.Array) -> dict:
    return {"y": x @ params["w"] + params["b"], "norm": jnp.sqrt(jnp.sum(x * x))}


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def test_a_kernel_is_a_torch_op_on_the_device_the_cpu_and_in_compiled_graphs():
    x, w = torch.randn(5, 24), torch.randn(24)
    ref = _rms_ref(x, w, 1e-5)
    torch.testing.assert_close(rmsnorm(x.to(DEV), w.to(DEV), eps=1e-5).cpu(), ref)
    torch.testing.assert_close(torch.ops.kapi.rmsnorm(x.to(DEV), w.to(DEV), eps=1e-5).cpu(), ref)
    torch.testing.assert_close(rmsnorm(x, w, eps=1e-5), ref)  # CPU tensors: the CPU kernel (dlpack)
    step = torch.compile(lambda a, b: rmsnorm(a * 2, b, eps=1e-5).relu() + 1, backend=DEV)
    torch.testing.assert_close(step(x.to(DEV), w.to(DEV)).cpu(), _rms_ref(x * 2, w, 1e-5).relu() + 1)
    assert "kapi::rmsnorm" in str(rmsnorm) and "float eps" in rmsnorm.op._schema.__str__()


def test_repeat_eager_calls_take_the_fast_path():
    if eager_mode.is_fused():
        pytest.skip("fused eager mode records calls instead of taking the fast path")
    x, w = torch.randn(4, 8, device=DEV), torch.randn(8, device=DEV)
    rmsnorm(x, w).cpu()
    before = torchbridge.metrics()["fast_path_hits"]
    for _ in range(3):
        rmsnorm(x, w)
    assert torchbridge.metrics()["fast_path_hits"] >= before + 3


def test_gradients_by_jax_vjp_match_torch_autograd_eager_and_compiled():
    x, w = torch.randn(6, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    (_rms_ref(xc, wc, 1e-6) ** 2).sum().backward()
    for mode in ("eager", "compiled"):
        xd, wd = x.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()

        def loss(a, b):
            return (rmsnorm(a, b) ** 2).sum()

        (torch.compile(loss, backend=DEV) if mode == "compiled" else loss)(xd, wd).backward()
        torch.testing.assert_close(xd.grad.cpu(), xc.grad)
        torch.testing.assert_close(wd.grad.cpu(), wc.grad)


def test_pallas_kernel_runs_interpreted_on_the_cpu_platform_with_odd_row_counts():
    x = torch.randn(13, 128)  # two blocks of 8 rows, the second partial
    torch.testing.assert_close(affine(x.to(DEV)).cpu(), x * 2 + 1)
    torch.testing.assert_close(affine(x), x * 2 + 1)


def test_pallas_kernel_trains_through_its_reference():
    x = torch.randn(9, 128)
    xd = x.to(DEV).requires_grad_()
    (affine(xd) * torch.arange(128.0, device=DEV)).sum().backward()
    xc = x.clone().requires_grad_()
    ((xc * 2 + 1) * torch.arange(128.0)).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad)


def test_pallas_kernel_without_a_backward_says_how_to_give_one():
    xd = torch.randn(8, 128, device=DEV, requires_grad=True)
    with pytest.raises(KernelError, match=r"kapi::affine_no_ref.*reference=.*register_backward"):
        affine_no_ref(xd).sum().backward()


def test_register_backward_replaces_the_default():
    calls = []

    @torchbridge.kernel("kapi::sine")
    def sine(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    @sine.register_backward
    def _(cot, x):
        calls.append(1)
        return (cot * jnp.cos(x),)

    x = torch.randn(7, 3)
    xd = x.to(DEV).requires_grad_()
    (sine(xd) * 3).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), 3 * torch.cos(x))
    assert calls, "the registered backward was not traced"


def test_mutating_kernel_writes_in_place_through_views_eager_cpu_and_compiled():
    def run(dev: str, compiled: bool) -> tuple[torch.Tensor, int]:
        acc = torch.arange(24.0).reshape(4, 6).to(dev)
        rows = acc[1:3]  # the kernel writes a view: the base must see it
        x = torch.ones(2, 6, device=dev)

        def step(view, inc):
            accumulate(view, inc, 2.5)
            return view.sum()

        total = (torch.compile(step, backend=DEV) if compiled else step)(rows, x)
        return acc.cpu(), total.item(), rows._version

    expected = torch.arange(24.0).reshape(4, 6)
    expected[1:3] += 2.5
    for dev, compiled in ((DEV, False), ("cpu", False), (DEV, True)):
        acc, total, version = run(dev, compiled)
        torch.testing.assert_close(acc, expected)
        assert total == pytest.approx(expected[1:3].sum().item())
        if not compiled:
            assert version > 0  # autograd sees the write


def test_mutating_kernel_donates_a_large_sole_owned_buffer():
    if eager_mode.is_fused():
        pytest.skip("fused eager mode runs recorded sequences, not per-op donating programs")
    acc = torch.zeros(512, 1024, device=DEV)  # 2 MiB: above the donation threshold
    x = torch.ones(512, 1024, device=DEV)
    accumulate(acc, x, 1.0)
    before = dispatch.donated_writes
    accumulate(acc, x, 1.0)
    assert dispatch.donated_writes == before + 1
    assert acc[:2, :3].cpu().eq(2.0).all()


def test_kernel_returning_a_tuple():
    x = torch.randn(3, 10)
    mean, mx = stats(x.to(DEV))
    torch.testing.assert_close(mean.cpu(), x.mean(-1))
    torch.testing.assert_close(mx.cpu(), x.amax(-1))


def test_pytrees_in_and_out_eager_and_compiled():
    w, b, x = torch.randn(8, 3), torch.randn(3), torch.randn(2, 8)
    params = {"w": w.to(DEV), "b": b.to(DEV)}
    out = linear_tree(params, x.to(DEV))
    assert set(out) == {"y", "norm"}
    torch.testing.assert_close(out["y"].cpu(), x @ w + b)
    torch.testing.assert_close(out["norm"].cpu(), x.norm())
    f = torch.compile(lambda p, a: linear_tree(p, a)["y"] * 2, backend=DEV)
    torch.testing.assert_close(f(params, x.to(DEV)).cpu(), (x @ w + b) * 2)


def test_a_new_static_value_compiles_once_then_is_cached_and_traced_scalars_never_recompile():
    if eager_mode.is_fused():
        pytest.skip("fused eager mode counts sequences, not per-op programs")
    x, w = torch.randn(3, 5, device=DEV), torch.randn(5, device=DEV)
    key = str(rmsnorm.op)

    def compiles() -> int:
        return dispatch.compile_counter[key]

    rmsnorm(x, w, eps=0.25).cpu()
    first = compiles()
    rmsnorm(x, w, eps=0.25)
    assert compiles() == first
    out = rmsnorm(x, w, eps=0.5)
    assert compiles() == first + 1
    rmsnorm(x, w, eps=0.25)
    assert compiles() == first + 1
    torch.testing.assert_close(out.cpu(), _rms_ref(x.cpu(), w.cpu(), 0.5))

    acc = torch.zeros(2, 2, device=DEV)
    accumulate(acc, torch.ones(2, 2, device=DEV), 1.0)
    n = dispatch.compile_counter[str(accumulate.op)]
    for s in (2.0, 3.0, 4.0):
        accumulate(acc, torch.ones(2, 2, device=DEV), s)
    assert dispatch.compile_counter[str(accumulate.op)] == n
    assert acc.cpu().eq(10.0).all()


TRACES: list[tuple] = []


@torchbridge.kernel("kapi::tile_rows", static_argnames=("times",))
def tile_rows(x: jax.Array, shift: float, times: int) -> jax.Array:
    """Rows repeated `times` (a static value that sets the output's shape) plus `shift` (traced)."""
    TRACES.append((x.shape, times))
    return jnp.tile(x, (times, 1)) + shift


def test_output_shapes_are_traced_once_per_argument_signature():
    """Dynamo and AOTAutograd ask an op's fake kernel for shapes several times per graph; the kernel
    is traced again only for new shapes, dtypes or static values, never for a traced scalar's value."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(3, 4, device=DEV))
        y = mode.from_tensor(torch.randn(5, 4, device=DEV))
        TRACES.clear()
        shapes = [tuple(tile_rows(a, s, times=t).shape) for a, s, t in
                  [(x, 1.0, 2), (x, 7.0, 2), (x, 1.0, 2), (x, 1.0, 3), (y, 1.0, 2), (x, 2.0, 3),
                   (x.to(torch.bfloat16), 1.0, 2)]]
    assert shapes == [(6, 4), (6, 4), (6, 4), (9, 4), (10, 4), (9, 4), (6, 4)]
    assert TRACES == [((3, 4), 2), ((3, 4), 3), ((5, 4), 2), ((3, 4), 2)]
    out = tile_rows(torch.ones(2, 3, device=DEV), 0.5, times=2)  # and the real kernel agrees
    torch.testing.assert_close(out.cpu(), torch.full((4, 3), 1.5))


def test_wrong_shaped_input_names_the_kernel_and_the_arguments():
    with pytest.raises(KernelError, match=r"kapi::rmsnorm.*x: float32\[4, 16\], w: float32\[8\]"):
        rmsnorm(torch.randn(4, 16, device=DEV), torch.randn(8, device=DEV))
    with pytest.raises(RuntimeError, match="kapi::rmsnorm.*missing value for argument 'w'"):
        rmsnorm(torch.randn(4, 16, device=DEV))


def test_kernel_in_fused_eager_mode():
    previous = eager_mode.mode()
    torchbridge.set_eager_mode("fused")
    try:
        x, w = torch.randn(4, 8), torch.randn(8)
        y = rmsnorm(x.to(DEV) + 1, w.to(DEV)) * 2
        assert fused.stats()["pending_ops"] > 0
        torch.testing.assert_close(y.cpu(), _rms_ref(x + 1, w, 1e-6) * 2)
    finally:
        torchbridge.set_eager_mode(previous)


def test_compiled_training_step_with_a_kernel_matches_cpu():
    """The docs' worked example: a model using the kernel, its forward and backward compiled."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.norm_w = torch.nn.Parameter(torch.ones(16))

        def forward(self, x: torch.Tensor, use_kernel: bool) -> torch.Tensor:
            h = self.lin(x)
            return rmsnorm(h, self.norm_w) if use_kernel else _rms_ref(h, self.norm_w, 1e-6)

    torch.manual_seed(0)
    ref = Block()
    dev = Block().to(DEV)
    dev.load_state_dict(ref.state_dict())
    x, target = torch.randn(8, 16), torch.randn(8, 16)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_dev = torch.optim.SGD(dev.parameters(), lr=0.1)
    step = torch.compile(lambda m, a, t: F.mse_loss(m(a, True), t), backend=DEV)
    for _ in range(3):
        loss_ref = F.mse_loss(ref(x, False), target)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss_dev = step(dev, x.to(DEV), target.to(DEV))
        loss_dev.backward()
        opt_dev.step()
        opt_dev.zero_grad()
        torch.testing.assert_close(loss_dev.cpu(), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dev.norm_w.detach().cpu(), ref.norm_w.detach(), rtol=1e-5, atol=1e-6)


def test_bad_definitions_are_rejected_with_the_kernel_name():
    with pytest.raises(TypeError, match="kapi::bad1.*'x' needs an annotation"):
        @torchbridge.kernel("kapi::bad1")
        def bad1(x) -> jax.Array:  # noqa: ANN001
            return x

    with pytest.raises(TypeError, match="kapi::bad2.*mutates_args 'y'"):
        @torchbridge.kernel("kapi::bad2", mutates_args=("y",))
        def bad2(x: jax.Array) -> None:
            return {}

    with pytest.raises(TypeError, match="kapi::bad4: a kernel needs at least one array argument"):
        @torchbridge.kernel("kapi::bad4")
        def bad4(n: int) -> jax.Array:
            return jnp.zeros(n)

    with pytest.raises(ValueError, match="must not end in '_'"):
        torchbridge.kernel("kapi::bad3_")(lambda x: x)


def test_kernel_sizes_stay_symbolic_under_dynamic_shapes():
    """With symbolic sizes a kernel's result sizes are expressions of its arguments' (JAX's shape
    polymorphism; tile_rows gives 2*n rows), so Dynamo keeps one graph for every size instead of
    guarding each; a Pallas kernel whose grid needs numbers gets them, per size. Each size against
    the same computation in PyTorch on the CPU."""
    from torch._dynamo.utils import counters

    exact = {"symbolic_sizes": "exact"}
    step = torch.compile(lambda x, w: tile_rows(rmsnorm(x, w), 0.5, times=2) * 3, backend=DEV, dynamic=True,
                         options=exact)
    frames = counters["stats"]["unique_graphs"]
    for n in (3, 5, 9):
        x, w = torch.randn(n, 16), torch.randn(16)
        ref = (torch.tile(_rms_ref(x, w, 1e-6), (2, 1)) + 0.5) * 3
        torch.testing.assert_close(step(x.to(DEV), w.to(DEV)).cpu(), ref)
    assert counters["stats"]["unique_graphs"] - frames == 1
    pallas = torch.compile(lambda x: affine(x) - 1, backend=DEV, dynamic=True, options=exact)
    for n in (3, 13):
        x = torch.randn(n, 128)
        torch.testing.assert_close(pallas(x.to(DEV)).cpu(), x * 2)
