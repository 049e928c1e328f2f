// modelopt_lite native CPU kernels: the Python binding and the tensor driver.
//
// Exposes (PYBIND11_MODULE) the functions of functional/reference.py with the same signatures and bit-identical
// results: fake_quant_int, quantize_int, int_backward, fake_e4m3, e4m3_backward, fake_affine, quantize_affine,
// affine_backward. Inputs may be float32/float16/bfloat16 (float64 too), of any strides, broadcast against the
// float32 scale (and zero point); outputs are contiguous. Everything is computed in float32.
//
// One fused pass: an at::TensorIterator (parallel through at::parallel_for) walks the broadcast shape in the
// output's order, coalescing dimensions, so a per-tensor scale becomes one long row with a scalar scale, a
// per-channel/per-block scale becomes rows of `inner` elements with one scale each (axis 0, block views
// (N, nb, bs) with scale (N, nb, 1)) or rows with a per-element scale (last axis), and any other broadcast (tuple
// axes) becomes the same rows with a general index walk. Rows go through the float32 kernels of quant_kernels.h
// in chunks: float32 contiguous data is used in place; other dtypes or strides are staged through small buffers.
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: faster JIT build

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "mx_kernels.h"
#include "output_pool.h"
#include "quant_elem.h"
#include "quant_kernels.h"

namespace mol {
void register_mx_ops(pybind11::module_& m);  // mx_cpu.cpp: the blocked 4-bit / microscaling ops
const MxKernels& mx_kernels_of(const Kernels& K);  // defined below, beside active_kernels()
}

namespace {

using mol::Kernels;
constexpr int64_t kChunk = 1024;

std::atomic<const Kernels*> g_kernels{nullptr};

const Kernels& kernels() {
  const Kernels* k = g_kernels.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = mol::avx512_kernels();
    if (k == nullptr) k = mol::avx2_kernels();
    if (k == nullptr) k = &mol::scalar_kernels();
    g_kernels.store(k, std::memory_order_release);
  }
  return *k;
}

// ---- staging of one chunk of one operand ----------------------------------------------------------------------
const float* read_f32(const Kernels& K, const char* p, int64_t stride, at::ScalarType dt, int64_t n, float* buf) {
  switch (dt) {
    case at::kFloat:
      if (stride == static_cast<int64_t>(sizeof(float))) return reinterpret_cast<const float*>(p);
      for (int64_t i = 0; i < n; ++i) buf[i] = *reinterpret_cast<const float*>(p + i * stride);
      return buf;
    case at::kHalf:
      if (stride == 2) {
        K.f16_to_f32(reinterpret_cast<const uint16_t*>(p), buf, n);
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = mol::f16_to_f32_elem(*reinterpret_cast<const uint16_t*>(p + i * stride));
      }
      return buf;
    case at::kBFloat16:
      if (stride == 2) {
        K.bf16_to_f32(reinterpret_cast<const uint16_t*>(p), buf, n);
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = mol::bf16_to_f32_elem(*reinterpret_cast<const uint16_t*>(p + i * stride));
      }
      return buf;
    default:  // kDouble (checked by the binding): x.float() rounds to nearest even, as static_cast does
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(*reinterpret_cast<const double*>(p + i * stride));
      return buf;
  }
}

// A broadcastable float32 operand (scale, zero point): in place with inc 0 (broadcast) or 1 (contiguous).
const float* read_bcast(const char* p, int64_t stride, int64_t n, float* buf, int* inc) {
  if (stride == 0 || stride == static_cast<int64_t>(sizeof(float))) {
    *inc = stride == 0 ? 0 : 1;
    return reinterpret_cast<const float*>(p);
  }
  for (int64_t i = 0; i < n; ++i) buf[i] = *reinterpret_cast<const float*>(p + i * stride);
  *inc = 1;
  return buf;
}

