// AVX2 kernels of the 4-bit and microscaling formats, 8 floats per step, bit-identical to mx_scalar.cpp.
//
// Same rules as quant_avx2.cpp: per-function target attributes (no global -mavx2), no torch headers, IEEE division
// (vdivps) where the formula divides by a non-power of two, NaN-propagating clamps (vmaxps/vminps operand order =
// torch.clamp), no FMA. Block amax: vmaxps of |x| plus a separate NaN mask (vmaxps alone would drop a NaN).
#include "mx_kernels.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>

#include "mx_elem.h"

#define MXK_TGT __attribute__((target("avx2,f16c")))

namespace mol {
namespace {

MXK_TGT inline __m256 clampv(__m256 v, __m256 lo, __m256 hi) { return _mm256_min_ps(hi, _mm256_max_ps(lo, v)); }

MXK_TGT inline __m256i set1u(uint32_t u) { return _mm256_set1_epi32(static_cast<int>(u)); }

// The vector form of mxe::minifloat_round<M, EMIN> (c already clamped, or NaN).
template <int M, int EMIN>
MXK_TGT inline __m256 mfround(__m256 c) {
  constexpr int kShift = 23 - M;
  const __m256i b = _mm256_castps_si256(c);
  const __m256i sign = _mm256_and_si256(b, set1u(0x80000000u));
  const __m256i a = _mm256_xor_si256(b, sign);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1));
  const __m256i rn = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(a, set1u((1u << (kShift - 1)) - 1u)), odd),
                                      set1u(~((1u << kShift) - 1u)));
  const __m256 big = _mm256_castsi256_ps(set1u(static_cast<uint32_t>(127 + EMIN - M + 23) << 23));
  const __m256i rs = _mm256_castps_si256(_mm256_sub_ps(_mm256_add_ps(_mm256_castsi256_ps(a), big), big));
  const __m256i sub = _mm256_cmpgt_epi32(set1u(static_cast<uint32_t>(127 + EMIN) << 23), a);  // a >= 0 as int32
  const __m256 r = _mm256_castsi256_ps(_mm256_or_si256(_mm256_blendv_epi8(rn, rs, sub), sign));
  return _mm256_blendv_ps(r, c, _mm256_cmp_ps(c, c, _CMP_UNORD_Q));
}

// The vector form of mxe::elem_round<ELEM>.
template <int ELEM>
MXK_TGT inline __m256 elemv(__m256 v) {
  if constexpr (ELEM == mxe::kE4M3) {
    return mfround<3, -6>(clampv(v, _mm256_set1_ps(-mxe::kE4M3Max), _mm256_set1_ps(mxe::kE4M3Max)));
  } else if constexpr (ELEM == mxe::kE5M2) {
    return mfround<2, -14>(clampv(v, _mm256_set1_ps(-mxe::kE5M2Max), _mm256_set1_ps(mxe::kE5M2Max)));
  } else if constexpr (ELEM == mxe::kE2M1) {
    const __m256 r = mfround<1, 0>(clampv(v, _mm256_set1_ps(-mxe::kE2M1Max), _mm256_set1_ps(mxe::kE2M1Max)));
    return _mm256_andnot_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_EQ_OQ), r);  // -0.0 in: +0.0 (mxe::e2m1)
  } else {  // int8 1.6 fixed point (mxe::int8_fixed)
    const __m256 t = clampv(_mm256_mul_ps(v, _mm256_set1_ps(64.0f)), _mm256_set1_ps(-127.0f), _mm256_set1_ps(127.0f));
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 sgn = _mm256_and_ps(t, _mm256_castsi256_ps(set1u(0x80000000u)));
    const __m256 r = _mm256_or_ps(_mm256_sub_ps(_mm256_add_ps(t, magic), magic), sgn);
    const __m256 y = _mm256_mul_ps(r, _mm256_set1_ps(0.015625f));
    return _mm256_blendv_ps(y, t, _mm256_cmp_ps(t, t, _CMP_UNORD_Q));
  }
}

