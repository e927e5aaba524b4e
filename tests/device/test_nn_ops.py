"""Convolution, pooling, normalization, upsampling, losses and attention on the device: forward values
and gradients against CPU PyTorch on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchbridge

pytestmark = pytest.mark.skipif(torchbridge.registration_error() is not None, reason="device backend not registered")
DEV = torchbridge.device_name()
TOL = {"atol": 1e-4, "rtol": 1e-4}


def fwd_bwd(fn, *inputs):
    """(outputs, grads) of fn on CPU and on the device. Every floating input gets a gradient; the backward
    seed is a fixed pseudo-random tensor so each output element's gradient path is exercised."""
    results = []
    for dev in ("cpu", DEV):
        xs = [x.detach().to(dev).requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        seeds = [torch.linspace(-1, 1, o.numel()).view(o.shape).to(dev) for o in outs]
        diff = [(o, s) for o, s in zip(outs, seeds, strict=True) if o.requires_grad]
        torch.autograd.backward([o for o, _ in diff], [s for _, s in diff])
        results.append(([o.detach().cpu() for o in outs], [x.grad.cpu() if x.grad is not None else None for x in xs]))
    (cpu_out, cpu_grad), (dev_out, dev_grad) = results
    torch.testing.assert_close(dev_out, cpu_out, **TOL)
    torch.testing.assert_close(dev_grad, cpu_grad, **TOL)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's own note on the CPU side
def test_conv2d_forward_backward():
    x = torch.randn(2, 4, 7, 6)
    w = torch.randn(6, 2, 3, 3)
    b = torch.randn(6)
    fwd_bwd(lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2), x, w, b)
    fwd_bwd(lambda x, w: F.conv2d(x, w, padding="same"), x, torch.randn(3, 4, 3, 2))


def test_conv1d_conv3d_and_transposed():
    fwd_bwd(lambda x, w: F.conv1d(x, w, stride=2, padding=1), torch.randn(2, 3, 9), torch.randn(4, 3, 3))
    fwd_bwd(lambda x, w: F.conv3d(x, w, padding=1), torch.randn(1, 2, 4, 4, 3), torch.randn(2, 2, 3, 3, 3))
    x = torch.randn(2, 4, 5, 5)
    w = torch.randn(4, 3, 3, 2)  # (in, out/groups, kh, kw)
    fwd_bwd(lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1, groups=2, dilation=1),
            x, w, torch.randn(6))
    fwd_bwd(lambda x, w: F.conv_transpose1d(x, w, stride=3, padding=2, dilation=2),
            torch.randn(1, 4, 6), torch.randn(4, 2, 3))


def test_conv_module_unbatched():
    conv = torch.nn.Conv2d(3, 5, 3, padding=1)
    x = torch.randn(3, 6, 6)
    want = conv(x)
    got = conv.to(DEV)(x.to(DEV)).cpu()
    torch.testing.assert_close(got, want, **TOL)


def test_pooling():
    x = torch.randn(2, 3, 9, 8)
    fwd_bwd(lambda x: F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True), x)
    fwd_bwd(lambda x: F.max_pool2d(x, (2, 3), stride=2, dilation=(2, 1), ceil_mode=True), x)
    fwd_bwd(lambda x: F.avg_pool2d(x, 3, stride=2, padding=1), x)
    fwd_bwd(lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False), x)
    fwd_bwd(lambda x: F.avg_pool2d(x, 2, divisor_override=3), x)
    fwd_bwd(lambda x: F.adaptive_avg_pool2d(x, (4, 3)), x)
    fwd_bwd(lambda x: F.adaptive_avg_pool2d(x, 1), x)
    fwd_bwd(lambda x: F.adaptive_max_pool2d(x, (4, 3), return_indices=True), x)


def test_max_pool_ties_pick_first():
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, 1, 1] = x[0, 0, 1, 0] = 5.0
    want = F.max_pool2d(x, 2, return_indices=True)
    got = F.max_pool2d(x.to(DEV), 2, return_indices=True)
    torch.testing.assert_close([g.cpu() for g in got], list(want))


def test_unfold_fold():
    x = torch.randn(2, 3, 7, 6)
    fwd_bwd(lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=(2, 1)), x)
    fwd_bwd(lambda c: F.fold(c, (5, 9), (2, 2), padding=(0, 1), stride=(1, 2), dilation=(2, 1)), torch.randn(2, 12, 15))


def test_layer_and_group_norm():
    x = torch.randn(3, 4, 6)
    fwd_bwd(lambda x, w, b: F.layer_norm(x, (6,), w, b, eps=1e-5), x, torch.randn(6), torch.randn(6))
    fwd_bwd(lambda x: F.layer_norm(x, (4, 6)), x)
    fwd_bwd(lambda x: torch.native_layer_norm(x, (6,), None, None, 1e-5), x)  # mean/rstd outputs too
    img = torch.randn(2, 6, 3, 4)
    fwd_bwd(lambda x, w, b: F.group_norm(x, 3, w, b), img, torch.randn(6), torch.randn(6))


