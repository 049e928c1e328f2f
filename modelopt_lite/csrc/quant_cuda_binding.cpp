// Torch binding of the CUDA kernels: the functions and signatures of modelopt_lite/functional/reference.py.
//
// Host-side only: validates arguments (TypeError / ValueError naming the function and the bad value), makes x and
// grad contiguous, moves scale / zero_point to x's device as contiguous float32, describes how they broadcast,
// and launches the extern "C" launchers of quant_kernels.cu on x's device and current stream. Outputs are new
// contiguous tensors; the caller's tensors are never modified.
//
// Every bound function raises its Python exception itself (binding_errors.h: python_errors).
//
// Built by modelopt_lite/functional/native_build.py. With -DMODELOPT_LITE_EMULATE_ON_HOST (tests only) it takes
// CPU tensors and the launchers run the kernel bodies on the host.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#ifndef MODELOPT_LITE_EMULATE_ON_HOST
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "binding_errors.h"
#include "quant_kernels_api.h"

namespace mol {
void register_mx_cuda_ops(pybind11::module_& m);     // mx_cuda_binding.cpp: NVFP4 / MX / E5M2 / E2M1
void register_block_cuda_ops(pybind11::module_& m);  // block_cuda_binding.cpp: fused dynamic blocks
}

namespace {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

constexpr int64_t kEMin = -160;  // modelopt_lite.calib.grid.E_MIN
constexpr int64_t kMaxExactInt = int64_t{1} << 24;

std::string where(const char* fn) { return std::string("modelopt_lite CUDA kernels, ") + fn + ": "; }

void check_device(const Tensor& t, const char* fn, const char* what) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  MOL_CHECK_VALUE(t.device().is_cpu(), where(fn), what, " must be a CPU tensor in the host-emulated build, got ",
                  t.device());
#else
  MOL_CHECK_VALUE(t.is_cuda(), where(fn), what, " must be a CUDA tensor, got device ", t.device());
#endif
}

mlq_dtype dtype_code(const Tensor& t, const char* fn, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return MLQ_FLOAT32;
    case at::kHalf:
      return MLQ_FLOAT16;
    case at::kBFloat16:
      return MLQ_BFLOAT16;
    default:
      MOL_CHECK_TYPE(false, where(fn), what, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return MLQ_FLOAT32;
}

void check_range(int64_t qmin, int64_t qmax, const char* fn) {
  MOL_CHECK_VALUE(qmin <= qmax, where(fn), "qmin must be <= qmax, got qmin=", qmin, ", qmax=", qmax);
  MOL_CHECK_VALUE(-kMaxExactInt <= qmin && qmax <= kMaxExactInt, where(fn), "qmin/qmax must be in [-2**24, 2**24], got ",
                  qmin, ", ", qmax);
}

void check_status(cudaError_t st, const char* fn) {
#ifdef MODELOPT_LITE_EMULATE_ON_HOST
  MOL_CHECK(st == cudaSuccess, where(fn), "launcher failed with status ", static_cast<int>(st));
#else
  MOL_CHECK(st == cudaSuccess, where(fn), "kernel launch failed: ", cudaGetErrorString(st));
#endif
}

#ifdef MODELOPT_LITE_EMULATE_ON_HOST
struct DeviceScope {
  explicit DeviceScope(const Tensor&) {}
  cudaStream_t stream() const { return nullptr; }
};
#else
struct DeviceScope {  // x's device made current; its current stream
  c10::cuda::CUDAGuard guard;
  explicit DeviceScope(const Tensor& x) : guard(x.device()) {}
  cudaStream_t stream() const { return c10::cuda::getCurrentCUDAStream(guard.current_device().index()).stream(); }
};
#endif

// Shape of a scale-like tensor as seen against x: rank of x (left-padded with 1s), every dim 1 or x's size.
std::vector<int64_t> aligned_shape(const Tensor& t, const Tensor& x, const char* fn, const char* what) {
  const int64_t nd = x.dim();
  std::vector<int64_t> shape(static_cast<size_t>(nd), 1);
  if (t.numel() == 1) return shape;
  MOL_CHECK_VALUE(t.numel() > 0, where(fn), what, " is empty");
  MOL_CHECK_VALUE(t.dim() <= nd, where(fn), what, " of shape ", t.sizes(), " does not broadcast to x of shape ",
                  x.sizes());
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t n = t.size(d), xd = nd - t.dim() + d;
    MOL_CHECK_VALUE(n == 1 || n == x.size(xd), where(fn), what, " of shape ", t.sizes(),
                    " does not broadcast to x of shape ", x.sizes(), " (dim ", d, ")");
    shape[static_cast<size_t>(xd)] = n;
  }
  return shape;
}

