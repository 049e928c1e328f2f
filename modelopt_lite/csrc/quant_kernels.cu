// modelopt_lite CUDA kernels: launch configuration and the extern "C" launchers (see quant_kernels_api.h).
//
// One grid-stride kernel template runs every elementwise op: each thread loads UNROLL 16-byte vectors before
// computing and storing them (memory-level parallelism), 64-bit indices throughout, a scalar tail (and a fully
// scalar path when a pointer is not 16-byte aligned). The math lives in quant_kernels.cuh.
//
// Built with -DMODELOPT_LITE_EMULATE_ON_HOST (by a host C++ compiler), the launchers run the very same kernel
// bodies on the CPU instead of launching: the test suite uses that to check the bodies and this file's dispatch
// bit for bit without a GPU.
#include "quant_kernels.cuh"
#include "quant_kernels_api.h"

namespace mlq {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kBlocksPerSm = 16;  // grid cap, in blocks per SM (grid-stride loops cover the rest)
constexpr int kHistThreads = 512;
constexpr int64_t kHistMaxPerBlock = int64_t{1} << 31;  // keeps the 32-bit shared-memory counters exact
constexpr int64_t kHistSmemBins = 12288;                 // 48 KiB of 32-bit counters
constexpr int kHistCopies = 4;                           // private copies of the bins per block (at most)
constexpr int kHistSpare = 32;                           // per-lane counters of the values with no bin

bool aligned16(const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

// One thread's share of the columns [begin, end) of one row: 16-byte vectors t, t + T, ... (two in flight) when
// `vec` (the row start 16-byte aligned, begin and end multiples of the vector), else elements t, t + T, ... Each
// value goes to count(b, counted), b unsigned (32-bit on the float32 path) and not a bin where `counted` is false,
// so that the device kernel can count without a branch per value. The device kernel and the host emulation both
// run this.
template <class T, bool F32, class Count>
MLQ_HD void hist_count(typename HistElem<T>::raw r, const HistGrid& g, const Count& count) {
  if constexpr (F32) {
    bool counted;
    const uint32_t b = grid_bin_f32(HistElem<T>::value_f32(r), g.inv_f32, g.nb_f32, counted);
    count(b, counted);
  } else {
    const int64_t b = grid_bin(HistElem<T>::value(r), g.inv, g.num_bins);
    count(static_cast<uint64_t>(b), b >= 0);
  }
}

template <class T, bool F32, class Count>
MLQ_HD void hist_share_as(const typename HistElem<T>::raw* xr, int64_t begin, int64_t end, bool vec, int64_t t,
                          int64_t T_, const HistGrid& g, const Count& count) {
  using R = typename HistElem<T>::raw;
  constexpr int V = 16 / static_cast<int>(sizeof(R));
  if (vec) {
    const int64_t ve = end / V;
    for (int64_t v = begin / V + t; v < ve; v += 2 * T_) {
      Pack16<R> p[2];
      p[0].u = load16(xr + v * V);
      const bool two = v + T_ < ve;
      if (two) p[1].u = load16(xr + (v + T_) * V);
MLQ_UNROLL
      for (int k = 0; k < 2; ++k) {
        if (k == 1 && !two) break;
MLQ_UNROLL
        for (int j = 0; j < V; ++j) hist_count<T, F32>(p[k].r[j], g, count);
      }
    }
    return;
  }
  for (int64_t j = begin + t; j < end; j += T_) hist_count<T, F32>(xr[j], g, count);
}

// The row's bins in float32 where that is exact (HistGrid::f32: one branch per row, not per value).
template <class T, class Count>
MLQ_HD void hist_share(const typename HistElem<T>::raw* xr, int64_t begin, int64_t end, bool vec, int64_t t,
                       int64_t T_, const HistGrid& g, const Count& count) {
  if (g.f32)
    hist_share_as<T, true>(xr, begin, end, vec, t, T_, g, count);
  else
    hist_share_as<T, false>(xr, begin, end, vec, t, T_, g, count);
}

#ifndef MODELOPT_LITE_EMULATE_ON_HOST
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <class Body>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(const Body body, int64_t nvec, int64_t n) {
  const int64_t tid = threadIdx.x;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t base = blockIdx.x * tile; base < nvec; base += static_cast<int64_t>(gridDim.x) * tile) {
    typename Body::In in[kUnroll];
MLQ_UNROLL
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t v = base + k * static_cast<int64_t>(blockDim.x) + tid;
      if (v < nvec) in[k] = body.load(v);
    }
MLQ_UNROLL
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t v = base + k * static_cast<int64_t>(blockDim.x) + tid;
      if (v < nvec) body.compute_store(v, in[k]);
    }
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = nvec * Body::VEC + blockIdx.x * static_cast<int64_t>(blockDim.x) + tid; i < n; i += stride)
    body.scalar(i);
}

