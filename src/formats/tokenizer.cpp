// Byte-level BPE from a Hugging Face tokenizer.json. The reference for every behaviour here is
// the `tokenizers` library (AddedVocabulary, the NFC normalizer, the Split and ByteLevel
// pre-tokenizers, BPE's Word::merge_all, the ByteLevel decoder); where the code follows a quirk
// of that library the comment says so, because matching its ids exactly is the point.
#include "formats/tokenizer.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "core/error.h"
#include "formats/tokenizer_detail.h"
#include "formats/tokenizer_text.h"

namespace turbospark {

// ---------------------------------------------------------------------------------------------
// UTF-8 helpers shared with the GGUF tokenizer (tokenizer_detail.h)

namespace tokenizer_detail {

// The library's decode uses String::from_utf8_lossy, hence its maximal-subpart rule.
Utf8Step utf8_step(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {1, Utf8Kind::kValid, b0};
  size_t width = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  char32_t cp = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    width = 2;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    width = 3;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;  // overlong
    if (b0 == 0xED) hi = 0x9F;  // surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    width = 4;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;  // overlong
    if (b0 == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return {1, Utf8Kind::kInvalid, 0};
  }
  for (size_t k = 1; k < width; ++k) {
    if (i + k >= s.size()) return {k, Utf8Kind::kTruncated, 0};
    const auto b = static_cast<unsigned char>(s[i + k]);
    if (b < lo || b > hi) return {k, Utf8Kind::kInvalid, 0};
    lo = 0x80;
    hi = 0xBF;
    cp = (cp << 6) | (b & 0x3F);
  }
  return {width, Utf8Kind::kValid, cp};
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Byte offset of the first byte that is not valid UTF-8, or npos.
size_t utf8_first_invalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step step = utf8_step(s, i);
    if (step.kind != Utf8Kind::kValid) return i;
    i += step.length;
  }
  return std::string_view::npos;
}

}  // namespace tokenizer_detail

namespace {

using Json = nlohmann::json;
using tokenizer_detail::append_utf8;
using tokenizer_detail::utf8_first_invalid;
using tokenizer_detail::utf8_step;
using tokenizer_detail::Utf8Kind;
using tokenizer_detail::Utf8Step;
using tokenizer_detail::nfc_normalize;
using tokenizer_detail::Regex;
using tokenizer_detail::regex_escape;
using tokenizer_detail::utf8_char_length;

// ---------------------------------------------------------------------------------------------
// UTF-8

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

// Appends bytes, replacing each maximal invalid subpart (and a truncated tail) by U+FFFD.
void append_utf8_lossy(std::string& out, std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    size_t ascii_end = i;
    while (ascii_end < bytes.size() && static_cast<unsigned char>(bytes[ascii_end]) < 0x80) ++ascii_end;
    out.append(bytes.substr(i, ascii_end - i));
    i = ascii_end;
    if (i == bytes.size()) break;
    const Utf8Step step = utf8_step(bytes, i);
    if (step.kind == Utf8Kind::kValid) {
      out.append(bytes.substr(i, step.length));
    } else {
      out.append(kReplacementChar);
    }
    i += step.length;
  }
}

// Length of the trailing bytes that are a valid but unfinished character, which a stream must
// hold back until the next token completes it.
size_t utf8_incomplete_tail(std::string_view bytes) {
  // A character is at most 4 bytes, so only the last 3 can start an unfinished one.
  const size_t from = bytes.size() > 3 ? bytes.size() - 3 : 0;
  for (size_t i = from; i < bytes.size(); ++i) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: not a start
    const Utf8Step step = utf8_step(bytes, i);
    if (step.kind == Utf8Kind::kTruncated) return bytes.size() - i;
  }
  return 0;
}



// ---------------------------------------------------------------------------------------------
// GPT-2's byte <-> character map: printable Latin-1 bytes stand for themselves, the other 68
// bytes map to U+0100.. in byte order, so every byte string becomes a printable string.

struct ByteAlphabet {
  std::array<char32_t, 256> char_of_byte{};
  std::array<int16_t, 0x144> byte_of_char{};  // -1 where the character is no byte's

  ByteAlphabet() {
    byte_of_char.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      char_of_byte[b] = printable ? static_cast<char32_t>(b) : next++;
      byte_of_char[char_of_byte[b]] = static_cast<int16_t>(b);
    }
  }

  static const ByteAlphabet& get() {
    static const ByteAlphabet instance;
    return instance;
  }

  // The bytes a token stands for, as the ByteLevel decoder computes them: if any character is
  // outside the alphabet (an added token such as "中文" or "  "), the token's own UTF-8 is used.
  std::string decode(std::string_view token) const {
    std::string out;
    for (size_t i = 0; i < token.size();) {
      const Utf8Step step = utf8_step(token, i);
      if (step.kind != Utf8Kind::kValid || step.code_point >= byte_of_char.size() ||
          byte_of_char[step.code_point] < 0) {
        return std::string(token);
      }
      out += static_cast<char>(byte_of_char[step.code_point]);
      i += step.length;
    }
    return out;
  }

  // Like decode(), but nullopt when the token is not entirely in the alphabet.
  std::optional<std::string> to_bytes(std::string_view token) const {
    std::string out;
    for (size_t i = 0; i < token.size();) {
      const Utf8Step step = utf8_step(token, i);
      if (step.kind != Utf8Kind::kValid || step.code_point >= byte_of_char.size() ||
          byte_of_char[step.code_point] < 0) {
        return std::nullopt;
      }
      out += static_cast<char>(byte_of_char[step.code_point]);
      i += step.length;
    }
    return out;
  }
};

// ---------------------------------------------------------------------------------------------
// Small helpers

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename Value>
using StringMap = std::unordered_map<std::string, Value, StringHash, std::equal_to<>>;

std::string read_text_file(const std::string& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open {}: {}", path, what, std::strerror(errno));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) fail("{}: cannot read {}", path, what);
  return std::move(buffer).str();
}

Json parse_json(std::string_view text, std::string_view source) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {  // parse errors, and numbers out of range (out_of_range.406)
    fail("{}: malformed JSON: {}", source, e.what());
  }
}

// Field access that names the file and the dotted path at fault.
class JsonReader {
 public:
  explicit JsonReader(std::string source) : source_(std::move(source)) {}

