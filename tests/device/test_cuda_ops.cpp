// The CUDA backend's non-matmul ops (backends/cuda/ops.h) against the CPU backend over ragged
// shapes: every launcher runs on device copies of the inputs, the CPU backend runs the same
// op on host copies, and the results are compared with normalized_error (||a - b|| / ||b||,
// infinite on any NaN). Device outputs are NaN-poisoned first, and strided outputs must leave
// their row padding poisoned (no write outside the view).
//
// Bounds: the math is f32 on both sides and differs only in summation order, so
//  - elementwise, rope, rmsnorm, softmax: 1e-6 (a few ulp; expf/tanhf/sincosf are the precise
//    versions on the device);
//  - attention: 1e-5 (f32 sums over up to 4000 keys in different orders; V is drawn from
//    [-0.5, 1.5] so that outputs are not near-zero averages whose relative error cancellation
//    would inflate -- dropping or double-counting a single key of 4000 still moves the
//    output by ~2e-4, 20x the bound);
//  - router: expert indices exactly (ties to the lower index), weights 1e-6;
//  - argmax, kv_write: exact.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/ops.h"
#include "device/device_ops_util.h"
#include "device/device_util.h"
#include "ops/backend.h"

namespace turbospark::testing {
namespace {

std::string shape(int64_t rows, int64_t cols, int64_t pad) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "] pad " + std::to_string(pad);
}

const int64_t kRows[] = {1, 3, 17, 64, 500};
const int64_t kCols[] = {1, 7, 64, 100, 1000, 1030, 4099};
const int64_t kPads[] = {0, 3};

// ---------------- rmsnorm ----------------

// rmsnorm out of place and in place, and add_rmsnorm.
TEST(CudaOps, RmsNorm) {
  REQUIRE_GPU();
  for (int64_t rows : kRows)
    for (int64_t cols : kCols)
      for (int64_t pad : kPads)
        for (float offset : {0.f, 1.f}) {
          SCOPED_TRACE(shape(rows, cols, pad) + " offset " + std::to_string(offset));
          Strided x(rows, cols, pad, 1 + uint32_t(cols), -2.f, 2.f);
          Strided y(rows, cols, pad, 2);
          const std::vector<float> w = random_floats(size_t(cols), 3, -0.5f, 1.5f);
          DeviceBuffer<float> dw(w);
          cpu().rmsnorm(x.h(), w.data(), 1e-6f, y.h(), offset);
          y.poison();
          cuda::rmsnorm(x.d(), dw.get(), 1e-6f, y.d(), offset, stream());
          EXPECT_LT(normalized_error(y.dev_dense(), y.host_dense()), 1e-6);
          if (pad) {
            EXPECT_TRUE(y.dev_pads_poisoned());
          }
          // In place (y aliases x), as the per-head q/k norms run.
          cpu().rmsnorm(x.h(), w.data(), 1e-6f, x.h(), offset);
          cuda::rmsnorm(x.d(), dw.get(), 1e-6f, x.d(), offset, stream());
          EXPECT_LT(normalized_error(x.dev_dense(), x.host_dense()), 1e-6);
          // add_rmsnorm (x += r, then y = rmsnorm(x)) against the CPU's add then rmsnorm: the
          // updated x exactly (one f32 add per element), y to the rmsnorm bound. r has its own
          // row padding.
          x.upload();  // both sides start from the host's (normed) x
          Strided r(rows, cols, pad ? pad + 1 : 0, 4 + uint32_t(cols), -1.f, 1.f);
          cpu().add_rmsnorm(x.h(), r.h(), w.data(), 1e-6f, y.h(), offset);
          y.poison();
          cuda::add_rmsnorm(x.d(), r.d(), dw.get(), 1e-6f, y.d(), offset, stream());
          EXPECT_EQ(x.dev_dense(), x.host_dense());
          EXPECT_LT(normalized_error(y.dev_dense(), y.host_dense()), 1e-6);
          if (pad) {
            EXPECT_TRUE(y.dev_pads_poisoned());
          }
        }
}

// rmsnorm_groups (hyper-connection streams side by side): each row's groups normed on their own
// with their slice of the weight, against the CPU's per-group rmsnorm calls; the warp-per-row
// (<= 1024 columns a group) and block-per-row kernels, strided rows, in place.
TEST(CudaOps, RmsNormGroups) {
  REQUIRE_GPU();
  for (int64_t rows : {int64_t(1), int64_t(3), int64_t(17)})
    for (int groups : {1, 2, 4})
      for (int64_t cols : {int64_t(7), int64_t(64), int64_t(100), int64_t(1030), int64_t(2048)})
        for (int64_t pad : kPads) {
          const int64_t width = cols * groups;
          SCOPED_TRACE(shape(rows, width, pad) + " groups " + std::to_string(groups));
          Strided x(rows, width, pad, 5 + uint32_t(width), -2.f, 2.f);
          Strided y(rows, width, pad, 6);
          const std::vector<float> w = random_floats(size_t(width), 7, -0.5f, 1.5f);
          DeviceBuffer<float> dw(w);
          cpu().rmsnorm_groups(x.h(), w.data(), groups, 1e-6f, y.h(), 1.f);
          y.poison();
          cuda::rmsnorm_groups(x.d(), dw.get(), groups, 1e-6f, y.d(), 1.f, stream());
          EXPECT_LT(normalized_error(y.dev_dense(), y.host_dense()), 1e-6);
          if (pad) {
            EXPECT_TRUE(y.dev_pads_poisoned());
          }
          cpu().rmsnorm_groups(x.h(), w.data(), groups, 1e-6f, x.h(), 0.f);
          cuda::rmsnorm_groups(x.d(), dw.get(), groups, 1e-6f, x.d(), 0.f, stream());
          EXPECT_LT(normalized_error(x.dev_dense(), x.host_dense()), 1e-6);
        }
}

// rmsnorm_gated (GatedDeltaNet's gated norm per value head): one weight for every range, times
// act(gate), against the CPU's rmsnorm over the ranges then mul_act; both activations the
// family uses, strided and dense rows (the CPU default takes one view or one per row), in place.
TEST(CudaOps, RmsNormGated) {
  REQUIRE_GPU();
  for (int64_t rows : {int64_t(1), int64_t(3), int64_t(17)})
    for (int groups : {1, 4, 32})
      for (int64_t cols : {int64_t(7), int64_t(128), int64_t(1030)})
        for (int64_t pad : kPads)
          for (Act act : {Act::kSigmoid, Act::kSilu}) {
            const int64_t width = cols * groups;
            SCOPED_TRACE(shape(rows, width, pad) + " groups " + std::to_string(groups) + " act " +
                         std::to_string(int(act)));
            Strided x(rows, width, pad, 8 + uint32_t(width), -2.f, 2.f);
            Strided gate(rows, width, pad ? pad + 1 : 0, 9, -4.f, 4.f);
            Strided y(rows, width, pad, 10);
            const std::vector<float> w = random_floats(size_t(cols), 11, -0.5f, 1.5f);
            DeviceBuffer<float> dw(w);
            cpu().rmsnorm_gated(x.h(), w.data(), groups, 1e-6f, gate.h(), act, y.h());
            y.poison();
            cuda::rmsnorm_gated(x.d(), dw.get(), groups, 1e-6f, gate.d(), act, y.d(), stream());
            EXPECT_LT(normalized_error(y.dev_dense(), y.host_dense()), 1e-6);
            if (pad) {
              EXPECT_TRUE(y.dev_pads_poisoned());
            }
            cpu().rmsnorm_gated(x.h(), w.data(), groups, 1e-6f, gate.h(), act, x.h());
            cuda::rmsnorm_gated(x.d(), dw.get(), groups, 1e-6f, gate.d(), act, x.d(), stream());
            EXPECT_LT(normalized_error(x.dev_dense(), x.host_dense()), 1e-6);
          }
}

// ---------------- elementwise ----------------

TEST(CudaOps, AddAndBias) {
  REQUIRE_GPU();
  for (int64_t rows : kRows)
    for (int64_t cols : kCols)
      for (int64_t pad : kPads) {
        SCOPED_TRACE(shape(rows, cols, pad));
        Strided y(rows, cols, pad, 10), x(rows, cols, pad + 1, 11);
        cpu().add(y.h(), x.h());
        cuda::add(y.d(), x.d(), stream());
        EXPECT_LT(normalized_error(y.dev_dense(), y.host_dense()), 1e-6);
        const std::vector<float> bias = random_floats(size_t(cols), 12);
        DeviceBuffer<float> db(bias);
        cpu().add_bias(y.h(), bias.data());
        cuda::add_bias(y.d(), db.get(), stream());
        EXPECT_LT(normalized_error(y.dev_dense(), y.host_dense()), 1e-6);
      }
}

TEST(CudaOps, SwigluAndClamped) {
  REQUIRE_GPU();
  for (int64_t rows : kRows)
    for (int64_t cols : kCols)
      for (int64_t pad : kPads) {
        SCOPED_TRACE(shape(rows, cols, pad));
        Strided g(rows, cols, pad, 20, -12.f, 12.f), u(rows, cols, pad, 21, -12.f, 12.f), o(rows, cols, pad, 22);
        cpu().swiglu(g.h(), u.h(), o.h());
        o.poison();
        cuda::swiglu(g.d(), u.d(), o.d(), stream());
        EXPECT_LT(normalized_error(o.dev_dense(), o.host_dense()), 1e-6);
        if (pad) {
          EXPECT_TRUE(o.dev_pads_poisoned());
        }
        // gpt-oss: alpha 1.702, limit 7 (inputs reach past the limit on both sides).
        std::vector<float> ref(size_t(rows * cols));
        Mat ref_m(ref.data(), rows, cols);
        {
          // The CPU backend exposes clamped_swiglu only inside moe_experts: mirror its formula.
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) {
              const float gv = g.h().row(r)[c], uv = u.h().row(r)[c];
              const float gc = std::min(gv, 7.f), uc = std::clamp(uv, -7.f, 7.f);
              ref[size_t(r * cols + c)] = (uc + 1.f) * (gc * (1.f / (1.f + std::exp(-(gc * 1.702f)))));
            }
        }
        o.poison();
        cuda::clamped_swiglu(g.d(), u.d(), 1.702f, 7.f, o.d(), stream());
        EXPECT_LT(normalized_error(o.dev_dense(), ref), 1e-6);
        // In place into gate, as moe_experts runs it.
        cuda::swiglu(g.d(), u.d(), g.d(), stream());
        cpu().swiglu(g.h(), u.h(), g.h());
        EXPECT_LT(normalized_error(g.dev_dense(), g.host_dense()), 1e-6);
      }
}

