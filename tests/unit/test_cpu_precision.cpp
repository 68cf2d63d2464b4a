// CpuPrecision (ops/backend.h): the CPU backend rounding where the CUDA path does, the reference
// the device tests hold the GPU to. Checked here op by op: K/V stored as bf16, and GEMM inputs
// rounded (bf16, tf32 for f32 weights) past the row bound, in dense matmuls and in every matmul
// of a MoE micro-batch past it, with f32 kept at and below the bound; attention past its bound
// as the tensor-core prefill kernel rounds it; MXFP4 matmuls on f32 activations. And the two
// aids of the GPU comparison: routing replayed from another run, and the nudge that measures the
// reference's own rounding noise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "backends/cpu/mxfp4.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/thread_pool.h"
#include "ops/backend.h"
#include "test_util.h"
#include "unit/mxfp4_matrix.h"

namespace turbospark {
namespace {

std::vector<float> randoms(size_t n, uint32_t seed) { return testing::uniform_floats(n, seed); }

float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

float round_tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}

struct Matrix {
  std::vector<uint16_t> bf16;
  std::vector<float> f32;
  WeightView view;
};

Matrix make_matrix(DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
  Matrix m;
  m.f32 = randoms(size_t(rows * cols), seed);
  m.view.dtype = dtype;
  m.view.rows = rows;
  m.view.cols = cols;
  if (dtype == DType::BF16) {
    for (float v : m.f32) m.bf16.push_back(f32_to_bf16(v));
    m.view.data = m.bf16.data();
    m.view.row_bytes = cols * 2;
  } else {
    m.view.data = m.f32.data();
    m.view.row_bytes = cols * 4;
  }
  return m;
}

std::vector<float> product(Backend& be, const WeightView& w, std::vector<float> x, int64_t rows) {
  std::vector<float> y(size_t(rows * w.rows));
  Weight wt;
  wt.view = w;
  be.matmul(wt, Mat(x.data(), rows, w.cols), Mat(y.data(), rows, w.rows));
  return y;
}

// A [rows, cols] f32 view of values.
WeightView f32_view(const float* values, int64_t rows, int64_t cols) {
  WeightView v;
  v.dtype = DType::F32;
  v.data = values;
  v.rows = rows;
  v.cols = cols;
  v.row_bytes = cols * 4;
  return v;
}

// Random weights stored in a format, with their stored values widened to f32.
struct Stored {
  DType dtype;
  int64_t rows, cols;
  std::vector<uint8_t> bytes;
  std::vector<float> values;
  WeightView view() const {
    WeightView v;
    v.dtype = dtype;
    v.data = bytes.data();
    v.rows = rows;
    v.cols = cols;
    v.row_bytes = row_bytes(dtype, cols);
    return v;
  }
  WeightView widened() const { return f32_view(values.data(), rows, cols); }
};

Stored store(DType t, int64_t r, int64_t c, uint32_t seed) {
  Stored s{t, r, c, {}, {}};
  const std::vector<float> w = randoms(size_t(r * c), seed);
  s.bytes.resize(size_t(r * row_bytes(t, c)));
  s.values.resize(size_t(r * c));
  for (int64_t i = 0; i < r; ++i) {
    quantize_row(t, w.data() + i * c, s.bytes.data() + i * row_bytes(t, c), c);
    dequantize_row(t, s.bytes.data() + i * row_bytes(t, c), s.values.data() + i * c, c);
  }
  return s;
}

TEST(CpuPrecision, GemmInputsAreRoundedPastTheRowBoundOnly) {
  auto exact = make_cpu_backend(1);
  auto gpu_like = make_cpu_backend(1, CpuPrecision{.bf16_kv = false, .gemm_above_rows = 8});
  // 40 columns: f32 rows of 160 bytes, which cuBLASLt reads in place (tf32); unaligned ones go
  // through the bf16 dequantize pass (GemmsOverDequantizedWeightsReadBf16Values).
  for (DType dtype : {DType::BF16, DType::F32}) {
    const Matrix w = make_matrix(dtype, 5, 40, 1);
    for (int64_t rows : {1, 8, 9, 40}) {
      const std::vector<float> x = randoms(size_t(rows * 40), 2 + uint32_t(rows));
      std::vector<float> rounded = x;
      for (float& v : rounded) v = dtype == DType::F32 ? round_tf32(v) : round_bf16(v);
      const std::vector<float> got = product(*gpu_like, w.view, x, rows);
      const std::vector<float> want = product(*exact, w.view, rows > 8 ? rounded : x, rows);
      EXPECT_EQ(got, want) << dtype_name(dtype) << " rows " << rows;
      // And the rounding changes something where it applies (the inputs are not representable).
      if (rows > 8) EXPECT_NE(got, product(*exact, w.view, x, rows)) << dtype_name(dtype) << " rows " << rows;
    }
  }
}

// Past the row bound CUDA's GEMM dequantizes every weight that is neither bf16 nor aligned f32
// to bf16 (gemm.cu) and reads bf16 activations: the CPU at CUDA's precision computes that
// product in f32 over both roundings (bit for bit the bf16-rounded values widened to F32 with an
// exact backend). At the bound a Q8_0 matmul keeps the CPU's int8 path, as CUDA's GEMV does.
TEST(CpuPrecision, GemmsOverDequantizedWeightsReadBf16Values) {
  auto exact = make_cpu_backend(1);
  auto gpu_like = make_cpu_backend(1, CpuPrecision{.bf16_kv = false, .gemm_above_rows = 8});
  for (DType dtype : {DType::Q8_0, DType::Q4_K, DType::F16, DType::F32}) {
    const int64_t out = 6, in = dtype == DType::F32 ? 257 : 256;  // f32: unaligned rows (1028 bytes)
    const Stored stored = store(dtype, out, in, 90);
    const WeightView w = stored.view();
    std::vector<float> rounded_w = stored.values;
    for (float& v : rounded_w) v = round_bf16(v);
    const WeightView wf = f32_view(rounded_w.data(), out, in);
    for (int64_t rows : {8, 9, 33}) {
      const std::vector<float> x = randoms(size_t(rows * in), 91 + uint32_t(rows));
      std::vector<float> rounded_x = x;
      for (float& v : rounded_x) v = round_bf16(v);
      const std::vector<float> got = product(*gpu_like, w, x, rows);
      if (rows > 8) {
        EXPECT_EQ(got, product(*exact, wf, rounded_x, rows)) << dtype_name(dtype) << " rows " << rows;
        EXPECT_NE(got, product(*exact, w, rounded_x, rows)) << dtype_name(dtype) << " rows " << rows;
      } else {
        EXPECT_EQ(got, product(*exact, w, x, rows)) << dtype_name(dtype) << " rows " << rows;
      }
    }
  }
}

// A MoE micro-batch past the bound rounds every expert matmul's input (gate/up read x, down reads
// the GLU's output) though each expert sees fewer rows; at the bound nothing is rounded.
TEST(CpuPrecision, MoeMicroBatchesPastTheBoundRoundEveryExpertInput) {
  auto exact = make_cpu_backend(1);
  auto gpu_like = make_cpu_backend(1, CpuPrecision{.bf16_kv = false, .gemm_above_rows = 8});
  const int64_t hidden = 32, inter = 16;
  const int E = 4, k = 2;
  std::vector<Matrix> mats;
  for (int e = 0; e < E; ++e)
    for (int p = 0; p < 3; ++p)
      mats.push_back(make_matrix(DType::BF16, p == 2 ? hidden : inter, p == 2 ? inter : hidden, uint32_t(10 + 3 * e + p)));
  std::vector<ExpertWeights> experts(E);
  for (int e = 0; e < E; ++e) {
    experts[size_t(e)].gate.view = mats[size_t(3 * e)].view;
    experts[size_t(e)].up.view = mats[size_t(3 * e + 1)].view;
    experts[size_t(e)].down.view = mats[size_t(3 * e + 2)].view;
  }
  for (int64_t rows : {8, 12}) {
    const std::vector<float> x = randoms(size_t(rows * hidden), 99);
    std::vector<int32_t> idx(size_t(rows * k));
    std::vector<float> wt(size_t(rows * k), 0.5f);
    for (int64_t t = 0; t < rows; ++t) idx[size_t(t * k)] = int32_t(t % E), idx[size_t(t * k + 1)] = int32_t((t + 1) % E);
    auto run = [&](Backend& be, std::vector<float> in) {
      std::vector<float> out(size_t(rows * hidden));
      be.moe_experts(experts, Mat(in.data(), rows, hidden), idx.data(), wt.data(), k, Mat(out.data(), rows, hidden));
      return out;
    };
    const std::vector<float> got = run(*gpu_like, x);
    if (rows <= 8) {
      EXPECT_EQ(got, run(*exact, x)) << "rows " << rows;
      continue;
    }
    // Past the bound: every row's experts read rounded inputs; the exact backend on rounded x
    // still differs in the down projection (its input, the GLU output, is not rounded there).
    std::vector<float> rounded = x;
    for (float& v : rounded) v = round_bf16(v);
    const std::vector<float> partly = run(*exact, rounded);
    EXPECT_NE(got, run(*exact, x));
    EXPECT_NE(got, partly);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, double(std::fabs(got[i] - partly[i])));
      scale = std::max(scale, double(std::fabs(partly[i])));
    }
    EXPECT_LT(worst, 1e-2 * scale) << "the down input's rounding is one bf16 step, not more";
  }
  // The flag does not outlive the MoE call: a dense matmul of few rows after it stays exact.
  const Matrix w = make_matrix(DType::BF16, 5, hidden, 7);
  const std::vector<float> x = randoms(size_t(2 * hidden), 5);
  EXPECT_EQ(product(*gpu_like, w.view, x, 2), product(*exact, w.view, x, 2));
}