Tensor float_param(const Tensor& t, const Tensor& x, const char* fn, const char* what) {
  MOL_CHECK_TYPE(t.is_floating_point(), where(fn), what, " must be a floating-point tensor, got ", t.scalar_type());
  return t.to(x.device(), at::kFloat);
}

// scale (and zero point) as contiguous float32 on x's device, plus the broadcast description for the launchers.
struct Params {
  Tensor scale, zp;
  mlq_broadcast bcast;
};

Params prepare(const Tensor& x, const Tensor& scale, const OptTensor& zero_point, const char* fn) {
  MOL_CHECK_VALUE(x.dim() <= MLQ_MAX_RANK, where(fn), "x has ", x.dim(), " dims, at most ", MLQ_MAX_RANK,
                  " are supported");
  const std::vector<int64_t> sshape = aligned_shape(scale, x, fn, "scale");
  std::vector<int64_t> shape = sshape;
  Tensor s = float_param(scale, x, fn, "scale");
  Tensor z;
  if (zero_point.has_value()) {
    const std::vector<int64_t> zshape = aligned_shape(*zero_point, x, fn, "zero_point");
    for (size_t d = 0; d < shape.size(); ++d) shape[d] = std::max(shape[d], zshape[d]);
    z = float_param(*zero_point, x, fn, "zero_point").reshape(zshape).expand(shape).contiguous();
  }
  s = s.reshape(sshape).expand(shape).contiguous();
  Params p;
  p.bcast.ndim = static_cast<int>(x.dim());
  int64_t acc = 1;
  for (int64_t d = x.dim() - 1; d >= 0; --d) {
    p.bcast.sizes[d] = x.size(d);
    p.bcast.scale_strides[d] = shape[static_cast<size_t>(d)] == 1 ? 0 : acc;
    acc *= shape[static_cast<size_t>(d)];
  }
  if (mlq_layout(&p.bcast) < 0) {  // too irregular for the general path: one scale per element
    s = s.expand(x.sizes()).contiguous();
    if (z.defined()) z = z.expand(x.sizes()).contiguous();
    acc = 1;
    for (int64_t d = x.dim() - 1; d >= 0; --d) {
      p.bcast.scale_strides[d] = x.size(d) == 1 ? 0 : acc;
      acc *= x.size(d);
    }
  }
  p.scale = s;
  p.zp = z;
  return p;
}

// `negative` (may be null): an int32 flag in x's device memory, zeroed, for the unsigned-input check of the same
// pass (mlq_forward_unsigned).
Tensor forward_into(mlq_forward_op op, const Tensor& x_in, const Tensor& scale, const OptTensor& zp, int64_t qmin,
                    int64_t qmax, const char* fn, const Tensor* negative) {
  check_device(x_in, fn, "x");
  const mlq_dtype dt = dtype_code(x_in, fn, "x");
  check_range(qmin, qmax, fn);
  const Tensor x = x_in.contiguous();
  Params p = prepare(x, scale, zp, fn);
  const bool codes = op == MLQ_QUANTIZE_INT || op == MLQ_QUANTIZE_AFFINE;
  Tensor y = at::empty(x.sizes(), x.options().dtype(codes ? at::kFloat : x.scalar_type()));
  if (x.numel() == 0) return y;
  DeviceScope scope(x);
  check_status(mlq_forward_unsigned(op, dt, x.data_ptr(), y.data_ptr(), p.scale.data_ptr<float>(),
                                    p.zp.defined() ? p.zp.data_ptr<float>() : nullptr, &p.bcast,
                                    static_cast<int>(qmin), static_cast<int>(qmax),
                                    negative != nullptr ? negative->data_ptr<int>() : nullptr, scope.stream()),
               fn);
  return y;
}

