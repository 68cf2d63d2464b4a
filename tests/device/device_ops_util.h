// What the CUDA op tests share (test_cuda_ops.cpp, test_cuda_hybrid_ops.cpp): the CPU backend
// they compare against, the stream the launchers run on, strided device matrices with
// NaN-poisoned padding, and a paged KV cache held on both backends.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "device/device_util.h"
#include "ops/backend.h"

namespace turbospark::testing {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

inline Backend& cpu() {
  static std::unique_ptr<Backend> b = make_cpu_backend(2);
  return *b;
}

// A non-default stream: the launchers must honour the one they are given.
inline cudaStream_t stream() {
  static cudaStream_t s = [] {
    cudaStream_t st = nullptr;
    TS_CHECK(cudaStreamCreate(&st) == cudaSuccess, "cudaStreamCreate");
    return st;
  }();
  return s;
}

inline void sync() { TS_CHECK(cudaStreamSynchronize(stream()) == cudaSuccess, "kernel failed: {}", cudaGetErrorString(cudaGetLastError())); }

// A [rows, cols] f32 matrix with row stride cols + pad, on the host and on the device.
struct Strided {
  int64_t rows = 0, cols = 0, stride = 0;
  std::vector<float> host;
  DeviceBuffer<float> dev;

  Strided(int64_t r, int64_t c, int64_t pad, uint32_t seed, float lo = -1.f, float hi = 1.f)
      : rows(r), cols(c), stride(c + pad), host(random_floats(size_t(r * (c + pad)), seed, lo, hi)),
        dev(host) {}
  Mat h() { return Mat(host.data(), rows, cols, stride); }
  Mat d() const { return Mat(dev.get(), rows, cols, stride); }
  void poison() { dev.poison(); }
  void upload() { dev.upload(host); }
  std::vector<float> host_dense() const { return dense(host); }
  std::vector<float> dev_dense() const {
    sync();
    return dense(dev.download());
  }
  // Whether every padding element of the device copy still holds the poison pattern.
  bool dev_pads_poisoned() const {
    sync();
    const std::vector<float> all = dev.download();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = cols; c < stride; ++c) {
        uint32_t bits;
        std::memcpy(&bits, &all[size_t(r * stride + c)], 4);
        if (bits != 0xffffffffu) return false;
      }
    return true;
  }

 private:
  std::vector<float> dense(const std::vector<float>& all) const {
    std::vector<float> out(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(all.begin() + r * stride, cols, out.begin() + r * cols);
    return out;
  }
};

inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;  // round to nearest even (finite inputs)
  std::memcpy(&x, &u, 4);
  return x;
}

inline std::vector<float> round_bf16(std::vector<float> x) {
  for (float& e : x) e = round_bf16(e);
  return x;
}

// One layer's paged pools, on the host (f32, as the CPU backend keeps them) and the device
// (bf16, as the CUDA backend does), with a shuffled block table for n_seqs sequences of up to
// max_context positions (block_size 16). The host values are bf16-exact, so both backends'
// attention reads the same numbers.
struct PagedCache {
  int n_seqs, block_size, max_blocks, n_kv_heads, head_dim;
  std::vector<float> k, v;     // [n_blocks, block_size, n_kv_heads, head_dim]
  std::vector<int32_t> table;  // [n_seqs, max_blocks]: a random permutation of the blocks
  DeviceBuffer<uint16_t> dk, dv;  // bf16 bits
  DeviceBuffer<int32_t> dtable;

  PagedCache(int seqs, int64_t max_context, int kv_heads, int hd, uint32_t seed, int bs = 16)
      : n_seqs(seqs), block_size(bs), max_blocks(int((max_context + bs - 1) / bs)), n_kv_heads(kv_heads),
        head_dim(hd) {
    const size_t floats = size_t(n_seqs) * max_blocks * bs * kv_heads * hd;
    // Every slot holds data, written or not: reading outside [lo, pos] changes the result.
    k = round_bf16(random_floats(floats, seed, -2.f, 2.f));
    v = round_bf16(random_floats(floats, seed + 1, -0.5f, 1.5f));
    table.resize(size_t(n_seqs) * max_blocks);
    std::iota(table.begin(), table.end(), 0);
    std::mt19937 rng(seed + 2);
    std::shuffle(table.begin(), table.end(), rng);
    dk = DeviceBuffer<uint16_t>(floats);
    dv = DeviceBuffer<uint16_t>(floats);
    upload();
    dtable = DeviceBuffer<int32_t>(table);
  }
  // Host k and v (bf16-exact) to the device pools.
  void upload() {
    dk.upload(to_bits(k));
    dv.upload(to_bits(v));
  }
  std::vector<float> device_k() const { return from_bits(dk.download()); }
  std::vector<float> device_v() const { return from_bits(dv.download()); }
  KvLayerView host_view(const int32_t* row_seq) {
    return KvLayerView{k.data(), v.data(), table.data(), max_blocks, row_seq, block_size, n_kv_heads, head_dim};
  }
  KvLayerView device_view(const int32_t* row_seq) const {
    return KvLayerView{dk.get(), dv.get(), dtable.get(), max_blocks, row_seq, block_size, n_kv_heads, head_dim,
                       KvType::kBf16};
  }

 private:
  static std::vector<uint16_t> to_bits(const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &x[i], 4);
      EXPECT_EQ(u & 0xffffu, 0u) << "pool value " << x[i] << " is not bf16-exact";
      b[i] = uint16_t(u >> 16);
    }
    return b;
  }
  static std::vector<float> from_bits(const std::vector<uint16_t>& b) {
    std::vector<float> x(b.size());
    for (size_t i = 0; i < b.size(); ++i) {
      const uint32_t u = uint32_t(b[i]) << 16;
      std::memcpy(&x[i], &u, 4);
    }
    return x;
  }
};

}  // namespace turbospark::testing
