// Torch binding of the CUDA kernels of the 4-bit and microscaling formats (mx_kernels.cu): fake_nvfp4, fake_mx
// (the functions of functional/microscaling.py, same signatures, errors and results), their STE gradients
// nvfp4_backward and mx_backward, fake_e5m2 and fake_e2m1
// (as fake_e4m3 of quant_cuda_binding.cpp). Registered into that module by register_mx_cuda_ops; every function
// raises its Python exception itself (binding_errors.h: python_errors).
//
// Host side only: validates arguments (the reference's messages, mx_checks.h), makes x contiguous, launches on x's
// device and current stream. The kernels raise a flag (one int32 in device memory; bit 1: NaN/Inf input, bit 2: a
// bad NVFP4 global scale, which the kernel reads from device memory). The ``*_flagged`` functions return it with the
// output WITHOUT reading it (no host synchronization: functional/deferred_errors.py reads it asynchronously); the
// plain ones read it back and raise the reference's ValueError (the "sync" error-check mode, and direct callers).
// With -DMODELOPT_LITE_EMULATE_ON_HOST (tests only) it takes CPU
// tensors and the launchers run the kernel bodies on the host.
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "binding_errors.h"
#include "launch_scope.h"
#include "mx_checks.h"
#include "mx_kernels_api.h"

namespace {

using at::Tensor;
using mol::dtype_code;

void check_device(const Tensor& t, const std::string& what) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  MOL_CHECK_VALUE(t.device().is_cpu(), "modelopt_lite CUDA kernels: ", what,
                  " must be a CPU tensor in the host-emulated build, got ", t.device());
#else
  MOL_CHECK_VALUE(t.is_cuda(), "modelopt_lite CUDA kernels: ", what, " must be a CUDA tensor, got ", t.device());
#endif
}

void check_status(cudaError_t st, const char* fn) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  MOL_CHECK(st == cudaSuccess, "modelopt_lite CUDA kernels, ", fn, ": launcher failed with status ",
            static_cast<int>(st));
#else
  MOL_CHECK(st == cudaSuccess, "modelopt_lite CUDA kernels, ", fn, ": kernel launch failed: ", cudaGetErrorString(st));
#endif
}

struct Blocked {
  Tensor x, y, grad, flag;
  int64_t rows, cols;
};

// x contiguous, a fresh output (the caching allocator's memory on a GPU), the flag; grad (backward) of x's shape
// and dtype, made contiguous.
Blocked prepare(const Tensor& x_in, const std::string& what, const Tensor* grad = nullptr) {
  mol::mxchk::check_x(x_in, what);
  check_device(x_in, what);
  Blocked b;
  b.x = x_in.contiguous();
  if (grad != nullptr) {
    check_device(*grad, "grad");
    MOL_CHECK_VALUE(grad->sizes() == x_in.sizes() && grad->scalar_type() == x_in.scalar_type() &&
                        grad->device() == x_in.device(),
                    "modelopt_lite CUDA kernels: grad (", grad->scalar_type(), " ", grad->sizes(),
                    ") must match x (", x_in.scalar_type(), " ", x_in.sizes(), ") in dtype, shape and device");
    b.grad = grad->contiguous();
  }
  b.y = at::empty(b.x.sizes(), b.x.options());
  b.cols = b.x.size(-1);
  b.rows = b.cols == 0 ? 0 : b.x.numel() / b.cols;
  b.flag = at::zeros({1}, b.x.options().dtype(at::kInt));
  return b;
}

// The host synchronization of the plain functions: the kernels' flag (bit 1: a NaN/Inf block amax, bit 2: a bad
// NVFP4 global scale), read back so that bad values raise ValueError as the reference does. Not called by the
// *_flagged functions.
void finish(const Blocked& b, const std::string& what, const Tensor* gs = nullptr) {
  const int f = b.flag.item<int>();
  if ((f & 1) != 0) mol::mxchk::raise_nonfinite(b.x, what);
  if ((f & 2) != 0 && gs != nullptr) mol::mxchk::global_scale_value(*gs);  // raises the reference's ValueError
}

