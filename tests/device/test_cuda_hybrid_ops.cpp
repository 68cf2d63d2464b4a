// Qwen4-Exp's hybrid ops on CUDA (causal_conv1d.cu, gated_delta_rule.cu,
// hyper_connection.cu, qsa.cu) against the CPU backend over ragged shapes, each op called
// twice in a row so that carried state (conv history, the delta rule's S, QSA's key tables)
// is checked after it moved. Outputs are NaN-poisoned first; strided outputs must keep their
// padding poisoned.
//
// Bounds (normalized error, infinite on NaN): elementwise-like ops 1e-6 (ple_gate 1e-5: its
// square root of a cancelling dot product amplifies the summation order); the delta rule 1e-5
// (f32 sums over dk in lane order, the state carried over up to 100 rows); QSA block keys
// 1e-5; selections as sets of positions per row (the scores' ties at relu 0
// resolved as torch.topk does on the CPU, ops/topk_like_torch.h; 1 row in 500 may differ where
// a dot product within ulps of zero lands on the other side of the relu); selected attention 1e-5
// (the cache holds bf16-exact values on both sides).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "backends/cuda/matmul.h"
#include "backends/cuda/ops.h"
#include "device/device_ops_util.h"
#include "device/device_util.h"
#include "ops/backend.h"

