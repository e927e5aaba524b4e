"""A fixed, representative slice of the OpInfo conformance sweep, run in CI.

Each case runs an OpInfo's own sample inputs (a few per op) on the CPU and on the `tpu` device and
compares them with `torch.testing.assert_close` (see torchbridge.device.conformance for the
tolerances). The full sweep over every op is `python -m torchbridge.device.conformance --all`; its
report is docs/ops.md.
"""

from __future__ import annotations

import pytest
import torch

import torchbridge  # noqa: F401 - registers the device
from torchbridge.device import conformance

# (OpInfo name[.variant], variant): elementwise, reductions, matmul, indexing, shape ops, nn.functional.
CASES: list[tuple[str, str]] = [
    # elementwise
    ("add", "f32"), ("add", "i64"), ("add", "bwd"),
    ("mul", "i64"), ("mul", "bwd"),
    ("div.no_rounding_mode", "f32"), ("div.floor_rounding", "i64"),
    ("exp", "f32"), ("log", "bwd"), ("sin", "f32"), ("tanh", "bwd"), ("sigmoid", "f32"),
    ("sqrt", "f32"), ("rsqrt", "f32"), ("pow", "f32"), ("pow", "i64"),
    ("expm1", "f32"), ("log1p", "bwd"), ("erf", "f32"), ("erfinv", "f32"),
    ("atan2", "f32"), ("hypot", "bwd"),
    ("remainder", "f32"), ("remainder", "i64"), ("fmod", "i64"), ("floor_divide", "i64"),
    ("clamp", "f32"), ("clamp", "bwd"), ("clamp", "i64"),
    ("lerp", "f32"), ("addcmul", "bwd"), ("addcdiv", "f32"),
    ("round", "f32"), ("round.decimals_3", "f32"), ("sign", "i64"), ("frac", "f32"),
    ("where", "f32"), ("maximum", "i64"), ("eq", "f32"), ("lt", "i64"),
    ("logical_and", "f32"), ("bitwise_xor", "i64"), ("bitwise_left_shift", "i64"),
    ("nan_to_num", "f32"), ("xlogy", "f32"), ("logaddexp", "f32"),
    # reductions, scans, sorts
    ("sum", "f32"), ("sum", "bwd"), ("mean", "f32"), ("amax", "i64"), ("prod", "f32"),
    ("var", "f32"), ("std", "bwd"), ("var_mean", "f32"),
    ("argmax", "f32"), ("max.reduction_with_dim", "f32"), ("max.reduction_with_dim", "bwd"),
    ("min.reduction_no_dim", "i64"),
    ("cumsum", "f32"), ("cumsum", "bwd"), ("cummax", "f32"), ("logsumexp", "bwd"),
    ("all", "i64"), ("any", "f32"), ("count_nonzero", "f32"),
    ("linalg.vector_norm", "f32"), ("norm", "bwd"),
    ("softmax", "f32"), ("softmax", "bwd"), ("log_softmax", "bwd"),
    ("sort", "f32"), ("topk", "f32"), ("kthvalue", "f32"), ("median", "f32"),
    # matmul
    ("mm", "f32"), ("mm", "bwd"), ("bmm", "f32"), ("matmul", "f32"), ("addmm", "f32"),
    ("mv", "f32"), ("baddbmm", "i64"),
    # linear algebra, fft
    ("linalg.solve", "f32"), ("linalg.inv", "bwd"), ("cholesky", "f32"), ("linalg.det", "f32"),
    ("fft.rfft", "f32"), ("fft.irfft", "f32"), ("fft.ifft", "f32"), ("fft.hfft", "f32"), ("view_as_complex", "f32"),
    ("repeat_interleave", "f32"), ("repeat_interleave", "i64"), ("repeat_interleave", "bwd"), ("to", "f32"),
    ("tensor_split", "i64"), ("as_strided.partial_views", "f32"),
    # indexing
    ("index_select", "f32"), ("gather", "f32"), ("masked_fill", "f32"), ("take", "i64"),
    ("__getitem__", "f32"),
    # shape ops
    ("cat", "f32"), ("stack", "bwd"), ("reshape", "f32"), ("permute", "f32"), ("transpose", "i64"),
    ("squeeze", "f32"), ("unsqueeze", "f32"), ("flip", "f32"), ("roll", "f32"), ("tril", "f32"),
    ("narrow", "f32"), ("expand", "bwd"), ("chunk", "f32"),
    # nn.functional
    ("nn.functional.relu", "f32"), ("nn.functional.gelu", "bwd"), ("nn.functional.silu", "bwd"),
    ("nn.functional.elu", "f32"), ("nn.functional.leaky_relu", "bwd"), ("nn.functional.hardtanh", "f32"),
    ("nn.functional.softplus", "bwd"), ("nn.functional.mish", "f32"), ("nn.functional.hardswish", "f32"),
    ("nn.functional.linear", "f32"),
    # special functions, distances, factorizations, segment reductions
    ("special.bessel_j0", "f32"), ("special.bessel_j1", "i64"), ("special.bessel_y0", "f32"),
    ("special.bessel_y1", "i64"), ("special.modified_bessel_k0", "f32"), ("special.modified_bessel_k1", "i64"),
    ("special.scaled_modified_bessel_k0", "i64"), ("special.scaled_modified_bessel_k1", "f32"),
    ("special.airy_ai", "f32"), ("special.airy_ai", "i64"),
    ("cdist", "f32"), ("cdist", "bwd"), ("nn.functional.pdist", "f32"), ("nn.functional.pdist", "bwd"),
    ("nonzero_static", "f32"), ("nonzero_static", "i64"), ("linalg.eig", "f32"), ("linalg.eigvals", "f32"),
    ("geqrf", "f32"), ("ormqr", "f32"), ("ormqr", "bwd"), ("linalg.householder_product", "bwd"),
    ("linalg.lstsq", "f32"), ("linalg.lstsq", "bwd"),
    ("_segment_reduce.lengths", "f32"), ("_segment_reduce.offsets", "bwd"),
    # eval batch norm's saved stats, counting, embedding_bag, backward ops of losses/upsampling/sampling
    ("native_batch_norm", "f32"), ("_native_batch_norm_legit", "bwd"),
    ("bincount", "i64"), ("histogram", "f32"), ("histogramdd", "f32"),
    ("nn.functional.embedding_bag", "f32"), ("nn.functional.embedding_bag", "bwd"),
    ("nn.functional.interpolate.bicubic", "bwd"), ("nn.functional.multi_margin_loss", "bwd"),
    ("nn.functional.multilabel_margin_loss", "bwd"), ("grid_sampler_2d", "bwd"), ("grid_sampler_3d", "bwd"),
    ("linalg.lu_solve", "bwd"), ("nn.functional.pad.replicate_negative", "f32"),
    ("nn.functional.pad.replicate_negative", "bwd"),
]