TEST(CudaOps, UnaryAndMulAct) {
  REQUIRE_GPU();
  const Act acts[] = {Act::kIdentity, Act::kSilu, Act::kSigmoid, Act::kGeluTanh, Act::kTanh};
  for (int64_t rows : {int64_t(1), int64_t(17), int64_t(500)})
    for (int64_t cols : {int64_t(1), int64_t(7), int64_t(64), int64_t(1030)})
      for (int64_t pad : kPads)
        for (Act act : acts) {
          SCOPED_TRACE(shape(rows, cols, pad) + " act " + std::to_string(int(act)));
          Strided x(rows, cols, pad, 30, -6.f, 6.f), y(rows, cols, pad, 31);
          cpu().unary(x.h(), act, 0.7f, 1.3f, y.h());
          y.poison();
          cuda::unary(x.d(), act, 0.7f, 1.3f, y.d(), stream());
          EXPECT_LT(normalized_error(y.dev_dense(), y.host_dense()), 1e-6);
          if (pad) {
            EXPECT_TRUE(y.dev_pads_poisoned());
          }
          // Full gate and 1-column broadcast gate.
          for (int64_t gate_cols : {cols, int64_t(1)}) {
            Strided z(rows, cols, pad, 32), gate(rows, gate_cols, pad, 33, -6.f, 6.f);
            cpu().mul_act(z.h(), gate.h(), act);
            cuda::mul_act(z.d(), gate.d(), act, stream());
            // A 1-column gate on one row scales everything by a single act(g): GELU-tanh's
            // 1 + tanh(u) cancels for negative g, and there the device's tanhf and the CPU's
            // differ by 2.6e-5 relative (H200, measured); any other shape averages to < 1e-6.
            const double bound = (act == Act::kGeluTanh && gate_cols == 1) ? 1e-4 : 1e-6;
            EXPECT_LT(normalized_error(z.dev_dense(), z.host_dense()), bound) << "gate cols " << gate_cols;
          }
        }
}

TEST(CudaOps, CopyAndSplitHeads) {
  REQUIRE_GPU();
  for (int64_t rows : kRows)
    for (int64_t pad : kPads) {
      for (int64_t cols : kCols) {
        SCOPED_TRACE("copy " + shape(rows, cols, pad));
        Strided src(rows, cols, pad + 2, 40), dst(rows, cols, pad, 41);
        dst.poison();
        cuda::copy(src.d(), dst.d(), stream());
        EXPECT_EQ(normalized_error(dst.dev_dense(), src.host_dense()), 0.0);
        if (pad) {
          EXPECT_TRUE(dst.dev_pads_poisoned());
        }
      }
      for (int heads : {1, 5, 16})
        for (int hd : {7, 64, 128}) {
          SCOPED_TRACE("split_heads " + shape(rows, 2 * heads * hd, pad) + " heads " + std::to_string(heads) +
                       " hd " + std::to_string(hd));
          Strided ab(rows, 2 * int64_t(heads) * hd, pad, 42);
          Strided a(rows, int64_t(heads) * hd, pad, 43), b(rows, int64_t(heads) * hd, pad, 44);
          cpu().split_heads(ab.h(), heads, hd, a.h(), b.h());
          a.poison();
          b.poison();
          cuda::split_heads(ab.d(), heads, hd, a.d(), b.d(), stream());
          EXPECT_EQ(normalized_error(a.dev_dense(), a.host_dense()), 0.0);
          EXPECT_EQ(normalized_error(b.dev_dense(), b.host_dense()), 0.0);
          if (pad) {
          EXPECT_TRUE(a.dev_pads_poisoned() && b.dev_pads_poisoned());
        }
        }
    }
}

// ---------------- rope ----------------

TEST(CudaOps, Rope) {
  REQUIRE_GPU();
  std::mt19937 rng(50);
  for (int64_t rows : {int64_t(1), int64_t(3), int64_t(17), int64_t(64)})
    for (int heads : {1, 4, 8})
      for (int hd : {64, 80, 128, 256})
        for (int rot : {hd, hd / 2, 32})
          for (float factor : {1.f, 1.2f}) {
            SCOPED_TRACE("rows " + std::to_string(rows) + " heads " + std::to_string(heads) + " hd " +
                         std::to_string(hd) + " rot " + std::to_string(rot) + " factor " + std::to_string(factor));
            const int64_t pad = rows % 2 ? 5 : 0;
            Strided x(rows, int64_t(heads) * hd, pad, uint32_t(rng()));
            std::vector<int64_t> pos(static_cast<size_t>(rows));
            // Up to 2^19: large angles, where __cosf/__sinf would be far off.
            for (auto& p : pos) p = int64_t(rng() % (1u << 19));
            pos[0] = 0;
            std::vector<float> inv_freq(size_t(rot / 2));
            for (int i = 0; i < rot / 2; ++i) inv_freq[size_t(i)] = float(std::pow(1e6, -2.0 * i / rot));
            DeviceBuffer<int64_t> dpos(pos);
            DeviceBuffer<float> dfreq(inv_freq);
            cpu().rope(x.h(), heads, hd, rot, pos.data(), inv_freq.data(), factor);
            cuda::rope(x.d(), heads, hd, rot, dpos.get(), dfreq.get(), factor, stream());
            EXPECT_LT(normalized_error(x.dev_dense(), x.host_dense()), 1e-6);
          }
}

// ---------------- router, softmax, argmax ----------------

enum class Logits { kRandom, kAllEqual, kPairsEqual, kFewLevels };

std::vector<float> router_logits(int64_t rows, int n, Logits kind, uint32_t seed) {
  std::vector<float> l = random_floats(size_t(rows * n), seed, -4.f, 4.f);
  std::mt19937 rng(seed);
  for (int64_t r = 0; r < rows; ++r)
    for (int e = 0; e < n; ++e) {
      float& v = l[size_t(r * n + e)];
      switch (kind) {
        case Logits::kRandom: break;
        case Logits::kAllEqual: v = 0.25f; break;
        case Logits::kPairsEqual: v = float((e / 2 * 37 + int(r)) % 11) * 0.5f; break;  // (2i, 2i+1) tie
        case Logits::kFewLevels: v = float(rng() % 4); break;
      }
    }
  return l;
}

TEST(CudaOps, RouterSoftmaxTopK) {
  REQUIRE_GPU();
  for (int n : {8, 32, 100, 128, 256, 512})
    for (int k : {1, 8, 10, 16})
      for (Logits kind : {Logits::kRandom, Logits::kAllEqual, Logits::kPairsEqual, Logits::kFewLevels})
        for (bool renorm : {false, true})
          for (bool scaled : {false, true}) {
            if (k > n) continue;
            for (int64_t rows : {int64_t(1), int64_t(17), int64_t(500)}) {
              SCOPED_TRACE("experts " + std::to_string(n) + " k " + std::to_string(k) + " kind " +
                           std::to_string(int(kind)) + " renorm " + std::to_string(renorm) + " scaled " +
                           std::to_string(scaled) + " rows " + std::to_string(rows));
              const std::vector<float> l = router_logits(rows, n, kind, uint32_t(n * 31 + k));
              const std::vector<float> scale = random_floats(size_t(n), 60, 0.5f, 2.f);
              std::vector<int32_t> idx(size_t(rows * k));
              std::vector<float> w(size_t(rows * k));
              std::vector<float> lh = l;
              cpu().router_softmax_topk(Mat(lh.data(), rows, n), k, renorm, idx.data(), w.data(),
                                        scaled ? scale.data() : nullptr);
              DeviceBuffer<float> dl(l), dscale(scale);
              DeviceBuffer<int32_t> didx(idx.size());
              DeviceBuffer<float> dw(w.size());
              didx.poison();
              dw.poison();
              cuda::router_softmax_topk(Mat(dl.get(), rows, n), k, renorm, didx.get(), dw.get(),
                                        scaled ? dscale.get() : nullptr, stream());
              sync();
              EXPECT_EQ(didx.download(), idx);
              // expf on the device and glibc's exp differ by an ulp or two, and the softmax
              // denominator sums up to 512 of them: 1.8e-6 measured on the H200 at k = 1.
              EXPECT_LT(normalized_error(dw.download(), w), 4e-6);
            }
          }
}

