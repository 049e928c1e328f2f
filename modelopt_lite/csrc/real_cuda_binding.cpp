// Torch binding of the real W8A8 kernels (real_kernels.cu): registered with the dispatcher (TORCH_LIBRARY) when the
// CUDA extension loads, as torch.ops.modelopt_lite_cuda.<name> for CUDA tensors; functional/library_real.py's ops
// call them (same results as that module's pure-torch chains). With -DMODELOPT_LITE_EMULATE_ON_HOST (tests only)
// the namespace is modelopt_lite_emulated, the kernels take CPU tensors and run on the host.
//
// Host side only: checks, contiguous inputs, output allocation (the caching allocator on a GPU), one launch on x's
// device and current stream. Nothing is read back to the host (divisors and scales stay in device memory).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#ifndef MODELOPT_LITE_EMULATE_ON_HOST
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define MLR_NAMESPACE modelopt_lite_cuda
#define MLR_KEY CUDA
#else
#define MLR_NAMESPACE modelopt_lite_emulated
#define MLR_KEY CPU
#endif

#include "check_msg.h"
#include "real_kernels_api.h"

namespace {

using at::Tensor;

mlq_dtype dtype_code(const Tensor& t) {
  return t.scalar_type() == at::kFloat ? MLQ_FLOAT32 : t.scalar_type() == at::kHalf ? MLQ_FLOAT16 : MLQ_BFLOAT16;
}

void check_device(const Tensor& t, const char* op, const char* what) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  MOL_CHECK_VALUE(t.device().is_cpu(), "modelopt_lite CUDA kernels, ", op, ": ", what,
                  " must be a CPU tensor in the host-emulated build, got ", t.device());
#else
  MOL_CHECK_VALUE(t.is_cuda(), "modelopt_lite CUDA kernels, ", op, ": ", what, " must be a CUDA tensor, got ",
                  t.device());
#endif
}

void check_x(const Tensor& x, const char* op) {
  check_device(x, op, "x");
  const auto dt = x.scalar_type();
  MOL_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "modelopt_lite CUDA kernels, ", op,
                 ": x must be float32, float16 or bfloat16, got ", dt);
  MOL_CHECK_VALUE(x.dim() == 2, "modelopt_lite CUDA kernels, ", op, ": x must be 2-D (rows, cols), got ", x.dim(),
                  "-D");
}

void check_f32(const Tensor& t, const Tensor& x, int64_t numel, const char* op, const char* what) {
  check_device(t, op, what);
  MOL_CHECK_TYPE(t.scalar_type() == at::kFloat, "modelopt_lite CUDA kernels, ", op, ": ", what,
                 " must be float32, got ", t.scalar_type());
  MOL_CHECK_VALUE(t.numel() == numel && t.device() == x.device(), "modelopt_lite CUDA kernels, ", op, ": ", what,
                  " must have ", numel, " element(s) on ", x.device(), ", got ", t.numel(), " on ", t.device());
}

#ifdef MODELOPT_LITE_EMULATE_ON_HOST
#define MLR_STREAM(t) cudaStream_t stream = nullptr
#else
#define MLR_STREAM(t)                         \
  const c10::cuda::CUDAGuard guard(t.device()); \
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream()
#endif

void check_status(cudaError_t st, const char* op) {
  MOL_CHECK(st == cudaSuccess, "modelopt_lite CUDA kernels, ", op, ": launch failed with status ",
            static_cast<int>(st));
}

Tensor fp8_static(const Tensor& x_in, const Tensor& divisor_in) {
  check_x(x_in, "real_fp8_static");
  check_f32(divisor_in, x_in, 1, "real_fp8_static", "divisor");
  const Tensor x = x_in.contiguous(), divisor = divisor_in.contiguous();
  Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  MLR_STREAM(x);
  check_status(mlr_fp8_static(dtype_code(x), x.data_ptr(), static_cast<uint8_t*>(codes.data_ptr()), x.numel(),
                              divisor.data_ptr<float>(), stream),
               "real_fp8_static");
  return codes;
}

