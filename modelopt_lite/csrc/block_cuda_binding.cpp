// Torch binding of the fused block quantization kernel (block_kernels.cu): fake_block_dynamic and
// block_dynamic_backward, fake_block_static and block_static_backward (a given block amax), the kernels of
// functional/library_block_cuda.py's ops (same signatures and results as that
// module's reference; its Python wrapper checks the arguments first and turns a raised flag into the reference's
// ValueError). Registered into the CUDA module by register_block_cuda_ops.
//
// Host side only: makes x (and grad) contiguous, allocates the output (the caching allocator on a GPU), launches
// on x's device and current stream and returns (y, flag) WITHOUT reading the flag (an int32 tensor, non-zero when
// a block amax is NaN or Inf, or a static one negative): no host synchronization here. With
// -DMODELOPT_LITE_EMULATE_ON_HOST (tests only) it takes CPU tensors and the launcher runs the kernel's lanes on the
// host.
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "binding_errors.h"
#include "launch_scope.h"
#include "mx_kernels_api.h"

namespace {

using at::Tensor;
using mol::dtype_code;

void check_tensor(const Tensor& t, const char* op, const char* what) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  MOL_CHECK_VALUE(t.device().is_cpu(), "modelopt_lite CUDA kernels, ", op, ": ", what,
                  " must be a CPU tensor in the host-emulated build, got ", t.device());
#else
  MOL_CHECK_VALUE(t.is_cuda(), "modelopt_lite CUDA kernels, ", op, ": ", what, " must be a CUDA tensor, got ",
                  t.device());
#endif
  const auto dt = t.scalar_type();
  MOL_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "modelopt_lite CUDA kernels, ", op,
                 ": ", what, " must be float32, float16 or bfloat16, got ", dt);
  MOL_CHECK_VALUE(t.dim() > 0, "modelopt_lite CUDA kernels, ", op, ": ", what, " must have at least one dimension");
}

// Double quantization of the block scales (scale_kind 1: unsigned integer codes 0..scale_qmax, 2: E4M3; 0: none).
struct ScaleQuant {
  int64_t kind;
  double bound;
  int64_t qmax;
};

// The static block amax as the kernel reads it: float32, on x's device, of shape x.shape[:-1] + (blocks per row,),
// contiguous.
Tensor static_amax(const Tensor& amax, const Tensor& x, int64_t block, const char* op) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = (x.size(-1) + block - 1) / block;
  MOL_CHECK_TYPE(amax.scalar_type() == at::kFloat, "modelopt_lite CUDA kernels, ", op,
                 ": block amax must be float32, got ", amax.scalar_type());
  MOL_CHECK_VALUE(amax.device() == x.device() && amax.sizes() == at::IntArrayRef(shape),
                  "modelopt_lite CUDA kernels, ", op, ": block amax must be on ", x.device(), " with shape ",
                  at::IntArrayRef(shape), ", got ", amax.device(), " ", amax.sizes());
  return amax.contiguous();
}

