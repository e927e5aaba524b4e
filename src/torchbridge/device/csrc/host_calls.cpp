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
#include <ATen/Parallel.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The torch scalar type of an XLA element type, where it is one of the types `allowed` (a handler's).
bool to_scalar_type(ffi::DataType t, std::initializer_list<at::ScalarType> allowed, at::ScalarType* out) {
  at::ScalarType st;
  switch (t) {
    case ffi::DataType::F32: st = at::kFloat; break;
    case ffi::DataType::F64: st = at::kDouble; break;
    case ffi::DataType::BF16: st = at::kBFloat16; break;
    case ffi::DataType::F16: st = at::kHalf; break;
    case ffi::DataType::S32: st = at::kInt; break;
    case ffi::DataType::S64: st = at::kLong; break;
    default: return false;
  }
  if (std::find(allowed.begin(), allowed.end(), st) == allowed.end()) return false;
  *out = st;
  return true;
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
      !to_scalar_type(a.element_type(), {at::kFloat, at::kDouble}, &st)) {
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
  if (!to_scalar_type(q.element_type(), {at::kFloat, at::kDouble}, &st)) return ffi::Error::InvalidArgument("torchbridge attention: float32/float64 only");
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
  if (!to_scalar_type(q.element_type(), {at::kFloat, at::kDouble}, &st)) return ffi::Error::InvalidArgument("torchbridge attention: float32/float64 only");
  c10::InferenceMode guard;
  auto res = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      wrap(grad_out, st), wrap(q, st), wrap(k, st), wrap(v, st), wrap(out, st), wrap(lse, st), 0.0, is_causal,
      optional_mask(mask, has_mask, st), scale);
  wrap(*gq, st).copy_(std::get<0>(res));
  wrap(*gk, st).copy_(std::get<1>(res));
  wrap(*gv, st).copy_(std::get<2>(res));
  return ffi::Error::Success();
}

// Adam/AdamW: one parameter's update in one pass. XLA:CPU has no multi-output loop fusion: it emits
// each moment's update as its own loop and recomputes both inside the parameter's, reading 8 arrays
// and writing 3 per element; this loop reads p, g, m, v once and writes p', m', v' once (what
// inductor's and PyTorch's fused kernels do). The operations are torch's foreach AdamW's, in its
// order: m' = lerp(m, g, 1 - beta1), v' = beta2 v + (1 - beta2) g g, d = sqrt(v') / sqrt(bc2) + eps,
// p' = decay p - step_size m' / d (first g = gscale g + l2 p: maximize's sign, Adam's L2 weight decay).
struct AdamCoef {
  double decay, l2, w1, beta2, w2, step_size, bc2_sqrt, eps, gscale;  // gscale: -1 for maximize
};

// The loop, written once for float and double. No helper calls inside (a function compiled with
// other options than its caller is not inlined, and a call stops vectorisation); the square root is
// the builtin, which -fno-math-errno (native.py) lets the vectoriser turn into vsqrtps.
#define TORCHBRIDGE_ADAM_LOOP(T, SQRT)                                                                       \
  const T decay = c.decay, l2 = c.l2, w1 = c.w1, b2 = c.beta2, w2 = c.w2, step = c.step_size, bc2 = c.bc2_sqrt, \
          eps = c.eps, gs = c.gscale;                                                                        \
  if (l2 != 0) { /* Adam's L2 weight decay: g += l2 p (AdamW decays p itself through `decay`) */            \
    for (int64_t i = lo; i < hi; ++i) {                                                                      \
      const T gi = gs * g[i] + l2 * p[i];                                                                    \
      const T mi = low ? m[i] + w1 * (gi - m[i]) : gi - (gi - m[i]) * (1 - w1);                              \
      const T vi = v[i] * b2 + w2 * gi * gi;                                                                 \
      po[i] = p[i] * decay - step * (mi / (SQRT(vi) / bc2 + eps));                                           \
      mo[i] = mi;                                                                                            \
      vo[i] = vi;                                                                                            \
    }                                                                                                        \
  } else if (low) { /* torch's lerp: the formula depends on which end the weight is nearer */               \
    for (int64_t i = lo; i < hi; ++i) {                                                                      \
      const T gi = gs * g[i];                                                                                \
      const T mi = m[i] + w1 * (gi - m[i]);                                                                  \
      const T vi = v[i] * b2 + w2 * gi * gi;                                                                 \
      po[i] = p[i] * decay - step * (mi / (SQRT(vi) / bc2 + eps));                                           \
      mo[i] = mi;                                                                                            \
      vo[i] = vi;                                                                                            \
    }                                                                                                        \
  } else {                                                                                                   \
    for (int64_t i = lo; i < hi; ++i) {                                                                      \
      const T gi = gs * g[i];                                                                                \
      const T mi = gi - (gi - m[i]) * (1 - w1);                                                              \
      const T vi = v[i] * b2 + w2 * gi * gi;                                                                 \
      po[i] = p[i] * decay - step * (mi / (SQRT(vi) / bc2 + eps));                                           \
      mo[i] = mi;                                                                                            \
      vo[i] = vi;                                                                                            \
    }                                                                                                        \
  }

