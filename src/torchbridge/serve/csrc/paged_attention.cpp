// Decode attention straight from the paged KV cache, for the engine on the CPU.
//
// One query per sequence, one sequence per work item. Its keys and values are read from their blocks in
// the pool, in place and only up to the sequence's own length (no gathered copy, no padding to the
// step's longest context). Scores and the weighted sum accumulate in fp32 whatever the cache dtype.
//
// Schema (torch.ops.torchbridge_serve.paged_decode_attention):
//   out [R, H, D] (written), q [R, H, D], k_cache/v_cache [num_blocks, block_size, KVH, D],
//   block_tables [R, max_blocks] int64, context_lens [R] int64, scale, window (0: none; else only the
//   last `window` positions are visible, as a sliding-window model's mask says).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include "widen.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using torchbridge_serve::widen;

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * widen(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* v, float* acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += a * widen(v[i]);
}

// Scores of one query against four keys at once: the four reductions share the query's loads and
// run side by side (one key at a time left the core waiting on each horizontal sum).
template <typename T>
inline void dot4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t d, float* s) {
  float a = 0.f, b = 0.f, c = 0.f, e = 0.f;
#pragma omp simd reduction(+ : a, b, c, e)
  for (int64_t i = 0; i < d; ++i) {
    a += q[i] * widen(k0[i]);
    b += q[i] * widen(k1[i]);
    c += q[i] * widen(k2[i]);
    e += q[i] * widen(k3[i]);
  }
  s[0] = a, s[1] = b, s[2] = c, s[3] = e;
}

// The same two loops with AVX-512, where the compiler targets it and the head size is a multiple of 16.
// Scores: 16 keys at a time, each key's 16-lane partial products summed across lanes by one
// transposing reduction for all 16 (one horizontal sum per key was most of the loop's time).
// Values: each head's output held in registers over the whole context.
#if defined(__AVX512F__)
using torchbridge_serve::load16;

// Lane j of the result: the sum of v[j]'s 16 lanes. Always inlined, as scores16: called, their 16
// accumulators went through the stack on every step of the loop.
__attribute__((always_inline)) inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a, b, a, b] halves of keys 2i, 2i+1
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: keys 4i .. 4i+3, that lane's part of each sum
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// Scores of 16 consecutive positions (rows at pool + where[x], this head's part at + off) for one head.
template <typename T>
__attribute__((always_inline)) inline __m512 scores16(const float* q, const T* pool, const int64_t* where, int64_t off,
                                                      int64_t d) {
  __m512 acc[16];
  for (int x = 0; x < 16; ++x) acc[x] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int x = 0; x < 16; ++x) acc[x] = _mm512_fmadd_ps(qc, load16(pool + where[x] + off + c), acc[x]);
  }
  return reduce16(acc);
}