// KV pools of `keys` positions (one sequence, blocks of 16), keys and values bf16-exact as the
// GPU's cache holds them.
struct TinyKv {
  std::vector<float> k, v;
  std::vector<int32_t> table;
  KvLayerView view;
  TinyKv(int keys, int heads, int dim, uint32_t seed) {
    const int blocks = (keys + 15) / 16;
    k = randoms(size_t(blocks * 16 * heads * dim), seed);
    v = randoms(k.size(), seed + 1);
    for (float& x : k) x = round_bf16(x);
    for (float& x : v) x = round_bf16(x);
    for (int b = 0; b < blocks; ++b) table.push_back(b);
    view.k = k.data();
    view.v = v.data();
    view.block_table = table.data();
    view.max_blocks = blocks;
    view.block_size = 16;
    view.n_kv_heads = heads;
    view.head_dim = dim;
  }
};

// Past the bound, attention rounds q to bf16 and the probabilities to bf16 against the running
// maximum of 64-key tiles (CUDA's tensor-core prefill). Within one tile the running maximum is the
// row's maximum, so a row is sum_j P_j v_j / sum_j P_j with P_j = bf16(2^((s_j - max s) log2 e)):
// computed here directly. At the bound it is the exact kernel's; over several tiles it stays
// within bf16 of it.
TEST(CpuPrecision, AttentionPastTheBoundRoundsAsTensorCoresDo) {
  auto exact = make_cpu_backend(1);
  auto gpu_like = make_cpu_backend(1, CpuPrecision{.bf16_kv = false, .gemm_above_rows = 0, .tc_attention_above_rows = 16});
  const int heads = 4, kv_heads = 2, dim = 16, group = heads / kv_heads;
  const float scale = 0.25f;
  const std::vector<float> sink_values = {0.5f, -1.f, 2.f, 0.f};
  for (bool with_sinks : {false, true}) {
    const float* sinks = with_sinks ? sink_values.data() : nullptr;
    for (int window : {0, 7}) {
      for (int rows : {16, 40}) {
        SCOPED_TRACE(::testing::Message() << "rows " << rows << " window " << window << " sinks " << (sinks != nullptr));
        // The last `rows` of 60 keys: one tile.
        TinyKv kv(60, kv_heads, dim, 21);
        std::vector<int64_t> pos(static_cast<size_t>(rows));
        for (int t = 0; t < rows; ++t) pos[size_t(t)] = 60 - rows + t;
        const std::vector<float> q = randoms(size_t(rows * heads * dim), 22);
        std::vector<float> got(q.size()), want(q.size());
        gpu_like->attention(Mat(const_cast<float*>(q.data()), rows, heads * dim), pos.data(), kv.view, heads, scale,
                            window, sinks, Mat(got.data(), rows, heads * dim));
        exact->attention(Mat(const_cast<float*>(q.data()), rows, heads * dim), pos.data(), kv.view, heads, scale,
                         window, sinks, Mat(want.data(), rows, heads * dim));
        if (rows <= 16) {
          EXPECT_EQ(got, want);
          continue;
        }
        EXPECT_NE(got, want);
        const float kLog2e = 1.4426950408889634f;
        double worst = 0;
        for (int t = 0; t < rows; ++t) {
          const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[size_t(t)] - window + 1) : 0;
          for (int h = 0; h < heads; ++h) {
            std::vector<float> qr(dim), sc;
            for (int d = 0; d < dim; ++d) qr[size_t(d)] = round_bf16(q[size_t((t * heads + h) * dim + d)]);
            float mx = -INFINITY;
            for (int64_t j = lo; j <= pos[size_t(t)]; ++j) {
              float s = 0;
              for (int d = 0; d < dim; ++d) s += qr[size_t(d)] * kv.view.k_at(0, j)[(h / group) * dim + d];
              sc.push_back(s * scale * kLog2e);
              mx = std::max(mx, sc.back());
            }
            double l = 0;
            std::vector<double> o(dim, 0.0);
            for (size_t j = 0; j < sc.size(); ++j) {
              const float p = round_bf16(std::exp2(sc[j] - mx));
              l += p;
              for (int d = 0; d < dim; ++d) o[size_t(d)] += double(p) * kv.view.v_at(0, lo + int64_t(j))[(h / group) * dim + d];
            }
            if (sinks) l += std::exp2(double(sinks[h]) * kLog2e - mx);
            for (int d = 0; d < dim; ++d)
              worst = std::max(worst, std::fabs(o[size_t(d)] / l - got[size_t((t * heads + h) * dim + d)]));
          }
        }
        EXPECT_LT(worst, 1e-5) << "the one-tile formula";
      }
    }
  }
  // 150 keys (three tiles, running maxima): within bf16 of the exact kernel, and not equal.
  TinyKv kv(150, kv_heads, dim, 31);
  const int rows = 40;
  std::vector<int64_t> pos(rows);
  for (int t = 0; t < rows; ++t) pos[size_t(t)] = 110 + t;
  const std::vector<float> q = randoms(size_t(rows * heads * dim), 32);
  std::vector<float> got(q.size()), want(q.size());
  gpu_like->attention(Mat(const_cast<float*>(q.data()), rows, heads * dim), pos.data(), kv.view, heads, scale, 0,
                      nullptr, Mat(got.data(), rows, heads * dim));
  exact->attention(Mat(const_cast<float*>(q.data()), rows, heads * dim), pos.data(), kv.view, heads, scale, 0, nullptr,
                   Mat(want.data(), rows, heads * dim));
  EXPECT_NE(got, want);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, double(std::fabs(got[i] - want[i])));
  EXPECT_LT(worst, 2e-2);
}

