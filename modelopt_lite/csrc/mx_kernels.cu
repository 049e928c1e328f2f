// modelopt_lite CUDA kernels of the 4-bit and microscaling formats (pure CUDA, no torch headers): NVFP4 and OCP MX
// blocked fake quant and their straight-through backward, E5M2 / E2M1 elementwise. The element math is mx_elem.h,
// the very code the CPU kernels run, so both backends share one definition of every rounding.
//
// Work distribution (mx_lanes.cuh): consecutive threads read consecutive 16-byte vectors; the 2-8 lanes of one
// 16- or 32-element block reduce its amax with warp shuffles, then each lane quantizes and stores its own vector.
// The elementwise ops use the same driver with one lane per vector and no reduction.
//
// Built with -DMODELOPT_LITE_EMULATE_ON_HOST (host compiler, no GPU), the launchers run the same two phases on the
// host, warp by warp with the lanes in order (mx_lanes.cuh): the CPU tests check the GPU's work distribution that way.
#include "mx_kernels_api.h"
#include "mx_lanes.cuh"

namespace mxk {

// The straight-through gradient of one lane (its gradient elements were read with x, GradLane): g where
// |x| <= top, else g * 0 (as the reference's grad * keep: -0.0 for a negative g, NaN stays NaN).
template <class T, int P, bool FULL>
MXK_HD void ste_lane(T* out, const Layout& L, GradLane<T, P, FULL>& st, float top) {
MXK_UNROLL
  for (int j = 0; j < P * VecOf<T>::N; ++j) {
    st.v.set(j, mxe::fabs_bits(st.v.get(j)) <= top ? st.g.get(j) : mxe::fmul(st.g.get(j), 0.0f));
  }
  store_lane(out, L, st);
}

// NVFP4: per block s = e4m3(amax / (6 gs)), y = e2m1(x / (s gs)) * (s gs) (BWD: the STE mask |x| <= 6 s gs).
// P vectors per lane: 1, a whole 16-element block of a 2-byte type (MLQ_MX_NVFP4_ONE_LANE), or 2 of float32
// (MLQ_MX_FP32_TWO_VECTORS).
template <class T, int P, bool BWD, bool FULL>
struct Nvfp4Op {
  using State = OpLane<T, P, BWD, FULL>;
  static constexpr bool kPrefetch16 = !BWD && sizeof(T) == 2;  // MLQ_MX_PREFETCH_16BIT takes this kernel
  const T* x;
  const T* grad;  // BWD only
  T* y;
  float* scales;
  const float* gsp;  // the global scale, one float32 in device memory (from_amax: the global amax instead)
  int* flag;
  Layout L;
  bool from_amax;  // gsp holds the per-tensor amax: gs = nvfp4_global_scale(amax), computed here (no launches)
  bool rcp_div;    // 16-bit forward: divide through the block scale's reciprocal where exact (not MLQ_MX_TRUE_DIVISION)
  static constexpr bool kRcp = !BWD && sizeof(T) == 2;  // fdiv_rcp is proven for 16-bit elements only
  static constexpr int kMinBlocks = kRcp && P == 2 && FULL ? 5 : 0;  // one lane per block: 48 registers, not 53

  MXK_HD int64_t slots() const { return L.rows * L.nbr * L.lanes; }
  MXK_HD int lanes() const { return L.lanes; }
  MXK_HD float load(int64_t slot, State& st) const { return load_op_lane<T, P, BWD, FULL>(x, grad, L, slot, st); }
  MXK_HD void prefetch(int64_t slot) const { prefetch_op_lane<T, P, BWD, FULL>(x, grad, L, slot); }