  const std::string& source() const { return source_; }

  const Json& require(const Json& object, std::string_view key, std::string_view path) const {
    if (!object.is_object()) fail("{}: \"{}\" must be an object", source_, parent_of(path));
    const auto it = object.find(key);
    if (it == object.end()) fail("{}: missing \"{}\"", source_, path);
    return *it;
  }

  const Json* optional(const Json& object, std::string_view key) const {
    if (!object.is_object()) return nullptr;
    const auto it = object.find(key);
    return (it == object.end() || it->is_null()) ? nullptr : &*it;
  }

  std::string string(const Json& value, std::string_view path) const {
    if (!value.is_string()) fail("{}: \"{}\" must be a string, got {}", source_, path, value.type_name());
    return value.get<std::string>();
  }

  bool boolean(const Json& object, std::string_view key, std::string_view path, bool fallback) const {
    const Json* value = optional(object, key);
    if (!value) return fallback;
    if (!value->is_boolean()) fail("{}: \"{}\" must be a boolean, got {}", source_, path, value->type_name());
    return value->get<bool>();
  }

  int32_t id(const Json& value, std::string_view path) const {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > INT32_MAX) {
      fail("{}: \"{}\" must be a non-negative 32-bit integer, got {}", source_, path, value.dump());
    }
    return static_cast<int32_t>(value.get<int64_t>());
  }

  std::string type_of(const Json& object, std::string_view path) const {
    return string(require(object, "type", fmt::format("{}.type", path)), fmt::format("{}.type", path));
  }

 private:
  static std::string_view parent_of(std::string_view path) {
    const size_t dot = path.rfind('.');
    return dot == std::string_view::npos ? std::string_view("(root)") : path.substr(0, dot);
  }

  std::string source_;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool normalized = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// Leftmost-longest literal matching over the added tokens, as the library's aho-corasick
// automaton (MatchKind::LeftmostLongest) finds them.
class AddedTokenMatcher {
 public:
  void add(std::string pattern, size_t token_index) {
    if (pattern.empty()) return;  // an empty added token can never match
    by_first_byte_[static_cast<unsigned char>(pattern[0])].push_back(patterns_.size());
    patterns_.push_back({std::move(pattern), token_index});
  }

  bool empty() const { return patterns_.empty(); }

  bool find(std::string_view text, size_t from, size_t& start, size_t& end, size_t& token_index) const {
    for (size_t i = from; i < text.size(); ++i) {
      const auto& candidates = by_first_byte_[static_cast<unsigned char>(text[i])];
      size_t best_length = 0;
      for (const size_t p : candidates) {
        const std::string& pattern = patterns_[p].text;
        if (pattern.size() > best_length && text.compare(i, pattern.size(), pattern) == 0) {
          best_length = pattern.size();
          token_index = patterns_[p].token_index;
        }
      }
      if (best_length) {
        start = i;
        end = i + best_length;
        return true;
      }
    }
    return false;
  }

 private:
  struct Pattern {
    std::string text;
    size_t token_index;
  };
  std::vector<Pattern> patterns_;
  std::array<std::vector<size_t>, 256> by_first_byte_;
};

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel };
  Kind kind = Kind::kSplit;
  // kSplit
  std::unique_ptr<Regex> regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // kByteLevel
  bool add_prefix_space = false;
  bool use_regex = false;  // split with GPT-2's pattern (gpt2_regex) before mapping bytes
};

// One piece of the text on its way to ids: either an added token already or text still to
// pre-tokenize and run through BPE.
struct Segment {
  std::string_view text;
  int32_t id = -1;
};

// GPT-2's pre-tokenizer pattern, used by ByteLevel when use_regex is set.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Words at most this long are cached; the cache stops growing at kWordCacheCapacity entries
// (the library does the same with 10,000) so adversarial input cannot grow it without bound.
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kWordCacheCapacity = 65536;

// ---------------------------------------------------------------------------------------------

// A Hugging Face tokenizer.json byte-level BPE.
struct HfBpeTokenizer final : Tokenizer::Impl {
  // Model vocab: byte-level text -> id. Added tokens are separate, as in the library.
  StringMap<int32_t> vocab;
  StringMap<int32_t> vocab_by_bytes;  // raw bytes -> id; filled only when ignore_merges
  std::vector<std::string> token_texts;  // [vocab_size] raw token text, empty where none
  std::vector<std::string> token_bytes;  // [vocab_size] what the ByteLevel decoder emits per id
  std::vector<uint8_t> token_flags;      // [vocab_size] kHasToken | kAdded | kSpecial
  static constexpr uint8_t kHasToken = 1, kAdded = 2, kSpecial = 4;

  struct MergeRule {
    int32_t rank;
    int32_t new_id;
  };
  std::unordered_map<uint64_t, MergeRule> merges;  // (left id << 32 | right id) -> rule
  std::array<int32_t, 256> byte_ids{};             // id of each single-byte token, -1 if absent
  bool ignore_merges = false;
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;

  bool nfc = false;
  std::vector<PreTokenizerStep> pre_steps;
  std::unique_ptr<Regex> gpt2_regex;

  std::vector<AddedToken> added;
  StringMap<size_t> added_by_content;
  AddedTokenMatcher raw_matcher;         // tokens with normalized=false, matched on the input
  AddedTokenMatcher normalized_matcher;  // tokens with normalized=true, matched after NFC
  std::unique_ptr<Regex> word_char;      // the Rust regex crate's \w, for single_word
  std::unique_ptr<Regex> space_char;     // the Rust regex crate's \s, for lstrip/rstrip

  std::vector<int32_t> template_prefix, template_suffix;  // post-processor "single" template

  mutable std::mutex cache_mutex;
  mutable StringMap<std::vector<int32_t>> word_cache;  // raw bytes of a pre-token -> ids

  // --- loading ---
  void load(const Json& root, const JsonReader& reader);
  void load_model(const Json& model, const JsonReader& reader);
  void load_normalizer(const Json* normalizer, const JsonReader& reader);
  void load_pre_tokenizer(const Json* pre_tokenizer, const JsonReader& reader);
  void load_post_processor(const Json* post_processor, const JsonReader& reader);
  void load_decoder(const Json* decoder, const JsonReader& reader);
  void add_token(AddedToken token, const std::string& where);
  void load_config(const Json& config, const JsonReader& reader);
  void finish();

