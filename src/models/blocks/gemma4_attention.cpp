#include "models/blocks/gemma4_attention.h"

namespace turbospark {

// Per-head RMSNorm in place: [rows, heads * hd] viewed as [rows * heads, hd] (rows contiguous).
static void head_norm(Backend& be, const Mat& m, int heads, int hd, const float* w, float eps) {
  Mat v(m.data, m.rows * heads, hd);
  be.rmsnorm(v, w, eps, v, 0.f);
}

void gemma4_attention(Backend& be, const AttentionParams& p, const Gemma4AttentionWeights& w, const Mat& x,
                      const int64_t* positions, const KvLayerView& kv, const AttentionScratch& s, const Mat& out) {
  const int64_t rows = x.rows;
  Mat q = s.q.rows_slice(0, rows), attn = s.attn.rows_slice(0, rows);
  // Scratch is sized for the widest layer; this layer's rows are packed at its own width.
  q = Mat(q.data, rows, int64_t(p.n_heads) * p.head_dim);
  attn = Mat(attn.data, rows, int64_t(p.n_heads) * p.head_dim);
  be.matmul(w.q, x, q);
  head_norm(be, q, p.n_heads, p.head_dim, w.q_norm.data(), p.norm_eps);
  be.rope(q, p.n_heads, p.head_dim, p.rotary_dim, positions, p.inv_freq.data(), p.attention_factor);
  if (!w.kv_shared) {
    const int64_t kvw = int64_t(p.n_kv_heads) * p.head_dim;
    Mat k(s.k.data, rows, kvw), v(s.v.data, rows, kvw);
    be.matmul(w.k, x, k);
    if (w.v.rows() > 0) {
      be.matmul(w.v, x, v);
    } else {
      be.copy(k, v);  // k_eq_v: values are the raw key projection
    }
    head_norm(be, k, p.n_kv_heads, p.head_dim, w.k_norm.data(), p.norm_eps);
    head_norm(be, v, p.n_kv_heads, p.head_dim, w.ones, p.norm_eps);
    be.rope(k, p.n_kv_heads, p.head_dim, p.rotary_dim, positions, p.inv_freq.data(), p.attention_factor);
    be.kv_write(kv, k, v, positions);
  }
  be.attention(q, positions, kv, p.n_heads, p.scale, p.window, nullptr, attn);
  be.matmul(w.o, attn, out);
}

}  // namespace turbospark
