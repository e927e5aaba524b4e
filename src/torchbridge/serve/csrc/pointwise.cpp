// The decoder layer's small per-token ops as one pass each, for the engine on the CPU: RMSNorm (with the
// residual add before it) and the rotary embedding of queries and keys. Unfused, each is five to eight
// ATen ops of a few microseconds over a few kilobytes, twice per layer and step.
//
// Rounding follows the unfused ops (and Hugging Face's modules): RMSNorm normalises in fp32, rounds to
// the input dtype, then multiplies by the weight in that dtype; the residual add and each product and sum
// of the rotation are rounded to the input dtype.
//
//   rms_norm(out, x, weight, eps)                  x, out: [..., D] (rows contiguous), weight: [D]
//   add_rms_norm(out, residual, x, weight, eps)    residual += x (the layer's stream); out = norm(residual)
//   rotary(q, k, cos, sin)                         q: [N, H, D], k: [N, KVH, D] (row strides allowed),
//                                                  rotated in place; cos, sin: [N, D] in q's dtype
//   rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
//                                                  rotary, then each token's k and v rows written to its
//                                                  cache slot (caches [num_blocks, block_size, KVH, D],
//                                                  slots [N] int64): the step's two index_copy_ calls
//   swiglu(out, gate, up)                          gate, up: [N, I] (row strides allowed: the halves of the
//                                                  fused gate|up projection's output), out [N, I] =
//                                                  silu(gate) * up, each rounded as F.silu(gate) * up rounds

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include "exp16.h"
#include "widen.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace {

using torchbridge_serve::widen;

template <typename T>
inline float round_to(float v) {  // the value after a store in T
  return widen(static_cast<T>(v));
}

template <typename T>
void norm_row(T* out, const T* x, const T* w, int64_t d, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += widen(x[i]) * widen(x[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(widen(w[i]) * round_to<T>(widen(x[i]) * inv));
}

void check_rows(const at::Tensor& t, const char* name, int64_t d) {
  TORCH_CHECK(t.size(-1) == d && t.is_contiguous(),
              "rms_norm: ", name, " must be contiguous [..., ", d, "]; got shape ", t.sizes(), " strides ", t.strides());
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t d = weight.numel();
  check_rows(x, "x", d);
  check_rows(out, "out", d);
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type()
                  && weight.is_contiguous(),
              "rms_norm: out, x and a contiguous weight must share dtype (out and x: shape); got x ", x.sizes(), " ",
              x.scalar_type(), ", weight ", weight.scalar_type(), ", out ", out.sizes(), " ", out.scalar_type());
  const int64_t rows = x.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(op + r * d, xp + r * d, wp, d, static_cast<float>(eps));
    });
  });
}

void add_rms_norm(at::Tensor out, at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t d = weight.numel();
  check_rows(x, "x", d);
  check_rows(out, "out", d);
  check_rows(residual, "residual", d);
  TORCH_CHECK(out.sizes() == x.sizes() && residual.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
                  residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "add_rms_norm: out, residual, x and a contiguous weight must share dtype (and all but weight shape); "
              "got x ", x.sizes(), " ", x.scalar_type(), ", residual ", residual.sizes(), " ", residual.scalar_type());
  const int64_t rows = x.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* h = rp + r * d;
        const scalar_t* xr = xp + r * d;
        for (int64_t i = 0; i < d; ++i) h[i] = static_cast<scalar_t>(widen(h[i]) + widen(xr[i]));
        norm_row(op + r * d, h, wp, d, static_cast<float>(eps));
      }
    });
  });
}

template <typename T>
void rotate(T* x, const T* c, const T* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = widen(x[i]), b = widen(x[i + half]);
    // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product and the sum rounded to T
    x[i] = static_cast<T>(round_to<T>(a * widen(c[i])) + round_to<T>(-b * widen(s[i])));
    x[i + half] = static_cast<T>(round_to<T>(b * widen(c[i + half])) + round_to<T>(a * widen(s[i + half])));
  }
}

void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rotary: q must be [N, H, D] and k [N, KVH, D] with D even; got q ", q.sizes(), ", k ", k.sizes());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "rotary: each token's heads of q and k must be contiguous (a row stride is allowed)");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type(),
              "rotary: cos and sin must be contiguous [N, D] in q's dtype; got ", cos.sizes(), " ", cos.scalar_type(),
              " for q ", q.sizes(), " ", q.scalar_type());
  const int64_t n = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const int64_t qs = q.stride(0), ks = k.stride(0);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < hq; ++h) rotate(qp + t * qs + h * d, cp + t * d, sp + t * d, d);
        for (int64_t h = 0; h < hk; ++h) rotate(kp + t * ks + h * d, cp + t * d, sp + t * d, d);
      }
    });
  });
}