  // --- Tokenizer::Impl ---
  std::vector<int32_t> encode(std::string_view text, bool parse_special, bool add_special) const override;
  void append_piece(int32_t id, bool skip_special, bool first, std::string& bytes) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(token_flags.size()); }
  std::optional<int32_t> token_id(std::string_view token) const override;
  std::string_view token_text(int32_t id) const override;
  bool is_special(int32_t id) const override {
    return id >= 0 && static_cast<size_t>(id) < token_flags.size() && (token_flags[id] & kSpecial);
  }

  // --- encoding ---
  void split_added(std::string_view text, const AddedTokenMatcher& matcher, bool parse_special,
                   std::vector<Segment>& out) const;
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  void split_piece(const PreTokenizerStep& step, std::string_view piece,
                   std::vector<std::string_view>& out) const;
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& out) const;

  // Ids may leave gaps (reserved ids), but not run far past the number of tokens: the id table
  // is sized by the largest one.
  static constexpr int64_t kMaxIdSlack = 65536;

  void ensure_id(int32_t id) {
    if (static_cast<size_t>(id) >= token_texts.size()) {
      token_texts.resize(id + 1);
      token_bytes.resize(id + 1);
      token_flags.resize(id + 1, 0);
    }
  }
};

}  // namespace

void HfBpeTokenizer::load(const Json& root, const JsonReader& reader) {
  if (!root.is_object()) fail("{}: top level must be a JSON object", reader.source());
  for (const char* unsupported : {"truncation", "padding"}) {
    if (reader.optional(root, unsupported)) {
      fail("{}: \"{}\" is set; truncation and padding inside the tokenizer are not supported",
           reader.source(), unsupported);
    }
  }
  load_model(reader.require(root, "model", "model"), reader);
  load_normalizer(reader.optional(root, "normalizer"), reader);
  load_pre_tokenizer(reader.optional(root, "pre_tokenizer"), reader);
  load_decoder(reader.optional(root, "decoder"), reader);

  if (const Json* tokens = reader.optional(root, "added_tokens")) {
    if (!tokens->is_array()) fail("{}: \"added_tokens\" must be an array", reader.source());
    for (size_t i = 0; i < tokens->size(); ++i) {
      const Json& t = (*tokens)[i];
      const std::string path = fmt::format("added_tokens[{}]", i);
      AddedToken token;
      token.id = reader.id(reader.require(t, "id", path + ".id"), path + ".id");
      token.content = reader.string(reader.require(t, "content", path + ".content"), path + ".content");
      token.special = reader.boolean(t, "special", path + ".special", false);
      // The library's AddedToken defaults normalized to !special when the field is absent.
      token.normalized = reader.boolean(t, "normalized", path + ".normalized", !token.special);
      token.lstrip = reader.boolean(t, "lstrip", path + ".lstrip", false);
      token.rstrip = reader.boolean(t, "rstrip", path + ".rstrip", false);
      token.single_word = reader.boolean(t, "single_word", path + ".single_word", false);
      add_token(std::move(token), fmt::format("{}: {}", reader.source(), path));
    }
  }
  // After added tokens: a TemplateProcessing template names them.
  load_post_processor(reader.optional(root, "post_processor"), reader);
}

void HfBpeTokenizer::load_model(const Json& model, const JsonReader& reader) {
  if (!model.is_object()) fail("{}: \"model\" must be an object", reader.source());
  std::string type;
  if (const Json* t = reader.optional(model, "type")) {
    type = reader.string(*t, "model.type");
  } else if (model.contains("merges")) {
    type = "BPE";  // old files have no type; the library then recognises BPE by its fields
  } else {
    fail("{}: missing \"model.type\"", reader.source());
  }
  if (type != "BPE") {
    fail("{}: unsupported model type \"{}\" in \"model.type\" (only byte-level BPE is supported)",
         reader.source(), type);
  }
  if (const Json* dropout = reader.optional(model, "dropout")) {
    if (!dropout->is_number() || dropout->get<double>() != 0.0) {
      fail("{}: \"model.dropout\" = {} is not supported (BPE dropout makes encoding random)",
           reader.source(), dropout->dump());
    }
  }
  if (reader.boolean(model, "byte_fallback", "model.byte_fallback", false)) {
    fail("{}: \"model.byte_fallback\" = true is not supported (only byte-level BPE)", reader.source());
  }
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const Json* value = reader.optional(model, affix)) {
      if (!reader.string(*value, fmt::format("model.{}", affix)).empty()) {
        fail("{}: \"model.{}\" = {} is not supported (byte-level BPE uses none)", reader.source(), affix,
             value->dump());
      }
    }
  }
  ignore_merges = reader.boolean(model, "ignore_merges", "model.ignore_merges", false);
  fuse_unk = reader.boolean(model, "fuse_unk", "model.fuse_unk", false);

  const Json& vocab_json = reader.require(model, "vocab", "model.vocab");
  if (!vocab_json.is_object()) fail("{}: \"model.vocab\" must be an object", reader.source());
  vocab.reserve(vocab_json.size());
  int32_t max_id = -1;
  for (const auto& [text, id_json] : vocab_json.items()) {
    // The path is formatted only for a bad entry: this loop runs 150k times for Qwen.
    const int32_t id = id_json.is_number_unsigned() && id_json.get<uint64_t>() <= INT32_MAX
                           ? static_cast<int32_t>(id_json.get<uint64_t>())
                           : reader.id(id_json, fmt::format("model.vocab[{}]", Json(text).dump()));
    if (!vocab.emplace(text, id).second) fail("{}: \"model.vocab\": token {} appears twice", reader.source(), Json(text).dump());
    max_id = std::max(max_id, id);
  }
  // The id table is sized by the largest id: refuse ids far past the vocabulary's size before
  // allocating (a 17 KB file whose vocabulary claimed id 5555213 took 357 MB; 2^31 - 1 would
  // ask for ~100 GB). Real vocabularies are dense.
  if (int64_t(max_id) >= kMaxIdSlack + 2 * int64_t(vocab.size()))
    fail("{}: \"model.vocab\": id {} is implausible for a vocabulary of {} tokens (ids must be below {})", reader.source(),
         max_id, vocab.size(), kMaxIdSlack + 2 * int64_t(vocab.size()));
  token_texts.resize(max_id + 1);
  token_bytes.resize(max_id + 1);
  token_flags.assign(max_id + 1, 0);
  const ByteAlphabet& alphabet = ByteAlphabet::get();
  for (const auto& [text, id] : vocab) {
    if (token_flags[id] & kHasToken) {
      fail("{}: \"model.vocab\": id {} is used by both {} and {}", reader.source(), id,
           Json(token_texts[id]).dump(), Json(text).dump());
    }
    token_flags[id] = kHasToken;
    token_texts[id] = text;
    token_bytes[id] = alphabet.decode(text);
    if (ignore_merges) {
      // Only tokens made of alphabet characters can equal a byte-mapped pre-token.
      if (auto bytes = alphabet.to_bytes(text)) vocab_by_bytes.emplace(std::move(*bytes), id);
    }
  }
  for (int b = 0; b < 256; ++b) {
    std::string text;
    append_utf8(text, alphabet.char_of_byte[b]);
    const auto it = vocab.find(text);
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
  }

  if (const Json* unk = reader.optional(model, "unk_token")) {
    const std::string text = reader.string(*unk, "model.unk_token");
    const auto it = vocab.find(text);
    if (it == vocab.end()) fail("{}: \"model.unk_token\" {} is not in \"model.vocab\"", reader.source(), unk->dump());
    unk_id = it->second;
  }

  const Json& merges_json = reader.require(model, "merges", "model.merges");
  if (!merges_json.is_array()) fail("{}: \"model.merges\" must be an array", reader.source());
  merges.reserve(merges_json.size());
  for (size_t rank = 0; rank < merges_json.size(); ++rank) {
    const Json& m = merges_json[rank];
    std::string left, right;
    if (m.is_string()) {
      // Legacy form "a b"; byte-level tokens never contain a space (it maps to U+0120).
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos) {
        fail("{}: \"model.merges[{}]\" = {} is not two tokens separated by a space", reader.source(), rank, m.dump());
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      fail("{}: \"model.merges[{}]\" = {} must be \"a b\" or [\"a\", \"b\"]", reader.source(), rank, m.dump());
    }
    const auto l = vocab.find(left);
    const auto r = vocab.find(right);
    const auto merged = vocab.find(left + right);
    if (l == vocab.end() || r == vocab.end() || merged == vocab.end()) {
      const std::string& missing = l == vocab.end() ? left : r == vocab.end() ? right : left + right;
      fail("{}: \"model.merges[{}]\": token {} is not in \"model.vocab\"", reader.source(), rank, Json(missing).dump());
    }
    // A repeated pair keeps its last rank, as the library's HashMap collect does.
    merges[(uint64_t(uint32_t(l->second)) << 32) | uint32_t(r->second)] =
        MergeRule{static_cast<int32_t>(rank), merged->second};
  }
}

