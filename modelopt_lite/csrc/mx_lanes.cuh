// The work distribution of the blocked CUDA kernels (pure CUDA, no torch headers): consecutive threads ("lanes")
// read consecutive 16-byte vectors, and the lanes of one quantization block reduce its amax together with warp
// shuffles (__shfl_xor_sync butterflies within the group).
//
// A quantization block of B elements (along the last axis of a row-major [rows, cols] tensor; the last block of a
// row may be partial) is handled by G lanes (G a power of two <= 32, so a group never straddles a warp), each lane
// owning P vectors of N = 16 / sizeof(T) elements: vector p of lane l starts at element (p * G + l) * N of the block,
// so one warp instruction reads 512 contiguous bytes. 16-byte loads and stores when every vector is whole and
// aligned (`vec`: every pointer 16-byte aligned and cols % N == 0 or a single row), else element loads over the same
// mapping (a misaligned view or a partial vector). Elements past a block's end read as +0.0 (they never change an
// amax) and are never written.
//
// Every Op is built twice (its FULL template parameter, carried by its Lane state): FULL when the layout is `full`
// (`vec` and every block whole, the common case), whose lanes load and store whole vectors with no length checks and
// find a block's start by a shift; the general build for the rest. The launchers pick one per call.
//
// An Op supplies the per-lane work in two phases around the group reduction:
//   float load(int64_t slot, Lane& st) const     read the lane's elements, return its partial amax
//   void finish(int64_t slot, Lane& st, float a) const   a = the group's amax: quantize and store
// and `int64_t slots() const` (groups * G), `int lanes() const` (G) and `kPrefetch16` (whether
// MLQ_MX_PREFETCH_16BIT prefetches for it). The reduction is mxe::amax_join (a NaN wins).
//
// A lane keeps its elements as loaded (Packs: T's bits), so a 2-byte type holds 8 elements in 4 registers while the
// lane waits for the reduction (bf16 MX E4M3: 32 registers instead of 48, full occupancy).
//
// Built with MODELOPT_LITE_EMULATE_ON_HOST, run_lanes executes the same two phases on the host one warp at a time,
// the 32 lanes in order, with each shuffle emulated as the lanes' values exchanged (b[l] = a[l ^ offset] from a
// snapshot): the CPU tests then check the very work distribution the GPU runs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "mx_elem.h"
#include "mx_kernels_api.h" /* the MLQ_MX_* variants */