void write_f32(const Kernels& K, const float* src, char* p, int64_t stride, at::ScalarType dt, int64_t n) {
  if (src == reinterpret_cast<const float*>(p)) return;  // computed in place
  switch (dt) {
    case at::kFloat:
      for (int64_t i = 0; i < n; ++i) *reinterpret_cast<float*>(p + i * stride) = src[i];
      return;
    case at::kHalf:
      if (stride == 2) {
        K.f32_to_f16(src, reinterpret_cast<uint16_t*>(p), n);
      } else {
        for (int64_t i = 0; i < n; ++i) *reinterpret_cast<uint16_t*>(p + i * stride) = mol::f32_to_f16_elem(src[i]);
      }
      return;
    case at::kBFloat16:
      if (stride == 2) {
        K.f32_to_bf16(src, reinterpret_cast<uint16_t*>(p), n);
      } else {
        for (int64_t i = 0; i < n; ++i) *reinterpret_cast<uint16_t*>(p + i * stride) = mol::f32_to_bf16_elem(src[i]);
      }
      return;
    default:  // kDouble
      for (int64_t i = 0; i < n; ++i) *reinterpret_cast<double*>(p + i * stride) = static_cast<double>(src[i]);
      return;
  }
}

// ---- the driver -----------------------------------------------------------------------------------------------
enum Role { kOut, kIn, kBcast };

// Walk `iter` (operands in the order outputs..., inputs...) in parallel; for every chunk call
// fn(K, in, inc, out, n) with contiguous float32 views of the operands (in[k]/inc[k] for inputs, out[k] for outputs).
template <int NT, class Fn>
void drive(at::TensorIterator& iter, const std::array<Role, NT>& roles, const Fn& fn) {
  const Kernels& K = kernels();
  std::array<at::ScalarType, NT> dts;
  for (int k = 0; k < NT; ++k) dts[k] = iter.dtype(k);
  iter.for_each([&](char** data, const int64_t* strides, int64_t n0, int64_t n1) {
    float bufs[NT][kChunk];
    std::array<const float*, NT> in{};
    std::array<float*, NT> out{};
    std::array<int, NT> inc{};
    for (int64_t r = 0; r < n1; ++r) {
      for (int64_t j = 0; j < n0; j += kChunk) {
        const int64_t m = std::min(kChunk, n0 - j);
        for (int k = 0; k < NT; ++k) {
          char* p = data[k] + r * strides[NT + k] + j * strides[k];
          if (roles[k] == kOut) {
            const bool direct = dts[k] == at::kFloat && strides[k] == static_cast<int64_t>(sizeof(float));
            out[k] = direct ? reinterpret_cast<float*>(p) : bufs[k];
          } else if (roles[k] == kIn) {
            in[k] = read_f32(K, p, strides[k], dts[k], m, bufs[k]);
            inc[k] = 1;
          } else {
            in[k] = read_bcast(p, strides[k], m, bufs[k], &inc[k]);
          }
        }
        fn(K, in, inc, out, m);
        for (int k = 0; k < NT; ++k) {
          if (roles[k] == kOut) write_f32(K, out[k], data[k] + r * strides[NT + k] + j * strides[k], strides[k], dts[k], m);
        }
      }
    }
  });
}

at::TensorIterator make_iter(std::initializer_list<at::Tensor> outs, std::initializer_list<at::Tensor> ins) {
  at::TensorIteratorConfig cfg;
  cfg.set_check_mem_overlap(false).check_all_same_dtype(false).resize_outputs(false);
  for (const auto& o : outs) cfg.add_output(o);
  for (const auto& i : ins) cfg.add_const_input(i);
  return cfg.build();
}

// ---- argument checks ------------------------------------------------------------------------------------------
void check_data(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "modelopt_lite cpu kernels: ", what, " must be on the CPU, got ", t.device());
  const auto dt = t.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble,
                   "modelopt_lite cpu kernels: ", what, " must be float32, float16 or bfloat16, got ", dt);
}

