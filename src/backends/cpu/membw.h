// DRAM streaming-read bandwidth of this machine, measured the way decode reads weights (every
// pool thread streaming its own contiguous slice), so `turbospark bench` can report achieved
// GB/s as a fraction of what the memory system actually delivers rather than a datasheet.
#pragma once

#include <cstddef>

#include "core/thread_pool.h"

namespace turbospark::cpu {

// Best-of-several streaming-read bandwidth in GB/s (1e9 bytes/s) over a freshly allocated
// buffer of `bytes` (rounded down to a multiple of 4 KiB; keep it well above the last-level
// cache so the number is DRAM's, not the cache's).
double measure_read_bandwidth_gbs(ThreadPool& pool, size_t bytes = size_t(1) << 30);

}  // namespace turbospark::cpu