_MAX_SAMPLES = 3  # a few samples per op keeps the run short; the full sweep uses more


@pytest.fixture(scope="module")
def op_table() -> dict[str, object]:
    return {conformance.op_key(op): op for op in conformance.all_ops()}


@pytest.mark.parametrize(("key", "variant"), CASES, ids=[f"{k}-{v}" for k, v in CASES])
def test_matches_cpu(op_table: dict[str, object], key: str, variant: str) -> None:
    res = conformance.check(op_table[key], variant, max_samples=_MAX_SAMPLES, budget_s=60.0)
    assert res.status == "pass", f"{key} {variant}: {res.status}: {res.note}"


def test_mismatch_is_reported(op_table: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner must be able to fail: a device result that differs from the CPU is a 'fail'."""
    real = conformance._to_cpu
    def shifted(v: object) -> object:
        on_device = isinstance(v, torch.Tensor) and v.device.type == conformance.DEVICE
        return real(v) + 1 if on_device else real(v)

    monkeypatch.setattr(conformance, "_to_cpu", shifted)
    res = conformance.check(op_table["exp"], "f32", max_samples=1)
    assert res.status == "fail" and "not close" in res.note


def test_report_lists_every_op() -> None:
    keys = ["a", "b.x", "c"]
    results = {"a": {v: conformance.Result("pass") for v in conformance.VARIANTS},
               "c": {v: conformance.Result("fail", "boom") for v in conformance.VARIANTS}}
    text = conformance.render(results, keys, "cmd")
    assert all(f"| `{k}` |" in text for k in keys)
    assert "| forward float32 (non-random ops) | 1 | 2 | 50.0% |" in text