// one copy per instruction set, picked when the library loads
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void adam_f32(
    const float* __restrict p, const float* __restrict g, const float* __restrict m, const float* __restrict v,
    float* __restrict po, float* __restrict mo, float* __restrict vo, int64_t lo, int64_t hi, const AdamCoef& c) {
  const bool low = c.w1 < 0.5;
  TORCHBRIDGE_ADAM_LOOP(float, __builtin_sqrtf)
}

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void adam_f64(
    const double* __restrict p, const double* __restrict g, const double* __restrict m, const double* __restrict v,
    double* __restrict po, double* __restrict mo, double* __restrict vo, int64_t lo, int64_t hi, const AdamCoef& c) {
  const bool low = c.w1 < 0.5;
  TORCHBRIDGE_ADAM_LOOP(double, __builtin_sqrt)
}
// In place (the program donated p, m and v and the call aliases its results to them): each element's
// results depend only on that element's inputs, read before they are overwritten; the output pointers
// are derived from the restrict-qualified inputs, so the compiler knows they are the same arrays.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void adam_f32_in_place(
    float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t lo, int64_t hi,
    const AdamCoef& c) {
  const bool low = c.w1 < 0.5;
  float *const po = p, *const mo = m, *const vo = v;
  TORCHBRIDGE_ADAM_LOOP(float, __builtin_sqrtf)
}

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void adam_f64_in_place(
    double* __restrict p, const double* __restrict g, double* __restrict m, double* __restrict v, int64_t lo,
    int64_t hi, const AdamCoef& c) {
  const bool low = c.w1 < 0.5;
  double *const po = p, *const mo = m, *const vo = v;
  TORCHBRIDGE_ADAM_LOOP(double, __builtin_sqrt)
}
#undef TORCHBRIDGE_ADAM_LOOP

ffi::Error adam_step(ffi::AnyBuffer p, ffi::AnyBuffer g, ffi::AnyBuffer m, ffi::AnyBuffer v, ffi::AnyBuffer coef,
                     ffi::Result<ffi::AnyBuffer> po, ffi::Result<ffi::AnyBuffer> mo, ffi::Result<ffi::AnyBuffer> vo) {
  const auto t = p.element_type();
  if (g.element_type() != t || m.element_type() != t || v.element_type() != t || coef.element_type() != ffi::DataType::F64 ||
      coef.element_count() != 9 || (t != ffi::DataType::F32 && t != ffi::DataType::F64)) {
    return ffi::Error::InvalidArgument("torchbridge adam step: float32/float64 arrays and 9 float64 coefficients");
  }
  const int64_t n = static_cast<int64_t>(p.element_count());
  if (g.element_count() != static_cast<size_t>(n) || m.element_count() != static_cast<size_t>(n) ||
      v.element_count() != static_cast<size_t>(n)) {
    return ffi::Error::InvalidArgument("torchbridge adam step: arrays of different sizes");
  }
  AdamCoef c;
  std::memcpy(&c, coef.untyped_data(), sizeof(c));
  const bool in_place = po->untyped_data() == p.untyped_data();
  if (in_place && (mo->untyped_data() != m.untyped_data() || vo->untyped_data() != v.untyped_data())) {
    return ffi::Error::InvalidArgument("torchbridge adam step: p, m and v are updated in place together or not at all");
  }
  // chunks of 64K elements: a few per thread for the large matrices, one call's worth for small ones
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    if (in_place && t == ffi::DataType::F32) {
      adam_f32_in_place(static_cast<float*>(po->untyped_data()), static_cast<const float*>(g.untyped_data()),
                        static_cast<float*>(mo->untyped_data()), static_cast<float*>(vo->untyped_data()), lo, hi, c);
    } else if (in_place) {
      adam_f64_in_place(static_cast<double*>(po->untyped_data()), static_cast<const double*>(g.untyped_data()),
                        static_cast<double*>(mo->untyped_data()), static_cast<double*>(vo->untyped_data()), lo, hi,
                        c);
    } else if (t == ffi::DataType::F32) {
      adam_f32(static_cast<const float*>(p.untyped_data()), static_cast<const float*>(g.untyped_data()),
                        static_cast<const float*>(m.untyped_data()), static_cast<const float*>(v.untyped_data()),
                        static_cast<float*>(po->untyped_data()), static_cast<float*>(mo->untyped_data()),
                        static_cast<float*>(vo->untyped_data()), lo, hi, c);
    } else {
      adam_f64(static_cast<const double*>(p.untyped_data()), static_cast<const double*>(g.untyped_data()),
                         static_cast<const double*>(m.untyped_data()), static_cast<const double*>(v.untyped_data()),
                         static_cast<double*>(po->untyped_data()), static_cast<double*>(mo->untyped_data()),
                         static_cast<double*>(vo->untyped_data()), lo, hi, c);
    }
  });
  return ffi::Error::Success();
}

