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
    while (generation_.load(std::memory_order_acquire) == seen && spins < 20000) {
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
  while (pending_.load(std::memory_order_acquire) != 0) TS_PAUSE();
  job_ = nullptr;
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  int64_t chunks = (n + grain - 1) / grain;
  int used = int(std::min<int64_t>(n_threads_, chunks));
  if (used <= 1) {
    fn(0, n);
    return;
  }
  run([&](int t, int) {
    if (t >= used) return;
    int64_t per = chunks / used, extra = chunks % used;
    int64_t c0 = t * per + std::min<int64_t>(t, extra);
    int64_t c1 = c0 + per + (t < extra ? 1 : 0);
    int64_t b = c0 * grain, e = std::min(n, c1 * grain);
    if (b < e) fn(b, e);
  });
}

}  // namespace turbospark