// acc[0, 16 NV) += sum over the positions of p[x] * value row x (this head's part).
template <int NV, typename T>
inline void weighted16(const float* p, int64_t count, const T* pool, const int64_t* where, int64_t off, float* acc) {
  __m512 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t x = 0; x < count; ++x) {
    const __m512 px = _mm512_set1_ps(p[x]);
    const T* v = pool + where[x] + off;
    for (int c = 0; c < NV; ++c) a[c] = _mm512_fmadd_ps(px, load16(v + 16 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

template <typename T>
inline void weighted(const float* p, int64_t count, const T* pool, const int64_t* where, int64_t off, int64_t d,
                     float* acc) {
  int64_t c = 0;
  for (; c + 128 <= d; c += 128) weighted16<8>(p, count, pool, where, off + c, acc + c);
  switch ((d - c) / 16) {
    case 1: return weighted16<1>(p, count, pool, where, off + c, acc + c);
    case 2: return weighted16<2>(p, count, pool, where, off + c, acc + c);
    case 3: return weighted16<3>(p, count, pool, where, off + c, acc + c);
    case 4: return weighted16<4>(p, count, pool, where, off + c, acc + c);
    case 5: return weighted16<5>(p, count, pool, where, off + c, acc + c);
    case 6: return weighted16<6>(p, count, pool, where, off + c, acc + c);
    case 7: return weighted16<7>(p, count, pool, where, off + c, acc + c);
    default: return;
  }
}
#elif defined(TORCHBRIDGE_AVX2)
// The same two loops over eight lanes, where the head size is a multiple of 8: scores of 8 positions per
// transposing reduction, each head's output in registers 64 values at a time.
using torchbridge_serve::load8;

// Lane j of the result: the sum of v[j]'s 8 lanes (pairwise hadds within each 128-bit half, then the halves).
__attribute__((always_inline)) inline __m256 reduce8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

template <typename T>
__attribute__((always_inline)) inline __m256 scores8(const float* q, const T* pool, const int64_t* where, int64_t off,
                                                     int64_t d) {
  __m256 acc[8];
  for (int x = 0; x < 8; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int x = 0; x < 8; ++x) acc[x] = _mm256_fmadd_ps(qc, load8(pool + where[x] + off + c), acc[x]);
  }
  return reduce8(acc);
}

template <int NV, typename T>
inline void weighted8(const float* p, int64_t count, const T* pool, const int64_t* where, int64_t off, float* acc) {
  __m256 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t x = 0; x < count; ++x) {
    const __m256 px = _mm256_set1_ps(p[x]);
    const T* v = pool + where[x] + off;
    for (int c = 0; c < NV; ++c) a[c] = _mm256_fmadd_ps(px, load8(v + 8 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

template <typename T>
inline void weighted(const float* p, int64_t count, const T* pool, const int64_t* where, int64_t off, int64_t d,
                     float* acc) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) weighted8<8>(p, count, pool, where, off + c, acc + c);
  switch ((d - c) / 8) {
    case 1: return weighted8<1>(p, count, pool, where, off + c, acc + c);
    case 2: return weighted8<2>(p, count, pool, where, off + c, acc + c);
    case 3: return weighted8<3>(p, count, pool, where, off + c, acc + c);
    case 4: return weighted8<4>(p, count, pool, where, off + c, acc + c);
    case 5: return weighted8<5>(p, count, pool, where, off + c, acc + c);
    case 6: return weighted8<6>(p, count, pool, where, off + c, acc + c);
    case 7: return weighted8<7>(p, count, pool, where, off + c, acc + c);
    default: return;
  }
}
#endif

// Asks for one head's slice of the next chunk's positions (into L2) while that head computes on this chunk.
// The loops read one head's part of 16 rows at a time, a strided walk, and a step's pool is far larger
// than the cache: without it a decode step's reads were bound by how many misses the core keeps in flight
// (bf16, 32 rows x ~160 positions x 4 layers from memory: ~8 GB/s of K/V where one core streams ~24). Into L2
// rather than L1: prefetches to L1 hold the same few miss buffers as the loads and gained < 15%.
template <typename T>
inline void prefetch_head(const T* pool, const int64_t* where, int64_t count, int64_t off, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t x = 0; x < count; ++x) {
    const char* p = reinterpret_cast<const char*>(pool + where[x] + off);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
  }
}

// Tests switch to the portable loops to check them on a machine that has the vector ones.
bool g_portable = false;

template <typename T>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t q_row = q.stride(0);  // a row of q may be a slice of the step's q|k|v product
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t token_stride = kv_heads * d;  // between consecutive positions of one block

  int64_t longest = 1;
  for (int64_t r = 0; r < rows; ++r)
    longest = std::max(longest, window > 0 ? std::min(lens[r], window) : lens[r]);
  // Scores [R, H, longest] (past a row's own length -inf): one vectorised softmax for the whole step.
  at::Tensor scores = at::full({rows, heads, longest}, -INFINITY, q.options().dtype(at::kFloat));
  float* sp = scores.data_ptr<float>();
  auto first_of = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, lens[r] - window) : int64_t(0); };
  // Element offset in the pool of each visible position's [KVH, D] row, walking the block table (an
  // integer division per position and head cost as much as the arithmetic).
  auto locate = [&](int64_t r, std::vector<int64_t>& where) {
    const int64_t first = first_of(r), n = lens[r] - first;
    where.resize(std::max<int64_t>(n, 0));
    const int64_t* table = tables + r * max_blocks;
    for (int64_t j = 0, b = first / block_size, t = first % block_size; j < n; ++j) {
      where[j] = (table[b] * block_size + t) * token_stride;
      if (++t == block_size) t = 0, ++b;
    }
  };

#if defined(__AVX512F__)
  const bool vector = !g_portable && d % 16 == 0;
#elif defined(TORCHBRIDGE_AVX2)
  const bool vector = !g_portable && d % 8 == 0;
#else
  const bool vector = false;
