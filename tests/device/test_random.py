"""Random ops on the device: seeding through torch.manual_seed, reproducibility, and distribution checks.

Device samples are not the CPU generator's numbers, so the reference here is each distribution's known
mean/variance/support (with tolerances of several standard errors for 10k samples).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchbridge

pytestmark = pytest.mark.skipif(torchbridge.registration_error() is not None, reason="device backend not registered")
DEV = torchbridge.device_name()
N = 10_000


def draw(seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(64, device=DEV).cpu(), torch.rand(64, device=DEV).cpu(),
            torch.randint(0, 1000, (64,), device=DEV).cpu()]


def test_manual_seed_does_not_start_jax():
    """A script seeds first, then makes a process group (or a tensor-parallel engine), which must join JAX's
    distributed runtime before JAX's backend starts: seeding must not start it. In a fresh process."""
    import subprocess
    import sys

    code = ("import torch; torch.manual_seed(5); from torchbridge.distributed import runtime; "
            "started = runtime.backend_started(); "
            f"x = torch.randn(8, device='{DEV}:1').cpu(); torch.manual_seed(5); "
            f"print(started, torch.equal(x, torch.randn(8, device='{DEV}:1').cpu()), torch.{DEV}.initial_seed())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "True", "5"], out.stderr[-3000:]


def test_manual_seed_reaches_device_and_reproduces():
    a, b, c = draw(1234), draw(1234), draw(1235)
    assert getattr(torch, DEV).initial_seed() == 1235  # torch.manual_seed reached the device module
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    for x, z in zip(a, c, strict=True):
        assert not torch.equal(x, z)
    assert not torch.equal(a[0][:32], a[0][32:])


def test_rng_state_roundtrip_and_consecutive_draws_differ():
    mod = getattr(torch, DEV)
    torch.manual_seed(7)
    state = mod.get_rng_state()
    x = torch.randn(32, device=DEV).cpu()
    y = torch.randn(32, device=DEV).cpu()
    assert not torch.equal(x, y)
    mod.set_rng_state(state)
    assert torch.equal(torch.randn(32, device=DEV).cpu(), x)


def _mean_std(t: torch.Tensor) -> tuple[float, float]:
    t = t.double().cpu()
    return t.mean().item(), t.std().item()


def test_normal_and_uniform_statistics():
    torch.manual_seed(0)
    m, s = _mean_std(torch.randn(N, device=DEV))
    assert abs(m) < 0.05 and abs(s - 1) < 0.05
    m, s = _mean_std(torch.empty(N, device=DEV).normal_(2.0, 3.0))
    assert abs(m - 2) < 0.15 and abs(s - 3) < 0.15
    mean = torch.full((N,), -1.0, device=DEV)
    m, s = _mean_std(torch.normal(mean, 0.5))
    assert abs(m + 1) < 0.03 and abs(s - 0.5) < 0.03
    m, s = _mean_std(torch.normal(mean, torch.full((N,), 2.0, device=DEV)))
    assert abs(m + 1) < 0.1 and abs(s - 2) < 0.1
    u = torch.empty(N, device=DEV).uniform_(-2.0, 5.0).cpu()
    assert u.min() >= -2 and u.max() < 5
    assert abs(u.mean().item() - 1.5) < 0.1
    r = torch.rand(N, device=DEV, dtype=torch.bfloat16).cpu()
    assert r.dtype == torch.bfloat16 and r.min() >= 0 and r.max() <= 1


def test_bernoulli_frequency():
    torch.manual_seed(0)
    x = torch.empty(N, device=DEV).bernoulli_(0.3).cpu()
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    assert abs(x.mean().item() - 0.3) < 0.02
    p = torch.tensor([0.0, 1.0] * 8, device=DEV)
    assert torch.equal(torch.bernoulli(p).cpu(), p.cpu())  # degenerate probabilities are exact
    q = torch.full((N,), 0.8, device=DEV)
    assert abs(torch.bernoulli(q).mean().item() - 0.8) < 0.02
    # p = 0.5 is the schema's default: a boxed call leaves it out, the lowering must still use it
    assert abs(torch.empty(N, device=DEV).bernoulli_(0.5).mean().item() - 0.5) < 0.02


def test_integer_draws():
    torch.manual_seed(0)
    r = torch.randint(3, 9, (N,), device=DEV).cpu()
    assert r.dtype == torch.int64 and r.min() == 3 and r.max() == 8
    assert set(r.unique().tolist()) == set(range(3, 9))
    i = torch.empty(N, device=DEV, dtype=torch.int32).random_(-5, 5).cpu()
    assert i.dtype == torch.int32 and i.min() == -5 and i.max() == 4
    f = torch.empty(N, device=DEV).random_(10).cpu()
    assert torch.equal(f, f.round()) and f.min() == 0 and f.max() == 9
    p = torch.randperm(50, device=DEV).cpu()
    assert torch.equal(p.sort().values, torch.arange(50)) and not torch.equal(p, torch.arange(50))


def test_multinomial():
    torch.manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.4, 0.2, 0.3], [0.0, 0.5, 0.3, 0.0, 0.2]], device=DEV)
    for k in (3, 3, 2):
        s = torch.multinomial(probs, k).cpu()
        for row, p in zip(s.tolist(), probs.cpu(), strict=True):
            assert len(set(row)) == len(row)  # without replacement: distinct
            assert all(p[j] > 0 for j in row)  # zero-probability categories are never drawn
    draws = torch.multinomial(probs[0], N, replacement=True).cpu()
    freq = torch.bincount(draws, minlength=5).double() / N
    torch.testing.assert_close(freq, probs[0].cpu().double(), atol=0.02, rtol=0)


