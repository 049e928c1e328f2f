// modelopt_lite: recycled memory for the large fresh outputs of the NVFP4 / MX CPU kernels.
//
// A fresh 64 MiB output costs 16384 first-touch page faults. On the 2-core AMD EPYC VM of bench/REPORT.md they
// cost about 1 us each (3-4x the kernel: a 4096x4096 fake quant takes ~7 ms into existing memory and ~25 ms into
// new memory), whether the pages are touched by one thread or two, pre-faulted with MAP_POPULATE, or come from
// torch's allocator or mmap: the price is the VM's (freed memory goes back to the host and is faulted in again),
// not the kernel's. torch.compile's outputs pay the same faults (bench/bench_fake_quant.py --faults).
//
// So the memory of an output the caller has released is kept for the next output of the same size: the tensor's
// deleter returns its block here instead of to the OS. Never an output still held (only the deleter gives a
// block back), never a result (every call computes every element). Blocks are 2 MiB aligned, at least 4 MiB
// (smaller outputs come from torch's allocator); at most `limit` bytes are kept (the oldest blocks are freed
// first), default 512 MiB, MODELOPT_LITE_OUTPUT_POOL_MB in the environment (0: off), or set_output_pool_limit.
// release() frees what is kept. Thread-safe (a deleter may run on any thread); the pool itself is never destroyed,
// so a tensor freed during interpreter exit still finds it.
#pragma once

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

namespace mol {
namespace mxpool {

constexpr size_t kAlign = size_t{2} << 20;     // block alignment and size granule
constexpr size_t kMinBytes = size_t{4} << 20;  // smaller outputs are not pooled
constexpr int64_t kDefaultLimitMiB = 512;

struct Pool {
  std::mutex mu;
  std::deque<std::pair<size_t, void*>> blocks;  // (bytes, block), oldest first
  size_t held = 0;
  int64_t limit = -1;  // bytes kept at most; -1: not decided yet (the environment)
  uint64_t hits = 0, misses = 0;
};

inline Pool& pool() {
  static Pool* p = new Pool();  // intentionally leaked: deleters may run after static destruction
  return *p;
}

inline int64_t default_limit() {
  const char* env = std::getenv("MODELOPT_LITE_OUTPUT_POOL_MB");
  int64_t mib = kDefaultLimitMiB;
  if (env != nullptr && env[0] != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    if (end != nullptr && *end == '\0' && v >= 0) mib = static_cast<int64_t>(v);
  }
  return mib << 20;
}

inline size_t limit_locked(Pool& P) {
  if (P.limit < 0) P.limit = default_limit();
  return static_cast<size_t>(P.limit);
}

inline void trim_locked(Pool& P, size_t keep) {
  while (P.held > keep && !P.blocks.empty()) {
    P.held -= P.blocks.front().first;
    std::free(P.blocks.front().second);
    P.blocks.pop_front();
  }
}

// A tensor's deleter: keep the block (newest last), trimming the oldest beyond the limit.
inline void give(void* p, size_t bytes) {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  const size_t limit = limit_locked(P);
  if (bytes > limit) {
    std::free(p);
    return;
  }
  trim_locked(P, limit - bytes);
  P.blocks.emplace_back(bytes, p);
  P.held += bytes;
}

// A kept block of exactly `bytes` (the most recently returned one), or nullptr.
inline void* take(size_t bytes) {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  if (limit_locked(P) == 0) return nullptr;
  for (auto it = P.blocks.rbegin(); it != P.blocks.rend(); ++it) {
    if (it->first == bytes) {
      void* p = it->second;
      P.held -= bytes;
      P.blocks.erase(std::next(it).base());
      ++P.hits;
      return p;
    }
  }
  ++P.misses;
  return nullptr;
}

// A fresh output of `shape`: pooled memory for large CPU outputs (fallback(shape, opts) otherwise, or when the
// pool is off or a block cannot be allocated).
template <class Fallback>
at::Tensor empty(at::IntArrayRef shape, const at::TensorOptions& opts, const Fallback& fallback) {
  int64_t numel = 1;
  for (const int64_t d : shape) numel *= d;
  const size_t raw = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(opts.dtype()));
  if (!opts.device().is_cpu() || raw < kMinBytes) return fallback(shape, opts);
  const size_t bytes = (raw + kAlign - 1) / kAlign * kAlign;
  void* p = take(bytes);
  if (p == nullptr) {
    {
      Pool& P = pool();
      std::lock_guard<std::mutex> lock(P.mu);
      if (limit_locked(P) < bytes) return fallback(shape, opts);  // off, or a block it could never keep
    }
    if (posix_memalign(&p, kAlign, bytes) != 0) return fallback(shape, opts);
  }
  return at::from_blob(p, shape, [bytes](void* q) { give(q, bytes); }, opts);
}

// None: back to the default (the environment variable, else 512 MiB). Frees kept blocks beyond the new limit.
inline void set_limit(std::optional<int64_t> mib) {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  P.limit = mib.has_value() ? (std::max<int64_t>(*mib, 0) << 20) : default_limit();
  trim_locked(P, static_cast<size_t>(P.limit));
}

inline void release() {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  trim_locked(P, 0);
}

// (bytes kept, blocks kept, limit in bytes, hits, misses)
inline std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> stats() {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  const size_t limit = limit_locked(P);
  return {static_cast<int64_t>(P.held), static_cast<int64_t>(P.blocks.size()), static_cast<int64_t>(limit),
          static_cast<int64_t>(P.hits), static_cast<int64_t>(P.misses)};
}

}  // namespace mxpool
}  // namespace mol