// The fused router (router_gemv_topk: GEMV, then the last block routes) against its two
// parts: its logits against a float64 product (1e-5: f32 sums of up to 2048 terms in another
// order), its picks and weights exactly equal to router_softmax_topk run on those same logits
// (the same routing code on the same numbers, ties included: with `ties` every odd expert's
// row equals its even neighbour's, so their logits tie bit for bit). Each case runs twice on
// one ticket (the last block resets it), and a NaN activation row routes to -1. Cases without
// ties add a router bias (gpt-oss) to the logits.
TEST(CudaOps, RouterGemvTopKMatchesGemvThenTopK) {
  REQUIRE_GPU();
  DeviceBuffer<unsigned> ticket(std::vector<unsigned>{0u});
  uint32_t seed = 900;
  for (DType dt : {DType::F32, DType::BF16})
    for (auto [n, cols] : {std::pair<int, int64_t>{128, 2048}, {60, 96}, {512, 64}, {8, 8}})
      for (int k : {1, 8, 16})
        for (int64_t rows : {int64_t(1), int64_t(3), int64_t(8)})
          for (bool ties : {false, true}) {
            if (k > n) continue;
            const bool renorm = (k + rows) % 2 == 0, scaled = ties && k == 8, nan_row = rows == 3 && !ties;
            SCOPED_TRACE(std::string(dtype_name(dt)) + " experts " + std::to_string(n) + " cols " +
                         std::to_string(cols) + " k " + std::to_string(k) + " rows " + std::to_string(rows) +
                         " ties " + std::to_string(ties));
            std::vector<float> w = random_floats(size_t(n * cols), seed++, -0.5f, 0.5f);
            if (ties)
              for (int e = 1; e < n; e += 2) std::copy_n(&w[size_t((e - 1) * cols)], cols, &w[size_t(e * cols)]);
            std::vector<uint16_t> wb(w.size());
            if (dt == DType::BF16)
              for (size_t i = 0; i < w.size(); ++i) {
                uint32_t u;
                std::memcpy(&u, &w[i], 4);
                wb[i] = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
                u = uint32_t(wb[i]) << 16;
                std::memcpy(&w[i], &u, 4);
              }
            std::vector<float> x = random_floats(size_t(rows * cols), seed++);
            if (nan_row) x[size_t(1 * cols + 3)] = std::nanf("");
            const std::vector<float> bias = random_floats(size_t(n), seed++);
            DeviceBuffer<float> dwf(w), dx(x), dl(size_t(rows * n)), dscale(random_floats(size_t(n), 61, 0.5f, 2.f));
            DeviceBuffer<float> dbias(bias);
            DeviceBuffer<uint16_t> dwb(wb);
            WeightView view;
            view.dtype = dt;
            view.data = dt == DType::BF16 ? static_cast<const void*>(dwb.get()) : dwf.get();
            view.rows = n;
            view.cols = cols;
            view.row_bytes = cols * (dt == DType::BF16 ? 2 : 4);
            std::vector<std::vector<int32_t>> idx_runs;
            std::vector<std::vector<float>> w_runs;
            for (int run = 0; run < 2; ++run) {
              DeviceBuffer<int32_t> didx(size_t(rows * k));
              DeviceBuffer<float> dw(size_t(rows * k));
              didx.poison();
              dw.poison();
              dl.poison();
              ASSERT_TRUE(cuda::router_gemv_topk(view, Mat(dx.get(), rows, cols), Mat(dl.get(), rows, n), k, renorm,
                                                 didx.get(), dw.get(), scaled ? dscale.get() : nullptr,
                                                 ties ? nullptr : dbias.get(), ticket.get(), stream()));
              sync();
              idx_runs.push_back(didx.download());
              w_runs.push_back(dw.download());
            }
            EXPECT_EQ(idx_runs[0], idx_runs[1]);
            EXPECT_EQ(w_runs[0], w_runs[1]);
            EXPECT_EQ(ticket.download()[0], 0u);
            std::vector<float> logits = dl.download();
            std::vector<float> want(logits.size());
            for (int64_t r = 0; r < rows; ++r)
              for (int e = 0; e < n; ++e) {
                double acc = 0;
                for (int64_t c = 0; c < cols; ++c) acc += double(w[size_t(e * cols + c)]) * x[size_t(r * cols + c)];
                want[size_t(r * n + e)] = float(acc + (ties ? 0.0 : double(bias[size_t(e)])));
              }
            if (nan_row) {
              for (int e = 0; e < n; ++e) EXPECT_TRUE(std::isnan(logits[size_t(n + e)]));
              for (int j = 0; j < k; ++j) EXPECT_EQ(idx_runs[0][size_t(k + j)], -1);
              for (int e = 0; e < n; ++e) want[size_t(n + e)] = logits[size_t(n + e)] = 0.f;
            }
            EXPECT_LT(normalized_error(logits, want), 1e-5);
            // The routing of those exact logits by the stand-alone kernel.
            DeviceBuffer<int32_t> ridx(size_t(rows * k));
            DeviceBuffer<float> rw(size_t(rows * k));
            cuda::router_softmax_topk(Mat(dl.get(), rows, n), k, renorm, ridx.get(), rw.get(),
                                      scaled ? dscale.get() : nullptr, stream());
            sync();
            EXPECT_EQ(idx_runs[0], ridx.download());
            EXPECT_EQ(w_runs[0], rw.download());
          }
  // Outside its shapes it launches nothing and says so.
  DeviceBuffer<float> dw(size_t(8 * 64)), dx(size_t(9 * 64)), dl(size_t(9 * 8));
  DeviceBuffer<int32_t> didx(size_t(9 * 2));
  DeviceBuffer<float> dwt(size_t(9 * 2));
  WeightView view;
  view.dtype = DType::F32;
  view.data = dw.get();
  view.rows = 8;
  view.cols = 64;
  view.row_bytes = 256;
  EXPECT_FALSE(cuda::router_gemv_topk(view, Mat(dx.get(), 9, 64), Mat(dl.get(), 9, 8), 2, true, didx.get(), dwt.get(),
                                      nullptr, nullptr, ticket.get(), stream()));
  view.dtype = DType::Q8_0;
  EXPECT_FALSE(cuda::router_gemv_topk(view, Mat(dx.get(), 1, 64), Mat(dl.get(), 1, 8), 2, true, didx.get(), dwt.get(),
                                      nullptr, nullptr, ticket.get(), stream()));
}

TEST(CudaOps, RouterRefusesTooManyExperts) {
  REQUIRE_GPU();
  DeviceBuffer<float> l(513);
  DeviceBuffer<int32_t> idx(8);
  DeviceBuffer<float> w(8);
  EXPECT_THROW(cuda::router_softmax_topk(Mat(l.get(), 1, 513), 8, true, idx.get(), w.get(), nullptr, stream()), Error);
  EXPECT_THROW(cuda::router_softmax_topk(Mat(l.get(), 1, 64), 17, true, idx.get(), w.get(), nullptr, stream()), Error);
}

TEST(CudaOps, SoftmaxRows) {
  REQUIRE_GPU();
  for (int64_t rows : {int64_t(1), int64_t(17), int64_t(500)})
    for (int64_t cols : {int64_t(1), int64_t(8), int64_t(128), int64_t(513), int64_t(1000)})
      for (int64_t pad : kPads) {
        SCOPED_TRACE(shape(rows, cols, pad));
        Strided x(rows, cols, pad, 70, -8.f, 8.f), y(rows, cols, pad, 71);
        cpu().softmax_rows(x.h(), y.h());
        y.poison();
        cuda::softmax_rows(x.d(), y.d(), stream());
        EXPECT_LT(normalized_error(y.dev_dense(), y.host_dense()), 1e-6);
        if (pad) {
          EXPECT_TRUE(y.dev_pads_poisoned());
        }
        cpu().softmax_rows(x.h(), x.h());
        cuda::softmax_rows(x.d(), x.d(), stream());
        EXPECT_LT(normalized_error(x.dev_dense(), x.host_dense()), 1e-6);
      }
}

TEST(CudaOps, ArgmaxRows) {
  REQUIRE_GPU();
  std::mt19937 rng(80);
  for (int64_t rows : {int64_t(1), int64_t(3), int64_t(17)})
    for (int64_t cols : {int64_t(1), int64_t(7), int64_t(1000), int64_t(151937), int64_t(262144)})
      for (int64_t pad : kPads) {
        SCOPED_TRACE(shape(rows, cols, pad));
        Strided x(rows, cols, pad, uint32_t(rng()), -30.f, 30.f);
        // Ties: row r gets its maximum at two places (the lower must win), row 1 at three,
        // and row 2 a NaN (-1, as the CPU reports it).
        for (int64_t r = 0; r < rows; ++r) {
          float* row = x.h().row(r);
          const int64_t a = int64_t(rng() % uint32_t(cols)), b = int64_t(rng() % uint32_t(cols));
          row[a] = row[b] = 40.f;
          if (r == 1) row[cols - 1] = 40.f;
          if (r == 2) row[int64_t(rng() % uint32_t(cols))] = NAN;
        }
        x.upload();
        std::vector<int32_t> ids(static_cast<size_t>(rows));
        cpu().argmax_rows(x.h(), ids.data());
        DeviceBuffer<int32_t> dids(static_cast<size_t>(rows));
        dids.poison();
        cuda::argmax_rows(x.d(), dids.get(), stream());
        sync();
        EXPECT_EQ(dids.download(), ids);
      }
}

// ---------------- paged KV: kv_write and attention ----------------

TEST(CudaOps, KvWrite) {
  REQUIRE_GPU();
  for (int kv_heads : {1, 2, 8})
    for (int hd : {64, 80, 128})
      for (int64_t rows : {int64_t(1), int64_t(3), int64_t(17), int64_t(64)})
        for (int64_t pad : kPads) {
          SCOPED_TRACE("kv_heads " + std::to_string(kv_heads) + " hd " + std::to_string(hd) + " rows " +
                       std::to_string(rows) + " pad " + std::to_string(pad));
          PagedCache cache(2, 300, kv_heads, hd, 90);
          Strided k(rows, int64_t(kv_heads) * hd, pad, 91), v(rows, int64_t(kv_heads) * hd, pad, 92);
          // Rows alternate between the sequences, each at its own run of positions.
          std::vector<int32_t> seq(static_cast<size_t>(rows));
          std::vector<int64_t> pos(static_cast<size_t>(rows));
          for (int64_t t = 0; t < rows; ++t) {
            seq[size_t(t)] = int32_t(t % 2);
            pos[size_t(t)] = t % 2 ? 150 + t / 2 : 283 - rows / 2 + t / 2;
          }
          DeviceBuffer<int32_t> dseq(seq);
          DeviceBuffer<int64_t> dpos(pos);
          cpu().kv_write(cache.host_view(seq.data()), k.h(), v.h(), pos.data());
          cuda::kv_write(cache.device_view(dseq.get()), k.d(), v.d(), dpos.get(), stream());
          sync();
          // The CPU stored f32, the GPU bf16 rounded to nearest even: exactly the rounded values.
          EXPECT_EQ(cache.device_k(), round_bf16(cache.k));
          EXPECT_EQ(cache.device_v(), round_bf16(cache.v));
        }
}