// Adds 1 to the 32-bit shared-memory counter at shared address `at`, with no result: one instruction, where an
// `if (counted) atomicAdd(...)` per value compiles to a branch region (and recomputes the shared window's base in it).
__device__ __forceinline__ void shared_increment(uint32_t at) {
  asm volatile("red.shared.add.u32 [%0], 1;" ::"r"(at) : "memory");
}

// One block handles `chunk` columns of a row at a time (hist_share below), counting into kHistCopies private
// copies of 32-bit shared-memory bins (warp w counts into copy w % copies: fewer threads contend on one counter;
// at most 2**31 values per block and row, so they cannot overflow), then adds its non-zero bins to the int64 counts.
// A value with no bin counts into its lane's spare counter past the copies (kHistSpare of them, never read): the
// shared-memory count takes no branch, and the uncounted values of a warp hit 32 different banks.
template <class T>
__global__ void __launch_bounds__(kHistThreads)
    histogram_kernel(const typename HistElem<T>::raw* x, int64_t rows, int64_t cols, int64_t chunk,
                     const int64_t* exps, int64_t exp_all, int64_t num_bins, unsigned long long* counts,
                     int copies, bool vec) {
  extern __shared__ unsigned int bins[];
  const bool shared_counts = copies > 0;
  unsigned int* mine = bins + (shared_counts ? (threadIdx.x / 32) % copies : 0) * num_bins;
  const uint32_t mine_at = static_cast<uint32_t>(__cvta_generic_to_shared(mine));
  const uint32_t spare_at =
      static_cast<uint32_t>(__cvta_generic_to_shared(bins + copies * num_bins + threadIdx.x % kHistSpare));
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const HistGrid g = hist_grid<T>(exps != nullptr ? exps[row] : exp_all, num_bins);
    unsigned long long* row_counts = counts + row * num_bins;
    if (shared_counts) {
      for (int64_t b = threadIdx.x; b < num_bins * copies; b += blockDim.x) bins[b] = 0u;
      __syncthreads();
    }
    const int64_t begin = blockIdx.x * chunk;
    const int64_t end = begin + chunk < cols ? begin + chunk : cols;
    const auto* xr = x + row * cols;
    if (shared_counts)
      hist_share<T>(xr, begin, end, vec, threadIdx.x, blockDim.x, g, [&](auto b, bool counted) {
        shared_increment(counted ? mine_at + 4u * static_cast<uint32_t>(b) : spare_at);
      });
    else
      hist_share<T>(xr, begin, end, vec, threadIdx.x, blockDim.x, g, [&](auto b, bool counted) {
        if (counted) atomicAdd(&row_counts[b], 1ull);
      });
    if (shared_counts) {
      __syncthreads();
      for (int64_t b = threadIdx.x; b < num_bins; b += blockDim.x) {
        unsigned long long c = 0;
        for (int k = 0; k < copies; ++k) c += bins[k * num_bins + b];
        if (c != 0ull) atomicAdd(&row_counts[b], c);
      }
      __syncthreads();
    }
  }
}

int sm_count() {
  static int cached[256] = {};  // per device; a racy first fill writes the same value
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 256) return 132;
  if (cached[dev] == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 132;
    cached[dev] = sms;
  }
  return cached[dev];
}
#endif  // !MODELOPT_LITE_EMULATE_ON_HOST

