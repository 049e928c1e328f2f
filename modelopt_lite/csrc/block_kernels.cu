// modelopt_lite CUDA kernel of dynamic block quantization (integer and E4M3 blocks along the last axis), fused: one
// read of x, the block amax reduced by the block's lanes (warp shuffles, mx_lanes.cuh), the scale computed in
// registers, quantize and one write. No amax or scale tensor goes through memory. The backward pass recomputes the
// block scales the same way and applies the straight-through mask (one read of x and grad, one write).
//
// Static block amax (mlq_static_block): the same kernel with each block's amax read from a float32 tensor of shape
// (rows, blocks per row) instead of reduced, and checked (NaN, Inf or < 0 raises the flag; x's own NaN/Inf pass
// through, as in the unfused path): the scale and the check that took their own launch and a scale tensor in memory
// are done in registers.
//
// Double quantization (scale_kind != 0): a first pass reads x for the tensor's amax (one float in device memory,
// abs_max below), from which every block derives the scales' scale; the block scales are fake-quantized in
// registers (still no per-block tensor). That is two reads of x: the scales' scale depends on every block.
//
// Numerics (functional/library_blocks.py's reference, the composition of blocks.block_amax, scales.scale_from_amax
// and the integer / E4M3 ops), all in float32:
//   s = amax / bound; s = s * (1 - 2**-24) where s * bound overflows (a finite amax); s = 0 where amax <= 2**-24
//   integer: y = clamp(rint(x / s), qmin, qmax) * s;  E4M3: y = e4m3(clamp(x / s, -448, 448)) * s;  s == 0: +0
//   backward: grad where lo <= x <= hi (lo = qmin * s, hi = qmax * s; E4M3: -448 s, 448 s), else +0
// The element math is quant_math.cuh's (the integer/E4M3 kernels' own).
//
// Built with MODELOPT_LITE_EMULATE_ON_HOST, run_lanes executes the lanes warp by warp on the host (tests).
#include "mx_kernels_api.h"
#include "mx_lanes.cuh"
#include "quant_math.cuh"

namespace mxk {

// scales.scale_from_amax of one float32 amax.
MXK_HD float block_scale(float a, float bound) {
  float s = mxe::fdiv(a, bound);
  const float end = mxe::fmul(s, bound);
  if (mxe::nonfinite(end) && end == end && !mxe::nonfinite(a)) s = mxe::fmul(s, 0.99999994f);  // 1 - 2**-24
  return a <= 5.9604644775390625e-8f ? 0.0f : s;
}

// checks.check_amax_values: an amax is refused when NaN, Inf or < 0 (-0.0 is fine).
MXK_HD bool bad_amax(float a) { return !(a >= 0.0f) || mxe::nonfinite(a); }

// STATIC: the block amax is read from `samax` (a static amax), not reduced from x; built apart from the dynamic
// kernels, which then carry no test of it.
template <class T, int P, bool E4M3, bool BWD, bool FULL, bool STATIC>
struct DynBlockOp {
  using State = OpLane<T, P, BWD, FULL>;
  // MLQ_MX_PREFETCH_16BIT does not take this kernel: since the lanes hold their 16-bit elements packed (32
  // registers, full occupancy) the prefetch cost 13 points of copy bandwidth on bf16 (H100, 2026-11-27: 101-102%
  // without, 86-88% with); MLQ_MX_PREFETCH_ALL still does.
  static constexpr bool kPrefetch16 = false;
  const T* x;
  const T* grad;
  T* y;
  int* flag;
  Layout L;
  float bound, qmin, qmax;
  const float* gmax;  // double quantization: the tensor's amax (device), else null
  int scale_kind;     // 1: unsigned integer scale codes [0, scale_qmax], 2: E4M3 scale codes
  float scale_bound, scale_qmax;
  bool rcp_div;        // divide through the block scale's reciprocal where exact (not MLQ_MX_TRUE_DIVISION)
  const float* samax;  // STATIC: the block amaxes (rows x blocks per row, row-major)
  // fdiv_rcp is proven for 16-bit elements; a static amax does not bound |x|: those kernels take fdiv_rcp_clamped
  static constexpr bool kRcp = !BWD && sizeof(T) == 2;
  static constexpr int kMinBlocks = kRcp && P == 1 && FULL ? 8 : 0;  // 32 registers (mx_lanes.cuh)
  static constexpr mlq::Fwd kFwd = E4M3 ? mlq::Fwd::E4m3Fake : mlq::Fwd::IntFake;