// attention_prep's fused kernel against the CPU backend's separate ops (biases, norms, ropes,
// cache write): q and k as left in place and the whole cache (written slots and untouched ones).
// The norm's sum of squares is ordered differently, so values agree to the rmsnorm bound.
TEST(CudaOps, AttentionPrepMatchesSeparateOps) {
  REQUIRE_GPU();
  std::mt19937 rng(95);
  struct Case {
    int heads, kv_heads, hd, rot;
    bool norm;
    float offset, factor;
    bool bias = false;  // q/k/v projection biases (gpt-oss: with YaRN's factor, no norms)
  };
  const Case cases[] = {{4, 2, 64, 64, true, 0.f, 1.f},        {8, 1, 128, 128, true, 1.f, 1.f},
                        {2, 2, 80, 40, false, 0.f, 1.f},       {32, 4, 128, 64, true, 0.f, 1.3f},
                        {3, 1, 256, 256, true, 0.f, 1.f},      {16, 8, 64, 0, false, 0.f, 1.f},
                        {1, 1, 512, 32, true, 0.f, 1.f},       {16, 2, 64, 64, false, 0.f, 1.35f, true},
                        {4, 2, 128, 64, true, 0.f, 1.f, true}};
  for (const Case& c : cases)
    for (int64_t rows : {int64_t(1), int64_t(3), int64_t(17), int64_t(64)}) {
      SCOPED_TRACE("heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " hd " +
                   std::to_string(c.hd) + " rot " + std::to_string(c.rot) + " norm " + std::to_string(c.norm) +
                   " bias " + std::to_string(c.bias) + " rows " + std::to_string(rows));
      const int64_t pad = rows % 2 ? 3 : 0;
      PagedCache cache(2, 300, c.kv_heads, c.hd, uint32_t(rng()));
      Strided q(rows, int64_t(c.heads) * c.hd, pad, uint32_t(rng())), k(rows, int64_t(c.kv_heads) * c.hd, pad,
                                                                         uint32_t(rng()));
      Strided v(rows, int64_t(c.kv_heads) * c.hd, pad, uint32_t(rng()));
      std::vector<int32_t> seq(static_cast<size_t>(rows));
      std::vector<int64_t> pos(static_cast<size_t>(rows));
      for (int64_t t = 0; t < rows; ++t) {
        seq[size_t(t)] = int32_t(t % 2);
        pos[size_t(t)] = t % 2 ? 150 + t / 2 : 283 - rows / 2 + t / 2;
      }
      std::vector<float> inv_freq(size_t(std::max(c.rot / 2, 1)));
      for (int i = 0; i < c.rot / 2; ++i) inv_freq[size_t(i)] = float(std::pow(1e6, -2.0 * i / c.rot));
      const std::vector<float> qn = random_floats(size_t(c.hd), uint32_t(rng()), 0.5f, 1.5f);
      const std::vector<float> kn = random_floats(size_t(c.hd), uint32_t(rng()), 0.5f, 1.5f);
      DeviceBuffer<int32_t> dseq(seq);
      DeviceBuffer<int64_t> dpos(pos);
      DeviceBuffer<float> dfreq(inv_freq), dqn(qn), dkn(kn);
      AttentionPrep hp;
      hp.n_heads = c.heads;
      hp.n_kv_heads = c.kv_heads;
      hp.head_dim = c.hd;
      hp.rotary_dim = c.rot;
      hp.norm_eps = 1e-6f;
      hp.norm_offset = c.offset;
      hp.attention_factor = c.factor;
      AttentionPrep dp = hp;
      hp.inv_freq = inv_freq.data();
      dp.inv_freq = dfreq.get();
      if (c.norm) {
        hp.q_norm = qn.data(), hp.k_norm = kn.data();
        dp.q_norm = dqn.get(), dp.k_norm = dkn.get();
      }
      const std::vector<float> qb = random_floats(size_t(c.heads * c.hd), uint32_t(rng()));
      const std::vector<float> kb = random_floats(size_t(c.kv_heads * c.hd), uint32_t(rng()));
      const std::vector<float> vb = random_floats(size_t(c.kv_heads * c.hd), uint32_t(rng()));
      DeviceBuffer<float> dqb(qb), dkb(kb), dvb(vb);
      if (c.bias) {
        hp.q_bias = qb.data(), hp.k_bias = kb.data(), hp.v_bias = vb.data();
        dp.q_bias = dqb.get(), dp.k_bias = dkb.get(), dp.v_bias = dvb.get();
      }
      cpu().attention_prep(q.h(), k.h(), v.h(), hp, pos.data(), cache.host_view(seq.data()));
      ASSERT_TRUE(cuda::attention_prep(q.d(), k.d(), v.d(), dp, dpos.get(), cache.device_view(dseq.get()), stream()));
      EXPECT_LT(normalized_error(q.dev_dense(), q.host_dense()), 1e-6);
      EXPECT_LT(normalized_error(k.dev_dense(), k.host_dense()), 1e-6);
      // The cache holds bf16: the rounded CPU values, but for the rare element the norm's
      // ordering moves across a rounding boundary (one bf16 step, 2^-8 relative).
      EXPECT_LT(normalized_error(cache.device_k(), round_bf16(cache.k)), 1e-4);
      EXPECT_EQ(cache.device_v(), round_bf16(cache.v));
    }
}

// kDecode is the f32 decode kernel (DecodeMath::kF32), kDecodeTc its tensor-core form.
// kDecodeAuto: attention_decode's per-row choice (DecodeMath::kAuto) at a given tc_min_span.
enum class Kernel { kDecode, kDecodeTc, kDecodeAuto, kPrefill, kPrefillTc, kAuto };

// Inputs for the tensor-core kernel's tests: kBf16 rounds q, K and V to bf16 (the kernel's
// own rounding of them is then exact and only P's remains); kZeroKeys also zeroes K, so every
// visible key scores 0 and gets probability exactly 1: the output is the plain mean of V over
// the keys the masks admit (V is integer-valued there: the sums are exact), which the
// tensor-core kernel must reproduce to f32 rounding.
enum class Inputs { kRandom, kBf16, kZeroKeys };


struct AttnCase {
  int n_heads, n_kv_heads, head_dim;
  int64_t rows, context;  // the last row of sequence 0 sits at position context - 1
  int window;
  bool sinks;
  int n_seqs;
  // > 0: a continuous-batching step instead of interleaved rows: rows [0, lone) are one row
  // each of sequences 1..lone (decode rows), the rest consecutive rows of sequence 0 (a prompt
  // chunk); n_seqs must be lone + 1 (or lone when every row is lone), and the device view says
  // lone_rows = lone (unless lone_hint is false: the same rows without the hint).
  int64_t lone = 0;
  bool lone_hint = true;
  std::string name() const {
    return "heads " + std::to_string(n_heads) + "/" + std::to_string(n_kv_heads) + " hd " + std::to_string(head_dim) +
           " rows " + std::to_string(rows) + " ctx " + std::to_string(context) + " window " + std::to_string(window) +
           " sinks " + std::to_string(sinks) + " seqs " + std::to_string(n_seqs) + " lone " + std::to_string(lone);
  }
};

struct AttnErrors {
  double normalized;  // ||cuda - cpu|| / ||cpu||, infinite on NaN
  double max_abs;     // max |cuda - cpu|, infinite on NaN
};

