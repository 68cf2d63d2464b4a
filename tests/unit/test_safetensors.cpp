// safetensors reader/writer: dtypes, sharding, validation. (The fused-expert layout against
// transformers' logits is a golden test: golden/test_fused_experts.cpp.)
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/dtype.h"
#include "core/error.h"
#include "core/npy.h"
#include "formats/safetensors.h"
#include "models/registry.h"
#include "test_util.h"

namespace turbospark {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

TensorWriteSpec pattern(const std::string& name, DType dt, std::vector<int64_t> shape, uint8_t seed) {
  return {name, dt, shape, [seed](uint8_t* d, size_t n) {
            for (size_t i = 0; i < n; ++i) d[i] = uint8_t(seed + i * 7);
          }};
}

TEST(Safetensors, RoundTripsEveryDtype) {
  TempDir tmp;
  std::string path = tmp.str() + "/t.safetensors";
  write_safetensors(path, {pattern("a", DType::BF16, {3, 5}, 1), pattern("b", DType::F16, {7}, 2),
                           pattern("c", DType::F32, {2, 2}, 3), pattern("d", DType::I64, {3}, 4),
                           pattern("e", DType::U8, {11}, 5), pattern("empty", DType::F32, {0, 4}, 6)});
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 6u);
  const TensorInfo& a = f.tensors().at("a");
  EXPECT_EQ(a.dtype, DType::BF16);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(a.nbytes, 30u);
  for (size_t i = 0; i < a.nbytes; ++i) EXPECT_EQ(a.data[i], uint8_t(1 + i * 7));
  EXPECT_EQ(f.tensors().at("d").nbytes, 24u);
  EXPECT_EQ(f.tensors().at("e").dtype, DType::U8);
  EXPECT_EQ(f.tensors().at("empty").nbytes, 0u);
}

