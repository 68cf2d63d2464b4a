#include "models/blocks/ple.h"

#include "core/quant_grouped.h"

#include <algorithm>

#include "core/error.h"

namespace turbospark {

namespace {

uint64_t splitmix64(uint64_t v) {
  v += 0x9E3779B97F4A7C15ull;
  v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
  v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
  return v ^ (v >> 31);
}

bool is_prime(int64_t v) {
  if (v < 2) return false;
  if (v % 2 == 0) return v == 2;
  for (int64_t d = 3; d * d <= v; d += 2) {
    if (v % d == 0) return false;
  }
  return true;
}

}  // namespace

NgramHash NgramHash::build(const NgramHashSpec& s) {
  NgramHash h;
  const uint64_t max_long = (uint64_t(1) << 63) - 1;
  const uint64_t multiplier_max = max_long / uint64_t(std::max<int64_t>(s.vocab_size, 1));
  const uint64_t half_bound = std::max<uint64_t>(1, multiplier_max / 2);
  const uint64_t base_seed = uint64_t(s.seed) + 10007ull * uint64_t(s.ple_index);
  for (int i = 0; i < s.ngram_size; ++i) {
    uint64_t v = base_seed + 0x9E3779B97F4A7C15ull * uint64_t(i + 1);  // wraps mod 2^64 as the reference masks
    h.multipliers.push_back(2 * (splitmix64(v) % half_bound) + 1);
  }
  // Head g of this layer uses the (global_g + 1)-th prime >= base, global_g counting over
  // every PLE layer's heads before it.
  const int heads = s.n_heads();
  int64_t prime = s.base - 1;
  const int first = s.ple_index * heads;
  for (int g = 0; g < first + heads; ++g) {
    ++prime;
    while (!is_prime(prime)) ++prime;
    if (g >= first) h.head_sizes.push_back(prime);
  }
  int64_t total = 0;
  for (int64_t size : h.head_sizes) {
    h.head_offsets.push_back(total);
    total += size;
  }
  h.padded_rows = (total + s.divisor - 1) / s.divisor * s.divisor;
  return h;
}

void ngram_row_ids(const NgramHashSpec& spec, const NgramHash& hash, const int32_t* tokens, int64_t n,
                   std::vector<int32_t>& context, std::vector<int64_t>& ids) {
  const int ctx = spec.ngram_size - 1;
  // history = context followed by this call's tokens
  std::vector<int32_t> hist(context);
  hist.insert(hist.end(), tokens, tokens + n);
  const int heads = spec.n_heads();
  ids.resize(size_t(n * heads));
  std::vector<uint64_t> shifted(size_t(spec.ngram_size));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t at = ctx + t;
    // shifted[s] = token s back, unless an EOS lies in [at - s, at - 1] (the n-gram would reach
    // across a segment boundary): then EOS.
    bool crossed = false;
    for (int s = 0; s < spec.ngram_size; ++s) {
      if (s > 0 && hist[size_t(at - s)] == spec.eos) crossed = true;
      shifted[size_t(s)] = uint64_t(crossed ? spec.eos : hist[size_t(at - s)]);
    }
    for (int order = 2; order <= spec.ngram_size; ++order) {
      uint64_t mixed = shifted[0] * hash.multipliers[0];
      for (int s = 1; s < order; ++s) mixed ^= shifted[size_t(s)] * hash.multipliers[size_t(s)];
      for (int j = 0; j < spec.heads_per_ngram; ++j) {
        const int head = (order - 2) * spec.heads_per_ngram + j;
        const int64_t size = hash.head_sizes[size_t(head)];
        ids[size_t(t * heads + head)] = int64_t(mixed % uint64_t(size)) + hash.head_offsets[size_t(head)];
      }
    }
  }
  context.assign(hist.end() - ctx, hist.end());
}

void ple_gather(Backend& be, const PleWeights& w, const int32_t* tokens, int64_t rows, PleState& state,
                PleScratch& s, const Mat& emb) {
  TS_CHECK(emb.rows == rows && emb.cols == w.ple_dim, "ple_gather: {} rows into [{}, {}] (PLE dim {})", rows, emb.rows,
           emb.cols, w.ple_dim);
  const int heads = w.spec.n_heads();
  ngram_row_ids(w.spec, w.hash, tokens, rows, state.context, s.ids);
  // The table stays in the mapped checkpoint (the real one is ~90 GiB): its rows are
  // gathered on the host and uploaded whole. Each token's embedding lands in its own row of
  // the widened `emb` buffer, and the upload is ordered with the queued work: a single-row
  // buffer would let every token of a micro-batch read the last token's n-grams on a queued
  // backend (the seed's PLE lesson).
  s.host_emb.resize(size_t(rows * emb.cols));
  for (int64_t t = 0; t < rows; ++t) {
    for (int h = 0; h < heads; ++h) {
      const int64_t id = s.ids[size_t(t * heads + h)];
      size_t shard = size_t(std::upper_bound(w.shard_starts.begin(), w.shard_starts.end(), id) - w.shard_starts.begin()) - 1;
      dequantize_weight_row(w.table_shards[shard].view, id - w.shard_starts[shard],
                            s.host_emb.data() + t * emb.cols + h * w.head_dim);
    }
  }
  be.upload(emb, s.host_emb.data());
}

void ple_layer(Backend& be, const PleWeights& w, const Mat& emb, const Mat& streams,
               std::span<const StateRows<const PleState>> runs, PleScratch& s) {
  const int64_t rows = streams.rows, H = w.hidden;
  TS_CHECK(emb.rows == rows, "ple_layer: {} gathered rows for {} streams rows", emb.rows, rows);
  Mat key = s.key.rows_slice(0, rows), query = s.query.rows_slice(0, rows), value = s.value.rows_slice(0, rows);
  Mat gated = s.gated.rows_slice(0, rows), normed = s.normed.rows_slice(0, rows), conv = s.conv.rows_slice(0, rows);
  const int C = w.n_streams;
  // key | value in one launch, each stream's norms in one launch (rmsnorm_groups: the same
  // values as a norm per stream).
  const Weight* on_emb[] = {&w.key, &w.value};
  const Mat kv_out[] = {key, value};
  be.matmul_shared_input(on_emb, emb, kv_out);
  const Mat key_c = key.cols_slice(0, C * H);
  be.rmsnorm_groups(key_c, w.norm_key.data(), C, w.eps, key_c, 1.f);
  be.rmsnorm_groups(streams.cols_slice(0, C * H), w.norm_query.data(), C, w.eps, query.cols_slice(0, C * H), 1.f);
  be.ple_gate(key, query, value, C, gated);
  be.rmsnorm_groups(gated.cols_slice(0, C * H), w.norm_conv.data(), C, w.eps, normed.cols_slice(0, C * H), 1.f);
  for (const auto& r : runs) {
    be.causal_conv1d(normed.rows_slice(r.first, r.rows), w.conv.data(), w.conv_kernel, w.spec.ngram_size,
                     r.state->conv, Act::kSilu, conv.rows_slice(r.first, r.rows));
  }
  be.add(streams, gated);
  be.add(streams, conv);
}

}  // namespace turbospark
