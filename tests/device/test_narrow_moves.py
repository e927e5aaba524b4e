"""16-bit floats gathered and scattered as bits on JAX's CPU platform (device/lowerings/moves.py).

The moves must be bit-exact against PyTorch's CPU (-0.0, infinities and subnormals included; NaN
stays NaN), and a compiled write into a large bf16 buffer must not convert that buffer to float32 (XLA's
CPU backend did, there and back, at every engine step: 127 ms of a bf16 decode step)."""

from __future__ import annotations

import math
import re

import pytest
import torch

import torchbridge  # noqa: F401  (registers the device and the backend)

DEV = "tpu"


def _special(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    flat = x.view(-1)
    info = torch.finfo(dtype)
    flat[:6] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), info.tiny / 4, info.max]).to(dtype)
    bits = flat.view(torch.int16)
    bits[6] = 0x7FC1 if dtype == torch.bfloat16 else 0x7E01  # a NaN with a payload
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits, NaNs aside: NaN where the reference has NaN (PyTorch's CPU scatter itself does not keep
    a NaN's payload), -0.0, infinities and subnormals exactly."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = b.isnan()
    assert torch.equal(a.isnan(), nan)
    assert torch.equal(a.contiguous().view(torch.int16)[~nan], b.contiguous().view(torch.int16)[~nan])


MOVES = {
    "index_select": lambda x, i: x.index_select(0, i),
    "index": lambda x, i: x[i],
    "take": lambda x, i: torch.take(x, i),
    "gather": lambda x, i: torch.gather(x, 0, i[:, None].expand(-1, x.shape[1])),
    "index_copy": lambda x, i: x.clone().index_copy_(0, i, x[:len(i)].flip(0)),
    "index_put": lambda x, i: x.clone().index_put_((i,), x[:len(i)].flip(0)),
    "scatter": lambda x, i: x.clone().scatter_(0, i[:, None].expand(-1, x.shape[1]), x[:len(i)].flip(0)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(MOVES))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_moves_are_bit_exact(name: str, dtype: torch.dtype, compiled: bool) -> None:
    x = _special(dtype, (16, 8))
    i = torch.tensor([5, 0, 3, 6, 1, 2])
    fn = MOVES[name]
    run = torch.compile(fn, backend="tpu") if compiled else fn
    _same_bits(run(x.to(DEV), i.to(DEV)).cpu(), fn(x, i))


def test_a_compiled_cache_write_keeps_the_cache_out_of_float32() -> None:
    """The engine's pattern: rows written into a bf16 cache viewed over uint16 storage, then gathered."""
    from torchbridge.compile import backend

    n, h, d = 4096, 2, 64
    storage = torch.zeros(n, h, d, dtype=torch.uint16)
    cache_ref = storage.view(torch.bfloat16)
    cache = storage.to(DEV).view(torch.bfloat16)
    slots, rows = torch.tensor([9, 4000, 17]), torch.randn(3, h, d).to(torch.bfloat16)
    picks = torch.tensor([17, 9])

    def step(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, slots, rows)
        return cache.index_select(0, picks).float().sum(-1)

    graphs: list = []
    real = backend.GraphProgram.__init__

    def recording(self, *args, **kwargs) -> None:
        real(self, *args, **kwargs)
        graphs.append(self)

    backend.GraphProgram.__init__ = recording
    try:
        for _ in range(2):  # the second call runs the donating program of the steady state
            out = torch.compile(step, backend="tpu")(cache, slots.to(DEV), rows.to(DEV), picks.to(DEV))
    finally:
        backend.GraphProgram.__init__ = real
    ref = step(cache_ref, slots, rows, picks)
    torch.testing.assert_close(out.cpu(), ref)
    _same_bits(cache.cpu(), cache_ref)
    texts = [c.as_text() for g in graphs for fn, _ in g._programs.values() for c in fn._donating.values() if c]
    assert texts, "the write was not compiled as a donating program"
    whole = n * h * d
    for text in texts:
        sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"f32\[([\d,]*)\]", text)]
        assert max(sizes) < whole, "the cache was converted to float32"
        assert f"bf16[{whole}]" not in text.split("ENTRY")[1].split("\n")[0]  # its buffer stays uint16