// Adagrad (torch.optim.Adagrad's foreach order): g = gscale g + l2 p, s' = s + g g,
// p' = p + (g clr) / (sqrt(s') + eps), clr = -lr / (1 + (step - 1) lr_decay).
struct AdagradCoef {
  double clr, eps, l2, gscale;
};

#define TORCHBRIDGE_ADAGRAD_LOOP(T, SQRT)                                   \
  const T clr = c.clr, eps = c.eps, l2 = c.l2, gs = c.gscale;               \
  for (int64_t i = lo; i < hi; ++i) {                                       \
    const T gi = l2 != 0 ? gs * g[i] + l2 * p[i] : gs * g[i];               \
    const T si = s[i] + gi * gi;                                            \
    po[i] = p[i] + (gi * clr) / (SQRT(si) + eps);                           \
    so[i] = si;                                                             \
  }

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void adagrad_f32(
    const float* __restrict p, const float* __restrict g, const float* __restrict s, float* __restrict po,
    float* __restrict so, int64_t lo, int64_t hi, const AdagradCoef& c) {
  TORCHBRIDGE_ADAGRAD_LOOP(float, __builtin_sqrtf)
}

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void adagrad_f64(
    const double* __restrict p, const double* __restrict g, const double* __restrict s, double* __restrict po,
    double* __restrict so, int64_t lo, int64_t hi, const AdagradCoef& c) {
  TORCHBRIDGE_ADAGRAD_LOOP(double, __builtin_sqrt)
}

// in place: as adam_f32_in_place (each element's results depend only on its own inputs)
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void adagrad_f32_in_place(
    float* __restrict p, const float* __restrict g, float* __restrict s, int64_t lo, int64_t hi,
    const AdagradCoef& c) {
  float *const po = p, *const so = s;
  TORCHBRIDGE_ADAGRAD_LOOP(float, __builtin_sqrtf)
}

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void adagrad_f64_in_place(
    double* __restrict p, const double* __restrict g, double* __restrict s, int64_t lo, int64_t hi,
    const AdagradCoef& c) {
  double *const po = p, *const so = s;
  TORCHBRIDGE_ADAGRAD_LOOP(double, __builtin_sqrt)
}
#undef TORCHBRIDGE_ADAGRAD_LOOP