// MXFP4 matmuls read f32 activations under float_mxfp4 (CUDA's), the int8 ones otherwise.
TEST(CpuPrecision, FloatMxfp4ReadsF32Activations) {
  const int64_t rows = 6, cols = 64, n = 3;
  std::mt19937 rng(5);
  const testing::Mxfp4Matrix m(rows, cols, rng, 120, 130);
  const WeightView& w = m.view;
  const std::vector<float> x = randoms(size_t(n * cols), 6);
  auto gpu_like = make_cpu_backend(1, CpuPrecision{.float_mxfp4 = true});
  ThreadPool pool(1);
  std::vector<float> want(size_t(n * rows)), int8(size_t(n * rows));
  cpu::mxfp4_matmul_exact(pool, w, Mat(const_cast<float*>(x.data()), n, cols), Mat(want.data(), n, rows));
  cpu::mxfp4_matmul_int8(pool, w, Mat(const_cast<float*>(x.data()), n, cols), Mat(int8.data(), n, rows));
  const std::vector<float> got = product(*gpu_like, w, x, n);
  EXPECT_EQ(got, want);
  EXPECT_NE(got, int8);
}

// MXFP4 experts of a MoE micro-batch of at most gemm_above_rows rows read int8 activations
// under float_mxfp4 too (CUDA's MoE decode kernels quantize x and h per 32 as the CPU does):
// bit for bit the plain CPU backend's int8 path; past the bound, f32 (bf16-rounded) again.
TEST(CpuPrecision, Mxfp4MoeDecodeReadsInt8ActivationsAsCudaDoes) {
  const int64_t hidden = 64, inter = 32;
  const int n_experts = 4, k = 2;
  std::mt19937 rng(40);
  std::vector<testing::Mxfp4Matrix> mats;
  mats.reserve(size_t(3 * n_experts));
  for (int i = 0; i < 3 * n_experts; ++i)
    mats.emplace_back(i % 3 == 2 ? hidden : inter, i % 3 == 2 ? inter : hidden, rng, 120, 130);
  std::vector<ExpertWeights> experts(n_experts);
  for (int e = 0; e < n_experts; ++e) {
    experts[size_t(e)].gate.view = mats[size_t(3 * e)].view;
    experts[size_t(e)].up.view = mats[size_t(3 * e + 1)].view;
    experts[size_t(e)].down.view = mats[size_t(3 * e + 2)].view;
  }
  cpu::mxfp4_set_int8_activations(true);
  auto run = [&](const CpuPrecision& p, int64_t rows) {
    auto be = make_cpu_backend(1, p);
    std::vector<int32_t> idx(size_t(rows * k));
    for (int64_t t = 0; t < rows; ++t) idx[size_t(t * k)] = int32_t(t % 4), idx[size_t(t * k + 1)] = int32_t((t + 1) % 4);
    const std::vector<float> wts(size_t(rows * k), 0.5f);
    std::vector<float> x = randoms(size_t(rows * hidden), 7), out(size_t(rows * hidden));
    be->moe_experts(experts, Mat(x.data(), rows, hidden), idx.data(), wts.data(), k, Mat(out.data(), rows, hidden));
    return out;
  };
  const CpuPrecision cuda_like{.gemm_above_rows = 8, .float_mxfp4 = true};
  const CpuPrecision all_float{.float_mxfp4 = true};
  EXPECT_EQ(run(cuda_like, 3), run(CpuPrecision{}, 3));
  EXPECT_NE(run(cuda_like, 3), run(all_float, 3));
  // Nine rows: the GEMM's bf16 inputs into the exact f32 path, not int8.
  EXPECT_NE(run(cuda_like, 9), run(CpuPrecision{.gemm_above_rows = 8}, 9));
}

