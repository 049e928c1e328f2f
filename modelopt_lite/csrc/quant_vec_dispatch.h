// The run-time to compile-time dispatch of the vector forward kernels, one copy for quant_avx2.cpp and
// quant_avx512.cpp: a dead broadcast slice (its one scale exactly 0) gives exact zeros (min(x) still folded), else
// the instantiation for a per-element or broadcast scale, codes or values. V is a vector set, a struct of:
//   template <bool VS, bool CODES, bool MIN> static void int_fwd(x, s, qmin, qmax, out, n, xmin);
//   template <bool VS> static void e4m3_fwd(x, s, out, n);  (only where Entries<V>::e4m3_fwd is used)
//   static void min_into(x, n, xmin);
// and Entries<V> are its functions of the Kernels table.
// No target attributes here: these only branch and call V's (target-attributed, never inlined into them) kernels.
#pragma once

#include <cstdint>

namespace mol {
namespace vecdispatch {

template <class V, bool MIN>
void int_fwd(const float* x, const float* s, int sinc, float qmin, float qmax, float* out, int64_t n, bool codes,
             float* xmin) {
  if (sinc == 0 && s[0] == 0.0f) {  // a dead slice: exact zeros
    if constexpr (MIN) V::min_into(x, n, xmin);
    for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
    return;
  }
  if (sinc) {
    codes ? V::template int_fwd<true, true, MIN>(x, s, qmin, qmax, out, n, xmin)
          : V::template int_fwd<true, false, MIN>(x, s, qmin, qmax, out, n, xmin);
  } else {
    codes ? V::template int_fwd<false, true, MIN>(x, s, qmin, qmax, out, n, xmin)
          : V::template int_fwd<false, false, MIN>(x, s, qmin, qmax, out, n, xmin);
  }
}

template <class V>
void e4m3_fwd(const float* x, const float* s, int sinc, float* out, int64_t n) {
  if (sinc == 0 && s[0] == 0.0f) {
    for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
    return;
  }
  sinc ? V::template e4m3_fwd<true>(x, s, out, n) : V::template e4m3_fwd<false>(x, s, out, n);
}

// The Kernels entries (quant_kernels.h) of vector set V.
template <class V>
struct Entries {
  static void int_fwd(const float* x, const float* s, int sinc, float qmin, float qmax, float* out, int64_t n,
                      bool codes) {
    vecdispatch::int_fwd<V, false>(x, s, sinc, qmin, qmax, out, n, codes, nullptr);
  }
  static void int_fwd_min(const float* x, const float* s, int sinc, float qmin, float qmax, float* out, int64_t n,
                          bool codes, float* xmin) {
    vecdispatch::int_fwd<V, true>(x, s, sinc, qmin, qmax, out, n, codes, xmin);
  }
  static void e4m3_fwd(const float* x, const float* s, int sinc, float* out, int64_t n) {
    vecdispatch::e4m3_fwd<V>(x, s, sinc, out, n);
  }
};

}  // namespace vecdispatch
}  // namespace mol
