// Scalar element formulas shared by every CPU code path (no torch headers: safe to include in the AVX2 unit).
//
// These are THE native definitions of the numerics in functional/reference.py, one element at a time:
//   clamp(v, lo, hi) = min(max(v, lo), hi) with NaN passing through (torch.clamp order),
//   rint             = round half to even (std::nearbyint under the default rounding mode),
//   e4m3(c)          = round to nearest even into float8_e4m3fn (subnormals included), for |c| <= 448,
//   fp16 / bf16      = IEEE round to nearest even (overflow to inf, NaN stays NaN).
// All functions have internal linkage (static) so that every translation unit keeps its own copy: the AVX2 unit
// may compile them with wider instructions without leaking those copies into the generic code path.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mol {

static inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

static inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// torch.clamp(v, lo, hi) == min(max(v, lo), hi); a NaN v stays NaN (same selection rule as vmaxps/vminps).
static inline float clamp_elem(float v, float lo, float hi) {
  const float t = (lo > v) ? lo : v;
  return (hi < t) ? hi : t;
}

static inline float rint_elem(float v) { return std::nearbyint(v); }

// An integer code as float32: clamp(rint(v), qmin, qmax) with -0.0 turned into +0.0 (an integer code has no sign;
// ONNX Runtime's DequantizeLinear of code 0 is +0.0). IEEE x + 0.0 is x for every x but -0.0 (no -ffast-math).
static inline float int_code_elem(float v, float qmin, float qmax) {
  return clamp_elem(rint_elem(v), qmin, qmax) + 0.0f;
}

// Round-to-nearest-even into float8_e4m3fn and back; c must already be clamped to [-448, 448] (or NaN).
static inline float e4m3_elem(float c) {
  if (c != c) return c;
  const uint32_t b = f2u(c);
  const uint32_t sign = b & 0x80000000u;
  const uint32_t a = b ^ sign;
  uint32_t r;
  if (a < 0x3C800000u) {  // |c| < 2**-6: e4m3 subnormals are multiples of 2**-9; 2**14 has an ulp of 2**-9
    r = f2u((u2f(a) + 16384.0f) - 16384.0f);  // exact IEEE add then sub (no -ffast-math anywhere)
  } else {  // keep 3 mantissa bits, ties to even
    r = (a + 0x7FFFFu + ((a >> 20) & 1u)) & 0xFFF00000u;
  }
  return u2f(r | sign);
}

// checks.check_amax_values for one amax: finite and >= 0 (-0.0 passes; NaN, Inf and negatives do not).
static inline bool amax_ok_elem(float a) { return a >= 0.0f && a <= 3.40282346638528859811704183484516925e38f; }

// scales.scale_from_amax for a finite amax a >= 0: a / bound (true division), one float32 step down where the grid's
// end bound * scale would overflow, 0 for a dead amax (a <= 2**-24).
static inline float scale_from_amax_elem(float a, float bound) {
  if (a <= 5.9604644775390625e-8f) return 0.0f;  // AMAX_EPS = 2**-24
  const float s = a / bound;
  return std::isinf(s * bound) ? s * 0.999999940395355224609375f : s;  // s * (1 - 2**-24)
}

static inline uint16_t f32_to_f16_elem(float f) {
  const uint32_t x = f2u(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;    // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;   // >= 65520 rounds to infinity
  if (a >= 0x38800000u) {                        // normal half (>= 2**-14): rebias, round 13 bits away
    uint32_t r = a - 0x38000000u;
    r += 0xFFFu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  const float t = u2f(a) + 0.5f;                 // multiples of 2**-24: the ulp of [0.5, 1)
  return static_cast<uint16_t>(sign | (f2u(t) - 0x3F000000u));
}

static inline float f16_to_f32_elem(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu) return u2f(sign | 0x7F800000u | (m << 13));
  if (e == 0) return u2f(sign | f2u(static_cast<float>(m) * 5.9604644775390625e-8f));  // m * 2**-24, exact
  return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t f32_to_bf16_elem(float f) {
  if (f != f) return 0x7FC0u;
  const uint32_t u = f2u(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_f32_elem(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

}  // namespace mol
