// AVX-512 (F, BW, VL, DQ) forms of the hot forward kernels, 16 floats per step, bit-identical to quant_scalar.cpp.
//
// The same rules as quant_avx2.cpp: per-function target attributes (no global -mavx512f), no torch headers, IEEE
// division (vdivps), round to nearest even (vrndscaleps imm 8), NaN-propagating clamp (vmaxps/vminps operand order
// = torch.clamp), no FMA. The last n % 16 elements run in the same vector code under a lane mask (no scalar tail).
// Only the per-tensor/per-channel integer and E4M3 forwards and the block amax are here (what a fake-quant forward
// and a dynamic block spend their time in); the rest of the table is quant_avx2.cpp's.
#include "quant_kernels.h"
#include "quant_vec_dispatch.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>

#define MOL_TGT512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace mol {
namespace {

MOL_TGT512 inline __m512 clampv(__m512 v, __m512 lo, __m512 hi) { return _mm512_min_ps(hi, _mm512_max_ps(lo, v)); }

MOL_TGT512 inline __m512 rintv(__m512 v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Lanes [0, m) of a 16-lane step (m in 1..16).
MOL_TGT512 inline __mmask16 head(int64_t m) { return static_cast<__mmask16>(m >= 16 ? 0xFFFFu : (1u << m) - 1u); }

// e4m3 round trip of c in [-448, 448] (or NaN): quant_avx2.cpp's e4m3v, with mask registers for the selects.
MOL_TGT512 inline __m512 e4m3v(__m512 c) {
  const __m512i b = _mm512_castps_si512(c);
  const __m512i sign = _mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(b, sign);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i rn = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)), odd),
                                      _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m512 big = _mm512_set1_ps(16384.0f);
  const __m512i rs = _mm512_castps_si512(_mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(a), big), big));
  const __mmask16 sub = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x3C800000), a);  // a >= 0 as int32
  const __m512 r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_mask_blend_epi32(sub, rn, rs), sign));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q), r, c);
}

// The scale lanes of a step: a per-element scale (0 -> dead lane, divided by 1) or the broadcast one.
template <bool VS>
MOL_TGT512 inline __m512 scale_lanes(const float* s, int64_t i, __mmask16 k, __m512 bcast, __mmask16* dead) {
  if constexpr (VS) {
    const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), k, s + i);
    *dead = _mm512_cmp_ps_mask(sv, _mm512_setzero_ps(), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(*dead, sv, _mm512_set1_ps(1.0f));
  } else {
    *dead = 0;
    return bcast;
  }
}

// One step of int_fwd on the lanes of k (MIN: min(x) and a NaN mask folded in, as in quant_avx2.cpp).
template <bool VS, bool CODES, bool MIN>
MOL_TGT512 inline void int_step(const float* x, const float* s, int64_t i, __mmask16 k, __m512 sb, __m512 lo,
                                __m512 hi, float* out, __m512* mn, __mmask16* nan) {
  __mmask16 dead;
  const __m512 ss = scale_lanes<VS>(s, i, k, sb, &dead);
  const __m512 xv = _mm512_maskz_loadu_ps(k, x + i);
  if constexpr (MIN) {
    *mn = _mm512_mask_min_ps(*mn, k, xv, *mn);
    *nan = static_cast<__mmask16>(*nan | _mm512_mask_cmp_ps_mask(k, xv, xv, _CMP_UNORD_Q));
  }
  // + 0.0 turns a -0.0 code into +0.0 (int_code_elem)
  const __m512 q = _mm512_add_ps(clampv(rintv(_mm512_div_ps(xv, ss)), lo, hi), _mm512_setzero_ps());
  const __m512 r = CODES ? q : _mm512_mul_ps(q, ss);
  _mm512_mask_storeu_ps(out + i, k, VS ? _mm512_maskz_mov_ps(static_cast<__mmask16>(~dead), r) : r);
}

template <bool VS>
MOL_TGT512 inline void e4m3_step(const float* x, const float* s, int64_t i, __mmask16 k, __m512 sb, float* out) {
  const __m512 lo = _mm512_set1_ps(-448.0f), hi = _mm512_set1_ps(448.0f);
  __mmask16 dead;
  const __m512 ss = scale_lanes<VS>(s, i, k, sb, &dead);
  const __m512 r = _mm512_mul_ps(e4m3v(clampv(_mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), ss), lo, hi)), ss);
  _mm512_mask_storeu_ps(out + i, k, VS ? _mm512_maskz_mov_ps(static_cast<__mmask16>(~dead), r) : r);
}