// CUDA's int8 MoE decode kernels take Q4_0, MXFP4 and Q8_0 experts whose projections share the
// format; others (here Q8_0 gate/up over an F16 down, as llama.cpp's converter writes tiny
// experts) run its f32-activation kernels. At a decode micro-batch the CPU at CUDA's precision
// then computes the Q8_0 matmuls in f32 on the dequantized weights (bit for bit the experts
// widened to F32), where all-Q8_0 experts keep the CPU's own int8 path (bit for bit the plain
// backend).
TEST(CpuPrecision, MoeDecodeOfMixedFormatsReadsF32ActivationsAsCudaDoes) {
  const int64_t hidden = 64, inter = 32;
  const int n_experts = 4, k = 2, rows = 3;
  std::vector<Stored> mats;
  for (int e = 0; e < n_experts; ++e) {
    mats.push_back(store(DType::Q8_0, inter, hidden, 50 + 3 * e));
    mats.push_back(store(DType::Q8_0, inter, hidden, 51 + 3 * e));
    mats.push_back(store(DType::F16, hidden, inter, 52 + 3 * e));
    mats.push_back(store(DType::Q8_0, hidden, inter, 52 + 3 * e));
  }
  auto experts = [&](bool mixed, bool widened) {
    std::vector<ExpertWeights> ex(n_experts);
    for (int e = 0; e < n_experts; ++e) {
      const Stored* m = &mats[size_t(4 * e)];
      auto as = [&](const Stored& st) { return widened ? st.widened() : st.view(); };
      ex[size_t(e)].gate.view = as(m[0]);
      ex[size_t(e)].up.view = as(m[1]);
      ex[size_t(e)].down.view = mixed ? as(m[2]) : as(m[3]);
    }
    return ex;
  };
  auto run = [&](const CpuPrecision& p, const std::vector<ExpertWeights>& ex) {
    auto be = make_cpu_backend(1, p);
    std::vector<int32_t> idx(size_t(rows * k));
    for (int64_t t = 0; t < rows; ++t) idx[size_t(t * k)] = int32_t(t % 4), idx[size_t(t * k + 1)] = int32_t((t + 1) % 4);
    const std::vector<float> wts(size_t(rows * k), 0.5f);
    std::vector<float> x = randoms(size_t(rows * hidden), 7), out(size_t(rows * hidden));
    be->moe_experts(ex, Mat(x.data(), rows, hidden), idx.data(), wts.data(), k, Mat(out.data(), rows, hidden));
    return out;
  };
  const CpuPrecision cuda_like{.gemm_above_rows = 8, .float_mxfp4 = true};
  EXPECT_EQ(run(cuda_like, experts(true, false)), run(CpuPrecision{}, experts(true, true)));
  EXPECT_NE(run(cuda_like, experts(true, false)), run(CpuPrecision{}, experts(true, false)));
  EXPECT_EQ(run(cuda_like, experts(false, false)), run(CpuPrecision{}, experts(false, false)));
  EXPECT_NE(run(cuda_like, experts(false, false)), run(CpuPrecision{}, experts(false, true)));
}

