// modelopt_lite CUDA kernels of the real W8A8 paths (functional/library_real.py's ops): the activation codes of
// torch._scaled_mm (FP8 E4M3, static or dynamic scale) and torch._int_mm (INT8), and the _int_mm epilogue, each one
// pass over memory in one launch (a dynamic per-tensor FP8 scale: two, the amax needing every element first).
//
// Numerics: the float32 operations of library_real.py's pure-torch chains, in their order, each exactly rounded
// (quant_math.cuh: true division __fdiv_rn, no FMA contraction) except where the chain itself is a fused
// multiply-add (torch.addcmul is one on CPU and CUDA alike: fma(float(acc), scale, bias)):
//   FP8 static:   code = e4m3(clamp(x / d, -448, 448))
//   FP8 dynamic:  a = max |x| over the row / tensor (a NaN wins); s = a / 448, one float32 ulp down where s * 448
//                 overflows a finite a, 0 where a <= 2**-24 (scales.scale_from_amax); v = x / s, v = 0 where v is
//                 NaN or +-Inf (torch.nan_to_num: dead rows give +0 codes, NaN rows 0 codes and a NaN scale);
//                 code = e4m3(v)
//   INT8:         q = clamp(rint(x / d), qmin, qmax) - shift (a NaN: 0 - shift); padding rows 0
//   epilogue:     y = out(fma(float(acc), s_c, b_c)) or out(float(acc) * s_c), out() rounding to nearest even
// e4m3() is torch's float -> float8_e4m3fn cast (c10's algorithm: round to nearest even, |v| >= 480 and NaN give
// the NaN code 0x7F with v's sign), so the codes equal `tensor.to(torch.float8_e4m3fn)` bit for bit.
//
// The amax reduction is order-free (a max over |x| >= +0 where a NaN wins is commutative and associative), so
// the host emulation (MODELOPT_LITE_EMULATE_ON_HOST, tests) reduces serially and runs the same element functions.
#include <cmath>

#include "quant_math.cuh"
#include "real_kernels_api.h"

namespace mlr {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 20;  // grid-stride loops cover the rest
constexpr int64_t kPartialChunk = 8192;         // elements per CUDA block of the per-tensor amax pass
constexpr int64_t kMaxPartials = 1024;
constexpr int64_t kTensorGrid = 2048;  // CUDA blocks of the per-tensor cast pass (each re-reduces the partials)

MLQ_HD float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

MLQ_HD bool nonfinite(float v) { return (mlq::float_to_bits(v) & 0x7f800000u) == 0x7f800000u; }

// c10's fp8e4m3fn_from_fp32_value: torch's float32 -> float8_e4m3fn cast.
MLQ_HD uint8_t e4m3_code(float f) {
  constexpr uint32_t kFp8Max = 1087u << 20;     // 480: from here (and NaN) the NaN code
  constexpr uint32_t kDenormMask = 141u << 23;  // 2**14: adding it rounds a subnormal code into the low bits
  uint32_t bits = mlq::float_to_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= kFp8Max) {
    result = 0x7f;
  } else if (bits < (121u << 23)) {  // below 2**-6: E4M3 subnormals
    const uint32_t r = mlq::float_to_bits(mlq::add_rn(mlq::bits_to_float(bits), mlq::bits_to_float(kDenormMask)));
    result = static_cast<uint8_t>(r - kDenormMask);
  } else {
    const uint32_t odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu;
    bits += odd;
    result = static_cast<uint8_t>(bits >> 20);
  }
  return static_cast<uint8_t>(result | (sign >> 24));
}

// The running amax over |x| (a NaN wins) and its symmetric join.
MLQ_HD float amax_join(float a, float b) { return a != a ? a : ((b != b || b > a) ? b : a); }

// scales.scale_from_amax(a, 448) of one float32 amax.
MLQ_HD float dynamic_scale(float a) {
  float s = mlq::div_rn(a, 448.0f);
  const float end = mlq::mul_rn(s, 448.0f);
  if (nonfinite(end) && end == end && !nonfinite(a)) s = mlq::mul_rn(s, 0.99999994f);  // 1 - 2**-24
  return a <= 5.9604644775390625e-8f ? 0.0f : s;
}

