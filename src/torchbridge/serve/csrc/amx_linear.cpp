// bf16 linear layers on Intel AMX for the engine's decode steps: out = x @ W.T (+ bias), fp32 accumulation.
//
// At a decode step's few rows a linear layer streams its weight once and does little arithmetic; oneDNN's
// packed bf16 linear spends 30-50 us per call around that (bench/bench_serve_kernels.py, "AMX linears"), and
// a small model's 17 linears per step are mostly that overhead. This kernel keeps the loop trivial: the
// weight is laid out once (serve/linear.py `amx_layout`) as [N/32, K/32, 2, 16, 32] bf16 tiles in AMX's
// pair-interleaved B format, read front to back in one stream; x is read as 16-row A tiles straight from
// its rows. Each pass over 32 output columns accumulates up to 32 rows x 32 columns in four C tiles, then
// rounds them to bf16 (round to nearest even, as torch) after adding the bias in fp32.
//
//   amx_linear(out, x, w_tiles, bias?)   x: [M, K] bf16 rows contiguous, out: [M, N] bf16 contiguous,
//                                        w_tiles: [N/32, K/32, 2, 16, 32] bf16, bias: [N] bf16 or None
//   amx_available() -> bool              built with AMX and the kernel granted the tile state
//
// Built with -march=native: on a CPU without AMX-BF16 the op exists and amx_available() is false.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TB_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifdef TB_HAVE_AMX

// Linux hands a process AMX's tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
constexpr int kReqXcompPerm = 0x1023;
constexpr int kXfeatureTileData = 18;

bool tiles_granted() {
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (rows of the first/second 16-row half x columns 0-15/16-31), 4-5: A halves, 6-7: B halves.
void configure(int rows0, int rows1) {
  TileConfig c;
  for (int t : {0, 1, 4}) c.rows[t] = static_cast<uint8_t>(rows0);
  for (int t : {2, 3, 5}) c.rows[t] = static_cast<uint8_t>(std::max(rows1, 1));
  for (int t : {6, 7}) c.rows[t] = 16;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// rows x 32 fp32 values (row stride 32) + bias -> bf16 at out (row stride ldo).
void round_rows(const float* acc, int rows, c10::BFloat16* out, int64_t ldo, const c10::BFloat16* bias) {
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias)));
    const __m512i raw1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + 16)));
    b0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    b1 = _mm512_castsi512_ps(_mm512_slli_epi32(raw1, 16));
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(acc + r * 32), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(acc + r * 32 + 16), b1);
    _mm512_storeu_si512(reinterpret_cast<void*>(out + r * ldo), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0)));
  }
}

void run(c10::BFloat16* out, const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, int64_t M, int64_t N,
         int64_t K) {
  const int64_t kb_count = K / 32, pairs = N / 32;
  constexpr int64_t kTile = 512;  // bf16 elements in one 16 x 32 tile
  at::parallel_for(0, pairs, 8, [&](int64_t p0, int64_t p1) {
    int cfg0 = -1, cfg1 = -1;
    alignas(64) float acc[16 * 32];
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* wp = w + p * kb_count * 2 * kTile;
      for (int64_t m = 0; m < M; m += 32) {
        const int rows0 = static_cast<int>(std::min<int64_t>(16, M - m));
        const int rows1 = static_cast<int>(std::min<int64_t>(16, M - m - 16));
        if (rows0 != cfg0 || rows1 != cfg1) {
          configure(rows0, rows1);
          cfg0 = rows0;
          cfg1 = rows1;
        }
        const uint16_t* a = x + m * K;
        _tile_zero(0);
        _tile_zero(1);
        if (rows1 > 0) {
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t kb = 0; kb < kb_count; ++kb) {
            _tile_loadd(4, a + kb * 32, K * 2);
            _tile_loadd(5, a + 16 * K + kb * 32, K * 2);
            _tile_loadd(6, wp + kb * 2 * kTile, 64);
            _tile_loadd(7, wp + kb * 2 * kTile + kTile, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        } else {
          for (int64_t kb = 0; kb < kb_count; ++kb) {
            _tile_loadd(4, a + kb * 32, K * 2);
            _tile_loadd(6, wp + kb * 2 * kTile, 64);
            _tile_loadd(7, wp + kb * 2 * kTile + kTile, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
          }
        }
        const c10::BFloat16* b = bias != nullptr ? bias + p * 32 : nullptr;
        _tile_stored(0, acc, 128);
        _tile_stored(1, acc + 16, 128);
        round_rows(acc, rows0, out + m * N + p * 32, N, b);
        if (rows1 > 0) {
          _tile_stored(2, acc, 128);
          _tile_stored(3, acc + 16, 128);
          round_rows(acc, rows1, out + (m + 16) * N + p * 32, N, b);
        }
      }
    }
    _tile_release();
  });
}

#endif  // TB_HAVE_AMX

bool amx_available() {
#ifdef TB_HAVE_AMX
  return tiles_granted();
#else
  return false;
#endif
}

void amx_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& w_tiles, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_available(), "amx_linear: this CPU or build has no AMX-BF16 (check amx_available() first)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "amx_linear: x must be a contiguous 2-D bfloat16 tensor; got shape ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(w_tiles.dim() == 5 && w_tiles.size(2) == 2 && w_tiles.size(3) == 16 && w_tiles.size(4) == 32
                  && w_tiles.scalar_type() == at::kBFloat16 && w_tiles.is_contiguous(),
              "amx_linear: w_tiles must be contiguous bfloat16 [N/32, K/32, 2, 16, 32]; got ", w_tiles.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w_tiles.size(0) * 32;
  TORCH_CHECK(w_tiles.size(1) * 32 == K, "amx_linear: x has ", K, " features, the weight tiles ", w_tiles.size(1) * 32);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.is_contiguous()
                  && out.scalar_type() == at::kBFloat16,
              "amx_linear: out must be contiguous bfloat16 [", M, ", ", N, "]; got ", out.sizes(), " ", out.scalar_type());
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == at::kBFloat16,
                "amx_linear: bias must be contiguous bfloat16 [", N, "]; got ", bias->sizes(), " ", bias->scalar_type());
    b = bias->data_ptr<c10::BFloat16>();
  }
  if (M == 0) return;
#ifdef TB_HAVE_AMX
  run(out.data_ptr<c10::BFloat16>(), reinterpret_cast<const uint16_t*>(x.data_ptr()),
      reinterpret_cast<const uint16_t*>(w_tiles.data_ptr()), b, M, N, K);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchbridge_serve, m) {
  m.def("amx_linear(Tensor(a!) out, Tensor x, Tensor w_tiles, Tensor? bias) -> ()");
  m.def("amx_available", amx_available);
}

TORCH_LIBRARY_IMPL(torchbridge_serve, CPU, m) { m.impl("amx_linear", amx_linear); }