void HfBpeTokenizer::load_normalizer(const Json* normalizer, const JsonReader& reader) {
  if (!normalizer) return;
  const std::string type = reader.type_of(*normalizer, "normalizer");
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const Json& list = reader.require(*normalizer, "normalizers", "normalizer.normalizers");
    if (!list.is_array()) fail("{}: \"normalizer.normalizers\" must be an array", reader.source());
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string path = fmt::format("normalizer.normalizers[{}]", i);
      const std::string inner = reader.type_of(list[i], path);
      if (inner != "NFC") fail("{}: unsupported normalizer type \"{}\" in \"{}.type\" (only NFC is supported)", reader.source(), inner, path);
      nfc = true;
    }
  } else {
    fail("{}: unsupported normalizer type \"{}\" in \"normalizer.type\" (only NFC is supported)", reader.source(), type);
  }
}

void HfBpeTokenizer::load_pre_tokenizer(const Json* pre_tokenizer, const JsonReader& reader) {
  if (!pre_tokenizer) {
    fail("{}: \"pre_tokenizer\" is null; a byte-level BPE needs a ByteLevel pre-tokenizer", reader.source());
  }
  std::vector<std::pair<const Json*, std::string>> steps;
  const std::string type = reader.type_of(*pre_tokenizer, "pre_tokenizer");
  if (type == "Sequence") {
    const Json& list = reader.require(*pre_tokenizer, "pretokenizers", "pre_tokenizer.pretokenizers");
    if (!list.is_array()) fail("{}: \"pre_tokenizer.pretokenizers\" must be an array", reader.source());
    for (size_t i = 0; i < list.size(); ++i) steps.emplace_back(&list[i], fmt::format("pre_tokenizer.pretokenizers[{}]", i));
  } else {
    steps.emplace_back(pre_tokenizer, "pre_tokenizer");
  }
  for (const auto& [json, path] : steps) {
    const std::string step_type = reader.type_of(*json, path);
    PreTokenizerStep step;
    if (step_type == "Split") {
      step.kind = PreTokenizerStep::Kind::kSplit;
      const Json& pattern = reader.require(*json, "pattern", path + ".pattern");
      std::string regex;
      if (const Json* r = reader.optional(pattern, "Regex")) {
        regex = reader.string(*r, path + ".pattern.Regex");
      } else if (const Json* s = reader.optional(pattern, "String")) {
        const std::string literal = reader.string(*s, path + ".pattern.String");
        if (literal.empty()) fail("{}: \"{}.pattern.String\" is empty", reader.source(), path);
        regex = regex_escape(literal);
      } else {
        fail("{}: \"{}.pattern\" must hold \"Regex\" or \"String\", got {}", reader.source(), path, pattern.dump());
      }
      step.regex = std::make_unique<Regex>(regex, fmt::format("{}: \"{}.pattern\"", reader.source(), path));
      const std::string behavior = reader.string(reader.require(*json, "behavior", path + ".behavior"), path + ".behavior");
      static const std::pair<const char*, SplitBehavior> kBehaviors[] = {
          {"Removed", SplitBehavior::kRemoved},
          {"Isolated", SplitBehavior::kIsolated},
          {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
          {"MergedWithNext", SplitBehavior::kMergedWithNext},
          {"Contiguous", SplitBehavior::kContiguous}};
      const auto* found = std::find_if(std::begin(kBehaviors), std::end(kBehaviors),
                                       [&](const auto& b) { return behavior == b.first; });
      if (found == std::end(kBehaviors)) fail("{}: unsupported split behavior \"{}\" in \"{}.behavior\"", reader.source(), behavior, path);
      step.behavior = found->second;
      step.invert = reader.boolean(*json, "invert", path + ".invert", false);
      if (!pre_steps.empty() && pre_steps.back().kind == PreTokenizerStep::Kind::kByteLevel) {
        fail("{}: \"{}\" is a Split after ByteLevel; ByteLevel must be the last pre-tokenizer", reader.source(), path);
      }
    } else if (step_type == "ByteLevel") {
      step.kind = PreTokenizerStep::Kind::kByteLevel;
      // Defaults are the library's ByteLevel::default().
      step.add_prefix_space = reader.boolean(*json, "add_prefix_space", path + ".add_prefix_space", true);
      step.use_regex = reader.boolean(*json, "use_regex", path + ".use_regex", true);
      if (step.use_regex && !gpt2_regex) gpt2_regex = std::make_unique<Regex>(kGpt2Pattern, "ByteLevel pattern");
      if (!pre_steps.empty() && pre_steps.back().kind == PreTokenizerStep::Kind::kByteLevel) {
        fail("{}: \"{}\" is a second ByteLevel pre-tokenizer", reader.source(), path);
      }
    } else {
      fail("{}: unsupported pre_tokenizer type \"{}\" in \"{}.type\" (supported: Sequence, Split, ByteLevel)",
           reader.source(), step_type, path);
    }
    pre_steps.push_back(std::move(step));
  }
  if (pre_steps.empty() || pre_steps.back().kind != PreTokenizerStep::Kind::kByteLevel) {
    fail("{}: \"pre_tokenizer\" must end with a ByteLevel pre-tokenizer for byte-level BPE", reader.source());
  }
}

void HfBpeTokenizer::load_post_processor(const Json* post_processor, const JsonReader& reader) {
  if (!post_processor) return;
  std::vector<std::pair<const Json*, std::string>> steps;
  const std::string type = reader.type_of(*post_processor, "post_processor");
  if (type == "Sequence") {
    const Json& list = reader.require(*post_processor, "processors", "post_processor.processors");
    if (!list.is_array()) fail("{}: \"post_processor.processors\" must be an array", reader.source());
    for (size_t i = 0; i < list.size(); ++i) steps.emplace_back(&list[i], fmt::format("post_processor.processors[{}]", i));
  } else {
    steps.emplace_back(post_processor, "post_processor");
  }
  bool have_template = false;
  for (const auto& [json, path] : steps) {
    const std::string step_type = reader.type_of(*json, path);
    if (step_type == "ByteLevel") continue;  // only adjusts offsets, which encode() does not return
    if (step_type != "TemplateProcessing") {
      fail("{}: unsupported post_processor type \"{}\" in \"{}.type\" (supported: ByteLevel, TemplateProcessing, Sequence)",
           reader.source(), step_type, path);
    }
    if (have_template) fail("{}: \"{}\" is a second TemplateProcessing", reader.source(), path);
    have_template = true;
    const Json& single = reader.require(*json, "single", path + ".single");
    const Json& specials = reader.require(*json, "special_tokens", path + ".special_tokens");
    if (!single.is_array()) fail("{}: \"{}.single\" must be an array", reader.source(), path);
    bool seen_sequence = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string item_path = fmt::format("{}.single[{}]", path, i);
      if (const Json* seq = reader.optional(single[i], "Sequence")) {
        const std::string name = reader.string(reader.require(*seq, "id", item_path + ".Sequence.id"), item_path + ".Sequence.id");
        if (name != "A" || seen_sequence) fail("{}: \"{}\": a single-sequence template must use sequence A once", reader.source(), item_path);
        seen_sequence = true;
      } else if (const Json* special = reader.optional(single[i], "SpecialToken")) {
        const std::string name = reader.string(reader.require(*special, "id", item_path + ".SpecialToken.id"), item_path + ".SpecialToken.id");
        const std::string entry_path = fmt::format("{}.special_tokens[{}]", path, Json(name).dump());
        const Json& entry = reader.require(specials, name, entry_path);
        const Json& ids = reader.require(entry, "ids", entry_path + ".ids");
        if (!ids.is_array()) fail("{}: \"{}.ids\" must be an array", reader.source(), entry_path);
        for (const Json& id : ids) (seen_sequence ? template_suffix : template_prefix).push_back(reader.id(id, entry_path + ".ids"));
      } else {
        fail("{}: \"{}\" must hold \"Sequence\" or \"SpecialToken\", got {}", reader.source(), item_path, single[i].dump());
      }
    }
    if (!seen_sequence) fail("{}: \"{}.single\" never places sequence A", reader.source(), path);
  }
}

