// modelopt_lite native CPU kernels of the blocked 4-bit and microscaling formats: the tensor driver and the Python
// binding (registered into the module of quant_cpu.cpp by register_mx_ops).
//
// Exposes fake_nvfp4 and fake_mx with the results of functional/microscaling.py bit for bit: blocks along the last
// axis (the last block of a row may be partial), float32/float16/bfloat16 (float64 too) inputs of any strides,
// outputs contiguous in x's dtype, plus (on request) the per-block scales as float32. One pass: at::parallel_for
// over the blocks of the whole tensor, chunks of whole blocks staged through small float32 buffers (float32 data is
// used in place), the per-chunk work done by the kernels of mx_kernels.h of the implementation in force.
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "mx_elem.h"
#include "mx_kernels.h"
#include "quant_kernels.h"

namespace mol {
const Kernels& active_kernels();  // quant_cpu.cpp: the implementation in force (set_kernel_impl)
}

namespace {

using mol::Kernels;
using mol::MxKernels;
constexpr int64_t kChunk = 2048;  // floats per staging buffer

const MxKernels& mx_kernels(const Kernels& K) {
  const MxKernels* a = mol::mx_avx2_kernels();
  return (a != nullptr && std::string(K.name) == "avx2") ? *a : mol::mx_scalar_kernels();
}

void check_x(const at::Tensor& x, const char* fn) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), "modelopt_lite cpu kernels, ", fn, ": x must be on the CPU, got ",
                    x.device());
  const auto dt = x.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble,
                   "modelopt_lite cpu kernels, ", fn, ": x must be float32, float16 or bfloat16, got ", dt);
}

void to_f32(const Kernels& K, const void* p, at::ScalarType dt, int64_t n, float* buf) {
  if (dt == at::kHalf) {
    K.f16_to_f32(static_cast<const uint16_t*>(p), buf, n);
  } else {
    K.bf16_to_f32(static_cast<const uint16_t*>(p), buf, n);
  }
}

void from_f32(const Kernels& K, const float* src, void* p, at::ScalarType dt, int64_t n) {
  if (dt == at::kHalf) {
    K.f32_to_f16(src, static_cast<uint16_t*>(p), n);
  } else {
    K.f32_to_bf16(src, static_cast<uint16_t*>(p), n);
  }
}

// Run kern(in, out, block_scales, n) over every row of x (blocks of `block` along the last axis), returning the
// output in x's dtype and, if need_scales, the float32 per-block values the kernel wrote (shape [..., blocks]).
template <class Fn>
std::tuple<at::Tensor, std::optional<at::Tensor>> blocked(const at::Tensor& x_in, int64_t block, bool need_scales,
                                                          const char* fn, const Fn& kern) {
  check_x(x_in, fn);
  TORCH_CHECK_VALUE(block > 0, "modelopt_lite cpu kernels, ", fn, ": block size must be > 0, got ", block);
  const bool dbl = x_in.scalar_type() == at::kDouble;
  const at::Tensor x = (dbl ? x_in.to(at::kFloat) : x_in).contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t K = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t nbr = K == 0 ? 0 : (K + block - 1) / block;
  std::vector<int64_t> sshape(x.sizes().begin(), x.sizes().end());
  if (sshape.empty()) sshape.push_back(1);
  sshape.back() = nbr;
  std::optional<at::Tensor> scales;
  if (need_scales) scales = at::empty(sshape, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {dbl ? y.to(at::kDouble) : y, scales};
  const int64_t rows = x.numel() / K, total = rows * nbr;
  const at::ScalarType dt = x.scalar_type();
  const size_t es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  float* sp = need_scales ? scales->data_ptr<float>() : nullptr;
  const Kernels& Kn = mol::active_kernels();
  const MxKernels& M = mx_kernels(Kn);
  const int64_t cap = std::max<int64_t>(1, kChunk / block);  // blocks per chunk
  const int64_t grain = std::max<int64_t>(1, 32768 / block);
  at::parallel_for(0, total, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> bin, bout;
    if (dt != at::kFloat) {
      bin.resize(static_cast<size_t>(cap * block));
      bout.resize(static_cast<size_t>(cap * block));
    }
    for (int64_t b = b0; b < b1;) {
      const int64_t r = b / nbr, j = b % nbr;
      const int64_t jj = std::min({nbr, j + (b1 - b), j + cap});
      const int64_t e0 = j * block, m = std::min(K, jj * block) - e0;
      const int64_t off = r * K + e0;
      float* s = sp ? sp + r * nbr + j : nullptr;
      if (dt == at::kFloat) {
        kern(M, reinterpret_cast<const float*>(xp) + off, reinterpret_cast<float*>(yp) + off, s, m);
      } else {
        to_f32(Kn, xp + off * es, dt, m, bin.data());
        kern(M, bin.data(), bout.data(), s, m);
        from_f32(Kn, bout.data(), yp + off * es, dt, m);
      }
      b += jj - j;
    }
  });
  return {dbl ? y.to(at::kDouble) : y, scales};
}

