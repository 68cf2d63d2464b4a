// A GGUF file's vocabulary, tokenized and detokenized as llama.cpp does it (llama-vocab.cpp at
// llama-cpp-python 0.3.36: llama_vocab::impl::load, tokenizer_st_partition, tokenize,
// llm_tokenizer_spm_session, llm_tokenizer_bpe_session, token_to_piece, detokenize). Matching
// its ids is the point, so where the code follows a quirk of llama.cpp the comment says so.
// The BPE pre-tokenizers are in tokenizer_gguf_split.cpp.
#include <algorithm>
#include <array>
#include <bitset>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <queue>
#include <span>
#include <unordered_map>

#include "core/error.h"
#include "formats/gguf.h"
#include "formats/tokenizer.h"
#include "formats/tokenizer_detail.h"

namespace turbospark {

namespace {

using tokenizer_detail::GgufPreTokenizer;

// llama_token_attr.
constexpr uint16_t kAttrUnknown = 1 << 0;
constexpr uint16_t kAttrUnused = 1 << 1;
constexpr uint16_t kAttrNormal = 1 << 2;
constexpr uint16_t kAttrControl = 1 << 3;
constexpr uint16_t kAttrUserDefined = 1 << 4;
constexpr uint16_t kAttrByte = 1 << 5;
constexpr uint16_t kAttrLstrip = 1 << 7;
constexpr uint16_t kAttrRstrip = 1 << 8;

uint16_t attr_of_token_type(int32_t type) {
  switch (type) {
    case 1: return kAttrNormal;
    case 2: return kAttrUnknown;
    case 3: return kAttrControl;
    case 4: return kAttrUserDefined;
    case 5: return kAttrUnused;
    case 6: return kAttrByte;
    default: return 0;  // undefined: decodes to nothing, never split out as special
  }
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename Value>
using StringMap = std::unordered_map<std::string, Value, StringHash, std::equal_to<>>;

// A token text for a one-line message: JSON-style quotes and escapes.
std::string quoted(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto b = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (b < 0x20) {
      out += fmt::format("\\u{:04x}", b);
    } else {
      out += c;
    }
  }
  return out + '"';
}

// isspace() in the C locale, which is what llama.cpp's lstrip / rstrip test.
bool is_c_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

constexpr std::string_view kSpaceEscape = "\xE2\x96\x81";  // U+2581 '▁'

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  size_t start = 0;
  for (size_t at; (at = s.find(from, start)) != std::string::npos; start = at + from.size()) {
    out.append(s, start, at - start);
    out += to;
  }
  out.append(s, start, std::string::npos);
  s.swap(out);
}

// llama.cpp's lenient UTF-8 reader (unicode_cpt_from_utf8 inside unicode_cpts_from_utf8): it
// checks continuation bytes but not overlongs or surrogates, and turns each bad byte into
// U+FFFD. Only used on token texts, which are normally valid.
char32_t lenient_code_point(std::string_view s, size_t& i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const auto continuation = [&](size_t k) { return i + k < s.size() && (b(k) & 0xC0) == 0x80; };
  const unsigned char b0 = b(0);
  char32_t cp = 0xFFFD;
  size_t n = 1;
  if (b0 < 0x80) {
    cp = b0;
  } else if (!(b0 & 0x40)) {
  } else if (!(b0 & 0x20)) {
    if (continuation(1)) cp = ((b0 & 0x1F) << 6) | (b(1) & 0x3F), n = 2;
  } else if (!(b0 & 0x10)) {
    if (continuation(1) && continuation(2)) cp = ((b0 & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F), n = 3;
  } else if (!(b0 & 0x08)) {
    if (continuation(1) && continuation(2) && continuation(3)) {
      cp = ((b0 & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F), n = 4;
    }
  }
  i += n;
  return cp;
}

// llama_decode_text: a byte-level BPE token's bytes. A character outside GPT-2's alphabet
// becomes "[UNK_BYTE_0x<its UTF-8 in hex><the whole token>]", as llama.cpp writes it.
std::string decode_byte_level(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const char32_t cp = lenient_code_point(text, i);
    const int byte = tokenizer_detail::gpt2_byte_of_char(cp);
    if (byte >= 0) {
      out += static_cast<char>(byte);
      continue;
    }
    std::string utf8;
    tokenizer_detail::append_utf8(utf8, cp);
    out += "[UNK_BYTE_0x";
    for (const char c : utf8) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
    out += text;
    out += ']';
  }
  return out;
}

// Tokens llama.cpp recognises by their text (llama_vocab::impl::load).
constexpr std::string_view kEotNames[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                          "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
                                          "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",
                                          "<end_of_utterance>"};
constexpr std::string_view kEomNames[] = {"<|eom_id|>"};
constexpr std::string_view kFimPreNames[] = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                                             "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "begin\xEF\xBD\x9C>", "<PRE>",
                                             "\xE2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>"};
constexpr std::string_view kFimSufNames[] = {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                                             "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "hole\xEF\xBD\x9C>", "<SUF>",
                                             "\xE2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>"};
constexpr std::string_view kFimMidNames[] = {"<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                                             "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "end\xEF\xBD\x9C>", "<MID>",
                                             "\xE2\x96\x81<MID>", "<|code_middle|>", "<|middle|>"};
constexpr std::string_view kFimPadNames[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"};
constexpr std::string_view kFimRepNames[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"};
constexpr std::string_view kFimSepNames[] = {"<|file_sep|>"};
constexpr std::string_view kEogNames[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>", "[e~["};

class GgufVocabTokenizer final : public Tokenizer::Impl {
 public:
  explicit GgufVocabTokenizer(const VocabSpec& spec);

  std::vector<int32_t> encode(std::string_view text, bool parse_special, bool add_special) const override;
  void append_piece(int32_t id, bool skip_special, bool first, std::string& bytes) const override;
  bool cleans_spaces() const override { return clean_spaces_; }
  int32_t vocab_size() const override { return static_cast<int32_t>(tokens_.size()); }
  std::optional<int32_t> token_id(std::string_view token) const override { return find(token); }
  std::string_view token_text(int32_t id) const override {
    return valid(id) ? std::string_view(tokens_[id].text) : std::string_view();
  }
  bool is_special(int32_t id) const override {
    return valid(id) && (tokens_[id].attr & (kAttrControl | kAttrUnknown));
  }

 private:
  struct Token {
    std::string text;
    float score = 0;
    uint16_t attr = kAttrNormal;
  };
  // A stretch of the input: raw text [begin, end) when id < 0, else a special token.
  struct Fragment {
    size_t begin, end;
    int32_t id;
  };

  bool valid(int32_t id) const { return id >= 0 && static_cast<size_t>(id) < tokens_.size(); }
  std::optional<int32_t> find(std::string_view text) const {
    const auto it = id_of_text_.find(text);
    return it == id_of_text_.end() ? std::nullopt : std::optional<int32_t>(it->second);
  }
  void resolve_special_ids(const VocabSpec& spec);
  void set_strip_attributes(const VocabSpec& spec);
  void split_special(std::string_view text, bool parse_special, std::vector<Fragment>& out) const;
  void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
  void encode_bpe_word(const std::string& word, std::vector<int32_t>& out) const;
  void merge_bpe_word(const std::string& word, std::vector<int32_t>& out) const;

  bool spm_ = true;  // "llama"; false: "gpt2"
  std::string source_;
  std::vector<Token> tokens_;
  // Built as llama.cpp builds token_to_id (no reserve, inserted in id order), because where it
  // looks tokens up by text it walks that map, and the walk order picks among candidates.
  StringMap<int32_t> id_of_text_;
  StringMap<int32_t> merge_rank_;   // "left right" -> rank; a repeated merge keeps its first
  std::vector<std::string> pieces_;  // [n_tokens] token_to_piece(id, special = true)
  std::vector<int32_t> special_order_;  // control / user-defined / unknown ids, longest first
  std::array<int32_t, 256> byte_token_{};  // SPM byte fallback: <0xXX>, else the byte itself
  const GgufPreTokenizer* pre_ = nullptr;  // BPE
  bool add_bos_ = false, add_eos_ = false, add_space_prefix_ = false, clean_spaces_ = false;
  bool ignore_merges_ = false;

  // Words already merged (the ids depend on the word alone). Bounded so that adversarial input
  // cannot grow it without limit; the mutex lets one tokenizer serve many threads.
  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kWordCacheCapacity = 65536;
  mutable std::mutex cache_mutex_;
  mutable StringMap<std::vector<int32_t>> word_cache_;
};

GgufVocabTokenizer::GgufVocabTokenizer(const VocabSpec& spec) : source_(spec.source.empty() ? "vocabulary" : spec.source) {
  if (spec.model == "llama") {
    spm_ = true;
  } else if (spec.model == "gpt2") {
    spm_ = false;
    pre_ = &tokenizer_detail::find_gguf_pre_tokenizer(spec.pre, source_);
  } else {
    fail("{}: tokenizer.ggml.model \"{}\" is not supported (supported: \"llama\" SentencePiece, \"gpt2\" byte-level "
         "BPE)",
         source_, spec.model);
  }
  const size_t n = spec.tokens.size();
  if (n == 0) fail("{}: tokenizer.ggml.tokens is empty", source_);
  if (n > size_t(INT32_MAX)) fail("{}: tokenizer.ggml.tokens has {} entries, more than ids can hold", source_, n);
  if (!spec.scores.empty() && spec.scores.size() < n) {
    fail("{}: tokenizer.ggml.scores has {} entries for {} tokens", source_, spec.scores.size(), n);
  }
  if (!spec.token_types.empty() && spec.token_types.size() < n) {
    fail("{}: tokenizer.ggml.token_type has {} entries for {} tokens", source_, spec.token_types.size(), n);
  }

  tokens_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    Token& t = tokens_[i];
    // llama.cpp renames an empty token rather than let it match everywhere.
    t.text = spec.tokens[i].empty() ? fmt::format("[EMPTY_{}]", i) : spec.tokens[i];
    t.score = spec.scores.empty() ? 0.0f : spec.scores[i];
    t.attr = spec.token_types.empty() ? kAttrNormal : attr_of_token_type(spec.token_types[i]);
    // llama.cpp aborts on a repeated text (GGML_ASSERT on the two maps' sizes).
    if (const auto [it, fresh] = id_of_text_.emplace(t.text, static_cast<int32_t>(i)); !fresh) {
      fail("{}: tokenizer.ggml.tokens has {} at both id {} and id {}", source_, quoted(t.text), it->second, i);
    }
  }
  if (!spm_) {
    merge_rank_.reserve(spec.merges.size());
    for (size_t rank = 0; rank < spec.merges.size(); ++rank) {
      // llama.cpp splits at the first space after the first byte; without one the merge is
      // ("", "") and can never apply.
      const std::string& m = spec.merges[rank];
      if (m.find(' ', 1) == std::string::npos) continue;
      merge_rank_.emplace(m, static_cast<int32_t>(rank));
    }
  }

  // Flags llama.cpp derives from the model and pre-tokenizer, then from the file's keys.
  if (spm_) {
    add_space_prefix_ = true;
    add_bos_ = true;
    clean_spaces_ = false;
  } else {
    add_space_prefix_ = false;
    add_bos_ = pre_->add_bos;
    clean_spaces_ = pre_->clean_spaces;
    ignore_merges_ = pre_->ignore_merges;
  }
  if (spec.add_space_prefix) add_space_prefix_ = *spec.add_space_prefix;
  if (spec.add_bos) add_bos_ = *spec.add_bos;
  if (spec.add_eos) add_eos_ = *spec.add_eos;

  resolve_special_ids(spec);

  // The tokens split out of the text before tokenizing, longest first. The order of tokens of
  // equal length is std::sort's, as in llama.cpp (built with the same libstdc++ it is the same).
  for (int32_t id = 0; id < static_cast<int32_t>(n); ++id) {
    if (tokens_[id].attr & (kAttrControl | kAttrUserDefined | kAttrUnknown)) special_order_.push_back(id);
  }
  std::sort(special_order_.begin(), special_order_.end(),
            [&](int32_t a, int32_t b) { return tokens_[a].text.size() > tokens_[b].text.size(); });

  set_strip_attributes(spec);

  if (spm_) {
    for (int b = 0; b < 256; ++b) {
      const std::string hex = fmt::format("<0x{:02X}>", b);
      const std::string raw(1, static_cast<char>(b));
      byte_token_[b] = find(hex).value_or(find(raw).value_or(-1));
    }
  }

  pieces_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const Token& t = tokens_[i];
    std::string& piece = pieces_[i];
    if (t.attr & (kAttrUnknown | kAttrControl | kAttrUserDefined)) {
      piece = t.text;
    } else if (t.attr & kAttrNormal) {
      if (spm_) {
        piece = t.text;
        replace_all(piece, kSpaceEscape, " ");
      } else {
        piece = decode_byte_level(t.text);
      }
    } else if (t.attr & kAttrByte) {
      // token_to_byte: strtol of the two characters after "<0x".
      if (t.text.size() < 3) fail("{}: byte token {} is {}, not <0xXX>", source_, i, quoted(t.text));
      const std::string hex = t.text.substr(3, 2);
      piece = std::string(1, static_cast<char>(std::strtol(hex.c_str(), nullptr, 16)));
    }
  }
}

// The special-id part of llama_vocab::impl::load: defaults by model, the file's keys, then the
// tokens it recognises by text, which also become control tokens and end generation.
void GgufVocabTokenizer::resolve_special_ids(const VocabSpec& spec) {
  const auto n = static_cast<int64_t>(tokens_.size());
  int64_t bos = -1, eos = -1, unk = -1, pad = -1, eot = -1, eom = -1;
  if (spm_) {
    bos = 1, eos = 2, unk = 0;
  } else {
    // llama.cpp's BPE default is 11 for both, whatever token that is.
    bos = pre_->no_default_bos ? -1 : 11;
    eos = 11;
  }
  const auto take = [&](int64_t& id, int32_t from_file) {
    if (id >= n) id = -1;  // a default out of range is dropped
    if (from_file >= 0 && from_file < n) id = from_file;  // an out-of-range key keeps the default
  };
  take(bos, spec.bos);
  take(eos, spec.eos);
  take(unk, spec.unk);
  take(pad, spec.pad);
  take(eot, spec.eot);
  take(eom, spec.eom);

  // Without the file naming them, llama.cpp walks its text -> id map and takes the first
  // token found with one of these texts, making it a control token. Which one wins among
  // several candidates depends on that walk: id_of_text_ is the same kind of std::unordered_map
  // filled the same way, so with the same standard library the walk is the same.
  int64_t fim_pre = -1, fim_suf = -1, fim_mid = -1, fim_pad = -1, fim_rep = -1, fim_sep = -1;
  const std::pair<int64_t*, std::span<const std::string_view>> searches[] = {
      {&eot, kEotNames},         {&eom, kEomNames},         {&fim_pre, kFimPreNames}, {&fim_suf, kFimSufNames},
      {&fim_mid, kFimMidNames}, {&fim_pad, kFimPadNames}, {&fim_rep, kFimRepNames}, {&fim_sep, kFimSepNames},
  };
  const bool searching = std::any_of(std::begin(searches), std::end(searches), [](const auto& s) { return *s.first < 0; });
  for (const auto& [text, id] : id_of_text_) {
    if (!searching) break;
    for (const auto& [found, names] : searches) {
      if (*found >= 0 || std::find(names.begin(), names.end(), text) == names.end()) continue;
      *found = id;
      tokens_[id].attr |= kAttrControl;
    }
  }

  std::vector<int32_t> eog;
  for (const int64_t id : {fim_pad, fim_rep, fim_sep}) {
    if (id >= 0) eog.push_back(static_cast<int32_t>(id));
  }
  for (const std::string_view name : kEogNames) {
    if (const auto found = find(name)) {
      eog.push_back(*found);
      tokens_[*found].attr |= kAttrControl;
    }
  }
  // gpt-oss: llama.cpp always renders these.
  for (const std::string_view name : {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}) {
    if (const auto found = find(name)) tokens_[*found].attr = kAttrUserDefined;
  }
  for (const int64_t id : {eos, eot, eom}) {
    if (id >= 0) eog.push_back(static_cast<int32_t>(id));
  }
  std::sort(eog.begin(), eog.end());
  eog.erase(std::unique(eog.begin(), eog.end()), eog.end());
  const auto eog_text = [&](std::string_view text) -> int32_t {
    for (const int32_t id : eog) {
      if (tokens_[id].text == text) return id;
    }
    return -1;
  };
  // o200k_harmony and solar-open: "<|end|>" ends a message, not generation.
  const bool has_call = eog_text("<|call|>") >= 0 || eog_text("<|calls|>") >= 0;
  if (const int32_t end = eog_text("<|end|>");
      end >= 0 && ((eog_text("<|return|>") >= 0 && has_call) || (has_call && eog_text("<|flush|>") >= 0))) {
    eog.erase(std::find(eog.begin(), eog.end(), end));
    tokens_[end].attr = kAttrUserDefined;
  }
  // Gemma 4 and PLaMo have an ordinary "</s>".
  if (const int32_t s = eog_text("</s>");
      s >= 0 && (eog_text("<|tool_response>") >= 0 || eog_text("<|plamo:eos|>") >= 0)) {
    eog.erase(std::find(eog.begin(), eog.end(), s));
    tokens_[s].attr = kAttrNormal;
  }

  const auto opt = [](int64_t id) { return id >= 0 ? std::optional<int32_t>(static_cast<int32_t>(id)) : std::nullopt; };
  bos_id = opt(bos);
  eos_id = opt(eos);
  pad_id = opt(pad);
  eot_id = opt(eot);
  end_of_generation_ids = std::move(eog);
  (void)unk;  // llama.cpp's tokenizers never emit it: SPM falls back to bytes
}

// llama.cpp's per-model token attributes ("Handle per token attributes" in load), which make
// the special-token split eat whitespace beside some tokens.
void GgufVocabTokenizer::set_strip_attributes(const VocabSpec& spec) {
  const auto contains_any = [](const std::string& s, std::initializer_list<std::string_view> parts) {
    return std::any_of(parts.begin(), parts.end(), [&](std::string_view p) { return s.find(p) != std::string::npos; });
  };
  const auto set = [&](std::string_view text, uint16_t attr, bool on, bool required) {
    const auto id = find(text);
    if (!id) {
      // llama.cpp's token_to_id.at() throws and the model does not load.
      if (required) fail("{}: llama.cpp needs a {} token in this vocabulary and it has none", source_, quoted(text));
      return;
    }
    tokens_[*id].attr = on ? (tokens_[*id].attr | attr) : (tokens_[*id].attr & ~attr);
  };
  std::string name = spec.name;
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (contains_any(spec.pre, {"jina-v2-de", "jina-v2-es", "jina-v2-code"}) ||
      contains_any(spec.architecture, {"nomic-bert-moe", "jina-bert-v3"})) {
    set("<mask>", kAttrLstrip, true, false);
  } else if (contains_any(name, {"phi-3", "phi3"})) {
    for (const int32_t id : special_order_) tokens_[id].attr |= kAttrRstrip;
    set("</s>", kAttrRstrip, true, true);
    for (const std::string_view text : {"<unk>", "<s>", "<|endoftext|>"}) set(text, kAttrRstrip, false, true);
  } else if (contains_any(name, {"modern-bert"})) {
    set("[MASK]", kAttrLstrip, true, false);
  }
}

// tokenizer_st_partition: for each special token, longest first, every raw stretch is split at
// each occurrence of its text. (Not leftmost-longest: a longer token anywhere wins over a
// shorter one that starts earlier.)
void GgufVocabTokenizer::split_special(std::string_view text, bool parse_special, std::vector<Fragment>& out) const {
  out.assign(1, Fragment{0, text.size(), -1});
  // Only tokens whose first two bytes occur somewhere can occur; most of a large special set
  // ("<unused123>") is skipped without a search.
  std::bitset<256> bytes_seen;
  std::bitset<65536> pairs_seen;
  for (size_t i = 0; i < text.size(); ++i) {
    const auto b = static_cast<unsigned char>(text[i]);
    bytes_seen.set(b);
    if (i + 1 < text.size()) pairs_seen.set((size_t(b) << 8) | static_cast<unsigned char>(text[i + 1]));
  }
  std::vector<Fragment> next;
  for (const int32_t id : special_order_) {
    const Token& token = tokens_[id];
    // parse_special = false: control and unknown tokens stay text; user-defined ones still
    // split (as the tokenizers library does for added tokens).
    if (!parse_special && (token.attr & (kAttrControl | kAttrUnknown))) continue;
    const std::string& t = token.text;
    const auto b0 = static_cast<unsigned char>(t[0]);
    if (t.size() == 1 ? !bytes_seen[b0] : !pairs_seen[(size_t(b0) << 8) | static_cast<unsigned char>(t[1])]) continue;
    if (text.find(t) == std::string_view::npos) continue;
    next.clear();
    for (const Fragment& f : out) {
      if (f.id >= 0) {
        next.push_back(f);
        continue;
      }
      size_t from = f.begin;
      while (true) {
        const size_t at = text.substr(0, f.end).find(t, from);
        if (at == std::string_view::npos) break;
        size_t left_end = at;
        if (token.attr & kAttrLstrip) {
          while (left_end > from && is_c_space(text[left_end - 1])) --left_end;
        }
        if (left_end > from) next.push_back({from, left_end, -1});
        next.push_back({at, at + t.size(), id});
        from = at + t.size();
        // Only a non-empty rest is stripped (and then searched again), as in llama.cpp.
        if ((token.attr & kAttrRstrip) && from < f.end) {
          while (from < f.end && is_c_space(text[from])) ++from;
        }
      }
      if (from < f.end) next.push_back({from, f.end, -1});
    }
    out.swap(next);
  }
}

std::vector<int32_t> GgufVocabTokenizer::encode(std::string_view text, bool parse_special, bool add_special) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special && add_bos_) {
    if (!bos_id) fail("{}: add_bos_token is set but the vocabulary has no BOS token", source_);
    ids.push_back(*bos_id);
  }
  std::vector<Fragment> fragments;
  if (!text.empty()) split_special(text, parse_special, fragments);
  std::vector<std::string> words;
  bool previous_special = true;  // SPM: a stretch at the start or after a special token gets the prefix space
  for (const Fragment& f : fragments) {
    if (f.id >= 0) {
      ids.push_back(f.id);
      previous_special = true;
      continue;
    }
    const std::string_view raw = text.substr(f.begin, f.end - f.begin);
    if (spm_) {
      std::string escaped;
      if (add_space_prefix_ && previous_special) escaped = " ";
      escaped += raw;
      replace_all(escaped, " ", kSpaceEscape);
      encode_spm(escaped, ids);
      previous_special = false;
    } else {
      words.clear();
      tokenizer_detail::gguf_pre_tokenize(*pre_, raw, words);
      for (const std::string& word : words) encode_bpe_word(word, ids);
    }
  }
  if (add_special && add_eos_) {
    if (!eos_id) fail("{}: add_eos_token is set but the vocabulary has no EOS token", source_);
    ids.push_back(*eos_id);
  }
  return ids;
}

// llm_tokenizer_spm_session: start from the characters, repeatedly merge the adjacent pair
// whose concatenation is the highest-scoring token (leftmost on ties), then emit each piece's
// id, or the byte tokens of a piece that is no token (only single characters can be: merges
// only ever form tokens, which is why llama.cpp's rev_merge resegmenting never runs for UTF-8
// input and is left out).
void GgufVocabTokenizer::encode_spm(std::string_view text, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t prev, next;
    uint32_t begin, size;
  };
  struct Bigram {
    int32_t left, right;
    float score;
    uint32_t size;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(text.size());
  for (size_t offset = 0; offset < text.size();) {
    // unicode_len_utf8: the length its first byte announces, cut at the end.
    static constexpr uint8_t kLength[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    const size_t len = std::min<size_t>(kLength[static_cast<unsigned char>(text[offset]) >> 4], text.size() - offset);
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({index - 1, offset + len == text.size() ? -1 : index + 1, static_cast<uint32_t>(offset),
                       static_cast<uint32_t>(len)});
    offset += len;
  }
  const auto lower = [](const Bigram& a, const Bigram& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Bigram, std::vector<Bigram>, decltype(lower)> queue(lower);
  const auto try_add = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const uint32_t size = symbols[left].size + symbols[right].size;
    const auto id = find(text.substr(symbols[left].begin, size));
    if (!id) return;
    queue.push({left, right, tokens_[*id].score, size});
  };
  for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) try_add(i - 1, i);
  while (!queue.empty()) {
    const Bigram bigram = queue.top();
    queue.pop();
    Symbol& left = symbols[bigram.left];
    Symbol& right = symbols[bigram.right];
    // Stale once either side was merged into something else.
    if (left.size == 0 || right.size == 0 || left.size + right.size != bigram.size) continue;
    left.size += right.size;
    right.size = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    try_add(left.prev, bigram.left);
    try_add(bigram.left, left.next);
  }
  if (symbols.empty()) return;
  for (int32_t i = 0; i != -1; i = symbols[i].next) {
    const std::string_view piece = text.substr(symbols[i].begin, symbols[i].size);
    if (const auto id = find(piece)) {
      out.push_back(*id);
      continue;
    }
    for (const char c : piece) {
      const int32_t id = byte_token_[static_cast<unsigned char>(c)];
      if (id < 0) {
        fail("{}: the text has a character the vocabulary lacks, and byte 0x{:02X} has no <0x{:02X}> token to fall "
             "back to",
             source_, static_cast<unsigned char>(c), static_cast<unsigned char>(c));
      }
      out.push_back(id);
    }
  }
}

// llm_tokenizer_bpe_session for one pre-tokenized word: merge the adjacent pair with the
// lowest merge rank (leftmost on ties) until none applies, then emit each piece's id. A piece
// that is no token (a merge whose result is missing from the vocabulary) falls back to the
// tokens of its single bytes, and bytes that are no token are dropped, as in llama.cpp.
void GgufVocabTokenizer::encode_bpe_word(const std::string& word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    if (const auto id = find(word)) {
      out.push_back(*id);
      return;
    }
  }
  if (word.size() > kMaxCachedWordBytes) return merge_bpe_word(word, out);
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (const auto it = word_cache_.find(word); it != word_cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge_bpe_word(word, out);
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (word_cache_.size() < kWordCacheCapacity) {
    word_cache_.emplace(word, std::vector<int32_t>(out.begin() + static_cast<ptrdiff_t>(first), out.end()));
  }
}

void GgufVocabTokenizer::merge_bpe_word(const std::string& word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t prev, next;
    uint32_t begin, size;
  };
  struct Bigram {
    int32_t left, right;
    int32_t rank;
    uint32_t size;
  };
  std::vector<Symbol> symbols;
  for (size_t offset = 0; offset < word.size();) {
    const size_t len = tokenizer_detail::utf8_step(word, offset).length;
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({index - 1, offset + len == word.size() ? -1 : index + 1, static_cast<uint32_t>(offset),
                       static_cast<uint32_t>(len)});
    offset += len;
  }
  const auto later = [](const Bigram& a, const Bigram& b) {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  };
  std::priority_queue<Bigram, std::vector<Bigram>, decltype(later)> queue(later);
  std::string key;
  const auto try_add = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    key.assign(word, symbols[left].begin, symbols[left].size);
    key += ' ';
    key.append(word, symbols[right].begin, symbols[right].size);
    const auto it = merge_rank_.find(key);
    if (it == merge_rank_.end()) return;
    queue.push({left, right, it->second, symbols[left].size + symbols[right].size});
  };
  for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) try_add(i - 1, i);
  while (!queue.empty()) {
    const Bigram bigram = queue.top();
    queue.pop();
    Symbol& left = symbols[bigram.left];
    Symbol& right = symbols[bigram.right];
    // llama.cpp compares the texts; adjacent symbols with the sizes queued have the same text.
    if (left.size == 0 || right.size == 0 || left.size + right.size != bigram.size) continue;
    left.size += right.size;
    right.size = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    try_add(left.prev, bigram.left);
    try_add(bigram.left, left.next);
  }
  for (const Symbol& s : symbols) {
    if (s.size == 0) continue;
    const std::string_view piece = std::string_view(word).substr(s.begin, s.size);
    if (const auto id = find(piece)) {
      out.push_back(*id);
      continue;
    }
    for (const char c : piece) {
      if (const auto id = find(std::string_view(&c, 1))) out.push_back(*id);
    }
  }
}

