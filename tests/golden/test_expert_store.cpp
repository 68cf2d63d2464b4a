// The expert store (experts/expert_store.h): written from every MoE fixture and streamed back
// through ExpertStreamer, it gives the resident logits bit for bit (one aligned read per expert,
// the owned float stacks of bf16 gpt-oss included); a damaged, truncated, rewritten or foreign
// store is refused naming the store and what is wrong, never read into wrong logits.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/session.h"
#include "experts/expert_store.h"
#include "experts/expert_streamer.h"
#include "golden/golden.h"
#include "models/registry.h"
#include "test_util.h"

namespace turbospark {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::fixture;
using testing::load_golden;
using testing::TempDir;

struct StoreCase {
  const char* fixture;
  const char* file;  // inside the fixture folder; "" = the folder itself (safetensors)
};

std::string model_path(const StoreCase& c) { return testing::fixture_model(c.fixture, c.file); }
using testing::bitwise_equal;

class ExpertStoreRoundTrip : public ::testing::TestWithParam<StoreCase> {};

TEST_P(ExpertStoreRoundTrip, StreamedFromTheStoreBitwiseEqualResident) {
  const StoreCase& c = GetParam();
  TempDir tmp;
  const std::string dir = tmp.str() + "/store";
  auto be = make_cpu_backend(2);
  LoadedModel m = load_model(model_path(c), *be);
  const int k = m.model->experts_per_token();
  ASSERT_GT(k, 0);
  int64_t n_experts = 0;
  m.model->for_each_routed_expert([&](const ExpertWeights&) { ++n_experts; });
  int64_t last_done = 0;
  const ExpertStoreWriteStats ws =
      write_expert_store(*m.model, dir, [&](int64_t done, int64_t total) {
        last_done = done;
        EXPECT_EQ(total, n_experts);
      });
  EXPECT_EQ(ws.records, n_experts);
  EXPECT_EQ(last_done, n_experts);
  EXPECT_EQ(ws.bytes % kExpertStoreAlign, 0);
  EXPECT_EQ(int64_t(fs::file_size(fs::path(dir) / "experts.bin")), ws.bytes);
  const auto store = ExpertStore::open(dir);
  EXPECT_EQ(store->records(), n_experts);
  EXPECT_EQ(store->architecture(), m.model->info().architecture);
  check_expert_store_source(*store, *m.model);  // its own source: accepted

  const std::vector<int32_t> tokens = load_golden(c.fixture).tokens;
  const int64_t chunks[] = {0, 3};
  std::vector<std::vector<float>> resident;
  for (int64_t chunk : chunks) {
    Session s(*m.model, *be);
    resident.push_back(s.feed(tokens, chunk, true));
  }
  for (int64_t slots : {int64_t(k), int64_t(2 * k + 1)}) {
    ExpertStreamOptions o;
    o.slots = slots;
    o.top_k = k;
    o.prefetch_depth = slots == k ? 0 : 2;
    o.store = store;
    ExpertStreamer streamer(o);
    be->set_expert_provider(&streamer);
    for (size_t ci = 0; ci < std::size(chunks); ++ci)
      for (const char* cache : {"cold", "warm"}) {
        Session s(*m.model, *be);
        EXPECT_TRUE(bitwise_equal(s.feed(tokens, chunks[ci], true), resident[ci]))
            << c.fixture << " " << c.file << " slots " << slots << " chunk " << chunks[ci] << " " << cache;
      }
    const ExpertStreamStats& st = streamer.stats();
    EXPECT_EQ(st.in_place, 0) << "the store serves every expert, owned float stacks too";
    EXPECT_GT(st.bytes_read, 0);
    EXPECT_EQ(st.bytes_read % kExpertStoreAlign, 0);
    EXPECT_EQ(st.hits + st.misses, st.acquires);
    // One aligned read of its record per load (the experts of a model are all the same size).
    const ExpertStoreRecord* first = store->find(0, 0);
    ASSERT_NE(first, nullptr);
    const int64_t per_load = (first->bytes + kExpertStoreAlign - 1) / kExpertStoreAlign * kExpertStoreAlign;
    EXPECT_EQ(st.bytes_read, st.loads() * per_load);
    // file_ranges names the model's own bytes (left out of the load-time page-in), not the store.
    m.model->for_each_routed_expert([&](const ExpertWeights& e) {
      for (const auto& range : streamer.file_ranges(e)) EXPECT_NE(range.path, store->data_path());
    });
    be->set_expert_provider(nullptr);
  }
}

INSTANTIATE_TEST_SUITE_P(
    MoeFamilies, ExpertStoreRoundTrip,
    ::testing::Values(StoreCase{"qwen3_moe_tiny", ""}, StoreCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q4_0.gguf"},
                      StoreCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q8_0.gguf"},
                      StoreCase{"qwen4_exp_tiny", ""}, StoreCase{"gemma4_moe_tiny", ""},
                      StoreCase{"gpt_oss_mxfp4_tiny", ""}, StoreCase{"gpt_oss_tiny", ""}),
    [](const auto& info) {
      std::string n = std::string(info.param.fixture) + "_" + info.param.file;
      for (char& ch : n)
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

// A store next to its model, and a way to rewrite its index.
struct StoreFixture {
  TempDir tmp;
  std::string dir = tmp.str() + "/store";
  std::unique_ptr<Backend> be = make_cpu_backend(2);
  LoadedModel m;
  StoreFixture() {
    m = load_model(fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-q4_0.gguf", *be);
    write_expert_store(*m.model, dir);
  }
  json index() const { return json::parse(std::ifstream(fs::path(dir) / "experts.json")); }
  void write_index(const json& j) const { std::ofstream(fs::path(dir) / "experts.json") << j.dump(); }
  std::string open_error() const {
    try {
      ExpertStore::open(dir);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  // The forward's error when streaming from the store (empty when it ran).
  std::string stream_error() {
    const int k = m.model->experts_per_token();
    ExpertStreamOptions o;
    o.slots = 2 * k;
    o.top_k = k;
    o.store = ExpertStore::open(dir);
    ExpertStreamer streamer(o);
    be->set_expert_provider(&streamer);
    std::string msg;
    try {
      Session s(*m.model, *be);
      s.feed(load_golden("qwen3_moe_gguf_tiny").tokens, 0, true);
    } catch (const Error& e) {
      msg = e.what();
    }
    be->set_expert_provider(nullptr);
    return msg;
  }
};

TEST(ExpertStoreFaults, DamagedRecordFailsItsChecksumNamingTheRecord) {
  StoreFixture f;
  ASSERT_EQ(f.stream_error(), "");
  // One flipped byte inside the second record.
  const json rec = f.index()["records"][1];
  {
    std::fstream data(fs::path(f.dir) / "experts.bin", std::ios::in | std::ios::out | std::ios::binary);
    data.seekg(rec[2].get<int64_t>() + 100);
    char b = 0;
    data.read(&b, 1);
    b ^= 0x10;
    data.seekp(rec[2].get<int64_t>() + 100);
    data.write(&b, 1);
  }
  const std::string msg = f.stream_error();
  EXPECT_NE(msg.find("fails its checksum"), std::string::npos) << msg;
  EXPECT_NE(msg.find(f.dir), std::string::npos) << msg;
}

TEST(ExpertStoreFaults, TruncatedDataAndBrokenIndexAreRefusedAtOpen) {
  StoreFixture f;
  const json good = f.index();
  auto expect_open_error = [&](const json& j, const std::string& want) {
    f.write_index(j);
    const std::string msg = f.open_error();
    EXPECT_NE(msg.find(want), std::string::npos) << "want '" << want << "', got: " << msg;
    EXPECT_NE(msg.find(f.dir), std::string::npos) << msg;
  };
  json j = good;
  j["version"] = 99;
  expect_open_error(j, "version 99");
  j = good;
  j["format"] = "something-else";
  expect_open_error(j, "not a turbospark-expert-store index");
  j = good;
  j["records"][0][2] = good["data_bytes"].get<int64_t>();
  expect_open_error(j, "not an aligned range");
  j = good;
  j["records"][0][2] = 100;
  expect_open_error(j, "not an aligned range");
  j = good;
  j["records"].push_back(good["records"][0]);
  expect_open_error(j, "appears twice");
  j = good;
  j["records"][0][5][0] = 1 << 30;
  expect_open_error(j, "plane offset");
  j = good;
  j["records"][0][4] = "not-hex";
  expect_open_error(j, "not 16 lowercase hex digits");
  j = good;
  j["data"] = "../elsewhere.bin";
  expect_open_error(j, "not a plain name");
  j = good;
  j.erase("records");
  expect_open_error(j, "missing or mistyped field");
  {
    std::ofstream(fs::path(f.dir) / "experts.json") << "{ not json";
    const std::string msg = f.open_error();
    EXPECT_NE(msg.find("malformed JSON"), std::string::npos) << msg;
  }
  f.write_index(good);
  EXPECT_EQ(f.open_error(), "");
  fs::resize_file(fs::path(f.dir) / "experts.bin", good["data_bytes"].get<int64_t>() - 4096);
  const std::string msg = f.open_error();
  EXPECT_NE(msg.find("truncated or rewritten"), std::string::npos) << msg;
  fs::remove(fs::path(f.dir) / "experts.json");
  EXPECT_NE(f.open_error().find("no experts.json"), std::string::npos);
}

// A store of another checkpoint with the very same shapes (here: one record's bytes changed and
// its checksum updated to match, as a store written from other weights would be) is refused before
// any forward, as is one of another format.
TEST(ExpertStoreFaults, StoreOfAnotherCheckpointIsRefused) {
  StoreFixture f;
  json j = f.index();
  const json rec = j["records"][0];
  std::vector<char> bytes(size_t(rec[3].get<int64_t>()));
  {
    std::fstream data(fs::path(f.dir) / "experts.bin", std::ios::in | std::ios::out | std::ios::binary);
    data.seekg(rec[2].get<int64_t>());
    data.read(bytes.data(), std::streamsize(bytes.size()));
    bytes[7] ^= 0x01;
    data.seekp(rec[2].get<int64_t>());
    data.write(bytes.data(), std::streamsize(bytes.size()));
  }
  j["records"][0][4] = fmt::format("{:016x}", expert_store_checksum(bytes.data(), int64_t(bytes.size())));
  f.write_index(j);
  const auto store = ExpertStore::open(f.dir);
  try {
    check_expert_store_source(*store, *f.m.model);
    ADD_FAILURE() << "a foreign store was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("differs from the model's"), std::string::npos) << e.what();
  }
  auto be = make_cpu_backend(2);
  LoadedModel bf16 = load_model(fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-bf16.gguf", *be);
  EXPECT_THROW(check_expert_store_source(*store, *bf16.model), Error);
}

TEST(ExpertStoreFaults, WriterRefusesDenseModelsAndNonEmptyDirectories) {
  TempDir tmp;
  auto be = make_cpu_backend(2);
  LoadedModel dense = load_model(fixture("qwen3_tiny"), *be);
  try {
    write_expert_store(*dense.model, tmp.str() + "/a");
    ADD_FAILURE() << "a dense model was written";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dense model"), std::string::npos) << e.what();
  }
  std::ofstream(tmp.path / "x") << "x";
  LoadedModel moe = load_model(fixture("qwen3_moe_tiny"), *be);
  try {
    write_expert_store(*moe.model, tmp.str());
    ADD_FAILURE() << "a non-empty directory was written into";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not empty"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace turbospark