// Runs one case on both backends through the chosen CUDA kernel; returns the errors (and,
// when asked, both outputs [rows, n_heads * head_dim] and the rows' positions).
struct AttnOutputs {
  std::vector<float> cuda, cpu;
  std::vector<int64_t> positions;
};
AttnErrors run_attention_errors(const AttnCase& c, Kernel kernel, bool with_scratch = true,
                                Inputs inputs = Inputs::kRandom, int64_t tc_min_span = -1,
                                AttnOutputs* outputs = nullptr) {
  // Row t belongs to sequence t % n_seqs (interleaved: the prefill tiles see mixed
  // sequences); sequence s's rows take the last positions of its context, which shrinks
  // with s so the sequences differ in length.
  std::vector<int32_t> seq(size_t(c.rows));
  std::vector<int64_t> pos(size_t(c.rows));
  std::vector<int64_t> n_rows(size_t(c.n_seqs), 0);
  // Row t's sequence: interleaved, or (lone > 0) decode rows first, then one prompt chunk.
  const bool all_lone = c.lone > 0 && c.lone == c.rows;
  auto seq_of = [&](int64_t t) {
    if (c.lone == 0) return int(t % c.n_seqs);
    if (t < c.lone) return all_lone ? int(t) : int(t + 1);
    return 0;
  };
  if (c.lone > 0) {
    EXPECT_EQ(c.n_seqs, all_lone ? c.lone : c.lone + 1) << "a lone-rows case's sequences";
  }
  for (int64_t t = 0; t < c.rows; ++t) n_rows[size_t(seq_of(t))]++;
  std::vector<int64_t> next(size_t(c.n_seqs));
  for (int s = 0; s < c.n_seqs; ++s) {
    // Sequence s's context shrinks with s (lone cases: cycles over three lengths).
    const int64_t step = c.lone > 0 ? s % 3 : s;
    const int64_t ctx = std::max<int64_t>(n_rows[size_t(s)], c.context - step * (c.context / 3));
    next[size_t(s)] = ctx - n_rows[size_t(s)];
  }
  for (int64_t t = 0; t < c.rows; ++t) {
    const int s = seq_of(t);
    seq[size_t(t)] = s;
    pos[size_t(t)] = next[size_t(s)]++;
  }
  PagedCache cache(c.n_seqs, c.context + 5, c.n_kv_heads, c.head_dim, uint32_t(c.context * 7 + c.head_dim));
  const int64_t width = int64_t(c.n_heads) * c.head_dim;
  // q is a column slice of a wider qkv-like buffer (stride > width), out has padding.
  Strided q(c.rows, width, 2 * int64_t(c.n_kv_heads) * c.head_dim + 1, uint32_t(c.rows + 100), -2.f, 2.f);
  Strided out(c.rows, width, 3, 101);
  if (inputs != Inputs::kRandom) {
    for (float& x : q.host) x = round_bf16(x);
    for (float& x : cache.k) x = inputs == Inputs::kZeroKeys ? 0.f : round_bf16(x);
    // Zero keys: V in {-1, 0, 1, 2}, so every sum of V either backend forms is an exact
    // integer (whatever the order or the tensor cores' accumulation rounding).
    for (float& x : cache.v) x = inputs == Inputs::kZeroKeys ? std::floor(2.f * x) : round_bf16(x);
    q.upload();
    cache.upload();
  }
  const std::vector<float> sinks = random_floats(size_t(c.n_heads), 102, -1.f, 3.f);
  DeviceBuffer<float> dsinks(sinks);
  DeviceBuffer<int32_t> dseq(seq);
  DeviceBuffer<int64_t> dpos(pos);
  const float scale = 1.f / std::sqrt(float(c.head_dim));
  const int32_t* host_seq = c.n_seqs > 1 ? seq.data() : nullptr;
  const int32_t* dev_seq = c.n_seqs > 1 ? dseq.get() : nullptr;

  cpu().attention(q.h(), pos.data(), cache.host_view(host_seq), c.n_heads, scale, c.window,
                  c.sinks ? sinks.data() : nullptr, out.h());
  const int64_t scratch_floats = with_scratch ? cuda::attention_scratch_floats(c.rows, c.n_heads, c.head_dim) : 0;
  DeviceBuffer<float> scratch(size_t(std::max<int64_t>(scratch_floats, 1)));
  scratch.poison();  // partial states are always written before they are read
  out.poison();
  KvLayerView kv = cache.device_view(dev_seq);
  kv.lone_rows = c.lone_hint ? c.lone : 0;
  const float* ds = c.sinks ? dsinks.get() : nullptr;
  switch (kernel) {
    case Kernel::kDecode:
    case Kernel::kDecodeTc:
    case Kernel::kDecodeAuto:
      cuda::attention_decode(q.d(), dpos.get(), kv, c.n_heads, scale, c.window, ds, out.d(),
                             with_scratch ? scratch.get() : nullptr, scratch_floats, stream(),
                             kernel == Kernel::kDecode     ? cuda::DecodeMath::kF32
                             : kernel == Kernel::kDecodeTc ? cuda::DecodeMath::kTensorCores
                                                           : cuda::DecodeMath::kAuto,
                             tc_min_span);
      break;
    case Kernel::kPrefill:
      cuda::attention_prefill(q.d(), dpos.get(), kv, c.n_heads, scale, c.window, ds, out.d(), stream());
      break;
    case Kernel::kPrefillTc:
      cuda::attention_prefill_tc(q.d(), dpos.get(), kv, c.n_heads, scale, c.window, ds, out.d(), stream());
      break;
    case Kernel::kAuto:
      cuda::attention(q.d(), dpos.get(), kv, c.n_heads, scale, c.window, ds, out.d(), scratch.get(), scratch_floats,
                      stream());
      break;
  }
  EXPECT_TRUE(out.dev_pads_poisoned());
  const std::vector<float> got = out.dev_dense(), want = out.host_dense();
  if (outputs) *outputs = AttnOutputs{got, want, pos};
  double max_abs = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(double(got[i]) - double(want[i]));
    if (!(d <= max_abs)) max_abs = std::isnan(d) ? INFINITY : d;  // NaN wins
  }
  return {normalized_error(got, want), max_abs};
}

double run_attention(const AttnCase& c, Kernel kernel, bool with_scratch = true) {
  return run_attention_errors(c, kernel, with_scratch).normalized;
}

constexpr double kAttentionBound = 1e-5;
// The tensor-core kernel on bf16-exact inputs: each output is sum_j w_j v_j / sum_j w_j with
// w_j = p_j (1 + d_j), |d_j| <= 2^-9 (P rounded to bf16, the sum taken over the rounded
// weights), so |out - exact| <= 2^-9 max_j |v_j - out| <= 2^-9 (max V - min V) = 2^-9 * 2
// for V in [-0.5, 1.5], plus f32 rounding. Element-wise, so a wrong key anywhere fails it
// only when it moves an output by more than that: the kZeroKeys cases catch those at 1e-5.
constexpr double kTcMaxAbsBound = 2.0 / 512 + 1e-5;
// On general f32 inputs the scores also carry q's and k's rounding (~2^-9 |q||k| scale):
// normalized, as the golden tests see it.
constexpr double kTcRandomBound = 2e-2;

// Every head_dim (512: Gemma 4's full-attention layers) and GQA ratio, both kernels, one
// decode row and a small prefill chunk; head_dim 512 also over more rows than one tile holds,
// with a window and sinks, and with GQA 16 (past its decode blocks' 2 heads).
TEST(CudaOps, AttentionHeadDimsAndGroups) {
  REQUIRE_GPU();
  for (int hd : {32, 64, 80, 128, 256, 512})
    for (int group : {1, 2, 4, 8})
      for (int64_t rows : {int64_t(1), int64_t(17)}) {
        const AttnCase c{2 * group, 2, hd, rows, 300, 0, (hd + group) % 3 == 0, 1};
        SCOPED_TRACE(c.name());
        EXPECT_LT(run_attention(c, Kernel::kDecode), kAttentionBound) << "decode";
        EXPECT_LT(run_attention(c, Kernel::kPrefill), kAttentionBound) << "prefill";
      }
  for (const AttnCase& c : {AttnCase{16, 2, 512, 64, 300, 0, false, 1}, AttnCase{16, 2, 512, 40, 700, 128, true, 2},
                            AttnCase{32, 2, 512, 3, 300, 0, true, 1}, AttnCase{4, 2, 288, 17, 300, 0, true, 1}}) {
    SCOPED_TRACE(c.name());
    EXPECT_LT(run_attention(c, Kernel::kDecode), kAttentionBound) << "decode";
    EXPECT_LT(run_attention(c, Kernel::kPrefill), kAttentionBound) << "prefill";
    EXPECT_LT(run_attention(c, Kernel::kAuto), kAttentionBound) << "auto";
  }
  // Groups that are not powers of two (Qwen2.5: 14/2, 12/2) and above 8.
  for (int n_heads : {14, 12, 6, 32})
    for (int64_t rows : {int64_t(1), int64_t(3), int64_t(64)}) {
      const AttnCase c{n_heads, 2, 64, rows, 300, 0, true, 1};
      SCOPED_TRACE(c.name());
      EXPECT_LT(run_attention(c, Kernel::kDecode), kAttentionBound) << "decode";
      EXPECT_LT(run_attention(c, Kernel::kPrefill), kAttentionBound) << "prefill";
    }
}

// Context lengths around the block size, windows and sinks: both kernels.
TEST(CudaOps, AttentionContextsWindowsSinks) {
  REQUIRE_GPU();
  for (int64_t ctx : {1, 15, 16, 17, 300, 4000})
    for (int64_t rows : {int64_t(1), int64_t(3)})
      for (int window : {0, 1, 7, 128})
        for (bool sinks : {false, true}) {
          if (rows > ctx) continue;
          const AttnCase c{8, 2, 128, rows, ctx, window, sinks, 1};
          SCOPED_TRACE(c.name());
          EXPECT_LT(run_attention(c, Kernel::kDecode), kAttentionBound) << "decode";
          EXPECT_LT(run_attention(c, Kernel::kPrefill), kAttentionBound) << "prefill";
        }
}

// Prefill-sized batches, one or two sequences interleaved in the micro-batch.
TEST(CudaOps, AttentionPrefillBatches) {
  REQUIRE_GPU();
  for (int64_t rows : {int64_t(17), int64_t(64), int64_t(500)})
    for (int64_t ctx : {int64_t(300), int64_t(4000)})
      for (int n_seqs : {1, 2})
        for (int window : {0, 128}) {
          if (rows > ctx) continue;
          const int hd = rows == 500 ? 64 : 128;
          const AttnCase c{8, rows == 64 ? 1 : 4, hd, rows, ctx, window, window > 0, n_seqs};
          SCOPED_TRACE(c.name());
          EXPECT_LT(run_attention(c, Kernel::kPrefill), kAttentionBound) << "prefill";
          // attention() takes the tensor-core kernel for these rows and head dims.
          EXPECT_LT(run_attention(c, Kernel::kAuto), kTcRandomBound) << "auto";
          EXPECT_LT(run_attention(c, Kernel::kPrefillTc), kTcRandomBound) << "prefill tc";
          if (rows <= 64) {
            EXPECT_LT(run_attention(c, Kernel::kDecode), kAttentionBound) << "decode";
          }
        }
}

// Decode rows of different sequences in one call, split-K with and without scratch (no
// scratch: one split, no combine).
TEST(CudaOps, AttentionDecodeRowsOfManySequences) {
  REQUIRE_GPU();
  for (int n_seqs : {2, 3})
    for (int64_t ctx : {int64_t(17), int64_t(300), int64_t(4000)})
      for (bool scratch : {true, false}) {
        const AttnCase c{16, 2, 128, n_seqs, ctx, ctx == 4000 ? 128 : 0, true, n_seqs};
        SCOPED_TRACE(c.name() + " scratch " + std::to_string(scratch));
        EXPECT_LT(run_attention(c, Kernel::kDecode, scratch), kAttentionBound);
        // attention() takes the tensor-core decode kernel here (head_dim 128, 8 heads a group).
        EXPECT_LT(run_attention(c, Kernel::kAuto, scratch), kTcRandomBound);
        EXPECT_LT(run_attention_errors(c, Kernel::kAuto, scratch, Inputs::kZeroKeys).normalized, kAttentionBound);
      }
}