void HfBpeTokenizer::load_decoder(const Json* decoder, const JsonReader& reader) {
  if (!decoder) fail("{}: \"decoder\" is null; byte-level BPE needs the ByteLevel decoder", reader.source());
  const std::string type = reader.type_of(*decoder, "decoder");
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const Json& list = reader.require(*decoder, "decoders", "decoder.decoders");
    if (!list.is_array() || list.size() != 1) {
      fail("{}: \"decoder.decoders\" must be a single ByteLevel decoder", reader.source());
    }
    const std::string inner = reader.type_of(list[0], "decoder.decoders[0]");
    if (inner == "ByteLevel") return;
    fail("{}: unsupported decoder type \"{}\" in \"decoder.decoders[0].type\" (only ByteLevel is supported)", reader.source(), inner);
  }
  fail("{}: unsupported decoder type \"{}\" in \"decoder.type\" (only ByteLevel is supported)", reader.source(), type);
}

void HfBpeTokenizer::add_token(AddedToken token, const std::string& where) {
  if (token.content.empty()) fail("{}: added token {} has empty content", where, token.id);
  if (utf8_first_invalid(token.content) != std::string_view::npos) fail("{}: added token {} is not valid UTF-8", where, token.id);
  if (const auto it = added_by_content.find(token.content); it != added_by_content.end()) {
    if (added[it->second].id != token.id) {
      fail("{}: added token {} has id {} but was already added with id {}", where, Json(token.content).dump(),
           token.id, added[it->second].id);
    }
    return;  // the same token twice
  }
  if (int64_t(token.id) >= kMaxIdSlack + 2 * int64_t(vocab.size() + added.size()))
    fail("{}: added token {} has id {}, implausible for a vocabulary of {} tokens (ids must be below {})", where,
         Json(token.content).dump(), token.id, vocab.size() + added.size(),
         kMaxIdSlack + 2 * int64_t(vocab.size() + added.size()));
  ensure_id(token.id);
  // A vocab token under the same id is shadowed (the library looks added tokens up first), but
  // two added tokens with one id are a broken file.
  if (token_flags[token.id] & kAdded) {
    fail("{}: added tokens {} and {} share id {}", where, Json(token_texts[token.id]).dump(),
         Json(token.content).dump(), token.id);
  }
  token_texts[token.id] = token.content;
  token_bytes[token.id] = ByteAlphabet::get().decode(token.content);
  token_flags[token.id] = kHasToken | kAdded | (token.special ? kSpecial : 0);
  added_by_content.emplace(token.content, added.size());
  added.push_back(std::move(token));
}

