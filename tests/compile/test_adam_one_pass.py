"""The AdamW step as one pass over each parameter's arrays (host_calls.adam_update), checked in the
optimised HLO and against CPU torch.optim.AdamW (the independent reference): the foreach step
compiled (the backend finds the update among the graph's writes, patterns.find_adam_writes), and the
fused step (`_fused_adamw_`, which PyTorch never lets Dynamo trace: it runs through its lowering)."""

from __future__ import annotations

import copy
import re

import jax
import numpy as np
import pytest
import torch
import torch.nn as nn

import torchbridge  # noqa: F401  (registers the device and the backend)
from torchbridge.compile import backend as compile_backend
from torchbridge.device import host_calls
from torchbridge.device.lowerings import registry

DEV = torchbridge.device_name()


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model() -> nn.Module:
    # two weights large enough for the one-pass update (>= host_calls.ADAM_MIN_ELEMENTS), two small biases
    return nn.Sequential(nn.Linear(256, 128), nn.Tanh(), nn.Linear(128, 128))


@pytest.fixture
def programs(monkeypatch: pytest.MonkeyPatch) -> list:
    """The compiled programs of the test, as the backend builds them (for their optimised HLO)."""
    if not host_calls.enabled():
        pytest.skip("the one-pass update is a custom call of JAX's CPU platform (host kernels on)")
    built = []
    compile_graph = compile_backend.compile_graph

    def spy(gm, example_inputs, forward=False, **kw):
        program = compile_graph(gm, example_inputs, forward, **kw)
        built.append(program)
        return program

    monkeypatch.setattr(compile_backend, "compile_graph", spy)
    return built


def _assert_one_pass(hlo: str, target: str) -> None:
    """One custom call per large parameter, and no XLA loop over a large parameter's elements beside it."""
    assert hlo.count(f'custom_call_target="{target}"') == 2, hlo
    for shape in ("f32[128,256]", "f32[32768]", "f32[128,128]", "f32[16384]"):
        loops = [line for line in hlo.splitlines() if re.search(r"= " + re.escape(shape) + r"\S* fusion\(", line)]
        assert not loops, loops


def _train_alongside(cpu: nn.Module, dev: nn.Module, opt_cpu, opt_dev, step, state: tuple[str, ...]) -> None:
    """Four steps on both; after each, parameters and optimizer state `state` equal CPU's."""
    for _ in range(4):
        x = torch.randn(32, 256)
        opt_cpu.zero_grad()
        cpu(x).square().sum().backward()
        opt_cpu.step()
        opt_dev.zero_grad()
        dev(x.to(DEV)).square().sum().backward()  # eager forward/backward: only the step is compiled
        step()
        # every step from the same weights: the gradients' last-bit differences then move Adam's
        # normalised update by ~1e-7, instead of compounding over the steps (maximize grows them)
        for p_ref, p_dev in zip(cpu.parameters(), dev.parameters(), strict=True):
            torch.testing.assert_close(p_dev.detach().cpu(), p_ref.detach(), atol=1e-5, rtol=1e-4)
            for k in state:
                torch.testing.assert_close(opt_dev.state[p_dev][k].cpu(), opt_cpu.state[p_ref][k], atol=1e-5,
                                           rtol=1e-4)
            with torch.no_grad():
                p_ref.copy_(p_dev.cpu())


@pytest.mark.parametrize("variant,make", [
    ("foreach", lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw)),
    ("fused", lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw)),
    # Adam's L2 decay (g + wd p, a graph value the one-pass call reads) and maximize (-g)
    ("foreach", lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, maximize=True, **kw)),
], ids=["adamw-foreach", "adamw-fused", "adam-l2-maximize-foreach"])
def test_compiled_adamw_is_one_pass_per_parameter_and_matches_cpu(variant: str, make, programs: list) -> None:
    torch.manual_seed(0)
    cpu = _model()
    dev = copy.deepcopy(cpu).to(DEV)
    opt_cpu = make(cpu.parameters(), foreach=False)
    opt_dev = make(dev.parameters(), **{variant: True})
    # (torch.compile of a fused step runs _fused_adamw_ eagerly: torch.compiler.disable in torch.optim)
    step = torch.compile(opt_dev.step, backend="tpu") if variant == "foreach" else opt_dev.step
    _train_alongside(cpu, dev, opt_cpu, opt_dev, step, ("exp_avg", "exp_avg_sq"))
    hlo = "\n".join(text for p in programs for text in p.program.hlo_texts()) if variant == "foreach" else \
        _fused_adamw_hlo([tuple(p.shape) for p in dev.parameters()])
    _assert_one_pass(hlo, "torchbridge_adam_step")  # the old lowering had three loops per parameter


def _fused_adamw_hlo(shapes: list[tuple[int, ...]]) -> str:
    """The optimised HLO of the `_fused_adamw_` lowering for parameters of these shapes (what eager
    dispatch compiles for the fused step)."""
    fn = registry.find(torch.ops.aten._fused_adamw_.default).fn
    arrays = [np.zeros(s, np.float32) for s in shapes]
    steps = [np.ones((), np.float32) for _ in shapes]

    def step(p, g, m, v, t):
        return fn(p, g, m, v, [], t, lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False,
                  maximize=False)

    with registry.tracing(registry.TraceContext()):
        return jax.jit(step).lower(arrays, arrays, arrays, arrays, steps).compile().as_text()


@pytest.mark.parametrize("kw", [
    {},
    # weight decay (g + wd p) and lr decay (a per-step factor), and maximize (-g)
    {"weight_decay": 0.1, "lr_decay": 0.01, "maximize": True},
], ids=["plain", "decay-maximize"])
def test_compiled_adagrad_is_one_pass_per_parameter_and_matches_cpu(kw: dict, programs: list) -> None:
    """Adagrad the same way (host_calls.adagrad_update, patterns.find_adagrad_writes), against CPU
    torch.optim.Adagrad's single-tensor loop."""
    torch.manual_seed(0)
    cpu = _model()
    dev = copy.deepcopy(cpu).to(DEV)
    opt_cpu = torch.optim.Adagrad(cpu.parameters(), lr=1e-2, foreach=False, **kw)
    opt_dev = torch.optim.Adagrad(dev.parameters(), lr=1e-2, foreach=True, **kw)
    step = torch.compile(opt_dev.step, backend="tpu")
    _train_alongside(cpu, dev, opt_cpu, opt_dev, step, ("sum",))
    _assert_one_pass("\n".join(text for p in programs for text in p.program.hlo_texts()), "torchbridge_adagrad_step")
