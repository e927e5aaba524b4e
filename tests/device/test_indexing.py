"""Indexing, scatter/gather, masking, concatenation and padding on the device, checked against CPU PyTorch.

Writes go through views (the KV-cache pattern `cache[:, pos] = new`, in-place ops on slices) and the
test reads the *base* afterwards, so a write that lands only in a temporary would fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchbridge

pytestmark = pytest.mark.skipif(torchbridge.registration_error() is not None, reason="device backend not registered")
DEV = torchbridge.device_name()


def both(fn, *args):
    """fn on CPU tensors and on device copies of them; returns (cpu result, device result moved back)."""
    cpu = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    dev = fn(*[a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args])
    return cpu, _to_cpu(dev)


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def check(fn, *args, **tol):
    cpu, dev = both(fn, *args)
    torch.testing.assert_close(dev, cpu, **tol)


@pytest.fixture
def x():
    torch.manual_seed(0)
    return torch.randn(4, 6)


def test_index_reads(x):
    i = torch.tensor([0, 3, -1, 2])
    check(lambda t, i: t[i], x, i)
    check(lambda t, i: t[:, i], x, i)
    check(lambda t, i: t[None, i, 1:4], x, i)
    check(lambda t, i: t[i, i.flip(0)], x, i)
    check(lambda t, i: t[i.view(2, 2), 1:], x, i)
    check(lambda t: t[t > 0], x)  # bool mask: torch turns it into nonzero() + index
    check(lambda t: t[[1, 2]][:, [0, 5]], x)  # host index lists


def test_index_on_a_view(x):
    check(lambda t: t.t()[torch.tensor([1, 4], device=t.device)], x)
    check(lambda t: t[1:, ::2][torch.tensor([0, 2], device=t.device)], x)


def test_index_put_and_kv_cache_write():
    torch.manual_seed(1)
    cache = torch.zeros(2, 8, 3)
    new = torch.randn(2, 3)

    def write(c, n):
        for pos in (0, 5):
            c[:, pos] = n * (pos + 1)
        c[:, torch.tensor([2, -1], device=c.device)] = n[:, None] * 7
        return c

    check(write, cache, new)

    def accumulate(c, n):
        idx = torch.tensor([1, 1, 3], device=c.device)
        c.index_put_((idx,), n.new_ones(3, 3) * n[0], accumulate=True)  # repeated index adds twice
        return c

    check(accumulate, cache[0], new)

    def mask_write(c):
        c[c > 0.5] = -1.0
        return c

    check(mask_write, torch.rand(5, 5))

    def strided_view_write(c, n):
        # Advanced-index write into a transposed, sliced view: the base must see it.
        v = c.transpose(0, 1)[1:6]
        v[torch.tensor([0, 3], device=c.device), 1] = n * 2
        v[torch.tensor([4])] += 1.5  # index tensor left on the CPU, as CUDA allows
        return c

    check(strided_view_write, cache, new)


def test_index_select_add_copy_fill(x):
    idx = torch.tensor([2, 0, 2])
    check(lambda t, i: t.index_select(1, i), x, idx)
    check(lambda t, i: t.index_select(0, i[:2]), x, idx)
    src = torch.randn(4, 3)
    check(lambda t, i, s: t.index_add(1, i, s, alpha=2.0), x, idx, src)

    def copy_into_slice(t, s):
        # index_copy_ into a view must show up in the base tensor.
        t[1:3].index_copy_(1, torch.tensor([5, 0], device=t.device), s)
        return t

    check(copy_into_slice, x, torch.randn(2, 2))
    check(lambda t, i: t.index_fill(1, i, -3.5), x, idx)
    check(lambda t, i: t.index_fill(0, i[:1], torch.tensor(2.0)), x, idx)


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")  # torch's deprecation note (CPU side)
def test_gather_scatter(x):
    idx = torch.tensor([[0, 5], [1, 1], [4, 2], [3, 3]])
    check(lambda t, i: torch.gather(t, 1, i), x, idx)
    check(lambda t, i: torch.gather(t, 0, i[:2, :]), x, torch.tensor([[0, 1], [3, 2]]))
    src = torch.randn(4, 2)
    check(lambda t, i, s: t.scatter(1, i[:, :1], s[:, :1]), x, idx, src)
    check(lambda t, i: t.scatter(1, i, 9.0), x, idx)
    check(lambda t, i, s: t.scatter(1, i, s, reduce="add"), x, idx, src)
    check(lambda t, i, s: t.scatter(1, i, s, reduce="multiply"), x, idx, src)
    check(lambda t, i, s: t.scatter_add(1, i, s), x, idx, src)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
def test_scatter_reduce(reduce):
    torch.manual_seed(2)
    base = torch.randn(3, 5)
    idx = torch.tensor([[0, 0, 4, 1], [2, 2, 2, 3], [1, 0, 1, 0]])
    src = torch.randn(3, 4)
    for include_self in (True, False):
        check(lambda b, i, s, inc=include_self: b.scatter_reduce(1, i, s, reduce, include_self=inc), base, idx, src)
    if reduce == "mean":  # integer mean rounds down, as on CPU
        ib = torch.arange(15).view(3, 5)
        check(lambda b, i, s: b.scatter_reduce(1, i, s, "mean"), ib, idx, torch.arange(12).view(3, 4) * 3)


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")  # torch's own note (CPU side)
@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
def test_index_reduce(x, reduce):
    idx = torch.tensor([0, 0, 3])
    for include_self in (True, False):
        check(lambda t, i, inc=include_self: t.index_reduce(1, i, t[:, :3] * 2, reduce, include_self=inc), x, idx)


def test_put_and_take(x):
    idx = torch.tensor([[0, -1], [7, 7]])
    check(lambda t, i: t.put(i, torch.ones(2, 2, device=t.device) * 3), x, torch.tensor([[0, -1], [7, 9]]))
    check(lambda t, i: t.put_(i, torch.arange(4.0, device=t.device).view(2, 2), accumulate=True), x, idx)
    check(lambda t, i: torch.take(t, i), x, idx)


def test_masked_ops(x):
    mask = torch.tensor([True, False, True, False, False, True])
    check(lambda t, m: t.masked_fill(m, 0.25), x, mask)
    check(lambda t, m: t.masked_fill(m, torch.tensor(-2.0)), x, mask)

    def fill_view(t, m):
        t[:, 2:].masked_fill_(m[2:], 7.0)  # through a view: the base must change
        return t

    check(fill_view, x, mask)
    check(lambda t, m: t.masked_scatter(m, torch.arange(24.0, device=t.device).view(4, 6)), x, mask)
    check(lambda t, m: t.masked_select(m), x, mask)
    check(lambda t: t.masked_select(t > 0), x)


def test_dynamic_shapes(x):
    check(lambda t: t.nonzero(), (x > 0.3).int())
    check(lambda t: torch.nonzero(t, as_tuple=True), x > 0)
    check(lambda t: torch.where(t > 0), x)
    v = torch.tensor([3, 1, 3, 2, 1, 7, 3])
    check(lambda t: torch.unique(t, return_inverse=True, return_counts=True), v)
    check(lambda t: torch.unique(t), v)
    check(lambda t: torch.unique_consecutive(t, return_inverse=True, return_counts=True), v)
    rows = torch.tensor([[1, 2], [0, 5], [1, 2], [0, 5], [3, 3]])
    check(lambda t: torch.unique(t, dim=0, return_inverse=True, return_counts=True), rows)


def test_search_bucketize():
    seq = torch.tensor([1.0, 2.0, 2.0, 5.0, 9.0])
    vals = torch.tensor([[0.0, 2.0, 3.0], [5.0, 9.0, 10.0]])
    check(lambda s, v: torch.searchsorted(s, v), seq, vals)
    check(lambda s, v: torch.searchsorted(s, v, right=True), seq, vals)
    check(lambda s, v: torch.searchsorted(s, v, side="right", out_int32=True), seq.expand(2, 5), vals)
    check(lambda s, v: torch.bucketize(v, s), seq, vals)
    check(lambda s, v: torch.bucketize(v, s, right=True), seq, vals)


def test_embedding_forward_backward():
    torch.manual_seed(3)
    w = torch.randn(10, 4)
    ids = torch.tensor([[1, 2, 2], [0, 9, 1]])

    def run(w, ids, **kw):
        w = w.detach().requires_grad_(True)
        out = F.embedding(ids, w, **kw)
        (out * torch.arange(out.numel(), device=w.device, dtype=out.dtype).view(out.shape)).sum().backward()
        return out, w.grad

    check(run, w, ids)
    check(lambda w, i: run(w, i, padding_idx=2, scale_grad_by_freq=True), w, ids)

    def renorm(w, ids):
        out = F.embedding(ids, w, max_norm=1.5)  # renormalizes the looked-up rows of w in place
        return out, w

    check(renorm, w * 3, ids)


def test_cat_stack_pad(x):
    y = torch.randn(2, 6)
    check(lambda a, b: torch.cat([a, b]), x, y)
    check(lambda a, b: torch.cat([a.t(), b.t().int()], dim=1), x, y)  # views and type promotion
    check(lambda a: torch.cat([a, torch.empty(0, device=a.device)]), x)  # legacy empty 1-d input
    check(lambda a, b: torch.stack([a[:2], b], dim=1), x, y)
    check(lambda a: F.pad(a, (1, 2)), x)
    check(lambda a: F.pad(a, (1, -2, 2, 0), value=3.0), x)
    img = torch.randn(1, 2, 4, 5)
    seed = torch.linspace(-1, 1, 2 * 7 * 8).view(1, 2, 7, 8)
    for mode in ("reflect", "replicate"):
        def pad_grad(a, s, mode=mode):
            a.requires_grad_(True)
            out = F.pad(a, (2, 1, 1, 2), mode=mode)
            out.backward(s)
            return out, a.grad

        check(pad_grad, img, seed)


def test_reorder_and_triangles(x):
    check(lambda t: t.flip(0), x)
    check(lambda t: t.flip(0, 1), x)
    check(lambda t: t.roll(2, 1), x)
    check(lambda t: t.roll((1, -2), (0, 1)), x)
    check(lambda t: t.roll(3), x)
    check(lambda t: t.tril(), x)
    check(lambda t: t.triu(1), x)
    check(lambda t: torch.tril(t.view(2, 2, 6), -1), x)
    check(lambda t: t.repeat(2, 1, 3), x)


def test_scatter_views(x):
    # The functional forms of writes through views (what compiled graphs use).
    src = torch.randn(4, 2)
    check(lambda t, s: torch.slice_scatter(t, s, dim=1, start=1, end=5, step=2), x, src)
    check(lambda t, s: torch.select_scatter(t, s[:, 0], 1, -1), x, src)
    check(lambda t, s: torch.diagonal_scatter(t, s[:, 0], 1), x, src)
    check(lambda t, s: torch.as_strided_scatter(t, s, (4, 2), (6, 2), 1), x, src)