// The vector set of this file (quant_vec_dispatch.h): its kernels, dispatched by vecdispatch::Entries<Vec>.
struct Vec {
  template <bool VS, bool CODES, bool MIN>
  static MOL_TGT512 void int_fwd(const float* x, const float* s, float qmin, float qmax, float* out, int64_t n,
                                 float* xmin) {
    const __m512 lo = _mm512_set1_ps(qmin), hi = _mm512_set1_ps(qmax), sb = _mm512_set1_ps(s[0]);
    __m512 mn = _mm512_set1_ps(__builtin_inff());
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) int_step<VS, CODES, MIN>(x, s, i, 0xFFFF, sb, lo, hi, out, &mn, &nan);
    if (i < n) int_step<VS, CODES, MIN>(x, s, i, head(n - i), sb, lo, hi, out, &mn, &nan);
    if constexpr (MIN) *xmin = scalar::fold_min(*xmin, nan != 0 ? __builtin_nanf("") : _mm512_reduce_min_ps(mn));
  }

  static MOL_TGT512 void min_into(const float* x, int64_t n, float* xmin) {
    __m512 mn = _mm512_set1_ps(__builtin_inff());
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = head(n - i);
      const __m512 xv = _mm512_maskz_loadu_ps(k, x + i);
      mn = _mm512_mask_min_ps(mn, k, xv, mn);
      nan = static_cast<__mmask16>(nan | _mm512_mask_cmp_ps_mask(k, xv, xv, _CMP_UNORD_Q));
    }
    *xmin = scalar::fold_min(*xmin, nan != 0 ? __builtin_nanf("") : _mm512_reduce_min_ps(mn));
  }

  template <bool VS>
  static MOL_TGT512 void e4m3_fwd(const float* x, const float* s, float* out, int64_t n) {
    const __m512 sb = _mm512_set1_ps(s[0]);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) e4m3_step<VS>(x, s, i, 0xFFFF, sb, out);
    if (i < n) e4m3_step<VS>(x, s, i, head(n - i), sb, out);
  }
};

// max |x| as a signed-int32 max of the |x| bit patterns (see quant_avx2.cpp's absmax); a NaN rescans with the
// scalar kernel, whose NaN is the one returned.
MOL_TGT512 inline __m512i abs_bits(const float* p, __mmask16 k) {
  return _mm512_maskz_and_epi32(k, _mm512_maskz_loadu_epi32(k, p), _mm512_set1_epi32(0x7FFFFFFF));
}

MOL_TGT512 float absmax(const float* x, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_max_epi32(a0, abs_bits(x + i, 0xFFFF));
    a1 = _mm512_max_epi32(a1, abs_bits(x + i + 16, 0xFFFF));
    a2 = _mm512_max_epi32(a2, abs_bits(x + i + 32, 0xFFFF));
    a3 = _mm512_max_epi32(a3, abs_bits(x + i + 48, 0xFFFF));
  }
  for (; i < n; i += 16) a0 = _mm512_max_epi32(a0, abs_bits(x + i, head(n - i)));
  const uint32_t m = static_cast<uint32_t>(
      _mm512_reduce_max_epi32(_mm512_max_epi32(_mm512_max_epi32(a0, a1), _mm512_max_epi32(a2, a3))));
  if (m > 0x7F800000u) return scalar::absmax(x, n);  // NaN
  float a;
  __builtin_memcpy(&a, &m, sizeof(a));
  return a;
}

}  // namespace

const Kernels* avx512_kernels() {
  static const Kernels* const k = []() -> const Kernels* {
    const Kernels* base = avx2_kernels();
    if (base == nullptr || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq")) {
      return nullptr;
    }
    static Kernels t = *base;
    t.name = "avx512";
    using E = vecdispatch::Entries<Vec>;
    t.int_fwd = E::int_fwd;
    t.int_fwd_min = E::int_fwd_min;
    t.e4m3_fwd = E::e4m3_fwd;
    t.absmax = absmax;
    return &t;
  }();
  return k;
}

}  // namespace mol

#else  // not x86 or not GCC/Clang

namespace mol {
const Kernels* avx512_kernels() { return nullptr; }
}  // namespace mol

#endif