TEST(CpuPrecision, KvRowsAreStoredAsBf16) {
  for (bool bf16 : {false, true}) {
    auto be = make_cpu_backend(1, CpuPrecision{.bf16_kv = bf16, .gemm_above_rows = 0});
    const int heads = 2, dim = 8, block = 4;
    std::vector<float> kpool(size_t(2 * block * heads * dim), 0.f), vpool(kpool.size(), 0.f);
    const std::vector<int32_t> table = {1, 0};
    KvLayerView kv;
    kv.k = kpool.data();
    kv.v = vpool.data();
    kv.block_table = table.data();
    kv.max_blocks = 2;
    kv.block_size = block;
    kv.n_kv_heads = heads;
    kv.head_dim = dim;
    std::vector<float> k = randoms(size_t(3 * heads * dim), 3), v = randoms(size_t(3 * heads * dim), 4);
    const std::vector<int64_t> positions = {0, 5, 6};
    be->kv_write(kv, Mat(k.data(), 3, heads * dim), Mat(v.data(), 3, heads * dim), positions.data());
    for (int t = 0; t < 3; ++t) {
      for (int i = 0; i < heads * dim; ++i) {
        const float kk = k[size_t(t * heads * dim + i)], vv = v[size_t(t * heads * dim + i)];
        EXPECT_EQ(kv.k_at(0, positions[size_t(t)])[i], bf16 ? round_bf16(kk) : kk);
        EXPECT_EQ(kv.v_at(0, positions[size_t(t)])[i], bf16 ? round_bf16(vv) : vv);
      }
    }
  }
}


