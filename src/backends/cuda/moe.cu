// Routed experts: out[t] = sum_j weight[t, j] * expert_{idx[t, j]}(x[t]), where each expert is
// a gated FFN down(glu(gate x + gb, up x + ub)) + db and glu is SiLU(g) * u, GELU-tanh(g) * u,
// or gpt-oss's clamped GLU. idx/weight [rows, k] stay in device memory: kernels read expert
// ids there and find each expert's planes in a device-side descriptor table (one per expert
// vector, uploaded at its first use).
//
// This file: the descriptor table (WeightMatmul::moe_table), the switches that pick kernels
// (moe_int8_activations, moe_gate_up_rows_per_warp, moe_down_split, moe_unit_*,
// moe_small_groups) and moe_experts, which checks the call and hands it (moe::MoeCall) to the
// decode kernels' launchers (moe_decode.cu, up to kMoeDecodeMaxRows rows) or the prefill
// ones' (moe_prefill.cu); moe_common.cuh holds what those files share.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "backends/cuda/matmul.h"
#include "backends/cuda/moe_common.cuh"
#include "backends/cuda/q8.cuh"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda {

using moe::Glu;
using moe::kSmallCols;
using moe::kSmallK;
using moe::MoeCall;
using moe::MoeExpertDesc;
using moe::MoeParams;
using moe::round_up;
using moe::small_smem_bytes;

namespace {

bool vec_aligned(const WeightView& w) {
  return reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && w.row_bytes % 16 == 0;
}

bool same_format(const WeightView& a, const WeightView& b) {
  return a.dtype == b.dtype && a.rows == b.rows && a.cols == b.cols && a.scales_dtype == b.scales_dtype &&
         a.group_size == b.group_size;
}

}  // namespace

const WeightMatmul::MoeTable& WeightMatmul::moe_table(const std::vector<ExpertWeights>& experts,
                                                      cudaStream_t stream) {
  std::vector<MoeExpertDesc> descs(experts.size());
  for (size_t e = 0; e < experts.size(); ++e) {
    const ExpertWeights& x = experts[e];
    descs[e] = {device_weight(x.gate.view), device_weight(x.up.view), device_weight(x.down.view),
                x.gate_bias, x.up_bias, x.down_bias};
  }
  const size_t bytes = descs.size() * sizeof(MoeExpertDesc);
  MoeTable& table = moe_tables_[{static_cast<const void*>(experts.data()), experts.size()}];
  if (table.host.size() == bytes && std::memcmp(table.host.data(), descs.data(), bytes) == 0) return table;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TS_CUDA_CHECK(cudaStreamIsCapturing(stream, &status), "moe_experts table");
  TS_CHECK(status == cudaStreamCaptureStatusNone,
           "moe_experts: the descriptor table of {} experts is new or changed while a graph is being captured: run "
           "the layer once before capture",
           experts.size());
  if (!table.device) TS_CUDA_CHECK(cudaMalloc(&table.device, bytes), "moe_experts table of {} bytes", bytes);
  table.host.assign(reinterpret_cast<const unsigned char*>(descs.data()),
                    reinterpret_cast<const unsigned char*>(descs.data()) + bytes);
  // Stream-ordered after any queued kernel still reading the old table; the source stays
  // alive in table.host.
  TS_CUDA_CHECK(cudaMemcpyAsync(table.device, table.host.data(), bytes, cudaMemcpyHostToDevice, stream),
                "moe_experts table upload ({} bytes)", bytes);
  return table;
}

bool moe_int8_activations(const ExpertWeights& e0, int64_t rows, int k) {
  const int64_t hidden = e0.gate.view.cols, inter = e0.gate.view.rows;
  const DType t = e0.gate.view.dtype;
  const bool format = (t == DType::Q4_0 || t == DType::MXFP4 || t == DType::Q8_0) && e0.down.view.dtype == t;
  return rows >= 1 && rows <= kMoeDecodeMaxRows && q4_dp4a_enabled() && format && hidden % 32 == 0 &&
         inter % 32 == 0 && k <= kWarp && q8x32_bytes(1, hidden) <= kQ8SmemMax;
}