template <class T>
MLQ_HD float load(const void* x, int64_t i) {
  return mlq::Elem<T>::to_float(static_cast<const typename mlq::Elem<T>::raw*>(x)[i]);
}

MLQ_HD uint8_t static_code(float x, float d) {
  return e4m3_code(mlq::clamp_keep_nan(mlq::div_rn(x, d), -448.0f, 448.0f));
}

MLQ_HD uint8_t dynamic_code(float x, float s) {
  const float v = mlq::div_rn(x, s);
  return e4m3_code(nonfinite(v) ? 0.0f : v);
}

MLQ_HD int8_t int8_code(float x, float d, float qmin, float qmax, float shift) {
  float q = mlq::clamp_keep_nan(mlq::rint_even(mlq::div_rn(x, d)), qmin, qmax);
  if (q != q) q = 0.0f;
  return static_cast<int8_t>(static_cast<int>(mlq::sub_rn(q, shift)));
}

template <class T>
MLQ_HD void epilogue_value(int32_t acc, const float* scale_row, const float* bias, void* y, int64_t i, int64_t c) {
  const float a = static_cast<float>(acc);  // int32 -> float32, round to nearest even (as torch's cast)
  const float r = bias != nullptr ? fma_rn(a, scale_row[c], bias[c]) : mlq::mul_rn(a, scale_row[c]);
  static_cast<typename mlq::Elem<T>::raw*>(y)[i] = mlq::Elem<T>::from_float(r);
}

// --- the work of one thread ------------------------------------------------------------------------------------
// A CUDA block handles tiles of kTile consecutive elements; thread t of the block takes elements t, t + 256, ...,
// t + 7 * 256 of a tile, loading all eight before computing any (eight independent loads in flight per thread: one
// element per thread and iteration kept ~2 KB in flight per SM, and the first H200 run measured the FP8 codes pass
// at ~10% of the memory bandwidth, 0.2 ms on a 4096 x 8192 bf16 input). A warp's loads of one step stay coalesced.
// The host emulation runs these same thread bodies for every (tile, thread), so the CPU tests cover the indexing.
constexpr int kUnroll = 8;
constexpr int64_t kTile = int64_t{kThreads} * kUnroll;

MLQ_HD int64_t tiles_for(int64_t n) { return (n + kTile - 1) / kTile; }

int64_t grid_for(int64_t tiles) { return tiles < 1 ? 1 : (tiles > kMaxGrid ? kMaxGrid : tiles); }

// The thread's values of the tile starting at `base` (elements < end; 0 elsewhere).
template <class T>
MLQ_HD void load_tile(const void* x, int64_t base, int64_t end, int tid, float (&v)[kUnroll]) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t i = base + int64_t{j} * kThreads + tid;
    v[j] = i < end ? load<T>(x, i) : 0.0f;
  }
}

// The codes of the thread's elements of the tile at `base`: code(x[i]) for i < end, 0 for end <= i < end_out (the
// padding rows of _int_mm's operand). Code: StaticCode / DynamicCode (E4M3, end_out = end) or Int8Code.
struct StaticCode {
  float d;
  MLQ_HD uint8_t operator()(float v) const { return static_code(v, d); }
};

struct DynamicCode {
  float s;
  MLQ_HD uint8_t operator()(float v) const { return dynamic_code(v, s); }
};

struct Int8Code {
  float d, qmin, qmax, shift;
  MLQ_HD int8_t operator()(float v) const { return int8_code(v, d, qmin, qmax, shift); }
};

template <class T, class Out, class Code>
MLQ_HD void codes_thread(const void* x, Out* codes, int64_t base, int64_t end, int64_t end_out, int tid, Code code) {
  float v[kUnroll];
  load_tile<T>(x, base, end, tid, v);
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t i = base + int64_t{j} * kThreads + tid;
    if (i < end_out) codes[i] = i < end ? code(v[j]) : Out{0};
  }
}

