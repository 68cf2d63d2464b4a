// What the device tests share: device buffers, seeded random inputs, NaN-poisoned outputs,
// and the one error measure every CUDA-vs-CPU comparison uses.
#pragma once

#include <cuda_runtime.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "test_util.h"

namespace turbospark::testing {

// A crash on the device machine (where there may be no debugger) prints its stack to stderr:
// frames as binary(+offset), which addr2line resolves against the unstripped build here.
inline void print_stack_and_die(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char head[] = "\n*** device tests: fatal signal, stack:\n";
  (void)!write(2, head, sizeof(head) - 1);
  backtrace_symbols_fd(frames, n, 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
inline const bool kStackOnCrash = [] {
  std::signal(SIGSEGV, print_stack_and_die);
  std::signal(SIGBUS, print_stack_and_die);
  std::signal(SIGABRT, print_stack_and_die);
  return true;
}();

// Device memory of `n` elements of T, freed when it goes out of scope.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    cudaError_t e = cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T));
    TS_CHECK(e == cudaSuccess, "cudaMalloc of {} bytes: {}", n * sizeof(T), cudaGetErrorString(e));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    TS_CHECK(host.size() <= n_, "upload of {} elements into a buffer of {}", host.size(), n_);
    cudaError_t e = cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    TS_CHECK(e == cudaSuccess, "cudaMemcpy H2D: {}", cudaGetErrorString(e));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    cudaError_t e = cudaDeviceSynchronize();
    TS_CHECK(e == cudaSuccess, "kernel before download: {}", cudaGetErrorString(e));
    e = cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    TS_CHECK(e == cudaSuccess, "cudaMemcpy D2H: {}", cudaGetErrorString(e));
    return host;
  }
  // Fills every byte with 0xff: as float that is NaN, so an element a kernel forgot to
  // write fails the comparison instead of passing as a zero.
  void poison() {
    cudaError_t e = cudaMemset(p_, 0xff, n_ * sizeof(T));
    TS_CHECK(e == cudaSuccess, "cudaMemset: {}", cudaGetErrorString(e));
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  return uniform_floats(n, seed, lo, hi);
}

inline std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& x : v) x = uint8_t(rng());
  return v;
}

// ||a - b|| / ||b|| over n values; infinity when either side holds a NaN or an infinity
// (NaN-poisoned outputs and NaN-producing kernels both fail), 0 when both are all zero.
inline double normalized_error(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

inline double normalized_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return normalized_error(a.data(), b.data(), std::min(a.size(), b.size()));
}

}  // namespace turbospark::testing
