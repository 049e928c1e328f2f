// The CPU kernels of the 4-bit and microscaling formats, on float32 arrays (no torch headers).
//
// Elementwise kernels take a scale pointer with an increment `sinc` of 0 (one scale) or 1 (one per element); a
// scale of exactly 0 marks a dead slice (exact +0 outputs). Blocked kernels take n consecutive elements of one row
// cut into blocks of `block` (the last one may be partial: it is quantized on its own elements, as the zero padding
// of the reference never changes a block's amax). Formulas: mx_elem.h and functional/microscaling.py.
//
// Two implementations, bit-identical: portable scalar (mx_scalar.cpp) and AVX2 (mx_avx2.cpp, per-function target
// attributes, chosen at run time together with the kernels of quant_kernels.h).
#pragma once

#include <cstdint>

namespace mol {

struct MxKernels {
  const char* name;
  // out = elem(clamp(x / s, -max, max)) * s for elem in {kE4M3, kE5M2, kE2M1}; 0 where s == 0.
  void (*minifloat_fwd)(int elem, const float* x, const float* s, int sinc, float* out, int64_t n);
  // NVFP4: per block s = e4m3(amax / (6 * scale_2)), out = e2m1(x / (s * scale_2)) * (s * scale_2); s == 0: zeros.
  // scales (if not null) receives one E4M3 block scale per block. Returns true when a block amax was NaN or Inf
  // (the caller rejects such inputs; the outputs of those blocks are then NaN or saturated, never read).
  bool (*nvfp4_fwd)(const float* x, float* out, float* scales, int64_t n, int64_t block, float scale_2);
  // MX: per block X = 2**e (mx_exponent), out = elem(x / X) * X. exps (if not null): one exponent per block.
  // Returns true when a block amax was NaN or Inf (as nvfp4_fwd).
  bool (*mx_fwd)(int elem, bool rceil, const float* x, float* out, float* exps, int64_t n, int64_t block);
};

const MxKernels& mx_scalar_kernels();
const MxKernels* mx_avx2_kernels();  // nullptr without AVX2 (CPU or build)

namespace mxscalar {
void minifloat_fwd(int elem, const float* x, const float* s, int sinc, float* out, int64_t n);
bool nvfp4_fwd(const float* x, float* out, float* scales, int64_t n, int64_t block, float scale_2);
bool mx_fwd(int elem, bool rceil, const float* x, float* out, float* exps, int64_t n, int64_t block);
}  // namespace mxscalar

}  // namespace mol