void GgufVocabTokenizer::append_piece(int32_t id, bool skip_special, bool first, std::string& bytes) const {
  if (!valid(id)) return;
  if (skip_special && (tokens_[id].attr & (kAttrUnknown | kAttrControl))) return;
  std::string_view piece = pieces_[id];
  // detokenize strips one leading space from the first piece when add_space_prefix.
  if (first && add_space_prefix_ && !piece.empty() && piece[0] == ' ') piece.remove_prefix(1);
  bytes += piece;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// detokenize's clean_spaces

namespace tokenizer_detail {

void clean_up_spaces(std::string& text) {
  // The three passes of llama_vocab::impl::detokenize, each over the previous one's output,
  // each keeping the first byte as it is.
  if (text.size() < 2) return;
  // 1: " ?" " !" " ." " ," lose the space.
  {
    size_t total = 1;
    for (size_t i = 1; i < text.size(); ++i) {
      const char x = text[i];
      if (text[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) --total;
      text[total++] = x;
    }
    text.resize(total);
  }
  // 2: " ' " becomes "'". The space after the apostrophe is overwritten with NUL and skipped,
  // so it cannot serve as the space before a following apostrophe.
  {
    size_t total = text.empty() ? 0 : 1;
    const size_t n = text.size();
    for (size_t i = 1; i < n; ++i) {
      const char x = text[i];
      if (x == '\'' && i + 1 < n && text[i - 1] == ' ' && text[i + 1] == ' ') {
        --total;
        text[++i] = '\0';
      }
      text[total++] = x;
    }
    text.resize(total);
  }
  // 3: " 's" " 'm" " 're" " 've" lose the space (" 't" " 'd" " 'll" keep it).
  {
    size_t total = text.empty() ? 0 : 1;
    const size_t n = text.size();
    for (size_t i = 1; i < n; ++i) {
      const char x = text[i];
      if (text[i - 1] == ' ' && x == '\'' && i + 1 < n) {
        const char x1 = text[i + 1];
        if (x1 == 's' || x1 == 'm') {
          --total;
        } else if (i + 2 < n) {
          const char x2 = text[i + 2];
          if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) --total;
        }
      }
      text[total++] = x;
    }
    text.resize(total);
  }
}

size_t clean_up_spaces_safe_cut(std::string_view bytes) {
  // Every rule looks at a space or an apostrophe and at most three bytes around it, and only
  // removes spaces. Where bytes[p-3..p] hold neither, no rule spans p: cleaning the two sides
  // apart gives the same bytes, and the side after p starts with a byte no pass removes (each
  // pass keeps its first byte unconditionally). p also starts a character, so decoding the
  // bytes before it cannot depend on what follows.
  for (size_t p = bytes.size(); p-- > 1;) {
    const auto c = static_cast<unsigned char>(bytes[p]);
    if ((c & 0xC0) == 0x80) continue;
    bool quiet = true;
    for (size_t k = p >= 3 ? p - 3 : 0; k <= p && quiet; ++k) quiet = bytes[k] != ' ' && bytes[k] != '\'';
    if (quiet) return p;
  }
  return 0;
}

}  // namespace tokenizer_detail

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::from_vocab(const VocabSpec& spec) { return Tokenizer(std::make_shared<GgufVocabTokenizer>(spec)); }

VocabSpec vocab_spec_from_gguf(const GgufFile& file) {
  VocabSpec spec;
  spec.source = file.path();
  spec.model = file.get_str("tokenizer.ggml.model");
  spec.pre = file.get_str("tokenizer.ggml.pre", "");
  spec.tokens = file.get_str_arr("tokenizer.ggml.tokens");
  if (const GgufValue* scores = file.find_value("tokenizer.ggml.scores")) {
    if (scores->type() == GgufType::ARRAY && scores->elem_type() != GgufType::F32 &&
        scores->elem_type() != GgufType::F64) {
      for (const int64_t s : file.get_int_arr("tokenizer.ggml.scores")) spec.scores.push_back(static_cast<float>(s));
    } else {
      spec.scores = file.get_f32_arr("tokenizer.ggml.scores");
    }
  }
  if (file.has("tokenizer.ggml.token_type")) {
    for (const int64_t t : file.get_int_arr("tokenizer.ggml.token_type")) spec.token_types.push_back(static_cast<int32_t>(t));
  }
  if (file.has("tokenizer.ggml.merges")) {
    spec.merges = file.get_str_arr("tokenizer.ggml.merges");
  } else if (spec.model == "gpt2") {
    fail("{}: missing metadata tokenizer.ggml.merges (a \"gpt2\" vocabulary needs its BPE merges)", file.path());
  }
  const auto id = [&](const char* key, int32_t& out) {
    if (file.has(key)) out = static_cast<int32_t>(std::min<uint32_t>(file.get_u32(key), INT32_MAX));
  };
  id("tokenizer.ggml.bos_token_id", spec.bos);
  id("tokenizer.ggml.eos_token_id", spec.eos);
  id("tokenizer.ggml.unknown_token_id", spec.unk);
  id("tokenizer.ggml.padding_token_id", spec.pad);
  id("tokenizer.ggml.eot_token_id", spec.eot);
  id("tokenizer.ggml.eom_token_id", spec.eom);
  const auto flag = [&](const char* key, std::optional<bool>& out) {
    if (file.has(key)) out = file.get_bool(key, false);
  };
  flag("tokenizer.ggml.add_bos_token", spec.add_bos);
  flag("tokenizer.ggml.add_eos_token", spec.add_eos);
  flag("tokenizer.ggml.add_space_prefix", spec.add_space_prefix);
  spec.name = file.get_str("general.name", "");
  spec.architecture = file.get_str("general.architecture", "");
  return spec;
}

}  // namespace turbospark