namespace turbospark::testing {
namespace {

std::string dims(std::initializer_list<int64_t> v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : " ") + std::to_string(x);
  return s;
}

// ---------------- causal_conv1d ----------------

TEST(CudaHybridOps, CausalConv1dCarriesState) {
  REQUIRE_GPU();
  for (int64_t rows : {1, 2, 5, 64, 300})
    for (int64_t ch : {1, 7, 100, 1030})
      for (int kernel : {1, 2, 4})
        for (int dilation : {1, 3})
          for (Act act : {Act::kSilu, Act::kIdentity}) {
            const int64_t span = int64_t(kernel - 1) * dilation;
            SCOPED_TRACE("rows ch kernel dilation: " + dims({rows, ch, kernel, dilation}) + " act " +
                         std::to_string(int(act)));
            const std::vector<float> w = random_floats(size_t(ch * kernel), 5, -1.f, 1.f);
            DeviceBuffer<float> dw(w);
            Strided state(span, ch, 2, 6);
            for (int call = 0; call < 2; ++call) {
              Strided in(rows, ch, 3, uint32_t(7 + call), -2.f, 2.f);
              Strided out(rows, ch, 1, 8);
              out.poison();
              cpu().causal_conv1d(in.h(), w.data(), kernel, dilation, state.h(), act, out.h());
              cuda::causal_conv1d(in.d(), dw.get(), kernel, dilation, state.d(), act, out.d(), stream());
              EXPECT_LT(normalized_error(out.dev_dense(), out.host_dense()), 1e-6) << "call " << call;
              EXPECT_TRUE(out.dev_pads_poisoned());
              if (span > 0) {
                EXPECT_LT(normalized_error(state.dev_dense(), state.host_dense()), 1e-6) << "state, call " << call;
              }
            }
          }
}

// ---------------- gated_delta_rule ----------------

TEST(CudaHybridOps, GatedDeltaRuleMatchesCpuAcrossCalls) {
  REQUIRE_GPU();
  struct Heads {
    int nk, nv, dk, dv;
  };
  for (const Heads& hd : {Heads{1, 1, 8, 8}, Heads{2, 4, 8, 8}, Heads{1, 2, 16, 24}, Heads{4, 8, 32, 32},
                          Heads{2, 4, 128, 128}, Heads{1, 1, 200, 40}, Heads{2, 2, 256, 64}, Heads{1, 3, 5, 33}})
    for (int64_t rows : {1, 3, 17, 100})
      for (cuda::GdnForm form : {cuda::GdnForm::kRecurrent, cuda::GdnForm::kChunked})
        for (bool tiled : {false, true}) {
      if (tiled && (hd.nk == 1 || hd.nk == hd.nv)) continue;  // the same order either way
      SCOPED_TRACE("nk nv dk dv rows: " + dims({hd.nk, hd.nv, hd.dk, hd.dv, rows}) + " form " + std::to_string(int(form)) +
                   (tiled ? " tiled" : ""));
      // The chunked form's triangular solve compounds rounding over a chunk (measured on the CPU
      // reference: 9.4e-6 at chunk 64, tests/unit/test_gated_delta_chunked.cpp).
      const double bound = form == cuda::GdnForm::kChunked ? 5e-5 : 1e-5;
      const int64_t key_dim = int64_t(hd.nk) * hd.dk, width = 2 * key_dim + int64_t(hd.nv) * hd.dv;
      const std::vector<float> a_log = random_floats(size_t(hd.nv), 11, -1.f, 1.f);
      const std::vector<float> dt_bias = random_floats(size_t(hd.nv), 12, -0.5f, 0.5f);
      DeviceBuffer<float> da_log(a_log), ddt(dt_bias);
      Strided state(hd.nv, int64_t(hd.dk) * hd.dv, 0, 13, -0.5f, 0.5f);
      for (int call = 0; call < 2; ++call) {
        Strided qkv(rows, width, 5, uint32_t(14 + call), -1.f, 1.f);
        // a spans softplus's linear regime (> 20) too; b both signs.
        Strided a(rows, hd.nv, 1, uint32_t(16 + call), -4.f, 24.f);
        Strided b(rows, hd.nv, 0, uint32_t(18 + call), -3.f, 3.f);
        Strided out(rows, int64_t(hd.nv) * hd.dv, 2, 20);
        out.poison();
        cpu().gated_delta_rule(qkv.h(), a.h(), b.h(), a_log.data(), dt_bias.data(), hd.nk, hd.nv, hd.dk, hd.dv,
                               tiled, state.h(), out.h());
        cuda::gated_delta_rule(qkv.d(), a.d(), b.d(), da_log.get(), ddt.get(), hd.nk, hd.nv, hd.dk, hd.dv, tiled,
                               state.d(), out.d(), stream(), form);
        EXPECT_LT(normalized_error(out.dev_dense(), out.host_dense()), bound) << "call " << call;
        EXPECT_TRUE(out.dev_pads_poisoned());
        EXPECT_LT(normalized_error(state.dev_dense(), state.host_dense()), bound) << "state, call " << call;
      }
    }
}

// Feeding a prompt in pieces or all at once leaves the same outputs and state: the recurrent
// kernel is chunk-invariant up to f32 rounding, and the chunked form (chunks of 64, 32 or 16
// rows of the call, the last one ragged) agrees with it within its solve's rounding.
TEST(CudaHybridOps, GatedDeltaRuleIsChunkInvariant) {
  REQUIRE_GPU();
  const int nk = 2, nv = 4;
  for (int d : {64, 128}) {
    const int dk = d, dv = d;
    const int64_t rows = 137, width = 2 * int64_t(nk) * dk + int64_t(nv) * dv;
    const std::vector<float> a_log = random_floats(nv, 21), dt_bias = random_floats(nv, 22);
    DeviceBuffer<float> da_log(a_log), ddt(dt_bias);
    Strided qkv(rows, width, 0, 23), a(rows, nv, 0, 24), b(rows, nv, 0, 25);
    auto run = [&](cuda::GdnForm form, int64_t piece, Strided& state, Strided& out) {
      out.poison();  // a row no piece writes stays NaN and fails the comparison
      for (int64_t t = 0; t < rows; t += piece) {
        const int64_t m = std::min<int64_t>(piece, rows - t);
        cuda::gated_delta_rule(qkv.d().rows_slice(t, m), a.d().rows_slice(t, m), b.d().rows_slice(t, m), da_log.get(),
                               ddt.get(), nk, nv, dk, dv, false, state.d(), out.d().rows_slice(t, m), stream(),
                               form);
      }
    };
    Strided s_whole(nv, int64_t(dk) * dv, 0, 26), s_steps(nv, int64_t(dk) * dv, 0, 26);
    Strided s_chunked(nv, int64_t(dk) * dv, 0, 26), s_pieces(nv, int64_t(dk) * dv, 0, 26);
    Strided whole(rows, int64_t(nv) * dv, 0, 27), steps(rows, int64_t(nv) * dv, 0, 27);
    Strided chunked(rows, int64_t(nv) * dv, 0, 27), pieces(rows, int64_t(nv) * dv, 0, 27);
    run(cuda::GdnForm::kRecurrent, rows, s_whole, whole);
    run(cuda::GdnForm::kRecurrent, 5, s_steps, steps);
    run(cuda::GdnForm::kChunked, rows, s_chunked, chunked);
    run(cuda::GdnForm::kChunked, 70, s_pieces, pieces);
    SCOPED_TRACE("head dim " + std::to_string(d));
    EXPECT_LT(normalized_error(steps.dev_dense(), whole.dev_dense()), 1e-6);
    EXPECT_LT(normalized_error(s_steps.dev_dense(), s_whole.dev_dense()), 1e-6);
    EXPECT_LT(normalized_error(chunked.dev_dense(), whole.dev_dense()), 5e-5);
    EXPECT_LT(normalized_error(s_chunked.dev_dense(), s_whole.dev_dense()), 5e-5);
    EXPECT_LT(normalized_error(pieces.dev_dense(), whole.dev_dense()), 5e-5);
    EXPECT_LT(normalized_error(s_pieces.dev_dense(), s_whole.dev_dense()), 5e-5);
  }
}

TEST(CudaHybridOps, GatedDeltaRuleRefusesWhatItCannotHold) {
  REQUIRE_GPU();
  DeviceBuffer<float> buf(size_t(1) << 20);
  Mat m(buf.get(), 1, 4096);
  EXPECT_THROW(cuda::gated_delta_rule(m, m, m, buf.get(), buf.get(), 1, 1, 300, 8, false, Mat(buf.get(), 1, 2400), m,
                                      stream()),
               Error);
  EXPECT_THROW(cuda::gated_delta_rule(m, m, m, buf.get(), buf.get(), 2, 3, 8, 8, false, Mat(buf.get(), 3, 64), m,
                                      stream()),
               Error);
}

// ---------------- hc_mix, hc_inject, ple_gate ----------------

TEST(CudaHybridOps, HyperConnectionMixInjectAndPleGate) {
  REQUIRE_GPU();
  for (int64_t rows : {1, 5, 64})
    for (int64_t H : {1, 7, 32, 1030})
      for (int C : {1, 2, 4}) {
        SCOPED_TRACE("rows H C: " + dims({rows, H, C}));
        Strided weight(rows, C * H, 3, 31), normed(rows, C * H, 1, 32);
        Strided mixed(rows, H, 2, 33);
        mixed.poison();
        cpu().hc_mix(weight.h(), normed.h(), C, mixed.h());
        cuda::hc_mix(weight.d(), normed.d(), C, mixed.d(), stream());
        EXPECT_LT(normalized_error(mixed.dev_dense(), mixed.host_dense()), 1e-6) << "hc_mix";
        EXPECT_TRUE(mixed.dev_pads_poisoned());

        Strided streams(rows, C * H, 1, 34), branch(rows, H, 0, 35), inject(rows, C, 2, 36);
        cpu().hc_inject(streams.h(), branch.h(), inject.h(), C);
        cuda::hc_inject(streams.d(), branch.d(), inject.d(), C, stream());
        EXPECT_LT(normalized_error(streams.dev_dense(), streams.host_dense()), 1e-6) << "hc_inject";

        // hc_inject_gated: the shared expert scaled in place, added to branch, the sum injected;
        // all three outputs against the CPU's mul_act, add and hc_inject.
        Strided shared(rows, H, 1, 41), sgate(rows, 1, 2, 42, -4.f, 4.f);
        cpu().hc_inject_gated(streams.h(), branch.h(), shared.h(), sgate.h(), inject.h(), C);
        cuda::hc_inject_gated(streams.d(), branch.d(), shared.d(), sgate.d(), inject.d(), C, stream());
        EXPECT_LT(normalized_error(shared.dev_dense(), shared.host_dense()), 1e-6) << "hc_inject_gated shared";
        EXPECT_LT(normalized_error(branch.dev_dense(), branch.host_dense()), 1e-6) << "hc_inject_gated branch";
        EXPECT_LT(normalized_error(streams.dev_dense(), streams.host_dense()), 1e-6) << "hc_inject_gated streams";

        // Scaled keys: some gates near 0 (the sqrt(max(|g|, 1e-6)) floor), some large.
        Strided key(rows, C * H, 1, 37, -3.f, 3.f), query(rows, C * H, 0, 38, -3.f, 3.f), value(rows, H, 2, 39);
        Strided out(rows, C * H, 3, 40);
        out.poison();
        cpu().ple_gate(key.h(), query.h(), value.h(), C, out.h());
        cuda::ple_gate(key.d(), query.d(), value.d(), C, out.d(), stream());
        // The gate is sign(g) sqrt(|g|) of an H-term dot product summed in another order: where
        // the terms cancel (H = 1030) its relative error reaches ~1e-5 and passes into the output.
        EXPECT_LT(normalized_error(out.dev_dense(), out.host_dense()), 1e-5) << "ple_gate";
        EXPECT_TRUE(out.dev_pads_poisoned());
      }
}

// ---------------- qsa_select ----------------

struct QsaCase {
  int n_heads, head_dim, rotary_dim, ratio, block_topk;
  int64_t context;
  int chunk;
  std::string name() const {
    return "heads " + std::to_string(n_heads) + " dim " + std::to_string(head_dim) + " rotary " +
           std::to_string(rotary_dim) + " ratio " + std::to_string(ratio) + " top " + std::to_string(block_topk) +
           " context " + std::to_string(context) + " chunk " + std::to_string(chunk);
  }
};

// Feeds `context` positions in micro-batches of `chunk` rows to both backends and compares
// each micro-batch's selections (as sets per row, with their counts) and the key tables.
// Counts the rows that had more complete blocks than they keep (where the top-k decided) and
// those whose selected set differs between the backends. The GPU also selects every
// micro-batch a second time through the serial torch.topk emulation alone: on the same scores
// the threshold path must pick exactly its sets (`threshold` counts the rows it picked).
struct QsaCounts {
  int decided = 0, differ = 0, threshold = 0;
};
QsaCounts run_qsa(const QsaCase& c, cuda::QsaScores scores) {
  cuda::DeviceScratch spill;
  const int d = c.head_dim;
  const int max_sel = c.block_topk * c.ratio + c.ratio - 1;
  const int64_t n_blocks = c.context / c.ratio + 1;
  Strided raw_table(c.context, d, 0, 41), block_table(n_blocks, d, 1, 42);
  raw_table.poison();
  block_table.poison();
  std::fill(raw_table.host.begin(), raw_table.host.end(), NAN);
  std::fill(block_table.host.begin(), block_table.host.end(), NAN);
  const std::vector<float> k_norm = random_floats(size_t(d), 43, -0.5f, 0.5f);
  std::vector<float> inv_freq(size_t(c.rotary_dim / 2));
  for (int i = 0; i < c.rotary_dim / 2; ++i) inv_freq[size_t(i)] = std::pow(10000.f, -2.f * float(i) / float(c.rotary_dim));
  DeviceBuffer<float> dk_norm(k_norm), dinv(inv_freq);
  QsaView hv, dv;
  hv.raw_keys = raw_table.h();
  hv.block_keys = block_table.h();
  hv.k_norm = k_norm.data();
  hv.inv_freq = inv_freq.data();
  hv.rotary_dim = c.rotary_dim;
  hv.ratio = c.ratio;
  hv.block_topk = c.block_topk;
  hv.n_heads = c.n_heads;
  hv.head_dim = d;
  dv = hv;
  dv.raw_keys = raw_table.d();
  dv.block_keys = block_table.d();
  dv.k_norm = dk_norm.get();
  dv.inv_freq = dinv.get();
  QsaCounts n;
  for (int64_t start = 0; start < c.context; start += c.chunk) {
    const int64_t m = std::min<int64_t>(c.chunk, c.context - start);
    SCOPED_TRACE("rows from " + std::to_string(start));
    // One index head: about half the key blocks score exactly 0 (every dot negative), so ties
    // at the cutoff are the rule, not the exception.
    Strided iq(m, int64_t(c.n_heads) * d, 2, uint32_t(44 + start), -1.f, 1.f);
    Strided ik(m, d, 1, uint32_t(45 + start), -1.f, 1.f);
    std::vector<int64_t> pos(static_cast<size_t>(m));
    for (int64_t t = 0; t < m; ++t) pos[size_t(t)] = start + t;
    DeviceBuffer<int64_t> dpos(pos);
    std::vector<int32_t> sel(size_t(m * max_sel), -7), counts(size_t(m), -7);
    DeviceBuffer<int32_t> dsel(sel), dcounts(counts), serial_sel(sel), serial_counts(counts);
    DeviceBuffer<int32_t> threshold_rows(std::vector<int32_t>{0});
    cpu().qsa_select(hv, iq.h(), ik.h(), pos.data(), sel.data(), counts.data(), max_sel);
    cuda::qsa_select(dv, iq.d(), ik.d(), dpos.get(), dsel.get(), dcounts.get(), max_sel, stream(), &spill, scores,
                     cuda::QsaTopK::kAuto, threshold_rows.get());
    // Again through the emulation alone (storing and pooling the same keys a second time is
    // idempotent).
    cuda::qsa_select(dv, iq.d(), ik.d(), dpos.get(), serial_sel.get(), serial_counts.get(), max_sel, stream(), &spill,
                     scores, cuda::QsaTopK::kSerial);
    sync();
    const std::vector<int32_t> got_sel = dsel.download(), got_counts = dcounts.download();
    const std::vector<int32_t> ser_sel = serial_sel.download(), ser_counts = serial_counts.download();
    n.threshold += threshold_rows.download()[0];
    // Row t's selection as a sorted set.
    auto row_set = [&](const std::vector<int32_t>& all, int64_t t, int32_t count) {
      std::vector<int32_t> v(all.begin() + t * max_sel, all.begin() + t * max_sel + count);
      std::sort(v.begin(), v.end());
      return v;
    };
    for (int64_t t = 0; t < m; ++t) {
      EXPECT_EQ(got_counts[size_t(t)], ser_counts[size_t(t)]) << "row " << start + t;
      if (got_counts[size_t(t)] != ser_counts[size_t(t)]) continue;
      EXPECT_EQ(row_set(got_sel, t, got_counts[size_t(t)]), row_set(ser_sel, t, ser_counts[size_t(t)]))
          << "row " << start + t << ": the threshold path and the emulation picked other blocks";
    }
    for (int64_t t = 0; t < m; ++t) {
      EXPECT_EQ(got_counts[size_t(t)], counts[size_t(t)]) << "row " << start + t;
      if (got_counts[size_t(t)] != counts[size_t(t)]) continue;
      n.differ += row_set(got_sel, t, counts[size_t(t)]) != row_set(sel, t, counts[size_t(t)]);
      n.decided += (start + t + 1) / c.ratio > c.block_topk;
    }
  }
  // Every written row of both tables (the rest stays NaN / poisoned on both sides).
  const int64_t complete = c.context / c.ratio;
  const std::vector<float> got_raw = raw_table.dev_dense(), want_raw = raw_table.host_dense();
  EXPECT_EQ(got_raw, want_raw);
  const std::vector<float> got_blocks = block_table.dev_dense(), want_blocks = block_table.host_dense();
  EXPECT_LT(normalized_error(got_blocks.data(), want_blocks.data(), size_t(complete * d)), 1e-5);
  return n;
}

TEST(CudaHybridOps, QsaSelectMatchesCpuTiesIncluded) {
  REQUIRE_GPU();
  QsaCounts n;
  for (const QsaCase& c : {QsaCase{1, 16, 8, 4, 2, 40, 1}, QsaCase{1, 16, 8, 4, 2, 40, 3},
                           QsaCase{1, 16, 8, 4, 2, 40, 40}, QsaCase{2, 16, 16, 8, 2, 100, 7},
                           QsaCase{4, 64, 32, 4, 3, 300, 64}, QsaCase{1, 32, 32, 1, 5, 200, 17},
                           QsaCase{2, 128, 64, 16, 4, 1000, 250}, QsaCase{1, 16, 16, 2, 1, 700, 700},
                           // A budget near the count of positive blocks: the cutoff falls in the
                           // zeros' tie for most rows.
                           QsaCase{1, 16, 16, 2, 40, 200, 5}}) {
    // Scores in shared memory, spilled to global memory (long contexts) and scored across the
    // GPU (steps of a few rows) select alike.
    for (cuda::QsaScores scores : {cuda::QsaScores::kShared, cuda::QsaScores::kGlobal, cuda::QsaScores::kSplit}) {
      SCOPED_TRACE(c.name() + (scores == cuda::QsaScores::kGlobal  ? " (scores in global memory)"
                               : scores == cuda::QsaScores::kSplit ? " (split scoring)"
                                                                   : ""));
      const QsaCounts one = run_qsa(c, scores);
      n.decided += one.decided;
      n.differ += one.differ;
      n.threshold += one.threshold;
    }
  }
  EXPECT_GT(n.decided, 1000);  // rows whose selection the top-k (not "keep every block") decided
  // Both ways of picking ran often: the threshold path (no tie at the cutoff: several index
  // heads) and the emulation (ties at relu 0: one index head).
  EXPECT_GT(n.threshold, 300);
  EXPECT_GT(n.decided - n.threshold, 150);
  // The block keys and dot products differ by ulps between the backends, so a relu'd dot within
  // ~1e-7 of zero may land on the other side and legitimately change a tie: allowed in 1 row of
  // 500. A tie broken the wrong way is systematic: it changes a large share of the rows.
  EXPECT_LE(n.differ, n.decided / 500) << n.differ << " of " << n.decided << " rows selected other blocks";
  std::printf("[ measured ] QSA selections differing from the CPU: %d of %d decided rows (%d by threshold)\n", n.differ,
              n.decided, n.threshold);
}

// A NaN in a query row's index q makes its block scores NaN: the flag goes up (and stays 0 for
// clean rows), so the model can name the layer after the step.
TEST(CudaHybridOps, QsaSelectFlagsNanScores) {
  REQUIRE_GPU();
  const int d = 16, ratio = 4, context = 12;
  cuda::DeviceScratch spill;
  for (bool poison : {false, true})
    for (cuda::QsaScores scores : {cuda::QsaScores::kShared, cuda::QsaScores::kSplit}) {
    Strided raw_table(context, d, 0, 61), block_table(context / ratio + 1, d, 0, 62);
    const std::vector<float> k_norm = random_floats(d, 63), inv_freq = random_floats(d / 2, 64, 0.f, 1.f);
    DeviceBuffer<float> dk_norm(k_norm), dinv(inv_freq);
    DeviceBuffer<int32_t> flag(std::vector<int32_t>{0});
    QsaView v;
    v.raw_keys = raw_table.d();
    v.block_keys = block_table.d();
    v.k_norm = dk_norm.get();
    v.inv_freq = dinv.get();
    v.rotary_dim = d;
    v.ratio = ratio;
    v.block_topk = 1;
    v.n_heads = 1;
    v.head_dim = d;
    v.nan_score = flag.get();
    Strided iq(context, d, 0, 65), ik(context, d, 0, 66);
    if (poison) {
      iq.host[size_t(10 * d + 3)] = NAN;  // row 10 sees two complete blocks
      iq.upload();
    }
    std::vector<int64_t> pos(static_cast<size_t>(context));
    std::iota(pos.begin(), pos.end(), 0);
    DeviceBuffer<int64_t> dpos(pos);
    DeviceBuffer<int32_t> sel(static_cast<size_t>(context * (ratio + ratio - 1)));
    DeviceBuffer<int32_t> counts(static_cast<size_t>(context));
    cuda::qsa_select(v, iq.d(), ik.d(), dpos.get(), sel.get(), counts.get(), ratio + ratio - 1, stream(), &spill,
                     scores);
    sync();
    EXPECT_EQ(flag.download()[0], poison ? 1 : 0)
        << "poisoned " << poison << (scores == cuda::QsaScores::kSplit ? " (split scoring)" : "");
  }
}

// ---------------- attention_selected ----------------

TEST(CudaHybridOps, AttentionOverSelectedPositions) {
  REQUIRE_GPU();
  struct Case {
    int n_heads, n_kv_heads, head_dim, max_selected;
    int64_t rows, context;
    int n_seqs;
  };
  // Rows up to 16 with more than 64 selected take the split path when given scratch: every case
  // runs with and without it. The last case is the Flash-Next decode shape (head dim 256,
  // 2063 positions: 128 blocks of 16 and the tail).
  for (const Case& c : {Case{4, 2, 16, 11, 5, 40, 1}, Case{8, 1, 64, 40, 17, 300, 1}, Case{2, 2, 128, 2111, 3, 3000, 1},
                        Case{16, 4, 256, 70, 9, 500, 3}, Case{3, 1, 80, 1, 4, 50, 2}, Case{4, 2, 32, 129, 16, 400, 2},
                        Case{16, 2, 256, 2063, 1, 4100, 1}}) {
    SCOPED_TRACE("heads " + dims({c.n_heads, c.n_kv_heads, c.head_dim, c.max_selected, c.rows, c.context, c.n_seqs}));
    PagedCache cache(c.n_seqs, c.context, c.n_kv_heads, c.head_dim, uint32_t(51 + c.head_dim));
    std::vector<int32_t> seq(size_t(c.rows));
    std::vector<int32_t> sel(size_t(c.rows * c.max_selected), 0), counts(size_t(c.rows));
    std::mt19937 rng(52);
    for (int64_t t = 0; t < c.rows; ++t) {
      seq[size_t(t)] = int32_t(t % c.n_seqs);
      const int64_t p = c.context - 1 - t;  // the row's own position
      // A random subset of [0, p] in random order, of 1..max_selected positions (the last
      // rows take the full selection).
      std::vector<int32_t> all(size_t(p + 1));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      const int64_t n = t == c.rows - 1 ? std::min<int64_t>(c.max_selected, p + 1)
                                        : 1 + int64_t(rng() % uint32_t(std::min<int64_t>(c.max_selected, p + 1)));
      std::copy_n(all.begin(), n, sel.begin() + t * c.max_selected);
      counts[size_t(t)] = int32_t(n);
    }
    DeviceBuffer<int32_t> dsel(sel), dcounts(counts), dseq(seq);
    const int64_t width = int64_t(c.n_heads) * c.head_dim;
    Strided q(c.rows, width, 3, 53, -2.f, 2.f), out(c.rows, width, 1, 54);
    out.poison();
    const float scale = 1.f / std::sqrt(float(c.head_dim));
    cpu().attention_selected(q.h(), cache.host_view(c.n_seqs > 1 ? seq.data() : nullptr), c.n_heads, scale, sel.data(),
                             counts.data(), c.max_selected, out.h());
    const int64_t floats = cuda::attention_selected_scratch_floats(c.rows, c.n_heads, c.head_dim, c.max_selected);
    EXPECT_EQ(floats > 0, c.rows <= 16);
    DeviceBuffer<float> scratch(static_cast<size_t>(std::max<int64_t>(floats, 1)));
    for (bool split : {false, true}) {
      out.poison();
      cuda::attention_selected(q.d(), cache.device_view(c.n_seqs > 1 ? dseq.get() : nullptr), c.n_heads, scale,
                               dsel.get(), dcounts.get(), c.max_selected, out.d(), stream(),
                               split ? scratch.get() : nullptr, split ? floats : 0);
      EXPECT_LT(normalized_error(out.dev_dense(), out.host_dense()), 1e-5) << "split " << split;
      EXPECT_TRUE(out.dev_pads_poisoned()) << "split " << split;
    }
  }
}

}  // namespace
}  // namespace turbospark::testing
