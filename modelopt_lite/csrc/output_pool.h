// modelopt_lite: the fresh outputs of every native CPU kernel (one owner: output_pool.cpp).
//
// A fresh 64 MiB output costs 16384 first-touch page faults. On the 2-core AMD EPYC VMs of bench/REPORT.md they
// cost about 1 us each (3-4x the kernel: a 4096x4096 fake quant takes ~7 ms into existing memory and ~25 ms into
// new memory), whether the pages are touched by one thread or two, pre-faulted with MAP_POPULATE, or come from
// torch's allocator or mmap: the price is the VM's (freed memory goes back to the host and is faulted in again),
// not the kernel's. torch.compile's outputs pay the same faults (bench/bench_fake_quant.py --faults).
//
// So every kernel (integer, affine, E4M3/E5M2/E2M1, NVFP4, MX; forward and backward) takes its outputs from
// empty_output(), whose large blocks (>= 4 MiB, 2 MiB-aligned and -granular) come from one process-wide pool:
//   - a tensor's storage returns its block to the pool when the storage is freed (its deleter), so the pool only
//     ever hands out memory whose previous tensor is released, never memory still referenced;
//   - a request takes the most recently returned block of exactly its (rounded) size, else allocates a new one;
//   - at most `limit` bytes are kept (the oldest blocks are freed first): 512 MiB by default,
//     MODELOPT_LITE_OUTPUT_POOL_MB in the environment (0: off), or set_limit(); release() frees what is kept;
//   - thread-safe (one mutex; a deleter may run on any thread), never destroyed (a tensor freed during interpreter
//     exit still finds it); the storages are resizable (the allocator is the pool's).
// Smaller outputs come from torch's CPU allocator. Every kernel computes every element of its output, so stale
// bytes of a reused block are never visible. New large blocks may be advised as transparent huge pages (opt-in,
// see huge_page_advice in output_pool.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace mol {

// A contiguous, uninitialized output of `shape` (CPU options; pooled when large).
at::Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions& opts);

namespace outpool {

// MiB kept at most (0: off); nullopt: back to the default (MODELOPT_LITE_OUTPUT_POOL_MB, else 512). Frees kept
// blocks beyond the new limit. Negative values are the caller's error to report.
void set_limit(std::optional<int64_t> mib);

// Free every kept block.
void release();

// (bytes kept, blocks kept, limit in bytes, hits, misses)
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> stats();

// Whether new large blocks are advised as transparent huge pages; nullopt: the default (MODELOPT_LITE_HUGEPAGES=1).
bool huge_page_advice();
void set_huge_page_advice(std::optional<bool> on);

}  // namespace outpool
}  // namespace mol