// Scale / zero point as float32 (float16, bfloat16 and integers convert exactly; float64 would change the math).
at::Tensor as_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "modelopt_lite cpu kernels: ", what, " must be on the CPU, got ", t.device());
  const auto dt = t.scalar_type();
  if (dt == at::kFloat) return t;
  TORCH_CHECK_TYPE(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kByte || dt == at::kChar ||
                       dt == at::kShort || dt == at::kInt || dt == at::kLong,
                   "modelopt_lite cpu kernels: ", what, " must be float32, got ", dt);
  return t.to(at::kFloat);
}

float qf(int64_t q) { return static_cast<float>(q); }

// Every output comes from the shared pool of output_pool.h (released large outputs' memory, huge-page advice).
at::Tensor empty_out(at::IntArrayRef shape, const at::TensorOptions& opts) { return mol::empty_output(shape, opts); }

// ---- forward ops -----------------------------------------------------------------------------------------------
at::Tensor int_forward(const at::Tensor& x, const at::Tensor& scale, int64_t qmin, int64_t qmax, bool codes) {
  check_data(x, "x");
  const at::Tensor s = as_f32(scale, "scale");
  at::Tensor y = empty_out(at::infer_size_dimvector(x.sizes(), s.sizes()),
                           x.options().dtype(codes ? at::kFloat : x.scalar_type()));
  if (y.numel() == 0) return y;
  auto iter = make_iter({y}, {x, s});
  const float lo = qf(qmin), hi = qf(qmax);
  drive<3>(iter, {kOut, kIn, kBcast}, [&](const Kernels& K, const auto& in, const auto& inc, const auto& out, int64_t n) {
    K.int_fwd(in[1], in[2], inc[2], lo, hi, out[0], n, codes);
  });
  return y;
}

at::Tensor fake_quant_int(const at::Tensor& x, const at::Tensor& scale, int64_t qmin, int64_t qmax) {
  return int_forward(x, scale, qmin, qmax, false);
}

// int_forward plus min(x) from the same pass (NaN when x holds a NaN; +Inf for an empty x): the unsigned ops
// refuse a negative or NaN input from it without a second read of x. One slot per worker thread, folded after.
std::tuple<at::Tensor, double> int_forward_min(const at::Tensor& x, const at::Tensor& scale, int64_t qmin,
                                               int64_t qmax, bool codes) {
  check_data(x, "x");
  const at::Tensor s = as_f32(scale, "scale");
  at::Tensor y = empty_out(at::infer_size_dimvector(x.sizes(), s.sizes()),
                           x.options().dtype(codes ? at::kFloat : x.scalar_type()));
  constexpr float kInf = std::numeric_limits<float>::infinity();
  if (y.numel() == 0) return {y, static_cast<double>(kInf)};
  struct alignas(64) Slot {
    float m = std::numeric_limits<float>::infinity();
  };
  std::vector<Slot> slots(static_cast<size_t>(std::max(1, at::get_num_threads())));
  auto iter = make_iter({y}, {x, s});
  const float lo = qf(qmin), hi = qf(qmax);
  drive<3>(iter, {kOut, kIn, kBcast}, [&](const Kernels& K, const auto& in, const auto& inc, const auto& out, int64_t n) {
    const size_t t = static_cast<size_t>(at::get_thread_num());
    TORCH_INTERNAL_ASSERT(t < slots.size(), "modelopt_lite: thread ", t, " outside ", slots.size(), " slots");
    K.int_fwd_min(in[1], in[2], inc[2], lo, hi, out[0], n, codes, &slots[t].m);
  });
  float m = kInf;
  for (const Slot& sl : slots) m = mol::scalar::fold_min(m, sl.m);
  return {y, static_cast<double>(m)};
}

std::tuple<at::Tensor, double> fake_quant_int_min(const at::Tensor& x, const at::Tensor& scale, int64_t qmin,
                                                  int64_t qmax) {
  return int_forward_min(x, scale, qmin, qmax, false);
}

