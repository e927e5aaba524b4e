"""Kernels the device gives existing aten ops beside its fallback (registered by registration.register).

Meta kernels PyTorch lacks (the dispatcher asks an op's meta kernel for its output metadata), and
device kernels for ops whose outputs PyTorch's meta kernels describe differently from the CPU's: each
runs the op through the fast path (its lowering) and then fixes what the CPU does differently. The
lowerings themselves stay pure JAX (device/lowerings/).
"""

from __future__ import annotations

import torch

from torchbridge.device import native, views

aten = torch.ops.aten
_NONE = 0  # at::Reduction::None


# ---- histogram / histogramdd (Meta) --------------------------------------------------------------
def _check_float(self: torch.Tensor, name: str) -> None:
    torch._check(self.dtype.is_floating_point,
                 lambda: f"torch.{name}: input tensor and bins tensors should have the same dtype, "
                         f"but got input {self.dtype}")


def _hist_meta_bin_ct(self, bins=100, *, range=None, weight=None, density=False):  # noqa: A002
    _check_float(self, "histogram")
    torch._check(bins > 0, lambda: f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    return self.new_empty((bins,)), self.new_empty((bins + 1,))


def _hist_meta_bins_tensor(self, bins, *, weight=None, density=False):
    _check_float(self, "histogram")
    torch._check(bins.dim() == 1, lambda: "torch.histogram(): bins tensor should have one dimension")
    return self.new_empty((max(bins.numel() - 1, 0),)), self.new_empty((bins.numel(),))


def _dd_check(self: torch.Tensor, n: int) -> None:
    _check_float(self, "histogramdd")
    torch._check(self.dim() >= 2, lambda: "torch.histogramdd: input tensor should have at least 2 dimensions")
    torch._check(self.shape[-1] == n, lambda: f"torch.histogramdd: expected {self.shape[-1]} sequences of bin "
                                              f"edges for each dimension of the input, but got {n}")


def _dd_edges_meta(self, bins, *, range=None, weight=None, density=False):  # noqa: A002
    _dd_check(self, len(bins))
    return [self.new_empty((b + 1,)) for b in bins]


def _dd_cts_meta(self, bins, *, range=None, weight=None, density=False):  # noqa: A002
    _dd_check(self, len(bins))
    return self.new_empty(tuple(bins))


def _dd_tensors_meta(self, bins, *, weight=None, density=False):
    _dd_check(self, len(bins))
    return self.new_empty(tuple(max(b.numel() - 1, 0) for b in bins))


# ---- geqrf (Meta) ----------------------------------------------------------------------------------
# geqrf has no Meta kernel, which the dispatcher needs for the output metadata. Shapes as on the
# CPU: the factored matrix keeps the input's shape (column-major, as LAPACK writes it) and tau has
# min(m, n) entries per matrix.


def _geqrf_meta(a):
    m, n = a.shape[-2], a.shape[-1]
    factored = torch.empty(a.shape[:-2] + (n, m), dtype=a.dtype, device="meta").mT
    return factored, torch.empty(a.shape[:-2] + (min(m, n),), dtype=a.dtype, device="meta")


def _geqrf_out_meta(self, *, a, tau):
    factored, t = _geqrf_meta(self)
    a.resize_(factored.shape)
    tau.resize_(t.shape)
    return a, tau


# ---- linalg_lstsq.out (Meta) -------------------------------------------------------------------------
def _lstsq_out_meta(self, b, rcond=None, *, driver=None, solution, residuals, rank, singular_values):
    driver = driver or "gelsy"
    m, n = self.shape[-2], self.shape[-1]
    vector = b.dim() == 1 or (b.dim() == self.dim() - 1 and b.shape == self.shape[:-1])
    k = 1 if vector else b.shape[-1]
    batch = torch.broadcast_shapes(self.shape[:-2], b.shape[:-1] if vector else b.shape[:-2])
    solution.resize_(batch + ((n,) if vector else (n, k)))
    residuals.resize_(batch + (k,) if m > n and driver != "gelsy" else (0,))
    rank.resize_(batch if driver != "gels" else (0,))
    singular_values.resize_(batch + (min(m, n),) if driver in ("gelsd", "gelss") else (0,))
    return solution, residuals, rank, singular_values


# ---- margin losses (Meta for the backward ops, a device kernel for the forward) -----------------------
def _grad_input_meta(grad_output, self, *args, **kwargs):
    return torch.empty_like(self)




# PyTorch's meta kernel sizes the unreduced loss of a 1-D input as (1,); the CPU kernel returns a 0-dim
# tensor. The device kernel runs the lowering, then views the loss as the CPU shapes it.
def _multilabel_forward_kernel(self: torch.Tensor, target: torch.Tensor, reduction: int) -> tuple:
    out, is_target = native.load().fast_call(torch.ops.aten.multilabel_margin_loss_forward.default, self, target,
                                             reduction)
    if reduction == _NONE and self.dim() <= 1 and out.dim() == 1:
        out = out.view(())
    return out, is_target


# ---- batch norm in eval mode (device kernels) --------------------------------------------------------
# In eval mode the CPU kernels return save_mean/save_invstd of shape (0,) (CUDA's return the running
# stats, (C,)); the meta kernels, and so the lowerings above, give (C,). Eager conformance is against the
# CPU, so the device kernels of these ops run the lowering and then swap those two outputs for empty
# tensors of the CPU's dtype. The backward ops ignore them in eval mode. Under torch.compile nothing
# changes: FakeTensorMode never reaches these kernels.
def _eval_batch_norm_kernel(op, training_at: int | None):
    def kernel(*args, **kwargs):
        out, mean, invstd = native.load().fast_call(op, *args, **kwargs)[:3]
        if training_at is None:
            training = False
        else:
            training = args[training_at] if len(args) > training_at else kwargs["training"]
        if training:
            return out, mean, invstd
        running_mean = args[3] if len(args) > 3 else kwargs.get("running_mean")
        # The CPU gives its saved stats the input's dtype, or float32 for a half input with float32 stats.
        dt = running_mean.dtype if running_mean is not None else args[0].dtype
        return out, mean.new_empty((0,), dtype=dt), invstd.new_empty((0,), dtype=dt)

    return kernel


# ---- cummax/cummin helpers, _logcumsumexp (Meta) -------------------------------------------------------
# cummax/cummin resize their outputs, then call these helpers to fill them. The helpers have no
# Meta kernel, which the dispatcher needs for output metadata: they return nothing and only write
# into already-sized outputs, so the Meta kernel is a no-op.
def _no_output(*args: object, **kwargs: object) -> None:
    return None


def _logcumsumexp_meta(a: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty_like(a)


# ---- complex <-> real views (device kernels) -----------------------------------------------------------
def _meta_view(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `t`'s sizes, strides, offset and dtype (for PyTorch's own checks)."""
    need = t.storage_offset() + views.storage_numel(tuple(t.shape), tuple(t.stride()))
    return torch.empty((need,), dtype=t.dtype, device="meta").as_strided(t.shape, t.stride(), t.storage_offset())


def _view_as_real_kernel(a: torch.Tensor) -> torch.Tensor:
    torch._check(not a.is_conj(), lambda: "view_as_real doesn't work on unresolved conjugated tensors.  "
                 "To resolve the conjugate tensor so you can view it as real, use self.resolve_conj(); "
                 "however, be warned that the resulting tensor will NOT alias the original.")
    torch.view_as_real(_meta_view(a))  # PyTorch's checks and errors
    # (..., 1) complex with a unit last stride, viewed as its real dtype: (..., 2), strides and offset
    # doubled, sharing the storage; exactly view_as_real's layout.
    return a.unsqueeze(-1).view(_REAL_OF[a.dtype])


def _view_as_complex_kernel(a: torch.Tensor) -> torch.Tensor:
    out = torch.view_as_complex(_meta_view(a))  # PyTorch's checks and errors
    # Its checks (last dim 2 with stride 1, even strides and offset) are view(dtype)'s conditions.
    return a.view(out.dtype).squeeze(-1)


_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}


_libraries: list[torch.library.Library] = []  # kept alive for the process: dropping one unregisters it


def register() -> None:
    """Register every kernel above (once)."""
    if _libraries:
        return
    meta = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - Meta kernels for existing aten ops
    for name, fn in (("histogram.bin_ct", _hist_meta_bin_ct), ("histogram.bins_tensor", _hist_meta_bins_tensor),
                     ("_histogramdd_bin_edges", _dd_edges_meta), ("_histogramdd_from_bin_cts", _dd_cts_meta),
                     ("_histogramdd_from_bin_tensors", _dd_tensors_meta), ("geqrf", _geqrf_meta),
                     ("geqrf.a", _geqrf_out_meta), ("linalg_lstsq.out", _lstsq_out_meta),
                     ("multi_margin_loss_backward", _grad_input_meta),
                     ("multilabel_margin_loss_backward", _grad_input_meta),
                     ("_cummax_helper", _no_output), ("_cummin_helper", _no_output),
                     ("_logcumsumexp", _logcumsumexp_meta)):
        meta.impl(name, fn, "Meta")
    device = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - device kernels for existing aten ops
    for name, fn in (("multilabel_margin_loss_forward", _multilabel_forward_kernel),
                     ("native_batch_norm", _eval_batch_norm_kernel(aten.native_batch_norm.default, 5)),
                     ("_native_batch_norm_legit", _eval_batch_norm_kernel(aten._native_batch_norm_legit.default, 5)),
                     ("_native_batch_norm_legit_no_training",
                      _eval_batch_norm_kernel(aten._native_batch_norm_legit_no_training.default, None)),
                     ("view_as_real", _view_as_real_kernel), ("view_as_complex", _view_as_complex_kernel)):
        device.impl(name, fn, "PrivateUse1")
    _libraries.extend((meta, device))
