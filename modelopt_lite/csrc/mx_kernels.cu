// modelopt_lite CUDA kernels of the 4-bit and microscaling formats (pure CUDA, no torch headers): E5M2 / E2M1
// elementwise, NVFP4 and OCP MX blocked fake quant. The element math is mx_elem.h, the very code the CPU kernels
// run, so both backends share one definition of every rounding.
//
// Blocked ops: one thread per block (16 or 32 elements, at most 128 bytes), read with 16-byte vector loads when the
// row length and the pointers allow it, else element by element; the block is kept in registers between the amax
// and the quantization. Elementwise ops: a grid-stride loop.
//
// Built with -DMODELOPT_LITE_EMULATE_ON_HOST (host compiler, no GPU), the launchers run the same bodies in a host
// loop: tests/cuda_host/mx_host_harness.cpp checks them bit for bit against the reference that way.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mx_elem.h"
#include "mx_kernels_api.h"

namespace mxk {

#if defined(__CUDACC__)
#define MXK_HD __host__ __device__ __forceinline__
#else
#define MXK_HD inline
#endif

// float32 <-> storage type (round to nearest even).
template <class T>
struct Conv;
template <>
struct Conv<float> {
  static MXK_HD float to(float v) { return v; }
  static MXK_HD float from(float v) { return v; }
};
template <>
struct Conv<__half> {
  static MXK_HD float to(__half v) { return __half2float(v); }
  static MXK_HD __half from(float v) { return __float2half_rn(v); }
};
template <>
struct Conv<__nv_bfloat16> {
  static MXK_HD float to(__nv_bfloat16 v) { return __bfloat162float(v); }
  static MXK_HD __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};

// Load the m (<= BLOCK) elements of one block as float32; 16-byte vector loads when `vec` (a full block whose
// start is 16-byte aligned).
template <class T, int BLOCK>
MXK_HD void load_block(const T* p, int m, bool vec, float (&v)[BLOCK]) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
  if (vec) {
#pragma unroll
    for (int c = 0; c < BLOCK / kPer; ++c) {
      union {
        uint4 u;
        T t[kPer];
      } pk;
#ifdef __CUDA_ARCH__
      pk.u = *reinterpret_cast<const uint4*>(p + c * kPer);
#else
      memcpy(&pk.u, p + c * kPer, sizeof pk.u);
#endif
#pragma unroll
      for (int j = 0; j < kPer; ++j) v[c * kPer + j] = Conv<T>::to(pk.t[j]);
    }
    return;
  }
  for (int i = 0; i < BLOCK; ++i) v[i] = i < m ? Conv<T>::to(p[i]) : 0.0f;
}

template <class T, int BLOCK>
MXK_HD void store_block(T* p, int m, bool vec, const float (&v)[BLOCK]) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
  if (vec) {
#pragma unroll
    for (int c = 0; c < BLOCK / kPer; ++c) {
      union {
        uint4 u;
        T t[kPer];
      } pk;
#pragma unroll
      for (int j = 0; j < kPer; ++j) pk.t[j] = Conv<T>::from(v[c * kPer + j]);
#ifdef __CUDA_ARCH__
      *reinterpret_cast<uint4*>(p + c * kPer) = pk.u;
#else
      memcpy(p + c * kPer, &pk.u, sizeof pk.u);
#endif
    }
    return;
  }
  for (int i = 0; i < m; ++i) p[i] = Conv<T>::from(v[i]);
}

struct Rows {
  int64_t rows, cols, nbr;  // nbr: blocks per row
  bool vec_ok;              // cols * sizeof(T) % 16 == 0 and both pointers 16-byte aligned
};

// Block b of the tensor: its first element and its length.
template <int BLOCK>
MXK_HD int64_t block_start(const Rows& r, int64_t b, int* m) {
  const int64_t row = b / r.nbr, j = b - row * r.nbr;
  const int64_t left = r.cols - j * BLOCK;
  *m = left < BLOCK ? static_cast<int>(left) : BLOCK;
  return row * r.cols + j * BLOCK;
}

// One NVFP4 block; returns whether its amax is NaN or Inf.
template <class T, int BLOCK>
MXK_HD bool nvfp4_body(const T* x, T* y, float* scales, const Rows& r, int64_t b, float gs) {
  int m;
  const int64_t o = block_start<BLOCK>(r, b, &m);
  const bool vec = r.vec_ok && m == BLOCK;
  float v[BLOCK];
  load_block<T, BLOCK>(x + o, m, vec, v);
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < BLOCK; ++i) a = mxe::amax_step(a, v[i]);  // padding zeros never change the amax
  const float s = gs == 0.0f ? 0.0f : mxe::nvfp4_block_scale(a, gs);
  if (scales != nullptr) scales[b] = s;
  const float d = mxe::fmul(s, gs);
#pragma unroll
  for (int i = 0; i < BLOCK; ++i) v[i] = s == 0.0f ? 0.0f : mxe::fmul(mxe::e2m1(mxe::fdiv(v[i], d)), d);
  store_block<T, BLOCK>(y + o, m, vec, v);
  return mxe::nonfinite(a);
}

