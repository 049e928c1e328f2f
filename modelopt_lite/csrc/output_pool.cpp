// modelopt_lite: the one pool of released output memory shared by every native CPU kernel (see output_pool.h).
#include "output_pool.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <utility>

namespace mol {
namespace {

constexpr size_t kAlign = size_t{2} << 20;     // block alignment and size granule
constexpr size_t kMinBytes = size_t{4} << 20;  // smaller outputs come from torch's allocator
constexpr int64_t kDefaultLimitMiB = 512;

struct Pool {
  std::mutex mu;
  std::deque<std::pair<size_t, void*>> blocks;  // (bytes, block), oldest first
  size_t held = 0;
  int64_t limit = -1;  // bytes kept at most; -1: not decided yet (the environment)
  uint64_t hits = 0, misses = 0;
};

Pool& pool() {
  static Pool* p = new Pool();  // intentionally leaked: deleters may run after static destruction
  return *p;
}

int64_t default_limit() {
  const char* env = std::getenv("MODELOPT_LITE_OUTPUT_POOL_MB");
  int64_t mib = kDefaultLimitMiB;
  if (env != nullptr && env[0] != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    if (end != nullptr && *end == '\0' && v >= 0) mib = static_cast<int64_t>(v);
  }
  return mib << 20;
}

size_t limit_locked(Pool& P) {
  if (P.limit < 0) P.limit = default_limit();
  return static_cast<size_t>(P.limit);
}

void trim_locked(Pool& P, size_t keep) {
  while (P.held > keep && !P.blocks.empty()) {
    P.held -= P.blocks.front().first;
    std::free(P.blocks.front().second);
    P.blocks.pop_front();
  }
}

// ---- transparent-huge-page advice of new large blocks (opt-in) -------------------------------------------------
// MADV_HUGEPAGE makes the first write fault one 2 MiB page instead of 512 4 KiB ones, which is most of the cost of a
// fresh output when huge pages are cheap to get. They often are not: under THP defrag "always", "madvise" or
// "defer+madvise" an advised region that finds no free huge page stalls in direct compaction on its first touch,
// and in VMs with free page reporting at 2 MiB (virtio-balloon, page_reporting_order 9) every freed huge page goes
// back to the host and the next output faults it in again. On the 2-core AMD EPYC VM of bench/REPORT.md a
// per-tensor fake-quant of 256 MiB took twice the un-advised time in an interleaved A/B under load. So it is off
// unless asked for: MODELOPT_LITE_HUGEPAGES=1 in the environment, or set_huge_page_advice(true). The pool makes it
// matter less: only a block the pool does not have yet is new memory.
int default_huge_page_advice() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const char* env = std::getenv("MODELOPT_LITE_HUGEPAGES");
  return (env != nullptr && env[0] == '1') ? 1 : 0;
#else
  return 0;
#endif
}

std::atomic<int> g_huge_page_advice{-1};  // -1: not decided yet

bool advice_on() {
  int v = g_huge_page_advice.load(std::memory_order_relaxed);
  if (v < 0) {
    v = default_huge_page_advice();
    g_huge_page_advice.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

// ---- blocks -----------------------------------------------------------------------------------------------------
// A kept block of exactly `bytes` (the most recently returned one), or nullptr. *keepable: whether the pool could
// keep a block of this size at all (on, and the limit holds it).
void* take(size_t bytes, bool* keepable) {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  *keepable = limit_locked(P) >= bytes;
  for (auto it = P.blocks.rbegin(); it != P.blocks.rend(); ++it) {
    if (it->first == bytes) {
      void* p = it->second;
      P.held -= bytes;
      P.blocks.erase(std::next(it).base());
      ++P.hits;
      return p;
    }
  }
  if (*keepable) ++P.misses;
  return nullptr;
}

// Keep a released block (newest last), trimming the oldest beyond the limit; free it if it can never be kept.
void give(void* p, size_t bytes) {
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

struct BlockCtx {
  void* p;
  size_t bytes;
};

void pooled_delete(void* ctx) {
  auto* c = static_cast<BlockCtx*>(ctx);
  give(c->p, c->bytes);
  delete c;
}

void plain_delete(void* p) { std::free(p); }

// The storages' allocator: pooled 2 MiB-aligned blocks for large requests, torch's CPU allocator for the rest.
// A storage keeps a pointer to it (a resize allocates through it), so it is never destroyed either.
struct PoolAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes) return c10::GetCPUAllocator()->allocate(n);
    const size_t bytes = (n + kAlign - 1) / kAlign * kAlign;
    bool keepable = false;
    void* p = take(bytes, &keepable);
    if (p != nullptr) return {p, new BlockCtx{p, bytes}, &pooled_delete, c10::Device(c10::kCPU)};
    const bool advise = advice_on();
    if (!keepable && !advise) return c10::GetCPUAllocator()->allocate(n);
    if (posix_memalign(&p, kAlign, bytes) != 0) return c10::GetCPUAllocator()->allocate(n);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (advise) madvise(p, bytes, MADV_HUGEPAGE);  // advice only: a refusal leaves ordinary pages
#endif
    if (!keepable) return {p, p, &plain_delete, c10::Device(c10::kCPU)};
    return {p, new BlockCtx{p, bytes}, &pooled_delete, c10::Device(c10::kCPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

c10::Allocator* allocator() {
  static PoolAllocator* a = new PoolAllocator();  // intentionally leaked (see above)
  return a;
}

}  // namespace

at::Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions& opts) {
  TORCH_CHECK(opts.device().is_cpu(), "modelopt_lite cpu kernels: outputs are CPU tensors, got ", opts.device());
  return at::Tensor(at::detail::empty_generic(shape, allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                              c10::typeMetaToScalarType(opts.dtype()), c10::MemoryFormat::Contiguous));
}

namespace outpool {

void set_limit(std::optional<int64_t> mib) {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  P.limit = mib.has_value() ? (std::max<int64_t>(*mib, 0) << 20) : default_limit();
  trim_locked(P, static_cast<size_t>(P.limit));
}

void release() {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  trim_locked(P, 0);
}

std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> stats() {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  const size_t limit = limit_locked(P);
  return {static_cast<int64_t>(P.held), static_cast<int64_t>(P.blocks.size()), static_cast<int64_t>(limit),
          static_cast<int64_t>(P.hits), static_cast<int64_t>(P.misses)};
}

bool huge_page_advice() { return advice_on(); }

void set_huge_page_advice(std::optional<bool> on) {
  g_huge_page_advice.store(on.has_value() ? (*on ? 1 : 0) : default_huge_page_advice(), std::memory_order_relaxed);
}

}  // namespace outpool
}  // namespace mol