namespace {

// An override from the environment ("0" / "1"), read at every call so tests can run both ways:
// -1 when unset.
int env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  const std::string_view s(v);
  TS_CHECK(s == "0" || s == "1", "{} must be 0 or 1, got '{}'", name, s);
  return s == "1";
}

}  // namespace

int moe_gate_up_rows_per_warp(int64_t n_pairs, int64_t inter) {
  // TURBOSPARK_CUDA_MOE_WIDE_WARPS: 1 = four rows a warp, 0 = two; unset = four only where two
  // would spill the 16-warp blocks (two an SM) into a second, partial wave that the 8-warp
  // blocks (three an SM) avoid.
  if (const int forced = env_switch("TURBOSPARK_CUDA_MOE_WIDE_WARPS"); forced >= 0) return forced ? 4 : 2;
  static const int64_t sms = [] {
    int device = 0, n = 0;
    TS_CUDA_CHECK(cudaGetDevice(&device), "moe: cudaGetDevice");
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "moe: SM count");
    return int64_t(n);
  }();
  const int64_t blocks = inter / 32 * n_pairs;
  return blocks > 2 * sms && blocks <= 3 * sms ? 4 : 2;
}

bool moe_down_split(int64_t inter) {
  // TURBOSPARK_CUDA_MOE_DOWN_SPLIT: 1 / 0 forces; unset = experts of at least 32 blocks a row.
  if (const int forced = env_switch("TURBOSPARK_CUDA_MOE_DOWN_SPLIT"); forced >= 0) return forced;
  return inter >= 32 * 32;
}

int moe_unit_gate_up_rows_per_warp() {
  // The same switch as the int8 kernels': 1 = two rows a warp, 0 = one; unset = two.
  const int forced = env_switch("TURBOSPARK_CUDA_MOE_WIDE_WARPS");
  return forced == 0 ? 1 : 2;
}

bool moe_unit_down_split() {
  // The same switch as the int8 kernels': 1 / 0 forces; unset = split.
  return env_switch("TURBOSPARK_CUDA_MOE_DOWN_SPLIT") != 0;
}

bool moe_small_groups(int64_t n_pairs, int64_t n_experts, int64_t hidden, int64_t inter) {
  if (hidden % kSmallK != 0 || inter % kSmallK != 0) return false;
  if (std::max(small_smem_bytes(true, hidden), small_smem_bytes(false, inter)) > 200 * 1024) return false;
  // TURBOSPARK_CUDA_MOE_SMALL: 1 = always (where the shape allows), 0 = never; unset = while the
  // step averages at most 8 rows an expert. Read at every call so tests can run both.
  // Measured (H100, Q4_0 30B-A3B, serve_bench at concurrency 16 / 64, llama-server 409.8 / 473.0
  // in the same call): 671.6 / 985.6 out tok/s with it; 488.4 / 907.5 with the tiles (another
  // H100 call, llama-server 370.7 / 444.3 there). Without the passes spread over blocks, 64
  // sequences decoding the same token (every pair on 8 experts) took 54.5 ms a step against
  // the tiles' 13.3.
  if (const int forced = env_switch("TURBOSPARK_CUDA_MOE_SMALL"); forced >= 0) return forced;
  return n_pairs <= kSmallCols * n_experts;
}