namespace mxk {

#if defined(__CUDACC__)
#define MXK_HD __host__ __device__ __forceinline__
#define MXK_UNROLL _Pragma("unroll")
#else
#define MXK_HD inline
#define MXK_UNROLL
#endif

// One float32 scalar from global memory (read-only cache on the GPU), shared by the MX and block kernels.
MXK_HD float load_scalar(const float* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

constexpr int kThreads = 256;  // threads per CUDA block (a multiple of 32)
constexpr int kWarp = 32;
constexpr int kBlocksPerSm = 16;  // grid cap per SM (grid-stride loops cover the rest)

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

template <class T>
struct VecOf {
  static constexpr int N = 16 / static_cast<int>(sizeof(T));
};

template <class T>
union Pack {
  uint4 u;
  T t[VecOf<T>::N];
};

// N elements at p as float32: one 16-byte load when `vec`, else element loads of the first m (the rest +0.0).
template <class T>
MXK_HD void load_vec(const T* p, int m, bool vec, float* v) {
  constexpr int N = VecOf<T>::N;
  if (vec) {
    Pack<T> pk;
#ifdef __CUDA_ARCH__
    pk.u = __ldg(reinterpret_cast<const uint4*>(p));
#else
    memcpy(&pk.u, p, sizeof pk.u);
#endif
MXK_UNROLL
    for (int j = 0; j < N; ++j) v[j] = Conv<T>::to(pk.t[j]);
    return;
  }
MXK_UNROLL
  for (int j = 0; j < N; ++j) v[j] = j < m ? Conv<T>::to(p[j]) : 0.0f;
}

// The N elements at p as T's bits (a Pack): one 16-byte load when `vec`, else element loads of the first m (the
// rest +0.0).
template <class T>
MXK_HD void load_pack(const T* p, int m, bool vec, Pack<T>& pk) {
  constexpr int N = VecOf<T>::N;
  if (vec) {
#ifdef __CUDA_ARCH__
    pk.u = __ldg(reinterpret_cast<const uint4*>(p));
#else
    memcpy(&pk.u, p, sizeof pk.u);
#endif
    return;
  }
MXK_UNROLL
  for (int j = 0; j < N; ++j) pk.t[j] = j < m ? p[j] : Conv<T>::from(0.0f);
}

// The first m elements of a Pack to p: one 16-byte store when `vec` (m == N).
template <class T>
MXK_HD void store_pack(T* p, int m, bool vec, const Pack<T>& pk) {
  constexpr int N = VecOf<T>::N;
  if (vec) {
#ifdef __CUDA_ARCH__
    *reinterpret_cast<uint4*>(p) = pk.u;
#else
    memcpy(static_cast<void*>(p), &pk.u, sizeof pk.u);
#endif
    return;
  }
  for (int j = 0; j < N && j < m; ++j) p[j] = pk.t[j];
}

// A lane's P vectors as they are in memory (T's bits, 16 bytes each): a 2-byte type keeps 8 elements in 4
// registers instead of 8 float32 ones while the lane waits for its group's amax. get(j) is element j as float32
// (exact); set(j, v) rounds v to T (round to nearest even), the conversion the store made when the lane held
// float32.
template <class T, int P>
struct Packs {
  static constexpr int N = VecOf<T>::N;
  Pack<T> pk[P];
  MXK_HD float get(int j) const { return Conv<T>::to(pk[j / N].t[j % N]); }
  MXK_HD void set(int j, float v) { pk[j / N].t[j % N] = Conv<T>::from(v); }
};

// max of two partial amaxes (each >= 0 or NaN, sign bit clear); a NaN wins, as in mxe::amax_step.
MXK_HD float amax_join(float a, float b) { return mxe::amax_join_bits(a, b); }

// The process-wide work-distribution variant (mlq_mx_set_variant, bits MLQ_MX_*): one instance for every file of
// the extension (an inline variable). The variants change the speed, never a result.
inline std::atomic<int> g_variant{MLQ_MX_VARIANT_DEFAULT};
inline int variant() { return g_variant.load(std::memory_order_relaxed); }
// Whether the 16-bit kernels divide through the scale's reciprocal (mx_elem.h fdiv_rcp): not MLQ_MX_TRUE_DIVISION.
inline bool reciprocal_division() { return (variant() & MLQ_MX_TRUE_DIVISION) == 0; }

// Blocked layout: rows x cols, blocks of `block` along each row, `lanes` lanes of P vectors per block.
// `whole`: `block` is a power of two (it always is here: 16 or 32 for NVFP4/MX, N * 2**k for the integer/E4M3
// blocks, N for the elementwise ops) and every row is a whole number of blocks, or there is a single row. where()
// then finds a block's start by a shift, without the 64-bit division by the blocks per row.
// `full`: `vec` and every block whole (cols a multiple of block): the launchers then run the kernels built with
// FULL = true, whose lanes load and store whole 16-byte vectors with no length checks and no partial-block code.
struct Layout {
  int64_t rows, cols, nbr;  // nbr: blocks per row
  int block, block_shift, lanes, lane_shift;
  bool vec, whole, full;
};

inline int log2_exact(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

// lanes = min(32, block / N) (block / N a power of two), P = block / (N * lanes). `vec` as described above.
template <class T>
Layout make_layout(int64_t rows, int64_t cols, int block, bool aligned) {
  constexpr int N = VecOf<T>::N;
  Layout L;
  L.rows = rows;
  L.cols = cols;
  L.block = block;
  L.block_shift = log2_exact(block);
  L.nbr = (cols + block - 1) / block;
  L.whole = (block & (block - 1)) == 0 && (rows == 1 || cols % block == 0);
  const int per = block / N > 0 ? block / N : 1;
  L.lanes = per < kWarp ? per : kWarp;
  L.lane_shift = log2_exact(L.lanes);
  L.vec = aligned && block % N == 0 && (rows == 1 || cols % N == 0);
  L.full = L.vec && L.whole && cols % block == 0;
  return L;
}

// The layout with `lanes` lanes per block (a power of two dividing make_layout's), each holding P = block / (N *
// lanes) vectors: the variants that give a lane more of a block (fewer lanes to reduce over, the per-block work done
// by fewer lanes).
inline Layout with_lanes(Layout L, int lanes) {
  L.lanes = lanes;
  L.lane_shift = log2_exact(lanes);
  return L;
}

inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Where a lane's elements are: the block's first element, the block's length m, and the lane index.
struct Where {
  int64_t b, off;
  int m, lane;
};

// Where lane `slot` works. FULL (a `full` layout): every block whole, so a block's start is a shift and its length
// `block`. Otherwise, without partial blocks inside the tensor (L.whole), block b still starts at b * block and only
// a single row's last block can be short; with them, the 64-bit division by the blocks per row (a ~60-instruction
// software routine on the GPU, more than the element math of a whole 16-byte vector).
template <bool FULL>
MXK_HD Where where(const Layout& L, int64_t slot) {
  Where w;
  w.b = slot >> L.lane_shift;
  w.lane = static_cast<int>(slot & (L.lanes - 1));
  if (FULL) {
    w.off = w.b << L.block_shift;
    w.m = L.block;
    return w;
  }
  int64_t left;
  if (L.whole) {
    w.off = w.b << L.block_shift;
    left = L.rows * L.cols - w.off;
  } else {
    const int64_t row = w.b / L.nbr, j = w.b - row * L.nbr;
    w.off = row * L.cols + j * L.block;
    left = L.cols - j * L.block;
  }
  w.m = left < L.block ? static_cast<int>(left) : L.block;
  return w;
}

// The lane's P vectors of x (float32, padded with +0.0) and its partial amax. FULL: the layout is `full` (the
// lane's vectors are all whole and 16-byte aligned).
template <class T, int P, bool FULL>
struct Lane {
  static constexpr int N = VecOf<T>::N;
  Packs<T, P> v;
  Where w;
};

// The backward ops' lane state: the incoming gradient's elements at the lane's places too, read in the load phase
// with x, so that both loads of a slot are in flight together (read after the reduction, they would wait for it).
template <class T, int P, bool FULL>
struct GradLane : Lane<T, P, FULL> {
  Packs<T, P> g;
};

// Element index (within the block) of vector p of lane `lane` for a group of `lanes` lanes.
template <class T>
MXK_HD int vec_start(int p, int lane, int lanes) {
  return (p * lanes + lane) * VecOf<T>::N;
}

// The lane's P vectors of `src` at its places into `out` (+0.0 past the block's end). FULL: the layout is `full`
// (the lane's vectors are all whole and 16-byte aligned).
template <class T, int P, bool FULL>
MXK_HD void load_packs(const T* src, const Layout& L, const Where& w, Packs<T, P>& out) {
  constexpr int N = VecOf<T>::N;
MXK_UNROLL
  for (int p = 0; p < P; ++p) {
    const int e = vec_start<T>(p, w.lane, L.lanes);
    const int m = w.m - e;
    if (FULL || m > 0) {  // FULL: every vector whole and aligned (m >= N, L.vec), known at compile time
      load_pack<T>(src + w.off + e, FULL ? N : m, FULL || (L.vec && m >= N), out.pk[p]);
    } else {
MXK_UNROLL
      for (int j = 0; j < N; ++j) out.pk[p].t[j] = Conv<T>::from(0.0f);
    }
  }
}

// Where lane `slot` works, its elements of x, and its partial amax.
template <class T, int P, bool FULL>
MXK_HD float load_lane(const T* x, const Layout& L, int64_t slot, Lane<T, P, FULL>& st) {
  st.w = where<FULL>(L, slot);
  load_packs<T, P, FULL>(x, L, st.w, st.v);
  float a = 0.0f;
MXK_UNROLL
  for (int j = 0; j < P * VecOf<T>::N; ++j) a = mxe::amax_step(a, st.v.get(j));
  return a;
}

template <class T, int P, bool FULL>
MXK_HD void store_lane(T* y, const Layout& L, const Lane<T, P, FULL>& st) {
  constexpr int N = VecOf<T>::N;
MXK_UNROLL
  for (int p = 0; p < P; ++p) {
    const int e = vec_start<T>(p, st.w.lane, L.lanes);
    const int m = st.w.m - e;
    if (FULL || m > 0) store_pack<T>(y + st.w.off + e, FULL ? N : m, FULL || (L.vec && m >= N), st.v.pk[p]);
  }
}

// load_lane, and the gradient's elements at the same places (the backward ops' load phase).
template <class T, int P, bool FULL>
MXK_HD float load_lane_grad(const T* x, const T* grad, const Layout& L, int64_t slot, GradLane<T, P, FULL>& st) {
  const float a = load_lane(x, L, slot, st);
  load_packs<T, P, FULL>(grad, L, st.w, st.g);
  return a;
}

// The lane state of an op: the backward ops carry the gradient's elements too.
template <class T, int P, bool BWD, bool FULL>
using OpLane = typename std::conditional<BWD, GradLane<T, P, FULL>, Lane<T, P, FULL>>::type;

template <class T, int P, bool BWD, bool FULL>
MXK_HD float load_op_lane(const T* x, const T* grad, const Layout& L, int64_t slot, OpLane<T, P, BWD, FULL>& st) {
  if constexpr (BWD) {
    return load_lane_grad(x, grad, L, slot, st);
  } else {
    (void)grad;
    return load_lane(x, L, slot, st);
  }
}

// MLQ_MX_PREFETCH_ALL / MLQ_MX_PREFETCH_16BIT (the ops whose kPrefetch16 is true): an L2 prefetch of a lane's
// 16-byte vectors (x, and the gradient for the backward ops), issued one grid-stride tile ahead so that the next
// tile's reads are in flight while this one computes, holding no registers. FULL layouts only (every vector whole, a
// block's start a shift); nothing on the host.
template <class T, int P, bool FULL>
MXK_HD void prefetch_lane(const T* x, const Layout& L, int64_t slot) {
#ifdef __CUDA_ARCH__
  if constexpr (FULL) {
    const Where w = where<FULL>(L, slot);
MXK_UNROLL
    for (int p = 0; p < P; ++p) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(x + w.off + vec_start<T>(p, w.lane, L.lanes)));
    }
  }
#else
  (void)x;
  (void)L;
  (void)slot;
#endif
}

template <class T, int P, bool BWD, bool FULL>
MXK_HD void prefetch_op_lane(const T* x, const T* grad, const Layout& L, int64_t slot) {
  prefetch_lane<T, P, FULL>(x, L, slot);
  if constexpr (BWD) prefetch_lane<T, P, FULL>(grad, L, slot);
}

// *flag |= value (atomically on the device; flags are only ever set, so the order of the writers does not matter).
MXK_HD void flag_set(int* flag, int value) {
  if (flag == nullptr) return;
#ifdef __CUDA_ARCH__
  atomicOr(flag, value);
#else
  *flag |= value;
#endif
}

#ifndef MODELOPT_LITE_EMULATE_ON_HOST

// One thread's work of lanes_kernel: its U slots per grid-stride tile, loads, the block reduction by shuffles, finish.
template <class Op, int U>
__device__ __forceinline__ void lanes_thread(const Op& op, const bool prefetch) {
  const int64_t slots = op.slots();
  const int lanes = op.lanes();
  const int64_t tile = static_cast<int64_t>(blockDim.x) * U;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * tile;
  for (int64_t base = blockIdx.x * tile; base < slots; base += stride) {
    if (prefetch) {  // the next tile of this thread block (prefetch_of)
MXK_UNROLL
      for (int u = 0; u < U; ++u) {
        const int64_t slot = base + stride + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
        if (slot < slots) op.prefetch(slot);
      }
    }
    typename Op::State st[U];
    float a[U];
MXK_UNROLL
    for (int u = 0; u < U; ++u) {
      const int64_t slot = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      a[u] = slot < slots ? op.load(slot, st[u]) : 0.0f;
    }
MXK_UNROLL
    for (int u = 0; u < U; ++u) {
      for (int o = lanes >> 1; o > 0; o >>= 1) a[u] = amax_join(a[u], __shfl_xor_sync(0xffffffffu, a[u], o));
    }
MXK_UNROLL
    for (int u = 0; u < U; ++u) {
      const int64_t slot = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (slot < slots) op.finish(slot, st[u], a[u]);
    }
  }
}

template <class Op, int U>
__global__ void __launch_bounds__(kThreads) lanes_kernel(const Op op, const bool prefetch) {
  lanes_thread<Op, U>(op, prefetch);
}

// The same kernel compiled to hold B thread blocks of kThreads per multiprocessor, for the ops that set kMinBlocks
// (registers capped at 65536 / (B * kThreads)): the 16-bit block kernels with two element loops (the division through
// a reciprocal and its fallback) and the 16-bit elementwise E4M3/E5M2/E2M1 kernel take 36 registers otherwise (B = 8:
// 32, full occupancy), the 16-bit NVFP4 kernel of one lane per block 53 (B = 5: 48, 5 blocks instead of 4); none
// spills so (bench/sass_hot_path.py). A cap that makes a kernel spill is not worth it (bench/REPORT.md).
template <class Op, int U, int B>
__global__ void __launch_bounds__(kThreads, B) lanes_kernel_min_blocks(const Op op, const bool prefetch) {
  lanes_thread<Op, U>(op, prefetch);
}

template <class Op, class = void>
struct MinBlocks : std::integral_constant<int, 0> {};
template <class Op>
struct MinBlocks<Op, std::void_t<decltype(Op::kMinBlocks)>> : std::integral_constant<int, Op::kMinBlocks> {};

template <class Op, int U>
constexpr auto lanes_kernel_of() {
  if constexpr (MinBlocks<Op>::value > 0) {
    return &lanes_kernel_min_blocks<Op, U, MinBlocks<Op>::value>;
  } else {
    return &lanes_kernel<Op, U>;
  }
}

// The thread blocks of the kernel one multiprocessor holds at once (the occupancy calculator, kThreads threads, no
// dynamic shared memory), computed once per kernel (one GPU architecture per process is assumed); kBlocksPerSm when
// the calculator fails.
template <class Op, int U>
int resident_blocks() {
  static const int cached = [] {
    int n = 0;
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, lanes_kernel_of<Op, U>(), kThreads, 0);
    if (e != cudaSuccess || n <= 0) {
      (void)cudaGetLastError();
      return kBlocksPerSm;
    }
    return n;
  }();
  return cached;
}

