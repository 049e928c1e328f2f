// Portable scalar kernels of the 4-bit and microscaling formats (mx_kernels.h), straight from mx_elem.h. They are
// the fallback without AVX2 and the tails (partial blocks, odd lengths) of the AVX2 kernels.
#include "mx_elem.h"
#include "mx_kernels.h"

namespace mol {
namespace mxscalar {

template <int ELEM>
static void minifloat_t(const float* x, const float* s, int sinc, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float sv = s[i * sinc];
    out[i] = (sv == 0.0f) ? 0.0f : mxe::fmul(mxe::elem_round<ELEM>(mxe::fdiv(x[i], sv)), sv);
  }
}

void minifloat_fwd(int elem, const float* x, const float* s, int sinc, float* out, int64_t n) {
  switch (elem) {
    case mxe::kE4M3:
      return minifloat_t<mxe::kE4M3>(x, s, sinc, out, n);
    case mxe::kE5M2:
      return minifloat_t<mxe::kE5M2>(x, s, sinc, out, n);
    default:
      return minifloat_t<mxe::kE2M1>(x, s, sinc, out, n);
  }
}

bool nvfp4_fwd(const float* x, float* out, float* scales, int64_t n, int64_t block, float scale_2) {
  bool bad = false;
  for (int64_t b0 = 0, k = 0; b0 < n; b0 += block, ++k) {
    const int64_t m = (n - b0 < block) ? n - b0 : block;
    float a = 0.0f;
    for (int64_t i = 0; i < m; ++i) a = mxe::amax_step(a, x[b0 + i]);
    bad |= mxe::nonfinite(a);
    const float s = mxe::nvfp4_block_scale(a, scale_2);
    if (scales != nullptr) scales[k] = s;
    if (s == 0.0f) {
      for (int64_t i = 0; i < m; ++i) out[b0 + i] = 0.0f;
      continue;
    }
    const float d = mxe::fmul(s, scale_2);
    for (int64_t i = 0; i < m; ++i) out[b0 + i] = mxe::fmul(mxe::e2m1(mxe::fdiv(x[b0 + i], d)), d);
  }
  return bad;
}

template <int ELEM>
static bool mx_t(bool rceil, const float* x, float* out, float* exps, int64_t n, int64_t block) {
  bool bad = false;
  for (int64_t b0 = 0, k = 0; b0 < n; b0 += block, ++k) {
    const int64_t m = (n - b0 < block) ? n - b0 : block;
    float a = 0.0f;
    for (int64_t i = 0; i < m; ++i) a = mxe::amax_step(a, x[b0 + i]);
    bad |= mxe::nonfinite(a);
    if (a != a) {  // a NaN in the block: the whole block is NaN (2**floor(log2(NaN)) is NaN)
      if (exps != nullptr) exps[k] = a;
      for (int64_t i = 0; i < m; ++i) out[b0 + i] = a;
      continue;
    }
    const int e = mxe::mx_exponent(a, ELEM, rceil);
    if (exps != nullptr) exps[k] = static_cast<float>(e);
    const float X = mxe::pow2f(e), inv = mxe::pow2f(-e);  // x * 2**-e == x / 2**e exactly (one rounding)
    for (int64_t i = 0; i < m; ++i) out[b0 + i] = mxe::fmul(mxe::elem_round<ELEM>(mxe::fmul(x[b0 + i], inv)), X);
  }
  return bad;
}

bool mx_fwd(int elem, bool rceil, const float* x, float* out, float* exps, int64_t n, int64_t block) {
  switch (elem) {
    case mxe::kE4M3:
      return mx_t<mxe::kE4M3>(rceil, x, out, exps, n, block);
    case mxe::kE5M2:
      return mx_t<mxe::kE5M2>(rceil, x, out, exps, n, block);
    case mxe::kE2M1:
      return mx_t<mxe::kE2M1>(rceil, x, out, exps, n, block);
    default:
      return mx_t<mxe::kInt8>(rceil, x, out, exps, n, block);
  }
}

}  // namespace mxscalar

const MxKernels& mx_scalar_kernels() {
  static const MxKernels k{"scalar", mxscalar::minifloat_fwd, mxscalar::nvfp4_fwd, mxscalar::mx_fwd};
  return k;
}

}  // namespace mol
