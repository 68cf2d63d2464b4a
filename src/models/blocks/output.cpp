#include "models/blocks/output.h"

namespace turbospark {

void output_logits(Backend& be, const ForwardBatch& b, const OutputWeights& w, int n_layers, const Mat& x,
                   const Mat& normed_scratch, const Mat& logits_scratch) {
  const int64_t rows = !b.logit_rows.empty() ? int64_t(b.logit_rows.size()) : b.all_logits ? x.rows : 1;
  const Mat normed = normed_scratch.rows_slice(0, rows);
  if (!b.logit_rows.empty()) {
    // The wanted rows gathered by the norm, one row each (a handful: one per sequence).
    for (int64_t i = 0; i < rows; ++i)
      be.rmsnorm(x.rows_slice(b.logit_rows[size_t(i)], 1), w.norm->data(), w.eps, normed.rows_slice(i, 1), w.norm_offset);
  } else {
    be.rmsnorm(b.all_logits ? x : x.rows_slice(x.rows - 1, 1), w.norm->data(), w.eps, normed, w.norm_offset);
  }
  b.emit("final_norm", n_layers, normed);
  const Mat logits = logits_scratch.rows_slice(0, rows);
  be.matmul(*w.lm_head, normed, logits);
  if (w.softcap > 0) be.unary(logits, Act::kTanh, 1.f / w.softcap, w.softcap, logits);
  b.emit("lm_head", n_layers, logits);
  download_outputs(be, b, logits);
}

void download_outputs(Backend& be, const ForwardBatch& b, const Mat& logits) {
  if (b.logits) return be.download(logits, b.logits);
  be.argmax_rows(logits, b.greedy_ids_backend);
  be.download_bytes(b.greedy_ids, b.greedy_ids_backend, logits.rows * int64_t(sizeof(int32_t)));
}

}  // namespace turbospark