#endif
  // One work item per sequence. Its positions are walked in chunks of 16 in order and every head is
  // served from the chunk while it is in cache (within a block a chunk is one contiguous stretch of
  // the pool, so the pool streams block by block).
  constexpr int64_t chunk = 16;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * d);
    std::vector<int64_t> where;
    for (int64_t r = begin; r < end; ++r) {
      locate(r, where);
      const int64_t n = where.size();
      float* s = sp + r * heads * longest;
      for (int64_t i = 0; i < heads * d; ++i) qf[i] = widen(qp[r * q_row + i]) * scale;
      for (int64_t kv = 0; kv < kv_heads; ++kv) prefetch_head(kp, where.data(), std::min(n, chunk), kv * d, d);
      for (int64_t j0 = 0; j0 < n; j0 += chunk) {
        const int64_t count = std::min(chunk, n - j0);
        const int64_t* w = where.data() + j0;
        const int64_t next = std::max<int64_t>(0, std::min(chunk, n - j0 - chunk));  // positions in the next chunk
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t off = (h / group) * d;
          float* sh = s + h * longest + j0;
          if (h % group == 0) prefetch_head(kp, w + chunk, next, off, d);  // once per KV head
          int64_t x = 0;
#if defined(__AVX512F__)
          if (vector && count == chunk) {
            _mm512_storeu_ps(sh, scores16(qf.data() + h * d, kp, w, off, d));
            continue;
          }
#elif defined(TORCHBRIDGE_AVX2)
          if (vector)
            for (; x + 8 <= count; x += 8) _mm256_storeu_ps(sh + x, scores8(qf.data() + h * d, kp, w + x, off, d));
#endif
          for (; x + 4 <= count; x += 4)
            dot4(qf.data() + h * d, kp + w[x] + off, kp + w[x + 1] + off, kp + w[x + 2] + off, kp + w[x + 3] + off,
                 d, sh + x);
          for (; x < count; ++x) sh[x] = dot(qf.data() + h * d, kp + w[x] + off, d);
        }
      }
    }
  });
  scores = at::_softmax(scores, -1, false);  // rows of length 0: uniform over -inf, never read
  sp = scores.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(heads * d);
    std::vector<int64_t> where;
    for (int64_t r = begin; r < end; ++r) {
      T* o = op + r * heads * d;
      locate(r, where);
      const int64_t n = where.size();
      const float* p = sp + r * heads * longest;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t kv = 0; kv < kv_heads; ++kv) prefetch_head(vp, where.data(), std::min(n, chunk), kv * d, d);
      for (int64_t j0 = 0; j0 < n; j0 += chunk) {
        const int64_t count = std::min(chunk, n - j0);
        const int64_t* w = where.data() + j0;
        const int64_t next = std::max<int64_t>(0, std::min(chunk, n - j0 - chunk));  // positions in the next chunk
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t off = (h / group) * d;
          const float* ph = p + h * longest + j0;
          if (h % group == 0) prefetch_head(vp, w + chunk, next, off, d);  // once per KV head
#if defined(__AVX512F__) || defined(TORCHBRIDGE_AVX2)
          if (vector) {
            weighted(ph, count, vp, w, off, d, acc.data() + h * d);
            continue;
          }
#endif
          for (int64_t x = 0; x < count; ++x) axpy(ph[x], vp + w[x] + off, acc.data() + h * d, d);
        }
      }
      for (int64_t i = 0; i < heads * d; ++i) o[i] = static_cast<T>(acc[i]);  // no context: zeros
    }
  });
}

// Whether each row of x [R, H, D] holds its heads contiguously (strides of size-1 dimensions do not count).
bool rows_of_heads(const at::Tensor& x) {
  return (x.size(2) <= 1 || x.stride(2) == 1) && (x.size(1) <= 1 || x.stride(1) == x.size(2)) &&
         (x.size(0) <= 1 || x.stride(0) >= x.size(1) * x.size(2));
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [R, H, D] and the caches [num_blocks, block_size, KVH, D] alike; got q ",
              q.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: head size or head count of q ", q.sizes(), " does not fit the cache ",
              k_cache.sizes());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode_attention: out, q and the caches must share shape [R, H, D] and dtype");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.dim() == 1 &&
                  context_lens.size(0) == q.size(0) && block_tables.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables must be [R, max_blocks] int64 and context_lens [R] int64");
  TORCH_CHECK(rows_of_heads(q) &&
                  out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention: every tensor must be contiguous (q: each row's heads; rows may be strided)");
  // Bounds once here, so the kernel's loops read only the pool: a bad table is an error, not a wild read.
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(lens[r] <= max_blocks * block_size, "paged_decode_attention: row ", r, "'s context length ", lens[r],
                " exceeds its block table (", max_blocks, " blocks of ", block_size, ")");
    for (int64_t b = 0; b * block_size < lens[r]; ++b) {
      const int64_t id = tables[r * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_attention: row ", r, " names block ", id, " of a pool of ",
                  num_blocks);
    }
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      return decode<float>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window);
    case at::kBFloat16:
      return decode<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window);
    case at::kHalf:
      return decode<c10::Half>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window);
    default:
      TORCH_CHECK(false, "paged_decode_attention: dtype ", q.scalar_type(), " (float32, bfloat16 or float16 only)");
  }
}

}  // namespace

TORCH_LIBRARY(torchbridge_serve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window) -> ()");
}

TORCH_LIBRARY_FRAGMENT(torchbridge_serve, m) {
  m.def("_force_portable", [](bool on) { g_portable = on; });
}

TORCH_LIBRARY_IMPL(torchbridge_serve, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
