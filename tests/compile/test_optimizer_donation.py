"""Compiled optimizer steps that rewrite whole parameters and state (Adam/AdamW, Adagrad, SGD with
momentum, RMSprop) donate the old buffers when XLA can write over them without copies, checked against CPU
torch.optim (the independent reference) over several steps, and the donation decision read from
what XLA compiled (donation.copied_bytes of its optimised HLO)."""

from __future__ import annotations

import pytest
import torch

import torchbridge  # noqa: F401  (registers the device and the backend)
from torchbridge.compile import metrics
from torchbridge.device import donation

DEV = torchbridge.device_name()

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_program_cache")

# two 2 MiB parameters (over donation.DONATE_BYTES) and two small ones
SHAPES = [(512, 1024), (1024, 512), (1024,), (7,)]

OPTIMIZERS = {
    "adagrad": lambda ps, **kw: torch.optim.Adagrad(ps, lr=1e-2, **kw),
    "sgd-momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, **kw),
    # these two also rewrite the gradients (nesterov) or re-derive the new state inside the parameter
    # update (RMSprop), and XLA answers donation with copies: run with fresh buffers, still correct
    "sgd-nesterov": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, **kw),
    "rmsprop": lambda ps, **kw: torch.optim.RMSprop(ps, lr=1e-3, **kw),
    # one-pass custom call (host_calls.adam_update) writing over its operands: AdamW's decay and
    # Adam's L2 weight decay take different branches of it
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "adam-l2": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, **kw),
}


def _run(name: str, steps: int = 5) -> int:
    """`steps` compiled steps of optimizer `name` against CPU torch.optim; returns the donated calls
    after the first step (which compiles and creates the state)."""
    torch.manual_seed(0)
    ref = [torch.randn(s) for s in SHAPES]
    dev_params = [torch.nn.Parameter(r.to(DEV)) for r in ref]
    cpu_params = [torch.nn.Parameter(r.clone()) for r in ref]
    # the CPU runs the foreach algorithm too, the device's default (foreach SGD with nesterov adds the
    # momentum into the gradients in place; the CPU's default single-tensor loop does not)
    dev_opt, cpu_opt = OPTIMIZERS[name](dev_params), OPTIMIZERS[name](cpu_params, foreach=True)
    step = torch.compile(dev_opt.step, backend="tpu")
    donated_before = 0
    for i in range(steps):
        for d, c in zip(dev_params, cpu_params, strict=True):
            g = torch.randn(d.shape)
            d.grad, c.grad = g.to(DEV), g
        step()
        cpu_opt.step()
        if i == 0:
            donated_before = metrics()["donated_calls"]
    for d, c in zip(dev_params, cpu_params, strict=True):
        torch.testing.assert_close(d.detach().cpu(), c.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d.grad.cpu(), c.grad, rtol=1e-5, atol=1e-6)
        for k, v in cpu_opt.state[c].items():
            if torch.is_tensor(v) and v.numel() > 1:
                torch.testing.assert_close(dev_opt.state[d][k].cpu(), v, rtol=1e-5, atol=1e-6)
    return metrics()["donated_calls"] - donated_before


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_step_matches_cpu(name: str) -> None:
    donated = _run(name)
    if name in ("adagrad", "sgd-momentum", "adamw", "adam-l2"):
        assert donated == 4  # written over in place: what the DLRM bench's Adagrad needs


def test_adam_in_place_program_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The donating Adam program: the custom call aliases its results to the donated arrays, and XLA
    adds no copy to keep an old value (a relayout or an alias it may not honour would show as one)."""
    from torchbridge.compile import backend

    texts: list[str] = []
    real = donation.unless_copying

    def recording(compiled, donated_bytes, baseline=0):  # noqa: ANN001, ANN202 - donation.unless_copying's
        texts.append(compiled.as_text())  # every donating program compiled, in order
        return real(compiled, donated_bytes, baseline)

    monkeypatch.setattr(donation, "unless_copying", recording)
    assert backend.donation is donation
    assert _run("adamw") == 4
    # the program of the steady steps, the last compiled (at the first step a new state's zeros are
    # one shared buffer, so not all of it is donated)
    assert "torchbridge_adam_step" in texts[-1] and "output_to_operand_aliasing" in texts[-1]
    assert donation.copied_bytes(texts[-1]) == 0


def test_donation_answered_with_copies_runs_the_fresh_buffer_program(monkeypatch: pytest.MonkeyPatch) -> None:
    # XLA copying in the donating program only (its donated argument is named so in the HLO), none in the
    # plain one: the copies are the donation's
    monkeypatch.setattr(donation, "copied_bytes", lambda text: (1 << 40) if "donated" in text else 0)
    assert _run("adagrad") == 0


def test_copied_bytes_reads_hlo_copy_instructions() -> None:
    text = """
  %copy.6 = f32[4194304]{0} copy(%donated_6_.1)
  %copy.7 = bf16[2,8]{1,0} copy(%p)
  %fusion = f32[4194304]{0} fusion(%copy.6), kind=kLoop
  %copy_fusion = f32[16]{0} fusion(%x), calls=%copy_computation
"""
    assert donation.copied_bytes(text) == 4194304 * 4 + 16 * 2
    assert donation.copied_bytes("ROOT %t = (f32[4]{0}) tuple(%a)") == 0


def test_the_plain_programs_copies_are_asked_for_only_when_the_donating_one_copies() -> None:
    """unless_copying compiles the non-donating program (the baseline) only when the donating one copies
    a quarter of the donated bytes or more; copies the baseline has too do not count against donation."""

    class Compiled:
        def __init__(self, copies: int) -> None:
            self.text = f"  %copy.1 = f32[{copies}]{{0}} copy(%donated_0_.1)" if copies else "ROOT %t = () tuple()"

        def as_text(self) -> str:
            return self.text

    asked: list[int] = []

    def baseline(n: int):  # noqa: ANN202
        return lambda: asked.append(n) or 4 * n

    few, many = Compiled(100), Compiled(1000)
    assert donation.unless_copying(few, 4 * 1000, baseline(0)) is few and asked == []
    assert donation.unless_copying(many, 4 * 1000, baseline(0)) is None and asked == [0]
    assert donation.unless_copying(many, 4 * 1000, baseline(1000)) is many and asked == [0, 1000]