// A continuous-batching step: decode rows of many sequences first (KvLayerView::lone_rows),
// then a prompt chunk of one more. attention() runs the lone rows through the per-row decode
// kernel and the chunk through the tiled one; with lone_rows = 0 every row goes tiled. Both
// against the CPU, with zero keys exactly (a row routed to the wrong sequence or position
// moves its output by ~1 / keys).
TEST(CudaOps, AttentionLoneRowsTakeTheDecodeKernel) {
  REQUIRE_GPU();
  for (int64_t lone : {int64_t(17), int64_t(64)})
    for (int64_t chunk : {int64_t(0), int64_t(30)})
      for (int64_t ctx : {int64_t(90), int64_t(600)})
        for (int window : {0, 64}) {
          const int64_t rows = lone + chunk;
          const int n_seqs = int(chunk == 0 ? lone : lone + 1);
          AttnCase c{32, 4, 128, rows, ctx, window, window > 0, n_seqs, lone};
          SCOPED_TRACE(c.name());
          EXPECT_LT(run_attention(c, Kernel::kAuto), kTcRandomBound) << "with lone rows";
          EXPECT_LT(run_attention_errors(c, Kernel::kAuto, true, Inputs::kZeroKeys).normalized, kAttentionBound)
              << "with lone rows, zero keys";
          c.lone_hint = false;  // the same rows without the hint: all tiled
          EXPECT_LT(run_attention_errors(c, Kernel::kAuto, true, Inputs::kZeroKeys).normalized, kAttentionBound)
              << "without the hint";
        }
}

// The tensor-core prefill kernel's masks, windows, sinks, sequences and GQA mapping, exactly:
// with every key scoring 0 a key read or dropped by mistake moves an output by ~1 / keys,
// 20x the bound even at 4000 keys (as the f32 kernels' tests).
TEST(CudaOps, AttentionTensorCoreMasksExactly) {
  REQUIRE_GPU();
  for (int hd : {32, 64, 80, 128})
    for (int group : {1, 4, 8, 12})
      for (int64_t rows : {int64_t(17), int64_t(64), int64_t(100)}) {
        const AttnCase c{2 * group, 2, hd, rows, 300, hd == 80 ? 7 : 0, (hd + group) % 3 == 0, group == 4 ? 2 : 1};
        SCOPED_TRACE(c.name());
        EXPECT_LT(run_attention_errors(c, Kernel::kPrefillTc, true, Inputs::kZeroKeys).normalized, kAttentionBound);
      }
  for (int64_t ctx : {17, 63, 64, 65, 300, 4000})
    for (int window : {0, 1, 7, 128})
      for (int n_seqs : {1, 2}) {
        const int64_t rows = std::min<int64_t>(ctx, 40);
        const AttnCase c{8, 2, 128, rows, ctx, window, window % 2 == 1, n_seqs};
        SCOPED_TRACE(c.name());
        EXPECT_LT(run_attention_errors(c, Kernel::kPrefillTc, true, Inputs::kZeroKeys).normalized, kAttentionBound);
      }
}

// Its products: random bf16-exact q, K, V, held element-wise to P's rounding (kTcMaxAbsBound),
// and general f32 inputs to kTcRandomBound. Ragged rows, every head_dim it takes.
TEST(CudaOps, AttentionTensorCoreProducts) {
  REQUIRE_GPU();
  for (int hd : {32, 64, 80, 128})
    for (int64_t rows : {int64_t(17), int64_t(64), int64_t(500)})
      for (int64_t ctx : {int64_t(500), int64_t(4000)})
        for (int window : {0, 128}) {
          const AttnCase c{8, 2, hd, rows, ctx, window, window > 0, rows == 17 ? 2 : 1};
          SCOPED_TRACE(c.name());
          const AttnErrors exact = run_attention_errors(c, Kernel::kPrefillTc, true, Inputs::kBf16);
          EXPECT_LT(exact.max_abs, kTcMaxAbsBound);
          EXPECT_LT(run_attention_errors(c, Kernel::kPrefillTc).normalized, kTcRandomBound);
        }
}

// The tensor-core decode kernel: masks, windows, sinks, splits, sequences and the GQA mapping
// exactly (kZeroKeys: a key read or dropped by mistake moves an output by ~1 / keys), its
// products element-wise to P's rounding on bf16-exact inputs, general inputs to the bound the
// goldens see. Every group size it takes (1..16, padding rows of A past the group), both head
// dims, 1..16 rows, contexts around its 16-key steps and 64-key splits, with and without
// scratch (one split: the block normalizes and adds the sink itself).
TEST(CudaOps, AttentionDecodeTensorCores) {
  REQUIRE_GPU();
  for (int hd : {64, 128})
    for (int group : {1, 2, 3, 4, 8, 12, 16})
      for (int64_t rows : {int64_t(1), int64_t(3), int64_t(16)}) {
        const AttnCase c{2 * group, 2, hd, rows, 300, group == 3 ? 7 : 0, (hd + group) % 3 == 0, rows == 3 ? 3 : 1};
        SCOPED_TRACE(c.name());
        EXPECT_LT(run_attention_errors(c, Kernel::kDecodeTc, true, Inputs::kZeroKeys).normalized, kAttentionBound);
        EXPECT_LT(run_attention_errors(c, Kernel::kDecodeTc, true, Inputs::kBf16).max_abs, kTcMaxAbsBound);
        EXPECT_LT(run_attention(c, Kernel::kDecodeTc), kTcRandomBound);
      }
  for (int64_t ctx : {1, 2, 15, 16, 17, 63, 64, 65, 300, 4000, 9000})
    for (int window : {0, 1, 7, 128})
      for (bool scratch : {true, false}) {
        const int64_t rows = std::min<int64_t>(ctx, 2);
        const AttnCase c{8, 2, 128, rows, ctx, window, (ctx + window) % 2 == 1, ctx == 300 ? 2 : 1};
        SCOPED_TRACE(c.name() + " scratch " + std::to_string(scratch));
        EXPECT_LT(run_attention_errors(c, Kernel::kDecodeTc, scratch, Inputs::kZeroKeys).normalized, kAttentionBound);
        EXPECT_LT(run_attention_errors(c, Kernel::kDecodeTc, scratch, Inputs::kBf16).max_abs, kTcMaxAbsBound);
        EXPECT_LT(run_attention(c, Kernel::kDecodeTc, scratch), kTcRandomBound);
      }
  // Outside its shapes: refused by name when insisted on, the f32 kernel under kAuto.
  const AttnCase wide{34, 2, 128, 1, 100, 0, false, 1};  // 17 heads a group
  EXPECT_THROW(run_attention(wide, Kernel::kDecodeTc), Error);
  EXPECT_LT(run_attention(wide, Kernel::kAuto), kAttentionBound);
  const AttnCase hd80{8, 2, 80, 1, 100, 0, true, 1};
  EXPECT_THROW(run_attention(hd80, Kernel::kDecodeTc), Error);
  EXPECT_LT(run_attention(hd80, Kernel::kAuto), kAttentionBound);
}

// kAuto picks the form per query row on the device, from the row's visible span: in one call
// of three sequences (spans 3000, 2000 and 1000), a row below tc_min_span equals the f32
// kernel's output bit for bit and a row at or above it the tensor cores' (the split count
// comes from the shapes alone, the same for the three launches without a window). With a
// window the forms' split counts differ, so the rows are held to their form's bound against
// the CPU instead: the f32 one (1e-5) is far below what the tensor cores' bf16 rounding of
// random inputs gives, so a row sent to the wrong form fails.
TEST(CudaOps, AttentionDecodeChoosesFormPerRow) {
  REQUIRE_GPU();
  auto row_error = [](const std::vector<float>& a, const std::vector<float>& b, size_t row, size_t width) {
    const std::vector<float> ra(a.begin() + long(row * width), a.begin() + long((row + 1) * width));
    const std::vector<float> rb(b.begin() + long(row * width), b.begin() + long((row + 1) * width));
    return normalized_error(ra, rb);
  };
  for (int hd : {64, 128})
    for (int group : {1, 3, 8})
      for (int window : {0, 1500}) {
        const AttnCase c{2 * group, 2, hd, 3, 3000, window, group != 3, 3};
        const size_t width = size_t(c.n_heads) * size_t(hd);
        AttnOutputs f32, tc;
        run_attention_errors(c, Kernel::kDecode, true, Inputs::kRandom, -1, &f32);
        run_attention_errors(c, Kernel::kDecodeTc, true, Inputs::kRandom, -1, &tc);
        ASSERT_EQ(f32.positions, (std::vector<int64_t>{2999, 1999, 999}));
        for (int64_t min_span : {int64_t(0), int64_t(1000), int64_t(1001), int64_t(1500), int64_t(2000),
                                 int64_t(3001), int64_t(1) << 40}) {
          SCOPED_TRACE(c.name() + " tc_min_span " + std::to_string(min_span));
          AttnOutputs mixed;
          run_attention_errors(c, Kernel::kDecodeAuto, true, Inputs::kRandom, min_span, &mixed);
          for (size_t t = 0; t < 3; ++t) {
            const int64_t pos = mixed.positions[t];
            const int64_t span = window > 0 ? std::min<int64_t>(pos + 1, window) : pos + 1;
            const bool want_tc = span >= min_span;
            SCOPED_TRACE("row " + std::to_string(t) + " span " + std::to_string(span) + (want_tc ? " tc" : " f32"));
            if (window == 0) {
              const AttnOutputs& want = want_tc ? tc : f32;
              EXPECT_TRUE(std::equal(mixed.cuda.begin() + long(t * width), mixed.cuda.begin() + long((t + 1) * width),
                                     want.cuda.begin() + long(t * width)));
            }
            const double err = row_error(mixed.cuda, mixed.cpu, t, width);
            if (want_tc) {
              EXPECT_LT(err, kTcRandomBound);
              EXPECT_GT(err, kAttentionBound);  // the bf16 rounding is there: it ran on the tensor cores
            } else {
              EXPECT_LT(err, kAttentionBound);
            }
          }
        }
      }
}