// Route replay: rows whose own top-k differs take the replayed experts, weighted from this
// run's probabilities (renormalized over them when asked), counted with the CPU's margin;
// calls cycle through the replay's MoE layers, each with its own row cursor.
TEST(CpuPrecision, RouteReplayImposesAnotherRunsExperts) {
  const int64_t n = 5;
  const int k = 2;
  // Rows: probabilities are softmax(logits); row 1 of layer 0 is replayed differently.
  const std::vector<float> logits = {3.f, 2.f, 1.f,  0.f, -1.f,    // own top 2: {0, 1}
                                     0.f, 1.f, 0.9f, 0.2f, -1.f,   // own {1, 2}, replayed {1, 3}
                                     -1.f, 0.f, 4.f, 3.f, 0.5f};   // own {2, 3}
  auto replay = std::make_shared<RouteReplay>();
  replay->top_k = k;
  replay->layers = {{0, 1, 3, 1, 2, 3}, {0, 1, 2, 1, 3, 2}};
  CpuPrecision p;
  p.route_replay = replay;
  auto be = make_cpu_backend(1, p);
  auto own_backend = make_cpu_backend(1);
  for (bool renormalize : {true, false}) {
    *replay = RouteReplay{.top_k = k, .layers = replay->layers};
    std::vector<int32_t> idx(6), own_idx(6);
    std::vector<float> w(6), own_w(6);
    Mat rows01(const_cast<float*>(logits.data()), 2, n), row2(const_cast<float*>(logits.data()) + 2 * n, 1, n);
    // Layer 0 rows 0-1, layer 1 rows 0-1, layer 0 row 2.
    be->router_softmax_topk(rows01, k, renormalize, idx.data(), w.data(), nullptr);
    own_backend->router_softmax_topk(rows01, k, renormalize, own_idx.data(), own_w.data(), nullptr);
    EXPECT_EQ(replay->flips, 1);
    EXPECT_EQ(std::vector<int32_t>(idx.begin(), idx.begin() + 2), std::vector<int32_t>(own_idx.begin(), own_idx.begin() + 2));
    EXPECT_EQ(w[0], own_w[0]);
    EXPECT_EQ(idx[2], 3);
    EXPECT_EQ(idx[3], 1);
    double sum = 0, e[5];
    for (int c = 0; c < n; ++c) sum += (e[c] = std::exp(double(logits[size_t(n + c)])));
    const double p1 = e[1] / sum, p3 = e[3] / sum;
    EXPECT_NEAR(w[2], renormalize ? p3 / (p1 + p3) : p3, 1e-6);
    EXPECT_NEAR(w[3], renormalize ? p1 / (p1 + p3) : p1, 1e-6);
    EXPECT_NEAR(replay->widest_flip_margin, (e[2] - e[3]) / e[1], 1e-6);  // own 2nd (expert 2) - 3rd (expert 3), over 1st
    // Layer 1 replays the CPU's own sets ({2, 1} is {1, 2}): nothing changes.
    be->router_softmax_topk(rows01, k, renormalize, idx.data(), w.data(), nullptr);
    EXPECT_EQ(replay->flips, 1);
    EXPECT_EQ(idx, own_idx);
    EXPECT_EQ(w, own_w);
    be->router_softmax_topk(row2, k, renormalize, idx.data(), w.data(), nullptr);  // layer 0, row 2: {2, 3} own
    EXPECT_EQ(replay->flips, 1);
    EXPECT_EQ(idx[0], 2);
    EXPECT_EQ(replay->cursor, (std::vector<int64_t>{3, 2}));
    EXPECT_THROW(be->router_softmax_topk(rows01, k, renormalize, idx.data(), w.data(), nullptr), Error)
        << "layer 1 holds 3 rows: 2 + 2 run past them";
  }
}

