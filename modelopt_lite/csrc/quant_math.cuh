// modelopt_lite CUDA kernels, part 1 of 3: element math (pure CUDA, no torch headers).
//
// Everything here is __host__ __device__ so that the exact same code can run on the CPU: the host test harness
// (tests/cuda_host/host_harness.cpp) and the host-emulated build (MODELOPT_LITE_EMULATE_ON_HOST) execute the kernel
// bodies element for element, which is how exactness is checked on machines without a GPU.
//
// Numerics (the contract of modelopt_lite/functional/reference.py), all in float32:
//   integer:  q = clamp(rint(x / s), qmin, qmax) + 0.0 (code 0 is +0.0), y = q * s
//   E4M3:     y = e4m3(clamp(x / s, -448, 448)) * s   (round to nearest even, saturating)
//   affine:   q = clamp(rint(x / s) + zp, qmin, qmax), y = (q - zp) * s
//   s == 0 marks a dead slice: exact +0 (codes: 0, affine codes: zp).
// Every operation is an explicitly rounded IEEE operation (no FMA contraction, true division); clamps keep NaN
// (fminf/fmaxf would drop it); outputs are rounded to nearest even into fp16/bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#ifndef __CUDA_ARCH__
#include <cmath>
#endif

#define MLQ_HD __host__ __device__ __forceinline__
#ifdef __CUDACC__
#define MLQ_UNROLL _Pragma("unroll")
#else
#define MLQ_UNROLL
#endif

namespace mlq {

// ---------------------------------------------------------------------------------------------------------------
// Exactly rounded float32 arithmetic (the device intrinsics forbid FMA contraction; the host path is plain IEEE).
// ---------------------------------------------------------------------------------------------------------------
MLQ_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MLQ_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MLQ_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MLQ_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
// Round half to even (the default rounding mode on both sides).
MLQ_HD float rint_even(float v) {
#ifdef __CUDA_ARCH__
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}
MLQ_HD float bits_to_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
MLQ_HD uint32_t float_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// torch.clamp semantics: NaN stays NaN, every other value (including -0.0) passes unless outside [lo, hi].
MLQ_HD float clamp_keep_nan(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

constexpr float kE4M3Max = 448.0f;

// Saturating round-to-nearest-even into float8 e4m3fn and back to float32 (NaN stays NaN).
MLQ_HD float e4m3_round(float v) {
  const float c = clamp_keep_nan(v, -kE4M3Max, kE4M3Max);
  const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(c, __NV_SATFINITE, __NV_E4M3);
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3)));
}

