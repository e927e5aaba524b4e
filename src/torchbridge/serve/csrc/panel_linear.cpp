// float32 linear layers on AVX2/FMA and AVX-512 CPUs: out = x @ W.T (+ bias), from W laid out in panels.
//
// On an AVX2 EPYC (Zen 3, one thread) oneDNN's packed fp32 call reached 6-19 GFLOP/s at 1-4 rows, 28-57 at
// 8-32 and 61-76 from 64 rows up, of the core's ~90 (the engine's decode steps are the first, its prefill
// chunks the last), and a decode step of the bench model spent ~70% of its time in those calls. Here W [N, K]
// is stored as panels of 16 outputs, [ceil(N/16), K, 16] (serve/linear.py `panel_layout`, zero-padded past
// N): a panel is streamed front to back once per block of rows of x, and each of its 64-byte rows (one input,
// 16 outputs) serves every row of the block through one broadcast of x's value, so a block keeps its
// accumulators in registers with no horizontal sums. One row (single-user decode, memory-bound) splits k into
// two chains instead, for the FMA latency. Measured against oneDNN's packed call on the bench model's 17
// products (bench/bench_serve_kernels.py --panels).
//
// Two forms, by the build's vector width (widen.h):
// - AVX2 (no AVX-512): blocks of up to six rows x one panel (two 8-lane vectors): 12 accumulators.
// - AVX-512: blocks of up to twelve rows x two panels (one 16-lane vector each): 24 accumulators. On an AMD
//   EPYC Zen 4 (one thread, ~105 GFLOP/s peak) oneDNN's packed fp32 call ran 13-31 GFLOP/s at 1 row and
//   60-90 at 8-32 on the engine's shapes; this form 21-37 and 80-106 (the docs' serve.md).
//
// Accumulators are named variables, not an array: GCC 12 kept a `__m256 acc[R][2]` array on the stack and
// stored it at every k (31 GFLOP/s instead of 88 in registers).
//
//   panel_linear(out, x, panels, bias?)   x [M, K] float32, panels [ceil(N/16), K, 16] float32, out [M, N]
//                                         float32, bias [N] float32 or None; all contiguous
//   panel_linear_available() -> bool      built for a CPU with AVX2/FMA or AVX-512 (widen.h)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "widen.h"

namespace {

#if defined(TORCHBRIDGE_AVX2)

constexpr int64_t kPanel = 16;   // outputs per panel: two 8-lane vectors
constexpr int kMaxRows = 6;      // rows per block: 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers
constexpr int64_t kChunk = 2048;  // inputs per pass over a panel (128 KiB of it): it stays in L2 across the blocks

// Accumulators start at zero, at `init` (16 values: a bias, for every row), or at y's own rows (a later chunk).
enum class Start { kZero, kInit, kLoad };

#define TB_PANEL_ROW(r)                                                       \
  if constexpr (R > r) {                                                      \
    const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);                    \
    c##r##a = _mm256_fmadd_ps(a, b0, c##r##a);                                \
    c##r##b = _mm256_fmadd_ps(a, b1, c##r##b);                                \
  }
#define TB_PANEL_START(r)                                                              \
  if constexpr (R > r) {                                                               \
    if (start == Start::kLoad) {                                                       \
      c##r##a = _mm256_loadu_ps(y + r * ldy), c##r##b = _mm256_loadu_ps(y + r * ldy + 8); \
    } else {                                                                           \
      c##r##a = i0, c##r##b = i1;                                                      \
    }                                                                                  \
  }
