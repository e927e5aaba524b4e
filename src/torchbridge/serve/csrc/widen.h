// Reading the engine's cache and activation dtypes as fp32, shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>

#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// CPUs without AVX-512 (AVX2 EPYCs and Xeons before Skylake-SP): the same loads, roundings and stores over
// eight fp32 lanes, so the kernels' vector loops have a second, narrower form instead of scalar code.
#define TORCHBRIDGE_AVX2 1
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

#if defined(TORCHBRIDGE_AVX2)
// Eight consecutive values as fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256i bf16_bits8(__m256 v) {  // as bf16_bits: the low half of each 32-bit lane, NaN a quiet NaN
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m256 rounded8(__m256 v, const float*) { return v; }
inline __m256 rounded8(__m256 v, const c10::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
inline __m256 rounded8(__m256 v, const c10::Half*) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  // packus works within each 128-bit half: [0-3, 0-3 | 4-7, 4-7]; the permute puts 0-3, 4-7 in the low half
  const __m256i b = bf16_bits8(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

}  // namespace torchbridge_serve