inline int sm_count() {
  static int cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (cached[dev] == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 132;
    cached[dev] = sms;
  }
  return cached[dev];
}
#endif

// Whether the kernel of Op prefetches its next tile under the variant v.
template <class Op>
bool prefetch_of(int v) {
  return (v & MLQ_MX_PREFETCH_ALL) != 0 || (Op::kPrefetch16 && (v & MLQ_MX_PREFETCH_16BIT) != 0);
}

// Launch (or, host-emulated, run warp by warp) the two phases of `op` over all its slots, U slots per thread.
template <int U, class Op>
cudaError_t run_lanes(const Op& op, cudaStream_t stream) {
  const int64_t slots = op.slots();
  if (slots <= 0) return cudaSuccess;
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  (void)stream;
  const int lanes = op.lanes();
  const int64_t tile = static_cast<int64_t>(kThreads) * U;
  for (int64_t base = 0; base < slots; base += tile) {
    for (int u = 0; u < U; ++u) {
      for (int warp = 0; warp < kThreads / kWarp; ++warp) {
        const int64_t first = base + u * static_cast<int64_t>(kThreads) + warp * kWarp;
        if (first >= slots) break;
        typename Op::State st[kWarp];
        float a[kWarp], b[kWarp];
        for (int l = 0; l < kWarp; ++l) a[l] = first + l < slots ? op.load(first + l, st[l]) : 0.0f;
        for (int o = lanes >> 1; o > 0; o >>= 1) {  // __shfl_xor_sync(full mask, a, o) on every lane at once
          for (int l = 0; l < kWarp; ++l) b[l] = a[l];
          for (int l = 0; l < kWarp; ++l) a[l] = amax_join(b[l], b[l ^ o]);
        }
        for (int l = 0; l < kWarp; ++l) {
          if (first + l < slots) op.finish(first + l, st[l], a[l]);
        }
      }
    }
  }
  return cudaSuccess;
#else
  const int64_t tile = static_cast<int64_t>(kThreads) * U;
  int64_t grid = (slots + tile - 1) / tile;
  const int per_sm = (variant() & MLQ_MX_ONE_WAVE) ? resident_blocks<Op, U>() : kBlocksPerSm;
  const int64_t cap = static_cast<int64_t>(sm_count()) * per_sm;
  if (grid > cap) grid = cap;
  if (grid < 1) grid = 1;
  lanes_kernel_of<Op, U>()<<<static_cast<unsigned int>(grid), kThreads, 0, stream>>>(op, prefetch_of<Op>(variant()));
  return cudaGetLastError();
#endif
}

}  // namespace mxk