Tensor forward(mlq_forward_op op, const Tensor& x_in, const Tensor& scale, const OptTensor& zp, int64_t qmin,
               int64_t qmax, const char* fn) {
  return forward_into(op, x_in, scale, zp, qmin, qmax, fn, nullptr);
}

// The integer forward with the unsigned-input check in its own pass: (y, flag), the int32 flag (bit 1: an element
// of x is negative or NaN) returned unread, for the caller to read or defer (functional/library.py).
std::tuple<Tensor, Tensor> forward_unsigned(mlq_forward_op op, const Tensor& x, const Tensor& scale, int64_t qmin,
                                            int64_t qmax, const char* fn) {
  const Tensor flag = at::zeros({1}, x.options().dtype(at::kInt));  // forward_into checks x before any launch
  Tensor y = forward_into(op, x, scale, c10::nullopt, qmin, qmax, fn, &flag);
  return {y, flag};
}

std::tuple<Tensor, OptTensor> backward(mlq_backward_op op, const Tensor& grad_in, const Tensor& x_in,
                                       const Tensor& scale, const OptTensor& zp, int64_t qmin, int64_t qmax,
                                       bool need_scale_grad, const char* fn) {
  check_device(x_in, fn, "x");
  check_device(grad_in, fn, "grad");
  dtype_code(x_in, fn, "x");
  dtype_code(grad_in, fn, "grad");
  check_range(qmin, qmax, fn);
  MOL_CHECK_VALUE(grad_in.sizes() == x_in.sizes(), where(fn), "grad of shape ", grad_in.sizes(),
                  " does not match x of shape ", x_in.sizes());
  MOL_CHECK_VALUE(grad_in.device() == x_in.device(), where(fn), "grad is on ", grad_in.device(), " but x is on ",
                  x_in.device());
  // Mixed dtypes: widen both to float32 (exact), then narrow grad_x back (exact: its values come from grad).
  const bool same = grad_in.scalar_type() == x_in.scalar_type();
  const Tensor x = same ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const Tensor grad = same ? grad_in.contiguous() : grad_in.to(at::kFloat).contiguous();
  Params p = prepare(x, scale, zp, fn);
  Tensor grad_x = at::empty(x.sizes(), grad.options());
  OptTensor term;
  if (need_scale_grad) term = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  if (x.numel() > 0) {
    DeviceScope scope(x);
    check_status(mlq_backward(op, dtype_code(x, fn, "x"), grad.data_ptr(), x.data_ptr(), grad_x.data_ptr(),
                              term.has_value() ? term->data_ptr<float>() : nullptr, p.scale.data_ptr<float>(),
                              p.zp.defined() ? p.zp.data_ptr<float>() : nullptr, &p.bcast, static_cast<int>(qmin),
                              static_cast<int>(qmax), scope.stream()),
                 fn);
  }
  if (!same) grad_x = grad_x.to(grad_in.scalar_type());
  return std::make_tuple(grad_x, term);
}

