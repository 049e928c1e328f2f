// modelopt_lite CUDA kernels, part 2 of 3: where the scale of element i lives (host planning, device cursors).
//
// make_plan (host) collapses x's shape and the scale's broadcast strides into the cheapest of three layouts; the
// matching Idx object travels in the kernel parameters, and a cursor built from it at the start of each vector
// gives the scale offset of consecutive elements. Like quant_math.cuh, everything also runs on the host.
#pragma once

#include "quant_math.cuh"

namespace mlq {

// ---------------------------------------------------------------------------------------------------------------
// 64-bit division by an invariant divisor (Granlund-Montgomery, valid for every 64-bit numerator).
// ---------------------------------------------------------------------------------------------------------------
MLQ_HD uint64_t umulhi64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return __umul64hi(a, b);
#else
  const uint64_t a_lo = a & 0xffffffffu, a_hi = a >> 32, b_lo = b & 0xffffffffu, b_hi = b >> 32;
  const uint64_t p0 = a_lo * b_lo, p1 = a_lo * b_hi, p2 = a_hi * b_lo, p3 = a_hi * b_hi;
  const uint64_t mid = (p0 >> 32) + (p1 & 0xffffffffu) + (p2 & 0xffffffffu);
  return p3 + (p1 >> 32) + (p2 >> 32) + (mid >> 32);
#endif
}