def test_other_distributions():
    torch.manual_seed(0)
    e = torch.empty(N, device=DEV).exponential_(2.0).cpu()
    assert e.min() >= 0 and abs(e.mean().item() - 0.5) < 0.03
    g = torch.empty(N, device=DEV).geometric_(0.25).cpu()
    assert g.min() >= 1 and torch.equal(g, g.round()) and abs(g.mean().item() - 4) < 0.25
    ln = torch.empty(N, device=DEV).log_normal_(0.5, 0.25).cpu()
    m, s = _mean_std(ln.log())
    assert abs(m - 0.5) < 0.02 and abs(s - 0.25) < 0.02
    c = torch.empty(N, device=DEV).cauchy_(1.0, 2.0).cpu()
    assert abs(c.median().item() - 1.0) < 0.15
    assert abs(((c - 1).abs() < 2).double().mean().item() - 0.5) < 0.03  # half the mass within one scale


def test_dropout():
    torch.manual_seed(0)
    p = 0.4
    x = torch.ones(N, device=DEV, requires_grad=True)
    y = F.dropout(x, p, training=True)
    y.backward(torch.full_like(y, 2.0))
    out, grad = y.detach().cpu(), x.grad.cpu()
    kept = out != 0
    assert abs(1 - kept.double().mean().item() - p) < 0.02
    torch.testing.assert_close(out[kept], torch.full((int(kept.sum()),), 1 / (1 - p)))
    torch.testing.assert_close(grad, torch.where(kept, 2 / (1 - p), 0.0))  # gradient uses the same mask
    z = torch.randn(8, device=DEV)
    assert torch.equal(F.dropout(z, p, training=False).cpu(), z.cpu())
    assert torch.equal(F.dropout(z, 1.0, training=True).cpu(), torch.zeros(8))


def test_device_generator_reproduces_and_is_independent_of_the_default_stream():
    g = torch.Generator(device=DEV)
    assert g.device.type == DEV
    g.manual_seed(11)
    first = [torch.randn(64, generator=g, device=DEV).cpu(), torch.rand(64, generator=g, device=DEV).cpu()]
    x = torch.empty(N, device=DEV).normal_(2.0, 0.5, generator=g).cpu()
    g.manual_seed(11)
    torch.manual_seed(0)
    torch.randn(64, device=DEV)  # draws from the device's default stream must not move the generator
    again = [torch.randn(64, generator=g, device=DEV).cpu(), torch.rand(64, generator=g, device=DEV).cpu()]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], torch.randn(64, generator=torch.Generator(device=DEV).manual_seed(12),
                                                 device=DEV).cpu())
    assert abs(float(x.mean()) - 2.0) < 5 * 0.5 / N**0.5 and abs(float(x.std()) - 0.5) < 0.02


def test_device_generator_state_roundtrip_and_bernoulli():
    g = torch.Generator(device=DEV).manual_seed(3)
    state = g.get_state()
    p = torch.full((N,), 0.3, device=DEV)
    m = torch.bernoulli(p, generator=g).cpu()
    g.set_state(state)
    assert torch.equal(m, torch.bernoulli(p, generator=g).cpu())
    assert abs(float(m.mean()) - 0.3) < 5 * (0.3 * 0.7 / N) ** 0.5


def test_cpu_generator_for_a_device_op_is_an_error():
    # CUDA raises too: a generator's numbers cannot come from another device's stream.
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.randn(4, generator=torch.Generator().manual_seed(0), device=DEV)


def test_draws_are_counter_based_so_a_shard_equals_its_part_of_the_whole():
    """Element i of a draw at offset o depends on (seed, o + i) only: drawing the second half of a tensor
    at the offset where it starts gives exactly that half (what DTensor's sharded random init needs)."""
    mod = getattr(torch, DEV)
    for fill in (lambda t: t.normal_(), lambda t: t.uniform_(-1, 1), lambda t: t.bernoulli_(0.5),
                 lambda t: t.random_(0, 1000)):
        torch.manual_seed(3)
        state = mod.get_rng_state()
        whole = fill(torch.empty(64, device=DEV)).cpu()
        seed, offset = state.view(torch.uint64).tolist()
        mod.set_rng_state(torch.tensor([seed, offset + 32], dtype=torch.uint64).view(torch.uint8))
        half = fill(torch.empty(32, device=DEV)).cpu()
        assert torch.equal(half, whole[32:])
        assert not torch.equal(whole[:32], whole[32:])


def test_normal_samples_follow_the_normal_cdf():
    """Kolmogorov-Smirnov distance between 20k device samples and the standard normal CDF (the 1% critical
    value is 1.63 / sqrt(n)); samples are also independent of their neighbours (lag-1 correlation)."""
    torch.manual_seed(5)
    x = torch.randn(20_000, device=DEV).double().cpu().sort().values
    n = x.numel()
    cdf = torch.special.ndtr(x)
    ks = torch.maximum(torch.arange(1, n + 1) / n - cdf, cdf - torch.arange(0, n) / n).max().item()
    assert ks < 1.63 / n ** 0.5
    y = torch.randn(20_000, device=DEV).double().cpu()
    assert abs(torch.corrcoef(torch.stack([y[:-1], y[1:]]))[0, 1].item()) < 0.03