// One decode row's AttentionPrep on both sides: host pointers for the CPU backend, device
// copies for the CUDA launchers (norm weights in [0.5, 1.5) when asked for, RoPE inv_freq of
// base 1e6 over rot dims, sinks per head in [-1, 3)).
struct PrepParams {
  std::vector<float> inv_freq, qn, kn, sinks;
  DeviceBuffer<float> dfreq, dqn, dkn, dsinks;
  AttentionPrep host, dev;

  PrepParams(int heads, int kv_heads, int hd, int rot, bool norm, float offset, float factor, std::mt19937& rng)
      : inv_freq(freqs(rot)),
        qn(random_floats(size_t(hd), uint32_t(rng()), 0.5f, 1.5f)),
        kn(random_floats(size_t(hd), uint32_t(rng()), 0.5f, 1.5f)),
        sinks(random_floats(size_t(heads), uint32_t(rng()), -1.f, 3.f)),
        dfreq(inv_freq),
        dqn(qn),
        dkn(kn),
        dsinks(sinks) {
    host.n_heads = heads;
    host.n_kv_heads = kv_heads;
    host.head_dim = hd;
    host.rotary_dim = rot;
    host.norm_eps = 1e-6f;
    host.norm_offset = offset;
    host.attention_factor = factor;
    dev = host;
    host.inv_freq = inv_freq.data();
    dev.inv_freq = dfreq.get();
    if (norm) {
      host.q_norm = qn.data(), host.k_norm = kn.data();
      dev.q_norm = dqn.get(), dev.k_norm = dkn.get();
    }
  }

 private:
  static std::vector<float> freqs(int rot) {
    std::vector<float> f(size_t(std::max(rot / 2, 1)));
    for (int i = 0; i < rot / 2; ++i) f[size_t(i)] = float(std::pow(1e6, -2.0 * i / rot));
    return f;
  }
};

// prep_attention fused into the tensor-core decode kernel (one row) against the CPU backend's
// attention_prep then attention: the output to the tensor-core bounds, the cache (the new
// key and value written by the block holding that position, every other slot untouched) as
// AttentionPrepMatchesSeparateOps holds it. kZeroKeys-style exactness: with every cached key
// and the new k zero (normed zero stays zero), each output is the mean of V over the visible
// positions, the new v included, which only a block that wrote it before reading it gets.
TEST(CudaOps, AttentionDecodePrepMatchesSeparateOps) {
  REQUIRE_GPU();
  std::mt19937 rng(97);
  struct Case {
    int heads, kv_heads, hd, rot;
    bool norm;
    float offset, factor;
    int window;
    bool sinks;
  };
  const Case cases[] = {{32, 4, 128, 128, true, 0.f, 1.f, 0, false}, {8, 1, 64, 64, false, 0.f, 1.f, 128, true},
                        {12, 2, 128, 64, true, 1.f, 1.3f, 0, true},   {16, 1, 128, 128, true, 0.f, 1.f, 7, false},
                        {4, 4, 64, 32, true, 0.f, 1.f, 0, false}};
  for (const Case& c : cases)
    for (int64_t p0 : {int64_t(0), int64_t(15), int64_t(16), int64_t(63), int64_t(64), int64_t(299), int64_t(4100)})
      for (bool zero : {false, true})
        for (int seq_id : {0, 1}) {
          SCOPED_TRACE("heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " hd " +
                       std::to_string(c.hd) + " rot " + std::to_string(c.rot) + " window " + std::to_string(c.window) +
                       " pos " + std::to_string(p0) + " zero " + std::to_string(zero) + " seq " +
                       std::to_string(seq_id));
          PagedCache cache(2, p0 > 1000 ? 4200 : 310, c.kv_heads, c.hd, uint32_t(rng()));
          const int64_t qkv = int64_t(c.heads + 2 * c.kv_heads) * c.hd;
          Strided q(1, int64_t(c.heads) * c.hd, qkv - int64_t(c.heads) * c.hd, uint32_t(rng()), -2.f, 2.f);
          Strided k(1, int64_t(c.kv_heads) * c.hd, 0, uint32_t(rng()));
          Strided v(1, int64_t(c.kv_heads) * c.hd, 0, uint32_t(rng()), -0.5f, 1.5f);
          if (zero) {
            for (float& x : cache.k) x = 0.f;
            for (float& x : cache.v) x = std::floor(2.f * x);
            for (float& x : k.host) x = 0.f;
            for (float& x : v.host) x = std::floor(2.f * x);
            cache.upload();
            k.upload();
            v.upload();
          }
          const std::vector<int32_t> seq{seq_id};
          const std::vector<int64_t> pos{p0};
          DeviceBuffer<int32_t> dseq(seq);
          DeviceBuffer<int64_t> dpos(pos);
          const PrepParams pp(c.heads, c.kv_heads, c.hd, c.rot, c.norm, c.offset, c.factor, rng);
          const AttentionPrep &hp = pp.host, &dp = pp.dev;
          const std::vector<float>& sinks = pp.sinks;
          const DeviceBuffer<float>& dsinks = pp.dsinks;
          const float scale = 1.f / std::sqrt(float(c.hd));
          Strided out(1, int64_t(c.heads) * c.hd, 3, 101);
          cpu().prep_attention(q.h(), k.h(), v.h(), hp, pos.data(), cache.host_view(seq.data()), scale, c.window,
                               c.sinks ? sinks.data() : nullptr, out.h());
          const int64_t scratch_floats = cuda::attention_scratch_floats(1, c.heads, c.hd);
          DeviceBuffer<float> scratch{size_t(scratch_floats)};
          scratch.poison();
          out.poison();
          ASSERT_TRUE(cuda::attention_decode_prep(q.d(), k.d(), v.d(), dp, dpos.get(), cache.device_view(dseq.get()),
                                                  scale, c.window, c.sinks ? dsinks.get() : nullptr, out.d(),
                                                  scratch.get(), scratch_floats, stream()));
          EXPECT_TRUE(out.dev_pads_poisoned());
          EXPECT_LT(normalized_error(out.dev_dense(), out.host_dense()), zero ? kAttentionBound : kTcRandomBound);
          if (zero) {
            EXPECT_EQ(cache.device_k(), cache.k);
          } else {
            EXPECT_LT(normalized_error(cache.device_k(), round_bf16(cache.k)), 1e-4);
          }
          EXPECT_EQ(cache.device_v(), round_bf16(cache.v));
        }
  // Outside its shapes it launches nothing and says so.
  {
    PagedCache cache(1, 64, 2, 80, 5);
    Strided q(1, 8 * 80, 0, 6), k(1, 2 * 80, 0, 7), v(1, 2 * 80, 0, 8), out(1, 8 * 80, 0, 9);
    AttentionPrep p;
    p.n_heads = 8, p.n_kv_heads = 2, p.head_dim = 80, p.rotary_dim = 80;
    DeviceBuffer<float> dfreq(std::vector<float>(40, 1.f));
    p.inv_freq = dfreq.get();
    DeviceBuffer<int64_t> dpos(std::vector<int64_t>{3});
    EXPECT_FALSE(cuda::attention_decode_prep(q.d(), k.d(), v.d(), p, dpos.get(), cache.device_view(nullptr), 0.1f, 0,
                                             nullptr, out.d(), nullptr, 0, stream()));
  }
}

// One decode row's attention_prep, then attention at once on the stream (programmatic dependent
// launch, as in a decode step): the decode kernels load the row's other keys before waiting on
// prep, and its own key only after. The device slot at the row's position starts poisoned with
// a large key and value, so a key read before prep wrote it moves every output. V is integer
// and the keys zero or bf16-exact, so the f32 form meets the CPU at kAttentionBound.
TEST(CudaOps, AttentionDecodeAfterPrepSeesTheNewKey) {
  REQUIRE_GPU();
  std::mt19937 rng(98);
  const int heads = 32, kv_heads = 4, hd = 128;
  for (int64_t p0 : {int64_t(0), int64_t(7), int64_t(15), int64_t(16), int64_t(63), int64_t(64), int64_t(300),
                     int64_t(511), int64_t(700)})
    for (cuda::DecodeMath math : {cuda::DecodeMath::kAuto, cuda::DecodeMath::kF32})
      for (int seq_id : {0, 1}) {
        SCOPED_TRACE("pos " + std::to_string(p0) + " math " + std::to_string(int(math)) + " seq " +
                     std::to_string(seq_id));
        PagedCache cache(2, 720, kv_heads, hd, uint32_t(rng()));
        for (float& x : cache.k) x = 0.f;
        for (float& x : cache.v) x = std::floor(2.f * x);
        // The device pools keep the poison until prep's kernel writes the slot; the CPU
        // reference's prep overwrites it in the host copy.
        const int64_t blk = cache.table[size_t(seq_id * cache.max_blocks + p0 / cache.block_size)];
        for (int h = 0; h < kv_heads; ++h)
          for (int d = 0; d < hd; ++d) {
            const size_t off = size_t(((blk * cache.block_size + p0 % cache.block_size) * kv_heads + h) * hd + d);
            cache.k[off] = 64.f;
            cache.v[off] = 4096.f;
          }
        cache.upload();
        Strided q(1, int64_t(heads) * hd, 2 * int64_t(kv_heads) * hd, uint32_t(rng()), -2.f, 2.f);
        Strided k(1, int64_t(kv_heads) * hd, 0, uint32_t(rng()));
        Strided v(1, int64_t(kv_heads) * hd, 0, uint32_t(rng()), -0.5f, 1.5f);
        for (float& x : k.host) x = 0.f;
        for (float& x : v.host) x = std::floor(2.f * x);
        k.upload();
        v.upload();
        const std::vector<int32_t> seq{seq_id};
        const std::vector<int64_t> pos{p0};
        std::vector<float> inv_freq(size_t(hd / 2));
        for (int i = 0; i < hd / 2; ++i) inv_freq[size_t(i)] = float(std::pow(1e6, -2.0 * i / hd));
        DeviceBuffer<int32_t> dseq(seq);
        DeviceBuffer<int64_t> dpos(pos);
        DeviceBuffer<float> dfreq(inv_freq);
        AttentionPrep hp;
        hp.n_heads = heads;
        hp.n_kv_heads = kv_heads;
        hp.head_dim = hd;
        hp.rotary_dim = hd;
        AttentionPrep dp = hp;
        hp.inv_freq = inv_freq.data();
        dp.inv_freq = dfreq.get();
        const float scale = 1.f / std::sqrt(float(hd));
        Strided out(1, int64_t(heads) * hd, 3, 101);
        cpu().prep_attention(q.h(), k.h(), v.h(), hp, pos.data(), cache.host_view(seq.data()), scale, 0, nullptr,
                             out.h());
        const int64_t scratch_floats = cuda::attention_scratch_floats(1, heads, hd);
        DeviceBuffer<float> scratch{size_t(scratch_floats)};
        scratch.poison();
        out.poison();
        const KvLayerView kv = cache.device_view(dseq.get());
        ASSERT_TRUE(cuda::attention_prep(q.d(), k.d(), v.d(), dp, dpos.get(), kv, stream()));
        cuda::attention_decode(q.d(), dpos.get(), kv, heads, scale, 0, nullptr, out.d(), scratch.get(),
                               scratch_floats, stream(), math);
        EXPECT_TRUE(out.dev_pads_poisoned());
        EXPECT_LT(normalized_error(out.dev_dense(), out.host_dense()), kAttentionBound);
        EXPECT_EQ(cache.device_v(), cache.v);
      }
}

