// e^x over 16 fp32 lanes (AVX-512) or 8 (AVX2), shared by the CPU kernels that need an exponential in a
// vector loop.
#pragma once

#include "widen.h"

namespace torchbridge_serve {

// Cephes' expf, the numbers both widths use: the clamp, log2(e), ln2 in two parts, e^r's polynomial.
namespace expf_consts {
constexpr float lo = -87.33654f, hi = 88.37626f, log2e = 1.44269504088896341f;
constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
constexpr float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                        4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace expf_consts

}  // namespace torchbridge_serve

#if defined(__AVX512F__)
#include <immintrin.h>

namespace torchbridge_serve {

// e^x in fp32, within ~1 ulp over [-87.3, 88.4]; outside it, the value at the nearer end (below: ~1e-38, not
// 0, which a sum or silu's division treats alike). Cephes' expf: x = n ln2 + r with ln2 in two parts, |r| <= ln2 / 2,
// e^r by its degree-7 polynomial, then 2^n with scalef.
inline __m512 exp16(__m512 x) {
  namespace k = expf_consts;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(k::lo)), _mm512_set1_ps(k::hi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(k::log2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(k::ln2_hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(k::ln2_lo), r);
  __m512 p = _mm512_set1_ps(k::c[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k::c[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace torchbridge_serve
#elif defined(TORCHBRIDGE_AVX2)

namespace torchbridge_serve {

// exp16's polynomial over eight lanes. AVX2 has no scalef: 2^n is built in the exponent bits, with n at
// most 127 (at the upper clamp x log2(e) rounds to 128, whose exponent field would be infinity's; r then
// stays within ln2 and the polynomial within its accuracy).
inline __m256 exp8(__m256 x) {
  namespace k = expf_consts;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(k::lo)), _mm256_set1_ps(k::hi));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(k::log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  n = _mm256_min_ps(n, _mm256_set1_ps(127.f));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(k::ln2_hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(k::ln2_lo), r);
  __m256 p = _mm256_set1_ps(k::c[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k::c[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace torchbridge_serve
#endif