#define TB_PANEL_STORE(r)                                 \
  if constexpr (R > r) {                                  \
    _mm256_storeu_ps(y + r * ldy, c##r##a);               \
    _mm256_storeu_ps(y + r * ldy + 8, c##r##b);           \
  }

// y[0..R) x 16 (row stride ldy) from x[0..R) x [0, K) (row stride ldx) and K rows of one panel.
template <int R>
inline void block(const float* __restrict x, int64_t ldx, const float* __restrict p, int64_t K, float* __restrict y,
                  int64_t ldy, Start start, const float* init) {
  const __m256 i0 = start == Start::kInit ? _mm256_loadu_ps(init) : _mm256_setzero_ps();
  const __m256 i1 = start == Start::kInit ? _mm256_loadu_ps(init + 8) : _mm256_setzero_ps();
  __m256 c0a, c0b, c1a, c1b, c2a, c2b, c3a, c3b, c4a, c4b, c5a, c5b;
  TB_PANEL_START(0) TB_PANEL_START(1) TB_PANEL_START(2) TB_PANEL_START(3) TB_PANEL_START(4) TB_PANEL_START(5)
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(p + k * kPanel), b1 = _mm256_loadu_ps(p + k * kPanel + 8);
    TB_PANEL_ROW(0) TB_PANEL_ROW(1) TB_PANEL_ROW(2) TB_PANEL_ROW(3) TB_PANEL_ROW(4) TB_PANEL_ROW(5)
  }
  TB_PANEL_STORE(0) TB_PANEL_STORE(1) TB_PANEL_STORE(2) TB_PANEL_STORE(3) TB_PANEL_STORE(4) TB_PANEL_STORE(5)
}

#undef TB_PANEL_ROW
#undef TB_PANEL_START
#undef TB_PANEL_STORE

// One row: even and odd k in separate accumulators (two chains of FMAs, not one).
inline void row(const float* __restrict x, const float* __restrict p, int64_t K, float* __restrict y, Start start,
                const float* init) {
  __m256 a0, a1;
  if (start == Start::kLoad) {
    a0 = _mm256_loadu_ps(y), a1 = _mm256_loadu_ps(y + 8);
  } else if (start == Start::kInit) {
    a0 = _mm256_loadu_ps(init), a1 = _mm256_loadu_ps(init + 8);
  } else {
    a0 = a1 = _mm256_setzero_ps();
  }
  __m256 e0 = _mm256_setzero_ps(), e1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
    a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(p + k * kPanel), a0);
    a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(p + k * kPanel + 8), a1);
    e0 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(p + k * kPanel + 16), e0);
    e1 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(p + k * kPanel + 24), e1);
  }
  if (k < K) {
    const __m256 x0 = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(p + k * kPanel), a0);
    a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(p + k * kPanel + 8), a1);
  }
  _mm256_storeu_ps(y, _mm256_add_ps(a0, e0));
  _mm256_storeu_ps(y + 8, _mm256_add_ps(a1, e1));
}

void rows_block(int rows, const float* x, int64_t ldx, const float* p, int64_t K, float* y, int64_t ldy, Start start,
                const float* init) {
  switch (rows) {
    case 1: return row(x, p, K, y, start, init);
    case 2: return block<2>(x, ldx, p, K, y, ldy, start, init);
    case 3: return block<3>(x, ldx, p, K, y, ldy, start, init);
    case 4: return block<4>(x, ldx, p, K, y, ldy, start, init);
    case 5: return block<5>(x, ldx, p, K, y, ldy, start, init);
    default: return block<6>(x, ldx, p, K, y, ldy, start, init);
  }
}

// All M rows of out over panels [j0, j1). Blocks of up to six rows, the rows split evenly (32 = 6+6+5+5+5+5,
// not 6 x 5 + 2: a two-row block runs at half the FMA rate of a six-row one).
void run(float* out, const float* x, const float* panels, const float* bias, int64_t M, int64_t j0, int64_t j1,
         int64_t N, int64_t K) {
  const int64_t chunks = (K + kChunk - 1) / kChunk, chunk = (K + chunks - 1) / chunks;
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
  alignas(32) float tail[kMaxRows * kPanel];
  alignas(32) float init[kPanel];
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t kn = std::min(chunk, K - k0);
    for (int64_t j = j0; j < j1; ++j) {
      const float* p = panels + (j * K + k0) * kPanel;
      const int64_t n0 = j * kPanel, cols = std::min(kPanel, N - n0);
      Start start = k0 > 0 ? Start::kLoad : bias != nullptr ? Start::kInit : Start::kZero;
      if (start == Start::kInit) {
        std::fill(init, init + kPanel, 0.f);
        std::copy(bias + n0, bias + n0 + cols, init);
      }
      for (int64_t b = 0, m = 0; b < blocks; ++b) {
        const int rows = static_cast<int>((M - m) / (blocks - b) + ((M - m) % (blocks - b) != 0));
        float* y = out + m * N + n0;
        if (cols == kPanel) {
          rows_block(rows, x + m * K + k0, K, p, kn, y, N, start, init);
        } else {  // the last panel's outputs past N are the layout's zero padding: through a 16-wide scratch
          std::fill(tail, tail + kMaxRows * kPanel, 0.f);
          if (start == Start::kLoad)
            for (int r = 0; r < rows; ++r) std::copy(y + r * N, y + r * N + cols, tail + r * kPanel);
          rows_block(rows, x + m * K + k0, K, p, kn, tail, kPanel, start, init);
          for (int r = 0; r < rows; ++r) std::copy(tail + r * kPanel, tail + r * kPanel + cols, y + r * N);
        }
        m += rows;
      }
    }
  }
}

