// The CUDA launchers of mx_kernels.cu compiled as host C++: they run the kernel bodies on the CPU (tests only; see
// tests/test_cuda_binding_emulated.py, which builds this next to modelopt_lite/csrc/mx_cuda_binding.cpp).
#define MODELOPT_LITE_EMULATE_ON_HOST 1
#include "../../modelopt_lite/csrc/mx_kernels.cu"
