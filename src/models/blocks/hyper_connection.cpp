#include "models/blocks/hyper_connection.h"

#include "formats/safetensors.h"

namespace turbospark {

HyperConnectionWeights HyperConnectionWeights::load(const WeightLoader& ld, const std::string& prefix, int n_streams,
                                                    int64_t hidden, int64_t rank, bool with_inject, float eps,
                                                    int layer) {
  HyperConnectionWeights w;
  const int64_t width = int64_t(n_streams) * hidden;
  w.n_streams = n_streams;
  w.hidden = hidden;
  w.eps = eps;
  w.norm = ld.floats(prefix + "hc_norm.weight", {width});
  auto weight = [&](const std::string& name, int64_t rows, int64_t cols) {
    return ld.matrix(prefix + name, rows, cols, layer);
  };
  w.down = weight("input_mix_weight_down.weight", rank, width);
  w.up = weight("input_mix_weight_up.weight", width, rank);
  if (with_inject) w.inject = weight("block_inject_weight.weight", n_streams, width);
  return w;
}

void hc_gated_residual(Backend& be, const HyperConnectionWeights& w, const Mat& streams, HyperConnectionScratch& s,
                       const Mat& mixed, const Mat* inject) {
  const int64_t rows = streams.rows;
  const float inv_c = 1.f / float(w.n_streams);
  Mat normed = s.normed.rows_slice(0, rows), low = s.low.rows_slice(0, rows), gate = s.gate.rows_slice(0, rows);
  // Every stream normed on its own, then the two products of the normed streams (the mixer's
  // down projection and the inject weights) with their activations: two launches at decode.
  be.rmsnorm_groups(streams, w.norm.data(), w.n_streams, w.eps, normed, 1.f);
  const Weight* on_normed[] = {&w.down, &w.inject};
  const Mat outs[] = {low, inject ? *inject : Mat{}};
  const MatmulAct acts[] = {{Act::kSilu, inv_c, 1.f}, {Act::kSigmoid, inv_c, 2.f}};
  const size_t n = inject ? 2 : 1;
  be.matmul_shared_input(std::span(on_normed, n), normed, std::span(outs, n), std::span(acts, n));
  const Weight* up[] = {&w.up};
  const MatmulAct sigmoid[] = {{Act::kSigmoid, 1.f, 1.f}};
  be.matmul_shared_input(up, low, std::span(&gate, 1), sigmoid);
  be.hc_mix(gate, normed, w.n_streams, mixed);
}

}  // namespace turbospark