// The NVFP4 global scale as one float32 in x's device memory (read by the kernel).
Tensor device_global_scale(const Tensor& global_scale, const Tensor& x, const char* name = "global_scale") {
  MOL_CHECK_VALUE(global_scale.numel() == 1, "NVFP4 ", name, " must be a single (per-tensor) value, got shape ",
                  global_scale.sizes());
  return global_scale.to(x.device(), at::kFloat).reshape({1}).contiguous();
}

using Flagged = std::tuple<Tensor, Tensor>;

// from_amax: global_scale is the per-tensor amax, and the kernel computes the global scale (the *_amax_flagged
// functions; their flag's bit 2 is a bad amax).
Flagged nvfp4_common(const Tensor& x, const Tensor& global_scale, int64_t block, const Tensor* grad, bool read,
                     bool from_amax = false) {
  const std::string what = "NVFP4 input";
  mol::mxchk::check_x(x, what);
  mol::mxchk::check_block(block, {16, 32}, "NVFP4");
  Blocked b = prepare(x, what, grad);
  const Tensor gs = device_global_scale(global_scale, b.x, from_amax ? "amax" : "global_scale");
  if (b.x.numel() == 0) return {b.y, b.flag};
  const mol::LaunchScope scope(b.x);
  const float* g = gs.data_ptr<float>();
  int* flag = b.flag.data_ptr<int>();
  const mlq_dtype dt = dtype_code(b.x);
  const int blk = static_cast<int>(block);
  if (grad == nullptr) {
    check_status(from_amax ? mlq_fake_nvfp4_amax(dt, b.x.data_ptr(), b.y.data_ptr(), b.rows, b.cols, blk, g, flag,
                                                 scope.stream())
                           : mlq_fake_nvfp4(dt, b.x.data_ptr(), b.y.data_ptr(), nullptr, b.rows, b.cols, blk, g,
                                            flag, scope.stream()),
                 "fake_nvfp4");
  } else {
    check_status(from_amax ? mlq_nvfp4_backward_amax(dt, b.grad.data_ptr(), b.x.data_ptr(), b.y.data_ptr(), b.rows,
                                                     b.cols, blk, g, flag, scope.stream())
                           : mlq_nvfp4_backward(dt, b.grad.data_ptr(), b.x.data_ptr(), b.y.data_ptr(), b.rows,
                                                b.cols, blk, g, flag, scope.stream()),
                 "nvfp4_backward");
  }
  if (read) finish(b, what, &gs);
  return {b.y, b.flag};
}

Tensor fake_nvfp4(const Tensor& x, const Tensor& global_scale, int64_t block) {
  return std::get<0>(nvfp4_common(x, global_scale, block, nullptr, true));
}

Tensor nvfp4_backward(const Tensor& grad, const Tensor& x, const Tensor& global_scale, int64_t block) {
  return std::get<0>(nvfp4_common(x, global_scale, block, &grad, true));
}

Flagged fake_nvfp4_flagged(const Tensor& x, const Tensor& global_scale, int64_t block) {
  return nvfp4_common(x, global_scale, block, nullptr, false);
}

Flagged nvfp4_backward_flagged(const Tensor& grad, const Tensor& x, const Tensor& global_scale, int64_t block) {
  return nvfp4_common(x, global_scale, block, &grad, false);
}

Flagged fake_nvfp4_amax_flagged(const Tensor& x, const Tensor& amax, int64_t block) {
  return nvfp4_common(x, amax, block, nullptr, false, true);
}

Flagged nvfp4_backward_amax_flagged(const Tensor& grad, const Tensor& x, const Tensor& amax, int64_t block) {
  return nvfp4_common(x, amax, block, &grad, false, true);
}