void rotary_into_cache(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                       at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  TORCH_CHECK(v.dim() == 3 && v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2),
              "rotary_into_cache: v must be shaped and typed as k [N, KVH, D] (each token's heads contiguous); got v ",
              v.sizes(), ", k ", k.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) &&
                  k_cache.size(3) == k.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k.scalar_type(),
              "rotary_into_cache: the caches must be contiguous [num_blocks, block_size, KVH, D] alike, in k's dtype; "
              "got ", k_cache.sizes(), " and ", v_cache.sizes(), " for k ", k.sizes());
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "rotary_into_cache: slots must be [N] int64, one per token; got ", slots.sizes(), " ",
              slots.scalar_type(), " for ", k.size(0), " tokens");
  const int64_t n = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)  // before anything is written: a bad slot is an error, not a wild write
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "rotary_into_cache: token ", t, "'s slot ", sp[t],
                " is outside the cache's ", num_slots, " slots");
  rotary(q, k, cos, sin);
  const int64_t row = k.size(1) * k.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "rotary_into_cache", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t ks = k.stride(0), vs = v.stride(0);
    for (int64_t t = 0; t < n; ++t) {
      std::memcpy(kc + sp[t] * row, kp + t * ks, row * sizeof(scalar_t));
      std::memcpy(vc + sp[t] * row, vp + t * vs, row * sizeof(scalar_t));
    }
  });
}


template <typename T>
void swiglu_row(T* out, const T* g, const T* u, int64_t width) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    using torchbridge_serve::load16;
    for (; i + 16 <= width; i += 16) {
      const __m512 x = load16(g + i);
      const __m512 e = torchbridge_serve::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
      const __m512 silu = torchbridge_serve::rounded(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), g);
      torchbridge_serve::store16(out + i, _mm512_mul_ps(silu, load16(u + i)));
    }
  }
#elif defined(TORCHBRIDGE_AVX2)
  if constexpr (!std::is_same_v<T, double>) {
    using torchbridge_serve::load8;
    for (; i + 8 <= width; i += 8) {
      const __m256 x = load8(g + i);
      const __m256 e = torchbridge_serve::exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
      const __m256 silu = torchbridge_serve::rounded8(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)), g);
      torchbridge_serve::store8(out + i, _mm256_mul_ps(silu, load8(u + i)));
    }
  }
#endif
  for (; i < width; ++i) {
    const float x = widen(g[i]);
    out[i] = static_cast<T>(round_to<T>(x / (1.f + std::exp(-x))) * widen(u[i]));
  }
}

void swiglu(at::Tensor out, const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type() &&
                  (gate.size(1) <= 1 || (gate.stride(1) == 1 && up.stride(1) == 1)),
              "swiglu: gate and up must be [N, I] alike, each row contiguous; got gate ", gate.sizes(), " strides ",
              gate.strides(), ", up ", up.sizes(), " strides ", up.strides());
  TORCH_CHECK(out.is_contiguous() && out.sizes() == gate.sizes() && out.scalar_type() == gate.scalar_type(),
              "swiglu: out must be contiguous [N, I] in gate's dtype; got ", out.sizes(), " ", out.scalar_type(),
              " for gate ", gate.sizes(), " ", gate.scalar_type());
  const int64_t rows = gate.size(0), width = gate.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu", [&] {
    const scalar_t* gp = gate.data_ptr<scalar_t>();
    const scalar_t* up_p = up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t gs = gate.stride(0), us = up.stride(0);
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) swiglu_row(op + r * width, gp + r * gs, up_p + r * us, width);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchbridge_serve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("rotary_into_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor(c!) k_cache, "
        "Tensor(d!) v_cache, Tensor slots) -> ()");
  m.def("swiglu(Tensor(a!) out, Tensor gate, Tensor up) -> ()");
}

TORCH_LIBRARY_IMPL(torchbridge_serve, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary", rotary);
  m.impl("rotary_into_cache", rotary_into_cache);
  m.impl("swiglu", swiglu);
}
