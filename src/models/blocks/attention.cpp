#include "models/blocks/attention.h"

namespace turbospark {

static void project(Backend& be, const Weight& w, const Param& bias, const Mat& x, const Mat& y) {
  be.matmul(w, x, y);
  if (!bias.empty()) be.add_bias(y, bias.data());
}

void attention_block(Backend& be, const AttentionParams& p, const AttentionWeights& w, const Mat& x,
                     const int64_t* positions, const KvLayerView& kv, const AttentionScratch& s, const Mat& out) {
  const int64_t rows = x.rows;
  Mat q = s.q.rows_slice(0, rows), k = s.k.rows_slice(0, rows), v = s.v.rows_slice(0, rows);
  Mat attn = s.attn.rows_slice(0, rows);
  // q, k and v read the same x: one call (one GEMV launch at decode on CUDA); their biases are
  // added by prep_attention (one launch with the norms, RoPE and cache write on CUDA).
  const Weight* qkv_w[3] = {&w.q, &w.k, &w.v};
  const Mat qkv_y[3] = {q, k, v};
  be.matmul_shared_input(qkv_w, x, qkv_y);
  auto bias = [](const Param& b) { return b.empty() ? nullptr : b.data(); };
  AttentionPrep prep;
  prep.q_bias = bias(w.q_bias);
  prep.k_bias = bias(w.k_bias);
  prep.v_bias = bias(w.v_bias);
  prep.n_heads = p.n_heads;
  prep.n_kv_heads = p.n_kv_heads;
  prep.head_dim = p.head_dim;
  prep.rotary_dim = p.rotary_dim;
  prep.q_norm = w.q_norm.empty() ? nullptr : w.q_norm.data();
  prep.k_norm = w.k_norm.empty() ? nullptr : w.k_norm.data();
  prep.norm_eps = p.norm_eps;
  prep.norm_offset = p.norm_offset;
  prep.inv_freq = p.inv_freq.data();
  prep.attention_factor = p.attention_factor;
  be.prep_attention(q, k, v, prep, positions, kv, p.scale, p.window, w.sinks.empty() ? nullptr : w.sinks.data(), attn);
  project(be, w.o, w.o_bias, attn, out);
}

}  // namespace turbospark