template <int ELEM, bool VS>
MXK_TGT void minifloat_t(const float* x, const float* s, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), sb = _mm256_set1_ps(s[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 ss = sb, dead = zero;
    if constexpr (VS) {
      const __m256 sv = _mm256_loadu_ps(s + i);
      dead = _mm256_cmp_ps(sv, zero, _CMP_EQ_OQ);
      ss = _mm256_blendv_ps(sv, one, dead);
    }
    const __m256 r = _mm256_mul_ps(elemv<ELEM>(_mm256_div_ps(_mm256_loadu_ps(x + i), ss)), ss);
    _mm256_storeu_ps(out + i, VS ? _mm256_andnot_ps(dead, r) : r);
  }
  mxscalar::minifloat_fwd(ELEM, x + i, s + (VS ? i : 0), VS ? 1 : 0, out + i, n - i);
}

template <int ELEM>
void minifloat_e(const float* x, const float* s, int sinc, float* out, int64_t n) {
  if (sinc == 0 && s[0] == 0.0f) {
    for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
    return;
  }
  sinc ? minifloat_t<ELEM, true>(x, s, out, n) : minifloat_t<ELEM, false>(x, s, out, n);
}

void minifloat_fwd(int elem, const float* x, const float* s, int sinc, float* out, int64_t n) {
  switch (elem) {
    case mxe::kE4M3:
      return minifloat_e<mxe::kE4M3>(x, s, sinc, out, n);
    case mxe::kE5M2:
      return minifloat_e<mxe::kE5M2>(x, s, sinc, out, n);
    default:
      return minifloat_e<mxe::kE2M1>(x, s, sinc, out, n);
  }
}

