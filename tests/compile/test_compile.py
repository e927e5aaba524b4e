"""torch.compile(backend="tpu") against CPU eager PyTorch (the independent reference)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import torchbridge  # noqa: F401  (registers the device and the backend)
from torchbridge.compile import backend as compile_backend

DEV = torchbridge.device_name()


def _pair(module: nn.Module) -> tuple[nn.Module, nn.Module]:
    return module, copy.deepcopy(module).to(DEV)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_mlp_forward_backward_matches_cpu():
    torch.manual_seed(0)
    cpu, dev = _pair(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)))
    x = torch.randn(6, 8)
    compiled = torch.compile(dev, backend="tpu")
    out = compiled(x.to(DEV))
    ref = cpu(x)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    out.square().mean().backward()
    ref.square().mean().backward()
    for p_ref, p_dev in zip(cpu.parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(p_dev.grad.cpu(), p_ref.grad, atol=1e-5, rtol=1e-5)


def test_second_call_does_not_recompile_and_new_shape_is_logged(caplog):
    torch.manual_seed(0)
    cpu, dev = _pair(nn.Linear(4, 3))
    compiled = torch.compile(dev, backend="tpu")
    with torch.no_grad():
        compiled(torch.randn(2, 4).to(DEV))
        before = compile_backend.metrics()["graphs_compiled"]
        x = torch.randn(2, 4)
        out = compiled(x.to(DEV))
        assert compile_backend.metrics()["graphs_compiled"] == before
        torch.testing.assert_close(out.cpu(), cpu(x), atol=1e-6, rtol=1e-5)
        with caplog.at_level(logging.WARNING):
            x3 = torch.randn(5, 4)
            out3 = compiled(x3.to(DEV))
    torch.testing.assert_close(out3.cpu(), cpu(x3), atol=1e-6, rtol=1e-5)
    assert compile_backend.metrics()["graphs_compiled"] > before
    assert compile_backend.metrics()["recompiles"] >= 1
    assert "recompiling for new input shapes" in caplog.text and "(2, 4) -> (5, 4)" in caplog.text


def test_expected_recompiles_are_counted_but_not_logged(caplog):
    compiled = torch.compile(lambda x: x * 3, backend="tpu")
    compiled(torch.ones(2, device=DEV))
    before = compile_backend.metrics()["recompiles"]
    with caplog.at_level(logging.WARNING), compile_backend.recompiles_expected():
        torch.testing.assert_close(compiled(torch.ones(3, device=DEV)).cpu(), torch.full((3,), 3.0))
    assert compile_backend.metrics()["recompiles"] == before + 1
    assert "recompiling" not in caplog.text


def test_tpu_compiles_leave_other_compiles_their_automatic_dynamic_shapes():
    """Compiling for the device changes nothing process-wide: a user's other compiled function
    (another backend; Dynamo's automatic dynamic shapes are the same for every backend, Inductor
    included) still gets a dynamic graph when its input size changes, while the device's own graphs
    stay static, one per shape."""
    dynamic_graphs = []

    def other_backend(gm: torch.fx.GraphModule, example_inputs: list):
        dynamic_graphs.append(any(isinstance(n.meta.get("example_value"), torch.SymInt)
                                  for n in gm.graph.find_nodes(op="placeholder")))
        return gm.forward

    other = torch.compile(lambda x: x * 2, backend=other_backend)
    other(torch.randn(3))
    on_device = torch.compile(lambda x: x.sum(0) + x.shape[0], backend="tpu")
    before = compile_backend.metrics()["recompiles"]
    for n in (2, 5, 7):
        x = torch.randn(n, 4)
        torch.testing.assert_close(on_device(x.to(DEV)).cpu(), x.sum(0) + n)
    assert compile_backend.metrics()["recompiles"] - before == 2  # 2 -> 5 -> 7: one static program each
    other(torch.randn(6))
    assert dynamic_graphs == [False, True]
    assert torch._dynamo.config.automatic_dynamic_shapes


def test_training_loop_20_steps_tracks_cpu_eager():
    torch.manual_seed(0)
    cpu, dev = _pair(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    opt_dev = torch.optim.SGD(dev.parameters(), lr=0.05, momentum=0.9)
    data = [(torch.randn(16, 10), torch.randn(16, 1)) for _ in range(20)]

    def step(model, opt, x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    compiled_model = torch.compile(dev, backend="tpu")
    for x, y in data:
        ref = step(cpu, opt_cpu, x, y)
        got = step(compiled_model, opt_dev, x.to(DEV), y.to(DEV))
        assert abs(got.item() - ref.item()) < 1e-4


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "adam", "sgd-nesterov"],
)
def test_full_training_step_with_compiled_optimizer_tracks_cpu(make_opt):
    """Forward, backward and optimizer.step() all compiled (the step is its own graph, with the
    optimizer's _foreach ops and its state updated in place); 20 steps stay within 1e-4 of CPU."""
    torch.manual_seed(0)
    cpu, dev = _pair(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt_cpu, opt_dev = make_opt(cpu.parameters()), make_opt(dev.parameters())
    compiled_model = torch.compile(dev, backend="tpu")

    @torch.compile(backend="tpu")
    def opt_step():
        opt_dev.step()

    data = [(torch.randn(16, 10), torch.randn(16, 1)) for _ in range(20)]
    graphs = []
    for x, y in data:
        opt_cpu.zero_grad()
        ref = nn.functional.mse_loss(cpu(x), y)
        ref.backward()
        opt_cpu.step()
        opt_dev.zero_grad()
        got = nn.functional.mse_loss(compiled_model(x.to(DEV)), y.to(DEV))
        got.backward()
        opt_step()
        graphs.append(compile_backend.metrics()["graphs_compiled"])
        assert abs(got.item() - ref.item()) < 1e-4
    assert graphs[0] >= 3  # forward, backward and the optimizer step each became a program
    assert graphs[-1] == graphs[2]  # steady state: no recompiles as the step counter advances
    for p_ref, p_dev in zip(cpu.parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(p_dev.detach().cpu(), p_ref.detach(), atol=1e-4, rtol=1e-4)
    for s_ref, s_dev in zip(opt_cpu.state.values(), opt_dev.state.values(), strict=True):
        for k, v in s_ref.items():
            torch.testing.assert_close(s_dev[k].cpu(), v, atol=1e-4, rtol=1e-4)


class _WithBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h) * 2


def test_graph_break_pieces_compile_and_stay_correct():
    torch.manual_seed(0)
    cpu, dev = _pair(_WithBreak())
    x = torch.randn(3, 6)
    out = torch.compile(dev, backend="tpu")(x.to(DEV))
    torch.testing.assert_close(out.cpu(), cpu(x), atol=1e-5, rtol=1e-5)


def test_batchnorm_training_updates_running_stats():
    torch.manual_seed(0)
    cpu, dev = _pair(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)))
    cpu.train()
    dev.train()
    compiled = torch.compile(dev, backend="tpu")
    for _ in range(3):
        x = torch.randn(8, 5)
        torch.testing.assert_close(compiled(x.to(DEV)).cpu(), cpu(x), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dev[1].running_mean.cpu(), cpu[1].running_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dev[1].running_var.cpu(), cpu[1].running_var, atol=1e-6, rtol=1e-5)
    assert int(dev[1].num_batches_tracked.cpu()) == 3


