// modelopt_lite native CPU kernels of the blocked 4-bit and microscaling formats: the tensor driver and the Python
// binding (registered into the module of quant_cpu.cpp by register_mx_ops).
//
// Exposes fake_nvfp4(x, global_scale, block) and fake_mx(x, elem, block, rounding), the functions of
// functional/microscaling.py with the same signatures, errors and results bit for bit (blocks along the last axis,
// the last block of a row may be partial; float32/float16/bfloat16 inputs of any strides; outputs contiguous in x's
// dtype), plus nvfp4_fake_with_scales / mx_fake_with_exponents, which also return the per-block scales.
// NaN/Inf inputs raise ValueError as in the reference, detected in the kernels' block-amax pass (no extra pass). One pass: at::parallel_for
// over the blocks of the whole tensor, chunks of whole blocks staged through small float32 buffers (float32 data is
// used in place), the per-chunk work done by the kernels of mx_kernels.h of the implementation in force.
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <optional>
#include <tuple>
#include <vector>

#include "mx_checks.h"
#include "mx_elem.h"
#include "mx_kernels.h"
#include "quant_elem.h"
#include "output_pool.h"
#include "quant_kernels.h"

namespace mol {
const Kernels& active_kernels();  // quant_cpu.cpp: the implementation in force (set_kernel_impl)
const MxKernels& mx_kernels_of(const Kernels& K);  // quant_cpu.cpp: the blocked-format kernels paired with K
}

namespace {

using mol::Kernels;
using mol::MxKernels;
constexpr int64_t kChunk = 2048;  // floats per staging buffer

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

// Run kern(M, in, out, block_scales, n) -> bool over every row of x (blocks of `block` along the last axis).
// Returns the output in x's dtype, the float32 per-block values the kernel wrote (shape [..., blocks]) when
// need_scales, and whether any kernel call reported a non-finite block amax.
struct BlockedResult {
  at::Tensor y;
  std::optional<at::Tensor> scales;
  bool nonfinite;
};

// out (optional): a preallocated contiguous output of x's shape and dtype (benchmarks: the kernel without the page
// faults of a fresh output). Fresh outputs come from the shared output pool (output_pool.h).
// scales_in (optional, with need_scales): the float32 contiguous tensor of shape (..., blocks) the kernel's per-block
// values go to (instead of a new one).
template <class Fn>
BlockedResult blocked(const at::Tensor& x_in, int64_t block, bool need_scales, const Fn& kern,
                      const std::optional<at::Tensor>& out = std::nullopt,
                      const std::optional<at::Tensor>& scales_in = std::nullopt) {
  const at::Tensor x = x_in.contiguous();
  if (out.has_value()) {
    TORCH_CHECK_VALUE(out->is_contiguous() && out->sizes() == x.sizes() && out->scalar_type() == x.scalar_type() &&
                          out->device().is_cpu() && !out->is_same(x),
                      "modelopt_lite cpu kernels: out must be a contiguous CPU tensor of x's shape and dtype, "
                      "distinct from x");
  }
  at::Tensor y = out.has_value() ? *out : mol::empty_output(x.sizes(), x.options());
  const int64_t K = x.size(-1);
  const int64_t nbr = (K + block - 1) / block;
  std::vector<int64_t> sshape(x.sizes().begin(), x.sizes().end());
  sshape.back() = nbr;
  std::optional<at::Tensor> scales;
  if (need_scales) scales = scales_in.has_value() ? *scales_in : at::empty(sshape, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {y, scales, false};
  const int64_t rows = x.numel() / K, total = rows * nbr;
  const at::ScalarType dt = x.scalar_type();
  const size_t es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  float* sp = need_scales ? scales->data_ptr<float>() : nullptr;
  const Kernels& Kn = mol::active_kernels();
  const MxKernels& M = mol::mx_kernels_of(Kn);
  const int64_t cap = std::max<int64_t>(1, kChunk / block);  // blocks per chunk
  const int64_t grain = std::max<int64_t>(1, 32768 / block);
  std::atomic<bool> bad{false};
  at::parallel_for(0, total, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> bin, bout;
    if (dt != at::kFloat) {
      bin.resize(static_cast<size_t>(cap * block));
      bout.resize(static_cast<size_t>(cap * block));
    }
    bool seen = false;
    for (int64_t b = b0; b < b1;) {
      const int64_t r = b / nbr, j = b % nbr;
      const int64_t jj = std::min({nbr, j + (b1 - b), j + cap});
      const int64_t e0 = j * block, m = std::min(K, jj * block) - e0;
      const int64_t off = r * K + e0;
      float* s = sp ? sp + r * nbr + j : nullptr;
      if (dt == at::kFloat) {
        seen |= kern(M, reinterpret_cast<const float*>(xp) + off, reinterpret_cast<float*>(yp) + off, s, m);
      } else {
        to_f32(Kn, xp + off * es, dt, m, bin.data());
        seen |= kern(M, bin.data(), bout.data(), s, m);
        from_f32(Kn, bout.data(), yp + off * es, dt, m);
      }
      b += jj - j;
    }
    if (seen) bad.store(true, std::memory_order_relaxed);
  });
  return {y, scales, bad.load()};
}

// The reference's checks (microscaling._prepare / _check_block), same exception types and messages.
void check_x(const at::Tensor& x, const std::string& what) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), "modelopt_lite cpu kernels: ", what, " must be on the CPU, got ", x.device());
  mol::mxchk::check_x(x, what);
}

