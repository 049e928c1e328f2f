// Element math of the 4-bit and microscaling formats (E5M2, E2M1, NVFP4, OCP MX), shared by the CPU kernels
// (mx_scalar.cpp, mx_avx2.cpp) and the CUDA kernels (mx_kernels.cu): no torch headers, host and device alike.
//
// The native definitions of functional/microscaling.py, one element / one block at a time, all in float32:
//   minifloat(c)  = round to nearest even onto the grid of a float format with M mantissa bits and smallest normal
//                   exponent EMIN (subnormals included), after clamping to [-max, max] (NaN passes, torch.clamp order)
//                   E4M3: M=3, EMIN=-6, max 448; E5M2: M=2, EMIN=-14, max 57344; E2M1: M=1, EMIN=0, max 6
//   int8 element  = clamp(rint(v * 64), -127, 127) / 64 (1.6 fixed point; see MxElem::kInt8)
//   NVFP4 block   = s = e4m3(min(block_amax / (6 * gs), 448)); y = e2m1(x / (s * gs)) * (s * gs); s == 0: +0.0
// NaN/Inf inputs are rejected before the kernels (as the reference does); the kernels still give NaN blocks for
// them rather than anything undefined.
//   MX block      = X = 2**clamp(k, -127, 127), k = floor(log2(block_amax)) - emax (floor), plus one (rceil) when
//                   the significand of block_amax exceeds the element maximum's; y = elem(x / X) * X
//                   (block_amax == 0: k = -127)
// Every operation is one IEEE float32 operation rounded to nearest even (no FMA contraction, no fast math): the
// device side spells them with the __f*_rn intrinsics.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MXE_HD __host__ __device__ __forceinline__
#else
#define MXE_HD static inline
#endif

