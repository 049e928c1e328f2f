// The torch binding of the real W8A8 kernels (modelopt_lite/csrc/real_cuda_binding.cpp) with its launchers running
// on the host: registers torch.ops.modelopt_lite_emulated.* for CPU tensors (tests/test_real_kernels_host.py).
#define MODELOPT_LITE_EMULATE_ON_HOST 1
#include "../../modelopt_lite/csrc/real_cuda_binding.cpp"
#include "../../modelopt_lite/csrc/real_kernels.cu"