// The running amax of the thread over the tile at `base` (elements < end).
template <class T>
MLQ_HD float amax_thread(const void* x, int64_t base, int64_t end, int tid, float a) {
  float v[kUnroll];
  load_tile<T>(x, base, end, tid, v);
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) a = amax_join(a, fabsf(v[j]));  // padding 0s never win
  return a;
}

// Row r's columns [ct * kTile, (ct + 1) * kTile): int32 loads first, then the epilogue of each.
template <class T>
MLQ_HD void epilogue_thread(const int32_t* acc, const float* scale_row, const float* bias, void* y, int64_t r,
                            int64_t cols, int64_t ct, int tid) {
  int32_t a[kUnroll];
  const int64_t row = r * cols;
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t c = ct * kTile + int64_t{j} * kThreads + tid;
    a[j] = c < cols ? acc[row + c] : 0;
  }
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t c = ct * kTile + int64_t{j} * kThreads + tid;
    if (c < cols) epilogue_value<T>(a[j], scale_row, bias, y, row + c, c);
  }
}

#ifndef MODELOPT_LITE_EMULATE_ON_HOST
__device__ __forceinline__ float block_amax(float a) {
  __shared__ float warp_max[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) a = amax_join(a, __shfl_xor_sync(0xffffffffu, a, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = a;
  __syncthreads();
  a = warp_max[0];
  for (int w = 1; w < kThreads / 32; ++w) a = amax_join(a, warp_max[w]);
  __syncthreads();  // warp_max may be reused by the caller's next reduction
  return a;
}

template <class T>
__global__ void __launch_bounds__(kThreads) fp8_static_kernel(const void* x, uint8_t* codes, int64_t n,
                                                              const float* divisor) {
  const float d = __ldg(divisor);
  for (int64_t t = blockIdx.x; t < tiles_for(n); t += gridDim.x)
    codes_thread<T>(x, codes, t * kTile, n, n, threadIdx.x, StaticCode{d});
}

template <class T>
__global__ void __launch_bounds__(kThreads) fp8_row_kernel(const void* x, uint8_t* codes, float* scales,
                                                           int64_t rows, int64_t cols) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * cols, end = base + cols;
    float a = 0.0f;
    for (int64_t b = base; b < end; b += kTile) a = amax_thread<T>(x, b, end, threadIdx.x, a);
    const float s = dynamic_scale(block_amax(a));
    if (threadIdx.x == 0) scales[r] = s;
    for (int64_t b = base; b < end; b += kTile) codes_thread<T>(x, codes, b, end, end, threadIdx.x, DynamicCode{s});
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) amax_partials_kernel(const void* x, int64_t n, float* partials) {
  float a = 0.0f;
  for (int64_t t = blockIdx.x; t < tiles_for(n); t += gridDim.x) a = amax_thread<T>(x, t * kTile, n, threadIdx.x, a);
  a = block_amax(a);
  if (threadIdx.x == 0) partials[blockIdx.x] = a;
}

template <class T>
__global__ void __launch_bounds__(kThreads) fp8_tensor_kernel(const void* x, uint8_t* codes, float* scale, int64_t n,
                                                              const float* partials, int64_t nparts) {
  float a = 0.0f;
  for (int64_t p = threadIdx.x; p < nparts; p += kThreads) a = amax_join(a, partials[p]);
  const float s = dynamic_scale(block_amax(a));
  if (blockIdx.x == 0 && threadIdx.x == 0) scale[0] = s;
  for (int64_t t = blockIdx.x; t < tiles_for(n); t += gridDim.x)
    codes_thread<T>(x, codes, t * kTile, n, n, threadIdx.x, DynamicCode{s});
}

template <class T>
__global__ void __launch_bounds__(kThreads) int8_kernel(const void* x, int8_t* codes, int64_t n, int64_t n_out,
                                                        const float* divisor, float qmin, float qmax, float shift) {
  const float d = __ldg(divisor);
  for (int64_t t = blockIdx.x; t < tiles_for(n_out); t += gridDim.x)
    codes_thread<T>(x, codes, t * kTile, n, n_out, threadIdx.x, Int8Code{d, qmin, qmax, shift});
}

template <class T>
__global__ void __launch_bounds__(kThreads) epilogue_kernel(const int32_t* acc, const float* scale_row,
                                                            const float* bias, void* y, int64_t rows, int64_t cols) {
  // 2-D: blockIdx.y walks rows, blockIdx.x a row's column tiles (no per-element division)
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t ct = blockIdx.x; ct < tiles_for(cols); ct += gridDim.x)
      epilogue_thread<T>(acc, scale_row, bias, y, r, cols, ct, threadIdx.x);
}
#endif