// One launch of the fused kernel: dynamic (amax_in null; double quantization when sq.kind != 0) or static, forward
// (grad_in null) or backward. `op` names the binding in errors.
std::tuple<Tensor, Tensor> run(const char* op, const Tensor* grad_in, const Tensor& x_in, const Tensor* amax_in,
                               int64_t block, double bound, int64_t qmin, int64_t qmax, bool e4m3,
                               const ScaleQuant& sq) {
  check_tensor(x_in, op, "x");
  MOL_CHECK_VALUE(mlq_dynamic_block_supported(dtype_code(x_in), block) != 0, "modelopt_lite CUDA kernels, ", op,
                  ": block size ", block, " is not supported for ", x_in.scalar_type(),
                  " (see block_dynamic_supported)");
  MOL_CHECK_VALUE(bound > 0.0 && qmin <= qmax, "modelopt_lite CUDA kernels, ", op, ": bad range bound=", bound,
                  " qmin=", qmin, " qmax=", qmax);
  MOL_CHECK_VALUE(sq.kind >= 0 && sq.kind <= 2 && (sq.kind == 0 || sq.bound > 0.0), "modelopt_lite CUDA kernels, ",
                  op, ": bad scale quantization kind=", sq.kind, " bound=", sq.bound);
  const Tensor x = x_in.contiguous();
  Tensor grad;
  if (grad_in != nullptr) {
    check_tensor(*grad_in, op, "grad");
    MOL_CHECK_VALUE(grad_in->sizes() == x.sizes() && grad_in->scalar_type() == x.scalar_type() &&
                        grad_in->device() == x.device(),
                    "modelopt_lite CUDA kernels, ", op, ": grad must match x in dtype, shape and device");
    grad = grad_in->contiguous();
  }
  const Tensor amax = amax_in != nullptr ? static_amax(*amax_in, x, block, op) : Tensor();
  Tensor y = at::empty(x.sizes(), x.options());
  Tensor flag = at::zeros({1}, x.options().dtype(at::kInt));
  Tensor gmax = sq.kind != 0 ? at::zeros({1}, x.options().dtype(at::kFloat)) : Tensor();
  const int64_t cols = x.size(-1);
  if (x.numel() == 0) return {y, flag};
  const int64_t rows = x.numel() / cols;
  const mol::LaunchScope scope(x);
  void* const g = grad_in != nullptr ? grad.data_ptr() : nullptr;
  const float lo = static_cast<float>(qmin), hi = static_cast<float>(qmax), b = static_cast<float>(bound);
  const cudaError_t st =
      amax_in != nullptr
          ? mlq_static_block(dtype_code(x), e4m3 ? 1 : 0, g, x.data_ptr(), amax.data_ptr<float>(), y.data_ptr(), rows,
                             cols, static_cast<int>(block), b, lo, hi, flag.data_ptr<int>(), scope.stream())
          : mlq_dynamic_block(dtype_code(x), e4m3 ? 1 : 0, g, x.data_ptr(), y.data_ptr(), rows, cols,
                              static_cast<int>(block), b, lo, hi, static_cast<int>(sq.kind),
                              static_cast<float>(sq.bound), static_cast<float>(sq.qmax),
                              sq.kind != 0 ? gmax.data_ptr<float>() : nullptr, flag.data_ptr<int>(), scope.stream());
  MOL_CHECK(st == cudaSuccess, "modelopt_lite CUDA kernels, ", op, ": launch failed with status ",
            static_cast<int>(st));
  return {y, flag};
}

std::tuple<Tensor, Tensor> fake_block_dynamic(const Tensor& x, int64_t block, double bound, int64_t qmin,
                                              int64_t qmax, bool e4m3, int64_t scale_kind, double scale_bound,
                                              int64_t scale_qmax) {
  return run("fake_block_dynamic", nullptr, x, nullptr, block, bound, qmin, qmax, e4m3,
             {scale_kind, scale_bound, scale_qmax});
}

std::tuple<Tensor, Tensor> block_dynamic_backward(const Tensor& grad, const Tensor& x, int64_t block, double bound,
                                                  int64_t qmin, int64_t qmax, bool e4m3, int64_t scale_kind,
                                                  double scale_bound, int64_t scale_qmax) {
  return run("block_dynamic_backward", &grad, x, nullptr, block, bound, qmin, qmax, e4m3,
             {scale_kind, scale_bound, scale_qmax});
}

std::tuple<Tensor, Tensor> fake_block_static(const Tensor& x, const Tensor& amax, int64_t block, double bound,
                                             int64_t qmin, int64_t qmax, bool e4m3) {
  return run("fake_block_static", nullptr, x, &amax, block, bound, qmin, qmax, e4m3, {0, 0.0, 0});
}

std::tuple<Tensor, Tensor> block_static_backward(const Tensor& grad, const Tensor& x, const Tensor& amax,
                                                 int64_t block, double bound, int64_t qmin, int64_t qmax, bool e4m3) {
  return run("block_static_backward", &grad, x, &amax, block, bound, qmin, qmax, e4m3, {0, 0.0, 0});
}

// scales.scale_from_amax with checks.check_amax_values' test in one launch: (scale, flag), the flag (int32, one
// element) non-zero when an amax is NaN, Inf or negative, not read here.
std::tuple<Tensor, Tensor> scale_from_amax(const Tensor& amax_in, double bound) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  MOL_CHECK_VALUE(amax_in.device().is_cpu(), "modelopt_lite CUDA kernels, scale_from_amax: amax must be a CPU "
                  "tensor in the host-emulated build, got ", amax_in.device());
