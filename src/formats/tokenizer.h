// Hugging Face tokenizer.json byte-level BPE tokenizer (GPT-2, Qwen2/Qwen3, Llama 3 style).
//
// It reproduces the `tokenizers` library's encode/decode for the configurations those models
// use, and refuses every other configuration by name when the file is loaded:
//   normalizer     null, NFC, or a Sequence of NFC
//   pre_tokenizer  ByteLevel, or a Sequence of Split (Regex or String pattern, any behavior,
//                  invert) ending in ByteLevel (add_prefix_space and use_regex honoured)
//   model          BPE (merges as "a b" strings or [a, b] pairs, ignore_merges, unk_token and
//                  fuse_unk; no dropout, byte_fallback, subword prefix or word suffix)
//   post_processor null, ByteLevel, TemplateProcessing ("single"), or a Sequence of those
//   decoder        ByteLevel
// Added tokens are split out before anything else, leftmost-longest, honouring special,
// normalized, lstrip, rstrip and single_word, as the library's AddedVocabulary does.
//
// Regexes run on PCRE2 (UTF + UCP, JIT when available). `tokenizers` uses Oniguruma, so the
// escapes the two engines read differently (\s \S \w \W \h \H \v) are rewritten to what
// Oniguruma means, and ^ $ are line anchors as in Oniguruma; what cannot be rewritten is refused.
// (?i) lacks Oniguruma's multi-character folds (ß matching "ss"); the models' patterns need none.
// Character properties come from the PCRE2 build (Debian 12: 10.42, Unicode 14) and NFC from
// tables generated from Python 3.11's unicodedata (Unicode 14, src/formats/tokenizer_nfc.inc);
// tokenizers 0.23 knows Unicode 16, so characters first assigned in Unicode 15 or 16 (CJK
// Extension H and I, a few new scripts) can be split differently. For every character assigned
// in Unicode 14, \s \S \w \W \d \p{L} \p{N} \p{M} \p{P} \p{S} were checked to agree with the library.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace turbospark {

class Tokenizer {
  struct Impl;  // PCRE2, the vocab and the merge table stay out of this header

 public:
  // Loads tokenizer.json and, when it exists beside it, tokenizer_config.json (its
  // added_tokens_decoder entries missing from tokenizer.json are added; eos/bos/pad token
  // names are resolved to ids). Throws turbospark::Error naming the file and field at fault.
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  // Same from text already in memory; `source` and `config_source` name them in errors.
  // An empty config_json means there is no tokenizer_config.json.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view source,
                             std::string_view config_json = {},
                             std::string_view config_source = {});

  // Text must be valid UTF-8. parse_special: special added tokens written in the text become
  // their ids (false: they are tokenized as plain text; non-special added tokens still match,
  // like the library's encode_special_tokens). add_special: apply the post-processor template
  // (e.g. a BOS id); Qwen and GPT-2 add nothing.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true,
                              bool add_special = false) const;
  // Ids that name no token are skipped, and byte sequences that are not UTF-8 become U+FFFD,
  // as the library's decode does.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  int32_t vocab_size() const;  // max id + 1 across the vocab and added tokens
  std::optional<int32_t> token_id(std::string_view token) const;  // added tokens first
  std::string_view token_text(int32_t id) const;  // raw vocab string ("Ġthe"); empty if none
  bool is_special(int32_t id) const;
  // From tokenizer_config.json, when it names them.
  std::optional<int32_t> eos_token_id() const;
  std::optional<int32_t> bos_token_id() const;
  std::optional<int32_t> pad_token_id() const;

  // Streaming detokenizer: push ids one at a time and get back only complete UTF-8 text; the
  // bytes of a character split across tokens are held until it is complete. The pieces
  // returned by push() and flush() concatenate to decode(ids, skip_special).
  class StreamDecoder {
   public:
    explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false);
    std::string push(int32_t id);
    // Returns what is still held (an incomplete character becomes U+FFFD) and starts afresh.
    std::string flush();

   private:
    std::shared_ptr<const Impl> impl_;
    bool skip_special_;
    std::string pending_;  // bytes of an incomplete trailing UTF-8 character
  };


 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  // Shared and immutable once loaded (the word cache inside locks itself), so copies are cheap
  // and one tokenizer can serve many threads.
  std::shared_ptr<const Impl> impl_;
};

}  // namespace turbospark
