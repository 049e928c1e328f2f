// AVX2 + F16C kernels, 8 floats per step, bit-identical to the scalar ones in quant_scalar.cpp.
//
// Only this unit uses AVX2, through per-function target attributes (no global -mavx2), and it includes no torch
// headers, so no inline function compiled for AVX2 can leak into the generic code path. avx2_kernels() checks the
// CPU at run time. IEEE division (vdivps), explicit round-to-nearest-even (vroundps imm 8), NaN-propagating clamp
// (vmaxps/vminps operand order = torch.clamp), no FMA.
#include "mx_kernels.h"
#include "quant_kernels.h"
#include "quant_vec_dispatch.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>

#include "mx_elem.h"
#include "quant_elem.h"

#define MOL_TGT __attribute__((target("avx2,f16c")))

namespace mol {
namespace {

MOL_TGT inline __m256 clampv(__m256 v, __m256 lo, __m256 hi) { return _mm256_min_ps(hi, _mm256_max_ps(lo, v)); }

MOL_TGT inline __m256 rintv(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// e4m3 round trip of c in [-448, 448] (or NaN): the vector form of e4m3_elem.
MOL_TGT inline __m256 e4m3v(__m256 c) {
  const __m256i b = _mm256_castps_si256(c);
  const __m256i sign = _mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_xor_si256(b, sign);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  const __m256i rn = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFFF)), odd),
                                      _mm256_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m256 big = _mm256_set1_ps(16384.0f);
  const __m256i rs = _mm256_castps_si256(_mm256_sub_ps(_mm256_add_ps(_mm256_castsi256_ps(a), big), big));
  const __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a);  // a >= 0 as int32
  const __m256 r = _mm256_castsi256_ps(_mm256_or_si256(_mm256_blendv_epi8(rn, rs, sub), sign));
  return _mm256_blendv_ps(r, c, _mm256_cmp_ps(c, c, _CMP_UNORD_Q));
}

// Scale lanes: the 8 values of a per-element scale, or the broadcast one.
template <bool VS>
MOL_TGT inline __m256 lanes(const float* p, int64_t i, __m256 bcast) {
  if constexpr (VS) {
    return _mm256_loadu_ps(p + i);
  } else {
    return bcast;
  }
}

// Horizontal min of 8 lanes (no NaN in them: the callers track NaN apart).
MOL_TGT inline float hmin(__m256 v) {
  __m128 h = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_min_ps(h, _mm_movehl_ps(h, h));
  h = _mm_min_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// The vector set of this file (quant_vec_dispatch.h): its kernels, dispatched by vecdispatch::Entries<Vec>.
struct Vec {
  // MIN: also fold min(x) into *xmin (vminps with x first drops a NaN lane, so NaN lanes are or-ed into a mask).
  template <bool VS, bool CODES, bool MIN>
  static MOL_TGT void int_fwd(const float* x, const float* s, float qmin, float qmax, float* out, int64_t n,
                              float* xmin) {
    const __m256 lo = _mm256_set1_ps(qmin), hi = _mm256_set1_ps(qmax), one = _mm256_set1_ps(1.0f);
    const __m256 zero = _mm256_setzero_ps(), sb = _mm256_set1_ps(s[0]);
    __m256 mn = _mm256_set1_ps(__builtin_inff()), nan = zero;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 ss = sb, dead = zero;  // a broadcast scale is never 0 here (dead rows return early)
      if constexpr (VS) {
        const __m256 sv = _mm256_loadu_ps(s + i);
        dead = _mm256_cmp_ps(sv, zero, _CMP_EQ_OQ);
        ss = _mm256_blendv_ps(sv, one, dead);
      }
      const __m256 xv = _mm256_loadu_ps(x + i);
      if constexpr (MIN) {
        mn = _mm256_min_ps(xv, mn);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
      }
      // + 0.0 turns a -0.0 code into +0.0 (int_code_elem)
      const __m256 q = _mm256_add_ps(clampv(rintv(_mm256_div_ps(xv, ss)), lo, hi), zero);
      const __m256 r = CODES ? q : _mm256_mul_ps(q, ss);
      _mm256_storeu_ps(out + i, VS ? _mm256_andnot_ps(dead, r) : r);
    }
    if constexpr (MIN) {
      const float m = _mm256_movemask_ps(nan) != 0 ? __builtin_nanf("") : hmin(mn);
      *xmin = scalar::fold_min(*xmin, m);
      scalar::int_fwd_min(x + i, s + (VS ? i : 0), VS ? 1 : 0, qmin, qmax, out + i, n - i, CODES, xmin);
    } else {
      scalar::int_fwd(x + i, s + (VS ? i : 0), VS ? 1 : 0, qmin, qmax, out + i, n - i, CODES);
    }
  }

  // min(x) folded into *xmin, NaN-aware (a dead slice still reads x for the check).
  static MOL_TGT void min_into(const float* x, int64_t n, float* xmin) {
    __m256 mn = _mm256_set1_ps(__builtin_inff()), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x + i);
      mn = _mm256_min_ps(xv, mn);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
    }
    float m = scalar::fold_min(*xmin, _mm256_movemask_ps(nan) != 0 ? __builtin_nanf("") : hmin(mn));
    for (; i < n; ++i) m = scalar::fold_min(m, x[i]);
    *xmin = m;
  }
};

