// What the CUDA bindings of the blocked kernels (mx_cuda_binding.cpp, block_cuda_binding.cpp) share around a launch:
// the launchers' dtype code of a tensor, and the device guard and current stream of the tensor's device (the
// host-emulated build, MODELOPT_LITE_EMULATE_ON_HOST: no guard, a null stream).
#pragma once

#include <torch/extension.h>

#ifndef MODELOPT_LITE_EMULATE_ON_HOST
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "quant_kernels_api.h" /* mlq_dtype */

namespace mol {

// float32 / float16 / bfloat16 (the callers have checked the dtype).
inline mlq_dtype dtype_code(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? MLQ_FLOAT32 : t.scalar_type() == at::kHalf ? MLQ_FLOAT16 : MLQ_BFLOAT16;
}

#ifdef MODELOPT_LITE_EMULATE_ON_HOST
struct LaunchScope {
  explicit LaunchScope(const at::Tensor&) {}
  cudaStream_t stream() const { return nullptr; }
};
#else
struct LaunchScope {
  c10::cuda::CUDAGuard guard;
  explicit LaunchScope(const at::Tensor& x) : guard(x.device()) {}
  cudaStream_t stream() const { return c10::cuda::getCurrentCUDAStream(guard.current_device().index()).stream(); }
};
#endif

}  // namespace mol