Flagged mx_common(const Tensor& x, const std::string& elem, int64_t block, const std::string& rounding,
                  const Tensor* grad, bool read) {
  const int e = mol::mxchk::elem_index(elem);
  const bool rceil = mol::mxchk::rounding_rceil(rounding);
  const std::string what = "MX (" + elem + ") input";
  mol::mxchk::check_x(x, what);
  mol::mxchk::check_block(block, {32}, "MX");
  Blocked b = prepare(x, what, grad);
  if (b.x.numel() == 0) return {b.y, b.flag};
  const mol::LaunchScope scope(b.x);
  int* flag = b.flag.data_ptr<int>();
  if (grad == nullptr) {
    check_status(mlq_fake_mx(dtype_code(b.x), e, rceil ? 1 : 0, b.x.data_ptr(), b.y.data_ptr(), nullptr, b.rows, b.cols,
                             static_cast<int>(block), flag, scope.stream()),
                 "fake_mx");
  } else {
    check_status(mlq_mx_backward(dtype_code(b.x), e, rceil ? 1 : 0, b.grad.data_ptr(), b.x.data_ptr(), b.y.data_ptr(),
                                 b.rows, b.cols, static_cast<int>(block), flag, scope.stream()),
                 "mx_backward");
  }
  if (read) finish(b, what);
  return {b.y, b.flag};
}

Tensor fake_mx(const Tensor& x, const std::string& elem, int64_t block, const std::string& rounding) {
  return std::get<0>(mx_common(x, elem, block, rounding, nullptr, true));
}

Tensor mx_backward(const Tensor& grad, const Tensor& x, const std::string& elem, int64_t block,
                   const std::string& rounding) {
  return std::get<0>(mx_common(x, elem, block, rounding, &grad, true));
}

Flagged fake_mx_flagged(const Tensor& x, const std::string& elem, int64_t block, const std::string& rounding) {
  return mx_common(x, elem, block, rounding, nullptr, false);
}

Flagged mx_backward_flagged(const Tensor& grad, const Tensor& x, const std::string& elem, int64_t block,
                            const std::string& rounding) {
  return mx_common(x, elem, block, rounding, &grad, false);
}

// elem(x / s) * s with s broadcast against x: per tensor, one channel dim, or expanded to one scale per element.
Tensor fake_minifloat(const Tensor& x_in, const Tensor& scale, int elem, const char* fn) {
  check_device(x_in, "x");
  const auto dt = x_in.scalar_type();
  MOL_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "modelopt_lite CUDA kernels, ", fn,
                 ": x must be float32, float16 or bfloat16, got ", dt);
  const Tensor x = x_in.contiguous();
  MOL_CHECK_VALUE(scale.dim() <= x.dim(), "modelopt_lite CUDA kernels, ", fn, ": scale of shape ", scale.sizes(),
                  " does not broadcast to x of shape ", x.sizes());
  Tensor s = scale.to(x.device(), at::kFloat);
  std::vector<int64_t> shape(static_cast<size_t>(x.dim() - s.dim()), 1);
  shape.insert(shape.end(), s.sizes().begin(), s.sizes().end());
  int64_t channels = 1, inner = 1, live = 0, dim = -1;
  for (int64_t d = 0; d < x.dim(); ++d) {
    const int64_t n = shape[static_cast<size_t>(d)];
    MOL_CHECK_VALUE(n == 1 || n == x.size(d), "modelopt_lite CUDA kernels, ", fn, ": scale of shape ",
                    scale.sizes(), " does not broadcast to x of shape ", x.sizes());
    if (n != 1) {
      ++live;
      dim = d;
    }
  }
  if (live == 1) {
    channels = x.size(dim);
    for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.size(d);
    s = s.reshape({-1}).contiguous();
  } else if (live > 1) {
    s = s.reshape(shape).expand(x.sizes()).contiguous();
    channels = x.numel();
  } else {
    s = s.reshape({1}).contiguous();
  }
  Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  const mol::LaunchScope scope(x);
  check_status(mlq_fake_minifloat(dtype_code(x), elem, x.data_ptr(), y.data_ptr(), s.data_ptr<float>(), x.numel(),
                                  channels, inner, scope.stream()),
               fn);
  return y;
}

Tensor fake_e5m2(const Tensor& x, const Tensor& scale) { return fake_minifloat(x, scale, 1, "fake_e5m2"); }

Tensor fake_e2m1(const Tensor& x, const Tensor& scale) { return fake_minifloat(x, scale, 2, "fake_e2m1"); }

}  // namespace