  MXK_HD int64_t slots() const { return L.rows * L.nbr * L.lanes; }
  MXK_HD int lanes() const { return L.lanes; }
  // STATIC: each lane returns its block's amax instead of its partial max (issued with the loads of x, so its
  // latency overlaps theirs), and the group's reduction of equal values leaves it unchanged: finish receives it with
  // no register kept for the block index.
  MXK_HD float load(int64_t slot, State& st) const {
    const float a = load_op_lane<T, P, BWD, FULL>(x, grad, L, slot, st);
    if constexpr (STATIC) return load_scalar(samax + st.w.b);
    return a;
  }
  MXK_HD void prefetch(int64_t slot) const { prefetch_op_lane<T, P, BWD, FULL>(x, grad, L, slot); }

  // The block scale, double-quantized when asked: the largest block scale is scale_from_amax(the tensor's amax)
  // (scale_from_amax is monotonic), the scales' own scale is scale_from_amax of that, and the block scale is
  // fake-quantized with it as the integer / E4M3 ops do.
  MXK_HD float scale_of(float a) const {
    const float s = block_scale(a, bound);
    if (gmax == nullptr) return s;
    const float ss = block_scale(block_scale(load_scalar(gmax), bound), scale_bound);
    return scale_kind == 2 ? mlq::forward_elem<mlq::Fwd::E4m3Fake>(s, ss, 0.0f, 0.0f, 0.0f)
                           : mlq::forward_elem<mlq::Fwd::IntFake>(s, ss, 0.0f, 0.0f, scale_qmax);
  }

