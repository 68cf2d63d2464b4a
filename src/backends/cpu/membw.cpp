#include "backends/cpu/membw.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "core/error.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace turbospark::cpu {
namespace {

constexpr size_t kPage = 4096;
constexpr int kRepetitions = 5;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Reads [p, p + n) and folds it into one word, so the loads cannot be optimised away. The
// slice is read as kStreams concurrent sequential streams (its quarters), the access pattern
// the matmul kernels use: on Zen 3 one stream per core leaves ~10% of the bandwidth unused.
constexpr int kStreams = 4;

uint64_t read_slice(const uint8_t* p, size_t n) {
  // Slices are whole pages, so the quarters are whole cache lines and cover all of it.
  const size_t q = n / kStreams / 64 * 64;
  uint64_t folded = 0;
#if defined(__AVX2__)
  __m256i a[kStreams][2];
  for (int s = 0; s < kStreams; ++s) a[s][0] = a[s][1] = _mm256_setzero_si256();
  for (size_t i = 0; i < q; i += 64) {
    for (int s = 0; s < kStreams; ++s) {
      const uint8_t* line = p + s * q + i;
      a[s][0] = _mm256_xor_si256(a[s][0], _mm256_load_si256(reinterpret_cast<const __m256i*>(line)));
      a[s][1] = _mm256_xor_si256(a[s][1], _mm256_load_si256(reinterpret_cast<const __m256i*>(line + 32)));
    }
  }
  for (int s = 0; s < kStreams; ++s) {
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(a[s][0], a[s][1]));
    folded ^= lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  }
#else
  uint64_t a[kStreams] = {};
  for (size_t i = 0; i < q; i += 8) {
    for (int s = 0; s < kStreams; ++s) {
      uint64_t v;
      std::memcpy(&v, p + s * q + i, 8);
      a[s] ^= v;
    }
  }
  for (int s = 0; s < kStreams; ++s) folded ^= a[s];
#endif
  return folded;
}

}  // namespace

double measure_read_bandwidth_gbs(ThreadPool& pool, size_t bytes) {
  bytes = bytes / kPage * kPage;
  TS_CHECK(bytes >= kPage, "membw: buffer of {} bytes is too small to measure", bytes);
  std::unique_ptr<uint8_t, FreeDeleter> buffer(static_cast<uint8_t*>(std::aligned_alloc(kPage, bytes)));
  TS_CHECK(buffer != nullptr, "membw: cannot allocate {} bytes", bytes);
  uint8_t* data = buffer.get();
  const size_t pages = bytes / kPage;

  // Thread t always owns pages [pages * t / n, pages * (t + 1) / n).
  auto slice_of = [&](int t, int n, size_t* begin, size_t* end) {
    *begin = pages * size_t(t) / size_t(n) * kPage;
    *end = pages * size_t(t + 1) / size_t(n) * kPage;
  };
  // Each thread first-touches the pages it will later read, so on NUMA hosts they sit on its
  // node, and every page is really backed (reading untouched pages would hit the zero page).
  pool.run([&](int t, int n) {
    size_t b, e;
    slice_of(t, n, &b, &e);
    std::memset(data + b, 0x5a, e - b);
  });

  std::vector<uint64_t> sinks(size_t(pool.size()) * 8, 0);  // 64 bytes apart: no false sharing
  double best_s = 1e30;
  for (int rep = 0; rep < kRepetitions; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.run([&](int t, int n) {
      size_t b, e;
      slice_of(t, n, &b, &e);
      sinks[size_t(t) * 8] ^= read_slice(data + b, e - b);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best_s = std::min(best_s, s);
  }
  // Make the result depend on the loads so the compiler must perform them.
  uint64_t folded = 0;
  for (uint64_t v : sinks) folded ^= v;
  volatile uint64_t keep = folded;
  (void)keep;
  return double(bytes) / best_s / 1e9;
}

}  // namespace turbospark::cpu