// --- launchers (host emulation: every CUDA thread's body, tile by tile and thread by thread) ---------------------
template <class T>
cudaError_t fp8_static(const void* x, uint8_t* codes, int64_t n, const float* divisor, cudaStream_t stream) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  const float d = *divisor;
  for (int64_t t = 0; t < tiles_for(n); ++t)
    for (int tid = 0; tid < kThreads; ++tid) codes_thread<T>(x, codes, t * kTile, n, n, tid, StaticCode{d});
  return cudaSuccess;
#else
  fp8_static_kernel<T><<<static_cast<unsigned>(grid_for(tiles_for(n))), kThreads, 0, stream>>>(x, codes, n, divisor);
  return cudaGetLastError();
#endif
}

template <class T>
cudaError_t fp8_dynamic(bool per_row, const void* x, uint8_t* codes, float* scales, int64_t rows, int64_t cols,
                        float* partials, cudaStream_t stream) {
  const int64_t n = rows * cols;
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  (void)partials;
  const int64_t groups = per_row ? rows : 1, len = per_row ? cols : n;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t base = g * len, end = base + len;
    float a = 0.0f;
    for (int tid = 0; tid < kThreads; ++tid)
      for (int64_t b = base; b < end; b += kTile) a = amax_join(a, amax_thread<T>(x, b, end, tid, 0.0f));
    const float s = dynamic_scale(a);
    scales[g] = s;
    for (int64_t b = base; b < end; b += kTile)
      for (int tid = 0; tid < kThreads; ++tid) codes_thread<T>(x, codes, b, end, end, tid, DynamicCode{s});
  }
  return cudaSuccess;
#else
  if (per_row) {
    const int64_t grid = rows < kMaxGrid ? rows : kMaxGrid;
    fp8_row_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(x, codes, scales, rows, cols);
    return cudaGetLastError();
  }
  const int64_t parts = mlr_fp8_dynamic_partials(n);
  amax_partials_kernel<T><<<static_cast<unsigned>(parts), kThreads, 0, stream>>>(x, n, partials);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const int64_t tiles = grid_for(tiles_for(n));
  const int64_t grid = tiles < kTensorGrid ? tiles : kTensorGrid;
  fp8_tensor_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(x, codes, scales, n, partials, parts);
  return cudaGetLastError();
#endif
}

template <class T>
cudaError_t int8_codes(const void* x, int8_t* codes, int64_t n, int64_t n_out, const float* divisor, float qmin,
                       float qmax, float shift, cudaStream_t stream) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  const float d = *divisor;
  for (int64_t t = 0; t < tiles_for(n_out); ++t)
    for (int tid = 0; tid < kThreads; ++tid)
      codes_thread<T>(x, codes, t * kTile, n, n_out, tid, Int8Code{d, qmin, qmax, shift});
  return cudaSuccess;
#else
  const unsigned grid = static_cast<unsigned>(grid_for(tiles_for(n_out)));
  int8_kernel<T><<<grid, kThreads, 0, stream>>>(x, codes, n, n_out, divisor, qmin, qmax, shift);
  return cudaGetLastError();
#endif
}

template <class T>
cudaError_t epilogue(const int32_t* acc, const float* scale_row, const float* bias, void* y, int64_t rows,
                     int64_t cols, cudaStream_t stream) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t ct = 0; ct < tiles_for(cols); ++ct)
      for (int tid = 0; tid < kThreads; ++tid) epilogue_thread<T>(acc, scale_row, bias, y, r, cols, ct, tid);
  return cudaSuccess;
