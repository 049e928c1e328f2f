// Checks mx_elem.h's division through a reciprocal (fdiv_rcp, the CUDA kernels' division of float16 / bfloat16
// elements by a block scale) against true division (fdiv), in two parts:
//   significands: every float16 significand x in [1, 2) (the bfloat16 ones among them) against divisor
//     significands d = 1 + k 2**-23, k = 0, s, 2s, ... (s = argv[1]; s = 1 is all 2**23): fdiv_rcp(x, d, frcp(d))
//     == fdiv(x, d) bit for bit. Both sides scale exactly by powers of two while every intermediate stays normal
//     (rcp_div_ok's range), so this is the whole claim for quotients >= 2**-12.
//   ranges: every finite bfloat16 and float16 value x (subnormals, zeros and both signs included) against divisors
//     2**e * m for every e in [-66, 18] and 8 significands m, wherever rcp_div_ok(d, r, |x|) holds: the quotient is
//     fdiv's bit for bit when |x / d| >= 2**-12, else smaller than 2**-11, zero together with fdiv's and of the
//     same sign; and the element formats give the same bits (e2m1(q) * d, e4m3(q) * d, e5m2(q) * d, integer codes
//     of 4 and 8 bits times d).
//   clamped ranges: fdiv_rcp_clamped (the elementwise and static-block kernels' division, no amax to bound x) over
//     every 16-bit value including +-Inf against divisors of every exponent in range: the same claims below 2**30,
//     saturating above.
// Prints "checked <n> mismatches <m>" last (and the first few mismatches); exit status 1 on any.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "../../modelopt_lite/csrc/mx_elem.h"