  MXK_HD void finish(int64_t, State& st, float a) const {
    constexpr int N = VecOf<T>::N;
    if (st.w.lane == 0 && (STATIC ? bad_amax(a) : mxe::nonfinite(a))) flag_set(flag, 1);  // static: check_amax_values
    const float s = scale_of(a);
    if constexpr (BWD) {  // the gradient's elements were read with x (GradLane)
MXK_UNROLL
      for (int j = 0; j < P * N; ++j) {
        const bool keep = E4M3 ? mlq::backward_pass<mlq::Bwd::E4m3>(st.v.get(j), s, 0.0f, qmin, qmax)
                               : mlq::backward_pass<mlq::Bwd::Int>(st.v.get(j), s, 0.0f, qmin, qmax);
        st.v.set(j, keep ? st.g.get(j) : 0.0f);
      }
    } else {
      const float r = kRcp && rcp_div ? mxe::frcp(s) : 0.0f;
      if (s == 0.0f) {  // a dead block: one test per lane, so the element loops below have no zero test left
MXK_UNROLL
        for (int j = 0; j < P * N; ++j) st.v.set(j, 0.0f);
      } else if (kRcp && rcp_div && (STATIC ? mxe::rcp_div_range(s) : mxe::rcp_div_ok(s, r, a))) {
MXK_UNROLL
        for (int j = 0; j < P * N; ++j) {  // dynamic: |x| <= a bounds the quotient; static: the clamped form
          const float v = st.v.get(j);
          const float q = STATIC ? mxe::fdiv_rcp_clamped(v, s, r) : mxe::fdiv_rcp(v, s, r);
          st.v.set(j, mlq::fake_of_quotient<kFwd>(q, s, qmin, qmax));
        }
      } else {
MXK_UNROLL
        for (int j = 0; j < P * N; ++j) st.v.set(j, mlq::forward_elem<kFwd>(st.v.get(j), s, 0.0f, qmin, qmax));
      }
    }
    store_lane(y, L, st);
  }
};

struct DynCall {
  const void* x;
  const void* grad;
  void* y;
  int* flag;
  int64_t rows, cols;
  int block;
  float bound, qmin, qmax;
  float* gmax;
  int scale_kind;
  float scale_bound, scale_qmax;
  cudaStream_t stream;
  const float* samax;  // static block amaxes, else null
};

// Built twice: FULL for `full` layouts (whole aligned vectors and blocks), the general one for the rest.
// U slots per thread: 2 for one vector per lane, else 1 (the two-vector variants, MLQ_MX_BLOCKS_FP32_TWO_VECTORS and
// MLQ_MX_16BIT_TWO_VECTORS: 2 with 2 vectors).
template <class T, int P, bool E4M3, bool BWD, bool STATIC, bool FULL, int U = (P == 1 ? 2 : 1)>
cudaError_t dyn_run_as(const DynCall& c, const Layout& L) {
  DynBlockOp<T, P, E4M3, BWD, FULL, STATIC> op{
      static_cast<const T*>(c.x), static_cast<const T*>(c.grad), static_cast<T*>(c.y), c.flag, L, c.bound, c.qmin,
      c.qmax, c.gmax, c.scale_kind, c.scale_bound, c.scale_qmax, reciprocal_division(), c.samax};
  return run_lanes<U>(op, c.stream);
}

template <class T, int P, bool E4M3, bool BWD, bool STATIC>
cudaError_t dyn_run(const DynCall& c, const Layout& L) {
  return L.full ? dyn_run_as<T, P, E4M3, BWD, STATIC, true>(c, L)
                : dyn_run_as<T, P, E4M3, BWD, STATIC, false>(c, L);
}

// The tensor's amax for double quantization (one read of x): each thread's running max over its 16-byte vectors
// (grid-stride), a warp butterfly, one atomicMax per warp on the float's bits (non-negative floats order as
// their bits; a NaN, above +Inf, wins). The host emulation runs the same threads warp by warp.
template <class T>
MXK_HD float thread_max(const T* x, int64_t n, bool vec, int64_t t, int64_t threads) {
  constexpr int N = VecOf<T>::N;
  float a = 0.0f, f[N];
  const int64_t nvec = vec ? n / N : 0;
  for (int64_t v = t; v < nvec; v += threads) {
    load_vec<T>(x + v * N, N, true, f);
    MXK_UNROLL
    for (int j = 0; j < N; ++j) a = mxe::amax_step(a, f[j]);
  }
  for (int64_t i = nvec * N + t; i < n; i += threads) a = mxe::amax_step(a, Conv<T>::to(x[i]));
  return a;
}

#ifndef MODELOPT_LITE_EMULATE_ON_HOST
template <class T>
__global__ void __launch_bounds__(kThreads) abs_max_kernel(const T* x, int64_t n, bool vec, unsigned int* out) {
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float a = thread_max<T>(x, n, vec, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x, threads);
  for (int o = kWarp / 2; o > 0; o >>= 1) a = amax_join(a, __shfl_xor_sync(0xffffffffu, a, o));
  if ((threadIdx.x & (kWarp - 1)) == 0 && a != 0.0f) atomicMax(out, mxe::fbits(a));
}
#endif

template <class T>
cudaError_t abs_max(const T* x, int64_t n, float* out, cudaStream_t stream) {
  constexpr int N = VecOf<T>::N;
  const bool vec = aligned16(x);
  const int64_t want = (n / N + kThreads - 1) / kThreads;
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  const int64_t grid = want < 4 * kBlocksPerSm ? (want > 0 ? want : 1) : 4 * kBlocksPerSm;  // a 4-SM device's grid
  const int64_t threads = grid * kThreads;
  uint32_t best = mxe::fbits(*out);
  for (int64_t w = 0; w < threads; w += kWarp) {
    float a[kWarp], b[kWarp];
    for (int l = 0; l < kWarp; ++l) a[l] = thread_max<T>(x, n, vec, w + l, threads);
    for (int o = kWarp / 2; o > 0; o >>= 1) {
      for (int l = 0; l < kWarp; ++l) b[l] = a[l];
      for (int l = 0; l < kWarp; ++l) a[l] = amax_join(b[l], b[l ^ o]);
    }
    if (a[0] != 0.0f && mxe::fbits(a[0]) > best) best = mxe::fbits(a[0]);
  }
  *out = mxe::ffrom(best);
  return cudaSuccess;
#else
  const int64_t cap = static_cast<int64_t>(sm_count()) * kBlocksPerSm;
  const int64_t grid = want < cap ? (want > 0 ? want : 1) : cap;
  abs_max_kernel<T><<<static_cast<unsigned int>(grid), kThreads, 0, stream>>>(x, n, vec,
                                                                              reinterpret_cast<unsigned int*>(out));
  return cudaGetLastError();
#endif
}

// scales.scale_from_amax of n amaxes and their check (checks.check_amax_values: *bad |= 1 for a NaN, Inf or
// negative amax): one launch for the ten small torch ops of the public functions' scale, grid-stride.
#ifndef MODELOPT_LITE_EMULATE_ON_HOST
__global__ void __launch_bounds__(kThreads)
    scale_kernel(const float* amax, float* scale, int64_t n, float bound, int* bad) {
  int b = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float a = load_scalar(amax + i);
    scale[i] = block_scale(a, bound);
    b |= bad_amax(a) ? 1 : 0;
  }
  if (__syncthreads_or(b) != 0 && threadIdx.x == 0) atomicOr(bad, 1);
}
#endif

