// modelopt_lite CUDA kernels: element math, index mapping and kernel bodies (pure CUDA, no torch headers).
//
// Everything here is __host__ __device__ so that the exact same code can run on the CPU: the host test harness
// (tests/cuda_host/host_math.cu) and the host-emulated build (MODELOPT_LITE_EMULATE_ON_HOST) execute the kernel
// bodies element for element, which is how exactness is checked on machines without a GPU.
//
// Numerics (the contract of modelopt_lite/functional/reference.py), all in float32:
//   integer:  q = clamp(rint(x / s), qmin, qmax), y = q * s
//   E4M3:     y = e4m3(clamp(x / s, -448, 448)) * s   (round to nearest even, saturating)
//   affine:   q = clamp(rint(x / s) + zp, qmin, qmax), y = (q - zp) * s
//   s == 0 marks a dead slice: exact +0 (codes: 0, affine codes: zp).
// Every operation is an explicitly rounded IEEE operation (no FMA contraction, true division); clamps keep NaN
// (fminf/fmaxf would drop it); outputs are rounded to nearest even into fp16/bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#ifndef __CUDA_ARCH__
#include <cmath>
#endif

#define MLQ_HD __host__ __device__ __forceinline__
#ifdef __CUDACC__
#define MLQ_UNROLL _Pragma("unroll")
#else
#define MLQ_UNROLL
#endif

namespace mlq {

// ---------------------------------------------------------------------------------------------------------------
// Exactly rounded float32 arithmetic (the device intrinsics forbid FMA contraction; the host path is plain IEEE).
// ---------------------------------------------------------------------------------------------------------------
MLQ_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MLQ_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MLQ_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MLQ_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
// Round half to even (the default rounding mode on both sides).
MLQ_HD float rint_even(float v) {
#ifdef __CUDA_ARCH__
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}
MLQ_HD float bits_to_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
MLQ_HD uint32_t float_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// torch.clamp semantics: NaN stays NaN, every other value (including -0.0) passes unless outside [lo, hi].
MLQ_HD float clamp_keep_nan(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

constexpr float kE4M3Max = 448.0f;

// Saturating round-to-nearest-even into float8 e4m3fn and back to float32 (NaN stays NaN).
MLQ_HD float e4m3_round(float v) {
  const float c = clamp_keep_nan(v, -kE4M3Max, kE4M3Max);
  const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(c, __NV_SATFINITE, __NV_E4M3);
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3)));
}

