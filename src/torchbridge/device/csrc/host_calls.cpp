// XLA FFI custom calls for JAX's CPU platform (registered for "cpu" only; see host_calls.py).
//
// The host GEMM runs a matrix multiply with PyTorch's CPU BLAS (the GEMM torch.mm and inductor use)
// instead of XLA:CPU's own dot emitter. Why: on the CPU platform XLA's YNNPACK/Eigen dots ran 1.2-1.4x slower than torch's GEMM on the
// Llama-shaped products we measured (1024x384 @ 384x1024 and friends), and the dots are most of a
// transformer step. Only the arithmetic moves: XLA still schedules, fuses everything around the
// dot, and owns every buffer. The custom call is registered for the "cpu" platform only; other
// platforms keep XLA's dot (see host_calls.py).
//
// Operands arrive row-major (XLA's default custom-call layout). A transposed operand is passed
// un-transposed with trans_a/trans_b set, so a weight read as W.T costs no copy.

#include <ATen/ATen.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <c10/core/InferenceMode.h>

#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

bool to_scalar_type(ffi::DataType t, at::ScalarType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = at::kFloat; return true;
    case ffi::DataType::F64: *out = at::kDouble; return true;
    default: return false;
  }
}

at::Tensor wrap(void* data, ffi::AnyBuffer::Dimensions dims, at::ScalarType st) {
  std::vector<int64_t> sizes(dims.begin(), dims.end());
  return at::from_blob(data, sizes, at::TensorOptions().dtype(st));
}

at::Tensor wrap(ffi::AnyBuffer b, at::ScalarType st) { return wrap(b.untyped_data(), b.dimensions(), st); }

ffi::Error host_gemm(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out, bool trans_a,
                     bool trans_b) {
  at::ScalarType st;
  if (a.element_type() != b.element_type() || a.element_type() != out->element_type() ||
      !to_scalar_type(a.element_type(), &st)) {
    return ffi::Error::InvalidArgument("torchbridge host GEMM: operands must both be float32 or float64");
  }
  const size_t rank = a.dimensions().size();
  if ((rank != 2 && rank != 3) || b.dimensions().size() != rank || out->dimensions().size() != rank) {
    return ffi::Error::InvalidArgument("torchbridge host GEMM: operands must be rank 2 (mm) or 3 (bmm)");
  }
  // Runs on an XLA worker thread: no autograd, no Python, no device state.
  c10::InferenceMode guard;
  at::Tensor ta = wrap(a, st);
  at::Tensor tb = wrap(b, st);
  at::Tensor to = wrap(*out, st);
  if (trans_a) ta = ta.transpose(-2, -1);
  if (trans_b) tb = tb.transpose(-2, -1);
  if (rank == 2) {
    at::mm_out(to, ta, tb);
  } else {
    at::bmm_out(to, ta, tb);
  }
  return ffi::Error::Success();
}

// The fence: a copy XLA cannot see through. XLA:CPU drops optimization barriers before fusion, and
// then fuses a small, costly value (a rotary cos/sin table) into every consumer, evaluating it once
// per *consumer* element; a custom call's result is a real buffer, computed once.
ffi::Error fence(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  if (in.size_bytes() != out->size_bytes()) return ffi::Error::InvalidArgument("torchbridge fence: size mismatch");
  if (in.size_bytes()) std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  return ffi::Error::Success();
}

// Fused attention: PyTorch's CPU flash attention (what CPU PyTorch and inductor run) on XLA buffers.
// q [B,H,L,E], k/v [B,H,S,E] (heads already equal), mask a float [B,H,L,S] additive bias when
// has_mask (else a 1-element placeholder). Outputs out [B,H,L,E] and logsumexp [B,H,L].
std::optional<at::Tensor> optional_mask(ffi::AnyBuffer mask, bool has_mask, at::ScalarType st) {
  return has_mask ? std::optional<at::Tensor>(wrap(mask, st)) : std::nullopt;
}

ffi::Error attention(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer mask,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, bool is_causal, bool has_mask,
                     double scale) {
  at::ScalarType st;
  if (!to_scalar_type(q.element_type(), &st)) return ffi::Error::InvalidArgument("torchbridge attention: float32/float64 only");
  c10::InferenceMode guard;
  auto res = at::_scaled_dot_product_flash_attention_for_cpu(wrap(q, st), wrap(k, st), wrap(v, st), 0.0, is_causal,
                                                              optional_mask(mask, has_mask, st), scale);
  wrap(*out, st).copy_(std::get<0>(res));
  wrap(*lse, st).copy_(std::get<1>(res));
  return ffi::Error::Success();
}

ffi::Error attention_backward(ffi::AnyBuffer grad_out, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer mask,
                              ffi::Result<ffi::AnyBuffer> gq, ffi::Result<ffi::AnyBuffer> gk,
                              ffi::Result<ffi::AnyBuffer> gv, bool is_causal, bool has_mask, double scale) {
  at::ScalarType st;
  if (!to_scalar_type(q.element_type(), &st)) return ffi::Error::InvalidArgument("torchbridge attention: float32/float64 only");
  c10::InferenceMode guard;
  auto res = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      wrap(grad_out, st), wrap(q, st), wrap(k, st), wrap(v, st), wrap(out, st), wrap(lse, st), 0.0, is_causal,
      optional_mask(mask, has_mask, st), scale);
  wrap(*gq, st).copy_(std::get<0>(res));
  wrap(*gk, st).copy_(std::get<1>(res));
  wrap(*gv, st).copy_(std::get<2>(res));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchbridgeAttention, attention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("is_causal")
                                  .Attr<bool>("has_mask")
                                  .Attr<double>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchbridgeAttentionBackward, attention_backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("is_causal")
                                  .Attr<bool>("has_mask")
                                  .Attr<double>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchbridgeHostGemm, host_gemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchbridgeFence, fence, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

void* torchbridge_host_gemm_handler() { return reinterpret_cast<void*>(&TorchbridgeHostGemm); }
void* torchbridge_fence_handler() { return reinterpret_cast<void*>(&TorchbridgeFence); }
void* torchbridge_attention_handler() { return reinterpret_cast<void*>(&TorchbridgeAttention); }
void* torchbridge_attention_backward_handler() { return reinterpret_cast<void*>(&TorchbridgeAttentionBackward); }
