// One row of RMSNorm and the dtype rounding around it, shared by rms_norm.cpp and fused_ops.cpp.
// Rounding follows the torch expressions the ops replace (Hugging Face Qwen3: upcast x to fp32,
// normalise, round to the input dtype, multiply by w in the input dtype). bf16 is read and rounded on
// its bits (round to nearest even, NaN to 0x7FC0: c10::BFloat16's own rule), so `omp simd` loops over
// a row vectorise; through the c10 conversions they stayed scalar and a qwen3-30m norm of 64 rows took
// ~7 cycles per element. fp32 needs no rounding; fp16 keeps the c10 conversions (the portable path).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace rlengine_norm {

inline float bf16_value(uint16_t bits) { return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16); }

inline uint16_t bf16_bits(float v) {
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// x[i] as fp32.
template <typename T>
inline float load(const T* x, int64_t i) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return bf16_value(reinterpret_cast<const uint16_t*>(x)[i]);
  else return static_cast<float>(x[i]);
}

// y[i] = v rounded to T.
template <typename T>
inline void store(T* y, int64_t i, float v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) reinterpret_cast<uint16_t*>(y)[i] = bf16_bits(v);
  else y[i] = static_cast<T>(v);
}

// v rounded to T, back as fp32 (what a torch op in dtype T would have produced).
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return bf16_value(bf16_bits(v));
  else return static_cast<float>(static_cast<T>(v));
}

// y[0, C) = w * round(x * rsqrt(mean(x^2) + eps)), the sum of squares in fp32. y may alias x.
template <typename T>
inline void norm_row(const T* x, const T* w, T* y, int64_t C, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)  // lane-wise partial sums; the strict order is a C-long dependency chain
  for (int64_t c = 0; c < C; ++c) ss += load(x, c) * load(x, c);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) store(y, c, load(w, c) * round_to<T>(load(x, c) * inv));
}

// norm_row's backward for one row: gy[0, C) is d y in fp32 (overwritten with gy * w), xh[0, C) scratch.
// dx = s (u - x^ mean(u x^)) with u = gy w, x^ = x s (the rounding passed straight through, as autograd does);
// dw[c] += gy[c] * round(x^[c]), the value the forward multiplied by w.
template <typename T>
inline void norm_row_backward(const T* x, float* gy, const float* w, float* xh, T* dx, float* dw, int64_t C,
                              float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < C; ++c) ss += load(x, c) * load(x, c);
  const float s = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t c = 0; c < C; ++c) {
    xh[c] = load(x, c) * s;
    dw[c] += gy[c] * round_to<T>(xh[c]);
    gy[c] *= w[c];
    dot += gy[c] * xh[c];
  }
  const float m = dot / static_cast<float>(C);
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) store(dx, c, s * (gy[c] - xh[c] * m));
}

// r[0, C) = round(r + x), the residual add in the input dtype.
template <typename T>
inline void add_row(T* r, const T* x, int64_t C) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) store(r, c, load(r, c) + load(x, c));
}

}  // namespace rlengine_norm