// --- the reference.py functions ------------------------------------------------------------------------------------
Tensor fake_quant_int(const Tensor& x, const Tensor& scale, int64_t qmin, int64_t qmax) {
  return forward(MLQ_FAKE_QUANT_INT, x, scale, c10::nullopt, qmin, qmax, "fake_quant_int");
}
Tensor quantize_int(const Tensor& x, const Tensor& scale, int64_t qmin, int64_t qmax) {
  return forward(MLQ_QUANTIZE_INT, x, scale, c10::nullopt, qmin, qmax, "quantize_int");
}
std::tuple<Tensor, Tensor> fake_quant_uint_flagged(const Tensor& x, const Tensor& scale, int64_t qmin, int64_t qmax) {
  return forward_unsigned(MLQ_FAKE_QUANT_INT, x, scale, qmin, qmax, "fake_quant_uint_flagged");
}
std::tuple<Tensor, Tensor> quantize_uint_flagged(const Tensor& x, const Tensor& scale, int64_t qmin, int64_t qmax) {
  return forward_unsigned(MLQ_QUANTIZE_INT, x, scale, qmin, qmax, "quantize_uint_flagged");
}
Tensor fake_e4m3(const Tensor& x, const Tensor& scale) {
  return forward(MLQ_FAKE_E4M3, x, scale, c10::nullopt, -448, 448, "fake_e4m3");
}
Tensor fake_affine(const Tensor& x, const Tensor& scale, const Tensor& zero_point, int64_t qmin, int64_t qmax) {
  return forward(MLQ_FAKE_AFFINE, x, scale, zero_point, qmin, qmax, "fake_affine");
}
Tensor quantize_affine(const Tensor& x, const Tensor& scale, const Tensor& zero_point, int64_t qmin, int64_t qmax) {
  return forward(MLQ_QUANTIZE_AFFINE, x, scale, zero_point, qmin, qmax, "quantize_affine");
}
std::tuple<Tensor, OptTensor> int_backward(const Tensor& grad, const Tensor& x, const Tensor& scale, int64_t qmin,
                                           int64_t qmax, bool need_scale_grad) {
  return backward(MLQ_INT_BACKWARD, grad, x, scale, c10::nullopt, qmin, qmax, need_scale_grad, "int_backward");
}
std::tuple<Tensor, OptTensor> e4m3_backward(const Tensor& grad, const Tensor& x, const Tensor& scale,
                                            bool need_scale_grad) {
  return backward(MLQ_E4M3_BACKWARD, grad, x, scale, c10::nullopt, -448, 448, need_scale_grad, "e4m3_backward");
}
Tensor affine_backward(const Tensor& grad, const Tensor& x, const Tensor& scale, const Tensor& zero_point,
                       int64_t qmin, int64_t qmax) {
  return std::get<0>(
      backward(MLQ_AFFINE_BACKWARD, grad, x, scale, zero_point, qmin, qmax, false, "affine_backward"));
}

// --- histograms on the calibrator's power-of-two grid --------------------------------------------------------------
Tensor histogram_rows(const Tensor& a_in, const Tensor& exp, int64_t cap) {
  const char* fn = "histogram_rows";
  check_device(a_in, fn, "a");
  MOL_CHECK_VALUE(a_in.dim() == 2, where(fn), "a must be 2-D (rows, values), got shape ", a_in.sizes());
  MOL_CHECK_VALUE(cap >= 1, where(fn), "cap must be >= 1, got ", cap);
  mlq_dtype dt = MLQ_FLOAT64;
  if (a_in.scalar_type() != at::kDouble) dt = dtype_code(a_in, fn, "a");
  MOL_CHECK_TYPE(!exp.is_floating_point() && !exp.is_complex() && exp.scalar_type() != at::kBool, where(fn),
                 "exp must be an integer tensor, got ", exp.scalar_type());
  const int64_t rows = a_in.size(0), cols = a_in.size(1);
  MOL_CHECK_VALUE(exp.numel() == rows || exp.numel() == 1, where(fn), "exp has ", exp.numel(),
                  " elements, expected 1 or one per row (", rows, ")");
  const Tensor a = a_in.contiguous();
  const Tensor e = exp.to(a.device(), at::kLong).reshape({-1}).expand({rows}).contiguous();
  Tensor counts = at::zeros({rows, cap}, a.options().dtype(at::kLong));
  if (a.numel() == 0) return counts;
  DeviceScope scope(a);
  check_status(mlq_histogram(dt, a.data_ptr(), rows, cols, e.data_ptr<int64_t>(), 0, cap,
                             counts.data_ptr<int64_t>(), scope.stream()),
               fn);
  return counts;
}

int64_t needed_exp(double m, int64_t cap) {  // smallest e >= E_MIN with cap * 2**e > m (as calib.grid.needed_exp)
  if (!(m > 0.0)) return kEMin;
  int ex = 0;
  std::frexp(m, &ex);
  int c = 0;
  while (c < 63 && (int64_t{1} << c) <= cap) ++c;  // bit_length(cap)
  int64_t e = ex - c;
  if (!(static_cast<double>(cap) * std::ldexp(1.0, static_cast<int>(e)) > m)) ++e;
  return std::max(e, kEMin);
}