void HfBpeTokenizer::load_config(const Json& config, const JsonReader& reader) {
  if (!config.is_object()) fail("{}: top level must be a JSON object", reader.source());
  if (const Json* decoder = reader.optional(config, "added_tokens_decoder")) {
    if (!decoder->is_object()) fail("{}: \"added_tokens_decoder\" must be an object", reader.source());
    for (const auto& [key, t] : decoder->items()) {
      const std::string path = fmt::format("added_tokens_decoder[{}]", Json(key).dump());
      int32_t id = -1;
      try {
        size_t used = 0;
        const long value = std::stol(key, &used);
        if (used == key.size() && value >= 0 && value <= INT32_MAX) id = static_cast<int32_t>(value);
      } catch (const std::exception&) {
      }
      if (id < 0) fail("{}: \"{}\": key must be a token id", reader.source(), path);
      AddedToken token;
      token.id = id;
      token.content = reader.string(reader.require(t, "content", path + ".content"), path + ".content");
      token.special = reader.boolean(t, "special", path + ".special", false);
      token.normalized = reader.boolean(t, "normalized", path + ".normalized", !token.special);
      token.lstrip = reader.boolean(t, "lstrip", path + ".lstrip", false);
      token.rstrip = reader.boolean(t, "rstrip", path + ".rstrip", false);
      token.single_word = reader.boolean(t, "single_word", path + ".single_word", false);
      // tokenizer.json is authoritative; the config may only add ids it lacks.
      if (static_cast<size_t>(id) < token_flags.size() && (token_flags[id] & kAdded)) {
        if (token_texts[id] != token.content) {
          fail("{}: \"{}\" = {} disagrees with tokenizer.json's added token {} for that id", reader.source(), path,
               Json(token.content).dump(), Json(token_texts[id]).dump());
        }
        continue;
      }
      add_token(std::move(token), fmt::format("{}: {}", reader.source(), path));
    }
  }
  const auto resolve = [&](const char* key, std::optional<int32_t>& out) {
    const Json* value = reader.optional(config, key);
    if (!value) return;
    std::string content;
    if (value->is_string()) {
      content = value->get<std::string>();
    } else if (value->is_object()) {
      content = reader.string(reader.require(*value, "content", fmt::format("{}.content", key)), fmt::format("{}.content", key));
    } else {
      fail("{}: \"{}\" must be a string or an object with \"content\", got {}", reader.source(), key, value->dump());
    }
    if (const auto it = added_by_content.find(content); it != added_by_content.end()) {
      out = added[it->second].id;
    } else if (const auto v = vocab.find(content); v != vocab.end()) {
      out = v->second;
    } else {
      fail("{}: \"{}\" = {} names no token in the vocabulary", reader.source(), key, Json(content).dump());
    }
  };
  resolve("eos_token", eos_id);
  resolve("bos_token", bos_id);
  resolve("pad_token", pad_id);
}

void HfBpeTokenizer::finish() {
  bool needs_word_char = false, needs_space_char = false;
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& t = added[i];
    if (t.normalized) {
      // Normalized tokens are matched against normalized text, so their patterns are too.
      normalized_matcher.add(nfc ? nfc_normalize(t.content) : t.content, i);
    } else {
      raw_matcher.add(t.content, i);
    }
    needs_word_char |= t.single_word;
    needs_space_char |= t.lstrip || t.rstrip;
  }
  if (needs_word_char) word_char = std::make_unique<Regex>(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])", "single_word class");
  if (needs_space_char) space_char = std::make_unique<Regex>(R"(\p{White_Space})", "lstrip/rstrip class");
}