std::tuple<at::Tensor, double> quantize_int_min(const at::Tensor& x, const at::Tensor& scale, int64_t qmin,
                                                int64_t qmax) {
  return int_forward_min(x, scale, qmin, qmax, true);
}

at::Tensor quantize_int(const at::Tensor& x, const at::Tensor& scale, int64_t qmin, int64_t qmax) {
  return int_forward(x, scale, qmin, qmax, true);
}

at::Tensor fake_e4m3(const at::Tensor& x, const at::Tensor& scale) {
  check_data(x, "x");
  const at::Tensor s = as_f32(scale, "scale");
  at::Tensor y = empty_out(at::infer_size_dimvector(x.sizes(), s.sizes()), x.options());
  if (y.numel() == 0) return y;
  auto iter = make_iter({y}, {x, s});
  drive<3>(iter, {kOut, kIn, kBcast}, [&](const Kernels& K, const auto& in, const auto& inc, const auto& out, int64_t n) {
    K.e4m3_fwd(in[1], in[2], inc[2], out[0], n);
  });
  return y;
}

// E4M3 / E5M2 / E2M1 (elem 0 / 1 / 2 of mx_elem.h): elem(clamp(x / s, -max, max)) * s in x's dtype.
at::Tensor fake_minifloat(const at::Tensor& x, const at::Tensor& scale, int64_t elem) {
  check_data(x, "x");
  const at::Tensor s = as_f32(scale, "scale");
  at::Tensor y = empty_out(at::infer_size_dimvector(x.sizes(), s.sizes()), x.options());
  if (y.numel() == 0) return y;
  auto iter = make_iter({y}, {x, s});
  const mol::MxKernels& M = mol::mx_kernels_of(kernels());
  const int e = static_cast<int>(elem);
  drive<3>(iter, {kOut, kIn, kBcast}, [&](const Kernels&, const auto& in, const auto& inc, const auto& out, int64_t n) {
    M.minifloat_fwd(e, in[1], in[2], inc[2], out[0], n);
  });
  return y;
}

at::Tensor fake_e5m2(const at::Tensor& x, const at::Tensor& scale) { return fake_minifloat(x, scale, 1); }

at::Tensor fake_e2m1(const at::Tensor& x, const at::Tensor& scale) { return fake_minifloat(x, scale, 2); }

at::Tensor affine_forward(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& zero_point, int64_t qmin,
                          int64_t qmax, bool codes) {
  check_data(x, "x");
  const at::Tensor s = as_f32(scale, "scale");
  const at::Tensor z = as_f32(zero_point, "zero_point");
  const auto shape = at::infer_size_dimvector(at::infer_size_dimvector(x.sizes(), s.sizes()), z.sizes());
  at::Tensor y = empty_out(shape, x.options().dtype(codes ? at::kFloat : x.scalar_type()));
  if (y.numel() == 0) return y;
  auto iter = make_iter({y}, {x, s, z});
  const float lo = qf(qmin), hi = qf(qmax);
  drive<4>(iter, {kOut, kIn, kBcast, kBcast},
           [&](const Kernels& K, const auto& in, const auto& inc, const auto& out, int64_t n) {
             K.affine_fwd(in[1], in[2], inc[2], in[3], inc[3], lo, hi, out[0], n, codes);
           });
  return y;
}

at::Tensor fake_affine(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& zero_point, int64_t qmin,
                       int64_t qmax) {
  return affine_forward(x, scale, zero_point, qmin, qmax, false);
}

at::Tensor quantize_affine(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& zero_point, int64_t qmin,
                           int64_t qmax) {
  return affine_forward(x, scale, zero_point, qmin, qmax, true);
}

// ---- backward ops ----------------------------------------------------------------------------------------------
using GradPair = std::tuple<at::Tensor, std::optional<at::Tensor>>;