std::tuple<Tensor, Tensor> fp8_dynamic(const Tensor& x_in, bool per_row) {
  check_x(x_in, "real_fp8_dynamic");
  const Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  Tensor scales = per_row ? at::empty({rows, 1}, x.options().dtype(at::kFloat))
                          : at::empty({1, 1}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {codes, scales.zero_()};  // the amax of nothing: 0, a dead scale
  Tensor partials = per_row ? Tensor() : at::empty({mlr_fp8_dynamic_partials(x.numel())}, scales.options());
  MLR_STREAM(x);
  check_status(mlr_fp8_dynamic(dtype_code(x), per_row ? 1 : 0, x.data_ptr(), static_cast<uint8_t*>(codes.data_ptr()),
                               scales.data_ptr<float>(), rows, cols,
                               per_row ? nullptr : partials.data_ptr<float>(), stream),
               "real_fp8_dynamic");
  return {codes, scales};
}

Tensor int8_codes(const Tensor& x_in, const Tensor& divisor_in, int64_t qmin, int64_t qmax, int64_t shift,
                  int64_t rows_out) {
  check_x(x_in, "real_int8_codes");
  check_f32(divisor_in, x_in, 1, "real_int8_codes", "divisor");
  MOL_CHECK_VALUE(qmin <= qmax && qmin - shift >= -128 && qmax - shift <= 127 && rows_out >= x_in.size(0),
                  "modelopt_lite CUDA kernels, real_int8_codes: bad range qmin=", qmin, " qmax=", qmax,
                  " shift=", shift, " rows_out=", rows_out, " for ", x_in.size(0), " rows");
  const Tensor x = x_in.contiguous(), divisor = divisor_in.contiguous();
  Tensor codes = at::empty({rows_out, x.size(1)}, x.options().dtype(at::kChar));
  MLR_STREAM(x);
  check_status(mlr_int8_codes(dtype_code(x), x.data_ptr(), codes.data_ptr<int8_t>(), x.size(0), rows_out, x.size(1),
                              divisor.data_ptr<float>(), static_cast<float>(qmin), static_cast<float>(qmax),
                              static_cast<float>(shift), stream),
               "real_int8_codes");
  return codes;
}

Tensor int_mm_epilogue(const Tensor& acc_in, const Tensor& scale_row_in, const std::optional<Tensor>& bias_in,
                       int64_t rows, at::ScalarType dtype) {
  const char* op = "real_int_mm_epilogue";
  check_device(acc_in, op, "acc");
  MOL_CHECK_TYPE(acc_in.scalar_type() == at::kInt && acc_in.dim() == 2, "modelopt_lite CUDA kernels, ", op,
                 ": acc must be a 2-D int32 tensor, got ", acc_in.scalar_type(), " ", acc_in.dim(), "-D");
  MOL_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                 "modelopt_lite CUDA kernels, ", op, ": the output dtype must be float32, float16 or bfloat16, got ",
                 dtype);
  const int64_t cols = acc_in.size(1);
  MOL_CHECK_VALUE(rows >= 0 && rows <= acc_in.size(0), "modelopt_lite CUDA kernels, ", op, ": rows=", rows,
                  " outside acc's ", acc_in.size(0));
  check_f32(scale_row_in, acc_in, cols, op, "scale_row");
  if (bias_in.has_value()) check_f32(*bias_in, acc_in, cols, op, "bias");
  const Tensor acc = acc_in.contiguous(), scale_row = scale_row_in.contiguous();
  const Tensor bias = bias_in.has_value() ? bias_in->contiguous() : Tensor();
  Tensor y = at::empty({rows, cols}, acc.options().dtype(dtype));
  MLR_STREAM(acc);
  const mlq_dtype code = dtype == at::kFloat ? MLQ_FLOAT32 : dtype == at::kHalf ? MLQ_FLOAT16 : MLQ_BFLOAT16;
  check_status(mlr_int_mm_epilogue(code, acc.data_ptr<int32_t>(), scale_row.data_ptr<float>(),
                                   bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr(), rows, cols,
                                   stream),
               op);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MLR_NAMESPACE, m) {
  m.def("real_fp8_static(Tensor x, Tensor divisor) -> Tensor");
  m.def("real_fp8_dynamic(Tensor x, bool per_row) -> (Tensor, Tensor)");
  m.def("real_int8_codes(Tensor x, Tensor divisor, int qmin, int qmax, int shift, int rows_out) -> Tensor");
  m.def("real_int_mm_epilogue(Tensor acc, Tensor scale_row, Tensor? bias, int rows, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(MLR_NAMESPACE, MLR_KEY, m) {
  m.impl("real_fp8_static", &fp8_static);
  m.impl("real_fp8_dynamic", &fp8_dynamic);
  m.impl("real_int8_codes", &int8_codes);
  m.impl("real_int_mm_epilogue", &int_mm_epilogue);
}
