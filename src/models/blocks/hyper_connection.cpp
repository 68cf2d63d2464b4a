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
  const int64_t rows = streams.rows, H = w.hidden;
  const float inv_c = 1.f / float(w.n_streams);
  Mat normed = s.normed.rows_slice(0, rows), low = s.low.rows_slice(0, rows), gate = s.gate.rows_slice(0, rows);
  for (int c = 0; c < w.n_streams; ++c) {
    be.rmsnorm(streams.cols_slice(c * H, H), w.norm.data() + c * H, w.eps, normed.cols_slice(c * H, H), 1.f);
  }
  be.matmul(w.down, normed, low);
  be.unary(low, Act::kSilu, inv_c, 1.f, low);
  be.matmul(w.up, low, gate);
  be.unary(gate, Act::kSigmoid, 1.f, 1.f, gate);
  be.hc_mix(gate, normed, w.n_streams, mixed);
  if (inject) {
    be.matmul(w.inject, normed, *inject);
    be.unary(*inject, Act::kSigmoid, inv_c, 2.f, *inject);
  }
}

}  // namespace turbospark