using mol::mxchk::check_block;
using mol::mxchk::elem_index;
using mol::mxchk::global_scale_value;
using mol::mxchk::raise_nonfinite;
using mol::mxchk::rounding_rceil;

BlockedResult nvfp4_run(const at::Tensor& x, const at::Tensor& global_scale, int64_t block, bool need_scales,
                        const std::optional<at::Tensor>& out = std::nullopt) {
  const std::string what = "NVFP4 input";
  check_x(x, what);
  check_block(block, {16, 32}, "NVFP4");
  const float gs = global_scale_value(global_scale);
  BlockedResult r =
      gs == 0.0f
          ? blocked(x, block, need_scales,
                    [&](const MxKernels& M, const float* in, float* out, float* s, int64_t n) {
                      // a dead tensor: zeros and zero scales, but still the finiteness check of the reference
                      const bool bad = M.nvfp4_fwd(in, out, s, n, block, 1.0f);
                      std::fill(out, out + n, 0.0f);
                      if (s != nullptr) std::fill(s, s + (n + block - 1) / block, 0.0f);
                      return bad;
                    },
                    out)
          : blocked(
                x, block, need_scales,
                [&](const MxKernels& M, const float* in, float* o, float* s, int64_t n) {
                  return M.nvfp4_fwd(in, o, s, n, block, gs);
                },
                out);
  if (r.nonfinite) raise_nonfinite(x, what);
  return r;
}

BlockedResult mx_run(const at::Tensor& x, const std::string& elem, int64_t block, const std::string& rounding,
                     bool need_scales, const std::optional<at::Tensor>& out = std::nullopt) {
  const int e = elem_index(elem);
  const bool rceil = rounding_rceil(rounding);
  const std::string what = "MX (" + elem + ") input";
  check_x(x, what);
  check_block(block, {32}, "MX");
  BlockedResult r = blocked(
      x, block, need_scales,
      [&](const MxKernels& M, const float* in, float* o, float* s, int64_t n) {
        return M.mx_fwd(e, rceil, in, o, s, n, block);
      },
      out);
  if (r.nonfinite) raise_nonfinite(x, what);
  return r;
}

// microscaling.fake_nvfp4: e2m1(x / (s * gs)) * (s * gs) per block of 16 or 32, in x's dtype.
at::Tensor fake_nvfp4(const at::Tensor& x, const at::Tensor& global_scale, int64_t block,
                      const std::optional<at::Tensor>& out) {
  return nvfp4_run(x, global_scale, block, false, out).y;
}

// (y, E4M3-valued float32 block scales of shape (..., nblocks)): microscaling.nvfp4_block_scales alongside.
std::tuple<at::Tensor, at::Tensor> nvfp4_fake_with_scales(const at::Tensor& x, const at::Tensor& global_scale,
                                                          int64_t block) {
  BlockedResult r = nvfp4_run(x, global_scale, block, true);
  return {r.y, *r.scales};
}

// microscaling.fake_mx: elem(x / 2**k) * 2**k per block of 32, in x's dtype.
at::Tensor fake_mx(const at::Tensor& x, const std::string& elem, int64_t block, const std::string& rounding,
                   const std::optional<at::Tensor>& out) {
  return mx_run(x, elem, block, rounding, false, out).y;
}

// (y, int32 exponents k of shape (..., nblocks)): microscaling.mx_scale_exponents alongside.
std::tuple<at::Tensor, at::Tensor> mx_fake_with_exponents(const at::Tensor& x, const std::string& elem, int64_t block,
                                                          const std::string& rounding) {
  BlockedResult r = mx_run(x, elem, block, rounding, true);
  return {r.y, r.scales->to(at::kInt)};
}