// One MX block; returns whether its amax is NaN or Inf.
template <class T, int ELEM, int BLOCK>
MXK_HD bool mx_body(const T* x, T* y, float* exps, const Rows& r, int64_t b, bool rceil) {
  int m;
  const int64_t o = block_start<BLOCK>(r, b, &m);
  const bool vec = r.vec_ok && m == BLOCK;
  float v[BLOCK];
  load_block<T, BLOCK>(x + o, m, vec, v);
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < BLOCK; ++i) a = mxe::amax_step(a, v[i]);
  const bool nan = a != a;  // as the CPU kernels: a NaN block is all NaN, an Inf amax gets k = 127
  const int k = nan ? 127 : mxe::mx_exponent(a, ELEM, rceil);
  if (exps != nullptr) exps[b] = nan ? a : static_cast<float>(k);
  const float X = mxe::pow2f(k), inv = mxe::pow2f(-k);
#pragma unroll
  for (int i = 0; i < BLOCK; ++i) v[i] = a != a ? a : mxe::fmul(mxe::elem_round<ELEM>(mxe::fmul(v[i], inv)), X);
  store_block<T, BLOCK>(y + o, m, vec, v);
  return mxe::nonfinite(a);
}

template <class T, int ELEM>
MXK_HD void minifloat_body(const T* x, T* y, const float* scale, int64_t i, int64_t channels, int64_t inner) {
  const float s = scale[(i / inner) % channels];
  const float v = Conv<T>::to(x[i]);
  y[i] = Conv<T>::from(s == 0.0f ? 0.0f : mxe::fmul(mxe::elem_round<ELEM>(mxe::fdiv(v, s)), s));
}

constexpr int kThreads = 256;

#ifndef MODELOPT_LITE_EMULATE_ON_HOST
__device__ __forceinline__ void flag_bad(int* nonfinite) {
  if (nonfinite != nullptr) atomicExch(nonfinite, 1);
}

template <class T, int BLOCK>
__global__ void __launch_bounds__(kThreads)
    nvfp4_kernel(const T* x, T* y, float* scales, Rows r, float gs, int* nonfinite) {
  const int64_t total = r.rows * r.nbr;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < total;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (nvfp4_body<T, BLOCK>(x, y, scales, r, b, gs)) flag_bad(nonfinite);
  }
}

template <class T, int ELEM>
__global__ void __launch_bounds__(kThreads)
    mx_kernel(const T* x, T* y, float* exps, Rows r, bool rceil, int* nonfinite) {
  const int64_t total = r.rows * r.nbr;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < total;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (mx_body<T, ELEM, 32>(x, y, exps, r, b, rceil)) flag_bad(nonfinite);
  }
}

template <class T, int ELEM>
__global__ void __launch_bounds__(kThreads)
    minifloat_kernel(const T* x, T* y, const float* scale, int64_t n, int64_t channels, int64_t inner) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    minifloat_body<T, ELEM>(x, y, scale, i, channels, inner);
  }
}