template <class Body>
cudaError_t launch(const Body& body, int64_t n, bool aligned, cudaStream_t stream) {
  const int64_t nvec = aligned ? n / Body::VEC : 0;
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  run_on_host(body, nvec, n);
  return cudaSuccess;
#else
  const int64_t tail = n - nvec * Body::VEC;
  int64_t blocks = ceil_div(nvec, static_cast<int64_t>(kThreads) * kUnroll);
  if (ceil_div(tail, kThreads) > blocks) blocks = ceil_div(tail, kThreads);
  const int64_t cap = static_cast<int64_t>(sm_count()) * kBlocksPerSm;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  elementwise_kernel<Body><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(body, nvec, n);
  return cudaGetLastError();
#endif
}

struct Args {
  const void* x;
  void* y;
  const void* grad;
  float* term;
  const float* scale;
  const float* zp;
  float qmin, qmax;
  int64_t n;
  bool aligned;
  cudaStream_t stream;
  int* negative;  // forward ops: the unsigned-input flag, or null
};

template <class T, Fwd M, class Idx>
cudaError_t run_forward(const Args& a, const Idx& idx) {
  using R = typename Elem<T>::raw;
  FwdBody<T, M, Idx> body{static_cast<const R*>(a.x), a.y, a.scale, a.zp, a.qmin, a.qmax, idx, a.negative};
  return launch(body, a.n, a.aligned, a.stream);
}

template <class T, Bwd M, class Idx>
cudaError_t run_backward(const Args& a, const Idx& idx) {
  using R = typename Elem<T>::raw;
  BwdBody<T, M, Idx> body{static_cast<const R*>(a.grad), static_cast<const R*>(a.x), static_cast<R*>(a.y),
                          a.term, a.scale, a.zp, a.qmin, a.qmax, idx};
  return launch(body, a.n, a.aligned, a.stream);
}

// Layout dispatch: the Idx type is a template parameter of the body, so each layout gets its own kernel.
template <class T, Fwd M>
cudaError_t forward_layout(const Args& a, const Plan& p) {
  switch (p.kind) {
    case Layout::PerTensor:
      return run_forward<T, M>(a, PerTensorIdx{});
    case Layout::Channel:
      return run_forward<T, M>(a, channel_idx(p));
    default:
      return run_forward<T, M>(a, general_idx(p));
  }
}

template <class T, Bwd M>
cudaError_t backward_layout(const Args& a, const Plan& p) {
  switch (p.kind) {
    case Layout::PerTensor:
      return run_backward<T, M>(a, PerTensorIdx{});
    case Layout::Channel:
      return run_backward<T, M>(a, channel_idx(p));
    default:
      return run_backward<T, M>(a, general_idx(p));
  }
}

template <Fwd M>
cudaError_t forward_dtype(mlq_dtype dtype, const Args& a, const Plan& p) {
  switch (dtype) {
    case MLQ_FLOAT32:
      return forward_layout<float, M>(a, p);
    case MLQ_FLOAT16:
      return forward_layout<__half, M>(a, p);
    case MLQ_BFLOAT16:
      return forward_layout<__nv_bfloat16, M>(a, p);
    default:
      break;
  }
  return cudaErrorInvalidValue;
}

template <Bwd M>
cudaError_t backward_dtype(mlq_dtype dtype, const Args& a, const Plan& p) {
  switch (dtype) {
    case MLQ_FLOAT32:
      return backward_layout<float, M>(a, p);
    case MLQ_FLOAT16:
      return backward_layout<__half, M>(a, p);
    case MLQ_BFLOAT16:
      return backward_layout<__nv_bfloat16, M>(a, p);
    default:
      break;
  }
  return cudaErrorInvalidValue;
}

// Shared validation: a usable plan and the element count (returns false on a bad description).
bool describe(const mlq_broadcast* b, Plan* p, int64_t* n) {
  if (b == nullptr || b->ndim < 0 || b->ndim > MLQ_MAX_RANK) return false;
  int64_t count = 1;
  for (int d = 0; d < b->ndim; ++d) {
    if (b->sizes[d] < 0 || b->scale_strides[d] < 0) return false;
    if (b->sizes[d] == 0) count = 0;
    else if (count > INT64_MAX / b->sizes[d]) return false;
    else count *= b->sizes[d];
  }
  *n = count;
  return make_plan(b->ndim, b->sizes, b->scale_strides, p);
}