// ---------------------------------------------------------------------------------------------------------------
// Element types: raw bit containers, conversions to and from float32 (round to nearest even).
// ---------------------------------------------------------------------------------------------------------------
template <class T>
struct Elem;
template <>
struct Elem<float> {
  using raw = uint32_t;
  static MLQ_HD float to_float(raw r) { return bits_to_float(r); }
  static MLQ_HD raw from_float(float f) { return float_to_bits(f); }
};
template <>
struct Elem<__half> {
  using raw = uint16_t;
  static MLQ_HD float to_float(raw r) { return __half2float(__ushort_as_half(r)); }
  static MLQ_HD raw from_float(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
template <>
struct Elem<__nv_bfloat16> {
  using raw = uint16_t;
  static MLQ_HD float to_float(raw r) { return bits_to_float(static_cast<uint32_t>(r) << 16); }
  static MLQ_HD raw from_float(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};

// 16 bytes of raw elements (one vector load or store).
template <class R>
union Pack16 {
  uint4 u;
  R r[16 / sizeof(R)];
};

MLQ_HD uint4 load16(const void* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint4*>(p);
#else
  uint4 u;
  std::memcpy(&u, p, sizeof u);
  return u;
#endif
}
MLQ_HD void store16(void* p, uint4 u) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<uint4*>(p) = u;
#else
  std::memcpy(p, &u, sizeof u);
#endif
}
MLQ_HD float load_param(const float* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Element math: the whole contract, one function per op.
// ---------------------------------------------------------------------------------------------------------------
enum class Fwd : int { IntFake = 0, IntCodes = 1, E4m3Fake = 2, AffineFake = 3, AffineCodes = 4 };
enum class Bwd : int { Int = 0, E4m3 = 1, Affine = 2 };

MLQ_HD float int_code(float x, float s, float qmin, float qmax) {
  return clamp_keep_nan(rint_even(div_rn(x, s)), qmin, qmax);
}
MLQ_HD float affine_code(float x, float s, float zp, float qmin, float qmax) {
  return clamp_keep_nan(add_rn(rint_even(div_rn(x, s)), zp), qmin, qmax);
}

template <Fwd M>
MLQ_HD float forward_elem(float x, float s, float zp, float qmin, float qmax) {
  if (M == Fwd::IntFake) return s == 0.0f ? 0.0f : mul_rn(int_code(x, s, qmin, qmax), s);
  if (M == Fwd::IntCodes) return s == 0.0f ? 0.0f : int_code(x, s, qmin, qmax);
  if (M == Fwd::E4m3Fake) return s == 0.0f ? 0.0f : mul_rn(e4m3_round(div_rn(x, s)), s);
  if (M == Fwd::AffineFake) return s == 0.0f ? 0.0f : mul_rn(sub_rn(affine_code(x, s, zp, qmin, qmax), zp), s);
  return s == 0.0f ? zp : affine_code(x, s, zp, qmin, qmax);  // Fwd::AffineCodes
}

// STE mask: lo <= x <= hi with the bounds computed from the raw scale (0 in a dead slice, as the reference does).
template <Bwd M>
MLQ_HD bool backward_pass(float x, float s, float zp, float qmin, float qmax) {
  float lo, hi;
  if (M == Bwd::Int) {
    lo = mul_rn(qmin, s);
    hi = mul_rn(qmax, s);
  } else if (M == Bwd::E4m3) {
    lo = mul_rn(-kE4M3Max, s);
    hi = mul_rn(kE4M3Max, s);
  } else {
    lo = mul_rn(sub_rn(qmin, zp), s);
    hi = mul_rn(sub_rn(qmax, zp), s);
  }
  return x >= lo && x <= hi;
}

// Per-element gradient of y with respect to the scale, times the incoming gradient (0 in a dead slice).
template <Bwd M>
MLQ_HD float backward_scale_term(float x, float g, float s, float qmin, float qmax) {
  if (s == 0.0f) return 0.0f;
  const float v = div_rn(x, s);
  float t;
  if (M == Bwd::Int) {
    const float q = clamp_keep_nan(rint_even(v), qmin, qmax);
    t = v < qmin ? qmin : (v > qmax ? qmax : sub_rn(q, v));
  } else {
    t = v < -kE4M3Max ? -kE4M3Max : (v > kE4M3Max ? kE4M3Max : sub_rn(e4m3_round(v), v));
  }
  return mul_rn(t, g);
}

// Histogram bin on a power-of-two grid: floor(v * 2**-e) (exact: a power-of-two scaling in float64), or -1 (not
// counted) for NaN, negative values and values at or above num_bins * 2**e. inv_width = 2**-e.
MLQ_HD int64_t grid_bin(double v, double inv_width, int64_t num_bins) {
  if (!(v >= 0.0)) return -1;
  const double t = v * inv_width;
  return t < static_cast<double>(num_bins) ? static_cast<int64_t>(t) : -1;
}

// Values a histogram reads: the three element types plus float64.
template <class T>
struct HistElem {
  using raw = typename Elem<T>::raw;
  static MLQ_HD double value(raw r) { return static_cast<double>(Elem<T>::to_float(r)); }
};
template <>
struct HistElem<double> {
  using raw = double;
  static MLQ_HD double value(raw r) { return r; }
};

MLQ_HD double pow2_neg(int64_t e) {  // 2**-e, exact (0 or inf beyond the float64 range)
  const int k = static_cast<int>(e < -2000 ? 2000 : (e > 2000 ? -2000 : -e));
#ifdef __CUDA_ARCH__
  return ldexp(1.0, k);
#else
  return std::ldexp(1.0, k);
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// 64-bit division by an invariant divisor (Granlund-Montgomery, valid for every 64-bit numerator).
// ---------------------------------------------------------------------------------------------------------------
MLQ_HD uint64_t umulhi64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

struct FastDivmod {
  uint64_t d = 1, m = 1;
  uint32_t sh1 = 0, sh2 = 0;
  FastDivmod() = default;
  __host__ explicit FastDivmod(uint64_t divisor) : d(divisor) {
    uint32_t l = 0;
    while (l < 64 && (uint64_t{1} << l) < d) ++l;  // l = ceil(log2(d))
    const unsigned __int128 two_l = static_cast<unsigned __int128>(1) << l;
    m = static_cast<uint64_t>(((two_l - d) << 64) / d) + 1;
    sh1 = l < 1 ? l : 1;
    sh2 = l > 0 ? l - 1 : 0;
  }
  MLQ_HD uint64_t div(uint64_t n) const {
    const uint64_t t = umulhi64(m, n);
    return (t + ((n - t) >> sh1)) >> sh2;
  }
  MLQ_HD void divmod(uint64_t n, uint64_t& q, uint64_t& r) const {
    q = div(n);
    r = n - q * d;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Where the scale of element i lives. Three layouts (chosen on the host by make_plan):
//   PerTensor: one scale.   Channel: scale[(i / inner) % C].   General: any broadcast, up to kMaxDims merged dims.
// A cursor is positioned once per vector (a few fast divisions) and then stepped element by element.
// ---------------------------------------------------------------------------------------------------------------
constexpr int kMaxDims = 8;
constexpr int kMaxRank = 64;

struct PerTensorIdx {
  static constexpr bool kPerTensor = true;
  struct Cursor {
    MLQ_HD int64_t offset() const { return 0; }
    MLQ_HD int64_t run() const { return INT64_MAX; }  // elements left that share this offset
    MLQ_HD void next(const PerTensorIdx&) {}
  };
  MLQ_HD Cursor at(int64_t) const { return Cursor{}; }
};

struct ChannelIdx {
  static constexpr bool kPerTensor = false;
  int64_t C = 1, inner = 1;
  FastDivmod div_inner, div_c;
  struct Cursor {
    int64_t c, r, inner;
    MLQ_HD int64_t offset() const { return c; }
    MLQ_HD int64_t run() const { return inner - r; }
    MLQ_HD void next(const ChannelIdx& idx) {
      if (++r == idx.inner) {
        r = 0;
        if (++c == idx.C) c = 0;
      }
    }
  };
  MLQ_HD Cursor at(int64_t i) const {
    uint64_t q, r, q2, c;
    div_inner.divmod(static_cast<uint64_t>(i), q, r);
    div_c.divmod(q, q2, c);
    return Cursor{static_cast<int64_t>(c), static_cast<int64_t>(r), inner};
  }
};

// Dims are stored right-aligned (the innermost merged dim at kMaxDims - 1); unused leading dims have size 1 and
// stride 0. Loops are fully unrolled so that coordinates stay in registers.
struct GeneralIdx {
  static constexpr bool kPerTensor = false;
  int first = kMaxDims - 1;  // index of the outermost used dim
  int64_t size[kMaxDims];
  int64_t stride[kMaxDims];
  int64_t span[kMaxDims];  // size * stride
  FastDivmod div[kMaxDims];
  struct Cursor {
    int64_t coord[kMaxDims];
    int64_t off;
    int64_t inner_left;  // elements left in the innermost run (same offset when the innermost stride is 0)
    MLQ_HD int64_t offset() const { return off; }
    MLQ_HD int64_t run() const { return inner_left; }
    MLQ_HD void next(const GeneralIdx& g) {
      bool carry = true;
MLQ_UNROLL
      for (int k = kMaxDims - 1; k >= 0; --k) {
        if (carry) {
          ++coord[k];
          off += g.stride[k];
          if (coord[k] == g.size[k] && k > g.first) {
            off -= g.span[k];
            coord[k] = 0;
          } else {
            carry = false;
          }
        }
      }
      inner_left = g.stride[kMaxDims - 1] == 0 ? g.size[kMaxDims - 1] - coord[kMaxDims - 1] : 1;
    }
  };
  MLQ_HD Cursor at(int64_t i) const {
    Cursor cur;
    cur.off = 0;
    uint64_t rest = static_cast<uint64_t>(i);
MLQ_UNROLL
    for (int k = kMaxDims - 1; k >= 0; --k) {
      if (k > first) {
        uint64_t q, r;
        div[k].divmod(rest, q, r);
        cur.coord[k] = static_cast<int64_t>(r);
        rest = q;
      } else if (k == first) {
        cur.coord[k] = static_cast<int64_t>(rest);
      } else {
        cur.coord[k] = 0;
      }
      cur.off += cur.coord[k] * stride[k];
    }
    cur.inner_left = stride[kMaxDims - 1] == 0 ? size[kMaxDims - 1] - cur.coord[kMaxDims - 1] : 1;
    return cur;
  }
};

// Scale (and zero point) of VEC consecutive elements starting at i0: one load when they share a slice.
template <bool kZp, int VEC, class Idx>
MLQ_HD void load_params(const Idx& idx, const float* scale, const float* zp, int64_t i0, float (&s)[VEC],
                        float (&z)[VEC]) {
  auto cur = idx.at(i0);
  if (cur.run() >= VEC) {
    const int64_t o = cur.offset();
    const float s0 = load_param(scale + o), z0 = kZp ? load_param(zp + o) : 0.0f;
MLQ_UNROLL
    for (int j = 0; j < VEC; ++j) s[j] = s0, z[j] = z0;
    return;
  }
MLQ_UNROLL
  for (int j = 0; j < VEC; ++j) {
    const int64_t o = cur.offset();
    s[j] = load_param(scale + o);
    z[j] = kZp ? load_param(zp + o) : 0.0f;
    if (j + 1 < VEC) cur.next(idx);
  }
}

enum class Layout : int { PerTensor = 0, Channel = 1, General = 2 };

struct Plan {
  Layout kind = Layout::PerTensor;
  int ndim = 0;                 // merged dims, outermost first
  int64_t size[kMaxRank] = {};  // merged sizes
  int64_t stride[kMaxRank] = {};
  int64_t C = 1, inner = 1;  // Channel layout
};

// Collapse (x sizes, scale strides with 0 on broadcast dims) into the cheapest layout. x is contiguous.
// Returns false when the broadcast pattern needs more than kMaxDims merged dims (the caller then expands the scale).
__host__ inline bool make_plan(int ndim, const int64_t* sizes, const int64_t* scale_strides, Plan* p) {
  *p = Plan{};
  if (ndim < 0 || ndim > kMaxRank) return false;
  int m = 0;  // merged dims, built innermost first, then reversed
  int64_t ms[kMaxRank], mt[kMaxRank];
  for (int d = ndim - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    const int64_t st = scale_strides[d];
    if (m > 0 && st == mt[m - 1] * ms[m - 1]) {
      ms[m - 1] *= sizes[d];
    } else {
      ms[m] = sizes[d];
      mt[m] = st;
      ++m;
    }
  }
  p->ndim = m;
  for (int k = 0; k < m; ++k) {
    p->size[k] = ms[m - 1 - k];
    p->stride[k] = mt[m - 1 - k];
  }
  int varying = 0, where = -1;
  for (int k = 0; k < m; ++k)
    if (p->stride[k] != 0) ++varying, where = k;
  if (varying == 0) {
    p->kind = Layout::PerTensor;
    return true;
  }
  if (varying == 1 && p->stride[where] == 1) {
    p->kind = Layout::Channel;
    p->C = p->size[where];
    p->inner = 1;
    for (int k = where + 1; k < m; ++k) p->inner *= p->size[k];
    return true;
  }
  p->kind = Layout::General;
  return m <= kMaxDims;
}

__host__ inline ChannelIdx channel_idx(const Plan& p) {
  ChannelIdx c;
  c.C = p.C;
  c.inner = p.inner;
  c.div_inner = FastDivmod(static_cast<uint64_t>(p.inner));
  c.div_c = FastDivmod(static_cast<uint64_t>(p.C));
  return c;
}

__host__ inline GeneralIdx general_idx(const Plan& p) {
  GeneralIdx g;
  g.first = kMaxDims - p.ndim;
  for (int k = 0; k < kMaxDims; ++k) {
    const int src = k - g.first;
    g.size[k] = src >= 0 ? p.size[src] : 1;
    g.stride[k] = src >= 0 ? p.stride[src] : 0;
    g.span[k] = g.size[k] * g.stride[k];
    g.div[k] = FastDivmod(static_cast<uint64_t>(g.size[k]));
  }
  return g;
}

// ---------------------------------------------------------------------------------------------------------------
// Kernel bodies: load / compute_store one 16-byte vector, or one scalar element (tail and unaligned data).
// ---------------------------------------------------------------------------------------------------------------
template <class R, int VEC>
MLQ_HD void store_floats(float* dst, const float (&v)[VEC]) {
MLQ_UNROLL
  for (int k = 0; k < VEC / 4; ++k) {
    union {
      uint4 u;
      float f[4];
    } pk;
MLQ_UNROLL
    for (int j = 0; j < 4; ++j) pk.f[j] = v[4 * k + j];
    store16(dst + 4 * k, pk.u);
  }
}

template <class T, Fwd M, class Idx>
struct FwdBody {
  using E = Elem<T>;
  using R = typename E::raw;
  static constexpr int VEC = 16 / sizeof(R);
  static constexpr bool kCodes = M == Fwd::IntCodes || M == Fwd::AffineCodes;
  static constexpr bool kZp = M == Fwd::AffineFake || M == Fwd::AffineCodes;
  using In = Pack16<R>;

  const R* x;
  void* y;  // R[] for fake quant, float[] for codes
  const float* scale;
  const float* zp;
  float qmin, qmax;
  Idx idx;

  MLQ_HD In load(int64_t v) const {
    In in;
    in.u = load16(x + v * VEC);
    return in;
  }
  MLQ_HD void compute_store(int64_t v, const In& in) const {
    float s[VEC], z[VEC], out[VEC];
    load_params<kZp, VEC>(idx, scale, zp, v * VEC, s, z);
MLQ_UNROLL
    for (int j = 0; j < VEC; ++j) out[j] = forward_elem<M>(E::to_float(in.r[j]), s[j], z[j], qmin, qmax);
    if (kCodes) {
      store_floats<R, VEC>(static_cast<float*>(y) + v * VEC, out);
    } else {
      Pack16<R> o;
MLQ_UNROLL
      for (int j = 0; j < VEC; ++j) o.r[j] = E::from_float(out[j]);
      store16(static_cast<R*>(y) + v * VEC, o.u);
    }
  }
  MLQ_HD void scalar(int64_t i) const {
    const int64_t o = idx.at(i).offset();
    const float s = load_param(scale + o);
    const float z = kZp ? load_param(zp + o) : 0.0f;
    const float out = forward_elem<M>(E::to_float(x[i]), s, z, qmin, qmax);
    if (kCodes)
      static_cast<float*>(y)[i] = out;
    else
      static_cast<R*>(y)[i] = E::from_float(out);
  }
};

template <class T, Bwd M, class Idx>
struct BwdBody {
  using E = Elem<T>;
  using R = typename E::raw;
  static constexpr int VEC = 16 / sizeof(R);
  static constexpr bool kZp = M == Bwd::Affine;
  struct In {
    Pack16<R> g, x;
  };

  const R* grad;
  const R* x;
  R* grad_x;
  float* term;  // per-element scale gradient (nullptr: not requested; never for affine)
  const float* scale;
  const float* zp;
  float qmin, qmax;
  Idx idx;

  MLQ_HD In load(int64_t v) const {
    In in;
    in.g.u = load16(grad + v * VEC);
    in.x.u = load16(x + v * VEC);
    return in;
  }
  MLQ_HD void compute_store(int64_t v, const In& in) const {
    float s[VEC], z[VEC];
    load_params<kZp, VEC>(idx, scale, zp, v * VEC, s, z);
    Pack16<R> o;
    float t[VEC];
MLQ_UNROLL
    for (int j = 0; j < VEC; ++j) {
      const float xf = E::to_float(in.x.r[j]);
      o.r[j] = backward_pass<M>(xf, s[j], z[j], qmin, qmax) ? in.g.r[j] : R(0);
      if (!kZp) t[j] = backward_scale_term<M>(xf, E::to_float(in.g.r[j]), s[j], qmin, qmax);
    }
    store16(grad_x + v * VEC, o.u);
    if (!kZp && term != nullptr) store_floats<R, VEC>(term + v * VEC, t);
  }
  MLQ_HD void scalar(int64_t i) const {
    const int64_t o = idx.at(i).offset();
    const float s = load_param(scale + o);
    const float z = kZp ? load_param(zp + o) : 0.0f;
    const float xf = E::to_float(x[i]);
    grad_x[i] = backward_pass<M>(xf, s, z, qmin, qmax) ? grad[i] : R(0);
    if (!kZp && term != nullptr) term[i] = backward_scale_term<M>(xf, E::to_float(grad[i]), s, qmin, qmax);
  }
};

// Run a body over n elements on the host, exactly as the kernel partitions the work (nvec vectors, then a tail).
template <class Body>
__host__ void run_on_host(const Body& body, int64_t nvec, int64_t n) {
  for (int64_t v = 0; v < nvec; ++v) body.compute_store(v, body.load(v));
  for (int64_t i = nvec * Body::VEC; i < n; ++i) body.scalar(i);
}

}  // namespace mlq