int grid_for(int64_t work) {
  int dev = 0, sms = 80;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t want = (work + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * 16;
  return static_cast<int>(want < cap ? (want > 0 ? want : 1) : cap);
}
#endif

template <class T>
Rows make_rows(const void* x, const void* y, int64_t rows, int64_t cols, int block) {
  Rows r;
  r.rows = rows;
  r.cols = cols;
  r.nbr = (cols + block - 1) / block;
  r.vec_ok = (cols * static_cast<int64_t>(sizeof(T))) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(y) % 16 == 0;
  return r;
}

template <class T, int BLOCK>
cudaError_t nvfp4_launch(const void* xv, void* yv, float* scales, int64_t rows, int64_t cols, float gs, int* bad,
                         cudaStream_t stream) {
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  const Rows r = make_rows<T>(xv, yv, rows, cols, BLOCK);
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  for (int64_t b = 0; b < r.rows * r.nbr; ++b) {
    if (nvfp4_body<T, BLOCK>(x, y, scales, r, b, gs) && bad != nullptr) *bad = 1;
  }
  return cudaSuccess;
#else
  nvfp4_kernel<T, BLOCK><<<grid_for(r.rows * r.nbr), kThreads, 0, stream>>>(x, y, scales, r, gs, bad);
  return cudaGetLastError();
#endif
}

template <class T, int ELEM>
cudaError_t mx_launch(const void* xv, void* yv, float* exps, int64_t rows, int64_t cols, bool rceil, int* bad,
                      cudaStream_t stream) {
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  const Rows r = make_rows<T>(xv, yv, rows, cols, 32);
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  for (int64_t b = 0; b < r.rows * r.nbr; ++b) {
    if (mx_body<T, ELEM, 32>(x, y, exps, r, b, rceil) && bad != nullptr) *bad = 1;
  }
  return cudaSuccess;
#else
  mx_kernel<T, ELEM><<<grid_for(r.rows * r.nbr), kThreads, 0, stream>>>(x, y, exps, r, rceil, bad);
  return cudaGetLastError();
#endif
}

template <class T, int ELEM>
cudaError_t minifloat_launch(const void* xv, void* yv, const float* scale, int64_t n, int64_t channels, int64_t inner,
                             cudaStream_t stream) {
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  for (int64_t i = 0; i < n; ++i) minifloat_body<T, ELEM>(x, y, scale, i, channels, inner);
  return cudaSuccess;
#else
  minifloat_kernel<T, ELEM><<<grid_for(n), kThreads, 0, stream>>>(x, y, scale, n, channels, inner);
  return cudaGetLastError();
#endif
}

template <class T>
cudaError_t nvfp4_dtype(int block, const void* x, void* y, float* s, int64_t rows, int64_t cols, float gs, int* bad,
                        cudaStream_t st) {
  return block == 16 ? nvfp4_launch<T, 16>(x, y, s, rows, cols, gs, bad, st)
                     : nvfp4_launch<T, 32>(x, y, s, rows, cols, gs, bad, st);
}

template <class T>
cudaError_t mx_dtype(int elem, bool rceil, const void* x, void* y, float* e, int64_t rows, int64_t cols, int* bad,
                     cudaStream_t st) {
  switch (elem) {
    case mxe::kE4M3:
      return mx_launch<T, mxe::kE4M3>(x, y, e, rows, cols, rceil, bad, st);
    case mxe::kE5M2:
      return mx_launch<T, mxe::kE5M2>(x, y, e, rows, cols, rceil, bad, st);
    case mxe::kE2M1:
      return mx_launch<T, mxe::kE2M1>(x, y, e, rows, cols, rceil, bad, st);
    default:
      return mx_launch<T, mxe::kInt8>(x, y, e, rows, cols, rceil, bad, st);
  }
}

template <class T>
cudaError_t minifloat_dtype(int elem, const void* x, void* y, const float* s, int64_t n, int64_t c, int64_t inner,
                            cudaStream_t st) {
  switch (elem) {
    case mxe::kE4M3:
      return minifloat_launch<T, mxe::kE4M3>(x, y, s, n, c, inner, st);
    case mxe::kE5M2:
      return minifloat_launch<T, mxe::kE5M2>(x, y, s, n, c, inner, st);
    default:
      return minifloat_launch<T, mxe::kE2M1>(x, y, s, n, c, inner, st);
  }
}

bool bad_dtype(mlq_dtype d) { return d != MLQ_FLOAT32 && d != MLQ_FLOAT16 && d != MLQ_BFLOAT16; }

}  // namespace mxk

extern "C" cudaError_t mlq_fake_nvfp4(mlq_dtype dtype, const void* x, void* y, float* scales, int64_t rows,
                                      int64_t cols, int block, float global_scale, int* nonfinite,
                                      cudaStream_t stream) {
  if (mxk::bad_dtype(dtype) || (block != 16 && block != 32) || rows < 0 || cols < 0 || !(global_scale >= 0.0f))
    return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (x == nullptr || y == nullptr) return cudaErrorInvalidValue;
  if (dtype == MLQ_FLOAT32) return mxk::nvfp4_dtype<float>(block, x, y, scales, rows, cols, global_scale, nonfinite, stream);
  if (dtype == MLQ_FLOAT16) return mxk::nvfp4_dtype<__half>(block, x, y, scales, rows, cols, global_scale, nonfinite, stream);
  return mxk::nvfp4_dtype<__nv_bfloat16>(block, x, y, scales, rows, cols, global_scale, nonfinite, stream);
}

extern "C" cudaError_t mlq_fake_mx(mlq_dtype dtype, int elem, int rceil, const void* x, void* y, float* exps,
                                   int64_t rows, int64_t cols, int block, int* nonfinite, cudaStream_t stream) {
  if (mxk::bad_dtype(dtype) || elem < 0 || elem > 3 || block != 32 || rows < 0 || cols < 0)
    return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (x == nullptr || y == nullptr) return cudaErrorInvalidValue;
  if (dtype == MLQ_FLOAT32) return mxk::mx_dtype<float>(elem, rceil != 0, x, y, exps, rows, cols, nonfinite, stream);
  if (dtype == MLQ_FLOAT16) return mxk::mx_dtype<__half>(elem, rceil != 0, x, y, exps, rows, cols, nonfinite, stream);
  return mxk::mx_dtype<__nv_bfloat16>(elem, rceil != 0, x, y, exps, rows, cols, nonfinite, stream);
}

extern "C" cudaError_t mlq_fake_minifloat(mlq_dtype dtype, int elem, const void* x, void* y, const float* scale,
                                          int64_t n, int64_t channels, int64_t inner, cudaStream_t stream) {
  if (mxk::bad_dtype(dtype) || elem < 0 || elem > 2 || n < 0 || channels < 1 || inner < 1) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (x == nullptr || y == nullptr || scale == nullptr) return cudaErrorInvalidValue;
  if (dtype == MLQ_FLOAT32) return mxk::minifloat_dtype<float>(elem, x, y, scale, n, channels, inner, stream);
  if (dtype == MLQ_FLOAT16) return mxk::minifloat_dtype<__half>(elem, x, y, scale, n, channels, inner, stream);
  return mxk::minifloat_dtype<__nv_bfloat16>(elem, x, y, scale, n, channels, inner, stream);
}
