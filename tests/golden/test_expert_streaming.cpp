// Expert streaming on the CPU (experts/expert_streamer.h): routed experts read from the
// checkpoint file into a bounded cache of slots give the same logits as resident experts,
// bit for bit, for every MoE family and file format, at every slot budget from top-k to
// 3 x top-k, at several chunk sizes, with cold and warm caches; and disk faults fail cleanly.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/session.h"
#include "experts/expert_streamer.h"
#include "golden/golden.h"
#include "models/registry.h"
#include "test_util.h"

namespace turbospark {
namespace {

using testing::fixture;
using testing::load_golden;

struct StreamCase {
  const char* fixture;
  const char* file;  // inside the fixture folder; "" = the folder itself (safetensors)
  bool streams;      // false: the family keeps its experts in memory it owns (served in place)
};
// Test names in ctest then carry the case, not its bytes (CMakeLists.txt labels some slow).
void PrintTo(const StreamCase& c, std::ostream* os) { *os << c.fixture << "/" << c.file; }

std::string model_path(const StreamCase& c) { return testing::fixture_model(c.fixture, c.file); }
using testing::bitwise_equal;

class ExpertStreaming : public ::testing::TestWithParam<StreamCase> {};

TEST_P(ExpertStreaming, LogitsBitwiseEqualResidentAtEverySlotBudget) {
  const StreamCase& c = GetParam();
  auto be = make_cpu_backend(2);
  LoadedModel m = load_model(model_path(c), *be);
  const int k = m.model->experts_per_token();
  ASSERT_GT(k, 0) << c.fixture;
  const std::vector<int32_t> tokens = load_golden(c.fixture).tokens;
  // Resident logits at each chunk size (chunking changes the CPU kernels' blocking, so
  // streamed and resident are compared at the same chunk).
  const int64_t chunks[] = {0, 1, 3};
  std::vector<std::vector<float>> resident;
  for (int64_t chunk : chunks) {
    Session s(*m.model, *be);
    resident.push_back(s.feed(tokens, chunk, true));
  }
  for (int64_t slots = k; slots <= 3 * k; ++slots) {
    ExpertStreamOptions o;
    o.slots = slots;
    o.top_k = k;
    // Every other budget without prefetch: each load is a miss read on the backend's thread.
    o.prefetch_depth = slots % 2 ? 0 : 2;
    ExpertStreamer streamer(o);
    be->set_expert_provider(&streamer);
    for (size_t ci = 0; ci < std::size(chunks); ++ci) {
      const int64_t chunk = chunks[ci];
      for (const char* cache : {"cold", "warm"}) {  // the second pass starts from what the first left
        Session s(*m.model, *be);
        const std::vector<float> got = s.feed(tokens, chunk, true);
        EXPECT_TRUE(bitwise_equal(got, resident[ci]))
            << c.fixture << " " << c.file << " slots " << slots << " chunk " << chunk << " " << cache;
      }
    }
    const ExpertStreamStats& st = streamer.stats();
    EXPECT_GT(st.acquires, 0);
    if (c.streams) {
      EXPECT_EQ(st.in_place, 0) << c.fixture;
      EXPECT_GT(st.bytes_read, 0) << c.fixture;
      EXPECT_EQ(st.hits + st.misses, st.acquires) << c.fixture;
      EXPECT_LE(st.loads(), st.acquires) << c.fixture;
      EXPECT_GE(st.hit_rate(), 0.0) << c.fixture;
      if (o.prefetch_depth == 0) {
        EXPECT_GT(st.misses, 0) << c.fixture;
        EXPECT_EQ(st.prefetched, 0) << c.fixture;
      } else if (slots > 1) {
        EXPECT_GT(st.prefetched, 0) << c.fixture;
      }
    } else {
      EXPECT_EQ(st.in_place, st.acquires) << c.fixture;
    }
    be->set_expert_provider(nullptr);
  }
}

INSTANTIATE_TEST_SUITE_P(
    MoeFamilies, ExpertStreaming,
    ::testing::Values(StreamCase{"qwen3_moe_tiny", "", true}, StreamCase{"qwen3_moe_norenorm_tiny", "", true},
                      StreamCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-bf16.gguf", true},
                      StreamCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q8_0.gguf", true},
                      StreamCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q4_0.gguf", true},
                      StreamCase{"qwen4_exp_tiny", "", true},
                      // llama.cpp's qwen4exp file: Q8_0 expert stacks, tiled GatedDeltaNet heads.
                      StreamCase{"qwen4_exp_mm_tiny", "qwen4_exp_mm_tiny-q8_0.gguf", true},
                      StreamCase{"gemma4_moe_tiny", "", true},
                      StreamCase{"gpt_oss_mxfp4_tiny", "", true}, StreamCase{"gpt_oss_tiny", "", false}),
    [](const auto& info) {
      std::string n = std::string(info.param.fixture) + "_" + info.param.file;
      for (char& ch : n)
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

// Speculation (--expert-speculate): the next MoE layer's router on this layer's input names
// experts loaded ahead as a guess. Guesses change what the cache holds, never the logits; they
// never take a slot the demand path needs (at 2 x top-k slots a wrong guess still loading once
// left a miss with every slot held, an error: the seed's one-bank lesson; slow reads keep the
// guesses in flight here, and the trained fixture, with a dense layer between its MoE layers,
// guesses wrong often); and they do happen.
TEST(ExpertStreamingSpeculation, LogitsBitwiseEqualAndGuessesNeverStarveDemand) {
  const StreamCase cases[] = {{"qwen3_moe_tiny", "", true},
                              {"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q4_0.gguf", true},
                              {"qwen3_moe_trained_tiny", "", true},
                              {"qwen4_exp_tiny", "", true}};
  auto slow_pread = [](int fd, void* dst, size_t n, off_t off) -> ssize_t {
    ::usleep(200);
    return ::pread(fd, dst, n, off);
  };
  for (const StreamCase& c : cases) {
    auto be = make_cpu_backend(2);
    LoadedModel m = load_model(model_path(c), *be);
    ASSERT_TRUE(m.model->guesses_next_experts()) << c.fixture;
    const int k = m.model->experts_per_token();
    // Trained fixtures keep their tokens in golden.json only (no hidden states to load).
    const std::vector<int32_t> tokens =
        testing::read_json(testing::fixture(c.fixture) + "/golden.json")["tokens"].get<std::vector<int32_t>>();
    const int64_t chunks[] = {0, 1, 2, 3};  // lists of k to 3k experts a layer
    std::vector<std::vector<float>> resident;
    for (int64_t chunk : chunks) {
      Session s(*m.model, *be);
      resident.push_back(s.feed(tokens, chunk, true));
    }
    int64_t guessed = 0, used = 0;
    for (int64_t slots : {2 * k, 2 * k + 1, 3 * k})
      for (int depth : {0, 2, 8})
        for (bool slow : {false, true}) {
        ExpertStreamOptions o;
        o.slots = slots;
        o.top_k = k;
        o.prefetch_depth = depth;
        o.speculate = true;
        if (slow) o.pread_fn = slow_pread;
        ExpertStreamer streamer(o);
        be->set_expert_provider(&streamer);
        ASSERT_TRUE(be->speculates_experts());
        for (size_t ci = 0; ci < std::size(chunks); ++ci) {
          Session s(*m.model, *be);
          const std::vector<float> got = s.feed(tokens, chunks[ci], true);
          EXPECT_TRUE(bitwise_equal(got, resident[ci]))
              << c.fixture << " slots " << slots << " depth " << depth << " slow " << slow << " chunk " << chunks[ci];
        }
        const ExpertStreamStats& st = streamer.stats();
        EXPECT_EQ(st.hits + st.misses, st.acquires) << c.fixture;
        EXPECT_LE(st.speculated_used, st.speculated) << c.fixture;
        EXPECT_LE(st.loads(), st.acquires) << c.fixture;
        guessed += st.speculated;
        used += st.speculated_used;
        be->set_expert_provider(nullptr);
      }
    EXPECT_GT(guessed, 0) << c.fixture << ": no guess was ever loaded";
    EXPECT_GT(used, 0) << c.fixture << ": no guess was ever used";
  }
}

TEST(ExpertStreamingSpeculation, RefusedBelowTwiceTopK) {
  ExpertStreamOptions o;
  o.slots = 7;
  o.top_k = 4;
  o.speculate = true;
  try {
    ExpertStreamer streamer(o);
    ADD_FAILURE() << "7 slots for top-4 with speculation were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 x top_k = 8"), std::string::npos) << e.what();
  }
}

// Faults from the disk: each must end the forward with an Error naming the file, and the
// failed slot must not be reused as if it held the expert.
std::string expect_stream_error(Backend& be, const Model& model, const std::vector<int32_t>& tokens,
                                ExpertStreamOptions o) {
  ExpertStreamer streamer(std::move(o));
  be.set_expert_provider(&streamer);
  std::string msg;
  try {
    Session s(model, be);
    s.feed(tokens, 0, true);
    ADD_FAILURE() << "the forward succeeded";
  } catch (const Error& e) {
    msg = e.what();
  }
  be.set_expert_provider(nullptr);
  return msg;
}

TEST(ExpertStreamingFaults, ShortReadEioAndTruncatedFileFailCleanly) {
  const std::string path = fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-bf16.gguf";
  auto be = make_cpu_backend(2);
  LoadedModel m = load_model(path, *be);
  const std::vector<int32_t> tokens = load_golden("qwen3_moe_gguf_tiny").tokens;
  const int k = m.model->experts_per_token();
  for (int64_t slots : {int64_t(k), int64_t(2 * k)}) {  // one bank (reads on the backend's thread) and two (I/O thread)
    ExpertStreamOptions o;
    o.slots = slots;
    o.top_k = k;
    int calls = 0;
    // EIO on the third read.
    o.pread_fn = [&calls](int fd, void* dst, size_t n, off_t off) -> ssize_t {
      if (++calls == 3) {
        errno = EIO;
        return -1;
      }
      return ::pread(fd, dst, n, off);
    };
    std::string msg = expect_stream_error(*be, *m.model, tokens, o);
    EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    // End of file early (a truncated store): every read returns nothing.
    o.pread_fn = [](int, void*, size_t, off_t) -> ssize_t { return 0; };
    msg = expect_stream_error(*be, *m.model, tokens, o);
    EXPECT_NE(msg.find("short read"), std::string::npos) << msg;
    // The same faults as io_uring completions (the default path where liburing is built in).
    ExpertStreamOptions u;
    u.slots = slots;
    u.top_k = k;
    int completions = 0;
    u.result_fn = [&completions](int64_t res) -> int64_t { return ++completions == 3 ? -EIO : res; };
    msg = expect_stream_error(*be, *m.model, tokens, u);
    EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
    u.result_fn = [](int64_t) -> int64_t { return 0; };
    msg = expect_stream_error(*be, *m.model, tokens, u);
    EXPECT_NE(msg.find("short read"), std::string::npos) << msg;
  }
  // After the faults the same backend and model still run resident, correctly.
  Session s(*m.model, *be);
  EXPECT_EQ(s.feed(tokens, 0, true).size(), tokens.size() * size_t(m.model->info().vocab_size));
}

// A file system that opens O_DIRECT but refuses the read (EINVAL) gets buffered reads instead,
// with the same logits.
TEST(ExpertStreamingFaults, DirectReadRefusedFallsBackToBufferedReads) {
  const std::string path = fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-bf16.gguf";
  const int probe = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (probe < 0) GTEST_SKIP() << "no O_DIRECT on this file system: the buffered path is the only one";
  ::close(probe);
  auto be = make_cpu_backend(2);
  LoadedModel m = load_model(path, *be);
  const std::vector<int32_t> tokens = load_golden("qwen3_moe_gguf_tiny").tokens;
  std::vector<float> want;
  {
    Session s(*m.model, *be);
    want = s.feed(tokens, 0, true);
  }
  for (bool uring : {true, false}) {
    ExpertStreamOptions o;
    o.slots = 2 * m.model->experts_per_token();
    o.top_k = m.model->experts_per_token();
    o.io_uring = uring;
    int refused = 0;
    // The first read refused: it and every later read of the file go buffered.
    o.result_fn = [&refused](int64_t res) -> int64_t { return refused++ < 1 ? -EINVAL : res; };
    ExpertStreamer streamer(o);
    be->set_expert_provider(&streamer);
    Session s(*m.model, *be);
    EXPECT_TRUE(bitwise_equal(s.feed(tokens, 0, true), want)) << "io_uring " << uring;
    EXPECT_GE(refused, 2);
    be->set_expert_provider(nullptr);
  }
}

TEST(ExpertStreamingFaults, FileChangedUnderneathIsRefused) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path() / "ts_stream_changed.gguf";
  std::filesystem::copy_file(fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-bf16.gguf", tmp,
                             std::filesystem::copy_options::overwrite_existing);
  auto be = make_cpu_backend(2);
  LoadedModel m = load_model(tmp.string(), *be);
  const std::vector<int32_t> tokens = load_golden("qwen3_moe_gguf_tiny").tokens;
  ExpertStreamOptions o;
  o.slots = m.model->experts_per_token();
  o.top_k = o.slots;
  ExpertStreamer streamer(o);
  be->set_expert_provider(&streamer);
  {
    Session s(*m.model, *be);
    s.feed(std::vector<int32_t>{tokens[0]}, 0, true);  // opens the file, loads a few experts
  }
  {
    std::ofstream f(tmp, std::ios::app | std::ios::binary);  // grows the file: size and mtime change
    f << "appended";
  }
  try {
    Session s(*m.model, *be);
    s.feed(tokens, 0, true);
    ADD_FAILURE() << "a changed file was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("changed on disk"), std::string::npos) << e.what();
  }
  be->set_expert_provider(nullptr);
  std::filesystem::remove(tmp);
}

TEST(ExpertStreamingFaults, FewerSlotsThanTopKAreRefusedNamingTheMinimum) {
  ExpertStreamOptions o;
  o.slots = 1;
  o.top_k = 2;
  try {
    ExpertStreamer streamer(o);
    ADD_FAILURE() << "1 slot accepted for top-2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace turbospark