// STE gradient for x (grad's dtype) and, if asked, the per-element scale gradient (float32, not reduced).
// e4m3 selects the FP8 grid (qmin/qmax ignored).
GradPair clip_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& scale, int64_t qmin, int64_t qmax,
                       bool need_scale_grad, bool e4m3) {
  check_data(grad, "grad");
  check_data(x, "x");
  const at::Tensor s = as_f32(scale, "scale");
  const auto shape = at::infer_size_dimvector(at::infer_size_dimvector(grad.sizes(), x.sizes()), s.sizes());
  at::Tensor gx = empty_out(shape, grad.options());
  std::optional<at::Tensor> gs;
  if (need_scale_grad) gs = empty_out(shape, x.options().dtype(at::kFloat));
  if (gx.numel() == 0) return {gx, gs};
  const float lo = qf(qmin), hi = qf(qmax);
  if (need_scale_grad) {
    auto iter = make_iter({gx, *gs}, {grad, x, s});
    drive<5>(iter, {kOut, kOut, kIn, kIn, kBcast},
             [&](const Kernels& K, const auto& in, const auto& inc, const auto& out, int64_t n) {
               if (e4m3) {
                 K.e4m3_bwd(in[2], in[3], in[4], inc[4], out[0], out[1], n);
               } else {
                 K.int_bwd(in[2], in[3], in[4], inc[4], lo, hi, out[0], out[1], n);
               }
             });
  } else {
    auto iter = make_iter({gx}, {grad, x, s});
    drive<4>(iter, {kOut, kIn, kIn, kBcast},
             [&](const Kernels& K, const auto& in, const auto& inc, const auto& out, int64_t n) {
               if (e4m3) {
                 K.e4m3_bwd(in[1], in[2], in[3], inc[3], out[0], nullptr, n);
               } else {
                 K.int_bwd(in[1], in[2], in[3], inc[3], lo, hi, out[0], nullptr, n);
               }
             });
  }
  return {gx, gs};
}

GradPair int_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& scale, int64_t qmin, int64_t qmax,
                      bool need_scale_grad) {
  return clip_backward(grad, x, scale, qmin, qmax, need_scale_grad, false);
}

GradPair e4m3_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& scale, bool need_scale_grad) {
  return clip_backward(grad, x, scale, 0, 0, need_scale_grad, true);
}

at::Tensor affine_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& scale,
                           const at::Tensor& zero_point, int64_t qmin, int64_t qmax) {
  check_data(grad, "grad");
  check_data(x, "x");
  const at::Tensor s = as_f32(scale, "scale");
  const at::Tensor z = as_f32(zero_point, "zero_point");
  auto shape = at::infer_size_dimvector(at::infer_size_dimvector(grad.sizes(), x.sizes()), s.sizes());
  shape = at::infer_size_dimvector(shape, z.sizes());
  at::Tensor gx = empty_out(shape, grad.options());
  if (gx.numel() == 0) return gx;
  auto iter = make_iter({gx}, {grad, x, s, z});
  const float lo = qf(qmin), hi = qf(qmax);
  drive<5>(iter, {kOut, kIn, kIn, kBcast, kBcast},
           [&](const Kernels& K, const auto& in, const auto& inc, const auto& out, int64_t n) {
             K.affine_bwd(in[1], in[2], in[3], inc[3], in[4], inc[4], lo, hi, out[0], n);
           });
  return gx;
}

