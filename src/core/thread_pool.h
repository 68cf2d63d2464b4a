// A persistent pool of worker threads that the CPU backend splits every op across.
// Workers spin briefly on a generation counter before sleeping, because a decode step
// issues hundreds of small ops and waking a thread through a condition variable for each
// costs more than the op itself.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace turbospark {

class ThreadPool {
 public:
  // n_threads <= 0 uses every hardware thread.
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Runs fn(thread_index, n_threads) once on every thread (the caller is thread 0) and
  // returns when all have finished.
  void run(const std::function<void(int, int)>& fn);

  // Splits [0, n) into contiguous ranges whose sizes are multiples of `grain` (except the
  // last) and calls fn(begin, end) for each, from any thread; a thread may get several.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace turbospark