  MXK_HD void finish(int64_t slot, State& st, float a) const {
    constexpr int N = VecOf<T>::N;
    const float g = load_scalar(gsp);
    const float gs = from_amax ? mxe::nvfp4_global_scale(g) : g;
    const float s = gs == 0.0f ? 0.0f : mxe::nvfp4_block_scale(a, gs);
    if (st.w.lane == 0) {
      if (scales != nullptr && !BWD) scales[st.w.b] = s;
      if (mxe::nonfinite(a)) flag_set(flag, 1);
    }
    if (slot == 0 && !(from_amax ? mxe::nvfp4_amax_ok(g) : gs >= 0.0f && !mxe::nonfinite(gs))) flag_set(flag, 2);
    const float d = mxe::fmul(s, gs);
    if constexpr (BWD) {
      ste_lane(y, L, st, mxe::fmul(d, mxe::kE2M1Max));
    } else {
      const float r = kRcp && rcp_div ? mxe::frcp(d) : 0.0f;
      if (s == 0.0f) {  // one test per vector (a uniform branch), not one select per element
MXK_UNROLL
        for (int j = 0; j < P * N; ++j) st.v.set(j, 0.0f);
      } else if (kRcp && rcp_div && mxe::rcp_div_ok(d, r, a)) {  // |x| <= a: the block amax (NaN, Inf: not here)
MXK_UNROLL
        for (int j = 0; j < P * N; ++j) st.v.set(j, mxe::fmul(mxe::e2m1(mxe::fdiv_rcp(st.v.get(j), d, r)), d));
      } else {
MXK_UNROLL
        for (int j = 0; j < P * N; ++j) st.v.set(j, mxe::fmul(mxe::e2m1(mxe::fdiv(st.v.get(j), d)), d));
      }
      store_lane(y, L, st);
    }
  }
};

MXK_HD float elem_max(int elem) {
  return elem == mxe::kE4M3 ? mxe::kE4M3Max
         : elem == mxe::kE5M2 ? mxe::kE5M2Max
         : elem == mxe::kE2M1 ? mxe::kE2M1Max
                              : mxe::kInt8Max;
}

// OCP MX: per block X = 2**k (k from the amax), y = elem(x / X) * X (BWD: the STE mask |x| <= elem_max * X).
// P vectors per lane: 1, or 2 (MLQ_MX_FP32_TWO_VECTORS: half the lanes per block).
template <class T, int P, int ELEM, bool BWD, bool FULL>
struct MxOp {
  using State = OpLane<T, P, BWD, FULL>;
  static constexpr bool kPrefetch16 = false;
  const T* x;
  const T* grad;
  T* y;
  float* exps;
  int* flag;
  Layout L;
  bool rceil;

  MXK_HD int64_t slots() const { return L.rows * L.nbr * L.lanes; }
  MXK_HD int lanes() const { return L.lanes; }
  MXK_HD float load(int64_t slot, State& st) const { return load_op_lane<T, P, BWD, FULL>(x, grad, L, slot, st); }
  MXK_HD void prefetch(int64_t slot) const { prefetch_op_lane<T, P, BWD, FULL>(x, grad, L, slot); }

  MXK_HD void finish(int64_t, State& st, float a) const {
    constexpr int N = VecOf<T>::N;
    const bool nan = a != a;  // as the CPU kernels: a NaN block is all NaN, an Inf amax gets k = 127
    const int k = nan ? 127 : mxe::mx_exponent(a, ELEM, rceil);
    if (st.w.lane == 0) {
      if (exps != nullptr && !BWD) exps[st.w.b] = nan ? a : static_cast<float>(k);
      if (mxe::nonfinite(a)) flag_set(flag, 1);
    }
    const float X = mxe::pow2f(k), inv = mxe::pow2f(-k);
    if constexpr (BWD) {
      ste_lane(y, L, st, mxe::fmul(X, elem_max(ELEM)));
    } else {
      if (nan) {
MXK_UNROLL
        for (int j = 0; j < P * N; ++j) st.v.set(j, a);
      } else {
MXK_UNROLL
        for (int j = 0; j < P * N; ++j) {
          st.v.set(j, mxe::fmul(mxe::elem_round<ELEM>(mxe::fmul(st.v.get(j), inv)), X));
        }
      }
      store_lane(y, L, st);
    }
  }
};

// Elementwise E4M3 / E5M2 / E2M1: y = elem(x / s) * s with s = scale[(i / inner) % channels]; one 16-byte vector
// per lane, no reduction (lanes() == 1).
template <class T, int ELEM, bool FULL>
struct MinifloatOp {
  using State = Lane<T, 1, FULL>;
  static constexpr bool kPrefetch16 = false;
  const T* x;
  T* y;
  const float* scale;
  int64_t channels, inner;
  Layout L;      // one row of n elements, "blocks" of one vector
  bool rcp_div;  // 16-bit: divide through the scale's reciprocal where exact (not MLQ_MX_TRUE_DIVISION)
  static constexpr bool kRcp = sizeof(T) == 2;  // fdiv_rcp_clamped is proven for 16-bit elements only
  static constexpr int kMinBlocks = FULL && kRcp ? 8 : 0;  // 16-bit: 32 registers, not 36 (float32 would spill)