cudaError_t scales(const float* amax, float* scale, int64_t n, float bound, int* bad, cudaStream_t stream) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  for (int64_t i = 0; i < n; ++i) {
    scale[i] = block_scale(amax[i], bound);
    if (bad_amax(amax[i])) *bad |= 1;
  }
  return cudaSuccess;
#else
  const int64_t want = (n + kThreads - 1) / kThreads, cap = static_cast<int64_t>(sm_count()) * 4;
  const int64_t grid = want < cap ? want : cap;
  scale_kernel<<<static_cast<unsigned int>(grid), kThreads, 0, stream>>>(amax, scale, n, bound, bad);
  return cudaGetLastError();
#endif
}

template <class T, bool E4M3, bool BWD, bool STATIC>
cudaError_t dyn_p(const DynCall& c) {
  constexpr int N = VecOf<T>::N;
  const Layout L =
      make_layout<T>(c.rows, c.cols, c.block, aligned16(c.x) && aligned16(c.y) && aligned16(c.grad));
  const int p = c.block / (N * L.lanes);
  if constexpr (!BWD) {  // the forward with 2 vectors per lane (float32: as the MX kernels' default)
    constexpr int kTwoVectors = sizeof(T) == 4 ? MLQ_MX_BLOCKS_FP32_TWO_VECTORS : MLQ_MX_16BIT_TWO_VECTORS;
    if (p == 1 && L.full && L.lanes >= 2 && (variant() & kTwoVectors)) {
      return dyn_run_as<T, 2, E4M3, BWD, STATIC, true, 2>(c, with_lanes(L, L.lanes / 2));
    }
  }
  if (p == 1) return dyn_run<T, 1, E4M3, BWD, STATIC>(c, L);
  if (p == 2) return dyn_run<T, 2, E4M3, BWD, STATIC>(c, L);
  return dyn_run<T, 4, E4M3, BWD, STATIC>(c, L);
}

template <class T, bool STATIC>
cudaError_t dyn_elem(const DynCall& c, bool e4m3, bool bwd) {
  if (e4m3) return bwd ? dyn_p<T, true, true, STATIC>(c) : dyn_p<T, true, false, STATIC>(c);
  return bwd ? dyn_p<T, false, true, STATIC>(c) : dyn_p<T, false, false, STATIC>(c);
}