// ---- amax check and scale ------------------------------------------------------------------------------------
// amax_scale.checked_scale on the CPU in one call, where the torch ops take twelve: (scale, bad) with scale =
// scales.scale_from_amax(amax, bound) (a contiguous float32 tensor of amax's shape; 0 where amax is bad) and bad the
// flat index of the first amax that is NaN, Inf or < 0 (-0.0 is fine), or -1. The caller raises the error.
std::tuple<at::Tensor, int64_t> checked_scale(const at::Tensor& amax, double bound) {
  TORCH_CHECK_VALUE(amax.device().is_cpu(), "modelopt_lite cpu kernels: amax must be on the CPU, got ", amax.device());
  TORCH_CHECK_TYPE(amax.scalar_type() == at::kFloat, "modelopt_lite cpu kernels: amax must be float32, got ",
                   amax.scalar_type());
  const at::Tensor a = amax.contiguous();
  at::Tensor s = at::empty(a.sizes(), a.options());
  const float* ap = a.const_data_ptr<float>();
  float* sp = s.data_ptr<float>();
  const float b = static_cast<float>(bound);
  int64_t bad = -1;
  for (int64_t i = 0, n = a.numel(); i < n; ++i) {
    const bool ok = mol::amax_ok_elem(ap[i]);
    if (!ok && bad < 0) bad = i;
    sp[i] = ok ? mol::scale_from_amax_elem(ap[i], b) : 0.0f;
  }
  return {s, bad};
}

// ---- implementation selection and conversion check (for tests and benchmarks) -------------------------------
// x (float32) rounded to float16 or bfloat16 by the kernels' own output conversion.
at::Tensor round_float32(const at::Tensor& x, bool bfloat16) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "round_float32: x must be float32, got ", x.scalar_type());
  at::Tensor y = empty_out(x.sizes(), x.options().dtype(bfloat16 ? at::kBFloat16 : at::kHalf));
  if (y.numel() == 0) return y;
  auto iter = make_iter({y}, {x});
  drive<2>(iter, {kOut, kIn}, [&](const Kernels&, const auto& in, const auto&, const auto& out, int64_t n) {
    std::copy(in[1], in[1] + n, out[0]);
  });
  return y;
}

std::string kernel_impl() { return kernels().name; }

void set_kernel_impl(const std::string& name) {
  if (name == "scalar") {
    g_kernels.store(&mol::scalar_kernels(), std::memory_order_release);
  } else if (name == "avx2" || name == "avx512") {
    const Kernels* k = name == "avx2" ? mol::avx2_kernels() : mol::avx512_kernels();
    TORCH_CHECK_VALUE(k != nullptr, "modelopt_lite cpu kernels: ", name, " is not available on this CPU/build");
    g_kernels.store(k, std::memory_order_release);
  } else if (name == "auto") {
    g_kernels.store(nullptr, std::memory_order_release);
  } else {
    TORCH_CHECK_VALUE(false,
                      "modelopt_lite cpu kernels: kernel impl must be 'auto', 'avx512', 'avx2' or 'scalar', got '",
                      name, "'");
  }
}

void set_output_pool_limit(std::optional<int64_t> mib) {
  TORCH_CHECK_VALUE(!mib.has_value() || *mib >= 0, "output pool limit must be >= 0 MiB (0: off), got ", *mib);
  mol::outpool::set_limit(mib);
}

}  // namespace

