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
//
// Tokenizer::from_vocab builds instead a tokenizer that behaves as llama.cpp's does for a GGUF
// file's vocabulary (llama-vocab.cpp at llama-cpp-python 0.3.36): SentencePiece-style
// ("llama": score-ordered bigram merges, '▁' for spaces, <0xXX> byte fallback) or byte-level
// BPE ("gpt2", with the pre-tokenizer llama.cpp picks for tokenizer.ggml.pre), its special-token
// splitting, BOS/EOS rules, and detokenization (including clean_spaces). See VocabSpec.
// It is checked against llama.cpp's own ids and text (tests/unit/test_tokenizer_vocab.cpp).
// Refused by name: tokenizer.ggml.model other than "llama"/"gpt2" (bert, t5, rwkv, gemma4, ...)
// and "gpt2" pre-tokenizers whose patterns need more than the matchers written here
// (deepseek-*, gpt-4o/llama4, tekken, chameleon, jais-2, kimi-k2, ...; the supported list is in
// tokenizer_gguf_split.cpp). Known differences from llama.cpp: encode refuses text that is not
// UTF-8 (llama.cpp reads bad bytes as U+FFFD); decode turns bytes that are not UTF-8 into
// U+FFFD (llama.cpp returns them raw); tokenizer.ggml.fim_*_token_id keys are not read (FIM
// tokens are found by text, as llama.cpp does when the keys are absent). Where llama.cpp's
// choice depends on std::unordered_map walk order or std::sort's order of equal elements (which
// of several EOT-like tokens becomes EOT; special tokens of equal length), the same containers
// are used, so with the same standard library (libstdc++) the choice is the same.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace turbospark {

class GgufFile;

// What a GGUF file says about its vocabulary (the tokenizer.ggml.* keys), independent of the
// GGUF reader. An id of -1 and an unset optional mean the key is absent; llama.cpp's default
// for the model and pre-tokenizer then applies (SPM: bos 1, eos 2, unk 0, add_bos, a space
// prefix; BPE: bos = eos = 11 when the vocabulary has that id, add_bos only for Llama 3 style
// pre-tokenizers), because llama.cpp applies them too.
struct VocabSpec {
  std::string model;  // tokenizer.ggml.model: "llama" (SPM) | "gpt2" (byte-level BPE); others refused
  std::string pre;    // tokenizer.ggml.pre, "" if absent (llama.cpp then uses "default")
  std::vector<std::string> tokens;   // tokenizer.ggml.tokens; index = id
  std::vector<float> scores;         // tokenizer.ggml.scores; empty = all 0
  std::vector<int32_t> token_types;  // tokenizer.ggml.token_type: 1 normal, 2 unknown,
                                     // 3 control, 4 user-defined, 5 unused, 6 byte; empty = all 1
  std::vector<std::string> merges;   // tokenizer.ggml.merges, "left right"
  int32_t bos = -1, eos = -1, unk = -1, pad = -1, eot = -1, eom = -1;
  std::optional<bool> add_bos, add_eos, add_space_prefix;
  // general.name and general.architecture: llama.cpp strips whitespace around special tokens
  // for some models it recognises by them (Phi-3: after each special token).
  std::string name, architecture;
  std::string source;  // the file, for error messages
};

// Reads tokenizer.ggml.* from an open GGUF file; throws Error naming the file and the key at
// fault (a missing token list, merges missing for "gpt2", a value of the wrong type).
VocabSpec vocab_spec_from_gguf(const GgufFile& file);

class Tokenizer {
 public:
  struct Impl;  // defined in formats/tokenizer_detail.h; keeps PCRE2 and the tables out of here

  // Loads tokenizer.json and, when it exists beside it, tokenizer_config.json (its
  // added_tokens_decoder entries missing from tokenizer.json are added; eos/bos/pad token
  // names are resolved to ids). Throws turbospark::Error naming the file and field at fault.
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  // Same from text already in memory; `source` and `config_source` name them in errors.
  // An empty config_json means there is no tokenizer_config.json.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view source,
                             std::string_view config_json = {},
                             std::string_view config_source = {});
  // llama.cpp's tokenizer for a GGUF vocabulary. Refuses by name (Error naming spec.source)
  // a model other than "llama"/"gpt2", a pre-tokenizer llama.cpp does not know or that is not
  // implemented here (the list is in tokenizer_gguf_split.cpp), and malformed arrays.
  static Tokenizer from_vocab(const VocabSpec& spec);

  // Text must be valid UTF-8. parse_special: special added tokens written in the text become
  // their ids (false: they are tokenized as plain text; non-special added tokens still match,
  // like the library's encode_special_tokens). add_special: apply the post-processor template
  // (e.g. a BOS id); Qwen and GPT-2 add nothing.
  // GGUF vocabularies: control and unknown-type tokens are the special ones, user-defined
  // tokens always match; add_special adds BOS / EOS as add_bos / add_eos say (llama_tokenize).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true,
                              bool add_special = false) const;
  // Ids that name no token are skipped, and byte sequences that are not UTF-8 become U+FFFD,
  // as the library's decode does.
  // GGUF vocabularies: llama_detokenize(ids, remove_special = false, unparse_special =
  // !skip_special): '▁' back to spaces, byte tokens to their byte, one leading space stripped
  // from the first piece with add_space_prefix, clean_spaces where the pre-tokenizer has it;
  // skip_special hides control and unknown-type tokens. The bytes are llama.cpp's, except
  // that what is not UTF-8 becomes U+FFFD.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  int32_t vocab_size() const;  // max id + 1 across the vocab and added tokens
  std::optional<int32_t> token_id(std::string_view token) const;  // added tokens first
  std::string_view token_text(int32_t id) const;  // raw vocab string ("Ġthe"); empty if none
  bool is_special(int32_t id) const;
  // From tokenizer_config.json, when it names them; for a GGUF vocabulary, the ids llama.cpp
  // settles on (file keys, its defaults, and for EOT its search for "<|im_end|>",
  // "<end_of_turn>", ... when the file names none).
  std::optional<int32_t> eos_token_id() const;
  std::optional<int32_t> bos_token_id() const;
  std::optional<int32_t> pad_token_id() const;
  std::optional<int32_t> eot_token_id() const;  // never set from tokenizer.json
  // Tokens that end generation, sorted: EOS for tokenizer.json; for a GGUF vocabulary,
  // llama.cpp's EOG set (EOS, EOT, EOM and the tokens it recognises by text).
  const std::vector<int32_t>& end_of_generation_ids() const;
  bool is_end_of_generation(int32_t id) const;

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
    std::string take(size_t n);  // decodes and drops the first n pending bytes

    std::shared_ptr<const Impl> impl_;
    bool skip_special_;
    bool first_ = true;    // the next id starts a sequence
    std::string pending_;  // bytes not yet safe to emit: an incomplete trailing UTF-8
                           // character, or what clean_spaces may still change
  };

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  // Shared and immutable once loaded (the word cache inside locks itself), so copies are cheap
  // and one tokenizer can serve many threads.
  std::shared_ptr<const Impl> impl_;
};

}  // namespace turbospark
