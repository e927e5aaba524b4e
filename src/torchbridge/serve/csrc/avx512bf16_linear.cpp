// bf16 linear layers with AVX512-BF16 (vdpbf16ps) for the engine's decode steps, on CPUs that have it but no
// AMX (AMD Zen 4/5, Intel Cooper Lake): out = x @ W.T (+ bias), fp32 accumulation, one rounding to bf16.
//
// The same role as amx_linear.cpp: at a decode step's few rows oneDNN's packed bf16 call spends tens of
// microseconds around streaming a weight once (a small model's 17 linears per step are mostly that). It
// reads the weight in amx_linear's layout (serve/linear.py `amx_layout`): each row of a 16 x 32 tile holds
// 16 outputs' values for one pair of inputs, exactly vdpbf16ps's second operand, so the weight streams
// front to back and each of its 64-byte rows serves every row of x in the block at once (x's input pair
// broadcast), with no horizontal sums.
//
//   avx512bf16_linear(out, x, w_tiles, bias?)   as amx_linear: x [M, K] bf16, out [M, N] bf16,
//                                               w_tiles [N/32, K/32, 2, 16, 32] bf16, bias [N] bf16 or None
//   avx512bf16_available() -> bool              built for a CPU with AVX512-BF16
//
// Built with -march=native: on a CPU without AVX512-BF16 the op exists and avx512bf16_available() is false.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TB_HAVE_AVX512BF16 1
#include <immintrin.h>
#endif

namespace {

#ifdef TB_HAVE_AVX512BF16

constexpr int64_t kTile = 512;  // bf16 elements in one 16 x 32 tile (16 input pairs x 16 outputs x 2)
constexpr int kRows = 4;        // rows of x per pass over two weight panels (16 accumulators in registers)

inline __m512 widen16(const c10::BFloat16* p) {
  const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
}

// Rows [m, m + MR) of out, panels [p, p + PN) (32 outputs each).
template <int MR, int PN>
void block(c10::BFloat16* out, const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, int64_t m, int64_t p,
           int64_t N, int64_t K) {
  const int64_t kb_count = K / 32, panel = kb_count * 2 * kTile;
  __m512 acc[MR][PN][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < PN; ++j) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    for (int r = 0; r < 16; ++r) {  // inputs kb * 32 + 2r, + 2r + 1
      __m512bh xv[MR];
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, x + (m + i) * K + kb * 32 + 2 * r, sizeof(pair));
        xv[i] = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      }
      for (int j = 0; j < PN; ++j) {
        const uint16_t* wr = w + (p + j) * panel + kb * 2 * kTile + r * 32;
        for (int t = 0; t < 2; ++t) {
          const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wr + t * kTile));
          for (int i = 0; i < MR; ++i) acc[i][j][t] = _mm512_dpbf16_ps(acc[i][j][t], xv[i], wv);
        }
      }
    }
  }
  for (int j = 0; j < PN; ++j) {
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias != nullptr) b0 = widen16(bias + (p + j) * 32), b1 = widen16(bias + (p + j) * 32 + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_add_ps(acc[i][j][1], b1), _mm512_add_ps(acc[i][j][0], b0));
      _mm512_storeu_si512(reinterpret_cast<void*>(out + (m + i) * N + (p + j) * 32), reinterpret_cast<__m512i>(v));
    }
  }
}

// Panels [p, p + 4): blocks of kRows rows over two panels at a time; the one or two rows left over take
// all four panels at once, so that even one row keeps eight accumulators in flight (with two, a single
// row's four dependency chains left the core waiting on vdpbf16ps's latency: one row ran slower than two).
void four_panels(c10::BFloat16* out, const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, int64_t p,
                 int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) {
    block<kRows, 2>(out, x, w, bias, m, p, N, K);
    block<kRows, 2>(out, x, w, bias, m, p + 2, N, K);
  }
  switch (M - m) {
    case 3:
      block<3, 2>(out, x, w, bias, m, p, N, K);
      return block<3, 2>(out, x, w, bias, m, p + 2, N, K);
    case 2: return block<2, 4>(out, x, w, bias, m, p, N, K);
    case 1: return block<1, 4>(out, x, w, bias, m, p, N, K);
    default: return;
  }
}

// One panel (the last one to three of a layer whose outputs are not a multiple of 128).
void one_panel(c10::BFloat16* out, const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, int64_t p,
               int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) block<kRows, 1>(out, x, w, bias, m, p, N, K);
  switch (M - m) {
    case 3: return block<3, 1>(out, x, w, bias, m, p, N, K);
    case 2: return block<2, 1>(out, x, w, bias, m, p, N, K);
    case 1: return block<1, 1>(out, x, w, bias, m, p, N, K);
    default: return;
  }
}

void run(c10::BFloat16* out, const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, int64_t M, int64_t N,
         int64_t K) {
  const int64_t count = N / 32, groups = (count + 3) / 4;
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * 4;
      if (p + 4 <= count) {
        four_panels(out, x, w, bias, p, M, N, K);
      } else {
        for (int64_t q = p; q < count; ++q) one_panel(out, x, w, bias, q, M, N, K);
      }
    }
  });
}

#endif  // TB_HAVE_AVX512BF16

bool avx512bf16_available() {
#ifdef TB_HAVE_AVX512BF16
  return true;
#else
  return false;
#endif
}

void avx512bf16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& w_tiles,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(avx512bf16_available(), "avx512bf16_linear: this CPU or build has no AVX512-BF16 "
              "(check avx512bf16_available() first)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "avx512bf16_linear: x must be a contiguous 2-D bfloat16 tensor; got shape ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(w_tiles.dim() == 5 && w_tiles.size(2) == 2 && w_tiles.size(3) == 16 && w_tiles.size(4) == 32
                  && w_tiles.scalar_type() == at::kBFloat16 && w_tiles.is_contiguous(),
              "avx512bf16_linear: w_tiles must be contiguous bfloat16 [N/32, K/32, 2, 16, 32]; got ", w_tiles.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w_tiles.size(0) * 32;
  TORCH_CHECK(w_tiles.size(1) * 32 == K, "avx512bf16_linear: x has ", K, " features, the weight tiles ",
              w_tiles.size(1) * 32);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.is_contiguous()
                  && out.scalar_type() == at::kBFloat16,
              "avx512bf16_linear: out must be contiguous bfloat16 [", M, ", ", N, "]; got ", out.sizes(), " ",
              out.scalar_type());
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == at::kBFloat16,
                "avx512bf16_linear: bias must be contiguous bfloat16 [", N, "]; got ", bias->sizes(), " ",
                bias->scalar_type());
    b = bias->data_ptr<c10::BFloat16>();
  }
  if (M == 0) return;
#ifdef TB_HAVE_AVX512BF16
  run(out.data_ptr<c10::BFloat16>(), reinterpret_cast<const uint16_t*>(x.data_ptr()),
      reinterpret_cast<const uint16_t*>(w_tiles.data_ptr()), b, M, N, K);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchbridge_serve, m) {
  m.def("avx512bf16_linear(Tensor(a!) out, Tensor x, Tensor w_tiles, Tensor? bias) -> ()");
  m.def("avx512bf16_available", avx512bf16_available);
}

TORCH_LIBRARY_IMPL(torchbridge_serve, CPU, m) { m.impl("avx512bf16_linear", avx512bf16_linear); }
