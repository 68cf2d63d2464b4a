// Per-layer n-gram embeddings (PLE, Qwen4-Exp). Each PLE layer hashes the last n tokens
// (n = 2..ngram_size, never reaching back across an EOS) with splitmix64-derived
// multipliers into `heads_per_ngram` prime-sized tables per order, gathers those rows from
// one huge table (memory-mapped, possibly split into shards; never copied), projects them
// to a shared value and per-stream keys, gates the value per stream with the normalized
// streams, and adds a dilated depthwise conv (carried state) of the normalized result.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "models/blocks/state_rows.h"
#include "ops/backend.h"

namespace turbospark {

class Checkpoint;

struct NgramHashSpec {
  int ngram_size = 0, heads_per_ngram = 0;
  int64_t vocab_size = 0;     // the token vocabulary
  int64_t base = 0;           // ngram_vocab_size_base
  int64_t divisor = 1;        // make_ngram_vocab_size_divisible_by
  int64_t seed = 0;
  int ple_index = 0;          // index of this layer among the PLE layers
  int32_t eos = 0;
  int n_heads() const { return (ngram_size - 1) * heads_per_ngram; }
};

// The per-layer hashing constants, derived exactly as the reference does.
struct NgramHash {
  std::vector<uint64_t> multipliers;  // [ngram_size]
  std::vector<int64_t> head_sizes;    // [n_heads] distinct primes >= base
  std::vector<int64_t> head_offsets;  // [n_heads]
  int64_t padded_rows = 0;            // table rows (total rounded up to the divisor)

  static NgramHash build(const NgramHashSpec& spec);
};

// Row ids [n, n_heads] for `tokens`, given the previous ngram_size-1 tokens of the sequence
// (EOS-filled at its start); advances `context`.
void ngram_row_ids(const NgramHashSpec& spec, const NgramHash& hash, const int32_t* tokens, int64_t n,
                   std::vector<int32_t>& context, std::vector<int64_t>& ids);

struct PleWeights {
  NgramHashSpec spec;
  NgramHash hash;
  std::vector<Weight> table_shards;  // row-concatenated [rows_k, head_dim] pieces of the table
  std::vector<int64_t> shard_starts;
  Weight key;     // [C*H, ple_dim]
  Weight value;   // [H, ple_dim]
  Param norm_key, norm_query, norm_conv;  // [C*H], (1 + w) per group
  Param conv;                             // [C*H, K]
  int conv_kernel = 0, n_streams = 0;
  int64_t hidden = 0, ple_dim = 0, head_dim = 0;
  float eps = 1e-6f;
};

struct PleState {
  Mat conv;                     // [(K-1) * ngram_size, C*H]
  std::vector<int32_t> context;  // last ngram_size-1 tokens
};

struct PleScratch {
  Mat key, query, gated, normed, conv;  // [rows, C*H]
  Mat value;                    // [rows, H]
  std::vector<int64_t> ids;     // [rows, n_heads] host: computed from the host token context
  std::vector<float> host_emb;  // [rows, ple_dim] host staging of the gathered table rows
};

// The host half of a PLE layer: the n-gram row ids of `rows` tokens from the carried context
// (which it advances), their table rows gathered on the host and uploaded into `emb`
// ([rows, ple_dim] backend memory, a row per token). Host work no recorded step can hold: a
// decode step replayed as a graph runs it before the replay (Model::prepare_step).
void ple_gather(Backend& be, const PleWeights& w, const int32_t* tokens, int64_t rows, PleState& state,
                PleScratch& s, const Mat& emb);

// The device half: streams += PLE(streams), from the rows ple_gather uploaded into `emb`;
// `runs` cover the rows, each advancing its sequence's conv state.
void ple_layer(Backend& be, const PleWeights& w, const Mat& emb, const Mat& streams,
               std::span<const StateRows<const PleState>> runs, PleScratch& s);

}  // namespace turbospark