// max |x| over m (a multiple of 8) elements; NaN if any is NaN.
MXK_TGT inline float block_amax(const float* x, int64_t m) {
  const __m256 absmask = _mm256_castsi256_ps(set1u(0x7FFFFFFFu));
  __m256 acc = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int64_t i = 0; i < m; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_max_ps(acc, _mm256_and_ps(v, absmask));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan) != 0) {  // the scalar rule: the NaN with the largest payload, sign cleared
    float a = 0.0f;
    for (int64_t i = 0; i < m; ++i) a = mxe::amax_step(a, x[i]);
    return a;
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// Lane j: max |x| over the m (a multiple of 8) elements of block j (x + j * m), j < 8, when no element of the 8
// blocks is NaN (then returns false and the caller takes the per-block path). The maxima of the non-negative
// |x| are exact in any order: the same values as block_amax.
MXK_TGT inline bool block_amax8(const float* x, int64_t m, __m256* out) {
  const __m256 absmask = _mm256_castsi256_ps(set1u(0x7FFFFFFFu));
  __m256 acc[8], nan = _mm256_setzero_ps();
  for (int j = 0; j < 8; ++j) {
    const float* xb = x + j * m;
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < m; i += 8) {
      const __m256 v = _mm256_loadu_ps(xb + i);
      a = _mm256_max_ps(a, _mm256_and_ps(v, absmask));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    acc[j] = a;
  }
  if (_mm256_movemask_ps(nan) != 0) return false;
  // transpose-reduce: per 128-bit half, [max of block 0..3] then [4..7]; then the two halves
  __m256 q[2];
  for (int h = 0; h < 2; ++h) {
    const __m256* a = acc + 4 * h;
    const __m256 m01 = _mm256_max_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
    const __m256 m23 = _mm256_max_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
    q[h] = _mm256_max_ps(_mm256_shuffle_ps(m01, m23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(m01, m23, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  *out = _mm256_max_ps(_mm256_permute2f128_ps(q[0], q[1], 0x20), _mm256_permute2f128_ps(q[0], q[1], 0x31));
  return true;
}

// NVFP4 over 8 whole blocks at once: the block scales e4m3(a / (6 * gs)) and divisors s * gs computed 8 lanes wide
// (the same IEEE operations as the scalar mxe::nvfp4_block_scale and fmul). False (nothing written) when a block
// holds a NaN.
MXK_TGT inline bool nvfp4_group8(const float* x, float* out, float* scales, int64_t block, float scale_2,
                                 bool* bad) {
  __m256 a;
  if (!block_amax8(x, block, &a)) return false;
  const __m256 gs = _mm256_set1_ps(scale_2);
  const __m256 sv = elemv<mxe::kE4M3>(_mm256_div_ps(a, _mm256_set1_ps(mxe::fmul(6.0f, scale_2))));
  alignas(32) float av[8], s[8], d[8];
  _mm256_store_ps(av, a);
  _mm256_store_ps(s, sv);
  _mm256_store_ps(d, _mm256_mul_ps(sv, gs));
  for (int j = 0; j < 8; ++j) {
    *bad |= mxe::nonfinite(av[j]);
    if (scales != nullptr) scales[j] = s[j];
    float* o = out + j * block;
    if (s[j] == 0.0f) {
      for (int64_t i = 0; i < block; i += 8) _mm256_storeu_ps(o + i, _mm256_setzero_ps());
      continue;
    }
    const float* xb = x + j * block;
    const __m256 dv = _mm256_set1_ps(d[j]);
    for (int64_t i = 0; i < block; i += 8) {
      const __m256 v = _mm256_div_ps(_mm256_loadu_ps(xb + i), dv);
      _mm256_storeu_ps(o + i, _mm256_mul_ps(elemv<mxe::kE2M1>(v), dv));
    }
  }
  return true;
}

MXK_TGT bool nvfp4_fwd(const float* x, float* out, float* scales, int64_t n, int64_t block, float scale_2) {
  if (block % 8 != 0) return mxscalar::nvfp4_fwd(x, out, scales, n, block, scale_2);
  int64_t b0 = 0, k = 0;
  bool bad = false;
  while (b0 + 8 * block <= n && nvfp4_group8(x + b0, out + b0, scales ? scales + k : nullptr, block, scale_2, &bad)) {
    b0 += 8 * block;
    k += 8;
  }
  for (; b0 + block <= n; b0 += block, ++k) {
    const float a = block_amax(x + b0, block);
    bad |= mxe::nonfinite(a);
    const float s = mxe::nvfp4_block_scale(a, scale_2);
    if (scales != nullptr) scales[k] = s;
    if (s == 0.0f) {
      for (int64_t i = 0; i < block; i += 8) _mm256_storeu_ps(out + b0 + i, _mm256_setzero_ps());
      continue;
    }
    const __m256 d = _mm256_set1_ps(mxe::fmul(s, scale_2));
    for (int64_t i = 0; i < block; i += 8) {
      const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + b0 + i), d);
      _mm256_storeu_ps(out + b0 + i, _mm256_mul_ps(elemv<mxe::kE2M1>(v), d));
    }
  }
  if (b0 < n) bad |= mxscalar::nvfp4_fwd(x + b0, out + b0, scales ? scales + k : nullptr, n - b0, block, scale_2);
  return bad;
}

template <int ELEM>
MXK_TGT bool mx_t(bool rceil, const float* x, float* out, float* exps, int64_t n, int64_t block) {
  int64_t b0 = 0, k = 0;
  bool bad = false;
  for (; b0 + block <= n; b0 += block, ++k) {
    const float a = block_amax(x + b0, block);
    bad |= mxe::nonfinite(a);
    if (a != a) {
      if (exps != nullptr) exps[k] = a;
      for (int64_t i = 0; i < block; i += 8) _mm256_storeu_ps(out + b0 + i, _mm256_set1_ps(a));
      continue;
    }
    const int e = mxe::mx_exponent(a, ELEM, rceil);
    if (exps != nullptr) exps[k] = static_cast<float>(e);
    const __m256 X = _mm256_set1_ps(mxe::pow2f(e)), inv = _mm256_set1_ps(mxe::pow2f(-e));
    for (int64_t i = 0; i < block; i += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + b0 + i), inv);
      _mm256_storeu_ps(out + b0 + i, _mm256_mul_ps(elemv<ELEM>(v), X));
    }
  }
  if (b0 < n) bad |= mxscalar::mx_fwd(ELEM, rceil, x + b0, out + b0, exps ? exps + k : nullptr, n - b0, block);
  return bad;
}

bool mx_fwd(int elem, bool rceil, const float* x, float* out, float* exps, int64_t n, int64_t block) {
  if (block % 8 != 0) return mxscalar::mx_fwd(elem, rceil, x, out, exps, n, block);
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

}  // namespace

const MxKernels* mx_avx2_kernels() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  static const MxKernels k{"avx2", minifloat_fwd, nvfp4_fwd, mx_fwd};
  return ok ? &k : nullptr;
}

}  // namespace mol

#else  // not x86 or not GCC/Clang: the scalar kernels only

namespace mol {
const MxKernels* mx_avx2_kernels() { return nullptr; }
}  // namespace mol

#endif
