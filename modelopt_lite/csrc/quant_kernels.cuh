// modelopt_lite CUDA kernels, part 3 of 3: kernel bodies (pure CUDA, no torch headers).
//
// A body loads / computes / stores one 16-byte vector, or one scalar element (tails and unaligned data). The
// kernels (quant_kernels.cu) run bodies in grid-stride loops; the host test harness (tests/cuda_host) and the
// host-emulated build (MODELOPT_LITE_EMULATE_ON_HOST) run the same bodies with run_on_host, element for element.
// The math is in quant_math.cuh, the scale indexing in quant_index.cuh.
#pragma once

#include "quant_index.cuh"

namespace mlq {

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

// *flag |= 1 (atomically on the device; flags are only ever set, so the writers' order does not matter).
MLQ_HD void flag_one(int* flag) {
#ifdef __CUDA_ARCH__
  atomicOr(flag, 1);
#else
  *flag |= 1;
#endif
}

// `negative` (may be null): bit 1 set when an element of x is negative or NaN, the unsigned-input check done in the
// forward's own pass (one uniform test per vector when null).
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
  int* negative;

  MLQ_HD In load(int64_t v) const {
    In in;
    in.u = load16(x + v * VEC);
    return in;
  }
  MLQ_HD void compute_store(int64_t v, const In& in) const {
    float s[VEC], z[VEC], out[VEC];
    load_params<kZp, VEC>(idx, scale, zp, v * VEC, s, z);
    if (negative != nullptr) {
      bool bad = false;
MLQ_UNROLL
      for (int j = 0; j < VEC; ++j) bad |= !(E::to_float(in.r[j]) >= 0.0f);
      if (bad) flag_one(negative);
    }
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
    if (negative != nullptr && !(E::to_float(x[i]) >= 0.0f)) flag_one(negative);
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