namespace mol {

void register_mx_cuda_ops(pybind11::module_& m) {
  namespace py = pybind11;
  using mol::python_errors;
  m.def("fake_nvfp4", python_errors(&fake_nvfp4), "NVFP4 fake quant along the last axis (microscaling.fake_nvfp4)",
        py::arg("x"), py::arg("global_scale"), py::arg("block") = 16);
  m.def("fake_mx", python_errors(&fake_mx), "OCP MX fake quant along the last axis (microscaling.fake_mx)",
        py::arg("x"), py::arg("elem"), py::arg("block") = 32, py::arg("rounding") = "floor");
  m.def("nvfp4_backward", python_errors(&nvfp4_backward), "STE gradient of fake_nvfp4 (microscaling.nvfp4_backward)",
        py::arg("grad"), py::arg("x"), py::arg("global_scale"), py::arg("block") = 16);
  m.def("mx_backward", python_errors(&mx_backward), "STE gradient of fake_mx (microscaling.mx_backward)",
        py::arg("grad"), py::arg("x"), py::arg("elem"), py::arg("block") = 32, py::arg("rounding") = "floor");
  m.def("fake_nvfp4_flagged", python_errors(&fake_nvfp4_flagged),
        "fake_nvfp4 -> (y, flag): the kernel's int32 flag (1: NaN/Inf input, 2: bad global scale), not read",
        py::arg("x"), py::arg("global_scale"), py::arg("block") = 16);
  m.def("nvfp4_backward_flagged", python_errors(&nvfp4_backward_flagged), "nvfp4_backward -> (grad_x, flag)",
        py::arg("grad"), py::arg("x"), py::arg("global_scale"), py::arg("block") = 16);
  m.def("fake_nvfp4_amax_flagged", python_errors(&fake_nvfp4_amax_flagged),
        "fake_nvfp4 of the per-tensor amax (the kernel computes the global scale amax / 2688, no torch ops) -> "
        "(y, flag): the kernel's int32 flag (1: NaN/Inf input, 2: amax negative, NaN or Inf), not read",
        py::arg("x"), py::arg("amax"), py::arg("block") = 16);
  m.def("nvfp4_backward_amax_flagged", python_errors(&nvfp4_backward_amax_flagged),
        "nvfp4_backward of the per-tensor amax -> (grad_x, flag)", py::arg("grad"), py::arg("x"), py::arg("amax"),
        py::arg("block") = 16);
  m.def("fake_mx_flagged", python_errors(&fake_mx_flagged),
        "fake_mx -> (y, flag): the kernel's int32 flag (1: NaN/Inf input), not read", py::arg("x"), py::arg("elem"),
        py::arg("block") = 32, py::arg("rounding") = "floor");
  m.def("mx_backward_flagged", python_errors(&mx_backward_flagged), "mx_backward -> (grad_x, flag)",
        py::arg("grad"), py::arg("x"), py::arg("elem"), py::arg("block") = 32, py::arg("rounding") = "floor");
  m.def("mx_set_variant", &mlq_mx_set_variant,
        "set the process-wide work-distribution variant of the blocked kernels (bits, mx_kernels_api.h: 1 = NVFP4 "
        "one lane per 16-element block of float16/bfloat16, 2 = the 16-bit NVFP4 forward kernels "
        "prefetch their next tile, 4 = every kernel does, 8 = float32 NVFP4/MX with 2 vectors per lane, 16 = one "
        "wave of thread blocks (the occupancy), 32 = float32 dynamic blocks with 2 vectors per lane; every "
        "variant computes the same bits) and return the previous one; -1 only returns the current one",
        py::arg("variant"));
  m.def("fake_e5m2", python_errors(&fake_e5m2), "e5m2(clamp(x / s, -57344, 57344)) * s in x's dtype", py::arg("x"),
        py::arg("scale"));
  m.def("fake_e2m1", python_errors(&fake_e2m1), "e2m1_round(x / s) * s in x's dtype", py::arg("x"),
        py::arg("scale"));
}

}  // namespace mol