  MXK_HD int64_t slots() const { return L.nbr; }
  MXK_HD int lanes() const { return 1; }
  MXK_HD float load(int64_t slot, State& st) const {
    load_lane(x, L, slot, st);
    return 0.0f;
  }
  MXK_HD void prefetch(int64_t slot) const { prefetch_lane<T, 1, FULL>(x, L, slot); }
  static MXK_HD float fake_nonzero(float v, float s) { return mxe::fmul(mxe::elem_round<ELEM>(mxe::fdiv(v, s)), s); }
  static MXK_HD float fake(float v, float s) { return s == 0.0f ? 0.0f : fake_nonzero(v, s); }
  // The elements of one vector (it starts at a multiple of N) share one scale when there is one channel or `inner`
  // is a multiple of N: one scale load, one zero test and no 64-bit division per vector, as per-tensor scaling
  // always has.
  MXK_HD void finish(int64_t, State& st, float) const {
    constexpr int N = VecOf<T>::N;
    if (channels == 1 || inner % N == 0) {
      const float s = load_scalar(scale + (channels == 1 ? 0 : (st.w.off / inner) % channels));
      const float r = kRcp && rcp_div ? mxe::frcp(s) : 0.0f;
      if (s == 0.0f) {
MXK_UNROLL
        for (int j = 0; j < N; ++j) st.v.set(j, 0.0f);
      } else if (kRcp && rcp_div && mxe::rcp_div_range(s)) {  // no amax bounds x here: the clamped division
MXK_UNROLL
        for (int j = 0; j < N; ++j) {
          st.v.set(j, mxe::fmul(mxe::elem_round<ELEM>(mxe::fdiv_rcp_clamped(st.v.get(j), s, r)), s));
        }
      } else {
MXK_UNROLL
        for (int j = 0; j < N; ++j) st.v.set(j, fake_nonzero(st.v.get(j), s));
      }
    } else {
MXK_UNROLL
      for (int j = 0; j < N; ++j) {
        st.v.set(j, fake(st.v.get(j), load_scalar(scale + ((st.w.off + j) / inner) % channels)));
      }
    }
    store_lane(y, L, st);
  }
};

// Dispatch -----------------------------------------------------------------------------------------------------------
struct Call {
  const void* x;
  const void* grad;
  void* y;
  float* side;  // block scales / exponents (forward), may be null
  const float* gs;
  int* flag;
  int64_t rows, cols;
  int block;
  bool rceil;
  cudaStream_t stream;
  bool gs_is_amax = false;  // NVFP4: gs points at the per-tensor amax (the kernel computes the global scale)
};

template <class T>
Layout call_layout(const Call& c) {
  return make_layout<T>(c.rows, c.cols, c.block, aligned16(c.x) && aligned16(c.y) && aligned16(c.grad));
}

// Each op is built twice: FULL for `full` layouts (whole aligned vectors, whole blocks: the common case, no length
// checks in the lanes), and the general one for partial blocks, misaligned or odd-length views. The FULL forward
// kernels have variants (mx_kernels_api.h): NVFP4's 16-element blocks of 2-byte elements take one lane per block
// with MLQ_MX_NVFP4_ONE_LANE (the block's scale computed once, not by each of its 2 lanes), and the float32 NVFP4 / MX
// kernels 2 vectors per lane with MLQ_MX_FP32_TWO_VECTORS (half the lanes per block, one shuffle step fewer), the
// float16/bfloat16 MX kernels so with MLQ_MX_16BIT_TWO_VECTORS.
template <class T, bool BWD, bool FULL, int P = 1>
cudaError_t nvfp4_run(const Call& c, const Layout& L) {
  Nvfp4Op<T, P, BWD, FULL> op{static_cast<const T*>(c.x), static_cast<const T*>(c.grad), static_cast<T*>(c.y),
                              c.side, c.gs, c.flag, L, c.gs_is_amax, reciprocal_division()};
  return run_lanes<2>(op, c.stream);
}

template <class T, bool BWD>
cudaError_t nvfp4_typed(const Call& c) {
  const Layout L = call_layout<T>(c);
  if (!L.full) return nvfp4_run<T, BWD, false>(c, L);
  if constexpr (!BWD && sizeof(T) == 2) {
    if (c.block == 16 && (variant() & MLQ_MX_NVFP4_ONE_LANE)) return nvfp4_run<T, BWD, true, 2>(c, with_lanes(L, 1));
  }
  if constexpr (!BWD && sizeof(T) == 4) {
    if (variant() & MLQ_MX_FP32_TWO_VECTORS) return nvfp4_run<T, BWD, true, 2>(c, with_lanes(L, L.lanes / 2));
  }
  return nvfp4_run<T, BWD, true>(c, L);
}

template <class T, int ELEM, bool BWD, bool FULL, int P = 1>
cudaError_t mx_run(const Call& c, const Layout& L) {
  MxOp<T, P, ELEM, BWD, FULL> op{static_cast<const T*>(c.x), static_cast<const T*>(c.grad), static_cast<T*>(c.y),
                                 c.side, c.flag, L, c.rceil};
  return run_lanes<2>(op, c.stream);
}

template <class T, int ELEM, bool BWD>
cudaError_t mx_elem_typed(const Call& c) {
  const Layout L = call_layout<T>(c);
  if (!L.full) return mx_run<T, ELEM, BWD, false>(c, L);
  if constexpr (!BWD) {
    constexpr int kTwoVectors = sizeof(T) == 4 ? MLQ_MX_FP32_TWO_VECTORS : MLQ_MX_16BIT_TWO_VECTORS;
    if (L.lanes >= 2 && (variant() & kTwoVectors)) return mx_run<T, ELEM, BWD, true, 2>(c, with_lanes(L, L.lanes / 2));
  }
  return mx_run<T, ELEM, BWD, true>(c, L);
}

template <class T, bool BWD>
cudaError_t mx_typed(int elem, const Call& c) {
  switch (elem) {
    case mxe::kE4M3:
      return mx_elem_typed<T, mxe::kE4M3, BWD>(c);
    case mxe::kE5M2:
      return mx_elem_typed<T, mxe::kE5M2, BWD>(c);
    case mxe::kE2M1:
      return mx_elem_typed<T, mxe::kE2M1, BWD>(c);
    default:
      return mx_elem_typed<T, mxe::kInt8, BWD>(c);
  }
}

template <class T, int ELEM, bool FULL>
cudaError_t minifloat_run(const void* x, void* y, const float* s, int64_t ch, int64_t inner, const Layout& L,
                          cudaStream_t st) {
  MinifloatOp<T, ELEM, FULL> op{static_cast<const T*>(x), static_cast<T*>(y), s, ch, inner, L,
                                 reciprocal_division()};
  return run_lanes<2>(op, st);
}

template <class T, int ELEM>
cudaError_t minifloat_elem_typed(const void* x, void* y, const float* s, int64_t n, int64_t ch, int64_t inner,
                                 cudaStream_t st) {
  constexpr int N = VecOf<T>::N;
  const Layout L = make_layout<T>(1, n, N, aligned16(x) && aligned16(y));
  return L.full ? minifloat_run<T, ELEM, true>(x, y, s, ch, inner, L, st)
                : minifloat_run<T, ELEM, false>(x, y, s, ch, inner, L, st);
}

template <class T>
cudaError_t minifloat_typed(int elem, const void* x, void* y, const float* s, int64_t n, int64_t c, int64_t inner,
                            cudaStream_t st) {
  switch (elem) {
    case mxe::kE4M3:
      return minifloat_elem_typed<T, mxe::kE4M3>(x, y, s, n, c, inner, st);
    case mxe::kE5M2:
      return minifloat_elem_typed<T, mxe::kE5M2>(x, y, s, n, c, inner, st);
    default:
      return minifloat_elem_typed<T, mxe::kE2M1>(x, y, s, n, c, inner, st);
  }
}

bool bad_dtype(mlq_dtype d) { return d != MLQ_FLOAT32 && d != MLQ_FLOAT16 && d != MLQ_BFLOAT16; }

// The shared argument checks of the blocked launchers: cudaErrorInvalidValue, or cudaSuccess with *done for an
// empty tensor.
cudaError_t check_blocked(mlq_dtype dtype, const Call& c, bool bwd, bool* done) {
  *done = false;
  if (bad_dtype(dtype) || c.rows < 0 || c.cols < 0) return cudaErrorInvalidValue;
  if (c.rows == 0 || c.cols == 0) {
    *done = true;
    return cudaSuccess;
  }
  if (c.x == nullptr || c.y == nullptr || (bwd && c.grad == nullptr)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

cudaError_t nvfp4_any(mlq_dtype dtype, const Call& c, bool bwd) {
  bool done;
  if (c.block != 16 && c.block != 32) return cudaErrorInvalidValue;
  const cudaError_t e = check_blocked(dtype, c, bwd, &done);
  if (e != cudaSuccess || done) return e;
  if (c.gs == nullptr) return cudaErrorInvalidValue;
  if (dtype == MLQ_FLOAT32) return bwd ? nvfp4_typed<float, true>(c) : nvfp4_typed<float, false>(c);
  if (dtype == MLQ_FLOAT16) return bwd ? nvfp4_typed<__half, true>(c) : nvfp4_typed<__half, false>(c);
  return bwd ? nvfp4_typed<__nv_bfloat16, true>(c) : nvfp4_typed<__nv_bfloat16, false>(c);
}

cudaError_t mx_any(mlq_dtype dtype, int elem, const Call& c, bool bwd) {
  bool done;
  if (elem < 0 || elem > 3 || c.block != 32) return cudaErrorInvalidValue;
  const cudaError_t e = check_blocked(dtype, c, bwd, &done);
  if (e != cudaSuccess || done) return e;
  if (dtype == MLQ_FLOAT32) return bwd ? mx_typed<float, true>(elem, c) : mx_typed<float, false>(elem, c);
  if (dtype == MLQ_FLOAT16) return bwd ? mx_typed<__half, true>(elem, c) : mx_typed<__half, false>(elem, c);
  return bwd ? mx_typed<__nv_bfloat16, true>(elem, c) : mx_typed<__nv_bfloat16, false>(elem, c);
}

}  // namespace mxk

extern "C" cudaError_t mlq_fake_nvfp4(mlq_dtype dtype, const void* x, void* y, float* scales, int64_t rows,
                                      int64_t cols, int block, const float* global_scale, int* nonfinite,
                                      cudaStream_t stream) {
  const mxk::Call c{x, nullptr, y, scales, global_scale, nonfinite, rows, cols, block, false, stream};
  return mxk::nvfp4_any(dtype, c, false);
}

extern "C" cudaError_t mlq_nvfp4_backward(mlq_dtype dtype, const void* grad, const void* x, void* grad_x,
                                          int64_t rows, int64_t cols, int block, const float* global_scale,
                                          int* nonfinite, cudaStream_t stream) {
  const mxk::Call c{x, grad, grad_x, nullptr, global_scale, nonfinite, rows, cols, block, false, stream};
  return mxk::nvfp4_any(dtype, c, true);
}

extern "C" cudaError_t mlq_fake_nvfp4_amax(mlq_dtype dtype, const void* x, void* y, int64_t rows, int64_t cols,
                                           int block, const float* amax, int* nonfinite, cudaStream_t stream) {
  const mxk::Call c{x, nullptr, y, nullptr, amax, nonfinite, rows, cols, block, false, stream, true};
  return mxk::nvfp4_any(dtype, c, false);
}

extern "C" cudaError_t mlq_nvfp4_backward_amax(mlq_dtype dtype, const void* grad, const void* x, void* grad_x,
                                               int64_t rows, int64_t cols, int block, const float* amax,
                                               int* nonfinite, cudaStream_t stream) {
  const mxk::Call c{x, grad, grad_x, nullptr, amax, nonfinite, rows, cols, block, false, stream, true};
  return mxk::nvfp4_any(dtype, c, true);
}

extern "C" cudaError_t mlq_fake_mx(mlq_dtype dtype, int elem, int rceil, const void* x, void* y, float* exps,
                                   int64_t rows, int64_t cols, int block, int* nonfinite, cudaStream_t stream) {
  const mxk::Call c{x, nullptr, y, exps, nullptr, nonfinite, rows, cols, block, rceil != 0, stream};
  return mxk::mx_any(dtype, elem, c, false);
}

extern "C" cudaError_t mlq_mx_backward(mlq_dtype dtype, int elem, int rceil, const void* grad, const void* x,
                                       void* grad_x, int64_t rows, int64_t cols, int block, int* nonfinite,
                                       cudaStream_t stream) {
  const mxk::Call c{x, grad, grad_x, nullptr, nullptr, nonfinite, rows, cols, block, rceil != 0, stream};
  return mxk::mx_any(dtype, elem, c, true);
}

extern "C" cudaError_t mlq_fake_minifloat(mlq_dtype dtype, int elem, const void* x, void* y, const float* scale,
                                          int64_t n, int64_t channels, int64_t inner, cudaStream_t stream) {
  if (mxk::bad_dtype(dtype) || elem < 0 || elem > 2 || n < 0 || channels < 1 || inner < 1) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (x == nullptr || y == nullptr || scale == nullptr) return cudaErrorInvalidValue;
  if (dtype == MLQ_FLOAT32) return mxk::minifloat_typed<float>(elem, x, y, scale, n, channels, inner, stream);
  if (dtype == MLQ_FLOAT16) return mxk::minifloat_typed<__half>(elem, x, y, scale, n, channels, inner, stream);
  return mxk::minifloat_typed<__nv_bfloat16>(elem, x, y, scale, n, channels, inner, stream);
}

extern "C" int mlq_mx_set_variant(int variant) {
  if (variant < 0 || variant > MLQ_MX_VARIANT_ALL) return mxk::variant();
  return mxk::g_variant.exchange(variant);
}