void WeightMatmul::moe_experts(const std::vector<ExpertWeights>& experts, const Mat& x, const int32_t* idx,
                               const float* weight, int k, const Mat& out, cudaStream_t stream,
                               std::span<const MoeBank> banks) {
  TS_CHECK(!experts.empty() && k >= 1, "moe_experts: {} experts, top-k {}", experts.size(), k);
  const ExpertWeights& e0 = experts[0];
  const int64_t hidden = e0.gate.view.cols, inter = e0.gate.view.rows;
  TS_CHECK(x.cols == hidden && out.cols == hidden && out.rows == x.rows,
           "moe_experts: x [{}, {}] and out [{}, {}] for experts of hidden {}", x.rows, x.cols, out.rows, out.cols,
           hidden);
  TS_CHECK(e0.act == Act::kSilu || e0.act == Act::kGeluTanh || e0.glu_limit > 0,
           "moe_experts: expert activation {} is not SiLU, GELU-tanh or the clamped GLU", int(e0.act));
  for (size_t e = 0; e < experts.size(); ++e) {
    const ExpertWeights& w = experts[e];
    TS_CHECK(same_format(w.gate.view, e0.gate.view) && same_format(w.up.view, e0.gate.view) &&
                 same_format(w.down.view, e0.down.view) && w.down.view.rows == hidden && w.down.view.cols == inter,
             "moe_experts: expert {} ({} gate [{}, {}], {} up [{}, {}], {} down [{}, {}]) differs from expert 0 "
             "({} [{}, {}] gate/up, {} down)",
             e, dtype_name(w.gate.view.dtype), w.gate.view.rows, w.gate.view.cols, dtype_name(w.up.view.dtype),
             w.up.view.rows, w.up.view.cols, dtype_name(w.down.view.dtype), w.down.view.rows, w.down.view.cols,
             dtype_name(e0.gate.view.dtype), inter, hidden, dtype_name(e0.down.view.dtype));
    TS_CHECK(w.act == e0.act && w.glu_limit == e0.glu_limit && w.glu_alpha == e0.glu_alpha,
             "moe_experts: expert {} has another activation than expert 0", e);
    check_weight(w.gate.view, "moe_experts gate");
    check_weight(w.up.view, "moe_experts up");
    check_weight(w.down.view, "moe_experts down");
  }
  for (size_t b = 0; b < banks.size(); ++b)
    TS_CHECK(banks[b].expert_end > (b ? banks[b - 1].expert_end : 0) && banks[b].pairs >= 0 &&
                 (b + 1 < banks.size() || size_t(banks[b].expert_end) == experts.size()),
             "moe_experts: bank {} ends at expert {} (of {}, after {})", b, banks[b].expert_end, experts.size(),
             b ? banks[b - 1].expert_end : 0);
  if (x.rows == 0) return;
  bool gate_up_vec = true, down_vec = true;
  for (const ExpertWeights& w : experts) {
    gate_up_vec = gate_up_vec && vec_aligned(w.gate.view) && vec_aligned(w.up.view);
    down_vec = down_vec && vec_aligned(w.down.view);
  }

  const MoeTable& table = moe_table(experts, stream);
  const auto* descs = static_cast<const MoeExpertDesc*>(table.device);
  MoeParams p;
  p.n_experts = int32_t(experts.size());
  p.k = k;
  p.hidden = hidden;
  p.inter = inter;
  p.glu = e0.glu_limit > 0 ? Glu::kClamped : e0.act == Act::kSilu ? Glu::kSilu : Glu::kGeluTanh;
  p.glu_alpha = e0.glu_alpha;
  p.glu_limit = e0.glu_limit;
  const int64_t rows = x.rows, n_pairs = rows * k;
  const MoeCall call{.experts = experts, .e0 = e0, .descs = descs, .p = p, .x = x, .idx = idx, .weight = weight,
                     .k = k, .hidden = hidden, .inter = inter, .rows = rows, .n_pairs = n_pairs, .out = out,
                     .gate_up_vec = gate_up_vec, .down_vec = down_vec, .stream = stream, .banks = banks};
  // The decode kernels read any expert from their first block: every bank first.
  auto await_banks = [&] {
    for (const MoeBank& b : banks)
      if (b.ready) TS_CUDA_CHECK(cudaStreamWaitEvent(stream, b.ready, 0), "moe_experts: waiting for a bank of experts");
  };

  if (moe_int8_activations(e0, rows, k)) {
    void* hq = moe_hidden_.get(size_t(q8x32_bytes(n_pairs, inter)), stream, "moe hidden (int8)");
    int64_t xs = 0;
    const float* xa = aligned_rows(x, &xs, stream);
    await_banks();
    call.decode_int8(xa, xs, hq);
    return;
  }
  if (rows <= kMoeDecodeMaxRows) {
    const int64_t ldh = round_up(inter, 4);  // 16-byte aligned rows: the down pass loads them as float4
    auto* h = static_cast<float*>(moe_hidden_.get(size_t(n_pairs * ldh) * 4, stream, "moe hidden"));
    int64_t xs = 0;
    const float* xa = aligned_rows(x, &xs, stream);
    await_banks();
    call.decode_f32(xa, xs, h, ldh);
    return;
  }

  call.prefill(moe_index_, moe_x_bf16_, moe_hidden_, moe_out_);
}

}  // namespace turbospark::cuda
