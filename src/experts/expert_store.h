// The expert store (`turbospark convert --expert-store DIR`): every routed expert of a MoE
// model written as one contiguous record, in its stored format (bf16 or quantized), so that
// expert streaming loads an expert with one aligned read instead of three to six spans
// scattered over the checkpoint.
//
// DIR holds two files:
//   experts.bin   the records, each starting on a 4 KiB boundary (O_DIRECT needs offset,
//                 length and buffer aligned) and padded to the next one; inside a record the
//                 expert's planes (gate, up, down: codes, scales, biases) follow each other,
//                 each at a 64-byte-aligned offset; planes that overlap in the checkpoint
//                 (gpt-oss's interleaved gate/up rows) are stored once, keeping their layout.
//   experts.json  the index: format and version, the data file's size, what it was written
//                 from (architecture, layer and expert counts, bytes per expert), and per
//                 record its layer, expert, offset, length, XXH3-64 checksum and plane offsets.
//
// ExpertStore::open validates the index against the data file before anything is read
// (format, version, sizes, bounds, alignment, duplicates); ExpertStreamer checks each record
// against the model's own expert views (plane count and sizes: a store written from another
// model is refused by name) and each record's checksum after reading it, so a damaged or rewritten
// store gives an error, never wrong logits.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ops/backend.h"

namespace turbospark {

class Model;

// One pointer field of an expert's views and the bytes it spans (rows may be strided).
struct PlaneField {
  const void** field;
  int64_t bytes;
};
// Every plane of the expert, gate then up then down (codes, then scales and biases where the
// format has them): the order records and ExpertStreamer's layouts follow. Fields point into ew.
std::vector<PlaneField> expert_planes(ExpertWeights& ew);

struct ExpertStoreRecord {
  int32_t layer = 0, expert = 0;
  int64_t offset = 0;  // in experts.bin, a multiple of kExpertStoreAlign
  int64_t bytes = 0;   // the record's bytes (the checksum covers them); the read is padded to the alignment
  uint64_t checksum = 0;  // XXH3-64 of the record's bytes
  std::vector<int64_t> plane_at;  // per expert_planes() entry: offset in the record, -1 for an empty plane
};

constexpr int64_t kExpertStoreAlign = 4096;
constexpr int64_t kExpertStorePlaneAlign = 64;
constexpr int kExpertStoreVersion = 1;

class ExpertStore {
 public:
  // Reads DIR/experts.json and checks it against DIR/experts.bin; throws naming the file and
  // what is wrong.
  static std::shared_ptr<const ExpertStore> open(const std::string& dir);

  const ExpertStoreRecord* find(int32_t layer, int32_t expert) const;
  const std::string& dir() const { return dir_; }
  const std::string& data_path() const { return data_path_; }
  int64_t data_bytes() const { return data_bytes_; }
  const std::string& architecture() const { return architecture_; }
  int64_t records() const { return int64_t(records_.size()); }

 private:
  std::string dir_, data_path_, architecture_;
  int64_t data_bytes_ = 0;
  std::map<int64_t, ExpertStoreRecord> records_;  // by layer << 32 | expert
};

// Rebuilds the records of three of the model's experts (first, middle, last) from the model's own
// bytes and compares them with the store's (size, plane offsets, checksum): a store written from
// another checkpoint, even one of the same shapes, is refused by name. Reads those experts
// through the model's mapping (a few MB).
void check_expert_store_source(const ExpertStore& store, const Model& model);

struct ExpertStoreWriteStats {
  int64_t records = 0;
  int64_t bytes = 0;  // experts.bin's size
  double seconds = 0;
};

// Writes every routed expert of `model` into DIR (created; must be empty or absent), reading
// the planes where the model's views point (the checkpoint's mapping). progress(done, total)
// is called after each record.
ExpertStoreWriteStats write_expert_store(const Model& model, const std::string& dir,
                                         const std::function<void(int64_t, int64_t)>& progress = {});

// XXH3-64 (libxxhash) of bytes: ~30 GB/s a core, so verifying a record costs little next to
// reading it (zlib's CRC-32, ~3 GB/s here, took a fifth of the I/O thread's time).
uint64_t expert_store_checksum(const void* data, int64_t bytes);

}  // namespace turbospark