// The E4M3 forward, e4m3(clamp(x / s, -448, 448)) * s: the E4M3 minifloat kernel of mx_avx2.cpp, the same formula
// (its 16-lane form is quant_avx512.cpp's).
void e4m3_fwd(const float* x, const float* s, int sinc, float* out, int64_t n) {
  mx_avx2_kernels()->minifloat_fwd(mxe::kE4M3, x, s, sinc, out, n);
}

template <bool VS, bool VZ, bool CODES>
MOL_TGT void affine_fwd_t(const float* x, const float* s, const float* zp, float qmin, float qmax, float* out,
                          int64_t n) {
  const __m256 lo = _mm256_set1_ps(qmin), hi = _mm256_set1_ps(qmax), one = _mm256_set1_ps(1.0f);
  const __m256 zero = _mm256_setzero_ps(), sb = _mm256_set1_ps(s[0]), zb = _mm256_set1_ps(zp[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 z = lanes<VZ>(zp, i, zb);
    __m256 ss = sb, dead = zero;
    if constexpr (VS) {
      const __m256 sv = _mm256_loadu_ps(s + i);
      dead = _mm256_cmp_ps(sv, zero, _CMP_EQ_OQ);
      ss = _mm256_blendv_ps(sv, one, dead);
    }
    const __m256 q = clampv(_mm256_add_ps(rintv(_mm256_div_ps(_mm256_loadu_ps(x + i), ss)), z), lo, hi);
    __m256 r = CODES ? q : _mm256_mul_ps(_mm256_sub_ps(q, z), ss);
    if constexpr (VS) r = CODES ? _mm256_blendv_ps(r, z, dead) : _mm256_andnot_ps(dead, r);
    _mm256_storeu_ps(out + i, r);
  }
  scalar::affine_fwd(x + i, s + (VS ? i : 0), VS ? 1 : 0, zp + (VZ ? i : 0), VZ ? 1 : 0, qmin, qmax, out + i, n - i,
                     CODES);
}

template <bool CODES>
void affine_fwd_c(const float* x, const float* s, int sinc, const float* zp, int zinc, float qmin, float qmax,
                  float* out, int64_t n) {
  if (sinc) {
    zinc ? affine_fwd_t<true, true, CODES>(x, s, zp, qmin, qmax, out, n)
         : affine_fwd_t<true, false, CODES>(x, s, zp, qmin, qmax, out, n);
  } else {
    zinc ? affine_fwd_t<false, true, CODES>(x, s, zp, qmin, qmax, out, n)
         : affine_fwd_t<false, false, CODES>(x, s, zp, qmin, qmax, out, n);
  }
}

void affine_fwd(const float* x, const float* s, int sinc, const float* zp, int zinc, float qmin, float qmax,
                float* out, int64_t n, bool codes) {
  if (sinc == 0 && s[0] == 0.0f) {  // a dead slice: zeros (codes: the zero point)
    for (int64_t i = 0; i < n; ++i) out[i] = codes ? zp[i * zinc] : 0.0f;
    return;
  }
  codes ? affine_fwd_c<true>(x, s, sinc, zp, zinc, qmin, qmax, out, n)
        : affine_fwd_c<false>(x, s, sinc, zp, zinc, qmin, qmax, out, n);
}

// The LSQ term of the scale gradient (times g), 0 in dead lanes. r = rounded value clamped to [lo, hi].
MOL_TGT inline __m256 lsq_term(__m256 v, __m256 r, __m256 lo, __m256 hi, __m256 g, __m256 dead) {
  __m256 t = _mm256_blendv_ps(_mm256_sub_ps(r, v), hi, _mm256_cmp_ps(v, hi, _CMP_GT_OQ));
  t = _mm256_blendv_ps(t, lo, _mm256_cmp_ps(v, lo, _CMP_LT_OQ));
  return _mm256_andnot_ps(dead, _mm256_mul_ps(t, g));
}

MOL_TGT inline __m256 ste(__m256 x, __m256 lo, __m256 hi, __m256 g) {
  const __m256 m = _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), _mm256_cmp_ps(x, hi, _CMP_LE_OQ));
  return _mm256_and_ps(m, g);
}

