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
  project(be, w.q, w.q_bias, x, q);
  project(be, w.k, w.k_bias, x, k);
  project(be, w.v, w.v_bias, x, v);
  if (!w.q_norm.empty()) {
    // Per-head norm: view [rows, heads*hd] as [rows*heads, hd] (rows are contiguous).
    be.rmsnorm(Mat(q.data, rows * p.n_heads, p.head_dim), w.q_norm.data(), p.norm_eps,
               Mat(q.data, rows * p.n_heads, p.head_dim), p.norm_offset);
    be.rmsnorm(Mat(k.data, rows * p.n_kv_heads, p.head_dim), w.k_norm.data(), p.norm_eps,
               Mat(k.data, rows * p.n_kv_heads, p.head_dim), p.norm_offset);
  }
  be.rope(q, p.n_heads, p.head_dim, p.rotary_dim, positions, p.inv_freq.data(), p.attention_factor);
  be.rope(k, p.n_kv_heads, p.head_dim, p.rotary_dim, positions, p.inv_freq.data(), p.attention_factor);
  be.kv_write(kv, k, v, positions);
  be.attention(q, positions, kv, p.n_heads, p.scale, p.window, w.sinks.empty() ? nullptr : w.sinks.data(), attn);
  project(be, w.o, w.o_bias, attn, out);
}

}  // namespace turbospark
