// The launchers of modelopt_lite/csrc/real_kernels.cu compiled as host C++ into a plain shared library (no torch):
// with MODELOPT_LITE_EMULATE_ON_HOST they run the kernels' element functions on the CPU. tests/test_real_kernels_host.py
// calls the extern "C" launchers through ctypes on CPU tensors' memory (tests only).
#define MODELOPT_LITE_EMULATE_ON_HOST 1
#include "../../modelopt_lite/csrc/real_kernels.cu"