#elif defined(__AVX512F__)

// The 16-lane form: a panel's 64-byte row is one vector, so a block takes two panels (32 outputs) for up to
// twelve rows of x: 24 accumulators, two weight vectors and a broadcast of the 32 registers, each broadcast of
// x serving both panels. The last panel's outputs past N are masked off at its loads and stores (its weights are
// the layout's zero padding), so no scratch copy.

constexpr int64_t kPanel = 16;   // outputs per panel: one 16-lane vector
constexpr int kMaxRows = 12;     // rows per block
constexpr int64_t kChunk = 2048;  // inputs per pass over a panel pair (256 KiB of it): it stays in L2 across the blocks

// Accumulators start at zero, at `init` (a bias, for every row), or at y's own rows (a later chunk).
enum class Start { kZero, kInit, kLoad };

#define TB_PANEL_ROW(r)                                              \
  if constexpr (R > r) {                                             \
    const __m512 a = _mm512_set1_ps(x[r * ldx + k]);                 \
    c##r##a = _mm512_fmadd_ps(a, b0, c##r##a);                       \
    if constexpr (P == 2) c##r##b = _mm512_fmadd_ps(a, b1, c##r##b); \
  }
#define TB_PANEL_START(r)                                                            \
  if constexpr (R > r) {                                                             \
    if (start == Start::kLoad) {                                                     \
      c##r##a = _mm512_maskz_loadu_ps(m0, y + r * ldy);                              \
      if constexpr (P == 2) c##r##b = _mm512_maskz_loadu_ps(m1, y + r * ldy + 16);   \
    } else {                                                                         \
      c##r##a = i0;                                                                  \
      if constexpr (P == 2) c##r##b = i1;                                            \
    }                                                                                \
  }
