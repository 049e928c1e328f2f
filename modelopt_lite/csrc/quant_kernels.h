// The CPU compute kernels of modelopt_lite, on float32 arrays (no torch headers).
//
// Every kernel processes n elements. Tensors that may broadcast (scale, zero point) come as a pointer plus an
// increment `inc` of 0 (one value for all n elements) or 1 (one value per element). A scale of exactly 0 marks a
// dead slice: forward outputs are exact zeros there (the zero point for affine codes). Formulas: see
// functional/reference.py; the element definitions are in quant_elem.h.
//
// Three implementations exist: a portable scalar one (quant_scalar.cpp), an AVX2+F16C one (quant_avx2.cpp) and an
// AVX-512 one (quant_avx512.cpp, the hot forwards over the AVX2 table), compiled with per-function target attributes
// and selected at run time. All are bit-identical.
#pragma once

#include <cstdint>

namespace mol {

struct Kernels {
  const char* name;
  // q = clamp(rint(x / s), qmin, qmax); out = codes ? q : q * s.
  void (*int_fwd)(const float* x, const float* s, int sinc, float qmin, float qmax, float* out, int64_t n,
                  bool codes);
  // int_fwd, and in the same pass folds min(x) into *xmin: NaN once any x is NaN (and then it stays NaN).
  // Start *xmin at +Inf. Read by the unsigned ops to refuse a negative or NaN input without a second pass.
  void (*int_fwd_min)(const float* x, const float* s, int sinc, float qmin, float qmax, float* out, int64_t n,
                      bool codes, float* xmin);
  // out = e4m3(clamp(x / s, -448, 448)) * s.
  void (*e4m3_fwd)(const float* x, const float* s, int sinc, float* out, int64_t n);
  // q = clamp(rint(x / s) + zp, qmin, qmax); out = codes ? q : (q - zp) * s.
  void (*affine_fwd)(const float* x, const float* s, int sinc, const float* zp, int zinc, float qmin, float qmax,
                     float* out, int64_t n, bool codes);
  // gx = (qmin*s <= x <= qmax*s) ? g : 0; gs (if not null) = LSQ term(x / s) * g, 0 where s == 0.
  void (*int_bwd)(const float* g, const float* x, const float* s, int sinc, float qmin, float qmax, float* gx,
                  float* gs, int64_t n);
  // gx = (-448*s <= x <= 448*s) ? g : 0; gs (if not null) = term * g with term = e4m3(v) - v inside the range.
  void (*e4m3_bwd)(const float* g, const float* x, const float* s, int sinc, float* gx, float* gs, int64_t n);
  // gx = ((qmin - zp)*s <= x <= (qmax - zp)*s) ? g : 0.
  void (*affine_bwd)(const float* g, const float* x, const float* s, int sinc, const float* zp, int zinc,
                     float qmin, float qmax, float* gx, int64_t n);
  // max |x| over n elements (n >= 0; 0 for n == 0); NaN when any element is NaN (Inf when one is infinite).
  float (*absmax)(const float* x, int64_t n);
  // Contiguous dtype conversions (round to nearest even).
  void (*f16_to_f32)(const uint16_t* src, float* dst, int64_t n);
  void (*f32_to_f16)(const float* src, uint16_t* dst, int64_t n);
  void (*bf16_to_f32)(const uint16_t* src, float* dst, int64_t n);
  void (*f32_to_bf16)(const float* src, uint16_t* dst, int64_t n);
};

// The portable implementation (always available).
const Kernels& scalar_kernels();

// The AVX2+F16C implementation, or nullptr when it was not compiled in or the CPU lacks AVX2/F16C.
const Kernels* avx2_kernels();

// The AVX-512 (F/BW/VL/DQ) implementation: avx2_kernels() with the integer/E4M3 forwards and absmax in 16-lane
// form (quant_avx512.cpp); nullptr when not compiled in or the CPU lacks those features.
const Kernels* avx512_kernels();

// Scalar helpers the AVX2 kernels use for their last n % 8 elements.
namespace scalar {
void int_fwd(const float* x, const float* s, int sinc, float qmin, float qmax, float* out, int64_t n, bool codes);
void int_fwd_min(const float* x, const float* s, int sinc, float qmin, float qmax, float* out, int64_t n, bool codes,
                 float* xmin);
float fold_min(float m, float v);
void e4m3_fwd(const float* x, const float* s, int sinc, float* out, int64_t n);
void affine_fwd(const float* x, const float* s, int sinc, const float* zp, int zinc, float qmin, float qmax,
                float* out, int64_t n, bool codes);
void int_bwd(const float* g, const float* x, const float* s, int sinc, float qmin, float qmax, float* gx, float* gs,
             int64_t n);
void e4m3_bwd(const float* g, const float* x, const float* s, int sinc, float* gx, float* gs, int64_t n);
void affine_bwd(const float* g, const float* x, const float* s, int sinc, const float* zp, int zinc, float qmin,
                float qmax, float* gx, int64_t n);
float absmax(const float* x, int64_t n);
void f16_to_f32(const uint16_t* src, float* dst, int64_t n);
void f32_to_f16(const float* src, uint16_t* dst, int64_t n);
void bf16_to_f32(const uint16_t* src, float* dst, int64_t n);
void f32_to_bf16(const float* src, uint16_t* dst, int64_t n);
}  // namespace scalar

}  // namespace mol