// The library's AddedVocabulary::find_matches.
void HfBpeTokenizer::split_added(std::string_view text, const AddedTokenMatcher& matcher, bool parse_special,
                                  std::vector<Segment>& out) const {
  if (text.empty()) return;
  if (matcher.empty()) {
    out.push_back({text, -1});
    return;
  }
  const auto previous_char = [&](size_t pos) {
    size_t p = pos - 1;
    while (p > 0 && (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80) --p;
    return p;
  };
  size_t start_offset = 0;
  size_t search_from = 0;
  size_t match_start = 0, match_end = 0, index = 0;
  while (matcher.find(text, search_from, match_start, match_end, index)) {
    // The automaton resumes after the raw match even when lstrip/rstrip widen it or the match
    // is discarded below.
    search_from = match_end;
    const AddedToken& token = added[index];
    if (!parse_special && token.special) continue;
    size_t start = match_start, stop = match_end;
    if (token.single_word) {
      const bool space_before = start == 0 || !word_char->matches_at(text, previous_char(start));
      const bool space_after = stop == text.size() || !word_char->matches_at(text, stop);
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) {
      size_t new_start = start;
      while (new_start > 0) {
        const size_t p = previous_char(new_start);
        if (!space_char->matches_at(text, p)) break;
        new_start = p;
      }
      // The previous match may already have taken those spaces.
      start = std::max(new_start, start_offset);
    }
    if (token.rstrip) {
      while (stop < text.size() && space_char->matches_at(text, stop)) stop += utf8_char_length(text, stop);
    }
    if (start > start_offset) out.push_back({text.substr(start_offset, start - start_offset), -1});
    out.push_back({text.substr(start, stop - start), token.id});
    start_offset = stop;
  }
  if (start_offset < text.size()) out.push_back({text.substr(start_offset), -1});
}

// The library's NormalizedString::split for one Split pre-tokenizer step.
void HfBpeTokenizer::split_piece(const PreTokenizerStep& step, std::string_view piece,
                                  std::vector<std::string_view>& out) const {
  struct Span {
    size_t start, end;
    bool is_match;
  };
  std::vector<Span> spans;
  size_t previous = 0;
  step.regex->for_each_match(piece, [&](size_t start, size_t end) {
    if (start != previous) spans.push_back({previous, start, false});
    spans.push_back({start, end, true});
    previous = end;
  });
  if (previous != piece.size()) spans.push_back({previous, piece.size(), false});
  if (step.invert) {
    for (Span& s : spans) s.is_match = !s.is_match;
  }

  struct Part {
    size_t start, end;
    bool removed;
  };
  std::vector<Part> parts;
  switch (step.behavior) {
    case SplitBehavior::kIsolated:
      for (const Span& s : spans) parts.push_back({s.start, s.end, false});
      break;
    case SplitBehavior::kRemoved:
      for (const Span& s : spans) parts.push_back({s.start, s.end, s.is_match});
      break;
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !parts.empty()) {
          parts.back().end = s.end;
        } else {
          parts.push_back({s.start, s.end, false});
        }
        previous_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !parts.empty()) {
          parts.back().end = s.end;
        } else {
          parts.push_back({s.start, s.end, false});
        }
        previous_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !parts.empty()) {
          parts.back().start = it->start;
        } else {
          parts.push_back({it->start, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(parts.begin(), parts.end());
      break;
    }
  }
  for (const Part& p : parts) {
    if (!p.removed && p.end > p.start) out.push_back(piece.substr(p.start, p.end - p.start));
  }
}

// Pre-tokenizes one stretch of normalized text (no added tokens inside) and appends its ids.
void HfBpeTokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::deque<std::string> prefixed;  // pieces given a prefix space; a deque keeps views valid
  std::vector<std::string_view> pieces{text}, next;
  for (const PreTokenizerStep& step : pre_steps) {
    next.clear();
    for (const std::string_view piece : pieces) {
      if (step.kind == PreTokenizerStep::Kind::kSplit) {
        split_piece(step, piece, next);
        continue;
      }
      std::string_view p = piece;
      // The library prepends the space to every piece reaching ByteLevel, not just the first.
      if (step.add_prefix_space && p[0] != ' ') {
        std::string& with_space = prefixed.emplace_back();
        with_space.reserve(p.size() + 1);
        with_space += ' ';
        with_space += p;
        p = with_space;
      }
      if (step.use_regex) {
        // Isolated split: gaps between matches stay pieces too (GPT-2's pattern leaves none).
        size_t previous = 0;
        gpt2_regex->for_each_match(p, [&](size_t start, size_t end) {
          if (start > previous) next.push_back(p.substr(previous, start - previous));
          if (end > start) next.push_back(p.substr(start, end - start));
          previous = end;
        });
        if (previous < p.size()) next.push_back(p.substr(previous));
      } else {
        next.push_back(p);
      }
    }
    pieces.swap(next);
  }
  for (const std::string_view piece : pieces) bpe(piece, out);
}

void HfBpeTokenizer::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    // The library emits a pre-token that is itself a vocab token whole, merges or not.
    if (const auto it = vocab_by_bytes.find(word); it != vocab_by_bytes.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() > kMaxCachedWordBytes) {
    bpe_uncached(word, out);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (const auto it = word_cache.find(word); it != word_cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  bpe_uncached(word, out);
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (word_cache.size() < kWordCacheCapacity) {
    word_cache.emplace(std::string(word), std::vector<int32_t>(out.begin() + first, out.end()));
  }
}

// The library's Word::merge_all: repeatedly apply the lowest-ranked merge among adjacent
// symbols, leftmost first on ties, using a heap of candidate merges that are re-validated when
// popped (an entry goes stale when either of its symbols was merged away).
void HfBpeTokenizer::bpe_uncached(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // indices into symbols, -1 at the ends
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  const auto append = [&](int32_t id) {
    const auto n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, true});
  };
  // Each byte is one character of the byte-level string; one missing from the vocab becomes
  // unk_token (fused when fuse_unk) or, with no unk_token, is dropped, as in the library.
  bool pending_unk = false;
  for (const char c : word) {
    const int32_t id = byte_ids[static_cast<unsigned char>(c)];
    if (id >= 0) {
      if (pending_unk) append(*unk_id);
      pending_unk = false;
      append(id);
    } else if (unk_id) {
      if (pending_unk && !fuse_unk) append(*unk_id);
      pending_unk = true;
    }
  }
  if (pending_unk) append(*unk_id);

  struct Candidate {
    int32_t rank, pos, new_id;
  };
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
  const auto rule_for = [&](int32_t left, int32_t right) -> const MergeRule* {
    const auto it = merges.find((uint64_t(uint32_t(left)) << 32) | uint32_t(right));
    return it == merges.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeRule* rule = rule_for(symbols[i].id, symbols[i + 1].id)) {
      queue.push({rule->rank, static_cast<int32_t>(i), rule->new_id});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const int32_t right_pos = left.next;
    const Symbol right = symbols[right_pos];
    const MergeRule* rule = rule_for(left.id, right.id);
    if (!rule || rule->new_id != top.new_id) continue;  // stale entry
    left.id = top.new_id;
    left.next = right.next;
    symbols[right_pos].alive = false;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) {
      if (const MergeRule* r = rule_for(symbols[left.prev].id, left.id)) queue.push({r->rank, left.prev, r->new_id});
    }
    if (left.next >= 0) {
      if (const MergeRule* r = rule_for(left.id, symbols[left.next].id)) queue.push({r->rank, top.pos, r->new_id});
    }
  }
  for (const Symbol& s : symbols) {
    if (s.alive) out.push_back(s.id);
  }
}

// ---------------------------------------------------------------------------------------------