ffi::Error adagrad_step(ffi::AnyBuffer p, ffi::AnyBuffer g, ffi::AnyBuffer s, ffi::AnyBuffer coef,
                        ffi::Result<ffi::AnyBuffer> po, ffi::Result<ffi::AnyBuffer> so) {
  const auto t = p.element_type();
  if (g.element_type() != t || s.element_type() != t || coef.element_type() != ffi::DataType::F64 ||
      coef.element_count() != 4 || (t != ffi::DataType::F32 && t != ffi::DataType::F64)) {
    return ffi::Error::InvalidArgument("torchbridge adagrad step: float32/float64 arrays and 4 float64 coefficients");
  }
  const int64_t n = static_cast<int64_t>(p.element_count());
  if (g.element_count() != static_cast<size_t>(n) || s.element_count() != static_cast<size_t>(n)) {
    return ffi::Error::InvalidArgument("torchbridge adagrad step: arrays of different sizes");
  }
  AdagradCoef c;
  std::memcpy(&c, coef.untyped_data(), sizeof(c));
  const bool in_place = po->untyped_data() == p.untyped_data();
  if (in_place != (so->untyped_data() == s.untyped_data())) {
    return ffi::Error::InvalidArgument("torchbridge adagrad step: p and its state sum are updated in place together or not at all");
  }
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    if (in_place && t == ffi::DataType::F32) {
      adagrad_f32_in_place(static_cast<float*>(po->untyped_data()), static_cast<const float*>(g.untyped_data()),
                           static_cast<float*>(so->untyped_data()), lo, hi, c);
    } else if (in_place) {
      adagrad_f64_in_place(static_cast<double*>(po->untyped_data()), static_cast<const double*>(g.untyped_data()),
                           static_cast<double*>(so->untyped_data()), lo, hi, c);
    } else if (t == ffi::DataType::F32) {
      adagrad_f32(static_cast<const float*>(p.untyped_data()), static_cast<const float*>(g.untyped_data()),
                  static_cast<const float*>(s.untyped_data()), static_cast<float*>(po->untyped_data()),
                  static_cast<float*>(so->untyped_data()), lo, hi, c);
    } else {
      adagrad_f64(static_cast<const double*>(p.untyped_data()), static_cast<const double*>(g.untyped_data()),
                  static_cast<const double*>(s.untyped_data()), static_cast<double*>(po->untyped_data()),
                  static_cast<double*>(so->untyped_data()), lo, hi, c);
    }
  });
  return ffi::Error::Success();
}

// The serving engine's CPU kernels (serve/csrc), registered with PyTorch by its kernel library, called on XLA
// buffers through PyTorch's dispatcher. Each op's handle is found once (the engine loads the library before any
// program calls it); a failure (a bad index, no such key, no library) is the custom call's error with the op's
// message, not a crash.
constexpr char kPagedDecodeOp[] = "torchbridge_serve::paged_decode_attention";
constexpr char kPrefillOp[] = "torchbridge_serve::prefill_attention";
constexpr char kHeldLinearOp[] = "torchbridge_serve::held_linear";

template <const char* Name, typename MakeStack>
ffi::Error call_engine_op(MakeStack make_stack) {
  c10::InferenceMode guard;
  try {
    static const c10::OperatorHandle& op = c10::Dispatcher::singleton().findSchemaOrThrow(Name, "");
    torch::jit::Stack stack = make_stack();
    op.callBoxed(&stack);
  } catch (const std::exception& e) {
    return ffi::Error::InvalidArgument(e.what());
  }
  return ffi::Error::Success();
}

// Paged decode attention: the serving engine's own CPU kernel (serve/csrc/paged_attention.cpp, registered
// with PyTorch as torchbridge_serve::paged_decode_attention) on XLA buffers, so the engine on the device
// reads each row's keys and values from the paged cache in place as the engine on the CPU does; written in JAX, XLA:CPU gathered every row's context to a padded copy and
// converted it to float32 (a b=32 bf16 decode step of the bundled model spent most of its program there).
// q [R,H,D] and out in float32/bfloat16/float16; the caches in that dtype or as its bits (uint16: the
// device moves 16-bit floats as bits on this platform); block tables [R,max_blocks] and context lengths
// [R] as int32 or int64 (the kernel's int64 copies are R x max_blocks: small).
ffi::Error paged_decode(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer tables,
                        ffi::AnyBuffer lens, ffi::Result<ffi::AnyBuffer> out, double scale) {
  at::ScalarType st, tt, lt;
  const auto cache_ok = [&](ffi::AnyBuffer c) {
    return c.element_type() == q.element_type() || (c.element_type() == ffi::DataType::U16 && st != at::kFloat);
  };
  if (!to_scalar_type(q.element_type(), {at::kFloat, at::kBFloat16, at::kHalf}, &st) ||
      out->element_type() != q.element_type() || !cache_ok(k_cache) || !cache_ok(v_cache) ||
      !to_scalar_type(tables.element_type(), {at::kInt, at::kLong}, &tt) ||
      !to_scalar_type(lens.element_type(), {at::kInt, at::kLong}, &lt)) {
    return ffi::Error::InvalidArgument(
        "torchbridge paged decode: q, out and the caches float32/bfloat16/float16 (caches may be their uint16 "
        "bits), block tables and context lengths int32/int64");
  }
  return call_engine_op<kPagedDecodeOp>([&] {
    return torch::jit::Stack{wrap(*out, st), wrap(q, st), wrap(k_cache, st), wrap(v_cache, st),
                             wrap(tables, tt).to(at::kLong), wrap(lens, lt).to(at::kLong), scale, int64_t{0}};
  });
}