struct FastDivmod {
  uint64_t d = 1, m = 1;
  uint32_t sh1 = 0, sh2 = 0;
  FastDivmod() = default;
  __host__ explicit FastDivmod(uint64_t divisor) : d(divisor) {
    uint32_t l = 0;
    while (l < 64 && (uint64_t{1} << l) < d) ++l;  // l = ceil(log2(d))
    // m = floor(2**64 * (2**l - d) / d) + 1, by long division of (2**l - d) * 2**64 (high part < d, so the
    // quotient fits in 64 bits); 2**64 - d wraps correctly when l == 64.
    uint64_t r = (l == 64 ? 0 : (uint64_t{1} << l)) - d, q = 0;
    for (int bit = 63; bit >= 0; --bit) {
      const bool carry = (r >> 63) != 0;
      r <<= 1;
      if (carry || r >= d) {
        r -= d;
        q |= uint64_t{1} << bit;
      }
    }
    m = q + 1;
    sh1 = l < 1 ? l : 1;
    sh2 = l > 0 ? l - 1 : 0;
  }
  MLQ_HD uint64_t div(uint64_t n) const {
    const uint64_t t = umulhi64(m, n);
    return (t + ((n - t) >> sh1)) >> sh2;
  }
  MLQ_HD void divmod(uint64_t n, uint64_t& q, uint64_t& r) const {
    q = div(n);
    r = n - q * d;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Where the scale of element i lives. Three layouts (chosen on the host by make_plan):
//   PerTensor: one scale.   Channel: scale[(i / inner) % C].   General: any broadcast, up to kMaxDims merged dims.
// A cursor is positioned once per vector (a few fast divisions) and then stepped element by element.
// ---------------------------------------------------------------------------------------------------------------
constexpr int kMaxDims = 8;
constexpr int kMaxRank = 64;

struct PerTensorIdx {
  static constexpr bool kPerTensor = true;
  struct Cursor {
    MLQ_HD int64_t offset() const { return 0; }
    MLQ_HD int64_t run() const { return INT64_MAX; }  // elements left that share this offset
    MLQ_HD int64_t unit_run() const { return 0; }     // elements left whose offsets step by exactly 1
    MLQ_HD void next(const PerTensorIdx&) {}
  };
  MLQ_HD Cursor at(int64_t) const { return Cursor{}; }
};

struct ChannelIdx {
  static constexpr bool kPerTensor = false;
  int64_t C = 1, inner = 1;
  FastDivmod div_inner, div_c;
  struct Cursor {
    int64_t c, r, inner, C;
    MLQ_HD int64_t offset() const { return c; }
    MLQ_HD int64_t run() const { return inner - r; }
    MLQ_HD int64_t unit_run() const { return inner == 1 ? C - c : 0; }
    MLQ_HD void next(const ChannelIdx& idx) {
      if (++r == idx.inner) {
        r = 0;
        if (++c == idx.C) c = 0;
      }
    }
  };
  MLQ_HD Cursor at(int64_t i) const {
    uint64_t q, r, q2, c;
    div_inner.divmod(static_cast<uint64_t>(i), q, r);
    div_c.divmod(q, q2, c);
    return Cursor{static_cast<int64_t>(c), static_cast<int64_t>(r), inner, C};
  }
};

// Dims are stored right-aligned (the innermost merged dim at kMaxDims - 1); unused leading dims have size 1 and
// stride 0. Loops are fully unrolled so that coordinates stay in registers.
struct GeneralIdx {
  static constexpr bool kPerTensor = false;
  int first = kMaxDims - 1;  // index of the outermost used dim
  int64_t size[kMaxDims];
  int64_t stride[kMaxDims];
  int64_t span[kMaxDims];  // size * stride
  FastDivmod div[kMaxDims];
  struct Cursor {
    int64_t coord[kMaxDims];
    int64_t off;
    int64_t inner_left;  // elements left in the innermost run (same offset when the innermost stride is 0)
    int64_t unit_left;   // elements left in the innermost run when its stride is 1 (offsets step by 1), else 0
    MLQ_HD int64_t offset() const { return off; }
    MLQ_HD int64_t run() const { return inner_left; }
    MLQ_HD int64_t unit_run() const { return unit_left; }
    MLQ_HD void next(const GeneralIdx& g) {
      bool carry = true;
MLQ_UNROLL
      for (int k = kMaxDims - 1; k >= 0; --k) {
        if (carry) {
          ++coord[k];
          off += g.stride[k];
          if (coord[k] == g.size[k] && k > g.first) {
            off -= g.span[k];
            coord[k] = 0;
          } else {
            carry = false;
          }
        }
      }
      set_runs(g);
    }
    MLQ_HD void set_runs(const GeneralIdx& g) {
      const int64_t left = g.size[kMaxDims - 1] - coord[kMaxDims - 1];
      inner_left = g.stride[kMaxDims - 1] == 0 ? left : 1;
      unit_left = g.stride[kMaxDims - 1] == 1 ? left : 0;
    }
  };
  MLQ_HD Cursor at(int64_t i) const {
    Cursor cur;
    cur.off = 0;
    uint64_t rest = static_cast<uint64_t>(i);
MLQ_UNROLL
    for (int k = kMaxDims - 1; k >= 0; --k) {
      if (k > first) {
        uint64_t q, r;
        div[k].divmod(rest, q, r);
        cur.coord[k] = static_cast<int64_t>(r);
        rest = q;
      } else if (k == first) {
        cur.coord[k] = static_cast<int64_t>(rest);
      } else {
        cur.coord[k] = 0;
      }
      cur.off += cur.coord[k] * stride[k];
    }
    cur.set_runs(*this);
    return cur;
  }
};

// Scale (and zero point) of VEC consecutive elements starting at i0: one load when they share a slice.
template <bool kZp, int VEC, class Idx>
MLQ_HD void load_params(const Idx& idx, const float* scale, const float* zp, int64_t i0, float (&s)[VEC],
                        float (&z)[VEC]) {
  auto cur = idx.at(i0);
  if (cur.run() >= VEC) {
    const int64_t o = cur.offset();
    const float s0 = load_param(scale + o), z0 = kZp ? load_param(zp + o) : 0.0f;
MLQ_UNROLL
    for (int j = 0; j < VEC; ++j) s[j] = s0, z[j] = z0;
    return;
  }
  if (cur.unit_run() >= VEC) {  // consecutive slices (e.g. per-channel on the last axis): no stepping
    const int64_t o = cur.offset();
MLQ_UNROLL
    for (int j = 0; j < VEC; ++j) {
      s[j] = load_param(scale + o + j);
      z[j] = kZp ? load_param(zp + o + j) : 0.0f;
    }
    return;
  }
MLQ_UNROLL
  for (int j = 0; j < VEC; ++j) {
    const int64_t o = cur.offset();
    s[j] = load_param(scale + o);
    z[j] = kZp ? load_param(zp + o) : 0.0f;
    if (j + 1 < VEC) cur.next(idx);
  }
}

enum class Layout : int { PerTensor = 0, Channel = 1, General = 2 };

struct Plan {
  Layout kind = Layout::PerTensor;
  int ndim = 0;                 // merged dims, outermost first
  int64_t size[kMaxRank] = {};  // merged sizes
  int64_t stride[kMaxRank] = {};
  int64_t C = 1, inner = 1;  // Channel layout
};

// Collapse (x sizes, scale strides with 0 on broadcast dims) into the cheapest layout. x is contiguous.
// Returns false when the broadcast pattern needs more than kMaxDims merged dims (the caller then expands the scale).
__host__ inline bool make_plan(int ndim, const int64_t* sizes, const int64_t* scale_strides, Plan* p) {
  *p = Plan{};
  if (ndim < 0 || ndim > kMaxRank) return false;
  int m = 0;  // merged dims, built innermost first, then reversed
  int64_t ms[kMaxRank], mt[kMaxRank];
  for (int d = ndim - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    const int64_t st = scale_strides[d];
    if (m > 0 && st == mt[m - 1] * ms[m - 1]) {
      ms[m - 1] *= sizes[d];
    } else {
      ms[m] = sizes[d];
      mt[m] = st;
      ++m;
    }
  }
  p->ndim = m;
  for (int k = 0; k < m; ++k) {
    p->size[k] = ms[m - 1 - k];
    p->stride[k] = mt[m - 1 - k];
  }
  int varying = 0, where = -1;
  for (int k = 0; k < m; ++k)
    if (p->stride[k] != 0) ++varying, where = k;
  if (varying == 0) {
    p->kind = Layout::PerTensor;
    return true;
  }
  if (varying == 1 && p->stride[where] == 1) {
    p->kind = Layout::Channel;
    p->C = p->size[where];
    p->inner = 1;
    for (int k = where + 1; k < m; ++k) p->inner *= p->size[k];
    return true;
  }
  p->kind = Layout::General;
  return m <= kMaxDims;
}

__host__ inline ChannelIdx channel_idx(const Plan& p) {
  ChannelIdx c;
  c.C = p.C;
  c.inner = p.inner;
  c.div_inner = FastDivmod(static_cast<uint64_t>(p.inner));
  c.div_c = FastDivmod(static_cast<uint64_t>(p.C));
  return c;
}

__host__ inline GeneralIdx general_idx(const Plan& p) {
  GeneralIdx g;
  g.first = kMaxDims - p.ndim;
  for (int k = 0; k < kMaxDims; ++k) {
    const int src = k - g.first;
    g.size[k] = src >= 0 ? p.size[src] : 1;
    g.stride[k] = src >= 0 ? p.stride[src] : 0;
    g.span[k] = g.size[k] * g.stride[k];
    g.div[k] = FastDivmod(static_cast<uint64_t>(g.size[k]));
  }
  return g;
}

}  // namespace mlq
