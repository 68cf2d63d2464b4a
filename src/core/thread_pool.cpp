#include "core/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#define TS_PAUSE() _mm_pause()
#else
#define TS_PAUSE() std::this_thread::yield()
#endif

namespace turbospark {

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    // Spin for a while (a decode step's next op usually comes within microseconds)...
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && spins < 4000) {
      TS_PAUSE();
      ++spins;
    }
    // ...then sleep until the next job.
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    (*job_)(index, n_threads_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  pending_.store(n_threads_ - 1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_.notify_all();
  fn(0, n_threads_);
  // Spin briefly for the stragglers, then yield: when the machine is oversubscribed (tests
  // in parallel, a build) a descheduled worker must get the core rather than watch us spin.
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < 2000) TS_PAUSE();
    else std::this_thread::yield();
  }
  job_ = nullptr;
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  // Chunks are handed out dynamically (about 8 per thread): on a shared or virtual machine
  // one core is often slower, and a static split leaves the other spinning at the barrier.
  int64_t chunk = std::max<int64_t>(grain, (n / (int64_t(n_threads_) * 8)) / grain * grain);
  int64_t n_chunks = (n + chunk - 1) / chunk;
  if (n_threads_ == 1 || n_chunks <= 1) {
    fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  run([&](int, int) {
    for (;;) {
      int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= n_chunks) break;
      int64_t b = c * chunk, e = std::min(n, b + chunk);
      fn(b, e);
    }
  });
}

}  // namespace turbospark