std::string slurp(const std::string& p) { return read_text_file(p); }
void spit(const std::string& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

// Replaces the header of a one-tensor file with `header` (padded to the same length).
void set_header(const std::string& path, std::string header) {
  std::string bytes = slurp(path);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  ASSERT_LE(header.size(), hlen);
  header.append(hlen - header.size(), ' ');
  spit(path, bytes.substr(0, 8) + header + bytes.substr(8 + hlen));
}

void expect_error(const std::string& path, const std::string& needle) {
  try {
    SafetensorsFile f(path);
    FAIL() << "no error for " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(Safetensors, RejectsCorruptHeaders) {
  TempDir tmp;
  std::string path = tmp.str() + "/t.safetensors";
  auto fresh = [&] {
    write_safetensors(path, {pattern("w", DType::BF16, {4, 4}, 0), pattern("x", DType::BF16, {4, 4}, 0)},
                      {{"padding", std::string(200, 'p')}});
  };
  fresh();
  set_header(path, R"({"w":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,32]},"x":{"dtype":"Q9","shape":[4,4],"data_offsets":[32,64]}})");
  expect_error(path, "unsupported dtype");
  fresh();
  set_header(path, R"({"w":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,32]},"x":{"dtype":"BF16","shape":[4,5],"data_offsets":[32,64]}})");
  expect_error(path, "expected 40");
  fresh();
  set_header(path, R"({"w":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,32]},"x":{"dtype":"BF16","shape":[4,4],"data_offsets":[16,48]}})");
  expect_error(path, "overlap");
  fresh();
  set_header(path, R"({"w":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,32]},"x":{"dtype":"BF16","shape":[4,4],"data_offsets":[32,64]})");
  expect_error(path, "malformed safetensors header JSON");
  fresh();
  set_header(path, R"({"w":{"dtype":"BF16","shape":[4,-4],"data_offsets":[0,32]}})");
  expect_error(path, "bad shape");
  // A shape whose element or byte count overflows 64 bits (2^63 x 2 bf16 values wrap to 0
  // bytes, which an empty data range would match) is refused before any product wraps.
  fresh();
  set_header(path, R"({"w":{"dtype":"BF16","shape":[9223372036854775807,2],"data_offsets":[0,0]}})");
  expect_error(path, "implausible shape");
  fresh();
  set_header(path, R"({"w":{"dtype":"F32","shape":[299999999999999,999999999999],"data_offsets":[0,32]}})");
  expect_error(path, "implausible shape");
  spit(path, "abc");
  expect_error(path, "truncated");
  // A header length of 100 GB (in a file of 10 bytes) and one over the library's 100 MB bound
  // (in a file that has it) are refused before anything is read or allocated.
  std::string huge(8, '\0');
  const uint64_t claim = 100'000'000'000ull;
  std::memcpy(huge.data(), &claim, 8);
  spit(path, huge + "{}");
  expect_error(path, "safetensors header of 100000000000 bytes is larger than the limit of 100000000 bytes");
}

TEST(Safetensors, ShardedIndexResolvesEveryTensor) {
  Checkpoint ck(testing::fixture("qwen3_moe_tiny"));
  auto index = testing::read_json(testing::fixture("qwen3_moe_tiny") + "/model.safetensors.index.json");
  EXPECT_EQ(ck.all().size(), index["weight_map"].size());
  for (auto& [name, file] : index["weight_map"].items()) {
    const TensorInfo& t = ck.get(name);
    EXPECT_NE(t.file->find(file.get<std::string>()), std::string::npos) << name;
  }
}

// An index names shards beside it: absolute paths, "..", subfolders and names with a NUL (which
// the file system would cut short) are refused by entry, before anything is opened; an index
// that names no shard says so.
TEST(Safetensors, IndexShardNamesStayBesideTheIndex) {
  const fs::path fixture = testing::fixture("qwen3_moe_tiny");
  TempDir tmp;
  for (const auto& e : fs::directory_iterator(fixture))
    if (e.path().extension() == ".safetensors") fs::create_symlink(e.path(), tmp.path / e.path().filename());
  auto index = testing::read_json((fixture / "model.safetensors.index.json").string());
  const std::string first = index["weight_map"].begin().key();
  auto write_index = [&](const nlohmann::json& j) {
    std::ofstream(tmp.path / "model.safetensors.index.json") << j.dump();
  };
  write_index(index);
  EXPECT_NO_THROW(Checkpoint{tmp.str()});
  for (const std::string bad : {std::string("../qwen3_moe_tiny/model-00001-of-00009.safetensors"), std::string("/etc/hostname"),
                                std::string("sub/model-00001-of-00009.safetensors"), std::string(".."), std::string(""),
                                std::string("model-00001-of-00009.safetensors\0.txt", 38)}) {
    auto j = index;
    j["weight_map"][first] = bad;
    write_index(j);
    try {
      Checkpoint ck(tmp.str());
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a file beside the index"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(first), std::string::npos) << e.what();
    }
  }
  write_index(nlohmann::json{{"weight_map", nlohmann::json::object()}});
  try {
    Checkpoint ck(tmp.str());
    ADD_FAILURE() << "an empty weight_map was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight_map names no shard"), std::string::npos) << e.what();
  }
}

// What Checkpoint::prefault pages in when byte ranges are skipped (streamed experts).
TEST(Checkpoint, ComplementRangesLeavesOutTheSkippedBytes) {
  using R = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(complement_ranges(100, {}), (R{{0, 100}}));
  EXPECT_EQ(complement_ranges(100, {{10, 20}, {50, 60}}), (R{{0, 10}, {20, 50}, {60, 100}}));
  EXPECT_EQ(complement_ranges(100, {{50, 60}, {10, 20}, {15, 55}}), (R{{0, 10}, {60, 100}}));  // unsorted, overlapping
  EXPECT_EQ(complement_ranges(100, {{0, 30}, {90, 200}}), (R{{30, 90}}));                    // ends, past the size
  EXPECT_EQ(complement_ranges(100, {{0, 100}}), R{});
}

// GGUF files are one mapped file of the checkpoint: counted and paged in like shards (they
// were left out of both, so the first tokens of a GGUF model paid its page faults).
TEST(Checkpoint, GgufFileIsMappedCountedAndPrefaulted) {
  const std::string path = testing::fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-bf16.gguf";
  Checkpoint ck(path);
  ASSERT_EQ(ck.mapped_files().size(), 1u);
  EXPECT_EQ(ck.total_bytes(), int64_t(std::filesystem::file_size(path)));
  int64_t last = 0;
  ck.prefault([&](int64_t done, int64_t total) {
    EXPECT_EQ(total, ck.total_bytes());
    last = done;
  }, {{path, {{0, 4096}}}});
  EXPECT_EQ(last, ck.total_bytes());
}

}  // namespace
}  // namespace turbospark