namespace mxe {

MXE_HD uint32_t fbits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

MXE_HD float ffrom(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

MXE_HD float fadd(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

MXE_HD float fsub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

MXE_HD float fmul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MXE_HD float fdiv(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// torch.clamp(v, lo, hi): min(max(v, lo), hi) with a NaN v passing through.
MXE_HD float clampn(float v, float lo, float hi) {
  const float t = (lo > v) ? lo : v;
  return (hi < t) ? hi : t;
}

// 1 / b rounded to nearest even (IEEE: __frcp_rn is correctly rounded).
MXE_HD float frcp(float b) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(b);
#else
  return 1.0f / b;
#endif
}

// a * b + c with one rounding to nearest even (IEEE fusedMultiplyAdd; fmaf is correctly rounded on the host).
MXE_HD float ffma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}

// x / d through the reciprocal r = frcp(d) (d > 0): q = x * r, then one correction by the exact remainder
// x - q * d (Markstein's quotient refinement) and x's sign bit or-ed in (for x = -0.0, whose corrected quotient
// would be +0.0; every other result already has x's sign): 4 operations where __fdiv_rn issues about 10 and a branch.
// No result depends on the sign of a rounded zero, which compilers may fold away (g++ -march=native turns
// -fma(a, b, -c) into fnma(a, b, c), giving +0.0 where -0.0 was meant).
// Equal to fdiv(x, d) bit for bit wherever rcp_div_ok(d, r, a) holds for an a >= |x|, x is a float16 or bfloat16
// value and |x / d| >= 2**-12; below that both are smaller than 2**-11, zero together and of x's sign, so every
// element format (E2M1, E4M3, E5M2, integers) rounds them to the same signed zero. Checked exhaustively (all 2**23
// divisor significands against every 16-bit input significand) and over every 16-bit input across the divisor's
// range by tests/cuda_host/rcp_div_check.cpp.
MXE_HD float rcp_refine(float q, float x, float d, float r) {  // q: the first quotient (x * r)
  return ffrom(fbits(ffma(ffma(-q, d, x), r, q)) | (fbits(x) & 0x80000000u));
}
MXE_HD float fdiv_rcp(float x, float d, float r) { return rcp_refine(fmul(x, r), x, d, r); }

// fdiv_rcp for any x, no bound on |x / d| needed: the product is first clamped to +-2**30 (NaN passing), so a
// quotient at or past 2**30 (x up to +-Inf) gives one past 2**29 of its sign, which every element format saturates
// the same way, instead of a NaN from Inf - Inf; below 2**30 the clamp changes nothing. Two more operations.
MXE_HD float fdiv_rcp_clamped(float x, float d, float r) {
  return rcp_refine(clampn(fmul(x, r), -1073741824.0f, 1073741824.0f), x, d, r);
}

// The divisors for which fdiv_rcp / fdiv_rcp_clamped are exact (above): 2**-64 <= d <= 2**16 keeps every
// intermediate a normal float (and a bfloat16 subnormal's quotient at least the smallest float32 subnormal).
MXE_HD bool rcp_div_range(float d) { return d >= 5.42101086242752217e-20f && d <= 65536.0f; }

// fdiv_rcp's condition for a block of amax a >= |x|: d in range and a * r < 2**30 (false for a NaN or Inf a).
MXE_HD bool rcp_div_ok(float d, float r, float a) { return rcp_div_range(d) && fmul(a, r) < 1073741824.0f; }

// NaN or +-Inf.
MXE_HD bool nonfinite(float v) { return (fbits(v) & 0x7FFFFFFFu) >= 0x7F800000u; }

// |v| (the sign bit cleared; NaN stays NaN).
MXE_HD float fabs_bits(float v) { return ffrom(fbits(v) & 0x7FFFFFFFu); }

// The larger of two non-negative floats (sign bit clear, NaN allowed) by their bits: for such floats the unsigned
// bit order is the value order, and every NaN lies above +Inf, so a NaN wins (the one with the larger payload). One
// integer max on the GPU instead of two compares and a select.
MXE_HD float amax_join_bits(float a, float b) {
  const uint32_t x = fbits(a), y = fbits(b);
  return ffrom(y > x ? y : x);
}

// max(a, |v|) for a running amax a (sign bit clear): a NaN v wins (a NaN in a block makes its amax NaN, as
// torch.amax does).
MXE_HD float amax_step(float a, float v) { return amax_join_bits(a, fabs_bits(v)); }

// Round to nearest even onto a float grid with M explicit mantissa bits whose smallest normal is 2**EMIN; c is
// already clamped to the format's range (or NaN, which stays NaN). The sign is restored afterwards (-0.0 stays -0.0).
// One add and one subtract of C = 2**(e + 23 - M), e = the exponent of |c| but at least EMIN (below 2**EMIN the
// subnormal grid keeps the step 2**(EMIN - M)): |c| + C lies in C's binade, whose float32 ulp 2**(e - M) is the grid
// step at |c|, so the add rounds |c| to the grid (ties to even, a carry into the next binade included) and the
// subtract is exact. Float adds rather than integer carries and no branch: on the GPU integer ops issue at half the
// float rate. Bit-identical to the integer-carry form it replaced for all 2**32 float32 inputs of E4M3, E5M2 and
// E2M1 (an exhaustive host check, 2026-11-27).
template <int M, int EMIN>
MXE_HD float minifloat_round(float c) {
  const uint32_t b = fbits(c);
  const uint32_t sign = b & 0x80000000u;
  const uint32_t a = b ^ sign;
  const uint32_t cn = (a & 0x7F800000u) + (static_cast<uint32_t>(23 - M) << 23);
  const uint32_t cs = static_cast<uint32_t>(127 + EMIN - M + 23) << 23;
  const float big = ffrom(cn > cs ? cn : cs);
  const uint32_t r = fbits(fsub(fadd(ffrom(a), big), big)) | sign;
  return c != c ? c : ffrom(r);
}

// Element formats of the blocked kernels (values of the `elem` argument everywhere).
enum MxElem : int { kE4M3 = 0, kE5M2 = 1, kE2M1 = 2, kInt8 = 3 };

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kE2M1Max = 6.0f;
constexpr float kInt8Max = 127.0f / 64.0f;  // the largest 1.6 fixed-point value

MXE_HD float e4m3(float v) { return minifloat_round<3, -6>(clampn(v, -kE4M3Max, kE4M3Max)); }
MXE_HD float e5m2(float v) { return minifloat_round<2, -14>(clampn(v, -kE5M2Max, kE5M2Max)); }
// E2M1 has no -0.0 input rule of its own: the reference gives the result the sign of (v < 0), so -0.0 maps to +0.0
// while a negative value that rounds to 0 keeps -0.0.
// (The rounding is computed first and the zero case selected after it: a select, not a branch around the rounding.)
MXE_HD float e2m1(float v) {
  const float r = minifloat_round<1, 0>(clampn(v, -kE2M1Max, kE2M1Max));
  return v == 0.0f ? 0.0f : r;
}

// rint(t) for |t| <= 2**22 (round half to even), keeping the sign of a zero result: (t + 1.5 * 2**23) - 1.5 * 2**23
// is exact there, and or-ing t's sign bit back gives -0.0 for a negative t that rounds to 0 (as torch.round does).
MXE_HD float rint_small(float t) {
  const float magic = 12582912.0f;
  return ffrom(fbits(fsub(fadd(t, magic), magic)) | (fbits(t) & 0x80000000u));
}

// MX INT8 element: v read as a 1.6 fixed-point number, clamp(rint(v * 64), -127, 127) / 64 (NaN stays NaN).
MXE_HD float int8_fixed(float v) {
  const float t = clampn(fmul(v, 64.0f), -127.0f, 127.0f);
  if (t != t) return t;
  return fmul(rint_small(t), 0.015625f);
}

template <int ELEM>
MXE_HD float elem_round(float v) {
  if (ELEM == kE4M3) return e4m3(v);
  if (ELEM == kE5M2) return e5m2(v);
  if (ELEM == kE2M1) return e2m1(v);
  return int8_fixed(v);
}

// emax of the element format (the exponent of its largest power of two) and the mantissa bits of its largest
// value's significand (1.75, 1.75, 1.5, 127/64 for e4m3, e5m2, e2m1, int8).
MXE_HD int elem_emax(int elem) { return elem == kE4M3 ? 8 : elem == kE5M2 ? 15 : elem == kE2M1 ? 2 : 0; }
MXE_HD uint32_t elem_max_mantissa(int elem) {
  return elem == kE2M1 ? 0x400000u : elem == kInt8 ? 0x7E0000u : 0x600000u;
}

// floor(log2(a)) of a finite a > 0 and the 23 fraction bits of its significand a / 2**floor(log2(a)), exactly
// (subnormals included).
MXE_HD int floor_log2(float a, uint32_t* frac) {
  const uint32_t u = fbits(a) & 0x7FFFFFFFu;
  const int e = static_cast<int>(u >> 23);
  if (e > 0) {
    *frac = u & 0x7FFFFFu;
    return e - 127;
  }
  int k = 22;  // subnormal: a = m * 2**-149 with m < 2**23
  while (((u >> k) & 1u) == 0u) --k;
  *frac = (u << (23 - k)) & 0x7FFFFFu;
  return k - 149;
}

// 2**e as float32 for e in [-127, 127] (2**-127 is a float32 subnormal).
MXE_HD float pow2f(int e) {
  return e >= -126 ? ffrom(static_cast<uint32_t>(e + 127) << 23) : ffrom(0x00400000u >> (-127 - e));
}

// The E8M0 exponent k of an MX block with amax a (finite, >= 0): floor (OCP MX v1.0): floor(log2(a)) - emax;
// rceil (the smallest k with a / 2**k <= the element maximum): one more when a's significand exceeds the element
// maximum's. Clamped to [-127, 127]; a == 0 gives -127.
MXE_HD int mx_exponent(float a, int elem, bool rceil) {
  if (a == 0.0f) return -127;
  uint32_t frac;
  int e = floor_log2(a, &frac) - elem_emax(elem);
  if (rceil && frac > elem_max_mantissa(elem)) ++e;
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// NVFP4 block scale (float32 value of the E4M3 code) for block amax a and global scale scale_2 > 0.
MXE_HD float nvfp4_block_scale(float a, float scale_2) { return e4m3(fdiv(a, fmul(6.0f, scale_2))); }

// microscaling.nvfp4_global_scale of a per-tensor amax: amax / 2688 (6 * 448, true division), +0 for a dead amax
// (amax <= 2**-24, a negative one included: nvfp4_amax_ok rejects it); NaN and +Inf stay NaN and +Inf.
MXE_HD float nvfp4_global_scale(float amax) { return amax <= 5.9604644775390625e-8f ? 0.0f : fdiv(amax, 2688.0f); }

// checks.check_amax_values for the NVFP4 global amax: finite and >= 0 (-0.0 passes; NaN, Inf, negatives do not).
MXE_HD bool nvfp4_amax_ok(float amax) { return amax >= 0.0f && !nonfinite(amax); }

}  // namespace mxe
