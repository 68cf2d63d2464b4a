// Gated full attention with QSA sparse selection (Qwen4-Exp): q_proj yields per head a query
// and an output gate; q/k RMSNorm (1 + w); partial RoPE; GQA over the paged KV cache, but
// each query attends only to the positions the QSA indexer picks: the top budget/ratio
// mean-pooled key blocks (scored by sum over index heads of relu(q . k_block) / sqrt(d))
// plus every token of the incomplete tail. The output is multiplied by sigmoid(gate) before
// o_proj.
#pragma once

#include <span>

#include "models/blocks/attention.h"
#include "models/blocks/state_rows.h"

namespace turbospark {

class Checkpoint;

struct QsaParams {
  int n_heads = 0, head_dim = 0, budget = 0, ratio = 0;
  int max_selected() const { return budget + ratio - 1; }
};

struct QsaAttentionWeights {
  Weight q_gate;  // [n_heads * 2 * head_dim, hidden]: per head [query, gate]
  Weight k, v;    // [n_kv * head_dim, hidden]
  Weight o;       // [hidden, n_heads * head_dim]
  Param q_norm, k_norm;  // [head_dim], (1 + w)
  Weight index_qk;                    // [(index_heads + 1) * index_dim, hidden]: queries then the key
  Param index_q_norm, index_k_norm;  // [index_dim], (1 + w)
};

// Per-sequence index keys for one layer (backend memory).
struct QsaState {
  Mat raw_keys;    // [max_context, index_dim]
  Mat block_keys;  // [max_context / ratio + 1, index_dim]
  int32_t* nan_score = nullptr;  // backend memory: 1 once a block score was NaN (QsaView::nan_score)
};

struct QsaScratch {
  Mat q_gate;            // [rows, n_heads * 2 * hd]
  Mat q, gate, k, v, attn;
  Mat index_qk, index_q;
  BackendArray<int32_t> selected;  // [rows, max_selected] positions each query row attends to
  BackendArray<int32_t> counts;    // [rows]
};

// The indexer: fills s.selected / s.counts for every row of x; `runs` cover x's rows, each
// selecting from (and adding its keys to) its sequence's key tables. It also projects x into
// s.q_gate, s.k and s.v for qsa_attention (all four projections share one GEMV launch at decode).
void qsa_index(Backend& be, const AttentionParams& p, const QsaParams& qp, const QsaAttentionWeights& w, const Mat& x,
               const int64_t* positions, std::span<const StateRows<const QsaState>> runs, QsaScratch& s);

// The gated attention over the positions qsa_index selected, from the q_gate, k and v it
// projected (x: the same rows qsa_index was given).
void qsa_attention(Backend& be, const AttentionParams& p, const QsaParams& qp, const QsaAttentionWeights& w,
                   const Mat& x, const int64_t* positions, const KvLayerView& kv, QsaScratch& s, const Mat& out);

}  // namespace turbospark