template <bool VS, bool E4M3>
MOL_TGT void bwd_t(const float* g, const float* x, const float* s, float qmin, float qmax, float* gx, float* gs,
                   int64_t n) {
  const __m256 lo = _mm256_set1_ps(qmin), hi = _mm256_set1_ps(qmax), one = _mm256_set1_ps(1.0f);
  const __m256 zero = _mm256_setzero_ps(), sb = _mm256_set1_ps(s[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 sv = lanes<VS>(s, i, sb);
    const __m256 xv = _mm256_loadu_ps(x + i), gv = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(gx + i, ste(xv, _mm256_mul_ps(lo, sv), _mm256_mul_ps(hi, sv), gv));
    if (gs == nullptr) continue;
    const __m256 dead = _mm256_cmp_ps(sv, zero, _CMP_EQ_OQ);
    const __m256 v = _mm256_div_ps(xv, _mm256_blendv_ps(sv, one, dead));
    const __m256 r = E4M3 ? e4m3v(clampv(v, lo, hi)) : clampv(rintv(v), lo, hi);
    _mm256_storeu_ps(gs + i, lsq_term(v, r, lo, hi, gv, dead));
  }
  const int sinc = VS ? 1 : 0;
  const float* st = s + (VS ? i : 0);
  if (E4M3) {
    scalar::e4m3_bwd(g + i, x + i, st, sinc, gx + i, gs ? gs + i : nullptr, n - i);
  } else {
    scalar::int_bwd(g + i, x + i, st, sinc, qmin, qmax, gx + i, gs ? gs + i : nullptr, n - i);
  }
}

void int_bwd(const float* g, const float* x, const float* s, int sinc, float qmin, float qmax, float* gx, float* gs,
             int64_t n) {
  sinc ? bwd_t<true, false>(g, x, s, qmin, qmax, gx, gs, n) : bwd_t<false, false>(g, x, s, qmin, qmax, gx, gs, n);
}

void e4m3_bwd(const float* g, const float* x, const float* s, int sinc, float* gx, float* gs, int64_t n) {
  sinc ? bwd_t<true, true>(g, x, s, -448.0f, 448.0f, gx, gs, n) : bwd_t<false, true>(g, x, s, -448.0f, 448.0f, gx, gs, n);
}

template <bool VS, bool VZ>
MOL_TGT void affine_bwd_t(const float* g, const float* x, const float* s, const float* zp, float qmin, float qmax,
                          float* gx, int64_t n) {
  const __m256 lo = _mm256_set1_ps(qmin), hi = _mm256_set1_ps(qmax);
  const __m256 sb = _mm256_set1_ps(s[0]), zb = _mm256_set1_ps(zp[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 sv = lanes<VS>(s, i, sb), z = lanes<VZ>(zp, i, zb);
    const __m256 l = _mm256_mul_ps(_mm256_sub_ps(lo, z), sv), h = _mm256_mul_ps(_mm256_sub_ps(hi, z), sv);
    _mm256_storeu_ps(gx + i, ste(_mm256_loadu_ps(x + i), l, h, _mm256_loadu_ps(g + i)));
  }
  scalar::affine_bwd(g + i, x + i, s + (VS ? i : 0), VS ? 1 : 0, zp + (VZ ? i : 0), VZ ? 1 : 0, qmin, qmax, gx + i,
                     n - i);
}

void affine_bwd(const float* g, const float* x, const float* s, int sinc, const float* zp, int zinc, float qmin,
                float qmax, float* gx, int64_t n) {
  if (sinc) {
    zinc ? affine_bwd_t<true, true>(g, x, s, zp, qmin, qmax, gx, n) : affine_bwd_t<true, false>(g, x, s, zp, qmin, qmax, gx, n);
  } else {
    zinc ? affine_bwd_t<false, true>(g, x, s, zp, qmin, qmax, gx, n)
         : affine_bwd_t<false, false>(g, x, s, zp, qmin, qmax, gx, n);
  }
}

// max |x| as a signed-int32 max of the |x| bit patterns: non-negative floats order like their bits, and a NaN's
// pattern is above Inf's, so one vpmaxsd per vector tracks both (4 accumulators: no single dependency chain). A NaN
// rescans with the scalar kernel, whose NaN is the one returned (the first one met).
MOL_TGT inline __m256i abs_bits(const float* p) {
  return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi32(0x7FFFFFFF));
}

MOL_TGT float absmax(const float* x, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_max_epi32(a0, abs_bits(x + i));
    a1 = _mm256_max_epi32(a1, abs_bits(x + i + 8));
    a2 = _mm256_max_epi32(a2, abs_bits(x + i + 16));
    a3 = _mm256_max_epi32(a3, abs_bits(x + i + 24));
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_max_epi32(a0, abs_bits(x + i));
  a0 = _mm256_max_epi32(_mm256_max_epi32(a0, a1), _mm256_max_epi32(a2, a3));
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(a0), _mm256_extracti128_si256(a0, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  const uint32_t m = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  if (m > 0x7F800000u) return scalar::absmax(x, n);  // NaN
  float a;
  __builtin_memcpy(&a, &m, sizeof(a));
  const float t = scalar::absmax(x + i, n - i);
  return (t > a || t != t) ? t : a;
}

MOL_TGT void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  scalar::f16_to_f32(src + i, dst + i, n - i);
}

MOL_TGT void f32_to_f16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  scalar::f32_to_f16(src + i, dst + i, n - i);
}

MOL_TGT void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  scalar::bf16_to_f32(src + i, dst + i, n - i);
}

MOL_TGT void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), qnan = _mm256_set1_epi32(0x7FC0);
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(src + i);
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), odd), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(p));
  }
  scalar::f32_to_bf16(src + i, dst + i, n - i);
}

}  // namespace

const Kernels* avx2_kernels() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  using E = vecdispatch::Entries<Vec>;
  static const Kernels k{"avx2",     E::int_fwd, E::int_fwd_min, e4m3_fwd,     affine_fwd,  int_bwd,    e4m3_bwd,
                         affine_bwd, absmax,     f16_to_f32,     f32_to_f16,   bf16_to_f32, f32_to_bf16};
  return ok ? &k : nullptr;
}

}  // namespace mol

#else  // not x86 or not GCC/Clang: the scalar kernels only

namespace mol {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace mol

#endif