std::vector<int32_t> HfBpeTokenizer::encode(std::string_view text, bool parse_special, bool add_special) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special) ids = template_prefix;
  std::vector<Segment> raw_segments, normalized_segments;
  split_added(text, raw_matcher, parse_special, raw_segments);
  for (const Segment& segment : raw_segments) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
      continue;
    }
    // Added tokens with normalized=false were matched on the raw text above; the rest of the
    // text is normalized, then searched for normalized=true tokens.
    const std::string normalized = nfc ? nfc_normalize(segment.text) : std::string(segment.text);
    normalized_segments.clear();
    split_added(normalized, normalized_matcher, parse_special, normalized_segments);
    for (const Segment& inner : normalized_segments) {
      if (inner.id >= 0) {
        ids.push_back(inner.id);
      } else {
        encode_text(inner.text, ids);
      }
    }
  }
  if (add_special) ids.insert(ids.end(), template_suffix.begin(), template_suffix.end());
  return ids;
}

void HfBpeTokenizer::append_piece(int32_t id, bool skip_special, bool /*first*/, std::string& bytes) const {
  if (id < 0 || static_cast<size_t>(id) >= token_flags.size()) return;
  const uint8_t flags = token_flags[id];
  if (!(flags & kHasToken) || (skip_special && (flags & kSpecial))) return;
  bytes += token_bytes[id];
}

std::optional<int32_t> HfBpeTokenizer::token_id(std::string_view token) const {
  if (const auto it = added_by_content.find(token); it != added_by_content.end()) return added[it->second].id;
  if (const auto it = vocab.find(token); it != vocab.end()) return it->second;
  return std::nullopt;
}

std::string_view HfBpeTokenizer::token_text(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= token_texts.size()) return {};
  return token_texts[id];
}

// ---------------------------------------------------------------------------------------------
// Tokenizer

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json_path) {
  const std::string text = read_text_file(tokenizer_json_path, "tokenizer file");
  const std::filesystem::path config_path =
      std::filesystem::path(tokenizer_json_path).parent_path() / "tokenizer_config.json";
  std::string config_text;
  std::error_code ec;
  if (std::filesystem::exists(config_path, ec)) config_text = read_text_file(config_path.string(), "tokenizer config");
  return from_json(text, tokenizer_json_path, config_text, config_path.string());
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view source, std::string_view config_json,
                               std::string_view config_source) {
  auto impl = std::make_shared<HfBpeTokenizer>();
  {
    const JsonReader reader{std::string(source)};
    const Json root = parse_json(tokenizer_json, source);
    impl->load(root, reader);
  }
  if (!config_json.empty()) {
    const JsonReader reader{std::string(config_source)};
    const Json config = parse_json(config_json, config_source);
    impl->load_config(config, reader);
  }
  impl->finish();
  if (impl->eos_id) impl->end_of_generation_ids = {*impl->eos_id};
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special, bool add_special) const {
  if (const size_t bad = utf8_first_invalid(text); bad != std::string_view::npos) {
    fail("Tokenizer::encode: input text is not valid UTF-8 at byte {}", bad);
  }
  return impl_->encode(text, parse_special, add_special);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) impl_->append_piece(ids[i], skip_special, i == 0, bytes);
  if (impl_->cleans_spaces()) tokenizer_detail::clean_up_spaces(bytes);
  std::string text;
  text.reserve(bytes.size());
  append_utf8_lossy(text, bytes);
  return text;
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size(); }
std::optional<int32_t> Tokenizer::token_id(std::string_view token) const { return impl_->token_id(token); }
std::string_view Tokenizer::token_text(int32_t id) const { return impl_->token_text(id); }
bool Tokenizer::is_special(int32_t id) const { return impl_->is_special(id); }
std::optional<int32_t> Tokenizer::eos_token_id() const { return impl_->eos_id; }
std::optional<int32_t> Tokenizer::bos_token_id() const { return impl_->bos_id; }
std::optional<int32_t> Tokenizer::pad_token_id() const { return impl_->pad_id; }
std::optional<int32_t> Tokenizer::eot_token_id() const { return impl_->eot_id; }
const std::vector<int32_t>& Tokenizer::end_of_generation_ids() const { return impl_->end_of_generation_ids; }
bool Tokenizer::is_end_of_generation(int32_t id) const {
  return std::binary_search(impl_->end_of_generation_ids.begin(), impl_->end_of_generation_ids.end(), id);
}

Tokenizer::StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : impl_(tokenizer.impl_), skip_special_(skip_special) {}

std::string Tokenizer::StreamDecoder::push(int32_t id) {
  impl_->append_piece(id, skip_special_, first_, pending_);
  first_ = false;
  size_t cut = 0;
  if (impl_->cleans_spaces()) {
    // Cleaning looks a few bytes ahead of a space or apostrophe: emit only up to a point where
    // what follows cannot change it. Such a point always starts a character, so the bytes
    // before it decode the same whatever comes next.
    cut = tokenizer_detail::clean_up_spaces_safe_cut(pending_);
  } else {
    // Emit everything except an unfinished trailing character. Cutting there cannot change how
    // the bytes before it decode: invalid bytes are replaced the same way wherever the cut is.
    cut = pending_.size() - utf8_incomplete_tail(pending_);
  }
  return take(cut);
}

std::string Tokenizer::StreamDecoder::flush() {
  std::string text = take(pending_.size());
  first_ = true;
  return text;
}

std::string Tokenizer::StreamDecoder::take(size_t n) {
  std::string chunk = pending_.substr(0, n);
  pending_.erase(0, n);
  if (impl_->cleans_spaces()) tokenizer_detail::clean_up_spaces(chunk);
  std::string text;
  append_utf8_lossy(text, chunk);
  return text;
}

// ---------------------------------------------------------------------------------------------
// GPT-2's byte alphabet for the GGUF tokenizer

namespace tokenizer_detail {

const std::string& gpt2_char_of_byte(uint8_t byte) {
  static const std::array<std::string, 256> utf8 = [] {
    std::array<std::string, 256> out;
    for (int b = 0; b < 256; ++b) append_utf8(out[b], ByteAlphabet::get().char_of_byte[b]);
    return out;
  }();
  return utf8[byte];
}

int gpt2_byte_of_char(char32_t cp) {
  const ByteAlphabet& alphabet = ByteAlphabet::get();
  return cp < alphabet.byte_of_char.size() ? alphabet.byte_of_char[cp] : -1;
}

}  // namespace tokenizer_detail

}  // namespace turbospark