#define TB_PANEL_STORE(r)                                                     \
  if constexpr (R > r) {                                                      \
    _mm512_mask_storeu_ps(y + r * ldy, m0, c##r##a);                          \
    if constexpr (P == 2) _mm512_mask_storeu_ps(y + r * ldy + 16, m1, c##r##b); \
  }

// y[0..R) x 16P (row stride ldy; lanes outside masks m0, m1 untouched) from x[0..R) x [0, K) (row stride ldx) and
// K rows of panels p0 (and p1).
template <int R, int P>
inline void block(const float* __restrict x, int64_t ldx, const float* __restrict p0, const float* __restrict p1,
                  int64_t K, float* __restrict y, int64_t ldy, __mmask16 m0, __mmask16 m1, Start start,
                  const float* init) {
  const __m512 i0 = start == Start::kInit ? _mm512_maskz_loadu_ps(m0, init) : _mm512_setzero_ps();
  const __m512 i1 = P == 2 && start == Start::kInit ? _mm512_maskz_loadu_ps(m1, init + 16) : _mm512_setzero_ps();
  __m512 c0a, c0b, c1a, c1b, c2a, c2b, c3a, c3b, c4a, c4b, c5a, c5b, c6a, c6b, c7a, c7b, c8a, c8b, c9a, c9b, c10a,
      c10b, c11a, c11b;
  TB_PANEL_START(0) TB_PANEL_START(1) TB_PANEL_START(2) TB_PANEL_START(3) TB_PANEL_START(4) TB_PANEL_START(5)
  TB_PANEL_START(6) TB_PANEL_START(7) TB_PANEL_START(8) TB_PANEL_START(9) TB_PANEL_START(10) TB_PANEL_START(11)
  for (int64_t k = 0; k < K; ++k) {
    __m512 b0 = _mm512_loadu_ps(p0 + k * kPanel);
    __m512 b1 = P == 2 ? _mm512_loadu_ps(p1 + k * kPanel) : b0;
    // In registers: at up to four rows GCC 12 folded the weight loads into every FMA instead (a 64-byte load
    // per FMA, the loads the bound: 72 GFLOP/s at four rows against 100 at five).
    asm("" : "+v"(b0), "+v"(b1));
    TB_PANEL_ROW(0) TB_PANEL_ROW(1) TB_PANEL_ROW(2) TB_PANEL_ROW(3) TB_PANEL_ROW(4) TB_PANEL_ROW(5)
    TB_PANEL_ROW(6) TB_PANEL_ROW(7) TB_PANEL_ROW(8) TB_PANEL_ROW(9) TB_PANEL_ROW(10) TB_PANEL_ROW(11)
  }
  TB_PANEL_STORE(0) TB_PANEL_STORE(1) TB_PANEL_STORE(2) TB_PANEL_STORE(3) TB_PANEL_STORE(4) TB_PANEL_STORE(5)
  TB_PANEL_STORE(6) TB_PANEL_STORE(7) TB_PANEL_STORE(8) TB_PANEL_STORE(9) TB_PANEL_STORE(10) TB_PANEL_STORE(11)
}

#undef TB_PANEL_ROW
#undef TB_PANEL_START
#undef TB_PANEL_STORE

// One row: even and odd k in separate accumulators per panel (two chains of FMAs each, not one).
template <int P>
inline void row(const float* __restrict x, const float* __restrict p0, const float* __restrict p1, int64_t K,
                float* __restrict y, __mmask16 m0, __mmask16 m1, Start start, const float* init) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  if (start == Start::kLoad) {
    a0 = _mm512_maskz_loadu_ps(m0, y);
    if constexpr (P == 2) a1 = _mm512_maskz_loadu_ps(m1, y + 16);
  } else if (start == Start::kInit) {
    a0 = _mm512_maskz_loadu_ps(m0, init);
    if constexpr (P == 2) a1 = _mm512_maskz_loadu_ps(m1, init + 16);
  }
  __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
    a0 = _mm512_fmadd_ps(x0, _mm512_loadu_ps(p0 + k * kPanel), a0);
    e0 = _mm512_fmadd_ps(x1, _mm512_loadu_ps(p0 + (k + 1) * kPanel), e0);
    if constexpr (P == 2) {
      a1 = _mm512_fmadd_ps(x0, _mm512_loadu_ps(p1 + k * kPanel), a1);
      e1 = _mm512_fmadd_ps(x1, _mm512_loadu_ps(p1 + (k + 1) * kPanel), e1);
    }
  }
  if (k < K) {
    const __m512 x0 = _mm512_set1_ps(x[k]);
    a0 = _mm512_fmadd_ps(x0, _mm512_loadu_ps(p0 + k * kPanel), a0);
    if constexpr (P == 2) a1 = _mm512_fmadd_ps(x0, _mm512_loadu_ps(p1 + k * kPanel), a1);
  }
  _mm512_mask_storeu_ps(y, m0, _mm512_add_ps(a0, e0));
  if constexpr (P == 2) _mm512_mask_storeu_ps(y + 16, m1, _mm512_add_ps(a1, e1));
}

template <int P>
void rows_block(int rows, const float* x, int64_t ldx, const float* p0, const float* p1, int64_t K, float* y,
                int64_t ldy, __mmask16 m0, __mmask16 m1, Start start, const float* init) {
  switch (rows) {
    case 1: return row<P>(x, p0, p1, K, y, m0, m1, start, init);
    case 2: return block<2, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    case 3: return block<3, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    case 4: return block<4, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    case 5: return block<5, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    case 6: return block<6, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    case 7: return block<7, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    case 8: return block<8, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    case 9: return block<9, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    case 10: return block<10, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    case 11: return block<11, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
    default: return block<12, P>(x, ldx, p0, p1, K, y, ldy, m0, m1, start, init);
  }
}