// attention_decode_fused (one decode row: prep, split attention and the cluster merge in one
// launch) against the CPU backend's attention_prep then attention, over head dims 16..128,
// GQA groups 1..8, partial rotary, norms with and without offset, windows, sinks, both
// sequences of the cache, block sizes 16 and 64, and positions around every tile and split
// boundary (the 16-key minimum split, 32-key tiles, two stages in flight, and spans far past
// the span the backend fuses at, where the splits walk many tiles). The device slot at the
// row's own position starts poisoned with a large key and value: a block that read it from
// memory instead of the value it computed would move every output.
//  - random keys: the CPU cache rounded to bf16 after its prep (the device stores the new key
//    and value rounded; the outputs differ only in summation orders and the norm's last ulp):
//    1e-4;
//  - zero keys (and new k zero): every output is the exact mean of the integer V over the
//    visible positions: kAttentionBound.
TEST(CudaOps, AttentionDecodeFusedMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(99);
  struct Case {
    int heads, kv_heads, hd, rot;
    bool norm;
    float offset, factor;
    int window;
    bool sinks;
    int block_size;
  };
  const Case cases[] = {{32, 4, 128, 128, true, 0.f, 1.f, 0, false, 16},  {32, 8, 128, 128, true, 0.f, 1.f, 0, false, 64},
                        {4, 2, 16, 16, true, 0.f, 1.f, 0, false, 16},     {4, 1, 16, 8, false, 0.f, 1.f, 0, true, 16},
                        {12, 2, 64, 64, false, 0.f, 1.f, 100, true, 16},  {8, 8, 32, 32, true, 1.f, 1.3f, 0, false, 64},
                        {14, 2, 128, 64, true, 0.f, 1.f, 7, false, 16},   {24, 3, 64, 32, true, 0.f, 1.f, 0, true, 16}};
  const int64_t positions[] = {0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 300, 511, 512, 1023, 2100};
  for (const Case& c : cases)
    for (int64_t p0 : positions)
      for (bool zero : {false, true}) {
        const int seq_id = int(p0 % 2);
        SCOPED_TRACE("heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " hd " +
                     std::to_string(c.hd) + " rot " + std::to_string(c.rot) + " window " + std::to_string(c.window) +
                     " block " + std::to_string(c.block_size) + " pos " + std::to_string(p0) + " zero " +
                     std::to_string(zero));
        PagedCache cache(2, 2112, c.kv_heads, c.hd, uint32_t(rng()), c.block_size);
        if (zero) {
          for (float& x : cache.k) x = 0.f;
          for (float& x : cache.v) x = std::floor(2.f * x);
        }
        const int64_t blk = cache.table[size_t(seq_id * cache.max_blocks + p0 / cache.block_size)];
        for (int h = 0; h < c.kv_heads; ++h)
          for (int d = 0; d < c.hd; ++d) {
            const size_t off =
                size_t(((blk * cache.block_size + p0 % cache.block_size) * c.kv_heads + h) * c.hd + d);
            cache.k[off] = 64.f;
            cache.v[off] = 4096.f;
          }
        cache.upload();
        Strided q(1, int64_t(c.heads) * c.hd, 5, uint32_t(rng()), -2.f, 2.f);
        Strided k(1, int64_t(c.kv_heads) * c.hd, 0, uint32_t(rng()));
        Strided v(1, int64_t(c.kv_heads) * c.hd, 0, uint32_t(rng()), -0.5f, 1.5f);
        if (zero) {
          for (float& x : k.host) x = 0.f;
          for (float& x : v.host) x = std::floor(2.f * x);
          k.upload();
          v.upload();
        }
        const std::vector<int32_t> seq{seq_id};
        const std::vector<int64_t> pos{p0};
        DeviceBuffer<int32_t> dseq(seq);
        DeviceBuffer<int64_t> dpos(pos);
        const PrepParams pp(c.heads, c.kv_heads, c.hd, c.rot, c.norm, c.offset, c.factor, rng);
        const AttentionPrep &hp = pp.host, &dp = pp.dev;
        const std::vector<float>& sinks = pp.sinks;
        const DeviceBuffer<float>& dsinks = pp.dsinks;
        const float scale = 1.f / std::sqrt(float(c.hd));
        // The reference: the CPU's prep, its cache rounded to bf16 as the device's holds it, then
        // the CPU's attention.
        Strided out(1, int64_t(c.heads) * c.hd, 3, 101);
        std::vector<float> hq_host = q.host, hk_host = k.host;  // the CPU's prep works in place
        const Mat hq(hq_host.data(), 1, q.cols, q.stride), hk(hk_host.data(), 1, k.cols, k.stride);
        cpu().attention_prep(hq, hk, v.h(), hp, pos.data(), cache.host_view(seq.data()));
        cache.k = round_bf16(cache.k);  // new vectors: views are made after
        cache.v = round_bf16(cache.v);
        cpu().attention(hq, pos.data(), cache.host_view(seq.data()), c.heads, scale, c.window,
                        c.sinks ? sinks.data() : nullptr, out.h());
        out.poison();
        ASSERT_TRUE(cuda::attention_decode_fused(q.d(), k.d(), v.d(), dp, dpos.get(), cache.device_view(dseq.get()),
                                                 scale, c.window, c.sinks ? dsinks.get() : nullptr, out.d(),
                                                 stream()));
        EXPECT_TRUE(out.dev_pads_poisoned());
        EXPECT_LT(normalized_error(out.dev_dense(), out.host_dense()), zero ? kAttentionBound : 1e-4);
        if (zero) {
          EXPECT_EQ(cache.device_k(), cache.k);
        } else {
          EXPECT_LT(normalized_error(cache.device_k(), cache.k), 1e-4);
        }
        EXPECT_EQ(cache.device_v(), cache.v);
      }
  // Outside its shapes it launches nothing and says so: head_dim 80, 16 heads a KV head, two rows.
  {
    PagedCache cache(1, 64, 2, 80, 5);
    Strided q(1, 8 * 80, 0, 6), k(1, 2 * 80, 0, 7), v(1, 2 * 80, 0, 8), out(1, 8 * 80, 0, 9);
    AttentionPrep p;
    p.n_heads = 8, p.n_kv_heads = 2, p.head_dim = 80, p.rotary_dim = 80;
    DeviceBuffer<float> dfreq(std::vector<float>(40, 1.f));
    p.inv_freq = dfreq.get();
    DeviceBuffer<int64_t> dpos(std::vector<int64_t>{3});
    EXPECT_FALSE(cuda::attention_decode_fused(q.d(), k.d(), v.d(), p, dpos.get(), cache.device_view(nullptr), 0.1f, 0,
                                              nullptr, out.d(), stream()));
    PagedCache wide(1, 64, 1, 64, 6);
    Strided q16(1, 16 * 64, 0, 6), k1(1, 64, 0, 7), v1(1, 64, 0, 8), out16(1, 16 * 64, 0, 9);
    p.n_heads = 16, p.n_kv_heads = 1, p.head_dim = 64, p.rotary_dim = 64;
    EXPECT_FALSE(cuda::attention_decode_fused(q16.d(), k1.d(), v1.d(), p, dpos.get(), wide.device_view(nullptr), 0.1f,
                                              0, nullptr, out16.d(), stream()));
    Strided q2(2, 4 * 64, 0, 6), k2(2, 64, 0, 7), v2(2, 64, 0, 8), out2(2, 4 * 64, 0, 9);
    p.n_heads = 4;
    EXPECT_FALSE(cuda::attention_decode_fused(q2.d(), k2.d(), v2.d(), p, dpos.get(), wide.device_view(nullptr), 0.1f,
                                              0, nullptr, out2.d(), stream()));
  }
}

TEST(CudaOps, AttentionRefusesUnsupportedHeadDim) {
  REQUIRE_GPU();
  for (int hd : {516, 1024}) {
    const AttnCase c{4, 2, hd, 1, 4, 0, false, 1};
    EXPECT_THROW(run_attention(c, Kernel::kDecode), Error) << hd;
    EXPECT_THROW(run_attention(c, Kernel::kPrefill), Error) << hd;
  }
}

}  // namespace
}  // namespace turbospark::testing
