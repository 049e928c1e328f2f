// The CUDA launcher of block_kernels.cu (fused dynamic block quantization) compiled as host C++: it runs the
// kernel's lanes on the CPU, warp by warp (tests only; see tests/test_cuda_binding_emulated.py).
#define MODELOPT_LITE_EMULATE_ON_HOST 1
#include "../../modelopt_lite/csrc/block_kernels.cu"