// tensor_quant.fake_block_quant over blocks of `block` along the last axis (the last one of a row may be partial),
// integer (kind 0: codes in [qmin, qmax]) or E4M3 (kind 1) elements, in one pass over x: per block the amax (the
// static `amax` of shape (..., blocks), else max |x| of the block: dynamic), scale = scale_from_amax(amax, bound),
// y = fake_quant_int(x, scale) or fake_e4m3(x, scale); a dynamic amax never goes to memory. Returns (y in x's dtype,
// float32 scales of shape (..., blocks), bad): bad when a dynamic block amax was NaN or Inf, or a static one NaN,
// Inf or negative; the caller raises the reference's error then (y and scales are not to be used).
std::tuple<at::Tensor, at::Tensor, bool> fake_block_last(const at::Tensor& x, const std::optional<at::Tensor>& amax,
                                                         int64_t block, int64_t kind, double bound, int64_t qmin,
                                                         int64_t qmax) {
  check_x(x, "block input");
  TORCH_CHECK_VALUE(block >= 1, "modelopt_lite cpu kernels: block size must be >= 1, got ", block);
  TORCH_CHECK_VALUE(kind == 0 || kind == 1, "modelopt_lite cpu kernels: kind must be 0 (int) or 1 (e4m3), got ", kind);
  std::optional<at::Tensor> scales_in;
  if (amax.has_value()) {
    std::vector<int64_t> sshape(x.sizes().begin(), x.sizes().end());
    sshape.back() = (x.size(-1) + block - 1) / block;
    TORCH_CHECK_VALUE(amax->device().is_cpu() && amax->scalar_type() == at::kFloat && amax->sizes() == sshape,
                      "modelopt_lite cpu kernels: block amax must be a float32 CPU tensor of shape ", sshape,
                      ", got ", amax->scalar_type(), " ", amax->sizes());
  }
  // The static amax is read in place (no copy: a small parallel op costs a whole pass on a loaded machine); the
  // kernel finds block j's amax at the offset of its scale pointer from the start of the scales.
  const at::Tensor am = amax.has_value() ? amax->contiguous() : at::Tensor();
  const float* ap = amax.has_value() ? am.data_ptr<float>() : nullptr;
  if (amax.has_value()) scales_in = at::empty(am.sizes(), am.options());
  const float* s0 = amax.has_value() ? scales_in->data_ptr<float>() : nullptr;
  const bool dynamic = !amax.has_value();
  const Kernels& Kn = mol::active_kernels();
  const float b = static_cast<float>(bound), lo = static_cast<float>(qmin), hi = static_cast<float>(qmax);
  auto kern = [&](const MxKernels&, const float* in, float* o, float* s, int64_t n) {
    bool bad = false;
    for (int64_t e = 0, j = 0; e < n; e += block, ++j) {
      const int64_t m = std::min(block, n - e);
      const float a = dynamic ? Kn.absmax(in + e, m) : ap[(s - s0) + j];
      float sc = 0.0f;
      if (mol::amax_ok_elem(a)) {
        sc = mol::scale_from_amax_elem(a, b);
      } else {
        bad = true;
      }
      s[j] = sc;
      if (kind == 0) {
        Kn.int_fwd(in + e, &sc, 0, lo, hi, o + e, m, false);
      } else {
        Kn.e4m3_fwd(in + e, &sc, 0, o + e, m);
      }
    }
    return bad;
  };
  BlockedResult r = blocked(x, block, true, kern, std::nullopt, scales_in);
  return {r.y, *r.scales, r.nonfinite};
}

std::string mx_kernel_impl() { return mol::mx_kernels_of(mol::active_kernels()).name; }

}  // namespace

namespace mol {

void register_mx_ops(pybind11::module_& m) {
  namespace py = pybind11;
  using rel = py::call_guard<py::gil_scoped_release>;
  m.def("fake_nvfp4", &fake_nvfp4, "NVFP4 fake quant along the last axis (microscaling.fake_nvfp4)", py::arg("x"),
        py::arg("global_scale"), py::arg("block") = 16, py::arg("out") = py::none(), rel());
  m.def("nvfp4_fake_with_scales", &nvfp4_fake_with_scales, "(fake_nvfp4 output, float32 E4M3 block scales)",
        py::arg("x"), py::arg("global_scale"), py::arg("block") = 16, rel());
  m.def("fake_mx", &fake_mx, "OCP MX fake quant along the last axis (microscaling.fake_mx)", py::arg("x"),
        py::arg("elem"), py::arg("block") = 32, py::arg("rounding") = "floor", py::arg("out") = py::none(), rel());
  m.def("mx_fake_with_exponents", &mx_fake_with_exponents, "(fake_mx output, int32 E8M0 exponents k)", py::arg("x"),
        py::arg("elem"), py::arg("block") = 32, py::arg("rounding") = "floor", rel());
  m.def("fake_block_last", &fake_block_last,
        "(y, float32 block scales, bad): static or dynamic block fake quant along the last axis in one pass",
        py::arg("x"), py::arg("amax"), py::arg("block"), py::arg("kind"), py::arg("bound"), py::arg("qmin"),
        py::arg("qmax"), rel());
  m.def("mx_kernel_impl", &mx_kernel_impl, "name of the blocked-format kernels in use: 'avx2' or 'scalar'");
}

}  // namespace mol