#else
  const int64_t gx = grid_for(tiles_for(cols));
  const int64_t gy = rows < 65535 ? rows : 65535;
  epilogue_kernel<T><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, 0, stream>>>(
      acc, scale_row, bias, y, rows, cols);
  return cudaGetLastError();
#endif
}

bool bad_dtype(mlq_dtype d) { return d != MLQ_FLOAT32 && d != MLQ_FLOAT16 && d != MLQ_BFLOAT16; }

}  // namespace mlr

#define MLR_DISPATCH(dtype, fn, ...)                                                 \
  ((dtype) == MLQ_FLOAT32   ? mlr::fn<float>(__VA_ARGS__)                            \
   : (dtype) == MLQ_FLOAT16 ? mlr::fn<__half>(__VA_ARGS__)                           \
                            : mlr::fn<__nv_bfloat16>(__VA_ARGS__))

extern "C" cudaError_t mlr_fp8_static(mlq_dtype dtype, const void* x, uint8_t* codes, int64_t n,
                                      const float* divisor, cudaStream_t stream) {
  if (mlr::bad_dtype(dtype) || n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (x == nullptr || codes == nullptr || divisor == nullptr) return cudaErrorInvalidValue;
  return MLR_DISPATCH(dtype, fp8_static, x, codes, n, divisor, stream);
}

extern "C" int64_t mlr_fp8_dynamic_partials(int64_t n) {
  const int64_t p = (n + mlr::kPartialChunk - 1) / mlr::kPartialChunk;
  return p < 1 ? 1 : (p > mlr::kMaxPartials ? mlr::kMaxPartials : p);
}

extern "C" cudaError_t mlr_fp8_dynamic(mlq_dtype dtype, int per_row, const void* x, uint8_t* codes, float* scales,
                                       int64_t rows, int64_t cols, float* partials, cudaStream_t stream) {
  if (mlr::bad_dtype(dtype) || rows < 0 || cols < 0) return cudaErrorInvalidValue;
  if (scales == nullptr || (!per_row && partials == nullptr)) return cudaErrorInvalidValue;
  if (rows == 0 || (cols == 0 && per_row)) return cudaSuccess;
  if (cols == 0) return cudaErrorInvalidValue;  // per tensor: the caller writes the scale of an empty tensor
  if (x == nullptr || codes == nullptr) return cudaErrorInvalidValue;
  return MLR_DISPATCH(dtype, fp8_dynamic, per_row != 0, x, codes, scales, rows, cols, partials, stream);
}

extern "C" cudaError_t mlr_int8_codes(mlq_dtype dtype, const void* x, int8_t* codes, int64_t rows, int64_t rows_out,
                                      int64_t cols, const float* divisor, float qmin, float qmax, float shift,
                                      cudaStream_t stream) {
  if (mlr::bad_dtype(dtype) || rows < 0 || rows_out < rows || cols < 0 || !(qmin <= qmax)) return cudaErrorInvalidValue;
  if (rows_out == 0 || cols == 0) return cudaSuccess;
  if (codes == nullptr || divisor == nullptr || (rows > 0 && x == nullptr)) return cudaErrorInvalidValue;
  return MLR_DISPATCH(dtype, int8_codes, x, codes, rows * cols, rows_out * cols, divisor, qmin, qmax, shift, stream);
}

extern "C" cudaError_t mlr_int_mm_epilogue(mlq_dtype dtype, const int32_t* acc, const float* scale_row,
                                           const float* bias, void* y, int64_t rows, int64_t cols,
                                           cudaStream_t stream) {
  if (mlr::bad_dtype(dtype) || rows < 0 || cols < 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (acc == nullptr || scale_row == nullptr || y == nullptr) return cudaErrorInvalidValue;
  return MLR_DISPATCH(dtype, epilogue, acc, scale_row, bias, y, rows, cols, stream);
}
