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

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Widening loads the compiler vectorises (c10's BFloat16 -> float goes through a call per element).
template <typename T>
inline float wide(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}
template <>
inline float wide(const c10::BFloat16* p, int64_t i) {
  return c10::bit_cast<float>(static_cast<uint32_t>(p[i].x) << 16);
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * wide(k, i);
  return s;
}

template <typename T>
inline void axpy(float a, const T* v, float* acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += a * wide(v, i);
}

// Scores of one query against four keys at once: the four reductions share the query's loads and
// run side by side (one key at a time left the core waiting on each horizontal sum).
template <typename T>
inline void dot4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t d, float* s) {
  float a = 0.f, b = 0.f, c = 0.f, e = 0.f;
#pragma omp simd reduction(+ : a, b, c, e)
  for (int64_t i = 0; i < d; ++i) {
    a += q[i] * wide(k0, i);
    b += q[i] * wide(k1, i);
    c += q[i] * wide(k2, i);
    e += q[i] * wide(k3, i);
  }
  s[0] = a, s[1] = b, s[2] = c, s[3] = e;
}

template <typename T>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
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
  auto row_at = [&](const T* pool, const int64_t* table, int64_t pos) {  // [KVH, D] of position pos
    return pool + (table[pos / block_size] * block_size + pos % block_size) * token_stride;
  };

  // One work item per sequence: its positions are walked in order and, at each, every head's key (or
  // value) is read from one contiguous [KVH, D] row of the block, so the pool streams block by block.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * d);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t first = first_of(r), n = lens[r] - first;
      const int64_t* table = tables + r * max_blocks;
      float* s = sp + r * heads * longest;
      for (int64_t i = 0; i < heads * d; ++i) qf[i] = wide(qp + r * heads * d, i) * scale;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        const T* k[4] = {row_at(kp, table, first + j), row_at(kp, table, first + j + 1),
                         row_at(kp, table, first + j + 2), row_at(kp, table, first + j + 3)};
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t off = (h / group) * d;
          dot4(qf.data() + h * d, k[0] + off, k[1] + off, k[2] + off, k[3] + off, d, s + h * longest + j);
        }
      }
      for (; j < n; ++j) {
        const T* k = row_at(kp, table, first + j);
        for (int64_t h = 0; h < heads; ++h) s[h * longest + j] = dot(qf.data() + h * d, k + (h / group) * d, d);
      }
    }
  });
  scores = at::_softmax(scores, -1, false);  // rows of length 0: uniform over -inf, never read
  sp = scores.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(heads * d);
    for (int64_t r = begin; r < end; ++r) {
      T* o = op + r * heads * d;
      const int64_t first = first_of(r), n = lens[r] - first;
      if (n <= 0) {
        std::fill(o, o + heads * d, T(0));
        continue;
      }
      const int64_t* table = tables + r * max_blocks;
      const float* p = sp + r * heads * longest;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const T* v = row_at(vp, table, first + j);
        for (int64_t h = 0; h < heads; ++h) axpy(p[h * longest + j], v + (h / group) * d, acc.data() + h * d, d);
      }
      for (int64_t i = 0; i < heads * d; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
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
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention: every tensor must be contiguous");
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window);
  });
}

}  // namespace

TORCH_LIBRARY(torchbridge_serve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(torchbridge_serve, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