inline __mmask16 lanes(int64_t cols) {
  return cols >= kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
}

// All M rows of out over panels [j0, j1), two panels at a time (the last one alone if their count is odd).
// Blocks of up to twelve rows, the rows split evenly (32 = 11+11+10).
void run(float* out, const float* x, const float* panels, const float* bias, int64_t M, int64_t j0, int64_t j1,
         int64_t N, int64_t K) {
  const int64_t chunks = (K + kChunk - 1) / kChunk, chunk = (K + chunks - 1) / chunks;
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t kn = std::min(chunk, K - k0);
    for (int64_t j = j0; j < j1; j += 2) {
      const bool pair = j + 1 < j1;
      const float* p0 = panels + (j * K + k0) * kPanel;
      const float* p1 = pair ? panels + ((j + 1) * K + k0) * kPanel : p0;
      const int64_t n0 = j * kPanel;
      const __mmask16 m0 = lanes(N - n0), m1 = pair ? lanes(N - n0 - kPanel) : 0;
      const Start start = k0 > 0 ? Start::kLoad : bias != nullptr ? Start::kInit : Start::kZero;
      const float* init = bias != nullptr ? bias + n0 : nullptr;
      for (int64_t b = 0, m = 0; b < blocks; ++b) {
        const int rows = static_cast<int>((M - m) / (blocks - b) + ((M - m) % (blocks - b) != 0));
        float* y = out + m * N + n0;
        if (pair) {
          rows_block<2>(rows, x + m * K + k0, K, p0, p1, kn, y, N, m0, m1, start, init);
        } else {
          rows_block<1>(rows, x + m * K + k0, K, p0, p1, kn, y, N, m0, m1, start, init);
        }
        m += rows;
      }
    }
  }
}

#endif  // TORCHBRIDGE_AVX2 / __AVX512F__

bool panel_linear_available() {
#if defined(TORCHBRIDGE_AVX2) || defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(panel_linear_available(), "panel_linear: this build is for a CPU with neither AVX2/FMA nor AVX-512 "
              "(check panel_linear_available() first)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "panel_linear: x must be a contiguous 2-D float32 tensor; got shape ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 16 && panels.scalar_type() == at::kFloat && panels.is_contiguous(),
              "panel_linear: panels must be contiguous float32 [ceil(N/16), K, 16]; got ", panels.sizes(), " ",
              panels.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = out.dim() == 2 ? out.size(1) : -1;
  TORCH_CHECK(panels.size(1) == K, "panel_linear: x has ", K, " features, the weight panels ", panels.size(1));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && (N + 15) / 16 == panels.size(0) && N > 0 && out.is_contiguous()
                  && out.scalar_type() == at::kFloat,
              "panel_linear: out must be contiguous float32 [", M, ", N] with ceil(N/16) = ", panels.size(0),
              " panels; got ", out.sizes(), " ", out.scalar_type());
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "panel_linear: bias must be contiguous float32 [", N, "]; got ", bias->sizes(), " ", bias->scalar_type());
    b = bias->data_ptr<float>();
  }
  if (M == 0) return;
#if defined(TORCHBRIDGE_AVX2) || defined(__AVX512F__)
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const int64_t NP = panels.size(0);
  at::parallel_for(0, NP, 4, [&](int64_t j0, int64_t j1) {
    // All rows per pass over a panel: blocking the rows too (weights re-read per 48-384 rows) was no faster
    // at 128-1024 rows on the bench model's shapes.
    run(o, xp, pp, b, M, j0, j1, N, K);
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchbridge_serve, m) {
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
  m.def("panel_linear_available", panel_linear_available);
}

TORCH_LIBRARY_IMPL(torchbridge_serve, CPU, m) { m.impl("panel_linear", panel_linear); }