def test_batch_norm_training_updates_running_stats():
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    w, b = torch.randn(3), torch.randn(3)
    stats = {}
    for dev in ("cpu", DEV):
        m, v = rm.clone().to(dev), rv.clone().to(dev)
        F.batch_norm(x.to(dev), m, v, w.to(dev), b.to(dev), training=True, momentum=0.3)
        stats[dev] = (m.cpu(), v.cpu())
    torch.testing.assert_close(stats[DEV], stats["cpu"], **TOL)
    fwd_bwd(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), x, w, b)


def test_batch_norm_eval_and_module():
    x = torch.randn(4, 3, 5)
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    fwd_bwd(lambda x, w, b: F.batch_norm(x, rm.to(x.device), rv.to(x.device), w, b, training=False), x,
            torch.randn(3), torch.randn(3))
    bn = torch.nn.BatchNorm1d(3)
    bn_dev = torch.nn.BatchNorm1d(3).to(DEV)
    for _ in range(2):
        bn(x)
        bn_dev(x.to(DEV))
    torch.testing.assert_close(bn_dev.running_mean.cpu(), bn.running_mean, **TOL)
    torch.testing.assert_close(bn_dev.running_var.cpu(), bn.running_var, **TOL)
    assert int(bn_dev.num_batches_tracked) == 2


def test_upsample():
    x = torch.randn(1, 2, 4, 5)
    fwd_bwd(lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), x)
    fwd_bwd(lambda x: F.interpolate(x, size=(7, 3), mode="nearest"), x)
    fwd_bwd(lambda x: F.interpolate(x, scale_factor=1.7, mode="bilinear"), x)
    fwd_bwd(lambda x: F.interpolate(x, size=(7, 9), mode="bilinear", align_corners=True), x)
    fwd_bwd(lambda x: F.interpolate(x, size=(6, 7), mode="nearest-exact"), x)


def test_losses():
    logits = torch.randn(5, 4)
    target = torch.tensor([1, 0, 3, 3, -100])
    w = torch.rand(4) + 0.5
    fwd_bwd(lambda x: F.cross_entropy(x, target.to(x.device)), logits)
    fwd_bwd(lambda x: F.nll_loss(F.log_softmax(x, 1), target.to(x.device), weight=w.to(x.device), reduction="sum"),
            logits)
    fwd_bwd(lambda x: F.nll_loss(x, target.to(x.device), reduction="none"), logits)
    img = torch.randn(2, 3, 4, 4)
    t2 = torch.randint(0, 3, (2, 4, 4))
    fwd_bwd(lambda x: F.cross_entropy(x, t2.to(x.device)), img)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    fwd_bwd(lambda a, b: F.mse_loss(a, b), a, b)
    fwd_bwd(lambda a, b: F.mse_loss(a, b, reduction="none"), a, b)
    fwd_bwd(lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), a, b)
    fwd_bwd(lambda a, b: F.huber_loss(a, b, delta=0.7, reduction="sum"), a, b)
    p = torch.rand(3, 4).clamp(0.05, 0.95)
    fwd_bwd(lambda p, t: F.binary_cross_entropy(p, t), p, torch.rand(3, 4))
    bw = torch.rand(3, 4)
    fwd_bwd(lambda p, t: F.binary_cross_entropy(p, t, weight=bw.to(p.device), reduction="sum"), p, torch.rand(3, 4))


def test_scaled_dot_product_attention():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    q2 = torch.randn(2, 3, 6, 8)
    fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q2, k, v)
    mask = torch.rand(6, 6) > 0.3
    mask[:, 0] = True
    fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device)), q2, k, v)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01), fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True),
], ids=["adam", "adamw_amsgrad", "adam_tensor_lr", "sgd_nesterov"])
def test_fused_optimizer_steps_match_cpu(make):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    dev = [p.detach().to(DEV).requires_grad_() for p in model.parameters()]
    x = torch.randn(5, 4)

    def loss(ps, x):
        h = torch.tanh(x @ ps[0].t() + ps[1])
        return (h @ ps[2].t() + ps[3]).square().sum()

    # CPU reference: the plain (unfused) for-loop implementation of the same optimizer.
    opt_ref = make(ref)
    for g in opt_ref.param_groups:
        g["fused"], g["foreach"] = False, False
    opt_dev = make(dev)
    for _ in range(3):
        for ps, opt, xx in ((ref, opt_ref, x), (dev, opt_dev, x.to(DEV))):
            opt.zero_grad()
            loss(ps, xx).backward()
            opt.step()
    torch.testing.assert_close([p.detach().cpu() for p in dev], [p.detach() for p in ref], atol=1e-5, rtol=1e-5)