// Fresh prompts' attention, packed: the serving engine's CPU kernel (serve/csrc/prefill_attention.cpp,
// torchbridge_serve::prefill_attention) on XLA buffers, through PyTorch's dispatcher. Each span of the step's
// rows attends causally over its own keys and values, with PyTorch's CPU flash attention and no padding; the
// engine's device step formed a masked group instead, every prompt padded to the longest and the group to a
// bucket of rows. q [N,H,D], k and v [N,KVH,D] and out in float32/bfloat16/float16; spans [S,2] int64.
ffi::Error prefill_attention(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer spans,
                             ffi::Result<ffi::AnyBuffer> out, double scale) {
  at::ScalarType st, it;
  if (!to_scalar_type(q.element_type(), {at::kFloat, at::kBFloat16, at::kHalf}, &st) ||
      k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      out->element_type() != q.element_type() || !to_scalar_type(spans.element_type(), {at::kLong}, &it)) {
    return ffi::Error::InvalidArgument(
        "torchbridge prefill attention: q, k, v and out float32/bfloat16/float16 of one dtype, spans int64");
  }
  return call_engine_op<kPrefillOp>([&] {
    return torch::jit::Stack{wrap(*out, st), wrap(q, st), wrap(k, st), wrap(v, st), wrap(spans, it), scale};
  });
}

// A linear layer whose weight the serving engine's kernel library holds (serve/csrc/held_linear.cpp,
// torchbridge_serve::held_linear), by the key the engine gave it: x [M, K], out [M, N], of one dtype.
// Pre-packed for oneDNN (bf16/fp16 x): XLA:CPU would multiply 16-bit floats in float32; oneDNN's packed
// 16-bit GEMM reads half the weight bytes and, with AVX512-BF16 or AMX, multiplies in bf16. In panels
// (float32 x, and 16-bit x where oneDNN has no 16-bit GEMM; AVX2 or AVX-512 CPUs): the library's own float32 kernel.
ffi::Error held_linear(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t key) {
  at::ScalarType st;
  if (!to_scalar_type(x.element_type(), {at::kFloat, at::kBFloat16, at::kHalf}, &st) ||
      out->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("torchbridge held linear: x and out float32, bfloat16 or float16, of one dtype");
  }
  return call_engine_op<kHeldLinearOp>([&] { return torch::jit::Stack{wrap(*out, st), wrap(x, st), key}; });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchbridgeAdamStep, adam_step,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchbridgeAdagradStep, adagrad_step,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchbridgeHeldLinear, held_linear,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("key"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchbridgePagedDecode, paged_decode,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<double>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchbridgePrefillAttention, prefill_attention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<double>("scale"));

void* torchbridge_host_gemm_handler() { return reinterpret_cast<void*>(&TorchbridgeHostGemm); }
void* torchbridge_fence_handler() { return reinterpret_cast<void*>(&TorchbridgeFence); }
void* torchbridge_attention_handler() { return reinterpret_cast<void*>(&TorchbridgeAttention); }
void* torchbridge_attention_backward_handler() { return reinterpret_cast<void*>(&TorchbridgeAttentionBackward); }
void* torchbridge_adam_step_handler() { return reinterpret_cast<void*>(&TorchbridgeAdamStep); }
void* torchbridge_adagrad_step_handler() { return reinterpret_cast<void*>(&TorchbridgeAdagradStep); }
void* torchbridge_held_linear_handler() { return reinterpret_cast<void*>(&TorchbridgeHeldLinear); }
void* torchbridge_paged_decode_handler() { return reinterpret_cast<void*>(&TorchbridgePagedDecode); }
void* torchbridge_prefill_attention_handler() { return reinterpret_cast<void*>(&TorchbridgePrefillAttention); }
