#include "models/blocks/gated_delta_net.h"

#include "formats/safetensors.h"

namespace turbospark {

GatedDeltaNetWeights GatedDeltaNetWeights::load(const WeightLoader& ld, const std::string& prefix,
                                                const GatedDeltaNetParams& p, int64_t hidden, int layer) {
  GatedDeltaNetWeights w;
  auto weight = [&](const std::string& name, int64_t rows, int64_t cols) {
    return ld.matrix(prefix + name, rows, cols, layer);
  };
  w.in_qkv = weight("in_proj_qkv.weight", p.conv_dim(), hidden);
  w.in_z = weight("in_proj_z.weight", p.value_dim(), hidden);
  w.in_b = weight("in_proj_b.weight", p.n_v_heads, hidden);
  w.in_a = weight("in_proj_a.weight", p.n_v_heads, hidden);
  w.out = weight("out_proj.weight", hidden, p.value_dim());
  w.conv = ld.floats(prefix + "conv1d.weight", {p.conv_dim(), 1, p.conv_kernel});
  w.a_log = ld.floats(prefix + "A_log", {p.n_v_heads});
  w.dt_bias = ld.floats(prefix + "dt_bias", {p.n_v_heads});
  w.norm = ld.floats(prefix + "norm.weight", {p.dv});
  return w;
}

void gated_delta_net(Backend& be, const GatedDeltaNetParams& p, const GatedDeltaNetWeights& w, const Mat& x,
                     std::span<const StateRows<const GatedDeltaNetState>> runs, GatedDeltaNetScratch& s,
                     const Mat& out) {
  const int64_t rows = x.rows;
  Mat qkv = s.qkv.rows_slice(0, rows), conv = s.qkv_conv.rows_slice(0, rows);
  Mat z = s.z.rows_slice(0, rows), core = s.core.rows_slice(0, rows);
  Mat a = s.a.rows_slice(0, rows), b = s.b.rows_slice(0, rows);
  const Weight* in[] = {&w.in_qkv, &w.in_z, &w.in_b, &w.in_a};
  const Mat in_out[] = {qkv, z, b, a};
  be.matmul_shared_input(in, x, in_out);
  for (const auto& r : runs) {
    const Mat run_conv = conv.rows_slice(r.first, r.rows);
    be.causal_conv1d(qkv.rows_slice(r.first, r.rows), w.conv.data(), p.conv_kernel, 1, r.state->conv, Act::kSilu,
                     run_conv);
    be.gated_delta_rule(run_conv, a.rows_slice(r.first, r.rows), b.rows_slice(r.first, r.rows), w.a_log.data(),
                        w.dt_bias.data(), p.n_k_heads, p.n_v_heads, p.dk, p.dv, p.v_heads_tiled, r.state->recurrent,
                        core.rows_slice(r.first, r.rows));
  }
  // Gated norm per value head.
  be.rmsnorm_gated(core, w.norm.data(), p.n_v_heads, p.eps, z, p.gate_act, core);
  be.matmul(w.out, core, out);
}

}  // namespace turbospark