namespace {

uint64_t g_bad = 0, g_checked = 0;

void report(const char* what, float x, float d, float got, float want) {
  if (g_bad++ < 8) {
    std::printf("%s: x %08x d %08x got %08x want %08x\n", what, static_cast<unsigned>(mxe::fbits(x)),
                static_cast<unsigned>(mxe::fbits(d)), static_cast<unsigned>(mxe::fbits(got)),
                static_cast<unsigned>(mxe::fbits(want)));
  }
}

void same_bits(const char* what, float x, float d, float got, float want) {
  ++g_checked;
  if (mxe::fbits(got) != mxe::fbits(want)) report(what, x, d, got, want);
}

float bf16_value(uint32_t h) { return mxe::ffrom(h << 16); }

float f16_value(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {  // zero or subnormal: m * 2**-24, exact
    const float v = mxe::fmul(static_cast<float>(m), 5.9604644775390625e-8f);
    return mxe::ffrom(mxe::fbits(v) | sign);
  }
  if (e == 31) return mxe::ffrom(sign | 0x7F800000u | (m << 13));
  return mxe::ffrom(sign | ((e + 112u) << 23) | (m << 13));
}

float int_code(float q, float qmin, float qmax) { return mxe::fadd(mxe::rint_small(mxe::clampn(q, qmin, qmax)), 0.0f); }

// The element formats of the kernels that divide so, applied to quotient q of block scale d.
void same_formats(float x, float d, float got, float want) {
  same_bits("e2m1", x, d, mxe::fmul(mxe::e2m1(got), d), mxe::fmul(mxe::e2m1(want), d));
  same_bits("e4m3", x, d, mxe::fmul(mxe::e4m3(got), d), mxe::fmul(mxe::e4m3(want), d));
  same_bits("e5m2", x, d, mxe::fmul(mxe::e5m2(got), d), mxe::fmul(mxe::e5m2(want), d));
  same_bits("int4", x, d, mxe::fmul(int_code(got, -8.0f, 7.0f), d), mxe::fmul(int_code(want, -8.0f, 7.0f), d));
  same_bits("int8", x, d, mxe::fmul(int_code(got, -128.0f, 127.0f), d),
            mxe::fmul(int_code(want, -128.0f, 127.0f), d));
}

bool same_sign(float a, float b) { return (mxe::fbits(a) >> 31) == (mxe::fbits(b) >> 31); }

// The claims on a quotient: fdiv's bits where |fdiv| is in [2**-12, 2**30); below, smaller than 2**-11, zero together
// with fdiv's and of its sign; at or past 2**30 (the clamped form only), past 2**29 and of its sign.
void check_quotient(const char* what, float x, float d, float got, float want) {
  const float aw = mxe::fabs_bits(want), ag = mxe::fabs_bits(got);
  if (aw >= 2.44140625e-4f && aw < 1073741824.0f) return same_bits(what, x, d, got, want);
  ++g_checked;
  const bool ok = aw >= 1073741824.0f ? ag > 536870912.0f && same_sign(got, want)
                                      : ag < 4.8828125e-4f && (got == 0.0f) == (want == 0.0f) && same_sign(got, want);
  if (!ok) report(what, x, d, got, want);
}

void significands(uint32_t step) {
  for (uint32_t k = 0; k < (1u << 23); k += step) {
    const float d = mxe::ffrom(0x3F800000u | k), r = mxe::frcp(d);
    for (uint32_t m = 0; m < (1u << 10); ++m) {  // float16 significands; every 8th is a bfloat16 one
      const float x = mxe::ffrom(0x3F800000u | (m << 13));
      same_bits("significand", x, d, mxe::fdiv_rcp(x, d, r), mxe::fdiv(x, d));
    }
  }
}

void ranges() {
  const uint32_t mants[8] = {0u, 1u, 0x7FFFFFu, 0x400000u, 0x3C0000u, 0x123457u, 0x5A5A5Bu, 0x7FFF01u};
  for (int e = -66; e <= 18; ++e) {
    for (uint32_t m : mants) {
      const float d = mxe::ffrom(static_cast<uint32_t>(e + 127) << 23 | m), r = mxe::frcp(d);
      for (uint32_t h = 0; h < 0x20000u; ++h) {
        const float x = h < 0x10000u ? bf16_value(h) : f16_value(h - 0x10000u);
        if (mxe::nonfinite(x) || !mxe::rcp_div_ok(d, r, mxe::fabs_bits(x))) continue;
        const float got = mxe::fdiv_rcp(x, d, r), want = mxe::fdiv(x, d);
        check_quotient("quotient", x, d, got, want);
        same_formats(x, d, got, want);
      }
    }
  }
}

// fdiv_rcp_clamped: every 16-bit value, the infinities included, and no bound on the quotient (only
// rcp_div_range(d)): as fdiv_rcp below 2**30; at or past it a result past 2**29 of the quotient's sign (every
// format saturates it, the integers included).
void clamped_ranges() {
  const uint32_t mants[4] = {0u, 0x7FFFFFu, 0x3C0000u, 0x5A5A5Bu};
  for (int e = -66; e <= 18; ++e) {
    for (uint32_t m : mants) {
      const float d = mxe::ffrom(static_cast<uint32_t>(e + 127) << 23 | m), r = mxe::frcp(d);
      if (!mxe::rcp_div_range(d)) continue;
      for (uint32_t h = 0; h < 0x20000u; ++h) {
        const float x = h < 0x10000u ? bf16_value(h) : f16_value(h - 0x10000u);
        if (x != x) continue;
        const float got = mxe::fdiv_rcp_clamped(x, d, r), want = mxe::fdiv(x, d);
        check_quotient("clamped quotient", x, d, got, want);
        same_formats(x, d, got, want);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t step = argc > 1 ? static_cast<uint32_t>(std::strtoul(argv[1], nullptr, 10)) : 1;
  significands(step == 0 ? 1 : step);
  ranges();
  clamped_ranges();
  std::printf("checked %llu mismatches %llu\n", static_cast<unsigned long long>(g_checked),
              static_cast<unsigned long long>(g_bad));
  return g_bad == 0 ? 0 : 1;
}