// Replayed experts from router probabilities: each routed layer's top k per token, descending,
// lower index first on ties; dense (all-zero) layers left out.
TEST(CpuPrecision, RouteReplayFromProbabilities) {
  // 3 layers x 2 tokens x 4 experts; layer 1 dense.
  const std::vector<float> probs = {0.1f, 0.4f, 0.3f, 0.2f, 0.25f, 0.25f, 0.25f, 0.25f,  //
                                    0.f,  0.f,  0.f,  0.f,  0.f,   0.f,   0.f,   0.f,    //
                                    0.7f, 0.1f, 0.1f, 0.1f, 0.f,   0.f,   0.5f,  0.5f};
  const auto r = route_replay_from_probs(probs, 3, 2, 4, 2);
  EXPECT_EQ(r->top_k, 2);
  ASSERT_EQ(r->layers.size(), 2u);
  EXPECT_EQ(r->layers[0], (std::vector<int32_t>{1, 2, 0, 1}));
  EXPECT_EQ(r->layers[1], (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_THROW(route_replay_from_probs(probs, 3, 2, 3, 2), Error);
  EXPECT_THROW(route_replay_from_probs(std::vector<float>(8, 0.f), 1, 2, 4, 2), Error);
}

// The nudge: every matmul output scaled by exactly 1 +- 2^-22, both signs present, the signs
// differing by seed and by call; seed 0 leaves the product alone.
TEST(CpuPrecision, NudgeScalesMatmulOutputsByOneUlpOfNoise) {
  const Matrix m = make_matrix(DType::BF16, 24, 32, 11);
  const std::vector<float> x = randoms(size_t(3 * 32), 12);
  auto plain = make_cpu_backend(1);
  const std::vector<float> want = product(*plain, m.view, x, 3);
  std::vector<std::vector<float>> runs;
  for (uint32_t seed : {1u, 1u, 2u}) {
    CpuPrecision p;
    p.nudge_seed = seed;
    auto be = make_cpu_backend(1, p);
    runs.push_back(product(*be, m.view, x, 3));
    if (seed == 2) runs.push_back(product(*be, m.view, x, 3));  // the second call of one backend
  }
  for (const auto& got : runs) {
    int up = 0, down = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (got[i] == want[i] * (1.f + 0x1p-22f)) {
        ++up;
      } else if (got[i] == want[i] * (1.f - 0x1p-22f)) {
        ++down;
      } else {
        ADD_FAILURE() << "element " << i << ": " << got[i] << " is not " << want[i] << " * (1 +- 2^-22)";
      }
    }
    EXPECT_GT(up, 10);
    EXPECT_GT(down, 10);
  }
  EXPECT_EQ(runs[0], runs[1]) << "one seed, one call: the same signs";
  EXPECT_NE(runs[0], runs[2]) << "another seed";
  EXPECT_NE(runs[2], runs[3]) << "another call";
  CpuPrecision zero;
  auto be = make_cpu_backend(1, zero);
  EXPECT_EQ(product(*be, m.view, x, 3), want);
}

// like_cuda() cuts prompts where CUDA does: its 2048-row micro-batches (the device tests hold
// this to the CUDA backend's preferred_prefill_batch()).
TEST(CpuPrecision, PrefillBatchIsTheBackendsPreferred) {
  EXPECT_EQ(make_cpu_backend(1)->preferred_prefill_batch(), kDefaultPrefillBatch);
  EXPECT_EQ(make_cpu_backend(1, CpuPrecision::like_cuda())->preferred_prefill_batch(), 2048);
  CpuPrecision bad;
  bad.prefill_batch = -1;
  EXPECT_THROW(make_cpu_backend(1, bad), Error);
}

}  // namespace
}  // namespace turbospark
