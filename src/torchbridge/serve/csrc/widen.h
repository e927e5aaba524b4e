// Reading the engine's cache and activation dtypes as fp32, shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>

#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace torchbridge_serve {

// A widening the compiler vectorises (c10's BFloat16 -> float goes through a call per element).
template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}
template <>
inline float widen(c10::BFloat16 v) {
  return c10::bit_cast<float>(static_cast<uint32_t>(v.x) << 16);
}

#if defined(__AVX512F__)
// Sixteen consecutive values as fp32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The value of each lane after a store in T (round to nearest even), and the store itself.
inline __m512i bf16_bits(__m512 v) {  // in the low half of each 32-bit lane; NaN stays a quiet NaN
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline __m512 rounded(__m512 v, const float*) { return v; }
inline __m512 rounded(__m512 v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
inline __m512 rounded(__m512 v, const c10::Half*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

}  // namespace torchbridge_serve
