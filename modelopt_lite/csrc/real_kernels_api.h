/* modelopt_lite CUDA kernels of the real (GPU-first) W8A8 paths: the plain C launcher API (real_kernels.cu).
 *
 * The activation side of torch._scaled_mm (FP8 E4M3) and torch._int_mm (INT8) in one kernel launch each (two for a
 * dynamic per-tensor FP8 scale), and the INT8 epilogue in one. x is dense, contiguous, row-major (rows x cols);
 * dtype float32 / float16 / bfloat16 (mlq_dtype). Scalars the kernels need (divisors) are read from device memory:
 * no host synchronization. Every launcher validates its arguments (cudaErrorInvalidValue), does nothing for 0
 * elements, launches asynchronously on `stream` and returns the launch status. Each mirrors one pure-torch chain of
 * modelopt_lite/functional/library_real.py bit for bit (see there and real_kernels.cu for the float32 operations).
 */
#ifndef MODELOPT_LITE_REAL_KERNELS_API_H_
#define MODELOPT_LITE_REAL_KERNELS_API_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "quant_kernels_api.h" /* mlq_dtype */

#ifdef __cplusplus
extern "C" {
#endif

/* Static FP8 codes: codes[i] = e4m3(clamp(x[i] / divisor[0], -448, 448)) (true division in float32; torch's
 * float -> float8_e4m3fn cast, a NaN stays a NaN code). divisor: one float32 in device memory. */
cudaError_t mlr_fp8_static(mlq_dtype dtype, const void* x, uint8_t* codes, int64_t n, const float* divisor,
                           cudaStream_t stream);

/* Dynamic FP8 codes: per row (per_row != 0, scales[rows]) or per tensor (scales[1]) amax a (a NaN wins),
 * s = a / 448 (0 where a <= 2**-24; the float32 guard of scales.scale_from_amax), codes = e4m3(v) with
 * v = x / s and v := 0 where v is NaN or +-Inf (dead rows, NaN/Inf rows). Per row: one launch (one CUDA block per
 * row). Per tensor: two launches; `partials` is scratch of mlr_fp8_dynamic_partials(rows * cols) floats. */
int64_t mlr_fp8_dynamic_partials(int64_t n);
cudaError_t mlr_fp8_dynamic(mlq_dtype dtype, int per_row, const void* x, uint8_t* codes, float* scales, int64_t rows,
                            int64_t cols, float* partials, cudaStream_t stream);

/* INT8 codes for torch._int_mm: rows_out >= rows rows; row r < rows: q = clamp(rint(x / divisor[0]), qmin, qmax)
 * - shift (a NaN gives q = 0 - shift), rows past `rows`: 0 (the padding _int_mm needs for small M). */
cudaError_t mlr_int8_codes(mlq_dtype dtype, const void* x, int8_t* codes, int64_t rows, int64_t rows_out,
                           int64_t cols, const float* divisor, float qmin, float qmax, float shift,
                           cudaStream_t stream);

/* The _int_mm epilogue: y[r, c] = round_out(fma(float(acc[r, c]), scale_row[c], bias[c])) for r < rows
 * (bias NULL: round_out(float(acc) * scale_row[c])), the float32 result rounded once more into y's dtype (what
 * torch.addcmul(bias, acc, scale_row, out=y) / torch.mul(acc, scale_row, out=y) compute). acc: int32, at least
 * `rows` rows of `cols`, row-major. */
cudaError_t mlr_int_mm_epilogue(mlq_dtype dtype, const int32_t* acc, const float* scale_row, const float* bias,
                                void* y, int64_t rows, int64_t cols, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MODELOPT_LITE_REAL_KERNELS_API_H_ */