float scalar_f32(const at::Tensor& t, const char* fn, const char* what) {
  TORCH_CHECK_VALUE(t.numel() == 1, "modelopt_lite cpu kernels, ", fn, ": ", what, " must have one element, got ",
                    t.numel());
  return t.to(at::kCPU).to(at::kFloat).item<float>();
}

// NVFP4 fake quant: blocks of `block` with E4M3 scales relative to the float32 global scale scale_2 (a dead
// scale_2 == 0 gives zeros). Returns (y, block scales or None).
std::tuple<at::Tensor, std::optional<at::Tensor>> fake_nvfp4(const at::Tensor& x, const at::Tensor& scale_2,
                                                              int64_t block, bool need_scales) {
  const float s2 = scalar_f32(scale_2, "fake_nvfp4", "scale_2");
  TORCH_CHECK_VALUE(s2 >= 0.0f && s2 < INFINITY, "modelopt_lite cpu kernels, fake_nvfp4: scale_2 must be finite and ",
                    ">= 0, got ", s2);
  if (s2 == 0.0f) {
    return blocked(x, block, need_scales, "fake_nvfp4",
                   [](const MxKernels&, const float*, float* out, float* s, int64_t n) {
                     std::fill(out, out + n, 0.0f);
                     (void)s;
                   });
  }
  auto r = blocked(x, block, need_scales, "fake_nvfp4",
                   [&](const MxKernels& M, const float* in, float* out, float* s, int64_t n) {
                     M.nvfp4_fwd(in, out, s, n, block, s2);
                   });
  return r;
}

// MX fake quant: blocks of `block` with a shared power-of-two scale 2**e (e in [-127, 127]); elem 0..3 =
// e4m3, e5m2, e2m1, int8; rceil selects ceil(log2(amax / max)) over floor(log2(amax)) - emax.
// Returns (y, exponents e as float32 or None).
std::tuple<at::Tensor, std::optional<at::Tensor>> fake_mx(const at::Tensor& x, int64_t elem, int64_t block,
                                                           bool rceil, bool need_scales) {
  TORCH_CHECK_VALUE(elem >= 0 && elem <= 3, "modelopt_lite cpu kernels, fake_mx: elem must be 0..3 ",
                    "(e4m3, e5m2, e2m1, int8), got ", elem);
  const int e = static_cast<int>(elem);
  return blocked(x, block, need_scales, "fake_mx",
                 [&](const MxKernels& M, const float* in, float* out, float* s, int64_t n) {
                   M.mx_fwd(e, rceil, in, out, s, n, block);
                 });
}

std::string mx_kernel_impl() { return mx_kernels(mol::active_kernels()).name; }

}  // namespace

namespace mol {

void register_mx_ops(pybind11::module_& m) {
  namespace py = pybind11;
  using rel = py::call_guard<py::gil_scoped_release>;
  m.def("fake_nvfp4", &fake_nvfp4, "NVFP4 fake quant along the last axis: (y, E4M3 block scales or None)",
        py::arg("x"), py::arg("scale_2"), py::arg("block"), py::arg("need_scales"), rel());
  m.def("fake_mx", &fake_mx, "MX fake quant along the last axis: (y, block exponents or None)", py::arg("x"),
        py::arg("elem"), py::arg("block"), py::arg("rceil"), py::arg("need_scales"), rel());
  m.def("mx_kernel_impl", &mx_kernel_impl, "name of the blocked-format kernels in use: 'avx2' or 'scalar'");
}

}  // namespace mol
