#include "models/blocks/qsa_attention.h"

#include "core/error.h"

namespace turbospark {

void qsa_index(Backend& be, const AttentionParams& p, const QsaParams& qp, const QsaAttentionWeights& w, const Mat& x,
               const int64_t* positions, std::span<const StateRows<const QsaState>> runs, QsaScratch& s) {
  const int64_t rows = x.rows;
  const int id = qp.head_dim;
  // The indexer's and the attention's projections of x in one call (one launch at decode);
  // qsa_attention reads q_gate, k and v from the scratch.
  Mat iqk = s.index_qk.rows_slice(0, rows);
  const Weight* proj[] = {&w.index_qk, &w.q_gate, &w.k, &w.v};
  const Mat proj_out[] = {iqk, s.q_gate.rows_slice(0, rows), s.k.rows_slice(0, rows), s.v.rows_slice(0, rows)};
  be.matmul_shared_input(proj, x, proj_out);
  // Queries normed and rotated at their positions; keys stored raw (pooled, normed and
  // rotated per complete block inside qsa_select, which reads them from the projection).
  Mat iq = iqk.cols_slice(0, int64_t(qp.n_heads) * id);
  Mat ik = iqk.cols_slice(int64_t(qp.n_heads) * id, id);
  Mat iq_rows = s.index_q.rows_slice(0, rows);
  be.copy(iq, iq_rows);
  be.rmsnorm(Mat(iq_rows.data, rows * qp.n_heads, id), w.index_q_norm.data(), p.norm_eps,
             Mat(iq_rows.data, rows * qp.n_heads, id), 1.f);
  be.rope(iq_rows, qp.n_heads, id, p.rotary_dim, positions, p.inv_freq.data(), p.attention_factor);

  QsaView view;
  view.k_norm = w.index_k_norm.data();
  view.inv_freq = p.inv_freq.data();
  view.rotary_dim = p.rotary_dim;
  view.ratio = qp.ratio;
  view.block_topk = qp.budget / qp.ratio;
  view.n_heads = qp.n_heads;
  view.head_dim = id;
  view.eps = p.norm_eps;
  const int max_sel = qp.max_selected();
  TS_CHECK(s.selected.size() >= rows * max_sel && s.counts.size() >= rows, "QSA selection buffers hold {} rows, need {}",
           s.counts.size(), rows);
  for (const auto& r : runs) {
    view.raw_keys = r.state->raw_keys;
    view.block_keys = r.state->block_keys;
    view.nan_score = r.state->nan_score;
    be.qsa_select(view, iq_rows.rows_slice(r.first, r.rows), ik.rows_slice(r.first, r.rows), positions + r.first,
                  s.selected.data() + r.first * max_sel, s.counts.data() + r.first, max_sel);
  }
}

void qsa_attention(Backend& be, const AttentionParams& p, const QsaParams& qp, const QsaAttentionWeights& w,
                   const Mat& x, const int64_t* positions, const KvLayerView& kv, QsaScratch& s, const Mat& out) {
  const int64_t rows = x.rows;
  const int hd = p.head_dim;
  Mat qg = s.q_gate.rows_slice(0, rows), q = s.q.rows_slice(0, rows), gate = s.gate.rows_slice(0, rows);
  Mat k = s.k.rows_slice(0, rows), v = s.v.rows_slice(0, rows), attn = s.attn.rows_slice(0, rows);
  be.split_heads(qg, p.n_heads, hd, q, gate);  // qg, k and v: projected by qsa_index
  // q and k normed per head (1 + w) and rotated, k and v written to the cache: one launch on a GPU.
  AttentionPrep prep;
  prep.n_heads = p.n_heads;
  prep.n_kv_heads = p.n_kv_heads;
  prep.head_dim = hd;
  prep.rotary_dim = p.rotary_dim;
  prep.q_norm = w.q_norm.data();
  prep.k_norm = w.k_norm.data();
  prep.norm_eps = p.norm_eps;
  prep.norm_offset = 1.f;
  prep.inv_freq = p.inv_freq.data();
  prep.attention_factor = p.attention_factor;
  be.attention_prep(q, k, v, prep, positions, kv);

  const int max_sel = qp.max_selected();
  be.attention_selected(q, kv, p.n_heads, p.scale, s.selected.data(), s.counts.data(), max_sel, attn);
  be.mul_act(attn, gate, Act::kSigmoid);
  be.matmul(w.o, attn, out);
}

}  // namespace turbospark