// ---------------------------------------------------------------------------------------------------------------
// Element types: raw bit containers, conversions to and from float32 (round to nearest even).
// ---------------------------------------------------------------------------------------------------------------
template <class T>
struct Elem;
template <>
struct Elem<float> {
  using raw = uint32_t;
  static MLQ_HD float to_float(raw r) { return bits_to_float(r); }
  static MLQ_HD raw from_float(float f) { return float_to_bits(f); }
};
template <>
struct Elem<__half> {
  using raw = uint16_t;
  static MLQ_HD float to_float(raw r) { return __half2float(__ushort_as_half(r)); }
  static MLQ_HD raw from_float(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
template <>
struct Elem<__nv_bfloat16> {
  using raw = uint16_t;
  static MLQ_HD float to_float(raw r) { return bits_to_float(static_cast<uint32_t>(r) << 16); }
  static MLQ_HD raw from_float(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};

// 16 bytes of raw elements (one vector load or store).
template <class R>
union Pack16 {
  uint4 u;
  R r[16 / sizeof(R)];
};

MLQ_HD uint4 load16(const void* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint4*>(p);
#else
  uint4 u;
  std::memcpy(&u, p, sizeof u);
  return u;
#endif
}
MLQ_HD void store16(void* p, uint4 u) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<uint4*>(p) = u;
#else
  std::memcpy(p, &u, sizeof u);
#endif
}
MLQ_HD float load_param(const float* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Element math: the whole contract, one function per op.
// ---------------------------------------------------------------------------------------------------------------
enum class Fwd : int { IntFake = 0, IntCodes = 1, E4m3Fake = 2, AffineFake = 3, AffineCodes = 4 };
enum class Bwd : int { Int = 0, E4m3 = 1, Affine = 2 };

// An integer code has no sign: + 0.0 turns a -0.0 code (a negative x that rounds to 0) into +0.0, as ONNX Runtime's
// DequantizeLinear of code 0 gives (x + 0.0 == x for every other x, NaN included).
MLQ_HD float int_code_of(float q, float qmin, float qmax) {  // q = x / s
  return add_rn(clamp_keep_nan(rint_even(q), qmin, qmax), 0.0f);
}
MLQ_HD float int_code(float x, float s, float qmin, float qmax) { return int_code_of(div_rn(x, s), qmin, qmax); }
MLQ_HD float affine_code(float x, float s, float zp, float qmin, float qmax) {
  return clamp_keep_nan(add_rn(rint_even(div_rn(x, s)), zp), qmin, qmax);
}

// forward_elem's IntFake / E4m3Fake of an element already divided by its scale s != 0: q = x / s.
template <Fwd M>
MLQ_HD float fake_of_quotient(float q, float s, float qmin, float qmax) {
  static_assert(M == Fwd::IntFake || M == Fwd::E4m3Fake, "fake-quant values only");
  return mul_rn(M == Fwd::IntFake ? int_code_of(q, qmin, qmax) : e4m3_round(q), s);
}

template <Fwd M>
MLQ_HD float forward_elem(float x, float s, float zp, float qmin, float qmax) {
  if constexpr (M == Fwd::IntFake || M == Fwd::E4m3Fake) {
    return s == 0.0f ? 0.0f : fake_of_quotient<M>(div_rn(x, s), s, qmin, qmax);
  }
  if (M == Fwd::IntCodes) return s == 0.0f ? 0.0f : int_code(x, s, qmin, qmax);
  if (M == Fwd::AffineFake) return s == 0.0f ? 0.0f : mul_rn(sub_rn(affine_code(x, s, zp, qmin, qmax), zp), s);
  return s == 0.0f ? zp : affine_code(x, s, zp, qmin, qmax);  // Fwd::AffineCodes
}

// STE mask: lo <= x <= hi with the bounds computed from the raw scale (0 in a dead slice, as the reference does).
template <Bwd M>
MLQ_HD bool backward_pass(float x, float s, float zp, float qmin, float qmax) {
  float lo, hi;
  if (M == Bwd::Int) {
    lo = mul_rn(qmin, s);
    hi = mul_rn(qmax, s);
  } else if (M == Bwd::E4m3) {
    lo = mul_rn(-kE4M3Max, s);
    hi = mul_rn(kE4M3Max, s);
  } else {
    lo = mul_rn(sub_rn(qmin, zp), s);
    hi = mul_rn(sub_rn(qmax, zp), s);
  }
  return x >= lo && x <= hi;
}

// Per-element gradient of y with respect to the scale, times the incoming gradient (0 in a dead slice).
template <Bwd M>
MLQ_HD float backward_scale_term(float x, float g, float s, float qmin, float qmax) {
  if (s == 0.0f) return 0.0f;
  const float v = div_rn(x, s);
  float t;
  if (M == Bwd::Int) {
    const float q = clamp_keep_nan(rint_even(v), qmin, qmax);
    t = v < qmin ? qmin : (v > qmax ? qmax : sub_rn(q, v));
  } else {
    t = v < -kE4M3Max ? -kE4M3Max : (v > kE4M3Max ? kE4M3Max : sub_rn(e4m3_round(v), v));
  }
  return mul_rn(t, g);
}

// Histogram bin on a power-of-two grid: floor(v * 2**-e) (exact: a power-of-two scaling in float64), or -1 (not
// counted) for NaN, negative values and values at or above num_bins * 2**e. inv_width = 2**-e.
MLQ_HD int64_t grid_bin(double v, double inv_width, int64_t num_bins) {
  if (!(v >= 0.0)) return -1;
  const double t = v * inv_width;
  return t < static_cast<double>(num_bins) ? static_cast<int64_t>(t) : -1;
}

// The same bin computed in float32, for float32 values v, where that is exact: inv_width = 2**-e a normal float32
// (|e| <= 126) and num_bins <= 2**24 (exact as a float; nb below). v * 2**-e is then exact in float32 except where it
// falls below 2**-126 (the bin is 0 either way) or overflows to +Inf (not counted either way), so the result equals
// grid_bin's. One float multiply and one truncating conversion per value, where grid_bin takes two float64
// conversions: conversions issue at a quarter of the float32 rate on the GPU.
// `counted` says whether v has a bin (grid_bin's -1 is `counted` false, the bin then 0): a 32-bit bin and a
// predicate, with no 64-bit sentinel to carry through a kernel's hot loop (num_bins <= 2**24).
MLQ_HD uint32_t grid_bin_f32(float v, float inv_width, float nb, bool& counted) {
  const float t = mul_rn(v, inv_width);
  counted = v >= 0.0f && t < nb;
#ifdef __CUDA_ARCH__
  return static_cast<uint32_t>(__float2int_rz(t));  // defined for every t on the device (NaN: 0, saturating)
#else
  return counted ? static_cast<uint32_t>(static_cast<int32_t>(t)) : 0u;  // the host converts only a bin (no UB)
#endif
}

// Values a histogram reads: the three element types plus float64 (which never takes the float32 bin).
template <class T>
struct HistElem {
  using raw = typename Elem<T>::raw;
  static constexpr bool kFloat32 = true;
  static MLQ_HD float value_f32(raw r) { return Elem<T>::to_float(r); }
  static MLQ_HD double value(raw r) { return static_cast<double>(value_f32(r)); }
};
template <>
struct HistElem<double> {
  using raw = double;
  static constexpr bool kFloat32 = false;
  static MLQ_HD double value(raw r) { return r; }
  static MLQ_HD float value_f32(raw r) { return static_cast<float>(r); }
};

// The bin rule of one histogram row: the grid 2**e, num_bins, and whether grid_bin_f32 gives grid_bin's bins.
struct HistGrid {
  double inv;
  int64_t num_bins;
  float inv_f32, nb_f32;
  bool f32;
};

MLQ_HD double pow2_neg(int64_t e) {  // 2**-e, exact (0 or inf beyond the float64 range)
  const int k = static_cast<int>(e < -2000 ? 2000 : (e > 2000 ? -2000 : -e));
#ifdef __CUDA_ARCH__
  return ldexp(1.0, k);
#else
  return std::ldexp(1.0, k);
#endif
}

template <class T>
MLQ_HD HistGrid hist_grid(int64_t e, int64_t num_bins) {
  HistGrid g;
  g.inv = pow2_neg(e);
  g.num_bins = num_bins;
  g.f32 = HistElem<T>::kFloat32 && e >= -126 && e <= 126 && num_bins <= (int64_t{1} << 24);
  g.inv_f32 = g.f32 ? static_cast<float>(g.inv) : 0.0f;
  g.nb_f32 = g.f32 ? static_cast<float>(num_bins) : 0.0f;
  return g;
}

}  // namespace mlq
