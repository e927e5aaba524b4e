"""Sizes that change every call (compile/bounded.py), against CPU eager PyTorch.

A jagged workload (index lists of a new length every step) must run as a few bounded programs, not
one program per step, and give CPU's numbers; graphs with an op that cannot run padded fall back to
one static program per size."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torchbridge  # noqa: F401  (registers the device and the backend)
from torchbridge.compile import backend as compile_backend

DEV = torchbridge.device_name()


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class DLRM(nn.Module):
    """DLRM-style: a bottom MLP over dense features, EmbeddingBags over jagged sparse features,
    pairwise dot-product interaction, a top MLP."""

    def __init__(self, tables: tuple[int, ...] = (50, 40, 30), dim: int = 8, dense: int = 5) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 16), nn.ReLU(), nn.Linear(16, dim), nn.ReLU())
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in tables)
        f = len(tables) + 1
        li, lj = torch.tril_indices(f, f, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + f * (f - 1) // 2, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        feats = torch.stack([x] + [bag(i, o) for bag, i, o in zip(self.bags, indices, offsets, strict=True)], dim=1)
        z = torch.bmm(feats, feats.transpose(1, 2))
        return self.top(torch.cat([x, z[:, self.li, self.lj]], dim=1)).squeeze(1)


def _batch(gen: torch.Generator, tables: tuple[int, ...], batch: int, max_bag: int) -> tuple:
    """One batch: every bag holds 0..max_bag indices, so each table's index list has a new length."""
    dense = torch.randn(batch, 5, generator=gen)
    indices, offsets = [], []
    for n in tables:
        sizes = torch.randint(0, max_bag + 1, (batch,), generator=gen)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]]))
        indices.append(torch.randint(0, n, (int(sizes.sum()),), generator=gen))
    labels = torch.randint(0, 2, (batch,), generator=gen).float()
    return dense, indices, offsets, labels


def test_jagged_dlrm_trains_like_cpu_with_few_compiles():
    """200 Adagrad steps, every table's index list a new length at every step: the losses and the
    final weights equal CPU eager's, and the whole run compiles at most 8 programs (one per step
    would be 600: forward, backward and optimizer)."""
    tables = (50, 40, 30)
    torch.manual_seed(0)
    cpu = DLRM(tables)
    dev = copy.deepcopy(cpu).to(DEV)
    opt_cpu = torch.optim.Adagrad(cpu.parameters(), lr=0.05)
    opt_dev = torch.optim.Adagrad(dev.parameters(), lr=0.05)
    model = torch.compile(dev, backend="tpu")
    opt_step = torch.compile(opt_dev.step, backend="tpu")
    bce = nn.functional.binary_cross_entropy_with_logits
    gen = torch.Generator().manual_seed(1)
    before = compile_backend.metrics()["graphs_compiled"]
    lengths = []
    for _ in range(200):
        dense, indices, offsets, labels = _batch(gen, tables, batch=16, max_bag=6)
        lengths.append(tuple(len(i) for i in indices))
        opt_cpu.zero_grad()
        ref = bce(cpu(dense, indices, offsets), labels)
        ref.backward()
        opt_cpu.step()
        opt_dev.zero_grad()
        got = bce(model(dense.to(DEV), [i.to(DEV) for i in indices], [o.to(DEV) for o in offsets]), labels.to(DEV))
        got.backward()
        opt_step()
        assert abs(got.item() - ref.item()) < 1e-5 * max(1.0, abs(ref.item()))
    assert len(set(lengths)) > 190  # the sizes really changed at (almost) every step
    compiles = compile_backend.metrics()["graphs_compiled"] - before
    assert compiles <= 8, f"{compiles} programs for 200 jagged steps"
    for p_ref, p_dev in zip(cpu.parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(p_dev.detach().cpu(), p_ref.detach(), atol=1e-5, rtol=1e-4)


def test_variable_length_embedding_sum_and_its_gradient():
    """nn.Embedding over a variable number of ids, summed (a masked reduction over the padded axis),
    and its backward (a scatter-add that must not count the padding): values and gradients equal
    CPU's at every length, with one bounded program per power-of-two bucket."""
    torch.manual_seed(0)
    cpu = nn.Embedding(20, 4)
    dev = copy.deepcopy(cpu).to(DEV)
    f = torch.compile(lambda e, ids, w: (e(ids) * w).sum(0), backend="tpu")
    w = torch.randn(4)
    before = compile_backend.metrics()["graphs_compiled"]
    for n in (3, 7, 5, 12, 9, 4, 11, 6):
        ids = torch.randint(0, 20, (n,))
        ref = (cpu(ids) * w).sum(0)
        got = f(dev, ids.to(DEV), w.to(DEV))
        torch.testing.assert_close(got.detach().cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
        ref.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(dev.weight.grad.cpu(), cpu.weight.grad, atol=1e-5, rtol=1e-5)
        cpu.weight.grad = None
        dev.weight.grad = None
    # a static forward and backward for n=3, then one bounded pair for every later length (all <= 16)
    assert compile_backend.metrics()["graphs_compiled"] - before == 4


def test_outputs_of_a_changing_size_and_their_gradients():
    """A compiled function returning a value of the changing size (a view of its true size into the
    padded buffer) gives CPU's values, also through later eager ops and .cpu(), and its backward, fed a
    gradient of that size, gives CPU's weight gradient."""
    torch.manual_seed(0)
    cpu = nn.Embedding(30, 3)
    dev = copy.deepcopy(cpu).to(DEV)
    f = torch.compile(lambda e, ids: torch.tanh(e(ids)) * 2, backend="tpu")
    before = compile_backend.metrics()["graphs_compiled"]
    for n in (5, 9, 6, 13, 7):
        ids = torch.randint(0, 30, (n,))
        ref, got = torch.tanh(cpu(ids)) * 2, f(dev, ids.to(DEV))
        assert got.shape == (n, 3)
        torch.testing.assert_close(got.detach().cpu(), ref.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close((got + 1).sum(0).detach().cpu(), (ref + 1).sum(0).detach(), atol=1e-5, rtol=1e-5)
        w = torch.randn(n, 3)
        (ref * w).sum().backward()
        (got * w.to(DEV)).sum().backward()
        torch.testing.assert_close(dev.weight.grad.cpu(), cpu.weight.grad, atol=1e-5, rtol=1e-5)
        cpu.weight.grad = None
        dev.weight.grad = None
    assert compile_backend.metrics()["graphs_compiled"] - before == 4  # static pair for n=5, one bounded pair


def test_an_op_that_cannot_run_padded_compiles_one_program_per_size():
    """sort over a changing size would put the padding among the values: that graph is specialised
    (one static program per size, Dynamo guarding each size) and stays exact."""
    f = torch.compile(lambda x: torch.sort(x).values * 2, backend="tpu")
    before = compile_backend.metrics()["graphs_compiled"]
    for n in (4, 6, 9):
        x = torch.randn(n)
        torch.testing.assert_close(f(x.to(DEV)).cpu(), torch.sort(x).values * 2)
    assert compile_backend.metrics()["graphs_compiled"] - before == 3
