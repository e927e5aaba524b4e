"""Replaying a compiled call with new host inputs (compile/replay.py), checked against the same function run
eagerly on CPU: a step that writes a device cache in place at host-given rows and reads it back, the way the
engine's step writes its KV cache. A replay must see the cache's latest buffer every time (each call donates
it), refuse inputs that no longer fit without running anything, and refuse captures it cannot repeat."""

from __future__ import annotations

import pytest
import torch

import torchbridge  # noqa: F401  (registers the device and the backend)
from torchbridge.compile import replay

DEV = "tpu"
ROWS, WIDTH = 4096, 64  # a cache large enough to be donated (donation.DONATE_BYTES)


def _step(weight: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """Write x @ weight into `cache` at `rows`, return the cache rows `read` summed with x's projection."""
    rows, x, read = rows.to(cache.device), x.to(cache.device), read.to(cache.device)
    y = torch.tanh(x @ weight)
    cache.index_copy_(0, rows, y)
    return cache[read].sum(0) + y.sum(0)


def _inputs(seed: int, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(ROWS, generator=g)[:n]
    read = torch.cat([rows, torch.randint(0, ROWS, (2,), generator=g)])
    return [rows, torch.randn(n, WIDTH, generator=g), read]


@pytest.fixture()
def state() -> dict:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(WIDTH, WIDTH, generator=g) / 8
    cache = torch.randn(ROWS, WIDTH, generator=g)
    return {"cpu": (weight, cache.clone()), "dev": (weight.to(DEV), cache.to(DEV))}


def test_replays_match_cpu_eager_and_write_the_latest_cache(state: dict) -> None:
    compiled = torch.compile(_step, backend="tpu")
    weight, cache = state["dev"]
    cpu_weight, cpu_cache = state["cpu"]
    with torch.inference_mode():
        first = _inputs(0)
        with replay.capture() as cap:
            out = compiled(weight, cache, *first)
        torch.testing.assert_close(out.cpu(), _step(cpu_weight, cpu_cache, *first))
        rep = cap.replay(first)
        assert rep is not None
        for seed in range(1, 6):
            inputs = _inputs(seed)
            host = seed % 2 == 0  # outputs as device tensors, or straight on the host
            got = rep(inputs, host_outputs=host)
            assert got is not None and got[0].device.type == ("cpu" if host else DEV)
            # each step reads rows the earlier steps wrote: a replay reading a stale (donated) cache fails here
            torch.testing.assert_close(got[0].cpu(), _step(cpu_weight, cpu_cache, *inputs))
        assert rep.replays == 5
    torch.testing.assert_close(cache.cpu(), cpu_cache)


def _captured(weight: torch.Tensor, cache: torch.Tensor) -> replay.Replay:
    """A replay of `_step`'s compiled call on the first inputs."""
    first = _inputs(0)
    with torch.inference_mode(), replay.capture() as cap:
        torch.compile(_step, backend="tpu", dynamic=False)(weight, cache, *first)
    rep = cap.replay(first)
    assert rep is not None
    return rep


def test_staged_launches_read_host_inputs_written_after_staging_and_run_in_order(state: dict) -> None:
    """Async scheduling's use: step k is staged while step k - 1 is in flight, its host inputs filled in
    place after staging, then launched; each reads the cache rows the one before it wrote."""
    weight, cache = state["dev"]
    cpu_weight, cpu_cache = state["cpu"]
    rep = _captured(weight, cache)
    _step(cpu_weight, cpu_cache, *_inputs(0))  # (the capture ran the first step)
    with torch.inference_mode():
        in_flight = None
        for seed in range(1, 6):
            inputs = _inputs(seed)
            real_x = inputs[1].clone()
            inputs[1].zero_()
            staged = rep.stage(inputs)  # the earlier launch is still running (or may be)
            assert staged is not None
            if in_flight is not None:
                want, launched = in_flight
                torch.testing.assert_close(launched.result()[0], want)
            inputs[1].copy_(real_x)  # written after staging: the launch must read this, not the zeros
            in_flight = (_step(cpu_weight, cpu_cache, *inputs), staged.launch())
        want, launched = in_flight
        torch.testing.assert_close(launched.result()[0], want)
    torch.testing.assert_close(cache.cpu(), cpu_cache)


def test_a_replay_refuses_inputs_that_no_longer_fit_and_runs_nothing(state: dict) -> None:
    weight, cache = state["dev"]
    rep = _captured(weight, cache)
    before = cache.cpu()
    with torch.inference_mode():
        assert rep(_inputs(1, n=5)) is None  # another number of rows: another program
        rows, x, read = _inputs(2)
        assert rep([rows, x.double(), read]) is None  # another dtype
    torch.testing.assert_close(cache.cpu(), before, rtol=0, atol=0)
    assert rep.replays == 0


def test_a_replay_refuses_when_the_host_calls_switches_changed(state: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.device import host_calls

    rep = _captured(*state["dev"])
    switches = host_calls.switches()
    monkeypatch.setattr(host_calls, "switches", lambda: (switches, "changed"))
    with torch.inference_mode():
        assert rep(_inputs(1)) is None


def test_captures_that_cannot_be_replayed(state: dict) -> None:
    weight, cache = state["dev"]

    def broken(weight: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, x: torch.Tensor,
               read: torch.Tensor) -> torch.Tensor:
        y = _step(weight, cache, rows, x, read)
        torch._dynamo.graph_break()
        return y * 2

    with torch.inference_mode():
        first = _inputs(0)
        with replay.capture() as cap:
            torch.compile(broken, backend="tpu")(weight, cache, *first)
        assert len(cap.calls) == 2 and cap.replay(first) is None  # two graphs: not one call to repeat
        with replay.capture() as cap:
            torch.compile(_step, backend="tpu")(weight, cache, *first)
        assert cap.replay(first[:2]) is None  # a host input the caller did not name
        assert cap.replay([first[0], first[1], first[2], first[2]]) is None  # named twice: ambiguous
        assert cap.replay(first) is not None