class _KVWriter(nn.Module):
    """Writes each step's key into a cache buffer at a position, then attends over the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(1, 8, 4))

    def forward(self, x, pos):
        k = self.proj(x)
        self.cache.index_copy_(1, pos, k)
        return torch.softmax(k @ self.cache.transpose(1, 2), dim=-1) @ self.cache


def test_kv_cache_writing_model_compiles_and_mutates_buffer():
    torch.manual_seed(0)
    cpu, dev = _pair(_KVWriter())
    compiled = torch.compile(dev, backend="tpu")
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(1, 1, 4)
            pos = torch.tensor([step])
            torch.testing.assert_close(compiled(x.to(DEV), pos.to(DEV)).cpu(), cpu(x, pos), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dev.cache.cpu(), cpu.cache, atol=1e-6, rtol=1e-5)


class _PoolWriter(nn.Module):
    """A 2 MiB KV pool written a few rows per step through a view (as the engine writes its cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pool", torch.zeros(512, 8, 128))

    def forward(self, rows, slots):
        self.pool.view(-1, 128).index_copy_(0, slots, rows)
        return self.pool.sum(dim=(1, 2))


def test_large_cache_scatter_donates_its_buffer_and_matches_cpu():
    from torchbridge.compile import metrics

    cpu, dev = _pair(_PoolWriter())
    compiled = torch.compile(dev, backend="tpu")
    with torch.no_grad():
        first = torch.randn(4, 128)
        compiled(first.to(DEV), torch.arange(4).to(DEV))  # first call: compile
        cpu(first, torch.arange(4))
        before = metrics()["donated_calls"]
        for step in range(3):
            rows, slots = torch.randn(4, 128), torch.tensor([5, 900, 17 + step, 4000 - step])
            torch.testing.assert_close(compiled(rows.to(DEV), slots.to(DEV)).cpu(), cpu(rows, slots))
    assert metrics()["donated_calls"] == before + 3  # XLA updated the pool in place, not a 2 MiB copy
    torch.testing.assert_close(dev.pool.cpu(), cpu.pool)
    view = dev.pool[1:3]  # a view shares the storage: after a donated write it reads the new rows
    with torch.no_grad():
        compiled(torch.ones(4, 128).to(DEV), torch.arange(4).to(DEV))
        cpu(torch.ones(4, 128), torch.arange(4))
    torch.testing.assert_close(view.cpu(), cpu.pool[1:3])
    torch.testing.assert_close(dev.pool.cpu(), cpu.pool)


def test_inference_graph_writes_its_inputs_in_place_like_cpu():
    """Under no_grad AOTAutograd keeps input mutations in the graph (trailing copy_ nodes): the
    executable returns the new values and the backend swaps them into the inputs' storages,
    including a write into a view of a larger tensor and into a CPU scalar input."""

    def f(buf, rows, x, count):
        buf.mul_(0.5).add_(x)
        rows.copy_(x[:2] * 3)
        count.add_(1)
        return buf.sum() + count

    torch.manual_seed(0)
    buf, big, x = torch.randn(4, 5), torch.randn(6, 5), torch.randn(4, 5)
    ref = (buf.clone(), big.clone(), torch.tensor(0.0))
    dev = (buf.to(DEV), big.to(DEV), torch.tensor(0.0))
    compiled = torch.compile(f, backend="tpu")
    with torch.no_grad():
        for _ in range(3):
            want = f(ref[0], ref[1][1:3], x, ref[2])
            got = compiled(dev[0], dev[1][1:3], x.to(DEV), dev[2])
            torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dev[0].cpu(), ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dev[1].cpu(), ref[1], atol=1e-5, rtol=1e-5)
    assert dev[2].item() == ref[2].item() == 3


def test_forward_outputs_that_alias_inputs_are_views_and_backward_stays_correct():
    """The forward graph saves parameters, their transposes and detached activations for the
    backward; the backend returns those as views (no copy). Gradients must still match CPU, also
    when the parameters are updated in place between steps."""
    torch.manual_seed(0)
    cpu, dev = _pair(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.LayerNorm(8)))
    compiled = torch.compile(dev, backend="tpu")
    for _ in range(3):
        x = torch.randn(5, 8)
        ref = cpu(x)
        out = compiled(x.to(DEV))
        torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
        ref.square().mean().backward()
        out.square().mean().backward()
        for p_ref, p_dev in zip(cpu.parameters(), dev.parameters(), strict=True):
            torch.testing.assert_close(p_dev.grad.cpu(), p_ref.grad, atol=1e-4, rtol=1e-4)
            with torch.no_grad():
                p_ref.sub_(0.1 * p_ref.grad)
                p_dev.sub_(0.1 * p_dev.grad)
            p_ref.grad = None
            p_dev.grad = None