template <class T>
cudaError_t dyn_typed(const DynCall& c, bool e4m3, bool bwd) {
  if (c.gmax != nullptr) {
    const cudaError_t e = abs_max<T>(static_cast<const T*>(c.x), c.rows * c.cols, c.gmax, c.stream);
    if (e != cudaSuccess) return e;
  }
  return c.samax != nullptr ? dyn_elem<T, true>(c, e4m3, bwd) : dyn_elem<T, false>(c, e4m3, bwd);
}

// The launch of a checked call for x's dtype (forward when c.grad is null, else backward).
cudaError_t dyn_launch(mlq_dtype dtype, const DynCall& c, int e4m3) {
  const bool bwd = c.grad != nullptr;
  if (dtype == MLQ_FLOAT32) return dyn_typed<float>(c, e4m3 != 0, bwd);
  if (dtype == MLQ_FLOAT16) return dyn_typed<__half>(c, e4m3 != 0, bwd);
  return dyn_typed<__nv_bfloat16>(c, e4m3 != 0, bwd);
}

}  // namespace mxk

extern "C" int mlq_dynamic_block_supported(mlq_dtype dtype, int64_t block) {
  const int64_t n = dtype == MLQ_FLOAT32 ? 4 : 8;
  if (dtype != MLQ_FLOAT32 && dtype != MLQ_FLOAT16 && dtype != MLQ_BFLOAT16) return 0;
  if (block < 1 || block % n != 0) return 0;
  const int64_t v = block / n;  // vectors per block: a power of two, at most 32 lanes of 4 vectors
  return (v & (v - 1)) == 0 && v <= 128 ? 1 : 0;
}

extern "C" cudaError_t mlq_dynamic_block(mlq_dtype dtype, int e4m3, const void* grad, const void* x, void* y,
                                         int64_t rows, int64_t cols, int block, float bound, float qmin, float qmax,
                                         int scale_kind, float scale_bound, float scale_qmax, float* amax_scratch,
                                         int* nonfinite, cudaStream_t stream) {
  if (!mlq_dynamic_block_supported(dtype, block) || rows < 0 || cols < 0 || !(bound > 0.0f) || !(qmin <= qmax))
    return cudaErrorInvalidValue;
  if (scale_kind < 0 || scale_kind > 2 || (scale_kind != 0 && (amax_scratch == nullptr || !(scale_bound > 0.0f))))
    return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (x == nullptr || y == nullptr) return cudaErrorInvalidValue;
  const mxk::DynCall c{x,     grad, y,          nonfinite,  rows,  cols, block, bound, qmin, qmax,
                       scale_kind != 0 ? amax_scratch : nullptr, scale_kind, scale_bound, scale_qmax, stream,
                       nullptr};
  return mxk::dyn_launch(dtype, c, e4m3);
}

extern "C" cudaError_t mlq_static_block(mlq_dtype dtype, int e4m3, const void* grad, const void* x,
                                        const float* block_amax, void* y, int64_t rows, int64_t cols, int block,
                                        float bound, float qmin, float qmax, int* bad_amax, cudaStream_t stream) {
  if (!mlq_dynamic_block_supported(dtype, block) || rows < 0 || cols < 0 || !(bound > 0.0f) || !(qmin <= qmax))
    return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (x == nullptr || y == nullptr || block_amax == nullptr) return cudaErrorInvalidValue;
  const mxk::DynCall c{x, grad, y, bad_amax, rows, cols, block, bound, qmin, qmax, nullptr, 0, 0.0f, 0.0f, stream,
                       block_amax};
  return mxk::dyn_launch(dtype, c, e4m3);
}

extern "C" cudaError_t mlq_scale_from_amax(const float* amax, float* scale, int64_t n, float bound, int* bad,
                                           cudaStream_t stream) {
  if (n < 0 || !(bound > 0.0f) || mxe::nonfinite(bound)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (amax == nullptr || scale == nullptr || bad == nullptr) return cudaErrorInvalidValue;
  return mxk::scales(amax, scale, n, bound, bad, stream);
}
