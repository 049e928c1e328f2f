// Portable scalar kernels: one element at a time, straight from the formulas in quant_elem.h.
// They are the fallback on CPUs without AVX2 and the tail handling of the AVX2 kernels.
#include "quant_elem.h"
#include "quant_kernels.h"

namespace mol {
namespace scalar {

static constexpr float kE4M3Max = 448.0f;

void int_fwd(const float* x, const float* s, int sinc, float qmin, float qmax, float* out, int64_t n, bool codes) {
  for (int64_t i = 0; i < n; ++i) {
    const float sv = s[i * sinc];
    if (sv == 0.0f) {
      out[i] = 0.0f;
      continue;
    }
    const float q = int_code_elem(x[i] / sv, qmin, qmax);
    out[i] = codes ? q : q * sv;
  }
}

// min(m, v) that keeps the first NaN it meets (a NaN m stays; a NaN v replaces m).
float fold_min(float m, float v) { return (m != m) ? m : ((v < m || v != v) ? v : m); }

void int_fwd_min(const float* x, const float* s, int sinc, float qmin, float qmax, float* out, int64_t n, bool codes,
                 float* xmin) {
  float m = *xmin;
  for (int64_t i = 0; i < n; ++i) {
    const float xv = x[i];
    m = fold_min(m, xv);
    const float sv = s[i * sinc];
    if (sv == 0.0f) {
      out[i] = 0.0f;
      continue;
    }
    const float q = int_code_elem(xv / sv, qmin, qmax);
    out[i] = codes ? q : q * sv;
  }
  *xmin = m;
}

void e4m3_fwd(const float* x, const float* s, int sinc, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float sv = s[i * sinc];
    out[i] = (sv == 0.0f) ? 0.0f : e4m3_elem(clamp_elem(x[i] / sv, -kE4M3Max, kE4M3Max)) * sv;
  }
}

void affine_fwd(const float* x, const float* s, int sinc, const float* zp, int zinc, float qmin, float qmax,
                float* out, int64_t n, bool codes) {
  for (int64_t i = 0; i < n; ++i) {
    const float sv = s[i * sinc];
    const float z = zp[i * zinc];
    if (sv == 0.0f) {
      out[i] = codes ? z : 0.0f;
      continue;
    }
    const float q = clamp_elem(rint_elem(x[i] / sv) + z, qmin, qmax);
    out[i] = codes ? q : (q - z) * sv;
  }
}

void int_bwd(const float* g, const float* x, const float* s, int sinc, float qmin, float qmax, float* gx, float* gs,
             int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float sv = s[i * sinc];
    const float xv = x[i];
    const float gv = g[i];
    gx[i] = (xv >= qmin * sv && xv <= qmax * sv) ? gv : 0.0f;
    if (gs == nullptr) continue;
    if (sv == 0.0f) {
      gs[i] = 0.0f;
      continue;
    }
    const float v = xv / sv;
    const float q = clamp_elem(rint_elem(v), qmin, qmax);
    const float term = (v < qmin) ? qmin : ((v > qmax) ? qmax : q - v);
    gs[i] = term * gv;
  }
}

void e4m3_bwd(const float* g, const float* x, const float* s, int sinc, float* gx, float* gs, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float sv = s[i * sinc];
    const float xv = x[i];
    const float gv = g[i];
    gx[i] = (xv >= -kE4M3Max * sv && xv <= kE4M3Max * sv) ? gv : 0.0f;
    if (gs == nullptr) continue;
    if (sv == 0.0f) {
      gs[i] = 0.0f;
      continue;
    }
    const float v = xv / sv;
    const float term = (v < -kE4M3Max) ? -kE4M3Max
                       : (v > kE4M3Max) ? kE4M3Max
                                        : e4m3_elem(clamp_elem(v, -kE4M3Max, kE4M3Max)) - v;
    gs[i] = term * gv;
  }
}

void affine_bwd(const float* g, const float* x, const float* s, int sinc, const float* zp, int zinc, float qmin,
                float qmax, float* gx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float sv = s[i * sinc];
    const float z = zp[i * zinc];
    const float xv = x[i];
    gx[i] = (xv >= (qmin - z) * sv && xv <= (qmax - z) * sv) ? g[i] : 0.0f;
  }
}

float absmax(const float* x, int64_t n) {
  float a = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float m = std::fabs(x[i]);
    if (m > a || m != m) a = m;
    if (a != a) return a;
  }
  return a;
}

void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32_elem(src[i]);
}

void f32_to_f16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16_elem(src[i]);
}

void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32_elem(src[i]);
}

void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16_elem(src[i]);
}

}  // namespace scalar

const Kernels& scalar_kernels() {
  static const Kernels k{"scalar",          scalar::int_fwd,    scalar::int_fwd_min, scalar::e4m3_fwd,   scalar::affine_fwd,
                         scalar::int_bwd,   scalar::e4m3_bwd,   scalar::affine_bwd, scalar::absmax,     scalar::f16_to_f32,
                         scalar::f32_to_f16, scalar::bf16_to_f32, scalar::f32_to_bf16};
  return k;
}

}  // namespace mol
