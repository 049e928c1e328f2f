/* modelopt_lite CUDA kernels: the plain C launcher API (raw pointers, sizes, a stream; no torch types).
 *
 * Every launcher validates its arguments (returning cudaErrorInvalidValue, never asserting on the device), does
 * nothing for 0 elements, launches asynchronously on `stream` and returns the launch status.
 * x (and grad) are dense, contiguous, row-major; scale / zero_point are float32 and are read through
 * `scale_strides` (0 on every dim where they broadcast), so any broadcast of a smaller tensor works.
 */
#ifndef MODELOPT_LITE_QUANT_KERNELS_API_H_
#define MODELOPT_LITE_QUANT_KERNELS_API_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MLQ_MAX_RANK 64

typedef enum { MLQ_FLOAT32 = 0, MLQ_FLOAT16 = 1, MLQ_BFLOAT16 = 2, MLQ_FLOAT64 = 3 /* histogram only */ } mlq_dtype;

typedef enum {
  MLQ_FAKE_QUANT_INT = 0,  /* y = clamp(rint(x / s), qmin, qmax) * s, in x's dtype */
  MLQ_QUANTIZE_INT = 1,    /* q = clamp(rint(x / s), qmin, qmax), float32 */
  MLQ_FAKE_E4M3 = 2,       /* y = e4m3(clamp(x / s, -448, 448)) * s, in x's dtype */
  MLQ_FAKE_AFFINE = 3,     /* y = (clamp(rint(x / s) + zp, qmin, qmax) - zp) * s, in x's dtype */
  MLQ_QUANTIZE_AFFINE = 4  /* q = clamp(rint(x / s) + zp, qmin, qmax), float32 */
} mlq_forward_op;

typedef enum {
  MLQ_INT_BACKWARD = 0,    /* grad_x on [qmin s, qmax s]; optional per-element scale gradient */
  MLQ_E4M3_BACKWARD = 1,   /* grad_x on [-448 s, 448 s]; optional per-element scale gradient */
  MLQ_AFFINE_BACKWARD = 2  /* grad_x on [(qmin - zp) s, (qmax - zp) s] */
} mlq_backward_op;

/* Shape of x and how the scale maps onto it. */
typedef struct {
  int ndim;
  int64_t sizes[MLQ_MAX_RANK];
  int64_t scale_strides[MLQ_MAX_RANK]; /* element strides into scale / zero_point; 0 where they broadcast */
} mlq_broadcast;

/* Layout the kernels will use for this broadcast: 0 per-tensor, 1 per-channel (outer, C, inner), 2 general,
 * -1 when the pattern needs more merged dims than the general path holds (expand the scale to x's shape). */
int mlq_layout(const mlq_broadcast* bcast);

/* Forward ops. y has x's dtype for the fake ops and is float32 for the quantize ops. zero_point is read by the
 * affine ops only (may be NULL otherwise). */
cudaError_t mlq_forward(mlq_forward_op op, mlq_dtype dtype, const void* x, void* y, const float* scale,
                        const float* zero_point, const mlq_broadcast* bcast, int qmin, int qmax,
                        cudaStream_t stream);

/* mlq_forward with the unsigned-input check in the same pass: *negative (device memory, zeroed by the caller) gets
 * bit 1 when an element of x is negative or NaN (-0.0 passes), as checks.check_unsigned_input refuses them. */
cudaError_t mlq_forward_unsigned(mlq_forward_op op, mlq_dtype dtype, const void* x, void* y, const float* scale,
                                 const float* zero_point, const mlq_broadcast* bcast, int qmin, int qmax,
                                 int* negative, cudaStream_t stream);

/* Backward ops. grad, x and grad_x share `dtype`; scale_term (float32, one per element) is written when not NULL
 * (int and e4m3 only). */
cudaError_t mlq_backward(mlq_backward_op op, mlq_dtype dtype, const void* grad, const void* x, void* grad_x,
                         float* scale_term, const float* scale, const float* zero_point,
                         const mlq_broadcast* bcast, int qmin, int qmax, cudaStream_t stream);

/* Histograms on the power-of-two grid of modelopt_lite.calib.grid: x is (rows, cols) row-major; row r has bin
 * width 2**e_r (e_r = exps[r], or exp_all when exps is NULL) and value v lands in bin floor(v * 2**-e_r), computed
 * exactly (float64 scaling). counts (rows, num_bins) int64, zeroed by the caller, receives += counts. Values that are
 * NaN, negative or >= num_bins * 2**e_r are not counted. */
cudaError_t mlq_histogram(mlq_dtype dtype, const void* x, int64_t rows, int64_t cols, const int64_t* exps,
                          int64_t exp_all, int64_t num_bins, int64_t* counts, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MODELOPT_LITE_QUANT_KERNELS_API_H_ */
