/* modelopt_lite CUDA kernels of the 4-bit and microscaling formats: the plain C launcher API (see mx_kernels.cu).
 *
 * x is dense, contiguous, row-major: `rows` rows of `cols` elements for the blocked ops, blocks of `block` along
 * each row (the last one may be partial). Every launcher validates its arguments (cudaErrorInvalidValue), does
 * nothing for 0 elements, launches asynchronously on `stream` and returns the launch status. `nonfinite` (device
 * memory, zeroed by the caller, may be NULL) is set to 1 when a block amax is NaN or Inf: the caller rejects the
 * input (the reference raises ValueError). Element math: mx_elem.h (shared with the CPU kernels).
 */
#ifndef MODELOPT_LITE_MX_KERNELS_API_H_
#define MODELOPT_LITE_MX_KERNELS_API_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "quant_kernels_api.h" /* mlq_dtype */

#ifdef __cplusplus
extern "C" {
#endif

/* NVFP4 fake quant: per block s = e4m3(min(amax / (6 gs), 448)), y = e2m1(x / (s gs)) * (s gs); gs == 0 or s == 0:
 * +0. block 16 or 32. scales (float32, rows x ceil(cols / block)) receives s when not NULL. global_scale: ONE
 * float32 in device memory (read by the kernel: no host synchronization); a negative, NaN or Inf value sets bit 2
 * of *nonfinite (a NaN/Inf block amax sets bit 1). */
cudaError_t mlq_fake_nvfp4(mlq_dtype dtype, const void* x, void* y, float* scales, int64_t rows, int64_t cols,
                           int block, const float* global_scale, int* nonfinite, cudaStream_t stream);

/* The straight-through gradient of mlq_fake_nvfp4: grad_x = grad where |x| <= 6 s gs (its block's range), else
 * grad * 0. grad, x and grad_x share dtype and shape. */
cudaError_t mlq_nvfp4_backward(mlq_dtype dtype, const void* grad, const void* x, void* grad_x, int64_t rows,
                               int64_t cols, int block, const float* global_scale, int* nonfinite,
                               cudaStream_t stream);

/* mlq_fake_nvfp4 and mlq_nvfp4_backward with the global scale computed by the kernel from `amax`, ONE float32 in
 * device memory: gs = amax / 2688 (true division), +0 where amax <= 2**-24 (microscaling.nvfp4_global_scale); an
 * amax that is negative, NaN or Inf sets bit 2 of *nonfinite. No block scales are returned. */
cudaError_t mlq_fake_nvfp4_amax(mlq_dtype dtype, const void* x, void* y, int64_t rows, int64_t cols, int block,
                                const float* amax, int* nonfinite, cudaStream_t stream);
cudaError_t mlq_nvfp4_backward_amax(mlq_dtype dtype, const void* grad, const void* x, void* grad_x, int64_t rows,
                                    int64_t cols, int block, const float* amax, int* nonfinite, cudaStream_t stream);

/* OCP MX fake quant: per block X = 2**k (k from the block amax, floor or rceil, clamped to [-127, 127]),
 * y = elem(x / X) * X; elem 0..3 = e4m3, e5m2, e2m1, int8; block 32. exps (float32 k) when not NULL. */
cudaError_t mlq_fake_mx(mlq_dtype dtype, int elem, int rceil, const void* x, void* y, float* exps, int64_t rows,
                        int64_t cols, int block, int* nonfinite, cudaStream_t stream);

/* The straight-through gradient of mlq_fake_mx: grad_x = grad where |x| <= elem_max * 2**k, else grad * 0. */
cudaError_t mlq_mx_backward(mlq_dtype dtype, int elem, int rceil, const void* grad, const void* x, void* grad_x,
                            int64_t rows, int64_t cols, int block, int* nonfinite, cudaStream_t stream);

/* Elementwise E4M3 / E5M2 / E2M1 (elem 0 / 1 / 2): y = elem(x / s) * s, 0 where s == 0. Element i uses
 * scale[(i / inner) % channels] (channels = 1: per tensor; channels = n, inner = 1: one scale per element). */
cudaError_t mlq_fake_minifloat(mlq_dtype dtype, int elem, const void* x, void* y, const float* scale, int64_t n,
                               int64_t channels, int64_t inner, cudaStream_t stream);

/* Dynamic block quantization along the last axis, fused (block_kernels.cu): per block of `block` elements
 * s = scale_from_amax(block amax, bound), integer y = clamp(rint(x / s), qmin, qmax) * s or (e4m3 != 0)
 * y = e4m3(clamp(x / s, -448, 448)) * s; with grad != NULL the straight-through gradient instead (grad where
 * qmin s <= x <= qmax s, E4M3: -448 s .. 448 s). Supported block sizes: mlq_dynamic_block_supported.
 * Double quantization: scale_kind 1 (unsigned integer scale codes 0..scale_qmax) or 2 (E4M3 scale codes), with
 * scale_bound the scales' bound and amax_scratch one float32 of device memory set to +0 by the caller (it receives
 * the tensor's amax: a first read of x). scale_kind 0: none. */
int mlq_dynamic_block_supported(mlq_dtype dtype, int64_t block);
cudaError_t mlq_dynamic_block(mlq_dtype dtype, int e4m3, const void* grad, const void* x, void* y, int64_t rows,
                              int64_t cols, int block, float bound, float qmin, float qmax, int scale_kind,
                              float scale_bound, float scale_qmax, float* amax_scratch, int* nonfinite,
                              cudaStream_t stream);

/* The same with a static block amax: block j of row r takes scale_from_amax(block_amax[r * blocks + j], bound)
 * (blocks = ceil(cols / block); float32, device memory, row-major) instead of its max |x|, and sets *bad_amax |= 1
 * (device memory, zeroed by the caller) when one of them is NaN, Inf or negative (checks.check_amax_values); x's
 * NaN/Inf pass through the element math. One launch, no scale tensor. */
cudaError_t mlq_static_block(mlq_dtype dtype, int e4m3, const void* grad, const void* x, const float* block_amax,
                             void* y, int64_t rows, int64_t cols, int block, float bound, float qmin, float qmax,
                             int* bad_amax, cudaStream_t stream);

/* scale[i] = scales.scale_from_amax(amax[i], bound) (float32 amax / bound, the float32 just below it where the
 * grid's end bound * scale would overflow, +0 where amax <= 2**-24) for n float32 amaxes in device memory, and
 * *bad |= 1 (device memory, zeroed by the caller) when one is NaN, Inf or negative (checks.check_amax_values).
 * One launch (block_kernels.cu). */
cudaError_t mlq_scale_from_amax(const float* amax, float* scale, int64_t n, float bound, int* bad,
                                cudaStream_t stream);

/* Work-distribution variants of the blocked kernels (NVFP4, MX, E5M2/E2M1, dynamic blocks), one bit each. Every
 * variant computes the same bits; only the speed differs (bench/bench_cuda.py --cases mx times each).
 *   MLQ_MX_NVFP4_ONE_LANE: NVFP4 forward, 16-element blocks of float16/bfloat16: one lane (2 vectors) per block,
 *     not two.
 *   MLQ_MX_PREFETCH_16BIT: the forward NVFP4 kernel of float16/bfloat16 prefetches (into L2) the vectors of each
 *     thread's next grid-stride tile.
 *   MLQ_MX_PREFETCH_ALL: every kernel prefetches so.
 *   MLQ_MX_FP32_TWO_VECTORS: NVFP4 / MX forward of float32: 2 vectors per lane, half the lanes per block (32 bytes
 *     of each lane's loads in flight instead of 16).
 *   MLQ_MX_ONE_WAVE: the grid is the number of thread blocks the GPU holds at once (the occupancy calculator),
 *     not 16 per multiprocessor: one wave of blocks, each looping over its grid-stride tiles.
 *   MLQ_MX_BLOCKS_FP32_TWO_VECTORS: the fused dynamic-block forward of float32, blocks of up to 32 vectors: 2
 *     vectors per lane and 2 slots per thread, half the lanes per block (what MLQ_MX_FP32_TWO_VECTORS does for
 *     NVFP4/MX).
 *   MLQ_MX_16BIT_TWO_VECTORS: the MX and fused dynamic-block forwards of float16/bfloat16: 2 vectors per lane, half
 *     the lanes per block (32 bytes of each lane's loads in flight instead of 16, as MLQ_MX_FP32_TWO_VECTORS does
 *     for float32; added 2026-11-27, session 11, not yet timed: with 5 calls back to back the bfloat16 MX kernels
 *     ran at 87-90% of copy against 92-94% for float32).
 *   MLQ_MX_TRUE_DIVISION: the NVFP4, fused block (dynamic and static) and elementwise E4M3/E5M2/E2M1 forwards of
 *     float16/bfloat16 divide each element by its scale with __fdiv_rn, not through the scale's reciprocal
 *     (mx_elem.h fdiv_rcp / fdiv_rcp_clamped: 4 / 6 operations instead of about 10 and a branch, bit-identical;
 *     added 2026-11-27, session 13, not yet timed: NVFP4 bf16 ran at 83% of copy with 5 calls back to back, its
 *     element loop 30 instructions per element of which 10 the division).
 * The default (one lane, 16-bit prefetch, float32 two vectors, float32 dynamic blocks two vectors) is what H100s
 * ran fastest (bench/REPORT.md; the last bit since session 11, 2026-11-27: the float32 int4-block row 91% -> 92%
 * of copy one call at a time, 90% -> 91% five calls back to back, two runs on two H100s):
 * 2026-11-27 (session 7), one lane 81% -> 87% of copy for NVFP4 bf16 and the prefetch 87% -> 92% there, while
 * prefetching cost 5-17% of copy in the float32 kernels and the light bf16 ones (MX, E5M2); 2026-11-27 (session
 * 9), float32 two vectors 89-90% -> 92-94% for NVFP4 and the four MX elements. Tried the same day and removed:
 * evict-first (.cs) loads and stores (no gain), float32 NVFP4 with registers capped for 5 resident blocks (92% ->
 * 89%). One wave was within the run's noise (kept as a variant).
 * The variants apply to aligned, whole-block tensors. mlq_mx_set_variant sets the process-wide variant and returns
 * the previous one; a value outside [0, MLQ_MX_VARIANT_ALL] only returns the current one. */
enum {
  MLQ_MX_NVFP4_ONE_LANE = 1,
  MLQ_MX_PREFETCH_16BIT = 2,
  MLQ_MX_PREFETCH_ALL = 4,
  MLQ_MX_FP32_TWO_VECTORS = 8,
  MLQ_MX_ONE_WAVE = 16,
  MLQ_MX_BLOCKS_FP32_TWO_VECTORS = 32,
  MLQ_MX_16BIT_TWO_VECTORS = 64,
  MLQ_MX_TRUE_DIVISION = 128,
  MLQ_MX_VARIANT_ALL = 255,
  MLQ_MX_VARIANT_DEFAULT = 43
};
int mlq_mx_set_variant(int variant);

#ifdef __cplusplus
}
#endif

#endif /* MODELOPT_LITE_MX_KERNELS_API_H_ */