Tensor histogram(const Tensor& x_abs, int64_t num_bins, double max) {
  const char* fn = "histogram";
  MOL_CHECK_VALUE(num_bins >= 1, where(fn), "num_bins must be >= 1, got ", num_bins);
  MOL_CHECK_VALUE(std::isfinite(max) && max >= 0.0, where(fn), "max must be finite and >= 0, got ", max);
  check_device(x_abs, fn, "x_abs");
  const Tensor e = at::full({1}, needed_exp(max, num_bins), x_abs.options().dtype(at::kLong));
  return histogram_rows(x_abs.reshape({1, -1}), e, num_bins).reshape({num_bins});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "modelopt_lite CUDA kernels (the functions of modelopt_lite.functional.reference, bit-exact)";
  namespace py = pybind11;
  using mol::python_errors;
  m.def("fake_quant_int", python_errors(&fake_quant_int), "clamp(rint(x / s), qmin, qmax) * s in x's dtype",
        py::arg("x"), py::arg("scale"), py::arg("qmin"), py::arg("qmax"));
  m.def("quantize_int", python_errors(&quantize_int), "integer codes as float32", py::arg("x"), py::arg("scale"),
        py::arg("qmin"), py::arg("qmax"));
  m.def("fake_quant_uint_flagged", python_errors(&fake_quant_uint_flagged),
        "fake_quant_int -> (y, flag): the int32 flag (1: x holds a negative value or NaN), not read", py::arg("x"),
        py::arg("scale"), py::arg("qmin"), py::arg("qmax"));
  m.def("quantize_uint_flagged", python_errors(&quantize_uint_flagged),
        "quantize_int -> (codes, flag): the int32 flag (1: x holds a negative value or NaN), not read", py::arg("x"),
        py::arg("scale"), py::arg("qmin"), py::arg("qmax"));
  m.def("fake_e4m3", python_errors(&fake_e4m3), "e4m3(clamp(x / s, -448, 448)) * s in x's dtype", py::arg("x"),
        py::arg("scale"));
  m.def("fake_affine", python_errors(&fake_affine), "(clamp(rint(x / s) + zp, qmin, qmax) - zp) * s",
        py::arg("x"), py::arg("scale"), py::arg("zero_point"), py::arg("qmin"), py::arg("qmax"));
  m.def("quantize_affine", python_errors(&quantize_affine), "affine codes as float32", py::arg("x"),
        py::arg("scale"), py::arg("zero_point"), py::arg("qmin"), py::arg("qmax"));
  m.def("int_backward", python_errors(&int_backward), "(grad_x, per-element scale gradient or None)",
        py::arg("grad"), py::arg("x"), py::arg("scale"), py::arg("qmin"), py::arg("qmax"),
        py::arg("need_scale_grad"));
  m.def("e4m3_backward", python_errors(&e4m3_backward), "(grad_x, per-element scale gradient or None)",
        py::arg("grad"), py::arg("x"), py::arg("scale"), py::arg("need_scale_grad"));
  m.def("affine_backward", python_errors(&affine_backward), "grad_x of affine quantization", py::arg("grad"),
        py::arg("x"), py::arg("scale"), py::arg("zero_point"), py::arg("qmin"), py::arg("qmax"));
  m.def("histogram_rows", python_errors(&histogram_rows),
        "int64 (rows, cap) counts of floor(v * 2**-exp[row]) (calib.grid.histogram_rows; out-of-range values "
        "are not counted)",
        py::arg("a"), py::arg("exp"), py::arg("cap"));
  m.def("histogram", python_errors(&histogram),
        "int64 counts of x_abs on the calibrator's grid for max: bin width 2**e, e = calib.grid.needed_exp(max, "
        "num_bins)",
        py::arg("x_abs"), py::arg("num_bins"), py::arg("max"));
  mol::register_mx_cuda_ops(m);
  mol::register_block_cuda_ops(m);
}