bool valid_dtype(mlq_dtype d) { return d == MLQ_FLOAT32 || d == MLQ_FLOAT16 || d == MLQ_BFLOAT16; }

}  // namespace
}  // namespace mlq

extern "C" int mlq_layout(const mlq_broadcast* bcast) {
  mlq::Plan p;
  int64_t n = 0;
  if (!mlq::describe(bcast, &p, &n)) return -1;
  return static_cast<int>(p.kind);
}

extern "C" cudaError_t mlq_forward(mlq_forward_op op, mlq_dtype dtype, const void* x, void* y, const float* scale,
                                   const float* zero_point, const mlq_broadcast* bcast, int qmin, int qmax,
                                   cudaStream_t stream) {
  return mlq_forward_unsigned(op, dtype, x, y, scale, zero_point, bcast, qmin, qmax, nullptr, stream);
}

extern "C" cudaError_t mlq_forward_unsigned(mlq_forward_op op, mlq_dtype dtype, const void* x, void* y,
                                            const float* scale, const float* zero_point, const mlq_broadcast* bcast,
                                            int qmin, int qmax, int* negative, cudaStream_t stream) {
  using namespace mlq;
  Plan p;
  int64_t n = 0;
  if (!valid_dtype(dtype) || !describe(bcast, &p, &n) || qmin > qmax) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const bool affine = op == MLQ_FAKE_AFFINE || op == MLQ_QUANTIZE_AFFINE;
  if (x == nullptr || y == nullptr || scale == nullptr || (affine && zero_point == nullptr))
    return cudaErrorInvalidValue;
  const Args a{x, y, nullptr, nullptr, scale, zero_point, static_cast<float>(qmin), static_cast<float>(qmax),
               n, aligned16(x) && aligned16(y), stream, negative};
  switch (op) {
    case MLQ_FAKE_QUANT_INT:
      return forward_dtype<Fwd::IntFake>(dtype, a, p);
    case MLQ_QUANTIZE_INT:
      return forward_dtype<Fwd::IntCodes>(dtype, a, p);
    case MLQ_FAKE_E4M3:
      return forward_dtype<Fwd::E4m3Fake>(dtype, a, p);
    case MLQ_FAKE_AFFINE:
      return forward_dtype<Fwd::AffineFake>(dtype, a, p);
    case MLQ_QUANTIZE_AFFINE:
      return forward_dtype<Fwd::AffineCodes>(dtype, a, p);
    default:
      break;
  }
  return cudaErrorInvalidValue;
}

extern "C" cudaError_t mlq_backward(mlq_backward_op op, mlq_dtype dtype, const void* grad, const void* x,
                                    void* grad_x, float* scale_term, const float* scale, const float* zero_point,
                                    const mlq_broadcast* bcast, int qmin, int qmax, cudaStream_t stream) {
  using namespace mlq;
  Plan p;
  int64_t n = 0;
  if (!valid_dtype(dtype) || !describe(bcast, &p, &n) || qmin > qmax) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const bool affine = op == MLQ_AFFINE_BACKWARD;
  if (grad == nullptr || x == nullptr || grad_x == nullptr || scale == nullptr || (affine && zero_point == nullptr) ||
      (affine && scale_term != nullptr))
    return cudaErrorInvalidValue;
  const bool aligned = aligned16(grad) && aligned16(x) && aligned16(grad_x) && aligned16(scale_term);
  const Args a{x, grad_x, grad, scale_term, scale, zero_point, static_cast<float>(qmin), static_cast<float>(qmax),
               n, aligned, stream, nullptr};
  switch (op) {
    case MLQ_INT_BACKWARD:
      return backward_dtype<Bwd::Int>(dtype, a, p);
    case MLQ_E4M3_BACKWARD:
      return backward_dtype<Bwd::E4m3>(dtype, a, p);
    case MLQ_AFFINE_BACKWARD:
      return backward_dtype<Bwd::Affine>(dtype, a, p);
    default:
      break;
  }
  return cudaErrorInvalidValue;
}

