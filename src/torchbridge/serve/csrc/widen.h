// Reading the engine's cache and activation dtypes as fp32, shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>

#include <cstdint>

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

}  // namespace torchbridge_serve