namespace mol {
const Kernels& active_kernels() { return kernels(); }

// The blocked-format kernels to run beside K: the AVX2 ones for the AVX2 and AVX-512 sets (mx_avx2.cpp), else the
// scalar ones.
const MxKernels& mx_kernels_of(const Kernels& K) {
  const MxKernels* a = mx_avx2_kernels();
  return (a != nullptr && &K != &scalar_kernels()) ? *a : mx_scalar_kernels();
}
}  // namespace mol

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "modelopt_lite native CPU quantization kernels (bit-exact with functional/reference.py)";
  using rel = py::call_guard<py::gil_scoped_release>;
  m.def("fake_quant_int", &fake_quant_int, "clamp(rint(x / s), qmin, qmax) * s in x's dtype", py::arg("x"),
        py::arg("scale"), py::arg("qmin"), py::arg("qmax"), rel());
  m.def("fake_quant_int_min", &fake_quant_int_min,
        "(fake_quant_int, min(x)) from one pass; the min is NaN when x holds a NaN (+inf when x is empty)",
        py::arg("x"), py::arg("scale"), py::arg("qmin"), py::arg("qmax"));
  m.def("quantize_int_min", &quantize_int_min,
        "(quantize_int, min(x)) from one pass; the min is NaN when x holds a NaN (+inf when x is empty)",
        py::arg("x"), py::arg("scale"), py::arg("qmin"), py::arg("qmax"));
  m.def("quantize_int", &quantize_int, "clamp(rint(x / s), qmin, qmax) as float32 codes", py::arg("x"),
        py::arg("scale"), py::arg("qmin"), py::arg("qmax"), rel());
  m.def("int_backward", &int_backward, "STE grad_x and per-element LSQ scale gradient (or None)", py::arg("grad"),
        py::arg("x"), py::arg("scale"), py::arg("qmin"), py::arg("qmax"), py::arg("need_scale_grad"), rel());
  m.def("fake_e4m3", &fake_e4m3, "e4m3(clamp(x / s, -448, 448)) * s in x's dtype", py::arg("x"), py::arg("scale"),
        rel());
  m.def("e4m3_backward", &e4m3_backward, "STE grad_x and per-element scale gradient (or None)", py::arg("grad"),
        py::arg("x"), py::arg("scale"), py::arg("need_scale_grad"), rel());
  m.def("fake_affine", &fake_affine, "(clamp(rint(x / s) + zp, qmin, qmax) - zp) * s in x's dtype", py::arg("x"),
        py::arg("scale"), py::arg("zero_point"), py::arg("qmin"), py::arg("qmax"), rel());
  m.def("quantize_affine", &quantize_affine, "clamp(rint(x / s) + zp, qmin, qmax) as float32 codes", py::arg("x"),
        py::arg("scale"), py::arg("zero_point"), py::arg("qmin"), py::arg("qmax"), rel());
  m.def("affine_backward", &affine_backward, "STE grad_x for affine quantization", py::arg("grad"), py::arg("x"),
        py::arg("scale"), py::arg("zero_point"), py::arg("qmin"), py::arg("qmax"), rel());
  m.def("round_float32", &round_float32, "x (float32) rounded to float16/bfloat16 by the kernels' conversion",
        py::arg("x"), py::arg("bfloat16"), rel());
  m.def("checked_scale", &checked_scale,
        "(scale, index of the first NaN/Inf/negative amax or -1): amax_scale.checked_scale in one call",
        py::arg("amax"), py::arg("bound"));
  m.def("kernel_impl", &kernel_impl, "name of the kernel implementation in use: 'avx512', 'avx2' or 'scalar'");
  m.def("huge_page_advice", &mol::outpool::huge_page_advice,
        "whether large fresh outputs are advised as transparent huge pages (see set_huge_page_advice)");
  m.def("set_huge_page_advice", &mol::outpool::set_huge_page_advice,
        "True/False: advise large fresh outputs as transparent huge pages or not; None: the default "
        "(MODELOPT_LITE_HUGEPAGES=1 turns it on; off otherwise)",
        py::arg("on"));
  m.def("fake_e5m2", &fake_e5m2, "e5m2(clamp(x / s, -57344, 57344)) * s in x's dtype", py::arg("x"),
        py::arg("scale"), rel());
  m.def("fake_e2m1", &fake_e2m1, "e2m1_round(x / s) * s in x's dtype (FP4 E2M1 elements)", py::arg("x"),
        py::arg("scale"), rel());
  m.def("set_output_pool_limit", &set_output_pool_limit,
        "MiB of released output memory (every kernel's large outputs) kept for the next output of the same size "
        "(0: off; None: the default, MODELOPT_LITE_OUTPUT_POOL_MB or 512); see csrc/output_pool.h",
        py::arg("mib"));
  m.def("release_output_pool", &mol::outpool::release, "free the kept output memory");
  m.def("output_pool_stats", &mol::outpool::stats, "(bytes kept, blocks kept, limit bytes, hits, misses)");
  mol::register_mx_ops(m);
  m.def("set_kernel_impl", &set_kernel_impl,
        "force 'avx512', 'avx2' or 'scalar' kernels, or 'auto' (for tests/benchmarks)", py::arg("name"));
}
