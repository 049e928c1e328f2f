// Argument checks of the NVFP4 / MX native ops (CPU and CUDA bindings): the exception types and messages of
// functional/microscaling.py, so that every backend fails the same way. Torch headers: bindings only.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "check_msg.h"

namespace mol {
namespace mxchk {

inline std::string torch_dtype_name(at::ScalarType dt) {
  switch (dt) {
    case at::kDouble:
      return "torch.float64";
    case at::kLong:
      return "torch.int64";
    case at::kInt:
      return "torch.int32";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    default:
      return c10::toString(dt);
  }
}

inline void check_block(int64_t block, std::initializer_list<int64_t> allowed, const char* fmt) {
  std::string list = "(";
  bool ok = false;
  for (const int64_t a : allowed) {
    ok |= a == block;
    list += std::to_string(a) + (allowed.size() == 1 ? ",)" : (a == *(allowed.end() - 1) ? ")" : ", "));
  }
  MOL_CHECK_VALUE(ok, fmt, " block size must be one of ", list, " along the last axis, got ", block);
}

inline std::string float_repr(float v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return std::to_string(v);
}

[[noreturn]] inline void raise_nonfinite(const at::Tensor& x, const std::string& what) {
  const at::Tensor xf = x.contiguous().reshape({-1});
  const at::Tensor idx = at::logical_not(at::isfinite(xf)).nonzero();
  const float v = idx.numel() ? xf[idx[0][0].item<int64_t>()].item<float>() : NAN;
  MOL_CHECK_VALUE(false, what, " contains NaN or Inf (", float_repr(v),
                  "); NVFP4/MX formats cannot represent it: clean the input");
  abort();  // unreachable
}

inline const char* const kElemNames[] = {"e4m3", "e5m2", "e2m1", "int8"};

inline int elem_index(const std::string& elem) {
  for (int i = 0; i < 4; ++i) {
    if (elem == kElemNames[i]) return i;
  }
  MOL_CHECK_VALUE(false, "MX element format must be one of ('e4m3', 'e5m2', 'e2m1', 'int8'), got '", elem, "'");
  return -1;
}

inline bool rounding_rceil(const std::string& rounding) {
  MOL_CHECK_VALUE(rounding == "floor" || rounding == "rceil",
                  "MX scale rounding must be one of ('floor', 'rceil'), got '", rounding, "'");
  return rounding == "rceil";
}

inline float global_scale_value(const at::Tensor& gs) {
  MOL_CHECK_VALUE(gs.numel() == 1, "NVFP4 global_scale must be a single (per-tensor) value, got shape ", gs.sizes());
  const float v = gs.to(at::kCPU).to(at::kFloat).item<float>();
  MOL_CHECK_VALUE(v >= 0.0f && !std::isinf(v), "NVFP4 global_scale must be finite and >= 0, got ", float_repr(v));
  return v;
}

// x's dtype and rank (the device is checked by each binding).
inline void check_x(const at::Tensor& x, const std::string& what) {
  const auto dt = x.scalar_type();
  MOL_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, what,
                 " must be float32, float16 or bfloat16, got ", torch_dtype_name(dt));
  MOL_CHECK_VALUE(x.dim() > 0, what, " must have at least one dimension (blocks run along the last axis), got a ",
                  "scalar");
}

}  // namespace mxchk
}  // namespace mol