namespace mlq {
namespace {
template <class T>
cudaError_t histogram_typed(const void* x, int64_t rows, int64_t cols, const int64_t* exps, int64_t exp_all,
                            int64_t num_bins, int64_t* counts, cudaStream_t stream) {
  using R = typename HistElem<T>::raw;
  constexpr int64_t V = 16 / static_cast<int64_t>(sizeof(R));
  const R* xr = static_cast<const R*>(x);
  const bool vec = aligned16(x) && cols % V == 0;
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  const int64_t sms = 4;  // the device's grid for a small GPU: every row cut into chunks, each thread's share in order
#else
  const int64_t sms = sm_count();
#endif
  const int64_t grid_y = rows < 65535 ? rows : 65535;
  int64_t grid_x = (cols + kHistThreads * 16 - 1) / (kHistThreads * 16);
  const int64_t want_x = (sms * 8 + grid_y - 1) / grid_y;  // about 8 blocks per SM in all
  if (grid_x > want_x) grid_x = want_x;
  if (grid_x < (cols + kHistMaxPerBlock - 1) / kHistMaxPerBlock) grid_x = (cols + kHistMaxPerBlock - 1) / kHistMaxPerBlock;
  if (grid_x < 1) grid_x = 1;
  int64_t chunk = (cols + grid_x - 1) / grid_x;
  chunk = (chunk + V - 1) / V * V;  // whole vectors: every chunk of an aligned row starts aligned
  grid_x = (cols + chunk - 1) / chunk;
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  for (int64_t r = 0; r < rows; ++r) {
    const HistGrid g = hist_grid<T>(exps != nullptr ? exps[r] : exp_all, num_bins);
    int64_t* row_counts = counts + r * num_bins;
    for (int64_t bx = 0; bx < grid_x; ++bx) {
      const int64_t begin = bx * chunk, end = begin + chunk < cols ? begin + chunk : cols;
      for (int64_t t = 0; t < kHistThreads; ++t)
        hist_share<T>(xr + r * cols, begin, end, vec, t, kHistThreads, g,
                      [&](auto b, bool counted) {
                        if (counted) ++row_counts[b];
                      });
    }
  }
  return cudaSuccess;
#else
  int copies = num_bins <= kHistSmemBins ? static_cast<int>(kHistSmemBins / num_bins) : 0;
  if (copies > kHistCopies) copies = kHistCopies;
  const size_t smem = copies > 0 ? (static_cast<size_t>(copies) * static_cast<size_t>(num_bins) + kHistSpare) *
                                        sizeof(unsigned int)
                                  : 0;
  const dim3 grid(static_cast<unsigned int>(grid_x), static_cast<unsigned int>(grid_y));
  histogram_kernel<T><<<grid, kHistThreads, smem, stream>>>(xr, rows, cols, chunk, exps, exp_all, num_bins,
                                                            reinterpret_cast<unsigned long long*>(counts), copies,
                                                            vec);
  return cudaGetLastError();
#endif
}
}  // namespace
}  // namespace mlq

extern "C" cudaError_t mlq_histogram(mlq_dtype dtype, const void* x, int64_t rows, int64_t cols,
                                     const int64_t* exps, int64_t exp_all, int64_t num_bins, int64_t* counts,
                                     cudaStream_t stream) {
  using namespace mlq;
  if (rows < 0 || cols < 0 || num_bins < 1 || counts == nullptr || (rows > 0 && cols > 0 && x == nullptr))
    return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  switch (dtype) {
    case MLQ_FLOAT32:
      return histogram_typed<float>(x, rows, cols, exps, exp_all, num_bins, counts, stream);
    case MLQ_FLOAT16:
      return histogram_typed<__half>(x, rows, cols, exps, exp_all, num_bins, counts, stream);
    case MLQ_BFLOAT16:
      return histogram_typed<__nv_bfloat16>(x, rows, cols, exps, exp_all, num_bins, counts, stream);
    case MLQ_FLOAT64:
      return histogram_typed<double>(x, rows, cols, exps, exp_all, num_bins, counts, stream);
  }
  return cudaErrorInvalidValue;
}