#else
  MOL_CHECK_VALUE(amax_in.is_cuda(), "modelopt_lite CUDA kernels, scale_from_amax: amax must be a CUDA tensor, got ",
                  amax_in.device());
#endif
  MOL_CHECK_TYPE(amax_in.scalar_type() == at::kFloat,
                 "modelopt_lite CUDA kernels, scale_from_amax: amax must be float32, got ", amax_in.scalar_type());
  MOL_CHECK_VALUE(bound > 0.0 && bound <= 3.4028234663852886e38,
                  "modelopt_lite CUDA kernels, scale_from_amax: bound must be finite and > 0, got ", bound);
  const Tensor amax = amax_in.contiguous();
  Tensor scale = at::empty(amax.sizes(), amax.options());
  Tensor flag = at::zeros({1}, amax.options().dtype(at::kInt));
  if (amax.numel() == 0) return {scale, flag};
  const mol::LaunchScope scope(amax);
  const cudaError_t st = mlq_scale_from_amax(amax.data_ptr<float>(), scale.data_ptr<float>(), amax.numel(),
                                             static_cast<float>(bound), flag.data_ptr<int>(), scope.stream());
  MOL_CHECK(st == cudaSuccess, "modelopt_lite CUDA kernels, scale_from_amax: launch failed with status ",
            static_cast<int>(st));
  return {scale, flag};
}

bool block_dynamic_supported(const std::string& dtype, int64_t block) {
  const mlq_dtype d = dtype == "float32" ? MLQ_FLOAT32 : dtype == "float16" ? MLQ_FLOAT16 : MLQ_BFLOAT16;
  return (dtype == "float32" || dtype == "float16" || dtype == "bfloat16") && mlq_dynamic_block_supported(d, block);
}

}  // namespace

namespace mol {

void register_block_cuda_ops(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("scale_from_amax", python_errors(&scale_from_amax),
        "scales.scale_from_amax(amax, bound) and the amax check in one launch -> (scale, flag: 1 when an amax is "
        "NaN, Inf or negative; not read)",
        py::arg("amax"), py::arg("bound"));
  m.def("fake_block_dynamic", python_errors(&fake_block_dynamic),
        "fused dynamic block fake quant along the last axis -> (y, nonfinite flag)", py::arg("x"), py::arg("block"),
        py::arg("bound"), py::arg("qmin"), py::arg("qmax"), py::arg("e4m3"), py::arg("scale_kind") = 0,
        py::arg("scale_bound") = 0.0, py::arg("scale_qmax") = 0);
  m.def("block_dynamic_backward", python_errors(&block_dynamic_backward),
        "STE gradient of fake_block_dynamic -> (grad_x, nonfinite flag)", py::arg("grad"), py::arg("x"),
        py::arg("block"), py::arg("bound"), py::arg("qmin"), py::arg("qmax"), py::arg("e4m3"),
        py::arg("scale_kind") = 0, py::arg("scale_bound") = 0.0, py::arg("scale_qmax") = 0);
  m.def("fake_block_static", python_errors(&fake_block_static),
        "block fake quant along the last axis with a given float32 block amax (shape x.shape[:-1] + (blocks,)) -> "
        "(y, flag: 1 when a block amax is NaN, Inf or negative; not read)",
        py::arg("x"), py::arg("amax"), py::arg("block"), py::arg("bound"), py::arg("qmin"), py::arg("qmax"),
        py::arg("e4m3"));
  m.def("block_static_backward", python_errors(&block_static_backward),
        "STE gradient of fake_block_static -> (grad_x, bad amax flag)", py::arg("grad"), py::arg("x"),
        py::arg("amax"), py::arg("block"), py::arg("bound"), py::arg("qmin"), py::arg("qmax"), py::arg("e4m3"));
  m.def("block_dynamic_supported", &block_dynamic_supported,
        "whether fake_block_dynamic takes this dtype ('float32', 'float16', 'bfloat16') and block size",
        py::arg("dtype"), py::arg("block"));
}

}  // namespace mol
