// Checks mx_elem.h's E4M3 / E5M2 / E2M1 rounding (float adds of a power of two, shared by the CPU scalar and the
// CUDA kernels) against an independent integer formulation over float32 bit patterns 0, s, 2s, ... (s = argv[1];
// s = 1 is all 2**32 inputs, about a minute). Prints "mismatches <n>" and the first few; exit status 1 on any.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "../../modelopt_lite/csrc/mx_elem.h"

namespace {

// Round to nearest even by integer carries: normals keep M mantissa bits (a carry rounds into the exponent), below
// 2**EMIN the grid step is 2**(EMIN - M) (rounded with an integer shift of the significand). NaN passes.
template <int M, int EMIN>
float carry_round(float c) {
  if (c != c) return c;
  const uint32_t b = mxe::fbits(c), sign = b & 0x80000000u, a = b ^ sign;
  uint32_t r;
  if (a < static_cast<uint32_t>(127 + EMIN) << 23) {  // subnormal grid: an integer number of steps
    const int e = static_cast<int>(a >> 23);
    const uint64_t sig = e == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
    const int shift = (e == 0 ? 1 : e) - 127 - 23 - (EMIN - M);  // value = sig * 2**(shift) steps
    uint64_t k;
    if (shift >= 0) {
      k = sig << shift;
    } else if (-shift >= 64) {
      k = 0;
    } else {
      const uint64_t q = sig >> -shift, rem = sig & ((uint64_t{1} << -shift) - 1), half = uint64_t{1} << (-shift - 1);
      k = q + ((rem > half || (rem == half && (q & 1u))) ? 1 : 0);
    }
    float v = static_cast<float>(k);  // k <= 2**(M + 1): exact
    for (int i = 0; i < M - EMIN; ++i) v *= 0.5f;
    r = mxe::fbits(v);
  } else {
    constexpr int kShift = 23 - M;
    r = (a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u)) & ~((1u << kShift) - 1u);
  }
  return mxe::ffrom(r | sign);
}

float ref_e4m3(float v) { return carry_round<3, -6>(mxe::clampn(v, -448.0f, 448.0f)); }
float ref_e5m2(float v) { return carry_round<2, -14>(mxe::clampn(v, -57344.0f, 57344.0f)); }
float ref_e2m1(float v) { return v == 0.0f ? 0.0f : carry_round<1, 0>(mxe::clampn(v, -6.0f, 6.0f)); }

}  // namespace

int main(int argc, char** argv) {
  const uint64_t step = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1;
  uint64_t bad = 0, n = 0;
  for (uint64_t i = 0; i <= 0xFFFFFFFFull; i += step) {
    const float v = mxe::ffrom(static_cast<uint32_t>(i));
    const float got[3] = {mxe::e4m3(v), mxe::e5m2(v), mxe::e2m1(v)};
    const float want[3] = {ref_e4m3(v), ref_e5m2(v), ref_e2m1(v)};
    for (int k = 0; k < 3; ++k) {
      ++n;
      if (mxe::fbits(got[k]) != mxe::fbits(want[k])) {
        if (bad++ < 5) std::printf("format %d input %08x got %08x want %08x\n", k, static_cast<unsigned>(i),
                                   static_cast<unsigned>(mxe::fbits(got[k])), static_cast<unsigned>(mxe::fbits(want[k])));
      }
    }
  }
  std::printf("checked %llu mismatches %llu\n", static_cast<unsigned long long>(n), static_cast<unsigned long long>(bad));
  return bad == 0 ? 0 : 1;
}
